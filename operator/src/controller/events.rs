//! Kubernetes Events on pods (Queued, Admitted, Preempted, Rejected,
//! Failed, Unplaceable) and on classes (Invalid).
//!
//! A release has no Event: a lease is released only when its pod has
//! finished (the pod's own phase says so) or is gone (no one is left to
//! show it to), and the lease's phase records it either way. Leaving it out
//! spares the API server a write just as the freed slot's next pod is
//! admitted.
//!
//! Events are published off the decision path by one task with a bounded
//! queue, [`IN_FLIGHT`] writes at a time: a slow or failing Events API
//! never delays an admission, and when the queue is full the event is
//! dropped and counted. Each Event carries the time it happened, not the
//! time it was written.
//!
//! The task writes `events.k8s.io/v1` Events itself rather than through
//! kube's `Recorder`, which keeps every event it published in the last six
//! minutes and scans them all on each publish, so its memory and the cost
//! of each event grow with the queue. Here an event that repeats one of the last [`RECENT`] (same
//! object, reason and note, within [`SERIES_WINDOW`]) counts up that
//! event's `series` instead of creating another object, so a pod that flaps
//! does not fill its namespace with Events, and memory stays bounded.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use futures::future::BoxFuture;
use futures::stream::{FuturesUnordered, StreamExt};
use jiff::{SignedDuration, Timestamp};
use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::{Event as K8sEvent, EventSeries};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, Client};
use tokio::sync::mpsc;

use crate::engine::ObjectKey;
use crate::metrics::Metrics;

/// Events waiting to be published before new ones are dropped.
const QUEUE: usize = 4096;
/// Urgent events (see [`PodEvent::is_urgent`]) waiting before new ones are dropped.
const URGENT_QUEUE: usize = 256;
/// Events written at once: more than one, so that a burst of pod creates
/// does not fill the queue and drop events while each write waits on the
/// API server.
pub const IN_FLIGHT: usize = 4;

/// Published events remembered for series, at most.
pub const RECENT: usize = 1024;

/// How long after it was first published an event may still be counted up.
pub const SERIES_WINDOW: SignedDuration = SignedDuration::from_mins(6);

/// What happened to a pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PodEvent {
    /// It got a lease and waits at `position`.
    Queued {
        /// 1-based place among waiting pods of its role, when known.
        position: Option<u32>,
    },
    /// It was admitted to `node`.
    Admitted {
        /// The node.
        node: String,
    },
    /// It is evicted for `by` (`namespace/name` of a primary).
    Preempted {
        /// The primary.
        by: String,
    },
    /// Its lease was rejected: the pod cannot queue as it is (the note says why).
    Rejected {
        /// The lease's message.
        why: String,
    },
    /// It failed, and the kubelet said why (it refused the pod at
    /// admission, say): its slots are released.
    Failed {
        /// The lease's message, with the kubelet's reason and message.
        why: String,
    },
    /// It was admitted, but the scheduler could not place it for its
    /// class's placement timeout: it is deleted so that its slots go
    /// back to the pool.
    Unplaceable {
        /// The lease's message, with the scheduler's.
        why: String,
    },
}

impl PodEvent {
    /// Reason and note as `kubectl describe pod` shows them.
    pub fn reason_and_note(&self) -> (&'static str, String) {
        match self {
            PodEvent::Queued { position: Some(p) } => {
                ("Queued", format!("waiting for a GPU slot at position {p}"))
            }
            PodEvent::Queued { position: None } => ("Queued", "waiting for a GPU slot".to_owned()),
            PodEvent::Admitted { node } => ("Admitted", format!("admitted to node {node}")),
            PodEvent::Preempted { by } => (
                "Preempted",
                format!("evicted to free GPU slots for primary {by}"),
            ),
            PodEvent::Rejected { why } => ("Rejected", why.clone()),
            PodEvent::Failed { why } => ("Failed", why.clone()),
            PodEvent::Unplaceable { why } => ("Unplaceable", why.clone()),
        }
    }

