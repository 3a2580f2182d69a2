//! Preemption (DESIGN §5.5): when the head primary of a class cannot fit,
//! helpers of any class that hands out the same resource are evicted on one
//! node, youngest first, only as many as it needs; the slots they free are
//! reserved for that primary until it is admitted. Classes are decided in
//! name order, so the head primary of the first class by name chooses first.

use std::collections::BTreeMap;

use gpupool_api::{HelperSpec, LeasePhase, Preemption, Role};
use jiff::{SignedDuration, Timestamp};

use super::message::Message;
use super::model::{EVICTION_RETRY, Eviction};
use super::pass::{Pass, PreemptedBy, Ticket};

/// The helpers preemption may count on or evict, by node index.
#[derive(Default)]
struct HelpersByNode {
    /// Being evicted already: the slots they hold and which they are.
    terminating: BTreeMap<u32, (u64, Vec<usize>)>,
    /// Running or admitted, and not terminating: candidates.
    evictable: BTreeMap<u32, Vec<usize>>,
}

/// Why a primary waits when no helper can make room for it.
fn no_room<'a>(slots: u32, free: u64, young: u32) -> Message<'a> {
    Message::NoVictims {
        slots,
        free,
        young,
        own: None,
        guards: Default::default(),
    }
}

impl<'a> Pass<'a> {
    /// Links preempted helpers to the waiting primaries they make room for
    /// and holds back, on each such node, the free slots those primaries need.
    /// Runs before any class is decided, so no class (not even another one
    /// sharing the node) can take them.
    pub fn reserve_for_preemptions(&mut self) {
        let mut wanted: BTreeMap<usize, Vec<u32>> = BTreeMap::new();
        for v in 0..self.tickets.len() {
            let primary = match self.tickets[v].preempted_by {
                Some(PreemptedBy::Persisted(key)) => self.find_ticket(key),
                _ => None,
            };
            let Some(p) = primary.filter(|&p| {
                let t = &self.tickets[p];
                t.candidate && t.role == Role::Primary && t.seq_persisted
            }) else {
                continue;
            };
            let victim = &self.tickets[v];
            let node = match victim.phase {
                LeasePhase::Preempting => victim.node_idx,
                // A victim that is gone still points at the node its slots
                // were freed on.
                LeasePhase::Released => victim.node.and_then(|n| self.nodes.find(n)),
                _ => None,
            };
            self.tickets[v].serves = Some(p);
            if let Some(node) = node {
                wanted.entry(p).or_default().push(node);
            }
        }
        for (p, mut nodes) in wanted {
            nodes.sort_unstable();
            nodes.dedup();
            let (Some(res), slots) = (self.tickets[p].res, self.tickets[p].slots) else {
                continue;
            };
            let mut held = Vec::new();
            for node in nodes {
                let amount = self.nodes.free(res, node).clamp(0, i64::from(slots)) as u32;
                if amount > 0 {
                    self.nodes.take(res, node, amount);
                    held.push((node, amount));
                }
            }
            self.reservations.insert(p, held);
        }
    }

