//! The queue step (DESIGN §5.3–§5.4): primaries in sequence order, then
//! helpers in theirs, each placed on one node that fits.

use std::collections::BTreeMap;

use gpupool_api::{LeasePhase, Ordering, Placement, Role};

use super::capacity::Nodes;
use super::classes::Guards;
use super::fit;
use super::message::{Message, Settled, Waiting};
use super::model::{Admission, ObjectKey, Plan, Taint};
use super::parked::{ClassFifos, Fifo, Lease};
use super::pass::{ClassQueue, ParkedOutcome, Pass, Queued, SkippedRun, Ticket, Waiter};
use super::status::QUEUE_HEAD;

/// The next lease a FIFO decides on: a ticket, or a parked lease (its
/// place in the FIFO and the lease).
#[derive(Clone, Copy)]
enum Next<'a> {
    Ticket(usize),
    Parked(&'a (u64, ObjectKey), &'a Lease),
}

/// A FIFO's tickets and parked leases, merged in (sequence, key) order.
struct Merge<'a> {
    /// The tickets with their (sequence, key), in that order.
    tickets: Vec<(Option<u64>, &'a ObjectKey, usize)>,
    next_ticket: usize,
    fifo: Option<&'a Fifo>,
    parked:
        Option<std::iter::Peekable<std::collections::btree_map::Iter<'a, (u64, ObjectKey), Lease>>>,
    /// How many parked leases were taken so far.
    taken: usize,
}

/// The parked leases of a FIFO not taken yet, when no ticket comes
/// between them.
struct Rest {
    count: usize,
    /// How many ask for each number of slots, fewest first.
    slots: Vec<(u32, usize)>,
    tolerating: usize,
}

impl<'a> Merge<'a> {
    fn new(tickets: Vec<(Option<u64>, &'a ObjectKey, usize)>, fifo: Option<&'a Fifo>) -> Self {
        Self {
            tickets,
            next_ticket: 0,
            fifo,
            parked: fifo.map(|f| f.leases.iter().peekable()),
            taken: 0,
        }
    }

    /// The parked leases left, when every ticket left comes after all of
    /// them.
    fn rest(&self) -> Option<Rest> {
        let fifo = self.fifo?;
        if let Some(&(sequence, key, _)) = self.tickets.get(self.next_ticket) {
            let (last, _) = fifo.leases.last_key_value()?;
            if (Some(last.0), &last.1) > (sequence, key) {
                return None;
            }
        }
        // What was taken is counted once, here, rather than per lease as
        // it is taken: most FIFOs are never passed over.
        let mut slots = fifo.slots.clone();
        let mut tolerating = fifo.tolerating;
        for (_, lease) in fifo.leases.iter().take(self.taken) {
            crate::set_apart::count_down(&mut slots, lease.summary.slots);
            tolerating -= usize::from(lease.summary.tolerates);
        }
        Some(Rest {
            count: fifo.len() - self.taken,
            slots: slots.into_iter().collect(),
            tolerating,
        })
    }

    /// Passes over the parked leases left (see [`Merge::rest`]).
    fn skip_rest(&mut self) {
        self.parked = None;
    }
}

impl<'a> Iterator for Merge<'a> {
    type Item = Next<'a>;

    fn next(&mut self) -> Option<Next<'a>> {
        let ticket = self.tickets.get(self.next_ticket).copied();
        let parked = self.parked.as_mut().and_then(|p| {
            p.next_if(|(place, _)| {
                ticket.is_none_or(|(sequence, key, _)| (Some(place.0), &place.1) < (sequence, key))
            })
        });
        if let Some((place, lease)) = parked {
            self.taken += 1;
            return Some(Next::Parked(place, lease));
        }
        let (_, _, t) = ticket?;
        self.next_ticket += 1;
        Some(Next::Ticket(t))
    }
}

/// The nodes a queued pod may go to.
enum Eligible {
    /// The class's precomputed list (the pod adds no constraints).
    Plain,
    /// Filtered by the pod's own constraints.
    Own(Vec<u32>),
}

