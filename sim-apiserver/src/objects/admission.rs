//! Admission webhooks: the registered Mutating/ValidatingWebhookConfigurations
//! are called over HTTPS with an `admission.k8s.io/v1` AdmissionReview,
//! verifying the server against the configuration's `caBundle`.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use serde_json::{Value, json};

use crate::Shared;
use crate::cel;
use crate::error::{ApiError, Reason};
use crate::objects::WriteCtx;
use crate::objects::webhook_client::Endpoint;
use crate::registry::{ResourceDef, ResourceId};
use crate::selectors::LabelSelector;
use crate::util::{base64_decode, meta_str};

/// The operation being admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    /// CREATE.
    Create,
    /// UPDATE.
    Update,
    /// DELETE.
    Delete,
}

impl Operation {
    fn as_str(self) -> &'static str {
        match self {
            Operation::Create => "CREATE",
            Operation::Update => "UPDATE",
            Operation::Delete => "DELETE",
        }
    }
}

/// Where to send a review.
struct Target {
    /// Host to connect to (IP or name), and port.
    connect: String,
    /// Name the server certificate must carry.
    server_name: String,
    /// Request path and query.
    path: String,
    /// Shown in error messages.
    display_url: String,
}

fn resolve(sh: &Shared, client_config: &Value) -> Result<Target, String> {
    if let Some(url) = client_config.get("url").and_then(Value::as_str) {
        let rest = url
            .strip_prefix("https://")
            .ok_or_else(|| format!("webhook url {url} must use https"))?;
        let (hostport, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, "/"),
        };
        let (host, port) = match hostport.rsplit_once(':') {
            Some((h, p)) if !h.ends_with(']') || hostport.starts_with('[') => (
                h,
                p.parse::<u16>()
                    .map_err(|_| format!("bad port in webhook url {url}"))?,
            ),
            _ => (hostport, 443),
        };
        let host = host.trim_start_matches('[').trim_end_matches(']');
        return Ok(Target {
            connect: if host.contains(':') {
                format!("[{host}]:{port}")
            } else {
                format!("{host}:{port}")
            },
            server_name: host.to_string(),
            path: path.to_string(),
            display_url: url.to_string(),
        });
    }
    if let Some(svc) = client_config.get("service") {
        let ns = svc
            .get("namespace")
            .and_then(Value::as_str)
            .unwrap_or_default();
        let name = svc.get("name").and_then(Value::as_str).unwrap_or_default();
        let path = svc.get("path").and_then(Value::as_str).unwrap_or("/");
        let port = svc.get("port").and_then(Value::as_u64).unwrap_or(443);
        let addr = sh
            .config
            .service_addresses
            .get(&format!("{ns}/{name}"))
            .ok_or_else(|| {
                format!(
                    "service \"{ns}/{name}\" has no address configured in the simulated API server"
                )
            })?;
        return Ok(Target {
            connect: addr.to_string(),
            server_name: format!("{name}.{ns}.svc"),
            path: path.to_string(),
            display_url: format!("https://{name}.{ns}.svc:{port}{path}"),
        });
    }
    Err("webhook clientConfig has neither url nor service".into())
}

fn list_contains(list: Option<&Value>, want: &str) -> bool {
    list.and_then(Value::as_array)
        .is_some_and(|a| a.iter().any(|x| x == "*" || x == want))
}

fn rule_matches(rule: &Value, def: &ResourceDef, op: Operation, sub: &str) -> bool {
    if !list_contains(rule.get("operations"), op.as_str()) {
        return false;
    }
    if !list_contains(rule.get("apiGroups"), &def.group)
        || !list_contains(rule.get("apiVersions"), &def.version)
    {
        return false;
    }
    let scope = rule.get("scope").and_then(Value::as_str).unwrap_or("*");
    if (scope == "Namespaced" && !def.namespaced) || (scope == "Cluster" && def.namespaced) {
        return false;
    }
    let wanted = if sub.is_empty() {
        def.plural.clone()
    } else {
        format!("{}/{sub}", def.plural)
    };
    rule.get("resources")
        .and_then(Value::as_array)
        .is_some_and(|rs| {
            rs.iter().filter_map(Value::as_str).any(|r| {
                r == wanted
                    || r == "*/*"
                    || (r == "*" && sub.is_empty())
                    || (sub.is_empty() && r == def.plural)
                    || r.strip_suffix("/*")
                        .is_some_and(|p| p == def.plural && !sub.is_empty())
                    || r.strip_prefix("*/").is_some_and(|s| s == sub)
            })
        })
}

