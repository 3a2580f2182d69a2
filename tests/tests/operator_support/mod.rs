//! Shared helpers of the operator's end-to-end tests: a simulated cluster
//! running the real `gpupool-operator` and `gpupool-device-plugin` binaries,
//! and what a user would run against it (create classes and pods, read
//! leases, pod gates and events through the Kubernetes API).

#![allow(dead_code, clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::future::Future;
use std::time::{Duration, Instant};

use gpupool_api::{GpuLease, GpuLeaseClass, LeasePhase};
use gpupool_sim::cluster::workload::{run_on, wait_until_webhook_knows_class};
use gpupool_sim::cluster::{BACKEND_ENV, Backend, ClusterConfig, OperatorMode, SimCluster};
use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::api::events::v1::Event;
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::{Api, Client};
use serde_json::{Value, json};

/// Namespace the tests' workload pods live in.
pub const NS: &str = "ml";

/// A running simulated cluster and an admin client.
pub struct Sim {
    /// The cluster.
    pub cluster: SimCluster,
    /// Admin client.
    pub client: Client,
}

impl Sim {
    /// Starts `nodes` nodes with `gpus` GPUs each, the operator (required) and namespace `ml`.
    pub async fn start(nodes: u32, gpus: u32) -> Sim {
        Self::start_with(ClusterConfig {
            nodes,
            gpus_per_node: gpus,
            operator: OperatorMode::Required,
            ready_timeout: Duration::from_secs(60),
            ..Default::default()
        })
        .await
    }

