//! The simulated cluster's scheduler: binds pending pods to nodes through the
//! `pods/binding` subresource, as kube-scheduler does, and marks the pods it
//! cannot place `PodScheduled=False` / `Unschedulable`.
//!
//! It watches pods and nodes and runs a pass ([`plan::plan`]) whenever either
//! changes, plus every [`RESYNC`] as a safety net, so an unschedulable pod is
//! retried as soon as capacity appears.

pub mod filter;
pub mod plan;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Binding, Node, ObjectReference, Pod, PodCondition};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, reflector, watcher};
use kube::{Client, ResourceExt};
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use plan::{Decision, plan};

/// Longest time between two passes when nothing changes.
pub const RESYNC: Duration = Duration::from_secs(2);

/// Field manager of the scheduler's writes.
const FIELD_MANAGER: &str = "sim-scheduler";

/// A running scheduler; stops when [`RunningScheduler::stop`] is called or it is dropped.
pub struct RunningScheduler {
    cancel: CancellationToken,
    task: JoinHandle<()>,
}

impl RunningScheduler {
    /// Starts the scheduler against the API server `client` talks to.
    pub fn start(client: Client) -> Self {
        let cancel = CancellationToken::new();
        let task = tokio::spawn(run(client, cancel.clone()));
        Self { cancel, task }
    }

    /// Stops the scheduler and waits for it to finish its current pass.
    pub async fn stop(mut self) {
        self.cancel.cancel();
        let _ = (&mut self.task).await;
    }
}

impl Drop for RunningScheduler {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// The order in which the scheduler first saw each pod.
#[derive(Default)]
struct Arrivals {
    order: HashMap<String, u64>,
    next: u64,
}

async fn run(client: Client, cancel: CancellationToken) {
    let pods: Api<Pod> = Api::all(client.clone());
    let nodes: Api<Node> = Api::all(client.clone());
    let (pod_store, pod_writer) = reflector::store();
    let (node_store, node_writer) = reflector::store();
    let changed = Arc::new(Notify::new());

    let pod_events = reflector(
        pod_writer,
        watcher(pods.clone(), watcher::Config::default()),
    )
    .default_backoff()
    .boxed();
    let node_events = reflector(node_writer, watcher(nodes, watcher::Config::default()))
        .default_backoff()
        .boxed();
    // Creation timestamps have one-second resolution; watch order breaks ties.
    let arrivals: Arc<Mutex<Arrivals>> = Arc::default();
    let seen = arrivals.clone();
    let pod_events = pod_events.map(move |event| {
        if let Ok(watcher::Event::Apply(pod) | watcher::Event::InitApply(pod)) = &event
            && let Some(uid) = pod.uid()
        {
            let mut seen = seen
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let next = seen.next;
            if let std::collections::hash_map::Entry::Vacant(v) = seen.order.entry(uid) {
                v.insert(next);
                seen.next += 1;
            }
        }
    });
    let mut events = futures::stream::select(pod_events, node_events.map(|_| ()));
    let notify = changed.clone();
    let pump_cancel = cancel.clone();
    let pump = tokio::spawn(async move {
        loop {
            tokio::select! {
                () = pump_cancel.cancelled() => break,
                next = events.next() => match next {
                    Some(()) => notify.notify_one(),
                    None => break,
                },
            }
        }
    });

    tokio::select! {
        () = cancel.cancelled() => { pump.abort(); return; }
        _ = pod_store.wait_until_ready() => {}
    }
    tokio::select! {
        () = cancel.cancelled() => { pump.abort(); return; }
        _ = node_store.wait_until_ready() => {}
    }

    // Pods bound in an earlier pass whose binding has not reached the store yet.
    let mut in_flight: HashMap<String, String> = HashMap::new();
    loop {
        let mut visible: Vec<Pod> = pod_store.state().iter().map(|p| (**p).clone()).collect();
        let all_nodes: Vec<Node> = node_store.state().iter().map(|n| (**n).clone()).collect();
        {
            let mut arrivals = arrivals
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let live: HashSet<String> = visible.iter().filter_map(|p| p.uid()).collect();
            arrivals.order.retain(|uid, _| live.contains(uid));
            visible.sort_by_key(|p| {
                p.uid()
                    .and_then(|u| arrivals.order.get(&u).copied())
                    .unwrap_or(u64::MAX)
            });
        }
        in_flight.retain(|uid, _| {
            visible
                .iter()
                .any(|p| p.uid().as_deref() == Some(uid) && plan::is_pending(p))
        });
        for pod in &mut visible {
            if let Some(node) = pod.uid().and_then(|u| in_flight.get(&u).cloned())
                && let Some(spec) = pod.spec.as_mut()
            {
                spec.node_name = Some(node);
            }
        }
        for decision in plan(&all_nodes, &visible) {
            match decision {
                Decision::Bind {
                    namespace,
                    name,
                    node,
                } => {
                    let uid = find_uid(&visible, &namespace, &name);
                    if bind(&client, &namespace, &name, &node).await {
                        record_scheduled(&client, &namespace, &name, uid.as_deref(), &node).await;
                        if let Some(uid) = uid {
                            in_flight.insert(uid, node);
                        }
                    }
                }
                Decision::Unschedulable {
                    namespace,
                    name,
                    message,
                } => {
                    if let Some(pod) = visible.iter().find(|p| {
                        p.namespace().as_deref() == Some(&namespace) && p.name_any() == name
                    }) {
                        mark_unschedulable(&client, pod, &message).await;
                    }
                }
            }
        }
        tokio::select! {
            () = cancel.cancelled() => break,
            () = changed.notified() => {
                // Let a burst of events settle into one pass.
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            () = tokio::time::sleep(RESYNC) => {}
        }
    }
    pump.abort();
}

fn find_uid(pods: &[Pod], namespace: &str, name: &str) -> Option<String> {
    pods.iter()
        .find(|p| p.namespace().as_deref() == Some(namespace) && p.name_any() == name)
        .and_then(|p| p.uid())
}

/// Binds through `pods/binding`; false when the API server refused (the pod
/// stays pending and the next pass sees why).
async fn bind(client: &Client, namespace: &str, name: &str, node: &str) -> bool {
    let api: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let binding = Binding {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            namespace: Some(namespace.to_owned()),
            ..Default::default()
        },
        target: ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Node".into()),
            name: Some(node.to_owned()),
            ..Default::default()
        },
    };
    let result: Result<serde_json::Value, kube::Error> = api
        .create_subresource("binding", name, &PostParams::default(), &binding)
        .await;
    match result {
        Ok(_) => {
            tracing::info!(pod = %format!("{namespace}/{name}"), node, "bound pod");
            true
        }
        Err(e) => {
            tracing::warn!(pod = %format!("{namespace}/{name}"), node, error = %e, "binding failed");
            false
        }
    }
}

