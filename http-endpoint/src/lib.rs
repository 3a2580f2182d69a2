//! The plain-HTTP endpoint gpupool's binaries serve `/metrics` and their
//! probes on.
//!
//! Anyone who can reach the port can connect: the operator's and the device
//! plugin's metrics ports are open to the cluster network unless a
//! NetworkPolicy closes them. An unbounded server keeps every connection a
//! peer opens, with its task and read buffer (about 15 KiB each), for as
//! long as the peer stays silent, so a few thousand half-sent requests cost
//! the operator over 100 MiB and enough of them its container's memory
//! limit. [`serve`] bounds what any peer can hold: a fixed number of
//! connections, each closed when its request head does not arrive in time
//! and after a maximum lifetime in any case.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

/// Pause after a failed accept (out of file descriptors and the like)
/// before trying again, so the loop does not spin while nothing can be
/// accepted.
const ACCEPT_RETRY: Duration = Duration::from_millis(50);

/// The smallest head limit HTTP/1 allows: hyper's read buffer starts at
/// this size.
pub const MIN_HEADER_BYTES: usize = 8 << 10;

/// How long a connection at its maximum lifetime may take to finish the
/// answer it is sending before it is cut.
const LIFETIME_GRACE: Duration = Duration::from_secs(2);

/// What the server lets its peers hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Connections served at once. Further peers wait, unaccepted, in the
    /// kernel's listen backlog until one of these ends.
    pub max_connections: usize,
    /// A request's head must arrive whole within this time, also after an
    /// idle pause between requests on a kept-alive connection; otherwise
    /// the connection is closed.
    pub header_timeout: Duration,
    /// Longest a connection stays open however it is used, so a peer that
    /// keeps a connection busy, or stops reading its answers, gives its
    /// slot back. An answer being sent then is finished first, within a
    /// grace of 2 s.
    pub max_lifetime: Duration,
    /// Largest request head read, in bytes; a smaller value is raised to
    /// [`MIN_HEADER_BYTES`].
    pub max_header_bytes: usize,
}

impl Default for Limits {
    /// 32 connections (a scraper and the kubelet's probes need one or two
    /// each), request heads within 5 s, connections at most a minute
    /// (Prometheus reconnects; probes open one per probe), heads up to
    /// 16 KiB.
    fn default() -> Self {
        Self {
            max_connections: 32,
            header_timeout: Duration::from_secs(5),
            max_lifetime: Duration::from_secs(60),
            max_header_bytes: 16 << 10,
        }
    }
}

/// Accepts connections on `listener` until `shutdown` completes, and runs
/// `connection` for each in a task of its own; returns those still running
/// (for the caller to drain or drop) once the listener is closed.
///
/// Guarantees: at most `max_connections` run at once. A slot is taken
/// before accepting, so while none is free new peers wait, unaccepted, in
/// the kernel's listen backlog (and `at_limit` is called once per wait)
/// instead of being accepted and held, or accepted and refused. A failed
/// accept (out of file descriptors and the like) is logged and tried again
/// after a short pause: it never ends the loop.
pub async fn accept_bounded<C, F>(
    listener: TcpListener,
    max_connections: usize,
    mut at_limit: impl FnMut(),
    shutdown: impl Future<Output = ()>,
    mut connection: C,
) -> JoinSet<()>
where
    C: FnMut(TcpStream, SocketAddr) -> F,
    F: Future<Output = ()> + Send + 'static,
{
    let slots = Arc::new(Semaphore::new(max_connections));
    let mut connections = JoinSet::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let slot = match slots.clone().try_acquire_owned() {
            Ok(slot) => slot,
            Err(_) => {
                at_limit();
                tokio::select! {
                    () = &mut shutdown => break,
                    slot = slots.clone().acquire_owned() => match slot {
                        Ok(slot) => slot,
                        // The semaphore is never closed.
                        Err(_) => break,
                    },
                    // Reap finished connections so the set does not grow.
                    Some(_) = connections.join_next(), if !connections.is_empty() => continue,
                }
            }
        };
        let accepted = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => accepted,
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(error) => {
                tracing::warn!(%error, "accept failed; trying again");
                tokio::time::sleep(ACCEPT_RETRY).await;
                continue;
            }
        };
        let served = connection(stream, peer);
        connections.spawn(async move {
            let _slot = slot;
            served.await;
        });
    }
    connections
}

/// Serves HTTP/1.1 (what Prometheus and the kubelet's probes speak) on
/// `listener`, answering each request with `respond`, until `shutdown`
/// completes; then it stops accepting, drops the open connections and
/// returns.
///
/// Guarantees: those of [`accept_bounded`] with `limits.max_connections`;
/// and each connection is closed when a request head takes longer than
/// `limits.header_timeout` or exceeds `limits.max_header_bytes`, and after
/// `limits.max_lifetime` in any case.
pub async fn serve<F>(
    listener: TcpListener,
    limits: Limits,
    respond: F,
    shutdown: impl Future<Output = ()>,
) where
    F: Fn(&Request<Incoming>) -> Response<Full<Bytes>> + Send + Sync + 'static,
{
    let respond = Arc::new(respond);
    let at_limit = || {
        tracing::debug!(
            limit = limits.max_connections,
            "HTTP endpoint at its connection limit; new connections wait"
        );
    };
    let connections = accept_bounded(
        listener,
        limits.max_connections,
        at_limit,
        shutdown,
        |stream, peer| {
            let respond = respond.clone();
            async move {
                let service = service_fn(move |request: Request<Incoming>| {
                    let response = respond(&request);
                    async move { Ok::<_, Infallible>(response) }
                });
                let connection = hyper::server::conn::http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(limits.header_timeout)
                    .max_buf_size(limits.max_header_bytes.max(MIN_HEADER_BYTES))
                    .serve_connection(TokioIo::new(stream), service);
                let mut connection = std::pin::pin!(connection);
                let ended = tokio::select! {
                    ended = connection.as_mut() => ended,
                    () = tokio::time::sleep(limits.max_lifetime) => {
                        // An answer being sent is finished first; a peer
                        // that does not take it is cut off after the grace.
                        connection.as_mut().graceful_shutdown();
                        match tokio::time::timeout(LIFETIME_GRACE, connection).await {
                            Ok(ended) => ended,
                            Err(_) => {
                                tracing::debug!(%peer, "HTTP endpoint: connection cut at its maximum lifetime");
                                return;
                            }
                        }
                    }
                };
                if let Err(error) = ended {
                    tracing::debug!(%peer, %error, "HTTP endpoint: connection ended with an error");
                }
            }
        },
    )
    .await;
    // Dropping the set aborts every connection still open.
    drop(connections);
}
