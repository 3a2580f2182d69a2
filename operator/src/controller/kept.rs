//! The engine's state kept across passes, fed only what changed.
//!
//! A watch cache hands out the same `Arc` for an object until a watch event
//! replaces it, and the overlay keeps the same `Arc` for a write it lays
//! over the cache. So an object whose `Arc` a pass has already translated
//! is unchanged: only new `Arc`s are translated and handed to the
//! [`Engine`], and keys whose object went away are removed from it. With
//! 16,000 pods and leases, a pass after one event translates one object
//! instead of all of them, and the engine never re-sorts its input.

use std::collections::BTreeSet;
use std::hash::Hash;
use std::sync::Arc;
use std::time::Instant;

use gpupool_api::{GpuLease, GpuLeaseClass};
use jiff::Timestamp;
use k8s_openapi::api::core::v1::Node;

use super::addr_hash::{AddrMap, addr};
use super::cached_pod::CachedPod;
use super::caches::Caches;
use super::key_hash::HashMap;
use super::overlay::Overlay;
use super::translate;
use crate::engine::{Engine, Eviction, ObjectKey};

/// One object a pass saw, by the address of its `Arc`.
struct Seen<K, Q> {
    /// Held so that the address cannot be reused by another object.
    obj: Arc<K>,
    /// Its key when it translated to something the engine keeps.
    key: Option<Q>,
    /// The pass-dependent bit it was translated with (evicted, missing).
    flag: bool,
    /// The last pass that saw it.
    mark: u64,
}

/// What [`Mirror::sync`] asks the engine to do.
pub enum Change<Q, V> {
    /// Keep `V` for key `Q` (new or replaced).
    Upsert(V),
    /// Nothing is kept for `Q` any more.
    Remove(Q),
}

/// The objects of one kind the engine was last fed, by `Arc` address, and
/// which address each engine key came from.
pub struct Mirror<K, Q> {
    by_ptr: AddrMap<Seen<K, Q>>,
    ptr_of: HashMap<Q, usize>,
    mark: u64,
}

impl<K, Q> Default for Mirror<K, Q> {
    fn default() -> Self {
        Self {
            by_ptr: AddrMap::default(),
            ptr_of: HashMap::default(),
            mark: 0,
        }
    }
}

impl<K, Q: Hash + Eq + Clone> Mirror<K, Q> {
    /// Brings the engine in line with `objs`: `translate` is called for
    /// objects not seen before (or whose `flag` changed) and `apply` gets an
    /// upsert for each of them that translates, and a removal for each key
    /// whose object is gone.
    ///
    /// Guarantee: afterwards the engine keeps, for each key in `objs`, the
    /// translation of an object in `objs` with that key (the caches hold
    /// one per key), and nothing for keys not in `objs`.
    pub fn sync<V>(
        &mut self,
        objs: Vec<Arc<K>>,
        flag: impl Fn(&Q) -> bool,
        mut translate: impl FnMut(&K) -> Option<(Q, V)>,
        mut apply: impl FnMut(Change<Q, V>, bool),
    ) {
        self.mark += 1;
        let mark = self.mark;
        for obj in objs {
            let ptr = addr(&obj);
            if let Some(seen) = self.by_ptr.get_mut(&ptr)
                && seen.key.as_ref().is_none_or(|k| flag(k) == seen.flag)
            {
                seen.mark = mark;
                continue;
            }
            let (key, seen_flag) = match translate(&obj) {
                Some((key, value)) => {
                    let f = flag(&key);
                    self.ptr_of.insert(key.clone(), ptr);
                    apply(Change::Upsert(value), f);
                    (Some(key), f)
                }
                None => (None, false),
            };
            self.by_ptr.insert(
                ptr,
                Seen {
                    obj,
                    key,
                    flag: seen_flag,
                    mark,
                },
            );
        }
        let ptr_of = &mut self.ptr_of;
        self.by_ptr.retain(|&ptr, seen| {
            if seen.mark == mark {
                return true;
            }
            // Removed only when no newer object holds the key.
            if let Some(key) = seen.key.take()
                && ptr_of.get(&key) == Some(&ptr)
            {
                ptr_of.remove(&key);
                apply(Change::Remove(key), false);
            }
            false
        });
    }

    /// The object the engine's entry for `key` was translated from.
    pub fn get(&self, key: &Q) -> Option<&Arc<K>> {
        self.by_ptr.get(self.ptr_of.get(key)?).map(|s| &s.obj)
    }

