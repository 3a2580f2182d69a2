//! The Node annotation `gpupool.io/gpus` (DESIGN §2): the device plugin's
//! account of the node's GPUs, read by the operator for the class snapshot.

use serde::{Deserialize, Serialize};

/// One GPU of a node, as discovered by the device plugin.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct NodeGpu {
    /// Index as the driver numbers it; sparse indices are kept as they are.
    pub index: u32,
    /// Stable UUID (`GPU-…` for NVIDIA).
    pub uuid: String,
    /// Product name, e.g. `NVIDIA H100 80GB HBM3`.
    #[serde(default)]
    pub product: String,
    /// Vendor, e.g. `NVIDIA`.
    #[serde(default)]
    pub vendor: String,
    /// Total memory in MiB, 0 when unknown.
    #[serde(default, rename = "memoryMiB")]
    pub memory_mib: u64,
    /// Whether the GPU passed its last health check.
    #[serde(default = "healthy_by_default")]
    pub healthy: bool,
}

fn healthy_by_default() -> bool {
    true
}

/// Why a node's GPU annotation could not be read.
#[derive(Debug, thiserror::Error)]
#[error("node annotation gpupool.io/gpus is not a JSON list of GPUs: {0}")]
pub struct NodeGpusError(#[from] serde_json::Error);

/// Reads the annotation's value.
pub fn parse(value: &str) -> Result<Vec<NodeGpu>, NodeGpusError> {
    Ok(serde_json::from_str(value)?)
}

/// Writes the annotation's value, GPUs in index order.
pub fn render(gpus: &[NodeGpu]) -> String {
    let mut sorted: Vec<&NodeGpu> = gpus.iter().collect();
    sorted.sort_by_key(|g| g.index);
    // A Vec of plain structs with string keys always serialises.
    serde_json::to_string(&sorted).unwrap_or_else(|_| "[]".to_owned())
}

/// The value of the `gpupool.io/slots` annotation: `<resource>=<slots>`.
pub fn render_slots(resource: &str, slots: u32) -> String {
    format!("{resource}={slots}")
}

/// Reads a `gpupool.io/slots` value; `None` when it is not
/// `<resource>=<whole number>`.
pub fn parse_slots(value: &str) -> Option<(&str, u32)> {
    let (resource, slots) = value.rsplit_once('=')?;
    let slots = slots.parse().ok()?;
    (!resource.is_empty()).then_some((resource, slots))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_round_trip_and_bad_values_read_as_none() {
        let value = render_slots("gpupool/slot", 4);
        assert_eq!(value, "gpupool/slot=4");
        assert_eq!(parse_slots(&value), Some(("gpupool/slot", 4)));
        for bad in [
            "",
            "gpupool/slot",
            "gpupool/slot=",
            "=3",
            "gpupool/slot=-1",
            "gpupool/slot=1.5",
        ] {
            assert_eq!(parse_slots(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn round_trip_in_index_order() {
        let gpus = vec![
            NodeGpu {
                index: 3,
                uuid: "GPU-b".into(),
                product: "P".into(),
                vendor: "NVIDIA".into(),
                memory_mib: 1024,
                healthy: false,
            },
            NodeGpu {
                index: 0,
                uuid: "GPU-a".into(),
                product: "P".into(),
                vendor: "NVIDIA".into(),
                memory_mib: 1024,
                healthy: true,
            },
        ];
        let text = render(&gpus);
        assert!(text.contains(r#""memoryMiB":1024"#), "{text}");
        let back = parse(&text).expect("parses");
        assert_eq!(back.iter().map(|g| g.index).collect::<Vec<_>>(), vec![0, 3]);
        assert!(!back[1].healthy);
    }

    #[test]
    fn not_a_list_is_an_error_naming_the_annotation() {
        let err = parse(r#"{"index":0}"#).expect_err("object, not list");
        assert!(err.to_string().contains("gpupool.io/gpus"), "{err}");
    }
}
