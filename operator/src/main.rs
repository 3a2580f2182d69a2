//! `gpupool-operator`: parses flags, starts the watches, the decision loop,
//! leader election, the webhook and the metrics server, and maps the outcome
//! to exit codes (0 on SIGTERM/SIGINT, 2 on bad flags, 1 on a fatal error).

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use gpupool_operator::config::{Args, Config};
use gpupool_operator::controller::{self, Caches, LoopConfig};
use gpupool_operator::leader::Leadership;
use gpupool_operator::metrics::{self, Health, Metrics};
use gpupool_operator::webhook;
use prometheus_client::registry::Registry;
use tokio::sync::Notify;

fn main() -> ExitCode {
    let args = match Args::try_parse() {
        Ok(a) => a,
        Err(e) => {
            let code = if e.use_stderr() { 2 } else { 0 };
            let _ = e.print();
            return ExitCode::from(code);
        }
    };
    let config = match args.validate() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("gpupool-operator: {e}");
            return ExitCode::from(2);
        }
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("gpupool-operator: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(config)) {
        Ok(()) => {
            tracing::info!("shut down");
            ExitCode::SUCCESS
        }
        Err(e) => {
            tracing::error!(error = format!("{e:#}"), "fatal");
            eprintln!("gpupool-operator: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(config: Config) -> anyhow::Result<()> {
    let mut kube_config = kube::Config::infer()
        .await
        .context("cannot build a Kubernetes client (in-cluster config or KUBECONFIG)")?;
    // The decision loop retries on its own schedule; a 429 from a
    // PodDisruptionBudget must come back at once, not after minutes of
    // client-side retries that would stall every admission behind it.
    kube_config.default_retry = false;
    let client = kube::Client::try_from(kube_config)
        .context("cannot build a Kubernetes client (in-cluster config or KUBECONFIG)")?;

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
            let running = webhook::start(webhook_config, client, caches, webhook_metrics)
                .await
                .context("webhook did not start")?;
            health.set_webhook_serving();
            running
                .serve(std::future::pending())
                .await
                .context("webhook stopped")
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
            decide: gpupool_operator::engine::decide,
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
            .await
            .context("decision loop stopped")
        }
    });

    tokio::select! {
        signal = shutdown_signal() => {
            signal?;
            tracing::info!("signal received; shutting down");
            // Hand leadership over now rather than after the Lease expires.
            let _ = tokio::time::timeout(std::time::Duration::from_secs(2), leadership.release()).await;
            Ok(())
        }
        Some(done) = tasks.join_next() => {
            match done {
                Ok(Ok(())) => anyhow::bail!("a server task ended unexpectedly"),
                Ok(Err(e)) => Err(e),
                Err(e) => Err(anyhow::anyhow!("a task panicked: {e}")),
            }
        }
    }
}

async fn shutdown_signal() -> anyhow::Result<()> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("cannot listen for SIGTERM")?;
    tokio::select! {
        _ = term.recv() => Ok(()),
        r = tokio::signal::ctrl_c() => r.context("cannot listen for SIGINT"),
    }
}
