//! The engine's input and output: plain data, no Kubernetes client types
//! beyond gpupool's own CRD structs, so the decision logic can be driven by
//! tests and benchmarks without a cluster.

use std::borrow::Borrow;
use std::collections::BTreeMap;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use crate::{CachedLease, SmallMap};
use gpupool_api::{
    GpuLeaseClassSpec, GpuLeaseClassStatus, GpuLeaseSpec, GpuLeaseStatus, NodeGpu, Role,
};
use jiff::Timestamp;

/// `namespace/name` of a pod, and of the lease named like it.
///
/// Its parts are shared, not copied: the engine, the caches' mirrors and
/// each pod's and lease's form keep the same key several times over, and a
/// clone costs two reference counts rather than two allocations.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ObjectKey {
    /// Namespace.
    pub namespace: Arc<str>,
    /// Name.
    pub name: Arc<str>,
}

impl ObjectKey {
    /// Builds a key.
    pub fn new(namespace: impl Into<Arc<str>>, name: impl Into<Arc<str>>) -> Self {
        Self {
            namespace: namespace.into(),
            name: name.into(),
        }
    }
}

/// The two parts of an [`ObjectKey`], borrowed: a map keyed by
/// `ObjectKey` is probed with `&("ns", "name") as &dyn KeyParts` without
/// building a key (two strings) per probe. Hashes and compares as the
/// `ObjectKey` with the same parts does.
pub trait KeyParts {
    /// The namespace.
    fn namespace(&self) -> &str;
    /// The name.
    fn name(&self) -> &str;
}

impl KeyParts for ObjectKey {
    fn namespace(&self) -> &str {
        &self.namespace
    }

    fn name(&self) -> &str {
        &self.name
    }
}

impl KeyParts for (&str, &str) {
    fn namespace(&self) -> &str {
        self.0
    }

    fn name(&self) -> &str {
        self.1
    }
}

impl<'a> Borrow<dyn KeyParts + 'a> for ObjectKey {
    fn borrow(&self) -> &(dyn KeyParts + 'a) {
        self
    }
}

// As the derived `Hash` of `ObjectKey` does: namespace, then name.
impl Hash for dyn KeyParts + '_ {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.namespace().hash(state);
        self.name().hash(state);
    }
}

impl PartialEq for dyn KeyParts + '_ {
    fn eq(&self, other: &Self) -> bool {
        self.namespace() == other.namespace() && self.name() == other.name()
    }
}

impl Eq for dyn KeyParts + '_ {}

impl fmt::Display for ObjectKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// Everything one decision pass looks at. Built by the controller from its
/// caches; `now` is the pass's clock reading (the engine never reads a clock).
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    /// The pass's time.
    pub now: Timestamp,
    /// Every GpuLeaseClass.
    pub classes: Vec<ClassInfo>,
    /// Every node.
    pub nodes: Vec<NodeInfo>,
    /// Every live pod that requests a class resource or is bound or pinned to a node.
    pub pods: Vec<PodInfo>,
    /// Every GpuLease, as persisted.
    pub leases: Vec<LeaseInfo>,
    /// Helper pods whose evictions a PodDisruptionBudget refuses (the API
    /// server answered 429), each with when it first did: their leases say
    /// so, and the eviction is asked for again [`EVICTION_RETRY`] later; once
    /// the refusals have lasted the helper's grace period the pod is
    /// deleted instead ([`Eviction::delete`]). Only the API server's answer
    /// tells this, so the caller keeps it; keys of pods not being evicted
    /// are ignored.
    pub blocked_evictions: BlockedEvictions,
    /// At most this many entries in [`Plan::lease_progress`], front of the
    /// queue first; `None` lists them all. A caller that writes progress
    /// within a budget sets it to what it can write before the next pass:
    /// when the head of a queue of 10,000 moves, building 10,000 statuses
    /// of which a few hundred are written is waste.
    pub progress_limit: Option<usize>,
}

/// Helper pods whose evictions a PodDisruptionBudget refuses, each with when
/// it first and last refused.
pub type BlockedEvictions = BTreeMap<ObjectKey, Refusals>;

/// When a PodDisruptionBudget refused a helper's evictions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refusals {
    /// The first refusal: the grace period counts from here.
    pub first: Timestamp,
    /// The latest: the next eviction is asked for [`EVICTION_RETRY`] after it.
    pub last: Timestamp,
}

