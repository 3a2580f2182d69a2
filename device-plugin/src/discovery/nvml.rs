//! NVML discovery: the NVIDIA management library, loaded at run time, lists
//! the GPUs and reports critical XID events.
//!
//! Health rule: a GPU is Unhealthy while its health check fails (NVML can no
//! longer query it) or while a critical XID was seen in the last
//! [`RECOVERY_QUIET_PERIOD`]; once the check passes again and the quiet
//! period has elapsed, it is Healthy again. XIDs that application faults
//! cause ([`APPLICATION_XIDS`]) say nothing about the GPU and are ignored.
//!
//! Everything NVML-specific sits behind [`NvmlSource`], so the health rule
//! and the mapping of NVML data to GPUs are tested without a GPU.
//!
//! Each GPU's NUMA node comes from sysfs (`<sysfs>/bus/pci/devices/<PCI
//! address>/numa_node`, found from NVML's PCI bus ID), read once when the
//! backend starts: a device's NUMA node is fixed by the slot it sits in.
//!
//! Steady-state cost: the monitor thread waits up to [`EVENT_WAIT`] in NVML
//! for XID events, then runs one NVML query per GPU on handles cached at
//! startup; when no GPU's health changed it allocates nothing and reports
//! [`Polled::Unchanged`].

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

use gpupool_api::NodeGpu;
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::event::EventSet;
use nvml_wrapper::{Device, Nvml};

use super::{Discovery, DiscoveryError, Gpu, Polled, validate_uuid};

/// XIDs caused by the application running on the GPU, not by the GPU:
/// graphics engine exception (13), MMU fault (31), channel reset (43),
/// preemptive cleanup (45), video processor exception (68), context-switch
/// timeout (109).
pub const APPLICATION_XIDS: [u64; 6] = [13, 31, 43, 45, 68, 109];

/// How long after its last critical XID a GPU stays Unhealthy even when its
/// health check passes.
pub const RECOVERY_QUIET_PERIOD: Duration = Duration::from_secs(60);

/// How long one poll waits for XID events.
pub const EVENT_WAIT: Duration = Duration::from_secs(1);

/// Most events drained in one poll, so a storm cannot starve health checks.
const MAX_EVENTS_PER_POLL: usize = 64;

/// Vendor reported for every NVML GPU.
pub const NVIDIA_VENDOR: &str = super::NVIDIA_VENDOR;

/// Where sysfs is mounted on a real node.
pub const SYSFS_ROOT: &str = "/sys";

/// A GPU as NVML describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NvmlGpu {
    /// NVML index.
    pub index: u32,
    /// `GPU-…` UUID.
    pub uuid: String,
    /// Product name.
    pub name: String,
    /// Total memory in bytes.
    pub memory_total_bytes: u64,
    /// Minor number of `/dev/nvidia<minor>`, when NVML knows it.
    pub minor: Option<u32>,
    /// PCI bus ID as NVML writes it (`00000000:3B:00.0`), when NVML knows it.
    pub pci_bus_id: Option<String>,
}

/// A critical XID event NVML reported.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XidEvent {
    /// UUID of the GPU it happened on; `None` when NVML could not say.
    pub uuid: Option<String>,
    /// The XID; `None` when NVML reported it as unknown.
    pub xid: Option<u64>,
}

/// What the NVML backend needs from NVML.
pub trait NvmlSource {
    /// Every GPU NVML sees. Called once, when the backend starts.
    fn gpus(&mut self) -> Result<Vec<NvmlGpu>, DiscoveryError>;
    /// The next critical XID event, waiting at most `timeout`; `None` if none came.
    fn next_xid(&mut self, timeout: Duration) -> Option<XidEvent>;
    /// Checks that the GPU still answers NVML queries.
    fn check(&self, uuid: &str) -> Result<(), String>;
}

/// True if `xid` says the GPU itself is in trouble. An unknown XID counts as
/// critical: a GPU is better withdrawn than handed out broken.
pub fn is_critical(xid: Option<u64>) -> bool {
    xid.is_none_or(|x| !APPLICATION_XIDS.contains(&x))
}

