//! gpupool on a real node: a real control plane and a real kubelet with
//! Debian's containerd (`gpupool_sim::real_node`), the images built from the
//! Dockerfile by `.ci/build-images.sh`, and the chart installed by a real
//! `helm`. The operator runs as the chart's Deployment and is reached as a
//! webhook through its Service; the device plugin runs as its DaemonSet,
//! registers with the real kubelet and reads the real PodResources socket
//! with its pod-bound token, under the chart's admission policies.
//!
//! One cluster serves the whole suite (starting one costs most of a
//! minute on two cores), so the steps run in order in one test; each step
//! is a function named after what it checks, and a failure names its step.
//!
//! Needs root, `KUBEBUILDER_ASSETS` with the kubelet (`bash
//! .ci/install-k8s.sh`), helm (`bash .ci/install-helm.sh`) and the images
//! (`GPUPOOL_IMAGES_DIR`, `bash .ci/build-images.sh`). Without them it
//! fails when `CI` is set and is skipped otherwise.

mod helm_support;
mod operator_support;

use std::collections::BTreeMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use futures::FutureExt;
use gpupool_api::{GpuLease, LeasePhase};
use gpupool_sim::control_plane::client_from_kubeconfig;
use gpupool_sim::real_node::{RealCluster, RealClusterConfig};
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::authentication::v1::TokenRequest;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Node, Pod, ServiceAccount};
use kube::api::{DeleteParams, ListParams, LogParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use operator_support::{annotated_health, wait_for};
use serde_json::{Value, json};

/// The chart's release and namespace.
const RELEASE: &str = "gpupool";
const SYSTEM_NS: &str = "gpupool-system";
/// Where the suite's workload pods live.
const NS: &str = "ml";
/// The class's helper grace period in this suite.
const HELPER_GRACE_SECONDS: u64 = 5;
/// The image test pods run (a Debian root with a shell).
const WORKLOAD_IMAGE: &str = "localhost/gpupool-workload:bookworm";
const RESOURCE: &str = "gpupool/slot";
/// Holds a deleted test pod until the test has read what it needs.
const TEST_FINALIZER: &str = "gpupool.io/test-hold";

/// What the suite needs from the machine; `None` (after a skip) when
/// something is missing outside CI, a panic naming it in CI.
struct Prerequisites {
    assets: PathBuf,
    helm: PathBuf,
    images: PathBuf,
}

fn prerequisites() -> Option<Prerequisites> {
    let missing = |tool: &str, what: &str| {
        gpupool_sim_apiserver::tool_check::missing("the real-node suite", tool, what);
        None
    };
    if !rustix::process::geteuid().is_root() {
        return missing("root", "it needs root");
    }
    let assets = gpupool_sim_apiserver::tool_check::kube_assets("the real-node suite")?;
    if !assets.join("kubelet").is_file() {
        return missing(
            "kubelet",
            "KUBEBUILDER_ASSETS has no kubelet (bash .ci/install-k8s.sh)",
        );
    }
    let helm = match std::env::var_os("HELM") {
        Some(p) => PathBuf::from(p),
        None => helm_support::repo_root().join(".tools/bin/helm"),
    };
    if !helm.is_file() {
        return missing("helm", "no helm (bash .ci/install-helm.sh)");
    }
    let images = std::env::var_os("GPUPOOL_IMAGES_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| helm_support::repo_root().join(".tools/images"));
    if !images.join("gpupool-operator.tar").is_file() {
        return missing(
            "images",
            "no images in GPUPOOL_IMAGES_DIR (bash .ci/build-images.sh)",
        );
    }
    Some(Prerequisites {
        assets,
        helm,
        images,
    })
}

/// The cluster under test and what talks to it.
struct Bed {
    cluster: RealCluster,
    client: Client,
    helm: PathBuf,
    dir: PathBuf,
    kubeconfig: PathBuf,
    node: String,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chart_on_a_real_node() {
    let Some(pre) = prerequisites() else {
        return;
    };
    let links_before = host_links();
    let tmp = tempfile::tempdir().expect("tempdir");
    // A run killed before its teardown leaves links, cgroups and shims;
    // the run below must find them and clean them up.
    let killed = tmp.path().join("killed");
    kill_a_running_real_node(&pre, &killed).await;
    let config = RealClusterConfig::new(&pre.assets, tmp.path().join("cluster"), 1, &pre.images)
        .expect("image archives");
    let cluster = RealCluster::start(config)
        .await
        .expect("a real node starts");
    let left = processes_naming(&killed);
    assert!(
        left.is_empty(),
        "the killed run's processes were not cleaned up: {left:?}"
    );
    let owners = std::fs::read_dir("/run/gpupool-sim")
        .map(|d| {
            d.filter_map(Result::ok)
                .filter_map(|e| std::fs::read_to_string(e.path()).ok())
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    assert!(
        !owners
            .iter()
            .any(|o| o.contains(&*killed.to_string_lossy())),
        "the killed run still owns an address block: {owners:?}"
    );
    let client = cluster.client().await.expect("admin client");
    let kubeconfig = cluster.kubeconfig().expect("kubeconfig").to_path_buf();
    let node = cluster.nodes()[0].name().to_owned();
    let mut bed = Bed {
        cluster,
        client,
        helm: pre.helm,
        dir: tmp.path().to_path_buf(),
        kubeconfig,
        node,
    };
    eprintln!("real-node run directory: {}", bed.dir.display());

    // The cluster is torn down whether the steps pass or not: a failed
    // step must not leave a node's links and processes behind.
    let steps = std::panic::AssertUnwindSafe(run_steps(&mut bed))
        .catch_unwind()
        .await;
    bed.cluster.shutdown().await;
    let left: Vec<String> = host_links()
        .into_iter()
        .filter(|l| !links_before.contains(l))
        .collect();
    if let Err(panic) = steps {
        std::panic::resume_unwind(panic);
    }
    assert!(left.is_empty(), "teardown left links behind: {left:?}");
}

async fn run_steps(bed: &mut Bed) {
    step("helm install", install_the_chart(bed)).await;
    step(
        "FIFO: the second pod waits for the first, then runs; a 2-slot pod sees both GPUs",
        fifo_and_two_gpus(bed),
    )
    .await;
    step(
        "a helper is evicted for a waiting primary within its grace period",
        helper_evicted_for_a_primary(bed),
    )
    .await;
    step(
        "the device plugin's token writes only its own node's objects",
        plugin_guard(bed),
    )
    .await;
    step(
        "a kubelet restart: the plugin re-registers, running pods are untouched",
        kubelet_restart(bed),
    )
    .await;
    step(
        "a GPU unhealthy and healthy again: allocatable and the pod's status follow",
        gpu_health(bed),
    )
    .await;
    step(
        "a pod the kubelet refuses: its lease and a Warning Event say why",
        kubelet_refusal(bed),
    )
    .await;
    step(
        "helm upgrade loses no queued or running pod; uninstall leaves what the docs say",
        upgrade_and_uninstall(bed),
    )
    .await;
}

/// Starts `gpupool-sim up --real-nodes 1` in `dir`, waits until it is
/// ready with a pod running, and kills it with SIGKILL, as a crash would.
async fn kill_a_running_real_node(pre: &Prerequisites, dir: &Path) {
    use tokio::io::AsyncBufReadExt;
    let sim = helm_support::repo_root().join("target/debug/gpupool-sim");
    let mut child = tokio::process::Command::new(&sim)
        .args(["up", "--real-nodes", "1", "--kube-assets"])
        .arg(&pre.assets)
        .arg("--images")
        .arg(&pre.images)
        .arg("--run-dir")
        .arg(dir)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("{} starts: {e}", sim.display()));
    let stdout = child.stdout.take().expect("stdout");
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let ready = tokio::time::timeout(Duration::from_secs(180), lines.next_line())
        .await
        .expect("the run to be killed is ready within 180 s")
        .expect("its stdout")
        .expect("a ready line");
    let kubeconfig = ready
        .strip_prefix("ready kubeconfig=")
        .unwrap_or_else(|| panic!("not a ready line: {ready}"));
    let client = client_from_kubeconfig(Path::new(kubeconfig))
        .await
        .expect("client of the run to be killed");
    let pods: Api<Pod> = Api::namespaced(client, "default");
    let accounts: Api<ServiceAccount> = Api::namespaced(pods.clone().into_client(), "default");
    wait_for("the default ServiceAccount", 60, || async {
        accounts.get_opt("default").await.ok().flatten().map(drop)
    })
    .await;
    let mut pod = workload("left-behind", 0, json!({}), "trap '' TERM; sleep infinity");
    pod["metadata"]["namespace"] = json!("default");
    pod["spec"]["containers"][0]["resources"] = json!({});
    let pod: Pod = serde_json::from_value(pod).expect("pod");
    pods.create(&PostParams::default(), &pod)
        .await
        .expect("a pod on the run to be killed");
    wait_for("a running pod on the run to be killed", 90, || async {
        let p = pods.get_opt("left-behind").await.ok().flatten()?;
        (pod_phase(&p) == "Running").then_some(())
    })
    .await;
    child.start_kill().expect("SIGKILL");
    let _ = child.wait().await;
    assert!(
        !processes_naming(dir).is_empty(),
        "a killed run leaves its containerd shims behind (the case under test)"
    );
}

/// PIDs of processes with an argument under `dir`.
fn processes_naming(dir: &Path) -> Vec<i32> {
    let prefix = format!("{}/", dir.display());
    std::fs::read_dir("/proc")
        .map(|d| {
            d.filter_map(Result::ok)
                .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
                .filter(|pid| {
                    std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| {
                        c.split(|b| *b == 0)
                            .any(|a| a.starts_with(prefix.as_bytes()))
                    })
                })
                .collect()
        })
        .unwrap_or_default()
}

async fn step(name: &str, f: impl Future<Output = ()>) {
    let started = Instant::now();
    eprintln!("== step: {name}");
    f.await;
    eprintln!(
        "== step done in {:.1} s: {name}",
        started.elapsed().as_secs_f64()
    );
}

/// Links of the kinds real nodes add (`gpn*`, `gpc*`).
fn host_links() -> Vec<String> {
    std::fs::read_dir("/sys/class/net")
        .map(|d| {
            d.filter_map(Result::ok)
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with("gpn") || n.starts_with("gpc"))
                .collect()
        })
        .unwrap_or_default()
}

impl Bed {
    fn helm(&self, args: &[&str]) -> Result<String, String> {
        helm_support::helm_run(&self.helm, &self.dir.join("helm"), &self.kubeconfig, args)
    }

    fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.client.clone(), NS)
    }

    fn leases(&self) -> Api<GpuLease> {
        Api::namespaced(self.client.clone(), NS)
    }

    async fn create_pod(&self, pod: Value) {
        let pod: Pod = serde_json::from_value(pod).expect("pod");
        self.pods()
            .create(&PostParams::default(), &pod)
            .await
            .expect("pod created");
    }

    async fn delete_pod(&self, name: &str) {
        let _ = self.pods().delete(name, &DeleteParams::default()).await;
    }

    async fn wait_pod_gone(&self, name: &str, secs: u64) {
        wait_for(&format!("pod {name} gone"), secs, || async {
            match self.pods().get_opt(name).await {
                Ok(None) => Some(()),
                _ => None,
            }
        })
        .await;
    }

    async fn wait_running(&self, name: &str, secs: u64) -> Pod {
        wait_for(&format!("pod {name} Running"), secs, || async {
            let pod = self.pods().get_opt(name).await.ok().flatten()?;
            (pod_phase(&pod) == "Running").then_some(pod)
        })
        .await
    }

    async fn lease(&self, name: &str) -> Option<GpuLease> {
        self.leases().get_opt(name).await.ok().flatten()
    }

    async fn wait_lease(&self, name: &str, phase: LeasePhase, secs: u64) -> GpuLease {
        wait_for(&format!("lease {name} {phase:?}"), secs, || async {
            let lease = self.lease(name).await?;
            (lease.status.as_ref().map(|s| s.phase) == Some(phase)).then_some(lease)
        })
        .await
    }

    async fn allocatable_slots(&self) -> Option<String> {
        let nodes: Api<Node> = Api::all(self.client.clone());
        let node = nodes.get(&self.node).await.ok()?;
        node.status?.allocatable?.get(RESOURCE).map(|q| q.0.clone())
    }

    async fn wait_allocatable(&self, slots: &str, secs: u64) {
        wait_for(
            &format!("{RESOURCE} allocatable {slots} on {}", self.node),
            secs,
            || async { (self.allocatable_slots().await.as_deref() == Some(slots)).then_some(()) },
        )
        .await;
    }

    async fn logs(&self, pod: &str) -> String {
        self.pods()
            .logs(pod, &LogParams::default())
            .await
            .unwrap_or_else(|e| panic!("logs of {pod}: {e}"))
    }

    async fn device_plugin_pod(&self) -> Pod {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), SYSTEM_NS);
        let list = pods
            .list(&ListParams::default().labels("app.kubernetes.io/component=device-plugin"))
            .await
            .expect("list device plugin pods");
        list.items
            .into_iter()
            .find(|p| p.metadata.deletion_timestamp.is_none() && pod_phase(p) == "Running")
            .expect("a running device plugin pod")
    }
}

