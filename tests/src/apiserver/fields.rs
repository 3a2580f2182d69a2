//! Unknown fields, as the real server's decoder finds them: a field the
//! type does not declare is dropped (`fieldValidation=Ignore`), dropped with
//! a `Warning` header (`Warn`, the default) or refused with 400 BadRequest
//! naming its path (`Strict`).
//!
//! Built-in types take their declared fields from the OpenAPI schemas the
//! k8s-openapi types carry; custom resources from their CRD's structural
//! schema, with `metadata` checked against `ObjectMeta` as for every kind.

use std::collections::HashMap;
use std::sync::OnceLock;

use k8s_openapi::schemars::{JsonSchema, SchemaGenerator};
use serde_json::{Map, Value};

use super::registry::ResourceDef;

/// What a request asked for with `fieldValidation`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FieldValidation {
    /// Drop unknown fields silently.
    Ignore,
    /// Drop unknown fields and warn about each (the server default).
    #[default]
    Warn,
    /// Refuse the request.
    Strict,
}

/// The schemas of the built-in kinds and every type they refer to.
struct Builtins {
    /// (group, plural) → the schema of the kind (a `$ref`).
    kinds: HashMap<(&'static str, &'static str), Value>,
    /// Referenced schemas by name.
    defs: Map<String, Value>,
    /// The `$ref` of `ObjectMeta`.
    object_meta: Value,
}

fn builtins() -> &'static Builtins {
    static BUILTINS: OnceLock<Builtins> = OnceLock::new();
    BUILTINS.get_or_init(|| {
        use k8s_openapi::api::{
            admissionregistration::v1 as admission, apps::v1 as apps,
            coordination::v1 as coordination, core::v1 as core, events::v1 as events,
            policy::v1 as policy, rbac::v1 as rbac,
        };
        use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1 as apiext;
        let mut generator = SchemaGenerator::default();
        let mut kinds = HashMap::new();
        fn add<T: JsonSchema>(
            generator: &mut SchemaGenerator,
            kinds: &mut HashMap<(&'static str, &'static str), Value>,
            group: &'static str,
            plural: &'static str,
        ) {
            kinds.insert((group, plural), generator.subschema_for::<T>().to_value());
        }
        let g = &mut generator;
        let k = &mut kinds;
        add::<core::Namespace>(g, k, "", "namespaces");
        add::<core::Node>(g, k, "", "nodes");
        add::<core::Pod>(g, k, "", "pods");
        add::<core::Event>(g, k, "", "events");
        add::<core::ConfigMap>(g, k, "", "configmaps");
        add::<core::Secret>(g, k, "", "secrets");
        add::<core::ServiceAccount>(g, k, "", "serviceaccounts");
        add::<core::Service>(g, k, "", "services");
        add::<core::Endpoints>(g, k, "", "endpoints");
        add::<coordination::Lease>(g, k, "coordination.k8s.io", "leases");
        add::<events::Event>(g, k, "events.k8s.io", "events");
        add::<policy::PodDisruptionBudget>(g, k, "policy", "poddisruptionbudgets");
        add::<apiext::CustomResourceDefinition>(
            g,
            k,
            "apiextensions.k8s.io",
            "customresourcedefinitions",
        );
        add::<admission::MutatingWebhookConfiguration>(
            g,
            k,
            "admissionregistration.k8s.io",
            "mutatingwebhookconfigurations",
        );
        add::<admission::ValidatingWebhookConfiguration>(
            g,
            k,
            "admissionregistration.k8s.io",
            "validatingwebhookconfigurations",
        );
        add::<apps::Deployment>(g, k, "apps", "deployments");
        add::<apps::DaemonSet>(g, k, "apps", "daemonsets");
        add::<apps::StatefulSet>(g, k, "apps", "statefulsets");
        add::<apps::ReplicaSet>(g, k, "apps", "replicasets");
        add::<rbac::ClusterRole>(g, k, "rbac.authorization.k8s.io", "clusterroles");
        add::<rbac::ClusterRoleBinding>(g, k, "rbac.authorization.k8s.io", "clusterrolebindings");
        add::<rbac::Role>(g, k, "rbac.authorization.k8s.io", "roles");
        add::<rbac::RoleBinding>(g, k, "rbac.authorization.k8s.io", "rolebindings");
        let object_meta = generator
            .subschema_for::<k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta>()
            .to_value();
        Builtins {
            kinds,
            defs: generator.definitions().clone(),
            object_meta,
        }
    })
}

