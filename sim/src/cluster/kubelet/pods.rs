//! The life of the pods bound to one node: admission (devices), Running,
//! `sim.gpupool.io/run-seconds` then Succeeded, deletion after the (capped)
//! grace period, and devices freed whenever a pod ends.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use gpupool_api::names::ANNOTATION_SIM_RUN_SECONDS;
use gpupool_api::pod::is_sidecar;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, Patch, PatchParams, Preconditions};
use kube::runtime::{WatchStreamExt, watcher};
use serde_json::json;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::Shared;
use super::admission;
use crate::cluster::scheduler::plan::is_terminal;

/// Pod annotation the kubelet writes with the env each container got from
/// Allocate (JSON: container → name → value), so tests can check it.
pub const ANNOTATION_ALLOCATED_ENV: &str = "sim.gpupool.io/allocated-env";

/// Timers the lifecycle schedules for itself.
enum Timer {
    /// run-seconds elapsed: the pod Succeeds.
    Finish(String),
    /// The deletion grace period elapsed: remove the pod.
    Remove(String),
    /// Starting the pod failed on an API write (an API error, or a webhook
    /// that did not answer): try to admit it again, as kubelet's sync loop
    /// does, instead of leaving it Pending forever.
    Retry {
        uid: String,
        namespace: String,
        name: String,
    },
}

/// How long a pod whose start or removal could not be recorded waits before
/// the next try.
const START_RETRY_DELAY: Duration = Duration::from_millis(250);

/// Sends `timer` to the lifecycle loop after `delay`, without holding the
/// loop up meanwhile.
fn send_later(timers: &mpsc::UnboundedSender<Timer>, delay: Duration, timer: Timer) {
    let tx = timers.clone();
    tokio::spawn(async move {
        tokio::time::sleep(delay).await;
        // The loop has stopped when the receiver is gone; nothing to do then.
        let _ = tx.send(timer);
    });
}

/// Attempts at a status write before the kubelet gives up on it (and logs).
const STATUS_WRITE_ATTEMPTS: u32 = 10;

struct Tracked {
    namespace: String,
    name: String,
    finished: bool,
    removing: bool,
}

/// Runs the lifecycle of the pods bound to this node until cancelled.
pub async fn run(shared: Arc<Shared>, cancel: CancellationToken) {
    let api: Api<Pod> = Api::all(shared.client.clone());
    let config = watcher::Config::default().fields(&format!("spec.nodeName={}", shared.node_name));
    let mut events = watcher(api, config).default_backoff().boxed();
    let (timer_tx, mut timers) = mpsc::unbounded_channel::<Timer>();
    let mut tracked: HashMap<String, Tracked> = HashMap::new();
    let mut relisted: Option<HashSet<String>> = None;
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            Some(timer) = timers.recv() => on_timer(&shared, &mut tracked, &timer_tx, timer).await,
            event = events.next() => match event {
                Some(Ok(watcher::Event::Apply(pod))) => {
                    on_pod(&shared, &mut tracked, &timer_tx, &pod).await;
                }
                Some(Ok(watcher::Event::InitApply(pod))) => {
                    if let (Some(listed), Some(uid)) = (relisted.as_mut(), pod.uid()) {
                        listed.insert(uid);
                    }
                    on_pod(&shared, &mut tracked, &timer_tx, &pod).await;
                }
                Some(Ok(watcher::Event::Init)) => relisted = Some(HashSet::new()),
                Some(Ok(watcher::Event::InitDone)) => {
                    // Pods deleted while the watch was down send no Delete event.
                    if let Some(listed) = relisted.take() {
                        let gone: Vec<String> = tracked
                            .keys()
                            .filter(|uid| !listed.contains(*uid))
                            .cloned()
                            .collect();
                        for uid in gone {
                            forget(&shared, &mut tracked, &uid);
                        }
                    }
                }
                Some(Ok(watcher::Event::Delete(pod))) => {
                    if let Some(uid) = pod.uid() {
                        forget(&shared, &mut tracked, &uid);
                    }
                }
                Some(Err(e)) => tracing::warn!(node = %shared.node_name, error = %e, "pod watch failed; retrying"),
                None => return,
            },
        }
    }
}

