use super::*;
use gpupool_api::{GpuLeaseClassSpec, GpuLeaseSpec, GpuLeaseStatus, Role};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, LabelSelectorRequirement};
use kube::runtime::watcher;
use serde_json::json;

use crate::index::{Caches, store};

fn now() -> Timestamp {
    Timestamp::from_microsecond(1_700_000_000_123_456).expect("valid time")
}

/// A view that fails the test if a review consults it.
struct UntouchableView;

impl ClusterView for UntouchableView {
    fn classes(&self) -> Vec<Arc<GpuLeaseClass>> {
        panic!("the review read the class store")
    }
    fn largest_node(&self, _: &ClassInfo, _: &PodInfo) -> Result<Option<(String, u32)>, String> {
        panic!("the review read the node store")
    }
    fn queued(&self, _: &str, _: Role) -> usize {
        panic!("the review read the lease store")
    }
}

fn class(name: &str, default: bool) -> Arc<GpuLeaseClass> {
    Arc::new(GpuLeaseClass::new(
        name,
        GpuLeaseClassSpec {
            default,
            ..Default::default()
        },
    ))
}

fn class_with(name: &str, f: impl FnOnce(&mut GpuLeaseClassSpec)) -> Arc<GpuLeaseClass> {
    let mut spec = GpuLeaseClassSpec::default();
    f(&mut spec);
    Arc::new(GpuLeaseClass::new(name, spec))
}

fn node(name: &str, labels: serde_json::Value, allocatable: serde_json::Value) -> Arc<Node> {
    Arc::new(
        serde_json::from_value(json!({
            "metadata": {"name": name, "labels": labels},
            "status": {"allocatable": allocatable},
        }))
        .expect("node json"),
    )
}

fn lease(name: &str, class: &str, phase: Option<LeasePhase>) -> Arc<CachedLease> {
    role_lease(name, class, Role::Primary, phase)
}

fn role_lease(name: &str, class: &str, role: Role, phase: Option<LeasePhase>) -> Arc<CachedLease> {
    let status = phase.map(|phase| GpuLeaseStatus {
        phase,
        ..Default::default()
    });
    Arc::new(CachedLease::new(
        "ml",
        name,
        GpuLeaseSpec {
            class_name: class.into(),
            pod_name: name.into(),
            pod_uid: format!("uid-{name}"),
            role,
            slots: 1,
        },
        status,
    ))
}

fn one_default_class() -> StaticView {
    StaticView {
        classes: vec![class("default", true)],
        nodes: vec![node("node-1", json!({}), json!({"gpupool/slot": "4"}))],
        leases: vec![],
    }
}

fn gpu_pod(slots: &str) -> serde_json::Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "train", "namespace": "ml"},
        "spec": {"containers": [{
            "name": "main", "image": "trainer",
            "resources": {"limits": {"gpupool/slot": slots}}
        }]}
    })
}

fn with_labels(mut pod: serde_json::Value, labels: serde_json::Value) -> serde_json::Value {
    pod["metadata"]["labels"] = labels;
    pod
}

fn request(
    operation: &str,
    user: &str,
    object: Option<serde_json::Value>,
    old: Option<serde_json::Value>,
) -> AdmissionRequest<Pod> {
    let review: AdmissionReview<Pod> = serde_json::from_value(json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "7d8f0d1e-0000-4000-8000-000000000001",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "name": "train",
            "namespace": "ml",
            "operation": operation,
            "userInfo": {"username": user},
            "object": object,
            "oldObject": old,
            "dryRun": false,
        }
    }))
    .expect("review json");
    review.try_into().expect("review has a request")
}

fn create(pod: serde_json::Value) -> AdmissionRequest<Pod> {
    request("CREATE", "alice", Some(pod), None)
}

fn denial(decision: Decision) -> Denial {
    match decision {
        Decision::Deny(d) => d,
        other => panic!("expected a denial, got {other:?}"),
    }
}

/// Applies the decision's patch to `pod` and returns the result.
fn patched(decision: Decision, pod: &serde_json::Value) -> serde_json::Value {
    let Decision::Patch(patch) = decision else {
        panic!("expected a patch, got {decision:?}");
    };
    let mut doc = pod.clone();
    json_patch::patch(&mut doc, &patch).expect("patch applies to the pod");
    doc
}

const STAMP: &str = "2023-11-14T22:13:20.123456Z";

#[test]
fn pods_without_extended_resources_pass_without_reading_stores() {
    let pod = json!({
        "metadata": {"name": "web"},
        "spec": {"containers": [{"name": "web", "resources": {"requests": {"cpu": "1", "memory": "1Gi"}}}]}
    });
    assert_eq!(
        mutate(&create(pod), &UntouchableView, now()),
        Decision::Allow
    );
    let bare = json!({"metadata": {"name": "bare"}, "spec": {"containers": [{"name": "c"}]}});
    assert_eq!(
        mutate(&create(bare), &UntouchableView, now()),
        Decision::Allow
    );
}

