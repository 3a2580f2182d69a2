//! Queued leases the kept engine sets apart ("parked"), so that a pass
//! after one event does not build a ticket for each of thousands of
//! waiting leases.
//!
//! A parked lease is one a pass could only leave in its StrictFIFO queue or
//! admit: its pod is live and gated, asks for its class alone (no
//! nodeSelector or affinity of its own), and its persisted status is a
//! plain `Queued` one with a stored sequence. Such a lease's ticket depends
//! on its own class, role, slots and sequence only, so the kept engine
//! keeps it in its class's FIFO order instead of among the entries a pass
//! visits. The queue step walks that order: where the outcome is fixed
//! whatever the lease (the queue is blocked ahead of it, helpers are held
//! back, or it cannot fit anywhere) it records the outcome without a
//! ticket; anywhere else it builds the ticket and decides it as a visited
//! one. Lease statuses are compared only as far as the progress limit
//! reaches. Whatever a pass wants of a parked lease is what it would want
//! had it visited it: `the_kept_engine_decides_as_a_full_pass` checks it.

use std::collections::BTreeMap;

use gpupool_api::{LeasePhase, Ordering, Role};

use super::facts::Resolved;
use super::fit;
use super::message::Settled;
use super::model::{ObjectKey, RoleLabel};
use super::pass::{Pass, is_live};
use super::set_apart::count_down;
use super::state::Entry;

/// Where a parked lease waits: its class, its role and its sequence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct FifoPlace {
    pub class: String,
    pub role: Role,
    pub sequence: u64,
}

/// What the queue step reads of a parked lease without fetching it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Summary {
    /// The slots its pod asks of its class's resource.
    pub slots: u32,
    /// The persisted `status.position`.
    pub position: Option<u32>,
    /// Its pod carries tolerations: whether it may use the class's guarded
    /// nodes is decided per pass, against the nodes of that pass.
    pub tolerates: bool,
}

/// A parked lease: what the queue step reads of it without fetching it,
/// and the entry itself.
#[derive(Debug, Clone)]
pub(crate) struct Lease {
    pub summary: Summary,
    pub entry: Entry,
    /// A message a pass found the persisted status to render already:
    /// while a pass wants the same, it is not rendered again. Forgotten
    /// whenever the lease or its pod changes (the lease is parked anew).
    pub settled: Option<Settled>,
}

/// A FIFO of parked leases, by (sequence, key): the queue step's order,
/// with what the queue step reads of all of them at once.
#[derive(Debug, Clone)]
pub(crate) struct Fifo {
    pub leases: BTreeMap<(u64, ObjectKey), Lease>,
    /// How many leases ask for each number of slots.
    pub slots: BTreeMap<u32, usize>,
    /// How many leases' pods carry tolerations.
    pub tolerating: usize,
}

impl Fifo {
    const fn new() -> Self {
        Self {
            leases: BTreeMap::new(),
            slots: BTreeMap::new(),
            tolerating: 0,
        }
    }

    fn insert(&mut self, place: (u64, ObjectKey), lease: Lease) {
        *self.slots.entry(lease.summary.slots).or_default() += 1;
        self.tolerating += usize::from(lease.summary.tolerates);
        self.leases.insert(place, lease);
    }

    fn remove(&mut self, place: &(u64, ObjectKey)) -> Option<Lease> {
        let lease = self.leases.remove(place)?;
        count_down(&mut self.slots, lease.summary.slots);
        self.tolerating -= usize::from(lease.summary.tolerates);
        Some(lease)
    }

    /// How many leases there are.
    pub fn len(&self) -> usize {
        self.leases.len()
    }
}

/// One class's parked leases.
#[derive(Debug, Clone)]
pub(crate) struct ClassFifos {
    pub primaries: Fifo,
    pub helpers: Fifo,
}

impl ClassFifos {
    const fn new() -> Self {
        Self {
            primaries: Fifo::new(),
            helpers: Fifo::new(),
        }
    }

    fn fifo_mut(&mut self, role: Role) -> &mut Fifo {
        match role {
            Role::Primary => &mut self.primaries,
            Role::Helper => &mut self.helpers,
        }
    }

    fn fifo(&self, role: Role) -> &Fifo {
        match role {
            Role::Primary => &self.primaries,
            Role::Helper => &self.helpers,
        }
    }
}

/// Every parked lease with its pod, in FIFO order per class, and where
/// each is by key.
#[derive(Debug, Clone)]
pub(crate) struct Parked {
    places: BTreeMap<ObjectKey, FifoPlace>,
    /// By class name.
    pub fifos: BTreeMap<String, ClassFifos>,
}

