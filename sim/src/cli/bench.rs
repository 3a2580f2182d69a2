//! `gpupool-sim bench`: pushes many short pods through a simulated cluster
//! running the real operator and device plugins, and prints JSON figures:
//! admission throughput, slot-free → ungate latency, webhook latency, the
//! operator's peak RSS, and the API server's raw patch rate for comparison
//! (label patches on ConfigMaps, which no webhook sees;
//! `apiServerRawPatchesFailed` counts those that failed).
//!
//! Method. The class first selects no node, so every pod queues (webhook
//! latency is measured on these creates). Once every lease is Queued
//! (`allQueuedAfterCreatesSeconds`: how long after the last create the
//! operator had queued them all), the class is widened to all nodes and the
//! burst of admissions that fills every slot is timed (admissions/s). The
//! rest of the pods are admitted as running pods finish: for each node, the
//! time from a pod there being seen Succeeded to the next pod pinned there
//! being seen ungated is one slot-free → ungate sample. All times come from
//! one pod watch in this process.
//!
//! Cost figures: `eventsDropped` (Events the operator dropped, its event
//! queue full), `failedCreates` (pod creates that failed, with the first
//! few errors; the run goes on with the pods that exist), `writesPerAdmission`
//! (every write request the operator's identity made during the run, as the
//! in-memory API server counts them per user, ÷ admissions; `null` on a real
//! control plane; `writesPerAdmissionByRoute` splits it by method and
//! resource, e.g. `PATCH gpuleases/status`), `apiWritesPerAdmissionByClient`
//! (every client's writes ÷ admissions, refused ones included: the
//! operator, the scheduler, the kubelets together, the device plugins, and
//! the bench's own pod creates as `admin`: what one admission costs the API
//! server over the run), `apiWritesPerBurstAdmissionByClient` (the same,
//! counted from the class's opening to the burst's last admission and
//! divided by the burst's admissions: the write rate the burst asks of the
//! API server, to set beside its raw patch rate), `operatorPeakOpenFiles`
//! (the most files the operator held open in the samples taken every 0.5 s
//! while pods run, its connections among them), `peakLeases` (most GpuLeases seen at once) and
//! `rssPerLeaseKiB` ((the operator's peak RSS − its RSS before the pods
//! were created) ÷ peak leases). With `--other-pods N`, N pods that ask for
//! no GPU are created first, and `otherPodsRssKiB` is how much the
//! operator's RSS grew meanwhile and in the 3 s after: what a cluster's
//! other workloads cost it.
//!
//! `podCreateWithWebhookMs` is what a client of the API server waits for a
//! create, so with `--concurrency N` it includes the wait behind the other
//! N − 1 creates in flight. `webhookCallMs` is the webhook alone, as the
//! in-memory API server times each call it makes to the operator (a TLS
//! dial when no connection is kept, the request, the whole answer); `null`
//! on a real control plane.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use futures::{StreamExt, TryStreamExt};
use gpupool_api::{GpuLease, GpuLeaseClass, LeasePhase};
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use serde_json::json;

use crate::cluster::sim::OPERATOR_USER;
use crate::cluster::workload::wait_until_webhook_knows_class;
use crate::cluster::{ClusterConfig, OperatorMode, SimCluster};

/// Arguments of `gpupool-sim bench`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Number of nodes.
    #[arg(long, env = "GPUPOOL_BENCH_NODES", default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub nodes: u32,
    /// GPUs per node.
    #[arg(long, env = "GPUPOOL_BENCH_GPUS_PER_NODE", default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub gpus_per_node: u32,
    /// Pods pushed through.
    #[arg(long, env = "GPUPOOL_BENCH_PODS", default_value_t = 2000, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub pods: u32,
    /// Seconds each pod runs before it Succeeds.
    #[arg(long, env = "GPUPOOL_BENCH_RUN_SECONDS", default_value_t = 1.0)]
    pub run_seconds: f64,
    /// Pods created concurrently.
    #[arg(long, env = "GPUPOOL_BENCH_CONCURRENCY", default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub concurrency: u32,
    /// Pods that ask for no GPU, created before the bench's own and left
    /// waiting behind a scheduling gate of their own: a cluster's other
    /// workloads, which the operator should not hold in memory
    /// (`otherPodsRssKiB` is its RSS growth while they are created).
    #[arg(long, env = "GPUPOOL_BENCH_OTHER_PODS", default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=100_000))]
    pub other_pods: u32,
    /// Give up after this many seconds.
    #[arg(long, env = "GPUPOOL_BENCH_TIMEOUT_SECONDS", default_value_t = 1800)]
    pub timeout_seconds: u64,
    /// The gpupool-operator binary (default: next to gpupool-sim).
    #[arg(long, env = "GPUPOOL_SIM_OPERATOR_BIN")]
    pub operator_bin: Option<PathBuf>,
    /// The gpupool-device-plugin binary (default: next to gpupool-sim).
    #[arg(long, env = "GPUPOOL_SIM_DEVICE_PLUGIN_BIN")]
    pub device_plugin_bin: Option<PathBuf>,
    /// Run on a real Kubernetes control plane from this envtest assets
    /// directory (etcd, kube-apiserver, kube-scheduler,
    /// kube-controller-manager) instead of the in-memory API server; the
    /// simulator then runs only the kubelets, device plugins and operator.
    #[arg(long = "kube-assets", env = "KUBEBUILDER_ASSETS", value_name = "DIR")]
    pub kube_assets: Option<PathBuf>,
}

