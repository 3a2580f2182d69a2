//! The admission engine: pure, deterministic FIFO/helper decisions (DESIGN §5).
//!
//! It reads a [`Snapshot`] and returns a [`Plan`]; it performs no I/O and
//! never reads a clock, so the same snapshot always yields the same plan.
//! A caller that sees the cluster change object by object keeps an
//! [`Engine`] instead and updates it per change: its passes run the same
//! rules over the kept, already ordered state.

mod cached;
mod capacity;
mod classes;
mod facts;
pub mod fit;
#[cfg(any(test, feature = "fixtures"))]
pub mod fixtures;
mod message;
mod quiet_primaries;
pub use message::POD_FAILED_BECAUSE;
pub mod model;
mod parked;
mod pass;
mod preempt;
mod queue;
mod room;
mod sequence;
mod set_apart;
mod small_map;
mod state;
mod status;
pub mod translate;
mod unplaced;

pub use cached::{CachedLease, CachedMeta};
pub use classes::{established_default, is_extended_resource, largest_node};
pub use model::*;
pub use room::{PodsSeen, Room, room};
pub use small_map::SmallMap;
pub use state::Engine;
pub use status::QUEUE_HEAD;

/// Decides one pass (DESIGN §5 steps 2–9) over every class at once.
///
/// Guarantees, for any snapshot: every live pod that requests a class's
/// resource has exactly one lease (created here, or after its stale lease is
/// deleted); sequences are assigned once, from the pods' stamps, above
/// every lease of the same class and role that holds slots and unlike any
/// other lease's (DESIGN §5.2); only
/// leases whose sequence is persisted are admitted; no admission takes more
/// slots than a node has free after counting every live pod bound or pinned
/// there and every lease holding slots; StrictFIFO primaries are admitted in
/// sequence order; no helper is admitted while a primary of its class waits
/// (unless `admitWhileQueued`); and slots freed by preempted helpers are held
/// for the primary they were evicted for. `lease_statuses` and
/// `lease_progress` together list only leases
/// whose wanted status differs from the persisted one.
pub fn decide(snapshot: &Snapshot) -> Plan {
    decide_until(snapshot, usize::MAX)
}

/// Runs the first `steps` steps of a pass and returns the plan so far, so a
/// benchmark can tell what each step costs (0: index classes and nodes; 1:
/// join pods and leases into tickets; 2: count leases, sequences,
/// give-backs and eviction retries; 3: the queues and readmissions; 4: lease specs; 5:
/// lease statuses; 6: class statuses).
#[cfg(feature = "fixtures")]
#[doc(hidden)]
pub fn decide_steps(snapshot: &Snapshot, steps: usize) -> Plan {
    decide_until(snapshot, steps)
}

fn decide_until(snapshot: &Snapshot, steps: usize) -> Plan {
    run_until(pass::View::of(snapshot), steps)
}

fn run_until(view: pass::View<'_>, steps: usize) -> Plan {
    pass_until(view, steps).plan
}

/// The one pass every decision runs, over a snapshot or the kept state,
/// after its first `steps` steps (all of them: `usize::MAX`).
fn pass_until(view: pass::View<'_>, steps: usize) -> pass::Pass<'_> {
    let mut pass = pass::Pass::index(view);
    if steps == 0 {
        return pass;
    }
    pass.join();
    if steps == 1 {
        return pass;
    }
    pass.count_leases();
    pass.requeue_overcommitted_redrives();
    pass.assign_sequences();
    pass.give_back_unplaceable();
    pass.retry_evictions();
    if steps == 2 {
        return pass;
    }
    pass.run_queues();
    pass.readmit();
    if steps == 3 {
        return pass;
    }
    pass.emit_lease_specs();
    if steps == 4 {
        return pass;
    }
    pass.emit_lease_statuses();
    if steps == 5 {
        return pass;
    }
    pass.emit_class_statuses();
    pass.wake_at_protection_expiry();
    pass
}
