//! Reporting against a small loopback HTTP server that speaks the three
//! Kubernetes REST calls the plugin makes (GET a GpuLease, merge-patch its
//! status, merge-patch the Node), recording what it is sent. The pods come
//! from the simulator's kubelet, which runs them on the plugin's slots on
//! its own in-memory API server.

#![allow(clippy::unwrap_used)]

mod common;

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};

use common::{Plugin, TestKubelet, wait_for, write_config};
use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};

#[derive(Debug, Clone)]
struct Seen {
    method: String,
    path: String,
    content_type: String,
    body: Value,
}

#[derive(Default)]
struct ApiState {
    leases: HashMap<String, Value>,
    requests: Vec<Seen>,
    /// The GpuLease CRD is not installed: lease paths get the plain-text
    /// 404 a real API server sends for a path nothing serves.
    crds_missing: bool,
}

type Shared = Arc<Mutex<ApiState>>;

fn lease(name: &str) -> Value {
    json!({
        "apiVersion": "gpupool.io/v1alpha1",
        "kind": "GpuLease",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"className": "default", "podName": name, "podUID": "uid", "role": "primary", "slots": 1},
        "status": {"phase": "Admitted", "node": "node-1"}
    })
}

fn reply(status: StatusCode, body: &Value) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body.to_string())));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert("content-type", "application/json".parse().unwrap());
    response
}

async fn handle(state: Shared, request: Request<Incoming>) -> Response<Full<Bytes>> {
    let method = request.method().to_string();
    let path = request.uri().path().to_owned();
    let content_type = request
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let bytes = request.into_body().collect().await.unwrap().to_bytes();
    let body: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    let mut state = state.lock().unwrap();
    state.requests.push(Seen {
        method: method.clone(),
        path: path.clone(),
        content_type,
        body: body.clone(),
    });
    let not_found = json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "reason": "NotFound", "code": 404, "message": format!("{path} not found")});
    let lease_prefix = "/apis/gpupool.io/v1alpha1/namespaces/default/gpuleases/";
    if let Some(rest) = path.strip_prefix(lease_prefix) {
        if state.crds_missing {
            let mut response = Response::new(Full::new(Bytes::from("404 page not found\n")));
            *response.status_mut() = StatusCode::NOT_FOUND;
            response
                .headers_mut()
                .insert("content-type", "text/plain; charset=utf-8".parse().unwrap());
            return response;
        }
        let (name, status) = match rest.strip_suffix("/status") {
            Some(name) => (name, true),
            None => (rest, false),
        };
        let Some(stored) = state.leases.get_mut(name) else {
            return reply(StatusCode::NOT_FOUND, &not_found);
        };
        if method == "PATCH" && status {
            for (k, v) in body["status"].as_object().cloned().unwrap_or_default() {
                stored["status"][k] = v;
            }
        }
        return reply(StatusCode::OK, stored);
    }
    if let Some(node) = path.strip_prefix("/api/v1/nodes/") {
        let node = json!({"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": node, "annotations": body["metadata"]["annotations"].clone()}});
        return reply(StatusCode::OK, &node);
    }
    reply(StatusCode::NOT_FOUND, &not_found)
}

async fn start_api_server() -> (String, Shared) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let state: Shared = Arc::default();
    let shared = state.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let state = shared.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |request| {
                    let state = state.clone();
                    async move { Ok::<_, Infallible>(handle(state, request).await) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    (url, state)
}

/// The GPU UUID of a slot device ID (`<uuid>-s<n>`).
fn gpu_of(id: &str) -> &str {
    id.rsplit_once("-s").map_or(id, |(uuid, _)| uuid)
}

fn requests(state: &Shared, method: &str, path_end: &str) -> Vec<Seen> {
    state
        .lock()
        .unwrap()
        .requests
        .iter()
        .filter(|r| r.method == method && r.path.ends_with(path_end))
        .cloned()
        .collect()
}

fn write_kubeconfig(dir: &std::path::Path, url: &str) -> std::path::PathBuf {
    let kubeconfig = dir.join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster: {{server: '{url}'}}\n\
             contexts:\n- name: c\n  context: {{cluster: c, user: u}}\ncurrent-context: c\nusers:\n- name: u\n  user: {{}}\n"
        ),
    )
    .unwrap();
    kubeconfig
}