    /// Number of keys the engine keeps from this kind.
    pub fn len(&self) -> usize {
        self.ptr_of.len()
    }

    /// True when the engine keeps nothing of this kind.
    pub fn is_empty(&self) -> bool {
        self.ptr_of.is_empty()
    }
}

/// The engine and the objects it was fed, kept by the decision loop from
/// pass to pass.
#[derive(Default)]
pub struct Kept {
    engine: Engine,
    /// The class resources nodes and pods were translated for.
    resources: BTreeSet<String>,
    classes: Mirror<GpuLeaseClass, String>,
    nodes: Mirror<Node, String>,
    pods: Mirror<CachedPod, ObjectKey>,
    leases: Mirror<GpuLease, ObjectKey>,
}

/// One decision pass's inputs: the engine brought up to date, and the raw
/// objects its entries came from (the writes need their UIDs and versions).
pub struct PassInput<'k> {
    /// What the engine decides on.
    pub engine: &'k Engine,
    pods: &'k Mirror<CachedPod, ObjectKey>,
    leases: &'k Mirror<GpuLease, ObjectKey>,
}

impl PassInput<'_> {
    /// The pod (cache + overlay) the engine's pod `key` comes from.
    pub fn pod(&self, key: &ObjectKey) -> Option<&Arc<CachedPod>> {
        self.pods.get(key)
    }

    /// The lease (cache + overlay, or held after it vanished) the engine's
    /// lease `key` comes from.
    pub fn lease(&self, key: &ObjectKey) -> Option<&Arc<GpuLease>> {
        self.leases.get(key)
    }
}

impl Kept {
    /// Feeds the engine what changed in the caches, with the controller's
    /// own unconfirmed writes laid over them, and returns the pass's input.
    pub fn sync(
        &mut self,
        caches: &Caches,
        overlay: &mut Overlay,
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
        classes.sync(
            overlay.classes(caches.classes.state(), at),
            |_| false,
            |c| translate::class_info(c).map(|i| (i.name.clone(), i)),
            |change, _| match change {
                Change::Upsert(c) => engine.upsert_class(c),
                Change::Remove(name) => drop(engine.remove_class(&name)),
            },
        );
        let wanted: BTreeSet<String> = engine
            .classes()
            .values()
            .map(|c| c.spec.resource_name.clone())
            .collect();
        if wanted != *resources {
            // Nodes and pods are translated for the classes' resources only:
            // a new resource means translating them all again.
            *nodes = Mirror::default();
            *pods = Mirror::default();
            let names: Vec<String> = engine.nodes().keys().cloned().collect();
            names.iter().for_each(|n| drop(engine.remove_node(n)));
            let keys: Vec<ObjectKey> = engine.pods().map(|p| p.key.clone()).collect();
            keys.iter().for_each(|k| drop(engine.remove_pod(k)));
            *resources = wanted;
        }
        nodes.sync(
            caches.nodes.state(),
            |_| false,
            |n| translate::node_info(n, resources).map(|i| (i.name.clone(), i)),
            |change, _| match change {
                Change::Upsert(n) => engine.upsert_node(n),
                Change::Remove(name) => drop(engine.remove_node(&name)),
            },
        );

        let pod_objs = overlay.pods(caches.pods.state(), at);
        let mut lease_objs = overlay.leases(caches.leases.state(), at);
        overlay.hold_vanished(
            &mut lease_objs,
            || {
                pod_objs
                    .iter()
                    .filter_map(|p| p.metadata.uid.as_deref())
                    .collect()
            },
            at,
        );
        overlay.lay_assumed(&mut lease_objs);
        leases.sync(
            lease_objs,
            |key| overlay.is_missing(key, at),
            |l| translate::lease_info(l).map(|i| (i.key.clone(), i)),
            |change, missing| match change {
                Change::Upsert(mut l) => {
                    l.missing = missing;
                    engine.upsert_lease(l);
                }
                Change::Remove(key) => drop(engine.remove_lease(&key)),
            },
        );
        pods.sync(
            pod_objs,
            |key| overlay.is_evicted(key),
            // A pod without a creation time (no API server sends one) keeps
            // the time it was first seen.
            |p| {
                let mut info = translate::pod_info(&p.to_pod(), resources, now)?;
                info.unmanaged = unmanaged_namespaces
                    .iter()
                    .any(|ns| **ns == *info.key.namespace);
                Some((info.key.clone(), info))
            },
            |change, evicted| match change {
                Change::Upsert(mut p) => {
                    p.terminating |= evicted;
                    engine.upsert_pod(p);
                }
                Change::Remove(key) => drop(engine.remove_pod(&key)),
            },
        );
        PassInput {
            engine,
            pods,
            leases,
        }
    }

