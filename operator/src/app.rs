//! The operator process: one index (watch caches), the webhook on every
//! replica, leader election, the decision loop on the leader, and the
//! metrics server, run until a signal or a fatal error. `main` only parses
//! flags and maps [`run`]'s outcome to an exit code.

use std::net::SocketAddr;
use std::sync::Arc;

use prometheus_client::registry::Registry;
use tokio::sync::Notify;

use crate::config::Config;
use crate::controller::{self, ControllerError, LoopConfig};
use crate::index::Caches;
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
    let mut kube_config = kube::Config::infer().await.map_err(|e| {
        RunError::KubeConfig(match gpupool_api::kubeconfig::missing_here() {
            Some(path) => format!(
                "no kubeconfig at {} and not running in a pod (KUBERNETES_SERVICE_HOST is unset); set KUBECONFIG to one",
                path.display()
            ),
            None => e.to_string(),
        })
    })?;
    // The decision loop retries on its own schedule; a 429 from a
    // PodDisruptionBudget must come back at once, not after minutes of
    // client-side retries that would stall every admission behind it.
    kube_config.default_retry = false;
    let client = kube::Client::try_from(kube_config.clone())
        .map_err(|e| RunError::KubeConfig(e.to_string()))?;
    // The decision loop's writers get a pool of their own with at most
    // `api_requests_in_flight` requests out: a burst of writes then costs
    // that many connections (each with its TLS and HTTP buffers) rather
    // than one per write, and watches and leader election, on the pool
    // above, never wait behind it.
    let writes_client = limited_client(kube_config, config.api_requests_in_flight)?;

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
        let (client, leader, health) = (writes_client, leadership.rx.clone(), health.clone());
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

/// A client of its own connection pool that has at most `in_flight`
/// requests out at once; later ones wait their turn, first come first
/// served. A request stops counting once its response's headers arrive,
/// so a watch would not hold a turn for its whole life.
fn limited_client(config: kube::Config, in_flight: usize) -> Result<kube::Client, RunError> {
    Ok(kube::client::ClientBuilder::try_from(config)
        .map_err(|e| RunError::KubeConfig(e.to_string()))?
        .with_layer(&tower::limit::ConcurrencyLimitLayer::new(in_flight))
        .build())
}

async fn shutdown_signal() -> std::io::Result<()> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = term.recv() => Ok(()),
        r = tokio::signal::ctrl_c() => r,
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;
    use tokio::sync::{Semaphore, mpsc};

    use super::*;

    /// What every held request is answered with.
    const ANSWER: &str = "{}";

    /// A plain HTTP/1.1 server that reports each request as it arrives and
    /// answers one only when `answers` gives it a permit. Returns its URL.
    async fn holding_server() -> (String, mpsc::UnboundedReceiver<()>, Arc<Semaphore>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("address"));
        let (arrived, arrivals) = mpsc::unbounded_channel();
        let answers = Arc::new(Semaphore::new(0));
        let gate = answers.clone();
        tokio::spawn(async move {
            while let Ok((mut tcp, _)) = listener.accept().await {
                let (arrived, gate) = (arrived.clone(), gate.clone());
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 1024];
                    loop {
                        // A GET is its headers, up to the blank line.
                        let end = loop {
                            if let Some(at) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                                break at + 4;
                            }
                            match tcp.read(&mut chunk).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => buf.extend_from_slice(&chunk[..n]),
                            }
                        };
                        buf.drain(..end);
                        let _ = arrived.send(());
                        gate.acquire().await.expect("never closed").forget();
                        let reply = format!(
                            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{ANSWER}",
                            ANSWER.len()
                        );
                        if tcp.write_all(reply.as_bytes()).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        (url, arrivals, answers)
    }

    /// Sends `n` GETs through `client` at once.
    fn send(client: &kube::Client, n: usize) -> tokio::task::JoinSet<kube::Result<String>> {
        let mut requests = tokio::task::JoinSet::new();
        for _ in 0..n {
            let client = client.clone();
            requests.spawn(async move {
                let request = http::Request::get("/version")
                    .body(Vec::new())
                    .expect("request");
                client.request_text(request).await
            });
        }
        requests
    }

    /// How many requests arrive within a moment.
    async fn arrivals_within_a_moment(arrivals: &mut mpsc::UnboundedReceiver<()>) -> usize {
        let mut n = 0;
        while tokio::time::timeout(Duration::from_millis(300), arrivals.recv())
            .await
            .is_ok_and(|arrived| arrived.is_some())
        {
            n += 1;
        }
        n
    }

    #[tokio::test]
    async fn the_limited_client_has_at_most_its_limit_out_and_the_rest_wait_their_turn() {
        let (url, mut arrivals, answers) = holding_server().await;
        let config = kube::Config::new(url.parse().expect("url"));

        // Without the limit, all eight reach the server at once: the
        // server itself holds nothing back.
        let unlimited = kube::Client::try_from(config.clone()).expect("client");
        let mut requests = send(&unlimited, 8);
        assert_eq!(arrivals_within_a_moment(&mut arrivals).await, 8);
        answers.add_permits(8);
        while let Some(done) = requests.join_next().await {
            assert_eq!(done.expect("task").expect("answered"), ANSWER);
        }

        let limited = limited_client(config, 3).expect("client");
        let mut requests = send(&limited, 8);
        assert_eq!(arrivals_within_a_moment(&mut arrivals).await, 3);
        // Each answer lets exactly one waiting request out.
        answers.add_permits(1);
        assert_eq!(arrivals_within_a_moment(&mut arrivals).await, 1);
        answers.add_permits(2);
        assert_eq!(arrivals_within_a_moment(&mut arrivals).await, 2);
        answers.add_permits(5);
        let mut answered = 0;
        while let Some(done) = requests.join_next().await {
            assert_eq!(done.expect("task").expect("answered"), ANSWER);
            answered += 1;
        }
        assert_eq!(answered, 8);
    }
}
