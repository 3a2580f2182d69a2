//! The real `kubectl-gpupool` binary as a tenant bound to the namespaced
//! `view` or `edit` role sees the API: its namespace's GpuLeases and Pods
//! may be read, while every namespace's leases, the cluster-scoped
//! GpuLeaseClasses and Nodes are refused with 403, as kube-apiserver's RBAC
//! refuses them. The simulated API server does not enforce RBAC, so a small
//! HTTP server here answers exactly those requests.

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpupool_api::{GpuLease, GpuLeaseSpec, GpuLeaseStatus, LeaseGpu, LeasePhase, Role};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

const PLUGIN: &str = env!("CARGO_BIN_EXE_kubectl-gpupool");
const LEASES: &str = "/apis/gpupool.io/v1alpha1";

/// An API server that knows one tenant: `ml`'s leases and pods are
/// readable, anything cluster-wide is forbidden, and `secret` is another
/// team's namespace.
struct TenantApi {
    port: u16,
    /// Every path asked for, with its method.
    requests: Arc<Mutex<Vec<String>>>,
}

fn forbidden(resource: &str, group: &str, scope: &str) -> (u16, Value) {
    let in_group = if group.is_empty() {
        String::new()
    } else {
        format!(" in API group \"{group}\"")
    };
    (
        403,
        json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": format!("{resource} is forbidden: User \"tenant\" cannot list resource \"{resource}\"{in_group} {scope}"),
            "reason": "Forbidden", "details": {"kind": resource}, "code": 403,
        }),
    )
}

fn lease(name: &str, phase: LeasePhase, position: Option<u32>, node: Option<&str>) -> GpuLease {
    let mut l = GpuLease::new(
        name,
        GpuLeaseSpec {
            class_name: "default".into(),
            pod_name: name.into(),
            pod_uid: format!("uid-{name}"),
            role: Role::Primary,
            slots: 2,
        },
    );
    l.metadata.namespace = Some("ml".into());
    l.metadata.resource_version = Some("7".into());
    let at = Time(jiff::Timestamp::now() - jiff::SignedDuration::from_secs(30));
    l.status = Some(GpuLeaseStatus {
        phase,
        sequence: Some(5),
        position,
        queued_at: Some(at.clone()),
        admitted_at: node.map(|_| at.clone()),
        bound_at: node.map(|_| at.clone()),
        node: node.map(str::to_owned),
        gpus: node
            .map(|n| {
                (0..2)
                    .map(|i| LeaseGpu {
                        index: i,
                        uuid: format!("GPU-{n}-{i}"),
                        product: Some("Sim GPU".into()),
                    })
                    .collect()
            })
            .unwrap_or_default(),
        message: (phase == LeasePhase::Queued)
            .then(|| "waiting: 1 primary ahead; needs 2 slots on one node".to_owned()),
        ..Default::default()
    });
    l
}

fn pod(name: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "ml", "uid": format!("uid-{name}"), "resourceVersion": "3"},
        "spec": {"containers": [{"name": "work", "image": "sim",
            "resources": {"limits": {"gpupool/slot": "2"}}}]},
    })
}

/// The answer to `GET path`: a status and a JSON body, or `None` for a
/// watch, which is held open with no event.
fn answer(path: &str) -> Option<(u16, Value)> {
    let (path, query) = path.split_once('?').unwrap_or((path, ""));
    if query
        .split('&')
        .any(|p| p == "watch=true" || p == "watch=1")
    {
        return None;
    }
    let leases = json!({
        "apiVersion": "gpupool.io/v1alpha1", "kind": "GpuLeaseList",
        "metadata": {"resourceVersion": "9"},
        "items": [
            lease("train-a", LeasePhase::Bound, None, Some("node-1")),
            lease("train-c", LeasePhase::Queued, Some(2), None),
        ],
    });
    Some(match path {
        p if p == format!("{LEASES}/gpuleases") => {
            forbidden("gpuleases", "gpupool.io", "at the cluster scope")
        }
        p if p == format!("{LEASES}/namespaces/ml/gpuleases") => (200, leases),
        p if p == format!("{LEASES}/namespaces/secret/gpuleases") => {
            forbidden("gpuleases", "gpupool.io", "in the namespace \"secret\"")
        }
        p if p == format!("{LEASES}/gpuleaseclasses") => {
            forbidden("gpuleaseclasses", "gpupool.io", "at the cluster scope")
        }
        "/api/v1/nodes" => forbidden("nodes", "", "at the cluster scope"),
        "/api/v1/namespaces/ml/pods/train-a" => (200, pod("train-a")),
        "/api/v1/namespaces/ml/pods/train-c" => (200, pod("train-c")),
        _ => (
            404,
            json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                "message": "the server could not find the requested resource", "reason": "NotFound", "code": 404}),
        ),
    })
}

