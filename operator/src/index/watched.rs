//! How pods and leases are read from the API server before they are kept:
//! the metadata of both ([`kept_metadata`]), and the lease's watched form
//! ([`WatchedLease`]; the pod's, [`WatchedPod`], sits beside the
//! [`CachedPod`] it becomes). The watches read them, and so do the answers
//! to the operator's own writes, which carry the same fields.
//!
//! kube's watcher follows resourceVersions through an `ObjectMeta`, so a
//! watched object must carry one; but the cache keeps only its identity,
//! timestamps and a few labels and annotations ([`CachedMeta`]). Read into a
//! whole `ObjectMeta`, every watch event would first build what is thrown
//! away at once: managed fields above all (one entry per writer of the
//! object, each a tree of JSON maps, and every pod and lease is written by
//! several), owner references, finalizers, and labels and annotations of any
//! size a tenant puts on their pod. [`kept_metadata`] reads only what is
//! kept, and the parser skips the rest without allocating for it.
//!
//! [`CachedMeta`]: crate::engine::CachedMeta
//! [`WatchedPod`]: super::cached_pod::WatchedPod
//! [`CachedPod`]: super::cached_pod::CachedPod

use std::collections::BTreeMap;
use std::fmt;

use gpupool_api::names::{ANNOTATION_ENQUEUED_AT, LABEL_CLASS, LABEL_ROLE};
use gpupool_api::{GpuLease, GpuLeaseSpec, GpuLeaseStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use serde::de::{DeserializeSeed, IgnoredAny, MapAccess, Visitor};
use serde::{Deserialize, Deserializer};

use crate::engine::CachedLease;

/// The labels kept: the ones admission reads. Any other, even under
/// `gpupool.io/`, is dropped, so what a pod's owner adds to their pod
/// cannot grow the operator's cache.
pub const KEPT_LABELS: [&str; 2] = [LABEL_CLASS, LABEL_ROLE];

/// The annotations kept: the enqueue stamp.
pub const KEPT_ANNOTATIONS: [&str; 1] = [ANNOTATION_ENQUEUED_AT];

/// Implements `kube::Resource` for a watched form by naming the kind it
/// stands for, and reading its `metadata`.
macro_rules! watched_form_of {
    ($watched:ty => $kind:ty) => {
        impl ::kube::Resource for $watched {
            type DynamicType = ();
            type Scope = ::k8s_openapi::NamespaceResourceScope;

            fn kind(_: &()) -> ::std::borrow::Cow<'_, str> {
                <$kind as ::kube::Resource>::kind(&())
            }
            fn group(_: &()) -> ::std::borrow::Cow<'_, str> {
                <$kind as ::kube::Resource>::group(&())
            }
            fn version(_: &()) -> ::std::borrow::Cow<'_, str> {
                <$kind as ::kube::Resource>::version(&())
            }
            fn api_version(_: &()) -> ::std::borrow::Cow<'_, str> {
                <$kind as ::kube::Resource>::api_version(&())
            }
            fn plural(_: &()) -> ::std::borrow::Cow<'_, str> {
                <$kind as ::kube::Resource>::plural(&())
            }
            fn meta(&self) -> &ObjectMeta {
                &self.metadata
            }
            fn meta_mut(&mut self) -> &mut ObjectMeta {
                &mut self.metadata
            }
        }
    };
}
pub(crate) use watched_form_of;

/// The fields of an object's metadata the operator keeps. Unknown fields
/// (every other one) are skipped by the parser.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct KeptFields {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    namespace: Option<String>,
    #[serde(default)]
    uid: Option<String>,
    #[serde(default)]
    resource_version: Option<String>,
    #[serde(default)]
    creation_timestamp: Option<Time>,
    #[serde(default)]
    deletion_timestamp: Option<Time>,
    #[serde(default, deserialize_with = "kept_labels")]
    labels: Option<BTreeMap<String, String>>,
    #[serde(default, deserialize_with = "kept_annotations")]
    annotations: Option<BTreeMap<String, String>>,
}

