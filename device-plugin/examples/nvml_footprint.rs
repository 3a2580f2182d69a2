//! What NVML itself costs in memory, apart from the plugin.
//!
//! A process that does nothing but what the plugin's NVML backend does
//! (load and initialise NVML, look up the GPUs, subscribe to XID events,
//! poll) prints its resident memory after each step and, at the end, every
//! mapping that appeared since it started. The plugin's own share is its
//! RSS with NVML minus what this process added.
//!
//! ```text
//! cargo build --release -p gpupool-device-plugin --example nvml_footprint
//! target/release/examples/nvml_footprint             # the plugin's path
//! target/release/examples/nvml_footprint --init-only # nvmlInit alone
//! target/release/examples/nvml_footprint --init-only --no-attach
//! ```
//!
//! Needs a host with the NVIDIA driver; elsewhere it exits 1 naming why.

#![allow(clippy::unwrap_used, missing_docs)]

use std::collections::BTreeMap;
use std::process::ExitCode;

use gpupool_device_plugin::discovery::Discovery;
use gpupool_device_plugin::discovery::nvml::{LiveNvml, NvmlDiscovery};
use nvml_wrapper::Nvml;
use nvml_wrapper::bitmasks::InitFlags;

/// One mapping of `/proc/self/smaps` (keyed by its start address): name, size and
/// resident KiB (of which anonymous).
#[derive(Debug, Clone)]
struct Mapping {
    name: String,
    size_kib: u64,
    rss_kib: u64,
    anon_kib: u64,
}

fn mappings() -> BTreeMap<String, Mapping> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap_or_default();
    let mut out = BTreeMap::new();
    let mut current: Option<(String, Mapping)> = None;
    let kib = |line: &str| -> u64 {
        line.split_whitespace()
            .nth(1)
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if first.contains('-') && !first.ends_with(':') {
            if let Some((start, mapping)) = current.take() {
                out.insert(start, mapping);
            }
            let start = first.split('-').next().unwrap_or(first).to_owned();
            let name = line
                .split_whitespace()
                .nth(5)
                .unwrap_or("[anonymous]")
                .to_owned();
            current = Some((
                start,
                Mapping {
                    name,
                    size_kib: 0,
                    rss_kib: 0,
                    anon_kib: 0,
                },
            ));
        } else if let Some((_, mapping)) = current.as_mut() {
            match first {
                "Size:" => mapping.size_kib = kib(line),
                "Rss:" => mapping.rss_kib = kib(line),
                "Anonymous:" => mapping.anon_kib = kib(line),
                _ => {}
            }
        }
    }
    if let Some((start, mapping)) = current {
        out.insert(start, mapping);
    }
    out
}

fn status(field: &str) -> String {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .map(|v| v.trim().to_owned())
        .unwrap_or_else(|| "?".to_owned())
}

fn stage(name: &str) {
    println!(
        "{name:<28} VmRSS {:>10}  RssAnon {:>10}  RssFile {:>10}  threads {}",
        status("VmRSS"),
        status("RssAnon"),
        status("RssFile"),
        status("Threads"),
    );
}

/// Mappings that are new since `before`, or grew, summed by name (largest
/// first); a new unnamed mapping is listed with its size, so a malloc arena
/// (64 MiB reserved) tells itself apart from a buffer.
fn report_growth(before: &BTreeMap<String, Mapping>) {
    let after = mappings();
    let mut by_name: BTreeMap<String, (u64, u64, u64)> = BTreeMap::new();
    let mut anonymous = Vec::new();
    for (start, mapping) in &after {
        let old = before.get(start);
        let rss = mapping.rss_kib - old.map_or(0, |m| m.rss_kib.min(mapping.rss_kib));
        let anon = mapping.anon_kib - old.map_or(0, |m| m.anon_kib.min(mapping.anon_kib));
        if rss == 0 {
            continue;
        }
        if mapping.name == "[anonymous]" && old.is_none() {
            anonymous.push((start.clone(), mapping.clone()));
        }
        let entry = by_name.entry(mapping.name.clone()).or_default();
        entry.0 += rss;
        entry.1 += anon;
        entry.2 += u64::from(old.is_none());
    }
    let mut rows: Vec<_> = by_name.into_iter().collect();
    rows.sort_by_key(|(_, (rss, _, _))| std::cmp::Reverse(*rss));
    println!(
        "resident growth since start, by mapping (KiB rss, of which anonymous; new mappings):"
    );
    for (name, (rss, anon, new)) in rows {
        println!("  {rss:>7} {anon:>7}  {new:>3} new  {name}");
    }
    anonymous.sort_by_key(|(_, m)| std::cmp::Reverse(m.rss_kib));
    println!("new unnamed mappings (KiB size, rss):");
    for (start, mapping) in anonymous.iter().take(12) {
        println!(
            "  {start}  size {:>8}  rss {:>7}",
            mapping.size_kib, mapping.rss_kib
        );
    }
}

fn main() -> ExitCode {
    let init_only = std::env::args().any(|a| a == "--init-only");
    let no_attach = std::env::args().any(|a| a == "--no-attach");
    let before = mappings();
    stage("start");
    if init_only {
        let flags = if no_attach {
            InitFlags::NO_ATTACH
        } else {
            InitFlags::empty()
        };
        let nvml = match Nvml::init_with_flags(flags) {
            Ok(nvml) => nvml,
            Err(e) => {
                eprintln!("nvml_footprint: NVML did not load: {e}");
                return ExitCode::FAILURE;
            }
        };
        stage(if no_attach {
            "nvmlInit (no attach)"
        } else {
            "nvmlInit"
        });
        // With NO_ATTACH, NVML attaches a GPU when it is first asked for.
        match nvml.device_by_index(0).and_then(|gpu| gpu.uuid()) {
            Ok(_) => stage("first GPU's UUID"),
            Err(e) => eprintln!("nvml_footprint: GPU 0: {e}"),
        }
        report_growth(&before);
        return ExitCode::SUCCESS;
    }
    let source = match LiveNvml::open() {
        Ok(source) => source,
        Err(e) => {
            eprintln!("nvml_footprint: {e}");
            return ExitCode::FAILURE;
        }
    };
    stage("nvmlInit + XID event set");
    let mut discovery = match NvmlDiscovery::new(source) {
        Ok(discovery) => discovery,
        Err(e) => {
            eprintln!("nvml_footprint: {e}");
            return ExitCode::FAILURE;
        }
    };
    stage("GPUs listed");
    for round in 1..=3 {
        match discovery.poll() {
            Ok(_) => stage(&format!("poll {round} (waits 1 s)")),
            Err(e) => {
                eprintln!("nvml_footprint: poll: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    report_growth(&before);
    ExitCode::SUCCESS
}
