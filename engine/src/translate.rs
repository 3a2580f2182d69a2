//! Kubernetes objects → the engine's plain model. Everything the engine
//! decides on is read here, so a field the engine needs is never missing in
//! one place and present in another; the operator and `kubectl gpupool`
//! both translate with these functions, so both feed the engine the same
//! model of the same objects.
//!
//! The engine does no I/O: what cannot be read (a GPU list, a request, an
//! enqueue stamp) is handed to the caller's `unread` sink as an [`Unread`],
//! for it to log or ignore.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, LazyLock};

use gpupool_api::names::{
    ANNOTATION_ENQUEUED_AT, ANNOTATION_NODE_GPUS, ANNOTATION_NODE_SLOTS, SCHEDULING_GATE,
};
use gpupool_api::pod::{ContainerFields, PodContainers};
use gpupool_api::{GpuLease, GpuLeaseClass, node_gpus, pod as api_pod};
use jiff::Timestamp;
use k8s_openapi::api::core::v1::{self as k8s, Node};

mod source;

pub use source::{PodScheduled, PodSource, PodSpecSource};

use crate::{
    CachedLease, ClassInfo, LeaseInfo, NodeInfo, NodeSelectorRequirement, NodeSelectorTerm,
    ObjectKey, PodInfo, PodPhase, RoleLabel, SelectorOperator, Taint, TaintEffect, Toleration,
    TolerationOperator, Unplaced, is_extended_resource,
};

/// The pod condition that says whether and since when the scheduler could
/// place the pod.
pub const POD_SCHEDULED: &str = "PodScheduled";

/// The reason of a `PodScheduled=False` condition when the scheduler found
/// no node for the pod (rather than, say, a gate holding it back).
pub const REASON_UNSCHEDULABLE: &str = "Unschedulable";

/// The two tolerations the API server's DefaultTolerationSeconds admission
/// plugin gives every pod that names neither: a not-ready or unreachable
/// node is tolerated for 300 s. Kept once, shared by every pod whose list
/// is exactly this, instead of seven allocations per pod.
pub static DEFAULT_TOLERATIONS: LazyLock<Arc<[k8s::Toleration]>> = LazyLock::new(|| {
    [
        "node.kubernetes.io/not-ready",
        "node.kubernetes.io/unreachable",
    ]
    .into_iter()
    .map(|key| k8s::Toleration {
        key: Some(key.to_owned()),
        operator: Some("Exists".to_owned()),
        effect: Some("NoExecute".to_owned()),
        toleration_seconds: Some(300),
        value: None,
    })
    .collect()
});

/// Something an object says that could not be read, and what the
/// translation did instead.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unread {
    /// The node's `gpupool.io/gpus` annotation: the node is taken to have
    /// no GPU list.
    GpuList {
        /// The node.
        node: String,
        /// The parser's words.
        error: String,
    },
    /// A pod's request of a class's resource (a fraction, say): the
    /// request is left out, so the pod is not queued for it.
    Request {
        /// The pod.
        pod: ObjectKey,
        /// The parser's words.
        error: String,
    },
    /// A pod's `gpupool.io/enqueued-at` stamp: it is ignored, and the
    /// pod's creation time stands for it.
    EnqueueStamp {
        /// The pod.
        pod: ObjectKey,
        /// The parser's words.
        error: String,
    },
}

impl std::fmt::Display for Unread {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Unread::GpuList { node, error } => {
                write!(f, "node {node}: ignoring its GPU list: {error}")
            }
            Unread::Request { pod, error } => write!(
                f,
                "pod {pod}: its GPU request cannot be read; it is not queued: {error}"
            ),
            Unread::EnqueueStamp { pod, error } => {
                write!(
                    f,
                    "pod {pod}: ignoring its unreadable enqueue stamp: {error}"
                )
            }
        }
    }
}

/// An `unread` sink that drops everything, for a caller with nowhere to
/// report it.
pub fn ignore(_: Unread) {}

/// The extended resources the classes use: the only pod requests and node
/// allocatables the engine needs.
pub fn resource_names(classes: &[ClassInfo]) -> BTreeSet<String> {
    classes
        .iter()
        .map(|c| c.spec.resource_name.clone())
        .collect()
}

