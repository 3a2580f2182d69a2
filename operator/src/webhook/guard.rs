//! Validation of gpupool's own objects (DESIGN §5.10): GpuLeases are the
//! operator's to write, and GpuLeaseClasses must make sense before they are
//! stored. Pure, like the pod reviews: a request and a view in, a decision out.

use std::collections::BTreeMap;

use gpupool_api::{GpuLease, GpuLeaseClass};
use kube::core::admission::{AdmissionRequest, Operation};
use serde_json::Value;

use super::review::{ClusterView, Decision, Denial, Users};
use crate::engine::fit::ClassSelector;
use crate::engine::{established_default, is_extended_resource};

/// The `userInfo.extra` key under which bound service-account tokens carry
/// the name of the node their pod runs on.
pub const NODE_NAME_EXTRA: &str = "authentication.kubernetes.io/node-name";

/// Status fields a device plugin may write: which GPUs the pod got (the
/// list and the column of their indexes), and when.
const DEVICE_PLUGIN_FIELDS: [&str; 3] = ["gpus", "gpuIndexes", "boundAt"];

/// The identities the webhooks trust with more than a tenant: the operator
/// and the device plugins.
#[derive(Debug, Clone)]
pub struct Identities {
    /// The operator: everything.
    pub operator: Users,
    /// Device plugins: `status.gpus`, `status.gpuIndexes` and
    /// `status.boundAt` of leases on their own node.
    pub device_plugins: Users,
}

/// Reviews a GpuLease CREATE or UPDATE (main resource or `status`).
///
/// The operator may do anything. Nobody else may create a lease or change
/// its spec. A device plugin may change only `status.gpus`,
/// `status.gpuIndexes` and `status.boundAt`, and only of a lease whose `status.node` is the node its
/// token is bound to (when the token carries one). Anyone else may change
/// only metadata (labels, annotations, finalizers). So the sequence, phase
/// and node the operator decided cannot be forged.
pub fn validate_lease(request: &AdmissionRequest<GpuLease>, writers: &Identities) -> Decision {
    let user = request.user_info.username.as_deref().unwrap_or_default();
    if writers.operator.contains(user) {
        return Decision::Allow;
    }
    let denied = |what: String| {
        Decision::Deny(Denial::LeaseWrite {
            user: user.to_owned(),
            what,
        })
    };
    match request.operation {
        Operation::Create => return denied("create GpuLeases".to_owned()),
        Operation::Update => {}
        _ => return Decision::Allow,
    }
    let (Some(old), Some(new)) = (request.old_object.as_ref(), request.object.as_ref()) else {
        return Decision::Deny(Denial::MissingObject {
            operation: "UPDATE".to_owned(),
        });
    };
    if old.spec != new.spec {
        return denied("change spec".to_owned());
    }
    let changed = changed_fields(
        &serde_json::to_value(&old.status).unwrap_or(Value::Null),
        &serde_json::to_value(&new.status).unwrap_or(Value::Null),
    );
    if changed.is_empty() {
        return Decision::Allow;
    }
    if !writers.device_plugins.contains(user) {
        return denied(format!("change status.{}", changed.join(", status.")));
    }
    let forbidden: Vec<&str> = changed
        .iter()
        .map(String::as_str)
        .filter(|f| !DEVICE_PLUGIN_FIELDS.contains(f))
        .collect();
    if !forbidden.is_empty() {
        return denied(format!(
            "change status.{} (a device plugin may change only status.gpus, status.gpuIndexes and status.boundAt)",
            forbidden.join(", status.")
        ));
    }
    let bound_node = request
        .user_info
        .extra
        .as_ref()
        .and_then(|e| e.get(NODE_NAME_EXTRA))
        .and_then(|v| v.first());
    let lease_node = old.status.as_ref().and_then(|s| s.node.as_deref());
    match bound_node {
        Some(node) if lease_node != Some(node.as_str()) => denied(format!(
            "write the GPUs of a lease on node {} from node {node}",
            lease_node.unwrap_or("(none)")
        )),
        _ => Decision::Allow,
    }
}

/// Top-level keys whose values differ between two JSON objects, sorted.
fn changed_fields(old: &Value, new: &Value) -> Vec<String> {
    let empty = serde_json::Map::new();
    let (old, new) = (
        old.as_object().unwrap_or(&empty),
        new.as_object().unwrap_or(&empty),
    );
    let mut keys: BTreeMap<&str, ()> = BTreeMap::new();
    for k in old.keys().chain(new.keys()) {
        if old.get(k) != new.get(k) {
            keys.insert(k, ());
        }
    }
    keys.into_keys().map(str::to_owned).collect()
}

/// Reviews a GpuLeaseClass CREATE or UPDATE: the resource must be an
/// extended resource, the node selector must be one the engine can evaluate
/// (the same compile the engine runs), and a class may not become the
/// default while another one is (the older default keeps its queue). An
/// update that leaves the spec as it was is always allowed.
pub fn validate_class(
    request: &AdmissionRequest<GpuLeaseClass>,
    view: &impl ClusterView,
) -> Decision {
    if !matches!(request.operation, Operation::Create | Operation::Update) {
        return Decision::Allow;
    }
    let Some(class) = request.object.as_ref() else {
        return Decision::Deny(Denial::MissingObject {
            operation: format!("{:?}", request.operation).to_uppercase(),
        });
    };
    let old = request.old_object.as_ref();
    if old.is_some_and(|o| o.spec == class.spec) {
        return Decision::Allow;
    }
    let name = class.metadata.name.as_deref().unwrap_or(&request.name);
    let spec = &class.spec;
    if !is_extended_resource(&spec.resource_name) {
        return Decision::Deny(Denial::NotExtendedResource {
            class: name.to_owned(),
            resource: spec.resource_name.clone(),
        });
    }
    if let Err(reason) = ClassSelector::compile(spec.node_selector.as_ref()) {
        return Decision::Deny(Denial::InvalidNodeSelector {
            class: name.to_owned(),
            reason,
        });
    }
    let was_default = old.is_some_and(|o| o.spec.default);
    if spec.default && !was_default {
        let classes = view.classes();
        let others = classes
            .iter()
            .filter(|c| c.spec.default && c.metadata.name.as_deref() != Some(name))
            .filter_map(|c| {
                Some((
                    c.metadata.name.as_deref()?,
                    c.metadata.creation_timestamp.as_ref().map(|t| t.0),
                ))
            });
        if let Some(default) = established_default(others) {
            return Decision::Deny(Denial::SecondDefault {
                class: name.to_owned(),
                default: default.to_owned(),
            });
        }
    }
    Decision::Allow
}

#[cfg(test)]
#[path = "guard_tests.rs"]
mod tests;
