use std::sync::Arc;

use gpupool_api::{
    GpuLease, GpuLeaseClass, GpuLeaseClassSpec, GpuLeaseSpec, GpuLeaseStatus, LeaseGpu, LeasePhase,
    Role,
};
use kube::core::admission::{AdmissionRequest, AdmissionReview};
use serde_json::json;

use super::*;
use crate::webhook::review::StaticView;

const OPERATOR: &str = "system:serviceaccount:gpupool-system:gpupool-operator";
const PLUGIN: &str = "system:serviceaccount:gpupool-system:gpupool-device-plugin";

fn identities() -> Identities {
    Identities {
        operator: Users::new([OPERATOR.to_owned()]),
        device_plugins: Users::new([PLUGIN.to_owned()]),
    }
}

fn lease(node: &str) -> GpuLease {
    let mut l = GpuLease::new(
        "train",
        GpuLeaseSpec {
            class_name: "default".into(),
            pod_name: "train".into(),
            pod_uid: "uid-1".into(),
            role: Role::Primary,
            slots: 2,
        },
    );
    l.metadata.namespace = Some("ml".into());
    l.status = Some(GpuLeaseStatus {
        phase: LeasePhase::Admitted,
        sequence: Some(7),
        node: Some(node.into()),
        ..Default::default()
    });
    l
}

fn request<K: serde::Serialize + kube::Resource + serde::de::DeserializeOwned>(
    operation: &str,
    user: &str,
    node: Option<&str>,
    object: Option<&K>,
    old: Option<&K>,
    sub_resource: Option<&str>,
) -> AdmissionRequest<K> {
    let mut user_info = json!({"username": user});
    if let Some(node) = node {
        user_info["extra"] = json!({ NODE_NAME_EXTRA: [node] });
    }
    let review: AdmissionReview<K> = serde_json::from_value(json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "7d8f0d1e-0000-4000-8000-000000000002",
            "kind": {"group": "gpupool.io", "version": "v1alpha1", "kind": "GpuLease"},
            "resource": {"group": "gpupool.io", "version": "v1alpha1", "resource": "gpuleases"},
            "subResource": sub_resource,
            "name": "train",
            "namespace": "ml",
            "operation": operation,
            "userInfo": user_info,
            "object": object,
            "oldObject": old,
            "dryRun": false,
        }
    }))
    .expect("review json");
    review.try_into().expect("review has a request")
}

fn denied(d: Decision) -> String {
    match d {
        Decision::Deny(d) => d.to_string(),
        other => panic!("expected a denial, got {other:?}"),
    }
}

#[test]
fn the_operator_writes_anything() {
    let old = lease("node-1");
    let mut new = old.clone();
    new.spec.slots = 1;
    if let Some(s) = new.status.as_mut() {
        s.sequence = Some(1);
    }
    let req = request("UPDATE", OPERATOR, None, Some(&new), Some(&old), None);
    assert_eq!(validate_lease(&req, &identities()), Decision::Allow);
    let req = request("CREATE", OPERATOR, None, Some(&new), None, None);
    assert_eq!(validate_lease(&req, &identities()), Decision::Allow);
}

#[test]
fn nobody_else_creates_a_lease_or_changes_spec_sequence_or_phase() {
    let old = lease("node-1");
    let create = request("CREATE", "alice", None, Some(&old), None, None);
    assert_eq!(
        denied(validate_lease(&create, &identities())),
        "user \"alice\" may not create GpuLeases: GpuLeases are written by the gpupool operator"
    );
    for user in ["alice", PLUGIN] {
        let mut fewer = old.clone();
        fewer.spec.slots = 1;
        let req = request(
            "UPDATE",
            user,
            Some("node-1"),
            Some(&fewer),
            Some(&old),
            None,
        );
        assert!(
            denied(validate_lease(&req, &identities())).contains("may not change spec"),
            "{user}"
        );
        let mut earlier = old.clone();
        if let Some(s) = earlier.status.as_mut() {
            s.sequence = Some(1);
            s.phase = LeasePhase::Released;
        }
        let req = request(
            "UPDATE",
            user,
            Some("node-1"),
            Some(&earlier),
            Some(&old),
            Some("status"),
        );
        let msg = denied(validate_lease(&req, &identities()));
        assert!(
            msg.contains("change status.phase, status.sequence"),
            "{user}: {msg}"
        );
        if user == PLUGIN {
            assert!(
                msg.contains(
                    "(a device plugin may change only status.gpus, status.gpuIndexes and status.boundAt)"
                ),
                "{msg}"
            );
        }
    }
}

