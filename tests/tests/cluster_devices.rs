//! The simulated cluster with the real device plugin: slots advertised per
//! node, allocation through the kubelet's gRPC calls, scheduling limits,
//! device health, kubelet restarts and PodResources reports.
//!
//! Needs the workspace's binaries: `cargo build --workspace --bins`.

// The webhook server the API server's own webhook suite uses, shared from there.
#[path = "../../sim-apiserver/tests/webhook_support/mod.rs"]
mod webhook_support;

use std::collections::BTreeSet;
use std::time::Duration;

use gpupool_api::names::{DEFAULT_RESOURCE_NAME, ENV_GPU_INDICES, ENV_GPU_UUIDS, LABEL_HOSTNAME};
use gpupool_api::pod::parse_whole;
use gpupool_api::{GpuLease, GpuLeaseSpec, Role};
use gpupool_sim::cluster::kubelet::pods::allocated_env;
use gpupool_sim::cluster::workload::{phase, slot_pod, wait_for, wait_pod};
use gpupool_sim::cluster::{ClusterConfig, OperatorMode, SimCluster};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};

const WAIT: Duration = Duration::from_secs(20);

async fn cluster(nodes: u32, gpus: u32, sessions: u32) -> SimCluster {
    let config = ClusterConfig {
        nodes,
        gpus_per_node: gpus,
        sessions_per_gpu: sessions,
        // The operator would gate these pods; this suite tests the node side.
        operator: OperatorMode::Off,
        ..Default::default()
    };
    match SimCluster::start(config).await {
        Ok(c) => c,
        Err(e) => panic!("the simulated cluster did not start: {e}"),
    }
}

async fn allocatable(client: &Client, node: &str) -> Option<u64> {
    let nodes: Api<Node> = Api::all(client.clone());
    let n = nodes.get_opt(node).await.ok().flatten()?;
    n.status?
        .allocatable?
        .get(DEFAULT_RESOURCE_NAME)
        .and_then(parse_whole)
}

async fn capacity(client: &Client, node: &str) -> Option<u64> {
    let nodes: Api<Node> = Api::all(client.clone());
    let n = nodes.get_opt(node).await.ok().flatten()?;
    n.status?
        .capacity?
        .get(DEFAULT_RESOURCE_NAME)
        .and_then(parse_whole)
}

async fn wait_allocatable(client: &Client, node: &str, want: u64) -> u64 {
    match wait_for(WAIT, || allocatable(client, node), |a| *a == want).await {
        Ok(a) => a,
        Err(last) => {
            panic!("{node} allocatable {DEFAULT_RESOURCE_NAME} stayed {last:?}, want {want}")
        }
    }
}

fn pinned(mut pod: Pod, node: &str) -> Pod {
    if let Some(spec) = pod.spec.as_mut() {
        spec.node_selector = Some([(LABEL_HOSTNAME.to_owned(), node.to_owned())].into());
    }
    pod
}

