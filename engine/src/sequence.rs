//! FIFO tickets (DESIGN §5.2): a lease's sequence comes from its pod's
//! enqueued-at stamp, so a pod's place follows its stamp whenever its lease
//! is made, and a lease made again after it was lost (deleted while the
//! operator was down, say) goes back ahead of every pod stamped after it.
//!
//! The rule, for a lease without a persisted sequence: start from the
//! stamp in microseconds since the Unix epoch (creationTimestamp when the
//! pod carries no stamp); move above the highest sequence of any lease of
//! the same class and role that holds slots, so nothing is admitted out of
//! sequence order; then take the first number no lease carries, Released
//! ones included. New leases of one pass are numbered in (stamp,
//! creationTimestamp, namespace/name) order. A sequence, once persisted,
//! never changes.

use std::collections::BTreeMap;

use gpupool_api::{LeasePhase, Role};
use jiff::Timestamp;

use super::pass::{Pass, View};
use super::set_apart::SetApart;

/// The first number of a pod's sequence: its stamp in microseconds since
/// the Unix epoch, at least 1.
pub(crate) fn stamp_sequence(stamp: Timestamp) -> u64 {
    u64::try_from(stamp.as_microsecond()).unwrap_or(0).max(1)
}

impl<'a> Pass<'a> {
    /// Gives every ticket without a sequence one, by the rule above.
    pub fn assign_sequences(&mut self) {
        let mut pending: Vec<usize> = (0..self.tickets.len())
            .filter(|&i| {
                let t = &self.tickets[i];
                t.sequence.is_none() && t.phase != LeasePhase::Released && t.pod.is_some()
            })
            .collect();
        if pending.is_empty() {
            return;
        }
        pending.sort_by(|&a, &b| {
            let (a, b) = (&self.tickets[a], &self.tickets[b]);
            let stamp = |t: &super::pass::Ticket<'_>| {
                t.pod
                    .map(|p| (p.enqueued_at.unwrap_or(p.created_at), p.created_at))
            };
            stamp(a).cmp(&stamp(b)).then_with(|| a.key.cmp(b.key))
        });
        let floors = self.admitted_floors();
        let first_of = |t: &super::pass::Ticket<'a>| {
            let pod = t.pod?;
            let mut sequence = stamp_sequence(pod.enqueued_at.unwrap_or(pod.created_at));
            if let Some(&floor) = floors.get(&(t.class_name, t.role)) {
                sequence = sequence.max(floor.saturating_add(1));
            }
            Some(sequence)
        };
        let firsts: Vec<Option<u64>> = pending
            .iter()
            .map(|&i| first_of(&self.tickets[i]))
            .collect();
        let lowest = firsts.iter().flatten().copied().min().unwrap_or(u64::MAX);
        let mut taken = Taken::at_or_above(&self.view, lowest);
        for (i, first) in pending.into_iter().zip(firsts) {
            if let Some(first) = first {
                self.tickets[i].sequence = Some(taken.first_free_from(first));
            }
        }
    }

    /// Per class and role, the highest sequence of a lease that holds
    /// slots: visited tickets, and the kept engine's quiet primaries.
    fn admitted_floors(&self) -> BTreeMap<(&'a str, Role), u64> {
        let mut floors: BTreeMap<(&'a str, Role), u64> = BTreeMap::new();
        let mut raise = |key: (&'a str, Role), sequence: u64| {
            let floor = floors.entry(key).or_default();
            *floor = (*floor).max(sequence);
        };
        for t in &self.tickets {
            if let (true, Some(sequence)) = (t.phase.holds_slots(), t.sequence) {
                raise((t.class_name, t.role), sequence);
            }
        }
        for (class, highest) in self.view.set_apart.quiet_highest_sequences() {
            raise((class, Role::Primary), highest);
        }
        floors
    }
}

/// Every sequence a lease carries from some number on: those the pass
/// visits and those the kept engine set apart.
struct Taken<'p> {
    /// The visited leases' sequences from `lowest` on, and those handed
    /// out since, in order: new sequences come from recent stamps, so few
    /// leases carry one as high.
    visited: Vec<u64>,
    set_apart: &'p SetApart,
}

impl<'p> Taken<'p> {
    /// The sequences `view` shows from `lowest` on.
    fn at_or_above(view: &View<'p>, lowest: u64) -> Self {
        let mut visited: Vec<u64> = view
            .entries
            .iter()
            .filter_map(|(_, l, _)| l.and_then(|l| l.status()).and_then(|s| s.sequence))
            .filter(|&s| s >= lowest)
            .collect();
        visited.sort_unstable();
        Self {
            visited,
            set_apart: view.set_apart,
        }
    }

    fn contains(&self, sequence: u64) -> bool {
        self.visited.binary_search(&sequence).is_ok() || self.set_apart.carries_sequence(sequence)
    }

    /// The first number from `sequence` on that no lease carries, now
    /// taken.
    fn first_free_from(&mut self, mut sequence: u64) -> u64 {
        while self.contains(sequence) {
            sequence = sequence.saturating_add(1);
        }
        if let Err(at) = self.visited.binary_search(&sequence) {
            self.visited.insert(at, sequence);
        }
        sequence
    }
}
