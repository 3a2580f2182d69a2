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
//! a pass that moves every position of a long queue hands over statuses,
//! not JSON documents, and a status replaced before its turn costs
//! nothing.
//!
//! The writer's own writes reach the watch caches a little later than the
//! writer learns of them, so the passes in between decide on the lease as it
//! was before. Such a status is written over the lease as the writer left
//! it, or not at all when it says the same: otherwise each would be refused
//! as a conflict, or rewrite what was just written, and spend a write of the
//! budget for nothing. What the writer left is recorded with the
//! controller's other own writes ([`ProgressRecords`], in
//! [`super::own_writes`]).

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use gpupool_api::GpuLeaseStatus;
use kube::Api;
use kube::api::Patch;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use serde_json::Value;
use tokio::sync::Notify;

use super::apply::patch_params;
use super::own_writes::{Base, SharedProgressRecords};
#[cfg(doc)]
use super::own_writes::{OwnWrites, ProgressRecords};
use super::patch;
use crate::engine::{CachedLease, ObjectKey};
use crate::index::watched::WatchedLease;

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

    /// Gives back the write [`ProgressQueue::take`] spent on an item that
    /// turned out to need no write.
    pub fn refund(&mut self) {
        self.tokens = (self.tokens + 1.0).min(self.rate);
    }

    /// How many writes the budget allows at `now`: what a pass need hand
    /// over, since a lease further back is offered again by a later pass
    /// with whatever it then wants.
    pub fn room(&mut self, now: Instant) -> usize {
        self.refill(now);
        self.tokens.max(0.0).floor() as usize
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

/// At most this many statuses that need no write are passed over while the
/// queue and the records are locked, so a pass offering its batch, or
/// taking a lease over from the records, never waits long for them.
const SKIPS_PER_LOCK: usize = 64;

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
    pub lease: Arc<CachedLease>,
    /// The status wanted.
    pub status: GpuLeaseStatus,
}

impl Wanted {
    /// The resourceVersion the status was decided on.
    pub fn decided_on(&self) -> Option<&str> {
        self.lease.metadata.resource_version.as_deref()
    }

    /// The merge patch to write, or `None` when the lease already says it:
    /// over the lease it was decided on, or over `base` when the writer's
    /// own writes moved the lease on.
    pub fn body(&self, base: Option<Base<'_>>) -> Option<Value> {
        let Some(base) = base else {
            let old = self.lease.status.as_ref();
            return patch::lease_status_differs(old, &self.status)
                .then(|| patch::lease_status_patch(old, &self.status, self.decided_on()));
        };
        let old = base.status_over(self.lease.status.as_ref());
        patch::lease_status_differs(old.as_ref(), &self.status).then(|| {
            patch::lease_status_patch(old.as_ref(), &self.status, Some(base.resource_version))
        })
    }
}

/// The writer's queue, shared by the task that takes writes and the
/// decision loop that offers them, and the records of what its writes left
/// (locked after the queue, never before it).
#[derive(Debug)]
struct Shared {
    queue: ProgressQueue<Wanted>,
    records: SharedProgressRecords,
}

/// One write taken from the queue, ready to send.
struct Write {
    key: ObjectKey,
    body: Value,
    decided_on: String,
    written_over: String,
}

impl Shared {
    /// The next write the budget allows at `now`, skipping (without
    /// spending the budget) statuses the lease already has, or `Err` with
    /// when to look again.
    fn next(&mut self, now: Instant) -> Result<Write, Option<Instant>> {
        let mut records = self.records.lock();
        for _ in 0..SKIPS_PER_LOCK {
            let Some((key, wanted)) = self.queue.take(now) else {
                return Err(self.queue.next_at(now));
            };
            let decided_on = wanted.decided_on().unwrap_or_default().to_owned();
            let base = records.base(&key, &decided_on, now);
            let written_over = base
                .map_or(decided_on.as_str(), |b| b.resource_version)
                .to_owned();
            match wanted.body(base) {
                Some(body) => {
                    return Ok(Write {
                        key,
                        body,
                        decided_on,
                        written_over,
                    });
                }
                None => self.queue.refund(),
            }
        }
        // Let offers in before looking further.
        Err(Some(now))
    }
}

/// Hands progress to the writing task; cheap to clone.
#[derive(Clone)]
pub struct ProgressWriter {
    shared: Arc<Mutex<Shared>>,
    wake: Arc<Notify>,
}

