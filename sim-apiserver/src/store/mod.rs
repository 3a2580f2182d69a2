//! The object store: one global resourceVersion, a sorted map per resource
//! and a bounded window of watch events, all behind one lock so every write
//! gets the next resourceVersion and reaches watchers in order.

pub mod owners;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use serde_json::{Value, json};
use tokio::sync::broadcast;

use crate::registry::{Registry, ResourceId};

/// A watch event type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventType {
    /// Object created.
    Added,
    /// Object changed.
    Modified,
    /// Object removed.
    Deleted,
}

impl EventType {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            EventType::Added => "ADDED",
            EventType::Modified => "MODIFIED",
            EventType::Deleted => "DELETED",
        }
    }
}

/// One committed change, shared by every watcher.
#[derive(Debug)]
pub struct WatchEvent {
    /// The resourceVersion this change got.
    pub rv: u64,
    /// What happened.
    pub etype: EventType,
    /// Which resource.
    pub resource: ResourceId,
    /// The object's namespace ("" when cluster-scoped).
    pub namespace: String,
    /// The object after the change (for deletes: its last state, new rv).
    pub object: Arc<Value>,
    /// The object before the change, for selector transitions.
    pub old: Option<Arc<Value>>,
    encoded: OnceLock<Bytes>,
}

impl WatchEvent {
    /// `{"type":…,"object":…}\n`, serialized once for all watchers.
    pub fn encoded(&self) -> Bytes {
        self.encoded
            .get_or_init(|| encode_event(self.etype.as_str(), &self.object))
            .clone()
    }
}

/// Serializes one watch line.
pub fn encode_event(etype: &str, object: &Value) -> Bytes {
    let mut out = Vec::with_capacity(256);
    out.extend_from_slice(b"{\"type\":\"");
    out.extend_from_slice(etype.as_bytes());
    out.extend_from_slice(b"\",\"object\":");
    // Serializing a Value into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut out, object);
    out.extend_from_slice(b"}\n");
    Bytes::from(out)
}

/// Where an object lives.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ObjectKey {
    /// Its resource.
    pub resource: ResourceId,
    /// Its namespace ("" when cluster-scoped).
    pub namespace: String,
    /// Its name.
    pub name: String,
}

type Objects = BTreeMap<(String, String), Arc<Value>>;

/// An iterator over `((namespace, name), object)` entries.
pub type ObjectIter<'a> = Box<dyn Iterator<Item = (&'a (String, String), &'a Arc<Value>)> + 'a>;

/// Everything the server holds.
#[derive(Debug)]
pub struct State {
    rv: u64,
    /// The resources served now.
    pub registry: Registry,
    objects: HashMap<ResourceId, Objects>,
    window: VecDeque<Arc<WatchEvent>>,
    window_cap: usize,
    /// Events with rv ≤ this have left the window.
    compacted_rv: u64,
    uids: HashMap<String, ObjectKey>,
    tx: broadcast::Sender<Arc<WatchEvent>>,
}

impl State {
    /// An empty store.
    pub fn new(
        registry: Registry,
        window_cap: usize,
        tx: broadcast::Sender<Arc<WatchEvent>>,
    ) -> Self {
        State {
            rv: 1,
            registry,
            objects: HashMap::new(),
            window: VecDeque::with_capacity(window_cap.min(65_536)),
            window_cap: window_cap.max(1),
            compacted_rv: 0,
            uids: HashMap::new(),
            tx,
        }
    }

    /// The latest resourceVersion.
    pub fn current_rv(&self) -> u64 {
        self.rv
    }

    /// The oldest resourceVersion a watch may start from.
    pub fn compacted_rv(&self) -> u64 {
        self.compacted_rv
    }

    /// A new receiver of committed events.
    pub fn subscribe(&self) -> broadcast::Receiver<Arc<WatchEvent>> {
        self.tx.subscribe()
    }

    /// Retained events newer than `rv`, oldest first.
    pub fn events_since(&self, rv: u64) -> Vec<Arc<WatchEvent>> {
        let start = self.window.partition_point(|e| e.rv <= rv);
        self.window.iter().skip(start).cloned().collect()
    }

    /// One object.
    pub fn get(&self, id: &ResourceId, ns: &str, name: &str) -> Option<Arc<Value>> {
        self.objects
            .get(id)?
            .get(&(ns.to_string(), name.to_string()))
            .cloned()
    }

