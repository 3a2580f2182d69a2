//! Ordinary cluster life (issue rows of "when Kubernetes does not go to
//! plan"): pods another controller still holds back, admitted pods the
//! scheduler cannot place, a default class deleted and created again,
//! cordoned nodes, and a lease lost while the operator was down. Each runs
//! the real operator and device plugins, on the backend
//! `GPUPOOL_E2E_BACKEND` names (the simulator unless it says `real`), and
//! checks what a user sees through the API: leases, pod gates, Events.

mod operator_support;

use gpupool_api::{GpuLease, GpuLeaseClass, LeasePhase};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Api;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use operator_support::{NS, PodSpec, Sim, annotated_health, gated, wait_for};
use serde_json::json;

/// The lease's message, or "" before it has one.
async fn message(sim: &Sim, name: &str) -> String {
    sim.lease(name)
        .await
        .and_then(|l| l.status?.message)
        .unwrap_or_default()
}

async fn sequence(sim: &Sim, name: &str) -> Option<u64> {
    sim.lease(name).await.and_then(|l| l.status?.sequence)
}

async fn position(sim: &Sim, name: &str) -> Option<u32> {
    sim.lease(name).await.and_then(|l| l.status?.position)
}

async fn create(sim: &Sim, pod: Pod) {
    let pods: Api<Pod> = Api::namespaced(sim.client.clone(), NS);
    pods.create(&PostParams::default(), &pod)
        .await
        .expect("create pod");
}

/// A pod that still carries another controller's scheduling gate takes no
/// slot and holds no one up, even under StrictFIFO; once that gate is
/// removed it is admitted in its place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_held_by_another_gate_takes_no_slot_and_blocks_no_one() {
    let sim = Sim::start(1, 1).await;
    sim.class("default", json!({"default": true})).await;
    let mut held = PodSpec::primary("held", 1).build();
    held.spec
        .as_mut()
        .expect("spec")
        .scheduling_gates
        .get_or_insert_with(Vec::new)
        .push(serde_json::from_value(json!({"name": "example.com/quota"})).expect("gate"));
    create(&sim, held).await;
    wait_for(
        "the held pod's lease to name the other gate",
        30,
        || async {
            message(&sim, "held")
                .await
                .contains("scheduling gate example.com/quota")
                .then_some(())
        },
    )
    .await;
    sim.pod(PodSpec::primary("next", 1)).await;
    sim.wait_admitted("next", 30).await;
    let held_pod = sim.get_pod("held").await.expect("held pod");
    assert!(gated(&held_pod), "the held pod is not admitted");
    assert_eq!(position(&sim, "held").await, Some(1), "it keeps its place");

    // The other controller lets it go: it is admitted once the slot is free.
    let pods: Api<Pod> = Api::namespaced(sim.client.clone(), NS);
    let gates = json!({"spec": {"schedulingGates": [{"name": "gpupool.io/admission"}]}});
    pods.patch("held", &PatchParams::default(), &Patch::Merge(&gates))
        .await
        .expect("the other controller removes its gate");
    sim.delete_pod("next").await;
    sim.wait_admitted("held", 60).await;
    sim.stop().await;
}

/// An admitted pod the scheduler cannot place (it asks for far more CPU
/// than its node has) gives its slots back after the class's
/// `placementTimeoutSeconds`: it is deleted, its lease is Released, a
/// Warning Event quotes the scheduler, and the pod behind it runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admitted_pod_the_scheduler_cannot_place_gives_its_slots_back() {
    let sim = Sim::start(1, 2).await;
    sim.class(
        "default",
        json!({"default": true, "admission": {"placementTimeoutSeconds": 5}}),
    )
    .await;
    let mut big = PodSpec::primary("too-big", 2).build();
    let container = &mut big.spec.as_mut().expect("spec").containers[0];
    let resources = container.resources.get_or_insert_with(Default::default);
    resources
        .requests
        .get_or_insert_with(Default::default)
        .insert(
            "cpu".into(),
            k8s_openapi::apimachinery::pkg::api::resource::Quantity("1000".into()),
        );
    create(&sim, big).await;
    sim.wait_admitted("too-big", 30).await;
    sim.pod(PodSpec::primary("behind", 1)).await;
    let waiting = wait_for(
        "the lease to say the scheduler cannot place it",
        30,
        || async {
            let m = message(&sim, "too-big").await;
            m.contains("the scheduler cannot place it").then_some(m)
        },
    )
    .await;
    assert!(waiting.contains("Insufficient cpu"), "{waiting}");
    // The pod is deleted; its lease goes with it (the garbage collector
    // follows the owner), so the Event is what stays to tell why.
    wait_for("the unplaceable pod to be deleted", 60, || async {
        sim.get_pod("too-big").await.is_none().then_some(())
    })
    .await;
    if let Some(lease) = sim.lease("too-big").await {
        assert_eq!(lease.status.map(|s| s.phase), Some(LeasePhase::Released));
    }
    let events = sim.events("too-big").await;
    assert!(
        events.iter().any(|(reason, note)| reason == "Unplaceable"
            && note.contains("could not place the pod on node node-1 for 5s")
            && note.contains("Insufficient cpu")),
        "{events:?}"
    );
    sim.wait_admitted("behind", 30).await;
    sim.wait_phase("behind", LeasePhase::Bound, 60).await;
    sim.stop().await;
}

