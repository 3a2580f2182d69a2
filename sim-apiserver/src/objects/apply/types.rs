//! How lists merge, per field: keyed by some of their items' fields, as
//! sets of values, or atomically (replaced whole). Built-in kinds follow
//! the list types and merge keys of the Kubernetes OpenAPI; custom
//! resources follow their schema's `x-kubernetes-list-type` and
//! `x-kubernetes-list-map-keys`, atomic unless stated.

use serde_json::Value;

use crate::registry::ResourceDef;

/// How a list merges.
#[derive(Debug, Clone, PartialEq)]
pub enum ListType {
    /// Replaced whole; owned as one field.
    Atomic,
    /// Items are values, merged as a set (`v:` path elements).
    Set,
    /// Items are objects keyed by these fields (`k:` path elements); a key
    /// field may have a default used when an item omits it.
    Map(Vec<(String, Option<Value>)>),
}

/// The list types of one resource.
pub struct Types<'a> {
    schema: Option<&'a Value>,
}

#[cfg(test)]
impl Types<'static> {
    /// The list types of built-in kinds.
    pub const fn builtin() -> Self {
        Types { schema: None }
    }
}

impl<'a> Types<'a> {
    /// The list types of a resource's objects.
    pub fn of(def: &'a ResourceDef) -> Self {
        Types {
            schema: if def.custom {
                def.schema.as_ref()
            } else {
                None
            },
        }
    }

    /// The type of the list at `path` (field names from the root; list
    /// items add nothing to the path).
    pub fn list_type(&self, path: &[String]) -> ListType {
        match self.schema {
            Some(schema) if path.first().map(String::as_str) != Some("metadata") => {
                custom_list_type(schema, path)
            }
            _ => builtin_list_type(path),
        }
    }
}

fn keyed(keys: &[&str]) -> ListType {
    ListType::Map(keys.iter().map(|k| (k.to_string(), None)).collect())
}

fn builtin_list_type(path: &[String]) -> ListType {
    let Some(field) = path.last() else {
        return ListType::Atomic;
    };
    let parent = path.len().checked_sub(2).map(|i| path[i].as_str());
    let in_container = matches!(
        parent,
        Some("containers" | "initContainers" | "ephemeralContainers")
    );
    let tcp = || Some(Value::String("TCP".into()));
    match field.as_str() {
        "finalizers" => ListType::Set,
        "ownerReferences" => keyed(&["uid"]),
        "containers"
        | "initContainers"
        | "ephemeralContainers"
        | "volumes"
        | "imagePullSecrets"
        | "resourceClaims"
        | "schedulingGates"
        | "webhooks" => keyed(&["name"]),
        "env" if in_container => keyed(&["name"]),
        "ports" if in_container => ListType::Map(vec![
            ("containerPort".into(), None),
            ("protocol".into(), tcp()),
        ]),
        "ports" if path.len() == 2 && path[0] == "spec" => {
            ListType::Map(vec![("port".into(), None), ("protocol".into(), tcp())])
        }
        "volumeMounts" => keyed(&["mountPath"]),
        "volumeDevices" => keyed(&["devicePath"]),
        "resizePolicy" => keyed(&["resourceName"]),
        "conditions" => keyed(&["type"]),
        "addresses" if parent == Some("status") => keyed(&["type"]),
        "hostAliases" => keyed(&["ip"]),
        "podIPs" | "hostIPs" => keyed(&["ip"]),
        "topologySpreadConstraints" => keyed(&["topologyKey", "whenUnsatisfiable"]),
        _ => ListType::Atomic,
    }
}

/// Steps through list items to the schema of the items' object.
fn through_items(mut node: &Value) -> &Value {
    for _ in 0..64 {
        match node.get("items") {
            Some(items) if node.get("type").and_then(Value::as_str) == Some("array") => {
                node = items;
            }
            _ => break,
        }
    }
    node
}

fn custom_list_type(schema: &Value, path: &[String]) -> ListType {
    let mut node = schema;
    for seg in path {
        let obj = through_items(node);
        let next = obj
            .get("properties")
            .and_then(|p| p.get(seg.as_str()))
            .or_else(|| obj.get("additionalProperties").filter(|a| a.is_object()));
        match next {
            Some(n) => node = n,
            None => return ListType::Atomic,
        }
    }
    match node.get("x-kubernetes-list-type").and_then(Value::as_str) {
        Some("set") => ListType::Set,
        Some("map") => {
            let item_props = node.get("items").and_then(|i| i.get("properties"));
            let keys = node
                .get("x-kubernetes-list-map-keys")
                .and_then(Value::as_array)
                .map(|ks| {
                    ks.iter()
                        .filter_map(Value::as_str)
                        .map(|k| {
                            let default = item_props
                                .and_then(|p| p.get(k))
                                .and_then(|p| p.get("default"))
                                .cloned();
                            (k.to_string(), default)
                        })
                        .collect::<Vec<_>>()
                })
                .unwrap_or_default();
            if keys.is_empty() {
                ListType::Atomic
            } else {
                ListType::Map(keys)
            }
        }
        _ => ListType::Atomic,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn p(s: &[&str]) -> Vec<String> {
        s.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn builtin_lists_follow_their_merge_keys() {
        let t = Types { schema: None };
        assert_eq!(
            t.list_type(&p(&["spec", "template", "spec", "containers"])),
            keyed(&["name"])
        );
        assert_eq!(
            t.list_type(&p(&["spec", "containers", "ports"])),
            ListType::Map(vec![
                ("containerPort".into(), None),
                ("protocol".into(), Some(json!("TCP")))
            ])
        );
        assert_eq!(
            t.list_type(&p(&["spec", "ports"])),
            ListType::Map(vec![
                ("port".into(), None),
                ("protocol".into(), Some(json!("TCP")))
            ])
        );
        assert_eq!(
            t.list_type(&p(&["spec", "containers", "env"])),
            keyed(&["name"])
        );
        assert_eq!(t.list_type(&p(&["metadata", "finalizers"])), ListType::Set);
        assert_eq!(t.list_type(&p(&["spec", "tolerations"])), ListType::Atomic);
        assert_eq!(
            t.list_type(&p(&["spec", "ingress", "ports"])),
            ListType::Atomic
        );
    }

    #[test]
    fn custom_lists_follow_the_schema_extensions() {
        let schema = json!({"type": "object", "properties": {"spec": {"type": "object", "properties": {
            "items": {"type": "array", "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["id"],
                "items": {"type": "object", "properties": {"id": {"type": "string"},
                    "tags": {"type": "array", "x-kubernetes-list-type": "set", "items": {"type": "string"}}}}},
            "plain": {"type": "array", "items": {"type": "string"}}}}}});
        let t = Types {
            schema: Some(&schema),
        };
        assert_eq!(t.list_type(&p(&["spec", "items"])), keyed(&["id"]));
        assert_eq!(t.list_type(&p(&["spec", "items", "tags"])), ListType::Set);
        assert_eq!(t.list_type(&p(&["spec", "plain"])), ListType::Atomic);
        assert_eq!(t.list_type(&p(&["spec", "missing"])), ListType::Atomic);
        assert_eq!(t.list_type(&p(&["metadata", "finalizers"])), ListType::Set);
    }
}