/// A class as the engine sees it; `None` for an object without a name.
pub fn class_info(class: &GpuLeaseClass) -> Option<ClassInfo> {
    Some(ClassInfo {
        name: class.metadata.name.clone()?,
        generation: class.metadata.generation,
        created_at: class.metadata.creation_timestamp.as_ref().map(|t| t.0),
        spec: class.spec.clone(),
        status: class.status.clone(),
    })
}

/// A node as the engine sees it with every resource it advertises, whichever
/// class uses it: the form the webhook's node index keeps.
pub fn node_info_all(node: &Node, unread: &mut dyn FnMut(Unread)) -> Option<NodeInfo> {
    let mut resources: BTreeSet<String> = node
        .status
        .as_ref()
        .and_then(|s| s.allocatable.as_ref())
        .map(|alloc| alloc.keys().cloned().collect())
        .unwrap_or_default();
    // A plugin's first slots are announced before allocatable lists them.
    if let Some((resource, _)) = node
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ANNOTATION_NODE_SLOTS))
        .and_then(|v| node_gpus::parse_slots(v))
    {
        resources.insert(resource.to_owned());
    }
    node_info(node, &resources, unread)
}

/// A node as the engine sees it: allocatable of `resources` only, in whole slots.
pub fn node_info(
    node: &Node,
    resources: &BTreeSet<String>,
    unread: &mut dyn FnMut(Unread),
) -> Option<NodeInfo> {
    let name = node.metadata.name.clone()?;
    let allocatable = node
        .status
        .as_ref()
        .and_then(|s| s.allocatable.as_ref())
        .map(|alloc| {
            alloc
                .iter()
                .filter(|(k, _)| resources.contains(*k))
                .filter_map(|(k, q)| {
                    let n = api_pod::parse_whole(q)?;
                    Some((k.clone(), u32::try_from(n).unwrap_or(u32::MAX)))
                })
                .collect()
        })
        .unwrap_or_default();
    let spec = node.spec.as_ref();
    let taints = spec
        .and_then(|s| s.taints.as_ref())
        .map(|ts| {
            ts.iter()
                .filter_map(|t| {
                    Some(Taint {
                        key: t.key.clone(),
                        value: t.value.clone(),
                        effect: taint_effect(&t.effect)?,
                    })
                })
                .collect()
        })
        .unwrap_or_default();
    let gpus = match node
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ANNOTATION_NODE_GPUS))
    {
        None => Vec::new(),
        Some(value) => node_gpus::parse(value).unwrap_or_else(|e| {
            unread(Unread::GpuList {
                node: name.clone(),
                error: e.to_string(),
            });
            Vec::new()
        }),
    };
    let announced = node
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ANNOTATION_NODE_SLOTS))
        .and_then(|v| node_gpus::parse_slots(v))
        .filter(|(resource, _)| resources.contains(*resource))
        .map(|(resource, slots)| (resource.to_owned(), slots))
        .into_iter()
        .collect();
    Some(NodeInfo {
        labels: node.metadata.labels.clone().unwrap_or_default(),
        taints,
        allocatable,
        gpus,
        announced,
        unschedulable: spec.and_then(|s| s.unschedulable).unwrap_or(false),
        name,
    })
}

/// `reason: message` of a failed pod's status, or either alone; `None`
/// when the kubelet said nothing.
fn failure(pod: &impl PodSource) -> Option<String> {
    let reason = pod.status_reason().filter(|r| !r.is_empty());
    let message = pod.status_message().filter(|m| !m.is_empty());
    match (reason, message) {
        (Some(r), Some(m)) => Some(format!("{r}: {m}")),
        (Some(one), None) | (None, Some(one)) => Some(one.to_owned()),
        (None, None) => None,
    }
}

fn taint_effect(s: &str) -> Option<TaintEffect> {
    match s {
        "NoSchedule" => Some(TaintEffect::NoSchedule),
        "PreferNoSchedule" => Some(TaintEffect::PreferNoSchedule),
        "NoExecute" => Some(TaintEffect::NoExecute),
        _ => None,
    }
}

