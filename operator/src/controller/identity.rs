//! What the controller reads of a cached object's identity, whatever form
//! its cache keeps it in: the kinds kept whole read it from their
//! `ObjectMeta`, a cached pod from the few fields it keeps (see
//! [`super::cached_pod`]).

use kube::Resource;

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

impl<K: Resource> Identity for K {
    fn namespace(&self) -> &str {
        self.meta().namespace.as_deref().unwrap_or_default()
    }
    fn name(&self) -> Option<&str> {
        self.meta().name.as_deref()
    }
    fn uid(&self) -> Option<&str> {
        self.meta().uid.as_deref()
    }
    fn resource_version(&self) -> Option<&str> {
        self.meta().resource_version.as_deref()
    }
    fn deleting(&self) -> bool {
        self.meta().deletion_timestamp.is_some()
    }
}

/// An object's namespace (empty when cluster-scoped) and name, borrowed.
pub fn parts_of<K: Identity>(obj: &K) -> Option<(&str, &str)> {
    Some((obj.namespace(), obj.name()?))
}
