//! `GpuLease` (DESIGN §4): one per pod that requests a class's resource.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// What the pod asked for. Written once by the operator when it creates the lease.
// Each printcolumn(...) repeats the same keys; clippy reads them as duplicates.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Serialize, Deserialize, Debug, Clone, PartialEq, JsonSchema)]
#[kube(
    group = "gpupool.io",
    version = "v1alpha1",
    kind = "GpuLease",
    plural = "gpuleases",
    singular = "gpulease",
    shortname = "gl",
    namespaced,
    status = "GpuLeaseStatus",
    // Each device plugin watches only the leases admitted to its node
    // (`fieldSelector=status.node=<node>`).
    selectable = ".status.node",
    doc = "A pod's place in a GpuLeaseClass queue, and the GPU slots it holds once admitted.",
    printcolumn(name = "Class", type_ = "string", json_path = ".spec.className"),
    printcolumn(name = "Role", type_ = "string", json_path = ".spec.role"),
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(name = "Position", type_ = "integer", json_path = ".status.position"),
    printcolumn(name = "Node", type_ = "string", json_path = ".status.node"),
    printcolumn(name = "GPU", type_ = "string", json_path = ".status.gpuIndexes"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    ),
    printcolumn(
        name = "Queued",
        type_ = "date",
        json_path = ".status.queuedAt",
        priority = 1
    ),
    printcolumn(
        name = "Message",
        type_ = "string",
        json_path = ".status.message",
        priority = 1
    )
)]
#[serde(rename_all = "camelCase")]
pub struct GpuLeaseSpec {
    /// The `GpuLeaseClass` the pod queues in.
    #[schemars(length(min = 1, max = 253))]
    pub class_name: String,
    /// Name of the pod the lease is for (same namespace).
    #[schemars(length(min = 1, max = 253))]
    pub pod_name: String,
    /// UID of that pod, so a re-created pod of the same name gets a new lease.
    #[serde(rename = "podUID")]
    #[schemars(length(min = 1))]
    pub pod_uid: String,
    /// The pod's role.
    #[serde(default)]
    pub role: Role,
    /// Slots the pod requests.
    #[schemars(range(min = 1))]
    pub slots: u32,
}

/// Role of a pod within its class.
#[derive(
    Serialize,
    Deserialize,
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Default,
    JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Queues in strict order and may preempt helpers.
    #[default]
    Primary,
    /// Uses idle GPUs only while no primary waits; may be preempted.
    Helper,
}

impl Role {
    /// The label value (`primary` / `helper`).
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Primary => "primary",
            Role::Helper => "helper",
        }
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where a lease is in its life.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Hash, Default, JsonSchema)]
pub enum LeasePhase {
    /// Waiting for a slot.
    #[default]
    Queued,
    /// Given a node: the pod's gate is removed and it is pinned there.
    Admitted,
    /// Running, with GPUs the device plugin reported.
    Bound,
    /// A helper being evicted for a primary.
    Preempting,
    /// The pod is gone or finished; its slots are free.
    Released,
    /// The pod can never be admitted (e.g. its class is invalid); the message says why.
    Rejected,
}

impl LeasePhase {
    /// True while the lease's pod holds (or is about to hold) slots on a node.
    pub fn holds_slots(self) -> bool {
        matches!(
            self,
            LeasePhase::Admitted | LeasePhase::Bound | LeasePhase::Preempting
        )
    }

    /// True once the lease will never change phase again.
    pub fn is_final(self) -> bool {
        matches!(self, LeasePhase::Released)
    }
}

