//! The CRD YAML checked in under `crds/`, generated from the Rust types so the
//! two cannot drift (a test compares them).

use kube::CustomResourceExt;

use crate::{GpuLease, GpuLeaseClass};

/// The command that regenerates `crds/` from the types.
pub const REGENERATE_COMMAND: &str = "cargo run -p gpupool-api --bin crdgen";

/// Why the CRDs could not be rendered.
#[derive(Debug, thiserror::Error)]
#[error("rendering CRD {file}: {source}")]
pub struct CrdgenError {
    /// File being rendered.
    pub file: &'static str,
    /// What the serialiser said.
    #[source]
    pub source: serde_yaml::Error,
}

/// Every CRD as `(file name under crds/, YAML text)`.
pub fn generated() -> Result<Vec<(&'static str, String)>, CrdgenError> {
    let header =
        format!("# Generated from the Rust types by `{REGENERATE_COMMAND}`. Do not edit.\n");
    let render = |file: &'static str, crd| {
        serde_yaml::to_string(&crd)
            .map(|body| format!("{header}{body}"))
            .map_err(|source| CrdgenError { file, source })
    };
    Ok(vec![
        (
            "gpuleaseclasses.yaml",
            render("gpuleaseclasses.yaml", GpuLeaseClass::crd())?,
        ),
        ("gpuleases.yaml", render("gpuleases.yaml", GpuLease::crd())?),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn checked_in_crds_match_the_types() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../crds");
        for (file, want) in generated().expect("renders") {
            let path = dir.join(file);
            let have = std::fs::read_to_string(&path).unwrap_or_default();
            assert!(
                have == want,
                "{} differs from what the Rust types generate; run `{REGENERATE_COMMAND}` and commit the result",
                path.display()
            );
        }
    }

    #[test]
    fn crds_carry_the_contract_names() {
        let class = GpuLeaseClass::crd();
        assert_eq!(class.spec.scope, "Cluster");
        assert_eq!(class.spec.names.short_names, Some(vec!["glc".to_owned()]));
        let lease = GpuLease::crd();
        assert_eq!(lease.spec.scope, "Namespaced");
        assert_eq!(lease.spec.names.plural, "gpuleases");
        let version = &lease.spec.versions[0];
        // The design's columns by default; -o wide adds when the lease was
        // queued and why it waits.
        let cols = |wide: bool| -> Vec<&str> {
            version
                .additional_printer_columns
                .iter()
                .flatten()
                .filter(|c| (c.priority.unwrap_or(0) > 0) == wide)
                .map(|c| c.name.as_str())
                .collect()
        };
        assert_eq!(
            cols(false),
            ["Class", "Role", "Phase", "Position", "Node", "GPU", "Age"]
        );
        assert_eq!(cols(true), ["Queued", "Message"]);
        // A device plugin watches the leases of its node by this field.
        let selectable: Vec<&str> = version
            .selectable_fields
            .iter()
            .flatten()
            .map(|f| f.json_path.as_str())
            .collect();
        assert_eq!(selectable, [format!(".{}", crate::names::FIELD_LEASE_NODE)]);
        assert!(
            version
                .subresources
                .as_ref()
                .and_then(|s| s.status.as_ref())
                .is_some()
        );
    }
}
