//! What the controller reads of a cached object's identity, whatever form
//! its cache keeps it in: the kinds kept whole read it from their
//! `ObjectMeta`, pods and leases from the [`CachedMeta`] they keep instead
//! (see [`super::cached_pod`] and [`gpupool_engine::CachedLease`]).

use gpupool_api::GpuLeaseClass;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use super::cached_pod::CachedPod;
use crate::engine::{CachedLease, CachedMeta};

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
}

/// The two metadata types: the same fields, owned as `String` in one and
/// `Box<str>` in the other.
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

/// Objects whose `metadata` field answers for them.
macro_rules! identity_of_metadata {
    ($($kind:ty),* $(,)?) => {$(
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
        }
    )*};
}

identity_of_metadata!(Node, GpuLeaseClass, CachedPod, CachedLease);

#[cfg(test)]
identity_of_metadata!(k8s_openapi::api::core::v1::ConfigMap);

/// An object's namespace (empty when cluster-scoped) and name, borrowed.
pub fn parts_of<K: Identity>(obj: &K) -> Option<(&str, &str)> {
    Some((obj.namespace(), obj.name()?))
}
