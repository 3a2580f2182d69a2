//! Reading the API objects the views are built from: small accessors over
//! `GpuLease`, `GpuLeaseClass` and `Node` that never fail (an absent field
//! reads as its documented default), and the FIFO order of a class.

use gpupool_api::names::{ANNOTATION_NODE_GPUS, DEFAULT_RESOURCE_NAME};
use gpupool_api::{GpuLease, GpuLeaseClass, LeasePhase, NodeGpu, Role};
use jiff::Timestamp;
use k8s_openapi::api::core::v1::Node;

/// The lease's namespace (empty when absent, which the API never returns).
pub fn namespace(l: &GpuLease) -> &str {
    l.metadata.namespace.as_deref().unwrap_or("")
}

/// The lease's pod: `spec.podName`, which the operator sets to the lease's name.
pub fn pod(l: &GpuLease) -> &str {
    &l.spec.pod_name
}

/// `namespace/pod`, the form `status.preemptedBy` and the class status use.
pub fn key(l: &GpuLease) -> String {
    format!("{}/{}", namespace(l), pod(l))
}

/// The lease's phase; a lease the operator has not written status for yet reads `Queued`.
pub fn phase(l: &GpuLease) -> LeasePhase {
    l.status.as_ref().map(|s| s.phase).unwrap_or_default()
}

/// The FIFO ticket, once the operator has assigned it.
pub fn sequence(l: &GpuLease) -> Option<u64> {
    l.status.as_ref().and_then(|s| s.sequence)
}

/// When the pod was queued: `status.queuedAt`, else the lease's creation.
pub fn queued_at(l: &GpuLease) -> Option<Timestamp> {
    l.status
        .as_ref()
        .and_then(|s| s.queued_at.as_ref())
        .or(l.metadata.creation_timestamp.as_ref())
        .map(|t| t.0)
}

/// The operator's message without its `waiting: ` lead, which every queued
/// lease carries and a WHY column does not need.
pub fn reason(l: &GpuLease) -> Option<&str> {
    let m = l.status.as_ref()?.message.as_deref()?;
    Some(m.strip_prefix("waiting: ").unwrap_or(m))
}

/// Whether the lease waits in its class's queue.
pub fn is_waiting(l: &GpuLease) -> bool {
    phase(l) == LeasePhase::Queued
}

/// The class's name.
pub fn class_name(c: &GpuLeaseClass) -> &str {
    c.metadata.name.as_deref().unwrap_or("")
}

/// The waiting leases of one class and role in FIFO order: by sequence,
/// those without one yet last (in the order they were queued), ties broken
/// by namespace/name as the operator breaks them.
pub fn fifo<'a>(leases: &'a [GpuLease], class: &str, role: Role) -> Vec<&'a GpuLease> {
    let mut out: Vec<&GpuLease> = leases
        .iter()
        .filter(|l| l.spec.class_name == class && l.spec.role == role && is_waiting(l))
        .collect();
    out.sort_by_key(|l| {
        (
            sequence(l).is_none(),
            sequence(l),
            queued_at(l),
            namespace(l).to_owned(),
            pod(l).to_owned(),
        )
    });
    out
}

/// The node's GPUs from its `gpupool.io/gpus` annotation: `None` when the
/// annotation is absent, `Err` with the parser's message when unreadable.
pub fn node_gpus(node: &Node) -> Option<Result<Vec<NodeGpu>, String>> {
    let value = node
        .metadata
        .annotations
        .as_ref()?
        .get(ANNOTATION_NODE_GPUS)?;
    Some(gpupool_api::node_gpus::parse(value).map_err(|e| e.to_string()))
}

/// Whole units of `resource` the node can allocate (0 when absent or not a
/// plain whole number, which extended resources always are).
pub fn allocatable(node: &Node, resource: &str) -> u64 {
    node.status
        .as_ref()
        .and_then(|s| s.allocatable.as_ref())
        .and_then(|a| a.get(resource))
        .and_then(|q| q.0.trim().parse::<u64>().ok())
        .unwrap_or(0)
}

/// The resource names the classes use (`gpupool/slot` when there is no class).
pub fn resource_names(classes: &[GpuLeaseClass]) -> Vec<String> {
    let mut names: Vec<String> = classes
        .iter()
        .map(|c| c.spec.resource_name.clone())
        .collect();
    if names.is_empty() {
        names.push(DEFAULT_RESOURCE_NAME.to_owned());
    }
    names.sort();
    names.dedup();
    names
}

#[cfg(test)]
pub(crate) mod fixtures {
    //! Objects for the views' table-driven tests.

    use super::*;
    use gpupool_api::{GpuLeaseClassSpec, GpuLeaseSpec, GpuLeaseStatus, LeaseGpu};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    /// A fixed "now" the tests measure ages against.
    pub fn now() -> Timestamp {
        Timestamp::from_second(1_700_000_000).expect("valid")
    }

    /// `secs` seconds before [`now`].
    pub fn ago(secs: i64) -> Time {
        Time(Timestamp::from_second(1_700_000_000 - secs).expect("valid"))
    }

    /// A lease of `ns/name` in `class`.
    pub fn lease(ns: &str, name: &str, class: &str, role: Role, slots: u32) -> GpuLease {
        let mut l = GpuLease::new(
            name,
            GpuLeaseSpec {
                class_name: class.into(),
                pod_name: name.into(),
                pod_uid: format!("uid-{name}"),
                role,
                slots,
            },
        );
        l.metadata.namespace = Some(ns.into());
        l.metadata.creation_timestamp = Some(ago(100));
        l
    }

