//! The controller: caches, decision passes and applying their plans.
//!
//! One pass at a time decides every class (DESIGN §5.9): it snapshots the
//! watch caches with the controller's own unconfirmed writes laid over them
//! ([`overlay`]), asks the engine for a plan, and applies it. Changes that
//! arrive during a pass are coalesced into one following pass. Only the
//! leader passes; losing leadership aborts the pass in flight.

pub mod apply;
pub mod cached_pod;
pub mod caches;
pub mod error;
pub mod events;
pub mod kept;
pub mod overlay;
pub mod patch;
pub mod progress;
pub mod translate;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpupool_api::{LeasePhase, Role};
use jiff::Timestamp;
use kube::Client;
use tokio::sync::{Notify, watch};

use crate::engine::Engine;
use crate::metrics::{Health, Metrics};

pub use apply::Applier;
pub use caches::Caches;
pub use error::Error;
pub use kept::{Kept, PassInput};

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

/// Earliest moment a helper's minRuntimeSeconds protection ends, so a pass
/// runs then and may preempt it (no event would otherwise trigger one).
pub fn next_protection_expiry(engine: &Engine) -> Option<Timestamp> {
    let min_runtime: BTreeMap<&str, u32> = engine
        .classes()
        .values()
        .filter(|c| c.spec.helpers.min_runtime_seconds > 0)
        .map(|c| (c.name.as_str(), c.spec.helpers.min_runtime_seconds))
        .collect();
    if min_runtime.is_empty() {
        return None;
    }
    engine
        .leases()
        .values()
        .filter(|l| l.spec.role == Role::Helper)
        .filter_map(|l| {
            let status = l.status.as_ref()?;
            if !matches!(status.phase, LeasePhase::Admitted | LeasePhase::Bound) {
                return None;
            }
            let secs = *min_runtime.get(l.spec.class_name.as_str())?;
            let since = status.admitted_at.as_ref()?.0;
            let end = since
                .checked_add(jiff::SignedDuration::from_secs(i64::from(secs)))
                .ok()?;
            (end > engine.now()).then_some(end)
        })
        .min()
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
    while !health.webhook_serving() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let sink = events::EventSink::spawn(client.clone(), config.instance.clone(), metrics.clone());
    let progress = progress::ProgressWriter::spawn(
        client.clone(),
        config.status_writes_per_second,
        config.progress_metrics.clone(),
    );
    let mut applier = Applier::new(client, metrics.clone(), sink, progress);
    let mut overlay = overlay::Overlay::default();
    let mut kept = Kept::default();
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
            let lost = async {
                loop {
                    if leader.changed().await.is_err() || !*leader.borrow() {
                        return;
                    }
                }
            };
            tokio::select! {
                biased;
                () = lost => break,
                () = changed.notified() => {}
                () = tokio::time::sleep_until(wake.into()) => {}
            }
            let outcome = tokio::select! {
                biased;
                () = async {
                    loop {
                        if leader.changed().await.is_err() || !*leader.borrow() {
                            return;
                        }
                    }
                } => None,
                o = pass(&caches, &mut kept, &mut overlay, &mut applier, &metrics, &config) => Some(o),
            };
            let Some(outcome) = outcome else {
                tracing::warn!("lost leadership during a pass; stopped writing");
                break;
            };
            health.set_pass_done();
            let now = Instant::now();
            let mut next = now + config.resync;
            if outcome.failed {
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
        metrics.leader.set(0);
        health.set_leading(false);
    }
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
    kept: &mut Kept,
    overlay: &mut overlay::Overlay,
    applier: &mut Applier,
    metrics: &Metrics,
    config: &LoopConfig,
) -> PassOutcome {
    let started = Instant::now();
    let now = Timestamp::now();
    let input = kept.sync(caches, overlay, &config.unmanaged_namespaces, now, started);
    let plan = input.engine.decide();
    tracing::debug!(
        pods = input.engine.pods().len(),
        leases = input.engine.leases().len(),
        creates = plan.create_leases.len(),
        deletes = plan.delete_leases.len(),
        admissions = plan.admissions.len(),
        evictions = plan.evictions.len(),
        lease_statuses = plan.lease_statuses.len(),
        lease_progress = plan.lease_progress.len(),
        "decided"
    );
    let outcome = applier.apply(plan, &input, overlay).await;
    let recreation = overlay.next_recreation(Instant::now());
    let protection = next_protection_expiry(input.engine).map(|t| {
        let wait = t.duration_since(now).unsigned_abs();
        // A little past the end, so the pass sees the helper as unprotected.
        Instant::now() + wait + Duration::from_millis(50)
    });
    metrics
        .pass_duration
        .observe(started.elapsed().as_secs_f64());
    PassOutcome {
        failed: outcome.failed,
        wake_at: [outcome.wake_at, protection, recreation]
            .into_iter()
            .flatten()
            .min(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{ClassInfo, LeaseInfo, ObjectKey, Snapshot};
    use gpupool_api::{GpuLeaseClassSpec, GpuLeaseSpec, GpuLeaseStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    fn helper(name: &str, class: &str, phase: LeasePhase, admitted: i64) -> LeaseInfo {
        LeaseInfo {
            key: ObjectKey::new("ns", name),
            spec: GpuLeaseSpec {
                class_name: class.into(),
                pod_name: name.into(),
                pod_uid: "u".into(),
                role: Role::Helper,
                slots: 1,
            },
            status: Some(GpuLeaseStatus {
                phase,
                admitted_at: Some(Time(Timestamp::from_second(admitted).expect("t"))),
                ..Default::default()
            }),
            missing: false,
        }
    }

    #[test]
    fn protection_expiry_is_the_earliest_young_helper() {
        let mut spec = GpuLeaseClassSpec::default();
        spec.helpers.min_runtime_seconds = 60;
        let snap = Snapshot {
            now: Timestamp::from_second(1_000).expect("t"),
            classes: vec![
                ClassInfo {
                    name: "slow".into(),
                    generation: None,
                    created_at: None,
                    spec,
                    status: None,
                },
                ClassInfo {
                    name: "plain".into(),
                    generation: None,
                    created_at: None,
                    spec: GpuLeaseClassSpec::default(),
                    status: None,
                },
            ],
            leases: vec![
                helper("old", "slow", LeasePhase::Bound, 900),
                helper("young", "slow", LeasePhase::Admitted, 980),
                helper("younger", "slow", LeasePhase::Bound, 990),
                helper("gone", "slow", LeasePhase::Released, 999),
                helper("other", "plain", LeasePhase::Bound, 999),
            ],
            ..Default::default()
        };
        assert_eq!(
            next_protection_expiry(&Engine::from_snapshot(&snap)),
            Some(Timestamp::from_second(1_040).expect("t"))
        );
        let none = Snapshot {
            classes: vec![],
            ..snap
        };
        assert_eq!(next_protection_expiry(&Engine::from_snapshot(&none)), None);
    }
}