/// The sysfs name of a PCI device from NVML's bus ID: NVML writes
/// `00000000:3B:00.0` (8-digit domain, upper case), sysfs names it
/// `0000:3b:00.0` (at least 4 domain digits, lower case). `None` when the ID
/// is not `domain:bus:device.function` in hex.
pub fn sysfs_pci_address(bus_id: &str) -> Option<String> {
    let bus_id = bus_id.trim_end_matches('\0').trim();
    let (domain, rest) = bus_id.split_once(':')?;
    let domain = u32::from_str_radix(domain, 16).ok()?;
    let (bus, rest) = rest.split_once(':')?;
    let (device, function) = rest.split_once('.')?;
    let hex =
        |part: &str, len: usize| part.len() == len && part.bytes().all(|b| b.is_ascii_hexdigit());
    if !(hex(bus, 2) && hex(device, 2) && hex(function, 1)) {
        return None;
    }
    let mut address = format!("{domain:04x}:{bus}:{device}.{function}");
    address.make_ascii_lowercase();
    Some(address)
}

/// The NUMA node of the PCI device with NVML bus ID `bus_id`, read from
/// `<sysfs_root>/bus/pci/devices/<address>/numa_node`. `None` when the kernel
/// says -1 (no NUMA affinity) or the file cannot be read or parsed; only the
/// latter is logged.
pub fn numa_node(sysfs_root: &Path, bus_id: &str) -> Option<u32> {
    let Some(address) = sysfs_pci_address(bus_id) else {
        tracing::warn!(bus_id, "unrecognised PCI bus ID; reporting no NUMA node");
        return None;
    };
    let path = sysfs_root
        .join("bus/pci/devices")
        .join(&address)
        .join("numa_node");
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "cannot read the GPU's NUMA node; reporting none");
            return None;
        }
    };
    match text.trim().parse::<i64>() {
        Ok(node) if node >= 0 => u32::try_from(node).ok(),
        Ok(_) => None,
        Err(e) => {
            tracing::warn!(path = %path.display(), content = %text.trim(), error = %e, "unparsable NUMA node; reporting none");
            None
        }
    }
}

/// Maps NVML's description of a GPU to the node's view of it.
pub fn to_gpu(raw: &NvmlGpu, healthy: bool, numa_node: Option<u32>) -> Gpu {
    Gpu {
        node: NodeGpu {
            index: raw.index,
            uuid: raw.uuid.clone(),
            product: raw.name.clone(),
            vendor: NVIDIA_VENDOR.to_owned(),
            memory_mib: raw.memory_total_bytes / (1024 * 1024),
            healthy,
        },
        minor: raw.minor,
        numa_node,
    }
}

/// The `nvml` backend over any [`NvmlSource`].
pub struct NvmlDiscovery<S> {
    source: S,
    gpus: Vec<NvmlGpu>,
    numa_nodes: Vec<Option<u32>>,
    last_critical: HashMap<String, Instant>,
    /// Health reported by the last poll (`None` before the first), and a
    /// buffer for the next one, so an unchanged poll allocates nothing.
    reported: Option<Vec<bool>>,
    scratch: Vec<bool>,
}

impl<S: NvmlSource> NvmlDiscovery<S> {
    /// Lists the GPUs once (GPUs do not come and go while the driver runs)
    /// and reads their NUMA nodes from the host's sysfs.
    pub fn new(source: S) -> Result<Self, DiscoveryError> {
        Self::with_sysfs_root(source, Path::new(SYSFS_ROOT))
    }

    /// Like [`NvmlDiscovery::new`], reading NUMA nodes under `sysfs_root`
    /// instead of `/sys`.
    pub fn with_sysfs_root(mut source: S, sysfs_root: &Path) -> Result<Self, DiscoveryError> {
        let mut gpus = source.gpus()?;
        gpus.retain(|g| match validate_uuid(&g.uuid) {
            Ok(()) => true,
            Err(e) => {
                tracing::error!(index = g.index, error = %e, "skipping GPU whose UUID cannot be a device ID");
                false
            }
        });
        gpus.sort_by_key(|g| g.index);
        if gpus.is_empty() {
            tracing::warn!("NVML found no GPUs; advertising zero slots");
        }
        let numa_nodes = gpus
            .iter()
            .map(|g| {
                let node = g
                    .pci_bus_id
                    .as_deref()
                    .and_then(|bus_id| numa_node(sysfs_root, bus_id));
                tracing::info!(
                    index = g.index,
                    uuid = %g.uuid,
                    bus_id = g.pci_bus_id.as_deref().unwrap_or("unknown"),
                    numa_node = %node.map_or_else(|| "none".to_owned(), |n| n.to_string()),
                    "GPU topology"
                );
                node
            })
            .collect();
        Ok(NvmlDiscovery {
            source,
            gpus,
            numa_nodes,
            last_critical: HashMap::new(),
            reported: None,
            scratch: Vec::new(),
        })
    }

