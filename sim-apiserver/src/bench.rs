//! Throughput benchmark of the simulated API server: kube-rs clients issue
//! small merge patches while watchers consume the resulting events.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, Patch, PatchParams, PostParams, WatchEvent, WatchParams};
use serde::Serialize;
use serde_json::json;

use crate::{ADMIN_TOKEN, ApiServer, ApiServerConfig};

/// What to run.
#[derive(Debug, Clone)]
pub struct BenchConfig {
    /// Concurrent writers (each its own in-flight request).
    pub writers: usize,
    /// Watchers of the written resource.
    pub watchers: usize,
    /// Objects the writers spread their patches over.
    pub objects: usize,
    /// How long the writers run.
    pub duration: Duration,
    /// Serve HTTPS (as the operator sees it) or plain HTTP.
    pub tls: bool,
}

impl Default for BenchConfig {
    fn default() -> Self {
        BenchConfig {
            writers: 32,
            watchers: 4,
            objects: 200,
            duration: Duration::from_secs(5),
            tls: false,
        }
    }
}

/// Measured figures.
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    /// Writers.
    pub writers: usize,
    /// Watchers.
    pub watchers: usize,
    /// Whether TLS was on.
    pub tls: bool,
    /// Successful patches.
    pub writes: u64,
    /// Failed patches.
    pub write_errors: u64,
    /// Patches per second over the write phase.
    pub writes_per_sec: f64,
    /// Events delivered to all watchers together.
    pub events_delivered: u64,
    /// Watch events delivered per second (fan-out), until every watcher
    /// had seen every write.
    pub events_per_sec: f64,
    /// Whether every watcher saw every write.
    pub watchers_complete: bool,
    /// Mean patch latency in microseconds.
    pub mean_write_latency_us: f64,
}

/// Why the benchmark could not run.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// Server start or client build failed.
    #[error("setup failed: {0}")]
    Setup(String),
    /// A request in the setup phase failed.
    #[error("request failed: {0}")]
    Request(#[from] kube::Error),
}

/// Runs the benchmark against a fresh in-process server.
pub async fn run(cfg: BenchConfig) -> Result<BenchReport, BenchError> {
    let server = ApiServer::start(ApiServerConfig {
        tls: cfg.tls,
        ..ApiServerConfig::default()
    })
    .await
    .map_err(|e| BenchError::Setup(e.to_string()))?;
    let mut kc = server
        .kube_config(ADMIN_TOKEN)
        .await
        .map_err(|e| BenchError::Setup(e.to_string()))?;
    kc.default_retry = false;
    let client = kube::Client::try_from(kc).map_err(|e| BenchError::Setup(e.to_string()))?;
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), "default");
    for i in 0..cfg.objects {
        let cm: ConfigMap = serde_json::from_value(
            json!({"metadata": {"name": format!("bench-{i}")}, "data": {"n": "init"}}),
        )
        .map_err(|e| BenchError::Setup(e.to_string()))?;
        api.create(&PostParams::default(), &cm).await?;
    }
    let start_rv = server.admin().resource_version().to_string();

    let delivered = Arc::new(AtomicU64::new(0));
    let mut watcher_tasks = Vec::new();
    let target = Arc::new(AtomicU64::new(u64::MAX));
    for _ in 0..cfg.watchers {
        let mut stream = api
            .watch(&WatchParams::default().timeout(290), &start_rv)
            .await?
            .boxed();
        let delivered = delivered.clone();
        let target = target.clone();
        watcher_tasks.push(tokio::spawn(async move {
            let mut seen = 0u64;
            while let Ok(Some(ev)) = stream.try_next().await {
                if matches!(ev, WatchEvent::Modified(_)) {
                    seen += 1;
                    delivered.fetch_add(1, Ordering::Relaxed);
                }
                if seen >= target.load(Ordering::Relaxed) {
                    break;
                }
            }
            seen
        }));
    }

    let stop = Arc::new(AtomicBool::new(false));
    let writes = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let latency_us = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut writer_tasks = Vec::new();
    for w in 0..cfg.writers {
        let api = api.clone();
        let (stop, writes, errors, latency_us) = (
            stop.clone(),
            writes.clone(),
            errors.clone(),
            latency_us.clone(),
        );
        let objects = cfg.objects;
        writer_tasks.push(tokio::spawn(async move {
            let mut i = w;
            while !stop.load(Ordering::Relaxed) {
                let name = format!("bench-{}", i % objects);
                let t = Instant::now();
                let patch = json!({"data": {"n": i.to_string()}});
                match api
                    .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                {
                    Ok(_) => {
                        writes.fetch_add(1, Ordering::Relaxed);
                        latency_us.fetch_add(t.elapsed().as_micros() as u64, Ordering::Relaxed);
                    }
                    Err(_) => {
                        errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
                i += cfg.writers;
            }
        }));
    }
    tokio::time::sleep(cfg.duration).await;
    stop.store(true, Ordering::Relaxed);
    for t in writer_tasks {
        let _ = t.await;
    }
    let write_secs = started.elapsed().as_secs_f64();
    let total_writes = writes.load(Ordering::Relaxed);
    target.store(total_writes, Ordering::Relaxed);
    let mut complete = true;
    for t in watcher_tasks {
        match tokio::time::timeout(Duration::from_secs(30), t).await {
            Ok(Ok(seen)) => complete &= seen >= total_writes,
            _ => complete = false,
        }
    }
    let fanout_secs = started.elapsed().as_secs_f64();
    let delivered = delivered.load(Ordering::Relaxed);
    server.shutdown().await;
    Ok(BenchReport {
        writers: cfg.writers,
        watchers: cfg.watchers,
        tls: cfg.tls,
        writes: total_writes,
        write_errors: errors.load(Ordering::Relaxed),
        writes_per_sec: total_writes as f64 / write_secs,
        events_delivered: delivered,
        events_per_sec: delivered as f64 / fanout_secs,
        watchers_complete: complete,
        mean_write_latency_us: latency_us.load(Ordering::Relaxed) as f64
            / total_writes.max(1) as f64,
    })
}