const NS: &str = "bench";
/// Where `--other-pods` go.
const OTHER_NS: &str = "bench-other";
/// How long the operator is given to take in the other pods' watch events
/// before its RSS is read again.
const OTHER_PODS_SETTLE: Duration = Duration::from_secs(3);

#[derive(Default)]
struct Seen {
    ungated: HashMap<String, (Instant, String)>,
    succeeded: HashMap<String, (Instant, String)>,
}

/// Runs `gpupool-sim bench`.
pub async fn run(args: Args) -> anyhow::Result<()> {
    if !(args.run_seconds.is_finite() && args.run_seconds >= 0.0) {
        anyhow::bail!("--run-seconds must be a non-negative number of seconds");
    }
    let mut cluster = SimCluster::start(ClusterConfig {
        backend: super::up::backend(args.kube_assets.as_ref()),
        nodes: args.nodes,
        gpus_per_node: args.gpus_per_node,
        operator: OperatorMode::Required,
        operator_bin: args.operator_bin.clone(),
        device_plugin_bin: args.device_plugin_bin.clone(),
        ready_timeout: Duration::from_secs(300),
        ..Default::default()
    })
    .await
    .context("starting the simulated cluster")?;
    let result = measure(&mut cluster, &args).await;
    let stop = cluster.shutdown().await;
    let figures = result?;
    stop.context("stopping the simulated cluster")?;
    println!("{}", serde_json::to_string_pretty(&figures)?);
    Ok(())
}

