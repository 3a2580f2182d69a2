//! The pod as the operator keeps it: only the fields the admission rules
//! and the admission patch read, deserialized straight from the API
//! server's JSON.
//!
//! A `k8s_openapi` Pod stays large in memory even after its big fields are
//! cleared, because every optional field of the pod, its spec and each
//! container has room reserved inline, and a queued cluster keeps one per
//! pod. This type never allocates what it does not keep: unknown fields
//! are skipped by the deserializer.
//!
//! Its metadata is likewise only the identity and timestamps the rules
//! read ([`CachedMeta`]): an `ObjectMeta` reserves room inline for every
//! field, most of them empty options, for every pod. A watch or a write reads the JSON
//! into a [`WatchedPod`] (kube's watcher needs an `ObjectMeta` to follow
//! resourceVersions), which becomes the kept [`CachedPod`] at once; its
//! metadata is read with [`kept_metadata`], so the managed fields, owner
//! references and the labels and annotations not kept are never built.
//!
//! The rules read it as they read a whole [`Pod`]: it implements the
//! engine's [`PodSource`] (and `gpupool_api::pod`'s traits for its labels
//! and containers), the reads the one translation makes, so the controller
//! and the webhook (which reviews whole pods) translate pods with the same
//! function, and no whole `Pod` is rebuilt to be read.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::Arc;

use gpupool_api::names::{
    ANNOTATION_ENQUEUED_AT, DEFAULT_RESOURCE_NAME, LABEL_CLASS, LABEL_HOSTNAME, LABEL_ROLE,
    SCHEDULING_GATE,
};
use gpupool_api::pod::{ContainerFields, PodContainers, PodLabels};
use gpupool_engine::translate::{PodScheduled, PodSource, PodSpecSource};
use gpupool_engine::{CachedMeta, SmallMap};
use jiff::Timestamp;
use k8s_openapi::api::core::v1::{Affinity, NodeSelector, Pod, PodSchedulingGate, Toleration};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use serde::{Deserialize, Deserializer};

use super::watched::{KEPT_ANNOTATIONS, KEPT_LABELS, kept_metadata, watched_form_of};

/// The strings nearly every kept pod carries: the label and annotation
/// keys, the admission gate, the default resource, the roles, the phases,
/// the node pin's key, the small whole quantities a GPU request is and
/// what the `PodScheduled` condition of a gated or unplaceable pod says. A
/// pod keeps a borrowed one instead of a copy of its own, so these cost no
/// allocation however many pods are cached. Any other string (a
/// class or a node's name, a tenant's own values) is the pod's own, so no
/// tenant can grow this list.
const KNOWN: [&str; 28] = [
    LABEL_CLASS,
    LABEL_ROLE,
    ANNOTATION_ENQUEUED_AT,
    SCHEDULING_GATE,
    DEFAULT_RESOURCE_NAME,
    LABEL_HOSTNAME,
    "primary",
    "helper",
    "Pending",
    "Running",
    "Succeeded",
    "Failed",
    "Unknown",
    "0",
    "1",
    "2",
    "3",
    "4",
    "5",
    "6",
    "7",
    "8",
    "Always",
    "True",
    "False",
    REASON_UNSCHEDULABLE,
    "SchedulingGated",
    // What the scheduler says of every gated pod.
    "Scheduling is blocked due to non-empty scheduling gates",
];

pub use crate::engine::translate::{POD_SCHEDULED, REASON_UNSCHEDULABLE};

/// A string as a kept pod holds it: borrowed when it is one of the strings
/// nearly every kept pod carries (keys, roles, phases and the like), else its own.
pub type KeptStr = Cow<'static, str>;

/// `s`, borrowed from [`KNOWN`] when it is one of those.
fn kept_str(s: String) -> KeptStr {
    match KNOWN.iter().find(|k| **k == s) {
        Some(known) => Cow::Borrowed(known),
        None => Cow::Owned(s),
    }
}

/// A pod trimmed to what admission reads. Guarantee: translating it (the
/// engine's `pod_info` reads it through [`PodSource`]) gives the same
/// engine input as translating the whole pod it was read from, and so does
/// every other rule that reads a [`PodSource`] (the admission patch).
/// Deserializing one reads a [`WatchedPod`] and keeps what this type holds.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(from = "WatchedPod")]
pub struct CachedPod {
    /// Identity, resourceVersion and timestamps.
    pub metadata: CachedMeta,
    /// The class and role labels, as a short sorted list (a map allocates
    /// a whole node even for one entry, and every queued pod has one).
    pub labels: SmallMap<KeptStr, KeptStr>,
    /// The enqueue stamp annotation, likewise.
    pub annotations: SmallMap<KeptStr, KeptStr>,
    /// The kept part of the spec.
    pub spec: Option<CachedPodSpec>,
    /// The kept part of the status.
    pub status: Option<CachedPodStatus>,
}

/// A pod as a watch or a write returns it, before its metadata is cut down
/// to [`CachedMeta`]: the form kube's watcher and API calls read, which must
/// carry an `ObjectMeta`. Nothing keeps one: it becomes a [`CachedPod`].
#[derive(Clone, Debug, Default, Deserialize)]
pub struct WatchedPod {
    /// The kept part of the metadata ([`kept_metadata`]): identity,
    /// timestamps and the kept labels and annotations.
    #[serde(deserialize_with = "kept_metadata")]
    pub metadata: ObjectMeta,
    /// The kept part of the spec.
    #[serde(default)]
    pub spec: Option<CachedPodSpec>,
    /// The kept part of the status.
    #[serde(default)]
    pub status: Option<CachedPodStatus>,
}

