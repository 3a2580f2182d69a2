//! The exact patches the controller sends. Kept pure so every byte of them
//! is unit-tested.

use gpupool_api::names::{LABEL_HOSTNAME, SCHEDULING_GATE};
use gpupool_api::{GpuLeaseClassStatus, GpuLeaseStatus};
use serde_json::{Map, Value, json};

use crate::engine::CachedLease;
use crate::engine::translate::{PodSource, PodSpecSource};
use crate::index::translate::gate_index;

/// The status fields the device plugin owns (the GPUs and the column that
/// lists their indexes): the operator never writes them, so a stale cache
/// can never erase what the plugin reported.
const DEVICE_PLUGIN_FIELDS: [&str; 2] = ["gpus", "gpuIndexes"];

/// Why no admission patch could be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdmissionPatchError {
    /// The cached pod no longer carries the gate (someone else admitted it).
    #[error("pod no longer carries the scheduling gate {SCHEDULING_GATE}")]
    NoGate,
    /// The pod already pins another host.
    #[error("pod already pins {LABEL_HOSTNAME}={0}")]
    PinnedElsewhere(String),
    /// The operations could not be encoded as a JSON patch.
    #[error("cannot encode the admission patch: {0}")]
    Encode(String),
}

/// The one JSON patch that admits `pod` to `node`: test that the pod is the
/// one decided on (uid) and that the gate is where the cache saw it, remove
/// the gate, and pin the pod with `nodeSelector kubernetes.io/hostname`. If
/// anything changed meanwhile the `test`s make the API server refuse the
/// whole patch, so a pod is never admitted on stale information. Reads any
/// form of a pod ([`PodSource`]): the controller's cached one.
pub fn admission_patch(
    pod: &impl PodSource,
    node: &str,
) -> Result<json_patch::Patch, AdmissionPatchError> {
    let index = gate_index(pod).ok_or(AdmissionPatchError::NoGate)?;
    let mut ops = Vec::with_capacity(4);
    if let Some(uid) = pod.uid() {
        ops.push(json!({"op": "test", "path": "/metadata/uid", "value": uid}));
    }
    ops.push(json!({
        "op": "test",
        "path": format!("/spec/schedulingGates/{index}"),
        "value": {"name": SCHEDULING_GATE},
    }));
    ops.push(json!({"op": "remove", "path": format!("/spec/schedulingGates/{index}")}));
    // Whether the pod has a selector at all, and its pin if it has one:
    // a patch adds to an existing selector but must create a missing one.
    let (has_selector, pinned) = match pod.spec().and_then(|s| s.node_selector()) {
        None => (false, None),
        Some(mut entries) => (
            true,
            entries.find_map(|(k, v)| (k == LABEL_HOSTNAME).then_some(v)),
        ),
    };
    match pinned {
        Some(existing) if existing == node => {}
        Some(existing) => {
            return Err(AdmissionPatchError::PinnedElsewhere(existing.to_owned()));
        }
        None if has_selector => ops.push(json!({
            "op": "add",
            "path": format!("/spec/nodeSelector/{}", escape_pointer(LABEL_HOSTNAME)),
            "value": node,
        })),
        None => ops.push(json!({
            "op": "add",
            "path": "/spec/nodeSelector",
            "value": {LABEL_HOSTNAME: node},
        })),
    }
    serde_json::from_value(Value::Array(ops))
        .map_err(|e| AdmissionPatchError::Encode(e.to_string()))
}

/// Escapes one JSON-pointer segment (RFC 6901).
fn escape_pointer(segment: &str) -> String {
    segment.replace('~', "~0").replace('/', "~1")
}

/// A merge patch turning status `old` into `new`: every field of `new`, and
/// `null` for fields `old` has and `new` lacks. `gpus` and `gpuIndexes` are
/// left out (the device plugin owns them). With `resource_version` the API server refuses the write
/// (409) if the lease changed since it was read.
pub fn lease_status_patch(
    old: Option<&GpuLeaseStatus>,
    new: &GpuLeaseStatus,
    resource_version: Option<&str>,
) -> Value {
    let mut status = to_object(new);
    // The GPUs are the device plugin's to write; only the first status of a
    // lease recreated after a deletion carries the last ones it reported.
    if old.is_some() || new.gpus.is_empty() {
        for field in DEVICE_PLUGIN_FIELDS {
            status.remove(field);
        }
    }
    if let Some(old) = old {
        for key in to_object(old).keys() {
            if !DEVICE_PLUGIN_FIELDS.contains(&key.as_str()) && !status.contains_key(key) {
                status.insert(key.clone(), Value::Null);
            }
        }
    }
    let mut patch = json!({"status": status});
    if let Some(rv) = resource_version {
        patch["metadata"] = json!({"resourceVersion": rv});
    }
    patch
}