/// Observed state of a lease.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuLeaseStatus {
    /// Current phase.
    #[serde(default)]
    pub phase: LeasePhase,
    /// FIFO ticket: assigned once, persisted, never changed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sequence: Option<u64>,
    /// 1-based place among waiting leases of the same role, while Queued.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub position: Option<u32>,
    /// Node the pod was admitted to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// GPUs the pod holds, as the device plugin read them from the kubelet.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpus: Vec<LeaseGpu>,
    /// The indexes of `gpus` as one string, ascending and comma-separated
    /// (`0,1`), which the device plugin writes with them. The GPU column of
    /// `kubectl get gpuleases` shows it: a column shows one value per
    /// lease, so a list would show only a pod's first GPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_indexes: Option<String>,
    /// For a preempted helper: the primary (`namespace/name`) it makes room for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preempted_by: Option<String>,
    /// When the pod was queued (its enqueue stamp).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queued_at: Option<Time>,
    /// When the operator admitted the pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admitted_at: Option<Time>,
    /// When the device plugin first saw the pod holding GPUs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bound_at: Option<Time>,
    /// When the lease was released.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub released_at: Option<Time>,
    /// Why the lease is where it is, for people.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// One GPU a lease's pod holds.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LeaseGpu {
    /// GPU index on the node.
    pub index: u32,
    /// GPU UUID.
    pub uuid: String,
    /// GPU product name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub product: Option<String>,
}

/// GPU indexes as a person writes them: ascending, each once, joined by
/// commas (`0,1,3`); empty for none.
pub fn index_list(indexes: impl IntoIterator<Item = u32>) -> String {
    let mut indexes: Vec<u32> = indexes.into_iter().collect();
    indexes.sort_unstable();
    indexes.dedup();
    indexes
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// What [`GpuLeaseStatus::gpu_indexes`] says for `gpus`: their
/// [`index_list`], or `None` for no GPU.
pub fn gpu_indexes(gpus: &[LeaseGpu]) -> Option<String> {
    Some(index_list(gpus.iter().map(|g| g.index))).filter(|list| !list.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(index: u32) -> LeaseGpu {
        LeaseGpu {
            index,
            uuid: format!("GPU-{index}"),
            product: None,
        }
    }

    #[test]
    fn gpu_indexes_lists_every_gpu_once_in_ascending_order() {
        assert_eq!(index_list([]), "");
        assert_eq!(index_list([2, 0, 2]), "0,2");
        assert_eq!(gpu_indexes(&[]), None);
        assert_eq!(gpu_indexes(&[gpu(3)]).as_deref(), Some("3"));
        assert_eq!(
            gpu_indexes(&[gpu(7), gpu(0), gpu(7), gpu(12)]).as_deref(),
            Some("0,7,12")
        );
    }

    #[test]
    fn the_gpu_column_reads_the_one_string_not_the_list() {
        let crd = serde_json::to_value(<GpuLease as kube::CustomResourceExt>::crd()).expect("crd");
        let columns = &crd["spec"]["versions"][0]["additionalPrinterColumns"];
        let column = columns
            .as_array()
            .and_then(|cols| cols.iter().find(|c| c["name"] == "GPU"))
            .expect("a GPU column");
        assert_eq!(column["jsonPath"], ".status.gpuIndexes");
        let status = GpuLeaseStatus {
            gpu_indexes: gpu_indexes(&[gpu(1), gpu(0)]),
            ..GpuLeaseStatus::default()
        };
        assert_eq!(
            serde_json::to_value(&status).expect("ser")["gpuIndexes"],
            "0,1"
        );
    }

    #[test]
    fn role_and_phase_wire_names() {
        assert_eq!(
            serde_json::to_string(&Role::Helper).expect("ser"),
            r#""helper""#
        );
        assert_eq!(
            serde_json::to_string(&LeasePhase::Preempting).expect("ser"),
            r#""Preempting""#
        );
        assert!(serde_json::from_str::<Role>(r#""boss""#).is_err());
    }

    #[test]
    fn spec_uses_pod_uid_casing() {
        let spec = GpuLeaseSpec {
            class_name: "default".into(),
            pod_name: "p".into(),
            pod_uid: "u-1".into(),
            role: Role::Primary,
            slots: 2,
        };
        let v = serde_json::to_value(&spec).expect("ser");
        assert_eq!(v["podUID"], "u-1");
        assert_eq!(v["className"], "default");
    }
}
