//! FIFO tickets (DESIGN §5.2): a lease's sequence is its pod's
//! `gpupool.io/enqueued-at` stamp in microseconds since the Unix epoch (its
//! creationTimestamp when it has no stamp). Leases wait in (sequence,
//! namespace/name) order, so a pod's place follows its stamp whatever
//! becomes of its lease: a lease deleted, or lost while the operator was
//! down, is created again with the same sequence and takes the same place,
//! never behind pods created after it. A sequence, once persisted, never
//! changes.
//!
//! Only the webhook writes the stamp, and nobody may change it afterwards
//! (DESIGN §5.10), so a tenant cannot choose a place.

use gpupool_api::LeasePhase;
use jiff::Timestamp;

use super::pass::Pass;

/// The sequence of a pod enqueued at `stamp`: microseconds since the Unix
/// epoch (0 for a stamp before it). Below 2^53 until the year 2255, so
/// every JSON reader reads it exactly.
pub fn sequence_of(stamp: Timestamp) -> u64 {
    u64::try_from(stamp.as_microsecond()).unwrap_or(0)
}

impl Pass<'_> {
    /// Gives every ticket without a sequence its pod's.
    pub fn assign_sequences(&mut self) {
        for t in &mut self.tickets {
            if t.sequence.is_some() || t.phase == LeasePhase::Released {
                continue;
            }
            if let Some(p) = t.pod {
                t.sequence = Some(sequence_of(p.enqueued_at.unwrap_or(p.created_at)));
            }
        }
    }
}
