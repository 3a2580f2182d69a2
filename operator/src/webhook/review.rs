//! The webhook's decisions, free of I/O: an admission request and a view of
//! the cluster in, a decision out (DESIGN §5.1).
//!
//! Mutation (pod CREATE) queues pods that request a gpupool resource: it
//! resolves the class, checks the role, the slot count, the largest matching
//! node and the class's queue bound, then adds the scheduling gate and the
//! enqueue stamp. Validation (pod UPDATE) keeps anyone but the operator from
//! removing the gate. The clock is an argument, so every decision is
//! reproducible.

use std::collections::BTreeSet;
use std::sync::Arc;

use gpupool_api::names::{
    ANNOTATION_ENQUEUED_AT, DEFAULT_RESOURCE_NAME, LABEL_CLASS, LABEL_ROLE, SCHEDULING_GATE,
};
use gpupool_api::pod::{self, PodError};
use gpupool_api::{GpuLeaseClass, LeasePhase, Role};

use crate::engine::{self, CachedLease, ClassInfo, NodeInfo, PodInfo, established_default};
use crate::index::translate;

pub use super::guard::{Identities, validate_class, validate_lease};
use super::near_miss;
use jiff::Timestamp;
use json_patch::jsonptr::PointerBuf;
use json_patch::{AddOperation, Patch, PatchOperation};
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{Container, Node, Pod, PodSpec};
use kube::ResourceExt;
use kube::core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview, Operation};
use serde_json::{Value, json};

/// The cluster state a review consults: GpuLeaseClasses, Nodes and GpuLeases.
/// The webhook backs it with the operator's watch caches; tests back it with plain lists.
/// Only pods that request an extended resource cause any of these calls.
pub trait ClusterView {
    /// Every GpuLeaseClass.
    fn classes(&self) -> Vec<Arc<GpuLeaseClass>>;
    /// `engine::largest_node` for `class` and `pod` over every Node (as the
    /// engine sees it): the webhook and the engine apply one rule.
    fn largest_node(
        &self,
        class: &ClassInfo,
        pod: &PodInfo,
    ) -> Result<Option<(String, u32)>, String>;
    /// How many leases of `class` and `role` count toward the class's
    /// `maxQueued` (see [`queue_tally_key`]).
    fn queued(&self, class: &str, role: Role) -> usize;
}

/// A fixed set of objects: the view tests and benchmarks hand to a review.
#[derive(Debug, Clone, Default)]
pub struct StaticView {
    /// The classes.
    pub classes: Vec<Arc<GpuLeaseClass>>,
    /// The nodes.
    pub nodes: Vec<Arc<Node>>,
    /// The leases.
    pub leases: Vec<Arc<CachedLease>>,
}

impl ClusterView for StaticView {
    fn classes(&self) -> Vec<Arc<GpuLeaseClass>> {
        self.classes.clone()
    }
    fn largest_node(
        &self,
        class: &ClassInfo,
        pod: &PodInfo,
    ) -> Result<Option<(String, u32)>, String> {
        let nodes: Vec<NodeInfo> = self
            .nodes
            .iter()
            .filter_map(|n| translate::node_info_all(n))
            .collect();
        let largest = engine::largest_node(class, &nodes, pod)?;
        Ok(largest.map(|(name, slots)| (name.to_owned(), slots)))
    }
    fn queued(&self, class: &str, role: Role) -> usize {
        let key = queue_key(class, role);
        self.leases
            .iter()
            .filter(|l| queue_tally_key(l).is_some_and(|k| k == key))
            .count()
    }
}

/// A set of usernames: the operator's own identities (its service account in
/// a cluster, its user in the simulator), which alone may remove the
/// `gpupool.io/admission` gate and write leases, or the device plugins'.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Users(Vec<String>);

impl Users {
    /// The given usernames; duplicates and empty names are dropped.
    pub fn new(users: impl IntoIterator<Item = String>) -> Self {
        let mut users: Vec<String> = users.into_iter().filter(|u| !u.is_empty()).collect();
        users.sort();
        users.dedup();
        Self(users)
    }

    /// The service-account username `system:serviceaccount:<namespace>:<name>`.
    pub fn service_account(namespace: &str, name: &str) -> String {
        format!("system:serviceaccount:{namespace}:{name}")
    }

