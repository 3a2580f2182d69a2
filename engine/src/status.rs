//! Statuses from one pass (DESIGN §3, §4, §5.7): every lease whose wanted
//! status differs from the persisted one, new leases, and every class's
//! counts, queue head and per-GPU snapshot.

use std::collections::BinaryHeap;

use gpupool_api::class::{CONDITION_INVALID, CONDITION_READY};
use gpupool_api::{GpuLeaseClassStatus, GpuLeaseStatus, LeasePhase, QueueEntry, Role, SlotEntry};
use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

use super::message::Message;
use super::model::{CLASS_STATUS_PERIOD, ClassWrite, NewLease, ObjectKey, QueueDepth};
use super::pass::{ParkedOutcome, Pass, Ticket, Waiter};

/// Most entries a class's `status.queue` lists.
pub const QUEUE_HEAD: usize = 20;

/// Bytes reserved for the scratch buffer messages are rendered into
/// ("waiting: 9999 primaries ahead (head …) …" fits).
const MESSAGE_CAPACITY: usize = 160;

/// A lease whose position or message moved, with where its ticket or
/// outcome is.
struct Progress<'a> {
    position: u32,
    key: &'a ObjectKey,
    source: Waiter,
}

impl Progress<'_> {
    /// Front of the queue first: lowest position, then key.
    fn order(a: &Self, b: &Self) -> std::cmp::Ordering {
        (a.position, a.key).cmp(&(b.position, b.key))
    }
}

/// How a lease's wanted status differs from the persisted one.
enum Change {
    /// Nothing to write.
    None,
    /// Only the position or the message: the queue moved.
    Progress,
    /// Anything else: phase, sequence, node, preempter or a timestamp.
    Phase,
}

/// Timestamps a lease status carries: set once on the transition, then kept.
struct Times {
    queued: Option<Timestamp>,
    admitted: Option<Timestamp>,
    bound: Option<Timestamp>,
    released: Option<Timestamp>,
}

fn times(t: &Ticket<'_>, now: Timestamp) -> Times {
    let p = t.persisted;
    let kept = |f: fn(&GpuLeaseStatus) -> Option<&Time>| p.and_then(f).map(|t| t.0);
    // A lease sent back to the queue (its admission never reached its pod)
    // has not been admitted: when it is admitted again, that is the time.
    let waiting = matches!(t.phase, LeasePhase::Queued | LeasePhase::Rejected);
    Times {
        queued: kept(|s| s.queued_at.as_ref())
            .or_else(|| t.pod.map(|p| p.enqueued_at.unwrap_or(p.created_at))),
        admitted: if t.admitted_now {
            Some(now)
        } else {
            (!waiting)
                .then(|| kept(|s| s.admitted_at.as_ref()).or(t.phase.holds_slots().then_some(now)))
                .flatten()
        },
        bound: (!waiting && !t.admitted_now)
            .then(|| {
                kept(|s| s.bound_at.as_ref()).or((t.phase == LeasePhase::Bound).then_some(now))
            })
            .flatten(),
        released: kept(|s| s.released_at.as_ref())
            .or((t.phase == LeasePhase::Released).then_some(now)),
    }
}

impl<'a> Pass<'a> {
    /// True when the ticket's lease needs no status write: the persisted
    /// status is the one this pass wants (which then reads no clock).
    pub(crate) fn wants_no_write(&self, t: &Ticket<'_>) -> bool {
        let mut scratch = String::with_capacity(MESSAGE_CAPACITY);
        t.message != Message::Unchanged
            && matches!(
                self.differs(t, &times(t, self.now), &mut scratch),
                Change::None
            )
    }