#[test]
fn pods_requesting_other_extended_resources_pass_untouched() {
    let pod = json!({
        "metadata": {"name": "cuda"},
        "spec": {"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}
    });
    assert_eq!(
        mutate(&create(pod), &one_default_class(), now()),
        Decision::Allow
    );
}

#[test]
fn default_class_pod_is_gated_and_stamped() {
    let pod = gpu_pod("1");
    let out = patched(
        mutate(&create(pod.clone()), &one_default_class(), now()),
        &pod,
    );
    assert_eq!(
        out["spec"]["schedulingGates"],
        json!([{"name": "gpupool.io/admission"}])
    );
    assert_eq!(
        out["metadata"]["annotations"]["gpupool.io/enqueued-at"],
        json!(STAMP)
    );
}

#[test]
fn gate_is_appended_and_stamp_added_beside_existing_annotations() {
    let mut pod = gpu_pod("1");
    pod["spec"]["schedulingGates"] = json!([{"name": "example.com/other"}]);
    pod["metadata"]["annotations"] =
        json!({"team": "vision", "gpupool.io/enqueued-at": "2000-01-01T00:00:00.000000Z"});
    let out = patched(
        mutate(&create(pod.clone()), &one_default_class(), now()),
        &pod,
    );
    assert_eq!(
        out["spec"]["schedulingGates"],
        json!([{"name": "example.com/other"}, {"name": "gpupool.io/admission"}])
    );
    assert_eq!(out["metadata"]["annotations"]["team"], json!("vision"));
    // A client cannot choose its own place in the queue.
    assert_eq!(
        out["metadata"]["annotations"]["gpupool.io/enqueued-at"],
        json!(STAMP)
    );
}

#[test]
fn gate_already_present_is_not_duplicated() {
    let mut pod = gpu_pod("1");
    pod["spec"]["schedulingGates"] = json!([{"name": "gpupool.io/admission"}]);
    let out = patched(
        mutate(&create(pod.clone()), &one_default_class(), now()),
        &pod,
    );
    assert_eq!(
        out["spec"]["schedulingGates"],
        json!([{"name": "gpupool.io/admission"}])
    );
}

#[test]
fn init_container_requests_count() {
    let pod = json!({
        "metadata": {"name": "init"},
        "spec": {
            "initContainers": [{"name": "warm", "resources": {"requests": {"gpupool/slot": "2"}}}],
            "containers": [{"name": "main"}]
        }
    });
    assert!(matches!(
        mutate(&create(pod), &one_default_class(), now()),
        Decision::Patch(_)
    ));
}

#[test]
fn named_class_is_used_instead_of_the_default() {
    let view = StaticView {
        classes: vec![
            class("default", true),
            class_with("big", |s| s.admission.max_queued = 1),
        ],
        nodes: vec![],
        leases: vec![lease("waiting", "big", Some(LeasePhase::Queued))],
    };
    let pod = with_labels(gpu_pod("1"), json!({"gpupool.io/class": "big"}));
    let d = denial(mutate(&create(pod), &view, now()));
    assert!(
        matches!(d, Denial::QueueFull { ref class, .. } if class == "big"),
        "{d:?}"
    );
}

#[test]
fn unknown_class_is_denied_by_name() {
    let pod = with_labels(gpu_pod("1"), json!({"gpupool.io/class": "fast"}));
    let d = denial(mutate(&create(pod), &one_default_class(), now()));
    assert_eq!(
        d.to_string(),
        "GpuLeaseClass \"fast\" (label gpupool.io/class) does not exist"
    );
}

#[test]
fn no_label_and_no_default_is_denied() {
    let view = StaticView {
        classes: vec![class("a", false)],
        ..Default::default()
    };
    let d = denial(mutate(&create(gpu_pod("1")), &view, now()));
    assert_eq!(
        d.to_string(),
        "the pod requests gpupool/slot but names no GpuLeaseClass (label gpupool.io/class) and no class is marked default: true"
    );
    // With no class at all the same holds: gpupool/slot is always gpupool's.
    let d = denial(mutate(&create(gpu_pod("1")), &StaticView::default(), now()));
    assert!(matches!(d, Denial::NoClass { .. }), "{d:?}");
}

fn created_at(mut class: Arc<GpuLeaseClass>, second: i64) -> Arc<GpuLeaseClass> {
    Arc::make_mut(&mut class).metadata.creation_timestamp =
        Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            Timestamp::from_second(second).expect("time"),
        ));
    class
}