/// A pod asking `slots` slots of the default class, running `script`
/// under `sh -c` until deleted.
fn workload(name: &str, slots: u32, labels: Value, script: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": labels},
        "spec": {
            "terminationGracePeriodSeconds": 2,
            "containers": [{
                "name": "work",
                "image": WORKLOAD_IMAGE,
                "imagePullPolicy": "Never",
                "command": ["sh", "-c", script],
                "resources": {"limits": {RESOURCE: slots.to_string()}}
            }]
        }
    })
}

/// Prints the GPU environment, then sleeps until stopped (exits on SIGTERM).
const PRINT_ENV_AND_WAIT: &str = "env | grep -E '^(NVIDIA_VISIBLE_DEVICES|GPUPOOL_)' | sort; trap 'exit 0' TERM; while :; do sleep 1; done";

fn pod_phase(pod: &Pod) -> String {
    pod.status
        .as_ref()
        .and_then(|s| s.phase.clone())
        .unwrap_or_default()
}

fn gated(pod: &Pod) -> bool {
    pod.spec
        .as_ref()
        .and_then(|s| s.scheduling_gates.as_ref())
        .is_some_and(|g| !g.is_empty())
}

/// Two static GPUs, written out so a step can flip one's health.
fn static_gpus(healthy: [bool; 2]) -> Value {
    json!([
        {"index": 0, "uuid": "GPU-00000000-0000-4000-8000-00000000aa00", "healthy": healthy[0]},
        {"index": 1, "uuid": "GPU-00000000-0000-4000-8000-00000000aa01", "healthy": healthy[1]},
    ])
}

