//! A lease deleted while the operator is down (issue #43, row 8): the
//! operator creates it again for the pod that is still running, and the
//! device plugin, which watches the leases admitted to its node, writes the
//! pod's GPUs into the new lease within a report round, not when its
//! periodic re-check comes round minutes later. Runs the real operator and
//! device plugins on the backend `GPUPOOL_E2E_BACKEND` names (the
//! simulator unless it says `real`), and checks what a user sees through
//! the API.

mod operator_support;

use std::time::{Duration, Instant};

use gpupool_api::names::FIELD_LEASE_NODE;
use gpupool_api::{GpuLease, LeasePhase};
use kube::api::{DeleteParams, ListParams};
use kube::{Api, ResourceExt};
use operator_support::{NS, PodSpec, Sim, wait_for};
use serde_json::json;

/// What the device plugin writes into a lease.
fn reported(lease: &GpuLease) -> (Vec<(u32, String)>, Option<String>, bool) {
    let status = lease.status.clone().unwrap_or_default();
    (
        status
            .gpus
            .iter()
            .map(|g| (g.index, g.uuid.clone()))
            .collect(),
        status.gpu_indexes,
        status.bound_at.is_some(),
    )
}

/// The lines of node `node`'s device plugin log about its lease watch, to
/// explain a lease that stays without GPUs (none on real nodes, whose
/// plugins run as pods).
fn plugin_watch_log(sim: &Sim, node: &str) -> String {
    let path = sim
        .cluster
        .run_dir()
        .join("logs")
        .join(format!("device-plugin-{node}.log"));
    std::fs::read_to_string(&path)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("GpuLease"))
        .collect::<Vec<_>>()
        .join("\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_deleted_while_the_operator_is_down_gets_the_running_pods_gpus_again() {
    let mut sim = Sim::start(1, 2).await;
    sim.class("default", json!({"default": true})).await;
    sim.pod(PodSpec::primary("train", 2)).await;
    let node = sim.wait_admitted("train", 60).await;
    let first = sim.wait_phase("train", LeasePhase::Bound, 60).await;
    let (gpus, indexes, bound) = reported(&first);
    assert_eq!(gpus.len(), 2, "the pod holds both GPUs: {first:?}");
    assert!(indexes.is_some() && bound, "{first:?}");
    let first_uid = first.uid().expect("a stored lease has a UID");

    // The operator goes down, and the lease with it.
    sim.cluster
        .kill_operator()
        .await
        .expect("the operator is killed");
    let leases: Api<GpuLease> = Api::namespaced(sim.client.clone(), NS);
    leases
        .delete("train", &DeleteParams::default())
        .await
        .expect("the lease is deleted");
    wait_for("the lease to be gone", 30, || async {
        sim.lease("train").await.is_none().then_some(())
    })
    .await;

    // Back up, the operator creates it again for the running pod, and the
    // device plugin fills in the same GPUs. Polled with a deadline well
    // short of the plugin's 300 s re-check of leases it has reported.
    sim.cluster
        .start_operator()
        .await
        .expect("the operator starts again");
    let deadline = Instant::now() + Duration::from_secs(60);
    let again = loop {
        let lease = sim.lease("train").await;
        if let Some(lease) = &lease
            && lease.uid().as_deref() != Some(first_uid.as_str())
            && reported(lease) == (gpus.clone(), indexes.clone(), true)
        {
            break lease.clone();
        }
        assert!(
            Instant::now() < deadline,
            "the re-created lease did not get the pod's GPUs {gpus:?} within 60 s; it is {lease:?}; the device plugin's log says:\n{}",
            plugin_watch_log(&sim, &node)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(
        again.status.as_ref().and_then(|s| s.node.as_deref()),
        Some(node.as_str()),
        "re-created on the pod's node"
    );
    sim.wait_phase("train", LeasePhase::Bound, 60).await;
    let row = sim.lease_row("train").await;
    assert_eq!(
        row.get("GPU"),
        Some(&json!(indexes.clone().unwrap_or_default())),
        "the GPU column shows them: {row:?}"
    );

    // The selection the device plugin watches by, as the API server
    // serves it: the node's leases by status.node, and no other field.
    let on_node = leases
        .list(&ListParams::default().fields(&format!("{FIELD_LEASE_NODE}={node}")))
        .await
        .expect("leases selected by status.node");
    assert_eq!(
        on_node
            .items
            .iter()
            .map(ResourceExt::name_any)
            .collect::<Vec<_>>(),
        ["train"]
    );
    let elsewhere = leases
        .list(&ListParams::default().fields(&format!("{FIELD_LEASE_NODE}=no-such-node")))
        .await
        .expect("leases selected by status.node");
    assert!(elsewhere.items.is_empty(), "{:?}", elsewhere.items);
    match leases
        .list(&ListParams::default().fields("status.phase=Bound"))
        .await
    {
        Err(kube::Error::Api(status)) => assert_eq!(
            (status.code, status.reason.as_str(), status.message.as_str()),
            (400, "BadRequest", "field label not supported: status.phase"),
        ),
        other => panic!("status.phase is no selectable field of GpuLease: {other:?}"),
    }
    sim.stop().await;
}