    /// True when `user` is one of them.
    pub fn contains(&self, user: &str) -> bool {
        self.0.iter().any(|u| u == user)
    }

    /// The usernames, sorted.
    pub fn users(&self) -> &[String] {
        &self.0
    }
}

/// Why the webhook refuses a pod. The message is what the user sees after
/// `admission webhook "..." denied the request: `.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Denial {
    /// The request carries no object where the operation needs one.
    #[error("the {operation} admission request carries no object")]
    MissingObject {
        /// The operation (CREATE, UPDATE).
        operation: String,
    },
    /// The pod names a class that does not exist.
    #[error("GpuLeaseClass {class:?} (label {LABEL_CLASS}) does not exist")]
    UnknownClass {
        /// The class the label names.
        class: String,
    },
    /// The pod names no class and no class is the default.
    #[error(
        "the pod requests {resource} but names no GpuLeaseClass (label {LABEL_CLASS}) and no class is marked default: true"
    )]
    NoClass {
        /// The gpupool resource the pod requests.
        resource: String,
    },
    /// The role label or a slot quantity cannot be read.
    #[error("{0}")]
    BadPod(#[from] PodError),
    /// The pod requests a gpupool resource its class does not hand out.
    #[error(
        "the pod requests {resource}, which its GpuLeaseClass {class:?} does not hand out (the class hands out {class_resource})"
    )]
    ForeignResource {
        /// The resource requested.
        resource: String,
        /// The pod's class.
        class: String,
        /// The resource that class hands out.
        class_resource: String,
    },
    /// The class's node selector cannot be evaluated.
    #[error("GpuLeaseClass {class:?} has an invalid nodeSelector: {reason}")]
    InvalidNodeSelector {
        /// The class.
        class: String,
        /// What is wrong with the selector.
        reason: String,
    },
    /// The pod names a class but asks for a resource no class hands out,
    /// one that looks meant for one.
    #[error(
        "the pod requests {requested}, which no GpuLeaseClass hands out (did you mean {meant}?), and names GpuLeaseClass {class:?} (label {LABEL_CLASS}), {}",
        match class_resource {
            Some(r) => format!("which hands out {r}"),
            None => "which does not exist".to_owned(),
        }
    )]
    NearMiss {
        /// What the pod asks for.
        requested: String,
        /// The class resources it resembles.
        meant: String,
        /// The class the label names.
        class: String,
        /// The resource that class hands out, when it exists.
        class_resource: Option<String>,
    },
    /// The pod asks for more slots than any matching node has.
    #[error(
        "the pod requests {requested} {resource} slots but the largest node of GpuLeaseClass {class:?} has {largest} ({node})"
    )]
    TooLarge {
        /// Slots requested.
        requested: u32,
        /// The class's resource.
        resource: String,
        /// The class.
        class: String,
        /// Allocatable slots of the largest matching node.
        largest: u32,
        /// That node.
        node: String,
    },
    /// The class's queue is full for the pod's role.
    #[error(
        "GpuLeaseClass {class:?} already has {queued} queued {} (admission.maxQueued is {max}, counted for primaries and helpers apart); try again once the queue shrinks",
        role_plural(*role, *queued)
    )]
    QueueFull {
        /// The class.
        class: String,
        /// The pod's role: only leases of this role count.
        role: Role,
        /// Leases of the class and role waiting now.
        queued: usize,
        /// The class's bound.
        max: u32,
    },
    /// The pod names its node itself, which would bypass the queue.
    #[error(
        "the pod sets spec.nodeName ({node:?}) but requests {resource}: gpupool pods wait in the queue and are placed by the operator; remove spec.nodeName (use a nodeSelector to choose nodes)"
    )]
    NodeNameSet {
        /// The node the pod names.
        node: String,
        /// The gpupool resource it requests.
        resource: String,
    },
    /// An update changes a label or annotation fixed at creation.
    #[error(
        "{what} {key} cannot be changed after the pod is created (it decides the pod's class, role or place in the queue); delete and recreate the pod instead"
    )]
    Immutable {
        /// `label` or `annotation`.
        what: &'static str,
        /// The key.
        key: &'static str,
    },
    /// Someone other than the operator wrote what only the operator may.
    #[error("user {user:?} may not {what}: GpuLeases are written by the gpupool operator")]
    LeaseWrite {
        /// The user who tried.
        user: String,
        /// What they tried.
        what: String,
    },
    /// A class names a resource that is not an extended resource.
    #[error(
        "GpuLeaseClass {class:?}: resourceName {resource:?} is not an extended resource (a domain-qualified name such as gpupool/slot, outside the kubernetes.io domain)"
    )]
    NotExtendedResource {
        /// The class.
        class: String,
        /// The name it gave.
        resource: String,
    },
    /// A class claims the default while another one holds it.
    #[error(
        "GpuLeaseClass {default:?} is already the default; at most one class may be marked default: true (set default: false on {default:?} first, or leave it out of {class:?})"
    )]
    SecondDefault {
        /// The class being written.
        class: String,
        /// The class that is the default now.
        default: String,
    },
    /// Someone other than the operator removed the scheduling gate.
    #[error(
        "only the gpupool operator ({}) may remove the scheduling gate {SCHEDULING_GATE}; user {user:?} may not",
        quoted(owners)
    )]
    GateRemoval {
        /// The user who tried.
        user: String,
        /// The users allowed to.
        owners: Vec<String>,
    },
}