#[test]
fn with_two_defaults_an_unlabelled_pod_goes_to_the_older_one() {
    let view = StaticView {
        classes: vec![
            created_at(class("zeta", true), 100),
            created_at(class("alpha", true), 200),
        ],
        nodes: one_default_class().nodes,
        ..Default::default()
    };
    // The engine makes the same choice: both ask `established_default`.
    assert!(matches!(
        mutate(&create(gpu_pod("1")), &view, now()),
        Decision::Patch(_)
    ));
    assert_eq!(
        established_default([
            ("zeta", Some(Timestamp::from_second(100).expect("t"))),
            ("alpha", Some(Timestamp::from_second(200).expect("t")))
        ]),
        Some("zeta")
    );
}

#[test]
fn a_pod_that_names_its_node_is_denied() {
    let mut pod = gpu_pod("1");
    pod["spec"]["nodeName"] = json!("node-1");
    let d = denial(mutate(&create(pod), &one_default_class(), now()));
    assert_eq!(
        d.to_string(),
        "the pod sets spec.nodeName (\"node-1\") but requests gpupool/slot: gpupool pods wait in the queue and are placed by the operator; remove spec.nodeName (use a nodeSelector to choose nodes)"
    );
    // A pod that asks for no gpupool slot may name its node.
    let mut plain = json!({"metadata": {"name": "x", "namespace": "ml"}, "spec": {"nodeName": "node-1", "containers": [{"name": "c"}]}});
    plain["spec"]["containers"][0]["resources"] = json!({"limits": {"example.com/fpga": "1"}});
    assert_eq!(
        mutate(&create(plain), &one_default_class(), now()),
        Decision::Allow
    );
}

#[test]
fn class_and_role_labels_and_the_stamp_cannot_change_after_creation() {
    let base = with_labels(
        gpu_pod("1"),
        json!({"gpupool.io/role": "helper", "gpupool.io/class": "a"}),
    );
    for (key, value) in [
        ("gpupool.io/role", json!("primary")),
        ("gpupool.io/class", json!("b")),
        ("gpupool.io/role", serde_json::Value::Null),
    ] {
        let mut changed = base.clone();
        match value {
            serde_json::Value::Null => {
                changed["metadata"]["labels"]
                    .as_object_mut()
                    .expect("labels")
                    .remove(key);
            }
            v => changed["metadata"]["labels"][key] = v,
        }
        // Even the operator does not relabel pods.
        for user in ["alice", "gpupool-operator"] {
            let req = request("UPDATE", user, Some(changed.clone()), Some(base.clone()));
            let d = denial(validate(&req, &owners()));
            assert_eq!(
                d.to_string(),
                format!(
                    "label {key} cannot be changed after the pod is created (it decides the pod's class, role or place in the queue); delete and recreate the pod instead"
                )
            );
        }
    }
    let mut stamped = base.clone();
    stamped["metadata"]["annotations"] = json!({"gpupool.io/enqueued-at": STAMP});
    let mut earlier = stamped.clone();
    earlier["metadata"]["annotations"]["gpupool.io/enqueued-at"] =
        json!("2001-01-01T00:00:00.000000Z");
    let d = denial(validate(
        &request("UPDATE", "alice", Some(earlier), Some(stamped.clone())),
        &owners(),
    ));
    assert!(
        matches!(
            d,
            Denial::Immutable {
                key: "gpupool.io/enqueued-at",
                ..
            }
        ),
        "{d:?}"
    );
    // Other labels change freely, and pods without extended resources too.
    let mut other = stamped.clone();
    other["metadata"]["labels"]["team"] = json!("x");
    assert_eq!(
        validate(
            &request("UPDATE", "alice", Some(other), Some(stamped)),
            &owners()
        ),
        Decision::Allow
    );
    let plain = json!({"metadata": {"name": "x", "namespace": "ml", "labels": {"gpupool.io/role": "helper"}}, "spec": {"containers": [{"name": "c"}]}});
    let relabelled = json!({"metadata": {"name": "x", "namespace": "ml", "labels": {"gpupool.io/role": "primary"}}, "spec": {"containers": [{"name": "c"}]}});
    assert_eq!(
        validate(
            &request("UPDATE", "alice", Some(relabelled), Some(plain)),
            &owners()
        ),
        Decision::Allow
    );
}

#[test]
fn bad_role_is_denied_naming_the_value() {
    let pod = with_labels(gpu_pod("1"), json!({"gpupool.io/role": "boss"}));
    let d = denial(mutate(&create(pod), &one_default_class(), now()));
    assert_eq!(
        d.to_string(),
        "label gpupool.io/role must be \"primary\" or \"helper\", not \"boss\""
    );
}

#[test]
fn helper_role_is_queued() {
    let pod = with_labels(gpu_pod("1"), json!({"gpupool.io/role": "helper"}));
    assert!(matches!(
        mutate(&create(pod), &one_default_class(), now()),
        Decision::Patch(_)
    ));
}

