//! Reporting to the API server: which pod holds which GPU (from the
//! kubelet's PodResources `List`, written to each pod's `GpuLease`
//! `status.gpus` and `status.boundAt`), and the node's GPU list (the Node
//! annotation `gpupool.io/gpus`).
//!
//! Reporting never blocks the kubelet side: with no API server, PodResources
//! or kube config, each round fails, is counted and logged. Rounds come every
//! [`REPORT_INTERVAL`]; API calls that fail wait out a growing backoff of
//! their own, so a failing API server neither stalls PodResources polling
//! nor is called every round. The GpuLease API not being served yet (the
//! CRDs not installed) is a state, not a failure: it is logged once, costs
//! no backoff, and the first round after the CRDs appear reports.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use gpupool_api::names::{
    ANNOTATION_NODE_GPUS, ANNOTATION_NODE_SLOTS, FIELD_MANAGER_DEVICE_PLUGIN,
};
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
    /// No kube client could be built: not in a pod, and no kubeconfig
    /// where one was looked for.
    #[error(
        "no Kubernetes client configuration: not running in a pod (KUBERNETES_SERVICE_HOST is unset) and no kubeconfig at {0}; set KUBECONFIG to one. GpuLease status and the node annotation are not written until then"
    )]
    NoConfig(String),
    /// A kube client configuration was found but could not be used.
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

/// The client from kube's default configuration, or why there is none.
async fn default_client() -> Result<kube::Client, ReportError> {
    kube::Client::try_default()
        .await
        .map_err(|e| match gpupool_api::kubeconfig::missing_here() {
            Some(path) => ReportError::NoConfig(path.display().to_string()),
            None => ReportError::Client(e),
        })
}

/// The Node annotations the plugin writes.
#[derive(Debug, Clone, PartialEq, Eq)]
struct NodeReport {
    /// `gpupool.io/gpus`.
    gpus: String,
    /// `gpupool.io/slots`.
    slots: String,
}

/// What became of one lease report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LeaseReport {
    /// The lease holds the pod's GPUs.
    Reported,
    /// The pod has no lease yet; asked again next round.
    NoLease,
    /// The API server does not serve GpuLeases (the CRDs are not installed);
    /// asked again next round, at no backoff.
    ApiNotServed,
}

/// True when `error` says the GpuLease resource itself is not served: a 404
/// that is not a Kubernetes `NotFound` Status for one object (the API
/// server answers a path of an uninstalled CRD with a plain-text 404).
fn api_not_served(error: &ReportError) -> bool {
    matches!(error, ReportError::Api(kube::Error::Api(status)) if status.code == 404 && status.reason != "NotFound")
}

/// When API calls may be made again: after a failed round they wait a
/// backoff that doubles from [`REPORT_INTERVAL`] up to
/// [`REPORT_BACKOFF_MAX`]; a successful round resets it.
#[derive(Debug, Default)]
struct ApiBackoff {
    delay: Duration,
    next: Option<tokio::time::Instant>,
}

impl ApiBackoff {
    fn due(&self, now: tokio::time::Instant) -> bool {
        self.next.is_none_or(|next| now >= next)
    }

    fn record(&mut self, failed: bool, now: tokio::time::Instant) {
        if failed {
            self.delay = (self.delay * 2).clamp(REPORT_INTERVAL, REPORT_BACKOFF_MAX);
            self.next = Some(now + self.delay);
        } else {
            self.delay = Duration::ZERO;
            self.next = None;
        }
    }
}

