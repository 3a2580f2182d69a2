//! Kubernetes Events on pods (Queued, Admitted, Preempted, Released,
//! Rejected) and on classes (Invalid).
//!
//! Events are published off the decision path by one task with a bounded
//! queue: a slow or failing Events API never delays an admission, and when
//! the queue is full the event is dropped and counted.

use k8s_openapi::api::core::v1::ObjectReference;
use kube::Client;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use tokio::sync::mpsc;

use crate::engine::ObjectKey;
use crate::metrics::Metrics;

/// Events waiting to be published before new ones are dropped.
const QUEUE: usize = 4096;

/// What happened to a pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PodEvent {
    /// It got a lease and waits at `position`.
    Queued {
        /// 1-based place among waiting pods of its role, when known.
        position: Option<u32>,
    },
    /// It was admitted to `node`.
    Admitted {
        /// The node.
        node: String,
    },
    /// It is evicted for `by` (`namespace/name` of a primary).
    Preempted {
        /// The primary.
        by: String,
    },
    /// Its lease was released (the pod finished or is gone).
    Released,
    /// Its lease was rejected: the pod cannot queue as it is (the note says why).
    Rejected {
        /// The lease's message.
        why: String,
    },
}

impl PodEvent {
    /// Reason and note as `kubectl describe pod` shows them.
    pub fn reason_and_note(&self) -> (&'static str, String) {
        match self {
            PodEvent::Queued { position: Some(p) } => {
                ("Queued", format!("waiting for a GPU slot at position {p}"))
            }
            PodEvent::Queued { position: None } => ("Queued", "waiting for a GPU slot".to_owned()),
            PodEvent::Admitted { node } => ("Admitted", format!("admitted to node {node}")),
            PodEvent::Preempted { by } => (
                "Preempted",
                format!("evicted to free GPU slots for primary {by}"),
            ),
            PodEvent::Released => ("Released", "GPU slots released".to_owned()),
            PodEvent::Rejected { why } => ("Rejected", why.clone()),
        }
    }

    /// `Warning` for what the pod's owner must act on, `Normal` otherwise.
    pub fn is_warning(&self) -> bool {
        matches!(self, PodEvent::Rejected { .. })
    }
}

/// An event to publish.
#[derive(Debug, Clone)]
struct Emit {
    /// The object it is about.
    reference: ObjectReference,
    /// `namespace/name` for logs.
    what: String,
    reason: &'static str,
    note: String,
    warning: bool,
}

/// Hands events to the publishing task.
#[derive(Clone)]
pub struct EventSink {
    tx: mpsc::Sender<Emit>,
    metrics: Metrics,
}

impl EventSink {
    /// Starts the publishing task (it ends when every sink is dropped).
    pub fn spawn(client: Client, instance: String, metrics: Metrics) -> Self {
        let (tx, mut rx) = mpsc::channel::<Emit>(QUEUE);
        let recorder = Recorder::new(
            client,
            Reporter {
                controller: gpupool_api::names::FIELD_MANAGER_OPERATOR.to_owned(),
                instance: Some(instance),
            },
        );
        let task_metrics = metrics.clone();
        tokio::spawn(async move {
            while let Some(e) = rx.recv().await {
                let ev = Event {
                    type_: if e.warning {
                        EventType::Warning
                    } else {
                        EventType::Normal
                    },
                    reason: e.reason.to_owned(),
                    note: Some(e.note),
                    action: e.reason.to_owned(),
                    secondary: None,
                };
                if let Err(err) = recorder.publish(&ev, &e.reference).await {
                    task_metrics.error("publish_event");
                    tracing::warn!(object = %e.what, reason = e.reason, error = %err, "cannot publish event");
                }
            }
        });
        Self { tx, metrics }
    }

    /// Queues an event about a pod; drops (and counts) it when the queue is full.
    pub fn emit(&self, pod: &ObjectKey, uid: &str, event: PodEvent) {
        let (reason, note) = event.reason_and_note();
        self.send(Emit {
            reference: ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Pod".into()),
                namespace: Some(pod.namespace.clone()),
                name: Some(pod.name.clone()),
                uid: Some(uid.to_owned()),
                ..Default::default()
            },
            what: pod.to_string(),
            reason,
            note,
            warning: event.is_warning(),
        });
    }

    /// Queues a Warning `Invalid` event on class `class` saying why it
    /// cannot admit anything.
    pub fn emit_class_invalid(&self, class: &str, uid: Option<String>, why: String) {
        self.send(Emit {
            reference: ObjectReference {
                api_version: Some(format!(
                    "{}/{}",
                    gpupool_api::names::GROUP,
                    gpupool_api::names::VERSION
                )),
                kind: Some("GpuLeaseClass".into()),
                name: Some(class.to_owned()),
                uid,
                ..Default::default()
            },
            what: class.to_owned(),
            reason: "Invalid",
            note: why,
            warning: true,
        });
    }

    fn send(&self, e: Emit) {
        if self.tx.try_send(e).is_err() {
            self.metrics.events_dropped.inc();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notes_say_what_happened() {
        assert_eq!(
            PodEvent::Queued { position: Some(3) }.reason_and_note(),
            ("Queued", "waiting for a GPU slot at position 3".to_owned())
        );
        let (r, n) = PodEvent::Admitted {
            node: "node-1".into(),
        }
        .reason_and_note();
        assert_eq!((r, n.contains("node-1")), ("Admitted", true));
        let (r, n) = PodEvent::Preempted { by: "ns/p".into() }.reason_and_note();
        assert_eq!((r, n.contains("ns/p")), ("Preempted", true));
        assert_eq!(PodEvent::Released.reason_and_note().0, "Released");
    }
}
