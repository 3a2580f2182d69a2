//! Slot accounting per node and resource (DESIGN §5.3, §5.9): free =
//! allocatable − slots of every live pod bound or pinned there, whatever its
//! class, each pod counted once.

use std::collections::HashMap;

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
    by_name: HashMap<&'a str, u32>,
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
