//! PATCH bodies: JSON Patch (RFC 6902), JSON merge patch (RFC 7386) and the
//! strategic merge patch of built-in types.

use serde_json::{Map, Value};

use crate::error::{ApiError, Reason};

/// The patch type, from the request's Content-Type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PatchType {
    /// `application/json-patch+json`.
    Json,
    /// `application/merge-patch+json`.
    Merge,
    /// `application/strategic-merge-patch+json`.
    Strategic,
    /// `application/apply-patch+yaml`: server-side apply (see
    /// the `objects::apply` module); as a plain patch, a merge of the YAML.
    Apply,
}

impl PatchType {
    /// Maps a Content-Type to a patch type; apply in CBOR and anything else
    /// is refused with 415.
    pub fn from_content_type(ct: &str) -> Result<Self, ApiError> {
        let base = ct.split(';').next().unwrap_or_default().trim();
        match base {
            "application/json-patch+json" => Ok(PatchType::Json),
            "application/merge-patch+json" => Ok(PatchType::Merge),
            "application/strategic-merge-patch+json" => Ok(PatchType::Strategic),
            "application/apply-patch+yaml" => Ok(PatchType::Apply),
            other => Err(ApiError::new(
                Reason::UnsupportedMediaType,
                format!(
                    "the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml, application/strategic-merge-patch+json (got \"{other}\")"
                ),
            )),
        }
    }
}

/// Applies a patch body to a copy of `current`.
pub fn apply(current: &Value, kind: PatchType, body: &[u8]) -> Result<Value, ApiError> {
    let patch: Value = if kind == PatchType::Apply {
        serde_yaml::from_slice(body)
            .map_err(|e| ApiError::bad_request(format!("error decoding YAML: {e}")))?
    } else {
        serde_json::from_slice(body)
            .map_err(|e| ApiError::bad_request(format!("error decoding patch: {e}")))?
    };
    let mut doc = current.clone();
    match kind {
        PatchType::Json => {
            let ops: json_patch::Patch = serde_json::from_value(patch)
                .map_err(|e| ApiError::bad_request(format!("error decoding patch: {e}")))?;
            json_patch::patch(&mut doc, &ops).map_err(|e| {
                ApiError::new(
                    Reason::Invalid,
                    format!("the server rejected our request due to an error in our request: {e}"),
                )
            })?;
        }
        PatchType::Merge | PatchType::Apply => {
            if !patch.is_object() {
                return Err(ApiError::bad_request(
                    "error decoding patch: a merge patch must be a JSON object",
                ));
            }
            json_patch::merge(&mut doc, &patch);
        }
        PatchType::Strategic => {
            if !patch.is_object() {
                return Err(ApiError::bad_request(
                    "error decoding patch: a strategic merge patch must be a JSON object",
                ));
            }
            strategic_merge(&mut doc, &patch, "");
        }
    }
    Ok(doc)
}

/// The merge key of a list field in built-in types, by field name; `None`
/// for lists that are replaced wholesale. `Some("")` merges primitive lists
/// as sets.
fn merge_key(path: &str, field: &str) -> Option<&'static str> {
    match field {
        "conditions" | "addresses" => Some("type"),
        "containers"
        | "initContainers"
        | "ephemeralContainers"
        | "schedulingGates"
        | "env"
        | "volumes"
        | "imagePullSecrets"
        | "resourceClaims" => Some("name"),
        "volumeMounts" => Some("mountPath"),
        "volumeDevices" => Some("devicePath"),
        "ports" if path.ends_with("containers") => Some("containerPort"),
        "ports" => Some("port"),
        "ownerReferences" => Some("uid"),
        "taints" => Some("key"),
        "finalizers" => Some(""),
        _ => None,
    }
}

fn strategic_merge(doc: &mut Value, patch: &Value, path: &str) {
    let Some(pobj) = patch.as_object() else {
        *doc = patch.clone();
        return;
    };
    if pobj.get("$patch").and_then(Value::as_str) == Some("replace") {
        let mut p = pobj.clone();
        p.remove("$patch");
        *doc = Value::Object(p);
        return;
    }
    if !doc.is_object() {
        *doc = Value::Object(Map::new());
    }
    let Some(dobj) = doc.as_object_mut() else {
        return;
    };
    for (k, v) in pobj {
        if k.starts_with("$setElementOrder/") || k == "$retainKeys" || k == "$patch" {
            continue;
        }
        if let Some(field) = k.strip_prefix("$deleteFromPrimitiveList/") {
            if let (Some(Value::Array(list)), Some(remove)) = (dobj.get_mut(field), v.as_array()) {
                list.retain(|x| !remove.contains(x));
            }
            continue;
        }
        if v.is_null() {
            dobj.remove(k);
            continue;
        }
        let child_path = format!("{path}.{k}");
        match (dobj.get_mut(k), v) {
            (Some(existing @ Value::Object(_)), Value::Object(_)) => {
                strategic_merge(existing, v, &child_path);
            }
            (Some(Value::Array(existing)), Value::Array(items)) => match merge_key(path, k) {
                Some("") => {
                    for item in items {
                        if !existing.contains(item) {
                            existing.push(item.clone());
                        }
                    }
                }
                Some(key) => merge_list(existing, items, key, &child_path),
                None => {
                    dobj.insert(k.clone(), v.clone());
                }
            },
            (_, Value::Object(o)) => {
                let mut fresh = Value::Object(Map::new());
                strategic_merge(&mut fresh, &Value::Object(o.clone()), &child_path);
                dobj.insert(k.clone(), fresh);
            }
            (_, Value::Array(items)) => {
                let cleaned: Vec<Value> = items
                    .iter()
                    .filter(|i| i.get("$patch").and_then(Value::as_str) != Some("delete"))
                    .cloned()
                    .collect();
                dobj.insert(k.clone(), Value::Array(cleaned));
            }
            _ => {
                dobj.insert(k.clone(), v.clone());
            }
        }
    }
}