/// The part of a pod's spec admission reads.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CachedPodSpec {
    /// Set once the pod is bound.
    #[serde(default)]
    pub node_name: Option<String>,
    /// The pod's own node selector (and the operator's pin), as a short
    /// sorted list rather than a map (a map allocates a whole node even
    /// for the one pin).
    #[serde(default, deserialize_with = "string_map")]
    pub node_selector: Option<SmallMap<KeptStr, KeptStr>>,
    /// Kept whole but boxed: most pods have none.
    #[serde(default)]
    pub affinity: Option<Box<Affinity>>,
    /// Taints the pod tolerates; the list nearly every pod carries (see
    /// [`DEFAULT_TOLERATIONS`]) is shared rather than copied.
    #[serde(default, deserialize_with = "shared_tolerations")]
    pub tolerations: Option<Arc<[Toleration]>>,
    /// Every scheduling gate's name, in order: where the admission gate
    /// is, and whether another controller's gate still holds the pod.
    #[serde(default, deserialize_with = "gate_names")]
    pub scheduling_gates: Option<Box<[KeptStr]>>,
    /// App containers that request a resource a class can name: names
    /// and those resources only. Any other container takes no slot, so
    /// none is kept (a pod's sidecars cost nothing here).
    #[serde(default, deserialize_with = "slot_containers")]
    pub containers: Vec<CachedContainer>,
    /// Init containers, likewise, with their restart policy (sidecars).
    #[serde(default, deserialize_with = "slot_init_containers")]
    pub init_containers: Option<Vec<CachedContainer>>,
}

/// The part of a container admission reads.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CachedContainer {
    /// Named in errors about its request.
    #[serde(default)]
    pub name: String,
    /// Requests and limits, as short lists rather than maps: a map
    /// allocates a whole node even for one entry.
    #[serde(default)]
    pub resources: Option<CachedResources>,
    /// `Always` marks a sidecar init container, whose request adds up.
    #[serde(default, deserialize_with = "kept_str_opt")]
    pub restart_policy: Option<KeptStr>,
}

/// A container's requests and limits of resources a class can name
/// (claims are not read).
#[derive(Clone, Debug, Default, Deserialize)]
pub struct CachedResources {
    /// Requested quantities by resource name.
    #[serde(default, deserialize_with = "quantity_list")]
    pub requests: Box<[(KeptStr, KeptStr)]>,
    /// Limits by resource name.
    #[serde(default, deserialize_with = "quantity_list")]
    pub limits: Box<[(KeptStr, KeptStr)]>,
}

impl CachedContainer {
    /// Whether it requests or limits a resource a class can name.
    fn asks_for_slots(&self) -> bool {
        self.resources
            .as_ref()
            .is_some_and(|r| !r.requests.is_empty() || !r.limits.is_empty())
    }
}

/// Whether `resource` can be a class's: a class names a domain-qualified
/// extended resource (`domain/name`, the CRD's schema says so), never
/// `cpu`, `memory`, `ephemeral-storage` or `hugepages-*`. The cached pod
/// keeps only these: a real pod's CPU and memory requests and limits
/// would otherwise be eight strings per container that no rule reads.
fn may_be_class_resource(resource: &str) -> bool {
    resource.contains('/')
}

/// A JSON map of strings (or null), kept short.
fn string_map<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<SmallMap<KeptStr, KeptStr>>, D::Error> {
    let map: Option<BTreeMap<String, String>> = Option::deserialize(d)?;
    Ok(map.map(|map| {
        map.into_iter()
            .map(|(k, v)| (kept_str(k), kept_str(v)))
            .collect()
    }))
}

/// A string (or null), borrowed when known.
fn kept_str_opt<'de, D: Deserializer<'de>>(d: D) -> Result<Option<KeptStr>, D::Error> {
    Ok(Option::<String>::deserialize(d)?.map(kept_str))
}

/// The names of a pod's scheduling gates (or null).
fn gate_names<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Box<[KeptStr]>>, D::Error> {
    let gates: Option<Vec<PodSchedulingGate>> = Option::deserialize(d)?;
    Ok(gates.map(|gates| gates.into_iter().map(|g| kept_str(g.name)).collect()))
}

/// The API server's default tolerations, kept once: see
/// [`crate::engine::translate::DEFAULT_TOLERATIONS`].
pub use crate::engine::translate::DEFAULT_TOLERATIONS;

/// A pod's tolerations (or null), sharing [`DEFAULT_TOLERATIONS`] when
/// the list is exactly that.
fn shared_tolerations<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<Arc<[Toleration]>>, D::Error> {
    let list: Option<Vec<Toleration>> = Option::deserialize(d)?;
    Ok(list.map(|list| {
        if list[..] == DEFAULT_TOLERATIONS[..] {
            DEFAULT_TOLERATIONS.clone()
        } else {
            list.into()
        }
    }))
}

/// A JSON map of quantities (or null) as a list in key order, of the
/// resources a class can name only.
fn quantity_list<'de, D: Deserializer<'de>>(d: D) -> Result<Box<[(KeptStr, KeptStr)]>, D::Error> {
    let map: Option<BTreeMap<String, Quantity>> = Option::deserialize(d)?;
    Ok(map
        .unwrap_or_default()
        .into_iter()
        .filter(|(k, _)| may_be_class_resource(k))
        .map(|(k, q)| (kept_str(k), kept_str(q.0)))
        .collect())
}

/// A list of containers (or null), keeping those that ask for slots.
fn slot_container_list<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<Vec<CachedContainer>>, D::Error> {
    let list: Option<Vec<CachedContainer>> = Option::deserialize(d)?;
    Ok(list.map(|mut list| {
        list.retain(CachedContainer::asks_for_slots);
        list.shrink_to_fit();
        list
    }))
}

/// The app containers that ask for slots.
fn slot_containers<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<CachedContainer>, D::Error> {
    Ok(slot_container_list(d)?.unwrap_or_default())
}

/// The init containers that ask for slots; none when none does.
fn slot_init_containers<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<Vec<CachedContainer>>, D::Error> {
    Ok(slot_container_list(d)?.filter(|list| !list.is_empty()))
}

