//! The webhook's HTTPS server: rustls (ring) and hyper 1, AdmissionReview v1
//! bodies on [`MUTATE_PATH`] and [`VALIDATE_PATH`], a latency histogram, and
//! a certificate that can be swapped while serving.

use std::convert::Infallible;
use std::future::Future;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use jiff::Timestamp;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;

use super::config::{MUTATE_PATH, VALIDATE_PATH};
use super::review::{BadReview, ClusterView, Users, WebhookKind, review_body};

/// Largest request body accepted. A pod is at most ~1.5 MiB in etcd and an
/// UPDATE review carries two of them.
pub const MAX_BODY_BYTES: usize = 8 << 20;
/// A client that has not finished its TLS handshake by then is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections still open this long after shutdown are cut.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LatencyLabels {
    webhook: &'static str,
    outcome: &'static str,
}

/// The webhook's metrics: `gpupool_webhook_request_duration_seconds`, a
/// histogram by `webhook` (mutate, validate, unknown) and `outcome`
/// (allowed, patched, denied, bad_request, error) of the time from a complete
/// request body to a serialized response.
#[derive(Clone, Debug)]
pub struct WebhookMetrics {
    latency: Family<LatencyLabels, Histogram>,
}

impl Default for WebhookMetrics {
    fn default() -> Self {
        Self {
            // 50 µs .. ~1.6 s: the target is 2 ms, the API server's limit 5 s.
            latency: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(5e-5, 2.0, 16))
            }),
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
        metrics
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

/// What answers each review: the cluster view, the gate owners and metrics.
pub struct Handler<V> {
    /// Where class, node and lease data come from.
    pub view: V,
    /// Who may remove the scheduling gate.
    pub gate_owners: Users,
    /// Where latencies are recorded.
    pub metrics: WebhookMetrics,
}

impl<V: ClusterView> Handler<V> {
    async fn handle(&self, request: Request<Incoming>) -> Response<Full<Bytes>> {
        let kind = match request.uri().path() {
            MUTATE_PATH => WebhookKind::Mutate,
            VALIDATE_PATH => WebhookKind::Validate,
            other => {
                return text(
                    StatusCode::NOT_FOUND,
                    format!("no webhook at {other}; use {MUTATE_PATH} or {VALIDATE_PATH}"),
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
        let body = match Limited::new(request.into_body(), MAX_BODY_BYTES)
            .collect()
            .await
        {
            Ok(body) => body.to_bytes(),
            Err(e) => {
                return text(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    format!("cannot read the request body (at most {MAX_BODY_BYTES} bytes): {e}"),
                );
            }
        };
        let started = Instant::now();
        let result = review_body(kind, &body, &self.view, &self.gate_owners, Timestamp::now());
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
    let mut connections = JoinSet::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => accepted,
            // Reap finished connections so the set does not grow.
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
        };
        let (tcp, peer) = match accepted {
            Ok(conn) => conn,
            Err(error) => {
                // Out of file descriptors and the like: back off briefly.
                tracing::warn!(%error, "webhook accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let acceptor = acceptor.clone();
        let handler = handler.clone();
        let mut stop = stop_rx.clone();
        connections.spawn(async move {
            let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
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
            let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
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
        });
    }
    drop(listener);
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