    /// `Warning` for what the pod's owner must act on, `Normal` otherwise.
    pub fn is_warning(&self) -> bool {
        matches!(
            self,
            PodEvent::Rejected { .. } | PodEvent::Failed { .. } | PodEvent::Unplaceable { .. }
        )
    }

    /// Published ahead of the queue: the one event that says why a helper
    /// or an unplaceable pod vanished must not wait seconds behind a burst
    /// of Queued and Admitted events, in which an operator that dies loses
    /// it.
    pub fn is_urgent(&self) -> bool {
        matches!(
            self,
            PodEvent::Preempted { .. } | PodEvent::Unplaceable { .. }
        )
    }
}

/// What an event is about. A pod is held by the key the index holds it
/// under, whose strings it shares: in a create burst the queue holds
/// thousands of events, and a full `ObjectReference` and a log name for
/// each would be seven copies of strings the index already has. The
/// reference is built when the event is written.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Regarding {
    /// A pod.
    Pod {
        /// Its namespace and name.
        key: ObjectKey,
        /// Its UID.
        uid: Arc<str>,
    },
    /// A GpuLeaseClass (cluster-scoped).
    Class {
        /// Its name.
        name: Arc<str>,
        /// Its UID, when known.
        uid: Option<Arc<str>>,
    },
}

impl Regarding {
    /// The namespace its Event is written in.
    fn namespace(&self) -> &str {
        match self {
            Regarding::Pod { key, .. } => &key.namespace,
            // Events about a cluster-scoped object go to `default`, as
            // kube's recorder puts them.
            Regarding::Class { .. } => "default",
        }
    }

    /// Its name, which its Events are named after.
    fn name(&self) -> &str {
        match self {
            Regarding::Pod { key, .. } => &key.name,
            Regarding::Class { name, .. } => name,
        }
    }

    /// The Event's `regarding`.
    fn reference(&self) -> ObjectReference {
        match self {
            Regarding::Pod { key, uid } => ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Pod".into()),
                namespace: Some(key.namespace.to_string()),
                name: Some(key.name.to_string()),
                uid: Some(uid.to_string()),
                ..Default::default()
            },
            Regarding::Class { name, uid } => ObjectReference {
                api_version: Some(format!(
                    "{}/{}",
                    gpupool_api::names::GROUP,
                    gpupool_api::names::VERSION
                )),
                kind: Some("GpuLeaseClass".into()),
                name: Some(name.to_string()),
                uid: uid.as_deref().map(str::to_owned),
                ..Default::default()
            },
        }
    }
}

/// `namespace/name` of a pod, the name of a class: for logs.
impl std::fmt::Display for Regarding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Regarding::Pod { key, .. } => key.fmt(f),
            Regarding::Class { name, .. } => f.write_str(name),
        }
    }
}

/// An event to publish.
#[derive(Debug, Clone)]
struct Emit {
    /// The object it is about.
    regarding: Regarding,
    reason: &'static str,
    note: String,
    warning: bool,
    /// When it happened.
    at: Timestamp,
}

/// What makes two events the same occurrence, counted in one series.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct SeriesKey {
    regarding: Regarding,
    reason: &'static str,
    note: String,
}

impl SeriesKey {
    fn of(e: &Emit) -> Self {
        Self {
            regarding: e.regarding.clone(),
            reason: e.reason,
            note: e.note.clone(),
        }
    }
}

/// An Event object already written, which a repeat counts up.
#[derive(Debug, Clone, PartialEq)]
struct Published {
    /// The Event's name.
    name: String,
    /// Occurrences so far (1 until the first repeat).
    count: i32,
}

/// The last [`RECENT`] events published within [`SERIES_WINDOW`], by what
/// they say. Each operation is O(1) amortized.
#[derive(Debug, Default)]
struct Recent {
    by_key: HashMap<SeriesKey, Published>,
    /// Keys in the order first published, with that time.
    order: VecDeque<(SeriesKey, Timestamp)>,
}