fn values_file(dir: &Path, log_level: &str) -> PathBuf {
    let values = json!({
        "operator": {
            // One replica on two cores; the PDB needs two.
            "replicas": 1,
            "podDisruptionBudget": {"enabled": false},
            "logLevel": log_level,
        },
        "devicePlugin": {
            "discovery": "static",
            "staticConfig": static_gpus([true, true]),
        },
        "defaultClass": {"spec": {"helpers": {"gracePeriodSeconds": HELPER_GRACE_SECONDS}}},
    });
    let path = dir.join(format!("values-{log_level}.yaml"));
    std::fs::write(&path, serde_yaml::to_string(&values).expect("yaml")).expect("values file");
    path
}

async fn install_the_chart(bed: &Bed) {
    let values = values_file(&bed.dir, "info");
    let out = bed.helm(&[
        "install",
        RELEASE,
        "charts/gpupool",
        "--namespace",
        SYSTEM_NS,
        "--create-namespace",
        "--values",
        &values.to_string_lossy(),
        "--wait",
        "--timeout",
        "180s",
    ]);
    assert!(out.is_ok(), "helm install: {out:?}");
    let deployments: Api<Deployment> = Api::namespaced(bed.client.clone(), SYSTEM_NS);
    let ready = deployments
        .get("gpupool-operator")
        .await
        .expect("operator Deployment")
        .status
        .and_then(|s| s.ready_replicas);
    assert_eq!(ready, Some(1), "the operator Deployment is ready");
    let daemonsets: Api<DaemonSet> = Api::namespaced(bed.client.clone(), SYSTEM_NS);
    let ds = daemonsets
        .get("gpupool-device-plugin")
        .await
        .expect("device plugin DaemonSet");
    assert_eq!(
        ds.status.map(|s| s.number_ready),
        Some(1),
        "one device plugin pod ready"
    );
    bed.wait_allocatable("2", 60).await;
    let namespaces: Api<Namespace> = Api::all(bed.client.clone());
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": NS}})).expect("ns");
    namespaces
        .create(&PostParams::default(), &ns)
        .await
        .expect("namespace");
    // Pods are refused until the namespace's default ServiceAccount exists.
    let accounts: Api<ServiceAccount> = Api::namespaced(bed.client.clone(), NS);
    wait_for("the ml namespace's default ServiceAccount", 60, || async {
        accounts.get_opt("default").await.ok().flatten().map(drop)
    })
    .await;
}

