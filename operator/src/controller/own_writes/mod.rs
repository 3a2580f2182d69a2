//! Everything the controller remembers of its own writes, in one place.
//!
//! Watches lag writes. A pass that decided on a cache still showing a pod
//! as gated, or a lease as Queued, after the previous pass admitted it,
//! could admit the same slot twice; a status decided on a lease version the
//! controller has itself moved on would be refused as a conflict. So the
//! controller keeps, here and nowhere else, what it wrote and the caches may
//! not show yet:
//!
//! | record | made when | read by | forgotten when |
//! |---|---|---|---|
//! | written leases, pods, classes | the API server answers a write | every pass, laid over the cache | the cache shows that object at a resourceVersion at least as new, or another object of the name |
//! | deleted leases, evicted pods | the API server answers a delete or an eviction | every pass: the lease hidden, the pod counted terminating | the cache shows it gone or terminating, or a time limit |
//! | assumed leases | a lease write starts in the background | the passes while it runs, laid over the rest | its answer is recorded, or leadership is lost |
//! | the confirmed lease under an assumed or held one | a pass lays either over a lease | the next pass, to tell a lease that vanished from one the controller never saw | the pass sees the lease as confirmed again |
//! | progress records ([`progress`]) | the progress writer's write is answered | the progress writer, and a full status write taking a lease over from it | the caches catch up, or a time limit |
//!
//! A lease that vanished from its cache while its pod is still cached is
//! held here too (see [`OwnWrites::lease_with_own_writes`]), although no
//! write of the controller's removed it: whether it vanished is told from
//! the lease the last pass confirmed, which only this module knows under an
//! assumed write.
//!
//! A pass asks about every key the records name (its `*_keys_to_look_at`
//! methods), every pass, and about every key they named when the last pass
//! ended ([`OwnWrites::end_pass`]): that is when what is held is compared
//! with the cache and its time limits are applied. A `*_with_own_writes`
//! call that forgets what it held for a key answers as it would have
//! without it, so a key let go of needs looking at only once more, in the
//! next pass, for what happened to it between the two.

pub mod progress;

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use gpupool_api::GpuLeaseClass;

use crate::engine::{CachedLease, ObjectKey};
use crate::index::cached_pod::CachedPod;
use crate::index::identity::{Identity, parts_of};
use crate::index::key_hash::{HashMap, HashSet};
pub use progress::{Base, ProgressRecords};

/// How long a lease the controller created may be missing from the cache
/// before the records forget it (it was deleted before the watch showed it).
const CREATED_TTL: Duration = Duration::from_secs(30);
/// How long a deletion or eviction is remembered while the cache does not
/// show it.
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

/// The progress writer's records ([`ProgressRecords`]), shared by the
/// decision loop's [`OwnWrites`] and the writer's tasks; cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct SharedProgressRecords(Arc<Mutex<ProgressRecords>>);

