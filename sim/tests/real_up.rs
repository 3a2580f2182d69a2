//! `gpupool-sim up --kube-assets DIR` on a real control plane: `kubectl get
//! nodes` shows the simulated nodes with their `gpupool/slot` allocatable, a
//! pod asking for a slot reaches Running with a Bound lease, and a SIGKILL
//! of the simulator leaves no process behind (etcd and the Kubernetes
//! binaries included).
//!
//! Needs `KUBEBUILDER_ASSETS` (`bash .ci/install-k8s.sh`), `kubectl` and the
//! workspace's binaries; without the first two it fails in CI and prints a skip line elsewhere.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use gpupool_sim::cli::detach::alive;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

const SIM: &str = env!("CARGO_BIN_EXE_gpupool-sim");

fn prerequisites() -> Option<PathBuf> {
    let test = "the real `gpupool-sim up` suite";
    let assets = gpupool_sim_apiserver::tool_check::kube_assets(test)?;
    if !gpupool_sim_apiserver::tool_check::runs(test, "kubectl", &["version", "--client"]) {
        return None;
    }
    let dir = Path::new(SIM).parent().expect("target dir");
    assert!(
        dir.join("gpupool-device-plugin").is_file() && dir.join("gpupool-operator").is_file(),
        "the device plugin and operator are not built in {}; run `cargo build --workspace --bins` first",
        dir.display()
    );
    Some(assets)
}

fn kubectl(kubeconfig: &Path, args: &[&str], stdin: Option<&str>) -> (bool, String) {
    use std::io::Write;
    let mut child = std::process::Command::new("kubectl")
        .env("KUBECONFIG", kubeconfig)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kubectl runs");
    if let Some(text) = stdin {
        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(text.as_bytes())
            .expect("write stdin");
    } else {
        drop(child.stdin.take());
    }
    let out = child.wait_with_output().expect("kubectl finishes");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    (
        out.status.success(),
        if out.status.success() { text } else { err },
    )
}

/// Every descendant of `pid`, from /proc.
fn descendants(pid: u32) -> Vec<u32> {
    let mut found = Vec::new();
    let mut frontier = vec![pid];
    while let Some(parent) = frontier.pop() {
        let Ok(entries) = std::fs::read_dir("/proc") else {
            break;
        };
        for e in entries.flatten() {
            let Some(child) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
                continue;
            };
            let ppid = std::fs::read_to_string(format!("/proc/{child}/stat"))
                .ok()
                .and_then(|s| {
                    s.rsplit(')')
                        .next()
                        .and_then(|rest| rest.split_whitespace().nth(1).map(str::to_owned))
                })
                .and_then(|p| p.parse::<u32>().ok());
            if ppid == Some(parent) {
                found.push(child);
                frontier.push(child);
            }
        }
    }
    found
}

const CLASS_AND_POD: &str = r#"
apiVersion: gpupool.io/v1alpha1
kind: GpuLeaseClass
metadata: {name: default}
spec: {default: true}
---
apiVersion: v1
kind: Pod
metadata: {name: train-a, namespace: default}
spec:
  containers:
  - name: main
    image: busybox
    resources: {limits: {gpupool/slot: 1}}
"#;

#[tokio::test]
async fn up_on_a_real_control_plane_runs_a_slot_pod_to_a_bound_lease_and_leaves_no_orphans() {
    let Some(assets) = prerequisites() else {
        return;
    };
    let run_dir = tempfile::tempdir().expect("run dir");
    let kubeconfig = run_dir.path().join("kubeconfig");
    let mut child = Command::new(SIM)
        .args([
            "up",
            "--nodes",
            "2",
            "--gpus-per-node",
            "2",
            "--operator",
            "on",
        ])
        .arg("--kube-assets")
        .arg(&assets)
        .arg("--run-dir")
        .arg(run_dir.path().join("run"))
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("gpupool-sim starts");
    let stdout = child.stdout.take().expect("stdout");
    let mut lines = BufReader::new(stdout).lines();
    let line = tokio::time::timeout(Duration::from_secs(150), lines.next_line())
        .await
        .expect("gpupool-sim printed its ready line within 150 s")
        .expect("read stdout")
        .expect("a line");
    assert_eq!(line, format!("ready kubeconfig={}", kubeconfig.display()));

    let (ok, nodes) = kubectl(
        &kubeconfig,
        &[
            "get",
            "nodes",
            "--no-headers",
            "-o",
            r"custom-columns=NAME:.metadata.name,SLOTS:.status.allocatable.gpupool/slot,READY:.status.conditions[?(@.type=='Ready')].status",
        ],
        None,
    );
    assert!(ok, "{nodes}");
    let rows: Vec<Vec<&str>> = nodes
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(
        rows,
        vec![vec!["node-1", "2", "True"], vec!["node-2", "2", "True"]],
        "{nodes}"
    );

    // Each simulated kubelet heartbeats through its Lease, as a real one does.
    let (ok, leases) = kubectl(
        &kubeconfig,
        &[
            "get",
            "leases",
            "-n",
            "kube-node-lease",
            "-o",
            "jsonpath={.items[*].spec.holderIdentity}",
        ],
        None,
    );
    assert!(ok, "{leases}");
    assert_eq!(leases, "node-1 node-2");

    let (ok, out) = kubectl(&kubeconfig, &["apply", "-f", "-"], Some(CLASS_AND_POD));
    assert!(ok, "{out}");
    let deadline = Instant::now() + Duration::from_secs(60);
    let (phase, lease) = loop {
        let (_, phase) = kubectl(
            &kubeconfig,
            &["get", "pod", "train-a", "-o", "jsonpath={.status.phase}"],
            None,
        );
        let (_, lease) = kubectl(
            &kubeconfig,
            &[
                "get",
                "gpulease",
                "train-a",
                "-o",
                "jsonpath={.status.phase} {.status.node} {.status.gpus}",
            ],
            None,
        );
        if (phase == "Running" && lease.starts_with("Bound")) || Instant::now() >= deadline {
            break (phase, lease);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    assert_eq!(phase, "Running", "lease: {lease}");
    assert!(lease.starts_with("Bound node-"), "{lease}");

    // SIGKILL: the kernel stops every child (pdeathsig), the control plane too.
    let pid = child.id().expect("pid");
    let children = descendants(pid);
    assert!(
        children.len() >= 7,
        "etcd, three Kubernetes binaries, two device plugins and the operator: {children:?}"
    );
    child.start_kill().expect("SIGKILL");
    let _ = child.wait().await;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let left: Vec<u32> = children.iter().copied().filter(|p| alive(*p)).collect();
        if left.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "processes outlived a SIGKILL of gpupool-sim: {left:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
