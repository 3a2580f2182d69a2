//! The engine's kept state: the cluster as ordered maps that the controller
//! updates object by object, so a pass after one event neither re-reads nor
//! re-sorts the other 16,000 objects. Deciding on it runs the very same
//! pass as [`crate::decide`] does on a [`Snapshot`].

use std::collections::{BTreeMap, BTreeSet};

use jiff::Timestamp;

use super::facts::Facts;
use super::model::{ClassInfo, Eviction, LeaseInfo, NodeInfo, ObjectKey, Plan, PodInfo, Snapshot};
use super::pass::{self, Pass, View};

/// A pod and its lease as kept; an entry with neither is removed. Boxed,
/// so the map's nodes hold two pointers per key rather than both objects
/// inline (~0.7 KiB, of which a node's unused slots kept a third idle).
#[derive(Debug, Clone, Default)]
pub(crate) struct Entry {
    pub pod: Option<Box<PodInfo>>,
    pub lease: Option<Box<LeaseInfo>>,
    /// What a pass derives from the two and the kept classes: current
    /// while the entry is live, derived again when a retired one returns.
    facts: Facts,
}

impl Entry {
    fn is_empty(&self) -> bool {
        self.pod.is_none() && self.lease.is_none()
    }

    /// True when no pass can act on this entry until it changes (see
    /// [`pass::is_inert`]).
    fn is_retired(&self) -> bool {
        pass::is_inert(self.pod.as_deref(), self.lease.as_deref())
    }

    /// The sequence a retired entry's lease carries: new ones go above it.
    fn sequence(&self) -> Option<u64> {
        self.lease.as_ref()?.status.as_ref()?.sequence
    }
}

/// A pass that knows the classes only: what deriving an entry's facts reads.
fn classes_only(classes: &BTreeMap<String, ClassInfo>) -> Pass<'_> {
    Pass::index(View::of_classes(classes.values().collect()))
}

fn refresh_facts(pass: &Pass<'_>, entry: &mut Entry) {
    entry.facts = pass.derive_kept_facts(entry.pod.as_deref(), entry.lease.as_deref());
}

/// True when resolving a pod's class reads the same of both versions of a
/// class (its name aside, which both share): a class whose status alone
/// changed leaves every entry's facts as they are.
fn resolves_alike(a: &ClassInfo, b: &ClassInfo) -> bool {
    a.spec.resource_name == b.spec.resource_name
        && a.spec.default == b.spec.default
        && a.created_at == b.created_at
}

/// Puts `value` in `slot`, replacing a kept object in place; true when
/// the slot was empty.
fn replace<T>(slot: &mut Option<Box<T>>, value: T) -> bool {
    match slot {
        Some(kept) => {
            **kept = value;
            false
        }
        empty => {
            *empty = Some(Box::new(value));
            true
        }
    }
}