impl SharedProgressRecords {
    /// The records, for one short step. A panic while they were held
    /// leaves them consistent enough to go on from: every method leaves
    /// its maps in step.
    pub fn lock(&self) -> MutexGuard<'_, ProgressRecords> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The keys of each kind the records named when the last pass ended.
#[derive(Debug, Default)]
struct NamedAtLastPass {
    classes: Vec<ObjectKey>,
    pods: Vec<ObjectKey>,
    leases: Vec<ObjectKey>,
}

/// The controller's own recent writes, laid over the watch caches, and the
/// progress writer's records of its own (see the module documentation).
#[derive(Debug, Default)]
pub struct OwnWrites {
    leases: HashMap<ObjectKey, Written<CachedLease>>,
    deleted_leases: HashMap<ObjectKey, Gone>,
    pods: HashMap<ObjectKey, Written<CachedPod>>,
    evicted: HashMap<ObjectKey, Gone>,
    classes: HashMap<ObjectKey, Written<GpuLeaseClass>>,
    /// Leases as writes still in flight will leave them.
    assumed: HashMap<ObjectKey, Arc<CachedLease>>,
    vanished: HashMap<ObjectKey, (Arc<CachedLease>, Instant)>,
    /// For each lease the last pass saw other than as confirmed (assumed or
    /// held), the lease as confirmed then (`None`: none was).
    confirmed_under: HashMap<ObjectKey, Option<Arc<CachedLease>>>,
    named_at_last_pass: NamedAtLastPass,
    progress: SharedProgressRecords,
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

fn key_of<K: Identity>(obj: &K) -> Option<ObjectKey> {
    let (namespace, name) = parts_of(obj)?;
    Some(ObjectKey::new(namespace, name))
}

fn same_uid<K: Identity>(obj: &K, uid: &str) -> bool {
    obj.uid() == Some(uid)
}

/// `cached` (what the cache holds for `key`) with the controller's write
/// of it laid over, while the cache lags behind that write; a write the
/// cache caught up with, or whose object it replaced or lost, is forgotten
/// (unless the controller just created the object and the watch has not
/// shown it yet).
fn with_recorded_write<K: Identity>(
    written: &mut HashMap<ObjectKey, Written<K>>,
    key: &ObjectKey,
    cached: Option<Arc<K>>,
    now: Instant,
) -> Option<Arc<K>> {
    let Some(w) = written.get(key) else {
        return cached;
    };
    match cached {
        Some(obj) => {
            let lagging = obj.uid() == w.object.uid()
                && !is_at_least(obj.resource_version(), w.object.resource_version());
            if lagging {
                return Some(w.object.clone());
            }
            written.remove(key);
            Some(obj)
        }
        None if w.created && now.duration_since(w.at) < CREATED_TTL => Some(w.object.clone()),
        None => {
            written.remove(key);
            None
        }
    }
}

impl OwnWrites {
    /// Remembers a lease as the API server returned it after a create or
    /// status write, in the form the lease cache keeps: a burst of lease
    /// creates holds thousands of these until the watch catches up.
    pub fn record_lease(&mut self, lease: CachedLease, created: bool, now: Instant) {
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

    /// What a pass sees of the class `key`: `cached` with the controller's
    /// newer status write laid over it.
    pub fn class_with_own_writes(
        &mut self,
        key: &ObjectKey,
        cached: Option<Arc<GpuLeaseClass>>,
        now: Instant,
    ) -> Option<Arc<GpuLeaseClass>> {
        with_recorded_write(&mut self.classes, key, cached, now)
    }

    /// Lays `lease` over the caches as a write still in flight will leave
    /// it, until [`OwnWrites::forget_assumed`]: the passes that run meanwhile
    /// count its sequence, phase and node as written.
    pub fn assume_lease(&mut self, key: ObjectKey, lease: Arc<CachedLease>) {
        self.assumed.insert(key, lease);
    }

    /// How many leases the records hold the confirmed lease under an
    /// assumed or held one for.
    #[cfg(test)]
    fn confirmed_under_count(&self) -> usize {
        self.confirmed_under.len()
    }

    /// The lease assumed for `key`, if any.
    #[cfg(test)]
    pub fn assumed_lease(&self, key: &ObjectKey) -> Option<&Arc<CachedLease>> {
        self.assumed.get(key)
    }

    /// The write behind an assumed lease finished (its answer, if any, is
    /// recorded on its own) or was abandoned.
    pub fn forget_assumed(&mut self, key: &ObjectKey) {
        self.assumed.remove(key);
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

    /// Remembers that the pod with `uid` was evicted or deleted (it is
    /// terminating, or gone): until the watch shows it so, a pass counts
    /// it terminating, and neither asks for it again nor counts an
    /// unbound one's slots.
    pub fn record_evicted(&mut self, key: ObjectKey, uid: String, now: Instant) {
        self.evicted.insert(key, Gone { uid, at: now });
    }

    /// Forgets a pod the controller wrote, after a conflict showed the write is stale.
    pub fn forget_pod(&mut self, key: &ObjectKey) {
        self.pods.remove(key);
    }

    /// What a pass sees of the pod `key`: `cached` with the controller's
    /// newer write laid over it. Also forgets the pod's eviction once the
    /// pod shows it (it is terminating or gone), so [`OwnWrites::is_evicted`]
    /// answers for this pass.
    pub fn pod_with_own_writes(
        &mut self,
        key: &ObjectKey,
        cached: Option<Arc<CachedPod>>,
        now: Instant,
    ) -> Option<Arc<CachedPod>> {
        let pod = with_recorded_write(&mut self.pods, key, cached, now);
        if let Some(gone) = self.evicted.get(key) {
            let pending = pod
                .as_ref()
                .is_some_and(|p| same_uid(p.as_ref(), &gone.uid) && !p.deleting());
            if !pending || now.duration_since(gone.at) >= TOMBSTONE_TTL {
                self.evicted.remove(key);
            }
        }
        pod
    }

    /// What a pass sees of the lease `key`, given what the cache holds for
    /// it and the lease the last pass that looked at `key` decided on
    /// (`last_seen`).
    ///
    /// A lease the controller deleted stays hidden until the cache drops it.
    /// A lease confirmed last pass (shown by the cache, or answered to a
    /// write) and confirmed no longer, while its pod (`pod_cached`: the pod
    /// cache holds the pod named like the lease, with the lease's pod UID)
    /// is still cached, is held: the garbage collector deletes a lease
    /// after its pod, and the lease watch may report it first, so a
    /// departing pod is never taken for a new one without a lease. It is
    /// held until the pod leaves the cache, the cache shows the lease
    /// again, or `VANISHED_TTL` (a minute) passes; a lease deleted while
    /// its pod lives is recreated from it (see [`OwnWrites::is_missing`]),
    /// keeping its sequence. A write in flight is laid over whatever is
    /// left.
    pub fn lease_with_own_writes(
        &mut self,
        key: &ObjectKey,
        cached: Option<Arc<CachedLease>>,
        last_seen: Option<&Arc<CachedLease>>,
        pod_cached: impl Fn(&CachedLease) -> bool,
        now: Instant,
    ) -> Option<Arc<CachedLease>> {
        let cached = match self.deleted_leases.get(key) {
            None => cached,
            Some(gone) => {
                let hidden = cached
                    .as_ref()
                    .is_some_and(|l| same_uid(l.as_ref(), &gone.uid))
                    && now.duration_since(gone.at) < TOMBSTONE_TTL;
                if !hidden {
                    self.deleted_leases.remove(key);
                }
                cached.filter(|_| !hidden)
            }
        };
        let confirmed = with_recorded_write(&mut self.leases, key, cached, now);
        match self.vanished.get(key) {
            Some((lease, at)) => {
                if confirmed.is_some()
                    || !pod_cached(lease)
                    || now.duration_since(*at) >= VANISHED_TTL
                {
                    self.vanished.remove(key);
                }
            }
            None => {
                if confirmed.is_none()
                    && let Some(last) = self.last_confirmed(key, last_seen)
                    && !self.deleted_leases.contains_key(key)
                    && pod_cached(last)
                {
                    let held = (last.clone(), now);
                    self.vanished.insert(key.clone(), held);
                }
            }
        }
        let effective = self
            .assumed
            .get(key)
            .or_else(|| self.vanished.get(key).map(|(l, _)| l))
            .or(confirmed.as_ref())
            .cloned();
        let seen_as_confirmed = match (&effective, &confirmed) {
            (Some(e), Some(c)) => Arc::ptr_eq(e, c),
            (e, c) => e.is_none() && c.is_none(),
        };
        if seen_as_confirmed {
            // Nearly always empty: most passes hold nothing over a lease.
            if !self.confirmed_under.is_empty() {
                self.confirmed_under.remove(key);
            }
        } else {
            self.confirmed_under.insert(key.clone(), confirmed);
        }
        effective
    }

    /// The lease the last pass that looked at `key` confirmed, given the
    /// one it decided on (`last_seen`): that one, unless it was assumed or
    /// held over the confirmed one.
    fn last_confirmed<'a>(
        &'a self,
        key: &ObjectKey,
        last_seen: Option<&'a Arc<CachedLease>>,
    ) -> Option<&'a Arc<CachedLease>> {
        match self.confirmed_under.get(key) {
            Some(under) => under.as_ref(),
            None => last_seen,
        }
    }

