//! Applying a plan: lease creates/deletes, status writes, admissions,
//! evictions and give-backs (deleting admitted pods the scheduler cannot
//! place), in the order that keeps DESIGN §5.8's invariants.
//!
//! Ordering rules:
//! - stale leases are deleted before anything else (a new lease may take the name);
//! - a new lease's sequence is persisted (status write) right after its create;
//! - an admission first persists the lease status (Admitted, node), then sends
//!   the pod's one JSON patch; if the status write fails, the pod is not touched;
//! - writes of different pods run concurrently, each chain in its own order;
//! - a pass waits only for its deletes, spec rewrites and admissions. Its
//!   other writes (lease creates, phase changes, evictions, give-backs,
//!   class statuses)
//!   run in the background while the next passes decide: each is laid over
//!   the caches as assumed until its answer is recorded, and no pass plans
//!   another write of an object whose write is in flight. An admission of such an
//!   object waits, and holds back the later admissions of its role, so pods
//!   still start in queue order.
//!
//! The applier is a plain writer: what to write and when (a class status
//! held back by its period, the message of an eviction a
//! PodDisruptionBudget refused, when to run again) is the engine's decision
//! and comes in the plan. The raw objects are read only for what a write's
//! precondition needs (UIDs, resourceVersions, where the pod's gate sits).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use futures::future::BoxFuture;
use futures::stream::FuturesUnordered;
use gpupool_api::names::{ANNOTATION_ENQUEUED_AT, FIELD_MANAGER_OPERATOR};
use gpupool_api::{
    GpuLease, GpuLeaseClass, GpuLeaseClassStatus, GpuLeaseSpec, GpuLeaseStatus, LeasePhase, Role,
};
use jiff::Timestamp;
use k8s_openapi::api::policy::v1::Eviction as EvictionBody;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{
    DeleteOptions, ObjectMeta, OwnerReference, Preconditions, Time,
};
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use super::PassInput;
use super::error::{Error, api_status};
use super::events::{EventSink, PodEvent};
use super::own_writes::OwnWrites;
use super::patch;
use super::progress::{ProgressWriter, Wanted};
use super::ungate::{Admitted, LeaseWrite, UngateOrder};
use crate::engine::{
    Admission, CachedLease, ClassWrite, Eviction, GiveBack, NewLease, ObjectKey, Plan, QueueDepth,
    StaleLease,
};
use crate::index::cached_pod::{CachedPod, WatchedPod};
use crate::index::watched::WatchedLease;
use crate::metrics::{ClassLabel, ClassRole, Metrics};

/// API writes in flight at once within a pass.
const CONCURRENCY: usize = 64;
/// Background writes spawned beyond the [`CONCURRENCY`] that run: each
/// takes a slot the moment one frees, even while a pass is being decided.
/// Any more wait in [`Applier`]'s queue as their data alone: a burst of
/// thousands of pods to give leases would otherwise hold a task and its
/// future for each lease create not yet begun.
const SPAWNED_AHEAD: usize = CONCURRENCY;
/// Longest one object's chain of writes may take before it is abandoned
/// (and retried by a later pass), so one stuck request never stalls admission.
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

/// What applying a plan left behind.
#[derive(Debug, Default)]
pub struct ApplyOutcome {
    /// Some write failed (not counting expected conflicts resolved by the next pass).
    pub failed: bool,
    /// The API server's answer to each eviction the plan asked for: `true`
    /// when a PodDisruptionBudget refused it, `false` when it went through
    /// or the pod is gone. The engine decides the next pass with them.
    pub evictions: Vec<(ObjectKey, bool)>,
}

/// Immediate retries of an admission's lease write that failed.
const ADMISSION_WRITE_RETRIES: usize = 2;

/// Applies plans. Across passes it keeps its connections (the budgeted
/// progress writer, the event sink) and the writes still in flight.
pub struct Applier {
    writer: Writer,
    progress: ProgressWriter,
    background: JoinSet<ChainOutcome>,
    /// The objects each background task writes.
    tasks: HashMap<tokio::task::Id, Vec<ObjectKey>>,
    /// Objects with a background write in flight, and how many.
    in_flight: HashMap<ObjectKey, u32>,
    /// Background writes running at once, across passes.
    permits: Arc<Semaphore>,
    /// Background writes not yet spawned, in the order they were asked for.
    waiting: VecDeque<Waiting>,
}

/// A background write waiting to be spawned: its objects and what builds
/// its chain.
struct Waiting {
    keys: Vec<ObjectKey>,
    /// `Sync` only so that the applier is: it is never called through a
    /// shared reference.
    build: Box<dyn FnOnce(&Writer) -> WriteChain + Send + Sync>,
}

/// A background write that finished: the objects it was for and its
/// outcome (`None` when its task panicked).
pub struct FinishedWrite {
    keys: Vec<ObjectKey>,
    outcome: Option<ChainOutcome>,
}

/// The key a class's writes are tracked under: no namespaced object has an
/// empty namespace, so it never meets a pod's or lease's key.
fn class_key(class: &str) -> ObjectKey {
    ObjectKey::new("", class)
}

/// What one write of a chain achieved (or, for an eviction, what the API
/// server answered), as the own-writes records and the engine record it.
enum WriteResult {
    Lease {
        lease: CachedLease,
        created: bool,
    },
    Pod(CachedPod),
    PodReread(Option<CachedPod>),
    Evicted {
        key: ObjectKey,
        uid: String,
    },
    /// An unplaceable pod was deleted to give its slots back.
    GaveBack {
        key: ObjectKey,
        uid: String,
    },
    Blocked(ObjectKey),
    Unblocked(ObjectKey),
    Class(GpuLeaseClass),
    LeaseDeleted {
        key: ObjectKey,
        uid: String,
    },
}

impl WriteResult {
    /// Drops what the operator never reads from an object a write
    /// returned (managedFields above all), as the watch caches drop it (a
    /// pod or lease is kept cut down from the start).
    /// Finished writes can wait a while to be recorded (a burst of lease
    /// creates finishes faster than the loop records them), so they are
    /// trimmed as they finish rather than when they are recorded.
    fn trimmed(mut self) -> Self {
        match &mut self {
            WriteResult::Class(class) => class.metadata.managed_fields = None,
            WriteResult::Lease { .. }
            | WriteResult::Pod(_)
            | WriteResult::PodReread(_)
            | WriteResult::Evicted { .. }
            | WriteResult::GaveBack { .. }
            | WriteResult::Blocked(_)
            | WriteResult::Unblocked(_)
            | WriteResult::LeaseDeleted { .. } => {}
        }
        self
    }
}

/// One object's writes, run in order as one future: what each write
/// achieved, and the errors that stopped it.
type WriteChain = BoxFuture<'static, (Vec<WriteResult>, Vec<Error>)>;

/// One chain's outcome and when it finished (the own-writes records date its writes).
struct ChainOutcome {
    at: Instant,
    results: Vec<WriteResult>,
    errors: Vec<Error>,
}

impl ChainOutcome {
    /// A chain's outcome as of now, its objects trimmed.
    fn now((results, errors): (Vec<WriteResult>, Vec<Error>)) -> Self {
        Self {
            at: Instant::now(),
            results: results.into_iter().map(WriteResult::trimmed).collect(),
            errors,
        }
    }
}

/// Runs `chains` concurrently, at most [`CONCURRENCY`] at once, each under
/// the write timeout; touches no shared state, so independent groups of
/// chains can run side by side.
async fn collect(chains: Vec<WriteChain>) -> Vec<ChainOutcome> {
    if chains.is_empty() {
        return Vec::new();
    }
    let chains: Vec<BoxFuture<'static, ((), ChainOutcome)>> =
        chains.into_iter().map(|chain| timed((), chain)).collect();
    futures::stream::iter(chains)
        .buffer_unordered(CONCURRENCY)
        .map(|((), outcome)| outcome)
        .collect()
        .await
}

/// Lays finished writes over the caches and notes the API server's answers
/// to evictions in `outcome`.
fn record(
    outcomes: Vec<ChainOutcome>,
    own_writes: &mut OwnWrites,
    errors: &mut Vec<Error>,
    outcome: &mut ApplyOutcome,
) {
    for ChainOutcome {
        at: now,
        results,
        errors: errs,
    } in outcomes
    {
        errors.extend(errs);
        for result in results {
            match result {
                WriteResult::Lease { lease, created } => {
                    own_writes.record_lease(lease, created, now)
                }
                WriteResult::Pod(pod) => own_writes.record_pod(pod, now),
                WriteResult::PodReread(Some(pod)) => own_writes.record_pod(pod, now),
                WriteResult::PodReread(None) => {}
                WriteResult::Evicted { key, uid } => {
                    outcome.evictions.push((key.clone(), false));
                    own_writes.record_evicted(key, uid, now);
                }
                // Terminating, as an evicted pod is, until the watch shows
                // it gone: the next pass neither asks again nor counts it.
                WriteResult::GaveBack { key, uid } => own_writes.record_evicted(key, uid, now),
                WriteResult::Blocked(key) => outcome.evictions.push((key, true)),
                WriteResult::Unblocked(key) => outcome.evictions.push((key, false)),
                WriteResult::LeaseDeleted { key, uid } => {
                    own_writes.record_lease_deleted(key, uid, now)
                }
                WriteResult::Class(class) => own_writes.record_class(class, now),
            }
        }
    }
}

/// The lease `key` as the pass saw it (or as the progress writer's own
/// writes moved it on since, `moved_on`), when writing `status` over it
/// would change something the operator owns; `None` when there is nothing
/// to write (it is unchanged, or the lease is not known).
fn status_to_write(
    input: &PassInput<'_>,
    moved_on: &HashMap<ObjectKey, Arc<CachedLease>>,
    key: &ObjectKey,
    status: &GpuLeaseStatus,
) -> Option<Arc<CachedLease>> {
    let lease = moved_on.get(key).or_else(|| input.lease(key))?;
    patch::lease_status_differs(lease.status.as_ref(), status).then(|| lease.clone())
}

impl Applier {
    /// How many queue-progress writes the budget allows now.
    pub fn progress_room(&self) -> usize {
        self.progress.room()
    }

    /// An applier writing through `client`; queue progress goes to `progress`.
    pub fn new(
        client: Client,
        metrics: Metrics,
        events: EventSink,
        progress: ProgressWriter,
    ) -> Self {
        Self {
            writer: Writer {
                client,
                metrics,
                events,
            },
            progress,
            background: JoinSet::new(),
            tasks: HashMap::new(),
            in_flight: HashMap::new(),
            permits: Arc::new(Semaphore::new(CONCURRENCY)),
            waiting: VecDeque::new(),
        }
    }

    /// True while a write of `key` runs in the background.
    fn busy(&self, key: &ObjectKey) -> bool {
        self.in_flight.contains_key(key)
    }