/// The `Scheduled` event kube-scheduler records for every pod it binds
/// (events.k8s.io/v1, reported as `default-scheduler`). A failed write is
/// only logged: events are best effort, as the real recorder's are.
async fn record_scheduled(
    client: &Client,
    namespace: &str,
    name: &str,
    uid: Option<&str>,
    node: &str,
) {
    let events: Api<k8s_openapi::api::events::v1::Event> =
        Api::namespaced(client.clone(), namespace);
    let now = jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%S%.6fZ")
        .to_string();
    let event = serde_json::json!({
        "apiVersion": "events.k8s.io/v1", "kind": "Event",
        "metadata": {"generateName": format!("{name}."), "namespace": namespace},
        "eventTime": now,
        "reportingController": "default-scheduler",
        "reportingInstance": "default-scheduler-gpupool-sim",
        "action": "Binding",
        "reason": "Scheduled",
        "type": "Normal",
        "note": format!("Successfully assigned {namespace}/{name} to {node}"),
        "regarding": {"apiVersion": "v1", "kind": "Pod", "namespace": namespace, "name": name, "uid": uid},
    });
    let created = match serde_json::from_value(event) {
        Ok(event) => events
            .create(&PostParams::default(), &event)
            .await
            .map(|_| ()),
        Err(e) => Err(kube::Error::SerdeError(e)),
    };
    if let Err(e) = created {
        tracing::warn!(pod = %format!("{namespace}/{name}"), error = %e, "cannot record the Scheduled event");
    }
}

/// Sets `PodScheduled=False/Unschedulable`, writing only when the condition changes.
async fn mark_unschedulable(client: &Client, pod: &Pod, message: &str) {
    let conditions = pod
        .status
        .as_ref()
        .and_then(|s| s.conditions.clone())
        .unwrap_or_default();
    if conditions.iter().any(|c| {
        c.type_ == "PodScheduled"
            && c.status == "False"
            && c.reason.as_deref() == Some("Unschedulable")
            && c.message.as_deref() == Some(message)
    }) {
        return;
    }
    // As kube-scheduler does: the transition time changes only with the
    // status, so a pod created gated keeps the time it was created, and a
    // new message keeps the time the scheduler first failed.
    let since = conditions
        .iter()
        .find(|c| c.type_ == "PodScheduled" && c.status == "False")
        .and_then(|c| c.last_transition_time.clone())
        .unwrap_or_else(|| Time(jiff::Timestamp::now()));
    let mut next: Vec<PodCondition> = conditions
        .into_iter()
        .filter(|c| c.type_ != "PodScheduled")
        .collect();
    next.push(PodCondition {
        type_: "PodScheduled".into(),
        status: "False".into(),
        reason: Some("Unschedulable".into()),
        message: Some(message.to_owned()),
        last_transition_time: Some(since),
        ..Default::default()
    });
    let namespace = pod.namespace().unwrap_or_default();
    let name = pod.name_any();
    let api: Api<Pod> = Api::namespaced(client.clone(), &namespace);
    let patch = serde_json::json!({"status": {"conditions": next}});
    match api
        .patch_status(
            &name,
            &PatchParams {
                field_manager: Some(FIELD_MANAGER.into()),
                ..Default::default()
            },
            &Patch::Merge(&patch),
        )
        .await
    {
        Ok(_) => tracing::info!(pod = %format!("{namespace}/{name}"), message, "pod unschedulable"),
        Err(e) => {
            tracing::warn!(pod = %format!("{namespace}/{name}"), error = %e, "cannot mark pod unschedulable")
        }
    }
}
