//! The engine's kept state: the cluster as ordered maps that the controller
//! updates object by object, so a pass after one event neither re-reads nor
//! re-sorts the other 16,000 objects. Deciding on it runs the very same
//! pass as [`crate::decide`] does on a [`Snapshot`].

use std::collections::{BTreeMap, BTreeSet};

use jiff::Timestamp;

use super::model::{ClassInfo, Eviction, LeaseInfo, NodeInfo, ObjectKey, Plan, PodInfo, Snapshot};
use super::pass::View;

/// The cluster as the engine keeps it between passes: one entry per class
/// and node name and per pod and lease key, each kept in order.
///
/// Guarantee: after any sequence of updates, [`Engine::decide`] returns the
/// same plan as [`crate::decide`] on [`Engine::to_snapshot`].
#[derive(Debug, Clone, Default)]
pub struct Engine {
    now: Timestamp,
    classes: BTreeMap<String, ClassInfo>,
    nodes: BTreeMap<String, NodeInfo>,
    pods: BTreeMap<ObjectKey, PodInfo>,
    leases: BTreeMap<ObjectKey, LeaseInfo>,
    blocked_evictions: BTreeSet<ObjectKey>,
    progress_limit: Option<usize>,
}

impl Engine {
    /// An empty cluster at the Unix epoch.
    pub fn new() -> Self {
        Self::default()
    }

    /// The snapshot's cluster; of two entries with the same name or key the
    /// first is kept, as a pass over the snapshot keeps it.
    pub fn from_snapshot(snapshot: &Snapshot) -> Self {
        let mut engine = Self {
            now: snapshot.now,
            blocked_evictions: snapshot.blocked_evictions.clone(),
            progress_limit: snapshot.progress_limit,
            ..Self::default()
        };
        for c in &snapshot.classes {
            engine
                .classes
                .entry(c.name.clone())
                .or_insert_with(|| c.clone());
        }
        for n in &snapshot.nodes {
            engine
                .nodes
                .entry(n.name.clone())
                .or_insert_with(|| n.clone());
        }
        for p in &snapshot.pods {
            engine
                .pods
                .entry(p.key.clone())
                .or_insert_with(|| p.clone());
        }
        for l in &snapshot.leases {
            engine
                .leases
                .entry(l.key.clone())
                .or_insert_with(|| l.clone());
        }
        engine
    }

    /// The same cluster as a snapshot, every list in order.
    pub fn to_snapshot(&self) -> Snapshot {
        Snapshot {
            now: self.now,
            classes: self.classes.values().cloned().collect(),
            nodes: self.nodes.values().cloned().collect(),
            pods: self.pods.values().cloned().collect(),
            leases: self.leases.values().cloned().collect(),
            blocked_evictions: self.blocked_evictions.clone(),
            progress_limit: self.progress_limit,
        }
    }

    /// Decides one pass over the kept state (the rules of [`crate::decide`]).
    pub fn decide(&self) -> Plan {
        super::run(self.view())
    }

    /// [`crate::decide_steps`] on the kept state.
    #[cfg(feature = "fixtures")]
    #[doc(hidden)]
    pub fn decide_steps(&self, steps: usize) -> Plan {
        super::run_until(self.view(), steps)
    }

    fn view(&self) -> View<'_> {
        View {
            now: self.now,
            classes: self.classes.values().collect(),
            nodes: self.nodes.values().collect(),
            pods: self.pods.values().collect(),
            leases: self.leases.values().collect(),
            blocked_evictions: &self.blocked_evictions,
            progress_limit: self.progress_limit,
        }
    }

    /// The time the next pass decides at.
    pub fn now(&self) -> Timestamp {
        self.now
    }

    /// Lists at most `limit` progress statuses per pass (see
    /// [`Snapshot::progress_limit`]).
    pub fn set_progress_limit(&mut self, limit: Option<usize>) {
        self.progress_limit = limit;
    }

    /// Sets the time the next pass decides at.
    pub fn set_now(&mut self, now: Timestamp) {
        self.now = now;
    }

    /// Adds or replaces the class of that name.
    pub fn upsert_class(&mut self, class: ClassInfo) {
        self.classes.insert(class.name.clone(), class);
    }

    /// Removes the class `name`; returns what was kept.
    pub fn remove_class(&mut self, name: &str) -> Option<ClassInfo> {
        self.classes.remove(name)
    }

    /// Adds or replaces the node of that name.
    pub fn upsert_node(&mut self, node: NodeInfo) {
        self.nodes.insert(node.name.clone(), node);
    }

    /// Removes the node `name`; returns what was kept.
    pub fn remove_node(&mut self, name: &str) -> Option<NodeInfo> {
        self.nodes.remove(name)
    }

    /// Adds or replaces the pod with that key.
    pub fn upsert_pod(&mut self, pod: PodInfo) {
        self.pods.insert(pod.key.clone(), pod);
    }

    /// Removes the pod `key`; returns what was kept.
    pub fn remove_pod(&mut self, key: &ObjectKey) -> Option<PodInfo> {
        self.pods.remove(key)
    }

    /// Adds or replaces the lease with that key.
    pub fn upsert_lease(&mut self, lease: LeaseInfo) {
        self.leases.insert(lease.key.clone(), lease);
    }

    /// Removes the lease `key`; returns what was kept.
    pub fn remove_lease(&mut self, key: &ObjectKey) -> Option<LeaseInfo> {
        self.leases.remove(key)
    }

    /// Records the API server's answer to the eviction of helper `key`:
    /// `true` when a PodDisruptionBudget refused it, `false` once it went
    /// through or is no longer wanted.
    pub fn set_eviction_blocked(&mut self, key: &ObjectKey, blocked: bool) {
        if blocked {
            self.blocked_evictions.insert(key.clone());
        } else {
            self.blocked_evictions.remove(key);
        }
    }

    /// Forgets refused evictions that a plan's `evictions` no longer asks
    /// for (the helper is gone, terminating or no longer preempted), so the
    /// set stays as small as the evictions in progress.
    pub fn forget_unwanted_evictions(&mut self, evictions: &[Eviction]) {
        if self.blocked_evictions.is_empty() {
            return;
        }
        self.blocked_evictions
            .retain(|key| evictions.iter().any(|e| &e.key == key));
    }

    /// Helper pods whose last eviction a PodDisruptionBudget refused.
    pub fn blocked_evictions(&self) -> &BTreeSet<ObjectKey> {
        &self.blocked_evictions
    }

    /// The kept classes, by name.
    pub fn classes(&self) -> &BTreeMap<String, ClassInfo> {
        &self.classes
    }

    /// The kept nodes, by name.
    pub fn nodes(&self) -> &BTreeMap<String, NodeInfo> {
        &self.nodes
    }

    /// The kept pods, by key.
    pub fn pods(&self) -> &BTreeMap<ObjectKey, PodInfo> {
        &self.pods
    }

    /// The kept leases, by key.
    pub fn leases(&self) -> &BTreeMap<ObjectKey, LeaseInfo> {
        &self.leases
    }
}