impl ProgressWriter {
    /// Starts the writing task, spending at most `per_second` writes per
    /// second through `client` and keeping what its writes left in
    /// `records`. The task ends when every handle is dropped.
    pub fn spawn(
        client: kube::Client,
        per_second: u32,
        metrics: ProgressMetrics,
        records: SharedProgressRecords,
    ) -> Self {
        let writer = Self {
            shared: Arc::new(Mutex::new(Shared {
                queue: ProgressQueue::new(per_second),
                records: records.clone(),
            })),
            wake: Arc::new(Notify::new()),
        };
        let weak = Arc::downgrade(&writer.shared);
        let wake = writer.wake.clone();
        tokio::spawn(async move {
            let slots = Arc::new(tokio::sync::Semaphore::new(IN_FLIGHT));
            loop {
                let Some(shared) = weak.upgrade() else {
                    return;
                };
                let (next, pending) = {
                    let mut s = lock(&shared);
                    let next = s.next(Instant::now());
                    (next, s.queue.len())
                };
                drop(shared);
                metrics
                    .pending
                    .set(i64::try_from(pending).unwrap_or(i64::MAX));
                let write = match next {
                    Ok(write) => write,
                    Err(wait_until) => {
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
                    }
                };
                let Ok(permit) = slots.clone().acquire_owned().await else {
                    return;
                };
                let api: Api<WatchedLease> = Api::namespaced(client.clone(), &write.key.namespace);
                let metrics = metrics.clone();
                let records = records.clone();
                tokio::spawn(async move {
                    let result = send(&api, write, &records).await;
                    metrics.writes.get_or_create(&ResultLabel { result }).inc();
                    drop(permit);
                });
            }
        });
        writer
    }

    /// Wants `wanted` written for `key` at `priority` (lowest first).
    pub fn offer(&self, key: ObjectKey, priority: u32, wanted: Wanted) {
        lock(&self.shared).queue.offer(key, priority, wanted);
        self.wake.notify_one();
    }

    /// How many writes the budget allows now (see [`ProgressQueue::room`]).
    pub fn room(&self) -> usize {
        lock(&self.shared).queue.room(Instant::now())
    }

    /// Forgets what waits for `key`: its status is about to be written in
    /// full (see [`OwnWrites::take_over_progress`] for the lease that write
    /// goes over).
    pub fn forget(&self, key: &ObjectKey) {
        lock(&self.shared).queue.forget(key);
    }
}

/// Sends one write and records what it left; returns the result label.
async fn send(
    api: &Api<WatchedLease>,
    write: Write,
    records: &SharedProgressRecords,
) -> &'static str {
    let outcome = api
        .patch_status(&write.key.name, &patch_params(), &Patch::Merge(&write.body))
        .await;
    if let Err(error) = &outcome {
        tracing::debug!(lease = %write.key, %error, "progress write not written; the next pass offers it again");
    }
    let (result, written) = what_was_written(outcome);
    let mut records = records.lock();
    match written {
        Some((status, rv)) => records.record(
            write.key,
            &write.decided_on,
            &write.written_over,
            status,
            rv,
            Instant::now(),
        ),
        None => records.forget(&write.key),
    }
    result
}

/// A write's result label, and the status and resourceVersion it left when
/// the answer carries both: only then can a later write be sent over it.
/// Anything else makes the writer forget its record of the lease.
fn what_was_written(
    outcome: Result<WatchedLease, kube::Error>,
) -> (&'static str, Option<(GpuLeaseStatus, String)>) {
    match outcome {
        Ok(lease) => ("written", lease.status.zip(lease.metadata.resource_version)),
        Err(kube::Error::Api(status)) if status.code == 409 => ("conflict", None),
        Err(kube::Error::Api(status)) if status.code == 404 => ("gone", None),
        Err(_) => ("failed", None),
    }
}

