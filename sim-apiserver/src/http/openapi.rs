//! A minimal OpenAPI v3 publication: `/openapi/v3` lists every served group
//! version, and each group version's document lists the paths of its
//! resources with the query parameters they take, and the schemas of its
//! custom resources (from their CRDs, as the real server publishes them,
//! so `kubectl explain` works for them); built-in kinds have none.
//!
//! That is what clients read to learn that the server validates fields
//! itself (`fieldValidation`): kubectl and Helm then leave field checking to
//! the server instead of downloading schemas for client-side validation,
//! which this server cannot offer. `/openapi/v2` is one empty document (see
//! `http::openapi_v2`), so kubectl skips client-side validation of a `List`.

use serde_json::{Map, Value, json};

use crate::error::{ApiError, Reason};
use crate::registry::{Registry, ResourceDef};

/// The query parameters every write takes.
const WRITE_PARAMS: [&str; 4] = ["dryRun", "fieldManager", "fieldValidation", "pretty"];

fn group_version_path(group: &str, version: &str) -> String {
    if group.is_empty() {
        format!("api/{version}")
    } else {
        format!("apis/{group}/{version}")
    }
}

/// A short, stable digest of a document, so clients that cache documents
/// by URL fetch a new one when the served resources change.
fn digest(doc: &Value) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in doc.to_string().bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{h:016X}")
}

fn operation(def: &ResourceDef, verb: &str) -> Value {
    let params: Vec<Value> = WRITE_PARAMS
        .iter()
        .map(|p| json!({"name": p, "in": "query", "schema": {"type": "string", "uniqueItems": true}}))
        .collect();
    json!({
        "operationId": format!("{verb}{}", def.kind),
        "x-kubernetes-action": verb,
        "x-kubernetes-group-version-kind": {"group": def.group, "version": def.version, "kind": def.kind},
        "parameters": params,
        "responses": {"200": {"description": "OK"}},
    })
}

/// The document of one group version, or 404 when it is not served.
pub fn group_version(reg: &Registry, group: &str, version: &str) -> Result<Value, ApiError> {
    if !reg.serves_group_version(group, version) {
        return Err(ApiError::new(
            Reason::NotFound,
            "the server could not find the requested resource",
        ));
    }
    let base = format!("/{}", group_version_path(group, version));
    let mut paths = Map::new();
    for def in reg
        .all()
        .filter(|d| d.group == group && d.version == version)
    {
        let collection = if def.namespaced {
            format!("{base}/namespaces/{{namespace}}/{}", def.plural)
        } else {
            format!("{base}/{}", def.plural)
        };
        paths.insert(collection.clone(), json!({"post": operation(def, "post")}));
        paths.insert(
            format!("{collection}/{{name}}"),
            json!({"put": operation(def, "put"), "patch": operation(def, "patch")}),
        );
        if def.status_subresource {
            paths.insert(
                format!("{collection}/{{name}}/status"),
                json!({"put": operation(def, "put"), "patch": operation(def, "patch")}),
            );
        }
    }
    let schemas: Map<String, Value> = reg
        .all()
        .filter(|d| d.group == group && d.version == version)
        .filter_map(|def| {
            Some((
                schema_name(def),
                custom_resource_schema(def, def.schema.as_ref()?),
            ))
        })
        .collect();
    Ok(json!({
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes (gpupool simulated API server)", "version": crate::http::discovery::version()["gitVersion"]},
        "paths": paths,
        "components": {"schemas": schemas},
    }))
}

/// The name the real server gives a kind's schema: the group's labels
/// reversed, then version and kind (`io.gpupool.v1alpha1.GpuLease`).
fn schema_name(def: &ResourceDef) -> String {
    let group: Vec<&str> = def.group.split('.').rev().collect();
    format!("{}.{}.{}", group.join("."), def.version, def.kind)
}