/// The part of a pod's status admission reads.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct CachedPodStatus {
    /// Pending, Running, Succeeded, Failed or Unknown.
    #[serde(default, deserialize_with = "kept_str_opt")]
    pub phase: Option<KeptStr>,
    /// Why the kubelet failed the pod (`UnexpectedAdmissionError`,
    /// `Evicted`, …). The kubelet sets it, with [`Self::message`], on pods
    /// it fails or evicts, so a running pod's costs nothing; only a Failed
    /// pod's reaches the engine.
    #[serde(default)]
    pub reason: Option<String>,
    /// The kubelet's words with the reason.
    #[serde(default)]
    pub message: Option<String>,
    /// The `PodScheduled` condition, the one condition read (whether the
    /// scheduler can place an admitted pod); any other (Ready,
    /// Initialized, …) is dropped. Boxed, so that a pod without one pays
    /// a pointer, not the condition's room; a gated pod's strings are
    /// borrowed (see `KNOWN`), so its condition costs one small allocation.
    #[serde(default, rename = "conditions", deserialize_with = "pod_scheduled")]
    pub scheduled: Option<Box<CachedCondition>>,
}

/// A pod's `PodScheduled` condition, as kept (its type is implied).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CachedCondition {
    /// `True`, `False` or `Unknown`.
    pub status: KeptStr,
    /// Why, in one word (`Unschedulable`, `SchedulingGated`).
    pub reason: Option<KeptStr>,
    /// The scheduler's words (which resources no node had enough of).
    pub message: Option<KeptStr>,
    /// When the status last changed: since when the pod has been
    /// unplaceable.
    pub last_transition_time: Option<Time>,
}

/// One pod condition as read off the wire, before all but `PodScheduled`
/// are dropped.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct WireCondition {
    #[serde(rename = "type", default)]
    type_: String,
    #[serde(default)]
    status: String,
    #[serde(default)]
    reason: Option<String>,
    #[serde(default)]
    message: Option<String>,
    #[serde(default)]
    last_transition_time: Option<Time>,
}

/// The `PodScheduled` condition of a list of conditions (or null).
fn pod_scheduled<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<Box<CachedCondition>>, D::Error> {
    let list: Option<Vec<WireCondition>> = Option::deserialize(d)?;
    Ok(list
        .into_iter()
        .flatten()
        .find(|c| c.type_ == POD_SCHEDULED)
        .map(|c| {
            Box::new(CachedCondition {
                status: kept_str(c.status),
                reason: c.reason.map(kept_str),
                message: c.message.map(kept_str),
                last_transition_time: c.last_transition_time,
            })
        }))
}

watched_form_of!(WatchedPod => Pod);

/// Keeps of a pod what admission reads: its identity and timestamps, the
/// labels and annotations it reads (any other, a tenant's own included, is
/// dropped), the kept spec and status. Managed fields and owner references
/// go with the rest of the metadata.
impl From<WatchedPod> for CachedPod {
    fn from(pod: WatchedPod) -> Self {
        let kept =
            |map: Option<BTreeMap<String, String>>, keys: &[&str]| -> SmallMap<KeptStr, KeptStr> {
                map.into_iter()
                    .flatten()
                    .filter(|(k, _)| keys.contains(&k.as_str()))
                    .map(|(k, v)| (kept_str(k), kept_str(v)))
                    .collect()
            };
        let mut meta = pod.metadata;
        Self {
            labels: kept(meta.labels.take(), &KEPT_LABELS),
            annotations: kept(meta.annotations.take(), &KEPT_ANNOTATIONS),
            metadata: meta.into(),
            spec: pod.spec,
            status: pod.status,
        }
    }
}

impl CachedPod {
    /// Whether any of its containers asks for a resource a class can name.
    /// A pod that does not can never take a slot, queue or be counted on a
    /// node, whatever classes exist then, and never will: a pod's
    /// containers and their extended resources cannot change after it is
    /// created. So the pod cache keeps only pods for which this holds, and
    /// the operator's memory grows with the GPU pods, not the cluster's.
    pub fn may_take_slots(&self) -> bool {
        self.spec.as_ref().is_some_and(|s| {
            !s.containers.is_empty() || s.init_containers.as_ref().is_some_and(|c| !c.is_empty())
        })
    }

    /// The value of annotation `key`, when it is one the pod keeps.
    pub fn annotation(&self, key: &str) -> Option<&str> {
        self.annotations.get(key).map(|v| &**v)
    }
}

/// The class and role labels, read as a whole pod's are.
impl PodLabels for CachedPod {
    fn label(&self, key: &str) -> Option<&str> {
        self.labels.get(key).map(|v| &**v)
    }
}

/// What the translation reads, answered from the kept fields exactly as
/// the whole pod would answer it: the guarantee [`CachedPod`] states, which
/// the tests below check against the whole pod's translation.
impl PodSource for CachedPod {
    type Spec = CachedPodSpec;

    fn namespace(&self) -> Option<&str> {
        self.metadata.namespace.as_deref()
    }

    fn name(&self) -> Option<&str> {
        self.metadata.name.as_deref()
    }

    fn uid(&self) -> Option<&str> {
        self.metadata.uid.as_deref()
    }

    fn created_at(&self) -> Option<Timestamp> {
        self.metadata.creation_timestamp.as_ref().map(|t| t.0)
    }

    fn deleting(&self) -> bool {
        self.metadata.deletion_timestamp.is_some()
    }

    fn annotation(&self, key: &str) -> Option<&str> {
        CachedPod::annotation(self, key)
    }

    fn spec(&self) -> Option<&CachedPodSpec> {
        self.spec.as_ref()
    }

    fn phase(&self) -> Option<&str> {
        self.status.as_ref()?.phase.as_deref()
    }

    fn status_reason(&self) -> Option<&str> {
        self.status.as_ref()?.reason.as_deref()
    }

    fn status_message(&self) -> Option<&str> {
        self.status.as_ref()?.message.as_deref()
    }

    fn pod_scheduled(&self) -> Option<PodScheduled<'_>> {
        let condition = self.status.as_ref()?.scheduled.as_deref()?;
        Some(PodScheduled {
            status: &condition.status,
            reason: condition.reason.as_deref(),
            message: condition.message.as_deref(),
            last_transition_time: condition.last_transition_time.as_ref().map(|t| t.0),
        })
    }
}

/// The kept containers. Those not kept ask for no resource a class can
/// name, so they add nothing to any such resource's effective request.
impl PodContainers for CachedPodSpec {
    type Container = CachedContainer;

