//! A hostile tenant and a careless admin against a simulated cluster running
//! the real operator and device-plugin binaries: none of what a user can
//! write (labels, leases, classes, webhook configurations) reorders a queue,
//! double-books a GPU or loses a lease.

mod operator_support;

use std::path::Path;
use std::time::{Duration, Instant};

use gpupool_api::{GpuLease, GpuLeaseClass, LeasePhase};
use gpupool_sim::cluster::workload::wait_until_webhook_knows_class;
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use operator_support::{NS, PodSpec, Sim, gated, wait_for};
use serde_json::json;

/// A client that speaks as the device plugin of `node`, with the kubeconfig
/// the simulator wrote for it (its token is bound to that node).
async fn device_plugin_client(sim: &Sim, node: &str) -> Client {
    let path = sim
        .cluster
        .run_dir()
        .join(format!("device-plugin-{node}.kubeconfig"));
    client_from(&path).await
}

async fn client_from(path: &Path) -> Client {
    let kubeconfig = kube::config::Kubeconfig::read_from(path).expect("kubeconfig");
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .expect("client config");
    Client::try_from(config).expect("client")
}

fn leases(client: &Client) -> Api<GpuLease> {
    Api::namespaced(client.clone(), NS)
}

fn merge(v: serde_json::Value) -> Patch<serde_json::Value> {
    Patch::Merge(v)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn helpers_of_another_class_are_evicted_for_a_waiting_primary() {
    let sim = Sim::start(2, 2).await;
    sim.class("default", json!({"default": true})).await;
    sim.class("alt", json!({})).await;
    // node-1 holds a primary; the alt helpers fill what is left.
    sim.pod(PodSpec::primary("running", 1)).await;
    assert_eq!(sim.wait_admitted("running", 20).await, "node-1");
    for h in ["h1", "h2", "h3"] {
        sim.pod(PodSpec::helper(h, 1).class("alt")).await;
        sim.wait_admitted(h, 20).await;
    }
    // A default-class primary wanting a whole node: the helpers' class is
    // no shield, the youngest helpers on one node make room.
    sim.pod(PodSpec::primary("big", 2)).await;
    let node = sim.wait_admitted("big", 40).await;
    assert_eq!(node, "node-2");
    // h1 went to node-1 (Pack: the fullest node that fits); h2 and h3, the
    // youngest on node-2, were evicted for big.
    let gone = |p: Option<Pod>| p.is_none_or(|p| p.metadata.deletion_timestamp.is_some());
    assert!(!gone(sim.get_pod("h1").await), "h1 was not in the way");
    assert!(gone(sim.get_pod("h2").await) && gone(sim.get_pod("h3").await));
    let events = sim.events("h3").await;
    assert!(
        events
            .iter()
            .any(|(reason, note)| reason == "Preempted" && note.contains("ml/big")),
        "{events:?}"
    );
    // While a default primary waits for node-2 again, a new alt helper does
    // not take a slot it could use.
    sim.pod(PodSpec::primary("big-2", 2)).await;
    sim.pod(PodSpec::helper("h4", 1).class("alt")).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let h4 = sim.get_pod("h4").await.expect("h4");
    let h4_node = operator_support::pinned_node(&h4);
    assert!(
        gated(&h4) || h4_node.as_deref() == Some("node-1"),
        "h4 must not take node-2 from big-2 (pinned to {h4_node:?})"
    );
    sim.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_cannot_be_forged_and_the_pod_stays_the_source_of_truth() {
    let sim = Sim::start(1, 2).await;
    sim.class("default", json!({"default": true})).await;
    sim.pod(PodSpec::primary("big", 2)).await;
    sim.wait_admitted("big", 20).await;
    sim.pod(PodSpec::primary("next", 1)).await;
    sim.wait_phase("next", LeasePhase::Queued, 20).await;
    let admin = leases(&sim.client);
    let pp = PatchParams::default();
    // The admin is not the operator: spec and sequence are refused.
    let err = admin
        .patch(
            "big",
            &pp,
            &merge(json!({"spec": {"slots": 1, "role": "helper"}})),
        )
        .await
        .expect_err("spec is the operator's");
    assert!(err.to_string().contains("may not change spec"), "{err}");
    let err = admin
        .patch_status("next", &pp, &merge(json!({"status": {"sequence": 0}})))
        .await
        .expect_err("the sequence is the operator's");
    assert!(
        err.to_string().contains("may not change status.sequence"),
        "{err}"
    );
    let err = admin
        .patch_status(
            "next",
            &pp,
            &merge(json!({"status": {"phase": "Released"}})),
        )
        .await
        .expect_err("the phase is the operator's");
    assert!(err.to_string().contains("status.phase"), "{err}");
    // A tenant cannot create a lease for a pod to jump the queue either.
    let forged: GpuLease = serde_json::from_value(json!({
        "apiVersion": "gpupool.io/v1alpha1", "kind": "GpuLease",
        "metadata": {"name": "forged", "namespace": NS},
        "spec": {"className": "default", "podName": "forged", "podUID": "x", "role": "primary", "slots": 1}
    }))
    .expect("lease");
    let err = admin
        .create(&PostParams::default(), &forged)
        .await
        .expect_err("leases are created by the operator");
    assert!(
        err.to_string().contains("may not create GpuLeases"),
        "{err}"
    );

    // A device plugin records GPUs only on leases of its own node.
    let own = leases(&device_plugin_client(&sim, "node-1").await);
    let gpus = json!({"status": {"gpus": [{"index": 1, "uuid": "GPU-sim-0001-0001"}]}});
    own.patch_status("big", &pp, &merge(gpus.clone()))
        .await
        .expect("the plugin of node-1 writes GPUs of a node-1 lease");
    let err = own
        .patch_status("big", &pp, &merge(json!({"status": {"node": "node-9"}})))
        .await
        .expect_err("a plugin writes nothing but GPUs");
    assert!(err.to_string().contains("status.node"), "{err}");
    // The queued lease has no node: no plugin may write it.
    let err = own
        .patch_status("next", &pp, &merge(gpus))
        .await
        .expect_err("not a lease of node-1");
    assert!(err.to_string().contains("from node node-1"), "{err}");

    // Still one pod on the node's two slots, and next still waits.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(gated(&sim.get_pod("next").await.expect("next")));
    let big = sim.lease("big").await.expect("big");
    assert_eq!(
        (big.spec.slots, big.spec.role),
        (2, gpupool_api::Role::Primary)
    );
    sim.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_labels_and_the_node_are_fixed_at_creation() {
    let sim = Sim::start(1, 1).await;
    sim.class("default", json!({"default": true})).await;
    sim.class("alt", json!({})).await;
    // A pod that names its node would bypass the queue.
    let mut pinned = PodSpec::primary("pinned", 1).build();
    pinned.spec.as_mut().expect("spec").node_name = Some("node-1".into());
    let pods: Api<Pod> = Api::namespaced(sim.client.clone(), NS);
    let err = pods
        .create(&PostParams::default(), &pinned)
        .await
        .expect_err("nodeName is refused");
    assert!(
        err.to_string()
            .contains("the pod sets spec.nodeName (\"node-1\") but requests gpupool/slot"),
        "{err}"
    );
    // Role and class labels cannot change on a live pod.
    sim.pod(PodSpec::helper("h", 1)).await;
    sim.wait_admitted("h", 20).await;
    for (label, value) in [("gpupool.io/role", "primary"), ("gpupool.io/class", "alt")] {
        let err = pods
            .patch(
                "h",
                &PatchParams::default(),
                &merge(json!({"metadata": {"labels": {label: value}}})),
            )
            .await
            .expect_err("queue labels are fixed");
        assert!(
            err.to_string().contains(&format!(
                "label {label} cannot be changed after the pod is created"
            )),
            "{err}"
        );
    }
    // So the primary that arrives still evicts it as the helper it is.
    sim.pod(PodSpec::primary("p", 1)).await;
    assert_eq!(sim.wait_admitted("p", 40).await, "node-1");
    sim.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_queued_bounds_primaries_and_helpers_apart() {
    let sim = Sim::start(1, 1).await;
    sim.class(
        "default",
        json!({"default": true, "admission": {"maxQueued": 1}}),
    )
    .await;
    sim.pod(PodSpec::primary("running", 1)).await;
    sim.wait_admitted("running", 20).await;
    sim.pod(PodSpec::helper("h1", 1)).await;
    sim.wait_phase("h1", LeasePhase::Queued, 20).await;
    let err = sim
        .try_pod(PodSpec::helper("h2", 1))
        .await
        .expect_err("one queued helper fills the helpers' bound");
    assert!(err.contains("already has 1 queued helper"), "{err}");
    // The queued helper does not lock primaries out.
    sim.pod(PodSpec::primary("p1", 1)).await;
    sim.wait_phase("p1", LeasePhase::Queued, 20).await;
    let err = sim
        .try_pod(PodSpec::primary("p2", 1))
        .await
        .expect_err("one queued primary fills the primaries' bound");
    assert!(err.contains("already has 1 queued primary"), "{err}");
    sim.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_lease_comes_back_with_its_place() {
    let sim = Sim::start(1, 1).await;
    sim.class("default", json!({"default": true})).await;
    sim.pod(PodSpec::primary("a", 1)).await;
    sim.wait_admitted("a", 20).await;
    sim.pod(PodSpec::primary("b", 1)).await;
    sim.pod(PodSpec::primary("c", 1)).await;
    sim.wait_phase("c", LeasePhase::Queued, 20).await;
    let bound = sim.wait_phase("a", LeasePhase::Bound, 20).await;
    let queued = sim.lease("c").await.expect("c");
    let api = leases(&sim.client);
    for name in ["a", "c"] {
        api.delete(name, &DeleteParams::default())
            .await
            .expect("a user may delete a lease");
    }
    let started = Instant::now();
    let again = wait_for("a's lease recreated", 10, || async {
        sim.lease("a")
            .await
            .filter(|l| l.metadata.uid != bound.metadata.uid && l.status.is_some())
    })
    .await;
    eprintln!("lease recreated after {:?}", started.elapsed());
    let (was, now) = (bound.status.expect("was"), again.status.expect("now"));
    assert_eq!(now.sequence, was.sequence, "same place");
    assert_eq!(now.node, was.node);
    assert_eq!(now.admitted_at, was.admitted_at);
    assert_eq!(now.gpus, was.gpus);
    assert_eq!(now.phase, LeasePhase::Bound);
    let c = wait_for("c's lease recreated", 10, || async {
        sim.lease("c")
            .await
            .filter(|l| l.metadata.uid != queued.metadata.uid && l.status.is_some())
    })
    .await;
    let c = c.status.expect("status");
    assert_eq!(c.sequence, queued.status.expect("was").sequence);
    assert_eq!(c.position, Some(2), "still behind b");
    sim.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_or_relaxed_webhook_configuration_is_restored_at_once() {
    let sim = Sim::start(1, 1).await;
    sim.class("default", json!({"default": true})).await;
    let mutating: Api<MutatingWebhookConfiguration> = Api::all(sim.client.clone());
    let validating: Api<ValidatingWebhookConfiguration> = Api::all(sim.client.clone());
    mutating
        .delete("gpupool", &DeleteParams::default())
        .await
        .expect("an admin deletes the mutating configuration");
    wait_for("mutating configuration restored", 3, || async {
        mutating.get_opt("gpupool").await.expect("get")
    })
    .await;
    let mut relaxed = validating.get("gpupool").await.expect("validating");
    for hook in relaxed.webhooks.iter_mut().flatten() {
        hook.failure_policy = Some("Ignore".into());
    }
    validating
        .replace("gpupool", &PostParams::default(), &relaxed)
        .await
        .expect("an admin relaxes the validating configuration");
    wait_for("failurePolicy restored", 3, || async {
        validating.get("gpupool").await.ok().filter(|v| {
            v.webhooks
                .iter()
                .flatten()
                .all(|h| h.failure_policy.as_deref() == Some("Fail"))
        })
    })
    .await;
    // Pods created afterwards are queued as ever.
    sim.pod(PodSpec::primary("p", 1)).await;
    let p = sim.get_pod("p").await.expect("p");
    assert!(
        gated(&p)
            || sim
                .lease("p")
                .await
                .is_some_and(|l| l.status.is_some_and(|s| s.sequence.is_some()))
    );
    let log = std::fs::read_to_string(sim.cluster.run_dir().join("logs/operator.log"))
        .expect("operator log");
    for found in ["was missing; restored", "was changed; restored"] {
        assert!(
            log.lines().any(|l| l.contains("WARN") && l.contains(found)),
            "no WARN {found:?} in the operator log"
        );
    }
    sim.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn classes_must_hand_out_an_extended_resource() {
    let sim = Sim::start(1, 1).await;
    let api: Api<GpuLeaseClass> = Api::all(sim.client.clone());
    for resource in ["cpu", "kubernetes.io/gpu"] {
        let class: GpuLeaseClass = serde_json::from_value(json!({
            "apiVersion": "gpupool.io/v1alpha1", "kind": "GpuLeaseClass",
            "metadata": {"name": "bad"}, "spec": {"resourceName": resource}
        }))
        .expect("class");
        let err = api
            .create(&PostParams::default(), &class)
            .await
            .expect_err("a built-in resource is refused");
        let text = err.to_string();
        assert!(
            text.contains("resourceName") && text.contains(resource),
            "{resource}: {text}"
        );
    }
    sim.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejected_lease_tells_the_pod_and_unwatched_namespaces_get_no_lease() {
    let sim = Sim::start(1, 1).await;
    sim.class("default", json!({"default": true})).await;
    sim.class("alt", json!({})).await;
    // A pod in the operator's own namespace skips the webhook: it holds its
    // slot, but is never queued and gets no lease.
    let pods: Api<Pod> = Api::namespaced(sim.client.clone(), "gpupool-system");
    let mut own = PodSpec::primary("system-job", 1).build();
    own.metadata.namespace = Some("gpupool-system".into());
    pods.create(&PostParams::default(), &own)
        .await
        .expect("a pod in the operator's namespace");
    wait_for("system-job running on node-1", 20, || async {
        pods.get("system-job")
            .await
            .ok()
            .and_then(|p| p.spec?.node_name)
    })
    .await;
    sim.pod(PodSpec::primary("waits", 1).class("alt")).await;
    let lease = sim.wait_phase("waits", LeasePhase::Queued, 20).await;
    assert_eq!(lease.status.and_then(|s| s.position), Some(1));
    let system: Api<GpuLease> = Api::namespaced(sim.client.clone(), "gpupool-system");
    assert!(
        system.get_opt("system-job").await.expect("get").is_none(),
        "no lease for a pod the webhook never saw"
    );
    // Its class goes away: the lease is Rejected and the pod is told.
    let classes: Api<GpuLeaseClass> = Api::all(sim.client.clone());
    classes
        .delete("alt", &DeleteParams::default())
        .await
        .expect("delete class");
    sim.wait_phase("waits", LeasePhase::Rejected, 20).await;
    let events = wait_for("a Rejected event", 10, || async {
        let events = sim.events("waits").await;
        events
            .iter()
            .any(|(reason, note)| {
                reason == "Rejected" && note.contains("GpuLeaseClass alt does not exist")
            })
            .then_some(events)
    })
    .await;
    eprintln!("{events:?}");
    // The simulator's wait for a class the webhook knows names the class and
    // the webhook's refusal when it gives up.
    let ml: Api<Pod> = Api::namespaced(sim.client.clone(), NS);
    let err = wait_until_webhook_knows_class(&ml, "alt", Duration::from_secs(1))
        .await
        .expect_err("the class is gone");
    let text = err.to_string();
    assert!(
        text.contains("did not know GpuLeaseClass \"alt\" within 1 s")
            && text.contains("(label gpupool.io/class) does not exist"),
        "{text}"
    );
    sim.stop().await;
}

/// Descriptors process `pid` has open.
fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, Iterator::count)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_half_sent_requests_on_the_metrics_port_holds_a_bounded_share() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let mut sim = Sim::start(1, 1).await;
    sim.class("default", json!({"default": true})).await;
    let (pid, port) = sim.cluster.operator_process().expect("the operator runs");
    let before = open_fds(pid);
    // Any pod of the cluster network can reach this port: 300 peers each
    // start a request and never finish it. Those beyond the operator's
    // limit wait in the listen backlog or are not let in at all.
    let mut flood = Vec::new();
    for _ in 0..300 {
        let connect = tokio::net::TcpStream::connect(("127.0.0.1", port));
        let Ok(Ok(mut peer)) = tokio::time::timeout(Duration::from_millis(200), connect).await
        else {
            continue;
        };
        if peer
            .write_all(b"GET /metrics HTTP/1.1\r\nHost:")
            .await
            .is_ok()
        {
            flood.push(peer);
        }
    }
    assert!(flood.len() > 32, "only {} peers got in", flood.len());
    let during = open_fds(pid);
    assert!(
        during <= before + 32 + 16,
        "{during} descriptors open with {} peers connected ({before} before)",
        flood.len()
    );
    // The operator goes on admitting meanwhile.
    sim.pod(PodSpec::primary("busy", 1)).await;
    sim.wait_admitted("busy", 30).await;
    // A peer that does not finish its request head in 5 s is let go.
    let mut first = flood.swap_remove(0);
    let mut buf = [0u8; 16];
    let read = tokio::time::timeout(Duration::from_secs(30), first.read(&mut buf)).await;
    assert!(
        matches!(read, Ok(Ok(0) | Err(_))),
        "a silent peer kept its connection: {read:?}"
    );
    drop(flood);
    let deadline = Instant::now() + Duration::from_secs(30);
    while sim.cluster.operator_metrics().await.is_none() {
        assert!(
            Instant::now() < deadline,
            "the metrics endpoint does not answer after the flood"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    sim.stop().await;
}
