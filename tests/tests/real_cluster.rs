//! The operator's rules on a real Kubernetes control plane
//! (`Backend::Real`): FIFO admission, helpers on idle GPUs, a helper
//! preempted through the real Eviction API for a primary, the operator
//! killed with SIGKILL mid-queue, and the leader of two replicas killed
//! (leader election on the real coordination API). The operator and device plugins run with
//! tokens of their ServiceAccounts under exactly the chart's RBAC, so a verb
//! the chart lacks fails here.
//!
//! Needs `KUBEBUILDER_ASSETS` (`bash .ci/install-k8s.sh`) and the
//! workspace's binaries; without the variable it fails in CI, and is skipped elsewhere.

use std::time::Duration;

use gpupool_api::{GpuLease, GpuLeaseClass, LeasePhase, Role};
use gpupool_sim::cluster::workload::{phase, slot_pod, wait_for, wait_pod};
use gpupool_sim::cluster::{Backend, ClusterConfig, OperatorMode, SimCluster};
use k8s_openapi::api::core::v1::{Event, Pod};
use kube::api::{Api, DeleteParams, ListParams, PostParams};

const WAIT: Duration = Duration::from_secs(60);

async fn start(nodes: u32, gpus: u32) -> Option<SimCluster> {
    start_replicas(nodes, gpus, 1).await
}

async fn start_replicas(nodes: u32, gpus: u32, replicas: usize) -> Option<SimCluster> {
    let assets = gpupool_sim_apiserver::tool_check::kube_assets("the real-cluster suite")?;
    let cluster = SimCluster::start(ClusterConfig {
        backend: Backend::Real { assets },
        nodes,
        gpus_per_node: gpus,
        operator: OperatorMode::Required,
        operator_replicas: replicas,
        ready_timeout: Duration::from_secs(120),
        // GPUPOOL_KEEP_RUN=1 keeps the run directory (logs) of a failing start.
        remove_run_dir: std::env::var_os("GPUPOOL_KEEP_RUN").is_none(),
        ..Default::default()
    })
    .await
    .unwrap_or_else(|e| panic!("a cluster on the real control plane: {e}"));
    let classes: Api<GpuLeaseClass> = Api::all(cluster.client());
    let class: GpuLeaseClass = serde_json::from_value(serde_json::json!({
        "apiVersion": "gpupool.io/v1alpha1", "kind": "GpuLeaseClass",
        "metadata": {"name": "default"},
        "spec": {"default": true, "helpers": {"gracePeriodSeconds": 1}},
    }))
    .expect("class");
    classes
        .create(&PostParams::default(), &class)
        .await
        .expect("create class");
    Some(cluster)
}

async fn lease_phase(leases: &Api<GpuLease>, name: &str, want: LeasePhase) -> GpuLease {
    wait_for(
        WAIT,
        || async { leases.get_opt(name).await.ok().flatten() },
        |l: &GpuLease| l.status.as_ref().is_some_and(|s| s.phase == want),
    )
    .await
    .unwrap_or_else(|last| panic!("lease {name} never reached {want:?}: {last:?}"))
}

fn position(lease: &GpuLease) -> Option<u32> {
    lease.status.as_ref().and_then(|s| s.position)
}

