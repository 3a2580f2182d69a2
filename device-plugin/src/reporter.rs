//! Reporting to the API server: which pod holds which GPU (from the
//! kubelet's PodResources `List`, written to each pod's `GpuLease`
//! `status.gpus` and `status.boundAt`), and the node's GPU list (the Node
//! annotation `gpupool.io/gpus`).
//!
//! Reporting never blocks the kubelet side: with no API server, PodResources
//! or kube config, each round fails, is counted and logged, and the next one
//! comes after a growing backoff.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use gpupool_api::names::{ANNOTATION_NODE_GPUS, FIELD_MANAGER_DEVICE_PLUGIN};
use gpupool_api::{GpuLease, LeaseGpu, NodeGpu, node_gpus};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;
use crate::proto::podresources::v1::ListPodResourcesRequest;
use crate::proto::podresources::v1::ListPodResourcesResponse;
use crate::proto::podresources::v1::pod_resources_lister_client::PodResourcesListerClient;
use crate::slots::SlotTable;
use crate::transport;

/// Time between report rounds while everything works.
pub const REPORT_INTERVAL: Duration = Duration::from_secs(2);
/// Longest time between report rounds while something fails.
pub const REPORT_BACKOFF_MAX: Duration = Duration::from_secs(30);
/// How often reported state is written again even if nothing changed here,
/// in case someone else overwrote it.
pub const REASSERT_INTERVAL: Duration = Duration::from_secs(300);
/// Longest a single PodResources or API call may take.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// The GPUs one pod holds, as PodResources says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodGpus {
    /// Pod namespace (and the lease's).
    pub namespace: String,
    /// Pod name (and the lease's).
    pub name: String,
    /// The GPUs behind the pod's slots, each once, in index order.
    pub gpus: Vec<LeaseGpu>,
}

/// Finds every pod holding devices of `resource_name` and maps the device
/// IDs to GPUs. IDs the table does not know (a GPU that vanished) are skipped.
pub fn pods_holding(
    response: &ListPodResourcesResponse,
    resource_name: &str,
    table: &SlotTable,
) -> Vec<PodGpus> {
    let mut pods: Vec<PodGpus> = response
        .pod_resources
        .iter()
        .filter_map(|pod| {
            let mut gpus: Vec<LeaseGpu> = Vec::new();
            let ids = pod
                .containers
                .iter()
                .flat_map(|c| &c.devices)
                .filter(|d| d.resource_name == resource_name)
                .flat_map(|d| &d.device_ids);
            for id in ids {
                let Some(slot) = table.lookup(id) else {
                    tracing::debug!(pod = %pod.name, device = %id, "PodResources names an unknown device");
                    continue;
                };
                if !gpus.iter().any(|g| g.uuid == slot.gpu.node.uuid) {
                    gpus.push(LeaseGpu {
                        index: slot.gpu.node.index,
                        uuid: slot.gpu.node.uuid.clone(),
                        product: Some(slot.gpu.node.product.clone()).filter(|p| !p.is_empty()),
                    });
                }
            }
            gpus.sort_by_key(|g| g.index);
            (!gpus.is_empty()).then(|| PodGpus {
                namespace: pod.namespace.clone(),
                name: pod.name.clone(),
                gpus,
            })
        })
        .collect();
    pods.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    pods
}

