//! Objects as the operator's caches keep them: what the controller and
//! the rules read, without the room an `ObjectMeta` reserves inline (most
//! of it empty options) for every pod and lease, so the caches grow with
//! what the rules read, not with Kubernetes' metadata (figures in
//! docs/performance-log.md).

use std::sync::Arc;

use gpupool_api::{GpuLease, GpuLeaseSpec, GpuLeaseStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};

use crate::model::ObjectKey;

/// The metadata a cached object keeps: its identity, the resourceVersion
/// it was read at and the two timestamps the rules read. Labels,
/// annotations, owner references and managed fields are not kept: each
/// kind's cached form keeps the few labels and annotations it reads
/// itself, so what anyone adds to an object cannot grow the cache.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CachedMeta {
    /// The namespace: shared, so that a cache holds each namespace's name
    /// once for all its objects (see [`CachedMeta::share_key`]).
    pub namespace: Option<Arc<str>>,
    /// The name: shared with the key a cache holds the object under.
    pub name: Option<Arc<str>>,
    /// The UID: an object deleted and created again under its name is
    /// another.
    pub uid: Option<Box<str>>,
    /// What the controller's own writes are compared against, and the
    /// precondition of its next.
    pub resource_version: Option<Box<str>>,
    /// When it was created.
    pub creation_timestamp: Option<Time>,
    /// Set once it is being deleted.
    pub deletion_timestamp: Option<Time>,
}

impl From<ObjectMeta> for CachedMeta {
    fn from(meta: ObjectMeta) -> Self {
        Self {
            namespace: meta.namespace.map(Arc::from),
            name: meta.name.map(Arc::from),
            uid: meta.uid.map(String::into_boxed_str),
            resource_version: meta.resource_version.map(String::into_boxed_str),
            creation_timestamp: meta.creation_timestamp,
            deletion_timestamp: meta.deletion_timestamp,
        }
    }
}

impl CachedMeta {
    /// Holds `key`'s strings instead of its own where they are equal (an
    /// unequal one is left as it is), so an object kept under `key` costs
    /// no second copy of its namespace and name.
    pub fn share_key(&mut self, key: &ObjectKey) {
        let share = |mine: &mut Option<Arc<str>>, theirs: &Arc<str>| {
            if mine.as_deref() == Some(&**theirs) {
                *mine = Some(theirs.clone());
            }
        };
        share(&mut self.namespace, &key.namespace);
        share(&mut self.name, &key.name);
    }

    /// An `ObjectMeta` holding exactly these fields.
    pub fn to_object_meta(&self) -> ObjectMeta {
        let owned = |s: Option<&str>| s.map(str::to_owned);
        ObjectMeta {
            namespace: owned(self.namespace.as_deref()),
            name: owned(self.name.as_deref()),
            uid: owned(self.uid.as_deref()),
            resource_version: owned(self.resource_version.as_deref()),
            creation_timestamp: self.creation_timestamp.clone(),
            deletion_timestamp: self.deletion_timestamp.clone(),
            ..ObjectMeta::default()
        }
    }
}

/// A GpuLease as the caches, the engine and the controller's writes keep
/// it: its spec and status whole, its metadata cut down to [`CachedMeta`].
/// Nothing the operator decides reads a lease's labels, annotations or
/// owner references (its writes are patches, so the server's copy keeps
/// them).
#[derive(Clone, Debug, PartialEq)]
pub struct CachedLease {
    /// Identity, resourceVersion and timestamps.
    pub metadata: CachedMeta,
    /// The spec, as the operator wrote it.
    pub spec: GpuLeaseSpec,
    /// The status; `None` before the first status write.
    pub status: Option<GpuLeaseStatus>,
}

impl From<GpuLease> for CachedLease {
    fn from(lease: GpuLease) -> Self {
        Self {
            metadata: lease.metadata.into(),
            spec: lease.spec,
            status: lease.status,
        }
    }
}

impl CachedLease {
    /// A lease named `name` in `namespace` with `spec` and `status`, as it
    /// is before the API server has stored it (no UID, no resourceVersion).
    pub fn new(
        namespace: &str,
        name: &str,
        spec: GpuLeaseSpec,
        status: Option<GpuLeaseStatus>,
    ) -> Self {
        Self::under(&ObjectKey::new(namespace, name), spec, status)
    }