/// Deleting the default class leaves running pods alone and turns the
/// queued ones Rejected, saying so; created again, the class gets them
/// back in their original order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_class_deleted_and_created_again_keeps_its_queue() {
    let sim = Sim::start(1, 1).await;
    sim.class("default", json!({"default": true})).await;
    sim.pod(PodSpec::primary("running", 1)).await;
    sim.wait_phase("running", LeasePhase::Bound, 60).await;
    for name in ["first", "second"] {
        sim.pod(PodSpec::primary(name, 1)).await;
        wait_for("a sequence", 30, || sequence(&sim, name)).await;
    }
    let before = (
        sequence(&sim, "first").await,
        sequence(&sim, "second").await,
    );

    let classes: Api<GpuLeaseClass> = Api::all(sim.client.clone());
    classes
        .delete("default", &DeleteParams::default())
        .await
        .expect("delete the default class");
    for name in ["first", "second"] {
        let lease = sim.wait_phase(name, LeasePhase::Rejected, 30).await;
        let text = lease.status.and_then(|s| s.message).unwrap_or_default();
        assert!(
            text.contains("GpuLeaseClass default does not exist"),
            "{text}"
        );
    }
    let running = sim.lease("running").await.expect("the running pod's lease");
    assert_eq!(
        running.status.map(|s| s.phase),
        Some(LeasePhase::Bound),
        "nothing running is released"
    );

    sim.class("default", json!({"default": true})).await;
    wait_for("the queue back in its order", 30, || async {
        (position(&sim, "first").await == Some(1) && position(&sim, "second").await == Some(2))
            .then_some(())
    })
    .await;
    assert_eq!(
        (
            sequence(&sim, "first").await,
            sequence(&sim, "second").await
        ),
        before
    );
    sim.delete_pod("running").await;
    sim.wait_admitted("first", 60).await;
    assert!(gated(&sim.get_pod("second").await.expect("second")));
    sim.stop().await;
}

/// Cordons `node` (or lifts the cordon), as `kubectl cordon` does.
async fn cordon(sim: &Sim, node: &str, on: bool) {
    let nodes: Api<Node> = Api::all(sim.client.clone());
    nodes
        .patch(
            node,
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": {"unschedulable": on}})),
        )
        .await
        .expect("cordon");
}

/// A waiting lease names the cordon that keeps its pod off the class's node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_lease_names_the_cordon() {
    let sim = Sim::start(1, 1).await;
    sim.class("default", json!({"default": true})).await;
    let node = sim.cluster.node_names()[0].clone();
    cordon(&sim, &node, true).await;
    sim.pod(PodSpec::primary("p", 1)).await;
    let text = wait_for("the lease to name the cordon", 30, || async {
        let m = message(&sim, "p").await;
        m.contains("1 node cordoned").then_some(m)
    })
    .await;
    assert!(
        text.starts_with("waiting: no node of class default is open to the pod"),
        "{text}"
    );
    cordon(&sim, &node, false).await;
    sim.wait_admitted("p", 30).await;
    sim.stop().await;
}

/// A queued pod's lease deleted while the operator is down comes back, once
/// it runs again, with its stamp's place: ahead of the pods stamped after
/// it, not behind them (DESIGN §5.2).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_lost_while_the_operator_is_down_comes_back_in_its_place() {
    let mut sim = Sim::start(1, 1).await;
    sim.class("default", json!({"default": true})).await;
    sim.pod(PodSpec::primary("running", 1)).await;
    sim.wait_phase("running", LeasePhase::Bound, 60).await;
    for name in ["first", "second", "third"] {
        sim.pod(PodSpec::primary(name, 1)).await;
        wait_for("a sequence", 30, || sequence(&sim, name)).await;
    }
    wait_for("first at the head", 30, || async {
        (position(&sim, "first").await == Some(1)).then_some(())
    })
    .await;
    let before = sequence(&sim, "first").await;

    sim.cluster
        .kill_operator()
        .await
        .expect("stop the operator");
    let leases: Api<GpuLease> = Api::namespaced(sim.client.clone(), NS);
    leases
        .delete("first", &DeleteParams::default())
        .await
        .expect("delete first's lease");
    wait_for("the lease gone", 30, || async {
        sim.lease("first").await.is_none().then_some(())
    })
    .await;
    sim.cluster
        .start_operator()
        .await
        .expect("start the operator");

    wait_for("first's lease made again", 60, || sequence(&sim, "first")).await;
    assert_eq!(
        sequence(&sim, "first").await,
        before,
        "the stamp gives the lease its old number"
    );
    wait_for("the queue in its order", 30, || async {
        (position(&sim, "first").await == Some(1)
            && position(&sim, "second").await == Some(2)
            && position(&sim, "third").await == Some(3))
        .then_some(())
    })
    .await;
    sim.delete_pod("running").await;
    sim.wait_admitted("first", 60).await;
    assert!(gated(&sim.get_pod("second").await.expect("second")));
    sim.stop().await;
}

