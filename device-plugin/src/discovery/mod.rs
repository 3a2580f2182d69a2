//! GPU discovery: one trait, three backends (`nvml`, `static`, `auto`), and
//! the monitor thread that polls the chosen backend and publishes every
//! change of the node's GPU list (health included).

pub mod nvml;
pub mod static_config;

use std::sync::mpsc;
use std::time::Duration;

use gpupool_api::NodeGpu;

/// Vendor of every NVIDIA GPU; GPUs of this vendor get NVIDIA device nodes
/// when allocated.
pub const NVIDIA_VENDOR: &str = "NVIDIA";

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
    /// The NUMA node the GPU is attached to; `None` when the host has no
    /// NUMA topology or does not say. Sent to the kubelet's Topology Manager.
    pub numa_node: Option<u32>,
}

impl Gpu {
    /// The device-node number: the driver's minor number, else the index.
    pub fn device_minor(&self) -> u32 {
        self.minor.unwrap_or(self.node.index)
    }
}

impl From<NodeGpu> for Gpu {
    fn from(node: NodeGpu) -> Self {
        Gpu {
            node,
            minor: None,
            numa_node: None,
        }
    }
}

/// What one poll of a backend found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Polled {
    /// Nothing changed since the previous poll. Backends answer this on the
    /// steady path so that an idle node allocates nothing per poll.
    Unchanged,
    /// The node's GPUs as they are now, health included, in index order.
    Gpus(Vec<Gpu>),
}

/// A source of the node's GPUs.
///
/// Backends are polled from one dedicated thread, so they may block (NVML
/// waits for XID events) and need not be `Send` once created there.
pub trait Discovery {
    /// Returns the node's GPUs, or [`Polled::Unchanged`] when nothing changed
    /// since the previous poll. The first poll always returns the list. May
    /// block for up to about a second; the monitor calls it in a loop, so the
    /// blocking sets the polling rhythm.
    fn poll(&mut self) -> Result<Polled, DiscoveryError>;
}

/// What to check when NVML cannot be loaded, in the order a node fails.
pub const NVML_NEXT_STEPS: &str = "Check that the NVIDIA driver is installed on the node (`nvidia-smi` works there); \
that the NVIDIA container toolkit is installed and configured for the container runtime; \
and that this pod runs with `runtimeClassName: nvidia` unless nvidia is the runtime's default \
(the chart's devicePlugin.runtimeClassName). Without GPUs, --discovery static simulates them.";

/// Why discovery failed.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    /// The NVIDIA management library could not be loaded or initialised;
    /// the message names what to check next.
    #[error(
        "--discovery nvml: the NVIDIA management library (libnvidia-ml.so.1) could not be loaded or initialised: {0}. {NVML_NEXT_STEPS}"
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

    /// Checks that every entry names one of `gpus` (the node's GPUs before
    /// filtering). The error names the missing entries and lists the GPUs
    /// the node has; it is a configuration error.
    pub fn check(&self, gpus: &[Gpu]) -> Result<(), DiscoveryError> {
        let unmatched = self.unmatched(gpus);
        if unmatched.is_empty() {
            return Ok(());
        }
        let have: Vec<String> = gpus
            .iter()
            .map(|g| format!("{} ({})", g.node.index, g.node.uuid))
            .collect();
        let have = if have.is_empty() {
            "none".to_owned()
        } else {
            have.join(", ")
        };
        Err(DiscoveryError::InvalidConfig(format!(
            "--devices names {} this node does not have: {}; its GPUs: {have}",
            if unmatched.len() == 1 {
                "a GPU"
            } else {
                "GPUs"
            },
            unmatched.join(", ")
        )))
    }

    /// Entries that name none of `gpus`.
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
    fn poll(&mut self) -> Result<Polled, DiscoveryError> {
        if self.polled {
            std::thread::sleep(self.interval);
            return Ok(Polled::Unchanged);
        }
        self.polled = true;
        Ok(Polled::Gpus(Vec::new()))
    }
}

