//! The object store: one global resourceVersion, a sorted map per resource
//! and a bounded window of watch events, all behind one lock so every write
//! gets the next resourceVersion and reaches watchers in order.
//!
//! Committed events go out on one channel per resource, and pods also on
//! one channel per node, as the real server's watch cache indexes pods by
//! `spec.nodeName`: a kubelet's watch wakes for its own node's pods, not
//! for every write in the cluster.

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
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
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
    owners: owners::OwnerIndex,
    channels: Channels,
}

/// Most events a node's pod channel holds for a slow watcher (a resource's
/// channel holds the configured capacity): a node sees few pods, and a
/// watcher that falls behind ends its stream and resumes from the window.
const NODE_CHANNEL_CAPACITY: usize = 1_024;

/// The channels watchers listen on, made when the first watcher of one
/// arrives.
#[derive(Debug)]
struct Channels {
    capacity: usize,
    by_resource: HashMap<ResourceId, ResourceChannels>,
}

/// One resource's channels: every event of the resource, and for pods each
/// node's share.
#[derive(Debug, Default)]
struct ResourceChannels {
    all: Option<broadcast::Sender<Arc<WatchEvent>>>,
    /// By the pod's `spec.nodeName` ("" while unscheduled).
    by_node: HashMap<String, broadcast::Sender<Arc<WatchEvent>>>,
}

impl Channels {
    fn subscribe(
        &mut self,
        resource: &ResourceId,
        node: Option<&str>,
    ) -> broadcast::Receiver<Arc<WatchEvent>> {
        let channels = self.by_resource.entry(resource.clone()).or_default();
        match node.filter(|_| is_pods(resource)) {
            Some(node) => {
                if let Some(tx) = channels.by_node.get(node) {
                    return tx.subscribe();
                }
                // Node names come from clients: channels nobody listens to
                // any more go before a new one is made, so they cannot pile
                // up.
                channels.by_node.retain(|_, tx| tx.receiver_count() > 0);
                let (tx, rx) = broadcast::channel(NODE_CHANNEL_CAPACITY.min(self.capacity));
                channels.by_node.insert(node.to_owned(), tx);
                rx
            }
            None => match &channels.all {
                Some(tx) => tx.subscribe(),
                None => {
                    let (tx, rx) = broadcast::channel(self.capacity);
                    channels.all = Some(tx);
                    rx
                }
            },
        }
    }

    fn send(&self, ev: &Arc<WatchEvent>) {
        let Some(channels) = self.by_resource.get(&ev.resource) else {
            return;
        };
        // No receiver is fine: nobody watches.
        if let Some(tx) = &channels.all {
            let _ = tx.send(ev.clone());
        }
        if channels.by_node.is_empty() {
            return;
        }
        let now = node_name(&ev.object);
        if let Some(tx) = channels.by_node.get(now) {
            let _ = tx.send(ev.clone());
        }
        // A pod that left a node's selection (were its nodeName ever
        // changed) is a DELETED event for that node's watchers.
        if let Some(before) = ev.old.as_deref().map(node_name)
            && before != now
            && let Some(tx) = channels.by_node.get(before)
        {
            let _ = tx.send(ev.clone());
        }
    }
}

fn is_pods(resource: &ResourceId) -> bool {
    resource.group.is_empty() && resource.plural == "pods"
}

/// A pod's `spec.nodeName`, "" when unset (as a field selector compares it).
fn node_name(pod: &Value) -> &str {
    pod.pointer("/spec/nodeName")
        .and_then(Value::as_str)
        .unwrap_or_default()
}

