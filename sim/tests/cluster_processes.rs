//! `gpupool-sim up` as a process: the `ready` line, its fault controls,
//! clean exit on SIGTERM, no orphans when it is killed, and a clear error
//! for a missing binary.
//!
//! Needs the workspace's binaries: `cargo build --workspace --bins`.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use gpupool_sim::cli::detach::alive;
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
async fn admin(run_dir: &Path, method: &str, path: &str) -> (u16, String) {
    admin_with_body(run_dir, method, path, "").await
}

/// Like [`admin`], with a request body.
async fn admin_with_body(run_dir: &Path, method: &str, path: &str, body: &str) -> (u16, String) {
    let url = std::fs::read_to_string(run_dir.join("admin-url")).expect("admin-url file");
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

/// The child pids of the cluster running in `run_dir`, through its fault controls.
async fn child_pids(run_dir: &Path) -> Vec<u32> {
    let (code, body) = admin(run_dir, "GET", "/sim/status").await;
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
    let pids = child_pids(sim.run_dir.path()).await;
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
    let pids = child_pids(sim.run_dir.path()).await;

    // Controls: a node's plugin killed and restarted, a kubelet restarted.
    let (code, body) = admin(sim.run_dir.path(), "POST", "/sim/nodes/node-1/plugin/kill").await;
    assert_eq!(code, 200, "{body}");
    let (code, body) = admin(
        sim.run_dir.path(),
        "POST",
        "/sim/nodes/node-1/plugin/restart",
    )
    .await;
    assert_eq!(code, 200, "{body}");
    let (code, body) = admin(
        sim.run_dir.path(),
        "POST",
        "/sim/nodes/node-2/kubelet/restart",
    )
    .await;
    assert_eq!(code, 200, "{body}");
    let (code, body) = admin(
        sim.run_dir.path(),
        "POST",
        "/sim/nodes/node-9/kubelet/restart",
    )
    .await;
    assert_eq!(code, 404, "{body}");
    assert!(body.contains("node-9"), "{body}");
    let (code, body) = admin(sim.run_dir.path(), "POST", "/sim/operator/explode").await;
    assert_eq!(code, 404, "{body}");
    // API faults are delegated to the API server's controls.
    let (code, body) = admin_with_body(
        sim.run_dir.path(),
        "PUT",
        "/sim/faults",
        r#"{"errorRate":2.0}"#,
    )
    .await;
    assert_eq!(code, 400, "{body}");
    assert!(body.contains("errorRate"), "{body}");
    let (code, body) = admin_with_body(
        sim.run_dir.path(),
        "PUT",
        "/sim/faults",
        r#"{"errorRate":0.0,"latencyMs":1}"#,
    )
    .await;
    assert_eq!(code, 200, "{body}");
    let (code, body) = admin(sim.run_dir.path(), "DELETE", "/sim/faults").await;
    assert_eq!(code, 200, "{body}");
    let now = child_pids(sim.run_dir.path()).await;
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

/// Runs `gpupool-sim ARGS` to its end (bounded): (exit code, stdout, stderr).
async fn run_sim(args: &[&str]) -> (Option<i32>, String, String) {
    let output = tokio::time::timeout(
        Duration::from_secs(120),
        Command::new(SIM)
            // The simulated backend: these runs do not ask for a real control plane.
            .env_remove("KUBEBUILDER_ASSETS")
            .env_remove("GPUPOOL_SIM_RUN_DIR")
            .args(args)
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("gpupool-sim returns within 120 s")
    .expect("gpupool-sim runs");
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// Starts a detached 2-node cluster in `dir`; returns the supervisor's pid.
async fn up_detached(dir: &Path) -> u32 {
    require_binaries();
    let dir_text = dir.to_str().expect("utf-8 dir");
    let (code, stdout, stderr) = run_sim(&[
        "up",
        "--detach",
        "--nodes",
        "2",
        "--gpus-per-node",
        "1",
        "--operator",
        "off",
        "--run-dir",
        dir_text,
    ])
    .await;
    assert_eq!(code, Some(0), "{stdout}\n{stderr}");
    assert_eq!(
        stdout,
        format!("export KUBECONFIG={dir_text}/kubeconfig\n"),
        "stdout is the one line a shell can eval"
    );
    assert!(
        stderr.contains(&format!("gpupool-sim down --run-dir {dir_text}")),
        "says how to stop it: {stderr}"
    );
    assert!(
        !stderr.contains("INFO") && !stderr.contains("WARN"),
        "no log lines in the terminal: {stderr}"
    );
    assert!(dir.join("kubeconfig").is_file());
    let log = std::fs::read_to_string(dir.join("logs/gpupool-sim.log")).expect("log file");
    assert!(log.contains("INFO"), "logs go to the run directory: {log}");
    std::fs::read_to_string(dir.join("gpupool-sim.pid"))
        .expect("pid file")
        .trim()
        .parse()
        .expect("a pid")
}

#[tokio::test]
async fn detached_up_returns_when_ready_and_down_stops_everything() {
    let dir = tempfile::tempdir().expect("run dir");
    let dir_text = dir.path().to_str().expect("utf-8");
    let supervisor = up_detached(dir.path()).await;
    assert!(alive(supervisor), "the supervisor runs after up returned");
    let children = child_pids(dir.path()).await;
    assert_eq!(
        children.len(),
        2,
        "one device plugin per node: {children:?}"
    );
    assert!(children.iter().all(|p| alive(*p)));

    // A second cluster in the same directory is refused, naming the first.
    let (code, stdout, stderr) = run_sim(&["up", "--detach", "--run-dir", dir_text]).await;
    assert_eq!(code, Some(1), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("already running") && stderr.contains(&supervisor.to_string()),
        "{stderr}"
    );
    assert!(stdout.is_empty(), "{stdout}");

    let (code, _, stderr) = run_sim(&["down", "--run-dir", dir_text]).await;
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stderr.contains("stopped the cluster"), "{stderr}");
    let all: Vec<u32> = children.iter().copied().chain([supervisor]).collect();
    assert!(
        wait_gone(&all).await.is_empty(),
        "down returns once the supervisor and its children are gone"
    );
    assert!(!dir.path().join("gpupool-sim.pid").exists());

    // Nothing runs there any more: said once, naming the directory.
    let (code, stdout, stderr) = run_sim(&["down", "--run-dir", dir_text]).await;
    assert_eq!(code, Some(1), "{stdout}\n{stderr}");
    assert!(
        stderr.starts_with("gpupool-sim: no simulated cluster is running in ")
            && stderr.contains(dir_text),
        "{stderr}"
    );
    assert_eq!(stderr.lines().count(), 1, "one line: {stderr}");
}

#[tokio::test]
async fn sigkill_of_a_detached_supervisor_leaves_no_child_behind() {
    let dir = tempfile::tempdir().expect("run dir");
    let supervisor = up_detached(dir.path()).await;
    let children = child_pids(dir.path()).await;
    assert_eq!(children.len(), 2, "{children:?}");
    let pid =
        rustix::process::Pid::from_raw(i32::try_from(supervisor).expect("fits")).expect("nonzero");
    rustix::process::kill_process(pid, rustix::process::Signal::KILL).expect("SIGKILL");
    let all: Vec<u32> = children.into_iter().chain([supervisor]).collect();
    let left = wait_gone(&all).await;
    assert!(
        left.is_empty(),
        "processes still running after the supervisor was killed: {left:?}"
    );
}

#[tokio::test]
async fn foreground_up_keeps_log_lines_out_of_the_terminal() {
    require_binaries();
    let run_dir = tempfile::tempdir().expect("run dir");
    let mut child = Command::new(SIM)
        .env_remove("KUBEBUILDER_ASSETS")
        .env("RUST_LOG", "debug")
        .args([
            "up",
            "--nodes",
            "1",
            "--gpus-per-node",
            "1",
            "--operator",
            "off",
            "--run-dir",
        ])
        .arg(run_dir.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("gpupool-sim starts");
    let stdout = child.stdout.take().expect("stdout");
    let line = tokio::time::timeout(
        Duration::from_secs(60),
        BufReader::new(stdout).lines().next_line(),
    )
    .await
    .expect("ready within 60 s")
    .expect("read")
    .expect("a line");
    assert!(line.starts_with("ready kubeconfig="), "{line}");
    let pid =
        rustix::process::Pid::from_raw(i32::try_from(child.id().expect("pid")).expect("fits"))
            .expect("nonzero");
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).expect("SIGTERM");
    let output = tokio::time::timeout(Duration::from_secs(30), child.wait_with_output())
        .await
        .expect("exits")
        .expect("output");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains(&format!(
            "logs in {}",
            run_dir.path().join("logs").display()
        )),
        "says where the logs are: {stderr}"
    );
    assert_eq!(stderr.matches("logs in").count(), 1, "said once: {stderr}");
    assert!(
        !stderr.contains("DEBUG") && !stderr.contains("INFO") && !stderr.contains('\u{1b}'),
        "no log lines and no colour in the terminal: {stderr}"
    );
    let log = std::fs::read_to_string(run_dir.path().join("logs/gpupool-sim.log")).expect("log");
    assert!(log.contains("DEBUG"), "RUST_LOG sets the file's level");
}