async fn measure(cluster: &mut SimCluster, args: &Args) -> anyhow::Result<serde_json::Value> {
    let client = cluster.client();
    let deadline = Instant::now() + Duration::from_secs(args.timeout_seconds);
    create_namespace(&client, NS).await?;
    let classes: Api<GpuLeaseClass> = Api::all(client.clone());
    classes
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "apiVersion": "gpupool.io/v1alpha1", "kind": "GpuLeaseClass",
                "metadata": {"name": "default"},
                "spec": {"default": true, "nodeSelector": {"matchLabels": {"bench.gpupool.io/none": "x"}}}
            }))?,
        )
        .await
        .context("creating the class")?;
    // One watch records when each pod is first seen ungated and Succeeded.
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let leases: Api<GpuLease> = Api::namespaced(client.clone(), NS);
    wait_until_webhook_knows_class(&pods, "default", Duration::from_secs(60)).await?;
    let (seen_tx, mut seen_rx) =
        tokio::sync::mpsc::unbounded_channel::<(bool, String, String, Instant)>();
    let watch = tokio::spawn({
        let pods = pods.clone();
        async move {
            let mut stream =
                std::pin::pin!(watcher(pods, watcher::Config::default()).applied_objects());
            while let Ok(Some(p)) = stream.try_next().await {
                let now = Instant::now();
                let name = p.metadata.name.clone().unwrap_or_default();
                let spec = p.spec.as_ref();
                let node = spec
                    .and_then(|s| s.node_selector.as_ref())
                    .and_then(|s| s.get("kubernetes.io/hostname"))
                    .cloned()
                    .unwrap_or_default();
                let gated = spec
                    .and_then(|s| s.scheduling_gates.as_ref())
                    .is_some_and(|g| !g.is_empty());
                if !gated && !node.is_empty() {
                    let _ = seen_tx.send((false, name.clone(), node.clone(), now));
                }
                if p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Succeeded") {
                    let _ = seen_tx.send((true, name, node, now));
                }
            }
        }
    });

    let other_pods_rss_kib = if args.other_pods > 0 {
        let before = operator_rss_kib(cluster, "VmRSS:").unwrap_or(0);
        create_other_pods(&client, args.other_pods, args.concurrency).await?;
        tokio::time::sleep(OTHER_PODS_SETTLE).await;
        let after = operator_rss_kib(cluster, "VmRSS:").unwrap_or(0);
        Some(after.saturating_sub(before))
    } else {
        None
    };
    let webhook_calls_before = cluster
        .api_server()
        .map_or(0, |server| server.webhook_call_durations_ms().len());

    // The operator's footprint and API writes before the burst, to subtract.
    let rss_before_kib = operator_rss_kib(cluster, "VmRSS:").unwrap_or(0);
    let operator_writes_before = operator_writes(cluster);
    let client_writes_before = writes_by_client(cluster);

    // Create every pod (all queue: the class selects no node yet). A failed
    // create is counted, not fatal: the figures then say how many failed.
    let mut create_ms = Vec::with_capacity(args.pods as usize);
    let run = args.run_seconds.to_string();
    let results: Vec<anyhow::Result<(String, f64)>> = futures::stream::iter(0..args.pods)
        .map(|i| {
            let pods = pods.clone();
            let run = run.clone();
            async move {
                let pod: Pod = serde_json::from_value(json!({
                    "metadata": {"name": format!("b{i:05}"), "namespace": NS,
                                 "annotations": {"sim.gpupool.io/run-seconds": run}},
                    "spec": {"containers": [{"name": "w", "image": "sim",
                        "resources": {"limits": {"gpupool/slot": "1"}}}]}
                }))?;
                let t = Instant::now();
                pods.create(&PostParams::default(), &pod)
                    .await
                    .with_context(|| format!("creating pod b{i:05}"))?;
                Ok((format!("b{i:05}"), t.elapsed().as_secs_f64() * 1000.0))
            }
        })
        .buffer_unordered(args.concurrency as usize)
        .collect()
        .await;
    let mut created = Vec::with_capacity(results.len());
    let mut failed_creates = 0usize;
    let mut create_errors = Vec::new();
    for r in results {
        match r {
            Ok((name, ms)) => {
                created.push(name);
                create_ms.push(ms);
            }
            Err(e) => {
                failed_creates += 1;
                if create_errors.len() < MAX_CREATE_ERRORS {
                    create_errors.push(format!("{e:#}"));
                }
            }
        }
    }
    anyhow::ensure!(
        !created.is_empty(),
        "every pod create failed; the first errors: {}",
        create_errors.join("; ")
    );

    // Wait for the operator to queue every pod created, so that the burst
    // times admissions alone and not the tail of lease creation.
    let creates_done = Instant::now();
    loop {
        let queued = count_queued_leases(&leases).await;
        if queued >= created.len() {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "timed out: {queued} of {} leases Queued before the class opened",
            created.len()
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let all_queued_secs = creates_done.elapsed().as_secs_f64();

    // Open every node: the burst of admissions fills all slots.
    let capacity = u64::from(args.nodes) * u64::from(args.gpus_per_node);
    let burst = capacity.min(created.len() as u64) as usize;
    let opened = Instant::now();
    let writes_at_open = writes_by_client(cluster);
    let mut writes_at_burst_end = None;
    classes
        .patch(
            "default",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"nodeSelector": null}})),
        )
        .await
        .context("opening the class to every node")?;

    let mut seen = Seen::default();
    let mut rss_peak_kib = 0u64;
    let mut open_files_peak = 0usize;
    let mut last_rss = Instant::now() - Duration::from_secs(1);
    let mut peak_leases = 0usize;
    let mut last_leases = Instant::now() - Duration::from_secs(2);
    let total = created.len();
    while seen.succeeded.len() < total {
        anyhow::ensure!(
            Instant::now() < deadline,
            "timed out: {} of {total} pods admitted, {} finished",
            seen.ungated.len(),
            seen.succeeded.len()
        );
        match tokio::time::timeout(Duration::from_millis(200), seen_rx.recv()).await {
            Ok(Some((done, name, node, at))) => {
                let map = if done {
                    &mut seen.succeeded
                } else {
                    &mut seen.ungated
                };
                map.entry(name).or_insert((at, node));
                if !done && writes_at_burst_end.is_none() && seen.ungated.len() >= burst {
                    writes_at_burst_end = writes_by_client(cluster);
                }
            }
            Ok(None) => anyhow::bail!("the pod watch ended"),
            Err(_) => {}
        }
        if last_rss.elapsed() >= Duration::from_millis(500) {
            last_rss = Instant::now();
            if let Some(pid) = operator_pid(cluster) {
                rss_peak_kib = rss_peak_kib.max(status_kib(pid, "VmHWM:").unwrap_or(0));
                open_files_peak = open_files_peak.max(open_files(pid).unwrap_or(0));
            }
        }
        if last_leases.elapsed() >= Duration::from_secs(2) {
            last_leases = Instant::now();
            peak_leases = peak_leases.max(count_leases(&leases).await);
        }
    }
    watch.abort();
    rss_peak_kib = rss_peak_kib.max(operator_rss_kib(cluster, "VmHWM:").unwrap_or(0));
    peak_leases = peak_leases.max(count_leases(&leases).await);
    // Per route, then in all: where the writes per admission go.
    let admitted = seen.ungated.len();
    let writes_by_route = operator_writes_before
        .zip(operator_writes(cluster))
        .and_then(|(before, after)| per_admission(&before, &after, admitted));
    let writes_per_admission = writes_by_route.as_ref().map(|r| r.values().sum::<f64>());
    let client_writes = client_writes_before
        .zip(writes_by_client(cluster))
        .and_then(|(before, after)| per_admission(&before, &after, admitted));
    let burst_writes = writes_at_open
        .zip(writes_at_burst_end)
        .and_then(|(before, after)| per_admission(&before, &after, burst));
    let rss_per_lease_kib = (peak_leases > 0 && rss_peak_kib > 0)
        .then(|| rss_peak_kib.saturating_sub(rss_before_kib) as f64 / peak_leases as f64);

    let mut ungate_times: Vec<(Instant, String, String)> = seen
        .ungated
        .iter()
        .map(|(n, (t, node))| (*t, n.clone(), node.clone()))
        .collect();
    ungate_times.sort();
    let burst_end = ungate_times
        .get(burst.saturating_sub(1))
        .map(|(t, _, _)| *t)
        .unwrap_or(opened);
    let burst_secs = burst_end.duration_since(opened).as_secs_f64().max(1e-9);
    let overall_secs = ungate_times
        .last()
        .map(|(t, _, _)| t.duration_since(opened).as_secs_f64())
        .unwrap_or(0.0)
        .max(1e-9);

    // Slot-free → ungate, per node.
    let mut events: BTreeMap<String, Vec<(Instant, bool)>> = BTreeMap::new();
    for (t, node) in seen.succeeded.values() {
        events.entry(node.clone()).or_default().push((*t, true));
    }
    for (t, _, node) in &ungate_times {
        events.entry(node.clone()).or_default().push((*t, false));
    }
    let mut free_to_ungate_ms = Vec::new();
    for evs in events.values_mut() {
        evs.sort();
        let mut frees: std::collections::VecDeque<Instant> = Default::default();
        for (t, is_free) in evs.iter() {
            if *is_free {
                frees.push_back(*t);
            } else if let Some(f) = frees.pop_front() {
                free_to_ungate_ms.push(t.duration_since(f).as_secs_f64() * 1000.0);
            }
        }
    }

    let mut webhook_call_ms: Option<Vec<f64>> = cluster.api_server().map(|server| {
        server
            .webhook_call_durations_ms()
            .into_iter()
            .skip(webhook_calls_before)
            .map(f64::from)
            .collect()
    });
    let operator_metrics = cluster.operator_metrics().await.unwrap_or_default();
    let passes = HistogramFigures::parse(&operator_metrics, HistogramFigures::PASSES);
    let reviews = HistogramFigures::parse(&operator_metrics, HistogramFigures::WEBHOOK_REVIEWS);
    let raw = raw_patch_rate(&client, created.len().min(2000), args.concurrency).await?;
    Ok(json!({
        "nodes": args.nodes,
        "gpusPerNode": args.gpus_per_node,
        "pods": args.pods,
        "runSeconds": args.run_seconds,
        "allQueuedAfterCreatesSeconds": all_queued_secs,
        "burstAdmissions": burst,
        "admissionsPerSecondBurst": burst as f64 / burst_secs,
        "admissionsPerSecondOverall": ungate_times.len() as f64 / overall_secs,
        "slotFreeToUngateMs": {"samples": free_to_ungate_ms.len(), "p50": percentile(&mut free_to_ungate_ms, 0.50), "p99": percentile(&mut free_to_ungate_ms, 0.99)},
        "podCreateWithWebhookMs": {"p50": percentile(&mut create_ms, 0.50), "p99": percentile(&mut create_ms, 0.99)},
        "webhookCallMs": webhook_call_ms.as_mut().map(|ms| json!({"calls": ms.len(), "p50": percentile(ms, 0.50), "p99": percentile(ms, 0.99)})),
        "operatorPeakRssMiB": rss_peak_kib as f64 / 1024.0,
        "operatorPeakOpenFiles": open_files_peak,
        "failedCreates": {"count": failed_creates, "firstErrors": create_errors},
        "writesPerAdmission": writes_per_admission,
        "writesPerAdmissionByRoute": writes_by_route,
        "apiWritesPerAdmissionByClient": client_writes,
        "apiWritesPerBurstAdmissionByClient": burst_writes,
        "operatorPasses": passes.as_ref().map(HistogramFigures::to_json),
        "webhookReviewMs": reviews.as_ref().map(HistogramFigures::to_json),
        "operatorApiErrors": counter_by_label(&operator_metrics, "gpupool_operator_api_errors_total"),
        "progressWrites": counter_by_label(&operator_metrics, "gpupool_operator_progress_writes_total"),
        "eventsDropped": counter(&operator_metrics, "gpupool_operator_events_dropped_total"),
        "otherPods": args.other_pods,
        "otherPodsRssKiB": other_pods_rss_kib,
        "peakLeases": peak_leases,
        "rssPerLeaseKiB": rss_per_lease_kib,
        "apiServerRawPatchesPerSecond": raw.per_second,
        "apiServerRawPatchesFailed": raw.failed,
    }))
}