async fn fifo_and_two_gpus(bed: &Bed) {
    // A finalizer holds the deleted pod (and so its lease, which the
    // garbage collector removes with it) until its lease has been read.
    let mut first = workload("first", 2, json!({}), PRINT_ENV_AND_WAIT);
    first["metadata"]["finalizers"] = json!([TEST_FINALIZER]);
    bed.create_pod(first).await;
    bed.wait_running("first", 90).await;
    let lease = bed.wait_lease("first", LeasePhase::Bound, 60).await;
    let status = lease.status.expect("status");
    let mut indexes: Vec<u32> = status.gpus.iter().map(|g| g.index).collect();
    indexes.sort_unstable();
    assert_eq!(
        indexes,
        vec![0, 1],
        "the 2-slot pod's lease holds both GPUs"
    );
    assert_eq!(status.gpu_indexes.as_deref(), Some("0,1"));
    assert_eq!(status.node.as_deref(), Some(bed.node.as_str()));
    let env = wait_for("the first pod's environment in its log", 30, || async {
        let log = bed.logs("first").await;
        log.contains("NVIDIA_VISIBLE_DEVICES").then_some(log)
    })
    .await;
    for gpu in &status.gpus {
        assert!(
            env.contains(&gpu.uuid),
            "the pod's environment names {}: {env}",
            gpu.uuid
        );
    }

    bed.create_pod(workload("second", 1, json!({}), PRINT_ENV_AND_WAIT))
        .await;
    bed.create_pod(workload("third", 1, json!({}), PRINT_ENV_AND_WAIT))
        .await;
    let second = bed.wait_lease("second", LeasePhase::Queued, 30).await;
    let third = bed.wait_lease("third", LeasePhase::Queued, 30).await;
    assert_eq!(second.status.and_then(|s| s.position), Some(1));
    assert_eq!(third.status.and_then(|s| s.position), Some(2));
    // Long enough for a wrongly ungated pod to be scheduled and started.
    tokio::time::sleep(Duration::from_secs(3)).await;
    for name in ["second", "third"] {
        let pod = bed.pods().get(name).await.expect("pod");
        assert!(
            gated(&pod),
            "{name} stays gated while the first holds both GPUs"
        );
        assert_eq!(pod_phase(&pod), "Pending");
    }

    bed.delete_pod("first").await;
    bed.wait_running("second", 90).await;
    bed.wait_running("third", 90).await;
    let second = bed.wait_lease("second", LeasePhase::Bound, 60).await;
    let third = bed.wait_lease("third", LeasePhase::Bound, 60).await;
    let g2 = second.status.expect("status").gpus;
    let g3 = third.status.expect("status").gpus;
    assert_eq!((g2.len(), g3.len()), (1, 1));
    assert_ne!(g2[0].index, g3[0].index, "two pods, two GPUs");
    let first = bed.wait_lease("first", LeasePhase::Released, 60).await;
    let message = first.status.and_then(|s| s.message).unwrap_or_default();
    assert_eq!(
        message, "released: pod deleted",
        "a deleted pod's lease says so"
    );
    let release = json!({"metadata": {"finalizers": null}});
    bed.pods()
        .patch("first", &PatchParams::default(), &Patch::Merge(&release))
        .await
        .expect("finalizer removed");
    for name in ["second", "third"] {
        bed.delete_pod(name).await;
    }
    for name in ["first", "second", "third"] {
        bed.wait_pod_gone(name, 60).await;
    }
}

