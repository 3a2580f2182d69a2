//! One decision pass: pods joined with their leases into tickets, each with
//! the lease state the pass wants. The steps that follow (sequence, queue,
//! preempt, status) work on the tickets.

use std::cmp::Ordering;
use std::collections::BTreeMap;

use gpupool_api::{GpuLeaseSpec, GpuLeaseStatus, LeasePhase, Role};
use jiff::Timestamp;

use super::capacity::{self, Nodes};
use super::classes::{Classes, PodClass};
use super::facts::{Facts, spec_is_current};
use super::fit;
use super::message::{Message, Release, Settled};
use super::model::{
    BlockedEvictions, ClassInfo, LeaseInfo, NodeInfo, ObjectKey, Plan, PodInfo, PodPhase,
    RoleLabel, Snapshot, StaleLease,
};
use super::set_apart::{NOTHING_SET_APART, SetApart};

/// Who a preempted helper makes room for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PreemptedBy<'a> {
    /// As the persisted status says.
    Persisted(&'a str),
    /// Chosen in this pass.
    Primary(&'a ObjectKey),
}

impl std::fmt::Display for PreemptedBy<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PreemptedBy::Persisted(key) => f.write_str(key),
            PreemptedBy::Primary(key) => key.fmt(f),
        }
    }
}

/// A pod's lease as this pass sees it: the persisted lease (if any), its
/// pod (if live or finished with the lease's UID) and the state wanted.
#[derive(Debug)]
pub(crate) struct Ticket<'a> {
    pub key: &'a ObjectKey,
    pub pod: Option<&'a PodInfo>,
    /// `None` for a lease this pass creates.
    pub lease: Option<&'a LeaseInfo>,
    pub persisted: Option<&'a GpuLeaseStatus>,
    pub class: Option<usize>,
    pub class_name: &'a str,
    /// Resource index, when the lease's resource is known.
    pub res: Option<usize>,
    pub role: Role,
    pub slots: u32,
    pub bad_role: Option<&'a str>,
    pub sequence: Option<u64>,
    /// The sequence is persisted: only such leases may be admitted.
    pub seq_persisted: bool,
    /// The pod's own placement was already counted as used capacity.
    pub pod_counted: bool,
    pub phase: LeasePhase,
    pub node: Option<&'a str>,
    pub node_idx: Option<u32>,
    pub position: Option<u32>,
    pub preempted_by: Option<PreemptedBy<'a>>,
    pub message: Message<'a>,
    /// A waiting primary or helper the queue step decides on.
    pub candidate: bool,
    /// Left queued by the queue step and able to fit some day (not
    /// impossible): such a primary holds helpers back.
    pub waits: bool,
    /// For a preempted helper: the waiting primary it makes room for.
    pub serves: Option<usize>,
    /// Admitted in an earlier pass but the pod still shows its gate: the
    /// admission patch is driven again.
    pub redrive: bool,
    /// Admitted by this pass's queue step (perhaps again, after an earlier
    /// admission that never reached its pod went back to the queue): its
    /// admission time is this pass's.
    pub admitted_now: bool,
    /// The pod may use other nodes of its class than the plain ones (see
    /// `ClassView::pod_has_own_nodes`): decided once, while the pod is at
    /// hand, rather than re-read from it by every step that places it.
    pub own_nodes: bool,
    /// The lease's spec says what its pod does (see
    /// [`spec_is_current`]); true without a lease or a pod.
    pub spec_current: bool,
    /// See [`Facts::quiet`].
    pub quiet: bool,
}

/// A pod that still runs or may run (it holds its slots until it is gone).
pub(crate) fn is_live(pod: &PodInfo) -> bool {
    !matches!(pod.phase, PodPhase::Succeeded | PodPhase::Failed)
}