/// Creates the namespace `name`.
async fn create_namespace(client: &kube::Client, name: &str) -> anyhow::Result<()> {
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    namespaces
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": name}}))?,
        )
        .await
        .with_context(|| format!("creating namespace {name}"))?;
    Ok(())
}

/// Creates `count` pods in [`OTHER_NS`] as a cluster's other workloads
/// look (two containers with CPU and memory requests and limits, labels
/// and an annotation), none asking for a GPU. Each waits behind a
/// scheduling gate nobody removes, so the simulated scheduler and kubelets
/// do no work for them; every watch of pods sees them all the same.
async fn create_other_pods(
    client: &kube::Client,
    count: u32,
    concurrency: u32,
) -> anyhow::Result<()> {
    create_namespace(client, OTHER_NS).await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), OTHER_NS);
    let resources = json!({"requests": {"cpu": "100m", "memory": "128Mi"},
                           "limits": {"cpu": "500m", "memory": "256Mi"}});
    futures::stream::iter(0..count)
        .map(|i| {
            let pods = pods.clone();
            let pod = json!({
                "metadata": {"name": format!("web-{i:05}"),
                             "labels": {"app": "web", "tier": "frontend", "pod-template-hash": "5d8f7c9b6"},
                             "annotations": {"prometheus.io/scrape": "true"}},
                "spec": {"schedulingGates": [{"name": "bench.gpupool.io/hold"}],
                         "containers": [{"name": "web", "image": "sim", "resources": resources},
                                        {"name": "proxy", "image": "sim", "resources": resources}]}
            });
            async move {
                let pod: Pod = serde_json::from_value(pod)?;
                pods.create(&PostParams::default(), &pod)
                    .await
                    .with_context(|| format!("creating the other pod web-{i:05}"))?;
                anyhow::Ok(())
            }
        })
        .buffer_unordered(concurrency.max(1) as usize)
        .try_collect::<()>()
        .await
}

