//! Admitted pods that cannot be placed give their slots back (DESIGN
//! §5.3).
//!
//! Admission pins a pod to one node before the scheduler has looked at
//! it, and the pin cannot be taken back: a pod's scheduling gates can only
//! be removed. When the scheduler then reports that it cannot place the
//! pod (too little CPU or memory on the node, the node gone or tainted
//! since), the pod would hold its slots for good. Once the scheduler has
//! said so for the class's `placementTimeoutSeconds`, the pod is deleted:
//! its lease is released with the scheduler's reason, its controller (if
//! any) creates it again, and the queue moves on.
//!
//! Deleting is the only safe way to give the slots back. Counting them
//! free while the pinned pod lives would let the scheduler place it later
//! on a GPU another pod was admitted to.

use gpupool_api::{AdmissionSpec, LeasePhase};
use jiff::{SignedDuration, Timestamp};

use super::message::Message;
use super::model::{GiveBack, PodInfo, Unplaced};
use super::pass::{Pass, Ticket, is_live};

/// The scheduler's report on `pod` when it counts: the pod is live, not
/// being deleted, no longer gated and not bound.
pub(crate) fn unplaced(pod: &PodInfo) -> Option<&Unplaced> {
    pod.unplaced
        .as_ref()
        .filter(|_| is_live(pod) && !pod.terminating && !pod.gated && pod.node_name.is_none())
}

impl<'a> Pass<'a> {
    /// The placement timeout of ticket `t`'s class (the default when its
    /// class is gone).
    fn placement_timeout(&self, t: &Ticket<'a>) -> u32 {
        match t.class {
            Some(c) => {
                self.classes.list[c]
                    .info
                    .spec
                    .admission
                    .placement_timeout_seconds
            }
            None => AdmissionSpec::default().placement_timeout_seconds,
        }
    }

    /// Releases, and asks to delete, every admitted pod the scheduler has
    /// not been able to place for its class's placement timeout; tells the
    /// others how long they have, and asks for a pass when the first
    /// timeout ends (no watch event says that time has passed). A lease
    /// already released this way whose pod still lives asks again: the
    /// delete may have failed.
    pub fn give_back_unplaceable(&mut self) {
        let mut wake: Option<Timestamp> = None;
        for i in 0..self.tickets.len() {
            let t = &self.tickets[i];
            let Some(pod) = t.pod else { continue };
            let Some(report) = unplaced(pod) else {
                continue;
            };
            if pod.uid
                != t.lease
                    .map_or(pod.uid.as_str(), |l| l.spec().pod_uid.as_str())
            {
                continue;
            }
            let seconds = self.placement_timeout(t);
            // Kubernetes keeps a condition's lastTransitionTime while its
            // status stays False, so a pod created gated reports the time
            // it was created, however long it waited in the queue: the
            // clock starts at admission at the earliest.
            let admitted = t
                .persisted
                .and_then(|s| s.admitted_at.as_ref())
                .map(|t| t.0);
            let since = admitted.map_or(report.since, |a| a.max(report.since));
            let deadline = since
                .checked_add(SignedDuration::from_secs(i64::from(seconds)))
                .unwrap_or(Timestamp::MAX);
            let node = t.node;
            let why = report.message.as_deref();
            let t = &mut self.tickets[i];
            match t.phase {
                LeasePhase::Admitted if self.now < deadline => {
                    t.message = Message::Unplaceable {
                        node,
                        why,
                        deadline,
                    };
                    wake = Some(wake.map_or(deadline, |w| w.min(deadline)));
                    continue;
                }
                LeasePhase::Admitted => {
                    t.phase = LeasePhase::Released;
                    t.message = Message::GaveBack { node, why, seconds };
                }
                // Released by an earlier pass; the pod is still there.
                LeasePhase::Released if self.now >= deadline => {}
                _ => continue,
            }
            let mut reason = String::new();
            Message::GaveBack { node, why, seconds }.render(&self.classes, &mut reason);
            self.plan.give_backs.push(GiveBack {
                key: t.key.clone(),
                pod_uid: pod.uid.clone(),
                node: node.unwrap_or_default().to_owned(),
                reason,
            });
        }
        self.wake_at(wake);
    }
}