/// Reads an object's `metadata` keeping its name, namespace, UID,
/// resourceVersion, creation and deletion time, the [`KEPT_LABELS`] and the
/// [`KEPT_ANNOTATIONS`]; every other field, label and annotation is skipped
/// unread, and is `None` (or absent) in the result.
pub fn kept_metadata<'de, D: Deserializer<'de>>(deserializer: D) -> Result<ObjectMeta, D::Error> {
    let kept = KeptFields::deserialize(deserializer)?;
    Ok(ObjectMeta {
        name: kept.name,
        namespace: kept.namespace,
        uid: kept.uid,
        resource_version: kept.resource_version,
        creation_timestamp: kept.creation_timestamp,
        deletion_timestamp: kept.deletion_timestamp,
        labels: kept.labels,
        annotations: kept.annotations,
        ..ObjectMeta::default()
    })
}

fn kept_labels<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<BTreeMap<String, String>>, D::Error> {
    deserializer.deserialize_option(KeptEntries(&KEPT_LABELS))
}

fn kept_annotations<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<BTreeMap<String, String>>, D::Error> {
    deserializer.deserialize_option(KeptEntries(&KEPT_ANNOTATIONS))
}

/// A string map (or null) of which only the entries under these keys are
/// read; the others' keys are compared in place and their values skipped.
struct KeptEntries(&'static [&'static str]);

impl<'de> Visitor<'de> for KeptEntries {
    type Value = Option<BTreeMap<String, String>>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a map of strings to strings, or null")
    }

    fn visit_none<E>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_some<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_map(self)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut kept = BTreeMap::new();
        while let Some(key) = map.next_key_seed(KeptKey(self.0))? {
            match key {
                Some(key) => {
                    kept.insert(key.to_owned(), map.next_value::<String>()?);
                }
                None => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(Some(kept))
    }
}

/// A map key read as the one of these keys it equals, if any, without
/// allocating for it.
struct KeptKey(&'static [&'static str]);

impl<'de> DeserializeSeed<'de> for KeptKey {
    type Value = Option<&'static str>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_str(self)
    }
}

impl Visitor<'_> for KeptKey {
    type Value = Option<&'static str>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a string key")
    }

    fn visit_str<E>(self, key: &str) -> Result<Self::Value, E> {
        Ok(self.0.iter().copied().find(|k| *k == key))
    }
}

/// A GpuLease as the lease watch reads it: the kept metadata
/// ([`kept_metadata`]), the spec and the status. Nothing keeps one: it
/// becomes a [`CachedLease`].
#[derive(Clone, Debug, Deserialize)]
pub struct WatchedLease {
    /// The kept part of the metadata.
    #[serde(deserialize_with = "kept_metadata")]
    pub metadata: ObjectMeta,
    /// The spec, whole.
    pub spec: GpuLeaseSpec,
    /// The status, whole.
    #[serde(default)]
    pub status: Option<GpuLeaseStatus>,
}

watched_form_of!(WatchedLease => GpuLease);

impl From<WatchedLease> for CachedLease {
    fn from(lease: WatchedLease) -> Self {
        GpuLease {
            metadata: lease.metadata,
            spec: lease.spec,
            status: lease.status,
        }
        .into()
    }
}

#[cfg(test)]
mod tests {
    use kube::Resource;
    use serde_json::json;

    use super::*;
    use crate::index::identity::Identity;