fn role_plural(role: Role, n: usize) -> &'static str {
    match (role, n) {
        (Role::Primary, 1) => "primary",
        (Role::Primary, _) => "primaries",
        (Role::Helper, 1) => "helper",
        (Role::Helper, _) => "helpers",
    }
}

fn quoted(items: &[String]) -> String {
    items
        .iter()
        .map(|s| format!("{s:?}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// What the webhook answers.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// Let the object through unchanged.
    Allow,
    /// Let it through with this JSON patch applied.
    Patch(Patch),
    /// Let it through untouched, with a warning for its creator (kubectl
    /// prints it): it looks meant for gpupool but will not be queued.
    Warn(String),
    /// Refuse it.
    Deny(Denial),
}

impl Decision {
    /// Short label for metrics and logs: `allowed`, `patched` or `denied`.
    pub fn outcome(&self) -> &'static str {
        match self {
            Decision::Allow | Decision::Warn(_) => "allowed",
            Decision::Patch(_) => "patched",
            Decision::Deny(_) => "denied",
        }
    }

    /// The AdmissionResponse for `request`: denials carry HTTP 403 and the
    /// message; patches are JSONPatch.
    pub fn into_response<K: kube::Resource>(
        self,
        request: &AdmissionRequest<K>,
    ) -> AdmissionResponse {
        let response = AdmissionResponse::from(request);
        match self {
            Decision::Allow => response,
            Decision::Warn(warning) => {
                let mut r = response;
                r.warnings = Some(vec![warning]);
                r
            }
            Decision::Patch(patch) => match response.clone().with_patch(patch) {
                Ok(r) => r,
                // A patch of strings and objects always serializes; should it
                // not, refusing is safer than admitting an ungated pod.
                Err(e) => response.deny(format!("internal error: cannot encode the patch: {e}")),
            },
            Decision::Deny(denial) => {
                let mut r = response.deny(denial.to_string());
                r.result.code = 403;
                r.result.reason = "Forbidden".to_owned();
                r
            }
        }
    }
}

/// Reviews a pod CREATE for the mutating webhook at time `now`.
///
/// A pod that requests no extended resource at all is allowed without
/// consulting `view`. A pod that requests none of the classes' resources
/// (nor `gpupool/slot`) is allowed untouched. Otherwise the pod is denied
/// with a [`Denial`] or patched: the gate is appended to its scheduling gates
/// (unless already there) and `gpupool.io/enqueued-at` is set to `now`,
/// replacing any value the pod came with, so that no client can choose its
/// own place in the queue.
pub fn mutate(
    request: &AdmissionRequest<Pod>,
    view: &impl ClusterView,
    now: Timestamp,
) -> Decision {
    if request.operation != Operation::Create {
        return Decision::Allow;
    }
    let Some(pod) = request.object.as_ref() else {
        return Decision::Deny(Denial::MissingObject {
            operation: "CREATE".to_owned(),
        });
    };
    let Some(spec) = pod.spec.as_ref() else {
        return Decision::Allow;
    };
    if !requests_extended_resources(spec) {
        return Decision::Allow;
    }
    match queue_decision(pod, spec, view) {
        Ok(Queueing::Queue) => Decision::Patch(gate_and_stamp(pod, spec, now)),
        Ok(Queueing::NotGpupool) => Decision::Allow,
        Ok(Queueing::NearMiss { miss, handed_out }) => Decision::Warn(format!(
            "gpupool: the pod requests {}, which no GpuLeaseClass hands out, so it gets no place in gpupool's queue and may stay Pending; the classes hand out {} (did you mean {}?)",
            miss.requested,
            handed_out.join(", "),
            miss.meant.join(" or ")
        )),
        Err(denial) => Decision::Deny(denial),
    }
}

/// What the mutating webhook does with a pod that asks for an extended
/// resource.
enum Queueing {
    /// A gpupool pod: gate and stamp it.
    Queue,
    /// Not gpupool's: let it through untouched.
    NotGpupool,
    /// Not gpupool's, but it looks meant to be: let it through with a warning.
    NearMiss {
        miss: near_miss::NearMiss,
        handed_out: Vec<String>,
    },
}

fn queue_decision(pod: &Pod, spec: &PodSpec, view: &impl ClusterView) -> Result<Queueing, Denial> {
    let classes = view.classes();
    let mut resources: Vec<&str> = classes
        .iter()
        .map(|c| c.spec.resource_name.as_str())
        .chain(std::iter::once(DEFAULT_RESOURCE_NAME))
        .collect();
    resources.sort_unstable();
    resources.dedup();
    let mentioned: Vec<&str> = resources
        .iter()
        .copied()
        .filter(|r| pod::mentions_resource(spec, r))
        .collect();
    let Some(first) = mentioned.first() else {
        return near_miss(pod, spec, &classes, &resources);
    };

    let class = resolve_class(pod, &classes, first)?;
    let class_name = class.name_any();
    let role = pod::role(pod)?;
    let resource = class.spec.resource_name.as_str();
    let slots = pod::requested_slots(spec, resource)?;
    for other in mentioned.iter().filter(|r| **r != resource) {
        if pod::requested_slots(spec, other)? > 0 {
            return Err(Denial::ForeignResource {
                resource: (*other).to_owned(),
                class: class_name,
                class_resource: resource.to_owned(),
            });
        }
    }
    if slots == 0 {
        return Ok(Queueing::NotGpupool);
    }
    if let Some(node) = spec.node_name.as_deref().filter(|n| !n.is_empty()) {
        return Err(Denial::NodeNameSet {
            node: node.to_owned(),
            resource: resource.to_owned(),
        });
    }

    // The engine's own rule, on the engine's own view of the nodes, so the
    // webhook never refuses what the engine would admit, nor the reverse.
    let resources = BTreeSet::from([resource.to_owned()]);
    let engine_class = translate::class_info(class);
    let engine_pod = translate::pod_info(pod, &resources, Timestamp::UNIX_EPOCH);
    if let (Some(engine_class), Some(engine_pod)) = (engine_class, engine_pod) {
        let largest = view
            .largest_node(&engine_class, &engine_pod)
            .map_err(|reason| Denial::InvalidNodeSelector {
                class: class_name.clone(),
                reason,
            })?;
        if let Some((node, largest)) = largest
            && slots > largest
        {
            return Err(Denial::TooLarge {
                requested: slots,
                resource: resource.to_owned(),
                class: class_name,
                largest,
                node,
            });
        }
    }

    let max = class.spec.admission.max_queued;
    if max > 0 {
        // Primaries and helpers are bounded apart, so queued helpers can
        // never lock primaries out (nor the other way round).
        let queued = view.queued(&class_name, role);
        if queued >= max as usize {
            return Err(Denial::QueueFull {
                class: class_name,
                role,
                queued,
                max,
            });
        }
    }
    Ok(Queueing::Queue)
}

/// A lease with no status yet has just been created and waits like a Queued one.
/// What a lease that counts toward its class's `maxQueued` is counted
/// under: its class and role. A lease counts while it has no status yet
/// or its phase is Queued. The lease cache tallies leases by this rule,
/// so a review reads a count instead of walking every lease.
pub fn queue_tally_key(lease: &CachedLease) -> Option<String> {
    let queued = lease
        .status
        .as_ref()
        .is_none_or(|s| s.phase == LeasePhase::Queued);
    queued.then(|| queue_key(&lease.spec.class_name, lease.spec.role))
}

/// The tally key of `class` and `role` (a class name holds no `/`).
pub fn queue_key(class: &str, role: Role) -> String {
    format!("{class}/{role}")
}

fn resolve_class<'a>(
    pod: &Pod,
    classes: &'a [Arc<GpuLeaseClass>],
    resource: &str,
) -> Result<&'a GpuLeaseClass, Denial> {
    if let Some(name) = pod::class_label(pod) {
        return classes
            .iter()
            .find(|c| c.metadata.name.as_deref() == Some(name))
            .map(|c| c.as_ref())
            .ok_or_else(|| Denial::UnknownClass {
                class: name.to_owned(),
            });
    }
    let defaults = classes.iter().filter(|c| c.spec.default).filter_map(|c| {
        Some((
            c.metadata.name.as_deref()?,
            c.metadata.creation_timestamp.as_ref().map(|t| t.0),
        ))
    });
    let default = established_default(defaults);
    classes
        .iter()
        .find(|c| {
            c.metadata
                .name
                .as_deref()
                .is_some_and(|n| Some(n) == default)
        })
        .map(|c| c.as_ref())
        .ok_or_else(|| Denial::NoClass {
            resource: resource.to_owned(),
        })
}