/// The cluster as the engine keeps it between passes: one entry per class
/// and node name and one per pod/lease key, each kept in order.
///
/// Entries no pass can act on (finished pods and their Released leases,
/// unless released for a preemption) are kept apart, so a pass costs what
/// is live and queued, not every pod that ever ran and is not yet deleted.
///
/// What a pass derives from a pod and its lease alone (their facts) is
/// kept with the entry, derived again whenever the entry changes and, for
/// every entry, whenever a class changes in what resolution reads.
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
    /// Retired entries, by key; never in `entries` at the same time.
    retired: BTreeMap<ObjectKey, Entry>,
    /// The sequences of retired leases, each with how many carry it: new
    /// sequences go above every one any lease carries.
    retired_sequences: BTreeMap<u64, usize>,
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
                .map(|e| (e.pod.as_deref(), e.lease.as_deref(), Some(&e.facts)))
                .collect(),
            retired: Some(&self.retired),
            retired_highest: self.retired_sequences.keys().next_back().copied(),
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
        let resolves_alike = self
            .classes
            .get(&class.name)
            .is_some_and(|kept| resolves_alike(kept, &class));
        self.classes.insert(class.name.clone(), class);
        if !resolves_alike {
            self.refresh_every_entry();
        }
    }

    /// Removes the class `name`; returns what was kept.
    pub fn remove_class(&mut self, name: &str) -> Option<ClassInfo> {
        let removed = self.classes.remove(name)?;
        self.refresh_every_entry();
        Some(removed)
    }

    /// Derives every live entry's facts again, after the classes changed.
    fn refresh_every_entry(&mut self) {
        let pass = classes_only(&self.classes);
        for entry in self.entries.values_mut() {
            refresh_facts(&pass, entry);
        }
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
        let key = pod.key.clone();
        let added = self.update(&key, |e| replace(&mut e.pod, pod));
        self.pod_count += usize::from(added);
    }

    /// Removes the pod `key`; returns what was kept.
    pub fn remove_pod(&mut self, key: &ObjectKey) -> Option<PodInfo> {
        let pod = self.update(key, |e| e.pod.take())?;
        self.pod_count -= 1;
        Some(*pod)
    }

    /// Adds or replaces the lease with that key.
    pub fn upsert_lease(&mut self, lease: LeaseInfo) {
        let key = lease.key.clone();
        let added = self.update(&key, |e| replace(&mut e.lease, lease));
        self.lease_count += usize::from(added);
    }

    /// Removes the lease `key`; returns what was kept.
    pub fn remove_lease(&mut self, key: &ObjectKey) -> Option<LeaseInfo> {
        let lease = self.update(key, |e| e.lease.take())?;
        self.lease_count -= 1;
        Some(*lease)
    }

    /// Applies `change` to the entry `key` (an empty one if none is kept),
    /// then keeps the entry where it now belongs: live, retired, or gone
    /// when it holds neither pod nor lease.
    fn update<R>(&mut self, key: &ObjectKey, change: impl FnOnce(&mut Entry) -> R) -> R {
        if let Some(entry) = self.entries.get_mut(key) {
            let out = change(entry);
            if entry.is_empty() {
                self.entries.remove(key);
            } else if entry.is_retired() {
                if let Some(entry) = self.entries.remove(key) {
                    self.retire(key.clone(), entry);
                }
            } else {
                refresh_facts(&classes_only(&self.classes), entry);
            }
            return out;
        }
        let mut entry = match self.retired.remove(key) {
            Some(entry) => {
                self.forget_sequence(&entry);
                entry
            }
            None => Entry::default(),
        };
        let out = change(&mut entry);
        if entry.is_empty() {
            return out;
        }
        if entry.is_retired() {
            self.retire(key.clone(), entry);
        } else {
            refresh_facts(&classes_only(&self.classes), &mut entry);
            self.entries.insert(key.clone(), entry);
        }
        out
    }

    fn retire(&mut self, key: ObjectKey, entry: Entry) {
        if let Some(seq) = entry.sequence() {
            *self.retired_sequences.entry(seq).or_default() += 1;
        }
        self.retired.insert(key, entry);
    }

    fn forget_sequence(&mut self, entry: &Entry) {
        let Some(seq) = entry.sequence() else {
            return;
        };
        if let Some(n) = self.retired_sequences.get_mut(&seq) {
            *n -= 1;
            if *n == 0 {
                self.retired_sequences.remove(&seq);
            }
        }
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

    fn entry(&self, key: &ObjectKey) -> Option<&Entry> {
        self.entries.get(key).or_else(|| self.retired.get(key))
    }

    /// Every entry, live and retired, in key order.
    fn all_entries(&self) -> impl Iterator<Item = &Entry> {
        let mut live = self.entries.iter().peekable();
        let mut retired = self.retired.iter().peekable();
        std::iter::from_fn(move || {
            let take_live = match (live.peek(), retired.peek()) {
                (Some((a, _)), Some((b, _))) => a < b,
                (a, _) => a.is_some(),
            };
            let next = if take_live {
                live.next()
            } else {
                retired.next()
            };
            next.map(|(_, e)| e)
        })
    }

    /// The kept pod `key`.
    pub fn pod(&self, key: &ObjectKey) -> Option<&PodInfo> {
        self.entry(key)?.pod.as_deref()
    }

    /// The kept lease `key`.
    pub fn lease(&self, key: &ObjectKey) -> Option<&LeaseInfo> {
        self.entry(key)?.lease.as_deref()
    }

    /// The kept pods, in key order.
    pub fn pods(&self) -> impl Iterator<Item = &PodInfo> {
        self.all_entries().filter_map(|e| e.pod.as_deref())
    }

    /// The kept leases, in key order.
    pub fn leases(&self) -> impl Iterator<Item = &LeaseInfo> {
        self.all_entries().filter_map(|e| e.lease.as_deref())
    }

    /// How many entries a pass skips as retired (see [`Engine`]).
    pub fn retired_count(&self) -> usize {
        self.retired.len()
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
    use crate::fixtures::{self, at, key, lease, pod};
    use crate::model::{PodPhase, RoleLabel};
    use gpupool_api::{GpuLeaseStatus, LeasePhase, Role};

    fn released(sequence: u64) -> Option<GpuLeaseStatus> {
        Some(GpuLeaseStatus {
            phase: LeasePhase::Released,
            sequence: Some(sequence),
            message: Some("released".into()),
            ..GpuLeaseStatus::default()
        })
    }

    fn finished(name: &str) -> PodInfo {
        PodInfo {
            phase: PodPhase::Succeeded,
            gated: false,
            node_name: Some("n1".into()),
            ..pod(name, 1, 0)
        }
    }

    /// An engine at time 100 with the default class and node `n1` of
    /// `slots` slots.
    fn default_class_and_one_node(slots: u32) -> Engine {
        let mut engine = Engine::new();
        engine.set_now(at(100));
        engine.upsert_class(fixtures::class("default"));
        engine.upsert_node(fixtures::node("n1", slots));
        engine
    }

    /// The kept engine decides as a pass over its own snapshot does.
    fn assert_decides_as_a_full_pass(engine: &Engine) -> Plan {
        let plan = engine.decide();
        assert_eq!(plan, crate::decide(&engine.to_snapshot()));
        plan
    }

    #[test]
    fn finished_pods_and_released_leases_are_retired_until_they_change() {
        let mut engine = default_class_and_one_node(1);
        let done = finished("done");
        engine.upsert_pod(done.clone());
        engine.upsert_lease(lease(&done, "default", released(7)));
        // A finished pod whose lease is gone.
        engine.upsert_pod(finished("orphan"));
        assert_eq!(engine.retired_count(), 2);
        assert_eq!((engine.pod_count(), engine.lease_count()), (2, 1));
        assert!(engine.entries.is_empty(), "a pass visits neither");
        let plan = assert_decides_as_a_full_pass(&engine);
        assert!(plan.create_leases.is_empty() && plan.delete_leases.is_empty());
        assert!(plan.all_lease_statuses().next().is_none() && plan.admissions.is_empty());

        // A new pod's sequence goes above the retired lease's.
        engine.upsert_pod(pod("new", 1, 50));
        let plan = assert_decides_as_a_full_pass(&engine);
        assert_eq!(plan.create_leases.len(), 1);
        assert_eq!(plan.create_leases[0].status.sequence, Some(8));

        // Released for a preemption, the lease may still hold slots back
        // for its primary: the pass visits it again.
        let mut preempted = lease(&done, "default", released(7));
        if let Some(st) = preempted.status.as_mut() {
            st.preempted_by = Some("team/new".into());
        }
        engine.upsert_lease(preempted);
        assert_eq!(engine.retired_count(), 1);
        assert_decides_as_a_full_pass(&engine);
        engine.upsert_lease(lease(&done, "default", released(7)));
        assert_eq!(engine.retired_count(), 2);

        // A pod replaced under the same name is live again.
        engine.upsert_pod(PodInfo {
            uid: "uid-done-2".into(),
            ..pod("done", 1, 60)
        });
        assert_eq!(engine.retired_count(), 1);
        let plan = assert_decides_as_a_full_pass(&engine);
        assert_eq!(plan.delete_leases.len(), 1, "the old lease goes first");

        // Removing what is kept removes retired entries too.
        assert!(engine.remove_pod(&key("orphan")).is_some());
        assert!(engine.remove_lease(&key("done")).is_some());
        assert!(engine.remove_pod(&key("done")).is_some());
        assert_eq!(engine.retired_count(), 0);
        assert!(engine.retired_sequences.is_empty());
        assert_eq!(
            engine
                .pods()
                .map(|p| p.key.name.as_ref())
                .collect::<Vec<_>>(),
            ["new"]
        );
        assert_decides_as_a_full_pass(&engine);
    }

    #[test]
    fn the_highest_sequence_is_kept_while_any_retired_lease_carries_it() {
        let mut engine = Engine::new();
        engine.upsert_class(fixtures::class("default"));
        for (name, seq) in [("a", 5), ("b", 9), ("c", 9)] {
            let p = finished(name);
            engine.upsert_lease(lease(&p, "default", released(seq)));
            engine.upsert_pod(p);
        }
        engine.upsert_pod(pod("new", 1, 50));
        let next = |engine: &Engine| {
            assert_decides_as_a_full_pass(engine).create_leases[0]
                .status
                .sequence
        };
        assert_eq!(next(&engine), Some(10));
        engine.remove_lease(&key("b"));
        assert_eq!(next(&engine), Some(10), "c still carries 9");
        engine.remove_lease(&key("c"));
        assert_eq!(next(&engine), Some(6));
    }

    #[test]
    fn a_helper_preempted_for_a_finished_primary_is_evicted_with_its_class_grace() {
        let mut engine = Engine::new();
        engine.set_now(at(100));
        let mut gpu = fixtures::class("gpu");
        gpu.spec.helpers.grace_period_seconds = 7;
        engine.upsert_class(gpu);
        engine.upsert_node(fixtures::node("n1", 1));
        // The primary the helper was evicted for has finished.
        let primary = PodInfo {
            class_label: Some("gpu".into()),
            ..finished("p")
        };
        engine.upsert_lease(lease(&primary, "gpu", released(2)));
        engine.upsert_pod(primary);
        // The helper's own class is gone; its eviction is still asked for.
        let helper = PodInfo {
            role: RoleLabel::Valid(Role::Helper),
            class_label: Some("gone".into()),
            phase: PodPhase::Running,
            gated: false,
            node_name: Some("n1".into()),
            ..pod("h", 1, 1)
        };
        engine.upsert_lease(lease(
            &helper,
            "gone",
            Some(GpuLeaseStatus {
                phase: LeasePhase::Preempting,
                sequence: Some(1),
                node: Some("n1".into()),
                preempted_by: Some("team/p".into()),
                ..GpuLeaseStatus::default()
            }),
        ));
        engine.upsert_pod(helper);
        assert_eq!(engine.retired_count(), 1, "the primary is retired");
        let plan = assert_decides_as_a_full_pass(&engine);
        assert_eq!(plan.evictions.len(), 1);
        assert_eq!(plan.evictions[0].grace_period_seconds, 7);
    }

    #[test]
    fn class_changes_that_resolution_reads_derive_every_entry_again() {
        let mut engine = default_class_and_one_node(1);
        let waiting = pod("waiting", 1, 1);
        engine.upsert_lease(lease(&waiting, "default", None));
        engine.upsert_pod(waiting);
        engine.upsert_pod(pod("fresh", 1, 2));
        let plan = assert_decides_as_a_full_pass(&engine);
        assert_eq!(plan.create_leases.len(), 1, "the fresh pod is queued");

        // The class now manages another resource: neither pod asks for it.
        let mut other = fixtures::class("default");
        other.spec.resource_name = "example.com/gpu".into();
        engine.upsert_class(other);
        let plan = assert_decides_as_a_full_pass(&engine);
        assert!(plan.create_leases.is_empty() && plan.admissions.is_empty());

        // Back again, then no longer the default: the unlabelled pods have
        // no class.
        engine.upsert_class(fixtures::class("default"));
        assert_eq!(
            assert_decides_as_a_full_pass(&engine).create_leases.len(),
            1
        );
        let mut plain = fixtures::class("default");
        plain.spec.default = false;
        engine.upsert_class(plain);
        assert!(
            assert_decides_as_a_full_pass(&engine)
                .create_leases
                .is_empty()
        );

        // A class added before it in name order moves its index.
        let mut first = fixtures::class("aaa");
        first.spec.default = true;
        engine.upsert_class(first);
        let plan = assert_decides_as_a_full_pass(&engine);
        assert_eq!(plan.create_leases[0].spec.class_name, "aaa");
        engine.remove_class("aaa");
        assert_decides_as_a_full_pass(&engine);

        // A class whose status alone changes resolves alike.
        let mut with_status = fixtures::class("default");
        with_status.status = Some(Default::default());
        assert!(resolves_alike(&fixtures::class("default"), &with_status));
        engine.upsert_class(with_status);
        assert_decides_as_a_full_pass(&engine);
    }

    #[test]
    fn a_lease_spec_edited_behind_the_operator_is_rewritten_until_it_matches_the_pod() {
        let mut engine = default_class_and_one_node(4);
        let p = pod("a", 2, 1);
        let mut edited = lease(&p, "default", None);
        engine.upsert_lease(edited.clone());
        engine.upsert_pod(p.clone());
        assert!(
            assert_decides_as_a_full_pass(&engine)
                .lease_specs
                .is_empty()
        );

        edited.spec.slots = 1;
        engine.upsert_lease(edited.clone());
        let plan = assert_decides_as_a_full_pass(&engine);
        assert_eq!(plan.lease_specs.get(&key("a")).map(|s| s.slots), Some(2));

        // The rewrite lands: nothing more to write.
        edited.spec.slots = 2;
        engine.upsert_lease(edited.clone());
        assert!(
            assert_decides_as_a_full_pass(&engine)
                .lease_specs
                .is_empty()
        );

        // The pod, not the lease, changes role: the lease follows it.
        engine.upsert_pod(PodInfo {
            role: RoleLabel::Valid(Role::Helper),
            ..p
        });
        let plan = assert_decides_as_a_full_pass(&engine);
        assert_eq!(
            plan.lease_specs.get(&key("a")).map(|s| s.role),
            Some(Role::Helper)
        );
    }

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
