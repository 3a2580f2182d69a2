//! The plugin and the operator asked about the same cluster: the engine
//! decides a pass over the objects (translated as the operator translates
//! them), and `why` and `top` describe the same objects. They must agree on
//! the free slots of every node, on the class's nodes, and on which of them
//! a pod may use.

#![allow(clippy::unwrap_used)]

use gpupool_api::{GpuLease, GpuLeaseClass};
use gpupool_engine::{ObjectKey, decide};
use jiff::Timestamp;
use k8s_openapi::api::core::v1::{Node, Pod};
use kubectl_gpupool::style::Style;
use kubectl_gpupool::{rules, top, why};
use serde_json::{Value, json};

fn now() -> Timestamp {
    Timestamp::from_second(1_800_000_000).unwrap()
}

fn at(secs_ago: i64) -> String {
    (now() - jiff::SignedDuration::from_secs(secs_ago)).to_string()
}

fn class(name: &str, default: bool, ordering: &str, selector: Value) -> GpuLeaseClass {
    serde_json::from_value(json!({
        "apiVersion": "gpupool.io/v1alpha1", "kind": "GpuLeaseClass",
        "metadata": {"name": name, "generation": 1, "creationTimestamp": at(3600)},
        "spec": {"default": default, "resourceName": "gpupool/slot",
                 "nodeSelector": selector, "admission": {"ordering": ordering}}
    }))
    .unwrap()
}

fn node(name: &str, slots: u32, labels: Value, spec: Value) -> Node {
    let mut labels = labels;
    labels["kubernetes.io/hostname"] = json!(name);
    serde_json::from_value(json!({
        "metadata": {"name": name, "labels": labels},
        "spec": spec,
        "status": {"allocatable": {"gpupool/slot": slots.to_string(), "cpu": "64"}}
    }))
    .unwrap()
}

/// A pod asking for `slots`; `extra` is merged into its spec.
fn pod(ns: &str, name: &str, class: Option<&str>, slots: u32, gated: bool, extra: Value) -> Pod {
    let mut spec = json!({
        "containers": [{"name": "work", "image": "x",
            "resources": {"limits": {"gpupool/slot": slots.to_string()}}}]
    });
    if gated {
        spec["schedulingGates"] = json!([{"name": "gpupool.io/admission"}]);
    }
    if let (Value::Object(spec), Value::Object(extra)) = (&mut spec, extra) {
        spec.extend(extra);
    }
    let labels = match class {
        Some(c) => json!({"gpupool.io/class": c}),
        None => json!({}),
    };
    serde_json::from_value(json!({
        "metadata": {"namespace": ns, "name": name, "uid": format!("uid-{name}"),
            "creationTimestamp": at(600), "labels": labels,
            "annotations": {"gpupool.io/enqueued-at": at(600)}},
        "spec": spec,
        "status": {"phase": if gated { "Pending" } else { "Running" }}
    }))
    .unwrap()
}

fn lease(name: &str, class: &str, slots: u32, seq: u64, status: Value) -> GpuLease {
    let mut status = status;
    status["sequence"] = json!(seq);
    status["queuedAt"] = json!(at(600));
    serde_json::from_value(json!({
        "apiVersion": "gpupool.io/v1alpha1", "kind": "GpuLease",
        "metadata": {"namespace": "ml", "name": name, "creationTimestamp": at(600)},
        "spec": {"className": class, "podName": name, "podUID": format!("uid-{name}"),
                 "role": "primary", "slots": slots},
        "status": status
    }))
    .unwrap()
}

struct Cluster {
    classes: Vec<GpuLeaseClass>,
    nodes: Vec<Node>,
    pods: Vec<Pod>,
    leases: Vec<GpuLease>,
}

