//! The pod admission webhook (DESIGN §5.1): a mutating webhook that queues
//! pods requesting a GpuLeaseClass's resource (scheduling gate
//! `gpupool.io/admission` and the `gpupool.io/enqueued-at` stamp) or denies
//! them with a message naming the problem, and a validating webhook that lets
//! only the operator remove that gate. Every replica serves it, leader or not.
//!
//! # Wiring it into the process
//!
//! [`crate::app::run`] starts it on every replica, as follows:
//!
//! ```text
//! let webhook_metrics = webhook::WebhookMetrics::register(&mut registry); // before Arc::new(registry)
//! let mut webhook_config = webhook::WebhookConfig::new(
//!     config.webhook_port,
//!     config.namespace.clone(),
//!     config.webhook_endpoint.clone(),
//!     config.gate_owners.clone(),
//! );
//! webhook_config.owner_cluster_role = config.webhook_owner_cluster_role.clone();
//! webhook_config.listen = SocketAddr::new(config.webhook_bind_address, config.webhook_port);
//! webhook_config.set_device_plugin_users(config.device_plugin_users.clone());
//! let unmanaged_namespaces = webhook_config.excluded_namespaces(); // the controller never queues their pods
//! tasks.spawn(async move {
//!     let running = webhook::start(webhook_config, client, caches, webhook_metrics).await?; // fatal: exit 1
//!     health.set_webhook_serving(); // readiness; the decision loop's first pass waits for it
//!     running.serve(std::future::pending()).await?; // for the process's lifetime
//!     Ok(())
//! });
//! ```
//!
//! The flags behind it ([`crate::config::Args`], each also read from an
//! environment variable):
//! - `--webhook-port` (9443) and `--webhook-bind-address` (0.0.0.0):
//!   [`WebhookConfig::listen`] is `<bind-address>:<port>`.
//! - `--webhook-service NS/NAME[:PORT]` (port 443 by default), parsed by
//!   [`ServiceRef`]'s `FromStr`, or `--webhook-url https://HOST[:PORT][/PATH]`,
//!   parsed by [`WebhookUrl`]'s `FromStr`; exactly one of them
//!   ([`WebhookEndpoint`]). Parse errors name the flag (exit 2).
//! - `--gate-owner USER` (repeatable / comma-separated): usernames allowed to
//!   remove the gate. Default: `system:serviceaccount:<namespace>:gpupool-operator`.
//!   In the simulator, pass the username the operator's token maps to.
//! - `--device-plugin-user USER` (repeatable / comma-separated): the device
//!   plugins' usernames ([`WebhookConfig::set_device_plugin_users`]).
//!   Default: `system:serviceaccount:<namespace>:gpupool-device-plugin`.
//! - `--webhook-owner-cluster-role`: [`WebhookConfig::owner_cluster_role`].
//! - `--namespace`: the operator's namespace (certificate Secret, exclusions).
//!
//! [`start`] gets the serving certificate from Secret `gpupool-webhook-tls`
//! (creating or renewing it), waits for the operator's caches (shared with
//! the controller) to fill, binds the port, and only then writes the
//! webhook configurations named `gpupool`, so the API server never calls a
//! webhook that is not listening yet.
//! [`RunningWebhook::serve`] serves until shutdown, re-checking the Secret
//! and the configurations every [`WebhookConfig::refresh_interval`]. The
//! HTTPS server itself runs on a runtime of its own
//! ([`server::serve_isolated`]), so reviews never queue behind the
//! controller's work.

pub mod certs;
pub mod config;
pub mod configurations;
pub mod guard;
pub mod near_miss;
pub mod review;
pub mod server;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use jiff::Timestamp;
use tokio::net::TcpListener;

pub use config::{ConfigError, ServiceRef, WebhookConfig, WebhookEndpoint, WebhookUrl};
pub use review::{Identities, Users};
pub use server::WebhookMetrics;

use crate::index::Caches;
use crate::index::caches::NotSynced;
use certs::{CertError, CertProblem, TlsBundle};
use configurations::ConfigurationError;
use server::{CertResolver, Handler};

