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
//!
//! Which leases need their GPUs written is decided by [`plan_lease_reports`]
//! from the leases admitted to this node as a watch holds them
//! ([`crate::lease_watch`]): every round, each pod's lease whose GPUs,
//! `gpuIndexes` or `boundAt` differ from what PodResources says is patched,
//! so a lease deleted and created again (a new UID, an empty status) gets
//! its GPUs back within a round. Until the watch has listed, or where the
//! API server refuses it, each lease is read with a GET instead, and a
//! lease already reported is read again only every [`REASSERT_INTERVAL`].

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

use crate::lease_watch::{LeaseWatch, WatchState};
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
/// in case someone else overwrote it: the node annotation, and the leases
/// while they are read one by one (a watched lease is compared every round).
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

/// The leases the reporter can see this round.
pub enum LeaseView<'a> {
    /// The leases admitted to `node`, as the watch holds them, looked up
    /// by namespace and name.
    Watched {
        /// This node.
        node: &'a str,
        /// The watched lease `namespace/name`, if the node has it.
        lookup: &'a (dyn Fn(&str, &str) -> Option<Arc<GpuLease>> + Sync),
    },
    /// No watch to decide from (not listed yet, refused, or no node name):
    /// each lease is read with a GET.
    Unwatched,
}

/// What to do about one pod's lease this round.
#[derive(Debug, Clone, PartialEq)]
pub enum LeaseAction<'p> {
    /// Patch the watched lease with the pod's GPUs.
    Patch {
        /// The pod.
        pod: &'p PodGpus,
        /// The lease's UID, as watched.
        uid: String,
        /// The lease's resourceVersion, as watched.
        resource_version: Option<String>,
        /// The lease's `boundAt`, kept once set.
        bound_at: Option<Time>,
    },
    /// Read the lease and patch it if it lacks the pod's GPUs.
    Check(&'p PodGpus),
    /// The node has no lease for the pod yet (not created, or not yet
    /// admitted to this node); asked again next round.
    Wait(&'p PodGpus),
}

/// A lease's `namespace/name`.
type LeaseKey = (String, String);

fn key_of(pod: &PodGpus) -> LeaseKey {
    (pod.namespace.clone(), pod.name.clone())
}

/// What the reporter remembers of its lease reports between rounds.
#[derive(Debug, Default)]
pub struct Reported {
    /// Read one by one: the GPUs each lease was last seen or made to hold.
    /// Forgotten every [`REASSERT_INTERVAL`], so each is read again.
    checked: HashMap<LeaseKey, Vec<LeaseGpu>>,
    /// Watched: the lease version (UID, resourceVersion) each patch was
    /// made against. While the watch still shows that very version, the
    /// patch is on its way and is not sent again.
    patched: HashMap<LeaseKey, (String, Option<String>)>,
}

impl Reported {
    /// Records that `pod`'s lease, read with a GET, holds its GPUs.
    pub fn checked(&mut self, pod: &PodGpus) {
        self.checked.insert(key_of(pod), pod.gpus.clone());
    }

    /// Records a patch made against the watched lease version.
    pub fn patched(&mut self, pod: &PodGpus, uid: String, resource_version: Option<String>) {
        self.patched.insert(key_of(pod), (uid, resource_version));
    }

    /// Forgets what was read one by one, so each lease is read again.
    pub fn reassert(&mut self) {
        self.checked.clear();
    }

    /// Forgets the leases of pods that no longer hold GPUs here.
    pub fn retain(&mut self, pods: &[PodGpus]) {
        let held =
            |(ns, name): &LeaseKey| pods.iter().any(|p| &p.namespace == ns && &p.name == name);
        self.checked.retain(|k, _| held(k));
        self.patched.retain(|k, _| held(k));
    }
}

/// True when `lease`'s status already says what PodResources says of `pod`.
fn lease_current(lease: &GpuLease, pod: &PodGpus) -> bool {
    lease.status.as_ref().is_some_and(|s| {
        s.gpus == pod.gpus
            && s.gpu_indexes == gpupool_api::gpu_indexes(&pod.gpus)
            && s.bound_at.is_some()
    })
}

/// Decides, for each pod holding GPUs here, what its lease needs this
/// round. Watched, a lease is patched when its GPUs, `gpuIndexes` or
/// `boundAt` differ from PodResources (a lease created again has none),
/// unless the watch still shows the very version (UID and
/// resourceVersion) the last patch was made against; only a lease whose
/// `status.node` is `node` is ever patched. Unwatched, a lease is read
/// unless it was seen holding the same GPUs since the last reassertion.
pub fn plan_lease_reports<'p>(
    pods: &'p [PodGpus],
    view: &LeaseView<'_>,
    reported: &Reported,
) -> Vec<LeaseAction<'p>> {
    pods.iter()
        .filter_map(|pod| match view {
            LeaseView::Unwatched => (reported.checked.get(&key_of(pod)) != Some(&pod.gpus))
                .then_some(LeaseAction::Check(pod)),
            LeaseView::Watched { node, lookup } => {
                let Some(lease) = lookup(&pod.namespace, &pod.name)
                    .filter(|l| l.status.as_ref().and_then(|s| s.node.as_deref()) == Some(*node))
                else {
                    return Some(LeaseAction::Wait(pod));
                };
                if lease_current(&lease, pod) {
                    return None;
                }
                let uid = lease.metadata.uid.clone().unwrap_or_default();
                let resource_version = lease.metadata.resource_version.clone();
                let in_flight = reported.patched.get(&key_of(pod))
                    == Some(&(uid.clone(), resource_version.clone()));
                (!in_flight).then(|| LeaseAction::Patch {
                    pod,
                    uid,
                    resource_version,
                    bound_at: lease.status.as_ref().and_then(|s| s.bound_at.clone()),
                })
            }
        })
        .collect()
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

    /// Reads `pod`'s lease and writes its GPUs there unless it holds them,
    /// or says why it could not yet.
    async fn check_lease(
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
        if lease_current(&lease, pod) {
            return Ok(LeaseReport::Reported);
        }
        let bound_at = lease.status.and_then(|s| s.bound_at);
        self.patch_lease(client, pod, bound_at).await
    }

    /// Writes `pod`'s GPUs, their indexes and `boundAt` to its lease.
    async fn patch_lease(
        &self,
        client: &kube::Client,
        pod: &PodGpus,
        bound_at: Option<Time>,
    ) -> Result<LeaseReport, ReportError> {
        let api: Api<GpuLease> = Api::namespaced(client.clone(), &pod.namespace);
        let indexes = gpupool_api::gpu_indexes(&pod.gpus);
        // boundAt is when the GPUs were first seen bound; keep it once set.
        let bound_at = bound_at.unwrap_or(Time(jiff::Timestamp::now()));
        let patch = json!({
            "status": { "gpus": pod.gpus, "gpuIndexes": indexes, "boundAt": bound_at }
        });
        let params = PatchParams {
            field_manager: Some(FIELD_MANAGER_DEVICE_PLUGIN.to_owned()),
            ..PatchParams::default()
        };
        match timed(api.patch_status(&pod.name, &params, &Patch::Merge(&patch))).await {
            Ok(_) => {}
            // Deleted since it was seen: the next one is reported when seen.
            Err(ReportError::Api(kube::Error::Api(status))) if status.is_not_found() => {
                return Ok(LeaseReport::NoLease);
            }
            Err(e) => return Err(e),
        }
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
        let mut reported = Reported::default();
        let mut lease_watch: Option<LeaseWatch> = None;
        let mut first_round = true;
        let mut api = ApiBackoff::default();
        let mut lease_api_missing = false;
        let mut reasserted = tokio::time::Instant::now();
        let mut failing = Failing::default();
        if self.node_name.is_none() {
            tracing::warn!(
                "no --node-name (NODE_NAME): the node's GPU annotation is not written, and leases are read one by one instead of watched"
            );
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
                reported.reassert();
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
            if let (Some(c), Some(node), None) = (&client, &self.node_name, &lease_watch) {
                lease_watch = Some(LeaseWatch::spawn(
                    c.clone(),
                    node.clone(),
                    shutdown.child_token(),
                ));
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
                    reported.retain(&pods);
                    let watched = lease_watch
                        .as_ref()
                        .filter(|w| w.state() == WatchState::Watching);
                    let lookup = |ns: &str, name: &str| watched.and_then(|w| w.get(ns, name));
                    let view = match (watched, &self.node_name) {
                        (Some(_), Some(node)) => LeaseView::Watched {
                            node,
                            lookup: &lookup,
                        },
                        _ => LeaseView::Unwatched,
                    };
                    for action in plan_lease_reports(&pods, &view, &reported) {
                        let Some(client) = client.filter(|_| !api_failed) else {
                            break;
                        };
                        let (pod, result) = match action {
                            LeaseAction::Wait(pod) => {
                                tracing::debug!(
                                    lease = %format!("{}/{}", pod.namespace, pod.name),
                                    "no GpuLease admitted to this node for this pod yet; retrying next round"
                                );
                                continue;
                            }
                            LeaseAction::Check(pod) => (pod, self.check_lease(client, pod).await),
                            LeaseAction::Patch {
                                pod,
                                uid,
                                resource_version,
                                bound_at,
                            } => {
                                let result = self.patch_lease(client, pod, bound_at).await;
                                if matches!(result, Ok(LeaseReport::Reported)) {
                                    reported.patched(pod, uid, resource_version);
                                }
                                (pod, result)
                            }
                        };
                        match result {
                            Ok(LeaseReport::Reported) => {
                                self.succeed(&mut failing, "lease");
                                if std::mem::take(&mut lease_api_missing) {
                                    tracing::info!(
                                        "the GpuLease API is served now; reporting leases"
                                    );
                                }
                                reported.checked(pod);
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

    fn pod_gpus(name: &str, indexes: &[u32]) -> PodGpus {
        PodGpus {
            namespace: "ml".to_owned(),
            name: name.to_owned(),
            gpus: indexes
                .iter()
                .map(|i| LeaseGpu {
                    index: *i,
                    uuid: format!("GPU-{i}"),
                    product: Some("H100".to_owned()),
                })
                .collect(),
        }
    }

    /// A watched lease of `pod` with that UID and resourceVersion, on
    /// `node`, whose status holds `gpus` (and `boundAt` when `bound`).
    fn lease(
        pod: &PodGpus,
        uid: &str,
        rv: &str,
        node: Option<&str>,
        gpus: &[LeaseGpu],
        bound: bool,
    ) -> Arc<GpuLease> {
        let lease: GpuLease = serde_json::from_value(json!({
            "apiVersion": "gpupool.io/v1alpha1", "kind": "GpuLease",
            "metadata": {"name": pod.name, "namespace": pod.namespace, "uid": uid, "resourceVersion": rv},
            "spec": {"className": "default", "podName": pod.name, "podUID": "p-1", "role": "primary", "slots": 1},
            "status": {
                "phase": if bound { "Bound" } else { "Admitted" },
                "node": node,
                "gpus": gpus,
                "gpuIndexes": gpupool_api::gpu_indexes(gpus),
                "boundAt": bound.then_some("2026-01-02T03:04:05Z"),
            },
        }))
        .expect("a lease");
        Arc::new(lease)
    }

    /// The plan on `node-1` with the watch holding `leases`.
    fn plan_watched<'p>(
        pods: &'p [PodGpus],
        leases: &[Arc<GpuLease>],
        reported: &Reported,
    ) -> Vec<LeaseAction<'p>> {
        let lookup = |ns: &str, name: &str| {
            leases
                .iter()
                .find(|l| {
                    l.metadata.namespace.as_deref() == Some(ns)
                        && l.metadata.name.as_deref() == Some(name)
                })
                .cloned()
        };
        let view = LeaseView::Watched {
            node: "node-1",
            lookup: &lookup,
        };
        plan_lease_reports(pods, &view, reported)
    }

    fn patched_uids(actions: &[LeaseAction<'_>]) -> Vec<(String, String)> {
        actions
            .iter()
            .filter_map(|a| match a {
                LeaseAction::Patch { pod, uid, .. } => Some((pod.name.clone(), uid.clone())),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_watched_lease_is_patched_while_its_status_differs_from_podresources() {
        let pods = [pod_gpus("a", &[0, 2])];
        let gpus = pods[0].gpus.clone();
        let reported = Reported::default();
        let current = lease(&pods[0], "u1", "5", Some("node-1"), &gpus, true);
        assert_eq!(plan_watched(&pods, &[current], &reported), []);

        // Admitted, nothing written yet.
        let empty = lease(&pods[0], "u1", "5", Some("node-1"), &[], false);
        let plan = plan_watched(&pods, &[empty], &reported);
        assert_eq!(
            plan,
            [LeaseAction::Patch {
                pod: &pods[0],
                uid: "u1".to_owned(),
                resource_version: Some("5".to_owned()),
                bound_at: None,
            }]
        );
        // GPUs but no boundAt.
        let unbound = lease(&pods[0], "u1", "6", Some("node-1"), &gpus, false);
        assert_eq!(
            patched_uids(&plan_watched(&pods, &[unbound], &reported)),
            [("a".to_owned(), "u1".to_owned())]
        );
        // Other GPUs: patched, and the first boundAt is kept.
        let other = lease(&pods[0], "u1", "7", Some("node-1"), &gpus[..1], true);
        match plan_watched(&pods, &[other], &reported).as_slice() {
            [LeaseAction::Patch { bound_at, .. }] => assert_eq!(
                bound_at.as_ref().map(|t| t.0.to_string()),
                Some("2026-01-02T03:04:05Z".to_owned())
            ),
            plan => panic!("{plan:?}"),
        }
    }

    #[test]
    fn a_lease_created_again_with_a_new_uid_is_patched_in_the_next_round() {
        let pods = [pod_gpus("a", &[1])];
        let gpus = pods[0].gpus.clone();
        let mut reported = Reported::default();
        // The first lease is patched from version 5 ...
        let first = lease(&pods[0], "u1", "5", Some("node-1"), &[], false);
        assert_eq!(
            patched_uids(&plan_watched(
                &pods,
                std::slice::from_ref(&first),
                &reported
            )),
            [("a".to_owned(), "u1".to_owned())]
        );
        reported.patched(&pods[0], "u1".to_owned(), Some("5".to_owned()));
        reported.checked(&pods[0]);
        // ... and not again while the watch still shows version 5,
        assert_eq!(plan_watched(&pods, &[first], &reported), []);
        // nor once it shows the patch.
        let written = lease(&pods[0], "u1", "6", Some("node-1"), &gpus, true);
        assert_eq!(plan_watched(&pods, &[written], &reported), []);
        // Deleted, and created again by the operator: a new UID, no GPUs.
        assert_eq!(
            plan_watched(&pods, &[], &reported),
            [LeaseAction::Wait(&pods[0])]
        );
        let again = lease(&pods[0], "u2", "9", Some("node-1"), &[], false);
        assert_eq!(
            patched_uids(&plan_watched(&pods, &[again], &reported)),
            [("a".to_owned(), "u2".to_owned())]
        );
        // The same lease whose GPUs someone else removed after the patch.
        let overwritten = lease(&pods[0], "u1", "8", Some("node-1"), &[], true);
        assert_eq!(
            patched_uids(&plan_watched(&pods, &[overwritten], &reported)),
            [("a".to_owned(), "u1".to_owned())]
        );
    }

    #[test]
    fn only_leases_admitted_to_this_node_are_patched() {
        let pods = [pod_gpus("a", &[0]), pod_gpus("b", &[2])];
        let leases = [
            lease(&pods[0], "u1", "5", Some("node-2"), &[], false),
            lease(&pods[1], "u2", "5", None, &[], false),
        ];
        assert_eq!(
            plan_watched(&pods, &leases, &Reported::default()),
            [LeaseAction::Wait(&pods[0]), LeaseAction::Wait(&pods[1])]
        );
    }

    #[test]
    fn unwatched_each_lease_is_read_until_seen_and_again_after_reassertion() {
        let mut pods = vec![pod_gpus("a", &[0]), pod_gpus("b", &[2])];
        let mut reported = Reported::default();
        let plan = |pods: &[PodGpus], reported: &Reported| -> Vec<String> {
            plan_lease_reports(pods, &LeaseView::Unwatched, reported)
                .iter()
                .map(|a| match a {
                    LeaseAction::Check(pod) => pod.name.clone(),
                    other => panic!("unwatched, every action is a read: {other:?}"),
                })
                .collect()
        };
        assert_eq!(plan(&pods, &reported), ["a", "b"]);
        reported.checked(&pods[0]);
        assert_eq!(plan(&pods, &reported), ["b"]);
        // Other GPUs for the same pod: read again.
        pods[0].gpus = pod_gpus("a", &[4]).gpus;
        assert_eq!(plan(&pods, &reported), ["a", "b"]);
        reported.checked(&pods[0]);
        reported.checked(&pods[1]);
        assert_eq!(plan(&pods, &reported), Vec::<String>::new());
        // A lease deleted and created again is found only by reasserting.
        reported.reassert();
        assert_eq!(plan(&pods, &reported), ["a", "b"]);
        // A pod gone from PodResources is forgotten.
        reported.checked(&pods[0]);
        reported.patched(&pods[0], "u1".to_owned(), None);
        reported.retain(&pods[1..]);
        assert!(reported.checked.is_empty() && reported.patched.is_empty());
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