    fn containers(&self) -> impl Iterator<Item = &CachedContainer> {
        self.containers.iter()
    }

    fn init_containers(&self) -> impl Iterator<Item = &CachedContainer> {
        self.init_containers.iter().flatten()
    }
}

impl PodSpecSource for CachedPodSpec {
    fn node_name(&self) -> Option<&str> {
        self.node_name.as_deref()
    }

    fn node_selector(&self) -> Option<impl Iterator<Item = (&str, &str)>> {
        let selector = self.node_selector.as_ref()?;
        Some(selector.iter().map(|(k, v)| (&**k, &**v)))
    }

    fn required_node_affinity(&self) -> Option<&NodeSelector> {
        self.affinity
            .as_deref()?
            .node_affinity
            .as_ref()?
            .required_during_scheduling_ignored_during_execution
            .as_ref()
    }

    fn tolerations(&self) -> Option<&[Toleration]> {
        // The shared default list is handed out as itself, which the
        // translation recognises by its address.
        self.tolerations.as_deref()
    }

    fn scheduling_gates(&self) -> impl Iterator<Item = &str> {
        self.scheduling_gates.iter().flatten().map(|g| &**g)
    }
}

/// A kept container's quantities are plain strings, read by the same slot
/// rules as a whole container's.
impl ContainerFields for CachedContainer {
    type Quantity = str;

    fn name(&self) -> &str {
        &self.name
    }

    fn request(&self, resource: &str) -> Option<&str> {
        let resources = self.resources.as_ref()?;
        find_quantity(&resources.requests, resource)
    }

    fn limit(&self, resource: &str) -> Option<&str> {
        let resources = self.resources.as_ref()?;
        find_quantity(&resources.limits, resource)
    }

    fn restart_policy(&self) -> Option<&str> {
        self.restart_policy.as_deref()
    }

    fn resource_names(&self) -> impl Iterator<Item = &str> {
        self.resources
            .iter()
            .flat_map(|r| r.requests.iter().chain(r.limits.iter()))
            .map(|(name, _)| &**name)
    }
}