    /// Metadata as a real API server sends it for an object several
    /// writers touched.
    fn busy_metadata() -> serde_json::Value {
        json!({
            "name": "p",
            "namespace": "ml",
            "uid": "u-1",
            "resourceVersion": "42",
            "generation": 3,
            "generateName": "p-",
            "creationTimestamp": "2026-01-01T00:00:00Z",
            "deletionTimestamp": "2026-01-01T00:05:00Z",
            "finalizers": ["example.com/keep"],
            "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": "o", "uid": "u-o"}],
            "managedFields": [{
                "manager": "kubectl",
                "operation": "Update",
                "apiVersion": "v1",
                "fieldsType": "FieldsV1",
                "fieldsV1": {"f:metadata": {"f:labels": {".": {}, "f:team": {}}}}
            }],
            "labels": {
                "gpupool.io/class": "default",
                "gpupool.io/role": "helper",
                "gpupool.io/other": "x",
                "team": "a"
            },
            "annotations": {
                "gpupool.io/enqueued-at": "2026-01-01T00:00:00.000001Z",
                "big": "y".repeat(4096)
            }
        })
    }

    #[derive(Deserialize)]
    struct Wrapped {
        #[serde(deserialize_with = "kept_metadata")]
        metadata: ObjectMeta,
    }

    fn read(metadata: serde_json::Value) -> Result<ObjectMeta, serde_json::Error> {
        serde_json::from_value::<Wrapped>(json!({ "metadata": metadata })).map(|w| w.metadata)
    }

    #[test]
    fn kept_metadata_reads_identity_timestamps_and_the_kept_keys_only() {
        let meta = read(busy_metadata()).expect("metadata");
        let time = |t: &str| Some(Time(t.parse().expect("timestamp")));
        let expected = ObjectMeta {
            name: Some("p".into()),
            namespace: Some("ml".into()),
            uid: Some("u-1".into()),
            resource_version: Some("42".into()),
            creation_timestamp: time("2026-01-01T00:00:00Z"),
            deletion_timestamp: time("2026-01-01T00:05:00Z"),
            labels: Some(BTreeMap::from([
                ("gpupool.io/class".into(), "default".into()),
                ("gpupool.io/role".into(), "helper".into()),
            ])),
            annotations: Some(BTreeMap::from([(
                "gpupool.io/enqueued-at".into(),
                "2026-01-01T00:00:00.000001Z".into(),
            )])),
            ..ObjectMeta::default()
        };
        assert_eq!(meta, expected);
    }

    #[test]
    fn kept_metadata_takes_absent_and_null_maps_alike() {
        let meta = read(json!({"name": "p", "labels": null})).expect("metadata");
        assert_eq!((meta.labels, meta.annotations), (None, None));
        let meta = read(json!({"labels": {"team": "a"}})).expect("metadata");
        assert_eq!(meta.labels, Some(BTreeMap::new()), "no kept label");
    }

    #[test]
    fn kept_metadata_refuses_what_an_object_meta_refuses() {
        // Read or skipped, a field of the wrong type is an error that
        // names it, as a whole ObjectMeta would give: no half-read pod.
        for (bad, named) in [
            (json!({"name": 7}), "integer `7`"),
            (json!({"labels": ["gpupool.io/class"]}), "a map of strings"),
            (json!({"labels": {"gpupool.io/class": 1}}), "integer `1`"),
            (json!({"creationTimestamp": "yesterday"}), ""),
        ] {
            let error = read(bad.clone()).expect_err("refused").to_string();
            assert!(error.contains(named), "{bad}: {error}");
        }
    }

    #[test]
    fn a_watched_lease_becomes_a_cached_lease_with_its_identity_spec_and_status() {
        let lease = json!({
            "apiVersion": "gpupool.io/v1alpha1",
            "kind": "GpuLease",
            "metadata": busy_metadata(),
            "spec": {
                "className": "default",
                "role": "primary",
                "podName": "p",
                "podUID": "u-1",
                "slots": 1
            },
            "status": {"phase": "Queued", "sequence": 7, "position": 1}
        });
        let whole: GpuLease = serde_json::from_value(lease.clone()).expect("lease");
        let watched: WatchedLease = serde_json::from_value(lease).expect("watched lease");
        assert_eq!(watched.metadata.managed_fields, None);
        assert_eq!(watched.meta().resource_version.as_deref(), Some("42"));
        let (via_watch, via_whole) = (CachedLease::from(watched), CachedLease::from(whole));
        assert_eq!(via_watch.spec, via_whole.spec);
        assert_eq!(via_watch.status, via_whole.status);
        assert_eq!(
            (
                Identity::namespace(&via_watch),
                Identity::name(&via_watch),
                Identity::uid(&via_watch),
                Identity::resource_version(&via_watch),
                Identity::deleting(&via_watch),
            ),
            (
                Identity::namespace(&via_whole),
                Identity::name(&via_whole),
                Identity::uid(&via_whole),
                Identity::resource_version(&via_whole),
                Identity::deleting(&via_whole),
            )
        );
        assert_eq!(
            WatchedLease::url_path(&(), Some("ml")),
            GpuLease::url_path(&(), Some("ml")),
            "watched at the lease's own path"
        );
        assert_eq!(WatchedLease::api_version(&()), GpuLease::api_version(&()));
    }
}