/// How long after a PodDisruptionBudget refused an eviction it is asked for again.
pub const EVICTION_RETRY: jiff::SignedDuration = jiff::SignedDuration::from_secs(2);

/// A class's status is written at most once per this period: while a queue
/// moves every few milliseconds, its class's counts and head are written at
/// most once a second, the last state winning.
pub const CLASS_STATUS_PERIOD: jiff::SignedDuration = jiff::SignedDuration::from_secs(1);

/// A GpuLeaseClass.
#[derive(Debug, Clone)]
pub struct ClassInfo {
    /// Class name (cluster-scoped).
    pub name: String,
    /// `metadata.generation`, echoed as `status.observedGeneration`.
    pub generation: Option<i64>,
    /// `metadata.creationTimestamp`: of two default classes, the older stays
    /// the default.
    pub created_at: Option<Timestamp>,
    /// Its spec.
    pub spec: GpuLeaseClassSpec,
    /// Its status as persisted (`None` before the first status write); the
    /// engine keeps condition transition times from it so that re-running a
    /// pass yields the same status.
    pub status: Option<GpuLeaseClassStatus>,
}

/// A node as far as slot accounting and fit are concerned.
#[derive(Debug, Clone, Default)]
pub struct NodeInfo {
    /// Node name (also its `kubernetes.io/hostname`).
    pub name: String,
    /// Node labels.
    pub labels: BTreeMap<String, String>,
    /// Node taints.
    pub taints: Vec<Taint>,
    /// `status.allocatable` of extended resources, in whole slots.
    pub allocatable: BTreeMap<String, u32>,
    /// GPUs from the `gpupool.io/gpus` annotation (empty when absent or unreadable).
    pub gpus: Vec<NodeGpu>,
    /// Slots the device plugin announces (`gpupool.io/slots`), which
    /// allocatable follows within seconds: only [`crate::largest_node`]
    /// reads it, so a request is not judged too large while capacity is
    /// being published. Placement uses allocatable alone.
    pub announced: BTreeMap<String, u32>,
    /// `spec.unschedulable` (cordoned).
    pub unschedulable: bool,
}

/// A node taint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Taint {
    /// Taint key.
    pub key: String,
    /// Taint value.
    pub value: Option<String>,
    /// Taint effect.
    pub effect: TaintEffect,
}

/// Effect of a taint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TaintEffect {
    /// Pods that do not tolerate it are not placed.
    NoSchedule,
    /// A soft preference; never blocks placement.
    PreferNoSchedule,
    /// Pods that do not tolerate it are not placed (and would be evicted).
    NoExecute,
}

/// A pod toleration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Toleration {
    /// Key it tolerates; `None` with `Exists` tolerates every taint.
    pub key: Option<String>,
    /// `Equal` or `Exists`.
    pub operator: TolerationOperator,
    /// Value for `Equal`.
    pub value: Option<String>,
    /// Effect it tolerates; `None` tolerates all effects.
    pub effect: Option<TaintEffect>,
}

/// Operator of a toleration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TolerationOperator {
    /// Key and value must match.
    Equal,
    /// Key must match (any value).
    Exists,
}

/// One term of a required node affinity: all requirements must hold.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NodeSelectorTerm {
    /// Requirements on node labels.
    pub match_expressions: Vec<NodeSelectorRequirement>,
    /// Requirements on node fields (only `metadata.name` is meaningful).
    pub match_fields: Vec<NodeSelectorRequirement>,
}

/// One label requirement of a node selector term.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeSelectorRequirement {
    /// Label key.
    pub key: String,
    /// Operator.
    pub operator: SelectorOperator,
    /// Values (`Gt`/`Lt`: one integer).
    pub values: Vec<String>,
}

/// Operator of a node selector requirement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SelectorOperator {
    /// Label value in the set.
    In,
    /// Label absent or value not in the set.
    NotIn,
    /// Label present.
    Exists,
    /// Label absent.
    DoesNotExist,
    /// Label value, as an integer, greater than the one value.
    Gt,
    /// Label value, as an integer, less than the one value.
    Lt,
}

/// Phase of a pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PodPhase {
    /// Not yet running.
    #[default]
    Pending,
    /// Running.
    Running,
    /// Finished successfully.
    Succeeded,
    /// Finished with a failure.
    Failed,
    /// Unknown.
    Unknown,
}

