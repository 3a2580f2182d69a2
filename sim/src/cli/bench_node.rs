//! `gpupool-sim bench-node`: the queue's hand-over timed on a real node.
//!
//! Starts a real control plane and one real node (containerd and a real
//! kubelet, [`crate::real_node`]), installs the chart with `helm` and the
//! images `.ci/build-images.sh` built, with one static GPU. Then, round
//! after round, a pod holds the GPU, a second one waits, and the holder is
//! deleted: the figures are the time from the holder being gone (its slot
//! free) to the waiter's gate being lifted, and to the waiter Running, as a
//! watch on the pods sees them. Last, the operator's and device plugin's
//! memory in their pods, as the kubelet's summary reports it. Prints one
//! JSON document.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Pod, ServiceAccount};
use kube::api::{Api, DeleteParams, PostParams};
use kube::runtime::watcher;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::real_node::{RealCluster, RealClusterConfig};

/// Arguments of `gpupool-sim bench-node`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The envtest assets directory, with the kubelet (`.ci/install-k8s.sh`).
    #[arg(long = "kube-assets", env = "KUBEBUILDER_ASSETS", value_name = "DIR")]
    pub kube_assets: PathBuf,

    /// The image tarballs `.ci/build-images.sh` writes.
    #[arg(
        long,
        env = "GPUPOOL_IMAGES_DIR",
        value_name = "DIR",
        default_value = ".tools/images"
    )]
    pub images: PathBuf,

    /// The helm binary.
    #[arg(long, env = "HELM", default_value = "helm")]
    pub helm: PathBuf,

    /// The chart to install.
    #[arg(
        long,
        env = "GPUPOOL_BENCH_CHART",
        value_name = "DIR",
        default_value = "charts/gpupool"
    )]
    pub chart: PathBuf,

    /// Hand-overs to time.
    #[arg(long, env = "GPUPOOL_BENCH_ROUNDS", default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=500))]
    pub rounds: u32,

    /// Run directory (default: a new directory under the system temp dir).
    #[arg(long, env = "GPUPOOL_SIM_RUN_DIR", value_name = "DIR")]
    pub run_dir: Option<PathBuf>,
}

/// Where the bench's pods live.
const NS: &str = "bench";
/// How long one step of a round may take before the bench gives up.
const STEP_TIMEOUT: Duration = Duration::from_secs(120);

/// What the pod watch saw of one pod, by when.
#[derive(Debug, Default, Clone, Copy)]
struct Seen {
    ungated: Option<Instant>,
    running: Option<Instant>,
    gone: Option<Instant>,
}

/// Runs the bench.
pub async fn run(args: Args) -> anyhow::Result<()> {
    let dir = args
        .run_dir
        .clone()
        .unwrap_or_else(crate::cluster::sim::fresh_run_dir);
    let config = RealClusterConfig::new(&args.kube_assets, &dir, 1, &args.images)?;
    let cluster = RealCluster::start(config)
        .await
        .context("starting a real node")?;
    let result = bench(&args, &cluster, &dir).await;
    cluster.shutdown().await;
    let figures = result?;
    println!("{}", serde_json::to_string_pretty(&figures)?);
    Ok(())
}

async fn bench(args: &Args, cluster: &RealCluster, dir: &std::path::Path) -> anyhow::Result<Value> {
    let client = cluster.client().await?;
    let kubeconfig = cluster.kubeconfig().context("the cluster's kubeconfig")?;
    let node = cluster
        .nodes()
        .first()
        .context("the node")?
        .name()
        .to_owned();
    let helm_home = dir.join("helm");
    let status = tokio::process::Command::new(&args.helm)
        .args(["install", "gpupool"])
        .arg(&args.chart)
        .args([
            "--namespace",
            "gpupool-system",
            "--create-namespace",
            "--set",
            "operator.replicas=1",
            "--set",
            "operator.podDisruptionBudget.enabled=false",
            "--set",
            "devicePlugin.discovery=static",
            "--set",
            "devicePlugin.staticGpus=1",
            "--wait",
            "--timeout",
            "180s",
        ])
        .env("KUBECONFIG", kubeconfig)
        .env("HELM_CACHE_HOME", helm_home.join("cache"))
        .env("HELM_CONFIG_HOME", helm_home.join("config"))
        .env("HELM_DATA_HOME", helm_home.join("data"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .status()
        .await
        .with_context(|| format!("running {}", args.helm.display()))?;
    if !status.success() {
        bail!("helm install failed ({status})");
    }
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": NS}}))?;
    namespaces.create(&PostParams::default(), &ns).await?;
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), NS);
    wait(
        STEP_TIMEOUT,
        "the bench namespace's ServiceAccount",
        || async { accounts.get_opt("default").await.ok().flatten().is_some() },
    )
    .await?;

    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let (tx, mut events) = mpsc::unbounded_channel();
    let watch = tokio::spawn(watch_pods(pods.clone(), tx));
    let mut seen: HashMap<String, Seen> = HashMap::new();
    let mut drain = |seen: &mut HashMap<String, Seen>| {
        while let Ok((name, update)) = events.try_recv() {
            let entry: &mut Seen = seen.entry(name).or_default();
            merge(entry, update);
        }
    };

    let mut to_ungated = Vec::new();
    let mut to_running = Vec::new();
    let mut holder = "pod-0".to_owned();
    pods.create(&PostParams::default(), &workload(&holder)?)
        .await?;
    wait_seen(&mut seen, &mut drain, &holder, |s| s.running.is_some()).await?;
    for round in 1..=args.rounds {
        let waiter = format!("pod-{round}");
        pods.create(&PostParams::default(), &workload(&waiter)?)
            .await?;
        // Queued behind the holder, with its gate still on.
        tokio::time::sleep(Duration::from_millis(500)).await;
        pods.delete(&holder, &DeleteParams::default().grace_period(0))
            .await?;
        wait_seen(&mut seen, &mut drain, &holder, |s| s.gone.is_some()).await?;
        let w = wait_seen(&mut seen, &mut drain, &waiter, |s| s.running.is_some()).await?;
        let freed = seen
            .get(&holder)
            .and_then(|s| s.gone)
            .context("holder gone")?;
        let ungated = w.ungated.context("the waiter's gate lifted")?;
        let running = w.running.context("the waiter Running")?;
        to_ungated.push(ungated.saturating_duration_since(freed));
        to_running.push(running.saturating_duration_since(freed));
        holder = waiter;
    }
    watch.abort();

    let summary: Value = {
        let request = http::Request::get(format!("/api/v1/nodes/{node}/proxy/stats/summary"))
            .body(Vec::new())?;
        serde_json::from_str(&client.request_text(request).await?)?
    };
    Ok(json!({
        "rounds": args.rounds,
        "slot_freed_to_ungated_ms": spread(&mut to_ungated),
        "slot_freed_to_running_ms": spread(&mut to_running),
        "memory_working_set_mib": {
            "operator": working_set_mib(&summary, "operator"),
            "device_plugin": working_set_mib(&summary, "device-plugin"),
        },
    }))
}

