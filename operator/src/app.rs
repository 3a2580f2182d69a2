//! The operator process: one index (watch caches), the webhook on every
//! replica, leader election, the decision loop on the leader, and the
//! metrics server, run until a signal or a fatal error. `main` only parses
//! flags and maps [`run`]'s outcome to an exit code.

use std::net::SocketAddr;
use std::sync::Arc;

use prometheus_client::registry::Registry;
use tokio::sync::Notify;

use crate::config::Config;
use crate::controller::{self, Caches, ControllerError, LoopConfig};
use crate::leader::Leadership;
use crate::metrics::{self, Health, Metrics, ServeError};
use crate::webhook::{self, WebhookError};

/// Why the operator stopped other than by a signal (exit 1).
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// No Kubernetes client could be built.
    #[error("cannot build a Kubernetes client (in-cluster config or KUBECONFIG): {0}")]
    KubeConfig(String),
    /// The metrics port could not be served.
    #[error(transparent)]
    Metrics(#[from] ServeError),
    /// The webhook did not start or stopped.
    #[error("webhook: {0}")]
    Webhook(#[from] WebhookError),
    /// The decision loop stopped.
    #[error("decision loop stopped: {0}")]
    Controller(#[from] ControllerError),
    /// Signals cannot be received.
    #[error("cannot listen for SIGTERM/SIGINT: {0}")]
    Signal(#[source] std::io::Error),
    /// A task that runs for the process's lifetime ended.
    #[error("a server task ended unexpectedly")]
    TaskEnded,
    /// A task panicked.
    #[error("a task panicked: {0}")]
    TaskPanicked(String),
}

/// Runs the operator with `config` until SIGTERM/SIGINT (`Ok`) or a fatal
/// error. On a signal, leadership is handed back at once.
pub async fn run(config: Config) -> Result<(), RunError> {
    let mut kube_config = kube::Config::infer()
        .await
        .map_err(|e| RunError::KubeConfig(e.to_string()))?;
    // The decision loop retries on its own schedule; a 429 from a
    // PodDisruptionBudget must come back at once, not after minutes of
    // client-side retries that would stall every admission behind it.
    kube_config.default_retry = false;
    let client =
        kube::Client::try_from(kube_config).map_err(|e| RunError::KubeConfig(e.to_string()))?;

    let mut registry = Registry::default();
    let metrics = Metrics::register(&mut registry);
    let webhook_metrics = webhook::WebhookMetrics::register(&mut registry);
    let progress_metrics = controller::progress::ProgressMetrics::register(&mut registry);
    let health = Arc::new(Health::default());
    let listener = metrics::bind(SocketAddr::new(
        config.metrics_bind_address,
        config.metrics_port,
    ))
    .await?;
    let registry = Arc::new(registry);
    let mut tasks = tokio::task::JoinSet::new();
    tasks.spawn({
        let (registry, health) = (registry.clone(), health.clone());
        async move {
            metrics::serve(listener, registry, health).await;
            Ok(())
        }
    });

    // One index: every replica keeps the caches; the webhook reads them on
    // every replica, the decision loop on the leader.
    let changed = Arc::new(Notify::new());
    let caches = Caches::start(&client, changed.clone(), &metrics);

    // Every replica serves the webhook, leader or not.
    let mut webhook_config = webhook::WebhookConfig::new(
        config.webhook_port,
        config.namespace.clone(),
        config.webhook_endpoint.clone(),
        config.gate_owners.clone(),
    );
    webhook_config.owner_cluster_role = config.webhook_owner_cluster_role.clone();
    webhook_config.listen = SocketAddr::new(config.webhook_bind_address, config.webhook_port);
    webhook_config.set_device_plugin_users(config.device_plugin_users.clone());
    // Pods the webhook never sees are never queued by the controller either.
    let unmanaged_namespaces = webhook_config.excluded_namespaces();
    tasks.spawn({
        let (client, health, caches) = (client.clone(), health.clone(), caches.clone());
        async move {
            let running = webhook::start(webhook_config, client, caches, webhook_metrics).await?;
            health.set_webhook_serving();
            running.serve(std::future::pending()).await?;
            Ok(())
        }
    });

    let leadership = if config.leader_elect {
        Leadership::elect(client.clone(), &config.namespace, &config.identity)
    } else {
        Leadership::always()
    };
    tasks.spawn({
        let (client, leader, health) = (client.clone(), leadership.rx.clone(), health.clone());
        let loop_config = LoopConfig {
            resync: config.resync,
            instance: config.identity.clone(),
            unmanaged_namespaces: unmanaged_namespaces.clone(),
            status_writes_per_second: config.status_writes_per_second,
            progress_metrics,
        };
        async move {
            controller::run(
                client,
                caches,
                changed,
                leader,
                metrics,
                health,
                loop_config,
            )
            .await?;
            Ok(())
        }
    });

    tokio::select! {
        signal = shutdown_signal() => {
            signal.map_err(RunError::Signal)?;
            tracing::info!("signal received; shutting down");
            // Hand leadership over now rather than after the Lease expires.
            let _ = tokio::time::timeout(std::time::Duration::from_secs(2), leadership.release()).await;
            Ok(())
        }
        Some(done) = tasks.join_next() => {
            match done {
                Ok(Ok(())) => Err(RunError::TaskEnded),
                Ok(Err(e)) => Err(e),
                Err(e) => Err(RunError::TaskPanicked(e.to_string())),
            }
        }
    }
}

async fn shutdown_signal() -> std::io::Result<()> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = term.recv() => Ok(()),
        r = tokio::signal::ctrl_c() => r,
    }
}
