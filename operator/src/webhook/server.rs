//! The webhook's HTTPS server: rustls (ring) and hyper 1, AdmissionReview v1
//! bodies on [`MUTATE_PATH`], [`VALIDATE_PATH`], [`LEASE_PATH`] and
//! [`CLASS_PATH`], a latency histogram, and a certificate that can be
//! swapped while serving.
//!
//! Anyone who can reach the port can talk to it, and the webhook runs in the
//! operator's process, so what a peer can hold is bounded: connections
//! ([`MAX_CONNECTIONS`]; at the cap the server stops accepting, and further
//! peers wait in the listen backlog until a slot frees, rather than being
//! refused: a refused review is a user's `kubectl apply` refused), time to finish the TLS handshake, the headers and
//! the body, the size of one body ([`MAX_BODY_BYTES`]) and the bytes of all
//! bodies being read or reviewed at once ([`BODY_BUDGET_BYTES`]). A request
//! over a limit gets an HTTP answer saying which (over HTTP/2 too), not a
//! silently closed stream.

use std::convert::Infallible;
use std::future::Future;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use jiff::Timestamp;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, watch};

use super::config::{CLASS_PATH, LEASE_PATH, MUTATE_PATH, VALIDATE_PATH};
use super::review::{BadReview, ClusterView, Identities, WebhookKind, review_body};

/// Largest request body accepted. An object is at most 1.5 MiB in etcd and
/// an UPDATE review carries two of them, plus the review's own fields.
pub const MAX_BODY_BYTES: usize = (3 << 20) + (512 << 10);
/// Bytes of request bodies being read or reviewed at once, all connections
/// together: what peers can make the operator buffer.
pub const BODY_BUDGET_BYTES: usize = 32 << 20;
/// Connections served at once; further ones wait, unaccepted, in the
/// listen backlog until one of these ends.
pub const MAX_CONNECTIONS: usize = 256;
/// Concurrent requests (streams) on one HTTP/2 connection.
const MAX_STREAMS_PER_CONNECTION: u32 = 64;
/// Largest header block accepted.
const MAX_HEADER_BYTES: u32 = 64 << 10;
/// A client that has not finished its TLS handshake by then is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// An HTTP/1 client must send a request's headers within this time, also
/// after an idle pause between requests; otherwise the connection is closed.
const HEADER_TIMEOUT: Duration = Duration::from_secs(5);
/// A request body must arrive whole within this time (the API server waits
/// at most 30 seconds for a whole review, 5 by default in our configurations).
const BODY_TIMEOUT: Duration = Duration::from_secs(5);
/// HTTP/2 connections are pinged this often when idle, and closed when a
/// ping goes unanswered for [`HEADER_TIMEOUT`].
const PING_INTERVAL: Duration = Duration::from_secs(20);
/// Connections still open this long after shutdown are cut.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LatencyLabels {
    webhook: &'static str,
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RefusedLabels {
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: &'static str,
}

/// The webhook's metrics: `gpupool_webhook_request_duration_seconds`, a
/// histogram by `webhook` (mutate, validate, lease, class) and `outcome`
/// (allowed, patched, denied, bad_request, error) of the time from a complete
/// request body to a serialized response; and
/// `gpupool_webhook_refused_total` by `reason` (body_too_large,
/// body_timeout, busy): requests turned away by the server's limits;
/// `gpupool_webhook_connection_limit_reached_total`: how often every
/// connection slot was taken, so new peers had to wait in the backlog; and
/// `gpupool_webhook_configuration_repairs_total` by `kind`.
#[derive(Clone, Debug)]
pub struct WebhookMetrics {
    latency: Family<LatencyLabels, Histogram>,
    refused: Family<RefusedLabels, Counter>,
    limit_reached: Counter,
    repairs: Family<KindLabels, Counter>,
}

