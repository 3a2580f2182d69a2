//! The chart's own RBAC for the operator and the device plugin, so that on a
//! real control plane they run with exactly the permissions `helm install`
//! gives them: a verb the chart forgets fails there as it would in a cluster.
//!
//! The templates are compiled in from `charts/gpupool/templates/` and
//! rendered for the release `gpupool` here; they use only the release
//! namespace, the component's full name and a labels include (dropped), and
//! rendering fails on any other template action, so a template that grows
//! one fails the tests instead of silently diverging.

use serde::Deserialize;
use serde_json::Value;

/// The chart's operator RBAC template.
const OPERATOR_RBAC: &str = include_str!("../../../charts/gpupool/templates/operator-rbac.yaml");
/// The chart's device-plugin RBAC template.
const DEVICE_PLUGIN_RBAC: &str =
    include_str!("../../../charts/gpupool/templates/device-plugin-rbac.yaml");

/// The operator's full name (ServiceAccount, ClusterRole, Role) for release `gpupool`.
pub const OPERATOR_NAME: &str = "gpupool-operator";
/// The device plugin's full name for release `gpupool`.
pub const DEVICE_PLUGIN_NAME: &str = "gpupool-device-plugin";

/// Why a template could not be rendered.
#[derive(Debug, thiserror::Error)]
pub enum RbacError {
    /// A template action this renderer does not know.
    #[error(
        "the chart's RBAC template uses {0:?}, which the simulator cannot render; teach control_plane::rbac about it"
    )]
    Unsupported(String),
    /// The rendered YAML does not parse.
    #[error("the chart's RBAC template does not render to YAML: {0}")]
    Yaml(String),
}

fn render(template: &str, name: &str, namespace: &str) -> Result<Vec<Value>, RbacError> {
    let mut out = String::new();
    let mut lines = template.lines().peekable();
    while let Some(line) = lines.next() {
        let trimmed = line.trim();
        // `{{- $name := … -}}`, `{{- if … }}`, `{{- end }}`: control lines.
        if trimmed.starts_with("{{-") && !trimmed.contains("include \"gpupool.componentLabels\"") {
            let known = trimmed.contains("$name :=")
                || trimmed.starts_with("{{- if .Values.devicePlugin.enabled")
                || trimmed == "{{- end }}";
            if !known {
                return Err(RbacError::Unsupported(trimmed.to_owned()));
            }
            continue;
        }
        // `labels:` followed by the labels include: both go.
        if trimmed == "labels:"
            && lines
                .peek()
                .is_some_and(|next| next.contains("include \"gpupool.componentLabels\""))
        {
            lines.next();
            continue;
        }
        let rendered = line
            .replace("{{ $name | quote }}", &format!("\"{name}\""))
            .replace("{{ $name }}", name)
            .replace("{{ .Release.Namespace }}", namespace);
        if let Some(start) = rendered.find("{{") {
            return Err(RbacError::Unsupported(rendered[start..].to_owned()));
        }
        out.push_str(&rendered);
        out.push('\n');
    }
    let mut docs = Vec::new();
    for doc in serde_yaml::Deserializer::from_str(&out) {
        let value = Value::deserialize(doc).map_err(|e| RbacError::Yaml(e.to_string()))?;
        if !value.is_null() {
            docs.push(value);
        }
    }
    Ok(docs)
}

/// The operator's ClusterRole, ClusterRoleBinding, Role and RoleBinding as
/// the chart renders them in `namespace`.
pub fn operator(namespace: &str) -> Result<Vec<Value>, RbacError> {
    render(OPERATOR_RBAC, OPERATOR_NAME, namespace)
}

/// The device plugin's ClusterRole and ClusterRoleBinding as the chart
/// renders them in `namespace`.
pub fn device_plugin(namespace: &str) -> Result<Vec<Value>, RbacError> {
    render(DEVICE_PLUGIN_RBAC, DEVICE_PLUGIN_NAME, namespace)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_charts_rbac_renders_to_the_objects_it_declares() {
        let docs = operator("gpupool-system").expect("renders");
        let kinds: Vec<&str> = docs.iter().filter_map(|d| d["kind"].as_str()).collect();
        assert_eq!(
            kinds,
            ["ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"]
        );
        assert_eq!(docs[1]["subjects"][0]["namespace"], "gpupool-system");
        assert_eq!(docs[0]["metadata"]["name"], OPERATOR_NAME);
        let docs = device_plugin("x").expect("renders");
        let kinds: Vec<&str> = docs.iter().filter_map(|d| d["kind"].as_str()).collect();
        assert_eq!(kinds, ["ClusterRole", "ClusterRoleBinding"]);
    }

    #[test]
    fn an_unknown_template_action_is_refused() {
        let err = render("a: {{ .Values.x }}\n", "n", "ns").expect_err("unknown");
        assert!(err.to_string().contains(".Values.x"), "{err}");
        let err = render("{{- range .Values.y }}\n", "n", "ns").expect_err("unknown");
        assert!(err.to_string().contains("range"), "{err}");
    }
}
