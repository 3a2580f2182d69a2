//! The engine's rules on what the plugin listed: the objects are
//! translated as the operator translates them, and which nodes a class
//! matches, whether a pod may use a node and how many slots are free on
//! each are the engine's answers, never the plugin's own. So `why` and
//! `top` cannot disagree with the operator about the same objects.

use gpupool_api::{GpuLease, GpuLeaseClass};
use gpupool_engine::translate;
use gpupool_engine::{ClassInfo, PodInfo, PodsSeen, Room, Snapshot};
use jiff::Timestamp;
use k8s_openapi::api::core::v1::{Node, Pod};

/// The listed objects in the engine's model, translated as the operator
/// translates them: nodes with the classes' resources only, pods that ask
/// for some extended resource (no other pod holds a slot), every lease.
/// What cannot be read is left out as the operator leaves it out.
pub fn snapshot(
    classes: &[GpuLeaseClass],
    nodes: &[Node],
    pods: &[Pod],
    leases: &[GpuLease],
    now: Timestamp,
) -> Snapshot {
    let classes: Vec<ClassInfo> = classes.iter().filter_map(translate::class_info).collect();
    let resources = translate::resource_names(&classes);
    Snapshot {
        now,
        nodes: nodes
            .iter()
            .filter_map(|n| translate::node_info(n, &resources, &mut translate::ignore))
            .collect(),
        pods: pods
            .iter()
            .filter_map(|p| translate::pod_info(p, &resources, now, &mut translate::ignore))
            .collect(),
        leases: leases.iter().filter_map(translate::lease_info).collect(),
        classes,
        ..Snapshot::default()
    }
}

/// The engine's room on every node of `snapshot` (see [`gpupool_engine::room`]):
/// `all_pods` says whether its pods are every namespace's.
pub fn room(snapshot: &Snapshot, all_pods: bool) -> Room {
    let seen = if all_pods {
        PodsSeen::All
    } else {
        PodsSeen::Some
    };
    gpupool_engine::room(snapshot, seen)
}

/// `pod` as the engine sees it among `snapshot`'s classes; `None` when it
/// asks for no extended resource.
pub fn pod_info(snapshot: &Snapshot, pod: &Pod) -> Option<PodInfo> {
    let resources = translate::resource_names(&snapshot.classes);
    translate::pod_info(pod, &resources, snapshot.now, &mut translate::ignore)
}