#[test]
fn a_device_plugin_records_gpus_only_on_its_own_node() {
    let old = lease("node-1");
    let mut reported = old.clone();
    if let Some(s) = reported.status.as_mut() {
        s.gpus = vec![LeaseGpu {
            index: 0,
            uuid: "GPU-1".into(),
            product: Some("Test".into()),
        }];
        s.gpu_indexes = Some("0".into());
        s.bound_at = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            jiff::Timestamp::from_second(1_800_000_000).expect("t"),
        ));
    }
    let own = request(
        "UPDATE",
        PLUGIN,
        Some("node-1"),
        Some(&reported),
        Some(&old),
        Some("status"),
    );
    assert_eq!(validate_lease(&own, &identities()), Decision::Allow);
    // A token without a node binding (clusters before 1.32) is trusted as
    // far as the fields go.
    let unbound = request(
        "UPDATE",
        PLUGIN,
        None,
        Some(&reported),
        Some(&old),
        Some("status"),
    );
    assert_eq!(validate_lease(&unbound, &identities()), Decision::Allow);
    let other = request(
        "UPDATE",
        PLUGIN,
        Some("node-2"),
        Some(&reported),
        Some(&old),
        Some("status"),
    );
    assert_eq!(
        denied(validate_lease(&other, &identities())),
        format!(
            "user \"{PLUGIN}\" may not write the GPUs of a lease on node node-1 from node node-2: GpuLeases are written by the gpupool operator"
        )
    );
    // A tenant may not write GPUs at all.
    let tenant = request(
        "UPDATE",
        "alice",
        None,
        Some(&reported),
        Some(&old),
        Some("status"),
    );
    assert!(
        denied(validate_lease(&tenant, &identities()))
            .contains("status.boundAt, status.gpuIndexes, status.gpus")
    );
}

#[test]
fn metadata_changes_are_anyones() {
    let old = lease("node-1");
    let mut labelled = old.clone();
    labelled.metadata.labels = Some([("team".to_owned(), "x".to_owned())].into());
    let req = request("UPDATE", "alice", None, Some(&labelled), Some(&old), None);
    assert_eq!(validate_lease(&req, &identities()), Decision::Allow);
    let missing = request::<GpuLease>("UPDATE", "alice", None, Some(&old), None, None);
    assert_eq!(
        denied(validate_lease(&missing, &identities())),
        "the UPDATE admission request carries no object"
    );
}

fn class(name: &str, f: impl FnOnce(&mut GpuLeaseClassSpec)) -> GpuLeaseClass {
    let mut spec = GpuLeaseClassSpec::default();
    f(&mut spec);
    GpuLeaseClass::new(name, spec)
}

fn view(classes: Vec<GpuLeaseClass>) -> StaticView {
    StaticView {
        classes: classes.into_iter().map(Arc::new).collect(),
        ..Default::default()
    }
}

#[test]
fn a_second_default_class_is_refused_naming_the_first() {
    let existing = view(vec![class("default", |s| s.default = true)]);
    let newcomer = class("fast", |s| s.default = true);
    let req = request("CREATE", "admin", None, Some(&newcomer), None, None);
    assert_eq!(
        denied(validate_class(&req, &existing)),
        "GpuLeaseClass \"default\" is already the default; at most one class may be marked default: true (set default: false on \"default\" first, or leave it out of \"fast\")"
    );
    // Editing the default itself, or a non-default class, is fine.
    let mut edited = class("default", |s| s.default = true);
    edited.spec.admission.max_queued = 5;
    let old = class("default", |s| s.default = true);
    let req = request("UPDATE", "admin", None, Some(&edited), Some(&old), None);
    assert_eq!(validate_class(&req, &existing), Decision::Allow);
    let plain = class("fast", |_| {});
    let req = request("CREATE", "admin", None, Some(&plain), None, None);
    assert_eq!(validate_class(&req, &existing), Decision::Allow);
}

#[test]
fn a_class_must_hand_out_an_extended_resource_and_a_usable_selector() {
    let none = view(vec![]);
    for bad in [
        "cpu",
        "nvidia.com",
        "kubernetes.io/gpu",
        "x.kubernetes.io/gpu",
        "/slot",
        "a/",
    ] {
        let c = class("c", |s| s.resource_name = bad.into());
        let req = request("CREATE", "admin", None, Some(&c), None, None);
        let msg = denied(validate_class(&req, &none));
        assert!(msg.contains("is not an extended resource"), "{bad}: {msg}");
    }
    for good in ["gpupool/slot", "nvidia.com/gpu", "example.com/fpga_1"] {
        let c = class("c", |s| s.resource_name = good.into());
        let req = request("CREATE", "admin", None, Some(&c), None, None);
        assert_eq!(validate_class(&req, &none), Decision::Allow, "{good}");
    }
    // The engine's own selector compile decides: Exists with values is refused.
    let c = class("c", |s| {
        s.node_selector = Some(
            serde_json::from_value(json!({
                "matchExpressions": [{"key": "gpu", "operator": "Exists", "values": ["a"]}]
            }))
            .expect("selector"),
        );
    });
    let req = request("CREATE", "admin", None, Some(&c), None, None);
    let msg = denied(validate_class(&req, &none));
    assert!(
        msg.starts_with("GpuLeaseClass \"c\" has an invalid nodeSelector"),
        "{msg}"
    );
}
