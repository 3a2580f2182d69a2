//! Create, update, patch and delete with the real server's object semantics:
//! metadata defaults, optimistic concurrency, status subresources,
//! generation, finalizers, pod grace periods, namespaces and CRDs.

use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};

pub mod admission;
pub mod apply;
pub mod context;
pub mod events;
pub mod gc;
pub mod patch;
pub mod pods;
pub mod schema;
pub mod webhook_client;

use crate::error::{ApiError, FieldCause, Reason, success_status};
pub use crate::fields::FieldValidation;
use crate::registry::{ResourceDef, ResourceId};
use crate::util::{finalizers, meta_mut, meta_str, now_rfc3339, parse_ts};
use crate::{Shared, fields};
use admission::Operation;
pub use context::WriteCtx;
use patch::PatchType;

/// Drops the fields of a request body its type does not declare; under
/// `fieldValidation=Strict` refuses it (400, as the real decoder does),
/// under `Warn` adds one warning per field.
fn check_fields(def: &ResourceDef, obj: &mut Value, ctx: &WriteCtx) -> Result<(), ApiError> {
    if let Some(e) = fields::type_error(def, obj) {
        return Err(ApiError::bad_request(format!(
            "{} in version \"{}\" cannot be handled as a {}: {e}",
            def.kind, def.version, def.kind
        )));
    }
    let unknown = fields::prune_unknown(def, obj);
    if unknown.is_empty() {
        return Ok(());
    }
    match ctx.validation {
        FieldValidation::Ignore => Ok(()),
        FieldValidation::Warn => {
            for f in unknown {
                ctx.warnings.push(format!("unknown field \"{f}\""));
            }
            Ok(())
        }
        FieldValidation::Strict => Err(ApiError::bad_request(format!(
            "{} in version \"{}\" cannot be handled as a {}: strict decoding error: {}",
            def.kind,
            def.version,
            def.kind,
            unknown
                .iter()
                .map(|f| format!("unknown field \"{f}\""))
                .collect::<Vec<_>>()
                .join(", ")
        ))),
    }
}

/// Which part of an object a write addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// The main resource.
    Main,
    /// The `/status` subresource.
    Status,
}

/// The body of an update.
#[derive(Debug, Clone)]
pub enum Change {
    /// PUT with a full object.
    Replace(Value),
    /// PATCH.
    Patch(PatchType, bytes::Bytes),
    /// Server-side apply of a parsed configuration (see [`apply()`]).
    Apply(Value),
}

/// Options of a delete.
#[derive(Debug, Clone, Default)]
pub struct DeleteOpts {
    /// `gracePeriodSeconds`.
    pub grace: Option<i64>,
    /// `propagationPolicy`.
    pub propagation: Option<String>,
    /// `preconditions.uid`.
    pub uid: Option<String>,
    /// `preconditions.resourceVersion`.
    pub resource_version: Option<String>,
}

/// What a delete answered.
#[derive(Debug, Clone)]
pub struct Deleted {
    /// 200 (gone) or 202 (pending: grace period or finalizers).
    pub code: u16,
    /// The body.
    pub body: Value,
}

const MAX_ATTEMPTS: usize = 16;

fn name_error(name: &str) -> Option<String> {
    let ok = !name.is_empty()
        && name.len() <= 253
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.')
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name.ends_with(|c: char| c.is_ascii_alphanumeric());
    if ok {
        None
    } else {
        Some("a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')".into())
    }
}

/// Checks `apiVersion`/`kind` of a body against the resource.
fn check_type(def: &ResourceDef, obj: &mut Value) -> Result<(), ApiError> {
    let Some(map) = obj.as_object_mut() else {
        return Err(ApiError::bad_request(
            "the body of the request must be a JSON object",
        ));
    };
    let expected_av = def.api_version();
    match map.get("apiVersion").and_then(Value::as_str) {
        Some(av) if av != expected_av => {
            return Err(ApiError::bad_request(format!(
                "the API version in the data ({av}) does not match the expected API version ({expected_av})"
            )));
        }
        _ => {}
    }
    match map.get("kind").and_then(Value::as_str) {
        Some(k) if k != def.kind => {
            return Err(ApiError::bad_request(format!(
                "the kind in the data ({k}) does not match the expected kind ({})",
                def.kind
            )));
        }
        _ => {}
    }
    map.insert("apiVersion".into(), json!(expected_av));
    map.insert("kind".into(), json!(def.kind));
    Ok(())
}