    /// Runs the chain `build` makes in the background for the objects
    /// `keys`, building it once a write slot is free; `assumed` (a lease as
    /// the write will leave it) is laid over the caches until the write's
    /// answer is recorded.
    fn spawn(
        &mut self,
        keys: Vec<ObjectKey>,
        build: impl FnOnce(&Writer) -> WriteChain + Send + Sync + 'static,
        assumed: Option<Arc<CachedLease>>,
        own_writes: &mut OwnWrites,
    ) {
        for key in &keys {
            *self.in_flight.entry(key.clone()).or_default() += 1;
        }
        if let (Some(lease), Some(key)) = (assumed, keys.first()) {
            own_writes.assume_lease(key.clone(), lease);
        }
        self.waiting.push_back(Waiting {
            keys,
            build: Box::new(build),
        });
        self.spawn_waiting();
    }

    /// Creates the lease `new` in the background. The write and the
    /// own-writes records share one copy of it: a create that waits for a
    /// write slot (thousands do in a burst of new pods) costs the lease it
    /// assumes and no second copy of its spec and status.
    fn spawn_create(&mut self, new: NewLease, own_writes: &mut OwnWrites) {
        let NewLease {
            key,
            pod_uid,
            spec,
            status,
        } = new;
        let lease = Arc::new(CachedLease::under(&key, spec, Some(status)));
        let (create, assumed) = (key.clone(), lease.clone());
        self.spawn(
            vec![key],
            move |w| w.create_chain(create, pod_uid, lease),
            Some(assumed),
            own_writes,
        );
    }

    /// Spawns waiting writes, first asked first, while fewer than
    /// [`CONCURRENCY`] + [`SPAWNED_AHEAD`] tasks are out; each runs once it
    /// has one of the [`CONCURRENCY`] permits, which are handed out in the
    /// order the tasks asked for them.
    fn spawn_waiting(&mut self) {
        while self.background.len() < CONCURRENCY + SPAWNED_AHEAD {
            let Some(Waiting { keys, build }) = self.waiting.pop_front() else {
                return;
            };
            let permits = self.permits.clone();
            let writer = self.writer.clone();
            let task = self.background.spawn(async move {
                // The semaphore is never closed; without a permit the write
                // still runs, only unthrottled.
                let _permit = permits.acquire_owned().await.ok();
                ChainOutcome::now(with_timeout(build(&writer)).await)
            });
            self.tasks.insert(task.id(), keys);
        }
    }

    /// The next background write to finish; pending forever while none runs
    /// (for `select!`).
    pub async fn next_finished_write(&mut self) -> FinishedWrite {
        match self.background.join_next_with_id().await {
            Some(joined) => self.finished_write(joined),
            None => std::future::pending().await,
        }
    }

    /// A background write that has finished, if any, without waiting.
    pub fn try_finished_write(&mut self) -> Option<FinishedWrite> {
        let joined = self.background.try_join_next_with_id()?;
        Some(self.finished_write(joined))
    }

    /// Pairs a joined task's outcome with the objects it wrote, and spawns
    /// the next waiting write in its place.
    fn finished_write(
        &mut self,
        joined: Result<(tokio::task::Id, ChainOutcome), tokio::task::JoinError>,
    ) -> FinishedWrite {
        // The joined task's place goes to the next waiting write.
        self.spawn_waiting();
        match joined {
            Ok((id, outcome)) => FinishedWrite {
                keys: self.tasks.remove(&id).unwrap_or_default(),
                outcome: Some(outcome),
            },
            // Only a bug panics a write task; its objects are released so a
            // later pass decides them again.
            Err(e) => {
                tracing::error!(error = %e, "a background write task failed");
                FinishedWrite {
                    keys: self.tasks.remove(&e.id()).unwrap_or_default(),
                    outcome: None,
                }
            }
        }
    }

    /// Records a background write's answer: the objects are no longer in
    /// flight, the assumed state gives way to the API server's answer, and
    /// errors are counted and logged.
    pub fn record_finished_write(
        &mut self,
        finished: FinishedWrite,
        own_writes: &mut OwnWrites,
    ) -> ApplyOutcome {
        for key in &finished.keys {
            if let Some(n) = self.in_flight.get_mut(key) {
                *n -= 1;
                if *n == 0 {
                    self.in_flight.remove(key);
                    own_writes.forget_assumed(key);
                }
            }
        }
        let mut outcome = ApplyOutcome::default();
        let Some(chain) = finished.outcome else {
            outcome.failed = true;
            return outcome;
        };
        let mut errors = Vec::new();
        record(vec![chain], own_writes, &mut errors, &mut outcome);
        self.report(&errors);
        outcome.failed = !errors.is_empty();
        outcome
    }

    /// Stops every background write (leadership is lost: this replica must
    /// stop writing) and forgets what they assumed.
    pub fn abandon(&mut self, own_writes: &mut OwnWrites) {
        self.background.abort_all();
        self.background.detach_all();
        self.tasks.clear();
        self.waiting.clear();
        for key in self.in_flight.drain().map(|(k, _)| k) {
            own_writes.forget_assumed(&key);
        }
    }

    fn report(&self, errors: &[Error]) {
        for e in errors {
            self.writer.metrics.error(e.metric_label());
            if e.is_expected() {
                tracing::info!(error = %e, kind = e.metric_label(), "write refused; deciding again");
            } else {
                tracing::warn!(error = %e, kind = e.metric_label(), "write failed; retrying with backoff");
            }
        }
    }

    /// Applies `plan` (decided on `input`), recording successful writes in
    /// `own_writes`. Returns once the deletes, spec rewrites and admissions are
    /// done; the rest runs on in the background (see
    /// [`Applier::record_finished_write`]).
    /// Writes of objects whose earlier write is still in flight are left
    /// out: the pass that follows its answer decides them again.
    pub async fn apply(
        &mut self,
        plan: Plan,
        input: &PassInput<'_>,
        own_writes: &mut OwnWrites,
    ) -> ApplyOutcome {
        let mut outcome = ApplyOutcome::default();
        let mut errors = Vec::new();

        let cleared = self
            .delete_stale_and_fix_specs(&plan.delete_leases, plan.lease_specs, input)
            .await;
        record(cleared, own_writes, &mut errors, &mut outcome);

        // Everything but the admissions goes to the background, one chain
        // per object.
        let mut statuses = plan.lease_statuses;
        self.create_leases(plan.create_leases, &mut statuses, own_writes);
        let moved_on = self.take_over_progress(&statuses, input, own_writes);
        self.offer_progress(plan.lease_progress, input);
        let admissions: BTreeMap<ObjectKey, Admission> = plan
            .admissions
            .into_iter()
            .map(|a| (a.key.clone(), a))
            .collect();
        let (admission_statuses, statuses) = statuses
            .into_iter()
            .partition(|(key, _)| admissions.contains_key(key));
        self.write_statuses(statuses, &moved_on, input, own_writes);
        let admissions = self.prepare_admissions(admissions, admission_statuses, &moved_on, input);
        self.evict(plan.evictions, input, own_writes);
        self.give_back(plan.give_backs, input, own_writes);
        self.write_classes(
            &plan.queue_depths,
            plan.class_writes,
            &plan.class_statuses,
            own_writes,
        );

        // The pass waits for its admissions only, so a freed slot is taken
        // without waiting for any unrelated write.
        let admitted = self.admit(admissions, input).await;
        record(admitted, own_writes, &mut errors, &mut outcome);

        self.report(&errors);
        outcome.failed = !errors.is_empty();
        outcome
    }

    /// Deletes the stale leases and rewrites the specs that disagree with
    /// their pods, and waits for the answers. Stale leases go first because
    /// a new lease of the same name may follow; specs are put right before
    /// any status of theirs is written.
    async fn delete_stale_and_fix_specs(
        &self,
        stale: &[StaleLease],
        specs: BTreeMap<ObjectKey, GpuLeaseSpec>,
        input: &PassInput<'_>,
    ) -> Vec<ChainOutcome> {
        let mut chains: Vec<WriteChain> = stale
            .iter()
            .filter(|s| !self.busy(&s.key))
            .filter_map(|s| self.writer.delete_chain(s, input))
            .collect();
        chains.extend(
            specs
                .into_iter()
                .filter(|(key, _)| !self.busy(key))
                .map(|(key, spec)| self.writer.spec_chain(key, spec)),
        );
        collect(chains).await
    }

    /// Starts the lease creates in the background (each writes its lease's
    /// status right after the create); their statuses are taken out of
    /// `statuses`, as the create writes them.
    fn create_leases(
        &mut self,
        creates: Vec<NewLease>,
        statuses: &mut BTreeMap<ObjectKey, GpuLeaseStatus>,
        own_writes: &mut OwnWrites,
    ) {
        for new in creates {
            statuses.remove(&new.key);
            if !self.busy(&new.key) {
                self.spawn_create(new, own_writes);
            }
        }
    }

    /// Takes the leases whose status this pass writes in full away from
    /// the progress writer, which then makes no write of its own for them;
    /// returns those it has written since the pass read them, as it left
    /// them, for the full write to go over.
    fn take_over_progress(
        &self,
        statuses: &BTreeMap<ObjectKey, GpuLeaseStatus>,
        input: &PassInput<'_>,
        own_writes: &OwnWrites,
    ) -> HashMap<ObjectKey, Arc<CachedLease>> {
        let mut moved_on = HashMap::new();
        let now = Instant::now();
        for key in statuses.keys() {
            self.progress.forget(key);
            let moved = input
                .lease(key)
                .and_then(|lease| own_writes.take_over_progress(key, lease, now));
            if let Some(lease) = moved {
                moved_on.insert(key.clone(), Arc::new(lease));
            }
        }
        moved_on
    }

    /// Hands the position and message updates to the budgeted progress
    /// writer, front of the queue first: they never hold up a pass.
    fn offer_progress(&self, progress: BTreeMap<ObjectKey, GpuLeaseStatus>, input: &PassInput<'_>) {
        for (key, status) in progress {
            if self.busy(&key) {
                continue;
            }
            let Some(lease) = input.lease(&key) else {
                continue;
            };
            let priority = status.position.unwrap_or(0);
            let wanted = Wanted {
                lease: lease.clone(),
                status,
            };
            self.progress.offer(key, priority, wanted);
        }
    }

    /// Starts the background writes of lease statuses (those of leases
    /// not being admitted) that change something.
    fn write_statuses(
        &mut self,
        statuses: BTreeMap<ObjectKey, GpuLeaseStatus>,
        moved_on: &HashMap<ObjectKey, Arc<CachedLease>>,
        input: &PassInput<'_>,
        own_writes: &mut OwnWrites,
    ) {
        for (key, status) in statuses {
            if self.busy(&key) {
                continue;
            }
            if let Some(lease) = status_to_write(input, moved_on, &key, &status) {
                self.spawn_status(key, status, lease, own_writes);
            }
        }
    }