async fn helper_evicted_for_a_primary(bed: &Bed) {
    // The helper ignores SIGTERM: only the kubelet's kill at the end of the
    // grace period ends it.
    let stubborn = "trap '' TERM; while :; do sleep 1; done";
    bed.create_pod(workload(
        "helper",
        2,
        json!({"gpupool.io/role": "helper"}),
        stubborn,
    ))
    .await;
    bed.wait_running("helper", 90).await;
    bed.wait_lease("helper", LeasePhase::Bound, 60).await;

    bed.create_pod(workload("primary", 1, json!({}), PRINT_ENV_AND_WAIT))
        .await;
    let evicted_at = wait_for("the helper's eviction", 60, || async {
        let pod = bed.pods().get_opt("helper").await.ok().flatten()?;
        pod.metadata.deletion_timestamp.map(|_| Instant::now())
    })
    .await;
    let lease = bed.lease("helper").await.expect("helper lease");
    let phase = lease.status.as_ref().map(|s| s.phase);
    assert!(
        matches!(phase, Some(LeasePhase::Preempting | LeasePhase::Released)),
        "the helper's lease is preempted: {phase:?}"
    );
    bed.wait_pod_gone("helper", HELPER_GRACE_SECONDS + 60).await;
    let took = evicted_at.elapsed();
    eprintln!(
        "the helper was gone {:.1} s after its eviction",
        took.as_secs_f64()
    );
    assert!(
        took >= Duration::from_secs(HELPER_GRACE_SECONDS - 1),
        "a helper that ignores SIGTERM lives out its grace period ({took:?})"
    );
    bed.wait_running("primary", 90).await;
    bed.wait_lease("primary", LeasePhase::Bound, 60).await;
    bed.delete_pod("primary").await;
    bed.wait_pod_gone("primary", 60).await;
}

/// A client holding a token bound to the device plugin's pod, as the
/// plugin's own projected token is.
async fn plugin_client(bed: &Bed) -> Client {
    let plugin = bed.device_plugin_pod().await;
    let accounts: Api<ServiceAccount> = Api::namespaced(bed.client.clone(), SYSTEM_NS);
    let request: TokenRequest = serde_json::from_value(json!({
        "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
        "spec": {
            "audiences": [],
            "expirationSeconds": 600,
            "boundObjectRef": {
                "apiVersion": "v1", "kind": "Pod",
                "name": plugin.metadata.name, "uid": plugin.metadata.uid,
            }
        }
    }))
    .expect("token request");
    let account = plugin
        .spec
        .and_then(|s| s.service_account_name)
        .expect("the plugin pod's service account");
    let issued: TokenRequest = accounts
        .create_subresource("token", &account, &PostParams::default(), &request)
        .await
        .expect("a token bound to the plugin's pod");
    let token = issued.status.and_then(|s| s.token).expect("token");
    let kubeconfig = bed.dir.join("device-plugin-token.kubeconfig");
    bed.cluster
        .control_plane()
        .expect("control plane")
        .write_token_kubeconfig(&kubeconfig, &token)
        .expect("token kubeconfig");
    client_from_kubeconfig(&kubeconfig)
        .await
        .expect("plugin client")
}

