//! The kubelet's Node object: created at start, and its capacity and
//! allocatable kept equal to what the device plugins advertise.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use gpupool_api::names::LABEL_HOSTNAME;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use super::Shared;

/// CPU, memory and pod capacity every simulated node reports besides its devices.
const BASE_CAPACITY: [(&str, &str); 3] = [("cpu", "16"), ("memory", "64Gi"), ("pods", "110")];

/// Creates the Node (an existing one of the same name is kept, as a
/// re-registering kubelet does) and marks it Ready.
pub async fn register_node(shared: &Shared) -> Result<(), kube::Error> {
    let api: Api<Node> = Api::all(shared.client.clone());
    let node = Node {
        metadata: ObjectMeta {
            name: Some(shared.node_name.clone()),
            labels: Some(BTreeMap::from([
                (LABEL_HOSTNAME.to_owned(), shared.node_name.clone()),
                ("kubernetes.io/os".to_owned(), "linux".to_owned()),
                (
                    "kubernetes.io/arch".to_owned(),
                    std::env::consts::ARCH.to_owned(),
                ),
            ])),
            ..Default::default()
        },
        ..Default::default()
    };
    match api.create(&PostParams::default(), &node).await {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 409 => {}
        Err(e) => return Err(e),
    }
    let now = jiff::Timestamp::now().to_string();
    let status = json!({"status": {
        "capacity": base_capacity(),
        "allocatable": base_capacity(),
        "conditions": [{
            "type": "Ready", "status": "True", "reason": "KubeletReady",
            "message": "simulated kubelet is posting ready status",
            "lastHeartbeatTime": now, "lastTransitionTime": now,
        }],
        "addresses": [
            {"type": "InternalIP", "address": "127.0.0.1"},
            {"type": "Hostname", "address": shared.node_name},
        ],
        "nodeInfo": {
            "machineID": shared.node_name, "systemUUID": shared.node_name, "bootID": shared.node_name,
            "kernelVersion": "sim", "osImage": "gpupool simulated node",
            "containerRuntimeVersion": "sim://1", "kubeletVersion": "v1.34.0-sim",
            "kubeProxyVersion": "", "operatingSystem": "linux", "architecture": std::env::consts::ARCH,
        },
    }});
    api.patch_status(&shared.node_name, &patch_params(), &Patch::Merge(&status))
        .await?;
    Ok(())
}

fn base_capacity() -> serde_json::Map<String, serde_json::Value> {
    BASE_CAPACITY
        .iter()
        .map(|(k, v)| ((*k).to_owned(), json!(v)))
        .collect()
}

fn patch_params() -> PatchParams {
    PatchParams {
        field_manager: Some("sim-kubelet".into()),
        ..Default::default()
    }
}

/// Writes the device resources' capacity and allocatable until cancelled:
/// at once when a plugin registers, first lists its devices or goes away,
/// and otherwise every 10 s, the kubelet's node status update period, so a
/// device's health reaches allocatable as late as it does with kubelet. A
/// failed write is retried, so the Node converges to the book.
pub async fn keep_status(shared: Arc<Shared>, cancel: CancellationToken) {
    let api: Api<Node> = Api::all(shared.client.clone());
    let mut last: Option<serde_json::Value> = None;
    loop {
        let (capacity, allocatable) = {
            let state = shared.lock();
            let mut capacity = base_capacity();
            let mut allocatable = base_capacity();
            for r in state.book.resources() {
                capacity.insert(r.to_owned(), json!(state.book.capacity(r).to_string()));
                allocatable.insert(r.to_owned(), json!(state.book.allocatable(r).to_string()));
            }
            (capacity, allocatable)
        };
        let patch = json!({"status": {"capacity": capacity, "allocatable": allocatable}});
        let retry = if last.as_ref() == Some(&patch) {
            false
        } else {
            match api
                .patch_status(&shared.node_name, &patch_params(), &Patch::Merge(&patch))
                .await
            {
                Ok(_) => {
                    tracing::info!(node = %shared.node_name, allocatable = %patch["status"]["allocatable"], "node status updated");
                    last = Some(patch);
                    false
                }
                Err(e) => {
                    tracing::warn!(node = %shared.node_name, error = %e, "cannot update node status; retrying");
                    true
                }
            }
        };
        let wait = if retry {
            Duration::from_millis(200)
        } else {
            Duration::from_secs(10)
        };
        tokio::select! {
            () = cancel.cancelled() => return,
            () = shared.node_dirty.notified() => {}
            () = tokio::time::sleep(wait) => {}
        }
    }
}

/// The namespace of node heartbeat Leases.
pub const NODE_LEASE_NAMESPACE: &str = "kube-node-lease";
/// How often the heartbeat Lease is renewed (the kubelet's default).
const LEASE_RENEW: Duration = Duration::from_secs(10);
/// How long a heartbeat stays valid (the kubelet's default).
const LEASE_DURATION_SECONDS: i32 = 40;

/// Renews the node's heartbeat Lease in `kube-node-lease` every 10 s until
/// cancelled, as the kubelet does: on a real control plane this (with the
/// Ready condition written at registration) is what says the node is alive,
/// without rewriting the Node object and waking every Node watcher. A
/// failed renewal is logged and retried at the next tick.
pub async fn keep_lease(shared: Arc<Shared>, cancel: CancellationToken) {
    let api: Api<Lease> = Api::namespaced(shared.client.clone(), NODE_LEASE_NAMESPACE);
    loop {
        if let Err(e) = renew_lease(&api, &shared.node_name).await {
            tracing::warn!(node = %shared.node_name, error = %e, "cannot renew the node's heartbeat Lease");
        }
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(LEASE_RENEW) => {}
        }
    }
}

async fn renew_lease(api: &Api<Lease>, node: &str) -> Result<(), kube::Error> {
    let now = jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%S%.6fZ")
        .to_string();
    let spec = json!({"spec": {
        "holderIdentity": node,
        "leaseDurationSeconds": LEASE_DURATION_SECONDS,
        "renewTime": now,
    }});
    match api.patch(node, &patch_params(), &Patch::Merge(&spec)).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 404 => {
            let mut lease = spec;
            lease["metadata"] = json!({"name": node, "namespace": NODE_LEASE_NAMESPACE});
            let lease: Lease = serde_json::from_value(lease).map_err(kube::Error::SerdeError)?;
            api.create(&PostParams::default(), &lease).await.map(|_| ())
        }
        Err(e) => Err(e),
    }
}