fn env_of(pod: &Pod, key: &str) -> Vec<String> {
    let env = allocated_env(pod).expect("the kubelet records the allocated env");
    env.get("main")
        .and_then(|e| e.get(key))
        .map(|v| v.split(',').map(str::to_owned).collect())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slots_allocation_and_scheduling_limits() {
    let c = cluster(2, 3, 2).await;
    let client = c.client();
    for node in c.node_names() {
        assert_eq!(
            wait_allocatable(&client, &node, 6).await,
            6,
            "3 GPUs × 2 sessions"
        );
        assert_eq!(capacity(&client, &node).await, Some(6));
    }
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let pp = PostParams::default();
    pods.create(
        &pp,
        &pinned(slot_pod("one", 1, Role::Primary, None), "node-1"),
    )
    .await
    .expect("create one");
    pods.create(
        &pp,
        &pinned(slot_pod("two", 2, Role::Primary, None), "node-1"),
    )
    .await
    .expect("create two");
    let one = wait_pod(&pods, "one", WAIT, |p| phase(p) == "Running")
        .await
        .expect("one runs");
    let two = wait_pod(&pods, "two", WAIT, |p| phase(p) == "Running")
        .await
        .expect("two runs");
    // The scheduler says where it put each pod, as kube-scheduler does.
    let events: Api<k8s_openapi::api::core::v1::Event> = Api::namespaced(client.clone(), "default");
    let scheduled = events
        .list(&kube::api::ListParams::default().fields("involvedObject.name=one"))
        .await
        .expect("list events");
    assert!(
        scheduled
            .items
            .iter()
            .any(|e| e.reason.as_deref() == Some("Scheduled")
                && e.message.as_deref() == Some("Successfully assigned default/one to node-1")),
        "{:?}",
        scheduled.items
    );
    assert_eq!(
        one.spec.as_ref().and_then(|s| s.node_name.as_deref()),
        Some("node-1")
    );
    let one_gpus = env_of(&one, ENV_GPU_INDICES);
    let two_gpus = env_of(&two, ENV_GPU_INDICES);
    assert_eq!(one_gpus.len(), 1, "{one_gpus:?}");
    assert_eq!(
        two_gpus.len(),
        2,
        "a 2-slot pod gets two GPUs: {two_gpus:?}"
    );
    let all: BTreeSet<&String> = one_gpus.iter().chain(&two_gpus).collect();
    assert_eq!(
        all.len(),
        3,
        "sessions spread over distinct GPUs: {one_gpus:?} {two_gpus:?}"
    );
    let uuids = env_of(&two, ENV_GPU_UUIDS);
    let known: Vec<String> = c
        .gpus("node-1")
        .expect("node-1")
        .iter()
        .map(|g| g.uuid.clone())
        .collect();
    assert!(
        uuids.iter().all(|u| known.contains(u)),
        "{uuids:?} not among {known:?}"
    );
    let ready = two
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|c| c.iter().find(|c| c.type_ == "Ready"))
        .map(|c| c.status.clone());
    assert_eq!(ready.as_deref(), Some("True"));

    // More than any node has: stays Pending, Unschedulable, with the reason.
    pods.create(&pp, &slot_pod("huge", 7, Role::Primary, None))
        .await
        .expect("create huge");
    let huge = wait_pod(&pods, "huge", WAIT, |p| {
        p.status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|c| {
                c.iter()
                    .any(|c| c.reason.as_deref() == Some("Unschedulable"))
            })
    })
    .await
    .expect("huge is marked unschedulable");
    let cond = huge
        .status
        .and_then(|s| s.conditions)
        .and_then(|c| c.into_iter().find(|c| c.type_ == "PodScheduled"))
        .expect("PodScheduled condition");
    assert_eq!(cond.status, "False");
    assert!(
        cond.message
            .as_deref()
            .is_some_and(|m| m.contains("Insufficient gpupool/slot") && m.contains("0/2 nodes")),
        "{:?}",
        cond.message
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    let still = pods.get("huge").await.expect("get huge");
    assert_eq!(still.spec.and_then(|s| s.node_name), None, "never bound");

    // A pod that runs for a while then Succeeds frees its slots for a waiting one.
    pods.create(
        &pp,
        &pinned(slot_pod("short", 3, Role::Primary, Some(0.5)), "node-1"),
    )
    .await
    .expect("create short");
    pods.create(
        &pp,
        &pinned(slot_pod("next", 3, Role::Primary, None), "node-1"),
    )
    .await
    .expect("create next");
    wait_pod(&pods, "short", WAIT, |p| phase(p) == "Succeeded")
        .await
        .expect("short succeeds");
    wait_pod(&pods, "next", WAIT, |p| phase(p) == "Running")
        .await
        .expect("next runs once short is done");

    // Deleting a running pod: Terminating for its (capped) grace, then gone.
    pods.delete("one", &DeleteParams::default())
        .await
        .expect("delete one");
    wait_for(
        WAIT,
        || async { Some(pods.get_opt("one").await.ok().flatten().is_none()) },
        |gone| *gone,
    )
    .await
    .expect("the kubelet removes the deleted pod");
    c.shutdown().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_kubelet_restart_and_pod_resources() {
    let mut c = cluster(1, 2, 1).await;
    let client = c.client();
    wait_allocatable(&client, "node-1", 2).await;

    c.set_gpu_health("node-1", 1, false).expect("flip GPU 1");
    assert_eq!(
        wait_allocatable(&client, "node-1", 1).await,
        1,
        "an unhealthy GPU is not allocatable"
    );
    assert_eq!(
        capacity(&client, "node-1").await,
        Some(2),
        "but still in capacity"
    );
    c.set_gpu_health("node-1", 1, true).expect("heal GPU 1");
    wait_allocatable(&client, "node-1", 2).await;

    let seen = c.kubelet("node-1").expect("kubelet").registrations();
    c.restart_kubelet("node-1").await.expect("restart kubelet");
    assert!(
        c.kubelet("node-1")
            .expect("kubelet")
            .wait_registration(seen, WAIT)
            .await,
        "the plugin registers again after a kubelet restart"
    );
    wait_allocatable(&client, "node-1", 2).await;

    // A hand-made lease for a running pod, admitted to the node, gets the
    // GPUs PodResources reports.
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let pod = pods
        .create(
            &PostParams::default(),
            &slot_pod("leased", 1, Role::Primary, None),
        )
        .await
        .expect("create pod");
    let running = wait_pod(&pods, "leased", WAIT, |p| phase(p) == "Running")
        .await
        .expect("runs");
    let leases: Api<GpuLease> = Api::namespaced(client.clone(), "default");
    let lease = GpuLease::new(
        "leased",
        GpuLeaseSpec {
            class_name: "default".into(),
            pod_name: "leased".into(),
            pod_uid: pod.uid().expect("uid"),
            role: Role::Primary,
            slots: 1,
        },
    );
    leases
        .create(&PostParams::default(), &lease)
        .await
        .expect("create lease");
    // Admitted to this node, as the operator writes it: the plugin reports
    // GPUs to the leases of its own node only.
    leases
        .patch_status(
            "leased",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({
                "status": {"phase": "Admitted", "node": "node-1"}
            })),
        )
        .await
        .expect("admit the lease to node-1");
    let with_gpus = wait_for(
        WAIT,
        || async { leases.get_opt("leased").await.ok().flatten() },
        |l: &GpuLease| l.status.as_ref().is_some_and(|s| !s.gpus.is_empty()),
    )
    .await
    .unwrap_or_else(|last| panic!("the device plugin never wrote status.gpus: {last:?}"));
    let gpus = with_gpus.status.expect("status").gpus;
    let index = env_of(&running, ENV_GPU_INDICES);
    assert_eq!(gpus.len(), 1);
    assert_eq!(
        vec![gpus[0].index.to_string()],
        index,
        "the lease shows the GPU the pod got"
    );
    assert_eq!(
        Some(&gpus[0].uuid),
        c.gpus("node-1")
            .expect("gpus")
            .iter()
            .find(|g| g.index == gpus[0].index)
            .map(|g| &g.uuid)
    );
    c.shutdown().await.expect("clean shutdown");
}

