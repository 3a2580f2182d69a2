//! The progress writer's records of its own writes (see the module above
//! for where they sit among the controller's other records).
//!
//! The progress writer writes a lease's position and message over the
//! resourceVersion a pass decided on. Its answer reaches the watch caches a
//! little later than the writer, so the passes in between decide on the
//! lease as it was before, and a status they decide would be refused as a
//! conflict. A record says which versions led to the lease's newest one
//! through this writer's writes alone, and what those writes left, so such
//! a status is written over the newest version instead (or not at all when
//! it says the same). Pure: time is passed in.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use gpupool_api::GpuLeaseStatus;

use crate::engine::{CachedLease, CachedMeta, ObjectKey};

/// How long a record of the writer's own write is kept: long enough for the
/// watch to deliver it (then the passes decide on it and the record is
/// dropped), short enough that records of leases never offered again (their
/// pod deleted while it waited) cannot pile up.
const OWN_WRITE_TTL: Duration = Duration::from_secs(10);

/// At most this many leases have a record; a write beyond them is made but
/// not recorded (a later stale status for that lease is refused as a
/// conflict, as it would be without records).
const OWN_WRITE_RECORDS: usize = 4096;

/// At most this many resourceVersions lead to one record: a lease whose
/// watch lags behind more of the writer's writes than this is written as
/// decided, and refused if it is stale.
const OWN_WRITE_CHAIN: usize = 8;

/// The writer's own writes the watch caches may not have delivered yet.
/// Pure: time is passed in.
///
/// Guarantee: [`ProgressRecords::base`] answers for a lease only when every
/// change from the resourceVersion a status was decided on to the one it
/// returns was a write of this writer (position and message only), so a
/// status decided on the older lease may be written over the newer one.
/// Any other writer's change moves the lease past the returned
/// resourceVersion, and the write carrying it is refused as before.
#[derive(Debug, Default)]
pub struct ProgressRecords {
    by_key: HashMap<ObjectKey, ProgressRecord>,
    /// When each record was made, oldest first; a key appears once per
    /// record made, and only the entry matching the record's time expires it.
    made: VecDeque<(Instant, ObjectKey)>,
}

/// One lease as the writer's latest write left it. Only position and
/// message are kept: they are all the writer changes, so the lease's status
/// is the one a status was decided on with these two replaced.
#[derive(Debug)]
struct ProgressRecord {
    /// The resourceVersions from which only this writer's writes lead here.
    behind: Vec<String>,
    position: Option<u32>,
    message: Option<String>,
    /// The resourceVersion the latest write returned.
    resource_version: String,
    at: Instant,
}

/// What a status decided on an older version is written over: the
/// position and message the writer's own writes left, at their
/// resourceVersion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Base<'a> {
    /// Position the lease now has.
    pub position: Option<u32>,
    /// Message the lease now has.
    pub message: Option<&'a str>,
    /// The lease's resourceVersion.
    pub resource_version: &'a str,
}

impl ProgressRecords {
    /// Records that a status decided on `decided_on` was written, and the
    /// API server returned `status` at `resource_version`. `written_over`
    /// is the resourceVersion the write's precondition named.
    pub fn record(
        &mut self,
        key: ObjectKey,
        decided_on: &str,
        written_over: &str,
        status: GpuLeaseStatus,
        resource_version: String,
        now: Instant,
    ) {
        self.expire(now);
        let mut behind = match self.by_key.remove(&key) {
            Some(old) if old.resource_version == written_over => old.behind,
            _ if self.by_key.len() >= OWN_WRITE_RECORDS => return,
            _ => Vec::new(),
        };
        for rv in [decided_on, written_over] {
            if !behind.iter().any(|b| b == rv) {
                behind.push(rv.to_owned());
            }
        }
        if behind.len() > OWN_WRITE_CHAIN {
            behind.drain(..behind.len() - OWN_WRITE_CHAIN);
        }
        self.made.push_back((now, key.clone()));
        self.by_key.insert(
            key,
            ProgressRecord {
                behind,
                position: status.position,
                message: status.message,
                resource_version,
                at: now,
            },
        );
    }

    /// The status and resourceVersion to write a status decided on
    /// `decided_on` over, when the writer's own writes moved the lease on
    /// since. A record the caches have caught up with, or that the lease
    /// has left behind, is dropped.
    pub fn base(&mut self, key: &ObjectKey, decided_on: &str, now: Instant) -> Option<Base<'_>> {
        self.expire(now);
        let fresh = self
            .by_key
            .get(key)
            .is_some_and(|w| w.behind.iter().any(|rv| rv == decided_on));
        if !fresh {
            self.by_key.remove(key);
            return None;
        }
        let w = self.by_key.get(key)?;
        Some(Base {
            position: w.position,
            message: w.message.as_deref(),
            resource_version: w.resource_version.as_str(),
        })
    }

    /// Forgets what is known of `key` (another writer is writing it, or the
    /// writer's last write was refused).
    pub fn forget(&mut self, key: &ObjectKey) {
        self.by_key.remove(key);
    }

    /// Leases with a record.
    pub fn len(&self) -> usize {
        self.by_key.len()
    }

    /// True when no record is kept.
    pub fn is_empty(&self) -> bool {
        self.by_key.is_empty()
    }

    fn expire(&mut self, now: Instant) {
        while let Some((at, _)) = self.made.front() {
            if now.saturating_duration_since(*at) < OWN_WRITE_TTL {
                break;
            }
            let Some((at, key)) = self.made.pop_front() else {
                break;
            };
            if self.by_key.get(&key).is_some_and(|w| w.at == at) {
                self.by_key.remove(&key);
            }
        }
    }
}