/// Min, median, p90 and max of `d`, in milliseconds.
fn spread(d: &mut [Duration]) -> Value {
    d.sort_unstable();
    let at = |q: f64| {
        let i = ((d.len() as f64 - 1.0) * q).round() as usize;
        d.get(i)
            .map(|x| (x.as_secs_f64() * 10_000.0).round() / 10.0)
    };
    json!({"min": at(0.0), "p50": at(0.5), "p90": at(0.9), "max": at(1.0)})
}

/// The working set of the container named `container` in gpupool's
/// namespace, in MiB, from the kubelet's stats summary.
fn working_set_mib(summary: &Value, container: &str) -> Option<f64> {
    summary["pods"]
        .as_array()?
        .iter()
        .filter(|p| p["podRef"]["namespace"] == "gpupool-system")
        .flat_map(|p| p["containers"].as_array().into_iter().flatten())
        .find(|c| c["name"] == container)
        .and_then(|c| c["memory"]["workingSetBytes"].as_f64())
        .map(|b| (b / 1024.0 / 1024.0 * 10.0).round() / 10.0)
}

/// A pod asking one slot, sleeping until deleted.
fn workload(name: &str) -> anyhow::Result<Pod> {
    Ok(serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "terminationGracePeriodSeconds": 0,
            "containers": [{
                "name": "work",
                "image": "localhost/gpupool-workload:bookworm",
                "imagePullPolicy": "Never",
                "command": ["sleep", "infinity"],
                "resources": {"limits": {"gpupool/slot": "1"}}
            }]
        }
    }))?)
}

fn merge(into: &mut Seen, update: Seen) {
    into.ungated = into.ungated.or(update.ungated);
    into.running = into.running.or(update.running);
    into.gone = into.gone.or(update.gone);
}

/// Sends what the watch sees of each pod, stamped on arrival.
async fn watch_pods(pods: Api<Pod>, tx: mpsc::UnboundedSender<(String, Seen)>) {
    let mut stream = watcher(pods, watcher::Config::default()).boxed();
    while let Some(event) = stream.next().await {
        let now = Instant::now();
        let (pod, gone) = match event {
            Ok(watcher::Event::Apply(pod) | watcher::Event::InitApply(pod)) => (pod, false),
            Ok(watcher::Event::Delete(pod)) => (pod, true),
            _ => continue,
        };
        let Some(name) = pod.metadata.name.clone() else {
            continue;
        };
        let spec = pod.spec.as_ref();
        let ungated = spec.is_some_and(|s| s.scheduling_gates.as_ref().is_none_or(Vec::is_empty));
        let running = pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
        let seen = Seen {
            ungated: ungated.then_some(now),
            running: running.then_some(now),
            gone: gone.then_some(now),
        };
        if tx.send((name, seen)).is_err() {
            return;
        }
    }
}

async fn wait_seen(
    seen: &mut HashMap<String, Seen>,
    drain: &mut impl FnMut(&mut HashMap<String, Seen>),
    name: &str,
    done: impl Fn(&Seen) -> bool,
) -> anyhow::Result<Seen> {
    let deadline = Instant::now() + STEP_TIMEOUT;
    loop {
        drain(seen);
        if let Some(s) = seen.get(name).filter(|s| done(s)) {
            return Ok(*s);
        }
        if Instant::now() >= deadline {
            bail!("pod {name} did not get there within {STEP_TIMEOUT:?}");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn wait<F, Fut>(timeout: Duration, what: &str, mut ready: F) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    while !ready().await {
        if Instant::now() >= deadline {
            bail!("{what} was not there within {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(())
}
