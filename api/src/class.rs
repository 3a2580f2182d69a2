//! `GpuLeaseClass` (DESIGN §3): how one pool of GPU slots admits pods.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector, Time};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::lease::Role;
use crate::names::DEFAULT_RESOURCE_NAME;

/// Desired behaviour of a class of GPU slots. Every field has the default
/// DESIGN §3 gives, so `spec: {}` is a valid class.
// Each printcolumn(...) repeats the same keys; clippy reads them as duplicates.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Serialize, Deserialize, Debug, Clone, PartialEq, JsonSchema)]
#[kube(
    group = "gpupool.io",
    version = "v1alpha1",
    kind = "GpuLeaseClass",
    plural = "gpuleaseclasses",
    singular = "gpuleaseclass",
    shortname = "glc",
    status = "GpuLeaseClassStatus",
    doc = "A class of GPU slots: which nodes it spans, how pods queue for them, and when helpers may use them.",
    printcolumn(name = "Default", type_ = "boolean", json_path = ".spec.default"),
    printcolumn(name = "Capacity", type_ = "integer", json_path = ".status.capacity"),
    printcolumn(name = "Free", type_ = "integer", json_path = ".status.free"),
    printcolumn(name = "Admitted", type_ = "integer", json_path = ".status.admitted"),
    printcolumn(name = "Queued", type_ = "integer", json_path = ".status.queued"),
    printcolumn(
        name = "Helpers",
        type_ = "integer",
        json_path = ".status.admittedHelpers"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct GpuLeaseClassSpec {
    /// Pods without the `gpupool.io/class` label use this class. At most one class may be the default.
    #[serde(default)]
    pub default: bool,
    /// Extended resource the class's pods request and its nodes advertise: a
    /// domain-qualified name (`domain/name`, e.g. gpupool/slot or
    /// nvidia.com/gpu) outside the kubernetes.io domain.
    #[serde(default = "default_resource_name")]
    #[schemars(
        length(min = 3, max = 253),
        regex(
            pattern = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
        )
    )]
    pub resource_name: String,
    /// Nodes the class spans; empty selects every node that advertises `resourceName`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_selector: Option<LabelSelector>,
    /// How queued pods are ordered and placed.
    #[serde(default)]
    pub admission: AdmissionSpec,
    /// How helper pods use idle GPUs.
    #[serde(default)]
    pub helpers: HelperSpec,
    /// How much of the per-GPU picture the status keeps.
    #[serde(default)]
    pub snapshot: SnapshotSpec,
}

fn default_resource_name() -> String {
    DEFAULT_RESOURCE_NAME.to_owned()
}

impl Default for GpuLeaseClassSpec {
    fn default() -> Self {
        Self {
            default: false,
            resource_name: default_resource_name(),
            node_selector: None,
            admission: AdmissionSpec::default(),
            helpers: HelperSpec::default(),
            snapshot: SnapshotSpec::default(),
        }
    }
}

/// Queue discipline for primaries.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Hash, Default, JsonSchema)]
pub enum Ordering {
    /// A primary that does not fit blocks every primary behind it.
    #[default]
    StrictFIFO,
    /// Later primaries that fit may pass one that does not.
    BestEffortFIFO,
}

/// Which fitting node an admitted pod goes to.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Hash, Default, JsonSchema)]
pub enum Placement {
    /// Fill the fullest node that fits, keeping whole nodes free for large requests.
    #[default]
    Pack,
    /// Use the emptiest node that fits.
    Spread,
}

/// Whether helpers may be evicted to make room for primaries.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Hash, Default, JsonSchema)]
pub enum Preemption {
    /// Evict helpers (Eviction API) when the head primary needs their GPUs.
    #[default]
    Evict,
    /// Never evict; primaries wait for helpers to finish.
    Never,
}

/// Admission settings of a class.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AdmissionSpec {
    /// Queue discipline for primaries.
    #[serde(default)]
    pub ordering: Ordering,
    /// Node choice among those that fit.
    #[serde(default)]
    pub placement: Placement,
    /// Most pods that may wait at once; 0 means unbounded. Beyond it the webhook denies new pods.
    #[serde(default)]
    pub max_queued: u32,
    /// How long an admitted pod may stay unplaceable before it gives its
    /// slots back: once the scheduler has reported it cannot place the pod
    /// (`PodScheduled=False`, reason `Unschedulable`: too little CPU, its
    /// node gone, a taint added after admission) for this long, the
    /// operator deletes it, so that its controller can create it again and
    /// the queue moves on.
    #[serde(default = "default_placement_timeout_seconds")]
    #[schemars(range(min = 5, max = 86400))]
    pub placement_timeout_seconds: u32,
}

fn default_placement_timeout_seconds() -> u32 {
    60
}

impl Default for AdmissionSpec {
    fn default() -> Self {
        Self {
            ordering: Ordering::default(),
            placement: Placement::default(),
            max_queued: 0,
            placement_timeout_seconds: default_placement_timeout_seconds(),
        }
    }
}

