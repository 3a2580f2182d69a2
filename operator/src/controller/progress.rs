//! The budgeted writer of queue progress: lease status changes that change
//! no phase (a new position, a new "why it waits" message).
//!
//! When the head of a long queue moves, every queued lease's position
//! changes. Writing them all before the next pass would put every admission
//! behind thousands of status writes, so the decision loop hands them here
//! and goes on: admissions and evictions never wait for them. The writer
//! keeps the latest wanted status per lease (a newer one replaces an older
//! one not yet written), writes the front of the queue first, and spends at
//! most a fixed number of writes per second. Each write carries the
//! resourceVersion it was decided on, so it can never overwrite a newer
//! phase; a refused or failed write is dropped, and the next pass offers it
//! again if it is still wanted. The patch body is built only when the write
//! is made, from the latest wanted status and the lease it was decided on:
//! a pass that moves 10,000 positions hands over 10,000 statuses, not
//! 10,000 JSON documents, and a status replaced before its turn costs
//! nothing.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gpupool_api::{GpuLease, GpuLeaseStatus};
use kube::Api;
use kube::api::{Patch, PatchParams};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use serde_json::Value;
use tokio::sync::Notify;

use super::patch;
use crate::engine::ObjectKey;

/// Writes at most this many at once, so a slow API server cannot pile up
/// requests.
const IN_FLIGHT: usize = 8;

/// Progress waiting to be written (`T` per lease), in priority order,
/// within a write budget. Pure: time is passed in.
#[derive(Debug)]
pub struct ProgressQueue<T> {
    pending: HashMap<ObjectKey, (u32, T)>,
    order: BTreeSet<(u32, ObjectKey)>,
    rate: f64,
    tokens: f64,
    last: Option<Instant>,
}

impl<T> ProgressQueue<T> {
    /// A queue spending at most `per_second` writes per second (and at most
    /// that many in a burst).
    pub fn new(per_second: u32) -> Self {
        let rate = f64::from(per_second.max(1));
        Self {
            pending: HashMap::new(),
            order: BTreeSet::new(),
            rate,
            tokens: rate,
            last: None,
        }
    }

    /// Wants `item` written for `key`; `priority` orders the writes, lowest
    /// first (the position in the queue). Replaces what was waiting for `key`.
    pub fn offer(&mut self, key: ObjectKey, priority: u32, item: T) {
        if let Some((old, _)) = self.pending.get(&key) {
            self.order.remove(&(*old, key.clone()));
        }
        self.order.insert((priority, key.clone()));
        self.pending.insert(key, (priority, item));
    }

    /// Forgets what waits for `key` (its status was just written in full).
    pub fn forget(&mut self, key: &ObjectKey) {
        if let Some((priority, _)) = self.pending.remove(key) {
            self.order.remove(&(priority, key.clone()));
        }
    }

    /// The most urgent write, if the budget allows one at `now`.
    pub fn take(&mut self, now: Instant) -> Option<(ObjectKey, T)> {
        self.refill(now);
        if self.tokens < 1.0 {
            return None;
        }
        let (_, key) = self.order.pop_first()?;
        let (_, item) = self.pending.remove(&key)?;
        self.tokens -= 1.0;
        Some((key, item))
    }

    /// When the budget next allows a write, if anything waits.
    pub fn next_at(&mut self, now: Instant) -> Option<Instant> {
        if self.order.is_empty() {
            return None;
        }
        self.refill(now);
        let missing = (1.0 - self.tokens).max(0.0);
        Some(now + Duration::from_secs_f64(missing / self.rate))
    }

    /// Writes waiting.
    pub fn len(&self) -> usize {
        self.pending.len()
    }

    /// True when nothing waits.
    pub fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }

    fn refill(&mut self, now: Instant) {
        if let Some(last) = self.last {
            let gained = now.saturating_duration_since(last).as_secs_f64() * self.rate;
            self.tokens = (self.tokens + gained).min(self.rate);
        }
        self.last = Some(now);
    }
}

/// The writer's metrics: `gpupool_operator_progress_pending` (writes
/// waiting) and `gpupool_operator_progress_writes_total{result}` (written,
/// conflict, gone, failed).
#[derive(Clone, Debug, Default)]
pub struct ProgressMetrics {
    /// Writes waiting.
    pub pending: Gauge,
    /// Writes done, by result.
    pub writes: Family<ResultLabel, Counter>,
}

/// Label of [`ProgressMetrics::writes`].
#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
pub struct ResultLabel {
    /// written, conflict, gone or failed.
    pub result: &'static str,
}

