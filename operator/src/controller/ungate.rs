//! The order in which a pass's admitted pods are ungated.
//!
//! An admission is two writes: the lease's Admitted status, then the pod's
//! patch that removes its gate. Pods of one role must start in queue order
//! even when the API server refuses a lease write, so a pod is ungated only
//! once its own lease and the lease of every earlier admission of its role
//! in the pass are written. [`UngateOrder`] keeps that rule as the answers
//! come in, so each pod's patch can start as soon as it is allowed rather
//! than after every lease write of the pass: the writes of one admission
//! overlap those of the next.
//!
//! Pure: no I/O, no clock; the applier feeds it the answers.

use std::collections::{BTreeMap, HashMap};

use gpupool_api::Role;

use crate::engine::ObjectKey;

/// Where an admission's lease write stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum LeaseWrite {
    /// Its status is being written.
    Writing,
    /// The lease says Admitted: it was written, or needed no write.
    Written,
    /// It could not be written in this pass (refused, failed, or the lease
    /// has a write in flight); the next pass decides it again.
    Failed,
}

/// One admission of the pass, as the ungate order sees it.
#[derive(Debug, Clone)]
pub(super) struct Admitted {
    /// The pod and its lease.
    pub key: ObjectKey,
    /// Pods start in queue order within a role.
    pub role: Role,
    /// Its lease's sequence.
    pub sequence: Option<u64>,
    /// Where its lease write stands when the pass starts writing.
    pub lease: LeaseWrite,
}

impl Admitted {
    /// Its place in the queue: by sequence, an unknown one last, then by key.
    pub fn place(&self) -> (u64, &ObjectKey) {
        (self.sequence.unwrap_or(u64::MAX), &self.key)
    }
}

/// One role's admissions in queue order, and how far its pods may go.
#[derive(Debug, Default)]
struct Line {
    /// `(key, state)` by sequence, then key.
    admissions: Vec<(ObjectKey, LeaseWrite)>,
    /// Entries before this one have been handed out to ungate.
    next: usize,
}

impl Line {
    /// Hands out the written prefix from `next` on; stops at the first
    /// entry still being written or failed (a failed one stops it for good).
    fn advance(&mut self, out: &mut Vec<ObjectKey>) {
        while let Some((key, LeaseWrite::Written)) = self.admissions.get(self.next) {
            out.push(key.clone());
            self.next += 1;
        }
    }
}

/// The admissions of one pass and which of their pods may be ungated.
///
/// Guarantees: a key is handed out at most once; it is handed out only when
/// its lease is written and every admission of its role placed before it
/// (see [`Admitted::place`]) was handed out before it; after a lease write
/// fails, no admission of its role placed after it is ever handed out.
#[derive(Debug, Default)]
pub(super) struct UngateOrder {
    lines: BTreeMap<Role, Line>,
    /// key → (role, index in its line).
    at: HashMap<ObjectKey, (Role, usize)>,
}

impl UngateOrder {
    /// Orders `admissions`. A key listed twice keeps its first entry.
    pub fn new(admissions: impl IntoIterator<Item = Admitted>) -> Self {
        let mut by_role: BTreeMap<Role, Vec<Admitted>> = BTreeMap::new();
        let mut seen = std::collections::HashSet::new();
        for a in admissions {
            if seen.insert(a.key.clone()) {
                by_role.entry(a.role).or_default().push(a);
            }
        }
        let mut order = Self::default();
        for (role, mut entries) in by_role {
            entries.sort_by(|a, b| a.place().cmp(&b.place()));
            let line = order.lines.entry(role).or_default();
            for (i, a) in entries.into_iter().enumerate() {
                order.at.insert(a.key.clone(), (role, i));
                line.admissions.push((a.key, a.lease));
            }
        }
        order
    }

    /// The pods that may be ungated before any lease write answers: each
    /// role's prefix whose leases need no write.
    pub fn ready(&mut self) -> Vec<ObjectKey> {
        let mut out = Vec::new();
        for line in self.lines.values_mut() {
            line.advance(&mut out);
        }
        out
    }