fn namespace_missing(ns: &str) -> ApiError {
    ApiError::not_found("", "namespaces", ns)
}

/// Creates the built-in namespaces at start.
pub fn bootstrap_namespace(sh: &Shared, name: &str) {
    let obj = json!({
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {
            "name": name,
            "uid": sh.ids.uuid(),
            "creationTimestamp": now_rfc3339(),
            "labels": {"kubernetes.io/metadata.name": name},
        },
        "spec": {"finalizers": ["kubernetes"]},
        "status": {"phase": "Active"},
    });
    sh.lock()
        .put(&ResourceId::new("", "namespaces"), "", name, obj);
}

/// Writes an object as given, for tests and the simulator.
pub fn admin_put(
    sh: &Shared,
    group: &str,
    plural: &str,
    mut obj: Value,
) -> Result<Value, ApiError> {
    let name = meta_str(&obj, "name")
        .ok_or_else(|| ApiError::bad_request("metadata.name: Required value"))?
        .to_string();
    let ns = meta_str(&obj, "namespace").unwrap_or_default().to_string();
    let mut st = sh.lock();
    let id = ResourceId::new(group, plural);
    let existing = st.get(&id, &ns, &name);
    let meta = meta_mut(&mut obj);
    if !meta.contains_key("uid") {
        let uid = existing
            .as_ref()
            .and_then(|e| meta_str(e, "uid").map(str::to_string))
            .unwrap_or_else(|| sh.ids.uuid());
        meta.insert("uid".into(), json!(uid));
    }
    if !meta.contains_key("creationTimestamp") {
        meta.insert("creationTimestamp".into(), json!(now_rfc3339()));
    }
    Ok((*st.put(&id, &ns, &name, obj)).clone())
}

/// Defaults the real server applies on create, per kind.
/// A new Service's defaults as the real server sets them: type ClusterIP,
/// no session affinity, a cluster IP (unless headless or ExternalName)
/// with its single-stack IPv4 family, TCP ports targeting themselves, an
/// empty load-balancer status.
fn service_defaults(sh: &Shared, obj: &mut Value) {
    let spec = &mut obj["spec"];
    if !spec.is_object() {
        *spec = json!({});
    }
    for (k, v) in [("type", "ClusterIP"), ("sessionAffinity", "None")] {
        if spec.get(k).is_none() {
            spec[k] = json!(v);
        }
    }
    if spec["type"] != "ExternalName" {
        let ip = match spec.get("clusterIP").and_then(Value::as_str) {
            Some(ip) if !ip.is_empty() => ip.to_owned(),
            _ => sh.next_cluster_ip(),
        };
        spec["clusterIP"] = json!(ip);
        if spec.get("clusterIPs").is_none() {
            spec["clusterIPs"] = json!([ip]);
        }
        for (k, v) in [
            ("ipFamilies", json!(["IPv4"])),
            ("ipFamilyPolicy", json!("SingleStack")),
            ("internalTrafficPolicy", json!("Cluster")),
        ] {
            if spec.get(k).is_none() {
                spec[k] = v;
            }
        }
    }
    if let Some(ports) = spec.get_mut("ports").and_then(Value::as_array_mut) {
        for port in ports {
            if port.get("protocol").is_none() {
                port["protocol"] = json!("TCP");
            }
            if port.get("targetPort").is_none() {
                port["targetPort"] = port["port"].clone();
            }
        }
    }
    obj["status"] = json!({"loadBalancer": {}});
}