/// A pod that asks for no resource a class hands out: a near miss of one
/// is denied when the pod names a class (it plainly wants gpupool), and let
/// through with a warning otherwise; anything else is not gpupool's.
fn near_miss(
    pod: &Pod,
    spec: &PodSpec,
    classes: &[Arc<GpuLeaseClass>],
    handed_out: &[&str],
) -> Result<Queueing, Denial> {
    let requested = extended_resources(spec);
    let Some(miss) = near_miss::find(&requested, handed_out) else {
        return Ok(Queueing::NotGpupool);
    };
    if let Some(class) = pod::class_label(pod) {
        let class_resource = classes
            .iter()
            .find(|c| c.metadata.name.as_deref() == Some(class))
            .map(|c| c.spec.resource_name.clone());
        return Err(Denial::NearMiss {
            requested: miss.requested,
            meant: miss.meant.join(" or "),
            class: class.to_owned(),
            class_resource,
        });
    }
    Ok(Queueing::NearMiss {
        miss,
        handed_out: handed_out.iter().map(|r| (*r).to_owned()).collect(),
    })
}

/// The domain-qualified resources any container or init container requests
/// or limits, sorted, each once.
fn extended_resources(spec: &PodSpec) -> Vec<&str> {
    let mut found: Vec<&str> = spec
        .containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
        .filter_map(|c| c.resources.as_ref())
        .flat_map(|r| [r.requests.as_ref(), r.limits.as_ref()])
        .flatten()
        .flat_map(|m| m.keys())
        .map(String::as_str)
        .filter(|k| k.contains('/'))
        .collect();
    found.sort_unstable();
    found.dedup();
    found
}