impl Base<'_> {
    /// `decided_on` (the status a pass read) as the writer's own writes
    /// since left it.
    pub fn status_over(&self, decided_on: Option<&GpuLeaseStatus>) -> Option<GpuLeaseStatus> {
        decided_on.map(|status| GpuLeaseStatus {
            position: self.position,
            message: self.message.map(str::to_owned),
            ..status.clone()
        })
    }

    /// `lease` (the version a status was decided on) as the writer's own
    /// writes since left it.
    pub fn lease_over(&self, lease: &CachedLease) -> CachedLease {
        CachedLease {
            metadata: CachedMeta {
                resource_version: Some(self.resource_version.into()),
                ..lease.metadata.clone()
            },
            spec: lease.spec.clone(),
            status: self.status_over(lease.status.as_ref()),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn key(name: &str) -> ObjectKey {
        ObjectKey::new("ns", name)
    }

    /// A Queued status at `position`.
    pub(crate) fn status_at(position: u32) -> GpuLeaseStatus {
        GpuLeaseStatus {
            phase: gpupool_api::LeasePhase::Queued,
            sequence: Some(7),
            position: Some(position),
            ..GpuLeaseStatus::default()
        }
    }

    #[test]
    fn a_status_decided_before_the_writers_own_writes_is_written_over_them() {
        let mut own = ProgressRecords::default();
        let t0 = Instant::now();
        // Decided on rv 1, written over rv 1, answered as rv 2; then decided
        // on rv 1 again (the watch still lags), written over rv 2: rv 3.
        own.record(key("a"), "1", "1", status_at(2), "2".into(), t0);
        assert_eq!(
            own.base(&key("a"), "1", t0)
                .map(|b| (b.position, b.resource_version.to_owned())),
            Some((Some(2), "2".to_owned()))
        );
        own.record(key("a"), "1", "2", status_at(1), "3".into(), t0);
        for decided_on in ["1", "2"] {
            assert_eq!(
                own.base(&key("a"), decided_on, t0)
                    .map(|b| b.resource_version.to_owned()),
                Some("3".to_owned()),
                "decided on rv {decided_on}"
            );
        }
        // The caches caught up: the status is written as decided, and the
        // record is no longer needed.
        assert!(own.base(&key("a"), "3", t0).is_none());
        assert!(own.is_empty());
    }

    #[test]
    fn a_record_is_dropped_when_the_lease_moved_past_it_or_it_grew_old() {
        let mut own = ProgressRecords::default();
        let t0 = Instant::now();
        own.record(key("a"), "1", "1", status_at(2), "2".into(), t0);
        // Decided on a version the writer did not write from (another
        // writer's): no base, and the record goes.
        assert!(own.base(&key("a"), "5", t0).is_none());
        assert!(own.is_empty());

        own.record(key("a"), "1", "1", status_at(2), "2".into(), t0);
        own.record(key("b"), "1", "1", status_at(3), "2".into(), t0);
        own.forget(&key("a"));
        assert!(own.base(&key("a"), "1", t0).is_none(), "forgotten");
        assert_eq!(own.len(), 1);
        let late = t0 + OWN_WRITE_TTL;
        assert!(own.base(&key("b"), "1", late).is_none(), "expired");
        assert!(own.is_empty());

        // A write that did not build on the record starts a new chain.
        own.record(key("c"), "1", "1", status_at(2), "2".into(), t0);
        own.record(key("c"), "4", "4", status_at(1), "5".into(), t0);
        assert!(own.base(&key("c"), "1", t0).is_none());
        own.record(key("c"), "4", "4", status_at(1), "5".into(), t0);
        assert!(own.base(&key("c"), "4", t0).is_some());
    }

    #[test]
    fn a_record_renewed_after_its_first_write_outlives_that_write() {
        let mut own = ProgressRecords::default();
        let t0 = Instant::now();
        own.record(key("a"), "1", "1", status_at(2), "2".into(), t0);
        let t1 = t0 + OWN_WRITE_TTL / 2;
        own.record(key("a"), "1", "2", status_at(1), "3".into(), t1);
        assert!(
            own.base(&key("a"), "1", t0 + OWN_WRITE_TTL).is_some(),
            "the first write's expiry does not drop the renewed record"
        );
        assert!(own.base(&key("a"), "1", t1 + OWN_WRITE_TTL).is_none());
    }

    #[test]
    fn the_chain_behind_a_record_is_bounded() {
        let mut own = ProgressRecords::default();
        let t0 = Instant::now();
        for rv in 1..=20u32 {
            own.record(
                key("a"),
                "1",
                &rv.to_string(),
                status_at(1),
                (rv + 1).to_string(),
                t0,
            );
        }
        assert!(own.base(&key("a"), "20", t0).is_some());
        assert!(
            own.base(&key("a"), "2", t0).is_none(),
            "older versions than the chain keeps are written as decided"
        );
    }

    #[test]
    fn records_are_bounded_whatever_the_number_of_leases_written() {
        let mut own = ProgressRecords::default();
        let t0 = Instant::now();
        for i in 0..=OWN_WRITE_RECORDS {
            own.record(
                key(&format!("l{i}")),
                "1",
                "1",
                status_at(1),
                "2".into(),
                t0,
            );
        }
        assert_eq!(own.len(), OWN_WRITE_RECORDS);
        let last = key(&format!("l{OWN_WRITE_RECORDS}"));
        assert!(own.base(&last, "1", t0).is_none(), "not recorded");
        // A lease already recorded still has its chain extended.
        own.record(key("l0"), "1", "2", status_at(1), "3".into(), t0);
        assert!(own.base(&key("l0"), "2", t0).is_some());
    }
}
