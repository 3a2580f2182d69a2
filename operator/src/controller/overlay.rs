//! What the controller wrote and its watch caches may not show yet.
//!
//! Watches lag writes. A pass that decided on a cache still showing a pod as
//! gated, or a lease as Queued, after the previous pass admitted it, could
//! admit the same slot twice. So every successful write is remembered here
//! and laid over the cache when a pass takes its snapshot, until the cache
//! shows that object at a resourceVersion at least as new (or the object was
//! replaced or deleted).

use std::sync::Arc;
use std::time::{Duration, Instant};

use gpupool_api::{GpuLease, GpuLeaseClass};
use kube::Resource;

use super::addr_hash::ByAddress;
use super::cached_pod::CachedPod;
use super::key_hash::{HashMap, HashSet, KeyHashes, parts_of};
use crate::engine::{KeyParts, ObjectKey};

/// How long a lease the controller created may be missing from the cache
/// before the overlay forgets it (it was deleted before the watch showed it).
const CREATED_TTL: Duration = Duration::from_secs(30);
/// How long a deletion or eviction is remembered without the cache confirming it.
const TOMBSTONE_TTL: Duration = Duration::from_secs(120);
/// How long a lease that vanished while its pod is still cached is held.
const VANISHED_TTL: Duration = Duration::from_secs(60);
/// How long a lease must have been gone, with its pod still cached and live,
/// before it is recreated: long enough for the pod watch to catch up when
/// the garbage collector removed the lease after its pod.
pub const RECREATE_AFTER: Duration = Duration::from_secs(1);

#[derive(Debug)]
struct Written<K> {
    object: Arc<K>,
    created: bool,
    at: Instant,
}

#[derive(Debug)]
struct Gone {
    uid: String,
    at: Instant,
}

/// The controller's own recent writes, laid over the watch caches.
#[derive(Debug, Default)]
pub struct Overlay {
    leases: HashMap<ObjectKey, Written<GpuLease>>,
    deleted_leases: HashMap<ObjectKey, Gone>,
    pods: HashMap<ObjectKey, Written<CachedPod>>,
    evicted: HashMap<ObjectKey, Gone>,
    classes: HashMap<ObjectKey, Written<GpuLeaseClass>>,
    /// Leases as writes still in flight will leave them.
    assumed: HashMap<ObjectKey, Arc<GpuLease>>,
    /// The leases the cache showed at the last pass, by address; holding
    /// them keeps their addresses from going to other leases.
    last_leases: ByAddress<GpuLease, ()>,
    vanished: HashMap<ObjectKey, (Arc<GpuLease>, Instant)>,
    pod_keys: KeyHashes<CachedPod>,
    lease_keys: KeyHashes<GpuLease>,
    class_keys: KeyHashes<GpuLeaseClass>,
}

/// True when `cached` is at least as new as `written`. resourceVersions are
/// opaque in general; every API server in practice uses integers, and for
/// anything else only equality can prove the cache caught up.
pub fn is_at_least(cached: Option<&str>, written: Option<&str>) -> bool {
    match (cached, written) {
        (Some(c), Some(w)) => match (c.parse::<u64>(), w.parse::<u64>()) {
            (Ok(c), Ok(w)) => c >= w,
            _ => c == w,
        },
        // A write whose response carried no version cannot be compared: trust the cache.
        (_, None) => true,
        (None, Some(_)) => false,
    }
}

fn key_of<K: Resource>(obj: &K) -> Option<ObjectKey> {
    let (namespace, name) = parts_of(obj)?;
    Some(ObjectKey::new(namespace, name))
}