impl Recent {
    /// Forgets events first published before `now - SERIES_WINDOW`.
    fn expire(&mut self, now: Timestamp) {
        while let Some((key, at)) = self.order.front() {
            if *at + SERIES_WINDOW > now {
                break;
            }
            self.by_key.remove(key);
            self.order.pop_front();
        }
    }

    /// Counts `times` more occurrences of `key`, when it was published
    /// recently; returns the Event to update.
    fn repeat(&mut self, key: &SeriesKey, times: i32) -> Option<&Published> {
        let published = self.by_key.get_mut(key)?;
        published.count = published.count.saturating_add(times);
        Some(published)
    }

    /// Remembers a newly written Event, forgetting the oldest beyond [`RECENT`].
    fn insert(&mut self, key: SeriesKey, name: String, now: Timestamp) {
        if self
            .by_key
            .insert(key.clone(), Published { name, count: 1 })
            .is_none()
        {
            self.order.push_back((key, now));
        }
        while self.order.len() > RECENT {
            if let Some((old, _)) = self.order.pop_front() {
                self.by_key.remove(&old);
            }
        }
    }

    fn forget(&mut self, key: &SeriesKey) {
        self.by_key.remove(key);
        self.order.retain(|(k, _)| k != key);
    }
}

/// Writes Events as the operator's reporting controller and instance.
struct Publisher {
    client: Client,
    controller: String,
    instance: String,
    recent: Recent,
    /// The series being written, each with the repeats of it that came
    /// meanwhile: they wait for that write, so that they count up the
    /// Event it creates instead of creating more (a pod that flaps must
    /// not fill its namespace with Events), and are written as one.
    writing: HashMap<SeriesKey, Option<Repeats>>,
}

/// Repeats of a series that came while it was being written.
struct Repeats {
    /// How many.
    count: i32,
    /// The latest.
    latest: Emit,
}

/// How one write of an Event ended.
struct Written {
    /// The event.
    emit: Emit,
    /// What it counts as.
    key: SeriesKey,
    /// The Event object it created, if it created one (and whether that
    /// replaced a series whose Event was gone), or why it failed.
    outcome: Result<Option<(String, bool)>, kube::Error>,
}

