//! What [`super::pod_info`] reads of a pod, as a trait: the webhook reviews
//! whole `Pod`s and the operator keeps trimmed copies, and both are read
//! by the one translation through this, so no form of a pod needs
//! rebuilding into another and no rule is written twice. The labels and
//! containers are read through `gpupool_api::pod`'s own traits, since its
//! rules (role, class, slots) read them.

use gpupool_api::pod::{PodContainers, PodLabels};
use jiff::Timestamp;
use k8s_openapi::api::core::v1::{self as k8s, Pod, PodSpec};

use super::POD_SCHEDULED;

/// A pod's metadata and status, as the translation reads them. An
/// implementation answers each read exactly as a whole `Pod` holding the
/// same fields would (see the `Pod` implementation): that is what makes
/// the translation of any form equal to that of the pod it was read from.
pub trait PodSource: PodLabels {
    /// How this form holds the pod's spec.
    type Spec: PodSpecSource;
    /// `metadata.namespace`.
    fn namespace(&self) -> Option<&str>;
    /// `metadata.name`.
    fn name(&self) -> Option<&str>;
    /// `metadata.uid`.
    fn uid(&self) -> Option<&str>;
    /// `metadata.creationTimestamp`.
    fn created_at(&self) -> Option<Timestamp>;
    /// Whether `metadata.deletionTimestamp` is set.
    fn deleting(&self) -> bool;
    /// The value of annotation `key`, if the pod has it.
    fn annotation(&self, key: &str) -> Option<&str>;
    /// The spec, if the pod has one.
    fn spec(&self) -> Option<&Self::Spec>;
    /// `status.phase`.
    fn phase(&self) -> Option<&str>;
    /// `status.reason` (why the kubelet failed the pod).
    fn status_reason(&self) -> Option<&str>;
    /// `status.message` (the kubelet's words with the reason).
    fn status_message(&self) -> Option<&str>;
    /// The `PodScheduled` condition of `status.conditions`, if any.
    fn pod_scheduled(&self) -> Option<PodScheduled<'_>>;
}

/// A pod's spec, as the translation reads it, besides its containers.
pub trait PodSpecSource: PodContainers {
    /// `nodeName`.
    fn node_name(&self) -> Option<&str>;
    /// `nodeSelector`'s entries; `None` when the pod has no selector
    /// (which a JSON patch adding one must tell from an empty one).
    fn node_selector(&self) -> Option<impl Iterator<Item = (&str, &str)>>;
    /// `affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution`.
    fn required_node_affinity(&self) -> Option<&k8s::NodeSelector>;
    /// `tolerations`, as sent.
    fn tolerations(&self) -> Option<&[k8s::Toleration]>;
    /// Every scheduling gate's name, in order.
    fn scheduling_gates(&self) -> impl Iterator<Item = &str>;
}

/// A pod's `PodScheduled` condition, borrowed from whatever form holds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PodScheduled<'a> {
    /// `True`, `False` or `Unknown`.
    pub status: &'a str,
    /// Why, in one word (`Unschedulable`, `SchedulingGated`).
    pub reason: Option<&'a str>,
    /// The scheduler's words.
    pub message: Option<&'a str>,
    /// When the status last changed.
    pub last_transition_time: Option<Timestamp>,
}

impl PodSource for Pod {
    type Spec = PodSpec;

    fn namespace(&self) -> Option<&str> {
        self.metadata.namespace.as_deref()
    }

    fn name(&self) -> Option<&str> {
        self.metadata.name.as_deref()
    }

    fn uid(&self) -> Option<&str> {
        self.metadata.uid.as_deref()
    }

    fn created_at(&self) -> Option<Timestamp> {
        self.metadata.creation_timestamp.as_ref().map(|t| t.0)
    }

    fn deleting(&self) -> bool {
        self.metadata.deletion_timestamp.is_some()
    }

    fn annotation(&self, key: &str) -> Option<&str> {
        self.metadata
            .annotations
            .as_ref()?
            .get(key)
            .map(String::as_str)
    }

    fn spec(&self) -> Option<&PodSpec> {
        self.spec.as_ref()
    }

    fn phase(&self) -> Option<&str> {
        self.status.as_ref()?.phase.as_deref()
    }

    fn status_reason(&self) -> Option<&str> {
        self.status.as_ref()?.reason.as_deref()
    }

    fn status_message(&self) -> Option<&str> {
        self.status.as_ref()?.message.as_deref()
    }

    fn pod_scheduled(&self) -> Option<PodScheduled<'_>> {
        let condition = self
            .status
            .as_ref()?
            .conditions
            .as_ref()?
            .iter()
            .find(|c| c.type_ == POD_SCHEDULED)?;
        Some(PodScheduled {
            status: &condition.status,
            reason: condition.reason.as_deref(),
            message: condition.message.as_deref(),
            last_transition_time: condition.last_transition_time.as_ref().map(|t| t.0),
        })
    }
}

impl PodSpecSource for PodSpec {
    fn node_name(&self) -> Option<&str> {
        self.node_name.as_deref()
    }

    fn node_selector(&self) -> Option<impl Iterator<Item = (&str, &str)>> {
        let selector = self.node_selector.as_ref()?;
        Some(selector.iter().map(|(k, v)| (k.as_str(), v.as_str())))
    }

    fn required_node_affinity(&self) -> Option<&k8s::NodeSelector> {
        self.affinity
            .as_ref()?
            .node_affinity
            .as_ref()?
            .required_during_scheduling_ignored_during_execution
            .as_ref()
    }

    fn tolerations(&self) -> Option<&[k8s::Toleration]> {
        self.tolerations.as_deref()
    }

    fn scheduling_gates(&self) -> impl Iterator<Item = &str> {
        self.scheduling_gates
            .iter()
            .flatten()
            .map(|g| g.name.as_str())
    }
}