    /// Writes `status` over `lease` in the background; until the answer is
    /// recorded, the own-writes records assume the lease with that status.
    fn spawn_status(
        &mut self,
        key: ObjectKey,
        status: GpuLeaseStatus,
        lease: Arc<CachedLease>,
        own_writes: &mut OwnWrites,
    ) {
        // The device plugin's GPUs stay as they are: the write leaves them
        // alone.
        let mut assumed = CachedLease::clone(&lease);
        let (gpus, gpu_indexes) = assumed
            .status
            .take()
            .map(|s| (s.gpus, s.gpu_indexes))
            .unwrap_or_default();
        assumed.status = Some(GpuLeaseStatus {
            gpus,
            gpu_indexes,
            ..status.clone()
        });
        let k = key.clone();
        self.spawn(
            vec![key],
            move |w| w.status_chain(k, status, lease),
            Some(Arc::new(assumed)),
            own_writes,
        );
    }

    /// Starts the evictions in the background. A refused eviction waits
    /// out its retry time (the engine asked for a pass then) rather than
    /// being asked for again at once.
    fn evict(
        &mut self,
        evictions: Vec<Eviction>,
        input: &PassInput<'_>,
        own_writes: &mut OwnWrites,
    ) {
        let now = jiff::Timestamp::now();
        for e in evictions {
            if self.busy(&e.key) || e.not_before.is_some_and(|at| at > now) {
                continue;
            }
            let key = e.key.clone();
            let class = class_of(input, &e.key);
            self.spawn(
                vec![key],
                move |w| w.evict_chain(e, class),
                None,
                own_writes,
            );
        }
    }

    /// Starts deleting the admitted pods the scheduler cannot place, in the
    /// background. A pod whose lease status is still being written (the
    /// pass that released it) is deleted by a later pass: the engine asks
    /// again every pass while the pod lives.
    fn give_back(
        &mut self,
        give_backs: Vec<GiveBack>,
        input: &PassInput<'_>,
        own_writes: &mut OwnWrites,
    ) {
        for g in give_backs {
            if self.busy(&g.key) {
                continue;
            }
            let key = g.key.clone();
            let class = class_of(input, &g.key);
            self.spawn(
                vec![key],
                move |w| w.give_back_chain(g, class),
                None,
                own_writes,
            );
        }
    }

    /// Sets the queue-depth gauges, as every pass does, and starts the
    /// class status writes the plan says are due, in the background.
    fn write_classes(
        &mut self,
        depths: &BTreeMap<String, QueueDepth>,
        writes: Vec<ClassWrite>,
        statuses: &BTreeMap<String, GpuLeaseClassStatus>,
        own_writes: &mut OwnWrites,
    ) {
        for (class, depth) in depths {
            self.writer.record_queue_depth(class, *depth);
        }
        for w in writes {
            let key = class_key(&w.class);
            if self.busy(&key) {
                continue;
            }
            if let Some(status) = statuses.get(&w.class) {
                let mut status = status.clone();
                status.updated_at = Some(Time(w.updated_at));
                self.spawn(
                    vec![key],
                    move |wr| wr.class_chain(w, status),
                    None,
                    own_writes,
                );
            }
        }
    }

    /// The pass's admissions, each with where its lease write stands.
    /// Each admission's lease status is written first, and its pod ungated
    /// only afterwards ([`Applier::admit`]). An admission of an object
    /// still being written waits for the next pass, and counts as a failed
    /// lease write: no later pod of its role is ungated before it. One whose
    /// lease already says what the pass decided (its pod never got its
    /// patch) needs no lease write.
    fn prepare_admissions(
        &self,
        by_key: BTreeMap<ObjectKey, Admission>,
        statuses: BTreeMap<ObjectKey, GpuLeaseStatus>,
        moved_on: &HashMap<ObjectKey, Arc<CachedLease>>,
        input: &PassInput<'_>,
    ) -> Admissions {
        let mut order: Vec<Admitted> = Vec::new();
        let mut lease_writes = HashMap::new();
        let sequence_of = |key: &ObjectKey| {
            input
                .lease(key)
                .and_then(|l| l.status.as_ref())
                .and_then(|s| s.sequence)
        };
        for a in by_key.values().filter(|a| self.busy(&a.key)) {
            let sequence = match statuses.get(&a.key) {
                Some(status) => status.sequence,
                None => sequence_of(&a.key),
            };
            order.push(Admitted {
                key: a.key.clone(),
                role: a.role,
                sequence,
                lease: LeaseWrite::Failed,
            });
        }
        for (key, status) in statuses {
            let Some(a) = by_key.get(&key).filter(|a| !self.busy(&a.key)) else {
                continue;
            };
            if let Some(lease) = status_to_write(input, moved_on, &key, &status) {
                order.push(Admitted {
                    key: key.clone(),
                    role: a.role,
                    sequence: status.sequence,
                    lease: LeaseWrite::Writing,
                });
                lease_writes.insert(key, (status, lease));
            }
        }
        for a in by_key.values() {
            if !self.busy(&a.key) && !lease_writes.contains_key(&a.key) {
                order.push(Admitted {
                    key: a.key.clone(),
                    role: a.role,
                    sequence: sequence_of(&a.key),
                    lease: LeaseWrite::Written,
                });
            }
        }
        Admissions {
            by_key,
            order,
            lease_writes,
        }
    }

    /// Writes the admissions' lease statuses and ungates their pods, at
    /// most [`CONCURRENCY`] writes at once. Leases are written in sequence
    /// order, and each pod is patched as soon as [`UngateOrder`] allows
    /// (its lease and every earlier one of its role written), so the two
    /// writes of one admission overlap those of the next rather than every
    /// lease write of the pass going before every pod patch. A lease write
    /// that fails in a way that may pass (a 5xx, a timeout; not a conflict)
    /// is tried again at once with the same status, so the pods behind it
    /// are not held back a whole pass, and its admittedAt stays the one
    /// decided together with theirs.
    async fn admit(&self, admissions: Admissions, input: &PassInput<'_>) -> Vec<ChainOutcome> {
        let Admissions {
            by_key: mut admissions,
            order: admitted,
            lease_writes: statuses,
        } = admissions;
        let mut writes: Vec<&Admitted> = admitted
            .iter()
            .filter(|a| a.lease == LeaseWrite::Writing)
            .collect();
        writes.sort_by(|a, b| a.place().cmp(&b.place()));
        // Each lease to write, with the retries it has had.
        let mut leases: VecDeque<(ObjectKey, usize)> =
            writes.into_iter().map(|a| (a.key.clone(), 0)).collect();
        let mut order = UngateOrder::new(admitted);
        let mut pods: VecDeque<ObjectKey> = order.ready().into();
        let mut running = FuturesUnordered::new();
        let mut results = Vec::new();
        loop {
            // Pods first: each finishes an admission already begun.
            while running.len() < CONCURRENCY {
                if let Some(key) = pods.pop_front() {
                    if let Some(a) = admissions.remove(&key) {
                        running.push(timed(None, self.writer.admit_chain(a, input)));
                    }
                } else if let Some((key, tries)) = leases.pop_front() {
                    // Every lease to write has its status; a retry writes
                    // the same status over the same lease.
                    if let Some((status, lease)) = statuses.get(&key) {
                        let chain =
                            self.writer
                                .status_chain(key.clone(), status.clone(), lease.clone());
                        running.push(timed(Some((key, tries)), chain));
                    }
                } else {
                    break;
                }
            }
            let Some((lease, outcome)) = running.next().await else {
                break;
            };
            if let Some((key, tries)) = lease {
                let written = outcome
                    .results
                    .iter()
                    .any(|r| matches!(r, WriteResult::Lease { .. }));
                // Only a failure that may pass is tried again: a conflict
                // stands until the next pass decides on the newer lease,
                // and a lease that is gone stays gone.
                let transient =
                    !outcome.errors.is_empty() && !outcome.errors.iter().any(Error::is_expected);
                if written {
                    pods.extend(order.answer(&key, LeaseWrite::Written));
                } else if transient && tries < ADMISSION_WRITE_RETRIES {
                    leases.push_front((key, tries + 1));
                } else {
                    pods.extend(order.answer(&key, LeaseWrite::Failed));
                }
            }
            results.push(outcome);
        }
        results
    }
}

/// A pass's admissions as [`Applier::admit`] writes them.
struct Admissions {
    /// The admissions, by pod.
    by_key: BTreeMap<ObjectKey, Admission>,
    /// Each admission's place in the ungate order, and where its lease
    /// write stands as the pass starts writing them.
    order: Vec<Admitted>,
    /// What each admission's lease write writes, and over which lease.
    lease_writes: HashMap<ObjectKey, (GpuLeaseStatus, Arc<CachedLease>)>,
}

/// The class of the lease `key`, as the metrics label it (empty when the
/// lease is not known).
fn class_of(input: &PassInput<'_>, key: &ObjectKey) -> String {
    input
        .lease(key)
        .map(|l| l.spec.class_name.clone())
        .unwrap_or_default()
}

/// Runs `chain` under the write timeout; its outcome comes back with `tag`.
fn timed<T: Send + 'static>(tag: T, chain: WriteChain) -> BoxFuture<'static, (T, ChainOutcome)> {
    Box::pin(async move { (tag, ChainOutcome::now(with_timeout(chain).await)) })
}

/// What the write chains need: the client, the metrics and the event sink.
/// Cheap to clone, so a background write builds its chain (and the request
/// state inside it) only when it may start: a burst of thousands of
/// creates waits as their inputs, not as thousands of request futures.
#[derive(Clone)]
struct Writer {
    client: Client,
    metrics: Metrics,
    events: EventSink,
}

impl Writer {
    /// Leases in `ns`, their answers read as the watch reads a lease
    /// ([`WatchedLease`]): each write's answer carries the lease's managed
    /// fields, which the parser then skips.
    fn leases(&self, ns: &str) -> Api<WatchedLease> {
        Api::namespaced(self.client.clone(), ns)
    }

    fn delete_chain(&self, stale: &StaleLease, input: &PassInput<'_>) -> Option<WriteChain> {
        let obj = input.lease(&stale.key)?;
        let uid = obj.metadata.uid.as_deref()?.to_owned();
        let api = self.leases(&stale.key.namespace);
        let key = stale.key.clone();
        Some(Box::pin(async move {
            let dp = DeleteParams {
                preconditions: Some(kube::api::Preconditions {
                    uid: Some(uid.clone()),
                    resource_version: None,
                }),
                ..Default::default()
            };
            match api.delete(&key.name, &dp).await {
                Ok(_) => {
                    tracing::info!(lease = %key, "deleted the lease of a replaced pod");
                    (vec![WriteResult::LeaseDeleted { key, uid }], vec![])
                }
                Err(e) if api_status(&e) == Some(404) => {
                    (vec![WriteResult::LeaseDeleted { key, uid }], vec![])
                }
                Err(e) if api_status(&e) == Some(409) => {
                    (vec![], vec![Error::LeaseConflict { lease: key }])
                }
                Err(source) => (vec![], vec![Error::DeleteLease { lease: key, source }]),
            }
        }))
    }

