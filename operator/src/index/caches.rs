//! Watch caches of Pods, Nodes, GpuLeaseClasses and GpuLeases: the
//! operator's one index. Every replica keeps them; the decision loop (on the
//! leader) and the webhook (on every replica) both read them. Every change
//! wakes the decision loop through one [`Notify`], which coalesces bursts:
//! however many events arrive during a pass, one more pass follows.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Debug;
use std::hash::Hash;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use futures::{Stream, StreamExt, TryStreamExt};
use gpupool_api::{GpuLeaseClass, Role};
use k8s_openapi::api::core::v1::Node;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, Resource};
use serde::de::DeserializeOwned;
use tokio::sync::{Notify, watch};

use super::cached_pod::{CachedPod, WatchedPod};
use super::changes::ChangeLog;
use super::identity::Identity;
use super::store::{Index, IndexWriter, TallyRule, WriterGone, index, tallied_index};
use super::translate;
use super::watched::WatchedLease;
use crate::engine::{self, CachedLease, ClassInfo, NodeInfo, ObjectKey, PodInfo};
use crate::metrics::Metrics;
use crate::webhook::review::{ClusterView, queue_key, queue_tally_key};

/// The four caches a pass snapshots.
#[derive(Clone)]
pub struct Caches {
    /// Every pod that may take a class's slots ([`CachedPod::may_take_slots`]),
    /// in the form that keeps only what admission reads.
    pub pods: Index<CachedPod>,
    /// Every node.
    pub nodes: Index<Node>,
    /// Every GpuLeaseClass.
    pub classes: Index<GpuLeaseClass>,
    /// Every GpuLease, as [`CachedLease`].
    pub leases: Index<CachedLease>,
    /// Every node in the engine's form, kept in step with `nodes` by the
    /// node watch, so an admission review converts no node.
    pub node_index: NodeIndex,
    /// The keys each watch changed since the decision loop last looked.
    pub changes: CacheChanges,
    /// Which caches hold their first full list (Pods, Nodes,
    /// GpuLeaseClasses, GpuLeases), and whether all do.
    synced: watch::Receiver<Synced>,
}

/// One [`ChangeLog`] per cache, fed by its watch.
#[derive(Clone, Default)]
pub struct CacheChanges {
    /// Pods.
    pub pods: ChangeLog,
    /// Nodes.
    pub nodes: ChangeLog,
    /// GpuLeaseClasses.
    pub classes: ChangeLog,
    /// GpuLeases.
    pub leases: ChangeLog,
}

/// First-list state of the four caches.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Synced {
    each: [bool; 4],
    /// A cache's writer went away before its first list: it never will.
    broken: bool,
}

/// Names of the caches, in the order of [`Synced::each`].
const CACHE_NAMES: [&str; 4] = ["Pods", "Nodes", "GpuLeaseClasses", "GpuLeases"];

impl Caches {
    /// Starts the four watches; each event notifies `changed`.
    pub fn start(client: &Client, changed: Arc<Notify>, metrics: &Metrics) -> Self {
        let node_index = NodeIndex::default();
        let changes = CacheChanges::default();
        let mut caches = Self {
            pods: watch(
                Api::<WatchedPod>::all(client.clone()),
                CacheSpec {
                    keep: CachedPod::may_take_slots,
                    ..CacheSpec::trimmed("pods", |_| {})
                },
                changed.clone(),
                metrics,
                changes.pods.clone(),
                |_| {},
            ),
            nodes: watch(
                Api::all(client.clone()),
                CacheSpec::trimmed("nodes", trim_node),
                changed.clone(),
                metrics,
                changes.nodes.clone(),
                node_index.updater(),
            ),
            classes: watch(
                Api::all(client.clone()),
                CacheSpec::trimmed("classes", |_| {}),
                changed.clone(),
                metrics,
                changes.classes.clone(),
                |_| {},
            ),
            leases: watch(
                Api::<WatchedLease>::all(client.clone()),
                CacheSpec {
                    tally: Some(queue_tally_key),
                    ..CacheSpec::trimmed("leases", |_| {})
                },
                changed,
                metrics,
                changes.leases.clone(),
                |_| {},
            ),
            node_index,
            changes,
            synced: watch::channel(Synced::default()).1,
        };
        caches.synced = track_sync(&caches);
        caches
    }