/// True when some container requests or limits a domain-qualified (extended)
/// resource; every gpupool resource is one, while cpu, memory and friends are not.
fn requests_extended_resources(spec: &PodSpec) -> bool {
    let extended = |c: &Container| {
        c.resources.as_ref().is_some_and(|r| {
            [r.requests.as_ref(), r.limits.as_ref()]
                .into_iter()
                .flatten()
                .any(|m| m.keys().any(|k| k.contains('/')))
        })
    };
    spec.containers.iter().any(extended) || spec.init_containers.iter().flatten().any(extended)
}

fn pointer(tokens: &[&str]) -> PointerBuf {
    PointerBuf::from_tokens(tokens.iter().copied())
}

fn add(path: PointerBuf, value: Value) -> PatchOperation {
    PatchOperation::Add(AddOperation { path, value })
}

fn gate_and_stamp(pod: &Pod, spec: &PodSpec, now: Timestamp) -> Patch {
    let mut ops = Vec::with_capacity(2);
    match spec.scheduling_gates.as_ref() {
        None => ops.push(add(
            pointer(&["spec", "schedulingGates"]),
            json!([{ "name": SCHEDULING_GATE }]),
        )),
        Some(gates) if gates.iter().any(|g| g.name == SCHEDULING_GATE) => {}
        Some(_) => ops.push(add(
            pointer(&["spec", "schedulingGates", "-"]),
            json!({ "name": SCHEDULING_GATE }),
        )),
    }
    let stamp = Value::String(gpupool_api::time::format_micros(now));
    if pod.metadata.annotations.is_some() {
        ops.push(add(
            pointer(&["metadata", "annotations", ANNOTATION_ENQUEUED_AT]),
            stamp,
        ));
    } else {
        ops.push(add(
            pointer(&["metadata", "annotations"]),
            json!({ ANNOTATION_ENQUEUED_AT: stamp }),
        ));
    }
    Patch(ops)
}

