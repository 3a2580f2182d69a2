//! Hashing of object addresses: the controller tells the objects a pass has
//! already seen by the address of their `Arc`, once per cached object per
//! pass. An address is chosen by the allocator, never by a tenant, so it
//! needs no flood-resistant hash: a multiply spreads its aligned low bits
//! over the table.

use std::collections::HashMap;
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
