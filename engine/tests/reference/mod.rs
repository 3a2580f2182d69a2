//! A deliberately naive statement of the admission rules (docs/design.md
//! §5.3 and §5.4), written from the design and not from the engine: slow,
//! short and plain, so that the property tests can hold the engine's
//! admissions to it.
//!
//! It covers the states those rules alone decide: every live pod that
//! asks for the resource has a lease with a stored sequence, nothing is
//! being preempted or driven again, no pod is terminating, carries another
//! controller's gate, waits for placement or was created without the gate,
//! and no lease's spec was edited. For any other state [`admissions`]
//! returns `None` and says nothing.

use std::collections::BTreeMap;

use gpupool_api::names::LABEL_HOSTNAME;
use gpupool_api::{LeasePhase, Ordering, Placement, Preemption, Role};
use gpupool_engine::{
    ClassInfo, LeaseInfo, NodeInfo, ObjectKey, PodInfo, PodPhase, RoleLabel, Snapshot,
};

/// The one resource the property tests' classes hand out.
const RES: &str = gpupool_engine::fixtures::RESOURCE;

fn live(p: &PodInfo) -> bool {
    !matches!(p.phase, PodPhase::Succeeded | PodPhase::Failed)
}

/// The node a pod is bound or pinned to.
fn placed_on(p: &PodInfo) -> Option<&str> {
    p.node_name
        .as_deref()
        .or_else(|| p.node_selector.get(LABEL_HOSTNAME).map(String::as_str))
}

fn slots_of(p: &PodInfo) -> u32 {
    p.requests.get(RES).copied().unwrap_or(0)
}

fn alloc(n: &NodeInfo) -> i64 {
    i64::from(n.allocatable.get(RES).copied().unwrap_or(0))
}

/// The class a pod belongs to: the one its label names, else the default.
fn class_of<'s>(s: &'s Snapshot, p: &PodInfo) -> Option<&'s ClassInfo> {
    match &p.class_label {
        Some(name) => s.classes.iter().find(|c| &c.name == name),
        None => s.classes.iter().find(|c| c.spec.default),
    }
}

/// A class's nodes: those its nodeSelector's labels match (the property
/// tests use `matchLabels` only, and neither taints nor cordons).
fn nodes_of<'s>(s: &'s Snapshot, c: &ClassInfo) -> Vec<&'s NodeInfo> {
    let wanted = c
        .spec
        .node_selector
        .as_ref()
        .and_then(|sel| sel.match_labels.clone())
        .unwrap_or_default();
    let mut nodes: Vec<&NodeInfo> = s
        .nodes
        .iter()
        .filter(|n| wanted.iter().all(|(k, v)| n.labels.get(k) == Some(v)))
        .collect();
    nodes.sort_by(|a, b| a.name.cmp(&b.name));
    nodes
}

/// One queued lease: its pod, class and place.
struct Waiting<'s> {
    pod: &'s PodInfo,
    class: &'s ClassInfo,
    role: Role,
    sequence: u64,
}

