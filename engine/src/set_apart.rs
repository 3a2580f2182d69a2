//! What the kept engine sets apart from the entries a pass visits one by
//! one, behind one interface: [`SetApart`].
//!
//! Three kinds of entry are set apart, each by the rule of its own module:
//!
//! - inert entries ([`crate::pass::is_inert`]): no pass can act on them
//!   until they change; a pass reads their sequences, and the class of one
//!   a preempted helper names;
//! - parked leases ([`crate::parked`]): plainly queued leases of StrictFIFO
//!   classes, which the queue step walks in their FIFO order;
//! - quiet primaries ([`crate::quiet_primaries`]): running primaries whose
//!   status is current, which a pass reads as capacity summed per node.
//!
//! The engine asks [`SetApart::keep_inert`] and [`SetApart::keep_live`]
//! where an entry goes and takes entries back when they change; a pass
//! reads them only through the read methods at the end of the impl. A pass
//! over a snapshot reads [`NOTHING_SET_APART`] through those very methods
//! (no FIFO, no quiet usage, no sequence), so a pass reads the same with
//! or without the shortcuts, and `the_kept_engine_decides_as_a_full_pass`
//! checks that both decide alike.

use std::collections::BTreeMap;

use super::message::Settled;
use super::model::ObjectKey;
use super::parked::{self, ClassFifos, Parked};
use super::pass::Pass;
use super::quiet_primaries::{self, QuietPrimaries};
use super::state::Entry;

/// Every entry the kept engine sets apart, with the sequences they carry.
///
/// Guarantee: an entry is in at most one of its three parts, and
/// `sequences` counts exactly the sequences of the leases in all three.
#[derive(Debug, Clone)]
pub(crate) struct SetApart {
    inert: BTreeMap<ObjectKey, Entry>,
    parked: Parked,
    quiet: QuietPrimaries,
    /// Each sequence the leases set apart carry, with how many carry it:
    /// no new lease takes a number any lease carries.
    sequences: BTreeMap<u64, usize>,
}

impl Default for SetApart {
    fn default() -> Self {
        Self::new()
    }
}

/// What a pass over a snapshot reads: nothing is set apart.
pub(crate) static NOTHING_SET_APART: SetApart = SetApart::new();

impl SetApart {
    /// Nothing set apart.
    pub const fn new() -> Self {
        Self {
            inert: BTreeMap::new(),
            parked: Parked::new(),
            quiet: QuietPrimaries::new(),
            sequences: BTreeMap::new(),
        }
    }

    /// Sets the inert `entry` apart.
    pub fn keep_inert(&mut self, key: ObjectKey, entry: Entry) {
        self.count_sequence(&entry);
        self.inert.insert(key, entry);
    }

    /// Parks `entry` or sets it apart as a quiet primary, when its module's
    /// rule says it may be; gives it back when a pass must visit it.
    /// `pass` knows the classes and `entry`'s facts are current.
    pub fn keep_live(
        &mut self,
        pass: &Pass<'_>,
        key: ObjectKey,
        entry: Entry,
    ) -> Option<(ObjectKey, Entry)> {
        if let Some(place) = parked::place_of(pass, &entry) {
            self.count_sequence(&entry);
            self.parked.insert(key, place, entry);
        } else if let Some(place) = quiet_primaries::place_of(pass, &entry) {
            self.count_sequence(&entry);
            self.quiet.insert(key, place, entry);
        } else {
            return Some((key, entry));
        }
        None
    }

    /// Takes the entry `key` out, wherever it is set apart.
    pub fn take(&mut self, key: &ObjectKey) -> Option<Entry> {
        if let Some(entry) = self.take_live(key) {
            return Some(entry);
        }
        let entry = self.inert.remove(key)?;
        self.forget_sequence(&entry);
        Some(entry)
    }

    /// Takes the entry `key` out when it is parked or a quiet primary.
    pub fn take_live(&mut self, key: &ObjectKey) -> Option<Entry> {
        let entry = self.parked.remove(key).or_else(|| self.quiet.remove(key))?;
        self.forget_sequence(&entry);
        Some(entry)
    }

    /// Takes every parked entry and quiet primary out.
    pub fn take_every_live(&mut self) -> Vec<(ObjectKey, Entry)> {
        let live: Vec<(ObjectKey, Entry)> = self
            .parked
            .take_all()
            .chain(self.quiet.take_all())
            .collect();
        for (_, entry) in &live {
            self.forget_sequence(entry);
        }
        live
    }