fn defaults_on_create(sh: &Shared, def: &ResourceDef, obj: &mut Value) -> Result<(), ApiError> {
    match (def.group.as_str(), def.plural.as_str()) {
        ("", "pods") => pods::prepare_create(obj),
        ("", "namespaces") => {
            let name = meta_str(obj, "name").unwrap_or_default().to_string();
            meta_mut(obj)
                .entry("labels")
                .or_insert_with(|| json!({}))
                .as_object_mut()
                .map(|l| l.insert("kubernetes.io/metadata.name".into(), json!(name)));
            obj["spec"] = json!({"finalizers": ["kubernetes"]});
            obj["status"] = json!({"phase": "Active"});
        }
        ("", "secrets") => {
            if let Some(string_data) = obj.get("stringData").cloned() {
                if let Some(map) = string_data.as_object() {
                    for (k, v) in map {
                        let s = v.as_str().unwrap_or_default();
                        obj["data"][k] = json!(crate::util::base64_encode(s.as_bytes()));
                    }
                }
                if let Some(o) = obj.as_object_mut() {
                    o.remove("stringData");
                }
            }
            if obj.get("type").is_none() {
                obj["type"] = json!("Opaque");
            }
        }
        ("", "services") => service_defaults(sh, obj),
        ("apiextensions.k8s.io", "customresourcedefinitions") => {
            let defs = crate::registry::defs_from_crd(obj).map_err(|m| {
                ApiError::invalid(
                    &def.group,
                    &def.kind,
                    meta_str(obj, "name").unwrap_or_default(),
                    vec![FieldCause::forbidden("spec", m)],
                )
            })?;
            let name = meta_str(obj, "name").unwrap_or_default().to_string();
            if let Some(d) = defs.first() {
                let want = format!("{}.{}", d.plural, d.group);
                if name != want {
                    return Err(ApiError::invalid(
                        &def.group,
                        &def.kind,
                        &name,
                        vec![FieldCause::invalid(
                            "metadata.name",
                            &json!(name),
                            "must be spec.names.plural+\".\"+spec.group",
                        )],
                    ));
                }
            }
            let names = obj["spec"]["names"].clone();
            let mut accepted = names.clone();
            if accepted.get("singular").is_none()
                && let Some(k) = names.get("kind").and_then(Value::as_str)
            {
                accepted["singular"] = json!(k.to_lowercase());
            }
            if accepted.get("listKind").is_none()
                && let Some(k) = names.get("kind").and_then(Value::as_str)
            {
                accepted["listKind"] = json!(format!("{k}List"));
            }
            let now = now_rfc3339();
            obj["status"] = json!({
                "acceptedNames": accepted,
                "storedVersions": defs.iter().filter(|d| d.storage).map(|d| d.version.clone()).collect::<Vec<_>>(),
                "conditions": [
                    {"type": "NamesAccepted", "status": "True", "reason": "NoConflicts", "message": "no conflicts found", "lastTransitionTime": now},
                    {"type": "Established", "status": "True", "reason": "InitialNamesAccepted", "message": "the initial names have been accepted", "lastTransitionTime": now},
                ],
            });
        }
        _ => {}
    }
    let _ = sh;
    Ok(())
}

/// Validation beyond admission: CR schemas and the pod rules. When
/// mutating webhooks changed the object, fields they added that the type
/// does not declare are dropped silently, as the real server's decoding of
/// a patched object does.
fn validate(
    def: &ResourceDef,
    obj: &mut Value,
    old: Option<&Value>,
    part: Part,
    mutated: bool,
) -> Result<(), ApiError> {
    let name = meta_str(obj, "name").unwrap_or_default().to_string();
    let mut causes = Vec::new();
    if mutated {
        fields::prune_unknown(def, obj);
    }
    if let Some(s) = &def.schema {
        causes.extend(schema::validate_object(s, obj));
    }
    if def.group.is_empty() && def.plural == "pods" && part == Part::Main {
        match old {
            None => causes.extend(pods::validate_create(obj)),
            Some(old) => causes.extend(pods::validate_update(old, obj)),
        }
    }
    if old.is_some()
        && let Some(old) = old
        && old["metadata"].get("deletionTimestamp").is_some()
    {
        let before = finalizers(old);
        if finalizers(obj).iter().any(|f| !before.contains(f)) {
            causes.push(FieldCause::forbidden(
                "metadata.finalizers",
                "no new finalizers can be added if the object is being deleted",
            ));
        }
    }
    if causes.is_empty() {
        Ok(())
    } else {
        Err(ApiError::invalid(&def.group, &def.kind, &name, causes))
    }
}

/// Runs mutating admission, validation and validating admission.
async fn admit(
    sh: &Arc<Shared>,
    def: &ResourceDef,
    op: Operation,
    part: Part,
    obj: &mut Value,
    old: Option<&Value>,
    ctx: &WriteCtx,
) -> Result<(), ApiError> {
    let sub = if part == Part::Status { "status" } else { "" };
    let mutated = admission::mutate(sh, def, op, sub, obj, old, ctx).await?;
    if mutated
        && part == Part::Status
        && def.custom
        && let Some(old) = old
    {
        // A custom resource's status strategy runs after mutating
        // admission on the real server and keeps only the status of what
        // the webhooks returned: a webhook on `/status` cannot change spec
        // or metadata, and validating webhooks see what will be stored.
        *obj = merge_update(def, Part::Status, old, obj.clone());
    }
    validate(def, obj, old, part, mutated)?;
    admission::validate(sh, def, op, sub, obj, old, ctx).await
}