    /// The engine as last fed.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// Records what the API server answered to evictions (`true`: a
    /// PodDisruptionBudget refused it), so the next pass decides with them.
    pub fn record_eviction_answers(&mut self, answers: &[(ObjectKey, bool)]) {
        for (key, blocked) in answers {
            self.engine.set_eviction_blocked(key, *blocked);
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

    use super::*;

    /// An object: its key and a value; a value of 0 does not translate.
    type Obj = (String, u32);

    /// Runs one sync into `kept`, returning how many objects were translated.
    fn sync(
        mirror: &mut Mirror<Obj, String>,
        kept: &mut BTreeMap<String, (u32, bool)>,
        objs: &[Arc<Obj>],
        flagged: &[&str],
    ) -> usize {
        let translated = Cell::new(0);
        mirror.sync(
            objs.to_vec(),
            |k| flagged.contains(&k.as_str()),
            |(k, v)| {
                translated.set(translated.get() + 1);
                (*v > 0).then(|| (k.clone(), (k.clone(), *v)))
            },
            |change, flag| match change {
                Change::Upsert((k, v)) => drop(kept.insert(k, (v, flag))),
                Change::Remove(k) => assert!(kept.remove(&k).is_some(), "{k} was kept"),
            },
        );
        translated.get()
    }

    fn obj(k: &str, v: u32) -> Arc<Obj> {
        Arc::new((k.to_owned(), v))
    }

    #[test]
    fn only_new_objects_are_translated_and_gone_keys_are_removed() {
        let (mut mirror, mut kept) = (Mirror::default(), BTreeMap::new());
        let (a, b, none) = (obj("a", 1), obj("b", 2), obj("n", 0));
        let all = [a.clone(), b.clone(), none.clone()];
        assert_eq!(sync(&mut mirror, &mut kept, &all, &[]), 3);
        assert_eq!(
            kept,
            BTreeMap::from([("a".into(), (1, false)), ("b".into(), (2, false))])
        );
        assert_eq!(mirror.len(), 2);
        assert_eq!(
            sync(&mut mirror, &mut kept, &all, &[]),
            0,
            "nothing changed"
        );

        // b replaced by a new object, a gone, the untranslatable one stays.
        let b2 = obj("b", 5);
        assert_eq!(sync(&mut mirror, &mut kept, &[b2.clone(), none], &[]), 1);
        assert_eq!(kept, BTreeMap::from([("b".into(), (5, false))]));
        assert!(Arc::ptr_eq(mirror.get(&"b".into()).expect("b"), &b2));
        assert!(mirror.get(&"a".into()).is_none());

        // Everything gone.
        assert_eq!(sync(&mut mirror, &mut kept, &[], &[]), 0);
        assert!(kept.is_empty() && mirror.is_empty());
    }

    #[test]
    fn a_changed_flag_translates_the_object_again() {
        let (mut mirror, mut kept) = (Mirror::default(), BTreeMap::new());
        let a = obj("a", 1);
        sync(&mut mirror, &mut kept, std::slice::from_ref(&a), &[]);
        assert_eq!(
            sync(&mut mirror, &mut kept, std::slice::from_ref(&a), &["a"]),
            1
        );
        assert_eq!(kept["a"], (1, true));
        assert_eq!(
            sync(&mut mirror, &mut kept, std::slice::from_ref(&a), &["a"]),
            0
        );
        assert_eq!(sync(&mut mirror, &mut kept, &[a], &[]), 1);
        assert_eq!(kept["a"], (1, false));
    }

    #[test]
    fn an_object_that_no_longer_translates_leaves_the_engine() {
        let (mut mirror, mut kept) = (Mirror::default(), BTreeMap::new());
        sync(&mut mirror, &mut kept, &[obj("a", 1)], &[]);
        assert_eq!(sync(&mut mirror, &mut kept, &[obj("a", 0)], &[]), 1);
        assert!(kept.is_empty(), "{kept:?}");
        assert!(mirror.get(&"a".into()).is_none());
    }
}
