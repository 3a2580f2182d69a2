//! A short map kept as one sorted slice.

use std::borrow::Borrow;
use std::collections::BTreeMap;

/// A map of a few entries stored as one sorted, exactly sized slice.
///
/// A pod's requests and node selector hold one or two entries each, and a
/// `BTreeMap` spends a whole node on them; this costs what it holds.
/// Lookups are a binary search; [`SmallMap::insert`] copies
/// the slice, so it is for building, not for maps that keep changing.
///
/// Guarantee: keys are unique and iterate in ascending order, as a
/// `BTreeMap`'s do; of equal keys given to `from_iter`, the last wins.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct SmallMap<K, V>(Box<[(K, V)]>);

impl<K, V> Default for SmallMap<K, V> {
    fn default() -> Self {
        Self(Box::new([]))
    }
}

impl<K: Ord, V> SmallMap<K, V> {
    /// An empty map (allocates nothing).
    pub fn new() -> Self {
        Self::default()
    }

    /// The value for `key`.
    pub fn get<Q>(&self, key: &Q) -> Option<&V>
    where
        K: Borrow<Q>,
        Q: Ord + ?Sized,
    {
        let i = self.0.binary_search_by(|(k, _)| k.borrow().cmp(key)).ok()?;
        Some(&self.0[i].1)
    }

    /// Whether `key` has a value.
    pub fn contains_key<Q>(&self, key: &Q) -> bool
    where
        K: Borrow<Q>,
        Q: Ord + ?Sized,
    {
        self.get(key).is_some()
    }

    /// Sets `key` to `value`; returns the value it replaces.
    pub fn insert(&mut self, key: K, value: V) -> Option<V> {
        match self.0.binary_search_by(|(k, _)| k.cmp(&key)) {
            Ok(i) => Some(std::mem::replace(&mut self.0[i].1, value)),
            Err(i) => {
                let mut entries = std::mem::take(&mut self.0).into_vec();
                entries.insert(i, (key, value));
                self.0 = entries.into_boxed_slice();
                None
            }
        }
    }
}

impl<K, V> SmallMap<K, V> {
    /// Entries in ascending key order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = (&K, &V)> {
        self.0.iter().map(|(k, v)| (k, v))
    }

    /// Keys in ascending order.
    pub fn keys(&self) -> impl ExactSizeIterator<Item = &K> {
        self.0.iter().map(|(k, _)| k)
    }

    /// Values in the order of their keys.
    pub fn values(&self) -> impl ExactSizeIterator<Item = &V> {
        self.0.iter().map(|(_, v)| v)
    }

    /// How many entries.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl<K: Ord, V> FromIterator<(K, V)> for SmallMap<K, V> {
    fn from_iter<I: IntoIterator<Item = (K, V)>>(iter: I) -> Self {
        let mut entries: Vec<(K, V)> = iter.into_iter().collect();
        // Stable, so of equal keys the last given is the last kept.
        entries.sort_by(|a, b| a.0.cmp(&b.0));
        let mut unique: Vec<(K, V)> = Vec::with_capacity(entries.len());
        for entry in entries {
            match unique.last_mut() {
                Some(last) if last.0 == entry.0 => *last = entry,
                _ => unique.push(entry),
            }
        }
        Self(unique.into_boxed_slice())
    }
}

impl<K: Ord, V> From<BTreeMap<K, V>> for SmallMap<K, V> {
    fn from(map: BTreeMap<K, V>) -> Self {
        Self(map.into_iter().collect::<Vec<_>>().into_boxed_slice())
    }
}

impl<K: Ord, V, const N: usize> From<[(K, V); N]> for SmallMap<K, V> {
    fn from(entries: [(K, V); N]) -> Self {
        entries.into_iter().collect()
    }
}

/// `map[key]`, which panics when `key` is absent, as a `BTreeMap`'s does.
impl<K: Ord + Borrow<Q>, Q: Ord + ?Sized, V> std::ops::Index<&Q> for SmallMap<K, V> {
    type Output = V;

    fn index(&self, key: &Q) -> &V {
        self.get(key).expect("no entry found for key")
    }
}

impl<'a, K, V> IntoIterator for &'a SmallMap<K, V> {
    type Item = (&'a K, &'a V);
    type IntoIter = std::iter::Map<std::slice::Iter<'a, (K, V)>, fn(&'a (K, V)) -> (&'a K, &'a V)>;

    fn into_iter(self) -> Self::IntoIter {
        self.0.iter().map(|(k, v)| (k, v))
    }
}

impl<K: std::fmt::Debug, V: std::fmt::Debug> std::fmt::Debug for SmallMap<K, V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn it_keeps_unique_keys_in_order_as_a_btree_map_does() {
        let given = [("b", 2), ("a", 1), ("c", 3), ("a", 9)];
        let small: SmallMap<&str, i32> = given.into_iter().collect();
        let btree: BTreeMap<&str, i32> = given.into_iter().collect();
        assert_eq!(
            small.iter().collect::<Vec<_>>(),
            btree.iter().collect::<Vec<_>>(),
            "sorted, unique, the last of equal keys kept"
        );
        assert_eq!(small, SmallMap::from(btree));
        assert_eq!((small.get("a"), small.get("z")), (Some(&9), None));
        assert!(small.contains_key("c") && !small.contains_key("d"));
        assert_eq!(small.len(), 3);
    }

    #[test]
    fn insert_places_or_replaces() {
        let mut map: SmallMap<String, u32> = SmallMap::new();
        assert!(map.is_empty());
        assert_eq!(map.insert("m".into(), 1), None);
        assert_eq!(map.insert("a".into(), 2), None);
        assert_eq!(map.insert("z".into(), 3), None);
        assert_eq!(map.insert("m".into(), 4), Some(1));
        assert_eq!(
            map.keys().map(String::as_str).collect::<Vec<_>>(),
            ["a", "m", "z"]
        );
        assert_eq!(map.get("m"), Some(&4));
        assert_eq!(format!("{map:?}"), r#"{"a": 2, "m": 4, "z": 3}"#);
    }
}
