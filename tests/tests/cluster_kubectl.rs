//! `kubectl` against the simulated cluster: nodes and pods as the real
//! kubelet and scheduler would leave them. Fails in CI, and is skipped elsewhere, when kubectl
//! is not installed.
//!
//! Needs the workspace's binaries: `cargo build --workspace --bins`.

use std::process::Command;
use std::time::Duration;

use gpupool_api::Role;
use gpupool_sim::cluster::workload::{phase, slot_pod, wait_pod};
use gpupool_sim::cluster::{ClusterConfig, OperatorMode, SimCluster};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};

fn kubectl(cluster: &SimCluster, cache: &std::path::Path, args: &[&str]) -> String {
    let output = Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(cluster.kubeconfig())
        .arg("--cache-dir")
        .arg(cache)
        .args(args)
        .output()
        .expect("kubectl runs");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "kubectl {args:?} failed: {}\n{stdout}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_gets_nodes_and_pods_wide() {
    if !gpupool_sim_apiserver::tool_check::runs(
        "kubectl_gets_nodes_and_pods_wide",
        "kubectl",
        &["version", "--client"],
    ) {
        return;
    }
    let config = ClusterConfig {
        nodes: 2,
        gpus_per_node: 1,
        operator: OperatorMode::Off,
        ..Default::default()
    };
    let cluster = SimCluster::start(config)
        .await
        .unwrap_or_else(|e| panic!("cluster: {e}"));
    let pods: Api<Pod> = Api::namespaced(cluster.client(), "default");
    pods.create(
        &PostParams::default(),
        &slot_pod("trainer", 1, Role::Primary, None),
    )
    .await
    .expect("create pod");
    let running = wait_pod(&pods, "trainer", Duration::from_secs(20), |p| {
        phase(p) == "Running"
    })
    .await
    .expect("pod runs");
    let node = running.spec.and_then(|s| s.node_name).expect("bound");
    let cache = tempfile::tempdir().expect("cache dir");

    let nodes = kubectl(&cluster, cache.path(), &["get", "nodes"]);
    let lines: Vec<&str> = nodes.lines().collect();
    assert!(lines[0].starts_with("NAME"), "{nodes}");
    for name in ["node-1", "node-2"] {
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with(name) && l.contains("Ready")),
            "{name} Ready in:\n{nodes}"
        );
    }
    let slots = kubectl(
        &cluster,
        cache.path(),
        &[
            "get",
            "node",
            "node-1",
            "-o",
            "jsonpath={.status.allocatable.gpupool/slot}",
        ],
    );
    assert_eq!(slots.trim(), "1", "allocatable slots via kubectl");

    let wide = kubectl(&cluster, cache.path(), &["get", "pods", "-o", "wide"]);
    let header = wide.lines().next().unwrap_or_default();
    for col in ["NAME", "READY", "STATUS", "IP", "NODE"] {
        assert!(header.contains(col), "{col} in {header:?}");
    }
    let row = wide
        .lines()
        .find(|l| l.starts_with("trainer"))
        .unwrap_or_else(|| panic!("trainer row in:\n{wide}"));
    assert!(
        row.contains("Running") && row.contains(&node) && row.contains("1/1"),
        "{row}"
    );
    cluster.shutdown().await.expect("clean shutdown");
}
