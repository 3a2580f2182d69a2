//! The operator's one index: the watch caches of Pods, Nodes,
//! GpuLeaseClasses and GpuLeases that every replica keeps, plus the nodes
//! in the engine's form, kept by the node watch for the webhook. The
//! webhook (on every replica) and the decision loop (on the leader) both
//! read it; only the watches write it.
//!
//! Pods and leases are read, from watches and from the answers to the
//! operator's own writes, with only the metadata they keep ([`watched`]),
//! so the parser skips managed fields and a tenant's other labels and
//! annotations. The pod cache holds only pods that ask for a
//! domain-qualified extended resource, and of each only what admission
//! reads ([`cached_pod`]).

pub mod cached_pod;
pub mod caches;
pub mod changes;
pub mod identity;
pub mod key_hash;
pub mod store;
pub mod translate;
pub mod watched;

pub use caches::Caches;