impl Publisher {
    /// Takes `e` to publish: the write to start, or nothing when its
    /// series is being written (it is then written with that write's
    /// other repeats once that one ends).
    fn take(&mut self, e: Emit, now: Timestamp) -> Option<BoxFuture<'static, Written>> {
        let key = SeriesKey::of(&e);
        if let Some(waiting) = self.writing.get_mut(&key) {
            match waiting {
                Some(repeats) => {
                    repeats.count = repeats.count.saturating_add(1);
                    repeats.latest = e;
                }
                None => {
                    *waiting = Some(Repeats {
                        count: 1,
                        latest: e,
                    });
                }
            }
            return None;
        }
        self.writing.insert(key.clone(), None);
        Some(self.write(e, key, 1, now))
    }

    /// Starts writing `e`, which stands for `times` occurrences: a count up
    /// of the series it repeats, or a new Event. What the series remember
    /// is updated when the write ends ([`Publisher::write_ended`]), so the task
    /// can have several in flight.
    fn write(
        &mut self,
        e: Emit,
        key: SeriesKey,
        times: i32,
        now: Timestamp,
    ) -> BoxFuture<'static, Written> {
        self.recent.expire(now);
        let api: Api<K8sEvent> = Api::namespaced(self.client.clone(), e.regarding.namespace());
        let repeat = self.recent.repeat(&key, times).map(|published| {
            let series = K8sEvent {
                series: Some(EventSeries {
                    count: published.count,
                    last_observed_time: MicroTime(e.at),
                }),
                ..K8sEvent::default()
            };
            (published.name.clone(), series)
        });
        let event = self.event(&e);
        Box::pin(async move {
            let mut replaced = false;
            if let Some((name, series)) = repeat {
                let patched = api
                    .patch(&name, &PatchParams::default(), &Patch::Merge(&series))
                    .await;
                match patched {
                    Ok(_) => {
                        return Written {
                            emit: e,
                            key,
                            outcome: Ok(None),
                        };
                    }
                    // The Event expired or was deleted: write it anew.
                    Err(kube::Error::Api(s)) if s.code == 404 => replaced = true,
                    Err(err) => {
                        return Written {
                            emit: e,
                            key,
                            outcome: Err(err),
                        };
                    }
                }
            }
            let name = event.metadata.name.clone().unwrap_or_default();
            let outcome = api
                .create(&PostParams::default(), &event)
                .await
                .map(|_| Some((name, replaced)));
            Written {
                emit: e,
                key,
                outcome,
            }
        })
    }

    /// Notes how a write ended: a new Event is what later repeats count
    /// up; a failure is counted and logged. Returns the write of the
    /// repeats that came meanwhile, counted up at once, if any came.
    fn write_ended(
        &mut self,
        written: Written,
        metrics: &Metrics,
        now: Timestamp,
    ) -> Option<BoxFuture<'static, Written>> {
        let Written { emit, key, outcome } = written;
        match outcome {
            Ok(None) => {}
            Ok(Some((name, replaced))) => {
                if replaced {
                    self.recent.forget(&key);
                }
                self.recent.insert(key.clone(), name, emit.at);
            }
            Err(err) => {
                metrics.error("publish_event");
                tracing::warn!(object = %emit.regarding, reason = emit.reason, error = %err, "cannot publish event");
            }
        }
        let Repeats { count, latest } = self.writing.remove(&key).flatten()?;
        self.writing.insert(key.clone(), None);
        Some(self.write(latest, key, count, now))
    }

    /// A new Event, named after its object and the time it happened, as
    /// kube names them.
    fn event(&self, e: &Emit) -> K8sEvent {
        K8sEvent {
            metadata: ObjectMeta {
                namespace: Some(e.regarding.namespace().to_owned()),
                name: Some(format!("{}.{:x}", e.regarding.name(), e.at.as_nanosecond())),
                ..ObjectMeta::default()
            },
            event_time: Some(MicroTime(e.at)),
            action: Some(e.reason.to_owned()),
            reason: Some(e.reason.to_owned()),
            note: Some(e.note.clone()),
            regarding: Some(e.regarding.reference()),
            reporting_controller: Some(self.controller.clone()),
            reporting_instance: Some(self.instance.clone()),
            type_: Some(if e.warning { "Warning" } else { "Normal" }.to_owned()),
            ..K8sEvent::default()
        }
    }
}

/// Hands events to the publishing task.
#[derive(Clone)]
pub struct EventSink {
    tx: mpsc::Sender<Emit>,
    urgent: mpsc::Sender<Emit>,
    metrics: Metrics,
}

impl EventSink {
    /// Starts the publishing task (it ends when every sink is dropped).
    pub fn spawn(client: Client, instance: String, metrics: Metrics) -> Self {
        let (tx, mut rx) = mpsc::channel::<Emit>(QUEUE);
        let (urgent, mut urgent_rx) = mpsc::channel::<Emit>(URGENT_QUEUE);
        let mut publisher = Publisher {
            client,
            controller: gpupool_api::names::FIELD_MANAGER_OPERATOR.to_owned(),
            instance,
            recent: Recent::default(),
            writing: HashMap::new(),
        };
        let task_metrics = metrics.clone();
        tokio::spawn(async move {
            let mut writing = FuturesUnordered::new();
            loop {
                let room = writing.len() < IN_FLIGHT;
                let next = tokio::select! {
                    biased;
                    Some(written) = writing.next(), if !writing.is_empty() => {
                        publisher.write_ended(written, &task_metrics, Timestamp::now())
                    }
                    Some(e) = urgent_rx.recv(), if room => publisher.take(e, Timestamp::now()),
                    Some(e) = rx.recv(), if room => publisher.take(e, Timestamp::now()),
                    else => break,
                };
                writing.extend(next);
            }
        });
        Self {
            tx,
            urgent,
            metrics,
        }
    }