#[test]
fn fractional_slots_are_denied() {
    let d = denial(mutate(
        &create(gpu_pod("500m")),
        &one_default_class(),
        now(),
    ));
    assert_eq!(
        d.to_string(),
        "container \"main\" requests gpupool/slot = \"500m\": GPU slots are whole numbers"
    );
}

#[test]
fn more_slots_than_the_largest_node_is_denied_with_both_numbers() {
    let view = StaticView {
        classes: vec![class("default", true)],
        nodes: vec![
            node("node-1", json!({}), json!({"gpupool/slot": "2"})),
            node("node-2", json!({}), json!({"gpupool/slot": "4"})),
        ],
        leases: vec![],
    };
    let d = denial(mutate(&create(gpu_pod("5")), &view, now()));
    assert_eq!(
        d.to_string(),
        "the pod requests 5 gpupool/slot slots but the largest node of GpuLeaseClass \"default\" has 4 (node-2)"
    );
    assert!(matches!(
        mutate(&create(gpu_pod("4")), &view, now()),
        Decision::Patch(_)
    ));
}

/// A device plugin that re-registers with more slots announces them on its
/// Node at once; the kubelet publishes them in allocatable seconds later.
/// A pod created in between is not refused: it is measured against what
/// the plugin announced. A malformed or foreign announcement changes nothing.
#[test]
fn slots_announced_but_not_yet_allocatable_count_toward_the_largest_node() {
    let announced = |value: &str, allocatable: serde_json::Value| -> Arc<Node> {
        Arc::new(
            serde_json::from_value(json!({
                "metadata": {"name": "node-1", "annotations": {"gpupool.io/slots": value}},
                "status": {"allocatable": allocatable},
            }))
            .expect("node json"),
        )
    };
    let view = |node: Arc<Node>| StaticView {
        classes: vec![class("default", true)],
        nodes: vec![node],
        leases: vec![],
    };
    let growing = view(announced("gpupool/slot=2", json!({"gpupool/slot": "1"})));
    assert!(matches!(
        mutate(&create(gpu_pod("2")), &growing, now()),
        Decision::Patch(_)
    ));
    // The first registration: allocatable does not list the resource yet.
    let first = view(announced("gpupool/slot=2", json!({})));
    assert!(matches!(
        mutate(&create(gpu_pod("2")), &first, now()),
        Decision::Patch(_)
    ));
    let d = denial(mutate(&create(gpu_pod("3")), &growing, now()));
    assert_eq!(
        d.to_string(),
        "the pod requests 3 gpupool/slot slots but the largest node of GpuLeaseClass \"default\" has 2 (node-1)"
    );
    for ignored in ["gpupool/slot=x", "other/slot=8"] {
        let view = view(announced(ignored, json!({"gpupool/slot": "1"})));
        let d = denial(mutate(&create(gpu_pod("2")), &view, now()));
        assert!(d.to_string().ends_with("has 1 (node-1)"), "{ignored}: {d}");
    }
}

#[test]
fn with_no_matching_node_the_pod_is_queued() {
    let view = StaticView {
        classes: vec![class_with("default", |s| {
            s.default = true;
            s.node_selector = Some(LabelSelector {
                match_labels: Some([("pool".to_owned(), "a100".to_owned())].into()),
                ..Default::default()
            });
        })],
        nodes: vec![
            node("other", json!({"pool": "t4"}), json!({"gpupool/slot": "1"})),
            node(
                "booting",
                json!({"pool": "a100"}),
                json!({"gpupool/slot": "0"}),
            ),
            node("cpu", json!({"pool": "a100"}), json!({"cpu": "8"})),
        ],
        leases: vec![],
    };
    assert!(matches!(
        mutate(&create(gpu_pod("8")), &view, now()),
        Decision::Patch(_)
    ));
}

#[test]
fn node_selector_confines_the_capacity_check() {
    let view = StaticView {
        classes: vec![class_with("default", |s| {
            s.default = true;
            s.node_selector = Some(LabelSelector {
                match_expressions: Some(vec![LabelSelectorRequirement {
                    key: "pool".into(),
                    operator: "In".into(),
                    values: Some(vec!["a100".into()]),
                }]),
                ..Default::default()
            });
        })],
        nodes: vec![
            node(
                "small",
                json!({"pool": "a100"}),
                json!({"gpupool/slot": "2"}),
            ),
            node("huge", json!({"pool": "t4"}), json!({"gpupool/slot": "16"})),
        ],
        leases: vec![],
    };
    let d = denial(mutate(&create(gpu_pod("3")), &view, now()));
    assert!(
        matches!(d, Denial::TooLarge { largest: 2, ref node, .. } if node == "small"),
        "{d:?}"
    );
}

