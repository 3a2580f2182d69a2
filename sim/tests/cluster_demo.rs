//! `gpupool-sim demo` runs to completion, narrating only what the leases
//! (or, without the operator, the pods) say.
//!
//! Needs the workspace's binaries: `cargo build --workspace --bins`.

use std::path::Path;
use std::time::Duration;

const SIM: &str = env!("CARGO_BIN_EXE_gpupool-sim");

#[tokio::test]
async fn demo_finishes_and_shows_the_queue_move() {
    let dir = Path::new(SIM).parent().expect("target dir");
    assert!(
        dir.join("gpupool-device-plugin").is_file(),
        "gpupool-device-plugin is not built in {}; run `cargo build --workspace --bins` first",
        dir.display()
    );
    let with_operator = dir.join("gpupool-operator").is_file();
    let run_dir = tempfile::tempdir().expect("run dir");
    let output = tokio::time::timeout(
        Duration::from_secs(150),
        tokio::process::Command::new(SIM)
            // The simulated backend: these runs do not ask for a real control plane.
            .env_remove("KUBEBUILDER_ASSETS")
            .args(["demo", "--timeout-seconds", "100", "--run-dir"])
            .arg(run_dir.path())
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("the demo ends within its bound")
    .expect("the demo runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(
        output.status.code(),
        Some(0),
        "demo failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(stdout.contains("primary-6 arrives"), "{stdout}");
    // The story only: log lines go to the run directory, said once.
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !stdout.contains("INFO") && !stderr.contains("INFO") && !stderr.contains("WARN"),
        "no log lines in the terminal:\n{stdout}\n{stderr}"
    );
    assert_eq!(
        stdout
            .matches(&format!(
                "logs in {}",
                run_dir.path().join("logs").display()
            ))
            .count(),
        1,
        "{stdout}"
    );
    let log = std::fs::read_to_string(run_dir.path().join("logs/gpupool-sim.log")).expect("log");
    assert!(
        log.contains("INFO"),
        "the simulator's log lines are in its log file"
    );
    // It says first what the story is about.
    let roles = stdout
        .find("  primary  gets GPUs")
        .expect("the demo says what a primary is");
    assert!(
        stdout
            .find("  helper   uses only GPUs")
            .is_some_and(|h| h > roles)
            && stdout.find("primary-1 arrives").is_some_and(|a| a > roles),
        "{stdout}"
    );
    // Counts read as words: "asking for 1 GPU", "asking for 2 GPUs".
    assert!(!stdout.contains("(s)"), "{stdout}");
    assert!(stdout.contains("asking for 1 GPU,"), "{stdout}");
    assert!(stdout.contains("asking for 2 GPUs,"), "{stdout}");
    if with_operator && !stdout.contains("operator is not running") {
        for needle in [
            "NAME",
            "POSITION",
            "admitted to node-",
            "queued",
            "preempted for default/primary-",
            // Every helper is told admitted, however fast it was bound.
            "helper-1: admitted to node-",
            "helper-2: admitted to node-",
            "helper-3: admitted to node-",
            // The story uses the table's word for a running pod.
            ": bound to node-",
            // A preempted helper's row goes with its pod, and the story says so.
            "(preempted for default/primary-2); its pod and lease are gone",
            "primaries were admitted in FIFO (sequence) order",
            "no helper was admitted while a primary waited",
        ] {
            assert!(
                stdout.contains(needle),
                "{needle:?} missing from:\n{stdout}"
            );
        }
    } else {
        assert!(stdout.contains("The operator is not running"), "{stdout}");
        assert!(stdout.contains("running on node-"), "{stdout}");
    }
}
