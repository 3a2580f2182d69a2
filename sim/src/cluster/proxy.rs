//! A TCP forwarder in front of the operator replicas' webhook ports, as a
//! Service is in a cluster: the API server calls one stable address and
//! reaches whichever replica is up.
//!
//! Each connection goes to the next backend in turn that accepts one, so
//! every replica serves (not only the leader) and a killed replica costs a
//! failed connect, not a failed webhook call. TLS passes through untouched:
//! the replicas share one serving certificate.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

/// How long a connect to one backend may take before the next is tried.
const CONNECT_TIMEOUT: Duration = Duration::from_millis(500);

/// A running forwarder; stops when dropped.
pub struct ServiceProxy {
    addr: SocketAddr,
    backends: Arc<Backends>,
    cancel: CancellationToken,
}

#[derive(Default)]
struct Backends {
    addrs: Mutex<Vec<SocketAddr>>,
    next: AtomicUsize,
}

impl Backends {
    /// The backends in the order this connection tries them (rotated, so
    /// load spreads over the replicas).
    fn order(&self) -> Vec<SocketAddr> {
        let addrs = self
            .addrs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        if addrs.is_empty() {
            return addrs;
        }
        let start = self.next.fetch_add(1, Ordering::Relaxed) % addrs.len();
        addrs[start..]
            .iter()
            .chain(&addrs[..start])
            .copied()
            .collect()
    }
}

impl ServiceProxy {
    /// Listens on a free loopback port with no backends yet.
    pub async fn start() -> std::io::Result<Self> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let backends = Arc::new(Backends::default());
        let cancel = CancellationToken::new();
        tokio::spawn(accept_loop(listener, backends.clone(), cancel.clone()));
        Ok(Self {
            addr,
            backends,
            cancel,
        })
    }

    /// The address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Replaces the set of backends; connections already forwarded stay.
    pub fn set_backends(&self, addrs: Vec<SocketAddr>) {
        *self
            .backends
            .addrs
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = addrs;
    }
}

impl Drop for ServiceProxy {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

async fn accept_loop(listener: TcpListener, backends: Arc<Backends>, cancel: CancellationToken) {
    loop {
        let accepted = tokio::select! {
            () = cancel.cancelled() => return,
            a = listener.accept() => a,
        };
        match accepted {
            Ok((client, _)) => {
                let order = backends.order();
                tokio::spawn(forward(client, order, cancel.clone()));
            }
            Err(e) => {
                tracing::warn!(error = %e, "webhook proxy cannot accept; retrying");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// Connects to the first backend that answers and copies both ways until
/// either side closes; with none answering the client's connection is
/// closed, which the API server reports as a failed webhook call.
async fn forward(mut client: TcpStream, order: Vec<SocketAddr>, cancel: CancellationToken) {
    for backend in order {
        match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(backend)).await {
            Ok(Ok(mut upstream)) => {
                tokio::select! {
                    () = cancel.cancelled() => {}
                    _ = tokio::io::copy_bidirectional(&mut client, &mut upstream) => {}
                }
                return;
            }
            Ok(Err(e)) => tracing::debug!(%backend, error = %e, "webhook backend refused"),
            Err(_) => tracing::debug!(%backend, "webhook backend did not accept in time"),
        }
    }
    tracing::warn!("no webhook backend accepted the connection");
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A backend that answers every connection with its own tag.
    async fn tagged_backend(tag: u8) -> SocketAddr {
        let l = TcpListener::bind(("127.0.0.1", 0)).await.expect("bind");
        let addr = l.local_addr().expect("addr");
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                let _ = s.write_all(&[tag]).await;
            }
        });
        addr
    }

    async fn read_tag(proxy: &ServiceProxy) -> Option<u8> {
        let mut s = TcpStream::connect(proxy.addr()).await.expect("connect");
        let mut buf = [0u8; 1];
        match s.read(&mut buf).await {
            Ok(1) => Some(buf[0]),
            _ => None,
        }
    }

    #[tokio::test]
    async fn spreads_connections_and_skips_dead_backends() {
        let proxy = ServiceProxy::start().await.expect("proxy");
        assert_eq!(read_tag(&proxy).await, None, "no backend: closed");

        let (a, b) = (tagged_backend(1).await, tagged_backend(2).await);
        // A port nothing listens on: taken, then released.
        let dead = TcpListener::bind(("127.0.0.1", 0))
            .await
            .expect("bind")
            .local_addr()
            .expect("addr");
        proxy.set_backends(vec![dead, a, b]);
        let mut seen = Vec::new();
        for _ in 0..6 {
            seen.push(read_tag(&proxy).await.expect("a live backend answers"));
        }
        assert!(
            seen.contains(&1) && seen.contains(&2),
            "both served: {seen:?}"
        );
    }
}