/// True when a pass can do nothing with this pod and lease until one of
/// them changes: a lease persisted as Released (not for a preemption, whose
/// freed slots may still be held for a primary) with no pod or its own pod
/// finished, or a finished pod without a lease. [`Pass::visit`] builds no
/// ticket for such a pair, or one that is Released with nothing to write:
/// it counts no capacity, queues nothing and writes nothing. What a pass
/// reads of it, the lease's sequence and (for a helper preempted for it)
/// the class, the kept state answers without visiting it.
pub(crate) fn is_inert(pod: Option<&PodInfo>, lease: Option<&LeaseInfo>) -> bool {
    let finished = pod.is_some_and(|p| !is_live(p));
    let Some(lease) = lease else {
        return finished;
    };
    let Some(status) = lease.status() else {
        return false;
    };
    !lease.missing
        && status.phase == LeasePhase::Released
        && status.preempted_by.is_none()
        && pod.is_none_or(|p| !is_live(p) && p.uid == lease.spec().pod_uid)
}

/// The state of one decision pass.
pub(crate) struct Pass<'a> {
    pub now: Timestamp,
    pub view: View<'a>,
    pub resources: Vec<&'a str>,
    pub nodes: Nodes<'a>,
    pub classes: Classes<'a>,
    /// Tickets of the visited entries in key order (the first `joined`),
    /// then those of parked leases the queue step decided one by one.
    pub tickets: Vec<Ticket<'a>>,
    /// How many tickets [`Pass::join`] built.
    pub joined: usize,
    /// Per class (same order as `classes`): the leases left queued.
    pub queues: Vec<Queued>,
    /// Parked leases the queue step left queued without a ticket.
    pub parked_out: Vec<ParkedOutcome<'a>>,
    /// Parked leases the queue step counted rather than visited.
    pub parked_skipped: Vec<SkippedRun>,
    /// Slots held back on nodes for primaries whose helpers are being
    /// evicted: primary ticket → (node, slots).
    pub reservations: BTreeMap<usize, Vec<(u32, u32)>>,
    pub plan: Plan,
}

/// Leases of one class waiting for the queue step, in FIFO order.
#[derive(Debug, Default)]
pub(crate) struct ClassQueue {
    pub primaries: Vec<usize>,
    pub helpers: Vec<usize>,
}

/// One lease left queued: a ticket, or a parked lease's outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Waiter {
    Ticket(usize),
    /// Index into [`Pass::parked_out`].
    Parked(usize),
    /// Index into [`Pass::parked_skipped`].
    Skipped(usize),
}

/// Parked leases of one FIFO the queue step counted rather than kept one
/// by one: the end of the FIFO passed over (see `Pass::skip_parked`), or
/// those behind the class status's head whose status needs no write and
/// whose message the kept engine remembers. All `Queued`, none of them
/// among the statuses a pass writes.
#[derive(Debug)]
pub(crate) struct SkippedRun {
    pub class: usize,
    pub role: Role,
    pub count: u32,
    /// How many of them could fit some day (the rest are too large).
    pub waiting: u32,
    /// The fewest slots any of those that wait asks for.
    pub fewest_waiting_slots: Option<u32>,
}

/// Leases of one class left waiting after the queue step, by position.
#[derive(Debug, Default)]
pub(crate) struct Queued {
    pub primaries: Vec<Waiter>,
    pub helpers: Vec<Waiter>,
}

/// What the queue step decided for a parked lease it left queued without
/// building its ticket: the phase stays `Queued`, so only the position and
/// the message can differ from the persisted status.
#[derive(Debug)]
pub(crate) struct ParkedOutcome<'a> {
    pub key: &'a ObjectKey,
    /// The slots its pod asks for.
    pub slots: u32,
    pub entry: &'a crate::state::Entry,
    /// Its class, by index.
    pub class: usize,
    pub role: Role,
    pub position: u32,
    pub message: Message<'a>,
    /// Able to fit some day (see [`Ticket::waits`]).
    pub waits: bool,
    /// Its position or message differs from the persisted status.
    pub moved: bool,
    /// The message, when this pass found the persisted status to render
    /// it and the kept engine does not remember that yet.
    pub settled: Option<Settled>,
}