/// POST: creates an object, recording its creator's fields.
pub async fn create(
    sh: &Arc<Shared>,
    def: &ResourceDef,
    ns: &str,
    obj: Value,
    ctx: &WriteCtx,
) -> Result<Arc<Value>, ApiError> {
    create_with(sh, def, ns, obj, ctx, None).await
}

/// Creates an object; with `applier`, it is the configuration that manager
/// applies, and its `Apply` entry is the object's only managed fields.
async fn create_with(
    sh: &Arc<Shared>,
    def: &ResourceDef,
    ns: &str,
    mut obj: Value,
    ctx: &WriteCtx,
    applier: Option<&str>,
) -> Result<Arc<Value>, ApiError> {
    check_type(def, &mut obj)?;
    check_fields(def, &mut obj, ctx)?;
    let meta = meta_mut(&mut obj);
    if def.namespaced {
        match meta.get("namespace").and_then(Value::as_str) {
            Some(n) if !n.is_empty() && n != ns => {
                return Err(ApiError::bad_request(
                    "the namespace of the provided object does not match the namespace sent on the request",
                ));
            }
            _ => {
                meta.insert("namespace".into(), json!(ns));
            }
        }
    } else {
        meta.remove("namespace");
    }
    if meta
        .get("resourceVersion")
        .and_then(Value::as_str)
        .is_some_and(|s| !s.is_empty())
    {
        return Err(ApiError::bad_request(
            "resourceVersion should not be set on objects to be created",
        ));
    }
    let name = match meta.get("name").and_then(Value::as_str) {
        Some(n) if !n.is_empty() => n.to_string(),
        _ => match meta.get("generateName").and_then(Value::as_str) {
            Some(prefix) if !prefix.is_empty() => format!("{prefix}{}", sh.ids.name_suffix()),
            _ => {
                return Err(ApiError::invalid(
                    &def.group,
                    &def.kind,
                    "",
                    vec![FieldCause::required(
                        "metadata.name",
                        "name or generateName is required",
                    )],
                ));
            }
        },
    };
    if let Some(why) = name_error(&name) {
        return Err(ApiError::invalid(
            &def.group,
            &def.kind,
            &name,
            vec![FieldCause::invalid("metadata.name", &json!(name), why)],
        ));
    }
    meta.insert("name".into(), json!(name));
    meta.insert("uid".into(), json!(sh.ids.uuid()));
    meta.insert("creationTimestamp".into(), json!(now_rfc3339()));
    meta.insert("generation".into(), json!(1));
    meta.remove("deletionTimestamp");
    meta.remove("deletionGracePeriodSeconds");
    meta.remove("resourceVersion");
    if def.status_subresource
        && def.custom
        && let Some(o) = obj.as_object_mut()
    {
        o.remove("status");
    }
    if def.namespaced
        && sh
            .lock()
            .get(&ResourceId::new("", "namespaces"), "", ns)
            .is_none()
    {
        return Err(namespace_missing(ns));
    }
    if let Some(manager) = applier {
        obj = apply::apply(def, Part::Main, None, obj, manager, ctx.force)?;
    }
    defaults_on_create(sh, def, &mut obj)?;
    if applier.is_none() {
        apply::record_update(def, Part::Main, None, &mut obj, ctx.manager());
    }
    admit(sh, def, Operation::Create, Part::Main, &mut obj, None, ctx).await?;
    let id = def.id();
    let mut st = sh.lock();
    if def.namespaced {
        match st.get(&ResourceId::new("", "namespaces"), "", ns) {
            None => return Err(namespace_missing(ns)),
            Some(n) if n["metadata"].get("deletionTimestamp").is_some() => {
                return Err(ApiError::new(
                    Reason::Forbidden,
                    format!(
                        "{} \"{name}\" is forbidden: unable to create new content in namespace {ns} because it is being terminated",
                        crate::error::qualified(&def.group, &def.plural)
                    ),
                ));
            }
            Some(_) => {}
        }
    }
    if st.get(&id, ns_key(def, ns), &name).is_some() {
        return Err(ApiError::already_exists(&def.group, &def.plural, &name));
    }
    if ctx.dry_run {
        return Ok(Arc::new(obj));
    }
    if id.group == "apiextensions.k8s.io" && id.plural == "customresourcedefinitions" {
        st.registry.apply_crd(&obj).map_err(ApiError::bad_request)?;
    }
    let stored = st.put(&id, ns_key(def, ns), &name, obj);
    if crate::objects::events::is_new_events(&id) {
        crate::objects::events::mirror(&mut st, ns, &name, Some(&stored));
    }
    Ok(stored)
}