/// Label patches on ConfigMaps of its own, as fast as the API server takes
/// them: the API server's write rate during the run, with no webhook in the
/// way (a pod patch would go through the operator's pod webhook). A failed
/// patch is counted, never fatal, so the run's other figures are kept.
async fn raw_patch_rate(
    client: &kube::Client,
    count: usize,
    concurrency: u32,
) -> anyhow::Result<RawPatches> {
    let maps: Api<ConfigMap> = Api::namespaced(client.clone(), NS);
    let names: Vec<String> = (0..count).map(|i| format!("raw-{i:05}")).collect();
    for name in &names {
        let map: ConfigMap = serde_json::from_value(json!({"metadata": {"name": name}}))?;
        maps.create(&PostParams::default(), &map)
            .await
            .with_context(|| format!("creating ConfigMap {NS}/{name} for the raw patch rate"))?;
    }
    let start = Instant::now();
    let failed = futures::stream::iter(&names)
        .map(|name| {
            let maps = maps.clone();
            async move {
                maps.patch(
                    name,
                    &PatchParams::default(),
                    &Patch::Merge(
                        json!({"metadata": {"labels": {"bench.gpupool.io/patched": "yes"}}}),
                    ),
                )
                .await
            }
        })
        .buffer_unordered(concurrency.max(1) as usize)
        .filter(|r| std::future::ready(r.is_err()))
        .count()
        .await;
    let ok = names.len() - failed;
    Ok(RawPatches {
        per_second: ok as f64 / start.elapsed().as_secs_f64().max(1e-9),
        failed,
    })
}

/// The API server's raw patch rate during the run.
struct RawPatches {
    per_second: f64,
    failed: usize,
}

fn percentile(v: &mut [f64], q: f64) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let idx = ((v.len() as f64 - 1.0) * q).round() as usize;
    v.get(idx).copied()
}

/// How many pod-create errors the figures quote verbatim.
const MAX_CREATE_ERRORS: usize = 5;

/// The operator process, found among the cluster's children by its
/// command name.
fn operator_pid(cluster: &mut SimCluster) -> Option<u32> {
    cluster.child_pids().into_iter().find(|pid| {
        std::fs::read_to_string(format!("/proc/{pid}/comm"))
            .is_ok_and(|comm| "gpupool-operator".starts_with(comm.trim()))
    })
}