#[test]
fn invalid_node_selector_is_denied_naming_the_operator() {
    let view = StaticView {
        classes: vec![class_with("default", |s| {
            s.default = true;
            s.node_selector = Some(LabelSelector {
                match_expressions: Some(vec![LabelSelectorRequirement {
                    key: "pool".into(),
                    operator: "Matches".into(),
                    values: None,
                }]),
                ..Default::default()
            });
        })],
        nodes: vec![node("n", json!({}), json!({"gpupool/slot": "1"}))],
        leases: vec![],
    };
    let d = denial(mutate(&create(gpu_pod("1")), &view, now()));
    assert_eq!(
        d.to_string(),
        "GpuLeaseClass \"default\" has an invalid nodeSelector: nodeSelector.matchExpressions[0] (key \"pool\") has operator \"Matches\"; expected In, NotIn, Exists or DoesNotExist"
    );
}

/// Drift found between the webhook and the engine: `Exists` with values made
/// the engine mark the class invalid while the webhook queued its pods. Both
/// now decide with the engine's selector compile.
#[test]
fn a_selector_the_engine_refuses_is_refused_by_the_webhook() {
    let view = StaticView {
        classes: vec![class_with("default", |s| {
            s.default = true;
            s.node_selector = Some(LabelSelector {
                match_expressions: Some(vec![LabelSelectorRequirement {
                    key: "pool".into(),
                    operator: "Exists".into(),
                    values: Some(vec!["a100".into()]),
                }]),
                ..Default::default()
            });
        })],
        nodes: vec![node(
            "n",
            json!({"pool": "x"}),
            json!({"gpupool/slot": "1"}),
        )],
        leases: vec![],
    };
    let d = denial(mutate(&create(gpu_pod("1")), &view, now()));
    assert!(matches!(d, Denial::InvalidNodeSelector { .. }), "{d}");
    assert!(
        d.to_string().contains("uses Exists but lists values"),
        "{d}"
    );
}

/// Drift found between the webhook and the engine: the webhook counted
/// cordoned and tainted nodes as "the largest node", the engine does not place
/// plain pods there. Both now ask `engine::largest_node`.
#[test]
fn cordoned_and_tainted_nodes_do_not_count_as_the_largest_node() {
    let mut cordoned = serde_json::to_value(
        node("big-cordoned", json!({}), json!({"gpupool/slot": "8"})).as_ref(),
    )
    .expect("json");
    cordoned["spec"] = json!({"unschedulable": true});
    let mut tainted =
        serde_json::to_value(node("big-tainted", json!({}), json!({"gpupool/slot": "8"})).as_ref())
            .expect("json");
    tainted["spec"] =
        json!({"taints": [{"key": "gpu", "value": "reserved", "effect": "NoSchedule"}]});
    let view = StaticView {
        classes: vec![class("default", true)],
        nodes: vec![
            Arc::new(serde_json::from_value(cordoned).expect("node")),
            Arc::new(serde_json::from_value(tainted).expect("node")),
            node("small", json!({}), json!({"gpupool/slot": "2"})),
        ],
        leases: vec![],
    };
    let d = denial(mutate(&create(gpu_pod("4")), &view, now()));
    assert!(
        matches!(d, Denial::TooLarge { largest: 2, ref node, .. } if node == "small"),
        "{d}"
    );
    // A pod that tolerates the taint may use the tainted node: the engine
    // would place it there, so the webhook queues it.
    let mut tolerant = gpu_pod("4");
    tolerant["spec"]["tolerations"] = json!([{"key": "gpu", "operator": "Exists"}]);
    assert!(matches!(
        mutate(&create(tolerant), &view, now()),
        Decision::Patch(_)
    ));
}

#[test]
fn full_queue_is_denied_with_the_count() {
    let mut view = one_default_class();
    view.classes = vec![class_with("default", |s| {
        s.default = true;
        s.admission.max_queued = 2;
    })];
    view.leases = vec![
        lease("a", "default", Some(LeasePhase::Queued)),
        lease("b", "default", Some(LeasePhase::Admitted)),
        lease("c", "other", Some(LeasePhase::Queued)),
    ];
    // One waits (the admitted lease and the other class's do not count).
    assert!(matches!(
        mutate(&create(gpu_pod("1")), &view, now()),
        Decision::Patch(_)
    ));
    // A lease without status has just been created and waits too.
    view.leases.push(lease("d", "default", None));
    let d = denial(mutate(&create(gpu_pod("1")), &view, now()));
    assert_eq!(
        d.to_string(),
        "GpuLeaseClass \"default\" already has 2 queued primaries (admission.maxQueued is 2, counted for primaries and helpers apart); try again once the queue shrinks"
    );
}