/// Helper settings of a class.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HelperSpec {
    /// Admit helpers even while primaries of the class wait.
    #[serde(default)]
    pub admit_while_queued: bool,
    /// Whether helpers are evicted for waiting primaries.
    #[serde(default)]
    pub preemption: Preemption,
    /// Grace period given to an evicted helper.
    #[serde(default = "default_grace_period_seconds")]
    #[schemars(range(max = 86400))]
    pub grace_period_seconds: u32,
    /// A helper that has run for less than this is never preempted.
    #[serde(default)]
    #[schemars(range(max = 86400))]
    pub min_runtime_seconds: u32,
}

fn default_grace_period_seconds() -> u32 {
    30
}

impl Default for HelperSpec {
    fn default() -> Self {
        Self {
            admit_while_queued: false,
            preemption: Preemption::default(),
            grace_period_seconds: default_grace_period_seconds(),
            min_runtime_seconds: 0,
        }
    }
}

/// Snapshot settings of a class.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotSpec {
    /// Per-GPU entries kept in `status.slots`; the rest is summarised by `slotsTruncated`.
    #[serde(default = "default_max_slots")]
    #[schemars(range(min = 0, max = 4096))]
    pub max_slots: u32,
}

fn default_max_slots() -> u32 {
    256
}

impl Default for SnapshotSpec {
    fn default() -> Self {
        Self {
            max_slots: default_max_slots(),
        }
    }
}

/// Observed state of a class: one decision pass's snapshot (DESIGN §5.7).
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuLeaseClassStatus {
    /// Generation of the spec this status was computed from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Ready`, or `Invalid` with the reason for a semantic error.
    #[serde(default)]
    pub conditions: Vec<Condition>,
    /// Slots on the class's matching nodes.
    #[serde(default)]
    pub capacity: u32,
    /// Slots on matching nodes held by no live pod.
    #[serde(default)]
    pub free: u32,
    /// Primaries holding slots.
    #[serde(default)]
    pub admitted: u32,
    /// Helpers holding slots.
    #[serde(default)]
    pub admitted_helpers: u32,
    /// Primaries waiting.
    #[serde(default)]
    pub queued: u32,
    /// Helpers waiting.
    #[serde(default)]
    pub queued_helpers: u32,
    /// Helpers being evicted for a primary.
    #[serde(default)]
    pub preempting: u32,
    /// Head of the queue, primaries first, at most 20 entries.
    #[serde(default)]
    pub queue: Vec<QueueEntry>,
    /// Per-GPU holders, at most `snapshot.maxSlots` entries.
    #[serde(default)]
    pub slots: Vec<SlotEntry>,
    /// True when `slots` was cut at `snapshot.maxSlots`.
    #[serde(default)]
    pub slots_truncated: bool,
    /// When the decision pass that produced this status ran.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub updated_at: Option<Time>,
}

/// One waiting lease in a class's queue head.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct QueueEntry {
    /// The lease as `namespace/name`.
    pub lease: String,
    /// Its role.
    pub role: Role,
    /// 1-based place among waiting leases of its role.
    pub position: u32,
    /// When its pod was queued.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queued_at: Option<Time>,
}

/// One GPU slot of a class and who holds it.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SlotEntry {
    /// Node the GPU is on.
    pub node: String,
    /// GPU index on the node.
    pub gpu: u32,
    /// GPU UUID, when the device plugin reported it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    /// GPU product name, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub product: Option<String>,
    /// GPU vendor, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vendor: Option<String>,
    /// Holder as `namespace/name` of its lease; absent when the slot is free.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease: Option<String>,
    /// Holder's role.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<Role>,
    /// Since when the holder has held it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since: Option<Time>,
}

/// The condition type a valid class carries.
pub const CONDITION_READY: &str = "Ready";
/// The condition type a semantically invalid class carries, with the reason.
pub const CONDITION_INVALID: &str = "Invalid";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_spec_takes_design_defaults() {
        let spec: GpuLeaseClassSpec = serde_json::from_str("{}").expect("empty spec is valid");
        assert_eq!(spec, GpuLeaseClassSpec::default());
        assert_eq!(spec.resource_name, "gpupool/slot");
        assert_eq!(spec.admission.ordering, Ordering::StrictFIFO);
        assert_eq!(spec.admission.placement, Placement::Pack);
        assert_eq!(spec.helpers.preemption, Preemption::Evict);
        assert_eq!(spec.helpers.grace_period_seconds, 30);
        assert_eq!(spec.snapshot.max_slots, 256);
    }

    #[test]
    fn unknown_enum_value_is_rejected_by_name() {
        let err = serde_json::from_str::<GpuLeaseClassSpec>(r#"{"admission":{"ordering":"LIFO"}}"#)
            .expect_err("LIFO is not an ordering");
        assert!(err.to_string().contains("LIFO"), "{err}");
    }
}