impl State {
    /// An empty store whose watch channels each hold up to
    /// `channel_capacity` events for a watcher that lags.
    pub fn new(registry: Registry, window_cap: usize, channel_capacity: usize) -> Self {
        State {
            rv: 1,
            registry,
            objects: HashMap::new(),
            window: VecDeque::with_capacity(window_cap.min(65_536)),
            window_cap: window_cap.max(1),
            compacted_rv: 0,
            uids: HashMap::new(),
            owners: owners::OwnerIndex::default(),
            channels: Channels {
                capacity: channel_capacity.max(1),
                by_resource: HashMap::new(),
            },
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

    /// A new receiver of the committed events of `resource`; with `node`,
    /// of pods only, those whose `spec.nodeName` is or was `node` ("" for
    /// unscheduled pods). Other resources ignore `node`. The receiver may
    /// get events its watcher's selectors do not match: filtering stays
    /// the watcher's.
    pub fn subscribe(
        &mut self,
        resource: &ResourceId,
        node: Option<&str>,
    ) -> broadcast::Receiver<Arc<WatchEvent>> {
        self.channels.subscribe(resource, node)
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
        let object_key = ObjectKey {
            resource: id.clone(),
            namespace: ns.to_string(),
            name: name.to_string(),
        };
        self.owners
            .update(&object_key, old.as_deref(), Some(obj.as_ref()));
        if let Some(uid) = uid_of(&obj)
            && old_uid != Some(uid)
        {
            // Most writes change an object in place: its uid entry stays.
            if let Some(stale) = old_uid {
                self.uids.remove(stale);
            }
            self.uids.insert(uid.to_string(), object_key);
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
        let object_key = ObjectKey {
            resource: id.clone(),
            namespace: ns.to_string(),
            name: name.to_string(),
        };
        self.owners.update(&object_key, Some(old.as_ref()), None);
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
            for ((namespace, name), obj) in &map {
                if let Some(uid) = uid_of(obj) {
                    self.uids.remove(uid);
                }
                let object_key = ObjectKey {
                    resource: id.clone(),
                    namespace: namespace.clone(),
                    name: name.clone(),
                };
                self.owners.update(&object_key, Some(obj.as_ref()), None);
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
        self.channels.send(&ev);
        self.window.push_back(ev);
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
        State::new(Registry::builtin(), cap, 16)
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

    /// The names of the objects of the events waiting on `rx`.
    fn received(rx: &mut broadcast::Receiver<Arc<WatchEvent>>) -> Vec<String> {
        let mut names = Vec::new();
        while let Ok(ev) = rx.try_recv() {
            let name = ev.object["metadata"]["name"].as_str().unwrap_or_default();
            names.push(format!("{} {name}", ev.etype.as_str()));
        }
        names
    }

    fn pod(name: &str, node: Option<&str>) -> Value {
        match node {
            Some(node) => json!({"metadata": {"name": name}, "spec": {"nodeName": node}}),
            None => json!({"metadata": {"name": name}, "spec": {}}),
        }
    }

    #[test]
    fn a_watch_hears_its_own_resource_only() {
        let mut s = state(10);
        let (pods, maps) = (
            ResourceId::new("", "pods"),
            ResourceId::new("", "configmaps"),
        );
        let mut pod_rx = s.subscribe(&pods, None);
        let mut map_rx = s.subscribe(&maps, Some("n1"));
        s.put(&pods, "ns", "p", pod("p", Some("n1")));
        s.put(&maps, "ns", "m", json!({"metadata": {"name": "m"}}));
        assert_eq!(received(&mut pod_rx), ["ADDED p"]);
        assert_eq!(
            received(&mut map_rx),
            ["ADDED m"],
            "a node means nothing off pods"
        );
    }

    #[test]
    fn a_node_watch_hears_its_nodes_pods_and_the_binding_that_moves_one() {
        let mut s = state(10);
        let pods = ResourceId::new("", "pods");
        let mut n1 = s.subscribe(&pods, Some("n1"));
        let mut unscheduled = s.subscribe(&pods, Some(""));
        let mut all = s.subscribe(&pods, None);
        s.put(&pods, "ns", "a", pod("a", Some("n1")));
        s.put(&pods, "ns", "b", pod("b", Some("n2")));
        s.put(&pods, "ns", "c", pod("c", None));
        s.put(&pods, "ns", "c", pod("c", Some("n1")));
        s.remove(&pods, "ns", "a").expect("exists");
        assert_eq!(received(&mut n1), ["ADDED a", "MODIFIED c", "DELETED a"]);
        // The binding leaves the unscheduled pods: its watchers hear it.
        assert_eq!(received(&mut unscheduled), ["ADDED c", "MODIFIED c"]);
        assert_eq!(received(&mut all).len(), 5);
    }

    #[test]
    fn node_channels_nobody_hears_are_dropped_before_a_new_one_is_made() {
        let mut s = state(10);
        let pods = ResourceId::new("", "pods");
        for i in 0..1_000 {
            let rx = s.subscribe(&pods, Some(&format!("made-up-{i}")));
            drop(rx);
        }
        let kept = s.subscribe(&pods, Some("n1"));
        let channels = &s.channels.by_resource[&pods].by_node;
        assert_eq!(
            channels.len(),
            1,
            "only the channel with a listener is kept"
        );
        assert_eq!(kept.len(), 0);
    }
}