impl Parked {
    /// Nothing parked.
    pub const fn new() -> Self {
        Self {
            places: BTreeMap::new(),
            fifos: BTreeMap::new(),
        }
    }

    /// Parks `entry` at `place`.
    pub fn insert(&mut self, key: ObjectKey, place: FifoPlace, entry: Entry) {
        let summary = summarize(&entry);
        self.fifos
            .entry(place.class.clone())
            .or_insert_with(ClassFifos::new)
            .fifo_mut(place.role)
            .insert(
                (place.sequence, key.clone()),
                Lease {
                    summary,
                    entry,
                    settled: None,
                },
            );
        self.places.insert(key, place);
    }

    /// Takes the parked entry `key` out.
    pub fn remove(&mut self, key: &ObjectKey) -> Option<Entry> {
        let place = self.places.remove(key)?;
        let tail = self.fifos.get_mut(&place.class)?;
        let lease = tail
            .fifo_mut(place.role)
            .remove(&(place.sequence, key.clone()));
        if tail.primaries.len() == 0 && tail.helpers.len() == 0 {
            self.fifos.remove(&place.class);
        }
        lease.map(|l| l.entry)
    }

    /// Takes every parked entry out.
    pub fn take_all(&mut self) -> impl Iterator<Item = (ObjectKey, Entry)> {
        self.places.clear();
        std::mem::take(&mut self.fifos)
            .into_values()
            .flat_map(|tail| tail.primaries.leases.into_iter().chain(tail.helpers.leases))
            .map(|((_, key), lease)| (key, lease.entry))
    }

    /// The parked entry `key`.
    pub fn get(&self, key: &ObjectKey) -> Option<&Entry> {
        let place = self.places.get(key)?;
        let lease = self
            .fifos
            .get(&place.class)?
            .fifo(place.role)
            .leases
            .get(&(place.sequence, key.clone()))?;
        Some(&lease.entry)
    }

    /// Every parked entry, in key order.
    pub fn iter(&self) -> impl Iterator<Item = (&ObjectKey, &Entry)> {
        self.places
            .keys()
            .filter_map(|key| Some((key, self.get(key)?)))
    }

    /// Remembers that the persisted status of the parked lease `key`
    /// renders `settled`.
    pub fn remember(&mut self, key: &ObjectKey, settled: Settled) {
        let Some(place) = self.places.get(key) else {
            return;
        };
        let lease = self.fifos.get_mut(&place.class).and_then(|t| {
            t.fifo_mut(place.role)
                .leases
                .get_mut(&(place.sequence, key.clone()))
        });
        if let Some(lease) = lease {
            lease.settled = Some(settled);
        }
    }

    /// How many leases are parked.
    pub fn len(&self) -> usize {
        self.places.len()
    }
}

fn summarize(entry: &Entry) -> Summary {
    Summary {
        slots: entry.facts.class_slots,
        position: entry
            .lease
            .as_ref()
            .and_then(|l| l.status())
            .and_then(|s| s.position),
        tolerates: entry
            .pod
            .as_ref()
            .is_some_and(|p| !p.tolerations.is_empty()),
    }
}

/// Where `entry` waits when it may be parked (see the module comment);
/// `pass` knows the classes and `entry`'s facts are current.
pub(crate) fn place_of(pass: &Pass<'_>, entry: &Entry) -> Option<FifoPlace> {
    let (pod, lease) = (entry.pod.as_deref()?, entry.lease.as_deref()?);
    let facts = &entry.facts;
    let Some(Resolved::Class(c)) = facts.resolved else {
        return None;
    };
    let class = pass.classes.list.get(c as usize)?;
    let RoleLabel::Valid(role) = pod.role else {
        return None;
    };
    let status = lease.status()?;
    let sequence = status.sequence?;
    let plain_queued = status.phase == LeasePhase::Queued
        && status.node.is_none()
        && status.preempted_by.is_none()
        && status.queued_at.is_some()
        && status.admitted_at.is_none()
        && status.bound_at.is_none()
        && status.released_at.is_none();
    let parkable = plain_queued
        && class.problem.is_none()
        && class.info.spec.admission.ordering == Ordering::StrictFIFO
        && is_live(pod)
        && pod.gated
        && pod.other_gate.is_none()
        && !pod.terminating
        && !lease.missing
        && !facts.replaced
        && facts.spec_current == Some(true)
        && !fit::narrows_nodes(pod);
    parkable.then(|| FifoPlace {
        class: class.info.name.clone(),
        role,
        sequence,
    })
}