fn labels_match(selector: Option<&Value>, labels: Option<&Value>) -> Result<bool, String> {
    let sel = LabelSelector::from_object(selector)?;
    Ok(sel.matches_labels(labels))
}

/// Runs the mutating webhooks, applying their patches to `obj`; returns
/// whether any of them changed it.
pub async fn mutate(
    sh: &Arc<Shared>,
    def: &ResourceDef,
    op: Operation,
    sub: &str,
    obj: &mut Value,
    old: Option<&Value>,
    ctx: &WriteCtx,
) -> Result<bool, ApiError> {
    run(
        sh,
        "mutatingwebhookconfigurations",
        def,
        op,
        sub,
        obj,
        old,
        ctx,
    )
    .await
}

/// Runs the validating webhooks.
pub async fn validate(
    sh: &Arc<Shared>,
    def: &ResourceDef,
    op: Operation,
    sub: &str,
    obj: &mut Value,
    old: Option<&Value>,
    ctx: &WriteCtx,
) -> Result<(), ApiError> {
    run(
        sh,
        "validatingwebhookconfigurations",
        def,
        op,
        sub,
        obj,
        old,
        ctx,
    )
    .await
    .map(|_| ())
}

/// Which registered webhooks have been called during one admission, for
/// `reinvocationPolicy: IfNeeded` as the real server tracks it: a webhook
/// that asked for reinvocation is called once more when a webhook after it
/// changed the object; at most one extra pass is made.
#[derive(Default)]
struct Reinvocation {
    /// IfNeeded webhooks called since the last change by another webhook.
    invoked_since_change: HashSet<usize>,
    /// Webhooks the extra pass calls again.
    again: HashSet<usize>,
    /// Whether any webhook changed the object.
    changed: bool,
}

