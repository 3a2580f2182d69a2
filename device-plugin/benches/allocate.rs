//! Allocate latency over the unix socket (10,000 calls: p50/p99) against the
//! real release binary with 8 static GPUs, its idle RSS (with the largest
//! mappings, from `/proc/<pid>/smaps`), and a criterion measurement of one
//! Allocate round trip.
//!
//! `GPUPOOL_BENCH_DISCOVERY=nvml` runs it on the node's real GPUs instead, so
//! the RSS breakdown shows what the NVIDIA library maps
//! (`libnvidia-ml.so.*`) apart from the plugin's own heap.

#![allow(clippy::unwrap_used, missing_docs)]

#[path = "../tests/common/mod.rs"]
mod common;
#[path = "../tests/common/smaps.rs"]
mod smaps;

use std::time::{Duration, Instant};

use common::{Plugin, TestKubelet};
use criterion::Criterion;
use gpupool_device_plugin::proto::deviceplugin::v1beta1 as dp;

const CALLS: usize = 10_000;

fn request(id: &str) -> dp::AllocateRequest {
    dp::AllocateRequest {
        container_requests: vec![dp::ContainerAllocateRequest {
            devices_ids: vec![id.to_owned()],
        }],
    }
}

/// A `/proc/<pid>/status` field in KiB (`VmRSS`, `RssAnon`, `RssFile`).
fn status_kib(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect(field)
}

fn vm_rss_kib(pid: u32) -> u64 {
    status_kib(pid, "VmRSS")
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let rank = ((sorted.len() as f64) * p).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn main() {
    // The test kubelet stands in for another process: it gets its own
    // runtime, so serving it never delays the measured calls.
    let kubelet_runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("kubelet runtime");
    let nvml = std::env::var("GPUPOOL_BENCH_DISCOVERY").as_deref() == Ok("nvml");
    let (kubelet, plugin, ids) = kubelet_runtime.block_on(async {
        let kubelet = TestKubelet::start().await;
        let args: &[&str] = if nvml {
            &["--discovery", "nvml"]
        } else {
            &["--discovery", "static", "--static-gpus", "8"]
        };
        let plugin = Plugin::start(kubelet.path(), args);
        let devices = kubelet
            .wait_devices("the devices", |d| {
                if nvml { !d.is_empty() } else { d.len() == 8 }
            })
            .await;
        let ids: Vec<String> = devices.into_iter().map(|d| d.id).collect();
        (kubelet, plugin, ids)
    });

    // Idle RSS: registered, ListAndWatch open, nothing happening.
    std::thread::sleep(Duration::from_secs(3));
    let idle_rss = vm_rss_kib(plugin.pid());
    println!(
        "idle RSS with {} GPUs ({}): {idle_rss} KiB ({:.2} MiB): {} KiB anonymous, {} KiB file-backed (code)",
        ids.len(),
        if nvml { "nvml" } else { "static" },
        idle_rss as f64 / 1024.0,
        status_kib(plugin.pid(), "RssAnon"),
        status_kib(plugin.pid(), "RssFile"),
    );
    println!("largest mappings (RSS KiB, of which anonymous):");
    let mappings = smaps::mappings(&plugin.pid().to_string());
    for (name, rss, anon) in smaps::rss_by_name(&mappings).iter().take(8) {
        println!("  {rss:>7} {anon:>7}  {name}");
    }
    // What the plugin said while it found the GPUs and registered.
    println!("plugin log until then:");
    for line in plugin.logs().lines().take(40) {
        println!("  {line}");
    }

    // The client drives its connection on the calling thread, so a call's
    // latency is the plugin's answer plus the socket round trip, not thread
    // hand-offs inside the client.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("client runtime");
    let mut client = runtime.block_on(kubelet.plugin());
    let mut latencies = Vec::with_capacity(CALLS);
    runtime.block_on(async {
        for i in 0..CALLS {
            let req = request(&ids[i % ids.len()]);
            let start = Instant::now();
            client.allocate(req).await.expect("allocate");
            latencies.push(start.elapsed());
        }
    });
    latencies.sort();
    println!(
        "Allocate over the unix socket, {CALLS} calls: p50 {:?}, p99 {:?}, max {:?}",
        percentile(&latencies, 0.50),
        percentile(&latencies, 0.99),
        latencies[latencies.len() - 1]
    );
    println!(
        "RSS after {CALLS} Allocate calls: {} KiB",
        vm_rss_kib(plugin.pid())
    );

    let mut criterion = Criterion::default().configure_from_args();
    criterion.bench_function("allocate_one_slot_unix_socket", |b| {
        b.iter(|| {
            runtime
                .block_on(client.allocate(request(&ids[0])))
                .expect("allocate")
        })
    });
    criterion.final_summary();
    drop(client);
    drop(plugin);
    drop(kubelet);
    drop(kubelet_runtime);
}
