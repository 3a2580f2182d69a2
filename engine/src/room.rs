//! Free slots and class nodes as a decision pass counts them (DESIGN §5.3,
//! §5.9), for a reader that shows them (`kubectl gpupool why` and `top`):
//! the pass itself runs up to the point where its queues would start, so
//! a reader cannot count otherwise than the operator does.

use std::collections::BTreeMap;

use crate::Snapshot;
use crate::pass::View;

/// The room on every node as a pass sees it before it admits anyone.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Room {
    /// Free slots per resource a class uses, per node, in name order: the
    /// node's allocatable slots of that resource minus what is held there.
    /// Negative when the node is over-committed (its allocatable shrank
    /// below what is held). Every node appears under every class resource.
    pub free: BTreeMap<String, BTreeMap<String, i64>>,
    /// Per class: the nodes its `nodeSelector` matches that advertise its
    /// resource, in name order: the only nodes the class admits to. Empty
    /// when the selector cannot be evaluated.
    pub class_nodes: BTreeMap<String, Vec<String>>,
}

impl Room {
    /// Free slots of `resource` on `node`; `None` for a node or resource
    /// the snapshot does not have.
    pub fn free(&self, resource: &str, node: &str) -> Option<i64> {
        self.free.get(resource)?.get(node).copied()
    }

    /// The nodes class `class` admits to (see [`Room::class_nodes`]); empty
    /// for a class the snapshot does not have.
    pub fn class_nodes(&self, class: &str) -> &[String] {
        self.class_nodes.get(class).map_or(&[], Vec::as_slice)
    }
}

/// What the pods of a snapshot stand for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PodsSeen {
    /// Every live pod of the cluster: a lease whose pod is not among them
    /// holds nothing (its pod is gone), as the operator decides.
    All,
    /// Only some (the reader may list only some namespaces): a lease whose
    /// pod is not among them holds what its status says (its slots on its
    /// node, while its phase holds slots), and pods not listed hold nothing.
    Some,
}

/// The room on every node as a decision pass counts it over `snapshot`,
/// before its queues run: allocatable slots minus the slots of every live
/// pod bound (`spec.nodeName`) or pinned (`nodeSelector
/// kubernetes.io/hostname`) there, gpupool's or not, and of the leases
/// holding slots whose pods are not placed yet. A pod still behind
/// gpupool's gate holds nothing until admitted, nor does a pod being
/// deleted before it was bound. These are the figures [`crate::decide`]
/// places pods by, since they come from the same pass.
pub fn room(snapshot: &Snapshot, pods: PodsSeen) -> Room {
    let mut pass = crate::pass_until(View::of(snapshot), 2);
    if pods == PodsSeen::Some {
        // The pass released the leases whose pods it did not see; these
        // pods may live in namespaces the reader cannot list.
        for &(pod, lease, _) in &pass.view.entries {
            let (None, Some(lease)) = (pod, lease) else {
                continue;
            };
            let Some(status) = lease.status().filter(|s| s.phase.holds_slots()) else {
                continue;
            };
            let node = status.node.as_deref().and_then(|n| pass.nodes.find(n));
            let class = pass.classes.find(&lease.spec().class_name);
            if let (Some(node), Some(class)) = (node, class) {
                let res = pass.classes.list[class].res;
                pass.nodes.take(res, node, lease.spec().slots);
            }
        }
    }
    let free = pass
        .resources
        .iter()
        .enumerate()
        .map(|(res, name)| {
            let per_node = pass
                .nodes
                .list
                .iter()
                .enumerate()
                .map(|(i, n)| (n.name.clone(), pass.nodes.free(res, i as u32)))
                .collect();
            ((*name).to_owned(), per_node)
        })
        .collect();
    let class_nodes = pass
        .classes
        .list
        .iter()
        .map(|c| {
            let names = c
                .nodes
                .iter()
                .map(|&i| pass.nodes.list[i as usize].name.clone())
                .collect();
            (c.name().to_owned(), names)
        })
        .collect();
    Room { free, class_nodes }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::{self, RESOURCE};
    use crate::model::{LeaseInfo, ObjectKey, PodInfo};
    use gpupool_api::names::LABEL_HOSTNAME;
    use gpupool_api::{GpuLeaseSpec, GpuLeaseStatus, LeasePhase, Role};

    fn held_lease(name: &str, node: &str, slots: u32) -> LeaseInfo {
        LeaseInfo::from_parts(
            ObjectKey::new("ns", name),
            GpuLeaseSpec {
                class_name: "default".into(),
                pod_name: name.into(),
                pod_uid: format!("uid-{name}"),
                role: Role::Primary,
                slots,
            },
            Some(GpuLeaseStatus {
                phase: LeasePhase::Admitted,
                sequence: Some(1),
                node: Some(node.into()),
                ..GpuLeaseStatus::default()
            }),
        )
    }

    fn pod(name: &str, slots: u32) -> PodInfo {
        let mut p = fixtures::pod(name, slots, 0);
        p.key = ObjectKey::new("ns", name);
        p.uid = format!("uid-{name}");
        p.gated = false;
        p
    }

    #[test]
    fn bound_pinned_and_leased_slots_are_taken_and_gated_or_deleted_ones_are_not() {
        let mut bound = pod("bound", 2);
        bound.node_name = Some("node-a".into());
        // Another team's pod in no class: it holds its slot all the same.
        let mut foreign = pod("foreign", 1);
        foreign.class_label = Some("nobody".into());
        foreign.node_name = Some("node-b".into());
        let mut pinned = pod("pinned", 1);
        pinned
            .node_selector
            .insert(LABEL_HOSTNAME.into(), "node-b".into());
        let mut gated = pod("gated", 3);
        gated.gated = true;
        gated
            .node_selector
            .insert(LABEL_HOSTNAME.into(), "node-a".into());
        let mut leaving = pod("leaving", 3);
        leaving.terminating = true;
        leaving
            .node_selector
            .insert(LABEL_HOSTNAME.into(), "node-a".into());
        // Admitted, its pod not pinned yet: its lease holds the slot.
        let admitted = pod("admitted", 1);
        let snapshot = Snapshot {
            classes: vec![fixtures::class("default")],
            nodes: vec![fixtures::node("node-a", 4), fixtures::node("node-b", 4)],
            pods: vec![bound, foreign, pinned, gated, leaving, admitted],
            leases: vec![
                held_lease("admitted", "node-a", 1),
                held_lease("gone", "node-b", 2),
            ],
            ..Snapshot::default()
        };
        let room = super::room(&snapshot, PodsSeen::All);
        assert_eq!(room.free(RESOURCE, "node-a"), Some(4 - 2 - 1));
        assert_eq!(
            room.free(RESOURCE, "node-b"),
            Some(4 - 1 - 1),
            "the lease of a pod that is gone holds nothing"
        );
        assert_eq!(room.class_nodes("default"), ["node-a", "node-b"]);
        assert!(room.class_nodes("other").is_empty());
        // A reader who cannot see every pod counts the lease as its status says.
        let partial = super::room(&snapshot, PodsSeen::Some);
        assert_eq!(partial.free(RESOURCE, "node-b"), Some(4 - 1 - 1 - 2));
        assert_eq!(partial.free(RESOURCE, "node-a"), Some(1));
    }
}
