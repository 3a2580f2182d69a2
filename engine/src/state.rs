//! The engine's kept state: the cluster as ordered maps that the controller
//! updates object by object, so a pass after one event neither re-reads nor
//! re-sorts the other 16,000 objects. Deciding on it runs the very same
//! pass as [`crate::decide`] does on a [`Snapshot`].

use std::collections::BTreeMap;

use jiff::Timestamp;

use super::facts::Facts;
use super::model::{
    BlockedEvictions, ClassInfo, Eviction, LeaseInfo, NodeInfo, ObjectKey, Plan, PodInfo, Refusals,
    Snapshot,
};
use super::pass::{self, Pass, View};
use super::set_apart::{SetApart, merge_by_key};

/// A pod and its lease as kept; an entry with neither is removed. Boxed,
/// so the map's nodes hold two pointers per key rather than both objects
/// inline, and a node's unused slots cost pointers, not objects.
#[derive(Debug, Clone, Default)]
pub(crate) struct Entry {
    pub pod: Option<Box<PodInfo>>,
    pub lease: Option<Box<LeaseInfo>>,
    /// What a pass derives from the two and the kept classes: current
    /// while the entry is live, derived again when an inert one returns.
    pub facts: Facts,
}

impl Entry {
    fn is_empty(&self) -> bool {
        self.pod.is_none() && self.lease.is_none()
    }

    /// True when no pass can act on this entry until it changes (see
    /// [`pass::is_inert`]).
    fn is_inert(&self) -> bool {
        pass::is_inert(self.pod.as_deref(), self.lease.as_deref())
    }

    /// The sequence the entry's lease carries: no new lease takes it.
    pub(crate) fn sequence(&self) -> Option<u64> {
        self.lease.as_ref()?.status()?.sequence
    }

    /// The primary the lease's persisted status says it was preempted for.
    fn preempted_for(&self) -> Option<ObjectKey> {
        let named = self.lease.as_ref()?.status()?.preempted_by.as_deref()?;
        let (namespace, name) = named.split_once('/')?;
        Some(ObjectKey::new(namespace, name))
    }
}

/// A pass that knows the classes only: what deriving an entry's facts reads.
fn classes_only(classes: &BTreeMap<String, ClassInfo>) -> Pass<'_> {
    Pass::index(View::of_classes(classes.values().collect()))
}

fn refresh_facts(pass: &Pass<'_>, entry: &mut Entry) {
    entry.facts = pass.derive_kept_facts(entry.pod.as_deref(), entry.lease.as_deref());
}