impl ProgressMetrics {
    /// Metrics registered in `registry` under `gpupool_operator`.
    pub fn register(registry: &mut prometheus_client::registry::Registry) -> Self {
        let m = Self::default();
        let r = registry.sub_registry_with_prefix("gpupool_operator");
        r.register(
            "progress_pending",
            "Lease position and message updates waiting for the write budget",
            m.pending.clone(),
        );
        r.register(
            "progress_writes",
            "Lease position and message updates written, by result",
            m.writes.clone(),
        );
        m
    }
}

/// A status wanted for a lease, and the lease as it was when the status was
/// decided (its status is what the patch changes; its resourceVersion is the
/// write's precondition).
#[derive(Debug, Clone)]
pub struct Wanted {
    /// The lease the status was decided on.
    pub lease: Arc<GpuLease>,
    /// The status wanted.
    pub status: GpuLeaseStatus,
}

impl Wanted {
    /// The merge patch to write, or `None` when the lease already says it.
    pub fn body(&self) -> Option<Value> {
        let old = self.lease.status.as_ref();
        patch::lease_status_differs(old, &self.status).then(|| {
            patch::lease_status_patch(
                old,
                &self.status,
                self.lease.metadata.resource_version.as_deref(),
            )
        })
    }
}

/// Hands progress to the writing task; cheap to clone.
#[derive(Clone)]
pub struct ProgressWriter {
    queue: Arc<Mutex<ProgressQueue<Wanted>>>,
    wake: Arc<Notify>,
}

impl ProgressWriter {
    /// Starts the writing task, spending at most `per_second` writes per
    /// second through `client`. The task ends when every handle is dropped.
    pub fn spawn(client: kube::Client, per_second: u32, metrics: ProgressMetrics) -> Self {
        let writer = Self {
            queue: Arc::new(Mutex::new(ProgressQueue::new(per_second))),
            wake: Arc::new(Notify::new()),
        };
        let queue = Arc::downgrade(&writer.queue);
        let wake = writer.wake.clone();
        tokio::spawn(async move {
            let slots = Arc::new(tokio::sync::Semaphore::new(IN_FLIGHT));
            loop {
                let Some(queue) = queue.upgrade() else {
                    return;
                };
                let now = Instant::now();
                let (next, wait_until, pending) = {
                    let mut q = lock(&queue);
                    let next = q.take(now);
                    let wait = if next.is_none() { q.next_at(now) } else { None };
                    (next, wait, q.len())
                };
                drop(queue);
                metrics
                    .pending
                    .set(i64::try_from(pending).unwrap_or(i64::MAX));
                let Some((key, wanted)) = next else {
                    match wait_until {
                        Some(at) => {
                            tokio::select! {
                                () = tokio::time::sleep_until(at.into()) => {}
                                () = wake.notified() => {}
                            }
                        }
                        None => wake.notified().await,
                    }
                    continue;
                };
                // The one place the body is built: at write time, for the
                // latest status wanted.
                let Some(body) = wanted.body() else {
                    continue;
                };
                let Ok(permit) = slots.clone().acquire_owned().await else {
                    return;
                };
                let api: Api<GpuLease> = Api::namespaced(client.clone(), &key.namespace);
                let metrics = metrics.clone();
                tokio::spawn(async move {
                    let params = PatchParams {
                        field_manager: Some(gpupool_api::names::FIELD_MANAGER_OPERATOR.to_owned()),
                        ..Default::default()
                    };
                    let result = match api
                        .patch_status(&key.name, &params, &Patch::Merge(&body))
                        .await
                    {
                        Ok(_) => "written",
                        Err(kube::Error::Api(s)) if s.code == 409 => "conflict",
                        Err(kube::Error::Api(s)) if s.code == 404 => "gone",
                        Err(error) => {
                            tracing::debug!(lease = %key, %error, "progress write failed; the next pass offers it again");
                            "failed"
                        }
                    };
                    metrics.writes.get_or_create(&ResultLabel { result }).inc();
                    drop(permit);
                });
            }
        });
        writer
    }

    /// Wants `wanted` written for `key` at `priority` (lowest first).
    pub fn offer(&self, key: ObjectKey, priority: u32, wanted: Wanted) {
        lock(&self.queue).offer(key, priority, wanted);
        self.wake.notify_one();
    }

    /// Forgets what waits for `key`.
    pub fn forget(&self, key: &ObjectKey) {
        lock(&self.queue).forget(key);
    }
}