impl<'a> Pass<'a> {
    /// Indexes the view's classes and nodes; [`Pass::join`] builds the tickets.
    pub fn index(view: View<'a>) -> Self {
        let resources = capacity::resource_names(&view.classes);
        let nodes = Nodes::new(&view.nodes, &resources);
        let classes = Classes::new(&view.classes, &resources, &nodes);
        Pass {
            now: view.now,
            tickets: Vec::with_capacity(view.entries.len() + 16),
            joined: 0,
            parked_out: Vec::new(),
            parked_skipped: Vec::new(),
            view,
            resources,
            nodes,
            classes,
            queues: Vec::new(),
            reservations: BTreeMap::new(),
            plan: Plan::default(),
        }
    }

    /// Builds every ticket with its lifecycle phase (released, admitted
    /// outside the queue, bound, preempting, or a queue candidate), counting
    /// used capacity on the way: walks the view's pods and leases, already
    /// paired by key, in key order.
    pub fn join(&mut self) {
        let entries = std::mem::take(&mut self.view.entries);
        for &(pod, lease, kept) in &entries {
            self.visit(pod, lease, kept);
        }
        self.view.entries = entries;
        self.joined = self.tickets.len();
        self.count_quiet_holders();
    }

    /// Takes what the quiet primaries set apart hold on their nodes, as
    /// visiting each would have.
    fn count_quiet_holders(&mut self) {
        for (node, usage) in self.view.set_apart.quiet_usage() {
            let Some(node) = self.nodes.find(node) else {
                continue;
            };
            for (res, name) in self.resources.iter().enumerate() {
                if let Some(&slots) = usage.get(*name) {
                    self.nodes.take_sum(res, node, slots);
                }
            }
        }
    }

    /// Builds the tickets of the quiet primaries set apart on `node`, as
    /// [`Pass::join`] would have (their capacity is already counted).
    pub fn materialize_quiet_holders(&mut self, node: &str) {
        for entry in self.view.set_apart.quiet_on_node(node) {
            let (Some(pod), Some(lease)) = (entry.pod.as_deref(), entry.lease.as_deref()) else {
                continue;
            };
            let facts = &entry.facts;
            let resolved = Some(self.class_of(pod, facts));
            let mut t = self.existing(lease, Some(pod), resolved, facts, true);
            t.spec_current = facts.spec_current.unwrap_or(true);
            t.quiet = facts.quiet;
            self.mark_own_nodes(&mut t);
            self.tickets.push(t);
        }
    }

    /// Builds the ticket of a parked lease, as [`Pass::join`] would have,
    /// and returns its index.
    pub fn materialize(&mut self, entry: &'a crate::state::Entry) -> Option<usize> {
        let before = self.tickets.len();
        self.visit(
            entry.pod.as_deref(),
            entry.lease.as_deref(),
            Some(&entry.facts),
        );
        (self.tickets.len() > before).then_some(before)
    }

    fn visit(
        &mut self,
        pod: Option<&'a PodInfo>,
        lease: Option<&'a LeaseInfo>,
        kept: Option<&Facts>,
    ) {
        let facts = match kept {
            Some(facts) => *facts,
            None => self.derive_facts(pod, lease),
        };
        let resolved = pod.map(|p| self.class_of(p, &facts));
        let managed_pod = pod.filter(|_| !matches!(resolved, Some(PodClass::Unmanaged) | None));
        // A gated pod the operator manages holds nothing until its lease is
        // admitted; everything else holds what it requests where it is bound
        // or pinned.
        let pod_counted = match pod {
            Some(p) if is_live(p) && !(p.gated && managed_pod.is_some()) => self.count_pod(p),
            _ => false,
        };
        match (pod, lease) {
            (Some(_), Some(l)) if facts.replaced => {
                // The pod was replaced: the old lease goes first, the new pod's
                // lease is created in a later pass (never two for one key).
                self.plan.delete_leases.push(StaleLease {
                    key: l.key.clone(),
                    pod_uid: l.spec().pod_uid.clone(),
                });
            }
            (pod, Some(l)) => {
                let mut t = self.existing(l, pod, resolved, &facts, pod_counted);
                t.spec_current = match (facts.spec_current, pod) {
                    (Some(current), _) => current,
                    (None, Some(p)) => spec_is_current(l, p, &t),
                    (None, None) => true,
                };
                t.quiet = facts.quiet;
                self.mark_own_nodes(&mut t);
                self.tickets.push(t);
            }
            // A pod deleted before it was bound is gone at once: it gets no lease.
            (Some(p), None) if is_live(p) && !(p.terminating && p.node_name.is_none()) => {
                if let Some(mut t) = self.fresh(p, resolved, &facts, pod_counted) {
                    self.mark_own_nodes(&mut t);
                    self.tickets.push(t);
                }
            }
            _ => {}
        }
    }