/// The `gpupool.io/role` label as found on a pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RoleLabel {
    /// A valid role (absent label = primary).
    Valid(Role),
    /// Anything else, kept for the lease message.
    Invalid(String),
}

/// A pod as far as admission is concerned.
#[derive(Debug, Clone)]
pub struct PodInfo {
    /// `namespace/name`.
    pub key: ObjectKey,
    /// `metadata.uid`.
    pub uid: String,
    /// `gpupool.io/class` label, if present.
    pub class_label: Option<String>,
    /// `gpupool.io/role` label.
    pub role: RoleLabel,
    /// Effective slots requested, per extended resource name (only non-zero entries).
    pub requests: SmallMap<String, u32>,
    /// `gpupool.io/enqueued-at`, when present and readable.
    pub enqueued_at: Option<Timestamp>,
    /// `metadata.creationTimestamp`.
    pub created_at: Timestamp,
    /// `status.phase`.
    pub phase: PodPhase,
    /// What the kubelet said of a Failed pod: `status.reason` and
    /// `status.message` (`UnexpectedAdmissionError: Allocate failed …` when
    /// it refused the pod). `None` for a pod that has not failed or that
    /// says nothing.
    pub failure: Option<String>,
    /// `metadata.deletionTimestamp` is set: it still holds its GPUs until it is gone.
    pub terminating: bool,
    /// Still carries the `gpupool.io/admission` scheduling gate.
    pub gated: bool,
    /// The first scheduling gate the pod carries besides gpupool's, if
    /// any: another controller still holds the pod back, so it is not
    /// admitted, takes no slot and holds no one up until gpupool's gate is
    /// its only one (DESIGN §5.3).
    pub other_gate: Option<String>,
    /// The scheduler's word that it cannot place the pod
    /// (`PodScheduled=False`, reason `Unschedulable`), while the pod is
    /// not bound; `None` otherwise.
    pub unplaced: Option<Unplaced>,
    /// `spec.nodeName`, once bound.
    pub node_name: Option<String>,
    /// `spec.nodeSelector` (the operator pins with `kubernetes.io/hostname`).
    pub node_selector: SmallMap<String, String>,
    /// Required node affinity terms (ORed); `None` when the pod has none.
    pub required_affinity: Option<Vec<NodeSelectorTerm>>,
    /// Tolerations. Shared, not owned: nearly every pod carries the same
    /// list (the API server's default two), which the caller may keep once
    /// for all of them.
    pub tolerations: Arc<[Toleration]>,
    /// In a namespace the webhook never sees (`kube-system`, the operator's
    /// own): the pod holds what it requests where it runs, but is never
    /// queued and gets no lease.
    pub unmanaged: bool,
}

/// The scheduler cannot place a pod: its `PodScheduled` condition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unplaced {
    /// The condition's `lastTransitionTime`: since when the scheduler has
    /// found no node for the pod.
    pub since: Timestamp,
    /// The scheduler's message (`0/3 nodes are available: 1 Insufficient
    /// cpu …`), if it gave one.
    pub message: Option<String>,
}

/// A GpuLease as persisted.
///
/// It holds the lease itself, shared with the watch cache it was read from,
/// rather than a copy of its spec and status, so a lease costs the
/// operator one copy however many places keep it.
#[derive(Debug, Clone)]
pub struct LeaseInfo {
    /// `namespace/name` (same as its pod's).
    pub key: ObjectKey,
    /// The lease as the pass sees it: the cache's, or the controller's own
    /// write laid over it until the watch confirms it.
    pub lease: Arc<CachedLease>,
    /// The lease is gone from the API server although its pod lives (someone
    /// deleted it): this is its last known state, and the pass recreates it
    /// as it was, keeping the pod's place in the queue.
    pub missing: bool,
}

impl LeaseInfo {
    /// The lease `lease`, kept under `key`.
    pub fn new(key: ObjectKey, lease: Arc<CachedLease>) -> Self {
        Self {
            key,
            lease,
            missing: false,
        }
    }

    /// A lease named `key` with `spec` and `status`, as a test or a
    /// benchmark builds one.
    pub fn from_parts(key: ObjectKey, spec: GpuLeaseSpec, status: Option<GpuLeaseStatus>) -> Self {
        let lease = CachedLease::under(&key, spec, status);
        Self::new(key, Arc::new(lease))
    }

    /// Its spec.
    pub fn spec(&self) -> &GpuLeaseSpec {
        &self.lease.spec
    }

