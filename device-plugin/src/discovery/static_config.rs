//! Static discovery: GPUs given by `--static-gpus N` or by a YAML file
//! (`--static-config FILE`) that is re-read whenever it changes, so that
//! kind clusters, CI and the simulator can add GPUs and flip their health.

use std::path::PathBuf;
use std::time::Duration;

use gpupool_api::NodeGpu;
use serde::Deserialize;

use super::{Discovery, DiscoveryError, Gpu, Polled, validate_uuid};

/// Product name of GPUs synthesised by `--static-gpus`, and the default for
/// file entries without one.
pub const SIMULATED_PRODUCT: &str = "Simulated GPU";
/// Vendor of GPUs synthesised by `--static-gpus`, and the default for file
/// entries without one. Not `NVIDIA`, so no NVIDIA device node is handed out
/// for a GPU that does not exist.
pub const SIMULATED_VENDOR: &str = "Simulated";
/// Memory reported for each GPU synthesised by `--static-gpus`.
pub const SIMULATED_MEMORY_MIB: u64 = 16_384;

/// How often the config file is checked for changes.
pub const CONFIG_POLL_INTERVAL: Duration = Duration::from_millis(250);

/// One entry of the `--static-config` YAML list.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct StaticGpu {
    index: u32,
    uuid: String,
    #[serde(default)]
    product: Option<String>,
    #[serde(default)]
    vendor: Option<String>,
    #[serde(default, rename = "memoryMiB")]
    memory_mib: u64,
    #[serde(default = "healthy_by_default")]
    healthy: bool,
    /// NUMA node the GPU is attached to; absent means no topology.
    #[serde(default)]
    numa_node: Option<u32>,
}

fn healthy_by_default() -> bool {
    true
}

/// `N` GPUs with stable, node-specific UUIDs, all Healthy, indices `0..N`.
///
/// The UUID mixes a hash of `node_name` with the index, so the same node
/// always gets the same UUIDs and two nodes never share one.
pub fn synthesise(count: u32, node_name: &str) -> Vec<NodeGpu> {
    let node_hash = fnv1a32(node_name.as_bytes());
    (0..count)
        .map(|index| NodeGpu {
            index,
            uuid: format!("GPU-{node_hash:08x}-0000-4000-8000-{index:012x}"),
            product: SIMULATED_PRODUCT.to_owned(),
            vendor: SIMULATED_VENDOR.to_owned(),
            memory_mib: SIMULATED_MEMORY_MIB,
            healthy: true,
        })
        .collect()
}

fn fnv1a32(bytes: &[u8]) -> u32 {
    bytes.iter().fold(0x811c_9dc5_u32, |hash, b| {
        (hash ^ u32::from(*b)).wrapping_mul(0x0100_0193)
    })
}

/// Parses the `--static-config` file's text into the node's view of its
/// GPUs (what the `gpupool.io/gpus` annotation shows); `path` only names the
/// file in errors. GPUs come back in index order.
pub fn parse_config(path: &str, text: &str) -> Result<Vec<NodeGpu>, DiscoveryError> {
    Ok(parse_gpus(path, text)?
        .into_iter()
        .map(|g| g.node)
        .collect())
}

/// Parses the `--static-config` file's text into GPUs, each with its
/// optional `numaNode`; `path` only names the file in errors. GPUs come back
/// in index order.
pub fn parse_gpus(path: &str, text: &str) -> Result<Vec<Gpu>, DiscoveryError> {
    let entries: Vec<StaticGpu> = if text.trim().is_empty() {
        Vec::new()
    } else {
        serde_yaml::from_str(text).map_err(|e| {
            DiscoveryError::InvalidConfig(format!(
                "--static-config {path}: not a YAML list of GPUs \
                 {{index, uuid, product, vendor, memoryMiB, healthy, numaNode}}: {e}"
            ))
        })?
    };
    let mut gpus: Vec<Gpu> = Vec::with_capacity(entries.len());
    for (position, entry) in entries.into_iter().enumerate() {
        let invalid = |what: String| {
            DiscoveryError::InvalidConfig(format!(
                "--static-config {path}: entry {position} (index {}): {what}",
                entry.index
            ))
        };
        validate_uuid(&entry.uuid).map_err(invalid)?;
        if let Some(other) = gpus.iter().find(|g| g.node.index == entry.index) {
            return Err(invalid(format!(
                "index {} is already used by uuid {}",
                entry.index, other.node.uuid
            )));
        }
        if gpus.iter().any(|g| g.node.uuid == entry.uuid) {
            return Err(invalid(format!("uuid {} is listed twice", entry.uuid)));
        }
        gpus.push(Gpu {
            node: NodeGpu {
                index: entry.index,
                uuid: entry.uuid,
                product: entry
                    .product
                    .unwrap_or_else(|| SIMULATED_PRODUCT.to_owned()),
                vendor: entry.vendor.unwrap_or_else(|| SIMULATED_VENDOR.to_owned()),
                memory_mib: entry.memory_mib,
                healthy: entry.healthy,
            },
            minor: None,
            numa_node: entry.numa_node,
        });
    }
    gpus.sort_by_key(|g| g.node.index);
    Ok(gpus)
}

/// The `static` backend.
pub enum StaticDiscovery {
    /// A fixed list (`--static-gpus`).
    Fixed {
        /// The GPUs.
        gpus: Vec<Gpu>,
        /// Whether the list was returned once already.
        polled: bool,
    },
    /// A YAML file, re-read when its contents change.
    File {
        /// The file.
        path: PathBuf,
        /// Contents of the last successful read.
        last: Option<String>,
    },
}

impl StaticDiscovery {
    /// A backend returning `gpus` forever.
    pub fn fixed(gpus: Vec<Gpu>) -> Self {
        StaticDiscovery::Fixed {
            gpus,
            polled: false,
        }
    }