fn lock(shared: &Mutex<Shared>) -> std::sync::MutexGuard<'_, Shared> {
    // A panic while holding the lock leaves the queue still consistent
    // enough to keep writing from: every method leaves its maps in step.
    shared.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::super::own_writes::progress::tests::status_at;
    use super::*;
    use gpupool_api::GpuLease;
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
            .map(|(k, v)| (k.name.to_string(), v))
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
        assert_eq!(q.room(t0), 2);
        assert!(q.take(t0).is_some());
        assert!(q.take(t0).is_some());
        assert!(q.take(t0).is_none(), "two writes per second, no more");
        assert_eq!(q.room(t0), 0, "a pass need hand over nothing now");
        let next = q.next_at(t0).expect("more waits");
        assert_eq!(next.duration_since(t0), Duration::from_millis(500));
        assert!(q.take(t0 + Duration::from_millis(499)).is_none());
        assert!(q.take(t0 + Duration::from_millis(500)).is_some());
        // A long idle spell does not save up more than one second's budget.
        let later = t0 + Duration::from_secs(60);
        assert_eq!(q.room(later), 2);
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
        let mut lease = CachedLease::new("ns", "l", spec, Some(persisted.clone()));
        lease.metadata.resource_version = Some("42".into());
        let lease = Arc::new(lease);
        let unchanged = Wanted {
            lease: lease.clone(),
            status: persisted.clone(),
        };
        assert_eq!(unchanged.body(None), None, "nothing to write");

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
        let body = wanted.body(None).expect("the position moved");
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

    fn lease_at(rv: &str, status: GpuLeaseStatus) -> Arc<CachedLease> {
        let mut lease = CachedLease::new(
            "ns",
            "l",
            gpupool_api::GpuLeaseSpec {
                class_name: "default".into(),
                pod_name: "l".into(),
                pod_uid: "u".into(),
                role: gpupool_api::Role::Primary,
                slots: 1,
            },
            Some(status),
        );
        lease.metadata.resource_version = Some(rv.into());
        Arc::new(lease)
    }

    #[test]
    fn a_status_the_writer_already_wrote_costs_no_write_of_the_budget() {
        let t0 = Instant::now();
        let mut shared = Shared {
            queue: ProgressQueue::new(1),
            records: SharedProgressRecords::default(),
        };
        let stale = lease_at("1", status_at(3));
        // The writer moved `a` to 2 (rv 2); a pass that read rv 1 wants 2.
        shared
            .records
            .lock()
            .record(key("a"), "1", "1", status_at(2), "2".into(), t0);
        let wanted = |position| Wanted {
            lease: stale.clone(),
            status: status_at(position),
        };
        shared.queue.offer(key("a"), 2, wanted(2));
        shared.queue.offer(key("b"), 5, wanted(5));
        let write = shared.next(t0).expect("b is written");
        assert_eq!(write.key, key("b"), "a already says it");
        assert!(shared.next(t0).is_err(), "one write a second");

        // A pass that read rv 1 wants `a` at 1: written over rv 2.
        shared.queue.offer(key("a"), 1, wanted(1));
        let write = shared
            .next(t0 + Duration::from_secs(1))
            .expect("a is written");
        assert_eq!(
            (write.decided_on.as_str(), write.written_over.as_str()),
            ("1", "2")
        );
        assert_eq!(write.body["metadata"]["resourceVersion"], json!("2"));
        assert_eq!(write.body["status"]["position"], json!(1));
    }

    fn written(metrics: &ProgressMetrics, result: &'static str) -> u64 {
        metrics.writes.get_or_create(&ResultLabel { result }).get()
    }

    /// Waits until the writer has made `n` writes in all.
    async fn until_writes(metrics: &ProgressMetrics, n: u64) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let mut total = 0;
            for result in ["written", "conflict", "gone", "failed"] {
                total += written(metrics, result);
            }
            if total >= n {
                return;
            }
            assert!(Instant::now() < deadline, "{total} of {n} writes made");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// A writer over a simulated API server holding lease `ns/a`, Queued
    /// at position 3 as `seen` holds it.
    struct Fixture {
        _server: gpupool_sim_apiserver::RunningApiServer,
        api: Api<GpuLease>,
        seen: Arc<CachedLease>,
        writer: ProgressWriter,
        records: SharedProgressRecords,
        metrics: ProgressMetrics,
    }

    impl Fixture {
        async fn start() -> Self {
            use super::super::test_api::{api_server, queued_lease};
            let (server, client) = api_server().await;
            let api: Api<GpuLease> = Api::namespaced(client.clone(), "ns");
            let seen = Arc::new(queued_lease(&api, "a", 3).await);
            let metrics = ProgressMetrics::default();
            let records = SharedProgressRecords::default();
            let writer = ProgressWriter::spawn(client, 100, metrics.clone(), records.clone());
            Self {
                _server: server,
                api,
                seen,
                writer,
                records,
                metrics,
            }
        }

        /// Offers `a` at `position`, decided on `seen`, and waits until
        /// the writer has made `writes` writes in all.
        async fn offer_moved(&self, position: u32, writes: u64) {
            let wanted = Wanted {
                lease: self.seen.clone(),
                status: GpuLeaseStatus {
                    position: Some(position),
                    ..self.seen.status.clone().expect("status")
                },
            };
            self.writer
                .offer(ObjectKey::new("ns", "a"), position, wanted);
            until_writes(&self.metrics, writes).await;
        }

        async fn status(&self) -> GpuLeaseStatus {
            let lease = self.api.get("a").await.expect("lease");
            lease.status.expect("status")
        }
    }

    #[tokio::test]
    async fn stale_positions_are_written_over_the_writers_own_and_never_over_anyone_elses() {
        let f = Fixture::start().await;
        f.offer_moved(2, 1).await;
        assert_eq!(f.status().await.position, Some(2));
        // Passes that still read the lease as it was before that write.
        f.offer_moved(1, 2).await;
        assert_eq!(f.status().await.position, Some(1));
        assert_eq!(written(&f.metrics, "conflict"), 0);
        assert_eq!(written(&f.metrics, "written"), 2);

        // Another writer admits the lease: a stale position is refused.
        let now = f.api.get("a").await.expect("lease");
        let admitted = GpuLeaseStatus {
            phase: gpupool_api::LeasePhase::Admitted,
            position: None,
            node: Some("node-1".into()),
            ..now.status.clone().expect("status")
        };
        super::super::test_api::written_behind(&f.api, "a", &now.into(), &admitted).await;
        f.offer_moved(2, 3).await;
        assert_eq!(written(&f.metrics, "conflict"), 1);
        let status = f.status().await;
        assert_eq!(
            status.phase,
            gpupool_api::LeasePhase::Admitted,
            "the admission stands"
        );
        assert_eq!(status.position, None);
    }

    #[tokio::test]
    async fn a_write_for_a_lease_that_is_gone_is_dropped_with_what_was_known_of_it() {
        let f = Fixture::start().await;
        f.offer_moved(2, 1).await;
        assert_eq!(f.records.lock().len(), 1);

        f.api
            .delete("a", &Default::default())
            .await
            .expect("lease deleted");
        f.offer_moved(1, 2).await;
        assert_eq!(written(&f.metrics, "gone"), 1);
        assert!(f.records.lock().is_empty());
        assert_eq!(
            lock(&f.writer.shared).queue.len(),
            0,
            "not offered again by itself"
        );
    }

    #[test]
    fn statuses_that_need_no_write_are_passed_over_a_few_at_a_time() {
        let t0 = Instant::now();
        let mut shared = Shared {
            queue: ProgressQueue::new(1),
            records: SharedProgressRecords::default(),
        };
        let seen = lease_at("1", status_at(3));
        let unchanged = SKIPS_PER_LOCK + 1;
        for i in 0..unchanged {
            let priority = u32::try_from(i).expect("small");
            shared.queue.offer(
                key(&format!("same-{priority}")),
                priority,
                Wanted {
                    lease: seen.clone(),
                    status: status_at(3),
                },
            );
        }
        shared.queue.offer(
            key("moved"),
            u32::MAX,
            Wanted {
                lease: seen.clone(),
                status: status_at(2),
            },
        );
        assert_eq!(shared.next(t0).err(), Some(Some(t0)), "look again at once");
        let write = shared.next(t0).expect("the budget was not spent on them");
        assert_eq!(write.key, key("moved"));
        assert!(shared.queue.is_empty());
    }

    #[test]
    fn only_an_answer_with_status_and_version_is_recorded_as_written() {
        let api_error = |code| {
            kube::Error::Api(Box::new(
                kube::core::Status::failure("refused", "Reason").with_code(code),
            ))
        };
        let mut answer = super::super::test_api::lease("a", "42", gpupool_api::LeasePhase::Queued);
        answer.status = Some(GpuLeaseStatus {
            position: Some(3),
            ..Default::default()
        });
        // Read back as an API answer is: through JSON.
        let read = |lease: GpuLease| -> WatchedLease {
            serde_json::from_value(serde_json::to_value(lease).expect("json")).expect("answer")
        };
        let (result, written) = what_was_written(Ok(read(answer.clone())));
        assert_eq!(result, "written");
        let (status, rv) = written.expect("recorded");
        assert_eq!((status.position, rv.as_str()), (Some(3), "42"));

        // An answer the writer cannot lay a later write over: counted as
        // written, but its record is dropped.
        let mut no_version = answer.clone();
        no_version.metadata.resource_version = None;
        assert_eq!(what_was_written(Ok(read(no_version))), ("written", None));
        let mut no_status = answer;
        no_status.status = None;
        assert_eq!(what_was_written(Ok(read(no_status))), ("written", None));

        assert_eq!(what_was_written(Err(api_error(409))), ("conflict", None));
        assert_eq!(what_was_written(Err(api_error(404))), ("gone", None));
        assert_eq!(what_was_written(Err(api_error(500))), ("failed", None));
    }
}