fn forget(shared: &Shared, tracked: &mut HashMap<String, Tracked>, uid: &str) {
    if let Some(t) = tracked.remove(uid) {
        let mut state = shared.lock();
        state.book.release(uid);
        state.running.remove(&(t.namespace, t.name));
    }
}

async fn on_pod(
    shared: &Arc<Shared>,
    tracked: &mut HashMap<String, Tracked>,
    timers: &mpsc::UnboundedSender<Timer>,
    pod: &Pod,
) {
    let Some(uid) = pod.uid() else { return };
    let namespace = pod.namespace().unwrap_or_default();
    let name = pod.name_any();
    if pod.metadata.deletion_timestamp.is_some() {
        let entry = tracked.entry(uid.clone()).or_insert_with(|| Tracked {
            namespace: namespace.clone(),
            name: name.clone(),
            finished: true,
            removing: false,
        });
        if !entry.removing {
            entry.removing = true;
            let grace = pod
                .metadata
                .deletion_grace_period_seconds
                .map_or(Duration::ZERO, |s| {
                    Duration::from_secs(s.max(0).unsigned_abs())
                });
            let wait = if is_terminal(pod) {
                Duration::ZERO
            } else {
                grace.min(shared.max_termination)
            };
            send_later(timers, wait, Timer::Remove(uid));
        }
        return;
    }
    if is_terminal(pod) {
        if let Some(t) = tracked.get_mut(&uid)
            && !t.finished
        {
            t.finished = true;
        }
        let mut state = shared.lock();
        state.book.release(&uid);
        state.running.remove(&(namespace, name));
        return;
    }
    if tracked.contains_key(&uid) {
        return;
    }
    tracked.insert(
        uid.clone(),
        Tracked {
            namespace: namespace.clone(),
            name: name.clone(),
            finished: false,
            removing: false,
        },
    );
    if pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running") {
        // Already running under an earlier kubelet: nothing to admit again.
        return;
    }
    match admission::allocate(shared, pod).await {
        Ok(envs) => {
            if let Err(e) = mark_running(shared, pod, &envs).await {
                tracing::warn!(node = %shared.node_name, pod = %format!("{namespace}/{name}"), error = %e, "cannot mark pod running; retrying");
                forget(shared, tracked, &uid);
                send_later(
                    timers,
                    START_RETRY_DELAY,
                    Timer::Retry {
                        uid,
                        namespace,
                        name,
                    },
                );
                return;
            }
            shared
                .lock()
                .running
                .insert((namespace.clone(), name.clone()));
            tracing::info!(node = %shared.node_name, pod = %format!("{namespace}/{name}"), "pod running");
            if let Some(secs) = run_seconds(pod) {
                send_later(timers, secs, Timer::Finish(uid));
            }
        }
        Err(e) => {
            tracing::warn!(node = %shared.node_name, pod = %format!("{namespace}/{name}"), error = %e, "pod admission failed");
            if let Some(t) = tracked.get_mut(&uid) {
                t.finished = true;
            }
            let message = format!("Allocate failed due to {e}, which is unexpected");
            let patch = json!({"status": {
                "phase": "Failed", "reason": "UnexpectedAdmissionError", "message": message,
            }});
            if let Err(e) = patch_status(shared, &namespace, &name, &patch).await {
                tracing::warn!(node = %shared.node_name, pod = %format!("{namespace}/{name}"), error = %e, "cannot mark pod failed");
            }
        }
    }
}

/// `sim.gpupool.io/run-seconds`, when present and a number.
fn run_seconds(pod: &Pod) -> Option<Duration> {
    let raw = pod.annotations().get(ANNOTATION_SIM_RUN_SECONDS)?;
    match raw.trim().parse::<f64>() {
        Ok(s) if s.is_finite() && s >= 0.0 => Some(Duration::from_secs_f64(s)),
        _ => {
            tracing::warn!(pod = %pod.name_any(), value = %raw, "ignoring {ANNOTATION_SIM_RUN_SECONDS}: not a non-negative number of seconds");
            None
        }
    }
}

