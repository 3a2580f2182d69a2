//! Discovery documents: `/version`, `/api`, `/apis`, `/apis/<group>` and the
//! `APIResourceList` of every served group version, kept current as CRDs
//! come and go.

use serde_json::{Value, json};

use crate::error::{ApiError, Reason};
use crate::registry::Registry;

/// `/version`.
pub fn version() -> Value {
    json!({
        "major": "1",
        "minor": "34",
        "gitVersion": "v1.34.0-gpupool-sim",
        "gitCommit": "0000000000000000000000000000000000000000",
        "gitTreeState": "clean",
        "buildDate": "2026-01-01T00:00:00Z",
        "goVersion": "none",
        "compiler": "rustc",
        "platform": "linux/amd64",
    })
}

/// `/api`.
pub fn api_versions() -> Value {
    json!({
        "kind": "APIVersions",
        "versions": ["v1"],
        "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": "127.0.0.1"}],
    })
}

fn group_entry(group: &str, versions: &[String]) -> Value {
    let vs: Vec<Value> = versions
        .iter()
        .map(|v| json!({"groupVersion": format!("{group}/{v}"), "version": v}))
        .collect();
    json!({"name": group, "versions": vs, "preferredVersion": vs.first().cloned().unwrap_or(Value::Null)})
}

/// `/apis`.
pub fn api_groups(reg: &Registry) -> Value {
    let groups: Vec<Value> = reg
        .groups()
        .iter()
        .map(|(g, vs)| group_entry(g, vs))
        .collect();
    json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": groups})
}

/// `/apis/<group>`.
pub fn api_group(reg: &Registry, group: &str) -> Result<Value, ApiError> {
    reg.groups()
        .iter()
        .find(|(g, _)| g == group)
        .map(|(g, vs)| {
            let mut v = group_entry(g, vs);
            v["kind"] = json!("APIGroup");
            v["apiVersion"] = json!("v1");
            v
        })
        .ok_or_else(|| {
            ApiError::new(
                Reason::NotFound,
                "the server could not find the requested resource",
            )
        })
}

/// `/api/v1` or `/apis/<group>/<version>`.
pub fn resource_list(reg: &Registry, group: &str, version: &str) -> Value {
    let resources: Vec<Value> = reg
        .all()
        .filter(|d| d.group == group && d.version == version)
        .flat_map(|d| d.discovery_entries())
        .collect();
    let gv = if group.is_empty() {
        version.to_string()
    } else {
        format!("{group}/{version}")
    };
    json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": resources})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn core_list_has_pods_with_subresources() {
        let reg = Registry::builtin();
        let list = resource_list(&reg, "", "v1");
        let names: Vec<&str> = list["resources"]
            .as_array()
            .expect("list")
            .iter()
            .filter_map(|r| r["name"].as_str())
            .collect();
        for n in [
            "pods",
            "pods/status",
            "pods/eviction",
            "pods/binding",
            "nodes",
            "nodes/status",
            "namespaces",
            "secrets",
        ] {
            assert!(names.contains(&n), "{n} missing from {names:?}");
        }
        let groups = api_groups(&reg);
        assert!(
            groups["groups"]
                .as_array()
                .expect("groups")
                .iter()
                .any(|g| g["name"] == "coordination.k8s.io")
        );
        assert!(api_group(&reg, "nope.io").is_err());
    }
}