/// A `/proc/<pid>/status` field (`VmRSS:` now, `VmHWM:` the peak) of the
/// operator process, in KiB.
fn operator_rss_kib(cluster: &mut SimCluster, field: &str) -> Option<u64> {
    status_kib(operator_pid(cluster)?, field)
}

/// A `/proc/<pid>/status` field of process `pid`, in KiB.
fn status_kib(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    parse_status_kib(&status, field)
}

/// How many files process `pid` has open now (its sockets among them).
fn open_files(pid: u32) -> Option<usize> {
    entries(Path::new(&format!("/proc/{pid}/fd")))
}

/// How many entries directory `dir` holds; `None` when it cannot be read.
fn entries(dir: &Path) -> Option<usize> {
    Some(std::fs::read_dir(dir).ok()?.count())
}

/// The KiB value of `field` in a `/proc/<pid>/status` text.
fn parse_status_kib(status: &str, field: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// Every API write the operator's identity has made, by route (`PATCH
/// gpuleases/status`), as the in-memory API server counts them; `None` on
/// a real control plane, which does not count per user.
fn operator_writes(cluster: &SimCluster) -> Option<BTreeMap<String, u64>> {
    Some(cluster.api_server()?.writes_by_route(OPERATOR_USER))
}

/// Every API write during the run by client, as the in-memory API server
/// counts them per user, the kubelets' users (`system:node:<node>`) folded
/// into one; `None` on a real control plane.
fn writes_by_client(cluster: &SimCluster) -> Option<BTreeMap<String, u64>> {
    let mut by_client = BTreeMap::new();
    for (user, n) in cluster.api_server()?.writes_by_user() {
        let client = if user.starts_with("system:node:") {
            "system:node:*".to_owned()
        } else {
            user
        };
        *by_client.entry(client).or_default() += n;
    }
    Some(by_client)
}

/// The counts that grew from `before` to `after`, each divided by
/// `admissions`; `None` when nothing was admitted.
fn per_admission(
    before: &BTreeMap<String, u64>,
    after: &BTreeMap<String, u64>,
    admissions: usize,
) -> Option<BTreeMap<String, f64>> {
    (admissions > 0).then(|| {
        after
            .iter()
            .map(|(key, n)| {
                let was = before.get(key).copied().unwrap_or(0);
                (
                    key.clone(),
                    n.saturating_sub(was) as f64 / admissions as f64,
                )
            })
            .filter(|(_, per)| *per > 0.0)
            .collect()
    })
}

/// A Prometheus histogram of the operator's, summed over all its label
/// sets: how many observations, their mean, and the bucket bound the 99th
/// percentile falls under.
#[derive(Debug, Clone, PartialEq)]
struct HistogramFigures {
    count: u64,
    sum_seconds: f64,
    p99_bound_ms: Option<f64>,
}

impl HistogramFigures {
    /// The decision passes: `gpupool_operator_reconcile_duration_seconds`.
    const PASSES: &'static str = "gpupool_operator_reconcile_duration_seconds";
    /// Every review the webhook answered, from a complete request body to a
    /// serialized response: `gpupool_webhook_request_duration_seconds`.
    const WEBHOOK_REVIEWS: &'static str = "gpupool_webhook_request_duration_seconds";

    /// Reads histogram `metric` out of Prometheus text; `None` when it has
    /// no observations.
    fn parse(text: &str, metric: &str) -> Option<Self> {
        let mut count = 0u64;
        let mut sum = 0.0;
        let mut buckets: BTreeMap<String, u64> = BTreeMap::new();
        for line in text.lines() {
            let Some(rest) = line.strip_prefix(metric) else {
                continue;
            };
            let Some((series, value)) = rest.rsplit_once(' ') else {
                continue;
            };
            let Ok(value) = value.parse::<f64>() else {
                continue;
            };
            let (suffix, labels) = series.split_once('{').unwrap_or((series, ""));
            match suffix {
                "_count" => count += value as u64,
                "_sum" => sum += value,
                "_bucket" => {
                    // Buckets are cumulative per label set, so the same
                    // bound summed over the sets stays cumulative.
                    let le = labels
                        .split(',')
                        .find_map(|l| l.trim_end_matches('}').strip_prefix("le=\""))
                        .map(|l| l.trim_end_matches('"'));
                    if let Some(le) = le {
                        *buckets.entry(le.to_owned()).or_default() += value as u64;
                    }
                }
                _ => {}
            }
        }
        if count == 0 {
            return None;
        }
        let mut buckets: Vec<(f64, u64)> = buckets
            .into_iter()
            .map(|(le, n)| {
                let bound = if le == "+Inf" {
                    Some(f64::INFINITY)
                } else {
                    le.parse().ok()
                };
                bound.map(|b| (b, n))
            })
            .collect::<Option<_>>()?;
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        let needed = (count as f64 * 0.99).ceil() as u64;
        let p99_bound_ms = buckets
            .iter()
            .find(|(_, cumulative)| *cumulative >= needed)
            .map(|(bound, _)| bound * 1000.0)
            .filter(|ms| ms.is_finite());
        Some(Self {
            count,
            sum_seconds: sum,
            p99_bound_ms,
        })
    }

    fn mean_ms(&self) -> f64 {
        self.sum_seconds * 1000.0 / self.count as f64
    }

    fn to_json(&self) -> serde_json::Value {
        json!({"count": self.count, "meanMs": self.mean_ms(), "p99UpToMs": self.p99_bound_ms})
    }
}

/// The value of the unlabelled counter `metric` in a metrics text (`None`
/// when it is not there).
fn counter(text: &str, metric: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let value = line.strip_prefix(metric)?.strip_prefix(' ')?;
        value.trim().parse::<f64>().ok().map(|v| v as u64)
    })
}