/// Each node's device plugin authenticates with its own token, whose user
/// carries the node's name in `extra` as a bound service-account token does;
/// webhooks (and admission policies) see it in `userInfo.extra`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_device_plugin_speaks_as_its_own_node() {
    use gpupool_sim::cluster::sim::{DEVICE_PLUGIN_USER, NODE_NAME_EXTRA};
    use kube::api::{Patch, PatchParams};
    use serde_json::json;

    let c = cluster(2, 1, 1).await;
    let hook = webhook_support::start_hook().await;
    let server = c.api_server().expect("API server");
    server
        .create(
            "admissionregistration.k8s.io",
            "v1",
            "validatingwebhookconfigurations",
            "",
            json!({
                "apiVersion": "admissionregistration.k8s.io/v1",
                "kind": "ValidatingWebhookConfiguration",
                "metadata": {"name": "record-nodes"},
                "webhooks": [{
                    "name": "nodes.record.test",
                    "clientConfig": {"url": format!("https://127.0.0.1:{}/allow", hook.addr.port()), "caBundle": hook.ca_b64},
                    "rules": [{"operations": ["UPDATE"], "apiGroups": [""], "apiVersions": ["v1"], "resources": ["nodes"]}],
                    "sideEffects": "None",
                    "admissionReviewVersions": ["v1"],
                }],
            }),
        )
        .await
        .expect("webhook registered");
    for node in ["node-1", "node-2"] {
        // The kubeconfig the simulator hands that node's plugin.
        let path = c.run_dir().join(format!("device-plugin-{node}.kubeconfig"));
        let kc = kube::config::Kubeconfig::read_from(&path)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default())
            .await
            .expect("kubeconfig loads");
        let nodes: Api<Node> = Api::all(Client::try_from(cfg).expect("client"));
        nodes
            .patch(
                node,
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"labels": {"touched-by-plugin": "yes"}}})),
            )
            .await
            .expect("the plugin's credentials may patch its node");
        let seen = std::mem::take(&mut *hook.seen.lock().expect("lock"));
        let user = seen
            .iter()
            .map(|s| &s["review"]["request"])
            .find(|r| r["name"] == node)
            .map(|r| r["userInfo"].clone())
            .unwrap_or_else(|| panic!("no review of the patch of {node}: {seen:?}"));
        assert_eq!(user["username"], DEVICE_PLUGIN_USER, "{node}");
        assert_eq!(
            user["extra"],
            json!({NODE_NAME_EXTRA: [node]}),
            "{node}: the token names its node"
        );
    }
    assert!(
        !c.run_dir().join("device-plugin.kubeconfig").exists(),
        "no shared device plugin kubeconfig"
    );
    c.shutdown().await.expect("clean shutdown");
}