    /// Remembers that the persisted status of the parked lease `key`
    /// renders `settled` (see [`parked::Lease::settled`]).
    pub fn remember(&mut self, key: &ObjectKey, settled: Settled) {
        self.parked.remember(key, settled);
    }

    /// The entry `key`, wherever it is set apart.
    pub fn get(&self, key: &ObjectKey) -> Option<&Entry> {
        self.parked
            .get(key)
            .or_else(|| self.quiet.get(key))
            .or_else(|| self.inert.get(key))
    }

    /// Every entry set apart, in key order.
    pub fn iter(&self) -> impl Iterator<Item = (&ObjectKey, &Entry)> {
        let live = merge_by_key(self.parked.iter(), self.quiet.iter());
        merge_by_key(live, self.inert.iter())
    }

    /// How many entries are inert.
    pub fn inert_count(&self) -> usize {
        self.inert.len()
    }

    /// How many leases are parked.
    pub fn parked_count(&self) -> usize {
        self.parked.len()
    }

    /// How many quiet primaries are set apart.
    pub fn quiet_primary_count(&self) -> usize {
        self.quiet.len()
    }

    /// How many leases set apart carry a sequence.
    #[cfg(test)]
    pub fn sequence_count(&self) -> usize {
        self.sequences.values().sum()
    }

    fn count_sequence(&mut self, entry: &Entry) {
        if let Some(seq) = entry.sequence() {
            *self.sequences.entry(seq).or_default() += 1;
        }
    }

    fn forget_sequence(&mut self, entry: &Entry) {
        if let Some(seq) = entry.sequence() {
            count_down(&mut self.sequences, seq);
        }
    }

    // What a pass reads.

    /// The parked leases of the class `class`, in FIFO order per role.
    pub fn class_fifos(&self, class: &str) -> Option<&ClassFifos> {
        self.parked.fifos.get(class)
    }

    /// Per node name, what the quiet primaries there request, summed per
    /// resource name.
    pub fn quiet_usage(&self) -> impl Iterator<Item = (&str, &BTreeMap<String, u64>)> {
        self.quiet.usage.iter().map(|(node, u)| (node.as_str(), u))
    }

    /// The quiet primaries on `node`, in sequence order.
    pub fn quiet_on_node(&self, node: &str) -> impl Iterator<Item = &Entry> {
        self.quiet
            .by_node
            .get(node)
            .into_iter()
            .flat_map(|on| on.values())
    }

    /// How many quiet primaries the class `class` has.
    pub fn quiet_primaries_of(&self, class: &str) -> usize {
        self.quiet.per_class.get(class).copied().unwrap_or(0)
    }

    /// Per class name, the highest sequence of its quiet primaries.
    pub fn quiet_highest_sequences(&self) -> impl Iterator<Item = (&str, u64)> {
        self.quiet.highest_sequences()
    }

    /// True when a lease set apart carries `sequence`.
    pub fn carries_sequence(&self, sequence: u64) -> bool {
        self.sequences.contains_key(&sequence)
    }

    /// The inert entry `key`.
    pub fn inert(&self, key: &ObjectKey) -> Option<&Entry> {
        self.inert.get(key)
    }
}

/// Takes one from the count of `key`, forgetting it at zero.
pub(crate) fn count_down<K: Ord>(counts: &mut BTreeMap<K, usize>, key: K) {
    if let std::collections::btree_map::Entry::Occupied(mut n) = counts.entry(key) {
        *n.get_mut() -= 1;
        if *n.get() == 0 {
            n.remove();
        }
    }
}

/// Two iterators over distinct keys, each in key order, as one in key order.
pub(crate) fn merge_by_key<'a, A, B>(a: A, b: B) -> impl Iterator<Item = (&'a ObjectKey, &'a Entry)>
where
    A: Iterator<Item = (&'a ObjectKey, &'a Entry)>,
    B: Iterator<Item = (&'a ObjectKey, &'a Entry)>,
{
    let (mut a, mut b) = (a.peekable(), b.peekable());
    std::iter::from_fn(move || {
        let take_a = match (a.peek(), b.peek()) {
            (Some((x, _)), Some((y, _))) => x < y,
            (x, _) => x.is_some(),
        };
        if take_a { a.next() } else { b.next() }
    })
}
