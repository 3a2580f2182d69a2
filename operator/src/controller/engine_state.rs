//! The engine's state kept across passes ([`EngineState`]), brought up to
//! date with only what changed.
//!
//! Each watch records the keys its events touched
//! ([`ChangeLog`](crate::index::changes::ChangeLog)); a pass looks at those
//! keys, and at the keys the controller's records of its own writes name
//! ([`OwnWrites`]), and at nothing else. For each key it asks the cache and
//! those records what the pass sees, and hands the engine a new translation
//! only when that is another object (a watch cache hands out the same `Arc`
//! for an object until an event replaces it, and the records keep the same
//! `Arc` for a write they lay over the cache). So a pass
//! after one event looks at a handful of keys and translates one object,
//! however many pods and leases are cached. After a re-list and at the
//! first pass every key is looked at, by the same rule; when the classes'
//! resources change, every node is (a pod's translation does not depend on
//! them).
//!
//! The walk over a kind's keys is written once (`EntrySync::sync_kind`);
//! each of the four kinds keeps its own impl of the `Kind` trait because
//! what is left in it is exactly what differs and cannot be said once: how
//! the own writes are laid over the cache (not at all for nodes, with a
//! held lease for leases, with an eviction flag for pods), what
//! its translation needs (the classes' resources, the unmanaged namespaces,
//! the pass's time), and how the flag reaches the engine's entry. What the
//! impls still share is the trait's outline; a macro or a table of closures
//! would save those few lines by hiding the differences a reader comes for.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Instant;

use gpupool_api::GpuLeaseClass;
use jiff::Timestamp;
use k8s_openapi::api::core::v1::Node;

use super::own_writes::OwnWrites;
use crate::engine::{
    CachedLease, ClassInfo, Engine, Eviction, LeaseInfo, NodeInfo, ObjectKey, PodInfo,
};
use crate::index::cached_pod::CachedPod;
use crate::index::caches::Caches;
use crate::index::changes::Changes;
use crate::index::key_hash::{HashMap, HashSet};
use crate::index::store::Index;
use crate::index::translate;

/// Where the engine's entry for one key came from.
struct EntrySource<K> {
    /// The object it was translated from. Held, so that an equal address
    /// next pass means the same object.
    obj: Arc<K>,
    /// The pass-dependent bit it was translated with (evicted, missing).
    flag: bool,
}

/// What [`EntrySources::sync_entry`] asks the engine to do for a key.
pub enum Change<V> {
    /// Keep `V`, translated with the given flag (new or replaced).
    Upsert(V, bool),
    /// Nothing is kept for the key any more.
    Remove,
}

/// For one kind, the object each of the engine's entries was translated
/// from, by key. An object that does not translate (a pod that asks for no
/// class's resource, say) is not remembered: a cluster's other pods cost
/// nothing here, and a pass looks at such a key again only when it changes.
pub struct EntrySources<K> {
    by_key: HashMap<ObjectKey, EntrySource<K>>,
}

impl<K> Default for EntrySources<K> {
    fn default() -> Self {
        Self {
            by_key: HashMap::default(),
        }
    }
}

impl<K> EntrySources<K> {
    /// Brings the engine's entry for `key` in line with `view` (the object
    /// a pass sees and its flag, or nothing): `translate` is called only
    /// when the object or the flag differs from the entry's source, and
    /// `apply` gets an upsert when it translates, or a removal when the
    /// engine had an entry for `key` and no longer should.
    ///
    /// Guarantee: afterwards the engine keeps, for `key`, the translation
    /// of the viewed object, or nothing when there is none or it does not
    /// translate.
    pub fn sync_entry<V>(
        &mut self,
        key: &ObjectKey,
        view: Option<(Arc<K>, bool)>,
        translate: impl FnOnce(&Arc<K>) -> Option<V>,
        mut apply: impl FnMut(Change<V>),
    ) {
        let Some((obj, flag)) = view else {
            if self.by_key.remove(key).is_some() {
                apply(Change::Remove);
            }
            return;
        };
        if let Some(old) = self.by_key.get(key)
            && Arc::ptr_eq(&old.obj, &obj)
            && old.flag == flag
        {
            return;
        }
        match translate(&obj) {
            Some(value) => {
                apply(Change::Upsert(value, flag));
                self.by_key.insert(key.clone(), EntrySource { obj, flag });
            }
            None => {
                if self.by_key.remove(key).is_some() {
                    apply(Change::Remove);
                }
            }
        }
    }

    /// The object the engine's entry for `key` was translated from.
    pub fn get(&self, key: &ObjectKey) -> Option<&Arc<K>> {
        self.by_key.get(key).map(|f| &f.obj)
    }

    /// Forgets everything, removing each entry from the engine through `remove`.
    fn clear(&mut self, mut remove: impl FnMut(&ObjectKey)) {
        for key in self.by_key.drain().map(|(key, _)| key) {
            remove(&key);
        }
    }

    /// Number of keys the engine keeps from this kind.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.by_key.len()
    }
}

/// The keys a pass looks at for one kind: those a watch changed (or every
/// cached key and every key with an entry after a re-list), and those the
/// own-writes records add (`own_write_keys`: those they name now, and
/// those they named when the last pass ended).
fn keys_to_look_at<K>(
    changes: Changes,
    store: &Index<K>,
    sources: &EntrySources<K>,
    own_write_keys: impl FnOnce(&mut HashSet<ObjectKey>),
) -> HashSet<ObjectKey> {
    let mut keys = match changes {
        Changes::Keys(keys) => keys,
        Changes::Everything => store
            .keys()
            .into_iter()
            .chain(sources.by_key.keys().cloned())
            .collect(),
    };
    own_write_keys(&mut keys);
    keys
}

/// What a pass sees of one key: the object the engine's entry is to come
/// from, with its pass-dependent flag, or nothing.
type Seen<K> = Option<(Arc<K>, bool)>;

/// One kind of object as a pass hands it to the engine: where its objects
/// are cached, what a pass sees of a key, and how an object becomes (or
/// stops being) an engine entry.
trait Kind {
    /// The object as its cache keeps it.
    type Object;
    /// The engine's entry for one object.
    type Entry;

    /// The watch cache of this kind.
    fn cache(&self) -> &Index<Self::Object>;

    /// Adds to `keys` the keys of this kind the own-writes records ask a
    /// pass to look at.
    fn own_write_keys(own_writes: &mut OwnWrites, keys: &mut HashSet<ObjectKey>);

    /// What the pass sees of `key`, given where the engine's entries came
    /// from (`sources`).
    fn see(
        &self,
        key: &ObjectKey,
        sources: &EntrySources<Self::Object>,
        own_writes: &mut OwnWrites,
        at: Instant,
    ) -> Seen<Self::Object>;