/// True when deriving an entry's facts and deciding whether it is parked
/// read the same of both versions of a class (its name aside, which both
/// share): a class whose status alone changed leaves every entry as it is.
fn resolves_alike(a: &ClassInfo, b: &ClassInfo) -> bool {
    a.spec == b.spec && a.created_at == b.created_at
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
/// Three kinds of entry are set apart (see the `set_apart` module), so a
/// pass costs what can change, not what the cluster holds: entries no pass
/// can act on (finished pods and their Released leases, unless released
/// for a preemption); plainly queued leases of StrictFIFO classes, parked
/// in their FIFO order, so a pass builds tickets for the few the queue
/// step may admit; and quiet running primaries, whose capacity a pass
/// reads summed by node. A primary that a preempted helper names is never
/// set apart.
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
    /// Inert, parked and quiet entries (see [`crate::set_apart`]); never
    /// in `entries` at the same time.
    set_apart: SetApart,
    /// Primaries that live entries' leases say they were preempted for,
    /// each with how many: a pass looks them up as tickets (slots are held
    /// back for them, and a victim's grace may be theirs), so they are
    /// neither parked nor set apart.
    preempted_for: BTreeMap<ObjectKey, usize>,
    pod_count: usize,
    lease_count: usize,
    blocked_evictions: BlockedEvictions,
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

    /// Decides one pass over the kept state (the rules of [`crate::decide`]),
    /// and remembers which waiting leases' persisted messages it found
    /// current, so that the next pass need not render them again.
    pub fn decide(&mut self) -> Plan {
        let pass = super::pass_until(self.view(), usize::MAX);
        let settled: Vec<(ObjectKey, crate::message::Settled)> = pass
            .parked_out
            .iter()
            .filter_map(|o| Some((o.key.clone(), o.settled.clone()?)))
            .collect();
        let plan = pass.plan;
        for (key, message) in settled {
            self.set_apart.remember(&key, message);
        }
        plan
    }

    /// [`crate::decide_steps`] on the kept state.
    #[cfg(feature = "fixtures")]
    #[doc(hidden)]
    pub fn decide_steps(&self, steps: usize) -> Plan {
        super::run_until(self.view(), steps)
    }

    fn view(&self) -> View<'_> {
        fn as_entry(e: &Entry) -> pass::PodLease<'_> {
            (e.pod.as_deref(), e.lease.as_deref(), Some(&e.facts))
        }
        View {
            now: self.now,
            classes: self.classes.values().collect(),
            nodes: self.nodes.values().collect(),
            entries: self.entries.values().map(as_entry).collect(),
            set_apart: &self.set_apart,
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

    /// Derives every live entry's facts again, after the classes changed,
    /// and parks or visits each as the classes now say.
    fn refresh_every_entry(&mut self) {
        // Every live entry is kept anew, counting what it names again.
        self.preempted_for.clear();
        let set_apart = self.set_apart.take_every_live();
        let live: Vec<(ObjectKey, Entry)> = std::mem::take(&mut self.entries)
            .into_iter()
            .chain(set_apart)
            .collect();
        for (key, entry) in live {
            self.keep(key, entry);
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
    /// then keeps the entry where it now belongs: live, parked, inert, or
    /// gone when it holds neither pod nor lease.
    fn update<R>(&mut self, key: &ObjectKey, change: impl FnOnce(&mut Entry) -> R) -> R {
        let mut entry = self.take(key).unwrap_or_default();
        let out = change(&mut entry);
        self.keep(key.clone(), entry);
        out
    }

    /// Takes the entry `key` out of wherever it is kept.
    fn take(&mut self, key: &ObjectKey) -> Option<Entry> {
        if let Some(entry) = self.entries.remove(key) {
            if let Some(primary) = entry.preempted_for() {
                self.forget_victim_of(primary);
            }
            return Some(entry);
        }
        self.set_apart.take(key)
    }

    /// Keeps `entry` where it belongs (see [`Engine::update`]), its facts
    /// derived again unless it is inert.
    fn keep(&mut self, key: ObjectKey, mut entry: Entry) {
        if entry.is_empty() {
            return;
        }
        if entry.is_inert() {
            self.set_apart.keep_inert(key, entry);
            return;
        }
        let pass = classes_only(&self.classes);
        refresh_facts(&pass, &mut entry);
        let (key, entry) = if self.preempted_for.contains_key(&key) {
            (key, entry)
        } else {
            match self.set_apart.keep_live(&pass, key, entry) {
                Some(visited) => visited,
                None => return,
            }
        };
        let primary = entry.preempted_for();
        self.entries.insert(key, entry);
        if let Some(primary) = primary {
            self.count_victim_of(primary);
        }
    }

    /// Counts one more helper preempted for `primary`; the first brings the
    /// primary back among the visited entries.
    fn count_victim_of(&mut self, primary: ObjectKey) {
        let n = self.preempted_for.entry(primary.clone()).or_default();
        *n += 1;
        if *n == 1
            && let Some(entry) = self.set_apart.take_live(&primary)
        {
            self.keep(primary, entry);
        }
    }

    /// Counts one helper preempted for `primary` less; after the last, the
    /// primary may be parked or set apart again.
    fn forget_victim_of(&mut self, primary: ObjectKey) {
        let std::collections::btree_map::Entry::Occupied(mut n) =
            self.preempted_for.entry(primary.clone())
        else {
            return;
        };
        *n.get_mut() -= 1;
        if *n.get() > 0 {
            return;
        }
        n.remove();
        if let Some(entry) = self.entries.remove(&primary) {
            // Taken out and kept as any update would (it may name a
            // primary itself, which `take` and `keep` count again).
            if let Some(named) = entry.preempted_for() {
                self.forget_victim_of(named);
            }
            self.keep(primary, entry);
        }
    }

    /// Records the API server's answer to the eviction of helper `key`:
    /// `Some(at)` when a PodDisruptionBudget refused it at `at` (the first
    /// refusal's time is kept), `None` once it went through or is no longer
    /// wanted.
    pub fn set_eviction_blocked(&mut self, key: &ObjectKey, refused_at: Option<Timestamp>) {
        match refused_at {
            Some(at) => {
                self.blocked_evictions
                    .entry(key.clone())
                    .and_modify(|r| r.last = r.last.max(at))
                    .or_insert(Refusals {
                        first: at,
                        last: at,
                    });
            }
            None => {
                self.blocked_evictions.remove(key);
            }
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
            .retain(|key, _| evictions.iter().any(|e| &e.key == key));
    }

    /// Helper pods whose last eviction a PodDisruptionBudget refused.
    pub fn blocked_evictions(&self) -> &BlockedEvictions {
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
        self.entries.get(key).or_else(|| self.set_apart.get(key))
    }

    /// Every entry, visited or set apart, in key order.
    fn all_entries(&self) -> impl Iterator<Item = &Entry> {
        merge_by_key(self.entries.iter(), self.set_apart.iter()).map(|(_, e)| e)
    }

    /// How many leases are parked (see [`Engine`]).
    pub fn parked_count(&self) -> usize {
        self.set_apart.parked_count()
    }

    /// How many quiet primaries are set apart (see [`Engine`]).
    pub fn quiet_primary_count(&self) -> usize {
        self.set_apart.quiet_primary_count()
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

    /// How many entries a pass skips as inert (see [`Engine`]).
    pub fn inert_count(&self) -> usize {
        self.set_apart.inert_count()
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
    use crate::QUEUE_HEAD;
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
    fn assert_decides_as_a_full_pass(engine: &mut Engine) -> Plan {
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
        assert_eq!(engine.inert_count(), 2);
        assert_eq!((engine.pod_count(), engine.lease_count()), (2, 1));
        assert!(engine.entries.is_empty(), "a pass visits neither");
        let plan = assert_decides_as_a_full_pass(&mut engine);
        assert!(plan.create_leases.is_empty() && plan.delete_leases.is_empty());
        assert!(plan.all_lease_statuses().next().is_none() && plan.admissions.is_empty());

        // A new pod's sequence is its stamp, in microseconds.
        engine.upsert_pod(pod("new", 1, 50));
        let plan = assert_decides_as_a_full_pass(&mut engine);
        assert_eq!(plan.create_leases.len(), 1);
        assert_eq!(
            plan.create_leases[0].status.sequence,
            Some(crate::sequence::stamp_sequence(at(50)))
        );

        // Released for a preemption, the lease may still hold slots back
        // for its primary: the pass visits it again.
        let mut preempted = lease(&done, "default", released(7));
        if let Some(st) = preempted.status_mut().as_mut() {
            st.preempted_by = Some("team/new".into());
        }
        engine.upsert_lease(preempted);
        assert_eq!(engine.inert_count(), 1);
        assert_decides_as_a_full_pass(&mut engine);
        engine.upsert_lease(lease(&done, "default", released(7)));
        assert_eq!(engine.inert_count(), 2);

        // A pod replaced under the same name is live again.
        engine.upsert_pod(PodInfo {
            uid: "uid-done-2".into(),
            ..pod("done", 1, 60)
        });
        assert_eq!(engine.inert_count(), 1);
        let plan = assert_decides_as_a_full_pass(&mut engine);
        assert_eq!(plan.delete_leases.len(), 1, "the old lease goes first");

        // Removing what is kept removes inert entries too.
        assert!(engine.remove_pod(&key("orphan")).is_some());
        assert!(engine.remove_lease(&key("done")).is_some());
        assert!(engine.remove_pod(&key("done")).is_some());
        assert_eq!(engine.inert_count(), 0);
        assert_eq!(engine.set_apart.sequence_count(), 0);
        assert_eq!(
            engine
                .pods()
                .map(|p| p.key.name.as_ref())
                .collect::<Vec<_>>(),
            ["new"]
        );
        assert_decides_as_a_full_pass(&mut engine);
    }

    #[test]
    fn a_sequence_stays_taken_while_any_retired_lease_carries_it() {
        let mut engine = Engine::new();
        engine.upsert_class(fixtures::class("default"));
        let stamp = crate::sequence::stamp_sequence(at(50));
        for (name, seq) in [("a", stamp), ("b", stamp + 1), ("c", stamp + 1)] {
            let p = finished(name);
            engine.upsert_lease(lease(&p, "default", released(seq)));
            engine.upsert_pod(p);
        }
        engine.upsert_pod(pod("new", 1, 50));
        let next = |engine: &mut Engine| {
            assert_decides_as_a_full_pass(engine).create_leases[0]
                .status
                .sequence
        };
        assert_eq!(next(&mut engine), Some(stamp + 2));
        engine.remove_lease(&key("b"));
        assert_eq!(next(&mut engine), Some(stamp + 2), "c still carries it");
        engine.remove_lease(&key("c"));
        assert_eq!(next(&mut engine), Some(stamp + 1));
        engine.remove_lease(&key("a"));
        assert_eq!(next(&mut engine), Some(stamp));
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
        assert_eq!(engine.inert_count(), 1, "the primary is inert");
        let plan = assert_decides_as_a_full_pass(&mut engine);
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
        let plan = assert_decides_as_a_full_pass(&mut engine);
        assert_eq!(plan.create_leases.len(), 1, "the fresh pod is queued");

        // The class now manages another resource: neither pod asks for it.
        let mut other = fixtures::class("default");
        other.spec.resource_name = "example.com/gpu".into();
        engine.upsert_class(other);
        let plan = assert_decides_as_a_full_pass(&mut engine);
        assert!(plan.create_leases.is_empty() && plan.admissions.is_empty());

        // Back again, then no longer the default: the unlabelled pods have
        // no class.
        engine.upsert_class(fixtures::class("default"));
        assert_eq!(
            assert_decides_as_a_full_pass(&mut engine)
                .create_leases
                .len(),
            1
        );
        let mut plain = fixtures::class("default");
        plain.spec.default = false;
        engine.upsert_class(plain);
        assert!(
            assert_decides_as_a_full_pass(&mut engine)
                .create_leases
                .is_empty()
        );

        // A class added before it in name order moves its index.
        let mut first = fixtures::class("aaa");
        first.spec.default = true;
        engine.upsert_class(first);
        let plan = assert_decides_as_a_full_pass(&mut engine);
        assert_eq!(plan.create_leases[0].spec.class_name, "aaa");
        engine.remove_class("aaa");
        assert_decides_as_a_full_pass(&mut engine);

        // A class whose status alone changes resolves alike.
        let mut with_status = fixtures::class("default");
        with_status.status = Some(Default::default());
        assert!(resolves_alike(&fixtures::class("default"), &with_status));
        engine.upsert_class(with_status);
        assert_decides_as_a_full_pass(&mut engine);
    }

    #[test]
    fn a_lease_spec_edited_behind_the_operator_is_rewritten_until_it_matches_the_pod() {
        let mut engine = default_class_and_one_node(4);
        let p = pod("a", 2, 1);
        let mut edited = lease(&p, "default", None);
        engine.upsert_lease(edited.clone());
        engine.upsert_pod(p.clone());
        assert!(
            assert_decides_as_a_full_pass(&mut engine)
                .lease_specs
                .is_empty()
        );

        edited.spec_mut().slots = 1;
        engine.upsert_lease(edited.clone());
        let plan = assert_decides_as_a_full_pass(&mut engine);
        assert_eq!(plan.lease_specs.get(&key("a")).map(|s| s.slots), Some(2));

        // The rewrite lands: nothing more to write.
        edited.spec_mut().slots = 2;
        engine.upsert_lease(edited.clone());
        assert!(
            assert_decides_as_a_full_pass(&mut engine)
                .lease_specs
                .is_empty()
        );

        // The pod, not the lease, changes role: the lease follows it.
        engine.upsert_pod(PodInfo {
            role: RoleLabel::Valid(Role::Helper),
            ..p
        });
        let plan = assert_decides_as_a_full_pass(&mut engine);
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

    /// Writes every status and lease the engine's passes ask for back into
    /// it, as the controller's watches would, until a pass asks for none.
    fn settle(engine: &mut Engine) {
        for _ in 0..50 {
            let plan = engine.decide();
            let mut wrote = false;
            for new in &plan.create_leases {
                let pod = engine
                    .pod(&new.key)
                    .cloned()
                    .expect("a lease is made for a pod");
                let mut l = lease(&pod, &new.spec.class_name, Some(new.status.clone()));
                *l.spec_mut() = new.spec.clone();
                engine.upsert_lease(l);
                wrote = true;
            }
            for (key, status) in plan.all_lease_statuses() {
                let mut l = engine.lease(key).cloned().expect("a written lease is kept");
                *l.status_mut() = Some(status.clone());
                engine.upsert_lease(l);
                wrote = true;
            }
            if !wrote {
                return;
            }
        }
        panic!("the engine's passes do not settle");
    }

    /// Runs a pass through its queue step on the kept state.
    fn through_queue_step(engine: &Engine) -> Pass<'_> {
        let mut pass = Pass::index(engine.view());
        pass.join();
        pass.count_leases();
        pass.requeue_overcommitted_redrives();
        pass.assign_sequences();
        pass.retry_evictions();
        pass.run_queues();
        pass
    }

    /// One node of one slot that a running primary holds, `waiting`
    /// primaries queued behind it (`wait-00`, `wait-01`, …), every status
    /// written.
    fn one_running_and_waiting(waiting: i64) -> Engine {
        let mut engine = default_class_and_one_node(1);
        let mut running = pod("running", 1, 0);
        running.gated = false;
        running.phase = PodPhase::Running;
        running.node_name = Some("n1".into());
        engine.upsert_pod(running);
        for i in 0..waiting {
            engine.upsert_pod(pod(&format!("wait-{i:02}"), 1, i + 1));
        }
        settle(&mut engine);
        engine
    }

    #[test]
    fn waiting_and_quiet_leases_are_set_apart_and_the_back_of_a_closed_fifo_is_counted() {
        let mut engine = one_running_and_waiting(30);
        assert_eq!(engine.parked_count(), 30, "every waiting lease is parked");
        assert_eq!(
            engine.quiet_primary_count(),
            1,
            "the running primary is set apart"
        );
        let counted = engine.set_apart.sequence_count();
        assert_eq!(counted, 31, "each set-apart sequence is counted once");
        let pass = through_queue_step(&engine);
        assert_eq!(pass.joined, 0, "the pass visits no entry");
        assert_eq!(
            pass.nodes.free(0, 0),
            0,
            "yet counts what the running pod holds"
        );
        assert_decides_as_a_full_pass(&mut engine);

        // The running pod finishes: the head is admitted, every position
        // moves, and the pass lists only the front of that progress.
        engine.set_progress_limit(Some(3));
        engine.remove_pod(&key("running"));
        let plan = assert_decides_as_a_full_pass(&mut engine);
        assert_eq!(plan.admissions.len(), 1);
        assert_eq!(plan.admissions[0].key, key("wait-00"));
        assert_eq!(plan.lease_progress.len(), 3);
        assert!(plan.progress_truncated);
        let class = &plan.class_statuses["default"];
        assert_eq!(class.queued, 29);
        assert_eq!(class.queue.len(), QUEUE_HEAD);
        let pass = through_queue_step(&engine);
        let counted: u32 = pass.parked_skipped.iter().map(|s| s.count).sum();
        assert!(counted > 0, "the back of the FIFO is counted, not visited");
        // The admitted head and the first that does not fit (which blocks
        // the rest) are decided as tickets; the other 28 are not.
        assert_eq!(pass.tickets.len() - pass.joined, 2);
        assert_eq!(pass.parked_out.len() + counted as usize, 28);

        // Without a limit every lease is compared and written.
        engine.set_progress_limit(None);
        let plan = assert_decides_as_a_full_pass(&mut engine);
        assert_eq!(plan.lease_progress.len(), 29);
        assert!(through_queue_step(&engine).parked_skipped.is_empty());

        // A parked lease that changes is parked again where it now belongs,
        // or visited when it no longer may be parked.
        let mut moved = engine.pod(&key("wait-10")).cloned().expect("kept");
        moved.node_selector.insert("zone".into(), "a".into());
        engine.upsert_pod(moved);
        assert_eq!(
            engine.parked_count(),
            29,
            "a pod with its own nodeSelector is visited"
        );
        assert_decides_as_a_full_pass(&mut engine);
    }

    #[test]
    fn a_message_found_current_is_not_rendered_again_until_its_lease_changes() {
        let mut engine = one_running_and_waiting(5);
        let found = |engine: &Engine| {
            let pass = through_queue_step(engine);
            let found = pass
                .parked_out
                .iter()
                .filter(|o| o.settled.is_some())
                .count();
            assert!(
                pass.parked_out.iter().all(|o| !o.moved),
                "the queue is settled"
            );
            (found, pass.parked_out.len())
        };
        // The last pass of `settle` remembered every current message.
        let (fresh, waiting) = found(&engine);
        assert_eq!(
            (fresh, waiting),
            (0, 4),
            "the head is a ticket; four are remembered"
        );

        // A lease written again is compared again, once.
        let l = engine.lease(&key("wait-03")).cloned().expect("kept");
        engine.upsert_lease(l);
        assert_eq!(found(&engine), (1, 4));
        assert_decides_as_a_full_pass(&mut engine);
        assert_eq!(found(&engine), (0, 4));
    }

    #[test]
    fn a_primary_a_victim_names_is_visited_while_it_is_named() {
        let mut engine = default_class_and_one_node(1);
        for i in 0..3 {
            engine.upsert_pod(pod(&format!("wait-{i}"), 1, i + 1));
        }
        settle(&mut engine);
        let parked = engine.parked_count();
        assert!(parked > 0 && engine.entries.keys().all(|k| k != &key("wait-1")));
        let mut helper = fixtures::helper("helper", 1, 0);
        helper.gated = false;
        helper.phase = PodPhase::Running;
        helper.node_name = Some("n1".into());
        engine.upsert_pod(helper.clone());
        let victim = lease(
            &helper,
            "default",
            Some(GpuLeaseStatus {
                phase: LeasePhase::Preempting,
                sequence: Some(99),
                node: Some("n1".into()),
                preempted_by: Some("team/wait-1".into()),
                ..GpuLeaseStatus::default()
            }),
        );
        engine.upsert_lease(victim.clone());
        // Slots are held for it, and its class may give the victim its
        // grace: the pass finds it among the tickets.
        assert_eq!(engine.parked_count(), parked - 1);
        assert!(engine.entries.contains_key(&key("wait-1")));
        assert_decides_as_a_full_pass(&mut engine);

        // Named twice, it stays visited until neither names it.
        let mut second = lease(&finished("other"), "default", None);
        *second.status_mut() = victim.status().cloned();
        engine.upsert_lease(second);
        engine.remove_lease(&key("helper"));
        assert!(engine.entries.contains_key(&key("wait-1")));
        engine.remove_lease(&key("other"));
        assert_eq!(engine.parked_count(), parked, "parked again");
        assert_decides_as_a_full_pass(&mut engine);
    }
}