#[test]
fn queued_helpers_never_lock_primaries_out() {
    let mut view = one_default_class();
    view.classes = vec![class_with("default", |s| {
        s.default = true;
        s.admission.max_queued = 1;
    })];
    let mut queued_helper = lease("h", "default", Some(LeasePhase::Queued));
    Arc::make_mut(&mut queued_helper).spec.role = Role::Helper;
    view.leases = vec![queued_helper];
    assert!(matches!(
        mutate(&create(gpu_pod("1")), &view, now()),
        Decision::Patch(_)
    ));
    let helper = with_labels(gpu_pod("1"), json!({"gpupool.io/role": "helper"}));
    let d = denial(mutate(&create(helper), &view, now()));
    assert_eq!(
        d.to_string(),
        "GpuLeaseClass \"default\" already has 1 queued helper (admission.maxQueued is 1, counted for primaries and helpers apart); try again once the queue shrinks"
    );
}

#[test]
fn zero_max_queued_is_unbounded() {
    let mut view = one_default_class();
    view.leases = (0..50)
        .map(|i| lease(&format!("l{i}"), "default", Some(LeasePhase::Queued)))
        .collect();
    assert!(matches!(
        mutate(&create(gpu_pod("1")), &view, now()),
        Decision::Patch(_)
    ));
}

#[test]
fn resource_of_another_class_is_denied() {
    let view = StaticView {
        classes: vec![
            class("default", true),
            class_with("big", |s| s.resource_name = "gpupool/big".into()),
        ],
        ..Default::default()
    };
    let pod = json!({
        "metadata": {"name": "mixed"},
        "spec": {"containers": [{"name": "c", "resources": {"limits": {"gpupool/big": "1"}}}]}
    });
    let d = denial(mutate(&create(pod), &view, now()));
    assert_eq!(
        d.to_string(),
        "the pod requests gpupool/big, which its GpuLeaseClass \"default\" does not hand out (the class hands out gpupool/slot)"
    );
}

#[test]
fn zero_slots_pass_untouched() {
    assert_eq!(
        mutate(&create(gpu_pod("0")), &one_default_class(), now()),
        Decision::Allow
    );
}

#[test]
fn mutation_ignores_other_operations_and_needs_an_object() {
    let update = request("UPDATE", "alice", Some(gpu_pod("1")), Some(gpu_pod("1")));
    assert_eq!(mutate(&update, &UntouchableView, now()), Decision::Allow);
    let empty = request("CREATE", "alice", None, None);
    let d = denial(mutate(&empty, &UntouchableView, now()));
    assert_eq!(
        d.to_string(),
        "the CREATE admission request carries no object"
    );
}

fn gated(pod: serde_json::Value) -> serde_json::Value {
    let mut pod = pod;
    pod["spec"]["schedulingGates"] = json!([{"name": "gpupool.io/admission"}]);
    pod
}

fn owners() -> Users {
    Users::new([
        Users::service_account("gpupool-system", "gpupool-operator"),
        "gpupool-operator".to_owned(),
    ])
}

fn identities() -> Identities {
    Identities {
        operator: owners(),
        device_plugins: Users::new([Users::service_account(
            "gpupool-system",
            "gpupool-device-plugin",
        )]),
    }
}

#[test]
fn gate_removal_by_a_user_is_denied_naming_user_and_owners() {
    let req = request(
        "UPDATE",
        "alice",
        Some(gpu_pod("1")),
        Some(gated(gpu_pod("1"))),
    );
    let d = denial(validate(&req, &owners()));
    assert_eq!(
        d.to_string(),
        "only the gpupool operator (\"gpupool-operator\", \"system:serviceaccount:gpupool-system:gpupool-operator\") may remove the scheduling gate gpupool.io/admission; user \"alice\" may not"
    );
}

#[test]
fn gate_removal_by_the_operator_is_allowed() {
    for user in owners().users() {
        let req = request(
            "UPDATE",
            user,
            Some(gpu_pod("1")),
            Some(gated(gpu_pod("1"))),
        );
        assert_eq!(validate(&req, &owners()), Decision::Allow, "{user}");
    }
}

#[test]
fn other_updates_are_allowed() {
    let keeps = request(
        "UPDATE",
        "alice",
        Some(gated(gpu_pod("1"))),
        Some(gated(gpu_pod("1"))),
    );
    assert_eq!(validate(&keeps, &owners()), Decision::Allow);
    let never_gated = request("UPDATE", "alice", Some(gpu_pod("1")), Some(gpu_pod("1")));
    assert_eq!(validate(&never_gated, &owners()), Decision::Allow);
    let create = request("CREATE", "alice", Some(gpu_pod("1")), None);
    assert_eq!(validate(&create, &owners()), Decision::Allow);
}

#[test]
fn update_without_old_object_is_denied() {
    let req = request("UPDATE", "alice", Some(gpu_pod("1")), None);
    let d = denial(validate(&req, &owners()));
    assert_eq!(
        d.to_string(),
        "the UPDATE admission request carries no object"
    );
}