/// Reviews a pod UPDATE for the validating webhook. Removing the
/// `gpupool.io/admission` gate is denied unless `userInfo.username` is one of
/// `owners`; changing the `gpupool.io/class` or `gpupool.io/role` label or
/// the `gpupool.io/enqueued-at` stamp of a pod that requests an extended
/// resource is denied to every user (they fix the pod's class, role and
/// place in the queue). Every other update is allowed, without consulting
/// any store. (The webhook configuration sends no update by the operator
/// itself here: its own writes are trusted.)
pub fn validate(request: &AdmissionRequest<Pod>, owners: &Users) -> Decision {
    if request.operation != Operation::Update {
        return Decision::Allow;
    }
    let (Some(old), Some(new)) = (request.old_object.as_ref(), request.object.as_ref()) else {
        return Decision::Deny(Denial::MissingObject {
            operation: "UPDATE".to_owned(),
        });
    };
    if old.spec.as_ref().is_some_and(requests_extended_resources) {
        let label =
            |p: &Pod, key: &str| p.metadata.labels.as_ref().and_then(|l| l.get(key)).cloned();
        for key in [LABEL_CLASS, LABEL_ROLE] {
            if label(old, key) != label(new, key) {
                return Decision::Deny(Denial::Immutable { what: "label", key });
            }
        }
        let stamp = |p: &Pod| {
            p.metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(ANNOTATION_ENQUEUED_AT))
                .cloned()
        };
        if stamp(old).is_some() && stamp(old) != stamp(new) {
            return Decision::Deny(Denial::Immutable {
                what: "annotation",
                key: ANNOTATION_ENQUEUED_AT,
            });
        }
    }
    if !has_gate(old) || has_gate(new) {
        return Decision::Allow;
    }
    let user = request.user_info.username.as_deref().unwrap_or_default();
    if owners.contains(user) {
        Decision::Allow
    } else {
        Decision::Deny(Denial::GateRemoval {
            user: user.to_owned(),
            owners: owners.users().to_vec(),
        })
    }
}

fn has_gate(pod: &Pod) -> bool {
    pod.spec
        .as_ref()
        .and_then(|s| s.scheduling_gates.as_ref())
        .is_some_and(|g| g.iter().any(|g| g.name == SCHEDULING_GATE))
}

/// Serializes `response` as an AdmissionReview v1 body. The JSON patch is
/// written as a base64 string, the encoding the Kubernetes API server's Go
/// decoder documents for `[]byte` fields.
pub fn response_body(response: AdmissionResponse) -> Result<Vec<u8>, serde_json::Error> {
    let mut review = serde_json::to_value(response.into_review())?;
    if let Some(patch) = review.pointer_mut("/response/patch") {
        let bytes: Vec<u8> = serde_json::from_value(patch.take())?;
        *patch = serde_json::to_value(ByteString(bytes))?;
    }
    serde_json::to_vec(&review)
}