    pub(crate) fn resolve(&self, pod: &'a PodInfo) -> PodClass<'a> {
        if pod.unmanaged {
            PodClass::Unmanaged
        } else {
            self.classes.resolve_pod(pod, &self.resources)
        }
    }

    fn mark_own_nodes(&self, t: &mut Ticket<'a>) {
        if let (Some(pod), Some(c)) = (t.pod, t.class) {
            t.own_nodes = self.classes.list[c].pod_has_own_nodes(pod, &self.nodes);
        }
    }

    /// Adds a pod's requests to its bound or pinned node; true when it has
    /// one. A pod being deleted that is not bound holds nothing: the
    /// scheduler never places it.
    fn count_pod(&mut self, pod: &PodInfo) -> bool {
        if pod.terminating && pod.node_name.is_none() {
            return false;
        }
        let Some(node) = pod
            .node_name
            .as_deref()
            .or_else(|| fit::pinned_node(pod))
            .and_then(|n| self.nodes.find(n))
        else {
            return false;
        };
        for (res, name) in self.resources.iter().enumerate() {
            if let Some(&slots) = pod.requests.get(*name) {
                self.nodes.take(res, node, slots);
            }
        }
        true
    }

    /// The resource a pod of an unknown class would use: the first managed
    /// resource it requests.
    pub(crate) fn requested_resource(&self, pod: &PodInfo) -> Option<(usize, u32)> {
        self.resources
            .iter()
            .enumerate()
            .find_map(|(i, r)| pod.requests.get(*r).map(|&s| (i, s)))
    }

    fn blank(&self, key: &'a ObjectKey, pod: Option<&'a PodInfo>) -> Ticket<'a> {
        Ticket {
            key,
            pod,
            lease: None,
            persisted: None,
            class: None,
            class_name: "",
            res: None,
            role: Role::Primary,
            slots: 0,
            bad_role: None,
            sequence: None,
            seq_persisted: false,
            pod_counted: false,
            phase: LeasePhase::Queued,
            node: None,
            node_idx: None,
            position: None,
            preempted_by: None,
            message: Message::Unchanged,
            candidate: false,
            waits: false,
            serves: None,
            redrive: false,
            admitted_now: false,
            own_nodes: false,
            spec_current: true,
            quiet: false,
        }
    }

