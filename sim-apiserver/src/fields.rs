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

use crate::registry::ResourceDef;

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

/// The declared fields of one or more types, compiled once from OpenAPI
/// schemas into a graph that a request's body is walked against.
#[derive(Debug, Default)]
pub struct KnownFields {
    nodes: Vec<Node>,
}

/// What one schema allows.
#[derive(Debug, Default)]
struct Node {
    /// Keys not declared are kept (`x-kubernetes-preserve-unknown-fields`).
    preserve: bool,
    /// Declared properties of an object.
    props: Option<HashMap<String, usize>>,
    /// The schema of every value of a map.
    additional: Option<usize>,
    /// The schema of every item of an array.
    items: Option<usize>,
    /// For `oneOf`/`anyOf`: the alternative for each JSON type.
    alternatives: Vec<(&'static str, usize)>,
    /// The Go type of an inline scalar schema (`int32`, `string`, …), whose
    /// JSON type the real server's decoder enforces. Named schemas
    /// (`Quantity`, `Time`, `IntOrString`) decode several JSON types and
    /// are left out.
    go_scalar: Option<&'static str>,
    /// The Go struct a named object schema is (`DeploymentSpec`).
    go_struct: Option<String>,
}

/// Builds nodes, one per named schema however often it is referred to (so
/// recursive schemas compile to cycles, not without end).
struct Compiler<'a> {
    defs: &'a Map<String, Value>,
    nodes: Vec<Node>,
    by_ref: HashMap<String, usize>,
}

impl Compiler<'_> {
    fn compile(&mut self, schema: &Value) -> usize {
        if let Some(r) = schema.get("$ref").and_then(Value::as_str) {
            let name = r.rsplit('/').next().unwrap_or(r);
            if let Some(&id) = self.by_ref.get(name) {
                return id;
            }
            let id = self.nodes.len();
            self.nodes.push(Node {
                preserve: true,
                ..Node::default()
            });
            self.by_ref.insert(name.to_string(), id);
            if let Some(target) = self.defs.get(name) {
                let mut node = self.build(target);
                node.go_struct = name.rsplit('.').next().map(str::to_owned);
                self.nodes[id] = node;
            }
            return id;
        }
        let mut node = self.build(schema);
        node.go_scalar = go_scalar(schema);
        self.nodes.push(node);
        self.nodes.len() - 1
    }

    fn build(&mut self, schema: &Value) -> Node {
        let mut node = Node {
            preserve: preserves_unknown(schema),
            ..Node::default()
        };
        if let Some(alts) = schema
            .get("oneOf")
            .or_else(|| schema.get("anyOf"))
            .and_then(Value::as_array)
        {
            for alt in alts {
                let ty = self.type_of(alt);
                let id = self.compile(alt);
                node.alternatives.push((ty, id));
            }
        }
        if let Some(props) = schema.get("properties").and_then(Value::as_object) {
            let mut compiled = HashMap::with_capacity(props.len());
            for (k, sub) in props {
                let id = self.compile(sub);
                compiled.insert(k.clone(), id);
            }
            node.props = Some(compiled);
        }
        if let Some(sub) = schema.get("additionalProperties").filter(|s| s.is_object()) {
            node.additional = Some(self.compile(sub));
        }
        if let Some(sub) = schema.get("items").filter(|s| s.is_object()) {
            node.items = Some(self.compile(sub));
        }
        node
    }

    /// The JSON type a schema (followed through `$ref`s) describes.
    fn type_of<'s>(&'s self, mut schema: &'s Value) -> &'static str {
        for _ in 0..8 {
            match schema
                .get("$ref")
                .and_then(Value::as_str)
                .and_then(|r| self.defs.get(r.rsplit('/').next().unwrap_or(r)))
            {
                Some(target) => schema = target,
                None => break,
            }
        }
        match schema.get("type").and_then(Value::as_str) {
            Some("object") => "object",
            Some("array") => "array",
            Some("string") => "string",
            Some("boolean") => "boolean",
            Some("integer" | "number") => "number",
            _ if schema.get("properties").is_some() => "object",
            _ => "",
        }
    }
}

impl KnownFields {
    /// The fields of a custom resource: its CRD's structural schema for the
    /// body, `ObjectMeta` for `metadata`. A root without declared properties
    /// keeps its other fields (as before this check existed).
    pub fn for_custom_resource(schema: &Value) -> (Self, usize) {
        let b = builtins();
        let mut root = schema.clone();
        if let Some(map) = root.as_object_mut() {
            if !map.contains_key("properties") {
                map.insert(
                    "x-kubernetes-preserve-unknown-fields".into(),
                    Value::Bool(true),
                );
            }
            let props = map
                .entry("properties")
                .or_insert_with(|| Value::Object(Map::new()));
            if let Some(props) = props.as_object_mut() {
                props.insert("metadata".into(), b.object_meta.clone());
                props.insert("apiVersion".into(), serde_json::json!({"type": "string"}));
                props.insert("kind".into(), serde_json::json!({"type": "string"}));
            }
        }
        let mut c = Compiler {
            defs: &b.defs,
            nodes: Vec::new(),
            by_ref: HashMap::new(),
        };
        let id = c.compile(&root);
        (KnownFields { nodes: c.nodes }, id)
    }

