//! Pod specifics: create defaults, the update rules the real server
//! enforces, grace periods, `/binding` and PDB-guarded `/eviction`.

use std::collections::BTreeMap;

use serde_json::{Value, json};

use crate::error::{ApiError, FieldCause, Reason};
use crate::registry::ResourceId;
use crate::selectors::LabelSelector;
use crate::store::State;
use crate::util::{meta_mut, meta_str, now_rfc3339};

const STANDARD_RESOURCES: &[&str] = &["cpu", "memory", "ephemeral-storage", "storage"];

fn is_extended(resource: &str) -> bool {
    !STANDARD_RESOURCES.contains(&resource)
        && !resource.starts_with("hugepages-")
        && resource.contains('/')
        && !resource.starts_with("kubernetes.io/")
}

fn containers(spec: &Value) -> impl Iterator<Item = (&'static str, usize, &Value)> {
    ["containers", "initContainers"]
        .into_iter()
        .flat_map(move |field| {
            spec.get(field)
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .enumerate()
                .map(move |(i, c)| (field, i, c))
        })
}

fn qos_class(spec: &Value) -> &'static str {
    let mut any = false;
    let mut guaranteed = true;
    for (_, _, c) in containers(spec) {
        let req = c.get("resources").and_then(|r| r.get("requests"));
        let lim = c.get("resources").and_then(|r| r.get("limits"));
        for r in ["cpu", "memory"] {
            let rq = req
                .and_then(|m| m.get(r))
                .or_else(|| lim.and_then(|m| m.get(r)));
            let l = lim.and_then(|m| m.get(r));
            if rq.is_some() || l.is_some() {
                any = true;
            }
            if l.is_none() || rq != l {
                guaranteed = false;
            }
        }
    }
    if !any {
        "BestEffort"
    } else if guaranteed {
        "Guaranteed"
    } else {
        "Burstable"
    }
}

/// `Always` for an untagged or `:latest` image, else `IfNotPresent`, as the
/// real defaulting chooses.
fn default_pull_policy(image: &str) -> &'static str {
    let without_digest = image.split('@').next().unwrap_or(image);
    let last = without_digest.rsplit('/').next().unwrap_or(without_digest);
    match last.split_once(':') {
        Some((_, tag)) if tag != "latest" => "IfNotPresent",
        _ if image.contains('@') => "IfNotPresent",
        _ => "Always",
    }
}

/// The DefaultTolerationSeconds admission plugin: tolerate a not-ready or
/// unreachable node for 300 s, unless the pod already says otherwise.
fn add_default_tolerations(spec: &mut Value) {
    let mut list = spec
        .get("tolerations")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let has = |list: &[Value], key: &str| {
        list.iter().any(|t| {
            t.get("key").and_then(Value::as_str) == Some(key)
                || (t.get("key").is_none()
                    && t.get("operator").and_then(Value::as_str) == Some("Exists"))
        })
    };
    for key in [
        "node.kubernetes.io/not-ready",
        "node.kubernetes.io/unreachable",
    ] {
        if !has(&list, key) {
            list.push(json!({"key": key, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300}));
        }
    }
    spec["tolerations"] = Value::Array(list);
}

/// The ServiceAccount admission plugin's projected token volume
/// (`kube-api-access-<suffix>`); returns its name for the mounts. A pod
/// that already mounts the service-account path keeps its own.
fn add_token_volume(spec: &mut Value) -> String {
    const SUFFIX_CHARS: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    let seed = jiff::Timestamp::now().as_nanosecond().unsigned_abs();
    let suffix: String = (0..5)
        .map(|i| {
            let n = (seed >> (i * 5)) as usize % SUFFIX_CHARS.len();
            char::from(SUFFIX_CHARS[n])
        })
        .collect();
    let name = format!("kube-api-access-{suffix}");
    let volume = json!({"name": name, "projected": {"defaultMode": 420, "sources": [
        {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
        {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
        {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}]}},
    ]}});
    match spec.get_mut("volumes").and_then(Value::as_array_mut) {
        Some(list) => list.push(volume),
        None => spec["volumes"] = json!([volume]),
    }
    name
}