    fn spec_chain(&self, key: ObjectKey, spec: GpuLeaseSpec) -> WriteChain {
        let api = self.leases(&key.namespace);
        Box::pin(async move {
            let body = serde_json::json!({ "spec": spec });
            match api
                .patch(&key.name, &patch_params(), &Patch::Merge(&body))
                .await
            {
                Ok(lease) => {
                    tracing::warn!(lease = %key, "lease spec disagreed with its pod; rewritten from the pod");
                    (
                        vec![WriteResult::Lease {
                            lease: lease.into(),
                            created: false,
                        }],
                        vec![],
                    )
                }
                Err(e) if api_status(&e) == Some(409) => {
                    (vec![], vec![Error::LeaseConflict { lease: key }])
                }
                Err(source) => (vec![], vec![Error::LeaseSpec { lease: key, source }]),
            }
        })
    }

    /// Creates the lease `lease` describes for the pod `pod_uid`, then
    /// writes its status (a create cannot set it). `lease` is the one the
    /// own-writes records assume meanwhile; one assumed without a status is
    /// created bare, and the next pass gives it its sequence.
    fn create_chain(&self, key: ObjectKey, pod_uid: String, lease: Arc<CachedLease>) -> WriteChain {
        // A create sends a whole lease, so it goes through the lease's own type.
        let posts: Api<GpuLease> = Api::namespaced(self.client.clone(), &key.namespace);
        let api = self.leases(&key.namespace);
        let events = self.events.clone();
        Box::pin(async move {
            let object = GpuLease {
                metadata: ObjectMeta {
                    name: Some(key.name.to_string()),
                    namespace: Some(key.namespace.to_string()),
                    owner_references: Some(vec![OwnerReference {
                        api_version: "v1".into(),
                        kind: "Pod".into(),
                        name: key.name.to_string(),
                        uid: pod_uid.clone(),
                        controller: Some(true),
                        block_owner_deletion: Some(false),
                    }]),
                    ..Default::default()
                },
                spec: lease.spec.clone(),
                status: None,
            };
            let pp = PostParams {
                dry_run: false,
                field_manager: Some(FIELD_MANAGER_OPERATOR.to_owned()),
            };
            let created = match posts.create(&pp, &object).await {
                Ok(l) => l,
                Err(e) if api_status(&e) == Some(409) => {
                    return (vec![], vec![Error::LeaseConflict { lease: key }]);
                }
                Err(source) => {
                    return (vec![], vec![Error::CreateLease { lease: key, source }]);
                }
            };
            let rv = created.metadata.resource_version.clone();
            let mut done = vec![WriteResult::Lease {
                lease: created.into(),
                created: true,
            }];
            let Some(status) = lease.status.as_ref() else {
                return (done, vec![]);
            };
            let body = patch::lease_status_patch(None, status, rv.as_deref());
            match api
                .patch_status(&key.name, &patch_params(), &Patch::Merge(&body))
                .await
            {
                Ok(l) => {
                    tracing::info!(lease = %key, sequence = ?status.sequence, phase = ?status.phase, "lease created");
                    let event = match status.phase {
                        LeasePhase::Rejected => Some(PodEvent::Rejected {
                            why: status.message.clone().unwrap_or_default(),
                        }),
                        LeasePhase::Queued => Some(PodEvent::Queued {
                            position: status.position,
                        }),
                        // A lease recreated after a deletion: nothing new
                        // happened to the pod.
                        _ => None,
                    };
                    if let Some(event) = event {
                        events.emit(&key, &pod_uid, event);
                    }
                    done.push(WriteResult::Lease {
                        lease: l.into(),
                        created: true,
                    });
                    (done, vec![])
                }
                Err(e) => (done, vec![status_error(key, e)]),
            }
        })
    }

    /// Writes `status` over `lease` (see [`status_to_write`]). The patch
    /// body is built when the write starts. When the write conflicts only
    /// because the progress writer moved the lease's position or message
    /// since the pass read it (it writes the front of the queue first, the
    /// very leases about to be admitted), the status is written once more
    /// over the lease as it is now: a conflict of that kind would otherwise
    /// hold back every later admission of the role for a whole pass.
    fn status_chain(
        &self,
        key: ObjectKey,
        status: GpuLeaseStatus,
        lease: Arc<CachedLease>,
    ) -> WriteChain {
        let api = self.leases(&key.namespace);
        let events = self.events.clone();
        Box::pin(async move {
            let old = lease.status.as_ref();
            let body =
                patch::lease_status_patch(old, &status, lease.metadata.resource_version.as_deref());
            let was = old.map(|s| s.phase);
            let released =
                status.phase == LeasePhase::Released && was != Some(LeasePhase::Released);
            let rejected = (status.phase == LeasePhase::Rejected
                && was != Some(LeasePhase::Rejected))
            .then(|| status.message.clone().unwrap_or_default());
            // A pod the kubelet failed (refused at admission, say) gets a
            // Warning that says why, beside its lease's message.
            let failed = status
                .message
                .as_deref()
                .filter(|m| released && m.starts_with(crate::engine::POD_FAILED_BECAUSE))
                .map(str::to_owned);
            let pod_uid = lease.spec.pod_uid.clone();
            let mut written = api
                .patch_status(&key.name, &patch_params(), &Patch::Merge(&body))
                .await;
            if matches!(&written, Err(e) if api_status(e) == Some(409)) {
                written = match api.get_status(&key.name).await.map(CachedLease::from) {
                    Ok(fresh) if patch::only_progress_changed(&lease, &fresh) => {
                        tracing::debug!(lease = %key, phase = ?status.phase, "only its position or message moved; writing over it");
                        let body = patch::lease_status_patch(
                            fresh.status.as_ref(),
                            &status,
                            fresh.metadata.resource_version.as_deref(),
                        );
                        api.patch_status(&key.name, &patch_params(), &Patch::Merge(&body))
                            .await
                    }
                    // Changed in earnest, or unreadable: the conflict
                    // stands, and a later pass decides on the new state.
                    _ => written,
                };
            }
            drop(lease);
            match written {
                Ok(l) => {
                    if released {
                        tracing::info!(lease = %key, "released");
                    }
                    if let Some(why) = rejected {
                        tracing::info!(lease = %key, %why, "rejected");
                        events.emit(&key, &pod_uid, PodEvent::Rejected { why });
                    }
                    if let Some(why) = failed {
                        tracing::info!(lease = %key, %why, "pod failed");
                        events.emit(&key, &pod_uid, PodEvent::Failed { why });
                    }
                    (
                        vec![WriteResult::Lease {
                            lease: l.into(),
                            created: false,
                        }],
                        vec![],
                    )
                }
                // Gone with its pod: nothing left to write.
                Err(e) if api_status(&e) == Some(404) => (vec![], vec![]),
                Err(e) => (vec![], vec![status_error(key, e)]),
            }
        })
    }

    fn admit_chain(&self, a: Admission, input: &PassInput<'_>) -> WriteChain {
        // The answer is read as the pod watch reads a pod, and kept as it keeps one.
        let api: Api<WatchedPod> = Api::namespaced(self.client.clone(), &a.key.namespace);
        let pod = input.pod(&a.key).cloned();
        let lease = input.lease(&a.key).cloned();
        let class = lease.as_ref().map(|l| l.spec.class_name.clone());
        // The enqueue stamp has microseconds; the lease's queuedAt only seconds.
        let queued_at = pod
            .as_ref()
            .and_then(|p| p.annotation(ANNOTATION_ENQUEUED_AT))
            .and_then(|v| gpupool_api::time::parse_stamp(v).ok())
            .or_else(|| {
                lease
                    .as_ref()
                    .and_then(|l| l.status.as_ref())
                    .and_then(|s| s.queued_at.as_ref())
                    .map(|t| t.0)
            });
        let metrics = self.metrics.clone();
        let events = self.events.clone();
        Box::pin(async move {
            let Some(pod) = pod else {
                return (vec![], vec![]);
            };
            if pod.metadata.uid.as_deref() != Some(a.pod_uid.as_str()) {
                return (
                    vec![],
                    vec![Error::AdmissionConflict {
                        pod: a.key,
                        reason: "the pod was replaced".into(),
                    }],
                );
            }
            let json = match patch::admission_patch(pod.as_ref(), &a.node) {
                Ok(p) => p,
                Err(e) => {
                    return (
                        vec![],
                        vec![Error::AdmissionConflict {
                            pod: a.key,
                            reason: e.to_string(),
                        }],
                    );
                }
            };
            match api
                .patch(&a.key.name, &patch_params(), &Patch::<()>::Json(json))
                .await
            {
                Ok(p) => {
                    tracing::info!(pod = %a.key, node = %a.node, role = %a.role, slots = a.slots, "admitted");
                    let class = class.unwrap_or_default();
                    metrics
                        .admissions
                        .get_or_create(&ClassRole {
                            class: class.clone(),
                            role: a.role.as_str().to_owned(),
                        })
                        .inc();
                    if let Some(q) = queued_at {
                        let wait = Timestamp::now().duration_since(q).as_secs_f64().max(0.0);
                        metrics
                            .admission_wait
                            .get_or_create(&ClassRole {
                                class,
                                role: a.role.as_str().to_owned(),
                            })
                            .observe(wait);
                    }
                    events.emit(&a.key, &a.pod_uid, PodEvent::Admitted { node: a.node });
                    (vec![WriteResult::Pod(p.into())], vec![])
                }
                Err(e) if matches!(api_status(&e), Some(409 | 422)) => {
                    // Someone else changed the pod: read it again, never retry blindly.
                    let fresh = api
                        .get_opt(&a.key.name)
                        .await
                        .ok()
                        .flatten()
                        .map(CachedPod::from);
                    (
                        vec![WriteResult::PodReread(fresh)],
                        vec![Error::AdmissionConflict {
                            pod: a.key,
                            reason: e.to_string(),
                        }],
                    )
                }
                Err(e) if api_status(&e) == Some(404) => (vec![], vec![]),
                Err(source) => (
                    vec![],
                    vec![Error::AdmitPod {
                        pod: a.key,
                        node: a.node,
                        source,
                    }],
                ),
            }
        })
    }