/// Class `default` (StrictFIFO, every node) and class `large`
/// (BestEffortFIFO, nodes labelled pool=large). node-1 is full with
/// ml/train-a; on node-2 a pod of another team, which asks for a slot but
/// has no lease, holds one of its two; node-3 is cordoned; node-4 is in
/// pool large and tainted. ml/train-b (2 slots) waits at the head of
/// `default`; in `large`, ml/wide (2 slots, no toleration) cannot fit and
/// ml/tolerant (1 slot, tolerates the taint) can.
fn cluster() -> Cluster {
    let queued = json!({"phase": "Queued", "position": 1});
    Cluster {
        classes: vec![
            class("default", true, "StrictFIFO", json!(null)),
            class(
                "large",
                false,
                "BestEffortFIFO",
                json!({"matchLabels": {"pool": "large"}}),
            ),
        ],
        nodes: vec![
            node("node-1", 2, json!({}), json!({})),
            node("node-2", 2, json!({"pool": "large"}), json!({})),
            node("node-3", 2, json!({}), json!({"unschedulable": true})),
            node(
                "node-4",
                2,
                json!({"pool": "large"}),
                json!({"taints": [{"key": "gpu", "value": "reserved", "effect": "NoSchedule"}]}),
            ),
        ],
        pods: vec![
            pod(
                "ml",
                "train-a",
                None,
                2,
                false,
                json!({"nodeName": "node-1", "nodeSelector": {"kubernetes.io/hostname": "node-1"}}),
            ),
            pod(
                "infra",
                "exporter",
                None,
                1,
                false,
                json!({"nodeName": "node-2"}),
            ),
            pod("ml", "train-b", None, 2, true, json!({})),
            pod("ml", "wide", Some("large"), 2, true, json!({})),
            pod(
                "ml",
                "tolerant",
                Some("large"),
                1,
                true,
                json!({"tolerations": [{"key": "gpu", "operator": "Equal", "value": "reserved", "effect": "NoSchedule"}]}),
            ),
        ],
        leases: vec![
            lease(
                "train-a",
                "default",
                2,
                1,
                json!({"phase": "Bound", "node": "node-1", "admittedAt": at(500), "boundAt": at(490)}),
            ),
            lease("train-b", "default", 2, 2, queued.clone()),
            lease("wide", "large", 2, 3, queued.clone()),
            lease("tolerant", "large", 1, 4, queued),
        ],
    }
}

fn explain(c: &Cluster, name: &str) -> String {
    let p = c
        .pods
        .iter()
        .find(|p| p.metadata.name.as_deref() == Some(name))
        .unwrap();
    let l = c
        .leases
        .iter()
        .find(|l| l.metadata.name.as_deref() == Some(name));
    why::explain(
        why::WhyInput {
            pod: p,
            lease: l,
            classes: &c.classes,
            classes_visible: true,
            leases: &c.leases,
            all_visible: true,
            nodes: Some(&c.nodes),
            pods: &c.pods,
            all_pods_visible: true,
            now: now(),
            unseen: &[],
        },
        Style::PLAIN,
    )
    .unwrap()
}

/// `(node, free)` pairs of why's "Of the class's N nodes (a 1 free, …)".
fn why_free(text: &str) -> Vec<(String, u64)> {
    let start = text.find("Of the class's").unwrap();
    let list = &text[text[start..].find('(').unwrap() + start + 1..];
    let list = &list[..list.find(')').unwrap()];
    list.split(", ")
        .map(|part| {
            let mut words = part.split(' ');
            let node = words.next().unwrap().to_owned();
            (node, words.next().unwrap().parse().unwrap())
        })
        .collect()
}

/// The number before `what` in the engine's message.
fn number_before(message: &str, what: &str) -> u64 {
    let end = message
        .find(what)
        .unwrap_or_else(|| panic!("no {what:?} in {message:?}"));
    message[..end]
        .split_whitespace()
        .last()
        .unwrap()
        .parse()
        .unwrap()
}