/// Before gpupool's CRDs are installed the API server answers lease paths
/// with a plain-text 404. That is a state, not a failure: the plugin keeps
/// its two-second rounds (PodResources and the API), counts no error, and
/// reports the lease in the first round after the CRDs appear, where a
/// backoff would have it wait up to half a minute.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crds_not_installed_yet_cost_no_backoff() {
    let (url, state) = start_api_server().await;
    state.lock().unwrap().crds_missing = true;
    let kubelet = TestKubelet::start().await;
    let config = kubelet.path().join("gpus.yaml");
    write_config(&config, &[(0, "GPU-a", true)]);
    let kubeconfig = write_kubeconfig(kubelet.path(), &url);
    let plugin = Plugin::start_with_env(
        kubelet.path(),
        &[
            "--discovery",
            "static",
            "--static-config",
            config.to_str().unwrap(),
            "--node-name",
            "node-1",
        ],
        &[("KUBECONFIG", kubeconfig.to_str().unwrap())],
    );
    kubelet.wait_devices("one slot", |d| d.len() == 1).await;
    kubelet.run_pod("p", 1).await;
    // Four lookups span three rounds: with a doubling backoff (2, 4, 8 s)
    // the fourth would come 14 s after the first.
    wait_for(
        "four lookups of the lease while the CRDs are missing",
        || (requests(&state, "GET", "/gpuleases/p").len() >= 4).then_some(()),
    )
    .await;
    let gets = requests(&state, "GET", "/gpuleases/p").len();
    {
        let mut api = state.lock().unwrap();
        api.crds_missing = false;
        api.leases.insert("p".into(), lease("p"));
    }
    let installed = std::time::Instant::now();
    wait_for("the lease reported once the CRDs are installed", || {
        requests(&state, "PATCH", "/gpuleases/p/status").pop()
    })
    .await;
    let waited = installed.elapsed();
    assert!(
        waited < std::time::Duration::from_secs(5),
        "reported {waited:?} after the CRDs appeared, after {gets} lookups"
    );
    let (_, metrics) = plugin.http_get("/metrics").await;
    assert!(
        !metrics.contains(r#"report_errors_total{target="lease"}"#),
        "a missing CRD is not counted as a report error: {metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reports_node_gpus_and_lease_gpus() {
    let (url, state) = start_api_server().await;
    state.lock().unwrap().leases.insert("p".into(), lease("p"));
    let kubelet = TestKubelet::start().await;
    let config = kubelet.path().join("gpus.yaml");
    write_config(&config, &[(0, "GPU-a", true), (2, "GPU-c", true)]);
    let kubeconfig = write_kubeconfig(kubelet.path(), &url);
    let plugin = Plugin::start_with_env(
        kubelet.path(),
        &[
            "--discovery",
            "static",
            "--static-config",
            config.to_str().unwrap(),
            "--sessions-per-gpu",
            "2",
            "--node-name",
            "node-1",
        ],
        &[("KUBECONFIG", kubeconfig.to_str().unwrap())],
    );
    // Pods the kubelet runs on the plugin's slots, seen by the plugin
    // through PodResources: p on both GPUs (the plugin spreads), q on one.
    kubelet.wait_devices("four slots", |d| d.len() == 4).await;
    let p_ids = kubelet.run_pod("p", 2).await;
    let mut p_gpus: Vec<&str> = p_ids.iter().map(|id| gpu_of(id)).collect();
    p_gpus.sort_unstable();
    assert_eq!(p_gpus, ["GPU-a", "GPU-c"], "{p_ids:?}");
    let q_ids = kubelet.run_pod("q", 1).await;
    assert_eq!(q_ids.len(), 1, "{q_ids:?}");

    // The Node annotation: a merge patch with the GPU list.
    let node_patch = wait_for("node patch", || {
        requests(&state, "PATCH", "/api/v1/nodes/node-1").pop()
    })
    .await;
    assert_eq!(node_patch.content_type, "application/merge-patch+json");
    let value = node_patch.body["metadata"]["annotations"]["gpupool.io/gpus"]
        .as_str()
        .unwrap()
        .to_owned();
    let gpus = gpupool_api::node_gpus::parse(&value).unwrap();
    assert_eq!(gpus.iter().map(|g| g.index).collect::<Vec<_>>(), vec![0, 2]);
    assert_eq!(gpus[1].uuid, "GPU-c");
    assert_eq!(gpus[1].product, "Test GPU");
    assert!(gpus.iter().all(|g| g.healthy));
    assert_eq!(
        node_patch.body["metadata"]["annotations"]["gpupool.io/slots"], "gpupool/slot=4",
        "the healthy slots the kubelet is told of, ahead of allocatable"
    );

    // The lease of pod p: status.gpus and boundAt, on the status subresource.
    let lease_patch = wait_for("lease patch", || {
        requests(&state, "PATCH", "/gpuleases/p/status").pop()
    })
    .await;
    assert_eq!(lease_patch.content_type, "application/merge-patch+json");
    assert_eq!(
        lease_patch.body["status"]["gpus"],
        json!([
            {"index": 0, "uuid": "GPU-a", "product": "Test GPU"},
            {"index": 2, "uuid": "GPU-c", "product": "Test GPU"}
        ])
    );
    assert_eq!(
        lease_patch.body["status"]["gpuIndexes"], "0,2",
        "the GPU column lists both GPUs"
    );
    let bound_at = lease_patch.body["status"]["boundAt"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(bound_at.ends_with('Z'), "{bound_at}");

    // Pod q has no lease yet: looked up, not patched, and retried later.
    wait_for("q looked up twice", || {
        (requests(&state, "GET", "/gpuleases/q").len() >= 2).then_some(())
    })
    .await;
    assert!(requests(&state, "PATCH", "/gpuleases/q/status").is_empty());
    // Its lease turns up as a plugin without the GPU column left it: the
    // right GPUs and boundAt, no gpuIndexes. The column is added and
    // boundAt kept.
    let q_gpu = gpu_of(&q_ids[0]);
    let q_index = if q_gpu == "GPU-a" { 0 } else { 2 };
    let mut q_lease = lease("q");
    q_lease["status"]["gpus"] = json!([{"index": q_index, "uuid": q_gpu, "product": "Test GPU"}]);
    q_lease["status"]["boundAt"] = json!("2026-01-01T00:00:00Z");
    state.lock().unwrap().leases.insert("q".into(), q_lease);
    let q_patch = wait_for("q patched once its lease exists", || {
        requests(&state, "PATCH", "/gpuleases/q/status").pop()
    })
    .await;
    assert_eq!(q_patch.body["status"]["gpus"][0]["uuid"], q_gpu);
    assert_eq!(q_patch.body["status"]["gpuIndexes"], q_index.to_string());
    assert_eq!(q_patch.body["status"]["boundAt"], "2026-01-01T00:00:00Z");

    // p was patched once: boundAt is not rewritten every round.
    assert_eq!(requests(&state, "PATCH", "/gpuleases/p/status").len(), 1);

    // A health change rewrites the Node annotation.
    write_config(&config, &[(0, "GPU-a", true), (2, "GPU-c", false)]);
    let unhealthy = wait_for("node patch with GPU 2 unhealthy", || {
        requests(&state, "PATCH", "/api/v1/nodes/node-1")
            .into_iter()
            .find_map(|r| {
                let value = r.body["metadata"]["annotations"]["gpupool.io/gpus"]
                    .as_str()?
                    .to_owned();
                let gpus = gpupool_api::node_gpus::parse(&value).ok()?;
                (!gpus[1].healthy).then_some(gpus)
            })
    })
    .await;
    assert!(unhealthy[0].healthy);
    let last = requests(&state, "PATCH", "/api/v1/nodes/node-1")
        .pop()
        .unwrap();
    assert_eq!(
        last.body["metadata"]["annotations"]["gpupool.io/slots"], "gpupool/slot=2",
        "an unhealthy GPU's slots are not announced"
    );
    let (_, metrics) = plugin.http_get("/metrics").await;
    assert!(
        metrics.contains("gpupool_device_plugin_lease_reports_total 2"),
        "{metrics}"
    );
}
