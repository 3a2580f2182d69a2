//! GPU discovery: one trait, three backends (`nvml`, `static`, `auto`), and
//! the monitor thread that polls the chosen backend and publishes every
//! change of the node's GPU list (health included).

pub mod nvml;
pub mod static_config;

use std::sync::mpsc;
use std::time::Duration;

use gpupool_api::NodeGpu;

/// Longest GPU UUID accepted, so that a slot's device ID (`<uuid>-s<k>`)
/// stays within the kubelet's 63-character limit.
pub const MAX_UUID_LEN: usize = 59;

/// One discovered GPU: what the Node annotation shows, plus what Allocate
/// needs to hand out its device node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gpu {
    /// Index, UUID, product, vendor, memory and health.
    pub node: NodeGpu,
    /// Minor number of `/dev/nvidia<minor>`; `None` means "same as the index"
    /// (static GPUs).
    pub minor: Option<u32>,
}

impl Gpu {
    /// The device-node number: the driver's minor number, else the index.
    pub fn device_minor(&self) -> u32 {
        self.minor.unwrap_or(self.node.index)
    }
}

impl From<NodeGpu> for Gpu {
    fn from(node: NodeGpu) -> Self {
        Gpu { node, minor: None }
    }
}

/// A source of the node's GPUs.
///
/// Backends are polled from one dedicated thread, so they may block (NVML
/// waits for XID events) and need not be `Send` once created there.
pub trait Discovery {
    /// Returns the node's GPUs as they are now, health included, in index
    /// order. May block for up to about a second; the monitor calls it in a
    /// loop, so the blocking sets the polling rhythm.
    fn poll(&mut self) -> Result<Vec<Gpu>, DiscoveryError>;
}

/// Why discovery failed.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    /// The NVIDIA management library could not be loaded or initialised.
    #[error(
        "--discovery nvml: the NVIDIA management library (libnvidia-ml.so.1) could not be loaded or initialised: {0}"
    )]
    NvmlUnavailable(String),
    /// An NVML query failed.
    #[error("NVML query failed: {0}")]
    Nvml(String),
    /// The static GPU list is invalid; the message names the flag and the entry.
    #[error("{0}")]
    InvalidConfig(String),
    /// The static config file could not be read.
    #[error("--static-config {path}: cannot read file: {source}")]
    ReadConfig {
        /// The file.
        path: String,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },
    /// The monitor thread could not be started or stopped before reporting.
    #[error("GPU discovery thread failed: {0}")]
    Thread(String),
}

impl DiscoveryError {
    /// True for errors in what the user configured (exit code 2), false for
    /// failures of the host (exit code 1).
    pub fn is_config_error(&self) -> bool {
        matches!(
            self,
            DiscoveryError::InvalidConfig(_) | DiscoveryError::ReadConfig { .. }
        )
    }
}

/// Checks that a UUID can become part of a device ID: non-empty, at most
/// [`MAX_UUID_LEN`] characters of `[A-Za-z0-9._-]`.
pub fn validate_uuid(uuid: &str) -> Result<(), String> {
    if uuid.is_empty() {
        return Err("uuid is empty".to_owned());
    }
    if uuid.len() > MAX_UUID_LEN {
        return Err(format!(
            "uuid {uuid:?} is longer than {MAX_UUID_LEN} characters"
        ));
    }
    if let Some(bad) = uuid
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')))
    {
        return Err(format!(
            "uuid {uuid:?} contains {bad:?}; only letters, digits, '-', '_' and '.' are allowed"
        ));
    }
    Ok(())
}

/// `--devices`: which GPUs to advertise, by index or UUID. Empty keeps all.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeviceFilter {
    indices: Vec<u32>,
    uuids: Vec<String>,
}

impl DeviceFilter {
    /// Parses a comma-separated list of indices and UUIDs (`0,2,GPU-…`).
    pub fn parse(list: &str) -> Result<Self, String> {
        let mut filter = DeviceFilter::default();
        for item in list.split(',').map(str::trim) {
            if item.is_empty() {
                return Err(format!(
                    "--devices {list:?}: empty entry; give comma-separated GPU indices or UUIDs"
                ));
            }
            if item.bytes().all(|b| b.is_ascii_digit()) {
                let index = item
                    .parse()
                    .map_err(|_| format!("--devices: index {item:?} is out of range"))?;
                filter.indices.push(index);
            } else {
                validate_uuid(item).map_err(|e| format!("--devices: {e}"))?;
                filter.uuids.push(item.to_owned());
            }
        }
        Ok(filter)
    }

    /// True when no filter was given.
    pub fn is_empty(&self) -> bool {
        self.indices.is_empty() && self.uuids.is_empty()
    }

    /// Keeps the GPUs the filter names; indices are kept as they are.
    pub fn apply(&self, gpus: Vec<Gpu>) -> Vec<Gpu> {
        if self.is_empty() {
            return gpus;
        }
        gpus.into_iter()
            .filter(|g| self.indices.contains(&g.node.index) || self.uuids.contains(&g.node.uuid))
            .collect()
    }

    /// Entries that name none of `gpus`, for a warning.
    pub fn unmatched(&self, gpus: &[Gpu]) -> Vec<String> {
        let indices = self
            .indices
            .iter()
            .filter(|i| !gpus.iter().any(|g| g.node.index == **i))
            .map(u32::to_string);
        let uuids = self
            .uuids
            .iter()
            .filter(|u| !gpus.iter().any(|g| &g.node.uuid == *u))
            .cloned();
        indices.chain(uuids).collect()
    }
}