#[test]
fn why_and_top_agree_with_the_engine_on_the_same_objects() {
    let c = cluster();
    let snapshot = rules::snapshot(&c.classes, &c.nodes, &c.pods, &c.leases, now());
    let plan = decide(&snapshot);
    let view = top::build_visible(
        Some(&c.classes),
        Some(&c.nodes),
        &c.pods,
        true,
        &c.leases,
        None,
    );
    let top_free = |node: &str| {
        view.nodes
            .iter()
            .find(|n| n.name == node)
            .map(|n| n.free)
            .unwrap()
    };
    // The other team's pod holds its slot on node-2, lease or not.
    assert_eq!(
        ["node-1", "node-2", "node-3", "node-4"].map(top_free),
        [0, 1, 2, 2]
    );

    // train-b waits for lack of room: the engine's free count over the
    // class's nodes is the sum of what `why` and `top` show per node.
    assert!(
        plan.admissions
            .iter()
            .all(|a| a.key.name.as_ref() != "train-b"),
        "{:?}",
        plan.admissions
    );
    let message = plan
        .lease_status(&ObjectKey::new("ml", "train-b"))
        .and_then(|s| s.message.clone())
        .unwrap();
    assert!(message.contains("needs 2 slots on one node"), "{message}");
    let text = explain(&c, "train-b");
    let per_node = why_free(&text);
    assert_eq!(
        per_node,
        [("node-1", 0), ("node-2", 1), ("node-3", 2), ("node-4", 2)]
            .map(|(n, f)| (n.to_owned(), f)),
        "{text}"
    );
    for (node, free) in &per_node {
        assert_eq!(top_free(node), *free, "{node}");
    }
    let total: u64 = per_node.iter().map(|(_, f)| f).sum();
    assert_eq!(number_before(&message, "free slots"), total, "{message}");
    assert!(text.contains("none has room for 2 slots"), "{text}");
    // Both name the nodes that turn it away.
    assert!(
        message.contains("1 node cordoned, 1 node tainted gpu=reserved:NoSchedule"),
        "{message}"
    );
    assert!(
        text.contains("node-3 and node-4 are cordoned or have a taint it does not tolerate."),
        "{text}"
    );
    // The class status the engine writes counts the same, less what this
    // pass admits (every node is `default`'s).
    let admitted: u64 = plan.admissions.iter().map(|a| u64::from(a.slots)).sum();
    assert_eq!(
        plan.class_statuses
            .get("default")
            .map(|s| u64::from(s.free)),
        Some(total - admitted)
    );

    // Class `large`: the engine's class nodes are why's.
    let text = explain(&c, "wide");
    let per_node = why_free(&text);
    assert_eq!(
        per_node,
        [("node-2", 1), ("node-4", 2)].map(|(n, f)| (n.to_owned(), f)),
        "{text}"
    );
    // wide tolerates nothing: node-4 turns it away, and node-2 is too small.
    assert!(
        text.contains("node-4 is cordoned or has a taint it does not tolerate."),
        "{text}"
    );
    assert!(
        plan.admissions
            .iter()
            .all(|a| a.key.name.as_ref() != "wide"),
        "{:?}",
        plan.admissions
    );
    let message = plan
        .lease_status(&ObjectKey::new("ml", "wide"))
        .and_then(|s| s.message.clone())
        .unwrap();
    assert_eq!(number_before(&message, "free slots"), 3, "{message}");
    assert!(message.contains("1 node tainted"), "{message}");

    // tolerant may use both nodes of its class, and the engine admits it
    // to one of them.
    let text = explain(&c, "tolerant");
    assert!(text.contains("2 have room for 1 slot."), "{text}");
    assert!(!text.contains("does not tolerate"), "{text}");
    let admitted = plan
        .admissions
        .iter()
        .find(|a| a.key.name.as_ref() == "tolerant")
        .map(|a| a.node.as_str());
    assert!(
        matches!(admitted, Some("node-2" | "node-4")),
        "{:?}",
        plan.admissions
    );
}

/// The plugin counts with the engine's rule, not with leases alone: a
/// pod bound to a node without a lease holds slots there, a pod being
/// deleted before it was bound holds none, and a lease whose pod is gone
/// holds none either.
#[test]
fn free_slots_count_every_pod_bound_there_and_no_stale_lease() {
    let mut c = cluster();
    // train-a is gone: its lease is left, but holds nothing.
    c.pods
        .retain(|p| p.metadata.name.as_deref() != Some("train-a"));
    // A pod pinned to node-3 but being deleted before it was bound.
    let mut leaving = pod(
        "ml",
        "leaving",
        None,
        2,
        false,
        json!({"nodeSelector": {"kubernetes.io/hostname": "node-3"}}),
    );
    leaving.metadata.deletion_timestamp =
        Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(now()));
    c.pods.push(leaving);
    let view = top::build_visible(
        Some(&c.classes),
        Some(&c.nodes),
        &c.pods,
        true,
        &c.leases,
        None,
    );
    let free: Vec<u64> = view.nodes.iter().map(|n| n.free).collect();
    assert_eq!(free, [2, 1, 2, 2]);
    // Without every pod, the lease counts as its status says.
    let view = top::build_visible(
        Some(&c.classes),
        Some(&c.nodes),
        &[],
        false,
        &c.leases,
        None,
    );
    let free: Vec<u64> = view.nodes.iter().map(|n| n.free).collect();
    assert_eq!(free, [0, 2, 2, 2]);
}