/// A custom resource's published schema: its CRD's `openAPIV3Schema`
/// with the `apiVersion`, `kind` and `metadata` fields every object has
/// and the group, version and kind it describes, which is how clients
/// find it. (`metadata` is a plain object here: the real server refers to
/// the full `ObjectMeta` schema, which this server does not publish.)
fn custom_resource_schema(def: &ResourceDef, crd_schema: &Value) -> Value {
    let mut schema = crd_schema.clone();
    if !schema["properties"].is_object() {
        schema["properties"] = json!({});
    }
    let properties = &mut schema["properties"];
    properties["apiVersion"] = json!({
        "type": "string",
        "description": "The group and version of this object's schema (group/version).",
    });
    properties["kind"] = json!({
        "type": "string",
        "description": "The kind of this object, in CamelCase.",
    });
    properties["metadata"] = json!({
        "type": "object",
        "description": "The object's metadata: its name, namespace, labels and annotations, and what the server records of it.",
    });
    schema["x-kubernetes-group-version-kind"] =
        json!([{"group": def.group, "version": def.version, "kind": def.kind}]);
    schema
}

/// `/openapi/v3`: every served group version and where its document is.
pub fn root(reg: &Registry) -> Value {
    let mut gvs: Vec<(String, String)> = reg
        .all()
        .map(|d| (d.group.clone(), d.version.clone()))
        .collect();
    gvs.dedup();
    let mut paths = Map::new();
    for (g, v) in gvs {
        let Ok(doc) = group_version(reg, &g, &v) else {
            continue;
        };
        let path = group_version_path(&g, &v);
        paths.insert(
            path.clone(),
            json!({"serverRelativeURL": format!("/openapi/v3/{path}?hash={}", digest(&doc))}),
        );
    }
    json!({"paths": paths})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_served_kind_has_a_patch_path_taking_field_validation() {
        let reg = Registry::builtin();
        let r = root(&reg);
        assert!(
            r["paths"]["api/v1"]["serverRelativeURL"]
                .as_str()
                .is_some_and(|u| u.starts_with("/openapi/v3/api/v1?hash="))
        );
        let apps = group_version(&reg, "apps", "v1").expect("served");
        let patch =
            &apps["paths"]["/apis/apps/v1/namespaces/{namespace}/deployments/{name}"]["patch"];
        assert_eq!(
            patch["x-kubernetes-group-version-kind"],
            json!({"group": "apps", "version": "v1", "kind": "Deployment"})
        );
        assert!(
            patch["parameters"]
                .as_array()
                .expect("parameters")
                .iter()
                .any(|p| p["name"] == "fieldValidation" && p["in"] == "query")
        );
        assert_eq!(
            apps["components"]["schemas"],
            json!({}),
            "built-in kinds publish no schema"
        );
        let core = group_version(&reg, "", "v1").expect("served");
        assert!(core["paths"]["/api/v1/nodes/{name}"]["patch"].is_object());
        assert_eq!(
            group_version(&reg, "nope", "v1")
                .expect_err("not served")
                .http_code(),
            404
        );
    }

    #[test]
    fn a_custom_resource_publishes_its_crd_schema_under_its_kind() {
        let mut reg = Registry::builtin();
        reg.apply_crd(&json!({
            "metadata": {"name": "widgets.shop.example.com"},
            "spec": {"group": "shop.example.com", "scope": "Namespaced",
                "names": {"kind": "Widget", "plural": "widgets"},
                "versions": [{"name": "v1", "served": true, "storage": true,
                    "schema": {"openAPIV3Schema": {"type": "object", "properties": {
                        "spec": {"type": "object", "description": "What the widget is."}}}}}]}
        }))
        .expect("a valid CRD");
        let doc = group_version(&reg, "shop.example.com", "v1").expect("served");
        let schema = &doc["components"]["schemas"]["com.example.shop.v1.Widget"];
        assert_eq!(
            schema["x-kubernetes-group-version-kind"],
            json!([{"group": "shop.example.com", "version": "v1", "kind": "Widget"}])
        );
        assert_eq!(
            schema["properties"]["spec"]["description"],
            "What the widget is."
        );
        for field in ["apiVersion", "kind", "metadata"] {
            assert!(
                schema["properties"][field]["type"].is_string(),
                "{field}: {schema}"
            );
        }
    }
}