    /// Queues an event about a pod; drops (and counts) it when the queue is full.
    pub fn emit(&self, pod: &ObjectKey, uid: &str, event: PodEvent) {
        let (reason, note) = event.reason_and_note();
        let queue = if event.is_urgent() {
            &self.urgent
        } else {
            &self.tx
        };
        self.send(
            queue,
            Emit {
                regarding: Regarding::Pod {
                    key: pod.clone(),
                    uid: uid.into(),
                },
                reason,
                note,
                warning: event.is_warning(),
                at: Timestamp::now(),
            },
        );
    }

    /// Queues a Warning `Invalid` event on class `class` (whose UID is
    /// `uid`: `kubectl describe` finds an object's Events by it) saying why
    /// it cannot admit anything.
    pub fn emit_class_invalid(&self, class: &str, uid: Option<&str>, why: String) {
        self.send(
            &self.tx,
            Emit {
                regarding: Regarding::Class {
                    name: class.into(),
                    uid: uid.map(Arc::from),
                },
                reason: "Invalid",
                note: why,
                warning: true,
                at: Timestamp::now(),
            },
        );
    }

    /// Queues `e` on `queue`; drops (and counts) it when that queue is full.
    fn send(&self, queue: &mpsc::Sender<Emit>, e: Emit) {
        if queue.try_send(e).is_err() {
            self.metrics.events_dropped.inc();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use http_body_util::BodyExt as _;
    use tokio::sync::Semaphore;

    use super::*;

    #[test]
    fn a_failed_pod_gets_a_warning_saying_why() {
        let event = PodEvent::Failed {
            why: "released: pod failed: UnexpectedAdmissionError: Requested: 2, Available: 1"
                .into(),
        };
        assert!(event.is_warning());
        assert!(!event.is_urgent());
        let (reason, note) = event.reason_and_note();
        assert_eq!(reason, "Failed");
        assert!(note.contains("UnexpectedAdmissionError"), "{note}");
    }

    #[test]
    fn a_pod_given_back_gets_an_urgent_warning_saying_why() {
        let event = PodEvent::Unplaceable {
            why: "released: node-1 could not run the pod: 0/3 nodes are available".into(),
        };
        assert!(event.is_warning() && event.is_urgent());
        let (reason, note) = event.reason_and_note();
        assert_eq!(reason, "Unplaceable");
        assert!(note.contains("0/3 nodes are available"), "{note}");
    }

    #[test]
    fn only_deletions_go_ahead_of_the_queue() {
        assert!(PodEvent::Preempted { by: "ns/p".into() }.is_urgent());
        assert!(!PodEvent::Failed { why: "x".into() }.is_urgent());
        assert!(!PodEvent::Queued { position: Some(1) }.is_urgent());
        assert!(
            !PodEvent::Admitted {
                node: "node-1".into()
            }
            .is_urgent()
        );
    }

    #[test]
    fn notes_say_what_happened() {
        assert_eq!(
            PodEvent::Queued { position: Some(3) }.reason_and_note(),
            ("Queued", "waiting for a GPU slot at position 3".to_owned())
        );
        let (r, n) = PodEvent::Admitted {
            node: "node-1".into(),
        }
        .reason_and_note();
        assert_eq!((r, n.contains("node-1")), ("Admitted", true));
        let (r, n) = PodEvent::Preempted { by: "ns/p".into() }.reason_and_note();
        assert_eq!((r, n.contains("ns/p")), ("Preempted", true));
    }

    /// How the test API server answers one write.
    #[derive(Clone, Copy)]
    struct Answer {
        /// Held until the test lets one more through (`release`).
        held: bool,
        /// Refused with a 500 rather than accepted (its body echoed).
        refused: bool,
    }

    /// A sink whose API server answers the `n`th write (from 0) as
    /// `answer(n)` says.
    struct HeldBack {
        sink: EventSink,
        metrics: Metrics,
        /// Each write's `reason` (empty for a body that is not an Event),
        /// in arrival order.
        seen: Arc<Mutex<Vec<String>>>,
        /// Each write's HTTP method, likewise.
        methods: Arc<Mutex<Vec<String>>>,
        /// Lets held writes be answered, one per permit.
        release: Arc<Semaphore>,
        /// One message per write as it arrives.
        arrivals: mpsc::UnboundedReceiver<()>,
    }

    fn held_back(answer: fn(usize) -> Answer) -> HeldBack {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let methods = Arc::new(Mutex::new(Vec::new()));
        let release = Arc::new(Semaphore::new(0));
        let (arrived, arrivals) = mpsc::unbounded_channel();
        let (s, m, r) = (seen.clone(), methods.clone(), release.clone());
        let service = tower::service_fn(move |request: http::Request<kube::client::Body>| {
            let (seen, methods, release, arrived) =
                (s.clone(), m.clone(), r.clone(), arrived.clone());
            async move {
                let method = request.method().to_string();
                let body = request.into_body().collect().await?.to_bytes();
                let reason = serde_json::from_slice::<K8sEvent>(&body)
                    .ok()
                    .and_then(|event| event.reason)
                    .unwrap_or_default();
                let answer = {
                    let mut methods = methods.lock().expect("not poisoned");
                    methods.push(method);
                    seen.lock().expect("not poisoned").push(reason);
                    answer(methods.len() - 1)
                };
                let _ = arrived.send(());
                if answer.held {
                    release.acquire().await?.forget();
                }
                let (status, body) = if answer.refused {
                    let refusal: &[u8] = br#"{"kind":"Status","apiVersion":"v1","status":"Failure","message":"unavailable","reason":"InternalError","code":500}"#;
                    (500, bytes::Bytes::from_static(refusal))
                } else {
                    (201, body)
                };
                let response = http::Response::builder()
                    .status(status)
                    .header("content-type", "application/json")
                    .body(http_body_util::Full::new(body))?;
                Ok::<_, Box<dyn std::error::Error + Send + Sync>>(response)
            }
        });
        let metrics = Metrics::register(&mut prometheus_client::registry::Registry::default());
        let sink = EventSink::spawn(
            Client::new(service, "default"),
            "test".into(),
            metrics.clone(),
        );
        HeldBack {
            sink,
            metrics,
            seen,
            methods,
            release,
            arrivals,
        }
    }

    /// A [`HeldBack`] sink with every write slot taken by a Queued event
    /// its API server holds, as on a slow API server.
    async fn held_back_and_full() -> HeldBack {
        let mut h = held_back(|_| Answer {
            held: true,
            refused: false,
        });
        for i in 0..IN_FLIGHT {
            h.sink.emit(
                &pod(&format!("a{i}")),
                "uid",
                PodEvent::Queued { position: Some(1) },
            );
        }
        for _ in 0..IN_FLIGHT {
            h.arrivals.recv().await.expect("a held write");
        }
        h
    }

    fn pod(name: &str) -> ObjectKey {
        ObjectKey::new("ml", name)
    }

    fn admitted() -> PodEvent {
        PodEvent::Admitted {
            node: "node-1".into(),
        }
    }

    #[tokio::test]
    async fn at_most_in_flight_events_are_written_at_once() {
        let mut h = held_back_and_full().await;
        h.sink.emit(&pod("b"), "uid-b", admitted());
        h.sink.emit(&pod("c"), "uid-c", admitted());
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        assert_eq!(h.seen.lock().expect("not poisoned").len(), IN_FLIGHT);
        h.release.add_permits(1);
        h.arrivals.recv().await.expect("one more once one ends");
        h.release.add_permits(1_000);
        h.arrivals.recv().await.expect("and the last");
        assert_eq!(h.seen.lock().expect("not poisoned").len(), IN_FLIGHT + 2);
        assert_eq!(h.metrics.events_dropped.get(), 0);
    }

    #[tokio::test]
    async fn a_preemption_is_published_before_events_queued_ahead_of_it() {
        // The publisher is stuck on its writes with a burst queued behind.
        let mut h = held_back_and_full().await;
        h.sink.emit(&pod("b"), "uid-b", admitted());
        h.sink
            .emit(&pod("c"), "uid-c", PodEvent::Queued { position: Some(2) });
        h.sink.emit(
            &pod("w"),
            "uid-w",
            PodEvent::Preempted { by: "ml/a".into() },
        );
        h.release.add_permits(1);
        h.arrivals
            .recv()
            .await
            .expect("the first write after a slot frees");
        assert_eq!(
            h.seen.lock().expect("not poisoned")[IN_FLIGHT],
            "Preempted",
            "the urgent lane goes first"
        );
        h.release.add_permits(1_000);
        for _ in 0..2 {
            h.arrivals.recv().await.expect("every event is written");
        }
        let mut rest = h.seen.lock().expect("not poisoned")[IN_FLIGHT + 1..].to_vec();
        rest.sort();
        assert_eq!(rest, ["Admitted", "Queued"]);
    }

    #[tokio::test]
    async fn a_full_urgent_lane_drops_and_counts_what_it_cannot_hold() {
        let h = held_back_and_full().await;
        for i in 0..=URGENT_QUEUE {
            let by = format!("ml/p{i}");
            h.sink.emit(&pod("a"), "uid-a", PodEvent::Preempted { by });
        }
        assert_eq!(
            h.metrics.events_dropped.get(),
            1,
            "one more than the lane holds"
        );
        h.sink.emit(&pod("a"), "uid-a", admitted());
        assert_eq!(
            h.metrics.events_dropped.get(),
            1,
            "the main queue still takes events"
        );
    }

    #[tokio::test]
    async fn repeats_that_waited_on_a_failed_write_are_written_as_one_new_event() {
        // The first write is held, then refused with a 500.
        let mut h = held_back(|n| Answer {
            held: n == 0,
            refused: n == 0,
        });
        let queued = || PodEvent::Queued { position: Some(1) };
        for _ in 0..3 {
            h.sink.emit(&pod("a"), "uid-a", queued());
        }
        h.arrivals.recv().await.expect("the first write");
        h.release.add_permits(1);
        h.arrivals.recv().await.expect("the repeats' write");
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        assert_eq!(
            *h.methods.lock().expect("not poisoned"),
            ["POST", "POST"],
            "the two repeats are one new Event, since the first was never written"
        );
        let failed = h
            .metrics
            .errors
            .get_or_create(&crate::metrics::ErrorLabel {
                error: "publish_event".into(),
            })
            .get();
        assert_eq!(failed, 1);
    }

    #[tokio::test]
    async fn an_event_carries_the_time_it_happened() {
        let publisher = Publisher {
            client: Client::new(
                tower::service_fn(|_: http::Request<kube::client::Body>| async {
                    Err::<http::Response<http_body_util::Full<bytes::Bytes>>, std::io::Error>(
                        std::io::Error::other("never called"),
                    )
                }),
                "default",
            ),
            controller: "gpupool-operator".into(),
            instance: "test".into(),
            recent: Recent::default(),
            writing: HashMap::new(),
        };
        let at = Timestamp::from_second(1_800_000_000).expect("time");
        let event = publisher.event(&Emit {
            regarding: Regarding::Pod {
                key: pod("p"),
                uid: "uid-p".into(),
            },
            reason: "Queued",
            note: "waiting".into(),
            warning: false,
            at,
        });
        assert_eq!(event.event_time, Some(MicroTime(at)));
        assert_eq!(
            event.metadata.name,
            Some(format!("p.{:x}", at.as_nanosecond()))
        );
        assert_eq!(event.type_.as_deref(), Some("Normal"));
        assert_eq!(event.metadata.namespace.as_deref(), Some("ml"));
        let regarding = event.regarding.expect("regarding");
        assert_eq!(
            (
                regarding.api_version.as_deref(),
                regarding.kind.as_deref(),
                regarding.namespace.as_deref(),
                regarding.name.as_deref(),
                regarding.uid.as_deref(),
            ),
            (
                Some("v1"),
                Some("Pod"),
                Some("ml"),
                Some("p"),
                Some("uid-p")
            )
        );
    }

    #[test]
    fn a_queued_event_is_small() {
        // The queue holds up to `QUEUE` of these in a create burst.
        assert!(
            std::mem::size_of::<Emit>() <= 128,
            "{}",
            std::mem::size_of::<Emit>()
        );
    }

    #[test]
    fn a_class_event_names_the_class_and_is_written_in_default() {
        let class = Regarding::Class {
            name: "gold".into(),
            uid: None,
        };
        assert_eq!(class.namespace(), "default");
        assert_eq!(class.to_string(), "gold");
        let reference = class.reference();
        assert_eq!(
            (
                reference.api_version,
                reference.kind.as_deref(),
                reference.namespace,
                reference.name.as_deref(),
                reference.uid,
            ),
            (
                Some(format!(
                    "{}/{}",
                    gpupool_api::names::GROUP,
                    gpupool_api::names::VERSION
                )),
                Some("GpuLeaseClass"),
                None,
                Some("gold"),
                None
            )
        );
        let pod = Regarding::Pod {
            key: pod("p"),
            uid: "u".into(),
        };
        assert_eq!(pod.to_string(), "ml/p");
    }

    #[test]
    fn a_series_is_one_object_the_same_event_is_about() {
        let about = |uid: &str| Regarding::Pod {
            key: pod("p"),
            uid: uid.into(),
        };
        assert_eq!(about("u1"), about("u1"));
        assert_ne!(
            about("u1"),
            about("u2"),
            "a pod created again under its name is another"
        );
        assert_ne!(
            about("u1"),
            Regarding::Class {
                name: "p".into(),
                uid: Some("u1".into()),
            }
        );
    }

    fn key(name: &str, note: &str) -> SeriesKey {
        SeriesKey {
            regarding: Regarding::Pod {
                key: pod(name),
                uid: format!("uid-{name}").into(),
            },
            reason: "Queued",
            note: note.into(),
        }
    }

    fn at(secs: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + secs).expect("time")
    }

    #[test]
    fn a_repeat_within_the_window_counts_up_the_event_it_repeats() {
        let mut recent = Recent::default();
        assert!(
            recent.repeat(&key("a", "x"), 1).is_none(),
            "nothing published"
        );
        recent.insert(key("a", "x"), "a.1".into(), at(0));
        assert!(
            recent.repeat(&key("a", "other note"), 1).is_none(),
            "another note is another event"
        );
        assert!(recent.repeat(&key("b", "x"), 1).is_none(), "another pod");
        let published = recent.repeat(&key("a", "x"), 1).cloned();
        assert_eq!(
            published,
            Some(Published {
                name: "a.1".into(),
                count: 2
            })
        );
        assert_eq!(recent.repeat(&key("a", "x"), 1).map(|p| p.count), Some(3));

        // Six minutes after it was first published it is forgotten.
        recent.expire(at(359));
        assert!(recent.repeat(&key("a", "x"), 1).is_some());
        recent.expire(at(360));
        assert!(recent.repeat(&key("a", "x"), 1).is_none());
        assert!(recent.by_key.is_empty() && recent.order.is_empty());
    }

    #[test]
    fn at_most_recent_events_are_remembered_the_oldest_forgotten_first() {
        let mut recent = Recent::default();
        for i in 0..RECENT + 10 {
            recent.insert(key(&format!("p{i}"), "x"), format!("p{i}.1"), at(0));
        }
        assert_eq!((recent.by_key.len(), recent.order.len()), (RECENT, RECENT));
        assert!(
            recent.repeat(&key("p0", "x"), 1).is_none(),
            "the oldest went"
        );
        assert!(recent.repeat(&key("p10", "x"), 1).is_some());
        let last = format!("p{}", RECENT + 9);
        assert!(recent.repeat(&key(&last, "x"), 1).is_some());

        recent.forget(&key("p10", "x"));
        assert!(recent.repeat(&key("p10", "x"), 1).is_none());
        assert_eq!(
            (recent.by_key.len(), recent.order.len()),
            (RECENT - 1, RECENT - 1)
        );
    }
}