    /// Removes what node `id` does not declare from `v`, recording paths.
    fn walk(&self, id: usize, v: &mut Value, path: &mut String, out: &mut Vec<String>) {
        let Some(mut node) = self.nodes.get(id) else {
            return;
        };
        if !node.alternatives.is_empty() {
            let want = json_type(v);
            match node
                .alternatives
                .iter()
                .find(|(t, _)| *t == want)
                .and_then(|(_, alt)| self.nodes.get(*alt))
            {
                Some(alt) => node = alt,
                None => return,
            }
        }
        match v {
            Value::Object(map) => {
                if let Some(props) = &node.props {
                    map.retain(|key, inner| match props.get(key) {
                        Some(&sub) => {
                            if inner.is_object() || inner.is_array() {
                                let len = path.len();
                                push_key(path, key);
                                self.walk(sub, inner, path, out);
                                path.truncate(len);
                            }
                            true
                        }
                        None if node.preserve => true,
                        None => {
                            let len = path.len();
                            push_key(path, key);
                            out.push(path.clone());
                            path.truncate(len);
                            false
                        }
                    });
                } else if let Some(sub) = node.additional {
                    for (key, inner) in map.iter_mut() {
                        if inner.is_object() || inner.is_array() {
                            let len = path.len();
                            push_key(path, key);
                            self.walk(sub, inner, path, out);
                            path.truncate(len);
                        }
                    }
                }
            }
            Value::Array(items) => {
                if let Some(sub) = node.items {
                    for (i, inner) in items.iter_mut().enumerate() {
                        if inner.is_object() || inner.is_array() {
                            let len = path.len();
                            path.push('[');
                            path.push_str(&i.to_string());
                            path.push(']');
                            self.walk(sub, inner, path, out);
                            path.truncate(len);
                        }
                    }
                }
            }
            _ => {}
        }
    }
}

/// The compiled fields of the built-in kinds.
struct Builtins {
    /// (group, plural) → the root node of the kind.
    kinds: HashMap<(&'static str, &'static str), usize>,
    fields: KnownFields,
    /// Every referenced schema by name, for compiling CRD schemas that
    /// refer to `ObjectMeta`.
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
            networking::v1 as networking, policy::v1 as policy, rbac::v1 as rbac,
        };
        use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1 as apiext;
        let mut generator = SchemaGenerator::default();
        let mut roots = Vec::new();
        fn add<T: JsonSchema>(
            generator: &mut SchemaGenerator,
            roots: &mut Vec<((&'static str, &'static str), Value)>,
            group: &'static str,
            plural: &'static str,
        ) {
            roots.push(((group, plural), generator.subschema_for::<T>().to_value()));
        }
        let g = &mut generator;
        let k = &mut roots;
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
        {
            use k8s_openapi::api::authorization::v1 as authz;
            let group = "authorization.k8s.io";
            add::<authz::SelfSubjectAccessReview>(g, k, group, "selfsubjectaccessreviews");
            add::<authz::SelfSubjectRulesReview>(g, k, group, "selfsubjectrulesreviews");
            add::<authz::SubjectAccessReview>(g, k, group, "subjectaccessreviews");
            add::<authz::LocalSubjectAccessReview>(g, k, group, "localsubjectaccessreviews");
        }
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
        add::<admission::ValidatingAdmissionPolicy>(
            g,
            k,
            "admissionregistration.k8s.io",
            "validatingadmissionpolicies",
        );
        add::<admission::ValidatingAdmissionPolicyBinding>(
            g,
            k,
            "admissionregistration.k8s.io",
            "validatingadmissionpolicybindings",
        );
        add::<networking::NetworkPolicy>(g, k, "networking.k8s.io", "networkpolicies");
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
        let defs = generator.definitions().clone();
        let mut c = Compiler {
            defs: &defs,
            nodes: Vec::new(),
            by_ref: HashMap::new(),
        };
        let kinds = roots
            .iter()
            .map(|(key, schema)| (*key, c.compile(schema)))
            .collect();
        let fields = KnownFields { nodes: c.nodes };
        Builtins {
            kinds,
            fields,
            defs,
            object_meta,
        }
    })
}

/// The Go type the real decoder reads an inline scalar schema into.
fn go_scalar(schema: &Value) -> Option<&'static str> {
    match (
        schema.get("type").and_then(Value::as_str),
        schema.get("format").and_then(Value::as_str),
    ) {
        (Some("string"), None) => Some("string"),
        (Some("boolean"), _) => Some("bool"),
        (Some("integer"), Some("int32")) => Some("int32"),
        (Some("integer"), _) => Some("int64"),
        (Some("number"), _) => Some("float64"),
        _ => None,
    }
}