    /// The engine's entry for `obj`, seen under `key`; `None` when it does
    /// not translate.
    fn translate(&self, key: &ObjectKey, obj: &Arc<Self::Object>) -> Option<Self::Entry>;

    /// Tells the engine of `change` to its entry for `key`.
    fn apply(engine: &mut Engine, key: &ObjectKey, change: Change<Self::Entry>);
}

/// What a pass brings every kind's entries up to date with: the engine,
/// the own writes laid over the caches, and the pass's instant.
struct EntrySync<'e, 'o> {
    engine: &'e mut Engine,
    own_writes: &'o mut OwnWrites,
    at: Instant,
}

impl EntrySync<'_, '_> {
    /// Brings the engine's entries of one kind in line with what the pass
    /// sees, looking only at the keys [`keys_to_look_at`] names for
    /// `changes`.
    ///
    /// Guarantee: afterwards, for each of those keys, the engine keeps the
    /// translation of the object the pass sees, or nothing (see
    /// [`EntrySources::sync_entry`]).
    fn sync_kind<T: Kind>(
        &mut self,
        kind: &T,
        changes: Changes,
        sources: &mut EntrySources<T::Object>,
    ) {
        let own_writes = &mut *self.own_writes;
        let keys = keys_to_look_at(changes, kind.cache(), sources, |keys| {
            T::own_write_keys(own_writes, keys)
        });
        for key in &keys {
            let view = kind.see(key, sources, self.own_writes, self.at);
            sources.sync_entry(
                key,
                view,
                |obj| kind.translate(key, obj),
                |change| T::apply(self.engine, key, change),
            );
        }
    }
}

/// Classes, with the controller's newer status writes laid over them.
struct Classes<'c> {
    cache: &'c Index<GpuLeaseClass>,
}

impl Kind for Classes<'_> {
    type Object = GpuLeaseClass;
    type Entry = ClassInfo;

    fn cache(&self) -> &Index<GpuLeaseClass> {
        self.cache
    }

    fn own_write_keys(own_writes: &mut OwnWrites, keys: &mut HashSet<ObjectKey>) {
        own_writes.class_keys_to_look_at(keys);
    }

    fn see(
        &self,
        key: &ObjectKey,
        _: &EntrySources<GpuLeaseClass>,
        own_writes: &mut OwnWrites,
        at: Instant,
    ) -> Seen<GpuLeaseClass> {
        let class = own_writes.class_with_own_writes(key, self.cache.get(key), at);
        class.map(|class| (class, false))
    }

    fn translate(&self, _: &ObjectKey, class: &Arc<GpuLeaseClass>) -> Option<ClassInfo> {
        translate::class_info(class)
    }

    fn apply(engine: &mut Engine, key: &ObjectKey, change: Change<ClassInfo>) {
        match change {
            Change::Upsert(class, _) => engine.upsert_class(class),
            Change::Remove => drop(engine.remove_class(&key.name)),
        }
    }
}

/// Nodes as the cache has them (the controller never writes one),
/// translated for the classes' resources.
struct Nodes<'c> {
    cache: &'c Index<Node>,
    resources: &'c BTreeSet<String>,
}

impl Kind for Nodes<'_> {
    type Object = Node;
    type Entry = NodeInfo;

    fn cache(&self) -> &Index<Node> {
        self.cache
    }

    fn own_write_keys(_: &mut OwnWrites, _: &mut HashSet<ObjectKey>) {}

    fn see(
        &self,
        key: &ObjectKey,
        _: &EntrySources<Node>,
        _: &mut OwnWrites,
        _: Instant,
    ) -> Seen<Node> {
        self.cache.get(key).map(|node| (node, false))
    }

    fn translate(&self, _: &ObjectKey, node: &Arc<Node>) -> Option<NodeInfo> {
        translate::node_info(node, self.resources)
    }

    fn apply(engine: &mut Engine, key: &ObjectKey, change: Change<NodeInfo>) {
        match change {
            Change::Upsert(node, _) => engine.upsert_node(node),
            Change::Remove => drop(engine.remove_node(&key.name)),
        }
    }
}

/// Leases, with the controller's writes laid over them, held a while after
/// they vanish while their pods are still cached (see
/// [`OwnWrites::lease_with_own_writes`]); flagged when missing (to be made
/// again).
struct Leases<'c> {
    cache: &'c Index<CachedLease>,
    pods: &'c Index<CachedPod>,
}

impl Kind for Leases<'_> {
    type Object = CachedLease;
    type Entry = LeaseInfo;

    fn cache(&self) -> &Index<CachedLease> {
        self.cache
    }

    fn own_write_keys(own_writes: &mut OwnWrites, keys: &mut HashSet<ObjectKey>) {
        own_writes.lease_keys_to_look_at(keys);
    }

    fn see(
        &self,
        key: &ObjectKey,
        sources: &EntrySources<CachedLease>,
        own_writes: &mut OwnWrites,
        at: Instant,
    ) -> Seen<CachedLease> {
        // A lease is named like its pod, in its pod's namespace.
        let pod_cached = |lease: &CachedLease| {
            self.pods
                .get(key)
                .is_some_and(|p| p.metadata.uid.as_deref() == Some(lease.spec.pod_uid.as_str()))
        };
        let lease = own_writes.lease_with_own_writes(
            key,
            self.cache.get(key),
            sources.get(key),
            pod_cached,
            at,
        );
        let missing = own_writes.is_missing(key, at);
        lease.map(|lease| (lease, missing))
    }

    fn translate(&self, key: &ObjectKey, lease: &Arc<CachedLease>) -> Option<LeaseInfo> {
        // The engine keeps the lease the pass sees, not a copy, under the
        // key the index holds.
        Some(LeaseInfo::new(key.clone(), lease.clone()))
    }

    fn apply(engine: &mut Engine, key: &ObjectKey, change: Change<LeaseInfo>) {
        match change {
            Change::Upsert(mut lease, missing) => {
                lease.missing = missing;
                engine.upsert_lease(lease);
            }
            Change::Remove => drop(engine.remove_lease(key)),
        }
    }
}

/// Pods, with the controller's writes laid over them; flagged when the
/// controller has evicted them (terminating, as far as the engine goes).
struct Pods<'c> {
    cache: &'c Index<CachedPod>,
    resources: &'c BTreeSet<String>,
    unmanaged_namespaces: &'c [String],
    now: Timestamp,
}

