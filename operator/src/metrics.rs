//! The operator's Prometheus metrics and its `/metrics`, `/healthz` and
//! `/readyz` HTTP server.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio::sync::watch;

/// Labels of the per-class, per-role series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ClassRole {
    /// Class name.
    pub class: String,
    /// `primary` or `helper`.
    pub role: String,
}

/// Labels of the per-class series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ClassLabel {
    /// Class name.
    pub class: String,
}

/// Labels of the error counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabel {
    /// What failed (`Error::metric_label`).
    pub error: String,
}

fn wait_histogram() -> Histogram {
    // 1 ms … ~9 h: admission waits range from an idle cluster to a long queue.
    Histogram::new(exponential_buckets(0.001, 4.0, 13))
}

/// The controller's metrics. Cloning shares the series.
#[derive(Clone)]
pub struct Metrics {
    /// Waiting leases by class and role.
    pub queue_depth: Family<ClassRole, Gauge>,
    /// Pods admitted, by class and role.
    pub admissions: Family<ClassRole, Counter>,
    /// Helpers evicted for primaries, by class.
    pub preemptions: Family<ClassLabel, Counter>,
    /// Admitted pods deleted because the scheduler could not place them, by class.
    pub give_backs: Family<ClassLabel, Counter>,
    /// Seconds from a lease's queuedAt to its admittedAt, by class and role.
    pub admission_wait: Family<ClassRole, Histogram, fn() -> Histogram>,
    /// Seconds one decision pass took (snapshot, decide and apply).
    pub pass_duration: Histogram,
    /// Failed API calls and conflicts, by kind.
    pub errors: Family<ErrorLabel, Counter>,
    /// Events that could not be queued for publishing (queue full).
    pub events_dropped: Counter,
    /// 1 while this replica is the leader (or runs without election).
    pub leader: Gauge,
}

impl Metrics {
    /// Creates the metrics and registers them in `registry` under the `gpupool_operator` prefix.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self {
            queue_depth: Family::default(),
            admissions: Family::default(),
            preemptions: Family::default(),
            give_backs: Family::default(),
            admission_wait: Family::new_with_constructor(wait_histogram),
            pass_duration: Histogram::new(exponential_buckets(0.0001, 2.0, 18)),
            errors: Family::default(),
            events_dropped: Counter::default(),
            leader: Gauge::default(),
        };
        let r = registry.sub_registry_with_prefix("gpupool_operator");
        r.register(
            "queue_depth",
            "Leases waiting for a slot, by class and role",
            m.queue_depth.clone(),
        );
        r.register(
            "admissions",
            "Pods admitted to a GPU slot, by class and role",
            m.admissions.clone(),
        );
        r.register(
            "preemptions",
            "Helper pods evicted to make room for a primary, by class",
            m.preemptions.clone(),
        );
        r.register(
            "give_backs",
            "Admitted pods deleted to give their slots back because the scheduler could not place them within their class's placementTimeoutSeconds, by class",
            m.give_backs.clone(),
        );
        r.register(
            "admission_wait_seconds",
            "Time from a lease being queued to its pod being admitted",
            m.admission_wait.clone(),
        );
        r.register(
            "reconcile_duration_seconds",
            "Duration of one decision pass over all classes",
            m.pass_duration.clone(),
        );
        r.register(
            "api_errors",
            "Failed Kubernetes API calls and write conflicts, by kind",
            m.errors.clone(),
        );
        r.register(
            "events_dropped",
            "Kubernetes Events not published because the event queue was full",
            m.events_dropped.clone(),
        );
        r.register(
            "leader",
            "1 while this replica is the leader and admits pods",
            m.leader.clone(),
        );
        m
    }

    /// Counts one error of kind `label`.
    pub fn error(&self, label: &str) {
        self.errors
            .get_or_create(&ErrorLabel {
                error: label.to_owned(),
            })
            .inc();
    }
}

/// What `/readyz` reports: ready once the webhook serves (its certificate
/// loaded, its port bound and its configurations written), every cache has
/// synced and, on the leader, the first decision pass has run. Every
/// replica serves the webhook, so a replica whose webhook cannot serve must
/// not receive the Service's traffic.
#[derive(Debug, Default)]
pub struct Health {
    /// A channel rather than a flag, so that the decision loop can wait for
    /// the webhook without polling.
    webhook_serving: watch::Sender<bool>,
    synced: AtomicBool,
    leading: AtomicBool,
    first_pass_done: AtomicBool,
}

impl Health {
    /// Records that the webhook accepts connections.
    pub fn set_webhook_serving(&self) {
        self.webhook_serving.send_replace(true);
    }

    /// Returns once the webhook accepts connections: at once when it
    /// already does, else as soon as [`Health::set_webhook_serving`] is called.
    pub async fn webhook_serves(&self) {
        let mut serving = self.webhook_serving.subscribe();
        // The sender lives in `self`, so the channel cannot close while this
        // waits: the only error `wait_for` has cannot happen.
        let _ = serving.wait_for(|serving| *serving).await;
    }

    /// Records that every watch has delivered its first list.
    pub fn set_synced(&self) {
        self.synced.store(true, Ordering::SeqCst);
    }

    /// Records whether this replica leads (passes only run on the leader).
    pub fn set_leading(&self, leading: bool) {
        if !leading {
            self.first_pass_done.store(false, Ordering::SeqCst);
        }
        self.leading.store(leading, Ordering::SeqCst);
    }

    /// Records that a decision pass completed while leading.
    pub fn set_pass_done(&self) {
        self.first_pass_done.store(true, Ordering::SeqCst);
    }

