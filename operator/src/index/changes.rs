//! Which objects a watch changed since the decision loop last looked.
//!
//! A pass brings the engine up to date by looking only at the keys a watch
//! event touched (and at the keys of the controller's own writes, see
//! [`crate::controller::own_writes`]), so its cost follows what changed, not
//! how many pods and leases the caches hold. A watch that lists again (a restart, or a
//! resourceVersion too old) may have missed deletions, so it asks for one
//! full look instead.

use std::sync::{Arc, Mutex, PoisonError};

use kube::runtime::watcher;

use super::identity::{Identity, parts_of};
use super::key_hash::HashSet;
use crate::engine::{KeyParts, ObjectKey};

/// Keys a log holds before it gives up naming them and asks for a full
/// look instead. A replica that does not lead never takes from its logs,
/// and every pod deleted while it follows would otherwise stay named; past
/// this many changes, a full look is no dearer than looking at each.
pub const MAX_KEYS: usize = 16_384;

/// What changed in one watch cache since [`ChangeLog::take`] last ran.
#[derive(Debug, PartialEq, Eq)]
pub enum Changes {
    /// Anything may have changed: look at every object.
    Everything,
    /// Only these keys changed (added, replaced or deleted).
    Keys(HashSet<ObjectKey>),
}

#[derive(Debug)]
struct Pending {
    keys: HashSet<ObjectKey>,
    everything: bool,
}

/// The keys one watch changed, shared between the watch task (which
/// records) and the decision loop (which takes). Cheap to clone.
///
/// Guarantee: every object the cache changed after the last
/// [`ChangeLog::take`] is named by the next one (or that one says
/// [`Changes::Everything`]); the first take says `Everything`. A key is
/// held once however often it changes, and never more than [`MAX_KEYS`]
/// keys are held.
#[derive(Debug, Clone)]
pub struct ChangeLog(Arc<Mutex<Pending>>);

impl Default for ChangeLog {
    fn default() -> Self {
        Self(Arc::new(Mutex::new(Pending {
            keys: HashSet::default(),
            everything: true,
        })))
    }
}

impl ChangeLog {
    /// Records one watch event, after the cache has applied it. `held` is
    /// the key the cache keeps the object under (see
    /// [`IndexWriter::apply`](super::store::IndexWriter::apply)): the log
    /// shares it rather than building one, so a pending key allocates
    /// nothing of its own.
    pub fn record<K: Identity>(&self, event: &watcher::Event<K>, held: Option<&ObjectKey>) {
        match event {
            watcher::Event::Apply(obj) | watcher::Event::Delete(obj) => {
                let Some((namespace, name)) = parts_of(obj) else {
                    return;
                };
                let mut pending = self.lock();
                if pending.everything {
                    return;
                }
                // An object changed again before the pass looked: no new key.
                if pending.keys.contains(&(namespace, name) as &dyn KeyParts) {
                    return;
                }
                if pending.keys.len() >= MAX_KEYS {
                    pending.everything = true;
                    pending.keys = HashSet::default();
                    return;
                }
                let key = match held {
                    Some(key) if (&*key.namespace, &*key.name) == (namespace, name) => key.clone(),
                    _ => ObjectKey::new(namespace, name),
                };
                pending.keys.insert(key);
            }
            // A re-list replaces the cache's contents when it completes;
            // what it dropped was never announced one by one.
            watcher::Event::Init | watcher::Event::InitApply(_) | watcher::Event::InitDone => {
                self.everything();
            }
        }
    }

    /// Asks the next [`ChangeLog::take`] for a full look.
    pub fn everything(&self) {
        let mut pending = self.lock();
        pending.everything = true;
        pending.keys = HashSet::default();
    }

    /// What changed since the last take; the log starts empty again.
    pub fn take(&self) -> Changes {
        let mut pending = self.lock();
        if std::mem::take(&mut pending.everything) {
            pending.keys = HashSet::default();
            return Changes::Everything;
        }
        Changes::Keys(std::mem::take(&mut pending.keys))
    }

    /// A holder that panicked left a whole set behind (each change is one
    /// insert), so a poisoned lock is used on.
    fn lock(&self) -> std::sync::MutexGuard<'_, Pending> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::ConfigMap;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    use super::*;