impl Kind for Pods<'_> {
    type Object = CachedPod;
    type Entry = PodInfo;

    fn cache(&self) -> &Index<CachedPod> {
        self.cache
    }

    fn own_write_keys(own_writes: &mut OwnWrites, keys: &mut HashSet<ObjectKey>) {
        own_writes.pod_keys_to_look_at(keys);
    }

    fn see(
        &self,
        key: &ObjectKey,
        _: &EntrySources<CachedPod>,
        own_writes: &mut OwnWrites,
        at: Instant,
    ) -> Seen<CachedPod> {
        let pod = own_writes.pod_with_own_writes(key, self.cache.get(key), at);
        // Asked after laying the pod, which forgets an eviction the pod shows.
        let evicted = own_writes.is_evicted(key);
        pod.map(|pod| (pod, evicted))
    }

    fn translate(&self, _: &ObjectKey, pod: &Arc<CachedPod>) -> Option<PodInfo> {
        // A pod without a creation time (no API server sends one) keeps
        // the time it was first seen.
        let mut info = translate::pod_info(pod.as_ref(), self.resources, self.now)?;
        info.unmanaged = self
            .unmanaged_namespaces
            .iter()
            .any(|ns| **ns == *info.key.namespace);
        Some(info)
    }

    fn apply(engine: &mut Engine, key: &ObjectKey, change: Change<PodInfo>) {
        match change {
            Change::Upsert(mut pod, evicted) => {
                pod.terminating |= evicted;
                pod.key = key.clone();
                engine.upsert_pod(pod);
            }
            Change::Remove => drop(engine.remove_pod(key)),
        }
    }
}

/// The admission engine and, for each of its entries, the object it was
/// translated from: what the decision loop keeps from pass to pass.
/// [`EngineState::sync`] brings it up to date with what changed.
#[derive(Default)]
pub struct EngineState {
    engine: Engine,
    /// The class resources nodes were translated for (and whose unreadable
    /// pod requests are worth a warning).
    resources: BTreeSet<String>,
    classes: EntrySources<GpuLeaseClass>,
    nodes: EntrySources<Node>,
    pods: EntrySources<CachedPod>,
    leases: EntrySources<CachedLease>,
}

/// One decision pass's inputs: the engine brought up to date, and the raw
/// objects its entries came from (the writes need their UIDs and versions).
pub struct PassInput<'k> {
    /// What the engine decides on (deciding lets it remember which
    /// statuses it found current).
    pub engine: &'k mut Engine,
    pods: &'k EntrySources<CachedPod>,
    leases: &'k EntrySources<CachedLease>,
}

impl PassInput<'_> {
    /// The pod (cache + own writes) the engine's pod `key` comes from.
    pub fn pod(&self, key: &ObjectKey) -> Option<&Arc<CachedPod>> {
        self.pods.get(key)
    }

    /// The lease (cache + own writes, or held after it vanished) the engine's
    /// lease `key` comes from.
    pub fn lease(&self, key: &ObjectKey) -> Option<&Arc<CachedLease>> {
        self.leases.get(key)
    }
}

impl EngineState {
    /// Brings the engine up to date with what changed in the caches, with
    /// the controller's own writes that they do not show yet laid over
    /// them, and returns the pass's input.
    pub fn sync(
        &mut self,
        caches: &Caches,
        own_writes: &mut OwnWrites,
        unmanaged_namespaces: &[String],
        now: Timestamp,
        at: Instant,
    ) -> PassInput<'_> {
        let Self {
            engine,
            resources,
            classes,
            nodes,
            pods,
            leases,
        } = self;
        engine.set_now(now);
        let changes = &caches.changes;
        let mut entry_sync = EntrySync {
            engine,
            own_writes,
            at,
        };

        let kind = Classes {
            cache: &caches.classes,
        };
        entry_sync.sync_kind(&kind, changes.classes.take(), classes);

        let mut node_changes = changes.nodes.take();
        let wanted: BTreeSet<String> = entry_sync
            .engine
            .classes()
            .values()
            .map(|c| c.spec.resource_name.clone())
            .collect();
        if wanted != *resources {
            // Nodes are translated for the classes' resources only: a new
            // resource means translating them all again. Pods keep every
            // extended resource they ask for (see `translate::pod_info`),
            // so they stay as they are: a deleted class's pods stay in the
            // engine, which keeps their leases' places.
            nodes.clear(|key| drop(entry_sync.engine.remove_node(&key.name)));
            node_changes = Changes::Everything;
            *resources = wanted;
        }
        let kind = Nodes {
            cache: &caches.nodes,
            resources,
        };
        entry_sync.sync_kind(&kind, node_changes, nodes);

        let kind = Leases {
            cache: &caches.leases,
            pods: &caches.pods,
        };
        entry_sync.sync_kind(&kind, changes.leases.take(), leases);

        let kind = Pods {
            cache: &caches.pods,
            resources,
            unmanaged_namespaces,
            now,
        };
        entry_sync.sync_kind(&kind, changes.pods.take(), pods);