/// Which webhook a request was sent to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WebhookKind {
    /// Pod CREATE: queue the pod ([`mutate`]).
    Mutate,
    /// Pod UPDATE: guard the gate and the queue labels ([`validate`]).
    Validate,
    /// GpuLease CREATE/UPDATE: only the operator writes leases ([`validate_lease`]).
    Lease,
    /// GpuLeaseClass CREATE/UPDATE: semantic checks ([`validate_class`]).
    Class,
}

impl WebhookKind {
    /// Label for metrics and logs: `mutate`, `validate`, `lease` or `class`.
    pub fn as_str(self) -> &'static str {
        match self {
            WebhookKind::Mutate => "mutate",
            WebhookKind::Validate => "validate",
            WebhookKind::Lease => "lease",
            WebhookKind::Class => "class",
        }
    }

    /// The kind of object this webhook reviews, as `group/Kind`.
    fn reviews(self) -> (&'static str, &'static str) {
        match self {
            WebhookKind::Mutate | WebhookKind::Validate => ("", "Pod"),
            WebhookKind::Lease => ("gpupool.io", "GpuLease"),
            WebhookKind::Class => ("gpupool.io", "GpuLeaseClass"),
        }
    }
}

/// A request body the webhook cannot answer with an AdmissionReview.
#[derive(Debug, thiserror::Error)]
pub enum BadReview {
    /// The body is not an AdmissionReview carrying the expected object.
    #[error("malformed AdmissionReview: {0}")]
    Malformed(#[source] serde_json::Error),
    /// The AdmissionReview has no `request`.
    #[error("malformed AdmissionReview: it carries no request")]
    NoRequest,
    /// The request is about another kind than the webhook reviews.
    #[error("this webhook reviews {expected}, not {got}")]
    WrongKind {
        /// What the webhook reviews.
        expected: String,
        /// What the request carries.
        got: String,
    },
    /// The response could not be encoded (a server fault, not the caller's).
    #[error("cannot encode the AdmissionReview response: {0}")]
    Encode(#[source] serde_json::Error),
}

/// Answers one AdmissionReview body: parses it, decides with the webhook's
/// function ([`mutate`], [`validate`], [`validate_lease`],
/// [`validate_class`]), and returns the response body with the decision's
/// [`Decision::outcome`].
pub fn review_body(
    kind: WebhookKind,
    body: &[u8],
    view: &impl ClusterView,
    identities: &Identities,
    now: Timestamp,
) -> Result<(Vec<u8>, &'static str), BadReview> {
    match kind {
        WebhookKind::Mutate => answer(kind, body, |r| mutate(r, view, now)),
        WebhookKind::Validate => answer(kind, body, |r| validate(r, &identities.operator)),
        WebhookKind::Lease => answer(kind, body, |r| validate_lease(r, identities)),
        WebhookKind::Class => answer(kind, body, |r| validate_class(r, view)),
    }
}

fn answer<K>(
    kind: WebhookKind,
    body: &[u8],
    decide: impl FnOnce(&AdmissionRequest<K>) -> Decision,
) -> Result<(Vec<u8>, &'static str), BadReview>
where
    K: kube::Resource + serde::de::DeserializeOwned,
{
    let review: AdmissionReview<K> = serde_json::from_slice(body).map_err(BadReview::Malformed)?;
    let request: AdmissionRequest<K> = review.try_into().map_err(|_| BadReview::NoRequest)?;
    let (group, object_kind) = kind.reviews();
    if !(request.kind.group == group && request.kind.kind == object_kind) {
        return Err(BadReview::WrongKind {
            expected: format!(
                "{object_kind} ({})",
                if group.is_empty() { "core" } else { group }
            ),
            got: format!(
                "{}/{} {}",
                request.kind.group, request.kind.version, request.kind.kind
            ),
        });
    }
    let decision = decide(&request);
    if let Decision::Deny(denial) = &decision {
        tracing::info!(
            webhook = kind.as_str(),
            namespace = request.namespace.as_deref().unwrap_or_default(),
            name = request.name.as_str(),
            user = request.user_info.username.as_deref().unwrap_or_default(),
            %denial,
            "denied"
        );
    }
    let outcome = decision.outcome();
    let body = response_body(decision.into_response(&request)).map_err(BadReview::Encode)?;
    Ok((body, outcome))
}

#[cfg(test)]
#[path = "review_tests.rs"]
mod tests;