    /// Evicts a helper of `class` (the metrics' label).
    fn evict_chain(&self, e: Eviction, class: String) -> WriteChain {
        let client = self.client.clone();
        let metrics = self.metrics.clone();
        let events = self.events.clone();
        Box::pin(async move {
            let body = EvictionBody {
                metadata: ObjectMeta {
                    name: Some(e.key.name.to_string()),
                    namespace: Some(e.key.namespace.to_string()),
                    ..Default::default()
                },
                delete_options: Some(DeleteOptions {
                    grace_period_seconds: Some(i64::from(e.grace_period_seconds)),
                    preconditions: Some(Preconditions {
                        uid: Some(e.pod_uid.clone()),
                        resource_version: None,
                    }),
                    ..Default::default()
                }),
            };
            // A PodDisruptionBudget may delay a helper's preemption by its
            // grace period, not stop it: then the pod is deleted, as
            // kube-scheduler's preemption deletes the pods it must.
            let answer = if e.delete {
                delete_helper(&client, &e).await
            } else {
                evict(&client, &e.key, &body).await
            };
            match answer {
                Ok(()) => {
                    if e.delete {
                        tracing::warn!(pod = %e.key, for_primary = %e.for_primary, grace = e.grace_period_seconds, "deleting helper: a PodDisruptionBudget refused its eviction for its grace period");
                    } else {
                        tracing::info!(pod = %e.key, for_primary = %e.for_primary, grace = e.grace_period_seconds, "evicting helper");
                    }
                    metrics
                        .preemptions
                        .get_or_create(&ClassLabel { class })
                        .inc();
                    events.emit(
                        &e.key,
                        &e.pod_uid,
                        PodEvent::Preempted {
                            by: e.for_primary.to_string(),
                        },
                    );
                    (
                        vec![WriteResult::Evicted {
                            key: e.key,
                            uid: e.pod_uid,
                        }],
                        vec![],
                    )
                }
                Err(err) if api_status(&err) == Some(429) => (
                    vec![WriteResult::Blocked(e.key.clone())],
                    vec![Error::EvictionBlocked { pod: e.key }],
                ),
                Err(err) if api_status(&err) == Some(404) => {
                    (vec![WriteResult::Unblocked(e.key)], vec![])
                }
                Err(source) => (vec![], vec![Error::Evict { pod: e.key, source }]),
            }
        })
    }

    /// Deletes an admitted pod of `class` (the metrics' label) that the
    /// scheduler could not place, so that it gives its slots back.
    fn give_back_chain(&self, g: GiveBack, class: String) -> WriteChain {
        let pods: Api<WatchedPod> = Api::namespaced(self.client.clone(), &g.key.namespace);
        let metrics = self.metrics.clone();
        let events = self.events.clone();
        Box::pin(async move {
            // No grace period: the pod is bound to no node, so no kubelet
            // runs a container that would need time to stop. The UID
            // precondition spares a new pod of the same name (its
            // controller may already have made one).
            let params = DeleteParams {
                grace_period_seconds: Some(0),
                preconditions: Some(kube::api::Preconditions {
                    uid: Some(g.pod_uid.clone()),
                    resource_version: None,
                }),
                ..DeleteParams::default()
            };
            match pods.delete(&g.key.name, &params).await {
                Ok(_) => {
                    tracing::warn!(pod = %g.key, node = %g.node, reason = %g.reason, "deleted an admitted pod the scheduler cannot place; its slots are free again");
                    metrics
                        .give_backs
                        .get_or_create(&ClassLabel { class })
                        .inc();
                    events.emit(&g.key, &g.pod_uid, PodEvent::Unplaceable { why: g.reason });
                    (
                        vec![WriteResult::GaveBack {
                            key: g.key,
                            uid: g.pod_uid,
                        }],
                        vec![],
                    )
                }
                // Gone already, or the name is another pod's now (the UID
                // precondition failed): this pod holds nothing any more,
                // which the next pass must see even before the watch does.
                Err(e) if matches!(api_status(&e), Some(404 | 409)) => (
                    vec![WriteResult::GaveBack {
                        key: g.key,
                        uid: g.pod_uid,
                    }],
                    vec![],
                ),
                Err(source) => (vec![], vec![Error::GiveBack { pod: g.key, source }]),
            }
        })
    }

    fn record_queue_depth(&self, class: &str, depth: QueueDepth) {
        for (role, n) in [
            (Role::Primary, depth.primaries),
            (Role::Helper, depth.helpers),
        ] {
            self.metrics
                .queue_depth
                .get_or_create(&ClassRole {
                    class: class.to_owned(),
                    role: role.as_str().to_owned(),
                })
                .set(i64::from(n));
        }
    }

    /// Writes one class status (already stamped); tells the class's owner
    /// when this write turns the class invalid.
    fn class_chain(&self, write: ClassWrite, status: GpuLeaseClassStatus) -> WriteChain {
        let api: Api<GpuLeaseClass> = Api::all(self.client.clone());
        let events = self.events.clone();
        Box::pin(async move {
            let body = patch::class_status_patch(&status);
            match api
                .patch_status(&write.class, &patch_params(), &Patch::Merge(&body))
                .await
            {
                Ok(class) => {
                    if let Some(why) = write.newly_invalid {
                        tracing::warn!(class = %write.class, %why, "class is invalid");
                        events.emit_class_invalid(&write.class, class.metadata.uid.as_deref(), why);
                    }
                    (vec![WriteResult::Class(class)], vec![])
                }
                Err(e) if api_status(&e) == Some(404) => (vec![], vec![]),
                Err(source) => (
                    vec![],
                    vec![Error::ClassStatus {
                        class: write.class,
                        source,
                    }],
                ),
            }
        })
    }
}

fn with_timeout(chain: WriteChain) -> WriteChain {
    Box::pin(async move {
        match tokio::time::timeout(WRITE_TIMEOUT, chain).await {
            Ok(done) => done,
            Err(_) => (vec![], vec![Error::Timeout]),
        }
    })
}

/// Patch parameters naming the operator as the field manager.
pub(super) fn patch_params() -> PatchParams {
    PatchParams {
        field_manager: Some(FIELD_MANAGER_OPERATOR.to_owned()),
        ..Default::default()
    }
}

fn status_error(lease: ObjectKey, e: kube::Error) -> Error {
    if api_status(&e) == Some(409) {
        Error::LeaseConflict { lease }
    } else {
        Error::LeaseStatus { lease, source: e }
    }
}

/// POSTs a policy/v1 Eviction (the typed client's helper does not send
/// `deleteOptions` under its wire name, which would drop the grace period).
/// Deletes helper `e.key` (its UID as a precondition) with its grace period.
async fn delete_helper(client: &Client, e: &Eviction) -> Result<(), kube::Error> {
    let pods: Api<k8s_openapi::api::core::v1::Pod> =
        Api::namespaced(client.clone(), &e.key.namespace);
    let params = DeleteParams {
        grace_period_seconds: Some(e.grace_period_seconds),
        preconditions: Some(kube::api::Preconditions {
            uid: Some(e.pod_uid.clone()),
            resource_version: None,
        }),
        ..DeleteParams::default()
    };
    pods.delete(&e.key.name, &params).await.map(drop)
}