    fn fresh(
        &self,
        pod: &'a PodInfo,
        resolved: Option<PodClass<'a>>,
        facts: &Facts,
        pod_counted: bool,
    ) -> Option<Ticket<'a>> {
        let resolved = resolved?;
        match resolved {
            PodClass::Unmanaged => return None,
            PodClass::Unknown(_) if facts.requested.is_none() => return None,
            PodClass::Class(_) | PodClass::Unknown(_) => {}
        }
        let mut t = self.blank(&pod.key, Some(pod));
        self.derive_from_pod(&mut t, pod, resolved, facts);
        t.pod_counted = pod_counted;
        self.settle(&mut t, LeasePhase::Queued);
        Some(t)
    }

    pub(crate) fn existing(
        &self,
        lease: &'a LeaseInfo,
        pod: Option<&'a PodInfo>,
        resolved: Option<PodClass<'a>>,
        facts: &Facts,
        pod_counted: bool,
    ) -> Ticket<'a> {
        let mut t = self.blank(&lease.key, pod);
        t.lease = Some(lease);
        t.persisted = lease.status();
        t.pod_counted = pod_counted;
        t.class = facts.lease_class.map(|c| c as usize);
        t.class_name = &lease.spec().class_name;
        t.role = lease.spec().role;
        t.slots = lease.spec().slots;
        match pod {
            // The pod, not the lease, says what is wanted: class, role and
            // slots are taken from it, so a lease edited behind the
            // operator's back changes nothing (and is put right).
            Some(p) => {
                self.derive_from_pod(&mut t, p, resolved.unwrap_or(PodClass::Unmanaged), facts)
            }
            None => {
                t.res = t.class.map(|c| self.classes.list[c].res);
            }
        }
        t.sequence = t.persisted.and_then(|s| s.sequence);
        // A missing lease is recreated first; nothing is admitted on a
        // sequence that is not stored.
        t.seq_persisted = t.sequence.is_some() && !lease.missing;
        t.node = t.persisted.and_then(|s| s.node.as_deref());
        let persisted_phase = t.persisted.map(|s| s.phase).unwrap_or_default();
        if persisted_phase == LeasePhase::Preempting || persisted_phase == LeasePhase::Released {
            t.preempted_by = t
                .persisted
                .and_then(|s| s.preempted_by.as_deref())
                .map(PreemptedBy::Persisted);
        }
        self.settle(&mut t, persisted_phase);
        t
    }

    /// Class, role and slots as the pod states them (DESIGN §5.10). A pod
    /// whose class cannot be resolved keeps the class its lease names, with
    /// the slots it requests of the first resource a class manages.
    fn derive_from_pod(
        &self,
        t: &mut Ticket<'a>,
        pod: &'a PodInfo,
        resolved: PodClass<'a>,
        facts: &Facts,
    ) {
        let requested = facts.requested.map(|(res, slots)| (res as usize, slots));
        match resolved {
            PodClass::Class(c) => {
                let class = &self.classes.list[c];
                t.class = Some(c);
                t.class_name = class.info.name.as_str();
                t.res = Some(class.res);
                t.slots = facts.class_slots;
            }
            PodClass::Unknown(name) => {
                t.class = None;
                t.class_name = name;
                if let Some((res, slots)) = requested {
                    t.res = Some(res);
                    t.slots = slots;
                }
            }
            PodClass::Unmanaged => {
                t.res = t.class.map(|c| self.classes.list[c].res);
                if let Some((res, slots)) = requested {
                    t.res = Some(res);
                    t.slots = slots;
                }
            }
        }
        match &pod.role {
            RoleLabel::Valid(role) => t.role = *role,
            RoleLabel::Invalid(value) => t.bad_role = Some(value),
        }
    }

    /// Sets the phase the lifecycle (not the queue) dictates.
    fn settle(&self, t: &mut Ticket<'a>, persisted_phase: LeasePhase) {
        if persisted_phase == LeasePhase::Released {
            t.phase = LeasePhase::Released;
            t.message = Message::Unchanged;
            return;
        }
        let pod = match t.pod {
            // The scheduler never places a pod that is being deleted: one
            // that is not bound yet will not run, and holds nothing.
            Some(p) if is_live(p) && !(p.terminating && p.node_name.is_none()) => p,
            other => {
                t.phase = LeasePhase::Released;
                t.message = Message::Released(Release::of(other));
                return;
            }
        };
        if persisted_phase == LeasePhase::Preempting {
            t.phase = LeasePhase::Preempting;
            t.node = pod.node_name.as_deref().or(t.node);
            t.message = Message::Preempting(t.preempted_by);
            self.hold(t);
            return;
        }
        if !pod.gated {
            // Running without the gate (admitted earlier, or created where the
            // webhook does not run): it is admitted already, never again.
            t.node = pod
                .node_name
                .as_deref()
                .or_else(|| fit::pinned_node(pod))
                .or(t.node);
            let has_gpus = t.persisted.is_some_and(|s| !s.gpus.is_empty());
            t.phase = if persisted_phase == LeasePhase::Bound
                || (pod.phase == PodPhase::Running && has_gpus)
            {
                LeasePhase::Bound
            } else {
                LeasePhase::Admitted
            };
            t.message = match (t.phase, t.node) {
                (LeasePhase::Bound, Some(node)) => Message::Bound(node),
                (_, node) => Message::Admitted(node),
            };
            self.hold(t);
            return;
        }
        if persisted_phase.holds_slots()
            && t.class.is_some()
            && t.node.and_then(|n| self.nodes.find(n)).is_some()
        {
            // Admitted in an earlier pass, but the pod still shows its gate:
            // the admission patch was lost; it is driven again to the same
            // node, unless its class is gone (then it waits as Rejected).
            t.phase = LeasePhase::Admitted;
            t.message = Message::Admitted(t.node);
            t.redrive = true;
            self.hold(t);
            return;
        }
        queue_or_reject(&self.classes, t);
    }
}