/// What a run over one FIFO carries from lease to lease.
struct FifoRun<'a> {
    c: usize,
    role: Role,
    strict: bool,
    placement: Placement,
    /// Helpers wait while primaries of the class do (no `admitWhileQueued`).
    held_back: bool,
    waiting_primaries: u32,
    res: usize,
    class_nodes: usize,
    /// The FIFO's leases left queued, in order.
    queued: Vec<Waiter>,
    /// Parked leases passed over in bulk, beyond the one entry of `queued`
    /// that stands for them: they are behind the others.
    skipped: u32,
    /// How many of the queued leases wait (are not impossible).
    waiting: u32,
    /// The first lease that waits with nothing closing the FIFO ahead of
    /// it: under StrictFIFO, everyone behind it waits for it.
    blocked: Option<usize>,
    /// Free slots of the class, computed again only after an admission.
    class_free: Option<u64>,
    /// Parked leases of this FIFO whose position or message moved.
    moved: usize,
    /// The entry of `parked_skipped` that counts this FIFO's quiet parked
    /// leases behind the class status's head.
    counted: Option<usize>,
    scratch: String,
    /// The primaries slots are held for, with their place in the FIFO.
    reserved_in_order: Vec<(usize, (Option<u64>, &'a ObjectKey))>,
}

impl<'a> FifoRun<'a> {
    /// How many leases of the FIFO stand ahead of the next one.
    fn ahead(&self) -> u32 {
        self.queued.len() as u32 + self.skipped
    }

    /// The waiting primaries that hold this run's helpers back, if they do.
    fn held_back_by(&self) -> Option<u32> {
        self.held_back.then_some(self.waiting_primaries)
    }

    /// Under StrictFIFO, the lease that blocks everyone behind it.
    fn strict_head(&self) -> Option<usize> {
        self.blocked.filter(|_| self.strict)
    }

    /// Leaves ticket `t` queued at the next position, with `message`;
    /// `waits`: it may fit some day, so it holds helpers back.
    fn queue(&mut self, tickets: &mut [Ticket<'a>], t: usize, waits: bool, message: Message<'a>) {
        let ticket = &mut tickets[t];
        ticket.waits = waits;
        ticket.phase = LeasePhase::Queued;
        ticket.position = Some(self.ahead() + 1);
        ticket.message = message;
        self.queued.push(Waiter::Ticket(t));
    }
}

/// `list` less the nodes `closed` marks, when it marks any of them.
fn open_to(list: &[u32], closed: &[bool]) -> Option<Vec<u32>> {
    (!closed.is_empty() && list.iter().any(|&n| closed[n as usize])).then(|| {
        list.iter()
            .copied()
            .filter(|&n| !closed[n as usize])
            .collect()
    })
}

/// Where a pod would go: the fullest node that fits (Pack) or the emptiest
/// (Spread), ties by node name.
pub(crate) fn place(
    nodes: &Nodes<'_>,
    list: &[u32],
    res: usize,
    slots: u32,
    placement: Placement,
) -> Option<u32> {
    let need = i64::from(slots);
    let mut best: Option<(i64, u32)> = None;
    for &n in list {
        let free = nodes.free(res, n);
        if free < need {
            continue;
        }
        match placement {
            Placement::Pack => {
                if best.is_none_or(|(f, _)| free < f) {
                    best = Some((free, n));
                    if free == need {
                        break;
                    }
                }
            }
            Placement::Spread => {
                if best.is_none_or(|(f, _)| free > f) {
                    best = Some((free, n));
                }
            }
        }
    }
    best.map(|(_, n)| n)
}

impl<'a> Pass<'a> {
    /// Decides every valid class over one shared capacity: first the
    /// primaries of every class (classes in name order), then the helpers of
    /// every class. A helper never takes a node that a waiting primary of any
    /// class could use (DESIGN §5.4): its own class's primaries hold back all
    /// its helpers (unless `admitWhileQueued`), and another class's waiting
    /// primaries close the nodes they could be placed on.
    pub fn run_queues(&mut self) {
        let mut by_class: Vec<ClassQueue> = (0..self.classes.list.len())
            .map(|_| ClassQueue::default())
            .collect();
        for (i, t) in self.tickets.iter().enumerate() {
            if let (true, Some(c)) = (t.candidate, t.class) {
                match t.role {
                    Role::Primary => by_class[c].primaries.push(i),
                    Role::Helper => by_class[c].helpers.push(i),
                }
            }
        }
        for q in &mut by_class {
            q.primaries
                .sort_unstable_by_key(|&i| (self.tickets[i].sequence, i));
            q.helpers
                .sort_unstable_by_key(|&i| (self.tickets[i].sequence, i));
        }
        let set_apart = self.view.set_apart;
        let fifos: Vec<Option<&'a ClassFifos>> = self
            .classes
            .list
            .iter()
            .map(|c| set_apart.class_fifos(c.name()))
            .collect();
        self.reserve_for_preemptions();
        self.requeue_contested_redrives(&mut by_class, &fifos);
        self.requeue_redrives_behind_the_queue(&mut by_class, &fifos);
        let mut waiting = Vec::with_capacity(by_class.len());
        let mut primaries = Vec::with_capacity(by_class.len());
        for (c, q) in by_class.iter().enumerate() {
            let order = self.merge(&q.primaries, fifos[c].map(|t| &t.primaries));
            let (queued, w) = self.run_role(c, Role::Primary, order, 0, &[]);
            primaries.push(queued);
            waiting.push(w);
        }
        let closed = self.nodes_closed_to_helpers(&primaries);
        self.queues = Vec::with_capacity(by_class.len());
        for (c, (q, primaries)) in by_class.into_iter().zip(primaries).enumerate() {
            let order = self.merge(&q.helpers, fifos[c].map(|t| &t.helpers));
            let helpers = self
                .run_role(c, Role::Helper, order, waiting[c], &closed[c])
                .0;
            self.queues.push(Queued { primaries, helpers });
        }
        // What is still held back for waiting primaries is not in use: the
        // class status reports it as free.
        for (p, held) in std::mem::take(&mut self.reservations) {
            let Some(res) = self.tickets[p].res else {
                continue;
            };
            for (node, amount) in held {
                self.nodes.give_back(res, node, amount);
            }
        }
    }

    /// Per class, the nodes its helpers may not take: every node on which a
    /// waiting primary of another class using the same resource could be
    /// placed. (A class's own waiting primaries hold back all of its helpers
    /// in `run_role`, unless `admitWhileQueued` allows them.)
    fn nodes_closed_to_helpers(&self, primaries: &[Vec<Waiter>]) -> Vec<Vec<bool>> {
        let n = self.nodes.list.len();
        let mut wanted: Vec<Option<Vec<bool>>> = vec![None; primaries.len()];
        for (c, queued) in primaries.iter().enumerate() {
            let class = &self.classes.list[c];
            // Waiting primaries without constraints of their own all see the
            // class's plain nodes: only the smallest request among them
            // matters (a node large enough for it is wanted).
            let mut plain_min: Option<u32> = None;
            for &w in queued {
                let t = match w {
                    Waiter::Ticket(t) => t,
                    Waiter::Parked(o) => {
                        let o = &self.parked_out[o];
                        let slots = o.slots;
                        if o.waits {
                            plain_min = Some(plain_min.map_or(slots, |m| m.min(slots)));
                        }
                        continue;
                    }
                    Waiter::Skipped(s) => {
                        if let Some(slots) = self.parked_skipped[s].fewest_waiting_slots {
                            plain_min = Some(plain_min.map_or(slots, |m| m.min(slots)));
                        }
                        continue;
                    }
                };
                if !self.tickets[t].waits {
                    continue;
                }
                let slots = self.tickets[t].slots;
                match self.tickets[t].pod {
                    Some(pod) if self.tickets[t].own_nodes => {
                        let marks = wanted[c].get_or_insert_with(|| vec![false; n]);
                        for &node in &class.nodes {
                            if self.nodes.alloc(class.res, node) >= slots
                                && fit::pod_fits_node(pod, self.nodes.list[node as usize])
                            {
                                marks[node as usize] = true;
                            }
                        }
                    }
                    _ => plain_min = Some(plain_min.map_or(slots, |m| m.min(slots))),
                }
            }
            if let Some(slots) = plain_min {
                let marks = wanted[c].get_or_insert_with(|| vec![false; n]);
                for &node in &class.plain_nodes {
                    if self.nodes.alloc(class.res, node) >= slots {
                        marks[node as usize] = true;
                    }
                }
            }
        }
        (0..primaries.len())
            .map(|h| {
                let res = self.classes.list[h].res;
                let mut closed = Vec::new();
                for (c, marks) in wanted.iter().enumerate() {
                    let Some(marks) = marks else { continue };
                    if c == h || self.classes.list[c].res != res {
                        continue;
                    }
                    if closed.is_empty() {
                        closed = vec![false; n];
                    }
                    for (slot, &m) in closed.iter_mut().zip(marks) {
                        *slot |= m;
                    }
                }
                closed
            })
            .collect()
    }

    /// The nodes of class `c`, its own class, that ticket `t` may be placed on.
    fn eligible(&self, c: usize, t: usize) -> Eligible {
        let class = &self.classes.list[c];
        debug_assert_eq!(self.tickets[t].class, Some(c), "placed in its own class");
        match self.tickets[t].pod {
            Some(pod) if self.tickets[t].own_nodes => Eligible::Own(
                class
                    .nodes
                    .iter()
                    .copied()
                    .filter(|&n| fit::pod_fits_node(pod, self.nodes.list[n as usize]))
                    .collect(),
            ),
            _ => Eligible::Plain,
        }
    }

    /// Runs one role's FIFO of class `c`; returns the leases left queued and
    /// how many of them wait (queued and not impossible). Helpers pass the
    /// number of waiting primaries, which holds them back.
    fn run_role(
        &mut self,
        c: usize,
        role: Role,
        mut order: Merge<'a>,
        waiting_primaries: u32,
        closed: &[bool],
    ) -> (Vec<Waiter>, u32) {
        let mut run = self.start_run(c, role, &order, waiting_primaries);
        while let Some(next) = order.next() {
            let t = match next {
                Next::Ticket(t) => t,
                Next::Parked(place, lease) => {
                    match self.visit_parked(&mut run, &mut order, (place, lease)) {
                        Some(t) => t,
                        None => continue,
                    }
                }
            };
            self.decide_ticket(&mut run, t, closed);
        }
        (run.queued, run.waiting)
    }

    /// What a run over class `c`'s FIFO of `role` starts from.
    fn start_run(
        &self,
        c: usize,
        role: Role,
        order: &Merge<'a>,
        waiting_primaries: u32,
    ) -> FifoRun<'a> {
        let class = &self.classes.list[c];
        let spec = &class.info.spec;
        // Where in this FIFO (by sequence and key, its order) the primaries
        // that slots are held for stand: few, so found once per run rather
        // than per ticket. They are tickets: a primary a victim names is
        // never parked.
        let reserved_in_order = if role == Role::Primary && !self.reservations.is_empty() {
            order
                .tickets
                .iter()
                .filter(|(_, _, t)| self.reservations.contains_key(t))
                .map(|&(sequence, key, t)| (t, (sequence, key)))
                .collect()
        } else {
            Vec::new()
        };
        FifoRun {
            c,
            role,
            strict: spec.admission.ordering == Ordering::StrictFIFO,
            placement: spec.admission.placement,
            held_back: role == Role::Helper
                && waiting_primaries > 0
                && !spec.helpers.admit_while_queued,
            waiting_primaries,
            res: class.res,
            class_nodes: class.nodes.len(),
            queued: Vec::new(),
            skipped: 0,
            waiting: 0,
            blocked: None,
            class_free: None,
            moved: 0,
            counted: None,
            scratch: String::new(),
            reserved_in_order,
        }
    }

    /// Decides a parked lease where the FIFO's state fixes its outcome, and
    /// records it; otherwise returns its ticket, to be decided as any
    /// visited lease is.
    fn visit_parked(
        &mut self,
        run: &mut FifoRun<'a>,
        order: &mut Merge<'a>,
        (place, lease): (&'a (u64, ObjectKey), &'a Lease),
    ) -> Option<usize> {
        let ahead = run.ahead();
        let head = run.strict_head();
        let outcome = self.decide_parked(
            (run.c, run.role),
            (place, lease),
            ahead,
            run.held_back_by(),
            head,
            &mut run.class_free,
            &mut run.scratch,
        );
        let Some(outcome) = outcome else {
            // Not closed ahead of it: decided as a ticket.
            let t = self.materialize(&lease.entry);
            debug_assert!(t.is_some(), "a parked lease always has a ticket");
            return t;
        };
        run.waiting += u32::from(outcome.waits);
        run.moved += usize::from(outcome.moved);
        self.record_parked(run, outcome, ahead);
        // Under a progress limit, once more leases of this FIFO moved than
        // the limit lets through, the ones behind them are neither written
        // nor needed to tell that the limit cut the progress: what is left
        // of the FIFO is counted, not visited, when its outcome is the same
        // for every lease (the class status lists the head).
        let closed = run.held_back || head.is_some();
        let bulk = self.view.progress_limit.is_some_and(|l| run.moved > l)
            && ahead as usize + 1 >= QUEUE_HEAD
            && (closed || self.classes.list[run.c].plain_nodes.is_empty());
        if bulk
            && let Some(rest) = order.rest()
            && let Some(skipped) = self.skip_parked(run.c, run.role, &rest, closed)
        {
            run.skipped += skipped.count - 1;
            run.waiting += skipped.waiting;
            run.queued.push(Waiter::Skipped(self.parked_skipped.len()));
            self.parked_skipped.push(skipped);
            order.skip_rest();
        }
        None
    }

    /// Keeps a parked lease's outcome for the statuses: in full, or, behind
    /// the class status's head for a lease that needs no write and whose
    /// message the engine already remembers, only counted.
    fn record_parked(&mut self, run: &mut FifoRun<'a>, outcome: ParkedOutcome<'a>, ahead: u32) {
        let quiet = !outcome.moved && outcome.settled.is_none() && ahead as usize >= QUEUE_HEAD;
        if !quiet {
            run.queued.push(Waiter::Parked(self.parked_out.len()));
            self.parked_out.push(outcome);
        } else if let Some(counted) = run.counted.map(|i| &mut self.parked_skipped[i]) {
            counted.count += 1;
            run.skipped += 1;
            if outcome.waits {
                counted.waiting += 1;
                counted.fewest_waiting_slots = Some(
                    counted
                        .fewest_waiting_slots
                        .map_or(outcome.slots, |f| f.min(outcome.slots)),
                );
            }
        } else {
            run.counted = Some(self.parked_skipped.len());
            run.queued.push(Waiter::Skipped(self.parked_skipped.len()));
            self.parked_skipped.push(SkippedRun {
                class: run.c,
                role: run.role,
                count: 1,
                waiting: u32::from(outcome.waits),
                fewest_waiting_slots: outcome.waits.then_some(outcome.slots),
            });
        }
    }

    /// Admits ticket `t` where the rules let it, or leaves it queued with
    /// the reason it waits. `closed` marks the nodes another class's
    /// waiting primaries could use, which helpers are not offered.
    fn decide_ticket(&mut self, run: &mut FifoRun<'a>, t: usize, closed: &[bool]) {
        if let Some(gate) = self.tickets[t].pod.and_then(|p| p.other_gate.as_deref()) {
            // Another controller holds the pod back: it takes no slot and
            // blocks no one until gpupool's gate is its only one.
            run.queue(&mut self.tickets, t, false, Message::OtherGate(gate));
            return;
        }
        let (c, res, slots) = (run.c, run.res, self.tickets[t].slots);
        let eligible = self.eligible(c, t);
        let class = &self.classes.list[c];
        let (list, largest): (&[u32], u32) = match &eligible {
            Eligible::Plain => (&class.plain_nodes, class.largest_plain),
            Eligible::Own(v) => (
                v,
                v.iter()
                    .map(|&n| self.nodes.alloc(res, n))
                    .max()
                    .unwrap_or(0),
            ),
        };
        let impossible = class.nodes.is_empty() || list.is_empty() || largest < slots;
        if impossible && let Some(held) = self.reservations.remove(&t) {
            // It can never fit: what its victims freed goes back to everyone.
            for (node, amount) in held {
                self.nodes.give_back(res, node, amount);
            }
        }
        let (ahead, held_back, head) = (run.ahead(), run.held_back_by(), run.strict_head());
        let waits = self.waits_before_placing(
            (c, run.role, slots),
            (list.is_empty(), largest),
            || self.guards_against(c, t),
            (ahead, held_back, head),
            &mut run.class_free,
        );
        let message = if let Some((message, waits)) = waits {
            run.waiting += u32::from(waits);
            message
        } else if !self.tickets[t].seq_persisted {
            // Its sequence is not stored yet (a new lease, or one being
            // recreated with its old place): it cannot be admitted in this
            // pass, and under StrictFIFO no one behind it may pass it.
            run.waiting += 1;
            run.blocked = run.blocked.or(Some(t));
            Message::NewlyQueued
        } else {
            match self.admit_or_wait(run, t, &eligible, closed) {
                Some(message) => message,
                None => return,
            }
        };
        run.queue(&mut self.tickets, t, !impossible, message);
    }

    /// Places ticket `t` (its sequence persisted, nothing ahead closing
    /// the FIFO) on one of its `eligible` nodes that `closed` leaves it, if
    /// one fits, over the slots held for primaries behind it if need be;
    /// `None` once admitted. Otherwise it blocks the FIFO behind it, and the
    /// first primary that waits so may preempt helpers: the reason it waits
    /// is returned.
    fn admit_or_wait(
        &mut self,
        run: &mut FifoRun<'a>,
        t: usize,
        eligible: &Eligible,
        closed: &[bool],
    ) -> Option<Message<'a>> {
        let (c, res, slots) = (run.c, run.res, self.tickets[t].slots);
        let class = &self.classes.list[c];
        let list: &[u32] = match eligible {
            Eligible::Plain => &class.plain_nodes,
            Eligible::Own(v) => v,
        };
        let open = open_to(list, closed);
        let open = open.as_deref();
        // Owned: the reservations behind it may change below. Empty (no
        // allocation) for all but the primaries preempted for.
        let reserved = self.reservations.get(&t).cloned().unwrap_or_default();
        for &(node, amount) in &reserved {
            self.nodes.give_back(res, node, amount);
        }
        let offered = open.unwrap_or(list);
        let placement = run.placement;
        let mut node = place(&self.nodes, offered, res, slots, placement);
        let here = (self.tickets[t].sequence, self.tickets[t].key);
        if node.is_none() && !run.reserved_in_order.is_empty() {
            let reserved_in_order = &run.reserved_in_order;
            node = place_over_reservations_behind(
                &mut self.nodes,
                &mut self.reservations,
                |b| reserved_in_order.iter().any(|&(r, at)| r == b && at > here),
                res,
                |nodes| place(nodes, offered, res, slots, placement),
            );
        }
        if let Some(node) = node {
            admit(
                &mut self.nodes,
                &mut self.tickets,
                &mut self.plan,
                t,
                res,
                node,
            );
            self.reservations.remove(&t);
            run.class_free = None;
            return None;
        }
        for &(node, amount) in &reserved {
            self.nodes.take(res, node, amount);
        }
        run.waiting += 1;
        let class = &self.classes.list[c];
        let free = *run
            .class_free
            .get_or_insert_with(|| self.nodes.free_on(res, &class.nodes));
        let first = run.blocked.is_none();
        run.blocked = run.blocked.or(Some(t));
        let own = match eligible {
            Eligible::Own(own) if own.len() < class.plain_nodes.len() => {
                Some((own.len(), self.nodes.free_on(res, own)))
            }
            _ => None,
        };
        let list_len = list.len();
        Some(if run.role == Role::Primary && first {
            // Only the first primary that does not fit may preempt
            // helpers, so evictions serve the queue's order.
            let list = list.to_vec();
            let mut message = self.preempt_for(c, t, &list, free);
            if let Message::NoVictims {
                own: o, guards: g, ..
            } = &mut message
            {
                *o = own;
                *g = self.guards_against(c, t);
            }
            message
        } else if let (Some(open), Role::Helper) = (open, run.role) {
            Message::KeptForPrimaries {
                nodes: list_len - open.len(),
            }
        } else {
            Message::NoFit {
                role: run.role,
                ahead: run.ahead(),
                slots,
                free,
                nodes: run.class_nodes,
                own,
                guards: self.guards_against(c, t),
            }
        })
    }

    /// What keeps ticket `t`'s pod off class `c`'s guarded nodes: cordons,
    /// and taints it does not tolerate.
    fn guards_against(&self, c: usize, t: usize) -> Guards<&'a Taint> {
        let class = &self.classes.list[c];
        let Some(pod) = self.tickets[t].pod.filter(|p| !p.tolerations.is_empty()) else {
            return class.guards(&self.nodes);
        };
        let mut guards = Guards::default();
        for &n in &class.guarded_nodes {
            let node = self.nodes.list[n as usize];
            if node.unschedulable {
                guards.cordoned += 1;
            } else if let Some(taint) = fit::first_untolerated_taint(pod, node) {
                guards.tainted += 1;
                guards.taint = guards.taint.or(Some(taint));
            }
        }
        guards
    }

    /// A FIFO's tickets (in (sequence, key) order) and its parked leases,
    /// to be merged in that order.
    fn merge(&self, tickets: &[usize], parked: Option<&'a Fifo>) -> Merge<'a> {
        let tickets = tickets
            .iter()
            .map(|&t| (self.tickets[t].sequence, self.tickets[t].key, t))
            .collect();
        Merge::new(tickets, parked)
    }

    /// True when the parked lease's pod may use other nodes of class `c`
    /// than the plain ones (see `ClassView::pod_has_own_nodes`): only a pod
    /// with tolerations can, and only where the class has guarded nodes.
    fn parked_has_own_nodes(&self, c: usize, lease: &Lease) -> bool {
        let class = &self.classes.list[c];
        if !lease.summary.tolerates || class.guarded_nodes.is_empty() {
            return false;
        }
        lease
            .entry
            .pod
            .as_deref()
            .is_none_or(|pod| class.pod_has_own_nodes(pod, &self.nodes))
    }

    /// Why a lease of class `c` (`role`, asking `slots`) waits before any
    /// node is tried, in the order the rules ask it (DESIGN §5.3–§5.4): the
    /// class has no node; none of its nodes is open to the pod (`no_node`);
    /// it asks more than the largest such node has; its class's waiting
    /// primaries hold helpers back (`held_back`); a StrictFIFO is blocked
    /// at `head`. With whether it waits (may fit some day), which holds
    /// helpers back; `None` when it may be placed. Visited and parked
    /// leases are told apart by the same words.
    fn waits_before_placing(
        &self,
        (c, role, slots): (usize, Role, u32),
        (no_node, largest): (bool, u32),
        guards: impl FnOnce() -> Guards<&'a Taint>,
        (ahead, held_back, head): (u32, Option<u32>, Option<usize>),
        class_free: &mut Option<u64>,
    ) -> Option<(Message<'a>, bool)> {
        let class = &self.classes.list[c];
        let class_nodes = class.nodes.len();
        Some(if class.nodes.is_empty() {
            // Impossible ones can never fit by waiting, so they hold no one up.
            (Message::Waiting(Waiting::NoClassNode(c)), false)
        } else if no_node {
            let guards = guards();
            let message = Message::Waiting(Waiting::NoPodNode {
                class: c,
                class_nodes,
                guards,
            });
            (message, false)
        } else if largest < slots {
            (
                Message::Waiting(Waiting::TooLarge { slots, largest }),
                false,
            )
        } else if let Some(primaries) = held_back {
            let message = Message::Waiting(Waiting::HelpersHeldBack {
                primaries,
                class: c,
            });
            (message, true)
        } else if let Some(head) = head {
            let free =
                *class_free.get_or_insert_with(|| self.nodes.free_on(class.res, &class.nodes));
            let message = Message::Waiting(Waiting::Behind {
                role,
                ahead,
                head: self.tickets[head].key,
                head_slots: self.tickets[head].slots,
                free,
                nodes: class_nodes,
            });
            (message, true)
        } else {
            return None;
        })
    }

    /// The outcome the queue step gives the parked lease at `place` when
    /// it is the same whatever the lease: no node of the class is open to
    /// plain pods or large enough, helpers are held back (the number of
    /// waiting primaries), or `head` blocks the StrictFIFO. `None` when
    /// the lease must be decided as a ticket.
    #[allow(clippy::too_many_arguments)]
    fn decide_parked(
        &self,
        (c, role): (usize, Role),
        (place, lease): (&'a (u64, ObjectKey), &'a Lease),
        ahead: u32,
        held_back: Option<u32>,
        head: Option<usize>,
        class_free: &mut Option<u64>,
        scratch: &mut String,
    ) -> Option<ParkedOutcome<'a>> {
        if self.parked_has_own_nodes(c, lease) {
            return None;
        }
        let class = &self.classes.list[c];
        let slots = lease.summary.slots;
        let (message, waits) = self.waits_before_placing(
            (c, role, slots),
            (class.plain_nodes.is_empty(), class.largest_plain),
            || class.guards(&self.nodes),
            (ahead, held_back, head),
            class_free,
        )?;
        let position = ahead + 1;
        // The phase stays Queued: only the position or the message can
        // move. A message the kept engine remembers the persisted status
        // to render is not rendered again.
        let mut settled = None;
        let moved = lease.summary.position != Some(position)
            || (!lease.settled.as_ref().is_some_and(|s| s.is(&message)) && {
                scratch.clear();
                message.render(&self.classes, scratch);
                let persisted = lease.entry.lease.as_ref().and_then(|l| l.status());
                let moved =
                    persisted.is_none_or(|s| s.message.as_deref() != Some(scratch.as_str()));
                if !moved {
                    settled = Settled::of(&message);
                }
                moved
            });
        Some(ParkedOutcome {
            key: &place.1,
            slots,
            entry: &lease.entry,
            class: c,
            role,
            position,
            message,
            waits,
            moved,
            settled,
        })
    }

    /// Passes over the `rest` of a FIFO of class `c` at once, when every
    /// lease in it gets the same outcome: the queue is closed ahead of
    /// them (`closed`: helpers held back or a blocked StrictFIFO), or no
    /// node is open to plain pods. `None` when some lease in it may use
    /// nodes of its own, and must be decided apart.
    fn skip_parked(&self, c: usize, role: Role, rest: &Rest, closed: bool) -> Option<SkippedRun> {
        let class = &self.classes.list[c];
        if rest.count == 0 || (rest.tolerating > 0 && !class.guarded_nodes.is_empty()) {
            return None;
        }
        let open = !class.plain_nodes.is_empty();
        debug_assert!(closed || !open, "only a closed FIFO is passed over");
        // Those that can fit some day wait; the rest are too large.
        let fitting = || {
            rest.slots
                .iter()
                .filter(move |&&(slots, _)| open && slots <= class.largest_plain)
        };
        Some(SkippedRun {
            class: c,
            role,
            count: rest.count as u32,
            waiting: fitting().map(|&(_, n)| n as u32).sum(),
            fewest_waiting_slots: fitting().map(|&(slots, _)| slots).next(),
        })
    }

    /// True when the parked lease could fit some day on the nodes of
    /// class `c` it may use.
    fn parked_may_fit(&self, c: usize, lease: &Lease) -> bool {
        let class = &self.classes.list[c];
        let slots = lease.summary.slots;
        if !self.parked_has_own_nodes(c, lease) {
            return class.largest_plain >= slots;
        }
        let Some(pod) = lease.entry.pod.as_deref() else {
            return false;
        };
        class.nodes.iter().any(|&n| {
            self.nodes.alloc(class.res, n) >= slots
                && fit::pod_fits_node(pod, self.nodes.list[n as usize])
        })
    }

    /// Under StrictFIFO, a primary whose admission never reached its pod
    /// (still gated) goes back to the queue when a primary with an earlier
    /// sequence waits and could fit some day (for instance because that one's
    /// node went away and it was queued again): its pod never started, so
    /// requeueing costs nothing, and the earlier primary is admitted first.
    fn requeue_redrives_behind_the_queue(
        &mut self,
        by_class: &mut [ClassQueue],
        fifos: &[Option<&'a ClassFifos>],
    ) {
        for (c, queue) in by_class.iter_mut().enumerate() {
            let class = &self.classes.list[c];
            if class.info.spec.admission.ordering != Ordering::StrictFIFO {
                continue;
            }
            let redriven =
                |t: &Ticket<'_>| t.redrive && t.role == Role::Primary && t.class == Some(c);
            if !self.tickets.iter().any(redriven) {
                continue;
            }
            let res = class.res;
            let earliest_parked = fifos[c].and_then(|tail| {
                tail.primaries
                    .leases
                    .iter()
                    .find(|(_, lease)| self.parked_may_fit(c, lease))
                    .map(|(place, _)| (Some(place.0), &place.1))
            });
            let earliest = queue
                .primaries
                .iter()
                .copied()
                .filter(|&t| self.tickets[t].pod.is_none_or(|p| p.other_gate.is_none()))
                .filter(|&t| {
                    let slots = self.tickets[t].slots;
                    match self.eligible(c, t) {
                        Eligible::Plain => class.largest_plain >= slots,
                        Eligible::Own(list) => {
                            list.iter().any(|&n| self.nodes.alloc(res, n) >= slots)
                        }
                    }
                })
                .map(|t| (self.tickets[t].sequence, self.tickets[t].key))
                .filter(|(sequence, _)| sequence.is_some())
                .chain(earliest_parked)
                .min();
            let Some(earliest) = earliest else {
                continue;
            };
            let mut requeued = false;
            for i in 0..self.tickets.len() {
                let t = &self.tickets[i];
                // Two pods enqueued in the same microsecond share a
                // sequence: their names order them.
                if !redriven(t) || t.sequence.is_none() || (t.sequence, t.key) < earliest {
                    continue;
                }
                if let (Some(res), Some(node)) = (t.res, t.node_idx) {
                    self.nodes.give_back(res, node, t.slots);
                }
                let t = &mut self.tickets[i];
                t.redrive = false;
                t.phase = LeasePhase::Queued;
                t.node = None;
                t.node_idx = None;
                t.candidate = true;
                queue.primaries.push(i);
                requeued = true;
            }
            if requeued {
                let tickets = &self.tickets;
                queue
                    .primaries
                    .sort_unstable_by_key(|&i| (tickets[i].sequence, i));
            }
        }
    }

    /// A helper whose admission never reached its pod (still gated) is not
    /// started where a primary may need its slots: while primaries of its
    /// own class queue (unless `admitWhileQueued`), or on a node of another
    /// class whose primaries queue. It goes back to its queue, and its slots
    /// to the pool, before any primary is decided.
    fn requeue_contested_redrives(
        &mut self,
        by_class: &mut [ClassQueue],
        fifos: &[Option<&'a ClassFifos>],
    ) {
        let queuing: Vec<usize> = (0..by_class.len())
            .filter(|&c| {
                !by_class[c].primaries.is_empty() || fifos[c].is_some_and(|t| t.primaries.len() > 0)
            })
            .collect();
        if queuing.is_empty() {
            return;
        }
        let mut requeued = Vec::new();
        for i in 0..self.tickets.len() {
            let t = &self.tickets[i];
            let (true, Role::Helper, Some(h), Some(res), Some(node)) =
                (t.redrive, t.role, t.class, t.res, t.node_idx)
            else {
                continue;
            };
            let contested = queuing.iter().any(|&c| {
                let class = &self.classes.list[c];
                if c == h {
                    !class.info.spec.helpers.admit_while_queued
                } else {
                    class.res == res && class.nodes.binary_search(&node).is_ok()
                }
            });
            if !contested {
                continue;
            }
            self.nodes.give_back(res, node, t.slots);
            let t = &mut self.tickets[i];
            t.redrive = false;
            t.phase = LeasePhase::Queued;
            t.node = None;
            t.node_idx = None;
            t.candidate = true;
            by_class[h].helpers.push(i);
            requeued.push(h);
        }
        requeued.sort_unstable();
        requeued.dedup();
        for h in requeued {
            let tickets = &self.tickets;
            by_class[h]
                .helpers
                .sort_unstable_by_key(|&i| (tickets[i].sequence, i));
        }
    }

    /// Drives again the admissions of leases admitted earlier whose pods
    /// still show the gate (the patch was lost, e.g. in a restart).
    pub fn readmit(&mut self) {
        for t in &self.tickets {
            if t.redrive
                && t.lease.is_none_or(|l| !l.missing)
                && let Some(node) = t.node
            {
                self.plan.admissions.push(Admission {
                    key: t.key.clone(),
                    pod_uid: t.pod.map(|p| p.uid.clone()).unwrap_or_default(),
                    role: t.role,
                    node: node.to_owned(),
                    slots: t.slots,
                });
            }
        }
    }
}

/// Places a primary that did not fit by letting it use what is held back
/// for the primaries behind it in its class's FIFO (`behind` says which): a reservation keeps
/// slots from the pods behind its primary, never from one ahead of it (else
/// a primary that became possible only after a later one's preemption, say
/// when its node grew, would wait on that reservation while, under
/// StrictFIFO, the later one waits on it). On success those reservations
/// are spent; otherwise they stay.
fn place_over_reservations_behind(
    nodes: &mut Nodes<'_>,
    reservations: &mut BTreeMap<usize, Vec<(u32, u32)>>,
    behind: impl Fn(usize) -> bool,
    res: usize,
    place: impl Fn(&Nodes<'_>) -> Option<u32>,
) -> Option<u32> {
    // Few primaries hold reservations: look at those, not at the queue.
    let yielding: Vec<usize> = reservations
        .iter()
        .filter(|(b, held)| !held.is_empty() && behind(**b))
        .map(|(b, _)| *b)
        .collect();
    if yielding.is_empty() {
        return None;
    }
    for b in &yielding {
        for &(node, amount) in &reservations[b] {
            nodes.give_back(res, node, amount);
        }
    }
    let node = place(nodes);
    for b in &yielding {
        if node.is_some() {
            reservations.remove(b);
        } else {
            for &(n, amount) in &reservations[b] {
                nodes.take(res, n, amount);
            }
        }
    }
    node
}

/// Admits ticket `t` to `node`: the slots are taken at once, so no later
/// pod of this pass can have them.
fn admit<'a>(
    nodes: &mut Nodes<'a>,
    tickets: &mut [Ticket<'a>],
    plan: &mut Plan,
    t: usize,
    res: usize,
    node: u32,
) {
    let ticket = &mut tickets[t];
    nodes.take(res, node, ticket.slots);
    let name = nodes.list[node as usize].name.as_str();
    ticket.phase = LeasePhase::Admitted;
    ticket.admitted_now = true;
    ticket.node = Some(name);
    ticket.node_idx = Some(node);
    ticket.position = None;
    ticket.message = Message::Admitted(Some(name));
    plan.admissions.push(Admission {
        key: ticket.key.clone(),
        pod_uid: ticket.pod.map(|p| p.uid.clone()).unwrap_or_default(),
        role: ticket.role,
        node: name.to_owned(),
        slots: ticket.slots,
    });
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::fixtures::{class, default_tolerations, node, pod};
    use crate::model::{
        NodeInfo, PodInfo, Snapshot, Taint, TaintEffect, Toleration, TolerationOperator,
    };
    use crate::pass::View;

    const TAINT_KEYS: [&str; 3] = [
        "node.kubernetes.io/not-ready",
        "node.kubernetes.io/unreachable",
        "gpu.example/maintenance",
    ];

    fn taint() -> impl Strategy<Value = Taint> {
        (0..TAINT_KEYS.len(), 0..3u8).prop_map(|(k, e)| Taint {
            key: TAINT_KEYS[k].to_owned(),
            value: None,
            effect: match e {
                0 => TaintEffect::NoSchedule,
                1 => TaintEffect::PreferNoSchedule,
                _ => TaintEffect::NoExecute,
            },
        })
    }

    fn toleration() -> impl Strategy<Value = Toleration> {
        (
            prop::option::of(0..TAINT_KEYS.len()),
            prop::option::of(0..2u8),
        )
            .prop_map(|(k, e)| Toleration {
                key: k.map(|k| TAINT_KEYS[k].to_owned()),
                operator: TolerationOperator::Exists,
                value: None,
                effect: e.map(|e| {
                    if e == 0 {
                        TaintEffect::NoSchedule
                    } else {
                        TaintEffect::NoExecute
                    }
                }),
            })
    }

    /// Nodes `n-0`… with random taints, cordons and a `zone` label.
    fn nodes() -> impl Strategy<Value = Vec<NodeInfo>> {
        prop::collection::vec(
            (
                prop::collection::vec(taint(), 0..3),
                prop::bool::weighted(0.15),
                0..2u8,
            ),
            1..8,
        )
        .prop_map(|specs| {
            specs
                .into_iter()
                .enumerate()
                .map(|(i, (taints, cordoned, zone))| NodeInfo {
                    taints,
                    unschedulable: cordoned,
                    labels: [("zone".to_owned(), format!("z{zone}"))].into(),
                    ..node(&format!("n-{i}"), 4)
                })
                .collect()
        })
    }

    /// Pods with the API server's default tolerations, more tolerations, a
    /// zone selector, or nothing of their own.
    fn pods() -> impl Strategy<Value = Vec<PodInfo>> {
        prop::collection::vec(
            (
                prop::bool::ANY,
                prop::collection::vec(toleration(), 0..3),
                prop::option::of(0..2u8),
            ),
            1..6,
        )
        .prop_map(|specs| {
            specs
                .into_iter()
                .enumerate()
                .map(|(i, (defaults, extra, zone))| {
                    let mut p = pod(&format!("p-{i}"), 1, i as i64);
                    let mut tolerations = if defaults {
                        default_tolerations()
                    } else {
                        Vec::new()
                    };
                    tolerations.extend(extra);
                    p.tolerations = tolerations.into();
                    if let Some(z) = zone {
                        p.node_selector = [("zone".to_owned(), format!("z{z}"))].into();
                    }
                    p
                })
                .collect()
        })
    }

    proptest! {
        /// Whichever way a pod's nodes are found (the class's plain list or
        /// its own filtered one), they are the class nodes it fits.
        #[test]
        fn a_pods_nodes_are_the_class_nodes_it_fits(nodes in nodes(), pods in pods()) {
            let snapshot = Snapshot {
                classes: vec![class("default")],
                nodes,
                pods,
                ..Snapshot::default()
            };
            let mut pass = Pass::index(View::of(&snapshot));
            pass.join();
            let class = &pass.classes.list[0];
            for t in 0..pass.tickets.len() {
                let Some(pod) = pass.tickets[t].pod else { continue };
                let fitting: Vec<u32> = class
                    .nodes
                    .iter()
                    .copied()
                    .filter(|&n| fit::pod_fits_node(pod, pass.nodes.list[n as usize]))
                    .collect();
                let found = match pass.eligible(0, t) {
                    Eligible::Plain => class.plain_nodes.clone(),
                    Eligible::Own(list) => list,
                };
                prop_assert_eq!(found, fitting, "pod {}", pod.key);
            }
        }
    }

    #[test]
    fn default_tolerations_keep_a_pod_on_the_plain_list() {
        let tainted = |name: &str, key: &str, effect| NodeInfo {
            taints: vec![Taint {
                key: key.into(),
                value: None,
                effect,
            }],
            ..node(name, 4)
        };
        let not_ready = tainted(
            "n-2",
            "node.kubernetes.io/not-ready",
            TaintEffect::NoExecute,
        );
        let tainted = tainted("n-1", "gpu.example/maintenance", TaintEffect::NoSchedule);
        let mut with_defaults = pod("a", 1, 0);
        with_defaults.tolerations = default_tolerations().into();
        let snapshot = Snapshot {
            classes: vec![class("default")],
            nodes: vec![node("n-0", 4), tainted.clone()],
            pods: vec![with_defaults.clone()],
            ..Snapshot::default()
        };
        let mut pass = Pass::index(View::of(&snapshot));
        pass.join();
        assert!(
            matches!(pass.eligible(0, 0), Eligible::Plain),
            "a taint it does not tolerate leaves it where plain pods go"
        );

        // A guarded node it does tolerate gives it a list of its own.
        let snapshot = Snapshot {
            nodes: vec![node("n-0", 4), tainted, not_ready],
            ..snapshot
        };
        let mut pass = Pass::index(View::of(&snapshot));
        pass.join();
        match pass.eligible(0, 0) {
            Eligible::Own(list) => assert_eq!(list, vec![0, 2], "n-0 and the not-ready n-2"),
            Eligible::Plain => panic!("the tolerated not-ready node must be offered"),
        }
    }
}