async fn evict(client: &Client, pod: &ObjectKey, body: &EvictionBody) -> Result<(), kube::Error> {
    let url = format!(
        "/api/v1/namespaces/{}/pods/{}/eviction",
        pod.namespace, pod.name
    );
    let bytes = serde_json::to_vec(body).map_err(kube::Error::SerdeError)?;
    let req = http::Request::post(url)
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(bytes)
        .map_err(kube::Error::HttpError)?;
    client.request::<serde_json::Value>(req).await.map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::super::own_writes::lists::LeasePasses;
    use super::super::test_api::{api_server, cached_lease, lease, queued_lease, written_behind};
    use super::*;

    /// An applier whose client points nowhere: the tests below drive only
    /// background chains they write themselves.
    fn offline_applier() -> Applier {
        let config = kube::Config::new("http://127.0.0.1:9".parse().expect("uri"));
        applier_for(Client::try_from(config).expect("client"))
    }

    fn applier_for(client: Client) -> Applier {
        let mut registry = prometheus_client::registry::Registry::default();
        let metrics = Metrics::register(&mut registry);
        let events = EventSink::spawn(client.clone(), "test".into(), metrics.clone());
        let progress =
            ProgressWriter::spawn(client.clone(), 10, Default::default(), Default::default());
        Applier::new(client, metrics, events, progress)
    }

    fn phase_in(
        own_writes: &mut OwnWrites,
        cached: Vec<Arc<CachedLease>>,
    ) -> Vec<Option<LeasePhase>> {
        let leases = LeasePasses::default().pass(own_writes, &cached, &[], Instant::now());
        leases
            .iter()
            .map(|l| l.status.as_ref().map(|s| s.phase))
            .collect()
    }

    #[tokio::test]
    async fn a_background_write_is_assumed_until_its_answer_is_recorded() {
        let mut applier = offline_applier();
        let mut own_writes = OwnWrites::default();
        let key = ObjectKey::new("ns", "a");
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let answer = cached_lease("a", "12", LeasePhase::Released);
        applier.spawn(
            vec![key.clone()],
            move |_| {
                Box::pin(async move {
                    let _ = rx.await;
                    (
                        vec![WriteResult::Lease {
                            lease: answer,
                            created: false,
                        }],
                        vec![],
                    )
                })
            },
            Some(Arc::new(cached_lease("a", "11", LeasePhase::Released))),
            &mut own_writes,
        );
        assert!(applier.busy(&key));
        let cached = || vec![Arc::new(cached_lease("a", "11", LeasePhase::Admitted))];
        assert_eq!(
            phase_in(&mut own_writes, cached()),
            [Some(LeasePhase::Released)]
        );
        assert!(applier.try_finished_write().is_none(), "still in flight");

        let _ = tx.send(());
        let finished = applier.next_finished_write().await;
        let outcome = applier.record_finished_write(finished, &mut own_writes);
        assert!(!outcome.failed);
        assert!(!applier.busy(&key));
        // The answer (resourceVersion 12) wins over the lagging cache.
        assert_eq!(
            phase_in(&mut own_writes, cached()),
            [Some(LeasePhase::Released)]
        );
        let caught_up = vec![Arc::new(cached_lease("a", "12", LeasePhase::Released))];
        phase_in(&mut own_writes, caught_up);
        assert!(own_writes.is_empty(), "nothing assumed or remembered");
    }

    #[test]
    fn finished_writes_keep_their_objects_as_the_caches_keep_them() {
        let mut written = lease("a", "11", LeasePhase::Admitted);
        written.metadata.managed_fields = Some(vec![Default::default()]);
        written.metadata.labels = Some([("team".to_owned(), "x".to_owned())].into());
        written.metadata.annotations = Some([("note".to_owned(), "y".repeat(256 << 10))].into());
        written.metadata.owner_references = Some(vec![Default::default()]);
        let pod: CachedPod = serde_json::from_value(serde_json::json!({
            "metadata": {
                "name": "a", "namespace": "ns", "resourceVersion": "12",
                "managedFields": [{"manager": "kubelet"}],
                "labels": {"gpupool.io/role": "helper", "team": "x"},
                "annotations": {"gpupool.io/enqueued-at": "2026-01-01T00:00:00Z", "note": "x"},
            },
        }))
        .expect("pod");
        let class: GpuLeaseClass = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "default", "managedFields": [{"manager": "x"}]},
            "spec": {},
        }))
        .expect("class");
        let outcome = ChainOutcome::now((
            vec![
                WriteResult::Lease {
                    lease: written.into(),
                    created: true,
                },
                WriteResult::PodReread(Some(pod)),
                WriteResult::Class(class),
            ],
            vec![],
        ));
        let [
            WriteResult::Lease { lease, .. },
            WriteResult::PodReread(Some(pod)),
            WriteResult::Class(class),
        ] = &outcome.results[..]
        else {
            panic!("three objects, in order");
        };
        assert_eq!(
            lease.metadata,
            crate::engine::CachedMeta {
                namespace: Some("ns".into()),
                name: Some("a".into()),
                uid: Some("u".into()),
                resource_version: Some("11".into()),
                ..Default::default()
            },
            "identity and version only: what anyone may grow is not kept, \
             and the server's copy keeps the owner"
        );
        assert_eq!(
            pod.labels,
            [("gpupool.io/role".into(), "helper".into())].into(),
            "only the labels admission reads"
        );
        assert_eq!(
            pod.annotations.keys().collect::<Vec<_>>(),
            ["gpupool.io/enqueued-at"]
        );
        assert_eq!(class.metadata.managed_fields, None);
    }

    #[tokio::test]
    async fn a_create_shares_the_lease_it_assumes_and_writes_it_then_its_status() {
        let (_server, client) = api_server().await;
        let mut applier = applier_for(client.clone());
        let mut own_writes = OwnWrites::default();
        let key = ObjectKey::new("ns", "a");
        let spec = lease("a", "", LeasePhase::Queued).spec;
        let status = GpuLeaseStatus {
            phase: LeasePhase::Queued,
            sequence: Some(7),
            position: Some(1),
            message: Some("waiting: first in line".into()),
            ..Default::default()
        };
        applier.spawn_create(
            NewLease {
                key: key.clone(),
                pod_uid: "pod-a".into(),
                spec: spec.clone(),
                status: status.clone(),
            },
            &mut own_writes,
        );

        let assumed = own_writes.assumed_lease(&key).expect("assumed").clone();
        assert_eq!(
            Arc::strong_count(&assumed),
            3,
            "one copy, held by the own_writes, the waiting write and this test"
        );
        assert!(
            assumed
                .metadata
                .name
                .as_ref()
                .is_some_and(|name| Arc::ptr_eq(name, &key.name)),
            "the lease holds its key's name, not a copy"
        );
        assert_eq!(assumed.status.as_ref(), Some(&status));

        let finished = applier.next_finished_write().await;
        assert!(
            !applier
                .record_finished_write(finished, &mut own_writes)
                .failed
        );
        assert!(
            own_writes.assumed_lease(&key).is_none(),
            "the answer replaces it"
        );
        assert_eq!(Arc::strong_count(&assumed), 1, "the write let go of it");
        let stored = Api::<GpuLease>::namespaced(client, "ns")
            .get("a")
            .await
            .expect("lease");
        assert_eq!(stored.spec, spec);
        let owner = stored.metadata.owner_references.unwrap_or_default();
        assert_eq!(owner.len(), 1);
        assert_eq!(
            (owner[0].kind.as_str(), owner[0].uid.as_str()),
            ("Pod", "pod-a")
        );
        let written = stored.status.expect("status");
        assert_eq!(written.sequence, Some(7));
        assert_eq!(written.position, Some(1));
        assert_eq!(written.message, status.message);
    }

    #[tokio::test]
    async fn a_lease_assumed_without_a_status_is_created_bare() {
        let (_server, client) = api_server().await;
        let applier = applier_for(client.clone());
        let key = ObjectKey::new("ns", "a");
        let spec = lease("a", "", LeasePhase::Queued).spec;
        let bare = Arc::new(CachedLease::under(&key, spec, None));
        let (done, errors) = applier.writer.create_chain(key, "pod-a".into(), bare).await;
        assert!(errors.is_empty(), "{errors:?}");
        assert!(matches!(
            done.as_slice(),
            [WriteResult::Lease { created: true, .. }]
        ));
        let stored = Api::<GpuLease>::namespaced(client, "ns")
            .get("a")
            .await
            .expect("lease");
        assert_eq!(stored.status, None, "the next pass gives it its sequence");
    }

    #[tokio::test]
    async fn a_failed_or_panicked_background_write_releases_its_object() {
        let mut applier = offline_applier();
        let mut own_writes = OwnWrites::default();
        let (a, b) = (ObjectKey::new("ns", "a"), ObjectKey::new("ns", "b"));
        applier.spawn(
            vec![a.clone()],
            |_| Box::pin(async { (vec![], vec![Error::Timeout]) }),
            Some(Arc::new(cached_lease("a", "1", LeasePhase::Released))),
            &mut own_writes,
        );
        applier.spawn(
            vec![b.clone()],
            |_| Box::pin(async { panic!("a bug in a write chain") }),
            None,
            &mut own_writes,
        );
        for _ in 0..2 {
            let finished = applier.next_finished_write().await;
            assert!(
                applier
                    .record_finished_write(finished, &mut own_writes)
                    .failed
            );
        }
        assert!(!applier.busy(&a) && !applier.busy(&b));
        let cached = vec![Arc::new(cached_lease("a", "1", LeasePhase::Admitted))];
        assert_eq!(
            phase_in(&mut own_writes, cached),
            [Some(LeasePhase::Admitted)],
            "the failed write assumes nothing any more"
        );
    }

    #[tokio::test]
    async fn losing_leadership_stops_background_writes_and_forgets_them() {
        let mut applier = offline_applier();
        let mut own_writes = OwnWrites::default();
        // Some spawned, one still waiting to be.
        let keys: Vec<ObjectKey> = (0..=CONCURRENCY + SPAWNED_AHEAD)
            .map(|i| ObjectKey::new("ns", format!("p{i}")))
            .collect();
        let built = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        for key in &keys {
            let built = built.clone();
            applier.spawn(
                vec![key.clone()],
                move |_| {
                    built.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    Box::pin(std::future::pending())
                },
                Some(Arc::new(cached_lease(&key.name, "1", LeasePhase::Released))),
                &mut own_writes,
            );
        }
        assert_eq!(applier.waiting.len(), 1);
        applier.abandon(&mut own_writes);
        assert!(keys.iter().all(|key| !applier.busy(key)));
        assert!(own_writes.is_empty());
        assert!(applier.try_finished_write().is_none());
        assert!(applier.waiting.is_empty(), "the waiting write is dropped");
        tokio::task::yield_now().await;
        assert_eq!(
            built.load(std::sync::atomic::Ordering::SeqCst),
            0,
            "no chain is built once leadership is lost"
        );
    }

    #[tokio::test]
    async fn background_writes_past_the_spawned_ones_wait_as_data_until_a_task_is_free() {
        let mut applier = offline_applier();
        let mut own_writes = OwnWrites::default();
        let spawned = CONCURRENCY + SPAWNED_AHEAD;
        let total = spawned + 10;
        let keys: Vec<ObjectKey> = (0..total)
            .map(|i| ObjectKey::new("ns", format!("p{i:03}")))
            .collect();
        // Which writes have built their chains (they do once they run), and
        // a gate every chain waits at.
        let started = Arc::new(std::sync::Mutex::new(Vec::new()));
        let gate = Arc::new(Semaphore::new(0));
        for (i, key) in keys.iter().enumerate() {
            let (started, gate) = (started.clone(), gate.clone());
            applier.spawn(
                vec![key.clone()],
                move |_| {
                    started.lock().expect("not poisoned").push(i);
                    Box::pin(async move {
                        gate.acquire().await.expect("never closed").forget();
                        (vec![], vec![])
                    })
                },
                Some(Arc::new(cached_lease(&key.name, "1", LeasePhase::Queued))),
                &mut own_writes,
            );
        }
        assert_eq!(applier.background.len(), spawned);
        assert_eq!(applier.waiting.len(), total - spawned);
        assert!(
            keys.iter().all(|key| applier.busy(key)),
            "a waiting write's object is in flight as much as a running one's"
        );
        let running = || started.lock().expect("not poisoned").clone();
        tokio::time::timeout(Duration::from_secs(10), async {
            while running().len() < CONCURRENCY {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("the first writes run");
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert_eq!(running().len(), CONCURRENCY, "no more run than the permits");
        assert!(running().iter().all(|&i| i < spawned));

        gate.add_permits(total);
        let mut recorded = 0;
        while recorded < total {
            let next = applier.next_finished_write().await;
            assert!(!applier.record_finished_write(next, &mut own_writes).failed);
            recorded += 1;
        }
        assert!(applier.waiting.is_empty());
        assert!(applier.try_finished_write().is_none());
        assert!(keys.iter().all(|key| !applier.busy(key)));
        let mut ran = running();
        ran.sort_unstable();
        assert_eq!(ran, (0..total).collect::<Vec<_>>(), "each write ran once");
    }

    /// The pass's admission of lease `a`, decided on `seen`.
    async fn admit_over(client: Client, seen: CachedLease) -> (Vec<WriteResult>, Vec<Error>) {
        applier_for(client)
            .writer
            .status_chain(ObjectKey::new("ns", "a"), admitted(), Arc::new(seen))
            .await
    }

    fn admitted() -> GpuLeaseStatus {
        GpuLeaseStatus {
            phase: LeasePhase::Admitted,
            sequence: Some(7),
            node: Some("node-1".into()),
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn an_admission_is_written_over_a_position_the_progress_writer_moved() {
        let (_server, client) = api_server().await;
        let api: Api<GpuLease> = Api::namespaced(client.clone(), "ns");
        let seen = queued_lease(&api, "a", 3).await;
        // The progress writer moves it to the front after the pass read it.
        let moved = GpuLeaseStatus {
            position: Some(1),
            message: Some("first in line".into()),
            ..seen.status.clone().expect("status")
        };
        written_behind(&api, "a", &seen, &moved).await;

        let (done, errors) = admit_over(client, seen).await;
        assert!(errors.is_empty(), "{errors:?}");
        let now = api.get("a").await.expect("lease");
        let status = now.status.expect("status");
        assert_eq!(status.phase, LeasePhase::Admitted);
        assert_eq!(status.node.as_deref(), Some("node-1"));
        assert_eq!(status.position, None, "the admission's status, not a mix");
        assert_eq!(status.message, None);
        assert!(matches!(done.as_slice(), [WriteResult::Lease { .. }]));
    }

    #[tokio::test]
    async fn an_admission_over_a_lease_changed_in_earnest_stays_a_conflict() {
        let (_server, client) = api_server().await;
        let api: Api<GpuLease> = Api::namespaced(client.clone(), "ns");
        let seen = queued_lease(&api, "a", 3).await;
        // Another writer (a replica that led before) admitted it elsewhere.
        let elsewhere = GpuLeaseStatus {
            node: Some("node-2".into()),
            ..admitted()
        };
        written_behind(&api, "a", &seen, &elsewhere).await;

        let (done, errors) = admit_over(client, seen).await;
        assert!(done.is_empty());
        assert!(
            matches!(errors.as_slice(), [Error::LeaseConflict { .. }]),
            "{errors:?}"
        );
        let now = api.get("a").await.expect("lease");
        assert_eq!(
            now.status.and_then(|s| s.node).as_deref(),
            Some("node-2"),
            "the other write stands"
        );
    }

    #[tokio::test]
    async fn an_admission_whose_lease_cannot_be_read_again_stays_a_conflict() {
        let (server, client) = api_server().await;
        let api: Api<GpuLease> = Api::namespaced(client.clone(), "ns");
        let seen = queued_lease(&api, "a", 3).await;
        // Every request now fails with 409: the write conflicts, and so
        // does reading the lease again to see what moved.
        server
            .faults()
            .set(gpupool_sim_apiserver::FaultConfig {
                error_rate: 1.0,
                error_code: 409,
                ..Default::default()
            })
            .expect("faults");

        let (done, errors) = admit_over(client, seen.clone()).await;
        server.faults().clear();
        assert!(done.is_empty());
        assert!(
            matches!(errors.as_slice(), [Error::LeaseConflict { .. }]),
            "{errors:?}"
        );
        let now = api.get("a").await.expect("lease");
        assert_eq!(now.status, seen.status, "nothing was written");
    }

    /// Pod `name` in namespace `ns`, gated, asking for one slot.
    fn gated_pod(name: &str) -> k8s_openapi::api::core::v1::Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": "ns"},
            "spec": {
                "schedulingGates": [{"name": gpupool_api::names::SCHEDULING_GATE}],
                "containers": [{
                    "name": "c",
                    "image": "busybox",
                    "resources": {"limits": {"gpupool/slot": "1"}},
                }],
            },
        }))
        .expect("pod")
    }

    /// Gated pods `names` with their Queued leases (sequences 1, 2, …) in
    /// a simulated API server, the plan that admits them all to node-1, and
    /// caches that show every one of them.
    struct Admitting {
        server: gpupool_sim_apiserver::RunningApiServer,
        client: Client,
        pods: Api<k8s_openapi::api::core::v1::Pod>,
        leases: Api<GpuLease>,
        caches: crate::index::Caches,
        plan: Plan,
    }

    impl Admitting {
        async fn new(names: &[&str]) -> Self {
            let (server, client) = api_server().await;
            let classes: Api<GpuLeaseClass> = Api::all(client.clone());
            classes
                .create(
                    &PostParams::default(),
                    &GpuLeaseClass::new("default", Default::default()),
                )
                .await
                .expect("class");
            let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(client.clone(), "ns");
            let leases: Api<GpuLease> = Api::namespaced(client.clone(), "ns");
            let mut plan = Plan::default();
            for (seq, name) in (1..).zip(names) {
                let pod = pods
                    .create(&PostParams::default(), &gated_pod(name))
                    .await
                    .expect("pod created");
                let uid = pod.metadata.uid.expect("uid");
                let queued = queued_lease(&leases, name, seq).await;
                let lease = GpuLease {
                    metadata: queued.metadata.to_object_meta(),
                    spec: GpuLeaseSpec {
                        pod_uid: uid.clone(),
                        ..queued.spec
                    },
                    status: queued.status,
                };
                leases
                    .replace(name, &PostParams::default(), &lease)
                    .await
                    .expect("lease points at its pod");
                let key = ObjectKey::new("ns", *name);
                let status = GpuLeaseStatus {
                    sequence: Some(u64::from(seq)),
                    ..admitted()
                };
                plan.lease_statuses.insert(key.clone(), status);
                plan.admissions.push(Admission {
                    key,
                    pod_uid: uid,
                    role: Role::Primary,
                    node: "node-1".into(),
                    slots: 1,
                });
            }
            let mut registry = prometheus_client::registry::Registry::default();
            let caches = crate::index::Caches::start(
                &client,
                Arc::new(tokio::sync::Notify::new()),
                &Metrics::register(&mut registry),
            );
            caches.wait_synced().await.expect("caches fill");
            let mut tries = 0;
            while caches.leases.len() < names.len() || caches.pods.len() < names.len() {
                tries += 1;
                assert!(tries < 200, "the caches never showed every pod and lease");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Self {
                server,
                client,
                pods,
                leases,
                caches,
                plan,
            }
        }

        /// The pods of `names` that still carry their gate; checks that the
        /// others are pinned to node-1.
        async fn gated<'n>(&self, names: &[&'n str]) -> Vec<&'n str> {
            let mut gated = Vec::new();
            for name in names {
                let pod = self.pods.get(name).await.expect("pod");
                let spec = pod.spec.expect("spec");
                if spec.scheduling_gates.is_some_and(|g| !g.is_empty()) {
                    gated.push(*name);
                } else {
                    assert_eq!(
                        spec.node_selector
                            .and_then(|s| s.get("kubernetes.io/hostname").cloned()),
                        Some("node-1".into()),
                        "{name} is pinned where it was admitted"
                    );
                }
            }
            gated
        }

        /// What a pass reads of the caches now.
        fn read<'k>(
            &self,
            engine_state: &'k mut super::super::EngineState,
            own_writes: &mut OwnWrites,
        ) -> PassInput<'k> {
            engine_state.sync(
                &self.caches,
                own_writes,
                &[],
                Timestamp::now(),
                Instant::now(),
            )
        }

        async fn phase(&self, name: &str) -> Option<LeasePhase> {
            let lease = self.leases.get(name).await.expect("lease");
            lease.status.map(|s| s.phase)
        }
    }

    #[tokio::test]
    async fn pods_behind_a_refused_admission_stay_gated_even_when_their_leases_are_written() {
        let names = ["a", "b", "c", "d"];
        let fx = Admitting::new(&names).await;
        let (mut engine_state, mut own_writes) =
            (super::super::EngineState::default(), OwnWrites::default());
        let input = fx.read(&mut engine_state, &mut own_writes);
        // After the pass read them, another writer takes lease b elsewhere.
        let seen_b = input
            .lease(&ObjectKey::new("ns", "b"))
            .expect("b is cached");
        let elsewhere = GpuLeaseStatus {
            node: Some("node-2".into()),
            sequence: Some(2),
            ..admitted()
        };
        written_behind(&fx.leases, "b", seen_b, &elsewhere).await;

        let mut applier = applier_for(fx.client.clone());
        let before = lease_status_writes(&fx.server);
        let outcome = applier
            .apply(fx.plan.clone(), &input, &mut own_writes)
            .await;
        assert!(outcome.failed, "b's admission was refused");
        assert_eq!(
            lease_status_writes(&fx.server) - before,
            names.len() as u64,
            "one status write per lease: b's conflict is not tried again"
        );
        assert_eq!(
            fx.gated(&names).await,
            ["b", "c", "d"],
            "only the pod before the refusal starts"
        );
        for name in ["c", "d"] {
            assert_eq!(
                fx.phase(name).await,
                Some(LeasePhase::Admitted),
                "{name}'s lease was written; its pod waits for the next pass"
            );
        }
        let b = fx.leases.get("b").await.expect("lease");
        assert_eq!(
            b.status.and_then(|s| s.node).as_deref(),
            Some("node-2"),
            "the other write stands"
        );
    }

    /// Lease status writes the server has taken, from every user.
    fn lease_status_writes(server: &gpupool_sim_apiserver::RunningApiServer) -> u64 {
        server
            .writes_by_user()
            .keys()
            .filter_map(|user| {
                server
                    .writes_by_route(user)
                    .get("PATCH gpuleases/status")
                    .copied()
            })
            .sum()
    }

    /// Applies the admission of one pod while the API server fails the
    /// next `failures` requests with a 500.
    async fn admit_through_failures(failures: u32) -> (Admitting, ApplyOutcome) {
        let fx = Admitting::new(&["a"]).await;
        let (mut engine_state, mut own_writes) =
            (super::super::EngineState::default(), OwnWrites::default());
        let input = fx.read(&mut engine_state, &mut own_writes);
        let mut applier = applier_for(fx.client.clone());
        fx.server
            .faults()
            .set(gpupool_sim_apiserver::FaultConfig {
                fail_next: failures,
                ..Default::default()
            })
            .expect("faults");
        let outcome = applier
            .apply(fx.plan.clone(), &input, &mut own_writes)
            .await;
        assert_eq!(
            fx.server.faults().config().fail_next,
            0,
            "every failure was met"
        );
        (fx, outcome)
    }

    #[tokio::test]
    async fn an_admission_whose_lease_write_failed_is_tried_again_at_once() {
        let (fx, outcome) = admit_through_failures(ADMISSION_WRITE_RETRIES as u32).await;
        assert!(outcome.failed, "the failed tries are reported");
        assert_eq!(fx.phase("a").await, Some(LeasePhase::Admitted));
        assert!(
            fx.gated(&["a"]).await.is_empty(),
            "the pod started in the same pass"
        );
    }

    #[tokio::test]
    async fn an_admission_whose_lease_write_keeps_failing_leaves_its_pod_gated() {
        let (fx, outcome) = admit_through_failures(ADMISSION_WRITE_RETRIES as u32 + 1).await;
        assert!(outcome.failed);
        assert_eq!(fx.phase("a").await, Some(LeasePhase::Queued));
        assert_eq!(fx.gated(&["a"]).await, ["a"], "never ungated unadmitted");
    }

    #[test]
    fn eviction_body_uses_policy_v1_wire_names() {
        let body = EvictionBody {
            metadata: ObjectMeta {
                name: Some("h".into()),
                namespace: Some("ns".into()),
                ..Default::default()
            },
            delete_options: Some(DeleteOptions {
                grace_period_seconds: Some(30),
                preconditions: Some(Preconditions {
                    uid: Some("u".into()),
                    resource_version: None,
                }),
                ..Default::default()
            }),
        };
        let v = serde_json::to_value(&body).expect("ser");
        assert_eq!(v["apiVersion"], "policy/v1");
        assert_eq!(v["kind"], "Eviction");
        assert_eq!(v["deleteOptions"]["gracePeriodSeconds"], 30);
        assert_eq!(v["deleteOptions"]["preconditions"]["uid"], "u");
    }

    /// A lease released because the kubelet failed its pod (refused at
    /// admission) carries the kubelet's words, and the pod gets a Warning
    /// event that says them; a plain release gets no event.
    #[tokio::test]
    async fn a_release_for_a_pod_the_kubelet_failed_raises_a_warning() {
        let (_server, client) = api_server().await;
        let api: Api<GpuLease> = Api::namespaced(client.clone(), "ns");
        let applier = applier_for(client.clone());
        let why = "released: pod failed: UnexpectedAdmissionError: Requested: 2, Available: 1";
        for (name, message) in [("a", why), ("b", "released: pod succeeded")] {
            let seen = queued_lease(&api, name, 1).await;
            let released = GpuLeaseStatus {
                phase: LeasePhase::Released,
                message: Some(message.to_owned()),
                ..Default::default()
            };
            let (_, errors) = applier
                .writer
                .status_chain(ObjectKey::new("ns", name), released, Arc::new(seen))
                .await;
            assert!(errors.is_empty(), "{errors:?}");
        }
        let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(client, "ns");
        for _ in 0..100 {
            if !events_list(&events).await.is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Time for a wrong second event to be written too.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let found = events_list(&events).await;
        assert_eq!(found.len(), 1, "{found:?}");
        let event = &found[0];
        assert_eq!(event.reason.as_deref(), Some("Failed"));
        assert_eq!(event.type_.as_deref(), Some("Warning"));
        assert_eq!(event.note.as_deref(), Some(why));
        assert_eq!(
            event.regarding.as_ref().and_then(|r| r.name.as_deref()),
            Some("a")
        );
    }

    /// Pod `name` in namespace `ns`, admitted (ungated and pinned to
    /// node-1) but bound to no node.
    fn pinned_pod(name: &str) -> k8s_openapi::api::core::v1::Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": "ns"},
            "spec": {
                "nodeSelector": {"kubernetes.io/hostname": "node-1"},
                "containers": [{
                    "name": "c",
                    "image": "busybox",
                    "resources": {"limits": {"gpupool/slot": "1"}},
                }],
            },
        }))
        .expect("pod")
    }

    /// The plan's order to give back pod `name` of UID `uid`.
    fn give_back(name: &str, uid: &str) -> GiveBack {
        GiveBack {
            key: ObjectKey::new("ns", name),
            pod_uid: uid.to_owned(),
            node: "node-1".into(),
            reason: format!(
                "released: the scheduler could not place {name} on node node-1 for 60s: \
                 0/1 nodes are available: 1 Insufficient cpu"
            ),
        }
    }

    /// Creates pod `name` (pinned, unbound) and returns its UID.
    async fn create_pinned(pods: &Api<k8s_openapi::api::core::v1::Pod>, name: &str) -> String {
        pods.create(&PostParams::default(), &pinned_pod(name))
            .await
            .expect("pod created")
            .metadata
            .uid
            .expect("uid")
    }

    /// Give-backs of `class` the metrics counted.
    fn give_backs_of(applier: &Applier, class: &str) -> u64 {
        applier
            .writer
            .metrics
            .give_backs
            .get_or_create(&ClassLabel {
                class: class.into(),
            })
            .get()
    }

    fn give_backs_counted(applier: &Applier) -> u64 {
        give_backs_of(applier, "default")
    }

    /// An admitted pod the scheduler cannot place is deleted at once (it
    /// runs nowhere), counted, and told why by a Warning; asking again
    /// once it is gone is done, not an error.
    #[tokio::test]
    async fn an_unplaceable_pod_is_deleted_and_gets_a_warning() {
        let (_server, client) = api_server().await;
        let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(client.clone(), "ns");
        let uid = create_pinned(&pods, "a").await;
        let applier = applier_for(client.clone());
        let order = give_back("a", &uid);
        let (done, errors) = applier
            .writer
            .give_back_chain(order.clone(), "default".into())
            .await;
        assert!(errors.is_empty(), "{errors:?}");
        assert!(
            matches!(&done[..], [WriteResult::GaveBack { key, uid: u }] if *key == order.key && *u == uid)
        );
        assert!(
            pods.get_opt("a").await.expect("get").is_none(),
            "an unbound pod goes at once"
        );
        assert_eq!(give_backs_counted(&applier), 1);

        let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(client, "ns");
        for _ in 0..100 {
            if !events_list(&events).await.is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let found = events_list(&events).await;
        assert_eq!(found.len(), 1, "{found:?}");
        let event = &found[0];
        assert_eq!(event.reason.as_deref(), Some("Unplaceable"));
        assert_eq!(event.type_.as_deref(), Some("Warning"));
        assert_eq!(event.note.as_deref(), Some(order.reason.as_str()));
        let regarding = event.regarding.as_ref().expect("regarding");
        assert_eq!(
            (regarding.name.as_deref(), regarding.uid.as_deref()),
            (Some("a"), Some(uid.as_str()))
        );

        // A pass that asks again before the watch shows the pod gone.
        let (done, errors) = applier
            .writer
            .give_back_chain(order, "default".into())
            .await;
        assert!(errors.is_empty(), "a 404 is done: {errors:?}");
        assert!(matches!(&done[..], [WriteResult::GaveBack { .. }]));
        assert_eq!(give_backs_counted(&applier), 1, "nothing more was deleted");
    }

    /// The UID precondition spares a new pod of the same name; the old one
    /// is gone, which is all the give-back asked for.
    #[tokio::test]
    async fn a_new_pod_of_the_same_name_is_never_given_back() {
        let (_server, client) = api_server().await;
        let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(client.clone(), "ns");
        let old = create_pinned(&pods, "a").await;
        pods.delete("a", &DeleteParams::default())
            .await
            .expect("deleted");
        let new = create_pinned(&pods, "a").await;
        assert_ne!(old, new);
        let applier = applier_for(client);
        let (done, errors) = applier
            .writer
            .give_back_chain(give_back("a", &old), "default".into())
            .await;
        assert!(errors.is_empty(), "a 409 is done: {errors:?}");
        assert!(matches!(&done[..], [WriteResult::GaveBack { uid, .. }] if *uid == old));
        let still = pods.get("a").await.expect("the new pod lives");
        assert_eq!(still.metadata.uid.as_deref(), Some(new.as_str()));
        assert!(still.metadata.deletion_timestamp.is_none());
        assert_eq!(give_backs_counted(&applier), 0);
    }

    /// A give-back the API server fails is reported (and counted) as a
    /// failed write, never taken as done: the pod is not marked
    /// terminating, and the engine's next ask deletes it.
    #[tokio::test]
    async fn a_failed_give_back_is_counted_and_done_by_a_later_pass() {
        let (server, client) = api_server().await;
        let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(client.clone(), "ns");
        let uid = create_pinned(&pods, "a").await;
        let mut applier = applier_for(client);
        let (pods_r, _pods) = crate::index::store::index();
        let (nodes_r, _nodes) = crate::index::store::index();
        let (classes_r, _classes) = crate::index::store::index();
        let (leases_r, _leases) = crate::index::store::index();
        let caches = crate::index::Caches::of_stores(pods_r, nodes_r, classes_r, leases_r);
        let (mut engine_state, mut own_writes) =
            (super::super::EngineState::default(), OwnWrites::default());
        let plan = Plan {
            give_backs: vec![give_back("a", &uid)],
            ..Plan::default()
        };
        let key = ObjectKey::new("ns", "a");
        // The pass knows no lease of the pod: its class label is empty.
        const NO_LEASE: &str = "";
        let errors_counted = |applier: &Applier| {
            applier
                .writer
                .metrics
                .errors
                .get_or_create(&crate::metrics::ErrorLabel {
                    error: "give_back".into(),
                })
                .get()
        };

        server
            .faults()
            .set(gpupool_sim_apiserver::FaultConfig {
                fail_next: 1,
                ..Default::default()
            })
            .expect("faults");
        let input = engine_state.sync(
            &caches,
            &mut own_writes,
            &[],
            Timestamp::now(),
            Instant::now(),
        );
        let outcome = applier.apply(plan.clone(), &input, &mut own_writes).await;
        assert!(!outcome.failed, "the delete runs in the background");
        let finished = applier.next_finished_write().await;
        let outcome = applier.record_finished_write(finished, &mut own_writes);
        assert!(outcome.failed, "the failed delete is reported");
        assert_eq!(errors_counted(&applier), 1);
        assert_eq!(give_backs_of(&applier, NO_LEASE), 0);
        assert!(!own_writes.is_evicted(&key), "not taken as done");
        assert!(pods.get_opt("a").await.expect("get").is_some());

        let input = engine_state.sync(
            &caches,
            &mut own_writes,
            &[],
            Timestamp::now(),
            Instant::now(),
        );
        applier.apply(plan, &input, &mut own_writes).await;
        let finished = applier.next_finished_write().await;
        let outcome = applier.record_finished_write(finished, &mut own_writes);
        assert!(!outcome.failed);
        assert!(
            own_writes.is_evicted(&key),
            "terminating until the watch shows it gone"
        );
        assert!(pods.get_opt("a").await.expect("get").is_none());
        assert_eq!(give_backs_of(&applier, NO_LEASE), 1);
        assert_eq!(errors_counted(&applier), 1);
    }

    async fn events_list(
        events: &Api<k8s_openapi::api::events::v1::Event>,
    ) -> Vec<k8s_openapi::api::events::v1::Event> {
        events
            .list(&kube::api::ListParams::default())
            .await
            .expect("events list")
            .items
    }

    #[tokio::test]
    async fn a_class_turned_invalid_gets_a_warning_event_that_names_its_uid() {
        let (_server, client) = api_server().await;
        let classes: Api<GpuLeaseClass> = Api::all(client.clone());
        let class: GpuLeaseClass = serde_json::from_value(serde_json::json!({
            "apiVersion": "gpupool.io/v1alpha1", "kind": "GpuLeaseClass",
            "metadata": {"name": "gold"}, "spec": {}
        }))
        .expect("class");
        let created = classes
            .create(&PostParams::default(), &class)
            .await
            .expect("class created");
        let applier = applier_for(client.clone());
        let write = ClassWrite {
            class: "gold".into(),
            updated_at: Timestamp::now(),
            newly_invalid: Some("class gold: it is broken".into()),
        };
        let (done, errors) = applier
            .writer
            .class_chain(write, GpuLeaseClassStatus::default())
            .await;
        assert!(errors.is_empty(), "{errors:?}");
        assert_eq!(done.len(), 1);
        // `kubectl describe gpuleaseclass gold` finds an object's Events by
        // its kind, name and UID; a cluster-scoped one's live in `default`.
        let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(client, "default");
        let mut found = None;
        for _ in 0..100 {
            let list = events
                .list(&kube::api::ListParams::default())
                .await
                .expect("events list");
            found = list
                .items
                .into_iter()
                .find(|e| e.reason.as_deref() == Some("Invalid"));
            if found.is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let event = found.expect("an Invalid event is written");
        let regarding = event.regarding.expect("regarding");
        assert_eq!(regarding.kind.as_deref(), Some("GpuLeaseClass"));
        assert_eq!(regarding.name.as_deref(), Some("gold"));
        assert_eq!(regarding.namespace, None);
        assert_eq!(regarding.uid, created.metadata.uid);
        assert!(regarding.uid.is_some());
        assert_eq!(event.type_.as_deref(), Some("Warning"));
        assert_eq!(event.note.as_deref(), Some("class gold: it is broken"));
    }
}