fn ns_key<'a>(def: &ResourceDef, ns: &'a str) -> &'a str {
    if def.namespaced { ns } else { "" }
}

/// Whether anything but metadata, status and type information differs
/// (what bumps `generation`), compared without copying.
fn spec_changed(old: &Value, new: &Value) -> bool {
    const IGNORED: [&str; 4] = ["metadata", "status", "apiVersion", "kind"];
    let (Some(o), Some(n)) = (old.as_object(), new.as_object()) else {
        return old != new;
    };
    let differs = |a: &serde_json::Map<String, Value>, b: &serde_json::Map<String, Value>| {
        a.iter()
            .filter(|(k, _)| !IGNORED.contains(&k.as_str()))
            .any(|(k, v)| b.get(k) != Some(v))
    };
    differs(o, n) || differs(n, o)
}

/// Builds the object to store from the old one and the requested one.
fn merge_update(def: &ResourceDef, part: Part, old: &Value, requested: Value) -> Value {
    let mut new = match part {
        Part::Main => {
            let mut n = requested;
            if def.status_subresource {
                match old.get("status") {
                    Some(s) => n["status"] = s.clone(),
                    None => {
                        if let Some(o) = n.as_object_mut() {
                            o.remove("status");
                        }
                    }
                }
            }
            n
        }
        Part::Status => {
            let mut n = old.clone();
            match requested.get("status") {
                Some(s) => n["status"] = s.clone(),
                None => {
                    if let Some(o) = n.as_object_mut() {
                        o.remove("status");
                    }
                }
            }
            n
        }
    };
    let old_meta = old.get("metadata").cloned().unwrap_or_else(|| json!({}));
    let meta = meta_mut(&mut new);
    for key in [
        "uid",
        "creationTimestamp",
        "namespace",
        "name",
        "deletionTimestamp",
        "deletionGracePeriodSeconds",
        "generation",
        "generateName",
    ] {
        match old_meta.get(key) {
            Some(v) => {
                meta.insert(key.into(), v.clone());
            }
            None => {
                meta.remove(key);
            }
        }
    }
    if part == Part::Main && spec_changed(old, &new) {
        let g = old_meta
            .get("generation")
            .and_then(Value::as_i64)
            .unwrap_or(1);
        meta_mut(&mut new).insert("generation".into(), json!(g + 1));
    }
    if let Some(o) = new.as_object_mut() {
        o.insert("apiVersion".into(), json!(def.api_version()));
        o.insert("kind".into(), json!(def.kind));
    }
    new
}

fn rv_of(v: &Value) -> Option<&str> {
    meta_str(v, "resourceVersion").filter(|s| !s.is_empty())
}

/// Whether an object being deleted may now be removed for good.
fn ready_to_remove(def: &ResourceDef, obj: &Value) -> bool {
    let meta = &obj["metadata"];
    if meta.get("deletionTimestamp").is_none() || !finalizers(obj).is_empty() {
        return false;
    }
    if def.group.is_empty() && def.plural == "pods" {
        return meta
            .get("deletionGracePeriodSeconds")
            .and_then(Value::as_i64)
            .unwrap_or(0)
            == 0
            || deadline_passed(obj);
    }
    if def.group.is_empty() && def.plural == "namespaces" {
        return false;
    }
    true
}

fn already_deleting(obj: &Value) -> bool {
    obj["metadata"].get("deletionTimestamp").is_some()
}

fn deadline_passed(obj: &Value) -> bool {
    meta_str(obj, "deletionTimestamp")
        .and_then(parse_ts)
        .is_some_and(|t| t <= jiff::Timestamp::now())
}