    /// How the ticket's wanted status differs from the persisted one;
    /// `scratch` is reused to render messages without allocating per lease.
    fn differs(&self, t: &Ticket<'_>, times: &Times, scratch: &mut String) -> Change {
        let Some(p) = t.persisted else {
            return Change::Phase;
        };
        let same_preempter = match (&t.preempted_by, &p.preempted_by) {
            (None, None) => true,
            (Some(a), Some(b)) => {
                scratch.clear();
                use std::fmt::Write as _;
                let _ = write!(scratch, "{a}");
                scratch == b
            }
            _ => false,
        };
        if p.phase != t.phase
            || p.sequence != t.sequence
            || p.node.as_deref() != t.node
            || !same_preempter
            || p.queued_at.as_ref().map(|x| x.0) != times.queued
            || p.admitted_at.as_ref().map(|x| x.0) != times.admitted
            || p.bound_at.as_ref().map(|x| x.0) != times.bound
            || p.released_at.as_ref().map(|x| x.0) != times.released
        {
            return Change::Phase;
        }
        if p.position != t.position {
            return Change::Progress;
        }
        scratch.clear();
        t.message.render(&self.classes, scratch);
        if p.message.as_deref() != Some(scratch.as_str()) {
            Change::Progress
        } else {
            Change::None
        }
    }

    fn build(&self, t: &Ticket<'_>, scratch: &mut String) -> GpuLeaseStatus {
        self.build_with(t, times(t, self.now), scratch)
    }

    /// Renders the message into `scratch` (which keeps its capacity from
    /// lease to lease) and copies it out at its exact length: a pass after
    /// the queue head moves writes thousands of these, and the plan keeps
    /// them until the controller has written them.
    fn build_with(&self, t: &Ticket<'_>, times: Times, scratch: &mut String) -> GpuLeaseStatus {
        scratch.clear();
        t.message.render(&self.classes, scratch);
        let message = scratch.as_str().to_owned();
        GpuLeaseStatus {
            phase: t.phase,
            sequence: t.sequence,
            position: t.position,
            node: t.node.map(str::to_owned),
            gpus: t.persisted.map(|s| s.gpus.clone()).unwrap_or_default(),
            gpu_indexes: t.persisted.and_then(|s| s.gpu_indexes.clone()),
            preempted_by: t.preempted_by.map(|p| p.to_string()),
            queued_at: times.queued.map(Time),
            admitted_at: times.admitted.map(Time),
            bound_at: times.bound.map(Time),
            released_at: times.released.map(Time),
            message: Some(message),
        }
    }

    /// Fills `plan.create_leases`, `plan.lease_statuses` and `plan.lease_progress`.
    pub fn emit_lease_statuses(&mut self) {
        let mut scratch = String::with_capacity(MESSAGE_CAPACITY);
        let mut created = Vec::new();
        let mut changed = Vec::new();
        // When the queue head moves, nearly every queued lease's position
        // changes: they are found here (comparing without allocating), and
        // their statuses built below, at most the progress limit of them.
        let mut progress: Vec<Progress<'a>> = Vec::new();
        for (i, t) in self.tickets.iter().enumerate() {
            match t.lease {
                None => created.push(NewLease {
                    key: t.key.clone(),
                    pod_uid: t.pod.map(|p| p.uid.clone()).unwrap_or_default(),
                    spec: self.new_spec(t),
                    status: self.build(t, &mut scratch),
                }),
                // Deleted while its pod lives: recreated as it was (same
                // sequence, node, GPUs and times), so the pod keeps its place.
                Some(l) if l.missing => {
                    if t.phase != LeasePhase::Released && t.pod.is_some_and(|p| !p.terminating) {
                        created.push(NewLease {
                            key: t.key.clone(),
                            pod_uid: l.spec().pod_uid.clone(),
                            spec: self.new_spec(t),
                            status: self.build(t, &mut scratch),
                        });
                    }
                }
                Some(_) if t.message == Message::Unchanged => {}
                // A quiet holder whose phase no step of this pass changed
                // wants its persisted status (see `Facts::quiet`).
                Some(_) if t.quiet && t.persisted.is_some_and(|p| p.phase == t.phase) => {}
                Some(_) => {
                    let times = times(t, self.now);
                    match self.differs(t, &times, &mut scratch) {
                        Change::Phase => {
                            changed.push((t.key.clone(), self.build_with(t, times, &mut scratch)))
                        }
                        Change::Progress => progress.push(Progress {
                            position: t.position.unwrap_or(0),
                            key: t.key,
                            source: Waiter::Ticket(i),
                        }),
                        Change::None => {}
                    }
                }
            }
        }
        self.parked_progress(&mut progress);
        if let Some(limit) = self.view.progress_limit
            && progress.len() > limit
        {
            // (position, key) is unique, so the cut is the same whatever
            // order the selection leaves the rest in.
            progress.select_nth_unstable_by(limit, Progress::order);
            progress.truncate(limit);
            self.plan.progress_truncated = true;
        }
        let progress = progress
            .into_iter()
            .filter_map(|p| {
                let status = match p.source {
                    Waiter::Ticket(i) => self.build(&self.tickets[i], &mut scratch),
                    Waiter::Parked(i) => {
                        let t = self.parked_ticket(&self.parked_out[i])?;
                        self.build(&t, &mut scratch)
                    }
                    Waiter::Skipped(_) => return None,
                };
                Some((p.key.clone(), status))
            })
            .collect();
        self.plan.create_leases = created;
        self.plan.lease_statuses = changed.into_iter().collect();
        self.plan.lease_progress = progress;
    }