/// Makes the ticket a queue candidate, or rejects it when its class or role
/// cannot be admitted.
fn queue_or_reject(classes: &Classes<'_>, t: &mut Ticket<'_>) {
    // A rejected or queued lease holds nothing.
    t.node = None;
    t.node_idx = None;
    t.redrive = false;
    t.phase = LeasePhase::Queued;
    match (t.class, t.bad_role) {
        (_, Some(value)) => {
            t.phase = LeasePhase::Rejected;
            t.message = Message::BadRole(value);
        }
        (None, None) => {
            t.phase = LeasePhase::Rejected;
            t.message = Message::UnknownClass(t.class_name);
        }
        (Some(c), None) if classes.list[c].problem.is_some() => {
            t.phase = LeasePhase::Rejected;
            t.message = Message::InvalidClass(c);
        }
        (Some(_), None) => t.candidate = true,
    }
}

impl<'a> Pass<'a> {
    /// Resolves the ticket's node index for accounting.
    fn hold(&self, t: &mut Ticket<'a>) {
        t.node_idx = t.node.and_then(|n| self.nodes.find(n));
    }

    /// Counts the slots of holding leases whose pods do not show a node yet.
    pub fn count_leases(&mut self) {
        for t in &self.tickets {
            if t.phase.holds_slots()
                && !t.pod_counted
                && let (Some(res), Some(node)) = (t.res, t.node_idx)
            {
                self.nodes.take(res, node, t.slots);
            }
        }
    }

    /// Admissions whose patch never reached the pod are driven again only
    /// where they still fit: on a node whose allocatable shrank below what
    /// is held, the newest go back to the queue (their pods never started).
    pub fn requeue_overcommitted_redrives(&mut self) {
        let mut redriven: Vec<usize> = (0..self.tickets.len())
            .filter(|&i| self.tickets[i].redrive)
            .collect();
        redriven.sort_unstable_by_key(|&i| std::cmp::Reverse((self.tickets[i].sequence, i)));
        for i in redriven {
            let t = &self.tickets[i];
            let (Some(res), Some(node)) = (t.res, t.node_idx) else {
                continue;
            };
            if self.nodes.free(res, node) >= 0 {
                continue;
            }
            self.nodes.give_back(res, node, t.slots);
            queue_or_reject(&self.classes, &mut self.tickets[i]);
        }
    }

    /// Specs to rewrite: leases whose spec no longer says what their live
    /// pod does (written by someone else, or from before a relabelling the
    /// webhook could not stop).
    pub fn emit_lease_specs(&mut self) {
        for t in &self.tickets {
            let (Some(lease), Some(pod)) = (t.lease, t.pod) else {
                continue;
            };
            if lease.missing || t.phase == LeasePhase::Released || !is_live(pod) {
                continue;
            }
            if !t.spec_current {
                self.plan
                    .lease_specs
                    .insert(t.key.clone(), self.new_spec(t));
            }
        }
    }

    /// The class an inert lease `ns/name` has: the one the ticket a pass
    /// over it would build says.
    pub fn retired_class(&self, key: &str) -> Option<usize> {
        let (ns, name) = key.split_once('/')?;
        let entry = self.view.set_apart.inert(&ObjectKey::new(ns, name))?;
        let lease = entry.lease.as_deref()?;
        let pod = entry.pod.as_deref();
        let facts = self.derive_facts(pod, Some(lease));
        let resolved = pod.map(|p| self.class_of(p, &facts));
        self.existing(lease, pod, resolved, &facts, false).class
    }

    /// Index of the ticket for `ns/name` among those [`Pass::join`] built.
    pub fn find_ticket(&self, key: &str) -> Option<usize> {
        let (ns, name) = key.split_once('/')?;
        self.tickets[..self.joined]
            .binary_search_by(|t| (&*t.key.namespace, &*t.key.name).cmp(&(ns, name)))
            .ok()
    }