/// Mounts the token volume where clients look for it, unless the
/// container mounts something there already.
fn mount_token_volume(container: &mut Value, volume: &str) {
    const PATH: &str = "/var/run/secrets/kubernetes.io/serviceaccount";
    let mounts = container
        .get("volumeMounts")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    if mounts
        .iter()
        .any(|m| m.get("mountPath").and_then(Value::as_str) == Some(PATH))
    {
        return;
    }
    let mut mounts = mounts;
    mounts.push(json!({"name": volume, "readOnly": true, "mountPath": PATH}));
    container["volumeMounts"] = Value::Array(mounts);
}

/// Defaults and the initial status the real server gives a new pod.
pub fn prepare_create(pod: &mut Value) {
    let spec = &mut pod["spec"];
    if !spec.is_object() {
        *spec = json!({});
    }
    for (k, v) in [
        ("restartPolicy", json!("Always")),
        ("terminationGracePeriodSeconds", json!(30)),
        ("dnsPolicy", json!("ClusterFirst")),
        ("schedulerName", json!("default-scheduler")),
        ("priority", json!(0)),
        ("enableServiceLinks", json!(true)),
        ("securityContext", json!({})),
        ("preemptionPolicy", json!("PreemptLowerPriority")),
        // The ServiceAccount admission plugin: the namespace's default
        // account, in both the field and its deprecated alias.
        ("serviceAccountName", json!("default")),
    ] {
        if spec.get(k).is_none() {
            spec[k] = v;
        }
    }
    if spec.get("serviceAccount").is_none() {
        spec["serviceAccount"] = spec["serviceAccountName"].clone();
    }
    add_default_tolerations(spec);
    let mount_token = spec.get("automountServiceAccountToken") != Some(&json!(false));
    let token_volume = mount_token.then(|| add_token_volume(spec));
    // Requests default to limits, as the real defaulting does.
    for field in ["containers", "initContainers"] {
        if let Some(list) = spec.get_mut(field).and_then(Value::as_array_mut) {
            for c in list {
                let limits = c.get("resources").and_then(|r| r.get("limits")).cloned();
                if let Some(Value::Object(limits)) = limits {
                    for (k, v) in limits {
                        if c["resources"]
                            .get("requests")
                            .and_then(|r| r.get(&k))
                            .is_none()
                        {
                            c["resources"]["requests"][k] = v;
                        }
                    }
                }
                if c.get("imagePullPolicy").is_none() {
                    c["imagePullPolicy"] = json!(default_pull_policy(
                        c.get("image").and_then(Value::as_str).unwrap_or_default()
                    ));
                }
                for (k, v) in [
                    ("terminationMessagePath", "/dev/termination-log"),
                    ("terminationMessagePolicy", "File"),
                ] {
                    if c.get(k).is_none() {
                        c[k] = json!(v);
                    }
                }
                if let Some(volume) = &token_volume {
                    mount_token_volume(c, volume);
                }
            }
        }
    }
    let qos = qos_class(&pod["spec"]);
    let gated = pod["spec"]
        .get("schedulingGates")
        .and_then(Value::as_array)
        .is_some_and(|g| !g.is_empty());
    let mut status = json!({"phase": "Pending", "qosClass": qos});
    if gated {
        status["conditions"] = json!([{
            "type": "PodScheduled",
            "status": "False",
            "reason": "SchedulingGated",
            "message": "Scheduling is blocked due to non-empty scheduling gates",
            "lastProbeTime": null,
            "lastTransitionTime": now_rfc3339(),
        }]);
    }
    pod["status"] = status;
}