/// A pod as the engine sees it, or `None` when it requests no
/// domain-qualified extended resource (such a pod neither queues nor takes
/// slots) or lacks a name. `now` stands in for a missing creation time.
///
/// Its requests are those of every extended resource it asks for, whether
/// a class uses it now or not: a pod must not leave the engine when its
/// class is deleted (its lease would be released as if the pod were gone,
/// and a queued pod would then stay gated for good), nor when a class
/// changes its resource. A request that cannot be read (a fraction, say)
/// is left out; only one of `resources` (the classes' resources) is worth
/// an [`Unread`], since no class counts any other.
///
/// Every form of a pod is read through [`PodSource`] (the webhook's whole
/// `Pod`, the operator's cached copy), so each is translated by these
/// same rules, without being rebuilt into another form first.
pub fn pod_info(
    pod: &impl PodSource,
    resources: &BTreeSet<String>,
    now: Timestamp,
    unread: &mut dyn FnMut(Unread),
) -> Option<PodInfo> {
    let spec = pod.spec()?;
    let key = ObjectKey::new(pod.namespace()?, pod.name()?);
    let mut requests = BTreeMap::new();
    for resource in extended_resources(spec) {
        match api_pod::requested_slots(spec, resource) {
            Ok(0) => {}
            Ok(n) => {
                requests.insert(resource.to_owned(), n);
            }
            Err(e) if resources.contains(resource) => unread(Unread::Request {
                pod: key.clone(),
                error: e.to_string(),
            }),
            Err(_) => {}
        }
    }
    if requests.is_empty() {
        return None;
    }
    let role = match api_pod::role(pod) {
        Ok(r) => RoleLabel::Valid(r),
        Err(api_pod::PodError::BadRole(v)) => RoleLabel::Invalid(v),
        Err(e) => RoleLabel::Invalid(e.to_string()),
    };
    let enqueued_at = pod.annotation(ANNOTATION_ENQUEUED_AT).and_then(|v| {
        match gpupool_api::time::parse_stamp(v) {
            Ok(t) => Some(t),
            Err(e) => {
                unread(Unread::EnqueueStamp {
                    pod: key.clone(),
                    error: e.to_string(),
                });
                None
            }
        }
    });
    let phase = match pod.phase() {
        Some("Running") => PodPhase::Running,
        Some("Succeeded") => PodPhase::Succeeded,
        Some("Failed") => PodPhase::Failed,
        Some("Unknown") => PodPhase::Unknown,
        _ => PodPhase::Pending,
    };
    let failure = (phase == PodPhase::Failed).then(|| failure(pod)).flatten();
    let gated = gate_index(pod).is_some();
    let other_gate = spec
        .scheduling_gates()
        .find(|g| *g != SCHEDULING_GATE)
        .map(str::to_owned);
    let node_name = spec
        .node_name()
        .filter(|n| !n.is_empty())
        .map(str::to_owned);
    // A bound pod is placed, whatever a stale condition still says.
    let unplaced = unplaced(pod.pod_scheduled()).filter(|_| node_name.is_none());
    Some(PodInfo {
        uid: pod.uid().unwrap_or_default().to_owned(),
        class_label: api_pod::class_label(pod).map(str::to_owned),
        role,
        requests: requests.into(),
        enqueued_at,
        created_at: pod.created_at().unwrap_or(now),
        phase,
        failure,
        terminating: pod.deleting(),
        gated,
        other_gate,
        unplaced,
        node_name,
        node_selector: spec
            .node_selector()
            .into_iter()
            .flatten()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect(),
        required_affinity: spec.required_node_affinity().map(required_affinity),
        tolerations: tolerations(spec.tolerations()),
        unmanaged: false,
        key,
    })
}

/// A required node affinity's terms in the engine's form; a term this
/// version cannot evaluate is dropped (see [`requirements`]).
fn required_affinity(selector: &k8s::NodeSelector) -> Vec<NodeSelectorTerm> {
    selector
        .node_selector_terms
        .iter()
        .filter_map(|t| {
            Some(NodeSelectorTerm {
                match_expressions: requirements(t.match_expressions.as_deref())?,
                match_fields: requirements(t.match_fields.as_deref())?,
            })
        })
        .collect()
}

/// A lease as the engine sees it, kept under `namespace/name`; `None` for
/// an object without a namespace or a name.
pub fn lease_info(lease: &GpuLease) -> Option<LeaseInfo> {
    let key = ObjectKey::new(
        lease.metadata.namespace.clone()?,
        lease.metadata.name.clone()?,
    );
    let mut cached = CachedLease::from(lease.clone());
    cached.metadata.share_key(&key);
    Some(LeaseInfo::new(key, Arc::new(cached)))
}