impl Default for WebhookMetrics {
    fn default() -> Self {
        Self {
            // 50 µs .. ~1.6 s: the target is 2 ms, the API server's limit 5 s.
            latency: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(5e-5, 2.0, 16))
            }),
            refused: Family::default(),
            limit_reached: Counter::default(),
            repairs: Family::default(),
        }
    }
}

impl WebhookMetrics {
    /// Metrics registered in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = Self::default();
        registry.register(
            "gpupool_webhook_request_duration_seconds",
            "Time the pod admission webhook took to answer a review",
            metrics.latency.clone(),
        );
        registry.register(
            "gpupool_webhook_refused",
            "Requests the webhook server turned away at its limits",
            metrics.refused.clone(),
        );
        registry.register(
            "gpupool_webhook_connection_limit_reached",
            "Times every webhook connection slot was taken and new connections waited in the backlog",
            metrics.limit_reached.clone(),
        );
        registry.register(
            "gpupool_webhook_configuration_repairs",
            "Webhook configurations found deleted or changed by someone else and restored",
            metrics.repairs.clone(),
        );
        metrics
    }

    /// Counts one restored webhook configuration of `kind`.
    pub fn configuration_repaired(&self, kind: &'static str) {
        self.repairs.get_or_create(&KindLabels { kind }).inc();
    }

    fn refuse(&self, reason: &'static str) {
        self.refused.get_or_create(&RefusedLabels { reason }).inc();
    }

    fn observe(&self, webhook: &'static str, outcome: &'static str, started: Instant) {
        self.latency
            .get_or_create(&LatencyLabels { webhook, outcome })
            .observe(started.elapsed().as_secs_f64());
    }
}

/// The serving certificate, replaceable while the server runs (renewals).
#[derive(Debug)]
pub struct CertResolver(RwLock<Arc<CertifiedKey>>);

impl CertResolver {
    /// A resolver presenting `key`.
    pub fn new(key: Arc<CertifiedKey>) -> Arc<Self> {
        Arc::new(Self(RwLock::new(key)))
    }

    /// Presents `key` from the next handshake on.
    pub fn replace(&self, key: Arc<CertifiedKey>) {
        match self.0.write() {
            Ok(mut current) => *current = key,
            Err(poisoned) => *poisoned.into_inner() = key,
        }
    }

    fn current(&self) -> Arc<CertifiedKey> {
        match self.0.read() {
            Ok(current) => current.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }
}

impl ResolvesServerCert for CertResolver {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current())
    }
}