    /// Waits until every cache has its first full list. Any number of tasks
    /// may wait at once (the webhook on every replica, the decision loop on
    /// the leader).
    pub async fn wait_synced(&self) -> Result<(), NotSynced> {
        self.wait_synced_within(Duration::MAX).await
    }

    /// Waits up to `timeout` for every cache's first full list; the error
    /// names the first cache that did not fill.
    pub async fn wait_synced_within(&self, timeout: Duration) -> Result<(), NotSynced> {
        let mut rx = self.synced.clone();
        let done = rx.wait_for(|s| s.broken || s.each.iter().all(|r| *r));
        let state = match tokio::time::timeout(timeout, done).await {
            Ok(Ok(state)) => *state,
            _ => *self.synced.borrow(),
        };
        match state.each.iter().position(|ready| !ready) {
            None => Ok(()),
            Some(i) => Err(NotSynced {
                what: CACHE_NAMES[i],
                timeout,
            }),
        }
    }
}

#[cfg(test)]
impl Caches {
    /// Caches over stores a test fills through their writers, recording
    /// what it writes in `changes` itself.
    pub(crate) fn of_stores(
        pods: Index<CachedPod>,
        nodes: Index<Node>,
        classes: Index<GpuLeaseClass>,
        leases: Index<CachedLease>,
    ) -> Self {
        let synced = Synced {
            each: [true; 4],
            broken: false,
        };
        Self {
            pods,
            nodes,
            classes,
            leases,
            node_index: NodeIndex::default(),
            changes: CacheChanges::default(),
            synced: watch::channel(synced).1,
        }
    }
}

/// One task waits for each store's first list and publishes the state:
/// a store's own readiness future is awaited by that task alone.
fn track_sync(caches: &Caches) -> watch::Receiver<Synced> {
    let (tx, rx) = watch::channel(Synced::default());
    let (pods, nodes, classes, leases) = (
        caches.pods.clone(),
        caches.nodes.clone(),
        caches.classes.clone(),
        caches.leases.clone(),
    );
    tokio::spawn(async move {
        let mark = |i: usize, result: Result<(), WriterGone>| {
            tx.send_modify(|s| match result {
                Ok(()) => s.each[i] = true,
                Err(_) => s.broken = true,
            });
        };
        tokio::join!(
            async { mark(0, pods.wait_until_ready().await) },
            async { mark(1, nodes.wait_until_ready().await) },
            async { mark(2, classes.wait_until_ready().await) },
            async { mark(3, leases.wait_until_ready().await) },
        );
    });
    rx
}

/// A cache that did not fill in time.
#[derive(Debug, thiserror::Error)]
#[error(
    "the {what} cache did not sync within {timeout:?}; can the operator list and watch {what} (is the CRD installed, is RBAC granted)?"
)]
pub struct NotSynced {
    /// Which cache.
    pub what: &'static str,
    /// How long it was given.
    pub timeout: Duration,
}

/// The webhook decides on the same caches as the controller: one index,
/// so the two can never see different clusters.
impl ClusterView for Caches {
    fn classes(&self) -> Vec<Arc<GpuLeaseClass>> {
        self.classes.state()
    }
    fn largest_node(
        &self,
        class: &ClassInfo,
        pod: &PodInfo,
    ) -> Result<Option<(String, u32)>, String> {
        let nodes = self.node_index.read();
        let largest = engine::largest_node(class, nodes.values(), pod)?;
        Ok(largest.map(|(name, slots)| (name.to_owned(), slots)))
    }
    fn queued(&self, class: &str, role: Role) -> usize {
        self.leases.count(&queue_key(class, role))
    }
}

/// What one watch cache keeps of its kind: the objects a watch of `W`
/// returns, trimmed, in the form `K` (the same type for nodes and classes;
/// pods and leases are kept as [`CachedPod`] and [`CachedLease`]).
struct CacheSpec<W, K> {
    /// The kind, as logs name it.
    what: &'static str,
    /// Drops what the operator never reads from each object.
    trim: fn(&mut W),
    /// The rule the cache counts its objects by, if any.
    tally: Option<TallyRule<K>>,
    /// Which objects the cache holds: one this refuses is never stored,
    /// and its events wake no pass. It must judge an object the same way
    /// all its life (it sees each event's object alone).
    keep: fn(&K) -> bool,
}

impl<W, K> CacheSpec<W, K> {
    fn trimmed(what: &'static str, trim: fn(&mut W)) -> Self {
        Self {
            what,
            trim,
            tally: None,
            keep: |_| true,
        }
    }
}