impl Reinvocation {
    fn record(&mut self, index: usize, if_needed: bool, changed: bool) {
        // A webhook's own change never asks for itself to be called again.
        if changed {
            self.again.extend(self.invoked_since_change.drain());
            self.changed = true;
        }
        if if_needed {
            self.invoked_since_change.insert(index);
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn run(
    sh: &Arc<Shared>,
    plural: &str,
    def: &ResourceDef,
    op: Operation,
    sub: &str,
    obj: &mut Value,
    old: Option<&Value>,
    ctx: &WriteCtx,
) -> Result<bool, ApiError> {
    if def.group == "admissionregistration.k8s.io" {
        return Ok(false);
    }
    let mutating = plural.starts_with("mutating");
    let (hooks, ns_labels) = {
        let st = sh.lock();
        let id = ResourceId::new("admissionregistration.k8s.io", plural);
        let mut hooks = Vec::new();
        for (_, cfg) in st.list(&id, None, None) {
            for h in cfg
                .get("webhooks")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                if h.get("rules")
                    .and_then(Value::as_array)
                    .is_some_and(|rs| rs.iter().any(|r| rule_matches(r, def, op, sub)))
                {
                    hooks.push(h.clone());
                }
            }
        }
        if hooks.is_empty() {
            return Ok(false);
        }
        let ns = meta_str(obj, "namespace").or_else(|| old.and_then(|o| meta_str(o, "namespace")));
        let ns_labels = if def.group.is_empty() && def.plural == "namespaces" {
            None
        } else {
            ns.and_then(|n| st.get(&ResourceId::new("", "namespaces"), "", n))
                .and_then(|n| n.pointer("/metadata/labels").cloned())
        };
        (hooks, ns_labels)
    };
    let mut reinvocation = Reinvocation::default();
    for (i, hook) in hooks.iter().enumerate() {
        if let Some(changed) = call_hook(
            sh,
            hook,
            mutating,
            def,
            op,
            sub,
            obj,
            old,
            ns_labels.as_ref(),
            ctx,
        )
        .await?
        {
            let if_needed =
                hook.get("reinvocationPolicy").and_then(Value::as_str) == Some("IfNeeded");
            reinvocation.record(i, mutating && if_needed, changed);
        }
    }
    if !mutating || !reinvocation.changed || reinvocation.again.is_empty() {
        return Ok(reinvocation.changed);
    }
    // The extra pass: only webhooks asked for again, still matching, in order;
    // one changing the object here asks for those called before it in this
    // pass too (the real server keeps no third pass).
    for (i, hook) in hooks.iter().enumerate() {
        if !reinvocation.again.contains(&i) {
            continue;
        }
        if let Some(changed) = call_hook(
            sh,
            hook,
            true,
            def,
            op,
            sub,
            obj,
            old,
            ns_labels.as_ref(),
            ctx,
        )
        .await?
        {
            let if_needed =
                hook.get("reinvocationPolicy").and_then(Value::as_str) == Some("IfNeeded");
            reinvocation.record(i, if_needed, changed);
        }
    }
    Ok(reinvocation.changed)
}

/// Calls one webhook whose rules match, if its selectors do too. Returns
/// None when it was not called, else whether it changed the object (a call
/// that failed under `failurePolicy: Ignore` changed nothing).
#[allow(clippy::too_many_arguments)]
async fn call_hook(
    sh: &Arc<Shared>,
    hook: &Value,
    mutating: bool,
    def: &ResourceDef,
    op: Operation,
    sub: &str,
    obj: &mut Value,
    old: Option<&Value>,
    ns_labels: Option<&Value>,
    ctx: &WriteCtx,
) -> Result<Option<bool>, ApiError> {
    let name = hook
        .get("name")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    let is_namespace = def.group.is_empty() && def.plural == "namespaces";
    if def.namespaced || is_namespace {
        let labels = if is_namespace {
            obj.pointer("/metadata/labels")
        } else {
            ns_labels
        };
        match labels_match(hook.get("namespaceSelector"), labels) {
            Ok(true) => {}
            Ok(false) => return Ok(None),
            Err(e) => {
                return Err(ApiError::internal(format!(
                    "webhook \"{name}\" has an invalid namespaceSelector: {e}"
                )));
            }
        }
    }
    let obj_labels = obj.pointer("/metadata/labels");
    let old_labels = old.and_then(|o| o.pointer("/metadata/labels"));
    let by_obj = labels_match(hook.get("objectSelector"), obj_labels).map_err(|e| {
        ApiError::internal(format!(
            "webhook \"{name}\" has an invalid objectSelector: {e}"
        ))
    })?;
    let by_old =
        old.is_some() && labels_match(hook.get("objectSelector"), old_labels).unwrap_or(false);
    if !(by_obj || by_old) {
        return Ok(None);
    }
    let fail_open = hook.get("failurePolicy").and_then(Value::as_str) == Some("Ignore");
    // The objects join the request only for a call: conditions read them
    // where they are, so a skipped webhook copies nothing.
    let object = if op == Operation::Delete {
        &Value::Null
    } else {
        &*obj
    };
    let old_object = old.unwrap_or(&Value::Null);
    let mut request = request_attributes(sh, def, op, sub, obj, ctx);
    match conditions_hold(hook, &request, object, old_object) {
        Ok(true) => {}
        Ok(false) => return Ok(None),
        Err(e) if fail_open => {
            tracing::warn!(webhook = %name, error = %e, "match condition failed; failurePolicy Ignore");
            return Ok(None);
        }
        Err(e) => {
            return Err(ApiError::internal(format!(
                "Internal error occurred: failed calling webhook \"{name}\": {e}"
            )));
        }
    }
    let side_effects = hook
        .get("sideEffects")
        .and_then(Value::as_str)
        .unwrap_or("Unknown");
    if ctx.dry_run && !matches!(side_effects, "None" | "NoneOnDryRun") {
        return Err(ApiError::bad_request(format!(
            "admission webhook \"{name}\" has side effects and does not support dry run"
        )));
    }
    let timeout = hook
        .get("timeoutSeconds")
        .and_then(Value::as_u64)
        .unwrap_or(10)
        .clamp(1, 30);
    request["object"] = object.clone();
    request["oldObject"] = old_object.clone();
    let review =
        json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request});
    let uid = review["request"]["uid"].clone();
    let response = match call(sh, hook, &review, timeout).await {
        Ok(r) => r,
        Err(e) if fail_open => {
            tracing::warn!(webhook = %name, error = %e, "webhook failed; failurePolicy Ignore");
            return Ok(Some(false));
        }
        Err(e) => {
            return Err(ApiError::internal(format!(
                "Internal error occurred: failed calling webhook \"{name}\": {e}"
            )));
        }
    };
    let resp = &response["response"];
    if resp.get("uid") != Some(&uid) {
        let e = format!(
            "expected response.uid={uid}, got {}",
            resp.get("uid").unwrap_or(&Value::Null)
        );
        if fail_open {
            return Ok(Some(false));
        }
        return Err(ApiError::internal(format!(
            "Internal error occurred: failed calling webhook \"{name}\": {e}"
        )));
    }
    if resp.get("allowed").and_then(Value::as_bool) != Some(true) {
        let status = resp.get("status");
        let code = status
            .and_then(|s| s.get("code"))
            .and_then(Value::as_u64)
            .filter(|c| *c >= 400)
            .unwrap_or(403) as u16;
        let message = match status
            .and_then(|s| s.get("message"))
            .and_then(Value::as_str)
            .filter(|m| !m.is_empty())
        {
            Some(m) => format!("admission webhook \"{name}\" denied the request: {m}"),
            None => {
                format!("admission webhook \"{name}\" denied the request without explanation")
            }
        };
        let reason = match code {
            400 => Reason::BadRequest,
            404 => Reason::NotFound,
            409 => Reason::Conflict,
            422 => Reason::Invalid,
            429 => Reason::TooManyRequests,
            500 => Reason::InternalError,
            _ => Reason::Forbidden,
        };
        return Err(ApiError {
            reason,
            message,
            details: None,
            code: Some(code),
        });
    }
    let Some(p) = resp.get("patch").and_then(Value::as_str) else {
        return Ok(Some(false));
    };
    if !mutating {
        return Err(ApiError::internal(format!(
            "Internal error occurred: validating webhook \"{name}\" returned a patch"
        )));
    }
    if resp.get("patchType").and_then(Value::as_str) != Some("JSONPatch") {
        return Err(ApiError::internal(format!(
            "Internal error occurred: webhook \"{name}\" returned an unsupported patchType {}",
            resp.get("patchType").unwrap_or(&Value::Null)
        )));
    }
    let bytes = base64_decode(p).map_err(|e| {
        ApiError::internal(format!(
            "Internal error occurred: webhook \"{name}\" returned a patch that is not base64: {e}"
        ))
    })?;
    let ops: json_patch::Patch = serde_json::from_slice(&bytes).map_err(|e| {
        ApiError::internal(format!(
            "Internal error occurred: webhook \"{name}\" returned an invalid JSON patch: {e}"
        ))
    })?;
    if ops.0.is_empty() {
        return Ok(Some(false));
    }
    let before = obj.clone();
    json_patch::patch(obj, &ops).map_err(|e| {
        ApiError::internal(format!(
            "Internal error occurred: webhook \"{name}\" returned a patch that does not apply: {e}"
        ))
    })?;
    Ok(Some(*obj != before))
}