/// Removes the fields of `obj` its type does not declare and returns their
/// paths (`spec.containers[0].foo`), in document order.
pub fn prune_unknown(def: &ResourceDef, obj: &mut Value) -> Vec<String> {
    let b = builtins();
    let mut unknown = Vec::new();
    let Some(map) = obj.as_object_mut() else {
        return unknown;
    };
    if def.custom {
        // The CRD schema covers the body; metadata is ObjectMeta everywhere.
        if let Some(schema) = &def.schema {
            let keys: Vec<String> = map.keys().cloned().collect();
            let props = schema.get("properties").and_then(Value::as_object);
            for key in keys {
                if matches!(key.as_str(), "apiVersion" | "kind") {
                    continue;
                }
                let Some(v) = map.get_mut(&key) else { continue };
                if key == "metadata" {
                    walk(&b.object_meta, &b.defs, v, "metadata", &mut unknown);
                    continue;
                }
                match props.and_then(|p| p.get(&key)) {
                    Some(sub) => walk(sub, &b.defs, v, &key, &mut unknown),
                    None if preserves_unknown(schema) || props.is_none() => {}
                    None => {
                        unknown.push(key.clone());
                        map.remove(&key);
                    }
                }
            }
        } else if let Some(meta) = map.get_mut("metadata") {
            walk(&b.object_meta, &b.defs, meta, "metadata", &mut unknown);
        }
        return unknown;
    }
    if let Some(schema) = b.kinds.get(&(def.group.as_str(), def.plural.as_str())) {
        walk(schema, &b.defs, obj, "", &mut unknown);
    }
    unknown
}

fn preserves_unknown(schema: &Value) -> bool {
    schema
        .get("x-kubernetes-preserve-unknown-fields")
        .and_then(Value::as_bool)
        == Some(true)
        || schema.get("additionalProperties").and_then(Value::as_bool) == Some(true)
}

/// Follows `$ref`s to the schema they name (a bounded number of hops).
fn resolve<'a>(mut schema: &'a Value, defs: &'a Map<String, Value>) -> &'a Value {
    for _ in 0..8 {
        let Some(r) = schema.get("$ref").and_then(Value::as_str) else {
            break;
        };
        let name = r.rsplit('/').next().unwrap_or(r);
        match defs.get(name) {
            Some(s) => schema = s,
            None => break,
        }
    }
    schema
}

fn json_type(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// For `oneOf`/`anyOf` schemas (a schema or a bool, one schema or many):
/// the alternative whose type fits the value.
fn alternative<'a>(
    schema: &'a Value,
    defs: &'a Map<String, Value>,
    v: &Value,
) -> Option<&'a Value> {
    let alts = schema
        .get("oneOf")
        .or_else(|| schema.get("anyOf"))
        .and_then(Value::as_array)?;
    let want = json_type(v);
    alts.iter()
        .map(|a| resolve(a, defs))
        .find(|a| match a.get("type").and_then(Value::as_str) {
            Some(t) => t == want || (t == "integer" && want == "number"),
            None => want == "object" && a.get("properties").is_some(),
        })
}