/// PUT or PATCH of the main resource or its status.
#[allow(clippy::too_many_arguments)]
pub async fn update(
    sh: &Arc<Shared>,
    def: &ResourceDef,
    ns: &str,
    name: &str,
    part: Part,
    change: Change,
    ctx: &WriteCtx,
) -> Result<Arc<Value>, ApiError> {
    if part == Part::Status && !def.status_subresource {
        return Err(ApiError::not_found(
            &def.group,
            &format!("{}/status", def.plural),
            name,
        ));
    }
    if let Change::Patch(PatchType::Strategic, _) = change
        && def.custom
    {
        return Err(ApiError::new(
            Reason::UnsupportedMediaType,
            "the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml",
        ));
    }
    let id = def.id();
    let nsk = ns_key(def, ns);
    for _ in 0..MAX_ATTEMPTS {
        let old = sh
            .lock()
            .get(&id, nsk, name)
            .ok_or_else(|| ApiError::not_found(&def.group, &def.plural, name))?;
        let old_rv = rv_of(&old).unwrap_or_default().to_string();
        let mut requested = match &change {
            Change::Replace(body) => {
                let mut b = body.clone();
                check_type(def, &mut b)?;
                match meta_str(&b, "name") {
                    Some(n) if n != name => {
                        return Err(ApiError::bad_request(format!(
                            "the name of the object ({n}) does not match the name on the URL ({name})"
                        )));
                    }
                    _ => {}
                }
                if def.namespaced
                    && let Some(n) = meta_str(&b, "namespace").filter(|n| !n.is_empty())
                    && n != ns
                {
                    return Err(ApiError::bad_request(
                        "the namespace of the provided object does not match the namespace sent on the request",
                    ));
                }
                b
            }
            Change::Patch(kind, body) => patch::apply(&old, *kind, body)?,
            Change::Apply(config) => {
                let manager = ctx.field_manager.as_deref().unwrap_or_default();
                apply::apply(def, part, Some(&old), config.clone(), manager, ctx.force)?
            }
        };
        if !requested.is_object() {
            return Err(ApiError::bad_request(
                "the patched object must be a JSON object",
            ));
        }
        check_fields(def, &mut requested, ctx)?;
        let explicit = match &change {
            Change::Replace(_) => true,
            Change::Patch(_, body) => body.windows(17).any(|w| w == b"\"resourceVersion\""),
            Change::Apply(config) => rv_of(config).is_some(),
        };
        let precondition = rv_of(&requested).filter(|_| explicit).map(str::to_string);
        if let Some(p) = &precondition
            && *p != old_rv
        {
            return Err(ApiError::conflict(
                &def.group,
                &def.plural,
                name,
                "the object has been modified; please apply your changes to the latest version and try again",
            ));
        }
        meta_mut(&mut requested).insert("resourceVersion".into(), json!(old_rv));
        let applied = match &change {
            Change::Apply(_) => Some(requested["metadata"].get("managedFields").cloned()),
            _ => None,
        };
        let mut new = merge_update(def, part, &old, requested);
        match applied {
            Some(Some(managed)) => {
                meta_mut(&mut new).insert("managedFields".into(), managed);
            }
            Some(None) => {
                meta_mut(&mut new).remove("managedFields");
            }
            None => apply::record_update(def, part, Some(&old), &mut new, ctx.manager()),
        }
        if new == *old {
            return Ok(old);
        }
        admit(sh, def, Operation::Update, part, &mut new, Some(&old), ctx).await?;
        let mut st = sh.lock();
        let current = st
            .get(&id, nsk, name)
            .ok_or_else(|| ApiError::not_found(&def.group, &def.plural, name))?;
        if rv_of(&current).unwrap_or_default() != old_rv {
            if precondition.is_some() {
                return Err(ApiError::conflict(
                    &def.group,
                    &def.plural,
                    name,
                    "the object has been modified; please apply your changes to the latest version and try again",
                ));
            }
            continue;
        }
        if ctx.dry_run {
            return Ok(Arc::new(new));
        }
        if id.group == "apiextensions.k8s.io"
            && id.plural == "customresourcedefinitions"
            && part == Part::Main
        {
            st.registry.apply_crd(&new).map_err(ApiError::bad_request)?;
        }
        if ready_to_remove(def, &new) {
            let gone = st.remove(&id, nsk, name);
            if crate::objects::events::is_new_events(&id) {
                crate::objects::events::mirror(&mut st, nsk, name, None);
            }
            drop(st);
            after_removal(sh, def);
            return gone.ok_or_else(|| ApiError::not_found(&def.group, &def.plural, name));
        }
        let stored = st.put(&id, nsk, name, new);
        if crate::objects::events::is_new_events(&id) {
            crate::objects::events::mirror(&mut st, nsk, name, Some(&stored));
        }
        return Ok(stored);
    }
    Err(ApiError::conflict(
        &def.group,
        &def.plural,
        name,
        "too many concurrent writers; please retry",
    ))
}