/// Which report targets are failing and with what message, so that a
/// failure that repeats every round is logged once (and its recovery once)
/// instead of at every retry; the metrics still count every failure.
#[derive(Debug, Default)]
struct Failing(HashMap<&'static str, String>);

impl Failing {
    /// Records a failure; true when it is new or its message changed.
    fn failed(&mut self, target: &'static str, message: String) -> bool {
        self.0.insert(target, message.clone()).as_ref() != Some(&message)
    }

    /// Records a success; true when the target was failing.
    fn recovered(&mut self, target: &'static str) -> bool {
        self.0.remove(target).is_some()
    }
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

    /// Writes `pod`'s GPUs to its lease, or says why it could not yet.
    async fn report_lease(
        &self,
        client: &kube::Client,
        pod: &PodGpus,
    ) -> Result<LeaseReport, ReportError> {
        let api: Api<GpuLease> = Api::namespaced(client.clone(), &pod.namespace);
        let lease = match timed(api.get_opt(&pod.name)).await {
            Ok(Some(lease)) => lease,
            Ok(None) => return Ok(LeaseReport::NoLease),
            Err(e) if api_not_served(&e) => return Ok(LeaseReport::ApiNotServed),
            Err(e) => return Err(e),
        };
        let status = lease.status.unwrap_or_default();
        let indexes = gpupool_api::gpu_indexes(&pod.gpus);
        if status.gpus == pod.gpus && status.gpu_indexes == indexes && status.bound_at.is_some() {
            return Ok(LeaseReport::Reported);
        }
        // boundAt is when the GPUs were first seen bound; keep it once set.
        let bound_at = status.bound_at.unwrap_or(Time(jiff::Timestamp::now()));
        let patch = json!({
            "status": { "gpus": pod.gpus, "gpuIndexes": indexes, "boundAt": bound_at }
        });
        let params = PatchParams {
            field_manager: Some(FIELD_MANAGER_DEVICE_PLUGIN.to_owned()),
            ..PatchParams::default()
        };
        timed(api.patch_status(&pod.name, &params, &Patch::Merge(&patch))).await?;
        self.metrics.lease_reported();
        tracing::info!(lease = %format!("{}/{}", pod.namespace, pod.name), gpus = indexes.as_deref().unwrap_or_default(), "reported GPUs to lease");
        Ok(LeaseReport::Reported)
    }

    /// Writes the node's GPU list and the healthy slots it advertises to
    /// the kubelet (which allocatable shows only seconds later).
    async fn report_node(
        &self,
        client: &kube::Client,
        node: &str,
        value: &NodeReport,
    ) -> Result<(), ReportError> {
        let api: Api<Node> = Api::all(client.clone());
        let patch = json!({ "metadata": { "annotations": {
            ANNOTATION_NODE_GPUS: value.gpus,
            ANNOTATION_NODE_SLOTS: value.slots,
        } } });
        let params = PatchParams {
            field_manager: Some(FIELD_MANAGER_DEVICE_PLUGIN.to_owned()),
            ..PatchParams::default()
        };
        timed(api.patch(node, &params, &Patch::Merge(&patch))).await?;
        tracing::info!(node, gpus = %value.gpus, slots = %value.slots, "wrote node GPU annotation");
        Ok(())
    }

    /// Reports until `shutdown` fires.
    pub async fn run(mut self, shutdown: CancellationToken) {
        let mut client: Option<kube::Client> = None;
        let mut node_written: Option<NodeReport> = None;
        let mut leases_written: HashMap<(String, String), Vec<LeaseGpu>> = HashMap::new();
        let mut first_round = true;
        let mut api = ApiBackoff::default();
        let mut lease_api_missing = false;
        let mut reasserted = tokio::time::Instant::now();
        let mut failing = Failing::default();
        if self.node_name.is_none() {
            tracing::warn!("no --node-name (NODE_NAME): the node's GPU annotation is not written");
        }
        loop {
            let delay = if first_round {
                Duration::ZERO
            } else {
                REPORT_INTERVAL
            };
            first_round = false;
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
            if reasserted.elapsed() >= REASSERT_INTERVAL {
                node_written = None;
                leases_written.clear();
                reasserted = tokio::time::Instant::now();
            }
            // API calls wait out their backoff; PodResources is read anyway.
            let api_due = api.due(tokio::time::Instant::now());
            let mut api_failed = false;

            if client.is_none() && api_due {
                match default_client().await {
                    Ok(c) => {
                        self.succeed(&mut failing, "client");
                        client = Some(c);
                    }
                    Err(e) => {
                        self.fail(&mut failing, "client", &e);
                        api_failed = true;
                    }
                }
            }
            let client = client.as_ref().filter(|_| api_due && !api_failed);

            if let (Some(client), Some(node)) = (client, &self.node_name) {
                let gpus: Vec<NodeGpu> = table.gpus().iter().map(|g| g.node.clone()).collect();
                let healthy = table.devices().filter(|(_, healthy, _)| *healthy).count();
                let value = NodeReport {
                    gpus: node_gpus::render(&gpus),
                    slots: node_gpus::render_slots(
                        &self.resource_name,
                        u32::try_from(healthy).unwrap_or(u32::MAX),
                    ),
                };
                if node_written.as_ref() != Some(&value) {
                    match self.report_node(client, node, &value).await {
                        Ok(()) => {
                            self.succeed(&mut failing, "node");
                            node_written = Some(value);
                        }
                        Err(e) => {
                            self.fail(&mut failing, "node", &e);
                            api_failed = true;
                        }
                    }
                }
            }

            match self.list_pod_resources().await {
                Err(e) => self.fail(&mut failing, "podresources", &e),
                Ok(response) => {
                    self.succeed(&mut failing, "podresources");
                    let pods = pods_holding(&response, &self.resource_name, &table);
                    leases_written.retain(|(ns, name), _| {
                        pods.iter().any(|p| &p.namespace == ns && &p.name == name)
                    });
                    for pod in &pods {
                        let Some(client) = client.filter(|_| !api_failed) else {
                            break;
                        };
                        let key = (pod.namespace.clone(), pod.name.clone());
                        if leases_written.get(&key) == Some(&pod.gpus) {
                            continue;
                        }
                        match self.report_lease(client, pod).await {
                            Ok(LeaseReport::Reported) => {
                                self.succeed(&mut failing, "lease");
                                if std::mem::take(&mut lease_api_missing) {
                                    tracing::info!(
                                        "the GpuLease API is served now; reporting leases"
                                    );
                                }
                                leases_written.insert(key, pod.gpus.clone());
                            }
                            Ok(LeaseReport::NoLease) => {
                                lease_api_missing = false;
                                tracing::debug!(
                                    lease = %format!("{}/{}", pod.namespace, pod.name),
                                    "no GpuLease for this pod yet; retrying next round"
                                );
                            }
                            Ok(LeaseReport::ApiNotServed) => {
                                if !std::mem::replace(&mut lease_api_missing, true) {
                                    tracing::info!(
                                        "the API server does not serve GpuLeases yet (gpupool's CRDs are not installed); leases are reported once it does"
                                    );
                                }
                                // One answer stands for every lease this round.
                                break;
                            }
                            Err(e) => {
                                self.fail(&mut failing, "lease", &e);
                                api_failed = true;
                            }
                        }
                    }
                }
            }
            if api_due {
                api.record(api_failed, tokio::time::Instant::now());
            }
        }
    }

    fn fail(&self, failing: &mut Failing, target: &'static str, error: &ReportError) {
        self.metrics.report_error(target);
        if failing.failed(target, error.to_string()) {
            tracing::warn!(target_kind = target, error = %error, "report failed; retrying with backoff (the same failure again is logged at debug level)");
        } else {
            tracing::debug!(target_kind = target, error = %error, "report failed again");
        }
    }

    fn succeed(&self, failing: &mut Failing, target: &'static str) {
        if failing.recovered(target) {
            tracing::info!(target_kind = target, "reporting works again");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::discovery::Gpu;
    use crate::proto::podresources::v1::{ContainerDevices, ContainerResources, PodResources};

    #[test]
    fn a_missing_kubeconfig_is_named_by_its_path_once() {
        let absent = std::path::Path::new("/nonexistent/kubeconfig");
        let message = ReportError::NoConfig(absent.display().to_string()).to_string();
        assert_eq!(
            message.matches(&absent.display().to_string()).count(),
            1,
            "{message}"
        );
        assert!(message.contains("set KUBECONFIG"), "{message}");
    }

    #[test]
    fn a_repeated_failure_is_new_once() {
        let mut failing = Failing::default();
        assert!(failing.failed("client", "a".into()));
        assert!(!failing.failed("client", "a".into()), "same failure again");
        assert!(failing.failed("client", "b".into()), "a different failure");
        assert!(failing.failed("node", "b".into()), "another target");
        assert!(failing.recovered("client"));
        assert!(!failing.recovered("client"), "recovers once");
        assert!(
            failing.failed("client", "b".into()),
            "failing again after recovery"
        );
    }

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