    /// Starts a cluster with `config` and namespace `ml`, on the backend
    /// `GPUPOOL_E2E_BACKEND` names (the in-memory API server unless it says
    /// `real` and `KUBEBUILDER_ASSETS` is set), so every rule suite runs on
    /// both. `real` without `KUBEBUILDER_ASSETS` fails in CI; elsewhere the
    /// test runs in memory, and the real run counts as skipped.
    pub async fn start_with(mut config: ClusterConfig) -> Sim {
        if std::env::var(BACKEND_ENV).as_deref() == Ok("real") {
            gpupool_sim_apiserver::tool_check::kube_assets(&format!("{BACKEND_ENV}=real"));
        }
        config.backend = Backend::from_env();
        // GPUPOOL_KEEP_RUN=1 keeps the run directory (logs) for a failing test.
        config.remove_run_dir = std::env::var_os("GPUPOOL_KEEP_RUN").is_none();
        let backend = config.backend.clone();
        let cluster = SimCluster::start(config).await.unwrap_or_else(|e| {
            panic!(
                "the cluster starts on {backend:?} (build the binaries first: cargo build --workspace --bins): {e}"
            )
        });
        let client = cluster.client();
        eprintln!(
            "simulated cluster run directory: {}",
            cluster.run_dir().display()
        );
        let namespaces: Api<Namespace> = Api::all(client.clone());
        namespaces
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({"metadata": {"name": NS}})).expect("namespace"),
            )
            .await
            .expect("namespace ml");
        Sim { cluster, client }
    }

    /// Stops everything.
    pub async fn stop(self) {
        self.cluster
            .shutdown()
            .await
            .expect("cluster stops cleanly");
    }

    /// The operator's `gpupool_operator_queue_depth` gauge for `class` and
    /// `role` (`primary` or `helper`), read from its `/metrics`; `None`
    /// when no replica answers or the gauge has no such series yet.
    pub async fn queue_depth(&mut self, class: &str, role: &str) -> Option<i64> {
        let text = self.cluster.operator_metrics().await?;
        let labels = [format!("class=\"{class}\""), format!("role=\"{role}\"")];
        text.lines()
            .filter(|l| l.starts_with("gpupool_operator_queue_depth{"))
            .find(|l| labels.iter().all(|label| l.contains(label.as_str())))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
    }

    /// Creates (or replaces) class `name` with `spec`.
    pub async fn class(&self, name: &str, spec: Value) {
        let api: Api<GpuLeaseClass> = Api::all(self.client.clone());
        let obj: GpuLeaseClass = serde_json::from_value(json!({
            "apiVersion": "gpupool.io/v1alpha1", "kind": "GpuLeaseClass",
            "metadata": {"name": name}, "spec": spec
        }))
        .expect("class");
        if let Some(old) = api.get_opt(name).await.expect("get class") {
            let mut obj = obj;
            obj.metadata.resource_version = old.metadata.resource_version;
            api.replace(name, &PostParams::default(), &obj)
                .await
                .expect("replace class");
        } else {
            api.create(&PostParams::default(), &obj)
                .await
                .expect("create class");
        }
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), NS);
        wait_until_webhook_knows_class(&pods, name, Duration::from_secs(30))
            .await
            .expect("the webhook learns the class");
        // The probe shows the class is cached, not that a replaced spec is.
        tokio::time::sleep(Duration::from_millis(300)).await;
    }

    /// Creates a pod; see [`PodSpec`].
    pub async fn pod(&self, p: PodSpec<'_>) -> Pod {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), NS);
        pods.create(&PostParams::default(), &p.build_for(self.cluster.backend()))
            .await
            .unwrap_or_else(|e| panic!("create pod {}: {e}", p.name))
    }

    /// Tries to create a pod; returns the API error message on denial.
    pub async fn try_pod(&self, p: PodSpec<'_>) -> Result<Pod, String> {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), NS);
        pods.create(&PostParams::default(), &p.build_for(self.cluster.backend()))
            .await
            .map_err(|e| e.to_string())
    }

    /// Creates `pod`, written as for the simulated kubelet, made to run
    /// on this cluster's backend ([`run_on`]).
    pub async fn create_pod(&self, mut pod: Pod) -> Pod {
        run_on(&mut pod, self.cluster.backend());
        let name = pod.metadata.name.clone().unwrap_or_default();
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), NS);
        pods.create(&PostParams::default(), &pod)
            .await
            .unwrap_or_else(|e| panic!("create pod {name}: {e}"))
    }

    /// The GPU environment Allocate gave each container of pod `name`
    /// (container name → `GPUPOOL_*` variables): the simulated kubelet's
    /// record of it, or on real nodes what the workload's containers print
    /// to their logs. `None` where neither exists (simulated kubelets on a
    /// real control plane do not record it) or while a container has not
    /// printed it yet.
    pub async fn allocated_env(
        &self,
        name: &str,
    ) -> Option<BTreeMap<String, BTreeMap<String, String>>> {
        let pod = self.get_pod(name).await?;
        if !self.cluster.backend().is_real_nodes() {
            let text = pod
                .metadata
                .annotations
                .as_ref()?
                .get("sim.gpupool.io/allocated-env")?;
            return serde_json::from_str(text).ok();
        }
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), NS);
        let spec = pod.spec.as_ref()?;
        let mut all = BTreeMap::new();
        for c in spec
            .init_containers
            .iter()
            .flatten()
            .chain(&spec.containers)
        {
            let params = kube::api::LogParams {
                container: Some(c.name.clone()),
                ..Default::default()
            };
            let log = pods.logs(name, &params).await.ok()?;
            let env: BTreeMap<String, String> = log
                .lines()
                .filter_map(|l| l.split_once('='))
                .filter(|(k, _)| k.starts_with("GPUPOOL_"))
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect();
            if !env.is_empty() {
                all.insert(c.name.clone(), env);
            }
        }
        Some(all)
    }

    /// Deletes a pod (default grace).
    pub async fn delete_pod(&self, name: &str) {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), NS);
        pods.delete(name, &DeleteParams::default())
            .await
            .unwrap_or_else(|e| panic!("delete pod {name}: {e}"));
    }

    /// Reads a pod.
    pub async fn get_pod(&self, name: &str) -> Option<Pod> {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), NS);
        pods.get_opt(name).await.expect("get pod")
    }

    /// Reads a lease.
    pub async fn lease(&self, name: &str) -> Option<GpuLease> {
        let api: Api<GpuLease> = Api::namespaced(self.client.clone(), NS);
        api.get_opt(name).await.expect("get lease")
    }

    /// Lease `name` as `kubectl get gpuleases` prints it: each column's
    /// header and cell, from the API server's Table rendering of the CRD's
    /// printer columns.
    pub async fn lease_row(&self, name: &str) -> BTreeMap<String, Value> {
        let request = http::Request::get(format!(
            "/apis/gpupool.io/v1alpha1/namespaces/{NS}/gpuleases/{name}"
        ))
        .header(
            http::header::ACCEPT,
            "application/json;as=Table;v=v1;g=meta.k8s.io",
        )
        .body(Vec::new())
        .expect("a Table request");
        let table: Value = self
            .client
            .request(request)
            .await
            .expect("lease as a Table");
        let headers = table["columnDefinitions"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let cells = table["rows"][0]["cells"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        assert_eq!(headers.len(), cells.len(), "{table}");
        headers
            .iter()
            .map(|h| h["name"].as_str().unwrap_or_default().to_owned())
            .zip(cells)
            .collect()
    }

    /// Every lease in `ml`, by name.
    pub async fn leases(&self) -> BTreeMap<String, GpuLease> {
        let api: Api<GpuLease> = Api::namespaced(self.client.clone(), NS);
        api.list(&ListParams::default())
            .await
            .expect("list leases")
            .items
            .into_iter()
            .map(|l| (l.metadata.name.clone().unwrap_or_default(), l))
            .collect()
    }

    /// Reads a class.
    pub async fn get_class(&self, name: &str) -> GpuLeaseClass {
        let api: Api<GpuLeaseClass> = Api::all(self.client.clone());
        api.get(name).await.expect("get class")
    }

    /// Events about pod `name`, as (reason, note).
    pub async fn events(&self, name: &str) -> Vec<(String, String)> {
        let api: Api<Event> = Api::namespaced(self.client.clone(), NS);
        let mut evs: Vec<Event> = api
            .list(&ListParams::default())
            .await
            .expect("list events")
            .items
            .into_iter()
            .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
            .collect();
        evs.sort_by_key(|e| e.event_time.as_ref().map(|t| t.0));
        evs.into_iter()
            .map(|e| (e.reason.unwrap_or_default(), e.note.unwrap_or_default()))
            .collect()
    }

    /// Waits (up to `secs`) for a lease to reach `phase`.
    pub async fn wait_phase(&self, name: &str, phase: LeasePhase, secs: u64) -> GpuLease {
        wait_for(&format!("lease {name} {phase:?}"), secs, || async {
            self.lease(name)
                .await
                .filter(|l| l.status.as_ref().is_some_and(|s| s.phase == phase))
        })
        .await
    }

    /// Waits for pod `name` to lose its gate; returns the node it is pinned to.
    pub async fn wait_admitted(&self, name: &str, secs: u64) -> String {
        wait_for(&format!("pod {name} admitted"), secs, || async {
            let pod = self.get_pod(name).await?;
            if gated(&pod) {
                return None;
            }
            pinned_node(&pod)
        })
        .await
    }
}

/// True while the pod carries the admission gate.
pub fn gated(pod: &Pod) -> bool {
    pod.spec
        .as_ref()
        .and_then(|s| s.scheduling_gates.as_ref())
        .is_some_and(|g| g.iter().any(|g| g.name == "gpupool.io/admission"))
}

/// The node the operator pinned the pod to.
pub fn pinned_node(pod: &Pod) -> Option<String> {
    pod.spec
        .as_ref()?
        .node_selector
        .as_ref()?
        .get("kubernetes.io/hostname")
        .cloned()
}

/// Polls `f` every 50 ms until it yields, failing the test after `secs`.
pub async fn wait_for<T, F, Fut>(what: &str, secs: u64, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {secs}s waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A test pod.
#[derive(Debug, Clone)]
pub struct PodSpec<'a> {
    /// Name.
    pub name: &'a str,
    /// Slots requested.
    pub slots: u32,
    /// `helper` or `primary` (None: no label).
    pub role: Option<&'a str>,
    /// Class label.
    pub class: Option<&'a str>,
    /// Seconds it runs before Succeeding (None: until deleted).
    pub run_seconds: Option<f64>,
    /// Extra labels.
    pub labels: Vec<(&'a str, &'a str)>,
    /// Node selector.
    pub node_selector: Vec<(&'a str, &'a str)>,
}

impl<'a> PodSpec<'a> {
    /// A primary asking for `slots`, running until deleted.
    pub fn primary(name: &'a str, slots: u32) -> Self {
        Self {
            name,
            slots,
            role: None,
            class: None,
            run_seconds: None,
            labels: vec![],
            node_selector: vec![],
        }
    }

    /// A helper asking for `slots`.
    pub fn helper(name: &'a str, slots: u32) -> Self {
        Self {
            role: Some("helper"),
            ..Self::primary(name, slots)
        }
    }

    /// Runs for `secs` then Succeeds.
    pub fn runs(mut self, secs: f64) -> Self {
        self.run_seconds = Some(secs);
        self
    }

    /// In class `class`.
    pub fn class(mut self, class: &'a str) -> Self {
        self.class = Some(class);
        self
    }

    /// The pod object, for the backend `GPUPOOL_E2E_BACKEND` names (the
    /// one [`Sim::start_with`] starts).
    pub fn build(&self) -> Pod {
        self.build_for(&Backend::from_env())
    }

    /// The pod object, made to run on `backend` ([`run_on`]): on real
    /// nodes, the workload image doing what the simulated kubelet does.
    pub fn build_for(&self, backend: &Backend) -> Pod {
        let mut labels: BTreeMap<String, String> = self
            .labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        if let Some(r) = self.role {
            labels.insert("gpupool.io/role".into(), r.into());
        }
        if let Some(c) = self.class {
            labels.insert("gpupool.io/class".into(), c.into());
        }
        let mut annotations = BTreeMap::new();
        if let Some(s) = self.run_seconds {
            annotations.insert("sim.gpupool.io/run-seconds".to_owned(), s.to_string());
        }
        let mut v = json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": self.name, "namespace": NS, "labels": labels, "annotations": annotations},
            "spec": {"containers": [{"name": "work", "image": "sim",
                "resources": {"limits": {"gpupool/slot": self.slots.to_string()}}}]}
        });
        if self.run_seconds.is_some() {
            // It ends by itself and is not restarted, so it Succeeds.
            v["spec"]["restartPolicy"] = json!("Never");
        }
        if !self.node_selector.is_empty() {
            let sel: BTreeMap<&str, &str> = self.node_selector.iter().copied().collect();
            v["spec"]["nodeSelector"] = json!(sel);
        }
        let mut pod = serde_json::from_value(v).expect("pod");
        run_on(&mut pod, backend);
        pod
    }
}

/// Phase and position of a lease, for assertions.
pub fn phase_of(l: &GpuLease) -> (Option<LeasePhase>, Option<u32>) {
    (
        l.status.as_ref().map(|s| s.phase),
        l.status.as_ref().and_then(|s| s.position),
    )
}

/// Whether the device plugin's GPU annotation on `node` says GPU `index`
/// is healthy (`None` before it says anything of it).
pub async fn annotated_health(client: &Client, node: &str, index: u32) -> Option<bool> {
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(client.clone());
    let node = nodes.get(node).await.ok()?;
    let value = node
        .metadata
        .annotations?
        .get(gpupool_api::names::ANNOTATION_NODE_GPUS)?
        .clone();
    let gpus = gpupool_api::node_gpus::parse(&value).ok()?;
    gpus.iter().find(|g| g.index == index).map(|g| g.healthy)
}
