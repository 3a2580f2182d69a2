//! `gpupool-sim bench` on a small cluster: every figure docs/performance.md
//! quotes is present and consistent with the run.
//!
//! Needs the workspace's binaries: `cargo build --workspace --bins`.

use std::path::Path;
use std::time::Duration;

use serde_json::Value;

const SIM: &str = env!("CARGO_BIN_EXE_gpupool-sim");

#[tokio::test]
async fn a_small_bench_reports_every_figure() {
    let dir = Path::new(SIM).parent().expect("target dir");
    if !dir.join("gpupool-operator").is_file() || !dir.join("gpupool-device-plugin").is_file() {
        panic!(
            "the operator and device plugin are not built in {}; run `cargo build --workspace --bins` first",
            dir.display()
        );
    }
    let output = tokio::time::timeout(
        Duration::from_secs(240),
        tokio::process::Command::new(SIM)
            // The simulated backend: the write counts come from its API server.
            .env_remove("KUBEBUILDER_ASSETS")
            .args([
                "bench",
                "--nodes",
                "2",
                "--gpus-per-node",
                "2",
                "--pods",
                "12",
                "--run-seconds",
                "1",
                "--timeout-seconds",
                "200",
            ])
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("the bench ends within its bound")
    .expect("the bench runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(0), "bench failed:\n{stderr}");
    let figures: Value = serde_json::from_slice(&output.stdout).expect("the bench prints JSON");
    assert_eq!(figures["pods"], 12);
    assert_eq!(figures["failedCreates"]["count"], 0, "{figures}");
    assert_eq!(figures["apiServerRawPatchesFailed"], 0, "{figures}");
    assert_eq!(figures["peakLeases"], 12, "{figures}");
    for positive in [
        "admissionsPerSecondBurst",
        "admissionsPerSecondOverall",
        "apiServerRawPatchesPerSecond",
        "operatorPeakRssMiB",
        "operatorPeakOpenFiles",
        "writesPerAdmission",
    ] {
        assert!(
            figures[positive].as_f64().is_some_and(|v| v > 0.0),
            "{positive} missing or not positive: {figures}"
        );
    }
    // The breakdown adds up to the total and names the writes every
    // admission needs: the lease, its status and the pod's ungate patch.
    let by_route = figures["writesPerAdmissionByRoute"]
        .as_object()
        .unwrap_or_else(|| panic!("writesPerAdmissionByRoute missing: {figures}"));
    let sum: f64 = by_route.values().filter_map(Value::as_f64).sum();
    let total = figures["writesPerAdmission"].as_f64().unwrap_or_default();
    assert!((sum - total).abs() < 1e-9, "{figures}");
    for route in ["POST gpuleases", "PATCH gpuleases/status", "PATCH pods"] {
        assert!(
            share(by_route, |r| r == route).is_some_and(|v| v > 0.0),
            "{route} missing from the breakdown: {figures}"
        );
    }
    // Every client's writes per admission: the operator's among them, and
    // the bench's own pod creates (one per pod) as admin.
    let by_client = figures["apiWritesPerAdmissionByClient"]
        .as_object()
        .unwrap_or_else(|| panic!("apiWritesPerAdmissionByClient missing: {figures}"));
    assert!(
        share(by_client, is_operator).is_some_and(|v| (v - total).abs() < 1e-9),
        "the operator's share is writesPerAdmission: {figures}"
    );
    for client in ["admin", "system:kube-scheduler", "system:node:*"] {
        assert!(
            share(by_client, |c| c == client).is_some_and(|v| v > 0.0),
            "{client} missing from the clients: {figures}"
        );
    }
    // During the burst, at least the operator's two admission writes per
    // pod (lease status and pod patch), both made before the pod is seen
    // ungated; what the scheduler and kubelets write follows the ungate,
    // so in a burst of four it may fall after the window.
    let burst = figures["apiWritesPerBurstAdmissionByClient"]
        .as_object()
        .unwrap_or_else(|| panic!("apiWritesPerBurstAdmissionByClient missing: {figures}"));
    assert!(
        share(burst, is_operator).is_some_and(|v| v >= 2.0),
        "{figures}"
    );
    // The operator's own account of its passes is read from its metrics.
    assert!(
        figures["operatorPasses"]["count"]
            .as_u64()
            .is_some_and(|n| n > 0),
        "{figures}"
    );
    assert!(
        figures["operatorPasses"]["meanMs"]
            .as_f64()
            .is_some_and(|ms| ms > 0.0),
        "{figures}"
    );
    // And of its webhook: every pod create and every ungate patch was a
    // review it answered.
    assert!(
        figures["webhookReviewMs"]["count"]
            .as_u64()
            .is_some_and(|n| n >= 12),
        "{figures}"
    );
    // 4 slots, 12 pods: the burst fills the slots, the other 8 follow as
    // slots free up, each one a slot-free → ungate sample.
    assert_eq!(figures["burstAdmissions"], 4, "{figures}");
    // The class opened only once every lease was Queued, and the bench says
    // how long that took after the last create.
    assert!(
        figures["allQueuedAfterCreatesSeconds"]
            .as_f64()
            .is_some_and(|s| s >= 0.0),
        "{figures}"
    );
    assert_eq!(figures["slotFreeToUngateMs"]["samples"], 8, "{figures}");
}

/// The figure of the first key in `figures` that `which` picks.
fn share(figures: &serde_json::Map<String, Value>, which: impl Fn(&str) -> bool) -> Option<f64> {
    figures
        .iter()
        .find(|(key, _)| which(key))
        .and_then(|(_, v)| v.as_f64())
}

/// The operator's service account.
fn is_operator(user: &str) -> bool {
    user.ends_with(":gpupool-operator")
}