    /// Records a critical XID event seen at `now`.
    pub fn record(&mut self, event: XidEvent, now: Instant) {
        if !is_critical(event.xid) {
            tracing::info!(uuid = ?event.uuid, xid = ?event.xid, "ignoring application XID");
            return;
        }
        tracing::warn!(uuid = ?event.uuid, xid = ?event.xid, "critical XID");
        match event.uuid {
            Some(uuid) => {
                self.last_critical.insert(uuid, now);
            }
            // An event NVML cannot place could be any GPU.
            None => {
                for gpu in &self.gpus {
                    self.last_critical.insert(gpu.uuid.clone(), now);
                }
            }
        }
    }

    /// Whether the GPU `raw` is healthy at `now`.
    fn healthy(&self, raw: &NvmlGpu, now: Instant) -> bool {
        let quiet = self
            .last_critical
            .get(&raw.uuid)
            .is_none_or(|at| now.saturating_duration_since(*at) >= RECOVERY_QUIET_PERIOD);
        quiet
            && match self.source.check(&raw.uuid) {
                Ok(()) => true,
                Err(e) => {
                    tracing::warn!(uuid = %raw.uuid, error = %e, "GPU health check failed");
                    false
                }
            }
    }

    /// The GPUs with their health at `now`.
    pub fn inventory(&self, now: Instant) -> Vec<Gpu> {
        self.gpus
            .iter()
            .zip(&self.numa_nodes)
            .map(|(raw, numa)| to_gpu(raw, self.healthy(raw, now), *numa))
            .collect()
    }

    /// Health at `now`; the GPU list only when it differs from the last one
    /// reported.
    fn poll_at(&mut self, now: Instant) -> Polled {
        let mut health = std::mem::take(&mut self.scratch);
        health.clear();
        for raw in &self.gpus {
            health.push(self.healthy(raw, now));
        }
        if self.reported.as_ref() == Some(&health) {
            self.scratch = health;
            return Polled::Unchanged;
        }
        let gpus = self
            .gpus
            .iter()
            .zip(&self.numa_nodes)
            .zip(&health)
            .map(|((raw, numa), healthy)| to_gpu(raw, *healthy, *numa))
            .collect();
        self.scratch = self.reported.replace(health).unwrap_or_default();
        Polled::Gpus(gpus)
    }
}

impl<S: NvmlSource> Discovery for NvmlDiscovery<S> {
    fn poll(&mut self) -> Result<Polled, DiscoveryError> {
        let mut wait = EVENT_WAIT;
        for _ in 0..MAX_EVENTS_PER_POLL {
            match self.source.next_xid(wait) {
                Some(event) => self.record(event, Instant::now()),
                None => break,
            }
            wait = Duration::ZERO;
        }
        Ok(self.poll_at(Instant::now()))
    }
}