/// Why one report failed.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// No kube client could be built (no kube config found).
    #[error("no Kubernetes client configuration: {0}")]
    Client(#[source] kube::Error),
    /// The kubelet's PodResources endpoint failed.
    #[error("PodResources List failed: {0}")]
    PodResources(String),
    /// An API call failed.
    #[error("API server call failed: {0}")]
    Api(#[from] kube::Error),
    /// An API call took too long.
    #[error("API server call timed out after {CALL_TIMEOUT:?}")]
    Timeout,
}

/// The reporting loop's configuration.
pub struct Reporter {
    /// The kubelet's directory (`--kubelet-dir`).
    pub kubelet_dir: PathBuf,
    /// The resource advertised (`--resource-name`).
    pub resource_name: String,
    /// This node (`--node-name`); without it no Node annotation is written.
    pub node_name: Option<String>,
    /// The current slots.
    pub table: watch::Receiver<Arc<SlotTable>>,
    /// Report-error counters.
    pub metrics: Metrics,
}

async fn timed<T, E>(call: impl Future<Output = Result<T, E>>) -> Result<T, ReportError>
where
    ReportError: From<E>,
{
    tokio::time::timeout(CALL_TIMEOUT, call)
        .await
        .map_err(|_| ReportError::Timeout)?
        .map_err(ReportError::from)
}

impl Reporter {
    fn pod_resources_socket(&self) -> PathBuf {
        self.kubelet_dir.join("pod-resources").join("kubelet.sock")
    }

    async fn list_pod_resources(&self) -> Result<ListPodResourcesResponse, ReportError> {
        let call = async {
            let channel = transport::connect_unix(self.pod_resources_socket())
                .await
                .map_err(|e| ReportError::PodResources(e.to_string()))?;
            PodResourcesListerClient::new(channel)
                .list(ListPodResourcesRequest {})
                .await
                .map(tonic::Response::into_inner)
                .map_err(|s| ReportError::PodResources(format!("{:?}: {}", s.code(), s.message())))
        };
        tokio::time::timeout(CALL_TIMEOUT, call)
            .await
            .map_err(|_| ReportError::PodResources(format!("no answer within {CALL_TIMEOUT:?}")))?
    }

    /// Writes `pod`'s GPUs to its lease. `Ok(false)`: the lease does not
    /// exist (yet); try again next round.
    async fn report_lease(
        &self,
        client: &kube::Client,
        pod: &PodGpus,
    ) -> Result<bool, ReportError> {
        let api: Api<GpuLease> = Api::namespaced(client.clone(), &pod.namespace);
        let Some(lease) = timed(api.get_opt(&pod.name)).await? else {
            return Ok(false);
        };
        let status = lease.status.unwrap_or_default();
        if status.gpus == pod.gpus && status.bound_at.is_some() {
            return Ok(true);
        }
        // boundAt is when the GPUs were first seen bound; keep it once set.
        let bound_at = status.bound_at.unwrap_or(Time(jiff::Timestamp::now()));
        let patch = json!({ "status": { "gpus": pod.gpus, "boundAt": bound_at } });
        let params = PatchParams {
            field_manager: Some(FIELD_MANAGER_DEVICE_PLUGIN.to_owned()),
            ..PatchParams::default()
        };
        timed(api.patch_status(&pod.name, &params, &Patch::Merge(&patch))).await?;
        self.metrics.lease_reported();
        tracing::info!(lease = %format!("{}/{}", pod.namespace, pod.name), gpus = ?pod.gpus.iter().map(|g| g.index).collect::<Vec<_>>(), "reported GPUs to lease");
        Ok(true)
    }

    async fn report_node(
        &self,
        client: &kube::Client,
        node: &str,
        value: &str,
    ) -> Result<(), ReportError> {
        let api: Api<Node> = Api::all(client.clone());
        let patch = json!({ "metadata": { "annotations": { ANNOTATION_NODE_GPUS: value } } });
        let params = PatchParams {
            field_manager: Some(FIELD_MANAGER_DEVICE_PLUGIN.to_owned()),
            ..PatchParams::default()
        };
        timed(api.patch(node, &params, &Patch::Merge(&patch))).await?;
        tracing::info!(node, gpus = %value, "wrote node GPU annotation");
        Ok(())
    }

    /// Reports until `shutdown` fires.
    pub async fn run(mut self, shutdown: CancellationToken) {
        let mut client: Option<kube::Client> = None;
        let mut node_written: Option<String> = None;
        let mut leases_written: HashMap<(String, String), Vec<LeaseGpu>> = HashMap::new();
        let mut delay = Duration::ZERO;
        let mut reasserted = tokio::time::Instant::now();
        if self.node_name.is_none() {
            tracing::warn!("no --node-name (NODE_NAME): the node's GPU annotation is not written");
        }
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(delay) => {}
                changed = self.table.changed() => {
                    if changed.is_err() {
                        return;
                    }
                }
            }
            let table = self.table.borrow_and_update().clone();
            let mut failed = false;
            if reasserted.elapsed() >= REASSERT_INTERVAL {
                node_written = None;
                leases_written.clear();
                reasserted = tokio::time::Instant::now();
            }

            if client.is_none() {
                match kube::Client::try_default().await {
                    Ok(c) => client = Some(c),
                    Err(e) => {
                        self.fail("client", &ReportError::Client(e));
                        failed = true;
                    }
                }
            }

            if let (Some(client), Some(node)) = (&client, &self.node_name) {
                let gpus: Vec<NodeGpu> = table.gpus().iter().map(|g| g.node.clone()).collect();
                let value = node_gpus::render(&gpus);
                if node_written.as_ref() != Some(&value) {
                    match self.report_node(client, node, &value).await {
                        Ok(()) => node_written = Some(value),
                        Err(e) => {
                            self.fail("node", &e);
                            failed = true;
                        }
                    }
                }
            }

            match self.list_pod_resources().await {
                Err(e) => {
                    self.fail("podresources", &e);
                    failed = true;
                }
                Ok(response) => {
                    let pods = pods_holding(&response, &self.resource_name, &table);
                    leases_written.retain(|(ns, name), _| {
                        pods.iter().any(|p| &p.namespace == ns && &p.name == name)
                    });
                    if let Some(client) = &client {
                        for pod in &pods {
                            let key = (pod.namespace.clone(), pod.name.clone());
                            if leases_written.get(&key) == Some(&pod.gpus) {
                                continue;
                            }
                            match self.report_lease(client, pod).await {
                                Ok(true) => {
                                    leases_written.insert(key, pod.gpus.clone());
                                }
                                Ok(false) => tracing::debug!(
                                    lease = %format!("{}/{}", pod.namespace, pod.name),
                                    "no GpuLease for this pod yet; retrying next round"
                                ),
                                Err(e) => {
                                    self.fail("lease", &e);
                                    failed = true;
                                }
                            }
                        }
                    }
                }
            }

            delay = if failed {
                (delay * 2).clamp(REPORT_INTERVAL, REPORT_BACKOFF_MAX)
            } else {
                REPORT_INTERVAL
            };
        }
    }

    fn fail(&self, target: &'static str, error: &ReportError) {
        self.metrics.report_error(target);
        tracing::warn!(target_kind = target, error = %error, "report failed; retrying with backoff");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::discovery::Gpu;
    use crate::proto::podresources::v1::{ContainerDevices, ContainerResources, PodResources};

    fn table() -> SlotTable {
        let gpus = (0..3).map(|i| {
            Gpu::from(NodeGpu {
                index: i * 2,
                uuid: format!("GPU-{i}"),
                product: "H100".to_owned(),
                vendor: "NVIDIA".to_owned(),
                memory_mib: 0,
                healthy: true,
            })
        });
        SlotTable::new(gpus.collect(), 2)
    }

    fn pod(ns: &str, name: &str, devices: Vec<(&str, Vec<&str>)>) -> PodResources {
        PodResources {
            name: name.to_owned(),
            namespace: ns.to_owned(),
            containers: vec![ContainerResources {
                name: "main".to_owned(),
                devices: devices
                    .into_iter()
                    .map(|(resource, ids)| ContainerDevices {
                        resource_name: resource.to_owned(),
                        device_ids: ids.into_iter().map(String::from).collect(),
                        topology: None,
                    })
                    .collect(),
                ..Default::default()
            }],
        }
    }

    #[test]
    fn maps_pods_to_distinct_gpus_of_our_resource() {
        let response = ListPodResourcesResponse {
            pod_resources: vec![
                pod(
                    "b",
                    "two",
                    vec![("gpupool/slot", vec!["GPU-2-s0", "GPU-0-s1", "GPU-0-s0"])],
                ),
                pod("a", "other", vec![("nvidia.com/gpu", vec!["GPU-1-s0"])]),
                pod(
                    "a",
                    "one",
                    vec![("gpupool/slot", vec!["GPU-1-s1", "gone-s0"])],
                ),
            ],
        };
        let pods = pods_holding(&response, "gpupool/slot", &table());
        assert_eq!(pods.len(), 2);
        assert_eq!(
            (pods[0].namespace.as_str(), pods[0].name.as_str()),
            ("a", "one")
        );
        assert_eq!(
            pods[0].gpus.iter().map(|g| g.index).collect::<Vec<_>>(),
            vec![2]
        );
        assert_eq!(
            pods[1].gpus.iter().map(|g| g.index).collect::<Vec<_>>(),
            vec![0, 4]
        );
        assert_eq!(pods[1].gpus[1].uuid, "GPU-2");
        assert_eq!(pods[1].gpus[1].product.as_deref(), Some("H100"));
    }
}