    fn obj(name: Option<&str>) -> ConfigMap {
        ConfigMap {
            metadata: ObjectMeta {
                namespace: Some("ns".into()),
                name: name.map(str::to_owned),
                ..ObjectMeta::default()
            },
            ..ConfigMap::default()
        }
    }

    fn keys(names: &[&str]) -> Changes {
        Changes::Keys(names.iter().map(|n| ObjectKey::new("ns", *n)).collect())
    }

    #[test]
    fn the_first_take_is_everything_then_only_changed_keys() {
        let log = ChangeLog::default();
        log.record(&watcher::Event::Apply(obj(Some("a"))), None);
        assert_eq!(log.take(), Changes::Everything);
        assert_eq!(log.take(), keys(&[]));

        log.record(&watcher::Event::Apply(obj(Some("a"))), None);
        log.record(&watcher::Event::Apply(obj(Some("a"))), None);
        log.record(&watcher::Event::Delete(obj(Some("b"))), None);
        log.record(&watcher::Event::Apply(obj(None)), None);
        assert_eq!(
            log.take(),
            keys(&["a", "b"]),
            "each key once; nameless skipped"
        );
        assert_eq!(log.take(), keys(&[]));
    }

    #[test]
    fn the_key_the_cache_holds_is_shared_not_copied() {
        let log = ChangeLog::default();
        log.take();
        let held = ObjectKey::new("ns", "a");
        log.record(&watcher::Event::Apply(obj(Some("a"))), Some(&held));
        // A key that does not name the event's object is not taken for it.
        log.record(&watcher::Event::Apply(obj(Some("b"))), Some(&held));
        let Changes::Keys(taken) = log.take() else {
            panic!("keys");
        };
        let a = taken.get(&held).expect("a");
        assert!(Arc::ptr_eq(&a.name, &held.name) && Arc::ptr_eq(&a.namespace, &held.namespace));
        assert!(taken.contains(&ObjectKey::new("ns", "b")));
        assert_eq!(taken.len(), 2);
    }

    #[test]
    fn a_relist_asks_for_everything() {
        for event in [
            watcher::Event::Init,
            watcher::Event::InitApply(obj(Some("a"))),
            watcher::Event::InitDone,
        ] {
            let log = ChangeLog::default();
            assert_eq!(log.take(), Changes::Everything);
            log.record(&watcher::Event::Apply(obj(Some("b"))), None);
            log.record(&event, None);
            assert_eq!(log.take(), Changes::Everything, "after {event:?}");
            assert_eq!(log.take(), keys(&[]));
        }
    }

    #[test]
    fn a_log_nobody_takes_from_stays_bounded() {
        let log = ChangeLog::default();
        log.take();
        for i in 0..MAX_KEYS {
            log.record(&watcher::Event::Delete(obj(Some(&format!("p{i}")))), None);
        }
        log.record(&watcher::Event::Apply(obj(Some("p0"))), None);
        assert_eq!(log.lock().keys.len(), MAX_KEYS, "a known key adds nothing");
        log.record(&watcher::Event::Delete(obj(Some("one-more"))), None);
        assert!(log.lock().keys.is_empty(), "the keys are let go");
        log.record(&watcher::Event::Apply(obj(Some("after"))), None);
        assert!(
            log.lock().keys.is_empty(),
            "a full look is due: nothing named"
        );
        assert_eq!(log.take(), Changes::Everything);
        assert_eq!(log.take(), keys(&[]));
    }

    #[test]
    fn a_log_whose_holder_panicked_is_used_on() {
        let log = ChangeLog::default();
        log.take();
        log.record(&watcher::Event::Apply(obj(Some("a"))), None);
        let poisoner = log.clone();
        let panicked = std::thread::spawn(move || {
            let _held = poisoner.lock();
            panic!("a holder dies with the lock");
        })
        .join();
        assert!(panicked.is_err());
        assert!(log.0.is_poisoned());
        log.record(&watcher::Event::Apply(obj(Some("b"))), None);
        assert_eq!(log.take(), keys(&["a", "b"]), "nothing recorded was lost");
        log.everything();
        assert_eq!(log.take(), Changes::Everything);
    }

    #[test]
    fn clones_share_one_log() {
        let log = ChangeLog::default();
        let watch_side = log.clone();
        log.take();
        watch_side.record(&watcher::Event::Apply(obj(Some("a"))), None);
        assert_eq!(log.take(), keys(&["a"]));
        watch_side.everything();
        assert_eq!(log.take(), Changes::Everything);
    }
}
