//! Hashing of object keys for the maps a pass probes once per cached
//! object (the overlay's writes, the mirrors' keys), and a memo of each
//! cached object's key hash by its address.
//!
//! A pass at 10,000 pods asks, for every cached pod and lease, whether the
//! controller wrote, deleted or evicted it: a handful of keys against
//! 16,000 objects. Reading each object's namespace and name to hash them
//! touched 16,000 scattered allocations per pass, the largest cost of the
//! operator's side of a pass. [`KeyHashes`] reads an object's key once,
//! the first time its `Arc` is seen, and answers from its address after
//! that; only an object whose key hash matches one of the handful is read.
//!
//! foldhash is seeded at random per process, so a tenant who picks pod
//! names cannot aim collisions at a running operator without first learning
//! its seed, and a collision costs one more key comparison, never a wrong
//! answer.

use std::hash::BuildHasher;
use std::sync::Arc;

use kube::Resource;

use super::addr_hash::ByAddress;
use crate::engine::{KeyParts, ObjectKey};

/// A `HashMap` hashed with foldhash.
pub type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

/// A `HashSet` hashed with foldhash.
pub type HashSet<T> = std::collections::HashSet<T, foldhash::fast::RandomState>;

/// An object's namespace and name, borrowed.
pub fn parts_of<K: Resource>(obj: &K) -> Option<(&str, &str)> {
    Some((
        obj.meta().namespace.as_deref().unwrap_or_default(),
        obj.meta().name.as_deref()?,
    ))
}

/// The key hash of each object a pass looked at, by the address of its
/// `Arc`: the same until the cache replaces the object.
///
/// Guarantee: [`KeyHashes::of`] returns the hash [`KeyHashes::of_key`]
/// gives for the object's key, whenever it was first asked; objects no
/// pass has asked about since the pass before are forgotten (and released)
/// by [`KeyHashes::next_pass`].
#[derive(Debug)]
pub struct KeyHashes<K> {
    state: foldhash::fast::RandomState,
    /// Each object's key hash; `None` for an object without a name.
    seen: ByAddress<K, Option<u64>>,
}

impl<K> Default for KeyHashes<K> {
    fn default() -> Self {
        Self {
            state: foldhash::fast::RandomState::default(),
            seen: ByAddress::default(),
        }
    }
}

impl<K: Resource> KeyHashes<K> {
    /// Starts a pass: forgets the objects the previous pass did not ask
    /// about (the cache no longer holds them).
    pub fn next_pass(&mut self) {
        self.seen.sweep(|_, _| {});
        self.seen.next_pass();
    }

    /// The hash of `obj`'s key (`None` when it has no name), reading the
    /// object only the first time its `Arc` is seen.
    pub fn of(&mut self, obj: &Arc<K>) -> Option<u64> {
        let state = &self.state;
        *self
            .seen
            .see(obj, |o| {
                parts_of(o).map(|p| state.hash_one(&p as &dyn KeyParts))
            })
            .0
    }

    /// The hash [`KeyHashes::of`] gives an object with key `key`.
    pub fn of_key(&self, key: &ObjectKey) -> u64 {
        self.state.hash_one(key as &dyn KeyParts)
    }

    /// The hashes of `keys`, to test objects against with [`KeyHashes::of`].
    pub fn of_keys<'k>(&self, keys: impl IntoIterator<Item = &'k ObjectKey>) -> HashSet<u64> {
        keys.into_iter().map(|k| self.of_key(k)).collect()
    }

    /// Objects remembered.
    pub fn len(&self) -> usize {
        self.seen.len()
    }

    /// True when nothing is remembered.
    pub fn is_empty(&self) -> bool {
        self.seen.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::ConfigMap;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    use super::*;

    fn obj(ns: &str, name: &str) -> Arc<ConfigMap> {
        Arc::new(ConfigMap {
            metadata: ObjectMeta {
                namespace: Some(ns.to_owned()),
                name: Some(name.to_owned()),
                ..ObjectMeta::default()
            },
            ..ConfigMap::default()
        })
    }

    #[test]
    fn an_object_hashes_as_its_key_and_is_read_once() {
        let mut h = KeyHashes::default();
        h.next_pass();
        let a = obj("ns", "a");
        let want = h.of_key(&ObjectKey::new("ns", "a"));
        assert_eq!(h.of(&a), Some(want));
        assert_ne!(h.of(&obj("ns", "b")), Some(want));
        assert_ne!(h.of(&obj("other", "a")), Some(want));
        assert!(h.of_keys([&ObjectKey::new("ns", "a")]).contains(&want));
        let nameless = Arc::new(ConfigMap::default());
        assert_eq!(h.of(&nameless), None);
        // Asked again: answered from the memo, with the same hash.
        assert_eq!(h.of(&a), Some(want));
        assert_eq!(h.len(), 4);
    }

    #[test]
    fn objects_no_pass_asked_about_are_released() {
        let mut h = KeyHashes::default();
        let (a, b) = (obj("ns", "a"), obj("ns", "b"));
        h.next_pass();
        h.of(&a);
        h.of(&b);
        assert_eq!(Arc::strong_count(&a), 2, "held while remembered");
        h.next_pass();
        h.of(&a);
        h.next_pass();
        assert_eq!(h.len(), 1, "b was not asked about in the last pass");
        assert_eq!(Arc::strong_count(&b), 1, "and is released");
        h.next_pass();
        assert!(h.is_empty());
        assert_eq!(Arc::strong_count(&a), 1);
    }
}