/// A GPU turns unhealthy just as a 2-slot pod comes: the kubelet's device
/// manager knows at once, the Node's allocatable only at its next status
/// update, so the pod is admitted on the stale figure and the kubelet
/// refuses it. Its lease is Released quoting the kubelet, and a Warning
/// Event says the same. A round in which the allocatable was current
/// first (the webhook then refuses the pod, or it waits) is tried again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_the_kubelet_refuses_has_its_lease_and_an_event_say_why() {
    let mut sim = Sim::start(1, 2).await;
    sim.class("default", json!({"default": true})).await;
    let node = "node-1";
    for round in 1..=3 {
        sim.cluster
            .set_gpu_health(node, 1, false)
            .expect("GPU 1 unhealthy");
        wait_for("the plugin reports GPU 1 unhealthy", 60, || async {
            (annotated_health(&sim.client, node, 1).await == Some(false)).then_some(())
        })
        .await;
        let refused = match sim.try_pod(PodSpec::primary("refused", 2)).await {
            Err(denied) => {
                eprintln!("round {round}: the webhook saw the current allocatable: {denied}");
                false
            }
            Ok(pod) => {
                let uid = pod.metadata.uid.unwrap_or_default();
                // Refused (Released), running (Bound), or waiting for a
                // node big enough: this pod's lease, not an earlier round's.
                let lease = wait_for("the pod refused, running or waiting", 60, || async {
                    let lease = sim
                        .lease("refused")
                        .await
                        .filter(|l| l.spec.pod_uid == uid)?;
                    let status = lease.status.as_ref()?;
                    let waits = status.phase == LeasePhase::Queued
                        && status
                            .message
                            .as_deref()
                            .is_some_and(|m| m.contains("largest"));
                    (waits || matches!(status.phase, LeasePhase::Released | LeasePhase::Bound))
                        .then_some(lease)
                })
                .await;
                let status = lease.status.expect("status");
                if status.phase == LeasePhase::Released {
                    let message = status.message.unwrap_or_default();
                    assert!(
                        message.starts_with("released: pod failed: UnexpectedAdmissionError"),
                        "the lease quotes the kubelet: {message}"
                    );
                    wait_for("the operator's Warning Event", 30, || async {
                        sim.events("refused")
                            .await
                            .iter()
                            .any(|(reason, note)| {
                                reason == "Failed"
                                    && note.starts_with(
                                        "released: pod failed: UnexpectedAdmissionError",
                                    )
                            })
                            .then_some(())
                    })
                    .await;
                }
                sim.delete_pod("refused").await;
                status.phase == LeasePhase::Released
            }
        };
        if refused {
            sim.stop().await;
            return;
        }
        sim.cluster
            .set_gpu_health(node, 1, true)
            .expect("GPU 1 healthy");
        wait_for("the pod gone and GPU 1 healthy", 60, || async {
            let gone = sim.get_pod("refused").await.is_none();
            (gone && annotated_health(&sim.client, node, 1).await == Some(true)).then_some(())
        })
        .await;
    }
    panic!("in three rounds the kubelet never saw the pod before its allocatable shrank");
}

/// A pod that names its class but asks for a resource one letter off the
/// class's (`gpupool/slots` for `gpupool/slot`) would wait for ever without
/// a lease: the webhook refuses it, naming both resources.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_near_miss_of_the_class_resource_is_refused_naming_both() {
    let sim = Sim::start(1, 1).await;
    sim.class("default", json!({"default": true})).await;
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": "typo", "namespace": NS,
                     "labels": {"gpupool.io/class": "default"}},
        "spec": {"containers": [{"name": "work", "image": "busybox",
            "resources": {"limits": {"gpupool/slots": "1"}}}]}
    }))
    .expect("pod");
    let pods: Api<Pod> = Api::namespaced(sim.client.clone(), NS);
    let denied = pods
        .create(&PostParams::default(), &pod)
        .await
        .expect_err("the webhook refuses the near miss")
        .to_string();
    assert!(
        denied.contains("gpupool/slots") && denied.contains("did you mean gpupool/slot?"),
        "{denied}"
    );
    assert!(
        sim.lease("typo").await.is_none(),
        "no lease for a refused pod"
    );
    sim.stop().await;
}