#[test]
fn gate_owners_drop_empty_and_duplicate_names() {
    let o = Users::new([
        "b".to_owned(),
        String::new(),
        "a".to_owned(),
        "b".to_owned(),
    ]);
    assert_eq!(o.users(), ["a".to_owned(), "b".to_owned()]);
    assert!(!o.contains(""));
    assert_eq!(
        Users::service_account("ns", "sa"),
        "system:serviceaccount:ns:sa"
    );
}

fn response_json(decision: Decision, req: &AdmissionRequest<Pod>) -> serde_json::Value {
    let body = response_body(decision.into_response(req)).expect("response serializes");
    serde_json::from_slice(&body).expect("response is JSON")
}

#[test]
fn denial_response_carries_403_and_the_message() {
    let req = create(gpu_pod("500m"));
    let decision = mutate(&req, &one_default_class(), now());
    let message = denial(decision.clone()).to_string();
    let response = response_json(decision, &req);
    assert_eq!(response["apiVersion"], json!("admission.k8s.io/v1"));
    assert_eq!(response["kind"], json!("AdmissionReview"));
    let r = &response["response"];
    assert_eq!(r["uid"], json!("7d8f0d1e-0000-4000-8000-000000000001"));
    assert_eq!(r["allowed"], json!(false));
    assert_eq!(r["status"]["code"], json!(403));
    assert_eq!(r["status"]["message"], json!(message));
    assert!(r.get("patch").is_none());
}

#[test]
fn patch_response_is_a_base64_json_patch() {
    let req = create(gpu_pod("1"));
    let decision = mutate(&req, &one_default_class(), now());
    let Decision::Patch(patch) = decision.clone() else {
        panic!("expected a patch");
    };
    let response = response_json(decision, &req);
    let r = &response["response"];
    assert_eq!(r["allowed"], json!(true));
    assert_eq!(r["patchType"], json!("JSONPatch"));
    let decoded: ByteString =
        serde_json::from_value(r["patch"].clone()).expect("patch is a base64 string");
    let sent: Patch = serde_json::from_slice(&decoded.0).expect("patch is a JSON patch");
    assert_eq!(sent, patch);
}

#[test]
fn allow_response_has_no_patch() {
    let req = create(gpu_pod("0"));
    let response = response_json(Decision::Allow, &req);
    assert_eq!(response["response"]["allowed"], json!(true));
    assert!(response["response"].get("patch").is_none());
    assert!(response["response"].get("patchType").is_none());
}

#[test]
fn outcome_labels() {
    assert_eq!(Decision::Allow.outcome(), "allowed");
    assert_eq!(Decision::Patch(Patch(vec![])).outcome(), "patched");
    assert_eq!(
        Decision::Deny(Denial::MissingObject {
            operation: "CREATE".into()
        })
        .outcome(),
        "denied"
    );
}

fn review_json(req: &AdmissionRequest<Pod>) -> Vec<u8> {
    let review = json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": req,
    });
    serde_json::to_vec(&review).expect("serializes")
}

#[test]
fn review_body_answers_both_webhooks() {
    let body = review_json(&create(gpu_pod("1")));
    let (out, outcome) = review_body(
        WebhookKind::Mutate,
        &body,
        &one_default_class(),
        &identities(),
        now(),
    )
    .expect("answers");
    assert_eq!(outcome, "patched");
    let out: serde_json::Value = serde_json::from_slice(&out).expect("json");
    assert_eq!(out["response"]["patchType"], json!("JSONPatch"));

    let body = review_json(&request(
        "UPDATE",
        "mallory",
        Some(gpu_pod("1")),
        Some(gated(gpu_pod("1"))),
    ));
    let (out, outcome) = review_body(
        WebhookKind::Validate,
        &body,
        &UntouchableView,
        &identities(),
        now(),
    )
    .expect("answers");
    assert_eq!(outcome, "denied");
    let out: serde_json::Value = serde_json::from_slice(&out).expect("json");
    assert!(
        out["response"]["status"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("mallory"))
    );
}

#[test]
fn review_body_rejects_malformed_input() {
    let err = review_body(
        WebhookKind::Mutate,
        b"{not json",
        &UntouchableView,
        &identities(),
        now(),
    )
    .expect_err("malformed");
    assert!(
        err.to_string().starts_with("malformed AdmissionReview: "),
        "{err}"
    );

    let no_request = br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview"}"#;
    let err = review_body(
        WebhookKind::Mutate,
        no_request,
        &UntouchableView,
        &identities(),
        now(),
    )
    .expect_err("no request");
    assert_eq!(
        err.to_string(),
        "malformed AdmissionReview: it carries no request"
    );

    let mut review: serde_json::Value =
        serde_json::from_slice(&review_json(&create(gpu_pod("1")))).expect("json");
    review["request"]["kind"] = json!({"group": "apps", "version": "v1", "kind": "Deployment"});
    let body = serde_json::to_vec(&review).expect("serializes");
    let err = review_body(
        WebhookKind::Mutate,
        &body,
        &UntouchableView,
        &identities(),
        now(),
    )
    .expect_err("not a pod");
    assert_eq!(
        err.to_string(),
        "this webhook reviews Pod (core), not apps/v1 Deployment"
    );
}