/// Whether a cache that keeps the objects `keep` accepts takes `event`:
/// every re-list marker, and the events of objects it keeps.
fn takes<K>(event: &watcher::Event<K>, keep: fn(&K) -> bool) -> bool {
    match event {
        watcher::Event::Apply(obj)
        | watcher::Event::Delete(obj)
        | watcher::Event::InitApply(obj) => keep(obj),
        watcher::Event::Init | watcher::Event::InitDone => true,
    }
}

fn watch<W, K>(
    api: Api<W>,
    spec: CacheSpec<W, K>,
    changed: Arc<Notify>,
    metrics: &Metrics,
    log: ChangeLog,
    mut on_event: impl FnMut(&watcher::Event<K>) + Send + 'static,
) -> Index<K>
where
    W: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
    W::DynamicType: Default + Eq + Hash + Clone,
    K: From<W> + Identity + Clone + Send + Sync + 'static,
{
    let (reader, writer) = match spec.tally {
        Some(rule) => tallied_index(rule),
        None => index(),
    };
    let (what, keep) = (spec.what, spec.keep);
    let stream = watcher(api, watcher::Config::default())
        .default_backoff()
        .modify(spec.trim)
        .map_ok(kept_form)
        .try_filter(move |event| std::future::ready(takes(event, keep)));
    let on_event = move |event: &watcher::Event<K>, held: Option<ObjectKey>| {
        on_event(event);
        log.record(event, held.as_ref());
    };
    tokio::spawn(drive(
        stream,
        writer,
        changed,
        metrics.clone(),
        what,
        on_event,
    ));
    reader
}

/// `event` with its objects in the form the cache keeps.
fn kept_form<W, K: From<W>>(event: watcher::Event<W>) -> watcher::Event<K> {
    match event {
        watcher::Event::Apply(obj) => watcher::Event::Apply(obj.into()),
        watcher::Event::Delete(obj) => watcher::Event::Delete(obj.into()),
        watcher::Event::Init => watcher::Event::Init,
        watcher::Event::InitApply(obj) => watcher::Event::InitApply(obj.into()),
        watcher::Event::InitDone => watcher::Event::InitDone,
    }
}

/// Follows a watch: each event goes into the index, then to `on_event`
/// with the key the index holds it under (`on_event` records the key: a
/// pass that takes it finds the object already there), and then wakes the
/// decision loop.
async fn drive<K: Identity + Clone>(
    stream: impl Stream<Item = Result<watcher::Event<K>, watcher::Error>>,
    mut writer: IndexWriter<K>,
    changed: Arc<Notify>,
    metrics: Metrics,
    what: &'static str,
    mut on_event: impl FnMut(&watcher::Event<K>, Option<ObjectKey>),
) {
    let mut stream = std::pin::pin!(stream);
    while let Some(item) = stream.next().await {
        match item {
            Ok(event) => {
                let held = writer.apply(&event);
                on_event(&event, held);
                changed.notify_one();
            }
            Err(e) => {
                metrics.error("watch");
                tracing::warn!(watch = what, error = %e, "watch failed; retrying with backoff");
            }
        }
    }
}

/// Every node in the engine's form, by name; cheap to clone (one index shared).
#[derive(Clone, Default)]
pub struct NodeIndex(Arc<RwLock<BTreeMap<String, NodeInfo>>>);