/// Starts the monitor thread: `open` creates the backend on that thread, its
/// first poll is returned here (so startup errors reach the caller), and every
/// later change of the filtered list is passed to `publish`. The thread ends
/// when `publish` returns false.
///
/// A `filter` entry naming a GPU the first poll did not find is a
/// configuration error returned here; a GPU that disappears later (a driver
/// reset, an edited static config) is only a change of the list.
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
                let gpus = match backend.poll()? {
                    Polled::Gpus(gpus) => gpus,
                    Polled::Unchanged => Vec::new(),
                };
                filter.check(&gpus)?;
                Ok((backend, filter.apply(gpus)))
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
                    Ok(Polled::Unchanged) => {}
                    Ok(Polled::Gpus(gpus)) => {
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
    fn filter_check_names_missing_gpus_and_the_ones_present() {
        let gpus = [gpu(0, "GPU-a"), gpu(2, "GPU-c")];
        let cases: [(&str, Option<&str>); 5] = [
            ("0", None),
            ("2,GPU-a", None),
            (
                "1",
                Some("does not have: 1; its GPUs: 0 (GPU-a), 2 (GPU-c)"),
            ),
            ("GPU-b,0,9", Some("does not have: 9, GPU-b;")),
            ("GPU-a,GPU-z", Some("does not have: GPU-z;")),
        ];
        for (list, want) in cases {
            let filter = DeviceFilter::parse(list).expect("valid");
            match (filter.check(&gpus), want) {
                (Ok(()), None) => {}
                (Err(e), Some(needle)) => {
                    assert!(e.is_config_error(), "{e}");
                    let text = e.to_string();
                    assert!(text.starts_with("--devices"), "{text}");
                    assert!(text.contains(needle), "{list}: {text}");
                }
                (got, want) => panic!("{list}: got {got:?}, want {want:?}"),
            }
        }
        let err = DeviceFilter::parse("0")
            .expect("valid")
            .check(&[])
            .expect_err("none");
        assert!(err.to_string().ends_with("its GPUs: none"), "{err}");
        assert!(DeviceFilter::default().check(&[]).is_ok());
    }

    struct Script(std::collections::VecDeque<Result<Polled, DiscoveryError>>);

    impl Discovery for Script {
        fn poll(&mut self) -> Result<Polled, DiscoveryError> {
            match self.0.pop_front() {
                Some(next) => next,
                None => {
                    std::thread::sleep(Duration::from_millis(10));
                    Ok(Polled::Unchanged)
                }
            }
        }
    }

    #[test]
    fn monitor_publishes_changes_only_and_refuses_missing_devices() {
        let script = Script(
            [
                Ok(Polled::Gpus(vec![gpu(0, "GPU-a"), gpu(1, "GPU-b")])),
                Ok(Polled::Unchanged),
                Err(DiscoveryError::Nvml("transient".to_owned())),
                // GPU 1 vanishes: a change, not an error.
                Ok(Polled::Gpus(vec![gpu(0, "GPU-a")])),
            ]
            .into(),
        );
        let (tx, rx) = mpsc::channel();
        let first = spawn_monitor(
            move || Ok(Box::new(script) as Box<dyn Discovery>),
            DeviceFilter::parse("0,1").expect("valid"),
            move |gpus| {
                let _ = tx.send(gpus.to_vec());
                false
            },
        )
        .expect("first poll");
        assert_eq!(first.len(), 2);
        let published = rx.recv_timeout(Duration::from_secs(10)).expect("a change");
        assert_eq!(published, vec![gpu(0, "GPU-a")]);

        let script = Script([Ok(Polled::Gpus(vec![gpu(0, "GPU-a")]))].into());
        let err = spawn_monitor(
            move || Ok(Box::new(script) as Box<dyn Discovery>),
            DeviceFilter::parse("3").expect("valid"),
            |_| false,
        )
        .expect_err("GPU 3 is missing");
        assert!(err.is_config_error(), "{err}");
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
