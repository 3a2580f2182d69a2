//! The kubelet lifecycle: serve `DevicePlugin` on the plugin socket, register
//! with the kubelet, and do both again whenever the kubelet restarts (its
//! socket is re-created) or the plugin socket disappears (a restarting
//! kubelet wipes the directory).
//!
//! Changes are noticed by checking both sockets' identities every
//! [`WATCH_INTERVAL`], which keeps re-registration well within a second
//! without depending on inotify being available in the container.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tonic::transport::Server;

use crate::metrics::Metrics;
use crate::proto::deviceplugin::v1beta1::RegisterRequest;
use crate::proto::deviceplugin::v1beta1::device_plugin_server::DevicePluginServer;
use crate::proto::deviceplugin::v1beta1::registration_client::RegistrationClient;
use crate::server::{DevicePluginService, plugin_options};
use crate::transport::{self, TransportError};

/// File name of the plugin's socket in `<kubelet-dir>/device-plugins/`.
pub const PLUGIN_SOCKET: &str = "gpupool.sock";
/// File name of the kubelet's registration socket in the same directory.
pub const KUBELET_SOCKET: &str = "kubelet.sock";
/// Device-plugin API version sent in the registration.
pub const API_VERSION: &str = "v1beta1";
/// How often both sockets are checked.
pub const WATCH_INTERVAL: Duration = Duration::from_millis(100);
/// Longest a registration call may take.
pub const REGISTER_TIMEOUT: Duration = Duration::from_secs(5);
/// First retry delay after a failed registration; doubles up to [`BACKOFF_MAX`].
pub const BACKOFF_MIN: Duration = Duration::from_millis(100);
/// Longest delay between registration attempts.
pub const BACKOFF_MAX: Duration = Duration::from_secs(5);

/// Why the lifecycle stopped.
#[derive(Debug, thiserror::Error)]
pub enum LifecycleError {
    /// The plugin socket could not be created at startup.
    #[error(transparent)]
    Transport(#[from] TransportError),
}

/// Builds a fresh `DevicePlugin` service whose streams end when the token fires.
pub type ServiceFactory = Box<dyn Fn(CancellationToken) -> DevicePluginService + Send + Sync>;

/// Where and as what the plugin registers.
pub struct Lifecycle {
    /// The kubelet's directory (`--kubelet-dir`).
    pub kubelet_dir: PathBuf,
    /// The extended resource advertised (`--resource-name`).
    pub resource_name: String,
    /// Creates the service for each (re)start of the socket.
    pub service: ServiceFactory,
    /// Registration counters.
    pub metrics: Metrics,
}

/// Identity of a file: a re-created socket has a new inode or change time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileId {
    dev: u64,
    ino: u64,
    ctime: i64,
    ctime_nsec: i64,
}

fn file_id(path: &Path) -> Option<FileId> {
    std::fs::symlink_metadata(path).ok().map(|m| FileId {
        dev: m.dev(),
        ino: m.ino(),
        ctime: m.ctime(),
        ctime_nsec: m.ctime_nsec(),
    })
}

struct RunningServer {
    stop: CancellationToken,
    task: JoinHandle<Result<(), TransportError>>,
    socket: Option<FileId>,
}

impl RunningServer {
    async fn stop(self) {
        self.stop.cancel();
        let abort = self.task.abort_handle();
        // Graceful shutdown waits for open calls; don't let one hang us.
        if tokio::time::timeout(Duration::from_secs(2), self.task)
            .await
            .is_err()
        {
            abort.abort();
        }
    }
}

impl Lifecycle {
    fn plugin_socket(&self) -> PathBuf {
        self.kubelet_dir.join("device-plugins").join(PLUGIN_SOCKET)
    }

    fn kubelet_socket(&self) -> PathBuf {
        self.kubelet_dir.join("device-plugins").join(KUBELET_SOCKET)
    }

    fn start_server(&self, shutdown: &CancellationToken) -> Result<RunningServer, TransportError> {
        let path = self.plugin_socket();
        let incoming = transport::bind_unix(&path)?;
        let socket = file_id(&path);
        let stop = shutdown.child_token();
        let router =
            Server::builder().add_service(DevicePluginServer::new((self.service)(stop.clone())));
        let signal = stop.clone().cancelled_owned();
        let task = tokio::spawn(async move {
            let result = transport::serve_incoming(router, &path, incoming, signal).await;
            if let Err(e) = &result {
                tracing::error!(error = %e, "device plugin server failed");
            }
            result
        });
        tracing::info!(socket = %self.plugin_socket().display(), "serving DevicePlugin");
        Ok(RunningServer { stop, task, socket })
    }