async fn serve_one(stream: TcpStream, requests: Arc<Mutex<Vec<String>>>) {
    let (read, mut write) = stream.into_split();
    let mut reader = BufReader::new(read);
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).await.unwrap_or(0) == 0 {
            return;
        }
        let mut parts = line.split_whitespace();
        let (method, path) = (
            parts.next().unwrap_or("").to_owned(),
            parts.next().unwrap_or("").to_owned(),
        );
        let mut length = 0usize;
        loop {
            let mut header = String::new();
            if reader.read_line(&mut header).await.unwrap_or(0) == 0 {
                return;
            }
            let header = header.trim_end();
            if header.is_empty() {
                break;
            }
            if let Some((k, v)) = header.split_once(':')
                && k.eq_ignore_ascii_case("content-length")
            {
                length = v.trim().parse().unwrap_or(0);
            }
        }
        let mut body = vec![0; length];
        if reader.read_exact(&mut body).await.is_err() {
            return;
        }
        requests.lock().unwrap().push(format!("{method} {path}"));
        let Some((code, value)) = answer(&path).filter(|_| method == "GET") else {
            if method == "GET" {
                // A watch: headers, then nothing until the client leaves.
                let head = "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n";
                let _ = write.write_all(head.as_bytes()).await;
                let mut rest = Vec::new();
                let _ = reader.read_to_end(&mut rest).await;
            }
            return;
        };
        let body = value.to_string();
        let head = format!(
            "HTTP/1.1 {code} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        if write.write_all(head.as_bytes()).await.is_err()
            || write.write_all(body.as_bytes()).await.is_err()
        {
            return;
        }
    }
}

impl TenantApi {
    async fn start() -> TenantApi {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let requests: Arc<Mutex<Vec<String>>> = Arc::default();
        let seen = requests.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(serve_one(stream, seen.clone()));
            }
        });
        TenantApi { port, requests }
    }

    /// A kubeconfig for the tenant, its context in namespace `ml`.
    fn kubeconfig(&self, dir: &Path) -> std::path::PathBuf {
        let path = dir.join("kubeconfig");
        std::fs::write(
            &path,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster: {{server: 'http://127.0.0.1:{}'}}\nusers:\n- name: tenant\n  user: {{token: tenant-token}}\ncontexts:\n- name: ml\n  context: {{cluster: c, user: tenant, namespace: ml}}\ncurrent-context: ml\n",
                self.port
            ),
        )
        .unwrap();
        path
    }

    fn writes(&self) -> Vec<String> {
        self.requests
            .lock()
            .unwrap()
            .iter()
            .filter(|r| !r.starts_with("GET "))
            .cloned()
            .collect()
    }
}