/// Whether every one of a webhook's `matchConditions` holds, with the
/// variables `object`, `oldObject` (null where the operation has none) and
/// `request` (the request's attributes): `false` as soon as one is false,
/// as the real server skips the webhook then; an error names the condition
/// that could not be evaluated when no condition is false.
fn conditions_hold(
    hook: &Value,
    request: &Value,
    object: &Value,
    old_object: &Value,
) -> Result<bool, String> {
    let Some(conditions) = hook.get("matchConditions").and_then(Value::as_array) else {
        return Ok(true);
    };
    let vars: HashMap<&str, &Value> = [
        ("object", object),
        ("oldObject", old_object),
        ("request", request),
    ]
    .into();
    let mut error = None;
    for condition in conditions {
        let name = condition.get("name").and_then(Value::as_str).unwrap_or("");
        let expression = condition
            .get("expression")
            .and_then(Value::as_str)
            .unwrap_or("");
        let result = cel::parse(expression)
            .and_then(|e| cel::eval(&e, &vars))
            .and_then(|v| {
                v.as_bool()
                    .ok_or_else(|| "the expression did not evaluate to a bool".to_owned())
            });
        match result {
            Ok(false) => return Ok(false),
            Ok(true) => {}
            Err(e) => {
                error.get_or_insert(format!(
                    "failed to evaluate match condition \"{name}\": {e}"
                ));
            }
        }
    }
    error.map_or(Ok(true), Err)
}

