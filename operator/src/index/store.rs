//! One watch cache: the objects of one kind, by the engine's key.
//!
//! kube's reflector store keys each object by an `ObjectRef`, which holds
//! the name, namespace, resourceVersion and UID as strings of its own, so
//! every cached object pays for a second copy of its identity. Here the key
//! is an [`ObjectKey`] (two shared strings), kept from the first time the
//! object was seen, and a lookup by name builds no key. The object
//! kept holds the key's strings rather than copies where its form can
//! ([`Identity::share_key`]), and every key of one namespace holds the same
//! string for it: a namespace's name is kept once, not once per object.

use std::sync::{Arc, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

use kube::runtime::watcher;
use tokio::sync::watch;

use super::identity::{Identity, parts_of};
use super::key_hash::{HashMap, HashSet};
use crate::engine::{KeyParts, ObjectKey};

type Objects<K> = HashMap<ObjectKey, Arc<K>>;

/// The rule an index tallies its objects by: the key an object is counted
/// under, or `None` for one not counted.
pub type TallyRule<K> = fn(&K) -> Option<String>;

type Counts = HashMap<String, usize>;

/// The namespaces' names the keys hold, one string each. A name no key or
/// object holds any more is dropped at the next re-list, or when the set
/// has doubled since it was last pruned: it never holds more than twice
/// the namespaces in use at its last pruning, or 32.
#[derive(Default)]
struct Namespaces {
    held: HashSet<Arc<str>>,
    /// How many were held after the last pruning.
    pruned_to: usize,
}

impl Namespaces {
    /// The one string for namespace `ns`.
    fn get(&mut self, ns: &str) -> Arc<str> {
        if let Some(held) = self.held.get(ns) {
            return held.clone();
        }
        if self.held.len() >= 2 * self.pruned_to.max(16) {
            self.prune();
        }
        let held: Arc<str> = ns.into();
        self.held.insert(held.clone());
        held
    }

    /// Drops the names only this set holds.
    fn prune(&mut self) {
        self.held.retain(|ns| Arc::strong_count(ns) > 1);
        self.pruned_to = self.held.len();
    }
}

/// The reading side: cheap to clone, shared by the decision loop and the
/// webhook. Guarantee: it holds exactly what the watch last said, each
/// object under its namespace and name; a re-list replaces the contents at
/// once when it completes, never half-way.
pub struct Index<K> {
    objects: Arc<RwLock<Objects<K>>>,
    counts: Arc<RwLock<Counts>>,
    ready: watch::Receiver<bool>,
}

impl<K> Clone for Index<K> {
    fn clone(&self) -> Self {
        Self {
            objects: self.objects.clone(),
            counts: self.counts.clone(),
            ready: self.ready.clone(),
        }
    }
}

/// The writing side, owned by the task that follows the watch.
pub struct IndexWriter<K> {
    objects: Arc<RwLock<Objects<K>>>,
    counts: Arc<RwLock<Counts>>,
    /// The rule the index tallies by, if it tallies.
    tally: Option<TallyRule<K>>,
    ready: watch::Sender<bool>,
    /// A re-list under way: what it has listed so far.
    relist: Option<Objects<K>>,
    /// The namespaces' names its keys share.
    namespaces: Namespaces,
}

/// The writer went away before its first full list: the index never fills.
#[derive(Debug, thiserror::Error)]
#[error("the watch that fills this cache stopped before its first full list")]
pub struct WriterGone;

/// An empty index and the writer that fills it.
pub fn index<K>() -> (Index<K>, IndexWriter<K>) {
    index_with(None)
}

/// An empty index that also counts its objects by `rule` (see
/// [`Index::count`]), and the writer that fills it and keeps the counts.
pub fn tallied_index<K>(rule: TallyRule<K>) -> (Index<K>, IndexWriter<K>) {
    index_with(Some(rule))
}

fn index_with<K>(tally: Option<TallyRule<K>>) -> (Index<K>, IndexWriter<K>) {
    let objects = Arc::new(RwLock::new(Objects::default()));
    let counts = Arc::new(RwLock::new(Counts::default()));
    let (tx, rx) = watch::channel(false);
    (
        Index {
            objects: objects.clone(),
            counts: counts.clone(),
            ready: rx,
        },
        IndexWriter {
            objects,
            counts,
            tally,
            ready: tx,
            relist: None,
            namespaces: Namespaces::default(),
        },
    )
}

/// Reads a map a panicked writer left behind: each change is one insert,
/// removal or swap, so what it holds is whole.
fn read<K>(lock: &RwLock<Objects<K>>) -> RwLockReadGuard<'_, Objects<K>> {
    lock.read().unwrap_or_else(PoisonError::into_inner)
}