struct Run {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

async fn plugin(kubeconfig: &Path, args: &[&str]) -> Run {
    let out = tokio::process::Command::new(PLUGIN)
        .args(args)
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .env_remove("KUBECONFIG")
        .output()
        .await
        .expect("the plugin runs");
    Run {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

async fn ok(kubeconfig: &Path, args: &[&str]) -> String {
    let r = plugin(kubeconfig, args).await;
    assert_eq!(
        r.code,
        Some(0),
        "{args:?}: stdout {} stderr {}",
        r.stdout,
        r.stderr
    );
    assert!(r.stderr.is_empty(), "{args:?}: {}", r.stderr);
    r.stdout
}

const LEASES_LINE: &str = "cannot list GpuLeases in all namespaces: forbidden; showing namespace ml, at the positions the operator wrote (status.position)";

#[tokio::test]
async fn queue_why_and_top_show_a_namespace_readers_leases_and_say_what_they_cannot_see() {
    let api = TenantApi::start().await;
    let dir = tempfile::tempdir().unwrap();
    let kc = api.kubeconfig(dir.path());

    let queue = ok(&kc, &["queue"]).await;
    let lines: Vec<&str> = queue.lines().collect();
    assert_eq!(lines[0], "CLASS default; 1 primary waiting", "{queue}");
    let row: Vec<&str> = lines[2].split_whitespace().take(5).collect();
    assert_eq!(row, ["2", "train-c", "ml", "primary", "2"], "{queue}");
    assert!(
        queue.ends_with(&format!(
            "\n{LEASES_LINE}\ncannot list GpuLeaseClasses: forbidden; classes are shown by name, without their capacity or ordering\n"
        )),
        "{queue}"
    );
    let view: Value = serde_json::from_str(&ok(&kc, &["queue", "-o", "json"]).await).unwrap();
    assert_eq!(view["positionsFrom"], "leaseStatus");
    assert_eq!(view["namespace"], "ml");
    assert_eq!(view["classes"][0]["primaries"][0]["position"], 2);
    assert!(view["classes"][0].get("capacity").is_none(), "{view}");
    let unseen: Vec<&str> = view["unseen"]
        .as_array()
        .unwrap()
        .iter()
        .map(|u| u["what"].as_str().unwrap())
        .collect();
    assert_eq!(unseen, ["GpuLeases in all namespaces", "GpuLeaseClasses"]);

    // -A asks for what cannot be had: an error that says what to do.
    let r = plugin(&kc, &["queue", "-A"]).await;
    assert_eq!(r.code, Some(1), "{}", r.stderr);
    assert!(r.stdout.is_empty());
    assert!(
        r.stderr.starts_with(
            "kubectl-gpupool: cannot list gpuleases in all namespaces: forbidden (gpuleases is forbidden: User \"tenant\""
        ),
        "{}",
        r.stderr
    );
    assert!(
        r.stderr.ends_with("); without -A it shows namespace ml\n"),
        "{}",
        r.stderr
    );
    // A namespace the tenant has no rights in is refused, by name.
    let r = plugin(&kc, &["queue", "-n", "secret"]).await;
    assert_eq!(r.code, Some(1));
    assert!(
        r.stderr
            .starts_with("kubectl-gpupool: cannot list gpuleases in namespace secret: forbidden ("),
        "{}",
        r.stderr
    );

    let why = ok(&kc, &["why", "train-c"]).await;
    let lines: Vec<&str> = why.lines().collect();
    assert_eq!(lines.len(), 4, "{why}");
    assert!(
        lines[0].contains("at position 2 among waiting primaries (sequence 5)."),
        "{why}"
    );
    assert!(
        lines[0].ends_with("The operator says: 1 primary ahead; needs 2 slots on one node."),
        "{why}"
    );
    assert_eq!(
        &lines[1..],
        [
            LEASES_LINE,
            "cannot list GpuLeaseClasses: forbidden; the class's capacity and ordering are not shown",
            "cannot list Nodes: forbidden; node fit is not shown",
        ]
    );
    let why = ok(&kc, &["why", "train-a"]).await;
    assert_eq!(why.lines().count(), 1, "{why}");
    assert!(
        why.contains("is a primary holding GPUs 0 and 1 on node-1"),
        "{why}"
    );

    let top = ok(&kc, &["top"]).await;
    let lines: Vec<&str> = top.lines().collect();
    let squeeze = |l: &str| l.split_whitespace().collect::<Vec<_>>().join(" ");
    assert_eq!(
        squeeze(lines[0]),
        "NODE GPU PRODUCT POD ROLE PHASE SINCE NOTE"
    );
    assert!(
        squeeze(lines[1]).starts_with("node-1 0 Sim GPU ml/train-a primary Bound"),
        "{top}"
    );
    assert!(
        squeeze(lines[2]).starts_with("node-1 1 Sim GPU ml/train-a primary Bound"),
        "{top}"
    );
    assert_eq!(
        &lines[4..],
        [
            "cannot list GpuLeases in all namespaces: forbidden; showing namespace ml: only the GPUs its pods hold",
            "cannot list GpuLeaseClasses: forbidden; class capacity is not shown",
            "cannot list Nodes: forbidden; showing the GPUs that leases hold, without the nodes' free GPUs or their health",
        ],
        "{top}"
    );
    let view: Value = serde_json::from_str(&ok(&kc, &["top", "-o", "json"]).await).unwrap();
    assert_eq!(view["held"][1]["gpu"], 1);
    assert_eq!(view["nodes"], json!([]));
    assert_eq!(view["unseen"].as_array().map(Vec::len), Some(3));

    // --watch follows the namespace's leases and does not watch classes.
    let mut child = tokio::process::Command::new(PLUGIN)
        .args(["queue", "-o", "json", "--watch", "--kubeconfig"])
        .arg(&kc)
        .env_remove("KUBECONFIG")
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let first = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await
        .expect("a first view within 30 s")
        .unwrap()
        .expect("the watch runs");
    let first: Value = serde_json::from_str(&first).unwrap();
    assert_eq!(first["classes"][0]["primaries"][0]["pod"], "train-c");
    assert_eq!(first["unseen"].as_array().map(Vec::len), Some(2));
    child.kill().await.unwrap();
    let watched: BTreeMap<String, usize> = api
        .requests
        .lock()
        .unwrap()
        .iter()
        .filter(|r| r.contains("watch=true"))
        .fold(BTreeMap::new(), |mut m, r| {
            let path = r.split('?').next().unwrap_or("").to_owned();
            *m.entry(path).or_default() += 1;
            m
        });
    assert!(
        watched
            .keys()
            .all(|p| p == &format!("GET {LEASES}/namespaces/ml/gpuleases")),
        "{watched:?}"
    );

    assert!(api.writes().is_empty(), "reads only: {:?}", api.writes());
}