/// The AdmissionRequest of a review without its `object` and `oldObject`:
/// what a webhook's conditions see as `request`, and what the review adds
/// the objects to.
fn request_attributes(
    sh: &Shared,
    def: &ResourceDef,
    op: Operation,
    sub: &str,
    obj: &Value,
    ctx: &WriteCtx,
) -> Value {
    let kind = json!({"group": def.group, "version": def.version, "kind": def.kind});
    let resource = json!({"group": def.group, "version": def.version, "resource": def.plural});
    let name = meta_str(obj, "name").unwrap_or_default();
    let mut groups = ctx.user.groups.clone();
    if !groups.iter().any(|g| g == "system:authenticated") {
        groups.push("system:authenticated".into());
    }
    let mut user_info =
        json!({"username": ctx.user.username, "uid": ctx.user.uid, "groups": groups});
    if !ctx.user.extra.is_empty() {
        user_info["extra"] = json!(ctx.user.extra);
    }
    let options_kind = match op {
        Operation::Create => "CreateOptions",
        Operation::Update => "UpdateOptions",
        Operation::Delete => "DeleteOptions",
    };
    let mut req = json!({
        "uid": sh.ids.uuid(),
        "kind": kind,
        "resource": resource,
        "requestKind": kind,
        "requestResource": resource,
        "name": name,
        "operation": op.as_str(),
        "userInfo": user_info,
        "dryRun": ctx.dry_run,
        "options": {"kind": options_kind, "apiVersion": "meta.k8s.io/v1"},
    });
    if def.namespaced {
        req["namespace"] = json!(meta_str(obj, "namespace").unwrap_or_default());
    }
    if !sub.is_empty() {
        req["subResource"] = json!(sub);
        req["requestSubResource"] = json!(sub);
    }
    req
}

async fn call(sh: &Shared, hook: &Value, review: &Value, timeout_s: u64) -> Result<Value, String> {
    let cc = hook.get("clientConfig").cloned().unwrap_or(Value::Null);
    let target = resolve(sh, &cc)?;
    let ca = cc
        .get("caBundle")
        .and_then(Value::as_str)
        .unwrap_or_default();
    if ca.is_empty() {
        return Err("failed to call webhook: clientConfig.caBundle is empty (the simulated API server has no other trust roots)".into());
    }
    let body = Bytes::from(serde_json::to_vec(review).map_err(|e| e.to_string())?);
    let sep = if target.path.contains('?') { '&' } else { '?' };
    let path = format!("{}{sep}timeout={timeout_s}s", target.path);
    let endpoint = Endpoint {
        connect: &target.connect,
        server_name: &target.server_name,
        ca_bundle: ca,
    };
    let fut = async {
        let (status, bytes) = sh.http_client.post(&endpoint, &path, body).await?;
        if !status.is_success() {
            return Err(format!(
                "received invalid webhook response: HTTP {status}: {}",
                String::from_utf8_lossy(&bytes)
            ));
        }
        serde_json::from_slice::<Value>(&bytes)
            .map_err(|e| format!("received invalid webhook response: {e}"))
    };
    let started = std::time::Instant::now();
    let result = tokio::time::timeout(Duration::from_secs(timeout_s), fut).await;
    sh.http_client.record(started.elapsed());
    match result {
        Ok(r) => r.map_err(|e| {
            format!(
                "failed to call webhook: Post \"{}\": {e}",
                target.display_url
            )
        }),
        Err(_) => Err(format!(
            "failed to call webhook: Post \"{}?timeout={timeout_s}s\": context deadline exceeded",
            target.display_url
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::Registry;

    #[test]
    fn reinvocation_asks_again_only_for_earlier_if_needed_webhooks() {
        let mut r = Reinvocation::default();
        r.record(0, true, true);
        assert!(r.again.is_empty(), "its own change does not count");
        r.record(1, false, false);
        r.record(2, true, false);
        assert!(r.again.is_empty());
        r.record(3, false, true);
        assert_eq!(r.again, HashSet::from([0, 2]));
        assert!(r.changed);
        let mut quiet = Reinvocation::default();
        quiet.record(0, true, false);
        quiet.record(1, true, false);
        assert!(!quiet.changed && quiet.again.is_empty());
    }

    #[test]
    fn rules_match_resources_and_subresources() {
        let reg = Registry::builtin();
        let pods = reg.get("", "v1", "pods").expect("pods");
        let rule = json!({"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"], "resources": ["pods"]});
        assert!(rule_matches(&rule, pods, Operation::Create, ""));
        assert!(!rule_matches(&rule, pods, Operation::Update, ""));
        assert!(!rule_matches(&rule, pods, Operation::Create, "status"));
        let all = json!({"operations": ["*"], "apiGroups": ["*"], "apiVersions": ["*"], "resources": ["*/*"]});
        assert!(rule_matches(&all, pods, Operation::Update, "status"));
        let cluster = json!({"operations": ["*"], "apiGroups": ["*"], "apiVersions": ["*"], "resources": ["*"], "scope": "Cluster"});
        assert!(!rule_matches(&cluster, pods, Operation::Create, ""));
    }
}