async fn on_timer(
    shared: &Arc<Shared>,
    tracked: &mut HashMap<String, Tracked>,
    timers: &mpsc::UnboundedSender<Timer>,
    timer: Timer,
) {
    match timer {
        Timer::Retry {
            uid,
            namespace,
            name,
        } => {
            if tracked.contains_key(&uid) {
                return;
            }
            let api: Api<Pod> = Api::namespaced(shared.client.clone(), &namespace);
            match api.get_opt(&name).await {
                Ok(Some(pod)) if pod.uid().as_deref() == Some(uid.as_str()) => {
                    on_pod(shared, tracked, timers, &pod).await;
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(node = %shared.node_name, pod = %format!("{namespace}/{name}"), error = %e, "cannot read pod to start it; retrying");
                    send_later(
                        timers,
                        START_RETRY_DELAY,
                        Timer::Retry {
                            uid,
                            namespace,
                            name,
                        },
                    );
                }
            }
        }
        Timer::Finish(uid) => {
            let Some(t) = tracked.get_mut(&uid) else {
                return;
            };
            if t.finished || t.removing {
                return;
            }
            t.finished = true;
            let (namespace, name) = (t.namespace.clone(), t.name.clone());
            {
                let mut state = shared.lock();
                state.book.release(&uid);
                state.running.remove(&(namespace.clone(), name.clone()));
            }
            let now = jiff::Timestamp::now().to_string();
            let api: Api<Pod> = Api::namespaced(shared.client.clone(), &namespace);
            let containers: Vec<String> = match api.get(&name).await {
                Ok(p) => p
                    .spec
                    .map(|s| s.containers.into_iter().map(|c| c.name).collect())
                    .unwrap_or_default(),
                Err(_) => Vec::new(),
            };
            let statuses: Vec<_> = containers
                .iter()
                .map(|c| json!({
                    "name": c, "ready": false, "started": false, "restartCount": 0,
                    "image": "sim", "imageID": "", "containerID": format!("sim://{uid}/{c}"),
                    "state": {"terminated": {"exitCode": 0, "reason": "Completed", "finishedAt": now}},
                }))
                .collect();
            let patch = json!({"status": {
                "phase": "Succeeded",
                "conditions": conditions(false, &now),
                "containerStatuses": statuses,
            }});
            match patch_status(shared, &namespace, &name, &patch).await {
                Ok(()) => {
                    tracing::info!(node = %shared.node_name, pod = %format!("{namespace}/{name}"), "pod succeeded")
                }
                Err(e) => {
                    tracing::warn!(node = %shared.node_name, pod = %format!("{namespace}/{name}"), error = %e, "cannot mark pod succeeded")
                }
            }
        }
        Timer::Remove(uid) => {
            let Some(t) = tracked.get(&uid) else { return };
            let (namespace, name) = (t.namespace.clone(), t.name.clone());
            {
                let mut state = shared.lock();
                state.book.release(&uid);
                state.running.remove(&(namespace.clone(), name.clone()));
            }
            let api: Api<Pod> = Api::namespaced(shared.client.clone(), &namespace);
            let params = DeleteParams {
                grace_period_seconds: Some(0),
                preconditions: Some(Preconditions {
                    uid: Some(uid.clone()),
                    resource_version: None,
                }),
                ..Default::default()
            };
            match api.delete(&name, &params).await {
                Ok(_) => {
                    tracing::info!(node = %shared.node_name, pod = %format!("{namespace}/{name}"), "pod removed after its grace period")
                }
                Err(kube::Error::Api(e)) if e.code == 404 || e.code == 409 => {}
                Err(e) => {
                    // Until it is removed the pod stays Terminating and its
                    // slot looks taken, so keep trying as kubelet does.
                    tracing::warn!(node = %shared.node_name, pod = %format!("{namespace}/{name}"), error = %e, "cannot remove pod; retrying");
                    send_later(timers, START_RETRY_DELAY, Timer::Remove(uid));
                }
            }
        }
    }
}