    /// Objects of a resource, in (namespace, name) order, optionally in one
    /// namespace, starting strictly after `after`.
    pub fn list<'a>(
        &'a self,
        id: &ResourceId,
        ns: Option<&'a str>,
        after: Option<(String, String)>,
    ) -> ObjectIter<'a> {
        let Some(map) = self.objects.get(id) else {
            return Box::new(std::iter::empty());
        };
        use std::ops::Bound;
        let lower = match after {
            Some(k) => Bound::Excluded(k),
            None => match ns {
                Some(n) => Bound::Included((n.to_string(), String::new())),
                None => Bound::Unbounded,
            },
        };
        let iter = map.range((lower, Bound::Unbounded));
        match ns {
            Some(n) => Box::new(iter.take_while(move |((kns, _), _)| kns == n)),
            None => Box::new(iter),
        }
    }

    /// Number of objects of a resource in a namespace (or all).
    pub fn count(&self, id: &ResourceId, ns: Option<&str>) -> usize {
        self.list(id, ns, None).count()
    }

    /// Every resource that has objects.
    pub fn resources(&self) -> Vec<ResourceId> {
        self.objects
            .iter()
            .filter(|(_, m)| !m.is_empty())
            .map(|(k, _)| k.clone())
            .collect()
    }

    /// Where the object with this uid lives, if it exists.
    pub fn by_uid(&self, uid: &str) -> Option<&ObjectKey> {
        self.uids.get(uid)
    }

    /// Forgets every retained event: watches from any older version get 410.
    pub fn compact_all(&mut self) {
        self.window.clear();
        self.compacted_rv = self.rv;
    }

    fn next_rv(&mut self) -> u64 {
        self.rv += 1;
        self.rv
    }

    /// Stores an object (created or changed), giving it the next
    /// resourceVersion, and publishes the event.
    pub fn put(&mut self, id: &ResourceId, ns: &str, name: &str, mut obj: Value) -> Arc<Value> {
        let rv = self.next_rv();
        set_rv(&mut obj, rv);
        let obj = Arc::new(obj);
        let key = (ns.to_string(), name.to_string());
        let old = self
            .objects
            .entry(id.clone())
            .or_default()
            .insert(key, obj.clone());
        let old_uid = old.as_deref().and_then(uid_of);
        if let Some(uid) = uid_of(&obj)
            && old_uid != Some(uid)
        {
            // Most writes change an object in place: its uid entry stays.
            if let Some(stale) = old_uid {
                self.uids.remove(stale);
            }
            self.uids.insert(
                uid.to_string(),
                ObjectKey {
                    resource: id.clone(),
                    namespace: ns.to_string(),
                    name: name.to_string(),
                },
            );
        }
        let etype = if old.is_some() {
            EventType::Modified
        } else {
            EventType::Added
        };
        self.publish(rv, etype, id, ns, obj.clone(), old);
        obj
    }

    /// Removes an object for good, publishing DELETED with a new
    /// resourceVersion. Returns the object's last state.
    pub fn remove(&mut self, id: &ResourceId, ns: &str, name: &str) -> Option<Arc<Value>> {
        let old = self
            .objects
            .get_mut(id)?
            .remove(&(ns.to_string(), name.to_string()))?;
        if let Some(uid) = uid_of(&old) {
            self.uids.remove(uid);
        }
        let rv = self.next_rv();
        let mut last = (*old).clone();
        set_rv(&mut last, rv);
        let last = Arc::new(last);
        self.publish(rv, EventType::Deleted, id, ns, last.clone(), Some(old));
        Some(last)
    }

    /// Drops every object of a resource without events (its CRD is gone and
    /// each object was already deleted through the normal path).
    pub fn forget_resource(&mut self, id: &ResourceId) {
        if let Some(map) = self.objects.remove(id) {
            for obj in map.values() {
                if let Some(uid) = uid_of(obj) {
                    self.uids.remove(uid);
                }
            }
        }
    }

    fn publish(
        &mut self,
        rv: u64,
        etype: EventType,
        id: &ResourceId,
        ns: &str,
        object: Arc<Value>,
        old: Option<Arc<Value>>,
    ) {
        let ev = Arc::new(WatchEvent {
            rv,
            etype,
            resource: id.clone(),
            namespace: ns.to_string(),
            object,
            old,
            encoded: OnceLock::new(),
        });
        if self.window.len() >= self.window_cap
            && let Some(dropped) = self.window.pop_front()
        {
            self.compacted_rv = dropped.rv;
        }
        self.window.push_back(ev.clone());
        // No receiver is fine: nobody watches.
        let _ = self.tx.send(ev);
    }
}

fn uid_of(obj: &Value) -> Option<&str> {
    obj.get("metadata")?.get("uid")?.as_str()
}

fn set_rv(obj: &mut Value, rv: u64) {
    if let Some(meta) = obj.get_mut("metadata").and_then(Value::as_object_mut) {
        meta.insert("resourceVersion".into(), json!(rv.to_string()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(cap: usize) -> State {
        let (tx, _) = broadcast::channel(16);
        State::new(Registry::builtin(), cap, tx)
    }

    #[test]
    fn rv_grows_and_window_compacts() {
        let mut s = state(2);
        let id = ResourceId::new("", "configmaps");
        let a = s.put(
            &id,
            "default",
            "a",
            json!({"metadata": {"name": "a", "uid": "u1"}}),
        );
        let b = s.put(&id, "default", "b", json!({"metadata": {"name": "b"}}));
        assert!(
            a["metadata"]["resourceVersion"].as_str() < b["metadata"]["resourceVersion"].as_str()
        );
        assert_eq!(s.compacted_rv(), 0);
        s.remove(&id, "default", "a").expect("exists");
        assert_eq!(s.compacted_rv(), 2);
        assert_eq!(s.events_since(2).len(), 2);
        assert!(s.by_uid("u1").is_none());
    }

    #[test]
    fn list_stays_in_namespace() {
        let mut s = state(10);
        let id = ResourceId::new("", "configmaps");
        for (ns, n) in [("a", "1"), ("b", "1"), ("b", "2"), ("c", "1")] {
            s.put(&id, ns, n, json!({"metadata": {"name": n}}));
        }
        let names: Vec<_> = s
            .list(&id, Some("b"), None)
            .map(|(k, _)| k.1.clone())
            .collect();
        assert_eq!(names, vec!["1", "2"]);
        let after: Vec<_> = s
            .list(&id, Some("b"), Some(("b".into(), "1".into())))
            .map(|(k, _)| k.1.clone())
            .collect();
        assert_eq!(after, vec!["2"]);
        assert_eq!(s.count(&id, None), 4);
    }
}