    /// Records the answer to `key`'s lease write (`Written` or `Failed`);
    /// returns the pods that may now be ungated, in queue order. An answer
    /// for a key that is not being written changes nothing.
    pub fn answer(&mut self, key: &ObjectKey, state: LeaseWrite) -> Vec<ObjectKey> {
        let mut out = Vec::new();
        let Some(&(role, i)) = self.at.get(key) else {
            return out;
        };
        let Some(line) = self.lines.get_mut(&role) else {
            return out;
        };
        if let Some(entry) = line.admissions.get_mut(i)
            && entry.1 == LeaseWrite::Writing
        {
            entry.1 = state;
        }
        line.advance(&mut out);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::LeaseWrite::{Failed, Writing, Written};
    use super::*;

    fn key(name: &str) -> ObjectKey {
        ObjectKey::new("team", name)
    }

    fn adm(name: &str, role: Role, sequence: Option<u64>, lease: LeaseWrite) -> Admitted {
        Admitted {
            key: key(name),
            role,
            sequence,
            lease,
        }
    }

    fn names(keys: Vec<ObjectKey>) -> Vec<String> {
        keys.into_iter().map(|k| k.name.to_string()).collect()
    }

    #[test]
    fn a_pod_waits_for_every_earlier_lease_of_its_role() {
        let mut order = UngateOrder::new([
            adm("c", Role::Primary, Some(3), Writing),
            adm("a", Role::Primary, Some(1), Writing),
            adm("b", Role::Primary, Some(2), Writing),
        ]);
        assert!(order.ready().is_empty());
        assert!(
            order.answer(&key("b"), Written).is_empty(),
            "a is not written yet"
        );
        assert!(order.answer(&key("c"), Written).is_empty());
        assert_eq!(names(order.answer(&key("a"), Written)), ["a", "b", "c"]);
        assert!(
            order.answer(&key("a"), Written).is_empty(),
            "handed out once"
        );
    }

    #[test]
    fn a_failed_lease_holds_back_the_rest_of_its_role_only() {
        let mut order = UngateOrder::new([
            adm("p1", Role::Primary, Some(1), Writing),
            adm("p2", Role::Primary, Some(2), Writing),
            adm("p3", Role::Primary, Some(4), Writing),
            adm("h1", Role::Helper, Some(3), Writing),
        ]);
        assert_eq!(names(order.answer(&key("p1"), Written)), ["p1"]);
        assert!(order.answer(&key("p2"), Failed).is_empty());
        assert!(
            order.answer(&key("p3"), Written).is_empty(),
            "behind a failure"
        );
        assert!(
            order.answer(&key("p2"), Written).is_empty(),
            "a failure is final for the pass"
        );
        assert_eq!(names(order.answer(&key("h1"), Written)), ["h1"]);
    }

    #[test]
    fn leases_that_need_no_write_are_ready_at_once_up_to_the_first_that_does() {
        let mut order = UngateOrder::new([
            adm("a", Role::Primary, Some(1), Written),
            adm("b", Role::Primary, Some(2), Writing),
            adm("c", Role::Primary, Some(3), Written),
            adm("busy", Role::Helper, Some(1), Failed),
            adm("h", Role::Helper, Some(2), Written),
        ]);
        assert_eq!(names(order.ready()), ["a"]);
        assert!(order.ready().is_empty(), "handed out once");
        assert_eq!(names(order.answer(&key("b"), Written)), ["b", "c"]);
        assert!(
            order.answer(&key("h"), Written).is_empty(),
            "a helper behind one with a write in flight waits for the next pass"
        );
    }

    #[test]
    fn an_unknown_sequence_comes_last_and_unknown_keys_change_nothing() {
        let mut order = UngateOrder::new([
            adm("none", Role::Primary, None, Written),
            adm("a", Role::Primary, Some(9), Writing),
            adm("none", Role::Primary, Some(1), Written),
        ]);
        assert!(
            order.ready().is_empty(),
            "the unknown sequence sorts after 9"
        );
        assert!(order.answer(&key("stranger"), Written).is_empty());
        assert_eq!(names(order.answer(&key("a"), Written)), ["a", "none"]);
    }
}