impl NodeIndex {
    /// Reads the index. A writer that panicked left whole entries only
    /// (each change is one insert or remove), so a poisoned lock is read on.
    pub fn read(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<String, NodeInfo>> {
        self.0
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, BTreeMap<String, NodeInfo>> {
        self.0
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Applies one node watch event: a node added, changed or deleted, or a
    /// re-list (nodes it no longer lists are dropped when it completes).
    pub fn updater(&self) -> impl FnMut(&watcher::Event<Node>) + Send + 'static {
        let index = self.clone();
        let mut relisted: BTreeSet<String> = BTreeSet::new();
        move |event| match event {
            watcher::Event::Apply(node) => index.upsert(node),
            watcher::Event::Delete(node) => {
                if let Some(name) = node.metadata.name.as_deref() {
                    index.write().remove(name);
                }
            }
            watcher::Event::Init => relisted.clear(),
            watcher::Event::InitApply(node) => {
                if let Some(name) = &node.metadata.name {
                    relisted.insert(name.clone());
                }
                index.upsert(node);
            }
            watcher::Event::InitDone => {
                index.write().retain(|name, _| relisted.contains(name));
                relisted.clear();
            }
        }
    }

    fn upsert(&self, node: &Node) {
        match translate::node_info_all(node) {
            Some(info) => drop(self.write().insert(info.name.clone(), info)),
            None => {
                if let Some(name) = node.metadata.name.as_deref() {
                    self.write().remove(name);
                }
            }
        }
    }
}

fn trim_node(node: &mut Node) {
    node.metadata.managed_fields = None;
    if let Some(status) = node.status.as_mut() {
        status.images = None;
        status.conditions = None;
        status.volumes_attached = None;
        status.volumes_in_use = None;
        status.node_info = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn node(name: &str, slots: u32) -> Node {
        serde_json::from_value(json!({
            "metadata": {"name": name},
            "status": {"allocatable": {"gpupool/slot": slots.to_string(), "cpu": "4"}}
        }))
        .expect("node")
    }

    fn slots(index: &NodeIndex) -> Vec<(String, u32)> {
        index
            .read()
            .values()
            .map(|n| (n.name.clone(), n.allocatable["gpupool/slot"]))
            .collect()
    }

    #[test]
    fn the_node_index_follows_node_events_and_relists() {
        let index = NodeIndex::default();
        let mut update = index.updater();
        update(&watcher::Event::Init);
        update(&watcher::Event::InitApply(node("a", 4)));
        update(&watcher::Event::InitApply(node("b", 8)));
        update(&watcher::Event::InitDone);
        assert_eq!(slots(&index), [("a".into(), 4), ("b".into(), 8)]);

        update(&watcher::Event::Apply(node("a", 2)));
        update(&watcher::Event::Apply(node("c", 1)));
        update(&watcher::Event::Delete(node("b", 8)));
        assert_eq!(slots(&index), [("a".into(), 2), ("c".into(), 1)]);

        // A re-list that no longer shows c drops it once complete.
        update(&watcher::Event::Init);
        update(&watcher::Event::InitApply(node("a", 6)));
        assert_eq!(
            slots(&index).len(),
            2,
            "nothing dropped before the list is complete"
        );
        update(&watcher::Event::InitDone);
        assert_eq!(slots(&index), [("a".into(), 6)]);

        // A node without a name is never indexed.
        update(&watcher::Event::Apply(Node::default()));
        assert_eq!(slots(&index).len(), 1);
    }

    fn pod(name: &str, resources: serde_json::Value) -> CachedPod {
        serde_json::from_value(json!({
            "metadata": {"namespace": "ns", "name": name},
            "spec": {"containers": [{"name": "c", "image": "i", "resources": resources}]}
        }))
        .expect("pod")
    }

    #[test]
    fn the_pod_cache_takes_only_pods_that_may_take_slots_and_every_relist_marker() {
        let keep: fn(&CachedPod) -> bool = CachedPod::may_take_slots;
        let gpu = pod(
            "gpu",
            json!({"limits": {"nvidia.com/gpu": "1", "cpu": "2"}}),
        );
        let web = pod("web", json!({"requests": {"cpu": "2", "memory": "1Gi"}}));
        let pods_of = |events: Vec<watcher::Event<CachedPod>>| -> Vec<String> {
            let (index, mut writer) = index::<CachedPod>();
            for event in events.into_iter().filter(|e| takes(e, keep)) {
                writer.apply(&event);
            }
            let mut names: Vec<String> = index.keys().iter().map(|k| k.name.to_string()).collect();
            names.sort();
            names
        };
        assert_eq!(
            pods_of(vec![
                watcher::Event::Init,
                watcher::Event::InitApply(gpu.clone()),
                watcher::Event::InitApply(web.clone()),
                watcher::Event::InitDone,
                watcher::Event::Apply(pod("web2", json!({}))),
            ]),
            ["gpu"],
            "a re-list completes, and keeps the GPU pod alone"
        );
        assert!(!takes(&watcher::Event::Apply(web.clone()), keep));
        assert!(!takes(&watcher::Event::Delete(web), keep));
        assert!(takes(&watcher::Event::Delete(gpu), keep));
        // Every other cache takes every event.
        let all: CacheSpec<Node, Node> = CacheSpec::trimmed("nodes", |_| {});
        assert!(takes(&watcher::Event::Apply(node("a", 0)), all.keep));
    }
}