    /// True when the replica can serve: webhook serving, caches synced, and
    /// if leader, one pass done.
    pub fn is_ready(&self) -> bool {
        *self.webhook_serving.borrow()
            && self.synced.load(Ordering::SeqCst)
            && (!self.leading.load(Ordering::SeqCst) || self.first_pass_done.load(Ordering::SeqCst))
    }
}

/// Why the metrics server stopped.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The port could not be bound.
    #[error("cannot listen on {addr} (--metrics-port): {source}")]
    Bind {
        /// Address tried.
        addr: SocketAddr,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
}

/// Binds `addr`; the returned listener is then served by [`serve`]. Split so
/// that a taken port is reported before anything else starts.
pub async fn bind(addr: SocketAddr) -> Result<TcpListener, ServeError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| ServeError::Bind { addr, source })
}

/// Serves `/metrics`, `/healthz` and `/readyz` on `listener` until the
/// task is dropped, within [`gpupool_http_endpoint::Limits::default`], so
/// no peer of the cluster network can run the operator out of memory or
/// file descriptors through this port.
pub async fn serve(listener: TcpListener, registry: Arc<Registry>, health: Arc<Health>) {
    gpupool_http_endpoint::serve(
        listener,
        gpupool_http_endpoint::Limits::default(),
        move |request: &Request<Incoming>| respond(request, &registry, &health),
        std::future::pending(),
    )
    .await;
}

fn text(status: StatusCode, body: impl Into<Bytes>, content_type: &str) -> Response<Full<Bytes>> {
    let mut resp = Response::new(Full::new(body.into()));
    *resp.status_mut() = status;
    if let Ok(v) = http::HeaderValue::from_str(content_type) {
        resp.headers_mut().insert(http::header::CONTENT_TYPE, v);
    }
    resp
}

fn respond<B>(req: &Request<B>, registry: &Registry, health: &Health) -> Response<Full<Bytes>> {
    const PLAIN: &str = "text/plain; charset=utf-8";
    if req.method() != Method::GET {
        return text(StatusCode::METHOD_NOT_ALLOWED, "only GET\n", PLAIN);
    }
    match req.uri().path() {
        "/metrics" => {
            let mut body = String::new();
            match prometheus_client::encoding::text::encode(&mut body, registry) {
                Ok(()) => text(
                    StatusCode::OK,
                    body,
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                ),
                Err(e) => text(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("encoding metrics failed: {e}\n"),
                    PLAIN,
                ),
            }
        }
        "/healthz" => text(StatusCode::OK, "ok\n", PLAIN),
        "/readyz" => {
            if health.is_ready() {
                text(StatusCode::OK, "ready\n", PLAIN)
            } else {
                text(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "not ready: webhook starting, caches syncing or first pass pending\n",
                    PLAIN,
                )
            }
        }
        _ => text(StatusCode::NOT_FOUND, "not found\n", PLAIN),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn get(path: &str) -> Request<()> {
        Request::get(path).body(()).expect("request")
    }

    #[test]
    fn readiness_needs_sync_and_a_pass_when_leading() {
        let h = Health::default();
        assert!(!h.is_ready());
        h.set_synced();
        assert!(!h.is_ready(), "synced, but the webhook does not serve yet");
        h.set_webhook_serving();
        assert!(h.is_ready(), "a follower is ready once synced and serving");
        h.set_leading(true);
        assert!(!h.is_ready(), "a new leader waits for its first pass");
        h.set_pass_done();
        assert!(h.is_ready());
        h.set_leading(false);
        h.set_leading(true);
        assert!(!h.is_ready(), "regaining leadership needs a fresh pass");
    }

    #[tokio::test]
    async fn waiting_for_the_webhook_ends_when_it_serves_and_not_before() {
        let h = Health::default();
        let mut waiting = std::pin::pin!(h.webhook_serves());
        assert!(futures::poll!(waiting.as_mut()).is_pending());
        assert!(futures::poll!(waiting.as_mut()).is_pending());
        h.set_webhook_serving();
        assert!(futures::poll!(waiting.as_mut()).is_ready());
        // Once it serves, a wait ends at its first poll.
        assert!(futures::poll!(std::pin::pin!(h.webhook_serves())).is_ready());
    }

    #[test]
    fn endpoints_answer() {
        let mut registry = Registry::default();
        let m = Metrics::register(&mut registry);
        m.error("admit_pod");
        m.admissions
            .get_or_create(&ClassRole {
                class: "default".into(),
                role: "primary".into(),
            })
            .inc();
        m.give_backs
            .get_or_create(&ClassLabel {
                class: "default".into(),
            })
            .inc();
        let health = Health::default();
        let resp = respond(&get("/metrics"), &registry, &health);
        assert_eq!(resp.status(), StatusCode::OK);
        let body = format!("{:?}", resp.body());
        assert!(body.contains("gpupool_operator_api_errors_total"), "{body}");
        assert!(body.contains("admit_pod"), "{body}");
        assert!(body.contains("gpupool_operator_admissions_total"), "{body}");
        assert!(body.contains("gpupool_operator_give_backs_total"), "{body}");
        assert_eq!(
            respond(&get("/readyz"), &registry, &health).status(),
            StatusCode::SERVICE_UNAVAILABLE
        );
        health.set_synced();
        health.set_webhook_serving();
        assert_eq!(
            respond(&get("/readyz"), &registry, &health).status(),
            StatusCode::OK
        );
        assert_eq!(
            respond(&get("/healthz"), &registry, &health).status(),
            StatusCode::OK
        );
        assert_eq!(
            respond(&get("/nope"), &registry, &health).status(),
            StatusCode::NOT_FOUND
        );
        let post = Request::post("/metrics").body(()).expect("request");
        assert_eq!(
            respond(&post, &registry, &health).status(),
            StatusCode::METHOD_NOT_ALLOWED
        );
    }
}
