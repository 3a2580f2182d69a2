//! Throughput of the simulated API server: small merge patches from kube-rs
//! clients with watchers consuming every change. Prints one JSON line per
//! configuration. Tunables: APISERVER_BENCH_SECONDS (default 5),
//! APISERVER_BENCH_WORKERS (runtime threads, default 2).

use std::time::Duration;

use gpupool_sim_apiserver::bench::{BenchConfig, run};

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let workers = env_or("APISERVER_BENCH_WORKERS", 2) as usize;
    let seconds = env_or("APISERVER_BENCH_SECONDS", 5);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()
        .expect("runtime");
    for (writers, watchers, tls) in [
        (32, 1, false),
        (32, 4, false),
        (32, 16, false),
        (32, 4, true),
    ] {
        let cfg = BenchConfig {
            writers,
            watchers,
            duration: Duration::from_secs(seconds),
            tls,
            ..BenchConfig::default()
        };
        let report = runtime.block_on(run(cfg)).expect("benchmark runs");
        println!("{}", serde_json::to_string(&report).expect("json"));
    }
}
