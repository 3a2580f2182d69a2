//! The resource manager: each GPU becomes `--sessions-per-gpu` slots, each
//! slot a kubelet device with a stable ID, the preferred-allocation policy
//! (distinct GPUs per container, least-used GPUs first) and the rules of an
//! allocation (which IDs are acceptable, which GPUs and device nodes a
//! container gets). Nothing here speaks gRPC.

use std::collections::HashMap;
use std::path::PathBuf;

use gpupool_api::names::{ENV_GPU_INDICES, ENV_GPU_UUIDS, ENV_NVIDIA_VISIBLE_DEVICES};

use crate::discovery::{Gpu, NVIDIA_VENDOR};

/// Control device nodes every NVIDIA container needs, handed out when present.
pub const NVIDIA_CONTROL_DEVICES: [&str; 3] = ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"];

/// Most sessions per GPU: keeps device IDs within 63 characters.
pub const MAX_SESSIONS_PER_GPU: u32 = 100;

/// Health string the kubelet expects for a usable device.
pub const HEALTHY: &str = "Healthy";
/// Health string the kubelet expects for an unusable device.
pub const UNHEALTHY: &str = "Unhealthy";

/// The device ID of session `session` of the GPU with `uuid`:
/// `<uuid>-s<session>`. It depends only on the UUID, so it survives restarts
/// and index changes, and it is at most 63 characters for UUIDs accepted by
/// [`crate::discovery::validate_uuid`].
pub fn device_id(uuid: &str, session: u32) -> String {
    format!("{uuid}-s{session}")
}

/// One slot, resolved.
#[derive(Debug, Clone, Copy)]
pub struct Slot<'a> {
    /// The GPU it is a session of.
    pub gpu: &'a Gpu,
    /// Which session (0-based).
    pub session: u32,
}

/// Why a preferred allocation could not be computed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PreferenceError {
    /// A device ID this plugin never advertised.
    #[error("unknown device ID {0:?}")]
    UnknownDevice(String),
    /// The requested size cannot be met.
    #[error(
        "allocation size {size} is impossible: {must_include} {} must be included and {available} {} available",
        if *must_include == 1 { "device" } else { "devices" },
        if *available == 1 { "is" } else { "are" }
    )]
    ImpossibleSize {
        /// Requested size.
        size: i32,
        /// Number of must-include IDs.
        must_include: usize,
        /// Number of available IDs.
        available: usize,
    },
}

/// Why an allocation was refused. Each message names the offending device.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AllocError {
    /// The request lists no device at all.
    #[error("lists no device IDs")]
    NoDevices,
    /// The same device ID appears twice.
    #[error("device ID {0:?} is listed twice")]
    Duplicate(String),
    /// A device ID this plugin never advertised.
    #[error("unknown device ID {0:?}: this plugin advertises no such device")]
    UnknownDevice(String),
    /// The device's GPU failed its health check.
    #[error("device ID {id:?} is Unhealthy: GPU {index} ({uuid}) failed its health check")]
    Unhealthy {
        /// The device ID asked for.
        id: String,
        /// Its GPU's index.
        index: u32,
        /// Its GPU's UUID.
        uuid: String,
    },
}

impl AllocError {
    /// True when the request is well formed but the device cannot be used
    /// now (the kubelet should try another device), false when the request
    /// itself is wrong.
    pub fn is_unavailable(&self) -> bool {
        matches!(self, AllocError::Unhealthy { .. })
    }
}

/// One GPU of an allocation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllocatedGpu {
    /// Index as the driver numbers it.
    pub index: u32,
    /// UUID.
    pub uuid: String,
}

/// What one container gets: its GPUs (each once, in index order, however
/// many of their slots it holds), its environment and its device nodes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allocation {
    /// The GPUs, each once, in index order.
    pub gpus: Vec<AllocatedGpu>,
    /// `NVIDIA_VISIBLE_DEVICES` (UUIDs), `GPUPOOL_GPU_INDICES` and
    /// `GPUPOOL_GPU_UUIDS`, comma-separated in index order.
    pub envs: Vec<(String, String)>,
    /// Device nodes to hand to the container, as `/dev/<name>` (the same path
    /// on the host and in the container): each NVIDIA GPU's `nvidia<minor>`,
    /// then the NVIDIA control devices, each only if present on the host.
    pub device_nodes: Vec<String>,
}