    /// Chooses helpers to evict for primary `p` (which did not fit on any of
    /// `eligible`) and returns the message `p` waits with.
    pub fn preempt_for(&mut self, c: usize, p: usize, eligible: &[u32], free: u64) -> Message<'a> {
        let class = &self.classes.list[c];
        let res = class.res;
        let slots = self.tickets[p].slots;
        if class.info.spec.helpers.preemption == Preemption::Never {
            return no_room(slots, free, 0);
        }
        let helpers = self.helpers_of(res, p);
        let (best, young) = self.fewest_victims(c, p, eligible, &helpers);
        let Some((node, chosen)) = best else {
            return no_room(slots, free, young);
        };
        self.evict_for(c, p, &chosen);
        let mut victims: Vec<usize> = helpers
            .terminating
            .get(&node)
            .map(|e| e.1.clone())
            .unwrap_or_default();
        victims.extend(chosen);
        victims.sort_unstable();
        Message::VictimsTerminating(victims.iter().map(|&v| self.tickets[v].key).collect())
    }

    /// The helpers of resource `res`, by node: those being evicted for `p`
    /// or for a primary that no longer waits (they count toward the need
    /// wherever they are), and those that may be evicted.
    fn helpers_of(&self, res: usize, p: usize) -> HelpersByNode {
        let mut helpers = HelpersByNode::default();
        for (i, t) in self.tickets.iter().enumerate() {
            let (Some(node), Some(r)) = (t.node_idx, t.res) else {
                continue;
            };
            if r != res || t.role != Role::Helper {
                continue;
            }
            match t.phase {
                LeasePhase::Preempting if t.serves.is_none_or(|s| s == p) => {
                    let e = helpers.terminating.entry(node).or_default();
                    e.0 += u64::from(t.slots);
                    e.1.push(i);
                }
                // A helper whose pod has not started (admission driven
                // again) is not a victim: it frees nothing by being evicted.
                LeasePhase::Admitted | LeasePhase::Bound
                    if !t.redrive && t.pod.is_some_and(|pod| !pod.terminating) =>
                {
                    helpers.evictable.entry(node).or_default().push(i);
                }
                _ => {}
            }
        }
        helpers
    }

    /// Of the `eligible` nodes big enough for primary `p` of class `c`, the
    /// one where it fits after evicting the fewest slots (then the fewest
    /// helpers, then the first in the list), with the helpers to evict
    /// there; and how many helpers were passed over as younger than their
    /// class's minRuntimeSeconds.
    fn fewest_victims(
        &self,
        c: usize,
        p: usize,
        eligible: &[u32],
        helpers: &HelpersByNode,
    ) -> (Option<(u32, Vec<usize>)>, u32) {
        let res = self.classes.list[c].res;
        let slots = u64::from(self.tickets[p].slots);
        let mut young = 0u32;
        // (new slots evicted, victims, node, chosen victims)
        let mut best: Option<(u64, usize, u32, Vec<usize>)> = None;
        for &node in eligible {
            if u64::from(self.nodes.alloc(res, node)) < slots {
                continue;
            }
            let pending = helpers.terminating.get(&node).map(|e| e.0).unwrap_or(0);
            // Slots already held back for `p` on this node are its own.
            let reserved: u64 = self
                .reservations
                .get(&p)
                .into_iter()
                .flatten()
                .filter(|(n, _)| *n == node)
                .map(|(_, a)| u64::from(*a))
                .sum();
            let mut have = (self.nodes.free(res, node) + reserved as i64).max(0) as u64 + pending;
            let mut chosen = Vec::new();
            let mut evicted = 0u64;
            if have < slots {
                for h in self.youngest_first(helpers.evictable.get(&node)) {
                    if have >= slots {
                        break;
                    }
                    let runtime = self.now.as_second() - self.admitted_at(h).as_second();
                    let min_runtime = i64::from(self.helper_spec(c, h).min_runtime_seconds);
                    if runtime < min_runtime {
                        young += 1;
                        continue;
                    }
                    let s = u64::from(self.tickets[h].slots);
                    have += s;
                    evicted += s;
                    chosen.push(h);
                }
            }
            if have < slots {
                continue;
            }
            let better = best
                .as_ref()
                .is_none_or(|b| (evicted, chosen.len()) < (b.0, b.1));
            if better {
                best = Some((evicted, chosen.len(), node, chosen));
            }
        }
        (best.map(|(_, _, node, chosen)| (node, chosen)), young)
    }

    /// `helpers`, youngest first. Admission times have second resolution,
    /// so helpers admitted in the same second are told apart by their place
    /// in the queue (the later sequence is the younger), and the pod UID
    /// settles what is left so the order is total.
    fn youngest_first(&self, helpers: Option<&Vec<usize>>) -> Vec<usize> {
        let mut helpers = helpers.cloned().unwrap_or_default();
        helpers.sort_by(|&a, &b| {
            self.admitted_at(b)
                .cmp(&self.admitted_at(a))
                .then_with(|| self.tickets[b].sequence.cmp(&self.tickets[a].sequence))
                .then_with(|| {
                    let uid = |i: usize| self.tickets[i].pod.map(|p| p.uid.as_str());
                    uid(a).cmp(&uid(b))
                })
        });
        helpers
    }

    /// When helper `h` was admitted (now, if its status does not say).
    fn admitted_at(&self, h: usize) -> Timestamp {
        self.tickets[h]
            .persisted
            .and_then(|s| s.admitted_at.as_ref())
            .map(|t| t.0)
            .unwrap_or(self.now)
    }

    /// The helper settings victim `h` is evicted under: its own class's;
    /// for a helper whose class is gone, those of class `c`, the primary's.
    /// Victims come from every class that hands out the same resource (and
    /// from helpers whose class is gone): a helper never keeps a slot a
    /// waiting primary could use, whatever its class label says.
    fn helper_spec(&self, c: usize, h: usize) -> &'a HelperSpec {
        let class = self.tickets[h].class.unwrap_or(c);
        &self.classes.list[class].info.spec.helpers
    }

    /// Marks the `chosen` helpers Preempting for primary `p` of class `c`
    /// and plans their evictions, each with its class's grace period.
    fn evict_for(&mut self, c: usize, p: usize, chosen: &[usize]) {
        let graces: Vec<u32> = chosen
            .iter()
            .map(|&h| self.helper_spec(c, h).grace_period_seconds)
            .collect();
        let primary_key = self.tickets[p].key;
        for (&h, grace) in chosen.iter().zip(graces) {
            let t = &mut self.tickets[h];
            t.phase = LeasePhase::Preempting;
            t.preempted_by = Some(PreemptedBy::Primary(primary_key));
            t.serves = Some(p);
            t.message = Message::Preempting(Some(PreemptedBy::Primary(primary_key)));
            let key = t.key.clone();
            let pod_uid = t.pod.map(|p| p.uid.clone()).unwrap_or_default();
            // The lease may not show an earlier, refused eviction (its
            // status write was lost), yet the refusal still stands.
            let (delete, not_before) = self.note_blocked_eviction(h, grace);
            self.plan.evictions.push(Eviction {
                key,
                pod_uid,
                for_primary: primary_key.clone(),
                grace_period_seconds: grace,
                delete,
                not_before,
            });
        }
    }

    /// The grace period a helper is evicted with: its class's, or for a
    /// helper whose class is gone, that of the class of the primary it was
    /// preempted for (else the API's default).
    fn grace_of(&self, t: &Ticket<'_>) -> u32 {
        if let Some(c) = t.class {
            return self.classes.list[c].info.spec.helpers.grace_period_seconds;
        }
        let primary_class = match t.preempted_by {
            Some(PreemptedBy::Persisted(k)) => match self.find_ticket(k) {
                Some(p) => self.tickets[p].class,
                None => self.retired_class(k),
            },
            Some(PreemptedBy::Primary(k)) => self
                .find_ticket(&k.to_string())
                .and_then(|p| self.tickets[p].class),
            None => None,
        };
        primary_class
            .map(|c| &self.classes.list[c].info.spec.helpers)
            .map_or_else(
                || {
                    gpupool_api::GpuLeaseClassSpec::default()
                        .helpers
                        .grace_period_seconds
                },
                |h| h.grace_period_seconds,
            )
    }

    /// Evictions of helpers already Preempting whose pods do not show the
    /// deletion yet: the earlier eviction was refused (e.g. by a
    /// PodDisruptionBudget) or lost, so it is asked for again. A lease whose
    /// last eviction a PodDisruptionBudget refused says so, and the pass
    /// asks to run again [`EVICTION_RETRY`] later.
    pub fn retry_evictions(&mut self) {
        let mut retries = Vec::new();
        for (i, t) in self.tickets.iter().enumerate() {
            if t.phase != LeasePhase::Preempting || t.pod.is_none_or(|p| p.terminating) {
                continue;
            }
            let for_primary = match t.preempted_by {
                Some(PreemptedBy::Persisted(k)) => k
                    .split_once('/')
                    .map(|(ns, n)| super::model::ObjectKey::new(ns, n)),
                Some(PreemptedBy::Primary(k)) => Some(k.clone()),
                None => None,
            };
            let Some(for_primary) = for_primary else {
                continue;
            };
            retries.push((i, for_primary));
        }
        for (i, for_primary) in retries {
            let grace_period_seconds = self.grace_of(&self.tickets[i]);
            let (delete, not_before) = self.note_blocked_eviction(i, grace_period_seconds);
            let t = &self.tickets[i];
            self.plan.evictions.push(Eviction {
                key: t.key.clone(),
                pod_uid: t.pod.map(|p| p.uid.clone()).unwrap_or_default(),
                for_primary,
                grace_period_seconds,
                delete,
                not_before,
            });
        }
    }

    /// When a PodDisruptionBudget refused the last eviction of helper `i`,
    /// its lease says so, the eviction is asked for again [`EVICTION_RETRY`]
    /// after that refusal (the second value: not before), and the pass asks
    /// to run then. Once the refusals have lasted `grace_period_seconds` the
    /// budget has delayed the preemption as long as it may: the first value
    /// says to delete the pod, at once.
    fn note_blocked_eviction(
        &mut self,
        i: usize,
        grace_period_seconds: u32,
    ) -> (bool, Option<Timestamp>) {
        let Some(refusals) = self
            .view
            .blocked_evictions
            .get(self.tickets[i].key)
            .copied()
        else {
            return (false, None);
        };
        let bound = SignedDuration::from_secs(i64::from(grace_period_seconds));
        if self.now.duration_since(refusals.first) >= bound {
            return (true, None);
        }
        let t = &mut self.tickets[i];
        t.message = Message::EvictionBlocked(t.preempted_by);
        // Asked for now when the retry time has come, else at that time;
        // either way a pass is due within EVICTION_RETRY.
        let not_before = refusals
            .last
            .checked_add(EVICTION_RETRY)
            .ok()
            .filter(|at| *at > self.now);
        self.wake_at(not_before.or_else(|| self.now.checked_add(EVICTION_RETRY).ok()));
        self.wake_at(refusals.first.checked_add(bound).ok());
        (false, not_before)
    }

    /// Asks for a pass at `at` unless one is due earlier.
    pub fn wake_at(&mut self, at: Option<Timestamp>) {
        let Some(at) = at.filter(|at| *at > self.now) else {
            return;
        };
        self.plan.wake_at = Some(self.plan.wake_at.map_or(at, |w| w.min(at)));
    }

    /// Asks for a pass when the first helper's `minRuntimeSeconds`
    /// protection ends: no watch event would otherwise say that it may now
    /// be preempted.
    pub fn wake_at_protection_expiry(&mut self) {
        let ends = self
            .tickets
            .iter()
            .filter(|t| t.role == Role::Helper && t.phase.holds_slots())
            .filter(|t| t.phase != LeasePhase::Preempting)
            .filter_map(|t| {
                // A helper whose class is gone is protected by the class of
                // the primary it would make room for; the resync pass covers it.
                let secs = self.classes.list[t.class?]
                    .info
                    .spec
                    .helpers
                    .min_runtime_seconds;
                let since = t.persisted?.admitted_at.as_ref()?.0;
                (secs > 0)
                    .then(|| {
                        since
                            .checked_add(SignedDuration::from_secs(i64::from(secs)))
                            .ok()
                    })
                    .flatten()
            })
            .filter(|end| *end > self.now)
            .min();
        self.wake_at(ends);
    }
}