async fn create(pods: &Api<Pod>, name: &str, slots: u32, role: Role) {
    pods.create(&PostParams::default(), &slot_pod(name, slots, role, None))
        .await
        .unwrap_or_else(|e| panic!("create {name}: {e}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifo_helpers_and_preemption_on_a_real_control_plane() {
    let Some(cluster) = start(1, 2).await else {
        return;
    };
    let client = cluster.client();
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let leases: Api<GpuLease> = Api::namespaced(client.clone(), "default");

    // Helpers use idle GPUs.
    create(&pods, "helper", 2, Role::Helper).await;
    lease_phase(&leases, "helper", LeasePhase::Bound).await;
    wait_pod(&pods, "helper", WAIT, |p| phase(p) == "Running")
        .await
        .expect("the helper runs");

    // A primary preempts it through the Eviction API, then runs.
    create(&pods, "first", 2, Role::Primary).await;
    let events: Api<Event> = Api::namespaced(client.clone(), "default");
    wait_for(
        WAIT,
        || async {
            events
                .list(&ListParams::default().fields("involvedObject.name=helper"))
                .await
                .ok()
        },
        |list| {
            list.items
                .iter()
                .any(|e| e.reason.as_deref() == Some("Preempted"))
        },
    )
    .await
    .unwrap_or_else(|last| panic!("no Preempted event for the helper: {last:?}"));
    let bound = lease_phase(&leases, "first", LeasePhase::Bound).await;
    assert_eq!(bound.status.and_then(|s| s.node).as_deref(), Some("node-1"));
    wait_pod(&pods, "first", WAIT, |p| phase(p) == "Running")
        .await
        .expect("the primary runs");

    // FIFO: two more primaries queue in order; a helper waits behind them.
    create(&pods, "second", 1, Role::Primary).await;
    create(&pods, "third", 1, Role::Primary).await;
    create(&pods, "late-helper", 1, Role::Helper).await;
    let second = lease_phase(&leases, "second", LeasePhase::Queued).await;
    let third = lease_phase(&leases, "third", LeasePhase::Queued).await;
    assert_eq!((position(&second), position(&third)), (Some(1), Some(2)));
    lease_phase(&leases, "late-helper", LeasePhase::Queued).await;

    // The GPUs free up: both primaries run, in order, before the helper.
    pods.delete("first", &DeleteParams::default())
        .await
        .expect("delete first");
    lease_phase(&leases, "second", LeasePhase::Bound).await;
    lease_phase(&leases, "third", LeasePhase::Bound).await;
    let helper = leases.get("late-helper").await.expect("late helper lease");
    assert_eq!(
        helper.status.map(|s| s.phase),
        Some(LeasePhase::Queued),
        "no GPU is idle for the helper"
    );
    cluster.shutdown().await.expect("cluster stops");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_queue_survives_a_sigkill_of_the_operator_on_a_real_control_plane() {
    let Some(mut cluster) = start(1, 1).await else {
        return;
    };
    let client = cluster.client();
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let leases: Api<GpuLease> = Api::namespaced(client.clone(), "default");
    create(&pods, "running", 1, Role::Primary).await;
    lease_phase(&leases, "running", LeasePhase::Bound).await;
    create(&pods, "waiting", 1, Role::Primary).await;
    lease_phase(&leases, "waiting", LeasePhase::Queued).await;

    cluster.kill_operator().await.expect("SIGKILL the operator");
    assert!(!cluster.operator_running());
    // While it is down the GPU frees up; nothing admits yet.
    pods.delete("running", &DeleteParams::default())
        .await
        .expect("delete running");
    cluster
        .start_operator()
        .await
        .expect("the operator restarts");
    let lease = lease_phase(&leases, "waiting", LeasePhase::Bound).await;
    assert!(lease.status.is_some_and(|s| !s.gpus.is_empty()));
    wait_pod(&pods, "waiting", WAIT, |p| phase(p) == "Running")
        .await
        .expect("the queued pod runs after the restart");
    cluster.shutdown().await.expect("cluster stops");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_other_replica_takes_over_when_the_leader_is_killed_on_a_real_control_plane() {
    let Some(mut cluster) = start_replicas(1, 1, 2).await else {
        return;
    };
    let client = cluster.client();
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let leases: Api<GpuLease> = Api::namespaced(client.clone(), "default");
    create(&pods, "running", 1, Role::Primary).await;
    lease_phase(&leases, "running", LeasePhase::Bound).await;
    create(&pods, "waiting", 1, Role::Primary).await;
    lease_phase(&leases, "waiting", LeasePhase::Queued).await;
    let leader = cluster
        .operator_leader()
        .await
        .expect("read the election Lease")
        .expect("one replica leads");

    cluster
        .kill_operator_replica(leader)
        .await
        .expect("SIGKILL the leader");
    pods.delete("running", &DeleteParams::default())
        .await
        .expect("delete running");
    // The survivor takes the Lease once it expires (15 s) and admits.
    let lease = lease_phase(&leases, "waiting", LeasePhase::Bound).await;
    assert!(lease.status.is_some_and(|s| !s.gpus.is_empty()));
    let new_leader = cluster
        .operator_leader()
        .await
        .expect("read the election Lease");
    assert_eq!(new_leader, Some(1 - leader), "the other replica leads");
    cluster.shutdown().await.expect("cluster stops");
}