/// rustls server configuration (TLS 1.2 and 1.3, ring, ALPN h2 and
/// http/1.1) presenting the certificate `certs` holds.
pub fn tls_config(certs: Arc<CertResolver>) -> Result<Arc<rustls::ServerConfig>, rustls::Error> {
    let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_no_client_auth()
    .with_cert_resolver(certs);
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// What answers each review: the cluster view, the trusted identities,
/// metrics, and the budget of body bytes in flight.
pub struct Handler<V> {
    /// Where class, node and lease data come from.
    pub view: V,
    /// Who may remove the scheduling gate and write leases.
    pub identities: Identities,
    /// Where latencies are recorded.
    pub metrics: WebhookMetrics,
    /// KiB of request bodies being read or reviewed, at most [`BODY_BUDGET_BYTES`].
    pub body_budget: Semaphore,
}

impl<V> Handler<V> {
    /// A handler with the full body budget.
    pub fn new(view: V, identities: Identities, metrics: WebhookMetrics) -> Self {
        Self {
            view,
            identities,
            metrics,
            body_budget: Semaphore::new(BODY_BUDGET_BYTES >> 10),
        }
    }
}

impl<V: ClusterView> Handler<V> {
    async fn handle(&self, request: Request<Incoming>) -> Response<Full<Bytes>> {
        let kind = match request.uri().path() {
            MUTATE_PATH => WebhookKind::Mutate,
            VALIDATE_PATH => WebhookKind::Validate,
            LEASE_PATH => WebhookKind::Lease,
            CLASS_PATH => WebhookKind::Class,
            other => {
                return text(
                    StatusCode::NOT_FOUND,
                    format!(
                        "no webhook at {other}; use {MUTATE_PATH}, {VALIDATE_PATH}, {LEASE_PATH} or {CLASS_PATH}"
                    ),
                );
            }
        };
        if request.method() != Method::POST {
            return text(
                StatusCode::METHOD_NOT_ALLOWED,
                format!(
                    "{} takes POST, not {}",
                    request.uri().path(),
                    request.method()
                ),
            );
        }
        let too_large = || {
            text(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!(
                    "the request body is larger than {MAX_BODY_BYTES} bytes, more than any AdmissionReview"
                ),
            )
        };
        let declared = request
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<usize>().ok());
        if declared.is_some_and(|n| n > MAX_BODY_BYTES) {
            self.metrics.refuse("body_too_large");
            return too_large();
        }
        // Reserve the body's size (or the largest allowed, when not declared)
        // before reading it, so peers together can never make the process
        // buffer more than the budget.
        let kib = declared.unwrap_or(MAX_BODY_BYTES).div_ceil(1024).max(1) as u32;
        let permit =
            match tokio::time::timeout(BODY_TIMEOUT, self.body_budget.acquire_many(kib)).await {
                Ok(Ok(permit)) => permit,
                _ => {
                    self.metrics.refuse("busy");
                    return text(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "the webhook is reading too many request bodies at once; retry".to_owned(),
                    );
                }
            };
        let read = Limited::new(request.into_body(), MAX_BODY_BYTES).collect();
        let body = match tokio::time::timeout(BODY_TIMEOUT, read).await {
            Ok(Ok(body)) => body.to_bytes(),
            Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => {
                self.metrics.refuse("body_too_large");
                return too_large();
            }
            Ok(Err(e)) => {
                return text(
                    StatusCode::BAD_REQUEST,
                    format!("cannot read the request body: {e}"),
                );
            }
            Err(_) => {
                self.metrics.refuse("body_timeout");
                return text(
                    StatusCode::REQUEST_TIMEOUT,
                    format!(
                        "the request body did not arrive within {} seconds",
                        BODY_TIMEOUT.as_secs()
                    ),
                );
            }
        };
        let started = Instant::now();
        let result = review_body(kind, &body, &self.view, &self.identities, Timestamp::now());
        drop(body);
        drop(permit);
        let (response, outcome) = match result {
            Ok((json, outcome)) => {
                let mut r = Response::new(Full::new(Bytes::from(json)));
                r.headers_mut().insert(
                    header::CONTENT_TYPE,
                    header::HeaderValue::from_static("application/json"),
                );
                (r, outcome)
            }
            Err(e @ BadReview::Encode(_)) => {
                tracing::error!(error = %e, "webhook response could not be encoded");
                (
                    text(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
                    "error",
                )
            }
            Err(e) => (text(StatusCode::BAD_REQUEST, e.to_string()), "bad_request"),
        };
        self.metrics.observe(kind.as_str(), outcome, started);
        response
    }
}

fn text(status: StatusCode, message: String) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(message)));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

/// Worker threads of the webhook's own runtime (see [`serve_isolated`]).
pub const WEBHOOK_THREADS: usize = 2;

/// Owns a runtime and shuts it down without blocking when dropped, which a
/// plain `Runtime` refuses to do inside another runtime.
struct OwnRuntime(Option<tokio::runtime::Runtime>);

impl Drop for OwnRuntime {
    fn drop(&mut self) {
        if let Some(runtime) = self.0.take() {
            runtime.shutdown_background();
        }
    }
}