    async fn register(&self) -> Result<(), String> {
        let request = RegisterRequest {
            version: API_VERSION.to_owned(),
            endpoint: PLUGIN_SOCKET.to_owned(),
            resource_name: self.resource_name.clone(),
            options: Some(plugin_options()),
        };
        let call = async {
            let channel = transport::connect_unix(self.kubelet_socket())
                .await
                .map_err(|e| e.to_string())?;
            RegistrationClient::new(channel)
                .register(request)
                .await
                .map(|_| ())
                .map_err(|status| {
                    format!(
                        "kubelet refused the registration ({:?}): {}",
                        status.code(),
                        status.message()
                    )
                })
        };
        tokio::time::timeout(REGISTER_TIMEOUT, call)
            .await
            .map_err(|_| format!("no answer within {REGISTER_TIMEOUT:?}"))?
    }

    /// Serves and registers until `shutdown` fires, then stops serving and
    /// removes the plugin socket. Only a failure to create the socket at
    /// startup is an error; every later failure is logged and retried.
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), LifecycleError> {
        let mut server = Some(self.start_server(&shutdown)?);
        let mut registered_with: Option<FileId> = None;
        let mut backoff = BACKOFF_MIN;
        let mut next_attempt = Instant::now();
        let mut attempt: u32 = 0;
        let mut ticker = tokio::time::interval(WATCH_INTERVAL);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = shutdown.cancelled() => break,
                _ = ticker.tick() => {}
            }

            let intact = server.as_ref().is_some_and(|s| {
                s.socket.is_some()
                    && file_id(&self.plugin_socket()) == s.socket
                    && !s.task.is_finished()
            });
            if !intact {
                if let Some(old) = server.take() {
                    tracing::warn!(
                        socket = %self.plugin_socket().display(),
                        "plugin socket is gone or its server stopped; serving it again"
                    );
                    old.stop().await;
                }
                registered_with = None;
                if Instant::now() < next_attempt {
                    continue;
                }
                match self.start_server(&shutdown) {
                    Ok(s) => {
                        server = Some(s);
                        next_attempt = Instant::now();
                    }
                    Err(e) => {
                        tracing::error!(error = %e, retry_in = ?backoff, "cannot serve the plugin socket");
                        next_attempt = Instant::now() + backoff;
                        backoff = (backoff * 2).min(BACKOFF_MAX);
                        continue;
                    }
                }
            }

            let kubelet = file_id(&self.kubelet_socket());
            if kubelet.is_none() || kubelet == registered_with || Instant::now() < next_attempt {
                continue;
            }
            attempt += 1;
            let outcome = tokio::select! {
                () = shutdown.cancelled() => break,
                outcome = self.register() => outcome,
            };
            self.metrics.registration(outcome.is_ok());
            match outcome {
                Ok(()) => {
                    tracing::info!(
                        resource = %self.resource_name,
                        kubelet = %self.kubelet_socket().display(),
                        attempt,
                        "registered with the kubelet"
                    );
                    registered_with = kubelet;
                    backoff = BACKOFF_MIN;
                    attempt = 0;
                }
                Err(e) => {
                    tracing::warn!(
                        kubelet = %self.kubelet_socket().display(),
                        attempt,
                        retry_in = ?backoff,
                        error = %e,
                        "registration with the kubelet failed"
                    );
                    next_attempt = Instant::now() + backoff;
                    backoff = (backoff * 2).min(BACKOFF_MAX);
                }
            }
        }
        let Some(server) = server else {
            return Ok(());
        };
        let ours = server.socket;
        server.stop().await;
        let path = self.plugin_socket();
        if ours.is_some() && file_id(&path) == ours {
            match std::fs::remove_file(&path) {
                Ok(()) => tracing::info!(socket = %path.display(), "removed plugin socket"),
                Err(e) => {
                    tracing::warn!(socket = %path.display(), error = %e, "cannot remove plugin socket")
                }
            }
        }
        Ok(())
    }
}