fn lock<T>(queue: &Mutex<ProgressQueue<T>>) -> std::sync::MutexGuard<'_, ProgressQueue<T>> {
    // A panic while holding the lock leaves a queue that is still consistent
    // enough to keep writing from: every method leaves both maps in step.
    match queue.lock() {
        Ok(q) => q,
        Err(poisoned) => poisoned.into_inner(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn key(name: &str) -> ObjectKey {
        ObjectKey::new("ns", name)
    }

    #[test]
    fn the_front_of_the_queue_goes_first_and_the_latest_offer_wins() {
        let mut q = ProgressQueue::new(100);
        let t0 = Instant::now();
        q.offer(key("c"), 30, json!(3));
        q.offer(key("a"), 10, json!(1));
        q.offer(key("b"), 20, json!(2));
        // b moved to the front before its write: one write, the latest one.
        q.offer(key("b"), 5, json!("b-latest"));
        assert_eq!(q.len(), 3);
        let order: Vec<(String, Value)> = std::iter::from_fn(|| q.take(t0))
            .map(|(k, v)| (k.name, v))
            .collect();
        assert_eq!(
            order,
            [
                ("b".to_owned(), json!("b-latest")),
                ("a".to_owned(), json!(1)),
                ("c".to_owned(), json!(3))
            ]
        );
        assert!(q.is_empty());
    }

    #[test]
    fn the_budget_caps_writes_per_second() {
        let mut q = ProgressQueue::new(2);
        let t0 = Instant::now();
        for i in 0..5 {
            q.offer(key(&format!("l{i}")), i, json!(i));
        }
        assert!(q.take(t0).is_some());
        assert!(q.take(t0).is_some());
        assert!(q.take(t0).is_none(), "two writes per second, no more");
        let next = q.next_at(t0).expect("more waits");
        assert_eq!(next.duration_since(t0), Duration::from_millis(500));
        assert!(q.take(t0 + Duration::from_millis(499)).is_none());
        assert!(q.take(t0 + Duration::from_millis(500)).is_some());
        // A long idle spell does not save up more than one second's budget.
        let later = t0 + Duration::from_secs(60);
        assert!(q.take(later).is_some());
        assert!(q.take(later).is_some());
        assert!(q.take(later).is_none());
        assert!(q.is_empty());
        assert_eq!(q.next_at(later), None);
    }

    #[test]
    fn the_body_is_built_from_the_latest_status_against_the_lease_it_was_decided_on() {
        use gpupool_api::{GpuLeaseSpec, LeasePhase};
        let persisted = GpuLeaseStatus {
            phase: LeasePhase::Queued,
            position: Some(7),
            message: Some("waiting: 6 primaries ahead".into()),
            ..GpuLeaseStatus::default()
        };
        let spec = GpuLeaseSpec {
            class_name: "default".into(),
            pod_name: "l".into(),
            pod_uid: "u".into(),
            role: gpupool_api::Role::Primary,
            slots: 1,
        };
        let mut lease = GpuLease::new("l", spec);
        lease.metadata.resource_version = Some("42".into());
        lease.status = Some(persisted.clone());
        let lease = Arc::new(lease);
        let unchanged = Wanted {
            lease: lease.clone(),
            status: persisted.clone(),
        };
        assert_eq!(unchanged.body(), None, "nothing to write");

        let mut q = ProgressQueue::new(10);
        let moved = |position: u32| Wanted {
            lease: lease.clone(),
            status: GpuLeaseStatus {
                position: Some(position),
                ..persisted.clone()
            },
        };
        q.offer(key("l"), 6, moved(6));
        q.offer(key("l"), 5, moved(5));
        let (_, wanted) = q.take(Instant::now()).expect("one write");
        let body = wanted.body().expect("the position moved");
        assert_eq!(body["status"]["position"], json!(5), "the latest offer");
        assert_eq!(body["metadata"]["resourceVersion"], json!("42"));
        assert!(q.is_empty());
    }

    #[test]
    fn a_full_status_write_forgets_the_progress_waiting_for_it() {
        let mut q = ProgressQueue::new(10);
        q.offer(key("a"), 1, json!(1));
        q.offer(key("b"), 2, json!(2));
        q.forget(&key("a"));
        q.forget(&key("never-offered"));
        assert_eq!(
            q.take(Instant::now()).map(|(k, _)| k.name),
            Some("b".into())
        );
        assert!(q.is_empty());
    }
}