async fn plugin_guard(bed: &Bed) {
    let plugin = plugin_client(bed).await;
    // Its own node: the annotation write the plugin makes is admitted.
    let own: Api<Node> = Api::all(plugin.clone());
    let note = json!({"metadata": {"annotations": {"gpupool.io/guard-test": "own"}}});
    own.patch(&bed.node, &PatchParams::default(), &Patch::Merge(&note))
        .await
        .expect("the plugin may write its own node");

    // Another node (a Node object with no kubelet) is refused, by name.
    let nodes: Api<Node> = Api::all(bed.client.clone());
    let other: Node = serde_json::from_value(json!({
        "metadata": {"name": "other-node", "labels": {"kubernetes.io/hostname": "other-node"}},
        "spec": {"taints": [{"key": "gpupool.io/test-only", "effect": "NoSchedule"}]}
    }))
    .expect("node");
    nodes
        .create(&PostParams::default(), &other)
        .await
        .expect("other node");
    let refused = own
        .patch("other-node", &PatchParams::default(), &Patch::Merge(&note))
        .await
        .expect_err("the plugin may not write another node");
    let text = refused.to_string();
    assert!(
        text.contains(&format!("the device plugin of node {}", bed.node))
            && text.contains("other-node"),
        "the refusal names both nodes: {text}"
    );

    // A lease admitted to its own node: its status may be reported; a
    // lease whose status names another node may not be touched.
    bed.create_pod(workload("guarded", 1, json!({}), PRINT_ENV_AND_WAIT))
        .await;
    let lease = bed.wait_lease("guarded", LeasePhase::Bound, 90).await;
    let plugin_leases: Api<GpuLease> = Api::namespaced(plugin.clone(), NS);
    let same = json!({"status": {"gpuIndexes": lease.status.as_ref().and_then(|s| s.gpu_indexes.clone())}});
    plugin_leases
        .patch_status("guarded", &PatchParams::default(), &Patch::Merge(&same))
        .await
        .expect("the plugin may write its own node's lease status");
    let moved = json!({"status": {"node": "other-node"}});
    let refused = plugin_leases
        .patch_status("guarded", &PatchParams::default(), &Patch::Merge(&moved))
        .await
        .expect_err("the plugin may not move a lease to another node");
    let text = refused.to_string();
    assert!(
        text.contains(&format!("the device plugin of node {}", bed.node))
            && text.contains("only of leases admitted to that node"),
        "the refusal names the plugin's node and the rule: {text}"
    );
    let after = bed.lease("guarded").await.expect("lease");
    assert_eq!(
        after.status.and_then(|s| s.node).as_deref(),
        Some(bed.node.as_str()),
        "the refused write changed nothing"
    );
    bed.delete_pod("guarded").await;
    bed.wait_pod_gone("guarded", 60).await;
    nodes
        .delete("other-node", &DeleteParams::default())
        .await
        .expect("delete the other node");
}

async fn kubelet_restart(bed: &mut Bed) {
    bed.create_pod(workload("steady", 1, json!({}), PRINT_ENV_AND_WAIT))
        .await;
    let before = bed.wait_running("steady", 90).await;
    let lease_before = bed.wait_lease("steady", LeasePhase::Bound, 60).await;
    let plugin_before = bed.device_plugin_pod().await;

    let node = bed.node.clone();
    bed.cluster
        .node_mut(&node)
        .expect("the node")
        .restart_kubelet()
        .await
        .expect("kubelet restarts");
    let kubelet_log = bed.cluster.nodes()[0].logs().join("kubelet.log");
    // The plugin registers again with the new kubelet process, whose log
    // (appended to the old one's) says so.
    wait_for(
        "the plugin re-registered with the restarted kubelet",
        90,
        || async {
            let log = std::fs::read_to_string(&kubelet_log).ok()?;
            let restarted = log.rfind("Starting to serve the podresources API")?;
            log[restarted..]
                .contains("Got registration request from device plugin with resource")
                .then_some(())
        },
    )
    .await;
    bed.wait_allocatable("2", 90).await;

    let after = bed.pods().get("steady").await.expect("pod");
    assert_eq!(after.metadata.uid, before.metadata.uid, "the same pod");
    assert_eq!(pod_phase(&after), "Running");
    let restarts = |p: &Pod| -> i32 {
        p.status
            .as_ref()
            .and_then(|s| s.container_statuses.as_ref())
            .map(|cs| cs.iter().map(|c| c.restart_count).sum())
            .unwrap_or_default()
    };
    assert_eq!(restarts(&after), 0, "its container was not restarted");
    let lease_after = bed.lease("steady").await.expect("lease");
    assert_eq!(
        lease_after
            .status
            .as_ref()
            .map(|s| (s.phase, s.gpus.clone())),
        lease_before
            .status
            .as_ref()
            .map(|s| (s.phase, s.gpus.clone())),
        "its lease is untouched"
    );
    let plugin_after = bed.device_plugin_pod().await;
    assert_eq!(
        plugin_after.metadata.uid, plugin_before.metadata.uid,
        "the plugin pod itself was not replaced"
    );
    bed.delete_pod("steady").await;
    bed.wait_pod_gone("steady", 60).await;
}