/// [`serve`] on a runtime of its own ([`WEBHOOK_THREADS`] worker threads,
/// named `gpupool-webhook`), awaited from the caller's runtime.
///
/// Every pod create in the cluster waits for a review, and a review takes
/// microseconds; in the operator's main runtime it would wait in the run
/// queue behind whatever the controller has ready (watch events being
/// decoded, a decision pass, dozens of writes being encoded). On its own
/// runtime a review waits only for the operating system to schedule one of
/// the webhook's threads. Errors when the runtime cannot be built, the
/// listener cannot move to it or the server's task panics; dropping the
/// returned future stops the server at once.
pub async fn serve_isolated<V>(
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    handler: Arc<Handler<V>>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()>
where
    V: ClusterView + Send + Sync + 'static,
{
    // A socket belongs to the runtime that registered it: hand over the
    // bound socket itself, so no connection is refused in between.
    let listener = listener.into_std()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(WEBHOOK_THREADS)
        .thread_name("gpupool-webhook")
        .enable_all()
        .build()?;
    let served = runtime.spawn(async move {
        let listener = TcpListener::from_std(listener)?;
        serve(listener, tls, handler, shutdown).await;
        Ok::<(), std::io::Error>(())
    });
    // Shut down when this future ends or is dropped.
    let _runtime = OwnRuntime(Some(runtime));
    // A task of this runtime ends only by returning, panicking or with
    // the runtime; the last two are the server stopping.
    served.await.map_err(std::io::Error::other)?
}

/// Serves HTTPS on `listener` until `shutdown` completes, then stops
/// accepting, lets open connections finish for up to 5 seconds, and returns.
pub async fn serve<V>(
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    handler: Arc<Handler<V>>,
    shutdown: impl Future<Output = ()>,
) where
    V: ClusterView + Send + Sync + 'static,
{
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
    let (stop_tx, stop_rx) = watch::channel(false);
    let at_limit = || {
        // A refused connection would be a user's create refused: count
        // each time peers have to wait instead.
        handler.metrics.limit_reached.inc();
        tracing::debug!(
            limit = MAX_CONNECTIONS,
            "webhook at its connection limit; new connections wait"
        );
    };
    let mut connections = gpupool_http_endpoint::accept_bounded(
        listener,
        MAX_CONNECTIONS,
        at_limit,
        shutdown,
        |tcp, peer| {
            let acceptor = acceptor.clone();
            let handler = handler.clone();
            let mut stop = stop_rx.clone();
            async move {
                let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await
                {
                    Ok(Ok(tls)) => tls,
                    Ok(Err(error)) => {
                        tracing::debug!(%peer, %error, "webhook TLS handshake failed");
                        return;
                    }
                    Err(_) => {
                        tracing::debug!(%peer, "webhook TLS handshake timed out");
                        return;
                    }
                };
                let service = service_fn(move |request| {
                    let handler = handler.clone();
                    async move { Ok::<_, Infallible>(handler.handle(request).await) }
                });
                let mut builder =
                    hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
                builder
                    .http1()
                    .timer(TokioTimer::new())
                    .header_read_timeout(HEADER_TIMEOUT)
                    .max_buf_size(MAX_HEADER_BYTES as usize);
                builder
                    .http2()
                    .timer(TokioTimer::new())
                    .max_concurrent_streams(MAX_STREAMS_PER_CONNECTION)
                    .max_header_list_size(MAX_HEADER_BYTES)
                    .keep_alive_interval(PING_INTERVAL)
                    .keep_alive_timeout(HEADER_TIMEOUT);
                let conn = builder.serve_connection(TokioIo::new(tls), service);
                let mut conn = std::pin::pin!(conn);
                tokio::select! {
                    result = conn.as_mut() => {
                        if let Err(error) = result {
                            tracing::debug!(%peer, %error, "webhook connection ended with an error");
                        }
                    }
                    _ = stop.changed() => {
                        conn.as_mut().graceful_shutdown();
                        let _ = conn.await;
                    }
                }
            }
        },
    )
    .await;
    let _ = stop_tx.send(true);
    let drained = tokio::time::timeout(DRAIN_TIMEOUT, async {
        while connections.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            open = connections.len(),
            "webhook connections cut at shutdown"
        );
        connections.abort_all();
    }
}