    /// A queued lease with a sequence, queued `waited` seconds ago.
    pub fn queued(
        ns: &str,
        name: &str,
        role: Role,
        slots: u32,
        seq: u64,
        waited: i64,
        message: &str,
    ) -> GpuLease {
        let mut l = lease(ns, name, "default", role, slots);
        l.status = Some(GpuLeaseStatus {
            phase: LeasePhase::Queued,
            sequence: Some(seq),
            position: Some(0),
            queued_at: Some(ago(waited)),
            message: Some(message.into()),
            ..Default::default()
        });
        l
    }

    /// A lease holding `gpus` on `node`, in phase `phase`.
    pub fn holding(
        ns: &str,
        name: &str,
        role: Role,
        phase: LeasePhase,
        node: &str,
        gpus: &[u32],
        seq: u64,
    ) -> GpuLease {
        let mut l = lease(ns, name, "default", role, gpus.len().max(1) as u32);
        l.status = Some(GpuLeaseStatus {
            phase,
            sequence: Some(seq),
            node: Some(node.into()),
            gpus: gpus
                .iter()
                .map(|&i| LeaseGpu {
                    index: i,
                    uuid: format!("GPU-{node}-{i}"),
                    product: Some("Sim GPU".into()),
                })
                .collect(),
            queued_at: Some(ago(60)),
            admitted_at: Some(ago(50)),
            bound_at: (phase == LeasePhase::Bound).then(|| ago(45)),
            ..Default::default()
        });
        l
    }

    /// A class with status counts.
    pub fn class(name: &str, capacity: u32, free: u32, queued: u32) -> GpuLeaseClass {
        let mut c = GpuLeaseClass::new(
            name,
            GpuLeaseClassSpec {
                default: name == "default",
                ..Default::default()
            },
        );
        c.status = Some(gpupool_api::GpuLeaseClassStatus {
            capacity,
            free,
            queued,
            ..Default::default()
        });
        c
    }

    /// A node with `gpus` GPUs of `sessions` slots each, and extra labels.
    pub fn node(name: &str, gpus: u32, sessions: u32, unhealthy: &[u32]) -> Node {
        let list: Vec<NodeGpu> = (0..gpus)
            .map(|i| NodeGpu {
                index: i,
                uuid: format!("GPU-{name}-{i}"),
                product: "Sim GPU".into(),
                vendor: "NVIDIA".into(),
                memory_mib: 81_920,
                healthy: !unhealthy.contains(&i),
            })
            .collect();
        serde_json::from_value(serde_json::json!({
            "metadata": {
                "name": name,
                "labels": {"kubernetes.io/hostname": name},
                "annotations": {ANNOTATION_NODE_GPUS: gpupool_api::node_gpus::render(&list)}
            },
            "status": {"allocatable": {DEFAULT_RESOURCE_NAME: (gpus * sessions).to_string()}}
        }))
        .expect("node")
    }
}

#[cfg(test)]
mod tests {
    use super::fixtures::*;
    use super::*;

    #[test]
    fn fifo_orders_by_sequence_then_unsequenced_by_time() {
        let mut late = lease("b", "no-seq-late", "default", Role::Primary, 1);
        late.metadata.creation_timestamp = Some(ago(5));
        let mut early = lease("b", "no-seq-early", "default", Role::Primary, 1);
        early.metadata.creation_timestamp = Some(ago(10));
        let leases = vec![
            late,
            queued("a", "seq-9", Role::Primary, 1, 9, 1, ""),
            early,
            queued("a", "seq-2", Role::Primary, 1, 2, 1, ""),
            queued("a", "helper", Role::Helper, 1, 1, 1, ""),
            holding("a", "bound", Role::Primary, LeasePhase::Bound, "n", &[0], 0),
        ];
        let names: Vec<&str> = fifo(&leases, "default", Role::Primary)
            .into_iter()
            .map(pod)
            .collect();
        assert_eq!(names, ["seq-2", "seq-9", "no-seq-early", "no-seq-late"]);
        assert!(fifo(&leases, "other", Role::Primary).is_empty());
    }

    #[test]
    fn reason_drops_the_waiting_lead() {
        let l = queued("a", "p", Role::Primary, 1, 1, 1, "waiting: 1 primary ahead");
        assert_eq!(reason(&l), Some("1 primary ahead"));
        let l = queued("a", "p", Role::Primary, 1, 1, 1, "its class is invalid");
        assert_eq!(reason(&l), Some("its class is invalid"));
        assert_eq!(reason(&lease("a", "p", "c", Role::Primary, 1)), None);
    }

    #[test]
    fn node_reads() {
        let n = node("node-1", 2, 2, &[1]);
        assert_eq!(allocatable(&n, DEFAULT_RESOURCE_NAME), 4);
        assert_eq!(allocatable(&n, "other/x"), 0);
        let gpus = node_gpus(&n).expect("annotated").expect("parses");
        assert_eq!(gpus.len(), 2);
        assert!(!gpus[1].healthy);
        let mut bad = n.clone();
        bad.metadata.annotations = Some(
            [(ANNOTATION_NODE_GPUS.to_owned(), "{".to_owned())]
                .into_iter()
                .collect(),
        );
        let err = node_gpus(&bad).expect("annotated").expect_err("bad json");
        assert!(err.contains("gpupool.io/gpus"), "{err}");
        bad.metadata.annotations = None;
        assert!(node_gpus(&bad).is_none());
    }

    #[test]
    fn resource_names_default_and_dedup() {
        assert_eq!(resource_names(&[]), ["gpupool/slot"]);
        let a = class("a", 1, 1, 0);
        let b = class("b", 1, 1, 0);
        assert_eq!(resource_names(&[a, b]), ["gpupool/slot"]);
    }
}