    /// Adds to `keys` every class key the records name, or named when the
    /// last pass ended (which this forgets).
    pub fn class_keys_to_look_at(&mut self, keys: &mut HashSet<ObjectKey>) {
        keys.extend(self.named_at_last_pass.classes.drain(..));
        keys.extend(self.classes.keys().cloned());
    }

    /// Adds to `keys` every pod key the records name, or named when the
    /// last pass ended (which this forgets).
    pub fn pod_keys_to_look_at(&mut self, keys: &mut HashSet<ObjectKey>) {
        keys.extend(self.named_at_last_pass.pods.drain(..));
        keys.extend(self.pod_keys().cloned());
    }

    /// Adds to `keys` every lease key the records name, or named when the
    /// last pass ended (which this forgets).
    pub fn lease_keys_to_look_at(&mut self, keys: &mut HashSet<ObjectKey>) {
        keys.extend(self.named_at_last_pass.leases.drain(..));
        keys.extend(self.lease_keys().cloned());
    }

    /// Notes the keys the records name as a pass ends: the next pass looks
    /// at them even if the records let go of them meanwhile.
    pub fn end_pass(&mut self) {
        let mut named = std::mem::take(&mut self.named_at_last_pass);
        named.classes.extend(self.classes.keys().cloned());
        named.pods.extend(self.pod_keys().cloned());
        named.leases.extend(self.lease_keys().cloned());
        self.named_at_last_pass = named;
    }

    /// Every pod key the records name now.
    pub fn pod_keys(&self) -> impl Iterator<Item = &ObjectKey> {
        self.pods.keys().chain(self.evicted.keys())
    }