    /// A lease kept under `key` with `spec` and `status`, as it is before
    /// the API server has stored it, holding `key`'s strings rather than
    /// copies of them.
    pub fn under(key: &ObjectKey, spec: GpuLeaseSpec, status: Option<GpuLeaseStatus>) -> Self {
        Self {
            metadata: CachedMeta {
                namespace: Some(key.namespace.clone()),
                name: Some(key.name.clone()),
                ..CachedMeta::default()
            },
            spec,
            status,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpupool_api::{LeasePhase, Role};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;

    #[test]
    fn a_cached_lease_keeps_identity_spec_and_status_only() {
        let spec = GpuLeaseSpec {
            class_name: "fast".into(),
            pod_name: "p".into(),
            pod_uid: "u".into(),
            role: Role::Helper,
            slots: 2,
        };
        let status = GpuLeaseStatus {
            phase: LeasePhase::Queued,
            sequence: Some(7),
            ..GpuLeaseStatus::default()
        };
        let time = |t: &str| Some(Time(t.parse().expect("timestamp")));
        let mut lease = GpuLease::new("p", spec.clone());
        lease.status = Some(status.clone());
        lease.metadata = ObjectMeta {
            namespace: Some("ml".into()),
            name: Some("p".into()),
            uid: Some("l-1".into()),
            resource_version: Some("42".into()),
            creation_timestamp: time("2026-01-01T00:00:00Z"),
            deletion_timestamp: time("2026-01-01T00:05:00Z"),
            labels: Some([("team".to_owned(), "x".to_owned())].into()),
            annotations: Some([("note".to_owned(), "y".repeat(1 << 10))].into()),
            owner_references: Some(vec![OwnerReference::default()]),
            finalizers: Some(vec!["example.com/keep".into()]),
            ..ObjectMeta::default()
        };
        let cached = CachedLease::from(lease);
        assert_eq!((&cached.spec, &cached.status), (&spec, &Some(status)));
        let meta = cached.metadata.to_object_meta();
        assert_eq!(
            (
                meta.namespace.as_deref(),
                meta.name.as_deref(),
                meta.uid.as_deref(),
                meta.resource_version.as_deref()
            ),
            (Some("ml"), Some("p"), Some("l-1"), Some("42"))
        );
        assert_eq!(meta.creation_timestamp, time("2026-01-01T00:00:00Z"));
        assert_eq!(meta.deletion_timestamp, time("2026-01-01T00:05:00Z"));
        assert_eq!(
            (
                meta.labels,
                meta.annotations,
                meta.owner_references,
                meta.finalizers
            ),
            (None, None, None, None),
            "nothing else of the metadata is kept"
        );
    }

    #[test]
    fn a_shared_key_replaces_equal_strings_only() {
        let key = ObjectKey::new("ml", "p");
        let mut meta = CachedMeta {
            namespace: Some("ml".into()),
            name: Some("p".into()),
            uid: Some("u".into()),
            ..CachedMeta::default()
        };
        meta.share_key(&key);
        let same = |mine: &Option<Arc<str>>, theirs: &Arc<str>| {
            mine.as_ref().is_some_and(|m| Arc::ptr_eq(m, theirs))
        };
        assert!(same(&meta.namespace, &key.namespace) && same(&meta.name, &key.name));
        assert_eq!(meta.uid.as_deref(), Some("u"));

        // Another object's key, or none at all, changes nothing.
        let mut other = CachedMeta {
            namespace: Some("ml".into()),
            name: Some("q".into()),
            ..CachedMeta::default()
        };
        other.share_key(&key);
        assert!(same(&other.namespace, &key.namespace));
        assert!(!same(&other.name, &key.name));
        assert_eq!(other.name.as_deref(), Some("q"));
        let mut unnamed = CachedMeta::default();
        unnamed.share_key(&key);
        assert_eq!(unnamed, CachedMeta::default());
    }

    #[test]
    fn a_new_lease_has_its_name_and_nothing_the_server_gives() {
        let spec = GpuLeaseSpec {
            class_name: "fast".into(),
            pod_name: "p".into(),
            pod_uid: "u".into(),
            role: Role::Primary,
            slots: 1,
        };
        let lease = CachedLease::new("ml", "p", spec, None);
        assert_eq!(
            lease.metadata,
            CachedMeta {
                namespace: Some("ml".into()),
                name: Some("p".into()),
                ..CachedMeta::default()
            }
        );
    }
}
