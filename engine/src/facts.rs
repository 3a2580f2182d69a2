//! What a pass derives from one pod and its lease that depends on nothing
//! but the two and the classes: the pod's class, the slots it asks for,
//! whether the lease is its own and whether the lease's spec says what the
//! pod does.
//!
//! A pass over a snapshot derives them entry by entry. The kept
//! [`crate::Engine`] derives them when an entry changes and, for every
//! entry, when the classes change in a way resolution reads, so a pass
//! over 16,000 unchanged entries neither resolves classes nor reads the
//! strings (UIDs, names, resource names) these comparisons would touch:
//! the pass is bound by fetching what it reads from memory.

use gpupool_api::LeasePhase;

use super::classes::PodClass;
use super::model::{LeaseInfo, PodInfo};
use super::pass::{Pass, Ticket, is_live};

/// A pod's class as [`PodClass`] says it, by index into the pass's
/// classes, so that it can be kept between passes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Resolved {
    Unmanaged,
    Class(u32),
    /// A class the pod names that does not exist (its name is the pod's
    /// class label).
    Unknown,
}

/// The facts of one entry (see the module comment).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Facts {
    /// The pod's class; `None` without a pod.
    pub resolved: Option<Resolved>,
    /// The first managed resource the pod requests, with its slots.
    pub requested: Option<(u32, u32)>,
    /// The slots the pod requests of its class's resource.
    pub class_slots: u32,
    /// The class the lease's spec names, when it exists.
    pub lease_class: Option<u32>,
    /// Pod and lease are both there and the lease was made for an earlier
    /// pod of the same name.
    pub replaced: bool,
    /// Whether the lease's spec says what its pod does; `None` until a
    /// ticket is built (a pass over a snapshot compares on the way).
    pub spec_current: Option<bool>,
    /// The lease holds slots for a live pod that runs without the gate,
    /// and its persisted status is exactly what a pass wants for it. What
    /// a pass wants for such a lease depends on the entry alone until a
    /// step of the pass changes its phase (only preemption does, and the
    /// pass checks the phase), so its status is not compared again. Never
    /// set by a pass over a snapshot.
    pub quiet: bool,
}

impl<'a> Pass<'a> {
    /// The facts a pass reads of `pod` and `lease`, except `spec_current`.
    pub fn derive_facts(&self, pod: Option<&PodInfo>, lease: Option<&LeaseInfo>) -> Facts {
        let resolved = pod.map(|p| match self.resolve(p) {
            PodClass::Unmanaged => Resolved::Unmanaged,
            PodClass::Class(c) => Resolved::Class(c as u32),
            PodClass::Unknown(_) => Resolved::Unknown,
        });
        let class_slots = match (pod, resolved) {
            (Some(p), Some(Resolved::Class(c))) => p
                .requests
                .get(&self.classes.list[c as usize].info.spec.resource_name)
                .copied()
                .unwrap_or(0),
            _ => 0,
        };
        Facts {
            resolved,
            requested: pod
                .and_then(|p| self.requested_resource(p))
                .map(|(res, slots)| (res as u32, slots)),
            class_slots,
            lease_class: lease
                .and_then(|l| self.classes.find(&l.spec().class_name))
                .map(|c| c as u32),
            replaced: matches!((pod, lease), (Some(p), Some(l)) if p.uid != l.spec().pod_uid),
            spec_current: None,
            quiet: false,
        }
    }

    /// All the facts of `pod` and `lease`, `spec_current` included, as
    /// the kept engine stores them.
    pub fn derive_kept_facts(
        &self,
        pod: Option<&'a PodInfo>,
        lease: Option<&'a LeaseInfo>,
    ) -> Facts {
        let mut facts = self.derive_facts(pod, lease);
        if let (Some(p), Some(l)) = (pod, lease)
            && !facts.replaced
        {
            let t = self.existing(l, Some(p), Some(self.class_of(p, &facts)), &facts, false);
            facts.spec_current = Some(spec_is_current(l, p, &t));
            // A pod the scheduler cannot place is not quiet: time alone
            // changes what a pass wants of it (DESIGN §5.3).
            facts.quiet = is_live(p)
                && !p.gated
                && crate::unplaced::unplaced(p).is_none()
                && !l.missing
                && matches!(t.phase, LeasePhase::Admitted | LeasePhase::Bound)
                && self.wants_no_write(&t);
        }
        facts
    }

    /// The pod's class as the pass's own type, from its facts.
    pub fn class_of(&self, pod: &'a PodInfo, facts: &Facts) -> PodClass<'a> {
        match facts.resolved {
            Some(Resolved::Class(c)) => PodClass::Class(c as usize),
            Some(Resolved::Unknown) => PodClass::Unknown(pod.class_label.as_deref().unwrap_or("")),
            Some(Resolved::Unmanaged) | None => PodClass::Unmanaged,
        }
    }
}

/// True when the lease's spec says what its live pod does: the class, the
/// pod's name and UID, the role and the slots the ticket derived from it.
/// Compared field by field: building the wanted spec for each of thousands
/// of unchanged leases would allocate three strings each.
pub(crate) fn spec_is_current(lease: &LeaseInfo, pod: &PodInfo, t: &Ticket<'_>) -> bool {
    let spec = lease.spec();
    spec.class_name == t.class_name
        && *spec.pod_name == *t.key.name
        && spec.pod_uid == pod.uid
        && spec.role == t.role
        && spec.slots == t.slots
}