/// True when writing `new` over `old` would change something the operator owns.
pub fn lease_status_differs(old: Option<&GpuLeaseStatus>, new: &GpuLeaseStatus) -> bool {
    let mut a = old.map(to_object).unwrap_or_default();
    let mut b = to_object(new);
    for field in DEVICE_PLUGIN_FIELDS {
        a.remove(field);
        b.remove(field);
    }
    a != b
}

/// True when `fresh` is `seen` with nothing changed but the fields the
/// progress writer writes (position and message), so a status decided on
/// `seen` may be written over `fresh` instead: the pass decided from the
/// lease's identity, spec, phase and sequence, and none of them moved.
/// A change anywhere else (another replica's phase, the device plugin's
/// GPUs or `boundAt`, a new lease of the same name) keeps the conflict.
pub fn only_progress_changed(seen: &CachedLease, fresh: &CachedLease) -> bool {
    if seen.metadata.uid != fresh.metadata.uid || seen.spec != fresh.spec {
        return false;
    }
    match (&seen.status, &fresh.status) {
        (Some(seen), Some(fresh)) => {
            let fresh = GpuLeaseStatus {
                position: seen.position,
                message: seen.message.clone(),
                ..fresh.clone()
            };
            *seen == fresh
        }
        (None, None) => true,
        _ => false,
    }
}

/// A merge patch replacing a class's status (lists are replaced whole by merge patches).
pub fn class_status_patch(new: &GpuLeaseClassStatus) -> Value {
    json!({"status": new})
}