fn child(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

fn walk(
    schema: &Value,
    defs: &Map<String, Value>,
    v: &mut Value,
    path: &str,
    out: &mut Vec<String>,
) {
    let mut schema = resolve(schema, defs);
    if let Some(alt) = alternative(schema, defs, v) {
        schema = alt;
    }
    match v {
        Value::Object(map) => {
            if preserves_unknown(schema) {
                return;
            }
            if let Some(props) = schema.get("properties").and_then(Value::as_object) {
                let keys: Vec<String> = map.keys().cloned().collect();
                for key in keys {
                    match props.get(&key) {
                        Some(sub) => {
                            if let Some(inner) = map.get_mut(&key) {
                                walk(sub, defs, inner, &child(path, &key), out);
                            }
                        }
                        None => {
                            out.push(child(path, &key));
                            map.remove(&key);
                        }
                    }
                }
            } else if let Some(sub) = schema.get("additionalProperties").filter(|s| s.is_object()) {
                for (key, inner) in map.iter_mut() {
                    walk(sub, defs, inner, &child(path, key), out);
                }
            }
        }
        Value::Array(items) => {
            if let Some(sub) = schema.get("items").filter(|s| s.is_object()) {
                for (i, inner) in items.iter_mut().enumerate() {
                    walk(sub, defs, inner, &format!("{path}[{i}]"), out);
                }
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::super::registry::Registry;
    use super::*;
    use serde_json::json;

    fn def(group: &str, version: &str, plural: &str) -> ResourceDef {
        Registry::builtin()
            .get(group, version, plural)
            .cloned()
            .expect("builtin")
    }

    #[test]
    fn unknown_pod_fields_are_found_at_every_depth_and_pruned() {
        let mut pod = json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "p", "labels": {"a": "b"}, "bogus": 1},
            "spec": {
                "containers": [{"name": "c", "image": "i", "colour": "red",
                    "resources": {"limits": {"gpupool/slot": 1}}}],
                "nodeSelector": {"x": "y"},
                "extra": {"deep": true},
            },
        });
        let found = prune_unknown(&def("", "v1", "pods"), &mut pod);
        assert_eq!(
            found,
            ["metadata.bogus", "spec.containers[0].colour", "spec.extra"]
        );
        assert!(pod["spec"].get("extra").is_none());
        assert!(pod["spec"]["containers"][0].get("colour").is_none());
        assert_eq!(
            pod["spec"]["containers"][0]["resources"]["limits"]["gpupool/slot"],
            1
        );
        assert_eq!(pod["spec"]["nodeSelector"]["x"], "y");
    }

    #[test]
    fn maps_and_opaque_fields_keep_their_keys() {
        let mut cm = json!({"metadata": {"name": "c", "annotations": {"any": "thing"},
            "managedFields": [{"manager": "m", "fieldsV1": {"f:data": {}}}]},
            "data": {"whatever": "x"}});
        assert!(prune_unknown(&def("", "v1", "configmaps"), &mut cm).is_empty());
        let mut crd = json!({"metadata": {"name": "a.b"}, "spec": {"group": "b", "names": {"plural": "a", "kind": "A"}, "scope": "Namespaced",
            "versions": [{"name": "v1", "served": true, "storage": true, "schema": {"openAPIV3Schema": {
                "type": "object", "x-kubernetes-preserve-unknown-fields": true,
                "properties": {"spec": {"type": "object", "additionalProperties": {"type": "string"}, "default": {"k": "v"}}}}}}]}});
        assert!(
            prune_unknown(
                &def("apiextensions.k8s.io", "v1", "customresourcedefinitions"),
                &mut crd
            )
            .is_empty()
        );
        crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["propertiez"] = json!({});
        assert_eq!(
            prune_unknown(
                &def("apiextensions.k8s.io", "v1", "customresourcedefinitions"),
                &mut crd
            ),
            ["spec.versions[0].schema.openAPIV3Schema.propertiez"]
        );
    }

    #[test]
    fn every_builtin_resource_has_a_schema() {
        for d in Registry::builtin().all() {
            assert!(
                builtins()
                    .kinds
                    .contains_key(&(d.group.as_str(), d.plural.as_str())),
                "{}/{}",
                d.group,
                d.plural
            );
        }
    }
}