/// Which device nodes exist on the host.
pub trait DeviceNodes {
    /// True if `/dev/<name>` exists on the host.
    fn present(&self, name: &str) -> bool;
}

/// A directory where the host's `/dev` is visible (`--dev-dir`).
impl DeviceNodes for PathBuf {
    fn present(&self, name: &str) -> bool {
        self.join(name).exists()
    }
}

impl<F: Fn(&str) -> bool> DeviceNodes for F {
    fn present(&self, name: &str) -> bool {
        self(name)
    }
}

/// Every slot of the node, by device ID.
#[derive(Debug)]
pub struct SlotTable {
    gpus: Vec<Gpu>,
    sessions_per_gpu: u32,
    by_id: HashMap<String, (usize, u32)>,
}

impl SlotTable {
    /// Builds the table; GPUs are kept in index order.
    pub fn new(mut gpus: Vec<Gpu>, sessions_per_gpu: u32) -> Self {
        gpus.sort_by_key(|g| g.node.index);
        let mut by_id = HashMap::with_capacity(gpus.len() * sessions_per_gpu as usize);
        for (position, gpu) in gpus.iter().enumerate() {
            for session in 0..sessions_per_gpu {
                by_id.insert(device_id(&gpu.node.uuid, session), (position, session));
            }
        }
        SlotTable {
            gpus,
            sessions_per_gpu,
            by_id,
        }
    }

    /// The GPUs, in index order.
    pub fn gpus(&self) -> &[Gpu] {
        &self.gpus
    }

    /// Slots per GPU.
    pub fn sessions_per_gpu(&self) -> u32 {
        self.sessions_per_gpu
    }