/// A backend that finds nothing: `auto` on a host without NVIDIA GPUs.
pub struct NoGpus {
    interval: Duration,
    polled: bool,
}

impl NoGpus {
    /// A backend that reports zero GPUs every `interval`.
    pub fn new(interval: Duration) -> Self {
        NoGpus {
            interval,
            polled: false,
        }
    }
}

impl Discovery for NoGpus {
    fn poll(&mut self) -> Result<Vec<Gpu>, DiscoveryError> {
        if self.polled {
            std::thread::sleep(self.interval);
        }
        self.polled = true;
        Ok(Vec::new())
    }
}

/// Starts the monitor thread: `open` creates the backend on that thread, its
/// first poll is returned here (so startup errors reach the caller), and every
/// later change of the filtered list is passed to `publish`. The thread ends
/// when `publish` returns false.
pub fn spawn_monitor<O, P>(
    open: O,
    filter: DeviceFilter,
    mut publish: P,
) -> Result<Vec<Gpu>, DiscoveryError>
where
    O: FnOnce() -> Result<Box<dyn Discovery>, DiscoveryError> + Send + 'static,
    P: FnMut(&[Gpu]) -> bool + Send + 'static,
{
    let (first_tx, first_rx) = mpsc::sync_channel(1);
    std::thread::Builder::new()
        .name("gpu-discovery".to_owned())
        .spawn(move || {
            let first = open().and_then(|mut backend| {
                let gpus = filter.apply(backend.poll()?);
                Ok((backend, gpus))
            });
            let (mut backend, mut current) = match first {
                Ok((backend, gpus)) => {
                    if first_tx.send(Ok(gpus.clone())).is_err() {
                        return;
                    }
                    (backend, gpus)
                }
                Err(e) => {
                    let _ = first_tx.send(Err(e));
                    return;
                }
            };
            loop {
                match backend.poll() {
                    Ok(gpus) => {
                        let gpus = filter.apply(gpus);
                        if gpus != current {
                            log_change(&current, &gpus);
                            if !publish(&gpus) {
                                return;
                            }
                            current = gpus;
                        }
                    }
                    Err(e) => {
                        // Keep the last good list: a transient read or query
                        // error must not withdraw every slot from the node.
                        tracing::warn!(error = %e, "GPU discovery poll failed; keeping the last known GPUs");
                        std::thread::sleep(Duration::from_secs(1));
                    }
                }
            }
        })
        .map_err(|e| DiscoveryError::Thread(e.to_string()))?;
    first_rx
        .recv()
        .map_err(|_| DiscoveryError::Thread("it stopped before reporting the GPUs".to_owned()))?
}

fn log_change(before: &[Gpu], after: &[Gpu]) {
    for gpu in after.iter().map(|g| &g.node) {
        match before.iter().map(|b| &b.node).find(|b| b.uuid == gpu.uuid) {
            Some(old) if old.healthy != gpu.healthy => {
                if gpu.healthy {
                    tracing::info!(index = gpu.index, uuid = %gpu.uuid, "GPU is Healthy again");
                } else {
                    tracing::warn!(index = gpu.index, uuid = %gpu.uuid, "GPU is Unhealthy");
                }
            }
            Some(_) => {}
            None => {
                tracing::info!(index = gpu.index, uuid = %gpu.uuid, healthy = gpu.healthy, "GPU appeared")
            }
        }
    }
    for gone in before
        .iter()
        .map(|b| &b.node)
        .filter(|b| !after.iter().any(|a| a.node.uuid == b.uuid))
    {
        tracing::warn!(index = gone.index, uuid = %gone.uuid, "GPU disappeared");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(index: u32, uuid: &str) -> Gpu {
        Gpu::from(NodeGpu {
            index,
            uuid: uuid.to_owned(),
            product: "P".to_owned(),
            vendor: "NVIDIA".to_owned(),
            memory_mib: 0,
            healthy: true,
        })
    }

    #[test]
    fn filter_keeps_sparse_indices_and_uuids() {
        let filter = DeviceFilter::parse("1, GPU-d").expect("valid");
        let kept = filter.apply(vec![
            gpu(0, "GPU-a"),
            gpu(1, "GPU-b"),
            gpu(2, "GPU-c"),
            gpu(3, "GPU-d"),
        ]);
        let indices: Vec<u32> = kept.iter().map(|g| g.node.index).collect();
        assert_eq!(indices, vec![1, 3]);
        assert_eq!(filter.unmatched(&kept), Vec::<String>::new());
        assert_eq!(
            filter.unmatched(&[]),
            vec!["1".to_owned(), "GPU-d".to_owned()]
        );
    }

    #[test]
    fn filter_rejects_empty_and_odd_entries_naming_the_flag() {
        for bad in ["", "0,,1", "GPU a"] {
            let err = DeviceFilter::parse(bad).expect_err(bad);
            assert!(err.contains("--devices"), "{err}");
        }
        let err = DeviceFilter::parse("99999999999").expect_err("too big");
        assert!(err.contains("out of range"), "{err}");
    }

    #[test]
    fn uuid_rules() {
        assert!(validate_uuid("GPU-fef8089b-4820-abfc-e83e-94318197576e").is_ok());
        assert!(validate_uuid("").is_err());
        assert!(validate_uuid(&"a".repeat(MAX_UUID_LEN + 1)).is_err());
        assert!(validate_uuid("GPU/1").is_err());
    }
}