/// [`NvmlSource`] backed by the real library.
pub struct LiveNvml {
    nvml: &'static Nvml,
    events: Option<EventSet<'static>>,
    /// Device handles by UUID, looked up once in [`NvmlSource::gpus`], so a
    /// health check neither builds a C string nor searches NVML's devices.
    devices: Vec<(String, Device<'static>)>,
}

impl LiveNvml {
    /// Loads and initialises NVML and subscribes to critical XID events.
    ///
    /// The library handle lives as long as the process: the event set and
    /// device handles borrow it, and the plugin never unloads NVML.
    pub fn open() -> Result<Self, DiscoveryError> {
        let nvml = Nvml::init().map_err(|e| DiscoveryError::NvmlUnavailable(e.to_string()))?;
        let nvml: &'static Nvml = Box::leak(Box::new(nvml));
        let events = subscribe_xids(nvml);
        Ok(LiveNvml {
            nvml,
            events,
            devices: Vec::new(),
        })
    }
}

/// Registers every GPU that supports them for critical XID events, on one
/// event set. A GPU without XID events is left out (its health check still
/// runs). NVML frees a set when a registration fails, so a failure rebuilds
/// the set without that GPU instead of probing every GPU on a throwaway set.
fn subscribe_xids(nvml: &'static Nvml) -> Option<EventSet<'static>> {
    let count = match nvml.device_count() {
        Ok(count) => count,
        Err(e) => {
            tracing::warn!(error = %e, "cannot count GPUs; XID monitoring is off");
            return None;
        }
    };
    let mut candidates: Vec<u32> = (0..count)
        .filter(|index| {
            let supported = nvml
                .device_by_index(*index)
                .and_then(|device| device.supported_event_types());
            match supported {
                Ok(types) if types.contains(EventTypes::CRITICAL_XID_ERROR) => true,
                Ok(_) => {
                    tracing::warn!(index, "GPU does not report XID events; only its health check runs");
                    false
                }
                Err(e) => {
                    tracing::warn!(index, error = %e, "cannot ask the GPU for its events; only its health check runs");
                    false
                }
            }
        })
        .collect();
    while !candidates.is_empty() {
        let mut set = match nvml.create_event_set() {
            Ok(set) => Some(set),
            Err(e) => {
                tracing::warn!(error = %e, "cannot create an NVML event set; only health checks run");
                return None;
            }
        };
        let mut failed = None;
        for index in &candidates {
            let Some(current) = set.take() else { break };
            let registered = nvml
                .device_by_index(*index)
                .map_err(Into::into)
                .and_then(|device| device.register_events(EventTypes::CRITICAL_XID_ERROR, current));
            match registered {
                Ok(next) => set = Some(next),
                Err(e) => {
                    tracing::warn!(index, error = %e.error, "GPU refused XID registration; only its health check runs");
                    failed = Some(*index);
                    break;
                }
            }
        }
        match failed {
            None => return set,
            Some(index) => candidates.retain(|i| *i != index),
        }
    }
    None
}

fn nvml_error(context: &str, e: NvmlError) -> DiscoveryError {
    DiscoveryError::Nvml(format!("{context}: {e}"))
}

impl NvmlSource for LiveNvml {
    fn gpus(&mut self) -> Result<Vec<NvmlGpu>, DiscoveryError> {
        let count = self
            .nvml
            .device_count()
            .map_err(|e| nvml_error("device count", e))?;
        let mut gpus = Vec::with_capacity(count as usize);
        self.devices.clear();
        for i in 0..count {
            let device = self
                .nvml
                .device_by_index(i)
                .map_err(|e| nvml_error(&format!("GPU {i}"), e))?;
            let uuid = device
                .uuid()
                .map_err(|e| nvml_error(&format!("GPU {i} uuid"), e))?;
            gpus.push(NvmlGpu {
                index: device.index().unwrap_or(i),
                uuid: uuid.clone(),
                name: device.name().unwrap_or_else(|_| "NVIDIA GPU".to_owned()),
                memory_total_bytes: device.memory_info().map(|m| m.total).unwrap_or(0),
                minor: device.minor_number().ok(),
                pci_bus_id: device.pci_info().map(|p| p.bus_id).ok(),
            });
            self.devices.push((uuid, device));
        }
        Ok(gpus)
    }

    fn next_xid(&mut self, timeout: Duration) -> Option<XidEvent> {
        let Some(events) = &self.events else {
            std::thread::sleep(timeout);
            return None;
        };
        let millis = u32::try_from(timeout.as_millis()).unwrap_or(u32::MAX);
        match events.wait(millis) {
            Ok(data) => Some(XidEvent {
                uuid: data.device.uuid().ok(),
                xid: match data.event_data {
                    Some(XidError::Value(x)) => Some(x),
                    Some(XidError::Unknown) | None => None,
                },
            }),
            Err(NvmlError::Timeout) => None,
            Err(e) => {
                tracing::warn!(error = %e, "waiting for XID events failed");
                std::thread::sleep(timeout);
                None
            }
        }
    }

    fn check(&self, uuid: &str) -> Result<(), String> {
        let Some((_, device)) = self.devices.iter().find(|(u, _)| u == uuid) else {
            return Err(format!("NVML no longer lists GPU {uuid}"));
        };
        device.memory_info().map(|_| ()).map_err(|e| e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;
    use std::collections::{HashSet, VecDeque};

    #[derive(Default)]
    struct FakeNvml {
        gpus: Vec<NvmlGpu>,
        events: VecDeque<XidEvent>,
        failing: RefCell<HashSet<String>>,
    }

    impl NvmlSource for FakeNvml {
        fn gpus(&mut self) -> Result<Vec<NvmlGpu>, DiscoveryError> {
            Ok(self.gpus.clone())
        }
        fn next_xid(&mut self, _timeout: Duration) -> Option<XidEvent> {
            self.events.pop_front()
        }
        fn check(&self, uuid: &str) -> Result<(), String> {
            if self.failing.borrow().contains(uuid) {
                Err("GPU is lost".to_owned())
            } else {
                Ok(())
            }
        }
    }

    fn raw(index: u32, uuid: &str) -> NvmlGpu {
        NvmlGpu {
            index,
            uuid: uuid.to_owned(),
            name: "NVIDIA H100 80GB HBM3".to_owned(),
            memory_total_bytes: 81_559 * 1024 * 1024,
            minor: Some(index + 4),
            pci_bus_id: Some(format!("00000000:{:02X}:00.0", 0x3B + index)),
        }
    }

    fn xid(uuid: &str, xid: u64) -> XidEvent {
        XidEvent {
            uuid: Some(uuid.to_owned()),
            xid: Some(xid),
        }
    }

    #[test]
    fn application_xids_are_not_critical() {
        for x in APPLICATION_XIDS {
            assert!(!is_critical(Some(x)), "{x}");
        }
        for x in [48, 79, 94, 95, 119] {
            assert!(is_critical(Some(x)), "{x}");
        }
        assert!(is_critical(None));
    }

    #[test]
    fn maps_nvml_data_to_gpus_in_index_order() {
        let source = FakeNvml {
            gpus: vec![raw(2, "GPU-b"), raw(0, "GPU-a"), raw(1, "bad uuid")],
            ..FakeNvml::default()
        };
        let discovery = NvmlDiscovery::new(source).expect("lists");
        let gpus = discovery.inventory(Instant::now());
        assert_eq!(gpus.len(), 2, "the GPU with an unusable UUID is skipped");
        assert_eq!(gpus[0].node.index, 0);
        assert_eq!(gpus[1].node.uuid, "GPU-b");
        assert_eq!(gpus[1].node.product, "NVIDIA H100 80GB HBM3");
        assert_eq!(gpus[1].node.vendor, "NVIDIA");
        assert_eq!(gpus[1].node.memory_mib, 81_559);
        assert_eq!(gpus[1].device_minor(), 6);
        assert!(gpus.iter().all(|g| g.node.healthy));
    }

    #[test]
    fn critical_xid_marks_unhealthy_until_quiet_and_checked() {
        let source = FakeNvml {
            gpus: vec![raw(0, "GPU-a"), raw(1, "GPU-b")],
            ..FakeNvml::default()
        };
        let mut discovery = NvmlDiscovery::new(source).expect("lists");
        let t0 = Instant::now();
        discovery.record(xid("GPU-a", 13), t0);
        discovery.record(xid("GPU-b", 43), t0);
        assert!(discovery.inventory(t0).iter().all(|g| g.node.healthy));

        discovery.record(xid("GPU-a", 79), t0);
        let health = |d: &NvmlDiscovery<FakeNvml>, at| {
            d.inventory(at)
                .iter()
                .map(|g| g.node.healthy)
                .collect::<Vec<_>>()
        };
        assert_eq!(health(&discovery, t0), vec![false, true]);
        let later = t0 + RECOVERY_QUIET_PERIOD - Duration::from_secs(1);
        assert_eq!(health(&discovery, later), vec![false, true]);

        // Quiet long enough, but the check fails: still Unhealthy.
        let quiet = t0 + RECOVERY_QUIET_PERIOD;
        discovery
            .source
            .failing
            .borrow_mut()
            .insert("GPU-a".to_owned());
        assert_eq!(health(&discovery, quiet), vec![false, true]);
        // The check passes again: Healthy.
        discovery.source.failing.borrow_mut().clear();
        assert_eq!(health(&discovery, quiet), vec![true, true]);
    }

    #[test]
    fn unplaceable_critical_xid_marks_every_gpu() {
        let source = FakeNvml {
            gpus: vec![raw(0, "GPU-a"), raw(1, "GPU-b")],
            ..FakeNvml::default()
        };
        let mut discovery = NvmlDiscovery::new(source).expect("lists");
        let now = Instant::now();
        discovery.record(
            XidEvent {
                uuid: None,
                xid: Some(48),
            },
            now,
        );
        assert!(discovery.inventory(now).iter().all(|g| !g.node.healthy));
    }

    fn listed(polled: Polled) -> Vec<Gpu> {
        match polled {
            Polled::Gpus(gpus) => gpus,
            Polled::Unchanged => panic!("expected a GPU list"),
        }
    }

    #[test]
    fn poll_drains_events_then_reports() {
        let source = FakeNvml {
            gpus: vec![raw(0, "GPU-a"), raw(1, "GPU-b")],
            events: VecDeque::from([xid("GPU-b", 31), xid("GPU-b", 94)]),
            ..FakeNvml::default()
        };
        let mut discovery = NvmlDiscovery::new(source).expect("lists");
        let gpus = listed(discovery.poll().expect("polls"));
        assert!(gpus[0].node.healthy);
        assert!(!gpus[1].node.healthy);
        assert!(discovery.source.events.is_empty());
    }

    #[test]
    fn poll_reports_only_changes() {
        let source = FakeNvml {
            gpus: vec![raw(0, "GPU-a"), raw(1, "GPU-b")],
            ..FakeNvml::default()
        };
        let mut discovery = NvmlDiscovery::new(source).expect("lists");
        let t0 = Instant::now();
        assert_eq!(
            listed(discovery.poll_at(t0)).len(),
            2,
            "the first poll lists"
        );
        assert_eq!(discovery.poll_at(t0), Polled::Unchanged);
        discovery
            .source
            .failing
            .borrow_mut()
            .insert("GPU-b".to_owned());
        let gpus = listed(discovery.poll_at(t0));
        assert!(!gpus[1].node.healthy);
        assert_eq!(discovery.poll_at(t0), Polled::Unchanged);
        discovery.source.failing.borrow_mut().clear();
        assert!(listed(discovery.poll_at(t0))[1].node.healthy);
    }

    #[test]
    fn pci_bus_ids_map_to_sysfs_addresses() {
        let cases = [
            ("00000000:3B:00.0", Some("0000:3b:00.0")),
            ("0000:3B:00.0", Some("0000:3b:00.0")),
            ("00000001:AF:1F.7", Some("0001:af:1f.7")),
            ("00010000:01:00.0", Some("10000:01:00.0")),
            ("00000000:3B:00.0\0\0", Some("0000:3b:00.0")),
            ("", None),
            ("3B:00.0", None),
            ("0000:3B:00", None),
            ("zzzz:3B:00.0", None),
            ("0000:3B:0.0", None),
        ];
        for (bus_id, want) in cases {
            assert_eq!(sysfs_pci_address(bus_id).as_deref(), want, "{bus_id:?}");
        }
    }

    fn fake_sysfs(nodes: &[(&str, &str)]) -> tempfile::TempDir {
        let root = tempfile::tempdir().expect("sysfs");
        for (address, content) in nodes {
            let dir = root.path().join("bus/pci/devices").join(address);
            std::fs::create_dir_all(&dir).expect("device dir");
            std::fs::write(dir.join("numa_node"), content).expect("numa_node");
        }
        root
    }

    #[test]
    fn numa_node_from_sysfs() {
        let sysfs = fake_sysfs(&[
            ("0000:3b:00.0", "1\n"),
            ("0000:3c:00.0", "-1\n"),
            ("0000:3d:00.0", "x\n"),
        ]);
        let cases = [
            ("00000000:3B:00.0", Some(1)),
            ("00000000:3C:00.0", None),
            ("00000000:3D:00.0", None),
            ("00000000:3E:00.0", None),
            ("garbage", None),
        ];
        for (bus_id, want) in cases {
            assert_eq!(numa_node(sysfs.path(), bus_id), want, "{bus_id}");
        }
    }

    #[test]
    fn gpus_carry_their_numa_node() {
        // raw(i) sits at bus 0x3B + i.
        let sysfs = fake_sysfs(&[("0000:3b:00.0", "0\n"), ("0000:3c:00.0", "1\n")]);
        let mut no_bus_id = raw(2, "GPU-c");
        no_bus_id.pci_bus_id = None;
        let source = FakeNvml {
            gpus: vec![raw(0, "GPU-a"), raw(1, "GPU-b"), no_bus_id],
            ..FakeNvml::default()
        };
        let mut discovery = NvmlDiscovery::with_sysfs_root(source, sysfs.path()).expect("lists");
        let numa: Vec<Option<u32>> = listed(discovery.poll_at(Instant::now()))
            .iter()
            .map(|g| g.numa_node)
            .collect();
        assert_eq!(numa, vec![Some(0), Some(1), None]);
    }
}
