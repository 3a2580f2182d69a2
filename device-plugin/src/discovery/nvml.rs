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

use std::collections::HashMap;
use std::time::{Duration, Instant};

use gpupool_api::NodeGpu;
use nvml_wrapper::Nvml;
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::event::EventSet;

use super::{Discovery, DiscoveryError, Gpu, validate_uuid};

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
pub const NVIDIA_VENDOR: &str = "NVIDIA";

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
    /// Every GPU NVML sees.
    fn gpus(&self) -> Result<Vec<NvmlGpu>, DiscoveryError>;
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

/// Maps NVML's description of a GPU to the node's view of it.
pub fn to_gpu(raw: &NvmlGpu, healthy: bool) -> Gpu {
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
    }
}

/// The `nvml` backend over any [`NvmlSource`].
pub struct NvmlDiscovery<S> {
    source: S,
    gpus: Vec<NvmlGpu>,
    last_critical: HashMap<String, Instant>,
}

impl<S: NvmlSource> NvmlDiscovery<S> {
    /// Lists the GPUs once (GPUs do not come and go while the driver runs).
    pub fn new(source: S) -> Result<Self, DiscoveryError> {
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
        Ok(NvmlDiscovery {
            source,
            gpus,
            last_critical: HashMap::new(),
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

    /// The GPUs with their health at `now`.
    pub fn inventory(&self, now: Instant) -> Vec<Gpu> {
        self.gpus
            .iter()
            .map(|raw| {
                let quiet = self
                    .last_critical
                    .get(&raw.uuid)
                    .is_none_or(|at| now.saturating_duration_since(*at) >= RECOVERY_QUIET_PERIOD);
                let healthy = quiet
                    && match self.source.check(&raw.uuid) {
                        Ok(()) => true,
                        Err(e) => {
                            tracing::warn!(uuid = %raw.uuid, error = %e, "GPU health check failed");
                            false
                        }
                    };
                to_gpu(raw, healthy)
            })
            .collect()
    }
}

impl<S: NvmlSource> Discovery for NvmlDiscovery<S> {
    fn poll(&mut self) -> Result<Vec<Gpu>, DiscoveryError> {
        let mut wait = EVENT_WAIT;
        for _ in 0..MAX_EVENTS_PER_POLL {
            match self.source.next_xid(wait) {
                Some(event) => self.record(event, Instant::now()),
                None => break,
            }
            wait = Duration::ZERO;
        }
        Ok(self.inventory(Instant::now()))
    }
}

/// [`NvmlSource`] backed by the real library.
pub struct LiveNvml {
    nvml: &'static Nvml,
    events: Option<EventSet<'static>>,
}

impl LiveNvml {
    /// Loads and initialises NVML and subscribes to critical XID events.
    ///
    /// The library handle lives as long as the process: the event set borrows
    /// it, and the plugin never unloads NVML.
    pub fn open() -> Result<Self, DiscoveryError> {
        let nvml = Nvml::init().map_err(|e| DiscoveryError::NvmlUnavailable(e.to_string()))?;
        let nvml: &'static Nvml = Box::leak(Box::new(nvml));
        let events = subscribe_xids(nvml);
        Ok(LiveNvml { nvml, events })
    }
}

/// Registers every GPU for critical XID events. A GPU that does not support
/// events is left out (its health check still runs).
fn subscribe_xids(nvml: &'static Nvml) -> Option<EventSet<'static>> {
    let count = match nvml.device_count() {
        Ok(count) => count,
        Err(e) => {
            tracing::warn!(error = %e, "cannot count GPUs; XID monitoring is off");
            return None;
        }
    };
    let register = |index: u32, set: EventSet<'static>| {
        nvml.device_by_index(index)?
            .register_events(EventTypes::CRITICAL_XID_ERROR, set)
            .map_err(|e| e.error)
    };
    // NVML frees a set when a registration fails, so probe each GPU on a
    // throwaway set first and then build the real one from those that work.
    let supported: Vec<u32> = (0..count)
        .filter(|index| {
            match nvml.create_event_set().and_then(|set| register(*index, set)) {
                Ok(_) => true,
                Err(e) => {
                    tracing::warn!(index, error = %e, "GPU does not report XID events; only its health check runs");
                    false
                }
            }
        })
        .collect();
    let set = nvml.create_event_set().and_then(|set| {
        supported
            .iter()
            .try_fold(set, |set, index| register(*index, set))
    });
    match set {
        Ok(set) => Some(set),
        Err(e) => {
            tracing::warn!(error = %e, "cannot subscribe to XID events; only health checks run");
            None
        }
    }
}

fn nvml_error(context: &str, e: NvmlError) -> DiscoveryError {
    DiscoveryError::Nvml(format!("{context}: {e}"))
}

impl NvmlSource for LiveNvml {
    fn gpus(&self) -> Result<Vec<NvmlGpu>, DiscoveryError> {
        let count = self
            .nvml
            .device_count()
            .map_err(|e| nvml_error("device count", e))?;
        (0..count)
            .map(|i| {
                let device = self
                    .nvml
                    .device_by_index(i)
                    .map_err(|e| nvml_error(&format!("GPU {i}"), e))?;
                Ok(NvmlGpu {
                    index: device.index().unwrap_or(i),
                    uuid: device
                        .uuid()
                        .map_err(|e| nvml_error(&format!("GPU {i} uuid"), e))?,
                    name: device.name().unwrap_or_else(|_| "NVIDIA GPU".to_owned()),
                    memory_total_bytes: device.memory_info().map(|m| m.total).unwrap_or(0),
                    minor: device.minor_number().ok(),
                })
            })
            .collect()
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
        let device = self.nvml.device_by_uuid(uuid).map_err(|e| e.to_string())?;
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
        fn gpus(&self) -> Result<Vec<NvmlGpu>, DiscoveryError> {
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

    #[test]
    fn poll_drains_events_then_reports() {
        let source = FakeNvml {
            gpus: vec![raw(0, "GPU-a"), raw(1, "GPU-b")],
            events: VecDeque::from([xid("GPU-b", 31), xid("GPU-b", 94)]),
            ..FakeNvml::default()
        };
        let mut discovery = NvmlDiscovery::new(source).expect("lists");
        let gpus = discovery.poll().expect("polls");
        assert!(gpus[0].node.healthy);
        assert!(!gpus[1].node.healthy);
        assert!(discovery.source.events.is_empty());
    }
}