/// The domain-qualified extended resources any container of `spec`
/// (init containers included) requests or limits, each once, in name order.
fn extended_resources(spec: &impl PodContainers) -> BTreeSet<&str> {
    spec.init_containers()
        .chain(spec.containers())
        .flat_map(ContainerFields::resource_names)
        .filter(|name| is_extended_resource(name))
        .collect()
}

/// The scheduler's word that it cannot place the pod: its `PodScheduled`
/// condition when that is `False` for reason `Unschedulable`. A condition
/// without a transition time says nothing of how long, so it is taken as
/// no word at all rather than as one from the start of time.
fn unplaced(condition: Option<PodScheduled<'_>>) -> Option<Unplaced> {
    let condition = condition?;
    if condition.status != "False" || condition.reason != Some(REASON_UNSCHEDULABLE) {
        return None;
    }
    Some(Unplaced {
        since: condition.last_transition_time?,
        message: condition
            .message
            .filter(|m| !m.is_empty())
            .map(str::to_owned),
    })
}

/// A pod's tolerations in the engine's form. No list and the API
/// server's default list (which nearly every pod carries) are each kept
/// once and shared, so 10,000 pods hold no copy of them. A form that
/// already shares [`DEFAULT_TOLERATIONS`] (the operator's cached pods do)
/// is known by its address, without comparing the lists.
fn tolerations(list: Option<&[k8s::Toleration]>) -> Arc<[Toleration]> {
    static NONE: LazyLock<Arc<[Toleration]>> = LazyLock::new(|| Arc::new([]));
    static DEFAULT: LazyLock<Arc<[Toleration]>> =
        LazyLock::new(|| engine_tolerations(&DEFAULT_TOLERATIONS));
    match list {
        None | Some([]) => NONE.clone(),
        Some(list)
            if std::ptr::eq(list, &DEFAULT_TOLERATIONS[..]) || *list == DEFAULT_TOLERATIONS[..] =>
        {
            DEFAULT.clone()
        }
        Some(list) => engine_tolerations(list),
    }
}

/// Each toleration the engine can read, in its form; one with an operator
/// or effect Kubernetes does not define tolerates nothing and is left out.
fn engine_tolerations(list: &[k8s::Toleration]) -> Arc<[Toleration]> {
    list.iter()
        .filter_map(|t| {
            let operator = match t.operator.as_deref() {
                None | Some("Equal") => TolerationOperator::Equal,
                Some("Exists") => TolerationOperator::Exists,
                Some(_) => return None,
            };
            let effect = match t.effect.as_deref() {
                None | Some("") => None,
                Some(e) => Some(taint_effect(e)?),
            };
            Some(Toleration {
                key: t.key.clone().filter(|k| !k.is_empty()),
                operator,
                value: t.value.clone(),
                effect,
            })
        })
        .collect()
}

/// Index of the admission gate in `spec.schedulingGates`, if the pod has it.
pub fn gate_index(pod: &impl PodSource) -> Option<usize> {
    pod.spec()?
        .scheduling_gates()
        .position(|g| g == SCHEDULING_GATE)
}

