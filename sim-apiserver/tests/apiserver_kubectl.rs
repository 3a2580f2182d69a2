//! The real `kubectl` against the simulated API server: discovery, applying
//! the CRDs, creating/getting/describing/deleting custom resources, printer
//! columns, output formats, watches and validation errors. Without `kubectl`
//! on the PATH each test fails in CI and is skipped elsewhere (see
//! `gpupool_sim_apiserver::tool_check`).

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use gpupool_sim_apiserver::{ADMIN_TOKEN, ApiServer, ApiServerConfig, RunningApiServer};
use serde_json::json;

struct Kubectl {
    kubeconfig: PathBuf,
    cache: PathBuf,
    _dir: tempfile::TempDir,
}

impl Kubectl {
    fn new(server: &RunningApiServer) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let kubeconfig = dir.path().join("kubeconfig");
        server
            .write_kubeconfig(&kubeconfig, ADMIN_TOKEN)
            .expect("kubeconfig");
        let cache = dir.path().join("cache");
        Kubectl {
            kubeconfig,
            cache,
            _dir: dir,
        }
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut c = Command::new("kubectl");
        c.arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .arg("--cache-dir")
            .arg(&self.cache)
            .arg("--request-timeout=20s")
            .args(args)
            .env_remove("KUBECONFIG");
        c
    }

    fn run(&self, args: &[&str]) -> Output {
        self.command(args).output().expect("kubectl runs")
    }

    fn ok(&self, args: &[&str]) -> String {
        let out = self.run(args);
        assert!(
            out.status.success(),
            "kubectl {args:?} failed: {}\n{}",
            String::from_utf8_lossy(&out.stderr),
            String::from_utf8_lossy(&out.stdout)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn with_stdin(&self, args: &[&str], stdin: &str) -> Output {
        let mut child = self
            .command(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("kubectl spawns");
        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(stdin.as_bytes())
            .expect("write stdin");
        child.wait_with_output().expect("kubectl finishes")
    }
}

fn kubectl_present() -> bool {
    gpupool_sim_apiserver::tool_check::runs(
        "the kubectl tests",
        "kubectl",
        &["version", "--client"],
    )
}

fn crds_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../crds")
}

async fn server() -> RunningApiServer {
    ApiServer::start(ApiServerConfig::default())
        .await
        .expect("server starts")
}

const LEASE: &str = r#"apiVersion: gpupool.io/v1alpha1
kind: GpuLease
metadata:
  name: train-0
  namespace: default
spec:
  className: default
  podName: train-0
  podUID: 6f1c
  role: primary
  slots: 1
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_resources_and_crd_apply() {
    if !kubectl_present() {
        return;
    }
    let s = server().await;
    let k = Kubectl::new(&s);
    let crds = crds_dir();
    let out = k.ok(&[
        "apply",
        "-f",
        crds.to_str().expect("utf8"),
        "--validate=false",
    ]);
    assert!(out.contains("gpuleases.gpupool.io created"), "{out}");
    assert!(out.contains("gpuleaseclasses.gpupool.io created"), "{out}");
    let res = k.ok(&["api-resources"]);
    for want in [
        "gpuleases",
        "gpuleaseclasses",
        "pods",
        "leases",
        "customresourcedefinitions",
        "mutatingwebhookconfigurations",
    ] {
        assert!(
            res.lines().any(|l| l.starts_with(want)),
            "{want} missing from:\n{res}"
        );
    }
    let gl = res
        .lines()
        .find(|l| l.starts_with("gpuleases "))
        .expect("gpuleases row");
    assert!(
        gl.contains(" gl ")
            && gl.contains("gpupool.io/v1alpha1")
            && gl.contains("true")
            && gl.contains("GpuLease"),
        "{gl}"
    );
    // Applying again is a no-op patch through the same path.
    let again = k.ok(&[
        "apply",
        "-f",
        crds.to_str().expect("utf8"),
        "--validate=false",
    ]);
    assert!(
        again.contains("unchanged") || again.contains("configured"),
        "{again}"
    );
    let crd_list = k.ok(&["get", "crd"]);
    assert!(crd_list.contains("gpuleases.gpupool.io"), "{crd_list}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn custom_resource_lifecycle_and_printing() {
    if !kubectl_present() {
        return;
    }
    let s = server().await;
    let k = Kubectl::new(&s);
    k.ok(&[
        "apply",
        "-f",
        crds_dir().to_str().expect("utf8"),
        "--validate=false",
    ]);
    let out = k.with_stdin(&["create", "-f", "-", "--validate=false"], LEASE);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("gpulease.gpupool.io/train-0 created"));

    let mut lease = s
        .admin()
        .get("gpupool.io", "gpuleases", "default", "train-0")
        .expect("stored");
    lease["status"] = json!({"phase": "Bound", "position": 1, "node": "node-1", "gpus": [{"index": 0, "uuid": "GPU-a"}, {"index": 2, "uuid": "GPU-b"}], "gpuIndexes": "0,2"});
    s.admin()
        .put("gpupool.io", "gpuleases", lease)
        .expect("status set");

    let table = k.ok(&["get", "gpuleases"]);
    let header: Vec<&str> = table
        .lines()
        .next()
        .expect("header")
        .split_whitespace()
        .collect();
    assert_eq!(
        header,
        vec![
            "NAME", "CLASS", "ROLE", "PHASE", "POSITION", "NODE", "GPU", "AGE"
        ],
        "{table}"
    );
    let row: Vec<&str> = table
        .lines()
        .nth(1)
        .expect("row")
        .split_whitespace()
        .collect();
    assert_eq!(
        &row[..7],
        &[
            "train-0", "default", "primary", "Bound", "1", "node-1", "0,2"
        ],
        "{table}"
    );

    let short = k.ok(&["get", "gl", "-A"]);
    assert!(
        short
            .lines()
            .next()
            .expect("header")
            .starts_with("NAMESPACE"),
        "{short}"
    );
    let yaml = k.ok(&["get", "gpulease", "train-0", "-o", "yaml"]);
    assert!(
        yaml.contains("kind: GpuLease") && yaml.contains("podUID: 6f1c") && yaml.contains("uid:"),
        "{yaml}"
    );
    let jp = k.ok(&[
        "get",
        "gpulease",
        "train-0",
        "-o",
        "jsonpath={.spec.className}/{.status.gpus[*].uuid}",
    ]);
    assert_eq!(jp, "default/GPU-a GPU-b");
    let explained = k.ok(&["explain", "gpulease.status.gpuIndexes"]);
    assert!(
        explained.contains("FIELD: gpuIndexes <string>")
            && explained.contains("ascending and comma-separated"),
        "{explained}"
    );
    let described = k.ok(&["describe", "gpulease", "train-0"]);
    assert!(
        described.contains("Name:")
            && described.contains("train-0")
            && described.contains("Pod UID:"),
        "{described}"
    );
    let deleted = k.ok(&["delete", "gpulease", "train-0"]);
    assert!(deleted.contains("deleted"), "{deleted}");
    let gone = k.run(&["get", "gpulease", "train-0"]);
    assert!(!gone.status.success());
    assert!(
        String::from_utf8_lossy(&gone.stderr).contains("NotFound"),
        "{}",
        String::from_utf8_lossy(&gone.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_custom_resource_is_rejected_naming_the_field() {
    if !kubectl_present() {
        return;
    }
    let s = server().await;
    let k = Kubectl::new(&s);
    k.ok(&[
        "apply",
        "-f",
        crds_dir().to_str().expect("utf8"),
        "--validate=false",
    ]);
    let bad = LEASE.replace("slots: 1", "slots: 0");
    let out = k.with_stdin(&["create", "-f", "-", "--validate=false"], &bad);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(
            "spec.slots: Invalid value: 0: spec.slots in body should be greater than or equal to 1"
        ),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_watch_receives_updates() {
    if !kubectl_present() {
        return;
    }
    let s = server().await;
    let k = Kubectl::new(&s);
    k.ok(&[
        "apply",
        "-f",
        crds_dir().to_str().expect("utf8"),
        "--validate=false",
    ]);
    let out = k.with_stdin(&["create", "-f", "-", "--validate=false"], LEASE);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut child = k
        .command(&["get", "gpuleases", "-w"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("kubectl get -w");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let first = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("header line");
    assert!(first.starts_with("NAME"), "{first}");
    let row = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("initial row");
    assert!(row.starts_with("train-0"), "{row}");
    let mut lease = s
        .admin()
        .get("gpupool.io", "gpuleases", "default", "train-0")
        .expect("stored");
    lease["status"] = json!({"phase": "Admitted", "node": "node-7"});
    s.admin()
        .put("gpupool.io", "gpuleases", lease)
        .expect("update");
    let mut seen = Vec::new();
    let mut found = false;
    for _ in 0..5 {
        match rx.recv_timeout(Duration::from_secs(20)) {
            Ok(l) => {
                found = l.contains("Admitted") && l.contains("node-7");
                seen.push(l);
                if found {
                    break;
                }
            }
            Err(_) => break,
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    assert!(found, "update not printed: {seen:?}");
}

const TYPO: &str = r#"apiVersion: v1
kind: ConfigMap
metadata:
  name: typo
dta:
  a: b
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_validates_fields_through_the_server() {
    if !kubectl_present() {
        return;
    }
    let server = server().await;
    let k = Kubectl::new(&server);
    // No --validate=false: kubectl learns from /openapi/v3 that the server
    // validates fields, and its default (strict) refuses the typo.
    let out = k.with_stdin(&["create", "-f", "-"], TYPO);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(
            "ConfigMap in version \"v1\" cannot be handled as a ConfigMap: strict decoding error: unknown field \"dta\""
        ),
        "{err}"
    );
    assert!(
        server
            .admin()
            .get("", "configmaps", "default", "typo")
            .is_none()
    );
    let out = k.with_stdin(&["create", "-f", "-", "--validate=warn"], TYPO);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("Warning: unknown field \"dta\""),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stored = server
        .admin()
        .get("", "configmaps", "default", "typo")
        .expect("created");
    assert!(stored.get("dta").is_none(), "the unknown field is dropped");
    // The CRDs apply with kubectl's default validation too.
    k.ok(&["apply", "-f", crds_dir().to_str().expect("utf-8 path")]);
    assert!(
        server
            .admin()
            .get(
                "apiextensions.k8s.io",
                "customresourcedefinitions",
                "",
                "gpuleases.gpupool.io"
            )
            .is_some()
    );
}
