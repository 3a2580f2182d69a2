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
    let output = tokio::time::timeout(
        Duration::from_secs(150),
        tokio::process::Command::new(SIM)
            // The simulated backend: these runs do not ask for a real control plane.
            .env_remove("KUBEBUILDER_ASSETS")
            .args(["demo", "--timeout-seconds", "100"])
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
    if with_operator && !stdout.contains("operator is not running") {
        for needle in [
            "NAME",
            "POSITION",
            "admitted to node-",
            "queued",
            "preempted for default/primary-",
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