    /// Adds the parked leases whose position or message moved to
    /// `progress`. Under a progress limit, a FIFO is compared only until
    /// the rest of it can no longer be among the front that is written:
    /// its positions only grow.
    fn parked_progress(&self, progress: &mut Vec<Progress<'a>>) {
        if self.parked_out.is_empty() {
            return;
        }
        // The `limit + 1` lowest (position, key) of the progress found so
        // far: once it is full, a lease behind its last is neither written
        // nor needed to tell that the limit cut the progress.
        let keep = self.view.progress_limit.map(|limit| limit + 1);
        let mut front: BinaryHeap<(u32, &ObjectKey)> = BinaryHeap::new();
        if let Some(keep) = keep {
            for p in progress.iter() {
                front.push((p.position, p.key));
                if front.len() > keep {
                    front.pop();
                }
            }
        }
        let mut skipped: Option<(usize, Role)> = None;
        for (i, o) in self.parked_out.iter().enumerate() {
            if skipped == Some((o.class, o.role)) {
                continue;
            }
            if let Some(keep) = keep
                && front.len() == keep
                && front.peek().is_some_and(|last| (o.position, o.key) > *last)
            {
                skipped = Some((o.class, o.role));
                continue;
            }
            if !o.moved {
                continue;
            }
            progress.push(Progress {
                position: o.position,
                key: o.key,
                source: Waiter::Parked(i),
            });
            if let Some(keep) = keep {
                front.push((o.position, o.key));
                if front.len() > keep {
                    front.pop();
                }
            }
        }
    }