async fn set_static_gpus(bed: &Bed, healthy: [bool; 2]) {
    let maps: Api<ConfigMap> = Api::namespaced(bed.client.clone(), SYSTEM_NS);
    let yaml = serde_yaml::to_string(&static_gpus(healthy)).expect("yaml");
    let patch = json!({"data": {"gpus.yaml": yaml}});
    maps.patch(
        "gpupool-device-plugin-static-gpus",
        &PatchParams::default(),
        &Patch::Merge(&patch),
    )
    .await
    .expect("static GPU ConfigMap patched");
}

/// The health the kubelet reports for the pod's devices, by device ID.
fn device_health(pod: &Pod) -> BTreeMap<String, String> {
    pod.status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .into_iter()
        .flatten()
        .flat_map(|c| c.allocated_resources_status.iter().flatten())
        .filter(|r| r.name == RESOURCE)
        .flat_map(|r| r.resources.iter().flatten())
        .map(|r| (r.resource_id.clone(), r.health.clone().unwrap_or_default()))
        .collect()
}

async fn gpu_health(bed: &Bed) {
    bed.create_pod(workload("both", 2, json!({}), PRINT_ENV_AND_WAIT))
        .await;
    bed.wait_running("both", 90).await;
    bed.wait_lease("both", LeasePhase::Bound, 60).await;

    set_static_gpus(bed, [true, false]).await;
    // The kubelet refreshes the ConfigMap volume (its sync period here is
    // 5 s); the plugin then reports the GPU Unhealthy over ListAndWatch.
    bed.wait_allocatable("1", 120).await;
    let unhealthy = wait_for(
        "the pod's allocatedResourcesStatus shows an Unhealthy device",
        90,
        || async {
            let pod = bed.pods().get("both").await.ok()?;
            let health = device_health(&pod);
            health.values().any(|h| h == "Unhealthy").then_some(health)
        },
    )
    .await;
    assert_eq!(
        unhealthy.values().filter(|h| *h == "Healthy").count(),
        1,
        "one device of the two stays Healthy: {unhealthy:?}"
    );

    set_static_gpus(bed, [true, true]).await;
    bed.wait_allocatable("2", 120).await;
    wait_for("the pod's devices Healthy again", 90, || async {
        let pod = bed.pods().get("both").await.ok()?;
        let health = device_health(&pod);
        (health.len() == 2 && health.values().all(|h| h == "Healthy")).then_some(())
    })
    .await;
    assert_eq!(
        pod_phase(&bed.pods().get("both").await.expect("pod")),
        "Running",
        "the pod kept running"
    );
    bed.delete_pod("both").await;
    bed.wait_pod_gone("both", 60).await;
}

/// The Warning Events on pod `name`: (reason, note).
async fn warnings(bed: &Bed, name: &str) -> Vec<(String, String)> {
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(bed.client.clone(), NS);
    events
        .list(&ListParams::default())
        .await
        .map(|l| l.items)
        .unwrap_or_default()
        .into_iter()
        .filter(|e| {
            e.type_.as_deref() == Some("Warning")
                && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name)
        })
        .map(|e| (e.reason.unwrap_or_default(), e.note.unwrap_or_default()))
        .collect()
}

