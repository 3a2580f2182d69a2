//! Primaries that hold slots quietly, which the kept engine sets apart by
//! node so that a pass does not build a ticket for each of thousands of
//! running pods.
//!
//! A quiet primary (see `Facts::quiet`) runs without the gate on its node
//! and its persisted status is the one a pass wants: no step of a pass
//! changes a primary that holds slots (only helpers are preempted), so all
//! a pass reads of it is the capacity its pod takes on its node, how many
//! primaries each class has admitted, and, for the few nodes a class
//! status pictures GPU by GPU, who holds which slot. The first two are
//! kept summed; for the third the pass builds the tickets of the quiet
//! primaries on those nodes only. Helpers are never set apart: preemption
//! reads every one of them.

use std::collections::BTreeMap;

use gpupool_api::Role;

use super::facts::Resolved;
use super::model::{ObjectKey, RoleLabel};
use super::pass::Pass;
use super::set_apart::count_down;
use super::state::Entry;

/// Where a quiet primary holds slots.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HolderPlace {
    pub node: String,
    pub class: String,
    pub sequence: u64,
}

/// Every quiet primary, by node, with what a pass reads of all of them.
#[derive(Debug, Clone)]
pub(crate) struct QuietPrimaries {
    places: BTreeMap<ObjectKey, HolderPlace>,
    /// By node name, then (sequence, key).
    pub by_node: BTreeMap<String, BTreeMap<(u64, ObjectKey), Entry>>,
    /// Per node name, what their pods request, summed per resource name.
    pub usage: BTreeMap<String, BTreeMap<String, u64>>,
    /// Per class name, how many there are.
    pub per_class: BTreeMap<String, usize>,
    /// Per class name, their sequences, each with how many carry it: new
    /// sequences of the class's primaries go above the highest.
    sequences: BTreeMap<String, BTreeMap<u64, usize>>,
}

impl QuietPrimaries {
    /// None set apart.
    pub const fn new() -> Self {
        Self {
            places: BTreeMap::new(),
            by_node: BTreeMap::new(),
            usage: BTreeMap::new(),
            per_class: BTreeMap::new(),
            sequences: BTreeMap::new(),
        }
    }

    /// Sets `entry` apart at `place`.
    pub fn insert(&mut self, key: ObjectKey, place: HolderPlace, entry: Entry) {
        if let Some(pod) = entry.pod.as_deref() {
            let usage = self.usage.entry(place.node.clone()).or_default();
            for (resource, &slots) in pod.requests.iter() {
                *usage.entry(resource.clone()).or_default() += u64::from(slots);
            }
        }
        *self.per_class.entry(place.class.clone()).or_default() += 1;
        *self
            .sequences
            .entry(place.class.clone())
            .or_default()
            .entry(place.sequence)
            .or_default() += 1;
        self.by_node
            .entry(place.node.clone())
            .or_default()
            .insert((place.sequence, key.clone()), entry);
        self.places.insert(key, place);
    }

    /// Takes the entry `key` out.
    pub fn remove(&mut self, key: &ObjectKey) -> Option<Entry> {
        let place = self.places.remove(key)?;
        let on_node = self.by_node.get_mut(&place.node)?;
        let entry = on_node.remove(&(place.sequence, key.clone()))?;
        if on_node.is_empty() {
            self.by_node.remove(&place.node);
        }
        if let (Some(pod), Some(usage)) = (entry.pod.as_deref(), self.usage.get_mut(&place.node)) {
            for (resource, &slots) in pod.requests.iter() {
                if let Some(sum) = usage.get_mut(resource) {
                    *sum -= u64::from(slots);
                    if *sum == 0 {
                        usage.remove(resource);
                    }
                }
            }
            if usage.is_empty() {
                self.usage.remove(&place.node);
            }
        }
        if let Some(sequences) = self.sequences.get_mut(&place.class) {
            count_down(sequences, place.sequence);
            if sequences.is_empty() {
                self.sequences.remove(&place.class);
            }
        }
        count_down(&mut self.per_class, place.class);
        Some(entry)
    }

    /// Takes every entry out.
    pub fn take_all(&mut self) -> impl Iterator<Item = (ObjectKey, Entry)> {
        self.places.clear();
        self.usage.clear();
        self.per_class.clear();
        self.sequences.clear();
        std::mem::take(&mut self.by_node)
            .into_values()
            .flatten()
            .map(|((_, key), entry)| (key, entry))
    }

    /// The entry `key`.
    pub fn get(&self, key: &ObjectKey) -> Option<&Entry> {
        let place = self.places.get(key)?;
        self.by_node
            .get(&place.node)?
            .get(&(place.sequence, key.clone()))
    }

    /// Every entry, in key order.
    pub fn iter(&self) -> impl Iterator<Item = (&ObjectKey, &Entry)> {
        self.places
            .keys()
            .filter_map(|key| Some((key, self.get(key)?)))
    }

    /// Per class name, the highest sequence of its quiet primaries.
    pub fn highest_sequences(&self) -> impl Iterator<Item = (&str, u64)> {
        self.sequences
            .iter()
            .filter_map(|(class, s)| Some((class.as_str(), *s.keys().next_back()?)))
    }

    /// How many there are.
    pub fn len(&self) -> usize {
        self.places.len()
    }
}

/// Where `entry` holds slots when it is a quiet primary that may be set
/// apart (see the module comment); `pass` knows the classes and `entry`'s
/// facts are current.
pub(crate) fn place_of(pass: &Pass<'_>, entry: &Entry) -> Option<HolderPlace> {
    let (pod, lease) = (entry.pod.as_deref()?, entry.lease.as_deref()?);
    let facts = &entry.facts;
    let Some(Resolved::Class(c)) = facts.resolved else {
        return None;
    };
    let status = lease.status()?;
    let quiet_primary = facts.quiet
        && !facts.replaced
        && facts.spec_current == Some(true)
        && pod.role == RoleLabel::Valid(Role::Primary)
        && status.preempted_by.is_none();
    if !quiet_primary {
        return None;
    }
    Some(HolderPlace {
        node: pod.node_name.clone()?,
        class: pass.classes.list.get(c as usize)?.info.name.clone(),
        sequence: status.sequence?,
    })
}