/// `cached` with `written` laid over it and `tombstones` taken out; an
/// object is read only when its key hash is one of theirs (see
/// [`KeyHashes`]).
fn merge<K: Resource>(
    cached: Vec<Arc<K>>,
    hashes: &mut KeyHashes<K>,
    written: &mut HashMap<ObjectKey, Written<K>>,
    tombstones: Option<&mut HashMap<ObjectKey, Gone>>,
    now: Instant,
) -> Vec<Arc<K>> {
    hashes.next_pass();
    let mut empty = HashMap::default();
    let tombstones = tombstones.unwrap_or(&mut empty);
    if written.is_empty() && tombstones.is_empty() {
        // Asked all the same, so the memo keeps what the cache holds.
        for obj in &cached {
            hashes.of(obj);
        }
        return cached;
    }
    let wanted = hashes.of_keys(written.keys().chain(tombstones.keys()));
    let mut seen_written = HashSet::default();
    let mut caught_up = HashSet::default();
    let mut seen_tombstones = HashSet::default();
    let mut out = Vec::with_capacity(cached.len() + written.len());
    for obj in cached {
        let parts = hashes
            .of(&obj)
            .filter(|h| wanted.contains(h))
            .and_then(|_| parts_of(obj.as_ref()));
        let Some(parts) = parts else {
            out.push(obj);
            continue;
        };
        let probe: &dyn KeyParts = &parts;
        if let Some((key, gone)) = tombstones.get_key_value(probe)
            && obj.meta().uid.as_deref() == Some(gone.uid.as_str())
        {
            seen_tombstones.insert(key.clone());
            continue;
        }
        if let Some((key, w)) = written.get_key_value(probe) {
            let same_object = obj.meta().uid == w.object.meta().uid;
            if same_object
                && !is_at_least(
                    obj.meta().resource_version.as_deref(),
                    w.object.meta().resource_version.as_deref(),
                )
            {
                seen_written.insert(key.clone());
                out.push(w.object.clone());
                continue;
            }
            caught_up.insert(key.clone());
        }
        out.push(obj);
    }
    // Keep what the cache still lags on; drop what it caught up with, and
    // what it lost (deleted) unless the controller just created it.
    written.retain(|key, w| {
        if seen_written.contains(key) {
            return true;
        }
        !caught_up.contains(key) && w.created && now.duration_since(w.at) < CREATED_TTL
    });
    for (key, w) in written.iter() {
        if !seen_written.contains(key) {
            out.push(w.object.clone());
        }
    }
    tombstones.retain(|key, gone| {
        seen_tombstones.contains(key) && now.duration_since(gone.at) < TOMBSTONE_TTL
    });
    out
}

impl Overlay {
    /// Remembers a lease as the API server returned it after a create or
    /// status write. The caller trims it as the lease cache trims it: a
    /// burst of lease creates holds thousands of these until the watch
    /// catches up.
    pub fn record_lease(&mut self, lease: GpuLease, created: bool, now: Instant) {
        let Some(key) = key_of(&lease) else { return };
        let created = created || self.leases.get(&key).is_some_and(|w| w.created);
        self.deleted_leases.remove(&key);
        self.leases.insert(
            key,
            Written {
                object: Arc::new(lease),
                created,
                at: now,
            },
        );
    }

    /// Remembers a class as the API server returned it after a status write:
    /// the next pass paces and compares the class's status against what
    /// was written, not against a cache that has not caught up.
    pub fn record_class(&mut self, class: GpuLeaseClass, now: Instant) {
        let Some(key) = key_of(&class) else { return };
        self.classes.insert(
            key,
            Written {
                object: Arc::new(class),
                created: false,
                at: now,
            },
        );
    }

    /// The cached classes with the controller's newer status writes laid over them.
    pub fn classes(
        &mut self,
        cached: Vec<Arc<GpuLeaseClass>>,
        now: Instant,
    ) -> Vec<Arc<GpuLeaseClass>> {
        merge(cached, &mut self.class_keys, &mut self.classes, None, now)
    }

    /// Lays `lease` over the caches as a write still in flight will leave
    /// it, until [`Overlay::forget_assumed`]: the passes that run meanwhile
    /// count its sequence, phase and node as written.
    pub fn assume_lease(&mut self, key: ObjectKey, lease: GpuLease) {
        self.assumed.insert(key, Arc::new(lease));
    }

    /// The write behind an assumed lease landed (its answer, if any, is
    /// recorded on its own) or was abandoned.
    pub fn forget_assumed(&mut self, key: &ObjectKey) {
        self.assumed.remove(key);
    }