fn conditions(ready: bool, now: &str) -> serde_json::Value {
    let ready_status = if ready { "True" } else { "False" };
    let reason = if ready { None } else { Some("PodCompleted") };
    let cond = |t: &str, status: &str, reason: Option<&str>| {
        let mut c = json!({"type": t, "status": status, "lastTransitionTime": now});
        if let Some(r) = reason {
            c["reason"] = json!(r);
        }
        c
    };
    json!([
        cond("PodReadyToStartContainers", "True", None),
        cond("Initialized", "True", None),
        cond("Ready", ready_status, reason),
        cond("ContainersReady", ready_status, reason),
        cond("PodScheduled", "True", None),
    ])
}

async fn mark_running(
    shared: &Shared,
    pod: &Pod,
    envs: &admission::AllocatedEnv,
) -> Result<(), kube::Error> {
    let namespace = pod.namespace().unwrap_or_default();
    let name = pod.name_any();
    let api: Api<Pod> = Api::namespaced(shared.client.clone(), &namespace);
    let env_json = serde_json::to_string(envs).unwrap_or_default();
    if shared.annotate_allocations {
        let annotate = json!({"metadata": {"annotations": {ANNOTATION_ALLOCATED_ENV: env_json}}});
        api.patch(&name, &params(), &Patch::Merge(&annotate))
            .await?;
    }
    let now = jiff::Timestamp::now().to_string();
    let spec = pod.spec.clone().unwrap_or_default();
    let running = |c: &k8s_openapi::api::core::v1::Container| {
        json!({
            "name": c.name, "ready": true, "started": true, "restartCount": 0,
            "image": c.image.clone().unwrap_or_default(), "imageID": "",
            "containerID": format!("sim://{}/{}", pod.uid().unwrap_or_default(), c.name),
            "state": {"running": {"startedAt": now}},
        })
    };
    let init: Vec<_> = spec
        .init_containers
        .iter()
        .flatten()
        .map(|c| {
            let mut s = running(c);
            if !is_sidecar(c) {
                s["ready"] = json!(true);
                s["started"] = json!(false);
                s["state"] = json!({"terminated": {"exitCode": 0, "reason": "Completed", "finishedAt": now}});
            }
            s
        })
        .collect();
    let statuses: Vec<_> = spec.containers.iter().map(running).collect();
    let mut status = json!({
        "phase": "Running",
        "hostIP": "127.0.0.1",
        "hostIPs": [{"ip": "127.0.0.1"}],
        "podIP": shared.pod_ip(),
        "startTime": now,
        "conditions": conditions(true, &now),
        "containerStatuses": statuses,
    });
    if !init.is_empty() {
        status["initContainerStatuses"] = json!(init);
    }
    patch_status(shared, &namespace, &name, &json!({"status": status})).await
}

fn params() -> PatchParams {
    PatchParams {
        field_manager: Some("sim-kubelet".into()),
        ..Default::default()
    }
}

/// Merge-patches the pod's status, retrying transient failures (anything
/// but 404 and 422) a bounded number of times, since a status the kubelet
/// fails to write would leave the pod in its old phase for good.
async fn patch_status(
    shared: &Shared,
    namespace: &str,
    name: &str,
    patch: &serde_json::Value,
) -> Result<(), kube::Error> {
    let api: Api<Pod> = Api::namespaced(shared.client.clone(), namespace);
    let mut delay = Duration::from_millis(50);
    let mut attempt = 1;
    loop {
        match api
            .patch_status(name, &params(), &Patch::Merge(patch))
            .await
        {
            Ok(_) => return Ok(()),
            Err(kube::Error::Api(e)) if e.code == 404 || e.code == 422 => {
                return Err(kube::Error::Api(e));
            }
            Err(e) if attempt >= STATUS_WRITE_ATTEMPTS => return Err(e),
            Err(e) => {
                tracing::debug!(node = %shared.node_name, pod = %format!("{namespace}/{name}"), error = %e, attempt, "pod status write failed; retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(1));
                attempt += 1;
            }
        }
    }
}

/// Env a running pod's containers got from Allocate, read back from
/// [`ANNOTATION_ALLOCATED_ENV`]; `None` when absent or unreadable.
pub fn allocated_env(pod: &Pod) -> Option<BTreeMap<String, BTreeMap<String, String>>> {
    pod.annotations()
        .get(ANNOTATION_ALLOCATED_ENV)
        .and_then(|s| serde_json::from_str(s).ok())
}