    /// The ticket a visit of the parked lease would have built, as the
    /// queue step left it.
    fn parked_ticket(&self, o: &ParkedOutcome<'a>) -> Option<Ticket<'a>> {
        let entry = o.entry;
        let (pod, lease) = (entry.pod.as_deref()?, entry.lease.as_deref()?);
        let resolved = Some(self.class_of(pod, &entry.facts));
        let mut t = self.existing(lease, Some(pod), resolved, &entry.facts, false);
        t.phase = LeasePhase::Queued;
        t.position = Some(o.position);
        t.message = o.message.clone();
        t.waits = o.waits;
        Some(t)
    }

    /// Fills `plan.queue_depths` for every class, and `plan.class_statuses`
    /// and `plan.class_writes` for the classes whose status may be written
    /// now (see [`Pass::class_write_held_until`]); a class held back asks
    /// for a pass when its period ends.
    pub fn emit_class_statuses(&mut self) {
        let visited = self.tickets.len();
        let held: Vec<Option<Timestamp>> = (0..self.classes.list.len())
            .map(|c| self.class_write_held_until(c))
            .collect();
        let built: Vec<bool> = held.iter().map(Option::is_none).collect();
        // Quiet primaries set apart are counted from their sums; only those
        // on the nodes a built class status pictures GPU by GPU get tickets.
        for node in self.pictured_nodes(&built) {
            let name = self.nodes.list[node as usize].name.as_str();
            self.materialize_quiet_holders(name);
        }
        let holders = if built.contains(&true) {
            self.holders_by_node()
        } else {
            TicketsByNode::default()
        };
        let mut writes = Vec::new();
        for (c, class) in self.classes.list.iter().enumerate() {
            let mut status = self.class_counts(c, visited);
            self.plan.queue_depths.insert(
                class.info.name.clone(),
                QueueDepth {
                    primaries: status.queued,
                    helpers: status.queued_helpers,
                },
            );
            if !built[c] {
                continue;
            }
            let res = class.res;
            status.observed_generation = class.info.generation;
            status.conditions = self.conditions(c);
            status.capacity = class.nodes.iter().map(|&n| self.nodes.alloc(res, n)).sum();
            status.free = self
                .nodes
                .free_on(res, &class.nodes)
                .min(u64::from(u32::MAX)) as u32;
            if let Some(q) = self.queues.get(c) {
                status.queue = q
                    .primaries
                    .iter()
                    .chain(&q.helpers)
                    .take(QUEUE_HEAD)
                    .filter_map(|&w| self.queue_entry(w))
                    .collect();
            }
            let (slots, truncated) = self.slot_entries(c, &holders);
            status.slots = slots;
            status.slots_truncated = truncated;
            let persisted = class.info.status.as_ref();
            if !persisted.is_some_and(|p| same_apart_from_stamp(p, &status)) {
                writes.push(ClassWrite {
                    class: class.info.name.clone(),
                    updated_at: self.now,
                    newly_invalid: newly_invalid(persisted, &status),
                });
            }
            self.plan
                .class_statuses
                .insert(class.info.name.clone(), status);
        }
        self.plan.class_writes.extend(writes);
        for due in held.into_iter().flatten() {
            self.wake_at(Some(due));
        }
    }

    /// Class `c`'s lease counts: admitted, queued and preempting, by role.
    fn class_counts(&self, c: usize, visited: usize) -> GpuLeaseClassStatus {
        let mut status = GpuLeaseClassStatus::default();
        let quiet = self
            .view
            .set_apart
            .quiet_primaries_of(self.classes.list[c].name());
        status.admitted += quiet as u32;
        for t in self.tickets[..visited]
            .iter()
            .filter(|t| t.class == Some(c))
        {
            let counter = match (t.phase, t.role) {
                (LeasePhase::Admitted | LeasePhase::Bound, Role::Primary) => &mut status.admitted,
                (LeasePhase::Admitted | LeasePhase::Bound, Role::Helper) => {
                    &mut status.admitted_helpers
                }
                (LeasePhase::Queued, Role::Primary) => &mut status.queued,
                (LeasePhase::Queued, Role::Helper) => &mut status.queued_helpers,
                (LeasePhase::Preempting, _) => &mut status.preempting,
                _ => continue,
            };
            *counter += 1;
        }
        let parked = self.parked_out.iter().map(|o| (o.class, o.role, 1));
        let skipped = self
            .parked_skipped
            .iter()
            .map(|s| (s.class, s.role, s.count));
        for (_, role, n) in parked.chain(skipped).filter(|(class, ..)| *class == c) {
            match role {
                Role::Primary => status.queued += n,
                Role::Helper => status.queued_helpers += n,
            }
        }
        status
    }

    /// The nodes whose GPUs a class status built in this pass (`built[c]`)
    /// lists one by one (see [`Pass::slot_entries`]), when quiet primaries
    /// are set apart.
    fn pictured_nodes(&self, built: &[bool]) -> std::collections::BTreeSet<u32> {
        let mut pictured = std::collections::BTreeSet::new();
        if self.view.set_apart.quiet_primary_count() == 0 {
            return pictured;
        }
        for (class, _) in self.classes.list.iter().zip(built).filter(|(_, b)| **b) {
            let max = class.info.spec.snapshot.max_slots as usize;
            let mut listed = 0usize;
            for &n in &class.nodes {
                let node = self.nodes.list[n as usize];
                if node.gpus.is_empty() {
                    continue;
                }
                if listed >= max {
                    break;
                }
                pictured.insert(n);
                let sessions = (self.nodes.alloc(class.res, n) as usize / node.gpus.len()).max(1);
                listed += node.gpus.len() * sessions;
            }
        }
        pictured
    }

    /// A class status's entry for a lease left queued (leases counted in
    /// bulk are never at the head).
    fn queue_entry(&self, w: Waiter) -> Option<QueueEntry> {
        Some(match w {
            Waiter::Skipped(_) => return None,
            Waiter::Ticket(i) => {
                let t = &self.tickets[i];
                QueueEntry {
                    lease: t.key.to_string(),
                    role: t.role,
                    position: t.position.unwrap_or(0),
                    queued_at: times(t, self.now).queued.map(Time),
                }
            }
            Waiter::Parked(i) => {
                let o = &self.parked_out[i];
                QueueEntry {
                    lease: o.key.to_string(),
                    role: o.role,
                    position: o.position,
                    // Parked leases persist their queue time.
                    queued_at: self.parked_status(o).and_then(|s| s.queued_at.clone()),
                }
            }
        })
    }

    /// The persisted status of a parked lease.
    fn parked_status<'o>(&self, o: &'o ParkedOutcome<'_>) -> Option<&'o GpuLeaseStatus> {
        o.entry.lease.as_ref()?.status()
    }

    /// When class `c`'s status was written less than [`CLASS_STATUS_PERIOD`]
    /// ago, the end of that period: no write of it may happen before then.
    /// The period is read from the persisted `updatedAt`, so it holds
    /// across passes and leader changes alike; a stamp from the future
    /// (another replica's clock) holds nothing back.
    fn class_write_held_until(&self, c: usize) -> Option<Timestamp> {
        self.classes.list[c]
            .info
            .status
            .as_ref()
            .and_then(|p| p.updated_at.as_ref())
            .map(|t| t.0)
            .filter(|last| *last <= self.now)
            .and_then(|last| last.checked_add(CLASS_STATUS_PERIOD).ok())
            .filter(|due| *due > self.now)
    }

    fn conditions(&self, c: usize) -> Vec<Condition> {
        let class = &self.classes.list[c];
        let previous = class
            .info
            .status
            .as_ref()
            .map(|s| s.conditions.as_slice())
            .unwrap_or(&[]);
        let condition = |type_: &str, status: bool, reason: &str, message: &str| {
            let status = if status { "True" } else { "False" };
            // The transition time moves only when the condition's status does.
            let since = previous
                .iter()
                .find(|p| p.type_ == type_ && p.status == status)
                .map(|p| p.last_transition_time.clone())
                .unwrap_or(Time(self.now));
            Condition {
                last_transition_time: since,
                message: message.to_owned(),
                observed_generation: class.info.generation,
                reason: reason.to_owned(),
                status: status.to_owned(),
                type_: type_.to_owned(),
            }
        };
        match &class.problem {
            None => vec![
                condition(CONDITION_READY, true, "Valid", "class is valid"),
                condition(CONDITION_INVALID, false, "Valid", "class is valid"),
            ],
            Some(p) => vec![
                condition(CONDITION_READY, false, p.reason, &p.message),
                condition(CONDITION_INVALID, true, p.reason, &p.message),
            ],
        }
    }

    /// Tickets holding slots, grouped by node: per node, a range into a list
    /// sorted by (node, sequence).
    fn holders_by_node(&self) -> TicketsByNode {
        let mut list: Vec<(u32, u64, usize)> = self
            .tickets
            .iter()
            .enumerate()
            .filter(|(_, t)| t.phase.holds_slots())
            .filter_map(|(i, t)| Some((t.node_idx?, t.sequence.unwrap_or(u64::MAX), i)))
            .collect();
        // Equal sequences (a lease copied by hand) are told apart by key:
        // tickets built for leases set apart come after the visited ones.
        list.sort_unstable_by(|a, b| {
            (a.0, a.1)
                .cmp(&(b.0, b.1))
                .then_with(|| self.tickets[a.2].key.cmp(self.tickets[b.2].key))
        });
        let mut start = vec![0usize; self.nodes.list.len() + 1];
        for &(n, _, _) in &list {
            start[n as usize + 1] += 1;
        }
        for i in 1..start.len() {
            start[i] += start[i - 1];
        }
        TicketsByNode {
            tickets: list.into_iter().map(|(_, _, i)| i).collect(),
            start,
        }
    }

    /// The per-GPU picture of class `c`, capped at `snapshot.maxSlots`.
    fn slot_entries(&self, c: usize, holders: &TicketsByNode) -> (Vec<SlotEntry>, bool) {
        let class = &self.classes.list[c];
        let max = class.info.spec.snapshot.max_slots as usize;
        let res = class.res;
        let mut entries = Vec::new();
        let mut total = 0usize;
        for &n in &class.nodes {
            let node = self.nodes.list[n as usize];
            if node.gpus.is_empty() {
                continue;
            }
            let alloc = self.nodes.alloc(res, n) as usize;
            let sessions = (alloc / node.gpus.len()).max(1);
            total += node.gpus.len() * sessions;
            if entries.len() >= max {
                continue;
            }
            let mut gpus: Vec<_> = node.gpus.iter().collect();
            gpus.sort_by_key(|g| g.index);
            // cells[g * sessions + s] = holder ticket
            let mut cells: Vec<Option<usize>> = vec![None; gpus.len() * sessions];
            let on_node =
                &holders.tickets[holders.start[n as usize]..holders.start[n as usize + 1]];
            let mine = on_node
                .iter()
                .copied()
                .filter(|&i| self.tickets[i].res == Some(res));
            let mut unplaced = Vec::new();
            for i in mine {
                let t = &self.tickets[i];
                let mut placed = 0u32;
                for g in t.persisted.map(|s| s.gpus.as_slice()).unwrap_or(&[]) {
                    let Some(gi) = gpus.iter().position(|x| x.index == g.index) else {
                        continue;
                    };
                    if let Some(cell) = cells[gi * sessions..(gi + 1) * sessions]
                        .iter_mut()
                        .find(|c| c.is_none())
                    {
                        *cell = Some(i);
                        placed += 1;
                    }
                }
                if placed < t.slots {
                    unplaced.push((i, t.slots - placed));
                }
            }
            // The rest go session-major (one session per GPU before a second),
            // as the device plugin spreads them.
            let mut order =
                (0..sessions).flat_map(|s| (0..gpus.len()).map(move |g| g * sessions + s));
            for (i, mut need) in unplaced {
                while need > 0 {
                    let Some(cell) = order.by_ref().find(|&k| cells[k].is_none()) else {
                        break;
                    };
                    cells[cell] = Some(i);
                    need -= 1;
                }
            }
            for (k, holder) in cells.iter().enumerate() {
                if entries.len() >= max {
                    break;
                }
                let gpu = gpus[k / sessions];
                let t = holder.map(|i| &self.tickets[i]);
                entries.push(SlotEntry {
                    node: node.name.clone(),
                    gpu: gpu.index,
                    uuid: Some(gpu.uuid.clone()).filter(|s| !s.is_empty()),
                    product: Some(gpu.product.clone()).filter(|s| !s.is_empty()),
                    vendor: Some(gpu.vendor.clone()).filter(|s| !s.is_empty()),
                    lease: t.map(|t| t.key.to_string()),
                    role: t.map(|t| t.role),
                    since: t.and_then(|t| times(t, self.now).admitted.map(Time)),
                });
            }
        }
        (entries, total > max)
    }
}

/// Holding tickets grouped by node.
#[derive(Default)]
struct TicketsByNode {
    tickets: Vec<usize>,
    start: Vec<usize>,
}

/// True when two class statuses differ at most in their `updatedAt` stamp.
fn same_apart_from_stamp(a: &GpuLeaseClassStatus, b: &GpuLeaseClassStatus) -> bool {
    let GpuLeaseClassStatus {
        observed_generation,
        conditions,
        capacity,
        free,
        admitted,
        admitted_helpers,
        queued,
        queued_helpers,
        preempting,
        queue,
        slots,
        slots_truncated,
        updated_at: _,
    } = a;
    *observed_generation == b.observed_generation
        && *conditions == b.conditions
        && *capacity == b.capacity
        && *free == b.free
        && *admitted == b.admitted
        && *admitted_helpers == b.admitted_helpers
        && *queued == b.queued
        && *queued_helpers == b.queued_helpers
        && *preempting == b.preempting
        && *queue == b.queue
        && *slots == b.slots
        && *slots_truncated == b.slots_truncated
}

/// The message of the `Invalid` condition when writing `after` over
/// `before` turns it true or changes its reason.
fn newly_invalid(
    before: Option<&GpuLeaseClassStatus>,
    after: &GpuLeaseClassStatus,
) -> Option<String> {
    let invalid = |s: &GpuLeaseClassStatus| {
        s.conditions
            .iter()
            .find(|c| c.type_ == CONDITION_INVALID && c.status == "True")
            .map(|c| (c.reason.clone(), c.message.clone()))
    };
    let (reason, message) = invalid(after)?;
    match before.and_then(invalid) {
        Some((old, _)) if old == reason => None,
        _ => Some(message),
    }
}