    /// Every slot as (device ID, healthy, NUMA node of its GPU), GPU by GPU
    /// in index order.
    pub fn devices(&self) -> impl Iterator<Item = (String, bool, Option<u32>)> + '_ {
        self.gpus.iter().flat_map(move |gpu| {
            (0..self.sessions_per_gpu).map(move |s| {
                (
                    device_id(&gpu.node.uuid, s),
                    gpu.node.healthy,
                    gpu.numa_node,
                )
            })
        })
    }

    /// Resolves a device ID.
    pub fn lookup(&self, id: &str) -> Option<Slot<'_>> {
        self.by_id.get(id).map(|(position, session)| Slot {
            gpu: &self.gpus[*position],
            session: *session,
        })
    }

    /// Resolves one container's device IDs into what it gets. Refuses an
    /// empty list, a repeated ID, an unknown ID and a slot of an Unhealthy
    /// GPU (the first problem found, in request order); several slots of one
    /// GPU give that GPU once. `nodes` says which device nodes exist: they
    /// are checked on every call, because the driver creates some of them
    /// (`nvidia-uvm`) only on first use.
    pub fn allocate(
        &self,
        ids: &[String],
        nodes: &dyn DeviceNodes,
    ) -> Result<Allocation, AllocError> {
        if ids.is_empty() {
            return Err(AllocError::NoDevices);
        }
        let mut positions: Vec<usize> = Vec::with_capacity(ids.len());
        for (i, id) in ids.iter().enumerate() {
            if ids[..i].contains(id) {
                return Err(AllocError::Duplicate(id.clone()));
            }
            let Some((position, _)) = self.by_id.get(id) else {
                return Err(AllocError::UnknownDevice(id.clone()));
            };
            let gpu = &self.gpus[*position];
            if !gpu.node.healthy {
                return Err(AllocError::Unhealthy {
                    id: id.clone(),
                    index: gpu.node.index,
                    uuid: gpu.node.uuid.clone(),
                });
            }
            positions.push(*position);
        }
        // GPUs are kept in index order, so position order is index order.
        positions.sort_unstable();
        positions.dedup();
        let gpus: Vec<&Gpu> = positions.iter().map(|p| &self.gpus[*p]).collect();
        let join =
            |f: &dyn Fn(&Gpu) -> String| gpus.iter().map(|g| f(g)).collect::<Vec<_>>().join(",");
        let uuids = join(&|g| g.node.uuid.clone());
        let indices = join(&|g| g.node.index.to_string());
        let nvidia: Vec<&&Gpu> = gpus
            .iter()
            .filter(|g| g.node.vendor == NVIDIA_VENDOR)
            .collect();
        let device_nodes = if nvidia.is_empty() {
            Vec::new()
        } else {
            nvidia
                .iter()
                .map(|g| format!("nvidia{}", g.device_minor()))
                .chain(NVIDIA_CONTROL_DEVICES.iter().map(|d| (*d).to_owned()))
                .filter(|name| nodes.present(name))
                .map(|name| format!("/dev/{name}"))
                .collect()
        };
        Ok(Allocation {
            gpus: gpus
                .iter()
                .map(|g| AllocatedGpu {
                    index: g.node.index,
                    uuid: g.node.uuid.clone(),
                })
                .collect(),
            envs: vec![
                (ENV_NVIDIA_VISIBLE_DEVICES.to_owned(), uuids.clone()),
                (ENV_GPU_INDICES.to_owned(), indices),
                (ENV_GPU_UUIDS.to_owned(), uuids),
            ],
            device_nodes,
        })
    }

    /// Picks `size` of `available` for one container: every `must_include`
    /// ID first, then one slot per GPU not yet used by the container, from
    /// the GPUs with the most free slots (the least used), lowest index
    /// first; only when every GPU is already used does a container get a
    /// second slot of the same GPU.
    pub fn preferred(
        &self,
        available: &[String],
        must_include: &[String],
        size: i32,
    ) -> Result<Vec<String>, PreferenceError> {
        for id in available.iter().chain(must_include) {
            if !self.by_id.contains_key(id) {
                return Err(PreferenceError::UnknownDevice(id.clone()));
            }
        }
        let mut chosen: Vec<String> = Vec::new();
        for id in must_include {
            if !chosen.contains(id) {
                chosen.push(id.clone());
            }
        }
        let mut candidates: Vec<&String> = available
            .iter()
            .filter(|id| !chosen.contains(*id))
            .collect();
        candidates.sort();
        candidates.dedup();
        let wanted = usize::try_from(size)
            .ok()
            .filter(|wanted| *wanted >= chosen.len() && *wanted <= chosen.len() + candidates.len());
        let Some(wanted) = wanted else {
            return Err(PreferenceError::ImpossibleSize {
                size,
                must_include: chosen.len(),
                available: available.len(),
            });
        };

        // Free slots per GPU position, as the kubelet sees them now.
        let mut free: HashMap<usize, usize> = HashMap::new();
        for id in available {
            if let Some((position, _)) = self.by_id.get(id) {
                *free.entry(*position).or_default() += 1;
            }
        }
        let mut used_by_container: HashMap<usize, usize> = HashMap::new();
        for id in &chosen {
            if let Some((position, _)) = self.by_id.get(id) {
                *used_by_container.entry(*position).or_default() += 1;
            }
        }
        while chosen.len() < wanted {
            let best = candidates
                .iter()
                .enumerate()
                .filter_map(|(i, id)| self.by_id.get(*id).map(|slot| (i, *slot)))
                .min_by_key(|(_, (position, session))| {
                    let gpu = &self.gpus[*position];
                    (
                        !gpu.node.healthy,
                        used_by_container.get(position).copied().unwrap_or(0),
                        std::cmp::Reverse(free.get(position).copied().unwrap_or(0)),
                        gpu.node.index,
                        *session,
                    )
                });
            let Some((i, (position, _))) = best else {
                break;
            };
            let id = candidates.remove(i);
            *used_by_container.entry(position).or_default() += 1;
            chosen.push(id.clone());
        }
        Ok(chosen)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpupool_api::NodeGpu;

    fn gpu(index: u32, healthy: bool) -> Gpu {
        Gpu::from(NodeGpu {
            index,
            uuid: format!("GPU-{index}"),
            product: "P".to_owned(),
            vendor: "NVIDIA".to_owned(),
            memory_mib: 0,
            healthy,
        })
    }

    fn strings(items: &[&str]) -> Vec<String> {
        items.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn allocate_resolves_gpus_envs_and_device_nodes() {
        let mut with_minor = gpu(2, true);
        with_minor.minor = Some(7);
        let mut simulated = gpu(3, true);
        simulated.node.vendor = "Simulated".to_owned();
        let table = SlotTable::new(vec![gpu(0, true), gpu(1, true), with_minor, simulated], 2);
        let all: fn(&str) -> bool = |_| true;
        let no_uvm_tools: fn(&str) -> bool = |name| name != "nvidia-uvm-tools";
        struct Case {
            ids: &'static [&'static str],
            nodes: fn(&str) -> bool,
            indices: &'static str,
            uuids: &'static str,
            device_nodes: &'static [&'static str],
        }
        let cases = [
            Case {
                ids: &["GPU-1-s1"],
                nodes: no_uvm_tools,
                indices: "1",
                uuids: "GPU-1",
                device_nodes: &["/dev/nvidia1", "/dev/nvidiactl", "/dev/nvidia-uvm"],
            },
            // Request order does not matter; two slots of GPU 0 give it once.
            Case {
                ids: &["GPU-1-s0", "GPU-0-s1", "GPU-0-s0"],
                nodes: all,
                indices: "0,1",
                uuids: "GPU-0,GPU-1",
                device_nodes: &[
                    "/dev/nvidia0",
                    "/dev/nvidia1",
                    "/dev/nvidiactl",
                    "/dev/nvidia-uvm",
                    "/dev/nvidia-uvm-tools",
                ],
            },
            // The driver's minor number names the device node, not the index.
            Case {
                ids: &["GPU-2-s0"],
                nodes: all,
                indices: "2",
                uuids: "GPU-2",
                device_nodes: &[
                    "/dev/nvidia7",
                    "/dev/nvidiactl",
                    "/dev/nvidia-uvm",
                    "/dev/nvidia-uvm-tools",
                ],
            },
            // Not an NVIDIA GPU: no NVIDIA device nodes at all.
            Case {
                ids: &["GPU-3-s0"],
                nodes: all,
                indices: "3",
                uuids: "GPU-3",
                device_nodes: &[],
            },
        ];
        for case in cases {
            let got = table
                .allocate(&strings(case.ids), &case.nodes)
                .unwrap_or_else(|e| panic!("{:?}: {e}", case.ids));
            let env = |name: &str| {
                got.envs
                    .iter()
                    .find(|(k, _)| k == name)
                    .map(|(_, v)| v.as_str())
            };
            assert_eq!(
                env("GPUPOOL_GPU_INDICES"),
                Some(case.indices),
                "{:?}",
                case.ids
            );
            assert_eq!(env("GPUPOOL_GPU_UUIDS"), Some(case.uuids), "{:?}", case.ids);
            assert_eq!(
                env("NVIDIA_VISIBLE_DEVICES"),
                Some(case.uuids),
                "{:?}",
                case.ids
            );
            assert_eq!(
                got.device_nodes,
                strings(case.device_nodes),
                "{:?}",
                case.ids
            );
            let uuids: Vec<&str> = got.gpus.iter().map(|g| g.uuid.as_str()).collect();
            assert_eq!(uuids.join(","), case.uuids);
        }
    }

    #[test]
    fn allocate_refuses_bad_requests_naming_the_device() {
        let table = SlotTable::new(vec![gpu(0, true), gpu(1, false)], 2);
        let nodes = |_: &str| true;
        let cases: [(&[&str], AllocError); 5] = [
            (&[], AllocError::NoDevices),
            (
                &["GPU-0-s0", "GPU-0-s0"],
                AllocError::Duplicate("GPU-0-s0".to_owned()),
            ),
            (
                &["GPU-0-s2"],
                AllocError::UnknownDevice("GPU-0-s2".to_owned()),
            ),
            (
                &["GPU-0-s0", "GPU-1-s1"],
                AllocError::Unhealthy {
                    id: "GPU-1-s1".to_owned(),
                    index: 1,
                    uuid: "GPU-1".to_owned(),
                },
            ),
            // The first problem in request order is the one reported.
            (
                &["nope", "GPU-1-s0"],
                AllocError::UnknownDevice("nope".to_owned()),
            ),
        ];
        for (ids, want) in cases {
            let err = table.allocate(&strings(ids), &nodes).expect_err("refused");
            let named = match &err {
                AllocError::NoDevices => None,
                AllocError::Duplicate(id)
                | AllocError::UnknownDevice(id)
                | AllocError::Unhealthy { id, .. } => Some(id.clone()),
            };
            if let Some(id) = named {
                assert!(err.to_string().contains(&id), "{err}");
            }
            assert_eq!(err, want, "{ids:?}");
        }
        assert!(
            AllocError::Unhealthy {
                id: String::new(),
                index: 0,
                uuid: String::new()
            }
            .is_unavailable()
        );
        assert!(!AllocError::NoDevices.is_unavailable());
    }

    #[test]
    fn allocate_checks_device_nodes_in_a_directory() {
        let dev = tempfile::tempdir().expect("dev");
        std::fs::write(dev.path().join("nvidia0"), "").expect("node");
        let table = SlotTable::new(vec![gpu(0, true)], 1);
        let got = table
            .allocate(&strings(&["GPU-0-s0"]), &dev.path().to_path_buf())
            .expect("allocates");
        assert_eq!(got.device_nodes, vec!["/dev/nvidia0"]);
    }

    fn ids(table: &SlotTable) -> Vec<String> {
        table.devices().map(|(id, _, _)| id).collect()
    }

    #[test]
    fn ids_are_stable_and_short() {
        let table = SlotTable::new(vec![gpu(2, true), gpu(0, false)], 2);
        assert_eq!(
            ids(&table),
            vec!["GPU-0-s0", "GPU-0-s1", "GPU-2-s0", "GPU-2-s1"]
        );
        let slot = table.lookup("GPU-2-s1").expect("known");
        assert_eq!((slot.gpu.node.index, slot.session), (2, 1));
        assert!(table.lookup("GPU-2-s2").is_none());
        let longest = device_id(
            &"x".repeat(crate::discovery::MAX_UUID_LEN),
            MAX_SESSIONS_PER_GPU - 1,
        );
        assert!(longest.len() <= 63, "{}", longest.len());
    }

    #[test]
    fn preferred_spreads_over_least_used_gpus() {
        let table = SlotTable::new(vec![gpu(0, true), gpu(1, true), gpu(2, true)], 2);
        // GPU 0 has one session in use, GPUs 1 and 2 none.
        let available: Vec<String> = ["GPU-0-s1", "GPU-1-s0", "GPU-1-s1", "GPU-2-s0", "GPU-2-s1"]
            .map(String::from)
            .to_vec();
        let pick = table.preferred(&available, &[], 1).expect("fits");
        assert_eq!(pick, vec!["GPU-1-s0"]);
        let pick = table.preferred(&available, &[], 3).expect("fits");
        assert_eq!(pick, vec!["GPU-1-s0", "GPU-2-s0", "GPU-0-s1"]);
        // More slots than GPUs: a GPU is reused only when all are used.
        let pick = table.preferred(&available, &[], 4).expect("fits");
        assert_eq!(pick, vec!["GPU-1-s0", "GPU-2-s0", "GPU-0-s1", "GPU-1-s1"]);
    }

    #[test]
    fn preferred_honours_must_include_and_keeps_gpus_distinct() {
        let table = SlotTable::new(vec![gpu(0, true), gpu(1, true)], 2);
        let available: Vec<String> = ["GPU-0-s0", "GPU-0-s1", "GPU-1-s0", "GPU-1-s1"]
            .map(String::from)
            .to_vec();
        let must = vec!["GPU-0-s1".to_owned()];
        let pick = table.preferred(&available, &must, 2).expect("fits");
        assert_eq!(pick, vec!["GPU-0-s1", "GPU-1-s0"]);
    }

    #[test]
    fn preferred_errors() {
        let table = SlotTable::new(vec![gpu(0, true)], 1);
        let available = vec!["GPU-0-s0".to_owned()];
        assert_eq!(
            table.preferred(&["nope".to_owned()], &[], 1),
            Err(PreferenceError::UnknownDevice("nope".to_owned()))
        );
        for size in [-1, 2] {
            let err = table.preferred(&available, &[], size).expect_err("size");
            assert!(err.to_string().contains("impossible"), "{err}");
        }
        let err = table.preferred(&available, &[], 2).expect_err("size");
        assert_eq!(
            err.to_string(),
            "allocation size 2 is impossible: 0 devices must be included and 1 is available"
        );
        let err = table
            .preferred(&available, &available, 2)
            .expect_err("size");
        assert!(
            err.to_string().contains(": 1 device must be included"),
            "{err}"
        );
    }
}