    /// Replaces or adds, in `leases`, the leases that writes in flight will
    /// leave. Applied after [`Overlay::hold_vanished`], so an assumed lease is
    /// never taken for one the API server showed.
    pub fn lay_assumed(&mut self, leases: &mut Vec<Arc<GpuLease>>) {
        if self.assumed.is_empty() {
            return;
        }
        let wanted = self.lease_keys.of_keys(self.assumed.keys());
        let mut laid = HashSet::default();
        for lease in leases.iter_mut() {
            if self
                .lease_keys
                .of(lease)
                .is_some_and(|h| wanted.contains(&h))
                && let Some(parts) = parts_of(lease.as_ref())
                && let Some((key, assumed)) = self.assumed.get_key_value(&parts as &dyn KeyParts)
            {
                laid.insert(key);
                *lease = assumed.clone();
            }
        }
        leases.extend(
            self.assumed
                .iter()
                .filter(|(key, _)| !laid.contains(*key))
                .map(|(_, lease)| lease.clone()),
        );
    }

    /// Remembers that the lease object with `uid` was deleted.
    pub fn record_lease_deleted(&mut self, key: ObjectKey, uid: String, now: Instant) {
        self.leases.remove(&key);
        self.deleted_leases.insert(key, Gone { uid, at: now });
    }

    /// Remembers a pod as the API server returned it after its admission
    /// patch. The caller trims it as the pod cache trims it: a burst of
    /// admissions holds hundreds of these until the watch catches up.
    pub fn record_pod(&mut self, pod: CachedPod, now: Instant) {
        let Some(key) = key_of(&pod) else { return };
        self.pods.insert(
            key,
            Written {
                object: Arc::new(pod),
                created: false,
                at: now,
            },
        );
    }

    /// Remembers that the pod with `uid` was evicted (it is terminating).
    pub fn record_evicted(&mut self, key: ObjectKey, uid: String, now: Instant) {
        self.evicted.insert(key, Gone { uid, at: now });
    }

    /// Forgets a pod the controller wrote, after a conflict showed the write is stale.
    pub fn forget_pod(&mut self, key: &ObjectKey) {
        self.pods.remove(key);
    }

    /// The cached leases with the controller's newer writes laid over them.
    pub fn leases(&mut self, cached: Vec<Arc<GpuLease>>, now: Instant) -> Vec<Arc<GpuLease>> {
        merge(
            cached,
            &mut self.lease_keys,
            &mut self.leases,
            Some(&mut self.deleted_leases),
            now,
        )
    }

    /// The cached pods with the controller's newer writes laid over them.
    pub fn pods(&mut self, cached: Vec<Arc<CachedPod>>, now: Instant) -> Vec<Arc<CachedPod>> {
        let pods = merge(cached, &mut self.pod_keys, &mut self.pods, None, now);
        if !self.evicted.is_empty() {
            let wanted = self.pod_keys.of_keys(self.evicted.keys());
            let mut still_pending = HashSet::default();
            for p in &pods {
                let parts = self
                    .pod_keys
                    .of(p)
                    .filter(|h| wanted.contains(h))
                    .and_then(|_| parts_of(p.as_ref()));
                let Some(parts) = parts else {
                    continue;
                };
                if let Some((key, gone)) = self.evicted.get_key_value(&parts as &dyn KeyParts)
                    && p.meta().uid.as_deref() == Some(gone.uid.as_str())
                    && p.meta().deletion_timestamp.is_none()
                {
                    still_pending.insert(key.clone());
                }
            }
            self.evicted.retain(|key, gone| {
                still_pending.contains(key) && now.duration_since(gone.at) < TOMBSTONE_TTL
            });
        }
        pods
    }