/// Create-time rules: containers present, extended resources with
/// requests equal to limits.
pub fn validate_create(pod: &Value) -> Vec<FieldCause> {
    let mut causes = Vec::new();
    let spec = &pod["spec"];
    if spec
        .get("containers")
        .and_then(Value::as_array)
        .is_none_or(Vec::is_empty)
    {
        causes.push(FieldCause::required("spec.containers", ""));
    }
    for (field, i, c) in containers(spec) {
        // As the real ValidatePodCreate: every container is named and has
        // an image (a Deployment's template may omit it; its pods may not).
        for key in ["name", "image"] {
            if c.get(key).and_then(Value::as_str).is_none_or(str::is_empty) {
                causes.push(FieldCause::required(format!("spec.{field}[{i}].{key}"), ""));
            }
        }
        let req = c
            .get("resources")
            .and_then(|r| r.get("requests"))
            .and_then(Value::as_object);
        let lim = c
            .get("resources")
            .and_then(|r| r.get("limits"))
            .and_then(Value::as_object);
        let mut names: Vec<&String> = req.into_iter().flat_map(|m| m.keys()).collect();
        names.extend(lim.into_iter().flat_map(|m| m.keys()));
        names.sort();
        names.dedup();
        for r in names.into_iter().filter(|r| is_extended(r)) {
            let rq = req.and_then(|m| m.get(r));
            let l = lim.and_then(|m| m.get(r));
            if l.is_none() {
                causes.push(FieldCause::required(
                    format!("spec.{field}[{i}].resources.limits[{r}]"),
                    "Limit must be set for non overcommitable resources",
                ));
            } else if rq.is_some() && quantity(rq) != quantity(l) {
                causes.push(FieldCause::invalid(
                    format!("spec.{field}[{i}].resources.requests[{r}]"),
                    rq.unwrap_or(&Value::Null),
                    "must be equal to ".to_string() + &r.to_string() + " limit of " + &render(l),
                ));
            }
        }
    }
    // The real server's ValidatePodCreate: a node may not be named while
    // any gate remains, so a gated pod can never bypass whoever holds the
    // gate (a mutating webhook adding a gate to a pod created with
    // nodeName makes the create fail here, after mutation).
    let named = spec
        .get("nodeName")
        .and_then(Value::as_str)
        .is_some_and(|n| !n.is_empty());
    if named && !gate_names(spec).is_empty() {
        causes.push(FieldCause::forbidden(
            "spec.nodeName",
            "cannot be set until all schedulingGates have been cleared",
        ));
    }
    causes
}