/// PATCH with `application/apply-patch+yaml`: server-side apply of the
/// body (YAML or JSON) for the `fieldManager` of `ctx`, creating the
/// object when it is missing. Answers the object and whether it was
/// created.
pub async fn apply(
    sh: &Arc<Shared>,
    def: &ResourceDef,
    ns: &str,
    name: &str,
    part: Part,
    body: &[u8],
    ctx: &WriteCtx,
) -> Result<(Arc<Value>, bool), ApiError> {
    let Some(manager) = ctx.field_manager.as_deref() else {
        return Err(ApiError::invalid(
            "meta.k8s.io",
            "PatchOptions",
            "",
            vec![FieldCause::required(
                "fieldManager",
                "is required for apply patch",
            )],
        ));
    };
    let mut config = apply::parse_config(def, ns, name, body)?;
    check_fields(def, &mut config, ctx)?;
    let id = def.id();
    for _ in 0..MAX_ATTEMPTS {
        let exists = sh.lock().get(&id, ns_key(def, ns), name).is_some();
        if exists || part != Part::Main {
            match update(sh, def, ns, name, part, Change::Apply(config.clone()), ctx).await {
                Err(e) if e.reason == Reason::NotFound && part == Part::Main => continue,
                r => return r.map(|o| (o, false)),
            }
        }
        match create_with(sh, def, ns, config.clone(), ctx, Some(manager)).await {
            Err(e) if e.reason == Reason::AlreadyExists => continue,
            r => return r.map(|o| (o, true)),
        }
    }
    Err(ApiError::conflict(
        &def.group,
        &def.plural,
        name,
        "too many concurrent writers; please retry",
    ))
}

fn after_removal(sh: &Arc<Shared>, def: &ResourceDef) {
    if def.group == "apiextensions.k8s.io" && def.plural == "customresourcedefinitions" {
        // The GC sweep drops the CR objects and the registry entries.
    }
    sh.gc_wakeup.notify_one();
}

/// DELETE of one object.
pub async fn delete(
    sh: &Arc<Shared>,
    def: &ResourceDef,
    ns: &str,
    name: &str,
    opts: &DeleteOpts,
    ctx: &WriteCtx,
) -> Result<Deleted, ApiError> {
    let id = def.id();
    let nsk = ns_key(def, ns);
    if def.group.is_empty()
        && def.plural == "namespaces"
        && ["default", "kube-system", "kube-public"].contains(&name)
    {
        return Err(ApiError::new(
            Reason::Forbidden,
            format!("namespaces \"{name}\" is forbidden: this namespace may not be deleted"),
        ));
    }
    let old = sh
        .lock()
        .get(&id, nsk, name)
        .ok_or_else(|| ApiError::not_found(&def.group, &def.plural, name))?;
    admission::validate(
        sh,
        def,
        Operation::Delete,
        "",
        &mut (*old).clone(),
        Some(&old),
        ctx,
    )
    .await?;
    let mut st = sh.lock();
    let cur = st
        .get(&id, nsk, name)
        .ok_or_else(|| ApiError::not_found(&def.group, &def.plural, name))?;
    if let Some(uid) = &opts.uid
        && meta_str(&cur, "uid") != Some(uid.as_str())
    {
        return Err(ApiError::conflict(
            &def.group,
            &def.plural,
            name,
            &format!(
                "Precondition failed: UID in precondition: {uid}, UID in object meta: {}",
                meta_str(&cur, "uid").unwrap_or_default()
            ),
        ));
    }
    if let Some(rv) = &opts.resource_version
        && rv_of(&cur) != Some(rv.as_str())
    {
        return Err(ApiError::conflict(
            &def.group,
            &def.plural,
            name,
            &format!(
                "Precondition failed: ResourceVersion in precondition: {rv}, ResourceVersion in object meta: {}",
                rv_of(&cur).unwrap_or_default()
            ),
        ));
    }
    let is_pod = def.group.is_empty() && def.plural == "pods";
    let is_ns = def.group.is_empty() && def.plural == "namespaces";
    let grace = if is_pod {
        pods::grace_period(&cur, opts.grace)
    } else {
        0
    };
    let mut obj = (*cur).clone();
    if opts.propagation.as_deref() == Some("Foreground")
        && !already_deleting(&cur)
        && meta_str(&cur, "uid").is_some_and(|uid| crate::store::owners::has_dependents(&st, uid))
    {
        // Dependents go first; the GC sweep removes this finalizer after.
        let meta = meta_mut(&mut obj);
        let list = meta.entry("finalizers").or_insert_with(|| json!([]));
        if let Some(a) = list.as_array_mut() {
            a.push(json!(crate::store::owners::FOREGROUND));
        }
    }
    let has_finalizers = !finalizers(&obj).is_empty();
    let already = cur["metadata"].get("deletionTimestamp").is_some();
    if opts.propagation.as_deref() == Some("Orphan")
        && !ctx.dry_run
        && let Some(uid) = meta_str(&cur, "uid")
    {
        crate::store::owners::orphan_dependents(&mut st, uid);
    }
    if grace > 0 || has_finalizers || is_ns {
        let now = jiff::Timestamp::now();
        let deadline = now + jiff::SignedDuration::from_secs(grace);
        let shorten = match meta_str(&cur, "deletionTimestamp").and_then(parse_ts) {
            Some(t) => deadline < t,
            None => true,
        };
        if !already || shorten {
            let meta = meta_mut(&mut obj);
            meta.insert(
                "deletionTimestamp".into(),
                json!(crate::util::format_ts(deadline)),
            );
            meta.insert("deletionGracePeriodSeconds".into(), json!(grace));
            if !already {
                let g = meta.get("generation").and_then(Value::as_i64).unwrap_or(1);
                meta.insert("generation".into(), json!(g + 1));
            }
            if is_ns {
                obj["status"]["phase"] = json!("Terminating");
            }
        }
        if !(grace == 0 && !has_finalizers && !is_ns) {
            if ctx.dry_run {
                return Ok(Deleted {
                    code: 202,
                    body: obj,
                });
            }
            let stored = if obj == *cur {
                cur
            } else {
                st.put(&id, nsk, name, obj)
            };
            drop(st);
            if is_pod && grace > 0 {
                schedule_grace_expiry(
                    sh.clone(),
                    def.clone(),
                    ns.to_string(),
                    name.to_string(),
                    grace,
                );
            }
            // Namespaces and foreground deletions finish in the GC sweep.
            sh.gc_wakeup.notify_one();
            return Ok(Deleted {
                code: 202,
                body: (*stored).clone(),
            });
        }
    }
    if ctx.dry_run {
        return Ok(Deleted {
            code: 200,
            body: obj,
        });
    }
    let gone = st
        .remove(&id, nsk, name)
        .ok_or_else(|| ApiError::not_found(&def.group, &def.plural, name))?;
    if crate::objects::events::is_new_events(&id) {
        crate::objects::events::mirror(&mut st, nsk, name, None);
    }
    drop(st);
    after_removal(sh, def);
    let body = if is_pod || def.custom {
        (*gone).clone()
    } else {
        success_status(
            200,
            Some(
                json!({"name": name, "group": def.group, "kind": def.plural, "uid": meta_str(&gone, "uid")}),
            ),
        )
    };
    Ok(Deleted { code: 200, body })
}