/// The webhook's `maxQueued` count read from the lease cache's tally is
/// the count the same rule gives over the leases themselves.
#[test]
fn the_queued_count_is_the_tally_of_the_lease_cache() {
    let (leases, mut writer) = store::tallied_index(queue_tally_key);
    let caches = Caches::of_stores(
        store::index().0,
        store::index().0,
        store::index().0,
        leases.clone(),
    );
    let events = [
        role_lease("a", "fast", Role::Primary, None),
        role_lease("b", "fast", Role::Primary, Some(LeasePhase::Queued)),
        role_lease("c", "fast", Role::Helper, Some(LeasePhase::Queued)),
        role_lease("d", "slow", Role::Primary, Some(LeasePhase::Queued)),
        role_lease("a", "fast", Role::Primary, Some(LeasePhase::Queued)),
        role_lease("b", "fast", Role::Primary, Some(LeasePhase::Admitted)),
        role_lease("e", "fast", Role::Primary, Some(LeasePhase::Released)),
    ];
    for (n, event) in events.iter().enumerate() {
        writer.apply(&watcher::Event::Apply((**event).clone()));
        let all: Vec<Arc<CachedLease>> = leases.state();
        let view = StaticView {
            leases: all,
            ..StaticView::default()
        };
        for (class, role) in [
            ("fast", Role::Primary),
            ("fast", Role::Helper),
            ("slow", Role::Primary),
            ("slow", Role::Helper),
        ] {
            assert_eq!(
                caches.queued(class, role),
                view.queued(class, role),
                "{class} {role} after event {n}"
            );
        }
    }
    assert_eq!(
        (
            caches.queued("fast", Role::Primary),
            caches.queued("fast", Role::Helper)
        ),
        (1, 1)
    );
    let gone = role_lease("a", "fast", Role::Primary, None);
    writer.apply(&watcher::Event::Delete((*gone).clone()));
    assert_eq!(caches.queued("fast", Role::Primary), 0);
}

fn asking(resource: &str) -> serde_json::Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "train", "namespace": "ml"},
        "spec": {"containers": [{
            "name": "main", "image": "trainer",
            "resources": {"limits": {resource: "1"}}
        }]}
    })
}

/// `gpupool/slots` is no class's resource: the pod would get no lease and
/// stay Pending with nothing said. It is let through (it is not gpupool's
/// to refuse) with a warning that names what it asked for and what the
/// classes hand out.
#[test]
fn a_near_miss_of_a_class_resource_is_let_through_with_a_warning() {
    let view = StaticView {
        classes: vec![class("default", true)],
        nodes: vec![node("node-1", json!({}), json!({"gpupool/slot": "2"}))],
        leases: vec![],
    };
    let request = create(asking("gpupool/slots"));
    let decision = mutate(&request, &view, now());
    let Decision::Warn(warning) = &decision else {
        panic!("expected a warning, got {decision:?}");
    };
    assert!(
        warning.contains("requests gpupool/slots")
            && warning.contains("hand out gpupool/slot")
            && warning.contains("did you mean gpupool/slot?"),
        "{warning}"
    );
    assert_eq!(decision.outcome(), "allowed");
    let response = decision.clone().into_response(&request);
    assert!(response.allowed);
    assert_eq!(response.warnings, Some(vec![warning.clone()]));
    // Another vendor's resource is none of gpupool's business.
    assert!(matches!(
        mutate(&create(asking("nvidia.com/gpu")), &view, now()),
        Decision::Allow
    ));
}

/// With the class label set the pod plainly wants gpupool: the near miss is
/// refused, naming the resource asked for and the class's.
#[test]
fn a_near_miss_with_the_class_label_is_denied_naming_both_resources() {
    let view = StaticView {
        classes: vec![class("default", true)],
        nodes: vec![],
        leases: vec![],
    };
    let pod = with_labels(
        asking("gpupool/slots"),
        json!({"gpupool.io/class": "default"}),
    );
    let d = denial(mutate(&create(pod), &view, now()));
    assert_eq!(
        d.to_string(),
        "the pod requests gpupool/slots, which no GpuLeaseClass hands out (did you mean gpupool/slot?), and names GpuLeaseClass \"default\" (label gpupool.io/class), which hands out gpupool/slot"
    );
    let pod = with_labels(asking("gpupool/slots"), json!({"gpupool.io/class": "nope"}));
    let d = denial(mutate(&create(pod), &view, now()));
    assert!(
        d.to_string().ends_with(
            "names GpuLeaseClass \"nope\" (label gpupool.io/class), which does not exist"
        ),
        "{d}"
    );
}