    /// Its status (`None` before the first status write).
    pub fn status(&self) -> Option<&GpuLeaseStatus> {
        self.lease.status.as_ref()
    }

    /// Its spec to change, in a copy of the lease of its own when the
    /// lease is shared (tests and benchmarks build variants this way).
    pub fn spec_mut(&mut self) -> &mut GpuLeaseSpec {
        &mut Arc::make_mut(&mut self.lease).spec
    }

    /// Its status to change, likewise.
    pub fn status_mut(&mut self) -> &mut Option<GpuLeaseStatus> {
        &mut Arc::make_mut(&mut self.lease).status
    }
}

/// What one decision pass wants done. Applying it and running the pass again
/// on the result yields an empty plan apart from statuses that are unchanged.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Plan {
    /// Leases to create for pods that have none (sequence already assigned in `status`).
    pub create_leases: Vec<NewLease>,
    /// Leases to delete: they belong to an older pod of the same name.
    pub delete_leases: Vec<StaleLease>,
    /// Specs to rewrite because they disagree with their pod (the pod is the
    /// source of truth for class, role and slots).
    pub lease_specs: BTreeMap<ObjectKey, GpuLeaseSpec>,
    /// Pods to ungate and pin. Only leases whose sequence is already persisted are admitted.
    pub admissions: Vec<Admission>,
    /// Helper pods to evict for a waiting primary.
    pub evictions: Vec<Eviction>,
    /// Admitted pods that cannot be placed, to delete so that they give
    /// their slots back (DESIGN §5.3).
    pub give_backs: Vec<GiveBack>,
    /// Desired status of every lease whose phase, sequence, node, preempter
    /// or a timestamp differs from the persisted one: written with the
    /// admissions and evictions of the pass.
    pub lease_statuses: BTreeMap<ObjectKey, GpuLeaseStatus>,
    /// Desired status of the leases that differ from the persisted one only
    /// in their position or message (the queue moved): these may be written
    /// later and coalesced, front of the queue first. With a progress limit,
    /// only that many, those without a position (a message change of a
    /// lease that does not queue) and then the lowest positions first.
    pub lease_progress: BTreeMap<ObjectKey, GpuLeaseStatus>,
    /// More leases differ in position or message than `lease_progress`
    /// lists (the progress limit cut it).
    pub progress_truncated: bool,
    /// Desired status, without its `updatedAt` stamp, of every class whose
    /// status this pass may write: its persisted status carries no stamp,
    /// one from the future (another replica's clock), or one at least
    /// [`CLASS_STATUS_PERIOD`] old. A class written less than a period ago
    /// is left out and sets `wake_at` to the period's end: no write could
    /// happen before then, so no pass builds a per-GPU picture that could
    /// not be written.
    pub class_statuses: BTreeMap<String, GpuLeaseClassStatus>,
    /// How many leases of every class wait, by role, as the class's status
    /// counts them: counted on every pass, built status or not.
    pub queue_depths: BTreeMap<String, QueueDepth>,
    /// The class statuses to write in this pass, in name order: those of
    /// `class_statuses` that differ from the persisted status (the stamp
    /// aside).
    pub class_writes: Vec<ClassWrite>,
    /// The earliest time a pass is due although nothing changes: the end
    /// of a class status's period (see `class_statuses`), a helper's
    /// `minRuntimeSeconds` protection ending, a refused eviction's retry.
    /// Always after the pass's `now`.
    pub wake_at: Option<Timestamp>,
}

/// The leases of a class that wait for a slot, by role: a class status's
/// `queued` and `queuedHelpers`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QueueDepth {
    /// Waiting primaries.
    pub primaries: u32,
    /// Waiting helpers.
    pub helpers: u32,
}

/// A class status to write now: `class_statuses[class]` stamped `updatedAt`.
#[derive(Debug, Clone, PartialEq)]
pub struct ClassWrite {
    /// The class.
    pub class: String,
    /// Its `status.updatedAt`: the pass's time.
    pub updated_at: Timestamp,
    /// The message of the class's `Invalid` condition when this write turns
    /// it true or changes its reason: the class's owner is told once, with
    /// the write, not on every pass.
    pub newly_invalid: Option<String>,
}

impl Plan {
    /// The status the plan wants for lease `key`, from whichever list holds it.
    pub fn lease_status(&self, key: &ObjectKey) -> Option<&GpuLeaseStatus> {
        self.lease_statuses
            .get(key)
            .or_else(|| self.lease_progress.get(key))
    }

