//! Hashing of object addresses: the controller tells the objects a pass has
//! already seen by the address of their `Arc`, once per cached object per
//! pass. An address is chosen by the allocator, never by a tenant, so it
//! needs no flood-resistant hash: a multiply spreads its aligned low bits
//! over the table.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;

/// Hashes one address (`usize` or pointer) with a multiply.
#[derive(Debug, Default, Clone, Copy)]
pub struct AddrHasher(u64);

impl Hasher for AddrHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only for keys other than a plain address; kept correct all the same.
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }

    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }

    fn write_u64(&mut self, n: u64) {
        // Fibonacci hashing: the high bits, which hashbrown reads, mix every
        // bit of the address.
        self.0 = (self.0 ^ n)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .rotate_left(26);
    }
}

/// Builds [`AddrHasher`]s.
pub type BuildAddrHasher = BuildHasherDefault<AddrHasher>;

/// The address of an object's `Arc`, the key of an [`AddrMap`]: the same
/// until the cache replaces the object.
pub fn addr<K>(obj: &Arc<K>) -> usize {
    Arc::as_ptr(obj) as usize
}

/// A map keyed by object address.
pub type AddrMap<V> = HashMap<usize, V, BuildAddrHasher>;

struct Marked<K, V> {
    obj: Arc<K>,
    value: V,
    pass: u64,
}

/// The objects passes saw, by the address of their `Arc`, each with a value
/// made the first time its `Arc` was seen and the pass that last saw it.
/// Each `Arc` is held, so its address cannot go to another object while it
/// is kept.
pub struct ByAddress<K, V> {
    seen: AddrMap<Marked<K, V>>,
    pass: u64,
}

impl<K, V> Default for ByAddress<K, V> {
    fn default() -> Self {
        Self {
            seen: AddrMap::default(),
            pass: 0,
        }
    }
}

impl<K, V> std::fmt::Debug for ByAddress<K, V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ByAddress")
            .field("objects", &self.seen.len())
            .field("pass", &self.pass)
            .finish()
    }
}

impl<K, V> ByAddress<K, V> {
    /// Starts a pass.
    pub fn next_pass(&mut self) {
        self.pass += 1;
    }

    /// Marks `obj` seen by this pass and returns its value (`value(obj)`
    /// when its `Arc` is new) and whether it was new.
    pub fn see(&mut self, obj: &Arc<K>, value: impl FnOnce(&K) -> V) -> (&V, bool) {
        let pass = self.pass;
        match self.seen.entry(addr(obj)) {
            Entry::Occupied(kept) => {
                let kept = kept.into_mut();
                kept.pass = pass;
                (&kept.value, false)
            }
            Entry::Vacant(slot) => {
                let kept = slot.insert(Marked {
                    obj: obj.clone(),
                    value: value(obj),
                    pass,
                });
                (&kept.value, true)
            }
        }
    }

    /// Takes out every object this pass has not seen, handing each to `gone`.
    pub fn sweep(&mut self, mut gone: impl FnMut(Arc<K>, V)) {
        let pass = self.pass;
        for (_, kept) in self.seen.extract_if(|_, kept| kept.pass != pass) {
            gone(kept.obj, kept.value);
        }
    }

    /// Objects kept.
    pub fn len(&self) -> usize {
        self.seen.len()
    }

    /// True when nothing is kept.
    pub fn is_empty(&self) -> bool {
        self.seen.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;
    use std::hash::BuildHasher;

    use super::*;

    #[test]
    fn aligned_addresses_spread_over_buckets() {
        let build = BuildAddrHasher::default();
        // 1,024 addresses 64 bytes apart, as an allocator hands them out:
        // their low 7 bits (what a 128-bucket table would use) must not
        // all collide, and neither may the top 7 (hashbrown's tag).
        let hashes: Vec<u64> = (0..1024usize)
            .map(|i| build.hash_one(0x7f00_0000_0000usize + i * 64))
            .collect();
        let low: HashSet<u64> = hashes.iter().map(|h| h & 127).collect();
        let top: HashSet<u64> = hashes.iter().map(|h| h >> 57).collect();
        assert!(low.len() > 100, "low bits used: {}", low.len());
        assert!(top.len() > 100, "top bits used: {}", top.len());
        let distinct: HashSet<u64> = hashes.iter().copied().collect();
        assert_eq!(distinct.len(), hashes.len(), "no two addresses collide");
    }

    #[test]
    fn objects_a_pass_did_not_see_are_swept_and_released() {
        let (a, b) = (Arc::new(1u32), Arc::new(2u32));
        let mut seen = ByAddress::default();
        seen.next_pass();
        assert_eq!(seen.see(&a, |v| v * 10), (&10, true));
        assert_eq!(seen.see(&b, |v| v * 10), (&20, true));
        assert_eq!(seen.see(&a, |_| unreachable!("made once")), (&10, false));
        assert_eq!(Arc::strong_count(&b), 2, "held while kept");
        seen.sweep(|_, _| panic!("both seen this pass"));
        seen.next_pass();
        seen.see(&a, |_| unreachable!("made once"));
        let mut gone = Vec::new();
        seen.sweep(|obj, value| gone.push((*obj, value)));
        assert_eq!(gone, [(2, 20)]);
        assert_eq!(seen.len(), 1);
        assert_eq!(Arc::strong_count(&b), 1, "released");
        seen.next_pass();
        seen.sweep(|_, _| {});
        assert!(seen.is_empty());
        assert_eq!(Arc::strong_count(&a), 1);
    }

    #[test]
    fn a_map_finds_what_it_holds_by_address() {
        let values: Vec<Arc<u32>> = (0..100).map(Arc::new).collect();
        let map: AddrMap<u32> = values.iter().map(|v| (addr(v), **v)).collect();
        for v in &values {
            assert_eq!(map.get(&addr(v)), Some(&**v));
        }
        let other = Arc::new(7u32);
        assert_eq!(map.get(&addr(&other)), None);
        assert_eq!(
            addr(&values[0]),
            addr(&values[0].clone()),
            "a clone shares it"
        );
    }
}
