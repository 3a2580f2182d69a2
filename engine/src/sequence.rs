//! FIFO tickets (DESIGN §5.2): one global counter above every sequence any
//! lease carries, handed out in (enqueued-at, creationTimestamp,
//! namespace/name) order. A sequence, once persisted, never changes.

use gpupool_api::LeasePhase;

use super::pass::Pass;

impl Pass<'_> {
    /// Gives every ticket without a sequence the next ones, in queue order.
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
        // Above every persisted sequence, the stale leases' included.
        let highest = self
            .view
            .entries
            .iter()
            .filter_map(|(_, l, _)| l.and_then(|l| l.status()).and_then(|s| s.sequence))
            .max()
            .max(self.view.set_apart_highest)
            .unwrap_or(0);
        pending.sort_by(|&a, &b| {
            let (a, b) = (&self.tickets[a], &self.tickets[b]);
            let stamp = |t: &super::pass::Ticket<'_>| {
                t.pod
                    .map(|p| (p.enqueued_at.unwrap_or(p.created_at), p.created_at))
            };
            stamp(a).cmp(&stamp(b)).then_with(|| a.key.cmp(b.key))
        });
        for (n, i) in pending.into_iter().enumerate() {
            self.tickets[i].sequence = Some(highest + 1 + n as u64);
        }
    }
}
