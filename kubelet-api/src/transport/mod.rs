//! gRPC over unix sockets: how the plugin and the kubelet reach each other.
//!
//! Servers accept any HTTP/2 `:authority` (clients on gRPC's C core send the
//! socket path, which the HTTP/2 layer would otherwise reset; see
//! [`authority`]); clients send `localhost`, which every server accepts.

pub mod authority;
pub mod hpack;

use std::future::Future;
use std::io;
use std::path::{Path, PathBuf};

use hyper_util::rt::TokioIo;
use tokio::net::{UnixListener, UnixStream};
use tokio_stream::StreamExt;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::server::Router;
use tonic::transport::{Channel, Endpoint, Uri};

/// Why a unix-socket gRPC endpoint could not be dialled or served.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// The socket could not be connected to.
    #[error("cannot connect to unix socket {path}: {reason}")]
    Connect {
        /// The socket's path.
        path: PathBuf,
        /// What went wrong, with its causes.
        reason: String,
    },
    /// The socket could not be created.
    #[error("cannot listen on unix socket {path}: {source}")]
    Bind {
        /// The socket's path.
        path: PathBuf,
        /// What the OS reported.
        #[source]
        source: io::Error,
    },
    /// The gRPC server failed while serving.
    #[error("gRPC server on unix socket {path} failed: {source}")]
    Serve {
        /// The socket's path.
        path: PathBuf,
        /// What tonic reported.
        #[source]
        source: tonic::transport::Error,
    },
}

/// The URI of every client channel. Only its authority is used: it is the
/// HTTP/2 `:authority` of each call, and `localhost` is what the kubelet
/// (1.26 and later) sends over unix sockets and what every server accepts.
/// The connector ignores it and dials the socket.
pub const CLIENT_URI: &str = "http://localhost";

/// Connects a gRPC channel to the unix socket at `path`; calls carry
/// `:authority: localhost`.
///
/// The connection is made before this returns, so a missing or dead socket is
/// an error here rather than on the first call. The channel reconnects to the
/// same path if the connection drops.
pub async fn connect_unix(path: impl AsRef<Path>) -> Result<Channel, TransportError> {
    let path = path.as_ref().to_path_buf();
    let dial_path = path.clone();
    Endpoint::from_static(CLIENT_URI)
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let dial_path = dial_path.clone();
            async move { UnixStream::connect(dial_path).await.map(TokioIo::new) }
        }))
        .await
        .map_err(|e| TransportError::Connect {
            path,
            reason: error_chain(&e),
        })
}

/// `error: cause: cause…`, since tonic's own message hides the cause.
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// Creates a listening unix socket at `path`, first removing whatever stale
/// socket a previous process left there and creating the parent directory.
pub fn bind_unix(path: impl AsRef<Path>) -> Result<UnixListenerStream, TransportError> {
    let path = path.as_ref();
    let bind_error = |source| TransportError::Bind {
        path: path.to_path_buf(),
        source,
    };
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(bind_error)?;
    }
    match std::fs::remove_file(path) {
        Ok(()) => tracing::info!(socket = %path.display(), "removed stale socket"),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(bind_error(e)),
    }
    let listener = UnixListener::bind(path).map_err(bind_error)?;
    Ok(UnixListenerStream::new(listener))
}

/// Serves `router` on the unix socket at `path` (see [`bind_unix`]) until
/// `shutdown` completes, then stops accepting and returns.
pub async fn serve_unix<F>(
    router: Router,
    path: impl AsRef<Path>,
    shutdown: F,
) -> Result<(), TransportError>
where
    F: Future<Output = ()> + Send,
{
    let path = path.as_ref();
    let incoming = bind_unix(path)?;
    serve_incoming(router, path, incoming, shutdown).await
}

/// Serves `router` on an already bound socket (see [`bind_unix`]) until
/// `shutdown` completes; `path` only names the socket in errors. Every
/// connection accepts any `:authority` ([`authority::AnyAuthority`]).
pub async fn serve_incoming<F>(
    router: Router,
    path: &Path,
    incoming: UnixListenerStream,
    shutdown: F,
) -> Result<(), TransportError>
where
    F: Future<Output = ()> + Send,
{
    let incoming = incoming.map(|conn| conn.map(authority::AnyAuthority::new));
    router
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await
        .map_err(|source| TransportError::Serve {
            path: path.to_path_buf(),
            source,
        })
}
