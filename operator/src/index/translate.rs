//! Kubernetes objects → the engine's plain model, with what cannot be read
//! logged: the translation itself is the engine's
//! ([`gpupool_engine::translate`]), which `kubectl gpupool` uses too, so the
//! operator and the plugin see the same model of the same objects.

use std::collections::BTreeSet;

use jiff::Timestamp;
use k8s_openapi::api::core::v1::Node;

use crate::engine::translate::{self as engine_translate, PodSource, Unread};
use crate::engine::{NodeInfo, PodInfo};

pub use crate::engine::translate::{class_info, gate_index, resource_names};

/// Logs what the translation could not read, at warning level, with the
/// object and the parser's words as fields.
fn warn(unread: Unread) {
    match unread {
        Unread::GpuList { node, error } => {
            tracing::warn!(node = %node, error = %error, "ignoring the node's GPU list");
        }
        Unread::Request { pod, error } => {
            tracing::warn!(pod = %pod, error = %error, "pod's GPU request cannot be read; it is not queued");
        }
        Unread::EnqueueStamp { pod, error } => {
            tracing::warn!(pod = %pod, error = %error, "ignoring unreadable enqueue stamp");
        }
    }
}

/// [`engine_translate::node_info_all`], logging what cannot be read.
pub fn node_info_all(node: &Node) -> Option<NodeInfo> {
    engine_translate::node_info_all(node, &mut warn)
}

/// [`engine_translate::node_info`], logging what cannot be read.
pub fn node_info(node: &Node, resources: &BTreeSet<String>) -> Option<NodeInfo> {
    engine_translate::node_info(node, resources, &mut warn)
}

/// [`engine_translate::pod_info`] of any form of a pod (the webhook's
/// whole `Pod`, a cached one), logging what cannot be read.
pub fn pod_info(
    pod: &impl PodSource,
    resources: &BTreeSet<String>,
    now: Timestamp,
) -> Option<PodInfo> {
    engine_translate::pod_info(pod, resources, now, &mut warn)
}
