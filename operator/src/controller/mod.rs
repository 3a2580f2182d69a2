//! The controller: decision passes over the index, and applying their plans.
//!
//! One pass at a time decides every class (DESIGN §5.9): it snapshots the
//! watch caches ([`crate::index`]) with the controller's own writes that
//! they do not show yet, answered or in flight, laid over them
//! ([`own_writes`]), asks the engine for a plan, and applies it. A pass waits
//! for its admissions only; its other writes run in the background, and
//! each answer wakes the loop like a watch event. Changes that arrive
//! during a pass are coalesced into one following pass. Only the leader
//! passes; losing leadership aborts the pass and every write in flight.

pub mod apply;
pub mod engine_state;
pub mod error;
pub mod events;
pub mod own_writes;
pub mod patch;
pub mod progress;
#[cfg(test)]
mod test_api;
mod ungate;

use std::sync::Arc;
use std::time::{Duration, Instant};

use jiff::Timestamp;
use kube::Client;
use tokio::sync::{Notify, watch};

use crate::index::Caches;
use crate::metrics::{Health, Metrics};

pub use apply::Applier;
pub use engine_state::{EngineState, PassInput};
pub use error::Error;

/// How long the progress writer takes to spend one pass's batch (a second
/// of its budget).
const PROGRESS_BATCH_PERIOD: Duration = Duration::from_secs(1);

/// Shortest and longest wait before retrying a pass whose writes failed.
const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(10);

/// Why the controller stopped.
#[derive(Debug, thiserror::Error)]
pub enum ControllerError {
    /// A watch cache's writer went away before the first list (its task died).
    #[error("a watch cache stopped before its first list arrived")]
    CacheNeverSynced,
    /// The leader-election task went away.
    #[error("leader election stopped")]
    LeadershipLost,
}

/// Settings of the decision loop.
#[derive(Debug, Clone)]
pub struct LoopConfig {
    /// Period of the safety-net pass when nothing changes.
    pub resync: Duration,
    /// This replica's name in events.
    pub instance: String,
    /// Namespaces the webhook never sees: their pods are counted, never queued.
    pub unmanaged_namespaces: Vec<String>,
    /// Budget of the progress writer (position and message updates per second).
    pub status_writes_per_second: u32,
    /// The progress writer's metrics.
    pub progress_metrics: progress::ProgressMetrics,
}

/// Runs the decision loop until leadership is lost for good or the caches die.
/// Passes run only while `leader` is true.
pub async fn run(
    client: Client,
    caches: Caches,
    changed: Arc<Notify>,
    mut leader: watch::Receiver<bool>,
    metrics: Metrics,
    health: Arc<Health>,
    config: LoopConfig,
) -> Result<(), ControllerError> {
    caches
        .wait_synced()
        .await
        .map_err(|_| ControllerError::CacheNeverSynced)?;
    health.set_synced();
    tracing::info!("caches synced");
    // The operator's own lease writes go through its lease webhook on API
    // servers that do not evaluate match conditions; deciding before this
    // replica's webhook serves would only make them fail.
    health.webhook_serves().await;
    let sink = events::EventSink::spawn(client.clone(), config.instance.clone(), metrics.clone());
    let mut own_writes = own_writes::OwnWrites::default();
    let progress = progress::ProgressWriter::spawn(
        client.clone(),
        config.status_writes_per_second,
        config.progress_metrics.clone(),
        own_writes.progress_records(),
    );
    let mut applier = Applier::new(client, metrics.clone(), sink, progress);
    let mut engine_state = EngineState::default();
    let mut backoff = BACKOFF_MIN;
    loop {
        // Wait to lead.
        while !*leader.borrow_and_update() {
            metrics.leader.set(0);
            health.set_leading(false);
            leader
                .changed()
                .await
                .map_err(|_| ControllerError::LeadershipLost)?;
        }
        metrics.leader.set(1);
        health.set_leading(true);
        tracing::info!("leading: deciding admissions");
        let mut wake = Instant::now();
        loop {
            let mut background_failed = false;
            tokio::select! {
                biased;
                () = leadership_lost(&mut leader) => break,
                // A background write's answer is a change like any other:
                // the objects it was for may be decided again.
                finished = applier.next_finished_write() => {
                    background_failed =
                        record_finished_write(&mut applier, finished, &mut engine_state, &mut own_writes);
                }
                () = changed.notified() => {}
                () = tokio::time::sleep_until(wake.into()) => {}
            }
            while let Some(finished) = applier.try_finished_write() {
                background_failed |= record_finished_write(
                    &mut applier,
                    finished,
                    &mut engine_state,
                    &mut own_writes,
                );
            }
            let outcome = tokio::select! {
                biased;
                () = leadership_lost(&mut leader) => None,
                o = pass(&caches, &mut engine_state, &mut own_writes, &mut applier, &metrics, &config) => Some(o),
            };
            let Some(outcome) = outcome else {
                tracing::warn!("lost leadership during a pass; stopped writing");
                break;
            };
            health.set_pass_done();
            let now = Instant::now();
            let mut next = now + config.resync;
            if outcome.failed || background_failed {
                next = next.min(now + backoff);
                backoff = (backoff * 2).min(BACKOFF_MAX);
            } else {
                backoff = BACKOFF_MIN;
            }
            if let Some(at) = outcome.wake_at {
                next = next.min(at);
            }
            wake = next;
        }
        // A replica that does not lead writes nothing, not even what it
        // started while it led.
        applier.abandon(&mut own_writes);
        metrics.leader.set(0);
        health.set_leading(false);
    }
}

