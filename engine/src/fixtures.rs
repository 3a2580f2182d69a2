//! Builders of snapshot parts for the engine's tests and benchmarks
//! (feature `fixtures`): one definition of a plain pod, node, class and
//! lease, which each test adjusts with struct-update syntax.

use std::sync::Arc;

use gpupool_api::{GpuLeaseClassSpec, GpuLeaseSpec, GpuLeaseStatus, NodeGpu, Role};
use jiff::Timestamp;

use crate::SmallMap;
use crate::model::{
    ClassInfo, LeaseInfo, NodeInfo, ObjectKey, PodInfo, PodPhase, RoleLabel, TaintEffect,
    Toleration, TolerationOperator,
};

/// The resource every fixture uses.
pub const RESOURCE: &str = gpupool_api::names::DEFAULT_RESOURCE_NAME;

/// Namespace of fixture pods and leases.
pub const NAMESPACE: &str = "team";

/// A fixed instant `sec` seconds after a base time, so tests read in
/// relative seconds and never depend on the clock.
pub fn at(sec: i64) -> Timestamp {
    Timestamp::from_second(1_800_000_000 + sec).unwrap_or(Timestamp::UNIX_EPOCH)
}

/// `team/<name>`.
pub fn key(name: &str) -> ObjectKey {
    ObjectKey::new(NAMESPACE, name)
}

/// A class with the design's defaults; the class named `default` is the default.
pub fn class(name: &str) -> ClassInfo {
    ClassInfo {
        name: name.into(),
        generation: Some(1),
        created_at: None,
        spec: GpuLeaseClassSpec {
            default: name == "default",
            ..GpuLeaseClassSpec::default()
        },
        status: None,
    }
}

/// A node advertising `slots` slots of [`RESOURCE`], one healthy GPU per slot.
pub fn node(name: &str, slots: u32) -> NodeInfo {
    NodeInfo {
        name: name.into(),
        allocatable: [(RESOURCE.to_owned(), slots)].into(),
        gpus: (0..slots)
            .map(|i| NodeGpu {
                index: i,
                uuid: format!("GPU-{name}-{i}"),
                product: "Test GPU".into(),
                vendor: "NVIDIA".into(),
                memory_mib: 1024,
                healthy: true,
            })
            .collect(),
        ..NodeInfo::default()
    }
}

/// A gated, pending primary `team/<name>` of the default class asking for
/// `slots`, enqueued (and created) at `at(enqueued)`; its uid is `uid-<name>`.
pub fn pod(name: &str, slots: u32, enqueued: i64) -> PodInfo {
    PodInfo {
        key: key(name),
        uid: format!("uid-{name}"),
        class_label: None,
        role: RoleLabel::Valid(Role::Primary),
        requests: [(RESOURCE.to_owned(), slots)].into(),
        enqueued_at: Some(at(enqueued)),
        created_at: at(enqueued),
        phase: PodPhase::Pending,
        failure: None,
        terminating: false,
        gated: true,
        other_gate: None,
        unplaced: None,
        node_name: None,
        node_selector: SmallMap::new(),
        required_affinity: None,
        tolerations: Arc::new([]),
        unmanaged: false,
    }
}

/// The tolerations a real API server's DefaultTolerationSeconds plugin adds
/// to every pod: a not-ready or unreachable node is tolerated (`NoExecute`).
pub fn default_tolerations() -> Vec<Toleration> {
    [
        "node.kubernetes.io/not-ready",
        "node.kubernetes.io/unreachable",
    ]
    .into_iter()
    .map(|key| Toleration {
        key: Some(key.to_owned()),
        operator: TolerationOperator::Exists,
        value: None,
        effect: Some(TaintEffect::NoExecute),
    })
    .collect()
}

/// [`pod`] with the helper role.
pub fn helper(name: &str, slots: u32, enqueued: i64) -> PodInfo {
    PodInfo {
        role: RoleLabel::Valid(Role::Helper),
        ..pod(name, slots, enqueued)
    }
}

/// The lease of `pod` in `class` with `status`.
pub fn lease(pod: &PodInfo, class: &str, status: Option<GpuLeaseStatus>) -> LeaseInfo {
    let (role, slots) = match &pod.role {
        RoleLabel::Valid(role) => (*role, pod.requests.values().copied().sum()),
        RoleLabel::Invalid(_) => (Role::Primary, pod.requests.values().copied().sum()),
    };
    LeaseInfo::from_parts(
        pod.key.clone(),
        GpuLeaseSpec {
            class_name: class.into(),
            pod_name: pod.key.name.to_string(),
            pod_uid: pod.uid.clone(),
            role,
            slots,
        },
        status,
    )
}