        let EntrySync {
            engine, own_writes, ..
        } = entry_sync;
        own_writes.end_pass();
        PassInput {
            engine,
            pods,
            leases,
        }
    }

    /// The engine as last brought up to date.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// Records what the API server answered to evictions (`true`: a
    /// PodDisruptionBudget refused it), so the next pass decides with them
    /// (and knows, from the first refusal's time, when the budget has
    /// delayed a preemption as long as it may).
    pub fn record_eviction_answers(&mut self, answers: &[(ObjectKey, bool)]) {
        for (key, blocked) in answers {
            self.engine
                .set_eviction_blocked(key, blocked.then(jiff::Timestamp::now));
        }
    }

    /// Lists at most `limit` position and message updates per pass.
    pub fn set_progress_limit(&mut self, limit: usize) {
        self.engine.set_progress_limit(Some(limit));
    }

    /// Forgets refused evictions a pass no longer asked for.
    pub fn forget_unwanted_evictions(&mut self, wanted: &[Eviction]) {
        self.engine.forget_unwanted_evictions(wanted);
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;
    use std::collections::BTreeMap;
    use std::time::Duration;

    use crate::index::identity::Identity;
    use gpupool_api::LeasePhase;
    use kube::runtime::watcher;
    use proptest::prelude::*;
    use serde_json::json;

    use super::*;
    use crate::engine::Plan;
    use crate::index::caches::CacheChanges;
    use crate::index::identity::parts_of;
    use crate::index::store::{IndexWriter, index};

    /// A sequence to persist for a lease, from a stamp: any increasing
    /// number serves.
    fn micros(stamp: &str) -> u64 {
        let t: jiff::Timestamp = stamp.parse().expect("stamp");
        u64::try_from(t.as_microsecond()).expect("after the epoch")
    }

    /// A value of 0 does not translate.
    type Obj = u32;

    /// Brings the entry for `key` in `entries` in line with `view`;
    /// returns whether it was translated.
    fn sync_entry(
        sources: &mut EntrySources<Obj>,
        entries: &mut BTreeMap<String, (u32, bool)>,
        key: &str,
        view: Option<(&Arc<Obj>, bool)>,
    ) -> bool {
        let translated = Cell::new(false);
        let k = ObjectKey::new("ns", key);
        sources.sync_entry(
            &k,
            view.map(|(o, f)| (o.clone(), f)),
            |v| {
                translated.set(true);
                (**v > 0).then_some(**v)
            },
            |change| match change {
                Change::Upsert(v, flag) => drop(entries.insert(key.to_owned(), (v, flag))),
                Change::Remove => assert!(entries.remove(key).is_some(), "{key} had an entry"),
            },
        );
        translated.get()
    }

    #[test]
    fn only_another_object_or_flag_is_translated_and_gone_keys_are_removed() {
        let (mut sources, mut entries) = (EntrySources::default(), BTreeMap::new());
        let (a, a2, none) = (Arc::new(1), Arc::new(1), Arc::new(0));
        assert!(sync_entry(
            &mut sources,
            &mut entries,
            "a",
            Some((&a, false))
        ));
        assert!(
            !sync_entry(&mut sources, &mut entries, "a", Some((&a, false))),
            "same object"
        );
        assert!(
            sync_entry(&mut sources, &mut entries, "a", Some((&a2, false))),
            "an equal copy is another object"
        );
        assert!(
            sync_entry(&mut sources, &mut entries, "a", Some((&a2, true))),
            "the flag changed"
        );
        assert_eq!(entries["a"], (1, true));
        assert!(sync_entry(
            &mut sources,
            &mut entries,
            "n",
            Some((&none, false))
        ));
        assert!(
            sync_entry(&mut sources, &mut entries, "n", Some((&none, false))),
            "not remembered: translated again when looked at again"
        );
        assert_eq!(sources.len(), 1);
        assert!(Arc::ptr_eq(
            sources.get(&ObjectKey::new("ns", "a")).expect("a"),
            &a2
        ));
        assert!(sources.get(&ObjectKey::new("ns", "n")).is_none());

        assert!(!sync_entry(&mut sources, &mut entries, "a", None));
        assert!(!sync_entry(&mut sources, &mut entries, "n", None));
        assert!(entries.is_empty() && sources.len() == 0);
    }

    #[test]
    fn an_object_that_no_longer_translates_leaves_the_engine() {
        let (mut sources, mut entries) = (EntrySources::default(), BTreeMap::new());
        sync_entry(&mut sources, &mut entries, "a", Some((&Arc::new(1), false)));
        assert!(sync_entry(
            &mut sources,
            &mut entries,
            "a",
            Some((&Arc::new(0), false))
        ));
        assert!(entries.is_empty(), "{entries:?}");
        assert!(sources.get(&ObjectKey::new("ns", "a")).is_none());
    }

    /// The caches as a watch fills them: each write goes to the store and
    /// then to its change log.
    struct Cluster {
        caches: Caches,
        pods: IndexWriter<CachedPod>,
        nodes: IndexWriter<Node>,
        classes: IndexWriter<GpuLeaseClass>,
        leases: IndexWriter<CachedLease>,
        version: u64,
    }

    impl Cluster {
        fn new() -> Self {
            let (pods_r, pods) = index();
            let (nodes_r, nodes) = index();
            let (classes_r, classes) = index();
            let (leases_r, leases) = index();
            Self {
                caches: Caches::of_stores(pods_r, nodes_r, classes_r, leases_r),
                pods,
                nodes,
                classes,
                leases,
                version: 100,
            }
        }

        fn next_version(&mut self) -> String {
            self.version += 1;
            self.version.to_string()
        }

        fn event<K: Identity + Clone>(
            writer: &mut IndexWriter<K>,
            log: &crate::index::changes::ChangeLog,
            event: watcher::Event<K>,
        ) {
            let held = writer.apply(&event);
            log.record(&event, held.as_ref());
        }
    }

    fn pod_object(
        name: &str,
        uid: u8,
        rv: &str,
        gated: bool,
        deleting: bool,
        slots: u8,
    ) -> CachedPod {
        let mut v = json!({
            "metadata": {
                "namespace": "ns", "name": name, "uid": format!("pod-{uid}"),
                "resourceVersion": rv, "creationTimestamp": "2026-01-01T00:00:00Z"
            },
            "spec": {"containers": [{"name": "c", "image": "i"}]}
        });
        if slots > 0 {
            v["spec"]["containers"][0]["resources"] =
                json!({"limits": {"gpupool/slot": slots.to_string()}});
        }
        if gated {
            v["spec"]["schedulingGates"] = json!([{"name": "gpupool.io/admission"}]);
        }
        if deleting {
            v["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:01:00Z");
        }
        serde_json::from_value(v).expect("pod")
    }

    fn lease_object(name: &str, uid: u8, pod_uid: u8, rv: &str, phase: LeasePhase) -> CachedLease {
        let mut lease = crate::controller::test_api::lease(name, rv, phase);
        lease.metadata.uid = Some(format!("lease-{uid}"));
        lease.spec.pod_uid = format!("pod-{pod_uid}");
        lease.into()
    }

    fn node_object(name: &str, slots: u8) -> Node {
        serde_json::from_value(json!({
            "metadata": {"name": name},
            "status": {"allocatable": {"gpupool/slot": slots.to_string()}}
        }))
        .expect("node")
    }

    fn class_object(resource: &str, rv: &str) -> GpuLeaseClass {
        serde_json::from_value(json!({
            "apiVersion": "gpupool.io/v1alpha1", "kind": "GpuLeaseClass",
            "metadata": {"name": "default", "uid": "c", "resourceVersion": rv},
            "spec": {"default": true, "resourceName": resource}
        }))
        .expect("class")
    }

    const NAMES: [&str; 4] = ["a", "b", "c", "d"];
    const PHASES: [LeasePhase; 4] = [
        LeasePhase::Queued,
        LeasePhase::Admitted,
        LeasePhase::Bound,
        LeasePhase::Released,
    ];

    /// One thing that happens between or at passes.
    #[derive(Debug, Clone)]
    enum Step {
        Pod {
            name: usize,
            uid: u8,
            gated: bool,
            deleting: bool,
            slots: u8,
        },
        DeletePod {
            name: usize,
        },
        Lease {
            name: usize,
            uid: u8,
            pod_uid: u8,
            phase: usize,
        },
        DeleteLease {
            name: usize,
        },
        Node {
            name: usize,
            slots: u8,
        },
        DeleteNode {
            name: usize,
        },
        Class {
            other_resource: bool,
        },
        Relist,
        /// A lease write the API server answered, `ahead` versions past the cache's.
        WroteLease {
            name: usize,
            uid: u8,
            pod_uid: u8,
            ahead: i8,
            phase: usize,
            created: bool,
        },
        DeletedLease {
            name: usize,
            uid: u8,
        },
        Assumed {
            name: usize,
            phase: usize,
        },
        /// The write behind an assumed lease finished: the own_writes forgets it.
        WriteFinished {
            name: usize,
        },
        WrotePod {
            name: usize,
            uid: u8,
            ahead: i8,
        },
        Evicted {
            name: usize,
            uid: u8,
        },
        ForgotPod {
            name: usize,
        },
        Wait {
            seconds: u8,
        },
        Pass,
    }

    fn step() -> impl Strategy<Value = Step> {
        let name = 0..NAMES.len();
        let phase = 0..PHASES.len();
        prop_oneof![
            (
                name.clone(),
                0..2u8,
                any::<bool>(),
                prop::bool::weighted(0.2),
                0..3u8
            )
                .prop_map(|(name, uid, gated, deleting, slots)| Step::Pod {
                    name,
                    uid,
                    gated,
                    deleting,
                    slots
                }),
            name.clone().prop_map(|name| Step::DeletePod { name }),
            (name.clone(), 0..2u8, 0..2u8, phase.clone()).prop_map(
                |(name, uid, pod_uid, phase)| Step::Lease {
                    name,
                    uid,
                    pod_uid,
                    phase
                }
            ),
            name.clone().prop_map(|name| Step::DeleteLease { name }),
            (0..2usize, 0..4u8).prop_map(|(name, slots)| Step::Node { name, slots }),
            (0..2usize).prop_map(|name| Step::DeleteNode { name }),
            prop::bool::weighted(0.2).prop_map(|other_resource| Step::Class { other_resource }),
            Just(Step::Relist),
            (
                name.clone(),
                0..2u8,
                0..2u8,
                -1..3i8,
                phase.clone(),
                any::<bool>()
            )
                .prop_map(|(name, uid, pod_uid, ahead, phase, created)| {
                    Step::WroteLease {
                        name,
                        uid,
                        pod_uid,
                        ahead,
                        phase,
                        created,
                    }
                }),
            (name.clone(), 0..2u8).prop_map(|(name, uid)| Step::DeletedLease { name, uid }),
            (name.clone(), phase).prop_map(|(name, phase)| Step::Assumed { name, phase }),
            name.clone().prop_map(|name| Step::WriteFinished { name }),
            (name.clone(), 0..2u8, -1..3i8).prop_map(|(name, uid, ahead)| Step::WrotePod {
                name,
                uid,
                ahead
            }),
            (name.clone(), 0..2u8).prop_map(|(name, uid)| Step::Evicted { name, uid }),
            name.prop_map(|name| Step::ForgotPod { name }),
            prop_oneof![0..3u8, Just(31), Just(61), Just(121)]
                .prop_map(|seconds| Step::Wait { seconds }),
            Just(Step::Pass),
            Just(Step::Pass),
            Just(Step::Pass),
        ]
    }

    /// What a pass's input says, as text both sides can be compared by.
    fn described(input: &mut PassInput<'_>) -> (Vec<String>, Plan) {
        let engine = &*input.engine;
        let mut lines: Vec<String> = engine
            .classes()
            .values()
            .map(|c| format!("{c:?}"))
            .collect();
        lines.extend(engine.nodes().values().map(|n| format!("{n:?}")));
        lines.extend(
            engine
                .pods()
                .map(|p| format!("{p:?} from {:?}", input.pod(&p.key))),
        );
        lines.extend(
            engine
                .leases()
                .map(|l| format!("{l:?} from {:?}", input.lease(&l.key))),
        );
        lines.sort();
        (lines, input.engine.decide())
    }

    /// Runs `steps` against two engine states on the same caches: one looks
    /// only at what the change logs and the own_writes name, the other at
    /// every key, every pass. Returns the first pass at which they differ.
    fn run(steps: &[Step]) -> Result<(), TestCaseError> {
        let mut cluster = Cluster::new();
        let mut everything = cluster.caches.clone();
        everything.changes = CacheChanges::default();
        let (mut changed_only, mut full) = (EngineState::default(), EngineState::default());
        let (mut changed_only_own_writes, mut full_own_writes) =
            (OwnWrites::default(), OwnWrites::default());
        let t0 = Instant::now();
        let mut elapsed = Duration::ZERO;
        let key = |name: usize| ObjectKey::new("ns", NAMES[name]);
        let lease_rv = |cluster: &Cluster, name: usize, ahead: i8| -> String {
            let cached = cluster
                .caches
                .leases
                .get(&key(name))
                .and_then(|l| l.metadata.resource_version.clone())
                .and_then(|v| v.parse::<i64>().ok())
                .unwrap_or(100);
            (cached + i64::from(ahead)).to_string()
        };
        Cluster::event(
            &mut cluster.classes,
            &cluster.caches.changes.classes.clone(),
            watcher::Event::Apply(class_object("gpupool/slot", "1")),
        );
        for (n, step) in steps.iter().enumerate() {
            let at = t0 + elapsed;
            let changes = cluster.caches.changes.clone();
            match step.clone() {
                Step::Pod {
                    name,
                    uid,
                    gated,
                    deleting,
                    slots,
                } => {
                    let rv = cluster.next_version();
                    let pod = pod_object(NAMES[name], uid, &rv, gated, deleting, slots);
                    Cluster::event(&mut cluster.pods, &changes.pods, watcher::Event::Apply(pod));
                }
                Step::DeletePod { name } => {
                    if let Some(pod) = cluster.caches.pods.get(&key(name)) {
                        Cluster::event(
                            &mut cluster.pods,
                            &changes.pods,
                            watcher::Event::Delete((*pod).clone()),
                        );
                    }
                }
                Step::Lease {
                    name,
                    uid,
                    pod_uid,
                    phase,
                } => {
                    let rv = cluster.next_version();
                    let lease = lease_object(NAMES[name], uid, pod_uid, &rv, PHASES[phase]);
                    Cluster::event(
                        &mut cluster.leases,
                        &changes.leases,
                        watcher::Event::Apply(lease),
                    );
                }
                Step::DeleteLease { name } => {
                    if let Some(lease) = cluster.caches.leases.get(&key(name)) {
                        Cluster::event(
                            &mut cluster.leases,
                            &changes.leases,
                            watcher::Event::Delete((*lease).clone()),
                        );
                    }
                }
                Step::Node { name, slots } => {
                    let node = node_object(NAMES[name], slots);
                    Cluster::event(
                        &mut cluster.nodes,
                        &changes.nodes,
                        watcher::Event::Apply(node),
                    );
                }
                Step::DeleteNode { name } => {
                    if let Some(node) = cluster.caches.nodes.get(&ObjectKey::new("", NAMES[name])) {
                        Cluster::event(
                            &mut cluster.nodes,
                            &changes.nodes,
                            watcher::Event::Delete((*node).clone()),
                        );
                    }
                }
                Step::Class { other_resource } => {
                    let rv = cluster.next_version();
                    let resource = if other_resource {
                        "example.com/gpu"
                    } else {
                        "gpupool/slot"
                    };
                    Cluster::event(
                        &mut cluster.classes,
                        &changes.classes,
                        watcher::Event::Apply(class_object(resource, &rv)),
                    );
                }
                Step::Relist => {
                    // A re-list that finds the same objects (their copies).
                    let pods = cluster.caches.pods.state();
                    Cluster::event(&mut cluster.pods, &changes.pods, watcher::Event::Init);
                    for p in pods {
                        Cluster::event(
                            &mut cluster.pods,
                            &changes.pods,
                            watcher::Event::InitApply((*p).clone()),
                        );
                    }
                    Cluster::event(&mut cluster.pods, &changes.pods, watcher::Event::InitDone);
                }
                Step::WroteLease {
                    name,
                    uid,
                    pod_uid,
                    ahead,
                    phase,
                    created,
                } => {
                    let rv = lease_rv(&cluster, name, ahead);
                    let lease = lease_object(NAMES[name], uid, pod_uid, &rv, PHASES[phase]);
                    changed_only_own_writes.record_lease(lease.clone(), created, at);
                    full_own_writes.record_lease(lease, created, at);
                }
                Step::DeletedLease { name, uid } => {
                    let uid = format!("lease-{uid}");
                    changed_only_own_writes.record_lease_deleted(key(name), uid.clone(), at);
                    full_own_writes.record_lease_deleted(key(name), uid, at);
                }
                Step::Assumed { name, phase } => {
                    let lease = Arc::new(lease_object(NAMES[name], 0, 0, "", PHASES[phase]));
                    changed_only_own_writes.assume_lease(key(name), lease.clone());
                    full_own_writes.assume_lease(key(name), lease);
                }
                Step::WriteFinished { name } => {
                    changed_only_own_writes.forget_assumed(&key(name));
                    full_own_writes.forget_assumed(&key(name));
                }
                Step::WrotePod { name, uid, ahead } => {
                    let cached_rv = cluster
                        .caches
                        .pods
                        .get(&key(name))
                        .and_then(|p| p.metadata.resource_version.clone())
                        .and_then(|v| v.parse::<i64>().ok())
                        .unwrap_or(100);
                    let rv = (cached_rv + i64::from(ahead)).to_string();
                    let pod = pod_object(NAMES[name], uid, &rv, false, false, 1);
                    changed_only_own_writes.record_pod(pod.clone(), at);
                    full_own_writes.record_pod(pod, at);
                }
                Step::Evicted { name, uid } => {
                    let uid = format!("pod-{uid}");
                    changed_only_own_writes.record_evicted(key(name), uid.clone(), at);
                    full_own_writes.record_evicted(key(name), uid, at);
                }
                Step::ForgotPod { name } => {
                    changed_only_own_writes.forget_pod(&key(name));
                    full_own_writes.forget_pod(&key(name));
                }
                Step::Wait { seconds } => elapsed += Duration::from_secs(seconds.into()),
                Step::Pass => {
                    let now = Timestamp::from_second(1_800_000_000 + elapsed.as_secs() as i64)
                        .expect("timestamp");
                    for log in [
                        &everything.changes.pods,
                        &everything.changes.nodes,
                        &everything.changes.classes,
                        &everything.changes.leases,
                    ] {
                        log.everything();
                    }
                    let a = described(&mut changed_only.sync(
                        &cluster.caches,
                        &mut changed_only_own_writes,
                        &[],
                        now,
                        at,
                    ));
                    let b =
                        described(&mut full.sync(&everything, &mut full_own_writes, &[], now, at));
                    prop_assert_eq!(a, b, "pass after step {}", n);
                    prop_assert_eq!(changed_only_own_writes.len(), full_own_writes.len());
                    entries_match_what_a_pass_sees(
                        &changed_only,
                        &cluster.caches,
                        &mut changed_only_own_writes,
                        now,
                        at,
                    )
                    .map_err(|e| TestCaseError::fail(format!("after step {n}: {e}")))?;
                }
            }
        }
        Ok(())
    }

    /// The sources of `state`'s entries are, key by key, what the cache and
    /// the own-writes records show now (asked again at the same instant,
    /// which changes nothing: a pass already applied the records' time
    /// limits): every cached key, every key the records name, and every key
    /// with an entry, not only those a pass looked at.
    fn entries_match_what_a_pass_sees(
        state: &EngineState,
        caches: &Caches,
        own_writes: &mut OwnWrites,
        now: Timestamp,
        at: Instant,
    ) -> Result<(), String> {
        fn all_keys<K: Identity>(
            store: &[Arc<K>],
            sources: &EntrySources<K>,
            more: Vec<ObjectKey>,
        ) -> Vec<ObjectKey> {
            let mut keys: Vec<ObjectKey> = store
                .iter()
                .filter_map(|o| parts_of(o.as_ref()).map(|(ns, n)| ObjectKey::new(ns, n)))
                .chain(sources.by_key.keys().cloned())
                .chain(more)
                .collect();
            keys.sort();
            keys.dedup();
            keys
        }
        fn check<K>(
            sources: &EntrySources<K>,
            key: &ObjectKey,
            view: Option<(Arc<K>, bool)>,
            translates: impl Fn(&Arc<K>) -> bool,
        ) -> Result<(), String> {
            match (sources.by_key.get(key), view) {
                (None, None) => Ok(()),
                (None, Some((obj, _))) if !translates(&obj) => Ok(()),
                (Some(f), Some((obj, flag))) if Arc::ptr_eq(&f.obj, &obj) && f.flag == flag => {
                    Ok(())
                }
                (f, v) => Err(format!(
                    "{key:?}: entry from {:?}, pass sees {:?}",
                    f.map(|f| f.flag),
                    v.map(|(_, flag)| flag)
                )),
            }
        }
        let pod_keys: Vec<ObjectKey> = own_writes.pod_keys().cloned().collect();
        for key in all_keys(&caches.pods.state(), &state.pods, pod_keys) {
            let view = own_writes.pod_with_own_writes(&key, caches.pods.get(&key), at);
            check(
                &state.pods,
                &key,
                view.map(|p| (p, own_writes.is_evicted(&key))),
                |p| translate::pod_info(p.as_ref(), &state.resources, now).is_some(),
            )?;
        }
        let lease_keys: Vec<ObjectKey> = own_writes.lease_keys().cloned().collect();
        for key in all_keys(&caches.leases.state(), &state.leases, lease_keys) {
            let pod_cached = |l: &CachedLease| {
                caches
                    .pods
                    .get(&key)
                    .is_some_and(|p| p.metadata.uid.as_deref() == Some(l.spec.pod_uid.as_str()))
            };
            let seen = own_writes.lease_with_own_writes(
                &key,
                caches.leases.get(&key),
                state.leases.get(&key),
                pod_cached,
                at,
            );
            let missing = own_writes.is_missing(&key, at);
            // The engine holds the very lease the pass sees, not a copy.
            let engine_holds = state.engine.lease(&key).map(|l| &l.lease);
            if let Some(effective) = &seen
                && !engine_holds.is_some_and(|held| Arc::ptr_eq(held, effective))
            {
                return Err(format!("{key:?}: the engine holds another lease"));
            }
            check(&state.leases, &key, seen.map(|l| (l, missing)), |_| true)?;
        }
        for key in all_keys(&caches.nodes.state(), &state.nodes, Vec::new()) {
            check(
                &state.nodes,
                &key,
                caches.nodes.get(&key).map(|n| (n, false)),
                |n| translate::node_info(n, &state.resources).is_some(),
            )?;
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

        /// Looking only at changed and overlaid keys brings the engine to
        /// exactly the state looking at every key does.
        #[test]
        fn looking_at_changed_keys_brings_the_engine_where_looking_at_every_key_does(
            steps in prop::collection::vec(step(), 1..60)
        ) {
            run(&steps)?;
        }
    }

    /// Runs passes over `cluster`'s caches, writing the leases each plan
    /// creates and the statuses it wants into the caches as the watch
    /// would show them, until a pass wants nothing more written (at most
    /// five). No pass may admit, evict or give back anything.
    fn settle(
        cluster: &mut Cluster,
        state: &mut EngineState,
        own_writes: &mut OwnWrites,
        now: Timestamp,
    ) {
        for _ in 0..5 {
            let plan = state
                .sync(&cluster.caches, own_writes, &[], now, Instant::now())
                .engine
                .decide();
            assert!(
                plan.admissions.is_empty() && plan.evictions.is_empty(),
                "{plan:?}"
            );
            assert!(plan.give_backs.is_empty(), "{plan:?}");
            let mut written: Vec<CachedLease> = plan
                .create_leases
                .iter()
                .map(|new| {
                    let mut lease = CachedLease::under(&new.key, new.spec.clone(), None);
                    lease.metadata.uid = Some(format!("lease-{}", new.key.name).into());
                    lease.status = Some(new.status.clone());
                    lease
                })
                .collect();
            for (key, status) in plan.all_lease_statuses() {
                if let Some(cached) = cluster.caches.leases.get(key) {
                    let mut lease = CachedLease::clone(&cached);
                    lease.status = Some(status.clone());
                    written.push(lease);
                }
            }
            if written.is_empty() {
                return;
            }
            for mut lease in written {
                lease.metadata.resource_version = Some(cluster.next_version().into());
                let log = cluster.caches.changes.leases.clone();
                Cluster::event(&mut cluster.leases, &log, watcher::Event::Apply(lease));
            }
        }
        panic!("the passes never settled");
    }

    /// Deleting the default class keeps its pods in the engine (issue #43
    /// row 6): its queued leases turn Rejected and say why, the running
    /// pod keeps its lease, and creating the class again queues the others
    /// once more in their first order. When the pods left the engine with
    /// the class's resource, every lease was released as if its pod were
    /// gone, and the queued pods stayed gated for good.
    #[test]
    fn deleting_the_default_class_rejects_its_queue_and_recreating_it_restores_the_order() {
        let mut cluster = Cluster::new();
        let (mut engine_state, mut own_writes) = (EngineState::default(), OwnWrites::default());
        let now = Timestamp::from_second(1_800_000_000).expect("timestamp");
        let class = class_object("gpupool/slot", "1");
        let classes = cluster.caches.changes.classes.clone();
        Cluster::event(
            &mut cluster.classes,
            &classes,
            watcher::Event::Apply(class.clone()),
        );
        let nodes = cluster.caches.changes.nodes.clone();
        Cluster::event(
            &mut cluster.nodes,
            &nodes,
            watcher::Event::Apply(node_object("node-1", 1)),
        );
        // `a` runs on the node's one slot; `b` and `c` queue behind it,
        // `b` first.
        // `d` comes while the class is gone.
        let stamps = [
            ("a", "2026-01-01T00:00:01Z"),
            ("b", "2026-01-01T00:00:02Z"),
            ("c", "2026-01-01T00:00:03Z"),
            ("d", "2026-01-01T00:00:04Z"),
        ];
        let pod_object = |cluster: &mut Cluster, uid: u8, (name, stamp): (&str, &str)| {
            let rv = cluster.next_version();
            let mut pod = json!({
                "metadata": {
                    "namespace": "ns", "name": name, "uid": format!("pod-{uid}"),
                    "resourceVersion": rv, "creationTimestamp": "2026-01-01T00:00:00Z",
                    "annotations": {"gpupool.io/enqueued-at": stamp}
                },
                "spec": {"containers": [{"name": "c", "image": "i",
                    "resources": {"limits": {"gpupool/slot": "1"}}}]},
                "status": {"phase": "Pending"}
            });
            if name == "a" {
                pod["spec"]["nodeName"] = json!("node-1");
                pod["spec"]["nodeSelector"] = json!({"kubernetes.io/hostname": "node-1"});
                pod["status"]["phase"] = json!("Running");
            } else {
                pod["spec"]["schedulingGates"] = json!([{"name": "gpupool.io/admission"}]);
            }
            let pod: CachedPod = serde_json::from_value(pod).expect("pod");
            let pods = cluster.caches.changes.pods.clone();
            Cluster::event(&mut cluster.pods, &pods, watcher::Event::Apply(pod));
        };
        for (uid, pod) in (1u8..).zip(&stamps[..3]) {
            pod_object(&mut cluster, uid, *pod);
        }
        let sequence = |stamp: &str| micros(stamp);
        let rv = cluster.next_version();
        let mut running = lease_object("a", 1, 1, &rv, LeasePhase::Bound);
        if let Some(status) = running.status.as_mut() {
            status.sequence = Some(sequence(stamps[0].1));
            status.node = Some("node-1".into());
        }
        let leases = cluster.caches.changes.leases.clone();
        Cluster::event(&mut cluster.leases, &leases, watcher::Event::Apply(running));

        let lease = |cluster: &Cluster, name: &str| {
            let lease = cluster
                .caches
                .leases
                .get(&ObjectKey::new("ns", name))
                .expect("lease");
            let status = lease.status.clone().expect("status");
            (
                status.phase,
                status.sequence,
                status.position,
                status.message,
            )
        };
        let queued_in_order = |cluster: &Cluster, queued: &[(&str, &str)]| {
            let mut last = None;
            for (position, (name, _)) in (1..).zip(queued) {
                let (phase, seq, pos, _) = lease(cluster, name);
                assert_eq!((phase, pos), (LeasePhase::Queued, Some(position)), "{name}");
                assert!(seq.is_some() && seq > last, "{name} in sequence order");
                last = seq;
            }
        };
        settle(&mut cluster, &mut engine_state, &mut own_writes, now);
        assert_eq!(lease(&cluster, "a").0, LeasePhase::Bound);
        queued_in_order(&cluster, &stamps[1..3]);
        let first_sequences: Vec<Option<u64>> = stamps[1..3]
            .iter()
            .map(|(name, _)| lease(&cluster, name).1)
            .collect();

        Cluster::event(
            &mut cluster.classes,
            &classes,
            watcher::Event::Delete(class),
        );
        settle(&mut cluster, &mut engine_state, &mut own_writes, now);
        pod_object(&mut cluster, 4, stamps[3]);
        settle(&mut cluster, &mut engine_state, &mut own_writes, now);
        let (phase, seq, _, _) = lease(&cluster, "a");
        assert_eq!(
            (phase, seq),
            (LeasePhase::Bound, Some(sequence(stamps[0].1))),
            "the running pod keeps its slot"
        );
        for ((name, _), first) in stamps[1..3].iter().zip(&first_sequences) {
            let (phase, seq, _, message) = lease(&cluster, name);
            assert_eq!(phase, LeasePhase::Rejected, "{name}");
            assert_eq!(seq, *first, "{name} keeps its sequence");
            assert_eq!(
                message.as_deref(),
                Some(
                    "rejected: GpuLeaseClass default does not exist; \
                     the lease queues once it is created"
                ),
                "{name}"
            );
            assert!(
                engine_state
                    .engine()
                    .pod(&ObjectKey::new("ns", *name))
                    .is_some(),
                "{name} stays in the engine"
            );
        }
        // Whether a pod that names no class may queue is the default
        // class's to say; it must only be there to ask once it is back.
        let d = ObjectKey::new("ns", "d");
        assert!(
            engine_state.engine().pod(&d).is_some(),
            "d is in the engine"
        );

        let rv = cluster.next_version();
        Cluster::event(
            &mut cluster.classes,
            &classes,
            watcher::Event::Apply(class_object("gpupool/slot", &rv)),
        );
        settle(&mut cluster, &mut engine_state, &mut own_writes, now);
        assert_eq!(lease(&cluster, "a").0, LeasePhase::Bound);
        queued_in_order(&cluster, &stamps[1..]);
    }

    /// The scheduler's word reaches the engine through the cached pod: an
    /// admitted pod it could not place for the class's timeout is given
    /// back, and once the delete is recorded (the pod terminating before
    /// the watch shows it), the next pass neither asks again nor counts
    /// its slot, which the next pod in line takes.
    #[test]
    fn an_unplaceable_pod_is_given_back_once_and_its_slot_goes_to_the_next() {
        let mut cluster = Cluster::new();
        let (mut engine_state, mut own_writes) = (EngineState::default(), OwnWrites::default());
        let now: Timestamp = "2026-01-01T00:10:00Z".parse().expect("timestamp");
        let classes = cluster.caches.changes.classes.clone();
        Cluster::event(
            &mut cluster.classes,
            &classes,
            watcher::Event::Apply(class_object("gpupool/slot", "1")),
        );
        let nodes = cluster.caches.changes.nodes.clone();
        Cluster::event(
            &mut cluster.nodes,
            &nodes,
            watcher::Event::Apply(node_object("node-1", 1)),
        );
        let pods = cluster.caches.changes.pods.clone();
        let stuck: CachedPod = serde_json::from_value(json!({
            "metadata": {"namespace": "ns", "name": "a", "uid": "pod-1", "resourceVersion": "2",
                "creationTimestamp": "2026-01-01T00:00:00Z",
                "annotations": {"gpupool.io/enqueued-at": "2026-01-01T00:00:01Z"}},
            "spec": {"nodeSelector": {"kubernetes.io/hostname": "node-1"},
                "containers": [{"name": "c", "resources": {"limits": {"gpupool/slot": "1"}}}]},
            "status": {"phase": "Pending", "conditions": [{"type": "PodScheduled",
                "status": "False", "reason": "Unschedulable",
                "message": "0/1 nodes are available: 1 Insufficient cpu.",
                "lastTransitionTime": "2026-01-01T00:05:00Z"}]}
        }))
        .expect("pod");
        Cluster::event(&mut cluster.pods, &pods, watcher::Event::Apply(stuck));
        let mut next = pod_object("b", 2, "3", true, false, 1);
        next.annotations.insert(
            gpupool_api::names::ANNOTATION_ENQUEUED_AT.into(),
            "2026-01-01T00:00:02Z".into(),
        );
        Cluster::event(&mut cluster.pods, &pods, watcher::Event::Apply(next));
        let leases = cluster.caches.changes.leases.clone();
        for (name, uid, phase, seq) in [
            ("a", 1, LeasePhase::Admitted, "2026-01-01T00:00:01Z"),
            ("b", 2, LeasePhase::Queued, "2026-01-01T00:00:02Z"),
        ] {
            let mut lease = lease_object(name, uid, uid, "4", phase);
            if let Some(status) = lease.status.as_mut() {
                status.sequence = Some(micros(seq));
                status.node = (phase == LeasePhase::Admitted).then(|| "node-1".to_owned());
            }
            Cluster::event(&mut cluster.leases, &leases, watcher::Event::Apply(lease));
        }
        let a = ObjectKey::new("ns", "a");

        let plan = engine_state
            .sync(&cluster.caches, &mut own_writes, &[], now, Instant::now())
            .engine
            .decide();
        assert_eq!(
            plan.give_backs
                .iter()
                .map(|g| (&g.key, g.pod_uid.as_str(), g.node.as_str()))
                .collect::<Vec<_>>(),
            [(&a, "pod-1", "node-1")]
        );
        assert!(
            plan.give_backs[0].reason.contains("Insufficient cpu"),
            "{:?}",
            plan.give_backs[0].reason
        );
        assert_eq!(
            plan.lease_status(&a).map(|s| s.phase),
            Some(LeasePhase::Released)
        );
        assert!(plan.admissions.is_empty(), "a still holds the slot");

        // The delete went through; the watch has not shown it yet.
        own_writes.record_evicted(a.clone(), "pod-1".into(), Instant::now());
        let plan = engine_state
            .sync(&cluster.caches, &mut own_writes, &[], now, Instant::now())
            .engine
            .decide();
        assert!(plan.give_backs.is_empty(), "asked once: {plan:?}");
        assert_eq!(
            plan.admissions
                .iter()
                .map(|x| x.key.name.as_ref())
                .collect::<Vec<_>>(),
            ["b"],
            "the slot went back to the pool"
        );
    }

    #[test]
    fn a_lease_deleted_before_its_pod_is_held_then_recreated() {
        let steps = [
            Step::Pod {
                name: 0,
                uid: 0,
                gated: true,
                deleting: false,
                slots: 1,
            },
            Step::Lease {
                name: 0,
                uid: 0,
                pod_uid: 0,
                phase: 0,
            },
            Step::Pass,
            Step::DeleteLease { name: 0 },
            Step::Pass,
            Step::Wait { seconds: 2 },
            Step::Pass,
        ];
        run(&steps).expect("equal");
    }
}
