//! `gpupool-sim up` as a process: the `ready` line, its fault controls,
//! clean exit on SIGTERM, no orphans when it is killed, and a clear error
//! for a missing binary.
//!
//! Needs the workspace's binaries: `cargo build --workspace --bins`.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, Command};

const SIM: &str = env!("CARGO_BIN_EXE_gpupool-sim");

fn require_binaries() {
    let dir = Path::new(SIM).parent().expect("target dir");
    assert!(
        dir.join("gpupool-device-plugin").is_file(),
        "gpupool-device-plugin is not built in {}; run `cargo build --workspace --bins` first",
        dir.display()
    );
}

struct Sim {
    child: Child,
    kubeconfig: PathBuf,
    run_dir: tempfile::TempDir,
}

async fn start_sim(extra: &[&str]) -> Sim {
    require_binaries();
    let run_dir = tempfile::tempdir().expect("run dir");
    let mut child = Command::new(SIM)
        // The simulated backend: these runs do not ask for a real control plane.
        .env_remove("KUBEBUILDER_ASSETS")
        .args([
            "up",
            "--nodes",
            "2",
            "--gpus-per-node",
            "1",
            "--operator",
            "off",
            "--run-dir",
        ])
        .arg(run_dir.path())
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("gpupool-sim starts");
    let stdout = child.stdout.take().expect("stdout");
    let mut lines = BufReader::new(stdout).lines();
    let line = tokio::time::timeout(Duration::from_secs(60), lines.next_line())
        .await
        .expect("gpupool-sim printed its ready line within 60 s")
        .expect("read stdout")
        .expect("a line");
    let kubeconfig = line
        .strip_prefix("ready kubeconfig=")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"));
    assert!(Path::new(kubeconfig).is_file(), "{kubeconfig} exists");
    Sim {
        child,
        kubeconfig: PathBuf::from(kubeconfig),
        run_dir,
    }
}

/// One HTTP/1.1 request to the admin endpoint; returns (status, body).
async fn admin(sim: &Sim, method: &str, path: &str) -> (u16, String) {
    admin_with_body(sim, method, path, "").await
}

/// Like [`admin`], with a request body.
async fn admin_with_body(sim: &Sim, method: &str, path: &str, body: &str) -> (u16, String) {
    let url =
        std::fs::read_to_string(sim.run_dir.path().join("admin-url")).expect("admin-url file");
    let addr = url.trim().trim_start_matches("http://").to_owned();
    let mut stream = tokio::net::TcpStream::connect(&addr)
        .await
        .expect("connect admin");
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.expect("send");
    let mut response = String::new();
    tokio::time::timeout(
        Duration::from_secs(30),
        stream.read_to_string(&mut response),
    )
    .await
    .expect("admin answers")
    .expect("read");
    let code = response
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = response
        .split("\r\n\r\n")
        .nth(1)
        .unwrap_or_default()
        .to_owned();
    (code, body)
}

fn alive(pid: u32) -> bool {
    // A zombie (state Z) has exited; only its parent's reaping is missing.
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit(')')
                .next()
                .map(|rest| !rest.trim_start().starts_with('Z'))
        })
        .unwrap_or(false)
}

async fn child_pids(sim: &Sim) -> Vec<u32> {
    let (code, body) = admin(sim, "GET", "/sim/status").await;
    assert_eq!(code, 200, "{body}");
    let status: serde_json::Value = serde_json::from_str(&body).expect("status JSON");
    status["childPids"]
        .as_array()
        .expect("childPids")
        .iter()
        .filter_map(|p| p.as_u64().and_then(|p| u32::try_from(p).ok()))
        .collect()
}