fn merge_list(existing: &mut Vec<Value>, items: &[Value], key: &str, path: &str) {
    if items
        .iter()
        .any(|i| i.get("$patch").and_then(Value::as_str) == Some("replace"))
    {
        *existing = items
            .iter()
            .filter(|i| i.get("$patch").is_none())
            .cloned()
            .collect();
        return;
    }
    for item in items {
        let id = item.get(key).cloned();
        let pos = id
            .as_ref()
            .and_then(|id| existing.iter().position(|e| e.get(key) == Some(id)));
        let delete = item.get("$patch").and_then(Value::as_str) == Some("delete");
        match (pos, delete) {
            (Some(i), true) => {
                existing.remove(i);
            }
            (None, true) => {}
            (Some(i), false) => strategic_merge(&mut existing[i], item, path),
            (None, false) => {
                let mut fresh = Value::Object(Map::new());
                strategic_merge(&mut fresh, item, path);
                existing.push(fresh);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn smp(doc: Value, patch: Value) -> Value {
        apply(&doc, PatchType::Strategic, patch.to_string().as_bytes()).expect("patch applies")
    }

    #[test]
    fn strategic_merges_conditions_by_type() {
        let doc = json!({"status": {"conditions": [
            {"type": "Ready", "status": "False"},
            {"type": "PodScheduled", "status": "True"}
        ]}});
        let out = smp(
            doc,
            json!({"status": {"conditions": [{"type": "Ready", "status": "True"}]}}),
        );
        assert_eq!(
            out["status"]["conditions"],
            json!([{"type": "Ready", "status": "True"}, {"type": "PodScheduled", "status": "True"}])
        );
    }

    #[test]
    fn strategic_deletes_scheduling_gate_by_name() {
        let doc = json!({"spec": {"schedulingGates": [{"name": "a"}, {"name": "b"}]}});
        let out = smp(
            doc,
            json!({"spec": {"schedulingGates": [{"name": "a", "$patch": "delete"}]}}),
        );
        assert_eq!(out["spec"]["schedulingGates"], json!([{"name": "b"}]));
    }

    #[test]
    fn strategic_replaces_tolerations_and_merges_containers() {
        let doc = json!({"spec": {
            "tolerations": [{"key": "a"}],
            "containers": [{"name": "c", "image": "x"}, {"name": "d", "image": "y"}]
        }});
        let out = smp(
            doc,
            json!({"spec": {
                "tolerations": [{"key": "b"}],
                "containers": [{"name": "d", "image": "z"}],
                "nodeSelector": {"k": "v"}
            }}),
        );
        assert_eq!(out["spec"]["tolerations"], json!([{"key": "b"}]));
        assert_eq!(out["spec"]["containers"][1]["image"], "z");
        assert_eq!(out["spec"]["containers"][0]["image"], "x");
        assert_eq!(out["spec"]["nodeSelector"], json!({"k": "v"}));
    }

    #[test]
    fn strategic_null_removes_label_and_finalizers_merge_as_set() {
        let doc = json!({"metadata": {"labels": {"a": "1", "b": "2"}, "finalizers": ["x"]}});
        let out = smp(
            doc,
            json!({"metadata": {"labels": {"a": null}, "finalizers": ["y", "x"]}}),
        );
        assert_eq!(out["metadata"]["labels"], json!({"b": "2"}));
        assert_eq!(out["metadata"]["finalizers"], json!(["x", "y"]));
    }

    #[test]
    fn json_patch_test_failure_is_invalid() {
        let doc = json!({"a": 1});
        let body = json!([{"op": "test", "path": "/a", "value": 2}, {"op": "replace", "path": "/a", "value": 3}]);
        let err =
            apply(&doc, PatchType::Json, body.to_string().as_bytes()).expect_err("test fails");
        assert_eq!(err.http_code(), 422);
    }

    #[test]
    fn apply_is_a_patch_type_and_unknown_media_types_are_415() {
        assert_eq!(
            PatchType::from_content_type("application/apply-patch+yaml; charset=utf-8")
                .expect("apply"),
            PatchType::Apply
        );
        let err = PatchType::from_content_type("application/apply-patch+cbor").expect_err("cbor");
        assert_eq!(err.http_code(), 415);
        let merged = apply(
            &json!({"spec": {"replicas": 1}}),
            PatchType::Apply,
            b"spec:\n  replicas: 3\n",
        )
        .expect("YAML merges");
        assert_eq!(merged["spec"]["replicas"], 3);
        assert_eq!(
            apply(&json!({}), PatchType::Apply, b"[x")
                .expect_err("bad YAML")
                .http_code(),
            400
        );
    }
}
