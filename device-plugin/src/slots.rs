//! The resource manager: each GPU becomes `--sessions-per-gpu` slots, each
//! slot a kubelet device with a stable ID, and the preferred-allocation
//! policy (distinct GPUs per container, least-used GPUs first).

use std::collections::HashMap;

use crate::discovery::Gpu;

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
        "allocation size {size} is impossible: {must_include} device(s) must be included and {available} are available"
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

    /// Every slot as (device ID, healthy), GPU by GPU in index order.
    pub fn devices(&self) -> impl Iterator<Item = (String, bool)> + '_ {
        self.gpus.iter().flat_map(move |gpu| {
            (0..self.sessions_per_gpu)
                .map(move |s| (device_id(&gpu.node.uuid, s), gpu.node.healthy))
        })
    }

    /// Resolves a device ID.
    pub fn lookup(&self, id: &str) -> Option<Slot<'_>> {
        self.by_id.get(id).map(|(position, session)| Slot {
            gpu: &self.gpus[*position],
            session: *session,
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

    fn ids(table: &SlotTable) -> Vec<String> {
        table.devices().map(|(id, _)| id).collect()
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
    }
}