/// Returns once this replica no longer leads, or leader election has
/// stopped; pending while it leads.
async fn leadership_lost(leader: &mut watch::Receiver<bool>) {
    loop {
        if leader.changed().await.is_err() || !*leader.borrow() {
            return;
        }
    }
}

/// Records a background write's answer (eviction answers go to the engine);
/// true when it failed.
fn record_finished_write(
    applier: &mut Applier,
    finished: apply::FinishedWrite,
    engine_state: &mut EngineState,
    own_writes: &mut own_writes::OwnWrites,
) -> bool {
    let outcome = applier.record_finished_write(finished, own_writes);
    engine_state.record_eviction_answers(&outcome.evictions);
    outcome.failed
}

/// What a pass left to do.
pub struct PassOutcome {
    /// Some write failed: retry with backoff.
    pub failed: bool,
    /// Something is due later (a deferred class status, a protection expiry).
    pub wake_at: Option<Instant>,
}

async fn pass(
    caches: &Caches,
    engine_state: &mut EngineState,
    own_writes: &mut own_writes::OwnWrites,
    applier: &mut Applier,
    metrics: &Metrics,
    config: &LoopConfig,
) -> PassOutcome {
    let started = Instant::now();
    let now = Timestamp::now();
    // A pass hands the progress writer what its budget allows now (at most
    // a second of it), front of the queue first: a lease further back is
    // offered by a later pass, with what it wants then. Passes that follow
    // each other closely thus build a few statuses each, not a second's.
    engine_state.set_progress_limit(applier.progress_room());
    let input = engine_state.sync(
        caches,
        own_writes,
        &config.unmanaged_namespaces,
        now,
        started,
    );
    let plan = input.engine.decide();
    tracing::debug!(
        pods = input.engine.pod_count(),
        leases = input.engine.lease_count(),
        inert = input.engine.inert_count(),
        parked = input.engine.parked_count(),
        quiet_primaries = input.engine.quiet_primary_count(),
        creates = plan.create_leases.len(),
        deletes = plan.delete_leases.len(),
        admissions = plan.admissions.len(),
        evictions = plan.evictions.len(),
        give_backs = plan.give_backs.len(),
        lease_statuses = plan.lease_statuses.len(),
        lease_progress = plan.lease_progress.len(),
        class_writes = plan.class_writes.len(),
        "decided"
    );
    // The engine's own wake-up (a class status held back, a helper's
    // protection ending, a refused eviction's retry), a little past the
    // time, so the pass that runs then sees it as passed.
    let due = plan.wake_at.map(|t| {
        let wait = t.duration_since(now).unsigned_abs();
        started + wait + Duration::from_millis(50)
    });
    // More progress waits than this pass handed over: the next batch once
    // the writer has spent a second of its budget.
    let more_progress = plan
        .progress_truncated
        .then(|| started + PROGRESS_BATCH_PERIOD);
    let evictions = plan.evictions.clone();
    let outcome = applier.apply(plan, &input, own_writes).await;
    engine_state.forget_unwanted_evictions(&evictions);
    engine_state.record_eviction_answers(&outcome.evictions);
    let recreation = own_writes.next_recreation(Instant::now());
    metrics
        .pass_duration
        .observe(started.elapsed().as_secs_f64());
    PassOutcome {
        failed: outcome.failed,
        wake_at: [due, recreation, more_progress].into_iter().flatten().min(),
    }
}