    /// Every lease key the records name now.
    pub fn lease_keys(&self) -> impl Iterator<Item = &ObjectKey> {
        self.leases
            .keys()
            .chain(self.deleted_leases.keys())
            .chain(self.assumed.keys())
            .chain(self.vanished.keys())
    }

    /// The progress writer's records, for the writer to keep and consult.
    pub fn progress_records(&self) -> SharedProgressRecords {
        self.progress.clone()
    }

    /// Hands `key`'s status from the progress writer's records to a full
    /// write decided on `lease`: forgets the record, and returns `lease` as
    /// the writer's own writes left it when they are all that changed it
    /// since (so the full write goes over that version instead of meeting
    /// a conflict).
    pub fn take_over_progress(
        &self,
        key: &ObjectKey,
        lease: &CachedLease,
        now: Instant,
    ) -> Option<CachedLease> {
        let mut records = self.progress.lock();
        let moved_on = lease
            .metadata
            .resource_version
            .as_deref()
            .and_then(|decided_on| records.base(key, decided_on, now))
            .map(|base| base.lease_over(lease));
        records.forget(key);
        moved_on
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

    /// Number of records laid over the caches (for tests and logs).
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

/// The records laid over whole lists, as passes that look at every key
/// do: what tests read.
#[cfg(test)]
pub(crate) mod lists {
    use std::collections::BTreeSet;

    use super::*;

    /// The keys a pass over `cached` looks at: every cached key, every key
    /// the records name (see [`OwnWrites::end_pass`]) and `more`.
    fn keys<'a, K: Identity + 'a>(
        cached: &'a [Arc<K>],
        named: impl FnOnce(&mut HashSet<ObjectKey>),
        more: impl Iterator<Item = &'a ObjectKey>,
    ) -> BTreeSet<ObjectKey> {
        let mut named_keys = HashSet::default();
        named(&mut named_keys);
        cached
            .iter()
            .filter_map(|o| key_of(o.as_ref()))
            .chain(named_keys)
            .chain(more.cloned())
            .collect()
    }

    fn find<K: Identity>(cached: &[Arc<K>], key: &ObjectKey) -> Option<Arc<K>> {
        cached
            .iter()
            .find(|o| key_of(o.as_ref()).as_ref() == Some(key))
            .cloned()
    }

    /// Passes over lease lists; remembers what each decided on, as the
    /// engine's entries do.
    #[derive(Default)]
    pub struct LeasePasses {
        seen: HashMap<ObjectKey, Arc<CachedLease>>,
    }

    impl LeasePasses {
        /// One pass: the leases it decides on, in key order. `pod_uids`
        /// are the UIDs of the cached pods.
        pub fn pass(
            &mut self,
            o: &mut OwnWrites,
            cached: &[Arc<CachedLease>],
            pod_uids: &[&str],
            now: Instant,
        ) -> Vec<Arc<CachedLease>> {
            let mut out = Vec::new();
            let looked_at = keys(cached, |k| o.lease_keys_to_look_at(k), self.seen.keys());
            for key in looked_at {
                let seen = o.lease_with_own_writes(
                    &key,
                    find(cached, &key),
                    self.seen.get(&key),
                    |l| pod_uids.contains(&l.spec.pod_uid.as_str()),
                    now,
                );
                match &seen {
                    Some(lease) => drop(self.seen.insert(key, lease.clone())),
                    None => drop(self.seen.remove(&key)),
                }
                out.extend(seen);
            }
            o.end_pass();
            out
        }
    }

    /// One pass over a pod list, in key order.
    pub fn pods(o: &mut OwnWrites, cached: &[Arc<CachedPod>], now: Instant) -> Vec<Arc<CachedPod>> {
        let looked_at = keys(cached, |k| o.pod_keys_to_look_at(k), std::iter::empty());
        let seen = looked_at
            .iter()
            .filter_map(|key| o.pod_with_own_writes(key, find(cached, key), now))
            .collect();
        o.end_pass();
        seen
    }

    /// One pass over a class list, in key order.
    pub fn classes(
        o: &mut OwnWrites,
        cached: &[Arc<GpuLeaseClass>],
        now: Instant,
    ) -> Vec<Arc<GpuLeaseClass>> {
        let looked_at = keys(cached, |k| o.class_keys_to_look_at(k), std::iter::empty());
        let seen = looked_at
            .iter()
            .filter_map(|key| o.class_with_own_writes(key, find(cached, key), now))
            .collect();
        o.end_pass();
        seen
    }
}

#[cfg(test)]
mod tests {
    use super::lists::{self, LeasePasses};
    use super::*;
    use serde_json::json;

    fn lease(name: &str, uid: &str, rv: &str, phase: &str) -> CachedLease {
        serde_json::from_value::<gpupool_api::GpuLease>(json!({
            "apiVersion": "gpupool.io/v1alpha1", "kind": "GpuLease",
            "metadata": {"namespace": "ns", "name": name, "uid": uid, "resourceVersion": rv},
            "spec": {"className": "default", "podName": name, "podUID": "p", "slots": 1},
            "status": {"phase": phase}
        }))
        .expect("lease")
        .into()
    }

    fn leases<const N: usize>(list: [CachedLease; N]) -> Vec<Arc<CachedLease>> {
        list.into_iter().map(Arc::new).collect()
    }

    fn phases(leases: &[Arc<CachedLease>]) -> Vec<(String, String)> {
        let mut v: Vec<_> = leases
            .iter()
            .map(|l| {
                (
                    l.metadata.name.as_deref().unwrap_or_default().to_owned(),
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
        let (mut o, mut passes) = (OwnWrites::default(), LeasePasses::default());
        o.record_lease(lease("a", "u", "11", "Admitted"), false, t0);
        let stale = leases([lease("a", "u", "10", "Queued")]);
        let merged = passes.pass(&mut o, &stale, &[], t0);
        assert_eq!(phases(&merged), vec![("a".into(), "Some(Admitted)".into())]);
        assert_eq!(o.len(), 1);
        let fresh = leases([lease("a", "u", "12", "Bound")]);
        let merged = passes.pass(&mut o, &fresh, &[], t0);
        assert_eq!(phases(&merged), vec![("a".into(), "Some(Bound)".into())]);
        assert!(o.is_empty(), "caught up: forgotten");
    }

    /// A write, a deletion and an assumed write recorded after earlier
    /// passes saw their leases unchanged are laid over them all the same.
    #[test]
    fn a_write_to_an_object_earlier_passes_saw_unchanged_is_laid_over_it() {
        let t0 = Instant::now();
        let (mut o, mut passes) = (OwnWrites::default(), LeasePasses::default());
        let cached: Vec<Arc<CachedLease>> = ["a", "b", "c"]
            .into_iter()
            .map(|n| Arc::new(lease(n, n, "10", "Queued")))
            .collect();
        for _ in 0..3 {
            assert_eq!(passes.pass(&mut o, &cached, &[], t0).len(), 3);
        }
        o.record_lease(lease("b", "b", "11", "Admitted"), false, t0);
        o.record_lease_deleted(ObjectKey::new("ns", "c"), "c".into(), t0);
        o.assume_lease(
            ObjectKey::new("ns", "a"),
            Arc::new(lease("a", "a", "10", "Admitted")),
        );
        let merged = passes.pass(&mut o, &cached, &[], t0);
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
        let class = |rv: &str, capacity: u32| -> Arc<GpuLeaseClass> {
            Arc::new(
                serde_json::from_value(json!({
                    "apiVersion": "gpupool.io/v1alpha1", "kind": "GpuLeaseClass",
                    "metadata": {"name": "default", "uid": "c", "resourceVersion": rv},
                    "spec": {},
                    "status": {"capacity": capacity}
                }))
                .expect("class"),
            )
        };
        let capacity = |cs: &[Arc<GpuLeaseClass>]| -> Vec<u32> {
            cs.iter()
                .map(|c| c.status.as_ref().map_or(0, |s| s.capacity))
                .collect()
        };
        let t0 = Instant::now();
        let mut o = OwnWrites::default();
        o.record_class((*class("8", 4)).clone(), t0);
        let mut named = HashSet::default();
        o.class_keys_to_look_at(&mut named);
        assert_eq!(named.len(), 1, "a pass looks at it");
        assert_eq!(capacity(&lists::classes(&mut o, &[class("7", 2)], t0)), [4]);
        assert_eq!(capacity(&lists::classes(&mut o, &[class("9", 6)], t0)), [6]);
        assert!(o.is_empty(), "caught up: forgotten");
        // A class deleted after its status write is not brought back.
        o.record_class((*class("10", 4)).clone(), t0);
        assert!(lists::classes(&mut o, &[], t0).is_empty());
        assert!(o.is_empty());
    }

    #[test]
    fn assumed_leases_replace_or_join_the_list_until_forgotten() {
        let t0 = Instant::now();
        let (mut o, mut passes) = (OwnWrites::default(), LeasePasses::default());
        let cached = leases([
            lease("a", "u", "1", "Admitted"),
            lease("b", "v", "1", "Queued"),
        ]);
        o.assume_lease(
            ObjectKey::new("ns", "a"),
            Arc::new(lease("a", "u", "1", "Released")),
        );
        o.assume_lease(
            ObjectKey::new("ns", "new"),
            Arc::new(lease("new", "", "", "Queued")),
        );
        assert_eq!(
            phases(&passes.pass(&mut o, &cached, &[], t0)),
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
        assert_eq!(
            phases(&passes.pass(&mut o, &cached[..1], &[], t0)),
            vec![("a".into(), "Some(Admitted)".into())]
        );
    }

    #[test]
    fn created_leases_appear_before_the_watch_shows_them_then_expire() {
        let t0 = Instant::now();
        let (mut o, mut passes) = (OwnWrites::default(), LeasePasses::default());
        o.record_lease(lease("new", "u", "5", "Queued"), true, t0);
        assert_eq!(passes.pass(&mut o, &[], &[], t0).len(), 1);
        // A status write after the create keeps it a created lease.
        o.record_lease(lease("new", "u", "6", "Queued"), false, t0);
        let t1 = t0 + Duration::from_secs(1);
        assert_eq!(passes.pass(&mut o, &[], &[], t1).len(), 1);
        assert!(passes.pass(&mut o, &[], &[], t0 + CREATED_TTL).is_empty());
        assert!(o.is_empty());
    }

    #[test]
    fn a_written_lease_gone_from_the_cache_is_gone() {
        let t0 = Instant::now();
        let (mut o, mut passes) = (OwnWrites::default(), LeasePasses::default());
        o.record_lease(lease("a", "u", "11", "Released"), false, t0);
        assert!(passes.pass(&mut o, &[], &[], t0).is_empty());
        assert!(o.is_empty());
    }

    #[test]
    fn replaced_objects_are_not_masked() {
        let t0 = Instant::now();
        let (mut o, mut passes) = (OwnWrites::default(), LeasePasses::default());
        o.record_lease(lease("a", "old", "50", "Admitted"), false, t0);
        let merged = passes.pass(&mut o, &leases([lease("a", "new", "3", "Queued")]), &[], t0);
        assert_eq!(phases(&merged), vec![("a".into(), "Some(Queued)".into())]);
        assert!(o.is_empty());
    }

    #[test]
    fn deleted_leases_are_hidden_until_the_cache_drops_them() {
        let t0 = Instant::now();
        let (mut o, mut passes) = (OwnWrites::default(), LeasePasses::default());
        o.record_lease_deleted(ObjectKey::new("ns", "a"), "u".into(), t0);
        let cached = leases([
            lease("a", "u", "1", "Queued"),
            lease("b", "v", "1", "Queued"),
        ]);
        // Its pod is still cached, yet a deleted lease is not held.
        assert_eq!(phases(&passes.pass(&mut o, &cached, &["p"], t0)).len(), 1);
        assert_eq!(
            phases(&passes.pass(&mut o, &cached[1..], &["p"], t0)).len(),
            1
        );
        assert!(o.is_empty());
        // A new lease of the same name (another uid) is shown.
        o.record_lease_deleted(ObjectKey::new("ns", "a"), "u".into(), t0);
        let renewed = leases([lease("a", "u2", "9", "Queued")]);
        assert_eq!(passes.pass(&mut o, &renewed, &[], t0).len(), 1);
        assert!(o.is_empty());
        // Hidden no longer than the tombstone lasts.
        o.record_lease_deleted(ObjectKey::new("ns", "a"), "u2".into(), t0);
        assert!(passes.pass(&mut o, &renewed, &[], t0).is_empty());
        assert_eq!(
            passes.pass(&mut o, &renewed, &[], t0 + TOMBSTONE_TTL).len(),
            1
        );
        assert!(o.is_empty());
    }

    #[test]
    fn a_lease_gone_before_its_pod_is_held_until_the_pod_goes() {
        let t0 = Instant::now();
        let (mut o, mut passes) = (OwnWrites::default(), LeasePasses::default());
        let a = leases([lease("a", "u", "1", "Preempting")]);
        assert_eq!(passes.pass(&mut o, &a, &["p"], t0).len(), 1);
        // The lease watch drops it; the pod (uid "p") is still cached.
        let held = passes.pass(&mut o, &[], &["p"], t0);
        assert_eq!(phases(&held), vec![("a".into(), "Some(Preempting)".into())]);
        assert!(!o.is_missing(&ObjectKey::new("ns", "a"), t0));
        assert!(o.is_missing(&ObjectKey::new("ns", "a"), t0 + RECREATE_AFTER));
        assert_eq!(o.next_recreation(t0), Some(t0 + RECREATE_AFTER));
        // The pod leaves the cache: so does the held lease.
        assert!(passes.pass(&mut o, &[], &[], t0).is_empty());
        assert!(o.is_empty());
        // Held at most VANISHED_TTL when the pod stays.
        let b = leases([lease("b", "v", "1", "Bound")]);
        passes.pass(&mut o, &b, &["p"], t0);
        assert_eq!(passes.pass(&mut o, &[], &["p"], t0).len(), 1);
        assert!(
            passes
                .pass(&mut o, &[], &["p"], t0 + VANISHED_TTL)
                .is_empty()
        );
        assert!(o.is_empty());
    }

    #[test]
    fn an_unchanged_or_replaced_lease_is_never_held() {
        let t0 = Instant::now();
        let (mut o, mut passes) = (OwnWrites::default(), LeasePasses::default());
        let first = leases([lease("a", "u", "1", "Queued")]);
        passes.pass(&mut o, &first, &["p"], t0);
        passes.pass(&mut o, &first, &["p"], t0);
        // The watch replaced it with a newer version: still one lease.
        let newer = leases([lease("a", "u", "2", "Admitted")]);
        let seen = passes.pass(&mut o, &newer, &["p"], t0);
        assert_eq!(phases(&seen), vec![("a".into(), "Some(Admitted)".into())]);
        assert!(o.is_empty(), "nothing held");

        // It vanishes while its pod stays: held, beside another lease's
        // newer version.
        passes.pass(
            &mut o,
            &[newer[0].clone(), Arc::new(lease("b", "v", "3", "Queued"))],
            &["p"],
            t0,
        );
        let seen = passes.pass(
            &mut o,
            &leases([lease("b", "v", "4", "Admitted")]),
            &["p"],
            t0,
        );
        assert_eq!(
            phases(&seen),
            vec![
                ("a".into(), "Some(Admitted)".into()),
                ("b".into(), "Some(Admitted)".into())
            ]
        );
        assert_eq!(o.len(), 1, "a is held");
        // The watch shows it again (a newer version): no longer held.
        let back = leases([
            lease("a", "u", "5", "Bound"),
            lease("b", "v", "4", "Admitted"),
        ]);
        assert_eq!(
            phases(&passes.pass(&mut o, &back, &["p"], t0)),
            vec![
                ("a".into(), "Some(Bound)".into()),
                ("b".into(), "Some(Admitted)".into())
            ]
        );
        assert!(o.is_empty(), "nothing held");
    }

    /// The lease the watch replaced under an assumed write is the one held
    /// when it then vanishes: not the assumed one, nor the version the
    /// last pass before the write saw.
    #[test]
    fn a_lease_replaced_under_an_assumed_write_is_held_as_replaced() {
        let t0 = Instant::now();
        let (mut o, mut passes) = (OwnWrites::default(), LeasePasses::default());
        let key = ObjectKey::new("ns", "a");
        passes.pass(
            &mut o,
            &leases([lease("a", "u", "1", "Queued")]),
            &["p"],
            t0,
        );
        o.assume_lease(key.clone(), Arc::new(lease("a", "u", "1", "Admitted")));
        let replaced = leases([lease("a", "u", "2", "Preempting")]);
        let seen = passes.pass(&mut o, &replaced, &["p"], t0);
        assert_eq!(phases(&seen), vec![("a".into(), "Some(Admitted)".into())]);
        assert_eq!(o.confirmed_under_count(), 1, "the confirmed lease under it");
        o.forget_assumed(&key);
        let held = passes.pass(&mut o, &[], &["p"], t0);
        assert_eq!(phases(&held), vec![("a".into(), "Some(Preempting)".into())]);
        assert_eq!(
            held[0].metadata.resource_version.as_deref(),
            Some("2"),
            "the version the watch showed last"
        );
        // The pod leaves: nothing is held, and nothing is kept for `a`.
        assert!(passes.pass(&mut o, &[], &[], t0).is_empty());
        assert!(o.is_empty());
        assert_eq!(o.confirmed_under_count(), 0);
    }

    /// A lease created by an assumed write that never reached the API
    /// server was never confirmed: it is not held as vanished.
    #[test]
    fn an_assumed_create_that_never_landed_is_not_held() {
        let t0 = Instant::now();
        let (mut o, mut passes) = (OwnWrites::default(), LeasePasses::default());
        let key = ObjectKey::new("ns", "new");
        o.assume_lease(key.clone(), Arc::new(lease("new", "", "", "Queued")));
        assert_eq!(passes.pass(&mut o, &[], &["p"], t0).len(), 1);
        o.forget_assumed(&key);
        assert!(passes.pass(&mut o, &[], &["p"], t0).is_empty());
        assert!(o.is_empty());
        assert_eq!(o.confirmed_under_count(), 0);
    }

    /// A key the records let go of between two passes is looked at by the
    /// next pass, and by no pass after it unless they name it again.
    #[test]
    fn a_key_let_go_of_is_looked_at_once_more() {
        let mut o = OwnWrites::default();
        let key = ObjectKey::new("ns", "a");
        o.assume_lease(key.clone(), Arc::new(lease("a", "u", "1", "Admitted")));
        let looked_at = |o: &mut OwnWrites| {
            let mut keys = HashSet::default();
            o.lease_keys_to_look_at(&mut keys);
            keys
        };
        assert!(looked_at(&mut o).contains(&key));
        o.end_pass();
        o.forget_assumed(&key);
        assert!(
            looked_at(&mut o).contains(&key),
            "named when the pass ended"
        );
        o.end_pass();
        assert!(looked_at(&mut o).is_empty());
    }

    fn queued_at(rv: &str, position: u32) -> CachedLease {
        serde_json::from_value::<gpupool_api::GpuLease>(json!({
            "apiVersion": "gpupool.io/v1alpha1", "kind": "GpuLease",
            "metadata": {"namespace": "ns", "name": "a", "uid": "u", "resourceVersion": rv},
            "spec": {"className": "default", "podName": "a", "podUID": "p", "slots": 1},
            "status": {"phase": "Queued", "sequence": 7, "position": position}
        }))
        .expect("lease")
        .into()
    }

    #[test]
    fn a_full_status_write_takes_the_lease_over_as_the_progress_writer_left_it() {
        let t0 = Instant::now();
        let o = OwnWrites::default();
        let key = ObjectKey::new("ns", "a");
        let seen = queued_at("1", 3);
        let moved_to = queued_at("2", 2).status.expect("status");
        let records = o.progress_records();
        records
            .lock()
            .record(key.clone(), "1", "1", moved_to.clone(), "2".into(), t0);
        let moved = o.take_over_progress(&key, &seen, t0).expect("moved on");
        assert_eq!(moved.metadata.resource_version.as_deref(), Some("2"));
        assert_eq!(moved.status, Some(moved_to.clone()));
        assert!(records.lock().is_empty(), "the record is handed over");

        // Without a record, or decided on a version the writer did not
        // write from: nothing to move on to, and nothing kept.
        assert!(o.take_over_progress(&key, &seen, t0).is_none());
        records
            .lock()
            .record(key.clone(), "7", "7", moved_to, "8".into(), t0);
        assert!(o.take_over_progress(&key, &seen, t0).is_none());
        assert!(records.lock().is_empty());
    }

    fn pod(rv: &str, gated: bool, deleting: bool) -> Arc<CachedPod> {
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
        Arc::new(serde_json::from_value(v).expect("pod"))
    }

    #[test]
    fn admitted_pods_and_evictions() {
        let t0 = Instant::now();
        let mut o = OwnWrites::default();
        o.record_pod((*pod("8", false, false)).clone(), t0);
        let merged = lists::pods(&mut o, &[pod("7", true, false)], t0);
        assert!(
            merged[0]
                .spec
                .as_ref()
                .and_then(|s| s.scheduling_gates.as_ref())
                .is_none(),
            "the admitted version is used"
        );
        lists::pods(&mut o, &[pod("8", false, false)], t0);
        assert!(o.is_empty());

        let key = ObjectKey::new("ns", "p");
        o.record_evicted(key.clone(), "u".into(), t0);
        let mut named = HashSet::default();
        o.pod_keys_to_look_at(&mut named);
        assert_eq!(named.len(), 1, "a pass looks at it");
        lists::pods(&mut o, &[pod("9", false, false)], t0);
        assert!(o.is_evicted(&key));
        lists::pods(&mut o, &[pod("10", false, true)], t0);
        assert!(!o.is_evicted(&key), "the cache shows it terminating");

        // Gone from the cache, or not shown by it for too long: forgotten.
        o.record_evicted(key.clone(), "u".into(), t0);
        lists::pods(&mut o, &[], t0);
        assert!(!o.is_evicted(&key));
        o.record_evicted(key.clone(), "u".into(), t0);
        lists::pods(&mut o, &[pod("11", false, false)], t0 + TOMBSTONE_TTL);
        assert!(!o.is_evicted(&key));
        assert!(o.is_empty());
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
        let mut o = OwnWrites::default();
        o.record_pod(written, Instant::now());
        let merged = lists::pods(&mut o, &[Arc::new(cached)], Instant::now());
        assert_eq!(merged.len(), 1);
        let kept = &merged[0];
        assert_eq!(kept.metadata.resource_version.as_deref(), Some("8"));
        // What the rules read stays.
        let spec = kept.spec.as_ref().expect("spec");
        assert!(spec.containers[0].resources.is_some());
    }
}