    /// The spec a new lease is created with.
    pub fn new_spec(&self, t: &Ticket<'a>) -> GpuLeaseSpec {
        GpuLeaseSpec {
            class_name: t.class_name.to_owned(),
            pod_name: t.key.name.to_string(),
            pod_uid: t.pod.map(|p| p.uid.clone()).unwrap_or_default(),
            role: t.role,
            slots: t.slots,
        }
    }
}

/// A pod and its lease, paired by key (at least one of the two is there),
/// with their facts when the engine keeps them.
pub(crate) type PodLease<'a> = (
    Option<&'a PodInfo>,
    Option<&'a LeaseInfo>,
    Option<&'a Facts>,
);

/// What one pass reads: every list sorted by name or key with one entry per
/// name or key (the first one given wins), so every pass over the same
/// cluster sees the same order whether it comes from a [`Snapshot`] or
/// from the engine's kept state.
pub(crate) struct View<'a> {
    pub now: Timestamp,
    pub classes: Vec<&'a ClassInfo>,
    pub nodes: Vec<&'a NodeInfo>,
    /// Pods and leases joined by key, in key order.
    pub entries: Vec<PodLease<'a>>,
    /// What the kept state set apart rather than list in `entries`
    /// (see [`crate::set_apart`]); nothing for a pass over a snapshot.
    pub set_apart: &'a SetApart,
    pub blocked_evictions: &'a BlockedEvictions,
    pub progress_limit: Option<usize>,
}

impl<'a> View<'a> {
    /// The classes alone: what deriving an entry's facts reads.
    pub fn of_classes(classes: Vec<&'a ClassInfo>) -> Self {
        static NO_EVICTIONS: BlockedEvictions = BTreeMap::new();
        Self {
            now: Timestamp::UNIX_EPOCH,
            classes,
            nodes: Vec::new(),
            entries: Vec::new(),
            set_apart: &NOTHING_SET_APART,
            blocked_evictions: &NO_EVICTIONS,
            progress_limit: None,
        }
    }

    /// Sorts the snapshot's lists (already-sorted input, as the controller's
    /// caches give it, costs one comparison per element) and pairs pods
    /// with leases by key.
    pub fn of(snapshot: &'a Snapshot) -> Self {
        let pods = sorted_unique(&snapshot.pods, |p| &p.key);
        let leases = sorted_unique(&snapshot.leases, |l| &l.key);
        Self {
            now: snapshot.now,
            classes: sorted_unique(&snapshot.classes, |c| c.name.as_str()),
            nodes: sorted_unique(&snapshot.nodes, |n| n.name.as_str()),
            entries: pair_by_key(&pods, &leases),
            set_apart: &NOTHING_SET_APART,
            blocked_evictions: &snapshot.blocked_evictions,
            progress_limit: snapshot.progress_limit,
        }
    }
}

/// Walks pods and leases, each in key order, together.
fn pair_by_key<'a>(pods: &[&'a PodInfo], leases: &[&'a LeaseInfo]) -> Vec<PodLease<'a>> {
    let mut entries = Vec::with_capacity(pods.len().max(leases.len()) + 16);
    let (mut i, mut j) = (0, 0);
    while i < pods.len() || j < leases.len() {
        let order = match (pods.get(i), leases.get(j)) {
            (Some(p), Some(l)) => p.key.cmp(&l.key),
            (Some(_), None) => Ordering::Less,
            _ => Ordering::Greater,
        };
        let pod = (order != Ordering::Greater).then(|| pods[i]);
        let lease = (order != Ordering::Less).then(|| leases[j]);
        i += usize::from(pod.is_some());
        j += usize::from(lease.is_some());
        entries.push((pod, lease, None));
    }
    entries
}

/// References in key order, the first of equal keys kept (the sort is stable).
fn sorted_unique<T, K: Ord + ?Sized>(items: &[T], key: impl Fn(&T) -> &K) -> Vec<&T> {
    let mut v: Vec<&T> = items.iter().collect();
    v.sort_by(|a, b| key(a).cmp(key(b)));
    v.dedup_by(|a, b| key(a) == key(b));
    v
}