fn schedule_grace_expiry(sh: Arc<Shared>, def: ResourceDef, ns: String, name: String, grace: i64) {
    let uid_wait = Duration::from_secs(grace.max(0) as u64) + Duration::from_millis(50);
    tokio::spawn(async move {
        tokio::select! {
            _ = tokio::time::sleep(uid_wait) => {}
            _ = sh.cancel.cancelled() => return,
        }
        let id = def.id();
        let mut st = sh.lock();
        if let Some(cur) = st.get(&id, &ns, &name)
            && deadline_passed(&cur)
            && finalizers(&cur).is_empty()
        {
            st.remove(&id, &ns, &name);
            drop(st);
            sh.gc_wakeup.notify_one();
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc1123_names_are_checked() {
        assert!(name_error("gpu-node-1.example").is_none());
        assert!(name_error("Bad_Name").is_some());
        assert!(name_error("-x").is_some());
        assert!(name_error("").is_some());
    }

    #[test]
    fn generation_bumps_only_on_spec_change() {
        let def = crate::registry::Registry::builtin()
            .get("", "v1", "configmaps")
            .cloned()
            .expect("builtin");
        let old =
            json!({"metadata": {"name": "a", "generation": 1, "uid": "u"}, "data": {"a": "1"}});
        let same = merge_update(
            &def,
            Part::Main,
            &old,
            json!({"metadata": {"name": "a", "labels": {"x": "y"}}, "data": {"a": "1"}}),
        );
        assert_eq!(same["metadata"]["generation"], 1);
        assert_eq!(same["metadata"]["uid"], "u");
        let changed = merge_update(
            &def,
            Part::Main,
            &old,
            json!({"metadata": {"name": "a"}, "data": {"a": "2"}}),
        );
        assert_eq!(changed["metadata"]["generation"], 2);
    }
}