fn write<K>(lock: &RwLock<Objects<K>>) -> RwLockWriteGuard<'_, Objects<K>> {
    lock.write().unwrap_or_else(PoisonError::into_inner)
}

impl<K> Index<K> {
    /// The object with `key`.
    pub fn get(&self, key: &ObjectKey) -> Option<Arc<K>> {
        read(&self.objects).get(key as &dyn KeyParts).cloned()
    }

    /// Every object, in no particular order.
    pub fn state(&self) -> Vec<Arc<K>> {
        read(&self.objects).values().cloned().collect()
    }

    /// Every key (each a clone of the index's own: no string is copied).
    pub fn keys(&self) -> Vec<ObjectKey> {
        read(&self.objects).keys().cloned().collect()
    }

    /// How many of its objects its tally rule counts under `key`, without
    /// walking them (0 for an index that does not tally). Kept by the
    /// writer with each change, so it agrees with the objects the index
    /// holds.
    pub fn count(&self, key: &str) -> usize {
        self.counts
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(key)
            .copied()
            .unwrap_or(0)
    }

    /// How many objects it holds.
    pub fn len(&self) -> usize {
        read(&self.objects).len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Waits for the first full list; any number of tasks may wait.
    pub async fn wait_until_ready(&self) -> Result<(), WriterGone> {
        let mut ready = self.ready.clone();
        ready
            .wait_for(|ready| *ready)
            .await
            .map(drop)
            .map_err(|_| WriterGone)
    }
}

impl<K: Identity + Clone> IndexWriter<K> {
    /// Applies one watch event. An object is kept under the key it was
    /// first seen with, so an update allocates no key. Returns that key
    /// for an object applied or deleted one by one (a clone of the index's
    /// own), so whoever records the change need not build another.
    pub fn apply(&mut self, event: &watcher::Event<K>) -> Option<ObjectKey> {
        match event {
            watcher::Event::Apply(obj) => {
                let (key, replaced) =
                    upsert(&mut write(&self.objects), None, &mut self.namespaces, obj)?;
                self.retally(replaced.as_deref(), Some(obj));
                Some(key)
            }
            watcher::Event::Delete(obj) => {
                let parts = parts_of(obj)?;
                let removed = write(&self.objects).remove_entry(&parts as &dyn KeyParts);
                let (key, gone) = removed?;
                self.retally(Some(&gone), None);
                Some(key)
            }
            watcher::Event::Init => {
                self.relist = Some(Objects::default());
                None
            }
            watcher::Event::InitApply(obj) => {
                let relist = self.relist.get_or_insert_with(Objects::default);
                upsert(
                    relist,
                    Some(&read(&self.objects)),
                    &mut self.namespaces,
                    obj,
                );
                None
            }
            watcher::Event::InitDone => {
                let listed = self.relist.take().unwrap_or_default();
                if let Some(rule) = self.tally {
                    let mut counts = Counts::default();
                    for key in listed.values().filter_map(|obj| rule(obj)) {
                        *counts.entry(key).or_default() += 1;
                    }
                    *self.write_counts() = counts;
                }
                *write(&self.objects) = listed;
                self.namespaces.prune();
                self.ready.send_replace(true);
                None
            }
        }
    }

    /// Moves an object's count from what `old` was counted under to what
    /// `new` is (either may be nothing).
    fn retally(&self, old: Option<&K>, new: Option<&K>) {
        let Some(rule) = self.tally else {
            return;
        };
        let (from, to) = (old.and_then(rule), new.and_then(rule));
        if from == to {
            return;
        }
        let mut counts = self.write_counts();
        if let Some(from) = from
            && let Some(n) = counts.get_mut(&from)
        {
            *n -= 1;
            if *n == 0 {
                counts.remove(&from);
            }
        }
        if let Some(to) = to {
            *counts.entry(to).or_default() += 1;
        }
    }

