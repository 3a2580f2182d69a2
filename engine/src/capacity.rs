//! Slot accounting per node and resource (DESIGN §5.3, §5.9): free =
//! allocatable − slots of every live pod bound or pinned there, whatever its
//! class, each pod counted once.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use super::model::{ClassInfo, NodeInfo};

/// The distinct resource names the classes manage, sorted; a resource is
/// referred to by its index in this list for the rest of the pass.
pub(crate) fn resource_names<'a>(classes: &[&'a ClassInfo]) -> Vec<&'a str> {
    let mut names: Vec<&str> = classes
        .iter()
        .map(|c| c.spec.resource_name.as_str())
        .collect();
    names.sort_unstable();
    names.dedup();
    names
}

/// Nodes in name order with their allocatable and used slots per resource.
#[derive(Debug)]
pub(crate) struct Nodes<'a> {
    pub list: Vec<&'a NodeInfo>,
    // Lookup only, never iterated: its order cannot leak into a decision.
    by_name: HashMap<&'a str, u32, BuildHasherDefault<NameHasher>>,
    alloc: Vec<Vec<u32>>,
    used: Vec<Vec<u64>>,
}

impl<'a> Nodes<'a> {
    /// Indexes the nodes, given sorted by name with one entry per name.
    pub fn new(nodes: &[&'a NodeInfo], resources: &[&str]) -> Self {
        let list = nodes.to_vec();
        let by_name = list
            .iter()
            .enumerate()
            .map(|(i, n)| (n.name.as_str(), i as u32))
            .collect();
        let alloc = resources
            .iter()
            .map(|r| {
                list.iter()
                    .map(|n| n.allocatable.get(*r).copied().unwrap_or(0))
                    .collect()
            })
            .collect();
        let used = resources.iter().map(|_| vec![0; list.len()]).collect();
        Self {
            list,
            by_name,
            alloc,
            used,
        }
    }

    /// Index of the node named `name`, if it exists.
    pub fn find(&self, name: &str) -> Option<u32> {
        self.by_name.get(name).copied()
    }

    /// Allocatable slots of resource `res` on node `node`.
    pub fn alloc(&self, res: usize, node: u32) -> u32 {
        self.alloc[res][node as usize]
    }

    /// Free slots (negative when over-committed, e.g. after allocatable shrank).
    pub fn free(&self, res: usize, node: u32) -> i64 {
        i64::from(self.alloc[res][node as usize]) - self.used[res][node as usize] as i64
    }

    /// Marks `slots` as held on the node.
    pub fn take(&mut self, res: usize, node: u32, slots: u32) {
        self.used[res][node as usize] += u64::from(slots);
    }

    /// Takes the slots several pods on `node` hold, summed.
    pub fn take_sum(&mut self, res: usize, node: u32, slots: u64) {
        self.used[res][node as usize] += slots;
    }

    /// Returns `slots` taken earlier in this pass (a lapsed reservation).
    pub fn give_back(&mut self, res: usize, node: u32, slots: u32) {
        let used = &mut self.used[res][node as usize];
        *used = used.saturating_sub(u64::from(slots));
    }

    /// Sum of non-negative free slots over `nodes`.
    pub fn free_on(&self, res: usize, nodes: &[u32]) -> u64 {
        nodes.iter().map(|&n| self.free(res, n).max(0) as u64).sum()
    }
}

/// Hashes node names for the per-pass index, eight bytes at a time.
///
/// Unseeded, and fine so: the names in the index are the nodes', which
/// kubelets and administrators write, not tenants; a tenant's pod only
/// looks a name up, and a lookup cannot make the table's chains longer.
/// A seeded hash would cost every lookup of every pass for no protection.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct NameHasher(u64);

impl NameHasher {
    fn mix(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
}

impl Hasher for NameHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for chunk in &mut chunks {
            let mut word = [0u8; 8];
            word.copy_from_slice(chunk);
            self.mix(u64::from_le_bytes(word));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            // The last byte says how many came before it, so a name and
            // the same name with trailing zero bytes hash apart.
            let mut word = [0u8; 8];
            word[..rest.len()].copy_from_slice(rest);
            word[7] = rest.len() as u8;
            self.mix(u64::from_le_bytes(word));
        }
    }

    fn write_u8(&mut self, byte: u8) {
        self.mix(u64::from(byte));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures;

    #[test]
    fn every_node_is_found_by_name_and_no_other_name_is() {
        let infos: Vec<NodeInfo> = (0..1000)
            .map(|i| fixtures::node(&format!("node-{i:04}"), 8))
            .collect();
        let refs: Vec<&NodeInfo> = infos.iter().collect();
        let nodes = Nodes::new(&refs, &[fixtures::RESOURCE]);
        for (i, n) in infos.iter().enumerate() {
            assert_eq!(nodes.find(&n.name), Some(i as u32));
        }
        for missing in ["", "node-", "node-1000", "node-00000", "node-0001 "] {
            assert_eq!(nodes.find(missing), None, "{missing:?}");
        }
    }

    #[test]
    fn names_that_differ_anywhere_hash_apart() {
        use std::hash::BuildHasher;
        let build = BuildHasherDefault::<NameHasher>::default();
        let hashes: std::collections::BTreeSet<u64> = (0..10_000)
            .map(|i| build.hash_one(format!("gpu-node-{i:05}.example")))
            .collect();
        assert_eq!(hashes.len(), 10_000, "no two of 10,000 names collide");
        assert_ne!(build.hash_one("a"), build.hash_one("a\0"));
        assert_ne!(build.hash_one("abcdefgh1"), build.hash_one("abcdefgh2"));
    }
}