/// Requirements of one term; `None` when one has an operator this version
/// does not know, which drops the whole term: a term that cannot be
/// evaluated must not widen where a pod may go.
fn requirements(
    reqs: Option<&[k8s_openapi::api::core::v1::NodeSelectorRequirement]>,
) -> Option<Vec<NodeSelectorRequirement>> {
    reqs.unwrap_or_default()
        .iter()
        .map(|r| {
            let operator = match r.operator.as_str() {
                "In" => SelectorOperator::In,
                "NotIn" => SelectorOperator::NotIn,
                "Exists" => SelectorOperator::Exists,
                "DoesNotExist" => SelectorOperator::DoesNotExist,
                "Gt" => SelectorOperator::Gt,
                "Lt" => SelectorOperator::Lt,
                _ => return None,
            };
            Some(NodeSelectorRequirement {
                key: r.key.clone(),
                operator,
                values: r.values.clone().unwrap_or_default(),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SmallMap;
    use k8s_openapi::api::core::v1::Pod;
    use serde_json::json;

    fn resources() -> BTreeSet<String> {
        BTreeSet::from(["gpupool/slot".to_owned(), "example.com/big".to_owned()])
    }

    fn now() -> Timestamp {
        Timestamp::from_second(1_800_000_000).expect("valid")
    }

    #[test]
    fn pod_with_everything() {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {
                "namespace": "ml", "name": "train", "uid": "u1",
                "creationTimestamp": "2026-01-01T00:00:00Z",
                "deletionTimestamp": "2026-01-01T00:01:00Z",
                "labels": {"gpupool.io/class": "fast", "gpupool.io/role": "helper"},
                "annotations": {"gpupool.io/enqueued-at": "2026-01-01T00:00:00.000123Z"}
            },
            "spec": {
                "nodeName": "node-1",
                "nodeSelector": {"zone": "a"},
                "schedulingGates": [{"name": "other"}, {"name": "gpupool.io/admission"}],
                "containers": [
                    {"name": "a", "resources": {"limits": {"gpupool/slot": "2"}}},
                    {"name": "b", "resources": {"requests": {"cpu": "1"}}}
                ],
                "tolerations": [
                    {"key": "gpu", "operator": "Exists", "effect": "NoSchedule"},
                    {"operator": "Exists"},
                    {"key": "x", "value": "y"}
                ],
                "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}]},
                        {"matchExpressions": [{"key": "gpu", "operator": "Near", "values": ["x"]}]},
                        {"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["n9"]}]}
                    ]
                }}}
            },
            "status": {"phase": "Running"}
        }))
        .expect("pod");
        let info = pod_info(&pod, &resources(), now(), &mut ignore).expect("requests a slot");
        assert_eq!(info.key, ObjectKey::new("ml", "train"));
        assert_eq!(info.uid, "u1");
        assert_eq!(info.class_label.as_deref(), Some("fast"));
        assert_eq!(info.role, RoleLabel::Valid(gpupool_api::Role::Helper));
        assert_eq!(
            info.requests,
            SmallMap::from([("gpupool/slot".to_owned(), 2)])
        );
        assert_eq!(
            info.enqueued_at.map(|t| t.as_microsecond()),
            Some(
                "2026-01-01T00:00:00.000123Z"
                    .parse::<Timestamp>()
                    .expect("t")
                    .as_microsecond()
            )
        );
        assert_eq!(
            info.created_at,
            "2026-01-01T00:00:00Z".parse::<Timestamp>().expect("t")
        );
        assert_eq!(info.phase, PodPhase::Running);
        assert!(info.terminating);
        assert!(info.gated);
        assert_eq!(info.node_name.as_deref(), Some("node-1"));
        assert_eq!(
            info.node_selector.get("zone").map(String::as_str),
            Some("a")
        );
        let terms = info.required_affinity.expect("affinity");
        assert_eq!(
            terms.len(),
            2,
            "the term with an unknown operator is dropped"
        );
        assert_eq!(terms[0].match_expressions[0].operator, SelectorOperator::In);
        assert_eq!(terms[1].match_fields[0].operator, SelectorOperator::NotIn);
        assert_eq!(
            info.tolerations[..],
            [
                Toleration {
                    key: Some("gpu".into()),
                    operator: TolerationOperator::Exists,
                    value: None,
                    effect: Some(TaintEffect::NoSchedule)
                },
                Toleration {
                    key: None,
                    operator: TolerationOperator::Exists,
                    value: None,
                    effect: None
                },
                Toleration {
                    key: Some("x".into()),
                    operator: TolerationOperator::Equal,
                    value: Some("y".into()),
                    effect: None
                },
            ]
        );
    }

    #[test]
    fn pod_defaults_and_bad_labels() {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"namespace": "d", "name": "p",
                "labels": {"gpupool.io/role": "boss"},
                "annotations": {"gpupool.io/enqueued-at": "yesterday"}},
            "spec": {"containers": [
                {"name": "a", "resources": {"requests": {"example.com/big": "1", "gpupool/slot": "1"}}}
            ]}
        }))
        .expect("pod");
        let info = pod_info(&pod, &resources(), now(), &mut ignore).expect("requests");
        assert_eq!(info.role, RoleLabel::Invalid("boss".into()));
        assert_eq!(info.enqueued_at, None, "garbage stamp is ignored");
        assert_eq!(info.created_at, now());
        assert_eq!(info.phase, PodPhase::Pending);
        assert!(!info.gated && !info.terminating);
        assert_eq!(info.requests.len(), 2, "one entry per class resource");
        assert_eq!(info.required_affinity, None);
    }

    #[test]
    fn pods_without_requests_are_left_out() {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"namespace": "d", "name": "web"},
            "spec": {"nodeName": "node-1", "containers": [
                {"name": "a", "resources": {"requests": {"cpu": "1", "kubernetes.io/x": "3"}}}
            ]}
        }))
        .expect("pod");
        assert!(pod_info(&pod, &resources(), now(), &mut ignore).is_none());
        let frac: Pod = serde_json::from_value(json!({
            "metadata": {"namespace": "d", "name": "frac"},
            "spec": {"containers": [
                {"name": "a", "resources": {"requests": {"gpupool/slot": "500m"}}}
            ]}
        }))
        .expect("pod");
        assert!(pod_info(&frac, &resources(), now(), &mut ignore).is_none());
    }

    /// A pod keeps the requests of every extended resource it asks for,
    /// whether a class uses it or not: when its class is deleted (the
    /// classes' resources are then none), it stays in the engine.
    #[test]
    fn pods_keep_every_extended_resource_whatever_the_classes() {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"namespace": "d", "name": "p"},
            "spec": {
                "initContainers": [
                    {"name": "i", "resources": {"limits": {"example.com/nic": "2"}}}
                ],
                "containers": [
                    {"name": "a", "resources": {
                        "requests": {"cpu": "1", "gpupool/slot": "1", "other/x": "0",
                                     "example.com/frac": "500m"},
                        "limits": {"memory": "1Gi", "gpupool/slot": "1"}}}
                ]
            }
        }))
        .expect("pod");
        let expected = SmallMap::from([
            ("example.com/nic".to_owned(), 2),
            ("gpupool/slot".to_owned(), 1),
        ]);
        for resources in [BTreeSet::new(), resources()] {
            let info = pod_info(&pod, &resources, now(), &mut ignore).expect("requests slots");
            assert_eq!(
                info.requests, expected,
                "zero and unreadable requests are left out, every other kept"
            );
        }
    }

    #[test]
    fn another_gate_and_the_schedulers_word_are_read() {
        let pod = |gates: serde_json::Value, condition: serde_json::Value| -> Pod {
            serde_json::from_value(json!({
                "metadata": {"namespace": "d", "name": "p"},
                "spec": {
                    "schedulingGates": gates,
                    "containers": [{"name": "a", "resources": {"limits": {"gpupool/slot": "1"}}}]
                },
                "status": {"conditions": condition}
            }))
            .expect("pod")
        };
        let unschedulable = json!({"type": "PodScheduled", "status": "False",
            "reason": "Unschedulable", "message": "0/2 nodes are available",
            "lastTransitionTime": "2026-01-01T00:02:00Z"});
        let info =
            |p: &Pod| pod_info(p, &resources(), now(), &mut ignore).expect("requests a slot");

        let held = info(&pod(
            json!([{"name": "gpupool.io/admission"}, {"name": "example.com/quota"},
                   {"name": "example.com/later"}]),
            json!([{"type": "PodScheduled", "status": "False", "reason": "SchedulingGated",
                    "lastTransitionTime": "2026-01-01T00:00:00Z"}]),
        ));
        assert!(held.gated);
        assert_eq!(held.other_gate.as_deref(), Some("example.com/quota"));
        assert_eq!(held.unplaced, None, "a gated pod is not unplaceable");

        let only_ours = info(&pod(json!([{"name": "gpupool.io/admission"}]), json!(null)));
        assert_eq!((only_ours.gated, only_ours.other_gate), (true, None));

        let stuck = info(&pod(json!(null), json!([unschedulable.clone()])));
        assert_eq!(stuck.other_gate, None);
        assert_eq!(
            stuck.unplaced,
            Some(Unplaced {
                since: "2026-01-01T00:02:00Z".parse().expect("t"),
                message: Some("0/2 nodes are available".into()),
            })
        );

        let mut silent = unschedulable.clone();
        silent["message"] = json!("");
        assert_eq!(
            info(&pod(json!([]), json!([silent])))
                .unplaced
                .map(|u| u.message),
            Some(None)
        );
        let mut timeless = unschedulable.clone();
        timeless["lastTransitionTime"] = json!(null);
        assert_eq!(info(&pod(json!([]), json!([timeless]))).unplaced, None);
        let mut unknown = unschedulable;
        unknown["status"] = json!("Unknown");
        assert_eq!(info(&pod(json!([]), json!([unknown]))).unplaced, None);
    }

    #[test]
    fn node_with_gpus_taints_and_allocatable() {
        let node: Node = serde_json::from_value(json!({
            "metadata": {"name": "node-1", "labels": {"gpu": "h100"},
                "annotations": {"gpupool.io/gpus":
                    r#"[{"index":0,"uuid":"GPU-a","product":"H100","vendor":"NVIDIA"}]"#}},
            "spec": {"unschedulable": true, "taints": [
                {"key": "gpu", "value": "yes", "effect": "NoSchedule"},
                {"key": "odd", "effect": "Weird"}
            ]},
            "status": {"allocatable": {"gpupool/slot": "4", "cpu": "8", "example.com/big": "2k"}}
        }))
        .expect("node");
        let info = node_info(&node, &resources(), &mut ignore).expect("named");
        assert_eq!(info.name, "node-1");
        assert_eq!(
            info.allocatable,
            BTreeMap::from([
                ("example.com/big".to_owned(), 2000),
                ("gpupool/slot".to_owned(), 4)
            ])
        );
        assert!(info.unschedulable);
        assert_eq!(
            info.taints,
            vec![Taint {
                key: "gpu".into(),
                value: Some("yes".into()),
                effect: TaintEffect::NoSchedule
            }]
        );
        assert_eq!(info.gpus.len(), 1);
        assert_eq!(info.gpus[0].uuid, "GPU-a");
        assert_eq!(info.labels.get("gpu").map(String::as_str), Some("h100"));
    }

    #[test]
    fn node_with_bad_gpu_annotation_has_no_gpus() {
        let node: Node = serde_json::from_value(json!({
            "metadata": {"name": "n", "annotations": {"gpupool.io/gpus": "{oops"}},
        }))
        .expect("node");
        let info = node_info(&node, &resources(), &mut ignore).expect("named");
        assert!(info.gpus.is_empty());
        assert!(info.allocatable.is_empty());
        assert!(!info.unschedulable);
    }

    #[test]
    fn the_default_tolerations_and_none_are_shared_by_every_pod() {
        let pod = |name: &str, tolerations: serde_json::Value| -> Pod {
            serde_json::from_value(json!({
                "metadata": {"namespace": "ml", "name": name, "uid": name},
                "spec": {
                    "containers": [{"name": "a", "resources": {"limits": {"gpupool/slot": "1"}}}],
                    "tolerations": tolerations
                }
            }))
            .expect("pod")
        };
        let defaults = json!([
            {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300},
            {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300}
        ]);
        let info =
            |p: &Pod| pod_info(p, &resources(), now(), &mut ignore).expect("requests a slot");
        let (a, b) = (info(&pod("a", defaults.clone())), info(&pod("b", defaults)));
        assert!(
            Arc::ptr_eq(&a.tolerations, &b.tolerations),
            "one list for both"
        );
        assert_eq!(
            a.tolerations
                .iter()
                .map(|t| t.key.as_deref())
                .collect::<Vec<_>>(),
            [
                Some("node.kubernetes.io/not-ready"),
                Some("node.kubernetes.io/unreachable")
            ]
        );
        assert!(
            a.tolerations
                .iter()
                .all(|t| t.effect == Some(TaintEffect::NoExecute)
                    && t.operator == TolerationOperator::Exists)
        );

        let (none, empty) = (info(&pod("c", json!(null))), info(&pod("d", json!([]))));
        assert!(none.tolerations.is_empty() && Arc::ptr_eq(&none.tolerations, &empty.tolerations));

        // The same keys for 60 s instead of 300 s is a list of its own.
        let own = info(&pod(
            "e",
            json!([
                {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 60},
                {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 60},
                {"key": "bad", "operator": "Near"}
            ]),
        ));
        assert!(!Arc::ptr_eq(&own.tolerations, &a.tolerations));
        assert_eq!(
            own.tolerations[..],
            a.tolerations[..],
            "the unknown operator is left out"
        );
    }

    #[test]
    fn classes() {
        let class: GpuLeaseClass = serde_json::from_value(json!({
            "apiVersion": "gpupool.io/v1alpha1", "kind": "GpuLeaseClass",
            "metadata": {"name": "default", "generation": 3},
            "spec": {"resourceName": "example.com/big"}
        }))
        .expect("class");
        let c = class_info(&class).expect("named");
        assert_eq!(c.generation, Some(3));
        assert_eq!(
            resource_names(&[c]),
            BTreeSet::from(["example.com/big".to_owned()])
        );
    }
}