impl KnownFields {
    /// The first value whose JSON type the real decoder would refuse for
    /// its field, as Go's `encoding/json` words it.
    fn type_error(
        &self,
        id: usize,
        v: &Value,
        go_path: &mut String,
        go_struct: &str,
    ) -> Option<String> {
        let node = self.nodes.get(id)?;
        let here = node.go_struct.as_deref().unwrap_or(go_struct);
        let check = |sub: usize, key: &str, inner: &Value, path: &mut String| -> Option<String> {
            let sub_node = self.nodes.get(sub)?;
            let len = path.len();
            push_key(path, key);
            let found = match (sub_node.go_scalar, inner) {
                (_, Value::Null) => None,
                (Some(go), v) if !scalar_fits(go, v) => Some(format!(
                    "json: cannot unmarshal {} into Go struct field {here}.{path} of type {go}",
                    go_json_name(v)
                )),
                (_, Value::Object(_) | Value::Array(_)) => self.type_error(sub, inner, path, here),
                _ => None,
            };
            path.truncate(len);
            found
        };
        match v {
            Value::Object(map) => {
                if let Some(props) = &node.props {
                    for (key, inner) in map {
                        if let Some(&sub) = props.get(key)
                            && let Some(e) = check(sub, key, inner, go_path)
                        {
                            return Some(e);
                        }
                    }
                }
                None
            }
            Value::Array(items) => {
                let sub = node.items?;
                let sub_node = self.nodes.get(sub)?;
                items.iter().find_map(|inner| match (sub_node.go_scalar, inner) {
                    (Some(go), v) if !v.is_null() && !scalar_fits(go, v) => Some(format!(
                        "json: cannot unmarshal {} into Go struct field {here}.{go_path} of type {go}",
                        go_json_name(v)
                    )),
                    (_, Value::Object(_) | Value::Array(_)) => {
                        self.type_error(sub, inner, go_path, here)
                    }
                    _ => None,
                })
            }
            _ => None,
        }
    }
}

/// Whether Go decodes JSON value `v` into a field of Go type `go`.
fn scalar_fits(go: &str, v: &Value) -> bool {
    match go {
        "string" => v.is_string(),
        "bool" => v.is_boolean(),
        "int32" | "int64" => v.is_i64() || v.is_u64(),
        _ => v.is_number(),
    }
}

/// How Go's decoder names a JSON value's type in its errors.
fn go_json_name(v: &Value) -> String {
    match v {
        Value::Bool(_) => "bool".into(),
        Value::Number(n) => format!("number {n}"),
        Value::String(_) => "string".into(),
        Value::Array(_) => "array".into(),
        _ => "object".into(),
    }
}

/// For a built-in kind: the first field whose JSON type its Go type cannot
/// take, worded as the real server's decoder reports it (which refuses the
/// whole body with 400). Custom resources are checked against their schema
/// elsewhere, with 422.
pub fn type_error(def: &ResourceDef, obj: &Value) -> Option<String> {
    if def.custom {
        return None;
    }
    let b = builtins();
    let root = *b.kinds.get(&(def.group.as_str(), def.plural.as_str()))?;
    b.fields
        .type_error(root, obj, &mut String::new(), &def.kind)
}

/// Removes the fields of `obj` its type does not declare and returns their
/// paths (`spec.containers[0].foo`), in document order.
pub fn prune_unknown(def: &ResourceDef, obj: &mut Value) -> Vec<String> {
    let mut unknown = Vec::new();
    let mut path = String::with_capacity(64);
    if def.custom {
        if let Some(known) = &def.known_fields {
            let (fields, root) = &**known;
            fields.walk(*root, obj, &mut path, &mut unknown);
        }
        return unknown;
    }
    let b = builtins();
    if let Some(&root) = b.kinds.get(&(def.group.as_str(), def.plural.as_str())) {
        b.fields.walk(root, obj, &mut path, &mut unknown);
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

fn push_key(path: &mut String, key: &str) {
    if !path.is_empty() {
        path.push('.');
    }
    path.push_str(key);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_value_of_the_wrong_json_type_is_named_as_gos_decoder_names_it() {
        let reg = crate::registry::Registry::builtin();
        let def = reg
            .get("apps", "v1", "deployments")
            .expect("deployments")
            .clone();
        let bad = serde_json::json!({"spec": {"replicas": "two"}});
        assert_eq!(
            type_error(&def, &bad).as_deref(),
            Some(
                "json: cannot unmarshal string into Go struct field DeploymentSpec.spec.replicas of type int32"
            )
        );
        let port = serde_json::json!({"spec": {"template": {"spec": {"containers": [
            {"name": "c", "ports": [{"containerPort": "80"}]}]}}}});
        assert_eq!(
            type_error(&def, &port).as_deref(),
            Some(
                "json: cannot unmarshal string into Go struct field ContainerPort.spec.template.spec.containers.ports.containerPort of type int32"
            )
        );
        // Quantities take numbers and strings alike.
        let ok = serde_json::json!({"spec": {"replicas": 2, "template": {"spec": {"containers": [
            {"name": "c", "resources": {"limits": {"gpupool/slot": 1, "cpu": "1"}}}]}}}});
        assert_eq!(type_error(&def, &ok), None);
    }
    use crate::registry::Registry;
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