/// A GPU turns unhealthy just as a 2-slot pod is admitted: the kubelet's
/// device manager knows at once, but the Node's allocatable follows only
/// at its next status update, so the operator admits the pod and the
/// kubelet refuses it (`UnexpectedAdmissionError`). The lease is Released
/// quoting the kubelet, and a Warning Event says the same. Should the
/// allocatable be current first (the pod then waits instead), the round
/// is tried again.
async fn kubelet_refusal(bed: &Bed) {
    for round in 1..=3 {
        set_static_gpus(bed, [true, false]).await;
        wait_for("the plugin reports GPU 1 unhealthy", 120, || async {
            (annotated_health(&bed.client, &bed.node, 1).await == Some(false)).then_some(())
        })
        .await;
        let pod: Pod =
            serde_json::from_value(workload("refused", 2, json!({}), PRINT_ENV_AND_WAIT))
                .expect("pod");
        let refused = match bed.pods().create(&PostParams::default(), &pod).await {
            // The webhook saw the current allocatable: too big for the node.
            Err(denied) => {
                eprintln!("round {round}: refused at creation: {denied}");
                false
            }
            Ok(pod) => {
                let uid = pod.metadata.uid.unwrap_or_default();
                wait_for(
                    "the kubelet refuses the pod, or it runs or waits",
                    90,
                    || async {
                        let pod = bed.pods().get_opt("refused").await.ok().flatten()?;
                        match pod_phase(&pod).as_str() {
                            "Failed" => Some(true),
                            "Running" => Some(false),
                            _ => {
                                // Waiting for a node big enough (this pod's lease,
                                // not an earlier round's).
                                let lease = bed.lease("refused").await?;
                                let status = lease.status?;
                                let waits = lease.spec.pod_uid == uid
                                    && status.phase == LeasePhase::Queued
                                    && status.message.is_some_and(|m| m.contains("largest"));
                                waits.then_some(false)
                            }
                        }
                    },
                )
                .await
            }
        };
        if refused {
            let lease = bed.wait_lease("refused", LeasePhase::Released, 60).await;
            let message = lease.status.and_then(|s| s.message).unwrap_or_default();
            assert!(
                message.starts_with("released: pod failed: UnexpectedAdmissionError"),
                "the lease quotes the kubelet: {message}"
            );
            let warned = wait_for("the operator's Warning Event on the pod", 60, || async {
                let w = warnings(bed, "refused").await;
                w.iter()
                    .any(|(reason, note)| {
                        reason == "Failed"
                            && note.starts_with("released: pod failed: UnexpectedAdmissionError")
                    })
                    .then_some(w)
            })
            .await;
            eprintln!("round {round}: refused; warnings {warned:?}");
        }
        bed.delete_pod("refused").await;
        bed.wait_pod_gone("refused", 60).await;
        set_static_gpus(bed, [true, true]).await;
        // The Node's allocatable may still say 2 from before the GPU
        // turned unhealthy: the plugin's word that it is healthy again is
        // what tells the kubelet.
        wait_for("the plugin reports GPU 1 healthy again", 120, || async {
            (annotated_health(&bed.client, &bed.node, 1).await == Some(true)).then_some(())
        })
        .await;
        bed.wait_allocatable("2", 120).await;
        if refused {
            return;
        }
        eprintln!("round {round}: the Node's allocatable was current before the pod came");
    }
    panic!("in three rounds the kubelet never saw the pod before its allocatable shrank");
}

async fn upgrade_and_uninstall(bed: &Bed) {
    bed.create_pod(workload("running", 2, json!({}), PRINT_ENV_AND_WAIT))
        .await;
    bed.wait_running("running", 90).await;
    bed.wait_lease("running", LeasePhase::Bound, 60).await;
    bed.create_pod(workload("queued", 1, json!({}), PRINT_ENV_AND_WAIT))
        .await;
    let queued = bed.wait_lease("queued", LeasePhase::Queued, 30).await;
    let sequence = queued.status.as_ref().and_then(|s| s.sequence);

    // A new log level changes the operator's pod template: a rollout.
    let values = values_file(&bed.dir, "debug");
    let out = bed.helm(&[
        "upgrade",
        RELEASE,
        "charts/gpupool",
        "--namespace",
        SYSTEM_NS,
        "--values",
        &values.to_string_lossy(),
        "--wait",
        "--timeout",
        "180s",
    ]);
    assert!(out.is_ok(), "helm upgrade: {out:?}");
    let running = bed.wait_lease("running", LeasePhase::Bound, 60).await;
    assert_eq!(
        running.status.map(|s| s.gpus.len()),
        Some(2),
        "the running pod keeps both GPUs"
    );
    let queued = bed.wait_lease("queued", LeasePhase::Queued, 60).await;
    assert_eq!(
        queued.status.as_ref().and_then(|s| s.sequence),
        sequence,
        "the queued pod keeps its place"
    );
    assert!(gated(&bed.pods().get("queued").await.expect("pod")));
    bed.delete_pod("running").await;
    bed.wait_running("queued", 120).await;
    bed.wait_lease("queued", LeasePhase::Bound, 60).await;

    let out = bed.helm(&[
        "uninstall",
        RELEASE,
        "--namespace",
        SYSTEM_NS,
        "--wait",
        "--timeout",
        "120s",
    ]);
    assert!(out.is_ok(), "helm uninstall: {out:?}");
    // What docs/operations.md says stays: the CRDs and every lease.
    assert!(
        bed.lease("queued").await.is_some(),
        "leases stay after uninstall"
    );
    let running_pod = bed
        .pods()
        .get("queued")
        .await
        .expect("the workload pod stays");
    assert_eq!(
        pod_phase(&running_pod),
        "Running",
        "a running workload keeps running"
    );
    let classes: Api<gpupool_api::GpuLeaseClass> = Api::all(bed.client.clone());
    wait_for("the chart's default class removed", 60, || async {
        classes
            .get_opt("default")
            .await
            .ok()?
            .is_none()
            .then_some(())
    })
    .await;
    let deployments: Api<Deployment> = Api::namespaced(bed.client.clone(), SYSTEM_NS);
    wait_for("the operator Deployment removed", 60, || async {
        deployments
            .get_opt("gpupool-operator")
            .await
            .ok()?
            .is_none()
            .then_some(())
    })
    .await;
}
