//! The simulated cluster with the real operator: a pod that asks for a slot
//! is gated, leased, admitted and bound; the operator survives being killed
//! and restarted through the cluster's controls.
//!
//! Needs the workspace's binaries: `cargo build --workspace --bins`.

use std::time::Duration;

use gpupool_api::{GpuLease, GpuLeaseClass, GpuLeaseClassSpec, LeasePhase, Role};
use gpupool_sim::cluster::workload::{phase, slot_pod, wait_for, wait_pod};
use gpupool_sim::cluster::{ClusterConfig, OperatorMode, SimCluster};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};

const WAIT: Duration = Duration::from_secs(30);

async fn bound_lease(leases: &Api<GpuLease>, name: &str) -> GpuLease {
    wait_for(
        WAIT,
        || async { leases.get_opt(name).await.ok().flatten() },
        |l: &GpuLease| {
            l.status
                .as_ref()
                .is_some_and(|s| s.phase == LeasePhase::Bound && !s.gpus.is_empty())
        },
    )
    .await
    .unwrap_or_else(|last| panic!("lease {name} never became Bound with GPUs: {last:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_are_leased_admitted_and_bound_across_an_operator_restart() {
    let config = ClusterConfig {
        nodes: 1,
        gpus_per_node: 2,
        operator: OperatorMode::Required,
        ..Default::default()
    };
    let mut cluster = SimCluster::start(config)
        .await
        .unwrap_or_else(|e| panic!("cluster with the operator: {e}"));
    assert_eq!(cluster.operator_note(), None);
    assert!(cluster.operator_running());
    let client = cluster.client();
    let classes: Api<GpuLeaseClass> = Api::all(client.clone());
    let class = GpuLeaseClass::new(
        "default",
        GpuLeaseClassSpec {
            default: true,
            ..Default::default()
        },
    );
    classes
        .create(&PostParams::default(), &class)
        .await
        .expect("create class");
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let leases: Api<GpuLease> = Api::namespaced(client.clone(), "default");

    let created = pods
        .create(
            &PostParams::default(),
            &slot_pod("first", 1, Role::Primary, None),
        )
        .await
        .expect("create first");
    let gates = created
        .spec
        .as_ref()
        .and_then(|s| s.scheduling_gates.clone())
        .unwrap_or_default();
    assert!(
        gates.iter().any(|g| g.name == "gpupool.io/admission"),
        "the operator's webhook gates the pod: {gates:?}"
    );
    wait_pod(&pods, "first", WAIT, |p| phase(p) == "Running")
        .await
        .expect("first runs");
    let lease = bound_lease(&leases, "first").await;
    assert_eq!(lease.status.and_then(|s| s.node).as_deref(), Some("node-1"));

    cluster.kill_operator().await.expect("kill operator");
    assert!(!cluster.operator_running());
    assert!(cluster.operator_note().is_some());
    cluster.start_operator().await.expect("restart operator");
    assert!(cluster.operator_running());

    pods.create(
        &PostParams::default(),
        &slot_pod("second", 1, Role::Primary, None),
    )
    .await
    .expect("create second");
    wait_pod(&pods, "second", WAIT, |p| phase(p) == "Running")
        .await
        .expect("second runs after the restart");
    let second = bound_lease(&leases, "second").await;
    let first = bound_lease(&leases, "first").await;
    let gpu = |l: &GpuLease| l.status.as_ref().map(|s| s.gpus[0].index);
    assert_ne!(gpu(&first), gpu(&second), "one session per GPU");
    cluster.shutdown().await.expect("clean shutdown");
}
