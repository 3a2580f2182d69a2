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

#[path = "../tests/common/smaps.rs"]
mod smaps;

use smaps::Mapping;
use std::process::ExitCode;

use gpupool_device_plugin::discovery::Discovery;
use gpupool_device_plugin::discovery::nvml::{LiveNvml, NvmlDiscovery};
use nvml_wrapper::Nvml;
use nvml_wrapper::bitmasks::InitFlags;

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
fn report_growth(before: &[Mapping]) {
    let before: BTreeMap<&str, &Mapping> = before.iter().map(|m| (m.start.as_str(), m)).collect();
    let mut grown = Vec::new();
    let mut new_unnamed = Vec::new();
    for mapping in smaps::mappings("self") {
        let old = before.get(mapping.start.as_str());
        let mut growth = Mapping {
            rss_kib: mapping.rss_kib - old.map_or(0, |m| m.rss_kib.min(mapping.rss_kib)),
            anon_kib: mapping.anon_kib - old.map_or(0, |m| m.anon_kib.min(mapping.anon_kib)),
            ..mapping
        };
        if growth.rss_kib == 0 {
            continue;
        }
        if old.is_none() {
            if growth.name == "[anonymous]" {
                new_unnamed.push(growth.clone());
            }
            growth.name = format!("(new) {}", growth.name);
        }
        grown.push(growth);
    }
    println!("resident growth since start, by mapping (KiB rss, of which anonymous):");
    for (name, rss, anon) in smaps::rss_by_name(&grown) {
        println!("  {rss:>7} {anon:>7}  {name}");
    }
    new_unnamed.sort_by_key(|m| std::cmp::Reverse(m.rss_kib));
    println!("new unnamed mappings (KiB size, rss):");
    for m in new_unnamed.iter().take(12) {
        println!(
            "  {}  size {:>8}  rss {:>7}",
            m.start, m.size_kib, m.rss_kib
        );
    }
}

fn main() -> ExitCode {
    let init_only = std::env::args().any(|a| a == "--init-only");
    let no_attach = std::env::args().any(|a| a == "--no-attach");
    let before = smaps::mappings("self");
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