fn to_object<T: serde::Serialize>(v: &T) -> Map<String, Value> {
    match serde_json::to_value(v) {
        Ok(Value::Object(m)) => m,
        _ => Map::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpupool_api::{GpuLeaseSpec, LeaseGpu, LeasePhase, Role};
    use k8s_openapi::api::core::v1::Pod;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    fn queued_lease() -> CachedLease {
        let mut lease = CachedLease::new(
            "ns",
            "a",
            GpuLeaseSpec {
                class_name: "default".into(),
                pod_name: "a".into(),
                pod_uid: "p".into(),
                role: Role::Primary,
                slots: 1,
            },
            None,
        );
        lease.metadata.uid = Some("u".into());
        lease.status = Some(GpuLeaseStatus {
            phase: LeasePhase::Queued,
            sequence: Some(7),
            position: Some(3),
            message: Some("waiting".into()),
            ..Default::default()
        });
        lease
    }

    #[test]
    fn only_a_moved_position_or_message_lets_a_status_be_written_over_the_new_lease() {
        let seen = queued_lease();
        let with = |change: &dyn Fn(&mut CachedLease)| {
            let mut fresh = seen.clone();
            change(&mut fresh);
            only_progress_changed(&seen, &fresh)
        };
        fn status(lease: &mut CachedLease) -> &mut GpuLeaseStatus {
            lease.status.as_mut().expect("status")
        }
        assert!(with(&|_| {}));
        assert!(with(&|l| {
            status(l).position = Some(1);
            status(l).message = None;
        }));
        // Anything else the pass decided from, or another writer's field.
        assert!(!with(&|l| status(l).phase = LeasePhase::Admitted));
        assert!(!with(&|l| status(l).sequence = Some(8)));
        assert!(!with(&|l| status(l).node = Some("node-1".into())));
        assert!(!with(
            &|l| status(l).bound_at = Some(Time(jiff::Timestamp::UNIX_EPOCH))
        ));
        assert!(!with(&|l| status(l).gpus = vec![LeaseGpu {
            index: 0,
            uuid: "GPU-0".into(),
            product: None,
        }]));
        assert!(!with(
            &|l| l.metadata.uid = Some("a new lease of the same name".into())
        ));
        assert!(!with(&|l| l.spec.slots = 2));
        assert!(!with(&|l| l.status = None));
    }

    fn pod(value: Value) -> Pod {
        serde_json::from_value(value).expect("pod")
    }

    #[test]
    fn admission_without_node_selector_adds_the_map() {
        let p = pod(json!({
            "metadata": {"name": "p", "uid": "u1"},
            "spec": {"containers": [], "schedulingGates": [{"name": "x"}, {"name": "gpupool.io/admission"}]}
        }));
        let patch = admission_patch(&p, "node-2").expect("gated");
        assert_eq!(
            serde_json::to_value(&patch).expect("ser"),
            json!([
                {"op": "test", "path": "/metadata/uid", "value": "u1"},
                {"op": "test", "path": "/spec/schedulingGates/1", "value": {"name": "gpupool.io/admission"}},
                {"op": "remove", "path": "/spec/schedulingGates/1"},
                {"op": "add", "path": "/spec/nodeSelector", "value": {"kubernetes.io/hostname": "node-2"}}
            ])
        );
    }

    #[test]
    fn admission_with_node_selector_adds_one_key() {
        let p = pod(json!({
            "metadata": {"name": "p"},
            "spec": {"containers": [], "nodeSelector": {"zone": "a"},
                     "schedulingGates": [{"name": "gpupool.io/admission"}]}
        }));
        let patch = admission_patch(&p, "node-1").expect("gated");
        assert_eq!(
            serde_json::to_value(&patch).expect("ser"),
            json!([
                {"op": "test", "path": "/spec/schedulingGates/0", "value": {"name": "gpupool.io/admission"}},
                {"op": "remove", "path": "/spec/schedulingGates/0"},
                {"op": "add", "path": "/spec/nodeSelector/kubernetes.io~1hostname", "value": "node-1"}
            ])
        );
        // Applying it to the pod gives what the API server would store.
        let mut doc = serde_json::to_value(&p).expect("ser");
        json_patch::patch(&mut doc, &patch).expect("applies");
        assert_eq!(
            doc["spec"]["nodeSelector"]["kubernetes.io/hostname"],
            "node-1"
        );
        assert_eq!(doc["spec"]["schedulingGates"], json!([]));
    }

    #[test]
    fn admission_refuses_stale_or_conflicting_pods() {
        let ungated = pod(json!({"metadata": {"name": "p"}, "spec": {"containers": []}}));
        assert_eq!(
            admission_patch(&ungated, "n").expect_err("no gate"),
            AdmissionPatchError::NoGate
        );
        let pinned = pod(json!({
            "metadata": {"name": "p"},
            "spec": {"containers": [], "nodeSelector": {"kubernetes.io/hostname": "other"},
                     "schedulingGates": [{"name": "gpupool.io/admission"}]}
        }));
        assert_eq!(
            admission_patch(&pinned, "n").expect_err("pinned"),
            AdmissionPatchError::PinnedElsewhere("other".into())
        );
        let same = admission_patch(&pinned, "other").expect("already pinned there");
        assert_eq!(
            serde_json::to_value(&same)
                .expect("ser")
                .as_array()
                .map(Vec::len),
            Some(2),
            "only test + remove"
        );
    }

    #[test]
    fn admission_test_fails_when_the_gate_moved() {
        let p = pod(json!({
            "metadata": {"name": "p"},
            "spec": {"containers": [], "schedulingGates": [{"name": "gpupool.io/admission"}]}
        }));
        let patch = admission_patch(&p, "n").expect("gated");
        let mut moved = json!({"metadata": {"name": "p"}, "spec": {"containers": [],
            "schedulingGates": [{"name": "other"}, {"name": "gpupool.io/admission"}]}});
        assert!(json_patch::patch(&mut moved, &patch).is_err());
    }

    #[test]
    fn status_patch_nulls_dropped_fields_and_never_touches_gpus() {
        let old = GpuLeaseStatus {
            phase: LeasePhase::Queued,
            sequence: Some(4),
            position: Some(2),
            gpus: vec![LeaseGpu {
                index: 0,
                uuid: "GPU-a".into(),
                product: None,
            }],
            gpu_indexes: Some("0".into()),
            message: Some("waiting".into()),
            ..Default::default()
        };
        let new = GpuLeaseStatus {
            phase: LeasePhase::Admitted,
            sequence: Some(4),
            node: Some("node-1".into()),
            ..Default::default()
        };
        assert_eq!(
            lease_status_patch(Some(&old), &new, Some("42")),
            json!({
                "metadata": {"resourceVersion": "42"},
                "status": {"phase": "Admitted", "sequence": 4, "node": "node-1",
                           "position": null, "message": null}
            })
        );
        assert!(lease_status_differs(Some(&old), &new));
        let mut same = old.clone();
        same.gpus.clear();
        same.gpu_indexes = None;
        assert!(
            !lease_status_differs(Some(&old), &same),
            "gpus and their indexes alone are no change"
        );
        assert!(lease_status_differs(None, &new));
        assert_eq!(
            lease_status_patch(None, &new, None),
            json!({"status": {"phase": "Admitted", "sequence": 4, "node": "node-1"}})
        );
    }

    #[test]
    fn a_recreated_lease_gets_back_the_gpus_and_their_column_together() {
        let last = GpuLeaseStatus {
            phase: LeasePhase::Bound,
            sequence: Some(4),
            node: Some("node-1".into()),
            gpus: vec![LeaseGpu {
                index: 1,
                uuid: "GPU-b".into(),
                product: None,
            }],
            gpu_indexes: Some("1".into()),
            ..Default::default()
        };
        let first = lease_status_patch(None, &last, None);
        assert_eq!(first["status"]["gpus"][0]["uuid"], "GPU-b");
        assert_eq!(first["status"]["gpuIndexes"], "1");
        let later = lease_status_patch(Some(&last), &last, None);
        assert!(
            later["status"].get("gpus").is_none() && later["status"].get("gpuIndexes").is_none(),
            "a lease that exists keeps what its device plugin wrote: {later}"
        );
    }
}