    /// A backend watching the file at `path`.
    pub fn file(path: PathBuf) -> Self {
        StaticDiscovery::File { path, last: None }
    }

    /// Reads and parses the file now (used at startup, so a bad file stops
    /// the plugin with exit code 2 before it serves anything).
    pub fn load(path: &std::path::Path) -> Result<(String, Vec<Gpu>), DiscoveryError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| DiscoveryError::ReadConfig {
            path: shown.clone(),
            source,
        })?;
        let gpus = parse_gpus(&shown, &text)?;
        Ok((text, gpus))
    }
}

impl Discovery for StaticDiscovery {
    fn poll(&mut self) -> Result<Polled, DiscoveryError> {
        match self {
            StaticDiscovery::Fixed { gpus, polled } => {
                // Nothing can change: poll rarely.
                if *polled {
                    std::thread::sleep(Duration::from_secs(5));
                    return Ok(Polled::Unchanged);
                }
                *polled = true;
                Ok(Polled::Gpus(gpus.clone()))
            }
            StaticDiscovery::File { path, last } => {
                if last.is_some() {
                    std::thread::sleep(CONFIG_POLL_INTERVAL);
                }
                let shown = path.display().to_string();
                let text = std::fs::read_to_string(&*path).map_err(|source| {
                    DiscoveryError::ReadConfig {
                        path: shown.clone(),
                        source,
                    }
                })?;
                if last.as_deref() == Some(text.as_str()) {
                    return Ok(Polled::Unchanged);
                }
                // A bad edit leaves `last` as it was, so the monitor keeps the
                // last good list and the next good edit is picked up.
                let gpus = parse_gpus(&shown, &text)?;
                *last = Some(text);
                Ok(Polled::Gpus(gpus))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synthesised_uuids_are_stable_distinct_and_valid() {
        let a = synthesise(3, "node-1");
        assert_eq!(a, synthesise(3, "node-1"));
        let b = synthesise(3, "node-2");
        assert_ne!(a[0].uuid, b[0].uuid);
        assert_ne!(a[0].uuid, a[1].uuid);
        for gpu in &a {
            validate_uuid(&gpu.uuid).expect("valid uuid");
            assert_eq!(gpu.uuid.len(), 40, "{}", gpu.uuid);
        }
        assert_eq!(a.iter().map(|g| g.index).collect::<Vec<_>>(), vec![0, 1, 2]);
    }

    #[test]
    fn config_parses_defaults_and_sorts() {
        let gpus = parse_config(
            "f.yaml",
            "- {index: 3, uuid: GPU-b, product: H100, vendor: NVIDIA, memoryMiB: 81559, healthy: false}\n\
             - {index: 1, uuid: GPU-a}\n",
        )
        .expect("valid");
        assert_eq!(gpus[0].index, 1);
        assert_eq!(gpus[0].product, SIMULATED_PRODUCT);
        assert!(gpus[0].healthy);
        assert_eq!(gpus[1].memory_mib, 81559);
        assert!(!gpus[1].healthy);
        assert!(
            parse_config("f.yaml", "")
                .expect("empty is zero GPUs")
                .is_empty()
        );
    }

    #[test]
    fn config_numa_node_is_optional() {
        let gpus = parse_gpus(
            "f.yaml",
            "- {index: 0, uuid: GPU-a, numaNode: 1}\n- {index: 1, uuid: GPU-b}\n",
        )
        .expect("valid");
        assert_eq!(gpus[0].numa_node, Some(1));
        assert_eq!(gpus[1].numa_node, None);
        let err = parse_gpus("f.yaml", "- {index: 0, uuid: GPU-a, numaNode: -1}")
            .expect_err("negative")
            .to_string();
        assert!(err.contains("--static-config f.yaml"), "{err}");
    }

    #[test]
    fn config_errors_name_the_flag_file_and_entry() {
        let cases = [
            ("- {index: 0, uuid: GPU-a, colour: red}", "colour"),
            (
                "- {index: 0, uuid: GPU-a}\n- {index: 0, uuid: GPU-b}",
                "index 0 is already used",
            ),
            (
                "- {index: 0, uuid: GPU-a}\n- {index: 1, uuid: GPU-a}",
                "listed twice",
            ),
            ("- {index: 0, uuid: 'a b'}", "contains"),
            ("index: 0", "not a YAML list"),
        ];
        for (text, needle) in cases {
            let err = parse_config("gpus.yaml", text).expect_err(text).to_string();
            assert!(err.contains("--static-config gpus.yaml"), "{err}");
            assert!(err.contains(needle), "{needle}: {err}");
        }
    }

    #[test]
    fn file_backend_follows_changes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("gpus.yaml");
        std::fs::write(&path, "- {index: 0, uuid: GPU-a}\n").expect("write");
        let mut backend = StaticDiscovery::file(path.clone());
        let gpus = |polled| match polled {
            Polled::Gpus(gpus) => gpus,
            Polled::Unchanged => panic!("expected a list"),
        };
        assert!(gpus(backend.poll().expect("first"))[0].node.healthy);
        assert_eq!(backend.poll().expect("same text"), Polled::Unchanged);
        std::fs::write(&path, "- {index: 0, uuid: GPU-a, healthy: false}\n").expect("write");
        assert!(!gpus(backend.poll().expect("second"))[0].node.healthy);
        std::fs::write(&path, "not: [valid").expect("write");
        assert!(backend.poll().is_err());
        // The bad edit is not remembered: fixing it is picked up.
        std::fs::write(&path, "- {index: 0, uuid: GPU-a, numaNode: 1}\n").expect("write");
        assert_eq!(gpus(backend.poll().expect("fixed"))[0].numa_node, Some(1));
    }
}