/// The quantity of `resource` in a kept list (a handful of entries, so a
/// scan beats a search).
fn find_quantity<'a>(list: &'a [(KeptStr, KeptStr)], resource: &str) -> Option<&'a str> {
    list.iter()
        .find(|(name, _)| name == resource)
        .map(|(_, q)| &**q)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;
    use crate::controller::patch::admission_patch;
    use crate::index::identity::Identity;
    use crate::index::translate;
    use k8s_openapi::api::core::v1::{
        Container, PodCondition, PodSpec, PodStatus, ResourceRequirements,
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use kube::Resource;
    use serde_json::json;

    /// A whole pod holding exactly the kept fields: what the tests below
    /// serialize to see what is kept. Nothing outside them rebuilds one:
    /// the rules read a cached pod as it is.
    impl CachedPod {
        fn to_pod(&self) -> Pod {
            let container = |c: &CachedContainer| Container {
                name: c.name.clone(),
                resources: c.resources.as_ref().map(CachedResources::to_requirements),
                restart_policy: c.restart_policy.as_deref().map(str::to_owned),
                ..Container::default()
            };
            let map = |kept: &SmallMap<KeptStr, KeptStr>| {
                (!kept.is_empty()).then(|| {
                    kept.iter()
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .collect()
                })
            };
            Pod {
                metadata: ObjectMeta {
                    labels: map(&self.labels),
                    annotations: map(&self.annotations),
                    ..self.metadata.to_object_meta()
                },
                spec: self.spec.as_ref().map(|s| PodSpec {
                    node_name: s.node_name.clone(),
                    node_selector: s.node_selector.as_ref().map(|m| {
                        m.iter()
                            .map(|(k, v)| (k.to_string(), v.to_string()))
                            .collect()
                    }),
                    affinity: s.affinity.as_deref().cloned(),
                    tolerations: s.tolerations.as_deref().map(<[Toleration]>::to_vec),
                    scheduling_gates: s.scheduling_gates.as_ref().map(|names| {
                        names
                            .iter()
                            .map(|name| PodSchedulingGate {
                                name: name.to_string(),
                            })
                            .collect()
                    }),
                    containers: s.containers.iter().map(container).collect(),
                    init_containers: s
                        .init_containers
                        .as_ref()
                        .map(|cs| cs.iter().map(container).collect()),
                    ..PodSpec::default()
                }),
                status: self.status.as_ref().map(|s| PodStatus {
                    phase: s.phase.as_deref().map(str::to_owned),
                    reason: s.reason.clone(),
                    message: s.message.clone(),
                    conditions: s.scheduled.as_deref().map(|c| {
                        vec![PodCondition {
                            type_: POD_SCHEDULED.to_owned(),
                            status: c.status.to_string(),
                            reason: c.reason.as_deref().map(str::to_owned),
                            message: c.message.as_deref().map(str::to_owned),
                            last_transition_time: c.last_transition_time.clone(),
                            ..PodCondition::default()
                        }]
                    }),
                    ..PodStatus::default()
                }),
            }
        }
    }

    impl CachedResources {
        fn to_requirements(&self) -> ResourceRequirements {
            let map = |list: &[(KeptStr, KeptStr)]| {
                (!list.is_empty()).then(|| {
                    list.iter()
                        .map(|(k, q)| (k.to_string(), Quantity(q.to_string())))
                        .collect::<BTreeMap<_, _>>()
                })
            };
            ResourceRequirements {
                requests: map(&self.requests),
                limits: map(&self.limits),
                ..ResourceRequirements::default()
            }
        }
    }

    fn whole_pod() -> serde_json::Value {
        json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {
                "namespace": "ml", "name": "p", "uid": "u-1", "resourceVersion": "42",
                "creationTimestamp": "2026-01-01T00:00:00Z",
                "labels": {"gpupool.io/role": "helper", "gpupool.io/class": "fast", "app": "x",
                           "gpupool.io/mine": "y"},
                "annotations": {"gpupool.io/enqueued-at": "2026-01-01T00:00:00.000001Z", "big": "x",
                                "gpupool.io/notes": "a tenant's own"},
                "managedFields": [{"manager": "kubectl", "operation": "Update"}]
            },
            "spec": {
                "volumes": [{"name": "data", "emptyDir": {}}],
                "nodeSelector": {"zone": "a"},
                "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [{"matchExpressions": [
                        {"key": "gpu", "operator": "In", "values": ["h100"]}]}]}}},
                "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
                "schedulingGates": [{"name": "other"}, {"name": "gpupool.io/admission"}],
                "initContainers": [
                    {"name": "warm", "image": "i", "resources": {"limits": {"gpupool/slot": "3"}}},
                    {"name": "side", "image": "i", "restartPolicy": "Always",
                     "resources": {"requests": {"gpupool/slot": "1"}}}
                ],
                "containers": [{
                    "name": "main", "image": "i", "command": ["run"],
                    "env": [{"name": "A", "value": "1"}],
                    "resources": {"limits": {"gpupool/slot": "2", "cpu": "1", "example.com/nic": "1"}}
                }]
            },
            "status": {"phase": "Pending", "conditions": [
                {"type": "Initialized", "status": "True",
                 "lastTransitionTime": "2026-01-01T00:00:01Z"},
                {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                 "message": "0/3 nodes are available: 1 Insufficient cpu.",
                 "lastProbeTime": null, "lastTransitionTime": "2026-01-01T00:02:00Z"}
            ]}
        })
    }

    /// What the kubelet said of a pod it failed reaches the engine through
    /// the kept form; a running pod's status carries nothing of it.
    #[test]
    fn a_failed_pods_reason_and_message_reach_the_engine() {
        let failed = |phase: &str| -> CachedPod {
            serde_json::from_value(json!({
                "metadata": {"namespace": "ml", "name": "p", "uid": "u"},
                "spec": {"containers": [{"name": "c",
                    "resources": {"limits": {"gpupool/slot": "2"}}}]},
                "status": {"phase": phase, "reason": "UnexpectedAdmissionError",
                           "message": "Allocate failed: Requested: 2, Available: 1"}
            }))
            .expect("cached pod")
        };
        let resources = BTreeSet::from(["gpupool/slot".to_owned()]);
        let info = translate::pod_info(&failed("Failed"), &resources, jiff::Timestamp::UNIX_EPOCH)
            .expect("pod info");
        assert_eq!(
            info.failure.as_deref(),
            Some("UnexpectedAdmissionError: Allocate failed: Requested: 2, Available: 1")
        );
        let info = translate::pod_info(&failed("Running"), &resources, jiff::Timestamp::UNIX_EPOCH)
            .expect("pod info");
        assert_eq!(
            info.failure, None,
            "only a failed pod's words are kept for the lease"
        );
    }

    #[test]
    fn only_resources_a_class_can_name_and_the_containers_asking_for_them_are_kept() {
        let cached: CachedPod = serde_json::from_value(json!({
            "metadata": {"namespace": "ml", "name": "p"},
            "spec": {
                "initContainers": [
                    {"name": "fetch", "resources": {"requests": {"cpu": "1", "memory": "1Gi"}}},
                    {"name": "proxy", "restartPolicy": "Always",
                     "resources": {"limits": {"example.com/nic": "1", "hugepages-2Mi": "2Mi"}}}
                ],
                "containers": [
                    {"name": "log", "resources": {"requests": {"cpu": "100m"}, "limits": {"memory": "64Mi"}}},
                    {"name": "train", "resources": {
                        "requests": {"cpu": "8", "memory": "32Gi", "ephemeral-storage": "1Gi",
                                     "gpupool/slot": "2"},
                        "limits": {"memory": "32Gi", "gpupool/slot": "2"}}},
                    {"name": "idle"}
                ]
            }
        }))
        .expect("cached pod");
        assert!(cached.may_take_slots());
        let spec = cached.spec.as_ref().expect("spec");
        let names = |cs: &[CachedContainer]| cs.iter().map(|c| c.name.clone()).collect::<Vec<_>>();
        assert_eq!(names(&spec.containers), ["train"]);
        assert_eq!(
            names(spec.init_containers.as_deref().expect("init containers")),
            ["proxy"]
        );
        let train = spec.containers[0].resources.as_ref().expect("resources");
        let listed = |l: &[(KeptStr, KeptStr)]| {
            l.iter()
                .map(|(k, q)| format!("{k}={q}"))
                .collect::<Vec<_>>()
        };
        assert_eq!(listed(&train.requests), ["gpupool/slot=2"]);
        assert_eq!(listed(&train.limits), ["gpupool/slot=2"]);

        // A pod that asks for no such resource may never take a slot.
        let plain: CachedPod = serde_json::from_value(json!({
            "metadata": {"namespace": "ml", "name": "web"},
            "spec": {
                "initContainers": [{"name": "i", "resources": {"requests": {"cpu": "1"}}}],
                "containers": [{"name": "c", "resources": {"limits": {"memory": "1Gi"}}}]
            }
        }))
        .expect("cached pod");
        assert!(!plain.may_take_slots());
        let spec = plain.spec.as_ref().expect("spec");
        assert!(spec.containers.is_empty() && spec.init_containers.is_none());
        let bare: CachedPod = serde_json::from_value(
            json!({"metadata": {"name": "x"}, "spec": {"containers": null}}),
        )
        .expect("cached pod");
        assert!(!bare.may_take_slots());
        assert!(!CachedPod::default().may_take_slots());
    }

    #[test]
    fn the_cached_form_translates_as_the_whole_pod_does() {
        let whole: Pod = serde_json::from_value(whole_pod()).expect("pod");
        let cached: CachedPod = serde_json::from_value(whole_pod()).expect("cached pod");
        let resources = BTreeSet::from(["gpupool/slot".to_owned()]);
        let now = jiff::Timestamp::UNIX_EPOCH;
        let from_whole = translate::pod_info(&whole, &resources, now).expect("translates");
        // The cached pod is read as it is: no whole pod is rebuilt.
        let from_cached = translate::pod_info(&cached, &resources, now).expect("translates");
        assert_eq!(format!("{from_cached:?}"), format!("{from_whole:?}"));
        // 2 slots in the app container + 1 in the sidecar beat 3 in the
        // init container, which proves the restart policy was kept.
        assert_eq!(from_cached.requests["gpupool/slot"], 3);
        assert_eq!(
            translate::gate_index(&cached),
            translate::gate_index(&whole)
        );
        // Every gate is kept, not only gpupool's, and so is what the
        // scheduler said of the pod.
        assert_eq!(from_cached.other_gate.as_deref(), Some("other"));
        let unplaced = from_cached.unplaced.expect("the scheduler cannot place it");
        assert_eq!(
            unplaced.since,
            "2026-01-01T00:02:00Z"
                .parse::<jiff::Timestamp>()
                .expect("t")
        );
        assert_eq!(
            unplaced.message.as_deref(),
            Some("0/3 nodes are available: 1 Insufficient cpu.")
        );
    }

    /// The scheduler's word reaches the engine through the kept form
    /// whatever it says, and only the `PodScheduled` condition is kept.
    #[test]
    fn the_pod_scheduled_condition_translates_as_the_whole_pod_does() {
        let scheduled = |condition: serde_json::Value, node: Option<&str>| {
            let mut pod = whole_pod();
            pod["status"]["conditions"] = json!([
                {"type": "Ready", "status": "False", "reason": "ContainersNotReady",
                 "lastTransitionTime": "2026-01-01T00:00:03Z"},
                condition
            ]);
            if let Some(node) = node {
                pod["spec"]["nodeName"] = json!(node);
            }
            pod
        };
        let gated = json!({"type": "PodScheduled", "status": "False", "reason": "SchedulingGated",
            "message": "Scheduling is blocked due to non-empty scheduling gates",
            "lastTransitionTime": "2026-01-01T00:00:00Z"});
        let unschedulable = json!({"type": "PodScheduled", "status": "False",
            "reason": "Unschedulable", "message": "0/1 nodes are available",
            "lastTransitionTime": "2026-01-01T00:02:00Z"});
        let timeless = json!({"type": "PodScheduled", "status": "False",
            "reason": "Unschedulable", "message": "0/1 nodes are available"});
        let placed = json!({"type": "PodScheduled", "status": "True",
            "lastTransitionTime": "2026-01-01T00:03:00Z"});
        let resources = BTreeSet::from(["gpupool/slot".to_owned()]);
        let now = jiff::Timestamp::UNIX_EPOCH;
        for (condition, node, unplaced) in [
            (gated, None, false),
            (unschedulable.clone(), None, true),
            (timeless, None, false),
            (placed, Some("node-1"), false),
            // Bound since: a stale condition does not count.
            (unschedulable, Some("node-1"), false),
        ] {
            let json = scheduled(condition.clone(), node);
            let whole: Pod = serde_json::from_value(json.clone()).expect("pod");
            let cached: CachedPod = serde_json::from_value(json).expect("cached pod");
            let from_whole = translate::pod_info(&whole, &resources, now).expect("translates");
            let from_cached = translate::pod_info(&cached, &resources, now).expect("translates");
            assert_eq!(format!("{from_cached:?}"), format!("{from_whole:?}"));
            assert_eq!(from_cached.unplaced.is_some(), unplaced, "{condition}");
            let back = serde_json::to_value(cached.to_pod()).expect("serializes");
            assert_eq!(
                back["status"]["conditions"],
                json!([condition]),
                "only PodScheduled is kept"
            );
        }
    }

    /// Every read the translation and the admission patch make agrees
    /// between the cached pod, read as it is, and the whole pod it was
    /// read from, in each shape those reads tell apart: the proof that the
    /// one rulebook, fed either form, decides alike.
    #[test]
    fn every_shape_reads_as_the_whole_pod_does() {
        type Shape = fn(&mut serde_json::Value);
        let shapes: [(&str, Shape); 17] = [
            ("as sent", |_| {}),
            ("default tolerations", |p| {
                p["spec"]["tolerations"] = default_pair(300);
            }),
            ("no tolerations", |p| {
                p["spec"]["tolerations"] = json!(null);
            }),
            ("no toleration", |p| p["spec"]["tolerations"] = json!([])),
            ("odd tolerations", |p| {
                p["spec"]["tolerations"] = json!([{"key": "a", "operator": "Near"},
                    {"key": "", "effect": "Weird"}, {"value": "v", "effect": ""}]);
            }),
            ("failed, deleted, bound", |p| {
                p["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:05:00Z");
                p["spec"]["nodeName"] = json!("node-1");
                p["status"] = json!({"phase": "Failed", "reason": "Evicted", "message": ""});
            }),
            ("bad role, garbage stamp, no creation time", |p| {
                p["metadata"]["labels"]["gpupool.io/role"] = json!("boss");
                p["metadata"]["annotations"]["gpupool.io/enqueued-at"] = json!("yesterday");
                p["metadata"]["creationTimestamp"] = json!(null);
            }),
            ("no labels or annotations", |p| {
                p["metadata"]["labels"] = json!(null);
                p["metadata"]["annotations"] = json!(null);
            }),
            ("fractional and zero requests", |p| {
                p["spec"]["containers"][0]["resources"] = json!({
                    "requests": {"gpupool/slot": "500m", "example.com/nic": "0", "cpu": "1"},
                    "limits": {"gpupool/slot": "1", "example.com/other": "1500m"}});
            }),
            ("requests under limits", |p| {
                p["spec"]["containers"][0]["resources"] = json!({
                    "requests": {"gpupool/slot": "1"}, "limits": {"gpupool/slot": "4"}});
                p["spec"]["initContainers"] = json!(null);
            }),
            ("an init container beats sidecars and apps", |p| {
                p["spec"]["initContainers"][0]["resources"]["limits"]["gpupool/slot"] = json!("9");
            }),
            ("no spec", |p| p["spec"] = json!(null)),
            ("no name", |p| p["metadata"]["name"] = json!(null)),
            ("no node selector, only our gate", |p| {
                p["spec"]["nodeSelector"] = json!(null);
                p["spec"]["schedulingGates"] = json!([{"name": "gpupool.io/admission"}]);
            }),
            ("an empty node selector", |p| {
                p["spec"]["nodeSelector"] = json!({})
            }),
            ("pinned elsewhere, no gate", |p| {
                p["spec"]["nodeSelector"]["kubernetes.io/hostname"] = json!("node-2");
                p["spec"]["schedulingGates"] = json!(null);
            }),
            ("an affinity term it cannot read", |p| {
                p["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
                    ["nodeSelectorTerms"] = json!([
                    {"matchExpressions": [{"key": "gpu", "operator": "Near", "values": ["x"]}]},
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n"]}]}]);
            }),
        ];
        let resources = BTreeSet::from(["gpupool/slot".to_owned(), "example.com/nic".to_owned()]);
        let now = "2026-02-01T00:00:00Z".parse().expect("t");
        for (shape, change) in shapes {
            let mut json = whole_pod();
            change(&mut json);
            let whole: Pod = serde_json::from_value(json.clone()).expect("pod");
            let cached: CachedPod = serde_json::from_value(json).expect("cached pod");
            let (mut unread_whole, mut unread_cached) = (Vec::new(), Vec::new());
            let from_whole =
                crate::engine::translate::pod_info(&whole, &resources, now, &mut |u| {
                    unread_whole.push(u);
                });
            let from_cached =
                crate::engine::translate::pod_info(&cached, &resources, now, &mut |u| {
                    unread_cached.push(u);
                });
            assert_eq!(
                format!("{from_cached:?}"),
                format!("{from_whole:?}"),
                "{shape}"
            );
            assert_eq!(unread_cached, unread_whole, "{shape}");
            if let (Some(a), Some(b)) = (&from_cached, &from_whole) {
                assert_eq!(
                    Arc::ptr_eq(&a.tolerations, &b.tolerations),
                    a.tolerations.is_empty() || *a.tolerations == *default_info_tolerations(),
                    "{shape}: the shared lists stay shared"
                );
            }
            assert_eq!(
                translate::gate_index(&cached),
                translate::gate_index(&whole),
                "{shape}"
            );
            assert_eq!(
                format!("{:?}", admission_patch(&cached, "node-1")),
                format!("{:?}", admission_patch(&whole, "node-1")),
                "{shape}"
            );
        }
    }

    /// The engine's form of the API server's default tolerations.
    fn default_info_tolerations() -> Arc<[crate::engine::Toleration]> {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"namespace": "ml", "name": "p"},
            "spec": {"tolerations": default_pair(300),
                "containers": [{"name": "c", "resources": {"limits": {"gpupool/slot": "1"}}}]}
        }))
        .expect("pod");
        let resources = BTreeSet::new();
        let info = translate::pod_info(&pod, &resources, jiff::Timestamp::UNIX_EPOCH);
        info.expect("translates").tolerations
    }

    /// A gated pod's condition, which every queued pod carries, costs no
    /// string of its own but its time.
    #[test]
    fn a_gated_pods_condition_is_borrowed() {
        let mut pod = whole_pod();
        pod["status"]["conditions"] = json!([{"type": "PodScheduled", "status": "False",
            "reason": "SchedulingGated",
            "message": "Scheduling is blocked due to non-empty scheduling gates",
            "lastTransitionTime": "2026-01-01T00:00:00Z"}]);
        let cached: CachedPod = serde_json::from_value(pod).expect("cached pod");
        let condition = cached
            .status
            .as_ref()
            .and_then(|s| s.scheduled.as_deref())
            .expect("condition");
        let borrowed = |s: &KeptStr| matches!(s, Cow::Borrowed(_));
        assert!(borrowed(&condition.status));
        assert!(condition.reason.as_ref().is_some_and(borrowed));
        assert!(condition.message.as_ref().is_some_and(borrowed));
    }

    #[test]
    fn only_what_admission_reads_is_kept() {
        let cached: CachedPod = serde_json::from_value(whole_pod()).expect("cached pod");
        let pod = serde_json::to_value(cached.to_pod()).expect("serializes");
        assert!(pod["metadata"].get("managedFields").is_none());
        assert_eq!(
            pod["metadata"]["labels"],
            json!({"gpupool.io/role": "helper", "gpupool.io/class": "fast"})
        );
        assert_eq!(
            pod["spec"]["containers"][0]["resources"],
            json!({"limits": {"example.com/nic": "1", "gpupool/slot": "2"}}),
            "CPU is no resource a class can name"
        );
        assert_eq!(
            pod["metadata"]["annotations"],
            json!({"gpupool.io/enqueued-at": "2026-01-01T00:00:00.000001Z"})
        );
        assert!(pod["spec"].get("volumes").is_none());
        assert!(pod["spec"]["containers"][0].get("env").is_none());
        assert!(pod["spec"]["containers"][0].get("command").is_none());
        assert_eq!(
            pod["status"]["conditions"],
            json!([{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                    "message": "0/3 nodes are available: 1 Insufficient cpu.",
                    "lastTransitionTime": "2026-01-01T00:02:00Z"}]),
            "of the conditions, only PodScheduled is kept"
        );
        assert_eq!(pod["status"]["phase"], "Pending");
        assert_eq!(pod["metadata"]["resourceVersion"], "42");

        assert_eq!(cached.labels.len(), 2);
        assert_eq!(
            cached.annotation("gpupool.io/enqueued-at"),
            Some("2026-01-01T00:00:00.000001Z")
        );
        assert_eq!(cached.annotation("big"), None, "a tenant's own is dropped");
        assert_eq!(cached.annotation("gpupool.io/notes"), None);
    }

    #[test]
    fn the_kept_metadata_is_the_identity_and_timestamps() {
        let mut pod = whole_pod();
        pod["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:05:00Z");
        pod["metadata"]["generateName"] = json!("p-");
        pod["metadata"]["finalizers"] = json!(["example.com/keep"]);
        let cached: CachedPod = serde_json::from_value(pod).expect("cached pod");
        assert_eq!(
            (
                Identity::namespace(&cached),
                Identity::name(&cached),
                Identity::uid(&cached),
                Identity::resource_version(&cached),
                Identity::deleting(&cached)
            ),
            ("ml", Some("p"), Some("u-1"), Some("42"), true)
        );
        let meta = cached.to_pod().metadata;
        let time = |t: &str| Some(Time(t.parse().expect("timestamp")));
        assert_eq!(meta.creation_timestamp, time("2026-01-01T00:00:00Z"));
        assert_eq!(meta.deletion_timestamp, time("2026-01-01T00:05:00Z"));
        assert_eq!(
            (meta.generate_name, meta.finalizers, meta.managed_fields),
            (None, None, None),
            "nothing else of the metadata is kept"
        );

        // A pod the API server never sent (no name) has no key.
        let nameless: CachedPod = serde_json::from_value(json!({"metadata": {}})).expect("pod");
        assert_eq!(super::super::identity::parts_of(&nameless), None);
        assert_eq!(Identity::namespace(&nameless), "");
    }

    #[test]
    fn the_strings_every_pod_carries_are_borrowed_not_copied() {
        let cached: CachedPod = serde_json::from_value(whole_pod()).expect("cached pod");
        let borrowed = |s: &KeptStr| matches!(s, Cow::Borrowed(_));
        assert!(cached.labels.iter().all(|(k, _)| borrowed(k)));
        assert!(borrowed(&cached.labels["gpupool.io/role"]));
        assert!(
            !borrowed(&cached.labels["gpupool.io/class"]),
            "a class name is the pod's own"
        );
        assert!(
            cached
                .annotations
                .iter()
                .all(|(k, v)| borrowed(k) && !borrowed(v))
        );

        let spec = cached.spec.as_ref().expect("spec");
        let gates = spec.scheduling_gates.as_deref().expect("gates");
        assert_eq!(gates, ["other", "gpupool.io/admission"]);
        assert_eq!(
            gates.iter().map(borrowed).collect::<Vec<_>>(),
            [false, true]
        );
        let limits = &spec.containers[0]
            .resources
            .as_ref()
            .expect("resources")
            .limits;
        let shown: Vec<_> = limits
            .iter()
            .map(|(k, q)| (&**k, borrowed(k), &**q, borrowed(q)))
            .collect();
        assert_eq!(
            shown,
            [
                ("example.com/nic", false, "1", true),
                ("gpupool/slot", true, "2", true)
            ]
        );
        let sidecar = &spec.init_containers.as_ref().expect("init")[1];
        assert!(sidecar.restart_policy.as_ref().is_some_and(borrowed));
        let phase = cached.status.as_ref().and_then(|s| s.phase.as_ref());
        assert!(phase.is_some_and(|p| p == "Pending" && borrowed(p)));
        let selector = spec.node_selector.as_ref().expect("selector");
        assert!(selector.iter().all(|(k, v)| !borrowed(k) && !borrowed(v)));
    }

    fn with_tolerations(tolerations: serde_json::Value) -> CachedPod {
        let mut pod = whole_pod();
        pod["spec"]["tolerations"] = tolerations;
        serde_json::from_value(pod).expect("cached pod")
    }

    fn default_pair(seconds: i64) -> serde_json::Value {
        json!([
            {"key": "node.kubernetes.io/not-ready", "operator": "Exists",
             "effect": "NoExecute", "tolerationSeconds": seconds},
            {"key": "node.kubernetes.io/unreachable", "operator": "Exists",
             "effect": "NoExecute", "tolerationSeconds": seconds},
        ])
    }

    fn tolerations(pod: &CachedPod) -> &Arc<[Toleration]> {
        let spec = pod.spec.as_ref().expect("spec");
        spec.tolerations.as_ref().expect("tolerations")
    }

    #[test]
    fn pods_with_the_default_tolerations_share_one_list() {
        let (a, b) = (
            with_tolerations(default_pair(300)),
            with_tolerations(default_pair(300)),
        );
        assert!(Arc::ptr_eq(tolerations(&a), tolerations(&b)));
        assert!(Arc::ptr_eq(tolerations(&a), &DEFAULT_TOLERATIONS));
        let whole: Pod = serde_json::from_value(json!({"spec": {
            "containers": [], "tolerations": default_pair(300)}}))
        .expect("pod");
        let spec = whole.spec.expect("spec");
        assert_eq!(a.to_pod().spec.expect("spec").tolerations, spec.tolerations);

        // Any other list is the pod's own, exactly as sent.
        for other in [
            default_pair(600),
            json!([{"key": "node.kubernetes.io/not-ready", "operator": "Exists",
                    "effect": "NoExecute", "tolerationSeconds": 300}]),
            json!([{"key": "gpu", "operator": "Exists"}]),
            json!([]),
        ] {
            let pod = with_tolerations(other.clone());
            assert!(!Arc::ptr_eq(tolerations(&pod), &DEFAULT_TOLERATIONS));
            let back = serde_json::to_value(pod.to_pod()).expect("serializes");
            assert_eq!(back["spec"]["tolerations"], other);
        }
        assert!(
            with_tolerations(json!(null))
                .spec
                .expect("spec")
                .tolerations
                .is_none()
        );
    }

    #[test]
    fn owner_references_are_not_kept() {
        let mut pod = whole_pod();
        pod["metadata"]["ownerReferences"] = json!([{"apiVersion": "batch/v1", "kind": "Job",
            "name": "train", "uid": "j-1", "controller": true}]);
        let cached: CachedPod = serde_json::from_value(pod).expect("cached pod");
        assert_eq!(cached.to_pod().metadata.owner_references, None);
    }

    #[test]
    fn it_is_addressed_as_a_pod() {
        assert_eq!(WatchedPod::kind(&()), "Pod");
        assert_eq!(WatchedPod::api_version(&()), "v1");
        assert_eq!(WatchedPod::plural(&()), "pods");
        let url = WatchedPod::url_path(&(), Some("ml"));
        assert_eq!(url, "/api/v1/namespaces/ml/pods");
    }
}