    /// Every lease status the plan wants written: phase changes, then progress.
    pub fn all_lease_statuses(&self) -> impl Iterator<Item = (&ObjectKey, &GpuLeaseStatus)> {
        self.lease_statuses.iter().chain(self.lease_progress.iter())
    }
}

/// A lease to create.
#[derive(Debug, Clone, PartialEq)]
pub struct NewLease {
    /// `namespace/name` (the pod's).
    pub key: ObjectKey,
    /// UID of the owning pod (for the ownerReference).
    pub pod_uid: String,
    /// Spec to create it with.
    pub spec: GpuLeaseSpec,
    /// Status to write right after creating it (carries the sequence).
    pub status: GpuLeaseStatus,
}

/// A lease to delete because its pod was replaced.
#[derive(Debug, Clone, PartialEq)]
pub struct StaleLease {
    /// `namespace/name`.
    pub key: ObjectKey,
    /// The pod UID the stale lease names (precondition for the delete).
    pub pod_uid: String,
}

/// Admit a pod: remove its gate and pin it to `node` in one patch.
#[derive(Debug, Clone, PartialEq)]
pub struct Admission {
    /// The pod (and lease) `namespace/name`.
    pub key: ObjectKey,
    /// Pod UID (precondition for the patch).
    pub pod_uid: String,
    /// Its role.
    pub role: Role,
    /// Node it is pinned to.
    pub node: String,
    /// Slots it takes there.
    pub slots: u32,
}

/// Evict a helper so that a primary can have its GPUs.
#[derive(Debug, Clone, PartialEq)]
pub struct Eviction {
    /// The helper pod `namespace/name`.
    pub key: ObjectKey,
    /// Helper pod UID (precondition for the eviction).
    pub pod_uid: String,
    /// The primary it makes room for.
    pub for_primary: ObjectKey,
    /// Grace period from the class.
    pub grace_period_seconds: u32,
    /// Delete the pod (with the grace period) rather than evict it: a
    /// PodDisruptionBudget has refused its eviction for as long as its grace
    /// period. A budget may delay a helper's preemption, never stop it, as
    /// kube-scheduler's preemption deletes the pods it must.
    pub delete: bool,
    /// Not to be asked for before this time: a PodDisruptionBudget refused
    /// the last eviction, which is retried [`EVICTION_RETRY`] later rather
    /// than at once.
    pub not_before: Option<Timestamp>,
}

/// Delete an admitted pod that the scheduler has not been able to place for
/// its class's `placementTimeoutSeconds`: it gives its slots back, and its
/// controller, if it has one, creates it again.
#[derive(Debug, Clone, PartialEq)]
pub struct GiveBack {
    /// The pod `namespace/name`.
    pub key: ObjectKey,
    /// Pod UID (precondition for the delete).
    pub pod_uid: String,
    /// The node it was pinned to.
    pub node: String,
    /// Why, as its lease says it (the scheduler's message quoted).
    pub reason: String,
}

#[cfg(test)]
mod tests {
    use std::collections::{HashMap, HashSet};
    use std::hash::BuildHasher;

    use super::*;

    #[test]
    fn borrowed_parts_find_what_the_key_finds() {
        let map: HashMap<ObjectKey, u32> = [
            (ObjectKey::new("team", "a"), 1),
            (ObjectKey::new("team", "ab"), 2),
            (ObjectKey::new("", "a"), 3),
        ]
        .into();
        let probe = |ns, name| map.get(&(ns, name) as &dyn KeyParts).copied();
        assert_eq!(probe("team", "a"), Some(1));
        assert_eq!(probe("team", "ab"), Some(2));
        assert_eq!(probe("", "a"), Some(3));
        // The boundary between the parts counts: "team"+"a" is not "tea"+"ma".
        assert_eq!(probe("tea", "ma"), None);
        assert_eq!(probe("team", "b"), None);

        let hasher = map.hasher();
        let key = ObjectKey::new("team", "a");
        assert_eq!(
            hasher.hash_one(&key),
            hasher.hash_one(&("team", "a") as &dyn KeyParts),
            "a key and its parts hash alike"
        );
        let set: HashSet<ObjectKey> = [key].into();
        assert!(set.contains(&("team", "a") as &dyn KeyParts));
    }
}