    /// Keeps the snapshot consistent across the two watches: when the
    /// garbage collector deletes a lease because its pod is gone, the lease
    /// watch may report it before the pod watch does. Until the pod leaves the
    /// cache too (or [`VANISHED_TTL`] passes), the last seen lease stays in
    /// `leases`, so a departing pod is never taken for a new one without a
    /// lease; and a lease deleted while its pod lives is recreated from it
    /// (see [`Overlay::is_missing`]), keeping its sequence.
    ///
    /// Only what changed since the last pass is looked at, by address: an
    /// object the cache still shows is the same `Arc` again. A key the
    /// cache shows now but did not show as this object last pass is among
    /// the newly shown ones, so a newer version of a lease is never taken
    /// for a vanished one. `cached_pod_uids` is called only when a lease is
    /// held or has just gone.
    pub fn hold_vanished<'p>(
        &mut self,
        leases: &mut Vec<Arc<GpuLease>>,
        cached_pod_uids: impl FnOnce() -> HashSet<&'p str>,
        now: Instant,
    ) {
        // What the cache showed is kept from pass to pass, not rebuilt: a
        // lease shown again is only marked.
        self.last_leases.next_pass();
        let mut newly_shown: HashSet<(&str, &str)> = HashSet::default();
        for l in leases.iter() {
            if self.last_leases.see(l, |_| ()).1 {
                newly_shown.extend(parts_of(l.as_ref()));
            }
        }
        let is_present =
            |key: &ObjectKey| newly_shown.contains(&(key.namespace.as_ref(), key.name.as_ref()));
        let mut gone: Vec<(ObjectKey, Arc<GpuLease>)> = Vec::new();
        self.last_leases.sweep(|lease, ()| {
            if let Some(key) = key_of(lease.as_ref())
                && !is_present(&key)
            {
                gone.push((key, lease));
            }
        });
        if !self.vanished.is_empty() || !gone.is_empty() {
            let pod_uids = cached_pod_uids();
            let pod_cached = |l: &GpuLease| pod_uids.contains(l.spec.pod_uid.as_str());
            self.vanished.retain(|key, (lease, at)| {
                !is_present(key) && pod_cached(lease) && now.duration_since(*at) < VANISHED_TTL
            });
            for (key, lease) in gone {
                if !self.deleted_leases.contains_key(&key)
                    && !self.vanished.contains_key(&key)
                    && pod_cached(&lease)
                {
                    self.vanished.insert(key, (lease, now));
                }
            }
        }
        // Added after the marking, which counts only what the cache showed:
        // a held lease must not be taken as shown, nor held again.
        leases.extend(self.vanished.values().map(|(l, _)| l.clone()));
    }

    /// True when the lease `key` is held because it vanished at least
    /// [`RECREATE_AFTER`] ago while its pod stayed: it should be recreated.
    pub fn is_missing(&self, key: &ObjectKey, now: Instant) -> bool {
        self.vanished
            .get(key)
            .is_some_and(|(_, at)| now.duration_since(*at) >= RECREATE_AFTER)
    }

    /// When the next held lease becomes due for recreation, if any.
    pub fn next_recreation(&self, now: Instant) -> Option<Instant> {
        self.vanished
            .values()
            .map(|(_, at)| *at + RECREATE_AFTER)
            .filter(|due| *due > now)
            .min()
    }

    /// True while `key`'s eviction is not yet visible in the cache: treat the pod as terminating.
    pub fn is_evicted(&self, key: &ObjectKey) -> bool {
        self.evicted.contains_key(key)
    }

    /// Number of remembered writes (for tests and logs).
    pub fn len(&self) -> usize {
        self.leases.len()
            + self.classes.len()
            + self.assumed.len()
            + self.deleted_leases.len()
            + self.pods.len()
            + self.evicted.len()
            + self.vanished.len()
    }

    /// True when nothing is remembered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod_uids<const N: usize>(uids: [&str; N]) -> HashSet<&str> {
        uids.into_iter().collect()
    }

    fn lease(name: &str, uid: &str, rv: &str, phase: &str) -> GpuLease {
        serde_json::from_value(json!({
            "apiVersion": "gpupool.io/v1alpha1", "kind": "GpuLease",
            "metadata": {"namespace": "ns", "name": name, "uid": uid, "resourceVersion": rv},
            "spec": {"className": "default", "podName": name, "podUID": "p", "slots": 1},
            "status": {"phase": phase}
        }))
        .expect("lease")
    }

    fn phases(leases: &[Arc<GpuLease>]) -> Vec<(String, String)> {
        let mut v: Vec<_> = leases
            .iter()
            .map(|l| {
                (
                    l.metadata.name.clone().unwrap_or_default(),
                    format!("{:?}", l.status.as_ref().map(|s| s.phase)),
                )
            })
            .collect();
        v.sort();
        v
    }

    #[test]
    fn resource_versions_compare_as_integers_else_by_equality() {
        assert!(is_at_least(Some("10"), Some("9")));
        assert!(is_at_least(Some("10"), Some("10")));
        assert!(!is_at_least(Some("9"), Some("10")));
        assert!(is_at_least(Some("abc"), Some("abc")));
        assert!(!is_at_least(Some("abd"), Some("abc")));
        assert!(!is_at_least(None, Some("1")));
        assert!(is_at_least(Some("1"), None));
    }

    #[test]
    fn written_status_wins_until_the_cache_catches_up() {
        let t0 = Instant::now();
        let mut o = Overlay::default();
        o.record_lease(lease("a", "u", "11", "Admitted"), false, t0);
        let stale = vec![Arc::new(lease("a", "u", "10", "Queued"))];
        let merged = o.leases(stale, t0);
        assert_eq!(phases(&merged), vec![("a".into(), "Some(Admitted)".into())]);
        assert_eq!(o.len(), 1);
        let fresh = vec![Arc::new(lease("a", "u", "12", "Bound"))];
        let merged = o.leases(fresh, t0);
        assert_eq!(phases(&merged), vec![("a".into(), "Some(Bound)".into())]);
        assert!(o.is_empty(), "caught up: forgotten");
    }

    /// Objects are read once and known by address after that: a write
    /// recorded after its lease was already seen, and unchanged, by
    /// earlier passes is laid over it all the same, and so are a deletion
    /// and an assumed write.
    #[test]
    fn a_write_to_an_object_earlier_passes_saw_unchanged_is_laid_over_it() {
        let t0 = Instant::now();
        let mut o = Overlay::default();
        let cached: Vec<Arc<GpuLease>> = ["a", "b", "c"]
            .into_iter()
            .map(|n| Arc::new(lease(n, n, "10", "Queued")))
            .collect();
        for _ in 0..3 {
            assert_eq!(o.leases(cached.clone(), t0).len(), 3);
        }
        o.record_lease(lease("b", "b", "11", "Admitted"), false, t0);
        o.record_lease_deleted(ObjectKey::new("ns", "c"), "c".into(), t0);
        let mut merged = o.leases(cached.clone(), t0);
        assert_eq!(
            phases(&merged),
            vec![
                ("a".into(), "Some(Queued)".into()),
                ("b".into(), "Some(Admitted)".into())
            ]
        );
        o.assume_lease(ObjectKey::new("ns", "a"), lease("a", "a", "10", "Admitted"));
        o.lay_assumed(&mut merged);
        assert_eq!(
            phases(&merged),
            vec![
                ("a".into(), "Some(Admitted)".into()),
                ("b".into(), "Some(Admitted)".into())
            ]
        );
    }

    #[test]
    fn a_written_class_status_wins_until_the_cache_catches_up() {
        let class = |rv: &str, capacity: u32| -> GpuLeaseClass {
            serde_json::from_value(json!({
                "apiVersion": "gpupool.io/v1alpha1", "kind": "GpuLeaseClass",
                "metadata": {"name": "default", "uid": "c", "resourceVersion": rv},
                "spec": {},
                "status": {"capacity": capacity}
            }))
            .expect("class")
        };
        let capacity = |cs: &[Arc<GpuLeaseClass>]| -> Vec<u32> {
            cs.iter()
                .map(|c| c.status.as_ref().map_or(0, |s| s.capacity))
                .collect()
        };
        let t0 = Instant::now();
        let mut o = Overlay::default();
        o.record_class(class("8", 4), t0);
        assert_eq!(capacity(&o.classes(vec![Arc::new(class("7", 2))], t0)), [4]);
        assert_eq!(capacity(&o.classes(vec![Arc::new(class("9", 6))], t0)), [6]);
        assert!(o.is_empty(), "caught up: forgotten");
        // A class deleted after its status write is not brought back.
        o.record_class(class("10", 4), t0);
        assert!(o.classes(vec![], t0).is_empty());
        assert!(o.is_empty());
    }

    #[test]
    fn assumed_leases_replace_or_join_the_list_until_forgotten() {
        let mut o = Overlay::default();
        let mut leases = vec![
            Arc::new(lease("a", "u", "1", "Admitted")),
            Arc::new(lease("b", "v", "1", "Queued")),
        ];
        o.assume_lease(ObjectKey::new("ns", "a"), lease("a", "u", "1", "Released"));
        o.assume_lease(ObjectKey::new("ns", "new"), lease("new", "", "", "Queued"));
        o.lay_assumed(&mut leases);
        assert_eq!(
            phases(&leases),
            vec![
                ("a".into(), "Some(Released)".into()),
                ("b".into(), "Some(Queued)".into()),
                ("new".into(), "Some(Queued)".into()),
            ]
        );
        assert_eq!(o.len(), 2);
        o.forget_assumed(&ObjectKey::new("ns", "a"));
        o.forget_assumed(&ObjectKey::new("ns", "new"));
        assert!(o.is_empty());
        let mut cached = vec![Arc::new(lease("a", "u", "1", "Admitted"))];
        o.lay_assumed(&mut cached);
        assert_eq!(phases(&cached), vec![("a".into(), "Some(Admitted)".into())]);
    }

    #[test]
    fn created_leases_appear_before_the_watch_shows_them_then_expire() {
        let t0 = Instant::now();
        let mut o = Overlay::default();
        o.record_lease(lease("new", "u", "5", "Queued"), true, t0);
        assert_eq!(o.leases(vec![], t0).len(), 1);
        // A status write after the create keeps it a created lease.
        o.record_lease(lease("new", "u", "6", "Queued"), false, t0);
        assert_eq!(o.leases(vec![], t0 + Duration::from_secs(1)).len(), 1);
        assert!(o.leases(vec![], t0 + CREATED_TTL).is_empty());
        assert!(o.is_empty());
    }

    #[test]
    fn a_written_lease_gone_from_the_cache_is_gone() {
        let t0 = Instant::now();
        let mut o = Overlay::default();
        o.record_lease(lease("a", "u", "11", "Released"), false, t0);
        assert!(o.leases(vec![], t0).is_empty());
        assert!(o.is_empty());
    }

    #[test]
    fn replaced_objects_are_not_masked() {
        let t0 = Instant::now();
        let mut o = Overlay::default();
        o.record_lease(lease("a", "old", "50", "Admitted"), false, t0);
        let merged = o.leases(vec![Arc::new(lease("a", "new", "3", "Queued"))], t0);
        assert_eq!(phases(&merged), vec![("a".into(), "Some(Queued)".into())]);
    }

    #[test]
    fn deleted_leases_are_hidden_until_the_cache_drops_them() {
        let t0 = Instant::now();
        let mut o = Overlay::default();
        o.record_lease_deleted(ObjectKey::new("ns", "a"), "u".into(), t0);
        let cached = vec![
            Arc::new(lease("a", "u", "1", "Queued")),
            Arc::new(lease("b", "v", "1", "Queued")),
        ];
        assert_eq!(phases(&o.leases(cached, t0)).len(), 1);
        // A new lease of the same name (another uid) is shown.
        let renewed = vec![Arc::new(lease("a", "u2", "9", "Queued"))];
        assert_eq!(o.leases(renewed, t0).len(), 1);
        assert!(o.is_empty());
    }

    #[test]
    fn a_lease_gone_before_its_pod_is_held_until_the_pod_goes() {
        let t0 = Instant::now();
        let mut o = Overlay::default();
        let pods = pod_uids(["p"]);
        let mut leases = vec![Arc::new(lease("a", "u", "1", "Preempting"))];
        o.hold_vanished(&mut leases, || pods.clone(), t0);
        assert_eq!(leases.len(), 1);
        // The lease watch drops it; the pod (uid "p") is still cached.
        let mut leases = vec![];
        o.hold_vanished(&mut leases, || pods.clone(), t0);
        assert_eq!(
            phases(&leases),
            vec![("a".into(), "Some(Preempting)".into())]
        );
        // The pod leaves the cache: so does the held lease.
        let mut leases = vec![];
        o.hold_vanished(&mut leases, HashSet::default, t0);
        assert!(leases.is_empty());
        assert!(o.is_empty());
        // Held at most VANISHED_TTL when the pod stays.
        let mut leases = vec![Arc::new(lease("b", "v", "1", "Bound"))];
        o.hold_vanished(&mut leases, || pods.clone(), t0);
        let mut leases = vec![];
        o.hold_vanished(&mut leases, || pods.clone(), t0);
        assert_eq!(leases.len(), 1);
        let mut leases = vec![];
        o.hold_vanished(&mut leases, || pods.clone(), t0 + VANISHED_TTL);
        assert!(leases.is_empty());
    }

    #[test]
    fn an_unchanged_or_replaced_lease_is_never_held() {
        let t0 = Instant::now();
        let mut o = Overlay::default();
        let first = Arc::new(lease("a", "u", "1", "Queued"));
        let mut leases = vec![first.clone()];
        o.hold_vanished(&mut leases, || panic!("nothing vanished"), t0);
        // The same object again: no set of pods is built for it.
        let mut leases = vec![first];
        o.hold_vanished(&mut leases, || panic!("nothing vanished"), t0);
        // The watch replaced it with a newer version: still one lease, and
        // still no set of pods.
        let mut leases = vec![Arc::new(lease("a", "u", "2", "Admitted"))];
        o.hold_vanished(&mut leases, || panic!("a newer version"), t0);
        assert_eq!(phases(&leases), vec![("a".into(), "Some(Admitted)".into())]);
        assert!(o.is_empty(), "nothing held");

        // It vanishes while its pod stays: held, beside another lease's
        // newer version.
        let b1 = Arc::new(lease("b", "v", "3", "Queued"));
        let mut leases = vec![leases[0].clone(), b1];
        o.hold_vanished(&mut leases, || panic!("nothing vanished"), t0);
        let mut leases = vec![Arc::new(lease("b", "v", "4", "Admitted"))];
        o.hold_vanished(&mut leases, || pod_uids(["p"]), t0);
        assert_eq!(
            phases(&leases),
            vec![
                ("a".into(), "Some(Admitted)".into()),
                ("b".into(), "Some(Admitted)".into())
            ]
        );
        assert_eq!(o.len(), 1, "a is held");
        // The watch shows it again (a newer version): no longer held.
        let b = leases[0].clone();
        let mut leases = vec![b, Arc::new(lease("a", "u", "5", "Bound"))];
        o.hold_vanished(&mut leases, || pod_uids(["p"]), t0);
        assert_eq!(
            phases(&leases),
            vec![
                ("a".into(), "Some(Bound)".into()),
                ("b".into(), "Some(Admitted)".into())
            ]
        );
        assert!(o.is_empty(), "nothing held");
    }

    #[test]
    fn admitted_pods_and_evictions() {
        let t0 = Instant::now();
        let pod = |rv: &str, gated: bool, deleting: bool| -> CachedPod {
            let mut v = json!({
                "metadata": {"namespace": "ns", "name": "p", "uid": "u", "resourceVersion": rv},
                "spec": {"containers": []}
            });
            if gated {
                v["spec"]["schedulingGates"] = json!([{"name": "gpupool.io/admission"}]);
            }
            if deleting {
                v["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
            }
            serde_json::from_value(v).expect("pod")
        };
        let mut o = Overlay::default();
        o.record_pod(pod("8", false, false), t0);
        let merged = o.pods(vec![Arc::new(pod("7", true, false))], t0);
        assert!(
            merged[0]
                .spec
                .as_ref()
                .and_then(|s| s.scheduling_gates.as_ref())
                .is_none(),
            "the admitted version is used"
        );
        o.pods(vec![Arc::new(pod("8", false, false))], t0);
        assert!(o.is_empty());

        let key = ObjectKey::new("ns", "p");
        o.record_evicted(key.clone(), "u".into(), t0);
        o.pods(vec![Arc::new(pod("9", false, false))], t0);
        assert!(o.is_evicted(&key));
        o.pods(vec![Arc::new(pod("10", false, true))], t0);
        assert!(!o.is_evicted(&key), "the cache shows it terminating");
    }

    #[test]
    fn a_written_pod_wins_over_the_lagging_cache_with_what_the_rules_read() {
        let written: CachedPod = serde_json::from_value(json!({
            "metadata": {"namespace": "ns", "name": "p", "uid": "u", "resourceVersion": "8"},
            "spec": {
                "volumes": [{"name": "data", "emptyDir": {}}],
                "containers": [{
                    "name": "c", "image": "i", "env": [{"name": "A", "value": "1"}],
                    "resources": {"limits": {"gpupool/slot": "1"}}
                }]
            }
        }))
        .expect("pod");
        let cached: CachedPod = serde_json::from_value(json!({
            "metadata": {"namespace": "ns", "name": "p", "uid": "u", "resourceVersion": "7"},
            "spec": {"containers": []}
        }))
        .expect("cached pod");
        let mut o = Overlay::default();
        o.record_pod(written, Instant::now());
        let merged = o.pods(vec![Arc::new(cached)], Instant::now());
        assert_eq!(merged.len(), 1);
        let kept = &merged[0];
        assert_eq!(kept.metadata.resource_version.as_deref(), Some("8"));
        // What the rules read stays.
        let spec = kept.spec.as_ref().expect("spec");
        assert!(spec.containers[0].resources.is_some());
    }
}