    fn write_counts(&self) -> RwLockWriteGuard<'_, Counts> {
        self.counts.write().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Puts `obj` into `objects`, reusing the key `objects` or `known` already
/// holds for it (a new key takes its namespace from `namespaces`), the
/// object holding the key's strings; returns that key and the object it
/// replaced (`None` for an object without a name).
fn upsert<K: Identity + Clone>(
    objects: &mut Objects<K>,
    known: Option<&Objects<K>>,
    namespaces: &mut Namespaces,
    obj: &K,
) -> Option<(ObjectKey, Option<Arc<K>>)> {
    let parts = parts_of(obj)?;
    // A copy, on purpose: the watch's own object was read from JSON among
    // the parser's scratch allocations and carries its lists' spare
    // capacity; the copy holds exactly what it needs, so the cache keeps
    // nothing the parser left behind (see the performance log, 2026-11-28).
    let mut value = obj.clone();
    if let Some((key, _)) = objects.get_key_value(&parts as &dyn KeyParts) {
        let key = key.clone();
        value.share_key(&key);
        // An insert under an equal key keeps the key the map holds.
        let replaced = objects.insert(key.clone(), Arc::new(value));
        return Some((key, replaced));
    }
    let key = known
        .and_then(|k| k.get_key_value(&parts as &dyn KeyParts))
        .map(|(key, _)| key.clone())
        .unwrap_or_else(|| ObjectKey::new(namespaces.get(parts.0), parts.1));
    value.share_key(&key);
    objects.insert(key.clone(), Arc::new(value));
    Some((key, None))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::CachedLease;
    use k8s_openapi::api::core::v1::ConfigMap;

    fn map(ns: &str, name: &str, rv: &str) -> ConfigMap {
        serde_json::from_value(serde_json::json!({
            "metadata": {"namespace": ns, "name": name, "resourceVersion": rv}
        }))
        .expect("config map")
    }

    fn version(index: &Index<ConfigMap>, ns: &str, name: &str) -> Option<String> {
        index
            .get(&ObjectKey::new(ns, name))
            .and_then(|m| m.metadata.resource_version.clone())
    }

    #[tokio::test]
    async fn it_follows_applies_deletes_and_a_relist_that_replaces_it_whole() {
        let (index, mut writer) = index::<ConfigMap>();
        writer.apply(&watcher::Event::Init);
        writer.apply(&watcher::Event::InitApply(map("a", "x", "1")));
        assert!(
            index.is_empty(),
            "a re-list shows nothing before it completes"
        );
        writer.apply(&watcher::Event::InitApply(map("a", "y", "2")));
        writer.apply(&watcher::Event::InitDone);
        index.wait_until_ready().await.expect("ready");
        assert_eq!(index.len(), 2);

        writer.apply(&watcher::Event::Apply(map("a", "x", "3")));
        writer.apply(&watcher::Event::Apply(map("b", "x", "4")));
        writer.apply(&watcher::Event::Delete(map("a", "y", "5")));
        assert_eq!(version(&index, "a", "x").as_deref(), Some("3"));
        assert_eq!(version(&index, "b", "x").as_deref(), Some("4"));
        assert_eq!(version(&index, "a", "y"), None);

        // A second re-list: the old contents stay until it is done, then
        // what it did not list is gone.
        writer.apply(&watcher::Event::Init);
        writer.apply(&watcher::Event::InitApply(map("b", "x", "6")));
        assert_eq!(version(&index, "a", "x").as_deref(), Some("3"));
        writer.apply(&watcher::Event::InitDone);
        assert_eq!(index.len(), 1);
        assert_eq!(version(&index, "b", "x").as_deref(), Some("6"));
        let mut keys = index.keys();
        keys.sort();
        assert_eq!(keys, [ObjectKey::new("b", "x")]);
    }

    #[tokio::test]
    async fn an_updated_object_keeps_the_key_it_was_first_seen_with() {
        let (index, mut writer) = index::<ConfigMap>();
        writer.apply(&watcher::Event::Apply(map("a", "x", "1")));
        let first = index.keys().pop().expect("a key");
        writer.apply(&watcher::Event::Apply(map("a", "x", "2")));
        writer.apply(&watcher::Event::Init);
        writer.apply(&watcher::Event::InitApply(map("a", "x", "3")));
        writer.apply(&watcher::Event::InitDone);
        let now = index.keys().pop().expect("a key");
        assert!(Arc::ptr_eq(&first.name, &now.name));
        assert!(Arc::ptr_eq(&first.namespace, &now.namespace));
        assert_eq!(version(&index, "a", "x").as_deref(), Some("3"));
    }

    fn lease(ns: &str, name: &str, rv: &str) -> CachedLease {
        let spec = gpupool_api::GpuLeaseSpec {
            class_name: "c".into(),
            pod_name: name.into(),
            pod_uid: "u".into(),
            role: gpupool_api::Role::Primary,
            slots: 1,
        };
        let mut lease = CachedLease::new(ns, name, spec, None);
        lease.metadata.resource_version = Some(rv.into());
        lease
    }

    #[tokio::test]
    async fn a_kept_object_holds_its_keys_strings_and_a_namespace_is_held_once() {
        let (index, mut writer) = index::<CachedLease>();
        let shares = |index: &Index<CachedLease>, name: &str| {
            let key = ObjectKey::new("a", name);
            let kept = index.get(&key).expect("kept");
            let held = index.keys().into_iter().find(|k| *k == key).expect("key");
            let (ns, n) = (
                kept.metadata.namespace.clone().expect("namespace"),
                kept.metadata.name.clone().expect("name"),
            );
            assert!(Arc::ptr_eq(&ns, &held.namespace) && Arc::ptr_eq(&n, &held.name));
            held
        };
        writer.apply(&watcher::Event::Apply(lease("a", "x", "1")));
        writer.apply(&watcher::Event::Apply(lease("a", "y", "1")));
        let (x, y) = (shares(&index, "x"), shares(&index, "y"));
        assert!(
            Arc::ptr_eq(&x.namespace, &y.namespace),
            "one string per namespace"
        );

        // An update and a re-list keep sharing the first key's strings.
        writer.apply(&watcher::Event::Apply(lease("a", "x", "2")));
        assert!(Arc::ptr_eq(&shares(&index, "x").name, &x.name));
        writer.apply(&watcher::Event::Init);
        writer.apply(&watcher::Event::InitApply(lease("a", "x", "3")));
        writer.apply(&watcher::Event::InitApply(lease("a", "z", "3")));
        writer.apply(&watcher::Event::InitDone);
        assert!(Arc::ptr_eq(&shares(&index, "x").name, &x.name));
        assert!(Arc::ptr_eq(&shares(&index, "z").namespace, &x.namespace));
        assert!(index.get(&ObjectKey::new("a", "y")).is_none());
    }

    #[test]
    fn namespaces_no_key_holds_are_dropped_when_pruned() {
        let mut namespaces = Namespaces::default();
        let kept = namespaces.get("kept");
        drop(namespaces.get("gone"));
        assert!(Arc::ptr_eq(&namespaces.get("kept"), &kept));
        namespaces.prune();
        assert_eq!(namespaces.held.len(), 1);
        assert!(namespaces.held.contains("kept"));
        // Growing past twice what was left after a pruning prunes again.
        for i in 0..40 {
            drop(namespaces.get(&format!("ns-{i}")));
        }
        assert!(namespaces.held.len() <= 32, "{}", namespaces.held.len());
        assert!(namespaces.held.contains("kept"));
    }

    #[test]
    fn applying_an_object_or_its_deletion_returns_the_key_the_index_holds() {
        let (index, mut writer) = index::<ConfigMap>();
        let held = |index: &Index<ConfigMap>| index.keys().pop().expect("a key");
        let added = writer.apply(&watcher::Event::Apply(map("a", "x", "1")));
        let same = |k: &ObjectKey, h: &ObjectKey| {
            Arc::ptr_eq(&k.name, &h.name) && Arc::ptr_eq(&k.namespace, &h.namespace)
        };
        assert!(added.is_some_and(|k| same(&k, &held(&index))));
        let updated = writer.apply(&watcher::Event::Apply(map("a", "x", "2")));
        assert!(updated.is_some_and(|k| same(&k, &held(&index))));
        let first = held(&index);
        let deleted = writer.apply(&watcher::Event::Delete(map("a", "x", "3")));
        assert!(deleted.is_some_and(|k| same(&k, &first)));
        assert!(index.is_empty());

        // Nothing to name: an unknown deletion, a nameless object, a re-list.
        assert_eq!(
            writer.apply(&watcher::Event::Delete(map("a", "x", "4"))),
            None
        );
        assert_eq!(
            writer.apply(&watcher::Event::Apply(ConfigMap::default())),
            None
        );
        for event in [
            watcher::Event::Init,
            watcher::Event::InitApply(map("b", "y", "5")),
            watcher::Event::InitDone,
        ] {
            assert_eq!(writer.apply(&event), None);
        }
    }

    /// Counts config maps by their `kind` data entry.
    fn by_kind(map: &ConfigMap) -> Option<String> {
        map.data.as_ref()?.get("kind").cloned()
    }

    fn of_kind(ns: &str, name: &str, rv: &str, kind: Option<&str>) -> ConfigMap {
        let mut map = map(ns, name, rv);
        map.data = kind.map(|k| [("kind".to_owned(), k.to_owned())].into());
        map
    }

    #[test]
    fn a_tallied_index_counts_in_step_with_each_change() {
        let (index, mut writer) = tallied_index::<ConfigMap>(by_kind);
        let counts = |index: &Index<ConfigMap>| (index.count("a"), index.count("b"));
        writer.apply(&watcher::Event::Apply(of_kind("n", "x", "1", Some("a"))));
        writer.apply(&watcher::Event::Apply(of_kind("n", "y", "2", Some("a"))));
        assert_eq!(counts(&index), (2, 0));
        // Replaced: counted under its new key only; again under the same: no change.
        writer.apply(&watcher::Event::Apply(of_kind("n", "x", "3", Some("b"))));
        writer.apply(&watcher::Event::Apply(of_kind("n", "x", "4", Some("b"))));
        assert_eq!(counts(&index), (1, 1));
        // No longer counted, then deleted; an unknown deletion changes nothing.
        writer.apply(&watcher::Event::Apply(of_kind("n", "y", "5", None)));
        writer.apply(&watcher::Event::Delete(of_kind("n", "x", "6", Some("b"))));
        writer.apply(&watcher::Event::Delete(of_kind("n", "z", "7", Some("a"))));
        assert_eq!(counts(&index), (0, 0));
        assert_eq!(index.len(), 1);

        // A re-list counts what it listed, when it completes.
        writer.apply(&watcher::Event::Apply(of_kind("n", "w", "8", Some("a"))));
        writer.apply(&watcher::Event::Init);
        writer.apply(&watcher::Event::InitApply(of_kind(
            "n",
            "v",
            "9",
            Some("b"),
        )));
        writer.apply(&watcher::Event::InitApply(of_kind(
            "n",
            "u",
            "10",
            Some("b"),
        )));
        assert_eq!(counts(&index), (1, 0), "nothing moves before it completes");
        writer.apply(&watcher::Event::InitDone);
        assert_eq!(counts(&index), (0, 2));
    }

    #[test]
    fn an_index_without_a_rule_counts_nothing() {
        let (index, mut writer) = index::<ConfigMap>();
        writer.apply(&watcher::Event::Apply(of_kind("n", "x", "1", Some("a"))));
        assert_eq!((index.len(), index.count("a")), (1, 0));
    }

    #[tokio::test]
    async fn waiting_for_an_index_whose_writer_is_gone_is_an_error() {
        let (index, writer) = index::<ConfigMap>();
        drop(writer);
        assert!(index.wait_until_ready().await.is_err());
    }

    #[test]
    fn an_object_without_a_name_is_not_kept() {
        let (index, mut writer) = index::<ConfigMap>();
        writer.apply(&watcher::Event::Apply(ConfigMap::default()));
        assert!(index.is_empty());
    }
}