/// Why the webhook could not start or keep serving.
#[derive(Debug, thiserror::Error)]
pub enum WebhookError {
    /// The serving certificate could not be made, read or stored.
    #[error(transparent)]
    Cert(#[from] CertError),
    /// The stored certificate cannot be served.
    #[error("the webhook certificate cannot be served: {0}")]
    BadCert(#[from] CertProblem),
    /// rustls refused the TLS configuration.
    #[error("cannot configure TLS: {0}")]
    Tls(#[from] rustls::Error),
    /// The webhook configurations could not be written.
    #[error(transparent)]
    Configuration(#[from] ConfigurationError),
    /// A cache did not fill.
    #[error(transparent)]
    NotSynced(#[from] NotSynced),
    /// The server's own runtime could not start, or its server panicked.
    #[error("the webhook server stopped: {0}")]
    Serve(#[source] std::io::Error),
    /// The port could not be bound.
    #[error("cannot listen on {addr} (--webhook-port): {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// A webhook that has its certificate, caches, listening socket and
/// configurations, ready to [`serve`](RunningWebhook::serve).
pub struct RunningWebhook {
    config: WebhookConfig,
    client: kube::Client,
    listener: TcpListener,
    local_addr: SocketAddr,
    bundle: TlsBundle,
    certs: Arc<CertResolver>,
    tls: Arc<rustls::ServerConfig>,
    handler: Arc<Handler<Caches>>,
    metrics: WebhookMetrics,
}

/// Prepares the webhook (see the module docs for the order of steps),
/// recording latencies in `metrics` (see [`WebhookMetrics::register`]).
/// Errors are fatal for the operator (exit 1); a bind failure names
/// `--webhook-port`.
pub async fn start(
    config: WebhookConfig,
    client: kube::Client,
    caches: Caches,
    metrics: WebhookMetrics,
) -> Result<RunningWebhook, WebhookError> {
    let names = config.endpoint.certificate_names();
    let bundle = certs::ensure_secret(
        client.clone(),
        &config.namespace,
        &config.secret_name,
        &names,
        Timestamp::now(),
    )
    .await?;
    let certs = CertResolver::new(bundle.certified_key()?);
    let tls = server::tls_config(certs.clone())?;

    caches.wait_synced_within(config.cache_sync_timeout).await?;

    let listener = TcpListener::bind(config.listen)
        .await
        .map_err(|source| WebhookError::Bind {
            addr: config.listen,
            source,
        })?;
    let local_addr = listener.local_addr().map_err(|source| WebhookError::Bind {
        addr: config.listen,
        source,
    })?;
    configurations::apply(client.clone(), &config, &bundle.ca_pem).await?;
    tracing::info!(%local_addr, endpoint = ?config.endpoint, "webhook ready");

    let handler = Arc::new(Handler::new(
        caches,
        Identities {
            operator: config.gate_owners.clone(),
            device_plugins: config.device_plugin_users.clone(),
        },
        metrics.clone(),
    ));
    Ok(RunningWebhook {
        config,
        client,
        listener,
        local_addr,
        bundle,
        certs,
        tls,
        handler,
        metrics,
    })
}

impl RunningWebhook {
    /// The address the server listens on (useful with port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The CA bundle (PEM) the webhook configurations carry.
    pub fn ca_bundle(&self) -> &str {
        &self.bundle.ca_pem
    }

    /// Serves until `shutdown` completes. Meanwhile, every refresh interval,
    /// re-reads the certificate Secret (renewing it when due, or picking up
    /// another replica's renewal) and rewrites the webhook configurations if
    /// they drifted. A failed refresh is logged and retried at the next
    /// interval; the server keeps serving the certificate it has. Reviews
    /// are served on the webhook's own threads ([`server::serve_isolated`]).
    pub async fn serve(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), WebhookError> {
        let RunningWebhook {
            config,
            client,
            listener,
            bundle,
            certs,
            tls,
            handler,
            metrics,
            ..
        } = self;
        let current = Arc::new(CurrentCertificate {
            config: config.clone(),
            client: client.clone(),
            certs,
            bundle: std::sync::Mutex::new(bundle),
        });
        let guard = guard_configurations(current.clone(), metrics);
        let refresh = refresh_loop(current);
        tokio::select! {
            served = server::serve_isolated(listener, tls, handler, shutdown) => {
                served.map_err(WebhookError::Serve)
            }
            never = refresh => match never {},
            never = guard => match never {},
        }
    }
}

/// Watches the two webhook configurations and rewrites them as soon as
/// anyone deletes or edits them (a deleted or relaxed webhook lets pods run
/// ungated, ahead of the queue): each change is repaired within about a
/// second, with a warning and `gpupool_webhook_configuration_repairs_total`.
/// A watch that fails is restarted with backoff; repairs that fail are
/// retried on the next event or after a second.
async fn guard_configurations(
    current: Arc<CurrentCertificate>,
    metrics: WebhookMetrics,
) -> std::convert::Infallible {
    let (config, client) = (&current.config, current.client.clone());
    use futures::StreamExt;
    use k8s_openapi::api::admissionregistration::v1::{
        MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
    };
    use kube::runtime::{WatchStreamExt, watcher};

    let selector = format!("metadata.name={}", config.configuration_name);
    let watch_config = watcher::Config::default().fields(&selector);
    let mutating = watcher(
        kube::Api::<MutatingWebhookConfiguration>::all(client.clone()),
        watch_config.clone(),
    )
    .default_backoff()
    .map(|e| e.map(|_| ()));
    let validating = watcher(
        kube::Api::<ValidatingWebhookConfiguration>::all(client.clone()),
        watch_config,
    )
    .default_backoff()
    .map(|e| e.map(|_| ()));
    let mut events = std::pin::pin!(futures::stream::select(mutating, validating));
    let mut retry = false;
    loop {
        let event = if retry {
            tokio::time::timeout(Duration::from_secs(1), events.next())
                .await
                .ok()
        } else {
            Some(events.next().await)
        };
        match event {
            Some(Some(Err(error))) => {
                tracing::warn!(%error, "watch of the webhook configurations failed; retrying");
                continue;
            }
            Some(None) => {
                // The watcher streams never end; should they, poll instead.
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            Some(Some(Ok(()))) | None => {}
        }
        // The Secret decides which CA the configurations carry: a replica
        // that restored its own CA over another's would have the two
        // overwrite each other for as long as both run.
        let ca_pem = match current.sync_from_secret().await {
            Ok(ca_pem) => ca_pem,
            Err(error) => {
                retry = true;
                tracing::warn!(%error, "cannot read the webhook certificate Secret; retrying");
                continue;
            }
        };
        match configurations::apply(client.clone(), config, &ca_pem).await {
            Ok((m, v)) => {
                retry = false;
                for (kind, written) in [
                    ("MutatingWebhookConfiguration", m),
                    ("ValidatingWebhookConfiguration", v),
                ] {
                    let found = match written {
                        configurations::Written::Unchanged => continue,
                        configurations::Written::Created => "missing",
                        configurations::Written::Replaced => "changed",
                    };
                    metrics.configuration_repaired(kind);
                    tracing::warn!(
                        kind,
                        name = %config.configuration_name,
                        found,
                        "webhook configuration was {found}; restored it (pods created meanwhile may have skipped the queue)"
                    );
                }
            }
            Err(error) => {
                retry = true;
                tracing::warn!(%error, "cannot restore the webhook configurations; retrying");
            }
        }
    }
}

async fn refresh_loop(current: Arc<CurrentCertificate>) -> std::convert::Infallible {
    let mut ticker = tokio::time::interval(current.config.refresh_interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticker.tick().await;
    loop {
        ticker.tick().await;
        let result = async {
            let ca_pem = current.sync_from_secret().await?;
            configurations::apply(current.client.clone(), &current.config, &ca_pem).await?;
            Ok::<(), WebhookError>(())
        }
        .await;
        if let Err(error) = result {
            tracing::warn!(%error, "webhook certificate or configuration refresh failed; retrying later");
        }
    }
}

/// The certificate this replica serves, kept to the one in the Secret:
/// every replica serves that one and writes its CA into the webhook
/// configurations, so replicas write the same `caBundle` and never undo
/// each other's writes.
struct CurrentCertificate {
    config: WebhookConfig,
    client: kube::Client,
    certs: Arc<CertResolver>,
    bundle: std::sync::Mutex<TlsBundle>,
}

impl CurrentCertificate {
    /// Reads the Secret (creating or renewing it when due, as
    /// [`certs::ensure_secret`] does), serves its certificate from now on if
    /// it is not the one served, and returns its CA bundle.
    async fn sync_from_secret(&self) -> Result<String, WebhookError> {
        let fresh = certs::ensure_secret(
            self.client.clone(),
            &self.config.namespace,
            &self.config.secret_name,
            &self.config.endpoint.certificate_names(),
            Timestamp::now(),
        )
        .await?;
        let ca_pem = fresh.ca_pem.clone();
        let changed = {
            let bundle = self
                .bundle
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            *bundle != fresh
        };
        if changed {
            self.certs.replace(fresh.certified_key()?);
            *self
                .bundle
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = fresh;
            tracing::info!("webhook certificate reloaded from its Secret");
        }
        Ok(ca_pem)
    }
}