/// A labelled counter of the operator's, by the value of its one label:
/// `{"lease_conflict": 12, ...}` for
/// `gpupool_operator_api_errors_total{error="lease_conflict"} 12`.
fn counter_by_label(text: &str, metric: &str) -> BTreeMap<String, u64> {
    let mut counts = BTreeMap::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(metric).and_then(|r| r.strip_prefix('{')) else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once(' ') else {
            continue;
        };
        let label = labels
            .trim_end_matches('}')
            .split_once('=')
            .map(|(_, v)| v.trim_matches('"').to_owned());
        if let (Some(label), Ok(value)) = (label, value.parse::<f64>()) {
            *counts.entry(label).or_default() += value as u64;
        }
    }
    counts
}

/// The number of GpuLeases in the bench namespace (0 when listing fails:
/// a missed sample only lowers the peak's resolution).
async fn count_leases(leases: &Api<GpuLease>) -> usize {
    leases
        .list_metadata(&kube::api::ListParams::default())
        .await
        .map(|l| l.items.len())
        .unwrap_or(0)
}

/// Leases whose phase is Queued (their sequence persisted); 0 when the
/// list fails, so a caller waiting for them waits on.
async fn count_queued_leases(leases: &Api<GpuLease>) -> usize {
    leases
        .list(&kube::api::ListParams::default())
        .await
        .map(|l| {
            l.items
                .iter()
                .filter(|l| {
                    l.status
                        .as_ref()
                        .is_some_and(|s| s.phase == LeasePhase::Queued)
                })
                .count()
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_per_admission_are_the_growth_of_each_count() {
        let before = BTreeMap::from([("a".to_owned(), 10), ("b".to_owned(), 5)]);
        let after = BTreeMap::from([
            ("a".to_owned(), 30),
            ("b".to_owned(), 5),
            ("c".to_owned(), 4),
        ]);
        let per = per_admission(&before, &after, 4).expect("admissions");
        assert_eq!(
            per,
            BTreeMap::from([("a".to_owned(), 5.0), ("c".to_owned(), 1.0)]),
            "b did not grow"
        );
        assert_eq!(per_admission(&before, &after, 0), None);
    }

    #[test]
    fn open_files_are_the_entries_of_the_fd_directory() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        assert_eq!(entries(dir.path()), Some(0));
        for name in ["0", "1", "2"] {
            std::fs::write(dir.path().join(name), b"").expect("entry written");
        }
        assert_eq!(entries(dir.path()), Some(3));
        assert_eq!(entries(&dir.path().join("absent")), None);
        // The reading itself holds this process's fd directory open.
        assert!(open_files(std::process::id()).is_some_and(|n| n >= 1));
        assert_eq!(open_files(u32::MAX), None, "no such process");
    }

    #[test]
    fn status_fields_are_read_in_kib() {
        let status = "Name:\tgpupool-operator\nVmHWM:\t   20480 kB\nVmRSS:\t   10240 kB\n";
        assert_eq!(parse_status_kib(status, "VmRSS:"), Some(10240));
        assert_eq!(parse_status_kib(status, "VmHWM:"), Some(20480));
        assert_eq!(parse_status_kib(status, "VmSwap:"), None);
        // A live process's own status file, and none for a process that is not.
        assert!(status_kib(std::process::id(), "VmRSS:").is_some_and(|kib| kib > 0));
        assert_eq!(status_kib(u32::MAX, "VmRSS:"), None);
    }

    #[test]
    fn pass_figures_come_from_the_reconcile_histogram() {
        let text = "\
# HELP gpupool_operator_reconcile_duration_seconds Duration of one decision pass.
# TYPE gpupool_operator_reconcile_duration_seconds histogram
gpupool_operator_reconcile_duration_seconds_sum 0.5
gpupool_operator_reconcile_duration_seconds_count 100
gpupool_operator_reconcile_duration_seconds_bucket{le=\"0.001\"} 50
gpupool_operator_reconcile_duration_seconds_bucket{le=\"0.01\"} 98
gpupool_operator_reconcile_duration_seconds_bucket{le=\"0.1\"} 100
gpupool_operator_reconcile_duration_seconds_bucket{le=\"+Inf\"} 100
gpupool_operator_admissions_total 7
";
        let figures = HistogramFigures::parse(text, HistogramFigures::PASSES).expect("figures");
        assert_eq!(figures.count, 100);
        assert!((figures.mean_ms() - 5.0).abs() < 1e-9);
        assert_eq!(figures.p99_bound_ms, Some(100.0));
        assert_eq!(
            HistogramFigures::parse(
                "gpupool_operator_admissions_total 7\n",
                HistogramFigures::PASSES
            ),
            None
        );
    }

    #[test]
    fn review_figures_sum_the_webhook_histogram_over_its_label_sets() {
        let text = "\
# TYPE gpupool_webhook_request_duration_seconds histogram
gpupool_webhook_request_duration_seconds_sum{webhook=\"mutate\",outcome=\"patched\"} 0.3
gpupool_webhook_request_duration_seconds_count{webhook=\"mutate\",outcome=\"patched\"} 60
gpupool_webhook_request_duration_seconds_bucket{le=\"0.001\",webhook=\"mutate\",outcome=\"patched\"} 50
gpupool_webhook_request_duration_seconds_bucket{le=\"0.1\",webhook=\"mutate\",outcome=\"patched\"} 60
gpupool_webhook_request_duration_seconds_bucket{le=\"+Inf\",webhook=\"mutate\",outcome=\"patched\"} 60
gpupool_webhook_request_duration_seconds_sum{webhook=\"validate\",outcome=\"allowed\"} 0.1
gpupool_webhook_request_duration_seconds_count{webhook=\"validate\",outcome=\"allowed\"} 40
gpupool_webhook_request_duration_seconds_bucket{le=\"0.001\",webhook=\"validate\",outcome=\"allowed\"} 40
gpupool_webhook_request_duration_seconds_bucket{le=\"0.1\",webhook=\"validate\",outcome=\"allowed\"} 40
gpupool_webhook_request_duration_seconds_bucket{le=\"+Inf\",webhook=\"validate\",outcome=\"allowed\"} 40
gpupool_operator_reconcile_duration_seconds_count 5
";
        let figures =
            HistogramFigures::parse(text, HistogramFigures::WEBHOOK_REVIEWS).expect("figures");
        assert_eq!(figures.count, 100);
        assert!((figures.mean_ms() - 4.0).abs() < 1e-9);
        // 90 of 100 within 1 ms, all within 100 ms.
        assert_eq!(figures.p99_bound_ms, Some(100.0));
    }

    #[test]
    fn labelled_counters_are_read_by_their_label() {
        let text = "\
# TYPE gpupool_operator_api_errors counter
gpupool_operator_api_errors_total{error=\"lease_conflict\"} 12
gpupool_operator_api_errors_total{error=\"admit_pod\"} 1
gpupool_operator_api_errors_created{error=\"admit_pod\"} 1700000000.0
gpupool_operator_progress_writes_total{result=\"written\"} 40
";
        let errors = counter_by_label(text, "gpupool_operator_api_errors_total");
        assert_eq!(
            errors,
            BTreeMap::from([
                ("admit_pod".to_owned(), 1),
                ("lease_conflict".to_owned(), 12)
            ])
        );
        assert!(counter_by_label(text, "gpupool_operator_events_dropped_total").is_empty());
    }

    #[test]
    fn an_unlabelled_counter_is_read_by_its_name_alone() {
        let text = "\
gpupool_operator_events_dropped_total 7
gpupool_operator_events_dropped_created 1700000000.0
gpupool_operator_api_errors_total{error=\"admit_pod\"} 1
";
        assert_eq!(
            counter(text, "gpupool_operator_events_dropped_total"),
            Some(7)
        );
        assert_eq!(counter(text, "gpupool_operator_api_errors_total"), None);
        assert_eq!(counter(text, "gpupool_operator_events_dropped"), None);
    }

    #[test]
    fn percentiles() {
        let mut v = vec![5.0, 1.0, 3.0, 2.0, 4.0];
        assert_eq!(percentile(&mut v, 0.5), Some(3.0));
        assert_eq!(percentile(&mut v, 0.99), Some(5.0));
        assert_eq!(percentile(&mut [], 0.5), None);
    }
}