/// The admissions one pass makes, pod key → node, for the states this
/// module covers; `None` for the others.
pub fn admissions(s: &Snapshot) -> Option<BTreeMap<ObjectKey, String>> {
    let lease_of = |p: &PodInfo| -> Option<&LeaseInfo> { s.leases.iter().find(|l| l.key == p.key) };
    // Free slots: allocatable less what every live pod bound or pinned to
    // the node asks for.
    let mut free: BTreeMap<&str, i64> = s
        .nodes
        .iter()
        .map(|n| (n.name.as_str(), alloc(n)))
        .collect();
    let mut waiting: Vec<Waiting<'_>> = Vec::new();
    for p in s.pods.iter().filter(|p| live(p) && slots_of(p) > 0) {
        if p.terminating || p.other_gate.is_some() || p.unplaced.is_some() {
            return None;
        }
        let lease = lease_of(p)?;
        let status = lease.status()?;
        let spec = lease.spec();
        if lease.missing || spec.pod_uid != p.uid || status.sequence.is_none() {
            return None;
        }
        let RoleLabel::Valid(role) = p.role else {
            return None;
        };
        if spec.slots != slots_of(p) || spec.role != role || status.preempted_by.is_some() {
            return None;
        }
        match (status.phase, p.gated) {
            (LeasePhase::Queued | LeasePhase::Rejected, true) => {
                if let Some(class) = class_of(s, p) {
                    waiting.push(Waiting {
                        pod: p,
                        class,
                        role,
                        sequence: status.sequence?,
                    });
                }
            }
            (LeasePhase::Admitted | LeasePhase::Bound, false) => {
                let node = placed_on(p)?;
                if let Some(f) = free.get_mut(node) {
                    *f -= i64::from(slots_of(p));
                }
            }
            _ => return None,
        }
    }
    // Leases that hold slots without a live pod (a pod just gone) are
    // released by the pass and hold nothing; anything else is not covered.
    if s.leases.iter().any(|l| {
        l.status()
            .is_some_and(|st| st.phase == LeasePhase::Preempting || st.preempted_by.is_some())
    }) {
        return None;
    }
    waiting.sort_by_key(|w| (w.class.name.clone(), w.sequence, w.pod.key.clone()));
    let mut classes: Vec<&ClassInfo> = s.classes.iter().collect();
    classes.sort_by(|a, b| a.name.cmp(&b.name));

    let mut admitted = BTreeMap::new();
    // §5.3: primaries, class by class, in sequence order.
    // Per class, the fewest slots a primary still waiting asks for.
    let mut primaries_waiting: BTreeMap<&str, (u32, u32)> = BTreeMap::new();
    for class in &classes {
        let nodes = nodes_of(s, class);
        let largest = nodes.iter().map(|n| alloc(n)).max().unwrap_or(0);
        let strict = class.spec.admission.ordering == Ordering::StrictFIFO;
        let mut blocked = false;
        for w in waiting
            .iter()
            .filter(|w| w.class.name == class.name && w.role == Role::Primary)
        {
            let slots = i64::from(slots_of(w.pod));
            if nodes.is_empty() || largest < slots {
                continue; // it can never fit: it holds no one up
            }
            if !(strict && blocked)
                && let Some(node) = place(&nodes, &free, slots, class.spec.admission.placement)
            {
                *free.get_mut(node)? -= slots;
                admitted.insert(w.pod.key.clone(), node.to_owned());
                continue;
            }
            if !blocked && class.spec.helpers.preemption == Preemption::Evict {
                // The first primary that does not fit may preempt helpers:
                // not covered here.
                let helpers_hold = s.leases.iter().any(|l| {
                    l.spec().role == Role::Helper
                        && l.status().is_some_and(|st| st.phase.holds_slots())
                });
                if helpers_hold {
                    return None;
                }
            }
            blocked = true;
            let entry = primaries_waiting
                .entry(class.name.as_str())
                .or_insert((0, u32::MAX));
            entry.0 += 1;
            entry.1 = entry.1.min(slots_of(w.pod));
        }
    }
    // §5.4: helpers, class by class, only while no primary of their class
    // waits (unless admitWhileQueued), and never on a node a waiting
    // primary of another class could take.
    for class in &classes {
        let own_waiting = primaries_waiting
            .get(class.name.as_str())
            .map_or(0, |w| w.0);
        if own_waiting > 0 && !class.spec.helpers.admit_while_queued {
            continue;
        }
        let closed = |n: &NodeInfo| {
            classes.iter().any(|other| {
                other.name != class.name
                    && primaries_waiting
                        .get(other.name.as_str())
                        .is_some_and(|&(_, fewest)| {
                            alloc(n) >= i64::from(fewest)
                                && nodes_of(s, other).iter().any(|o| o.name == n.name)
                        })
            })
        };
        let nodes: Vec<&NodeInfo> = nodes_of(s, class)
            .into_iter()
            .filter(|n| !closed(n))
            .collect();
        let all_nodes = nodes_of(s, class);
        let largest = all_nodes.iter().map(|n| alloc(n)).max().unwrap_or(0);
        let strict = class.spec.admission.ordering == Ordering::StrictFIFO;
        let mut blocked = false;
        for w in waiting
            .iter()
            .filter(|w| w.class.name == class.name && w.role == Role::Helper)
        {
            let slots = i64::from(slots_of(w.pod));
            if all_nodes.is_empty() || largest < slots {
                continue;
            }
            if !(strict && blocked)
                && let Some(node) = place(&nodes, &free, slots, class.spec.admission.placement)
            {
                *free.get_mut(node)? -= slots;
                admitted.insert(w.pod.key.clone(), node.to_owned());
                continue;
            }
            blocked = true;
        }
    }
    Some(admitted)
}

/// Pack: the node with the fewest free slots that still fit; Spread: the
/// most. Ties go to the first by name.
fn place<'n>(
    nodes: &[&'n NodeInfo],
    free: &BTreeMap<&str, i64>,
    slots: i64,
    placement: Placement,
) -> Option<&'n str> {
    let mut best: Option<(i64, &str)> = None;
    for n in nodes {
        let f = free.get(n.name.as_str()).copied().unwrap_or(0);
        if f < slots {
            continue;
        }
        let better = match (placement, best) {
            (_, None) => true,
            (Placement::Pack, Some((b, _))) => f < b,
            (Placement::Spread, Some((b, _))) => f > b,
        };
        if better {
            best = Some((f, n.name.as_str()));
        }
    }
    best.map(|(_, name)| name)
}
