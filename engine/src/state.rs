//! The engine's kept state: the cluster as ordered maps that the controller
//! updates object by object, so a pass after one event neither re-reads nor
//! re-sorts the other 16,000 objects. Deciding on it runs the very same
//! pass as [`crate::decide`] does on a [`Snapshot`].

use std::collections::{BTreeMap, BTreeSet};

use jiff::Timestamp;

use super::model::{ClassInfo, Eviction, LeaseInfo, NodeInfo, ObjectKey, Plan, PodInfo, Snapshot};
use super::pass::View;

/// A pod and its lease as kept; an entry with neither is removed. Boxed,
/// so the map's nodes hold two pointers per key rather than both objects
/// inline (~0.7 KiB, of which a node's unused slots kept a third idle).
#[derive(Debug, Clone, Default)]
struct Entry {
    pod: Option<Box<PodInfo>>,
    lease: Option<Box<LeaseInfo>>,
}

/// Puts `value` in the slot of its key's entry that `slot` picks, replacing
/// a kept object in place; true when the slot was empty.
fn put<T>(
    entries: &mut BTreeMap<ObjectKey, Entry>,
    value: T,
    key: fn(&T) -> &ObjectKey,
    slot: fn(&mut Entry) -> &mut Option<Box<T>>,
) -> bool {
    if let Some(entry) = entries.get_mut(key(&value)) {
        return match slot(entry) {
            Some(kept) => {
                **kept = value;
                false
            }
            empty => {
                *empty = Some(Box::new(value));
                true
            }
        };
    }
    let mut entry = Entry::default();
    let k = key(&value).clone();
    *slot(&mut entry) = Some(Box::new(value));
    entries.insert(k, entry);
    true
}

/// The cluster as the engine keeps it between passes: one entry per class
/// and node name and one per pod/lease key, each kept in order.
///
/// Guarantee: after any sequence of updates, [`Engine::decide`] returns the
/// same plan as [`crate::decide`] on [`Engine::to_snapshot`].
#[derive(Debug, Clone, Default)]
pub struct Engine {
    now: Timestamp,
    classes: BTreeMap<String, ClassInfo>,
    nodes: BTreeMap<String, NodeInfo>,
    /// Each pod with its lease, by their shared key: a pass walks them
    /// already paired.
    entries: BTreeMap<ObjectKey, Entry>,
    pod_count: usize,
    lease_count: usize,
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
            if engine.pod(&p.key).is_none() {
                engine.upsert_pod(p.clone());
            }
        }
        for l in &snapshot.leases {
            if engine.lease(&l.key).is_none() {
                engine.upsert_lease(l.clone());
            }
        }
        engine
    }

    /// The same cluster as a snapshot, every list in order.
    pub fn to_snapshot(&self) -> Snapshot {
        Snapshot {
            now: self.now,
            classes: self.classes.values().cloned().collect(),
            nodes: self.nodes.values().cloned().collect(),
            pods: self.pods().cloned().collect(),
            leases: self.leases().cloned().collect(),
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
            entries: self
                .entries
                .values()
                .map(|e| (e.pod.as_deref(), e.lease.as_deref()))
                .collect(),
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
        let added = put(&mut self.entries, pod, |p| &p.key, |e| &mut e.pod);
        self.pod_count += usize::from(added);
    }

    /// Removes the pod `key`; returns what was kept.
    pub fn remove_pod(&mut self, key: &ObjectKey) -> Option<PodInfo> {
        let entry = self.entries.get_mut(key)?;
        let pod = entry.pod.take()?;
        self.pod_count -= 1;
        if entry.lease.is_none() {
            self.entries.remove(key);
        }
        Some(*pod)
    }

    /// Adds or replaces the lease with that key.
    pub fn upsert_lease(&mut self, lease: LeaseInfo) {
        let added = put(&mut self.entries, lease, |l| &l.key, |e| &mut e.lease);
        self.lease_count += usize::from(added);
    }

    /// Removes the lease `key`; returns what was kept.
    pub fn remove_lease(&mut self, key: &ObjectKey) -> Option<LeaseInfo> {
        let entry = self.entries.get_mut(key)?;
        let lease = entry.lease.take()?;
        self.lease_count -= 1;
        if entry.pod.is_none() {
            self.entries.remove(key);
        }
        Some(*lease)
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

    /// The kept pod `key`.
    pub fn pod(&self, key: &ObjectKey) -> Option<&PodInfo> {
        self.entries.get(key)?.pod.as_deref()
    }

    /// The kept lease `key`.
    pub fn lease(&self, key: &ObjectKey) -> Option<&LeaseInfo> {
        self.entries.get(key)?.lease.as_deref()
    }

    /// The kept pods, in key order.
    pub fn pods(&self) -> impl Iterator<Item = &PodInfo> {
        self.entries.values().filter_map(|e| e.pod.as_deref())
    }

    /// The kept leases, in key order.
    pub fn leases(&self) -> impl Iterator<Item = &LeaseInfo> {
        self.entries.values().filter_map(|e| e.lease.as_deref())
    }

    /// How many pods are kept.
    pub fn pod_count(&self) -> usize {
        self.pod_count
    }

    /// How many leases are kept.
    pub fn lease_count(&self) -> usize {
        self.lease_count
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::{key, lease, pod};

    #[test]
    fn a_pod_and_its_lease_share_one_entry_that_goes_with_the_last_of_them() {
        let mut engine = Engine::new();
        let p = pod("a", 1, 0);
        engine.upsert_pod(p.clone());
        engine.upsert_lease(lease(&p, "default", None));
        engine.upsert_pod(p.clone());
        assert_eq!((engine.pod_count(), engine.lease_count()), (1, 1));

        assert!(engine.remove_pod(&key("a")).is_some());
        assert!(engine.remove_pod(&key("a")).is_none(), "removed once");
        assert_eq!((engine.pod_count(), engine.lease_count()), (0, 1));
        assert!(engine.lease(&key("a")).is_some(), "the lease stays");
        assert_eq!(engine.to_snapshot().pods.len(), 0);

        assert!(engine.remove_lease(&key("a")).is_some());
        assert_eq!((engine.pod_count(), engine.lease_count()), (0, 0));
        assert!(engine.entries.is_empty(), "no empty entry is kept");
        assert!(engine.remove_lease(&key("a")).is_none());
    }
}