/// Names of the pod spec's scheduling gates, in order.
fn gate_names(spec: &Value) -> Vec<String> {
    spec.get("schedulingGates")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|g| g.get("name").and_then(Value::as_str).map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

fn render(v: Option<&Value>) -> String {
    match v {
        Some(Value::String(s)) => s.clone(),
        Some(other) => other.to_string(),
        None => String::new(),
    }
}

fn quantity(v: Option<&Value>) -> String {
    render(v)
}

/// Update rules of the real server for pod spec changes.
pub fn validate_update(old: &Value, new: &Value) -> Vec<FieldCause> {
    let mut causes = Vec::new();
    let os = &old["spec"];
    let ns = &new["spec"];
    let old_gates = gate_names(os);
    let new_gates = gate_names(ns);
    // One error per added gate, at its index, as the real server's
    // validateOnlyDeletedSchedulingGates reports them.
    for (i, g) in new_gates.iter().enumerate() {
        if !old_gates.contains(g) {
            causes.push(FieldCause::forbidden(
                format!("spec.schedulingGates[{i}].name"),
                format!("only deletion is allowed, but found new scheduling gate '{g}'"),
            ));
        }
    }
    let was_gated = !old_gates.is_empty();
    if was_gated {
        if let (Some(o), n) = (
            os.get("nodeSelector").and_then(Value::as_object),
            ns.get("nodeSelector").and_then(Value::as_object),
        ) {
            let kept = n.is_some_and(|n| o.iter().all(|(k, v)| n.get(k) == Some(v)));
            if !kept {
                causes.push(FieldCause::invalid(
                    "spec.nodeSelector",
                    ns.get("nodeSelector").unwrap_or(&Value::Null),
                    "only additions to spec.nodeSelector are allowed (no mutations or deletions)",
                ));
            }
        }
        let req = |s: &Value| {
            s.pointer("/affinity/nodeAffinity/requiredDuringSchedulingIgnoredDuringExecution/nodeSelectorTerms")
                .and_then(Value::as_array)
                .cloned()
        };
        if let Some(old_terms) = req(os) {
            let ok = match req(ns) {
                Some(new_terms) => {
                    new_terms.len() == old_terms.len()
                        && old_terms.iter().zip(&new_terms).all(|(o, n)| {
                            let list = |t: &Value, k: &str| {
                                t.get(k)
                                    .and_then(Value::as_array)
                                    .cloned()
                                    .unwrap_or_default()
                            };
                            let (oe, ne) =
                                (list(o, "matchExpressions"), list(n, "matchExpressions"));
                            let (of, nf) = (list(o, "matchFields"), list(n, "matchFields"));
                            ne.starts_with(&oe) && nf.starts_with(&of)
                        })
                }
                None => false,
            };
            if !ok {
                causes.push(FieldCause::invalid(
                    "spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution",
                    &Value::Null,
                    "only additions to spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms are allowed",
                ));
            }
        }
    }
    // Everything else is immutable but the fields the real server allows.
    let mut o = os.clone();
    let mut n = ns.clone();
    for s in [&mut o, &mut n] {
        if let Some(m) = s.as_object_mut() {
            m.remove("schedulingGates");
            m.remove("activeDeadlineSeconds");
            m.remove("tolerations");
            m.remove("terminationGracePeriodSeconds");
            if was_gated {
                m.remove("nodeSelector");
                m.remove("affinity");
            }
        }
        for field in ["containers", "initContainers"] {
            if let Some(list) = s.get_mut(field).and_then(Value::as_array_mut) {
                for c in list {
                    if let Some(m) = c.as_object_mut() {
                        m.remove("image");
                    }
                }
            }
        }
    }
    if o != n {
        causes.push(FieldCause::forbidden(
            "spec",
            "pod updates may not change fields other than `spec.containers[*].image`,`spec.initContainers[*].image`,`spec.activeDeadlineSeconds`,`spec.tolerations` (only additions to existing tolerations),`spec.terminationGracePeriodSeconds` (allow it to be set to 1 if it was previously negative)",
        ));
    }
    let old_tol = os
        .get("tolerations")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let new_tol = ns
        .get("tolerations")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    if old_tol.iter().any(|t| !new_tol.contains(t)) {
        causes.push(FieldCause::forbidden(
            "spec.tolerations",
            "existing toleration can not be modified except its tolerationSeconds",
        ));
    }
    causes
}

/// The grace period a delete of this pod gets.
pub fn grace_period(pod: &Value, requested: Option<i64>) -> i64 {
    let unbound = pod["spec"]
        .get("nodeName")
        .and_then(Value::as_str)
        .is_none_or(str::is_empty);
    let phase = pod["status"]
        .get("phase")
        .and_then(Value::as_str)
        .unwrap_or_default();
    if unbound || phase == "Succeeded" || phase == "Failed" {
        return 0;
    }
    requested
        .or_else(|| {
            pod["spec"]
                .get("terminationGracePeriodSeconds")
                .and_then(Value::as_i64)
        })
        .unwrap_or(30)
        .max(0)
}

/// `/binding`: sets spec.nodeName of an unbound pod.
pub fn bind(st: &mut State, ns: &str, name: &str, binding: &Value) -> Result<(), ApiError> {
    let id = ResourceId::new("", "pods");
    let target = binding
        .get("target")
        .and_then(|t| t.get("name"))
        .and_then(Value::as_str)
        .filter(|n| !n.is_empty())
        .ok_or_else(|| {
            ApiError::invalid(
                "",
                "Binding",
                name,
                vec![FieldCause::required("target.name", "")],
            )
        })?
        .to_string();
    let pod = st
        .get(&id, ns, name)
        .ok_or_else(|| ApiError::not_found("", "pods", name))?;
    if let Some(uid) = binding.pointer("/metadata/uid").and_then(Value::as_str)
        && meta_str(&pod, "uid") != Some(uid)
    {
        return Err(ApiError::conflict(
            "",
            "pods",
            name,
            "the UID in the precondition does not match the UID of the pod",
        ));
    }
    if pod["metadata"].get("deletionTimestamp").is_some() {
        return Err(ApiError::conflict(
            "",
            "pods",
            name,
            "pod is being deleted, cannot be assigned to a host",
        ));
    }
    if let Some(node) = pod["spec"]
        .get("nodeName")
        .and_then(Value::as_str)
        .filter(|n| !n.is_empty())
    {
        return Err(ApiError::conflict(
            "",
            "pods",
            name,
            &format!("pod {name} is already assigned to node \"{node}\""),
        ));
    }
    if pod["spec"]
        .get("schedulingGates")
        .and_then(Value::as_array)
        .is_some_and(|g| !g.is_empty())
    {
        return Err(ApiError::conflict(
            "",
            "pods",
            name,
            "pod has scheduling gates and cannot be bound",
        ));
    }
    let mut new = (*pod).clone();
    new["spec"]["nodeName"] = json!(target);
    let now = now_rfc3339();
    let conds = new["status"]
        .get("conditions")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let mut conds: Vec<Value> = conds
        .into_iter()
        .filter(|c| c["type"] != "PodScheduled")
        .collect();
    conds.push(json!({"type": "PodScheduled", "status": "True", "lastProbeTime": null, "lastTransitionTime": now}));
    new["status"]["conditions"] = json!(conds);
    st.put(&id, ns, name, new);
    Ok(())
}

fn healthy(pod: &Value) -> bool {
    pod["metadata"].get("deletionTimestamp").is_none()
        && pod["status"]["phase"] == "Running"
        && pod["status"]
            .get("conditions")
            .and_then(Value::as_array)
            .is_some_and(|c| {
                c.iter()
                    .any(|c| c["type"] == "Ready" && c["status"] == "True")
            })
}

fn int_or_percent(v: &Value, total: usize, round_up: bool) -> Option<i64> {
    match v {
        Value::Number(n) => n.as_i64(),
        Value::String(s) => {
            let pct: f64 = s.strip_suffix('%')?.parse().ok()?;
            let x = pct * total as f64 / 100.0;
            Some(if round_up { x.ceil() } else { x.floor() } as i64)
        }
        _ => None,
    }
}

/// `/eviction`: checks every PodDisruptionBudget covering the pod. Returns
/// the PDB updates to store when allowed (each consumes one disruption).
pub fn check_eviction(st: &State, ns: &str, pod: &Value) -> Result<Vec<Value>, ApiError> {
    let name = meta_str(pod, "name").unwrap_or_default().to_string();
    // A pod that is already not running does not count against budgets.
    let phase = pod["status"]
        .get("phase")
        .and_then(Value::as_str)
        .unwrap_or_default();
    if phase == "Succeeded"
        || phase == "Failed"
        || phase == "Pending"
        || pod["metadata"].get("deletionTimestamp").is_some()
    {
        return Ok(Vec::new());
    }
    let pdb_id = ResourceId::new("policy", "poddisruptionbudgets");
    let pods_id = ResourceId::new("", "pods");
    let mut updates = Vec::new();
    let mut covering = 0;
    for (_, pdb) in st.list(&pdb_id, Some(ns), None) {
        let Ok(sel) = LabelSelector::from_object(pdb["spec"].get("selector")) else {
            continue;
        };
        // A nil or empty selector selects nothing in policy/v1 for our purpose
        // of not blocking everything; the real server treats empty as all.
        if pdb["spec"].get("selector").is_none() || !sel.matches(pod) {
            continue;
        }
        covering += 1;
        let selected: Vec<&Value> = st
            .list(&pods_id, Some(ns), None)
            .map(|(_, p)| p.as_ref())
            .filter(|p| sel.matches(p))
            .collect();
        let expected = selected.len();
        let current_healthy = selected.iter().filter(|p| healthy(p)).count() as i64;
        let desired_healthy = if let Some(min) = pdb["spec"].get("minAvailable") {
            int_or_percent(min, expected, true).unwrap_or(0)
        } else if let Some(max) = pdb["spec"].get("maxUnavailable") {
            expected as i64 - int_or_percent(max, expected, true).unwrap_or(0)
        } else {
            0
        };
        let allowed = (current_healthy - desired_healthy).max(0);
        if !healthy(pod) && current_healthy >= desired_healthy {
            continue;
        }
        if allowed <= 0 {
            return Err(ApiError {
                reason: Reason::TooManyRequests,
                message: "Cannot evict pod as it would violate the pod's disruption budget.".into(),
                details: Some(json!({
                    "causes": [{
                        "reason": "DisruptionBudget",
                        "message": format!(
                            "The disruption budget {} needs {desired_healthy} healthy pods and has {current_healthy} currently",
                            meta_str(pdb, "name").unwrap_or_default()
                        ),
                    }]
                })),
                code: None,
            });
        }
        let mut updated = (**pdb).clone();
        let mut disrupted: BTreeMap<String, Value> = updated["status"]
            .get("disruptedPods")
            .and_then(Value::as_object)
            .map(|m| m.clone().into_iter().collect())
            .unwrap_or_default();
        disrupted.insert(name.clone(), json!(now_rfc3339()));
        updated["status"] = json!({
            "observedGeneration": pdb["metadata"].get("generation").cloned().unwrap_or(json!(1)),
            "disruptionsAllowed": allowed - 1,
            "currentHealthy": current_healthy,
            "desiredHealthy": desired_healthy,
            "expectedPods": expected,
            "disruptedPods": disrupted,
        });
        updates.push(updated);
    }
    if covering > 1 {
        return Err(ApiError::internal(
            "This pod has more than one PodDisruptionBudget, which the eviction subresource does not support.",
        ));
    }
    Ok(updates)
}

/// Stores PDB status updates computed by [`check_eviction`].
pub fn store_pdb_updates(st: &mut State, ns: &str, updates: Vec<Value>) {
    let id = ResourceId::new("policy", "poddisruptionbudgets");
    for mut u in updates {
        let name = meta_str(&u, "name").unwrap_or_default().to_string();
        meta_mut(&mut u);
        st.put(&id, ns, &name, u);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extended_resource_requests_must_equal_limits() {
        let pod = json!({"spec": {"containers": [{"name": "c", "image": "i", "resources": {
            "requests": {"gpupool/slot": "1"}, "limits": {"gpupool/slot": "2"}}}]}});
        let causes = validate_create(&pod);
        assert_eq!(causes.len(), 1);
        assert!(
            causes[0]
                .to_string()
                .contains("must be equal to gpupool/slot limit"),
            "{}",
            causes[0]
        );
    }

    #[test]
    fn new_pods_get_the_real_servers_defaults() {
        let mut pod = json!({"spec": {"containers": [{"name": "c", "image": "nginx"}],
            "tolerations": [{"key": "node.kubernetes.io/unreachable", "operator": "Exists"}]}});
        prepare_create(&mut pod);
        let spec = &pod["spec"];
        assert_eq!(spec["serviceAccountName"], "default");
        assert_eq!(spec["serviceAccount"], "default");
        let keys: Vec<&str> = spec["tolerations"]
            .as_array()
            .expect("tolerations")
            .iter()
            .filter_map(|t| t["key"].as_str())
            .collect();
        assert_eq!(
            keys,
            [
                "node.kubernetes.io/unreachable",
                "node.kubernetes.io/not-ready"
            ],
            "the pod's own toleration is kept, the missing one added"
        );
        let c = &spec["containers"][0];
        assert_eq!(c["imagePullPolicy"], "Always", "untagged");
        assert_eq!(c["terminationMessagePath"], "/dev/termination-log");
        assert_eq!(c["terminationMessagePolicy"], "File");
        let volume = spec["volumes"][0]["name"].as_str().expect("token volume");
        assert!(volume.starts_with("kube-api-access-"), "{volume}");
        assert_eq!(c["volumeMounts"][0]["name"], volume);

        let mut opted_out = json!({"spec": {"automountServiceAccountToken": false,
            "containers": [{"name": "c", "image": "nginx:1.27"}]}});
        prepare_create(&mut opted_out);
        assert!(opted_out["spec"].get("volumes").is_none());
        assert_eq!(
            opted_out["spec"]["containers"][0]["imagePullPolicy"],
            "IfNotPresent"
        );
        assert_eq!(default_pull_policy("registry:5000/app"), "Always");
        assert_eq!(default_pull_policy("app:latest"), "Always");
        assert_eq!(default_pull_policy("app@sha256:abc"), "IfNotPresent");
    }

    #[test]
    fn containers_need_a_name_and_an_image() {
        let pod = json!({"spec": {"initContainers": [{"name": "init", "image": ""}],
            "containers": [{"image": "i"}]}});
        let causes: Vec<String> = validate_create(&pod)
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(
            causes,
            [
                "spec.containers[0].name: Required value",
                "spec.initContainers[0].image: Required value",
            ],
        );
    }

    #[test]
    fn gates_may_be_removed_not_added() {
        let old =
            json!({"spec": {"schedulingGates": [{"name": "a"}], "containers": [{"name": "c"}]}});
        let removed = json!({"spec": {"containers": [{"name": "c"}], "nodeSelector": {"k": "v"}}});
        assert!(validate_update(&old, &removed).is_empty());
        let added = json!({"spec": {"schedulingGates": [{"name": "a"}, {"name": "b"}], "containers": [{"name": "c"}]}});
        let causes = validate_update(&old, &added);
        assert_eq!(causes.len(), 1, "{causes:?}");
        assert_eq!(
            causes[0].to_string(),
            "spec.schedulingGates[1].name: Forbidden: only deletion is allowed, but found new scheduling gate 'b'"
        );
    }

    #[test]
    fn node_name_is_refused_while_gated() {
        let gated = json!({"spec": {"nodeName": "node-1", "schedulingGates": [{"name": "a"}],
            "containers": [{"name": "c", "image": "i"}]}});
        let causes = validate_create(&gated);
        assert_eq!(causes.len(), 1, "{causes:?}");
        assert_eq!(
            causes[0].to_string(),
            "spec.nodeName: Forbidden: cannot be set until all schedulingGates have been cleared"
        );
        let ungated = json!({"spec": {"nodeName": "node-1", "schedulingGates": [],
            "containers": [{"name": "c", "image": "i"}]}});
        assert!(validate_create(&ungated).is_empty());
        // Setting nodeName on update is a spec change the real server refuses
        // whether or not the pod is gated.
        let old =
            json!({"spec": {"schedulingGates": [{"name": "a"}], "containers": [{"name": "c"}]}});
        let named = json!({"spec": {"nodeName": "node-1", "schedulingGates": [{"name": "a"}],
            "containers": [{"name": "c"}]}});
        let causes = validate_update(&old, &named);
        assert!(
            causes.iter().any(|c| c
                .to_string()
                .starts_with("spec: Forbidden: pod updates may not change fields")),
            "{causes:?}"
        );
    }

    #[test]
    fn ungated_pod_spec_is_immutable() {
        let old = json!({"spec": {"containers": [{"name": "c"}]}});
        let new = json!({"spec": {"containers": [{"name": "c"}], "nodeSelector": {"k": "v"}}});
        let causes = validate_update(&old, &new);
        assert!(
            causes[0].to_string().contains("may not change fields"),
            "{}",
            causes[0]
        );
        let image = json!({"spec": {"containers": [{"name": "c", "image": "new"}]}});
        assert!(validate_update(&old, &image).is_empty());
    }

    #[test]
    fn grace_is_zero_for_unbound_pods() {
        assert_eq!(grace_period(&json!({"spec": {}}), Some(30)), 0);
        assert_eq!(grace_period(&json!({"spec": {"nodeName": "n"}}), None), 30);
        assert_eq!(
            grace_period(
                &json!({"spec": {"nodeName": "n", "terminationGracePeriodSeconds": 5}}),
                None
            ),
            5
        );
    }
}