async fn wait_gone(pids: &[u32]) -> Vec<u32> {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let left: Vec<u32> = pids.iter().copied().filter(|p| alive(*p)).collect();
        if left.is_empty() || Instant::now() >= deadline {
            return left;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn sigkill_of_the_simulator_leaves_no_child_behind() {
    let mut sim = start_sim(&[]).await;
    let pids = child_pids(&sim).await;
    assert_eq!(pids.len(), 2, "one device plugin per node: {pids:?}");
    assert!(pids.iter().all(|p| alive(*p)));
    sim.child.start_kill().expect("SIGKILL gpupool-sim");
    let _ = sim.child.wait().await;
    let left = wait_gone(&pids).await;
    assert!(
        left.is_empty(),
        "children still running after gpupool-sim was killed: {left:?}"
    );
}

#[tokio::test]
async fn sigterm_stops_every_child_and_exits_zero_and_controls_work() {
    let mut sim = start_sim(&[]).await;
    let pids = child_pids(&sim).await;

    // Controls: a node's plugin killed and restarted, a kubelet restarted.
    let (code, body) = admin(&sim, "POST", "/sim/nodes/node-1/plugin/kill").await;
    assert_eq!(code, 200, "{body}");
    let (code, body) = admin(&sim, "POST", "/sim/nodes/node-1/plugin/restart").await;
    assert_eq!(code, 200, "{body}");
    let (code, body) = admin(&sim, "POST", "/sim/nodes/node-2/kubelet/restart").await;
    assert_eq!(code, 200, "{body}");
    let (code, body) = admin(&sim, "POST", "/sim/nodes/node-9/kubelet/restart").await;
    assert_eq!(code, 404, "{body}");
    assert!(body.contains("node-9"), "{body}");
    let (code, body) = admin(&sim, "POST", "/sim/operator/explode").await;
    assert_eq!(code, 404, "{body}");
    // API faults are delegated to the API server's controls.
    let (code, body) = admin_with_body(&sim, "PUT", "/sim/faults", r#"{"errorRate":2.0}"#).await;
    assert_eq!(code, 400, "{body}");
    assert!(body.contains("errorRate"), "{body}");
    let (code, body) = admin_with_body(
        &sim,
        "PUT",
        "/sim/faults",
        r#"{"errorRate":0.0,"latencyMs":1}"#,
    )
    .await;
    assert_eq!(code, 200, "{body}");
    let (code, body) = admin(&sim, "DELETE", "/sim/faults").await;
    assert_eq!(code, 200, "{body}");
    let now = child_pids(&sim).await;
    assert_eq!(now.len(), 2, "{now:?}");
    assert!(!now.contains(&pids[0]), "node-1's plugin is a new process");
    assert!(sim.kubeconfig.starts_with(sim.run_dir.path()));

    let pid = sim.child.id().expect("pid");
    let sim_pid =
        rustix::process::Pid::from_raw(i32::try_from(pid).expect("pid fits")).expect("nonzero");
    rustix::process::kill_process(sim_pid, rustix::process::Signal::TERM).expect("SIGTERM");
    let status = tokio::time::timeout(Duration::from_secs(30), sim.child.wait())
        .await
        .expect("exits within 30 s")
        .expect("wait");
    assert_eq!(status.code(), Some(0), "clean shutdown exits 0");
    let all: Vec<u32> = pids.into_iter().chain(now).collect();
    assert!(
        wait_gone(&all).await.is_empty(),
        "no child left after SIGTERM"
    );
}

#[tokio::test]
async fn a_missing_binary_is_named_with_the_build_command() {
    let output = Command::new(SIM)
        // The simulated backend: these runs do not ask for a real control plane.
        .env_remove("KUBEBUILDER_ASSETS")
        .args([
            "up",
            "--device-plugin-bin",
            "/nonexistent/gpupool-device-plugin",
        ])
        .output()
        .await
        .expect("runs");
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("/nonexistent/gpupool-device-plugin")
            && stderr.contains("cargo build --workspace --bins"),
        "{stderr}"
    );
    assert!(output.stdout.is_empty(), "no ready line");

    let output = Command::new(SIM)
        // The simulated backend: these runs do not ask for a real control plane.
        .env_remove("KUBEBUILDER_ASSETS")
        .args(["up", "--nodes", "0"])
        .output()
        .await
        .expect("runs");
    assert_eq!(output.status.code(), Some(2), "bad flag");
    assert!(String::from_utf8_lossy(&output.stderr).contains("--nodes"));
}
