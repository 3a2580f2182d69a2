//! What the operator reads of a cached object's identity, whatever form
//! its cache keeps it in: the kinds kept whole read it from their
//! `ObjectMeta`, pods and leases from the [`CachedMeta`] they keep instead
//! (see [`super::cached_pod`] and [`gpupool_engine::CachedLease`]).

use gpupool_api::GpuLeaseClass;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use super::cached_pod::CachedPod;
use crate::engine::{CachedLease, CachedMeta, ObjectKey};

/// An object's namespace, name, UID, resourceVersion and whether it is
/// being deleted.
pub trait Identity {
    /// The namespace; empty for a cluster-scoped object.
    fn namespace(&self) -> &str;
    /// The name; `None` for an object that has none (never one the API
    /// server returns).
    fn name(&self) -> Option<&str>;
    /// The UID.
    fn uid(&self) -> Option<&str>;
    /// The resourceVersion it was read at.
    fn resource_version(&self) -> Option<&str>;
    /// Whether it carries a deletion timestamp.
    fn deleting(&self) -> bool;
    /// Holds `key`'s namespace and name instead of its own copies, where
    /// its form can share them (the cached forms can; a kind kept whole
    /// owns its strings, and keeps them).
    fn share_key(&mut self, _key: &ObjectKey) {}
}

/// The two metadata types: the same fields, owned as `String` in one and
/// `Box<str>` and `Arc<str>` in the other.
macro_rules! identity_of_fields {
    ($($meta:ty),* $(,)?) => {$(
        impl Identity for $meta {
            fn namespace(&self) -> &str {
                self.namespace.as_deref().unwrap_or_default()
            }
            fn name(&self) -> Option<&str> {
                self.name.as_deref()
            }
            fn uid(&self) -> Option<&str> {
                self.uid.as_deref()
            }
            fn resource_version(&self) -> Option<&str> {
                self.resource_version.as_deref()
            }
            fn deleting(&self) -> bool {
                self.deletion_timestamp.is_some()
            }
        }
    )*};
}

identity_of_fields!(ObjectMeta, CachedMeta);

/// Objects whose `metadata` field answers for them; `shares` for the
/// cached forms, whose [`CachedMeta`] can share the cache's key.
macro_rules! identity_of_metadata {
    (shares $($kind:ty),* $(,)?) => {$(
        identity_of_metadata!(@impl $kind, fn share_key(&mut self, key: &ObjectKey) {
            self.metadata.share_key(key);
        });
    )*};
    ($($kind:ty),* $(,)?) => {$(
        identity_of_metadata!(@impl $kind,);
    )*};
    (@impl $kind:ty, $($share:item)?) => {
        impl Identity for $kind {
            fn namespace(&self) -> &str {
                self.metadata.namespace()
            }
            fn name(&self) -> Option<&str> {
                Identity::name(&self.metadata)
            }
            fn uid(&self) -> Option<&str> {
                Identity::uid(&self.metadata)
            }
            fn resource_version(&self) -> Option<&str> {
                Identity::resource_version(&self.metadata)
            }
            fn deleting(&self) -> bool {
                self.metadata.deleting()
            }
            $($share)?
        }
    };
}

identity_of_metadata!(Node, GpuLeaseClass);
identity_of_metadata!(shares CachedPod, CachedLease);

#[cfg(test)]
identity_of_metadata!(k8s_openapi::api::core::v1::ConfigMap);

/// An object's namespace (empty when cluster-scoped) and name, borrowed.
pub fn parts_of<K: Identity>(obj: &K) -> Option<(&str, &str)> {
    Some((obj.namespace(), obj.name()?))
}
