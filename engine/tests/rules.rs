//! One scenario per admission rule of DESIGN §5, driven through the public
//! `decide` function with plans applied the way the controller applies them.

use std::collections::BTreeMap;

use gpupool_api::class::{CONDITION_INVALID, CONDITION_READY};
use gpupool_api::names::LABEL_HOSTNAME;
use gpupool_api::{
    GpuLeaseSpec, GpuLeaseStatus, LeaseGpu, LeasePhase, Ordering, Placement, Preemption, Role,
};
use gpupool_engine::{
    CLASS_STATUS_PERIOD, EVICTION_RETRY, Engine, Eviction, LeaseInfo, NodeInfo,
    NodeSelectorRequirement, NodeSelectorTerm, ObjectKey, Plan, PodInfo, PodPhase, Refusals,
    RoleLabel, SelectorOperator, Snapshot, Taint, TaintEffect, Toleration, TolerationOperator,
    decide,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{
    Condition, LabelSelector, LabelSelectorRequirement, Time,
};

use gpupool_engine::fixtures::{RESOURCE as RES, at, class, helper, key, node, pod};

/// Applies a plan as the controller does: creates leases with their status,
/// deletes stale ones, writes statuses, ungates and pins admitted pods (the
/// scheduler then binds them and they run), marks evicted pods terminating.
fn apply(s: &mut Snapshot, plan: &Plan) {
    s.leases.retain(|l| {
        !plan
            .delete_leases
            .iter()
            .any(|d| d.key == l.key && d.pod_uid == l.spec().pod_uid)
    });
    for n in &plan.create_leases {
        s.leases.push(LeaseInfo::from_parts(
            n.key.clone(),
            n.spec.clone(),
            Some(n.status.clone()),
        ));
    }
    for l in &mut s.leases {
        if let Some(spec) = plan.lease_specs.get(&l.key) {
            *l.spec_mut() = spec.clone();
        }
        if let Some(st) = plan.lease_status(&l.key) {
            *l.status_mut() = Some(st.clone());
        }
    }
    for a in &plan.admissions {
        let p = s
            .pods
            .iter_mut()
            .find(|p| p.key == a.key && p.uid == a.pod_uid)
            .expect("admitted pod exists");
        p.gated = false;
        p.node_selector
            .insert(LABEL_HOSTNAME.into(), a.node.clone());
        p.node_name = Some(a.node.clone());
        p.phase = PodPhase::Running;
    }
    for e in &plan.evictions {
        if let Some(p) = s.pods.iter_mut().find(|p| p.key == e.key) {
            p.terminating = true;
        }
    }
    for (name, st) in &plan.class_statuses {
        if let Some(c) = s.classes.iter_mut().find(|c| &c.name == name) {
            c.status = Some(st.clone());
        }
    }
}

/// Runs passes until one changes nothing (bounded); returns the last plan.
fn settle(s: &mut Snapshot) -> Plan {
    for _ in 0..20 {
        let plan = decide(s);
        apply(s, &plan);
        if plan.create_leases.is_empty()
            && plan.delete_leases.is_empty()
            && plan.admissions.is_empty()
            && plan.evictions.is_empty()
            && plan.lease_statuses.is_empty()
            && plan.lease_progress.is_empty()
            && plan.lease_specs.is_empty()
        {
            return plan;
        }
    }
    panic!("the engine did not settle in 20 passes");
}

fn lease<'a>(s: &'a Snapshot, name: &str) -> &'a GpuLeaseStatus {
    s.leases
        .iter()
        .find(|l| l.key == key(name))
        .and_then(|l| l.status())
        .unwrap_or_else(|| panic!("lease team/{name} with a status"))
}

fn phase(s: &Snapshot, name: &str) -> LeasePhase {
    lease(s, name).phase
}

fn message(s: &Snapshot, name: &str) -> String {
    lease(s, name).message.clone().unwrap_or_default()
}

fn world(nodes: Vec<NodeInfo>, pods: Vec<PodInfo>) -> Snapshot {
    Snapshot {
        now: at(1000),
        classes: vec![class("default")],
        nodes,
        pods,
        leases: vec![],
        blocked_evictions: Default::default(),
        progress_limit: None,
    }
}

fn finish(s: &mut Snapshot, name: &str) {
    s.pods.retain(|p| p.key != key(name));
}

#[test]
fn every_managed_pod_gets_one_lease_named_like_it_and_unmanaged_pods_none() {
    let mut other = pod("cpu-only", 0, 1);
    other.requests = [("cpu".to_owned(), 2)].into();
    let mut s = world(vec![node("n1", 2)], vec![pod("p1", 1, 1), other]);
    let plan = decide(&s);
    assert_eq!(plan.create_leases.len(), 1);
    let new = &plan.create_leases[0];
    assert_eq!(new.key, key("p1"));
    assert_eq!(new.spec.pod_name, "p1");
    assert_eq!(new.spec.pod_uid, "uid-p1");
    assert_eq!(new.spec.class_name, "default");
    assert_eq!(new.spec.slots, 1);
    assert_eq!(new.status.phase, LeasePhase::Queued);
    assert_eq!(new.status.sequence, Some(micros(1)), "its stamp");
    assert!(
        plan.admissions.is_empty(),
        "not admitted before the sequence is persisted"
    );
    apply(&mut s, &plan);
    let plan = decide(&s);
    assert!(plan.create_leases.is_empty(), "no second lease");
    assert_eq!(plan.admissions.len(), 1);
    assert_eq!(plan.admissions[0].node, "n1");
}

/// A sequence as DESIGN §5.2 starts it: the stamp at `at(sec)`, in
/// microseconds since the Unix epoch.
fn micros(sec: i64) -> u64 {
    u64::try_from(at(sec).as_microsecond()).expect("after the epoch")
}

#[test]
fn sequences_follow_enqueue_stamp_then_creation_then_name_in_free_numbers() {
    let mut s = world(vec![node("n1", 0)], vec![]);
    // A Released lease still carries the number "first"'s stamp gives.
    s.leases.push(LeaseInfo::from_parts(
        ObjectKey::new("old", "gone"),
        GpuLeaseSpec {
            class_name: "default".into(),
            pod_name: "gone".into(),
            pod_uid: "x".into(),
            role: Role::Primary,
            slots: 1,
        },
        Some(GpuLeaseStatus {
            phase: LeasePhase::Released,
            sequence: Some(micros(0)),
            ..GpuLeaseStatus::default()
        }),
    ));
    let mut no_stamp = pod("c-no-stamp", 1, 5);
    no_stamp.enqueued_at = None;
    no_stamp.created_at = at(2);
    let mut same_stamp_older = pod("z-same", 1, 3);
    same_stamp_older.created_at = at(1);
    s.pods = vec![
        pod("b", 1, 3),
        pod("a", 1, 3),
        no_stamp,
        same_stamp_older,
        pod("first", 1, 0),
    ];
    let plan = decide(&s);
    let seq: BTreeMap<String, u64> = plan
        .create_leases
        .iter()
        .map(|n| (n.key.name.to_string(), n.status.sequence.expect("sequence")))
        .collect();
    assert_eq!(seq["first"], micros(0) + 1, "the next number no lease has");
    assert_eq!(seq["c-no-stamp"], micros(2), "no stamp: creationTimestamp");
    assert_eq!(seq["z-same"], micros(3), "same stamp: older creation first");
    assert_eq!(seq["a"], micros(3) + 1, "then by name");
    assert_eq!(seq["b"], micros(3) + 2);
    apply(&mut s, &plan);
    s.now = at(5000);
    let again = settle(&mut s);
    assert!(again.create_leases.is_empty());
    for (name, want) in seq {
        assert_eq!(
            lease(&s, &name).sequence,
            Some(want),
            "{name} kept its sequence"
        );
    }
}

#[test]
fn strict_fifo_head_that_does_not_fit_blocks_everyone_behind_it() {
    let mut s = world(
        vec![node("n1", 2)],
        vec![pod("p1", 1, 1), pod("p2", 2, 2), pod("p3", 1, 3)],
    );
    settle(&mut s);
    assert_eq!(phase(&s, "p1"), LeasePhase::Admitted);
    assert_eq!(phase(&s, "p2"), LeasePhase::Queued);
    assert_eq!(
        phase(&s, "p3"),
        LeasePhase::Queued,
        "p3 would fit but must wait"
    );
    assert_eq!(lease(&s, "p2").position, Some(1));
    assert_eq!(lease(&s, "p3").position, Some(2));
    assert_eq!(
        message(&s, "p3"),
        "waiting: 1 primary ahead (head team/p2 needs 2 slots), 1 free slot on 1 matching node"
    );
    finish(&mut s, "p1");
    settle(&mut s);
    assert_eq!(phase(&s, "p1"), LeasePhase::Released);
    assert_eq!(phase(&s, "p2"), LeasePhase::Admitted);
    assert_eq!(phase(&s, "p3"), LeasePhase::Queued);
}

#[test]
fn best_effort_fifo_lets_later_primaries_that_fit_pass() {
    let mut s = world(
        vec![node("n1", 2)],
        vec![pod("p1", 1, 1), pod("p2", 2, 2), pod("p3", 1, 3)],
    );
    s.classes[0].spec.admission.ordering = Ordering::BestEffortFIFO;
    settle(&mut s);
    assert_eq!(phase(&s, "p1"), LeasePhase::Admitted);
    assert_eq!(phase(&s, "p2"), LeasePhase::Queued);
    assert_eq!(phase(&s, "p3"), LeasePhase::Admitted);
}

#[test]
fn a_request_larger_than_any_node_waits_without_blocking_the_queue() {
    let mut s = world(
        vec![node("n1", 2), node("n2", 2)],
        vec![pod("huge", 4, 1), pod("p2", 1, 2)],
    );
    settle(&mut s);
    assert_eq!(phase(&s, "huge"), LeasePhase::Queued);
    assert_eq!(
        message(&s, "huge"),
        "waiting: needs 4 slots; largest matching node has 2"
    );
    assert_eq!(phase(&s, "p2"), LeasePhase::Admitted);
}

#[test]
fn with_no_matching_node_the_lease_says_so() {
    let mut s = world(vec![], vec![pod("p1", 1, 1)]);
    settle(&mut s);
    assert_eq!(phase(&s, "p1"), LeasePhase::Queued);
    assert_eq!(
        message(&s, "p1"),
        "waiting: no node matches class default yet"
    );
    s.nodes.push(node("n1", 1));
    settle(&mut s);
    assert_eq!(phase(&s, "p1"), LeasePhase::Admitted);
}

#[test]
fn pack_fills_the_fullest_node_and_spread_the_emptiest_ties_by_name() {
    let busy = |name: &str, node: &str| {
        let mut p = pod(name, 1, 0);
        p.gated = false;
        p.node_name = Some(node.into());
        p.phase = PodPhase::Running;
        p
    };
    // Free: a 3, b 2, c 4, d 4.
    for (placement, want) in [(Placement::Pack, "b"), (Placement::Spread, "c")] {
        let mut s = world(
            vec![node("a", 4), node("b", 4), node("c", 4), node("d", 4)],
            vec![
                busy("x1", "a"),
                busy("x2", "b"),
                busy("x3", "b"),
                pod("p", 2, 5),
            ],
        );
        s.classes[0].spec.admission.placement = placement;
        settle(&mut s);
        assert_eq!(lease(&s, "p").node.as_deref(), Some(want), "{placement:?}");
    }
    // Multi-slot requests land on one node: 3 slots cannot use 2+2.
    let mut s = world(vec![node("a", 2), node("b", 2)], vec![pod("p", 3, 0)]);
    settle(&mut s);
    assert_eq!(phase(&s, "p"), LeasePhase::Queued);
}

#[test]
fn node_fit_honours_class_selector_pod_selector_affinity_taints_and_cordons() {
    let mut labelled = node("gpu-a", 1);
    labelled.labels.insert("pool".into(), "a".into());
    let mut tainted = node("gpu-t", 1);
    tainted.labels.insert("pool".into(), "a".into());
    tainted.taints.push(Taint {
        key: "dedicated".into(),
        value: Some("ml".into()),
        effect: TaintEffect::NoSchedule,
    });
    let mut cordoned = node("gpu-c", 1);
    cordoned.labels.insert("pool".into(), "a".into());
    cordoned.unschedulable = true;
    let outside = node("gpu-b", 4);
    let mut s = world(
        vec![labelled, tainted, cordoned, outside],
        vec![pod("p1", 1, 1), pod("p2", 1, 2)],
    );
    s.classes[0].spec.node_selector = Some(LabelSelector {
        match_labels: Some([("pool".to_owned(), "a".to_owned())].into()),
        match_expressions: None,
    });
    let mut tolerant = pod("p3", 1, 3);
    tolerant.tolerations = std::sync::Arc::new([Toleration {
        key: Some("dedicated".into()),
        operator: TolerationOperator::Equal,
        value: Some("ml".into()),
        effect: Some(TaintEffect::NoSchedule),
    }]);
    s.pods.push(tolerant);
    s.classes[0].spec.admission.ordering = Ordering::BestEffortFIFO;
    settle(&mut s);
    assert_eq!(lease(&s, "p1").node.as_deref(), Some("gpu-a"));
    assert_eq!(
        phase(&s, "p2"),
        LeasePhase::Queued,
        "only the tainted node is left"
    );
    assert_eq!(lease(&s, "p3").node.as_deref(), Some("gpu-t"));
    assert_eq!(s.classes[0].status.as_ref().expect("status").capacity, 3);

    // The pod's own selector and required affinity narrow the class's nodes.
    let mut zoned = node("z1", 1);
    zoned.labels.insert("zone".into(), "west".into());
    let mut s = world(vec![node("n0", 1), zoned], vec![]);
    let mut by_selector = pod("sel", 1, 1);
    by_selector
        .node_selector
        .insert("zone".into(), "west".into());
    let mut by_affinity = pod("aff", 1, 2);
    by_affinity.required_affinity = Some(vec![NodeSelectorTerm {
        match_expressions: vec![NodeSelectorRequirement {
            key: "zone".into(),
            operator: SelectorOperator::NotIn,
            values: vec!["west".into()],
        }],
        match_fields: vec![],
    }]);
    s.pods = vec![by_selector, by_affinity];
    settle(&mut s);
    assert_eq!(lease(&s, "sel").node.as_deref(), Some("z1"));
    assert_eq!(lease(&s, "aff").node.as_deref(), Some("n0"));
}

#[test]
fn a_pod_no_node_fits_is_told_so_and_does_not_block() {
    let mut s = world(vec![node("n1", 1)], vec![]);
    let mut picky = pod("picky", 1, 1);
    picky.node_selector.insert("zone".into(), "mars".into());
    s.pods = vec![picky, pod("p2", 1, 2)];
    settle(&mut s);
    assert_eq!(
        message(&s, "picky"),
        "waiting: the one node of class default does not fit the pod's nodeSelector, affinity and tolerations"
    );
    assert_eq!(phase(&s, "p2"), LeasePhase::Admitted);
}

#[test]
fn helpers_wait_while_a_primary_waits_unless_admit_while_queued() {
    for admit_while_queued in [false, true] {
        let mut s = world(
            vec![node("n1", 2), node("n2", 1)],
            vec![pod("p1", 2, 1), pod("big", 2, 2), helper("h1", 1, 3)],
        );
        s.classes[0].spec.helpers.admit_while_queued = admit_while_queued;
        s.classes[0].spec.helpers.preemption = Preemption::Never;
        settle(&mut s);
        assert_eq!(phase(&s, "p1"), LeasePhase::Admitted);
        assert_eq!(phase(&s, "big"), LeasePhase::Queued);
        if admit_while_queued {
            assert_eq!(phase(&s, "h1"), LeasePhase::Admitted);
        } else {
            assert_eq!(phase(&s, "h1"), LeasePhase::Queued);
            assert_eq!(
                message(&s, "h1"),
                "waiting: 1 primary of class default is queued; helpers are admitted only while none wait"
            );
        }
    }
    // With no primary waiting, helpers take idle GPUs in their own FIFO.
    let mut s = world(
        vec![node("n1", 2)],
        vec![helper("h1", 1, 1), helper("h2", 1, 2)],
    );
    settle(&mut s);
    assert_eq!(phase(&s, "h1"), LeasePhase::Admitted);
    assert_eq!(phase(&s, "h2"), LeasePhase::Admitted);
}

fn bound(s: &mut Snapshot, name: &str, admitted: i64) {
    let l = s
        .leases
        .iter_mut()
        .find(|l| l.key == key(name))
        .expect("lease");
    let st = l.status_mut().as_mut().expect("status");
    st.admitted_at = Some(Time(at(admitted)));
}

#[test]
fn preemption_evicts_youngest_helpers_only_as_many_as_needed_and_waits_for_them() {
    let mut s = world(
        vec![node("n1", 4)],
        vec![
            helper("h-old", 1, 1),
            helper("h-mid", 1, 2),
            helper("h-young", 1, 3),
            pod("p-run", 1, 4),
        ],
    );
    settle(&mut s);
    bound(&mut s, "h-old", 10);
    bound(&mut s, "h-mid", 20);
    bound(&mut s, "h-young", 30);
    s.pods.push(pod("p-new", 2, 100));
    s.now = at(2000);
    let plan = settle_until_eviction(&mut s);
    let victims: Vec<&str> = plan.evictions.iter().map(|e| e.key.name.as_ref()).collect();
    assert_eq!(
        victims,
        vec!["h-young", "h-mid"],
        "youngest first, only 2 slots"
    );
    assert!(plan.evictions.iter().all(|e| e.for_primary == key("p-new")));
    assert!(plan.evictions.iter().all(|e| e.grace_period_seconds == 30));
    assert_eq!(phase(&s, "h-young"), LeasePhase::Preempting);
    assert_eq!(
        lease(&s, "h-young").preempted_by.as_deref(),
        Some("team/p-new")
    );
    assert_eq!(phase(&s, "h-old"), LeasePhase::Admitted);
    assert_eq!(
        phase(&s, "p-run"),
        LeasePhase::Admitted,
        "never preempt a primary"
    );
    assert_eq!(
        message(&s, "p-new"),
        "waiting for helpers team/h-mid, team/h-young to terminate"
    );
    // Terminating pods still hold their GPUs: nothing more happens.
    let plan = decide(&s);
    assert!(plan.admissions.is_empty() && plan.evictions.is_empty());
    // One victim gone: still not enough, and no second eviction.
    finish(&mut s, "h-young");
    let plan = decide(&s);
    assert!(plan.admissions.is_empty(), "{:?}", plan.admissions);
    assert!(plan.evictions.is_empty(), "never evict more than needed");
    apply(&mut s, &plan);
    finish(&mut s, "h-mid");
    settle(&mut s);
    assert_eq!(phase(&s, "p-new"), LeasePhase::Admitted);
    assert_eq!(phase(&s, "h-young"), LeasePhase::Released);
    assert_eq!(phase(&s, "h-old"), LeasePhase::Admitted);
}

#[test]
fn helpers_admitted_in_the_same_second_are_preempted_latest_in_the_queue_first() {
    // The UID tie-break alone would pick "h-early" (its UID sorts first).
    let mut early = helper("h-early", 1, 1);
    early.uid = "uid-a".into();
    let mut later = helper("h-later", 1, 2);
    later.uid = "uid-z".into();
    let mut s = world(vec![node("n1", 2)], vec![early, later]);
    settle(&mut s);
    bound(&mut s, "h-early", 10);
    bound(&mut s, "h-later", 10);
    s.pods.push(pod("p-new", 1, 100));
    s.now = at(2000);
    let plan = settle_until_eviction(&mut s);
    let victims: Vec<&str> = plan.evictions.iter().map(|e| e.key.name.as_ref()).collect();
    assert_eq!(victims, vec!["h-later"]);
}

fn settle_until_eviction(s: &mut Snapshot) -> Plan {
    for _ in 0..5 {
        let plan = decide(s);
        apply(s, &plan);
        if !plan.evictions.is_empty() {
            return plan;
        }
    }
    panic!("no eviction planned");
}

#[test]
fn helpers_younger_than_min_runtime_are_not_preempted() {
    let mut s = world(vec![node("n1", 1)], vec![helper("h1", 1, 1)]);
    s.classes[0].spec.helpers.min_runtime_seconds = 600;
    settle(&mut s);
    bound(&mut s, "h1", 900);
    s.pods.push(pod("p1", 1, 950));
    settle(&mut s);
    assert_eq!(phase(&s, "h1"), LeasePhase::Admitted);
    assert!(
        message(&s, "p1").contains("younger than minRuntimeSeconds"),
        "{}",
        message(&s, "p1")
    );
    s.now = at(1600);
    let plan = decide(&s);
    assert_eq!(plan.evictions.len(), 1, "old enough now");
}

#[test]
fn preemption_never_leaves_helpers_alone() {
    let mut s = world(vec![node("n1", 1)], vec![helper("h1", 1, 1)]);
    s.classes[0].spec.helpers.preemption = Preemption::Never;
    settle(&mut s);
    s.pods.push(pod("p1", 1, 5));
    let plan = settle(&mut s);
    assert!(plan.evictions.is_empty());
    assert_eq!(phase(&s, "h1"), LeasePhase::Admitted);
    assert!(message(&s, "p1").contains("no helper can be preempted"));
}

#[test]
fn slots_freed_by_preemption_are_reserved_for_the_primary() {
    let mut s = world(vec![node("n1", 2)], vec![helper("h1", 2, 1)]);
    s.classes[0].spec.helpers.admit_while_queued = true;
    settle(&mut s);
    s.pods.push(pod("p1", 2, 10));
    settle_until_eviction(&mut s);
    // Helper h1 is terminating; a new helper that could use idle slots arrives.
    s.pods.push(helper("h2", 1, 20));
    settle(&mut s);
    finish(&mut s, "h1");
    // Another class sharing the node must not take the freed slots either.
    let mut other = class("other");
    other.spec.default = false;
    s.classes.push(other);
    let mut stranger = pod("stranger", 1, 30);
    stranger.class_label = Some("other".into());
    s.pods.push(stranger);
    settle(&mut s);
    assert_eq!(phase(&s, "p1"), LeasePhase::Admitted);
    assert_eq!(phase(&s, "h2"), LeasePhase::Queued);
    assert_eq!(phase(&s, "stranger"), LeasePhase::Queued);
}

#[test]
fn released_when_the_pod_is_gone_succeeded_or_failed_and_its_slots_free() {
    let mut s = world(
        vec![node("n1", 3)],
        vec![
            pod("gone", 1, 1),
            pod("ok", 1, 2),
            pod("bad", 1, 3),
            pod("next", 3, 4),
        ],
    );
    settle(&mut s);
    assert_eq!(phase(&s, "next"), LeasePhase::Queued);
    s.now = at(3000);
    finish(&mut s, "gone");
    for (name, ph) in [("ok", PodPhase::Succeeded), ("bad", PodPhase::Failed)] {
        s.pods
            .iter_mut()
            .find(|p| p.key == key(name))
            .expect("pod")
            .phase = ph;
    }
    settle(&mut s);
    for name in ["gone", "ok", "bad"] {
        let st = lease(&s, name);
        assert_eq!(st.phase, LeasePhase::Released, "{name}");
        assert_eq!(st.released_at, Some(Time(at(3000))));
        assert_eq!(st.position, None);
    }
    assert_eq!(message(&s, "ok"), "released: pod succeeded");
    assert_eq!(message(&s, "bad"), "released: pod failed");
    assert_eq!(message(&s, "gone"), "released: pod deleted");
    assert_eq!(phase(&s, "next"), LeasePhase::Admitted);
}

/// A pod its user deletes ends as the kubelet stops its containers: Failed
/// when one ignores SIGTERM and is killed, Succeeded when it exits 0. Either
/// way its lease says it was deleted, not that it failed.
#[test]
fn a_deleted_pod_is_released_as_deleted_whatever_its_exit() {
    let mut s = world(
        vec![node("n1", 2)],
        vec![pod("killed", 1, 1), pod("exited", 1, 2)],
    );
    settle(&mut s);
    s.now = at(3000);
    for (name, ph) in [
        ("killed", PodPhase::Failed),
        ("exited", PodPhase::Succeeded),
    ] {
        let p = s.pods.iter_mut().find(|p| p.key == key(name)).expect("pod");
        p.terminating = true;
        p.phase = ph;
    }
    settle(&mut s);
    for name in ["killed", "exited"] {
        assert_eq!(phase(&s, name), LeasePhase::Released, "{name}");
        assert_eq!(message(&s, name), "released: pod deleted", "{name}");
    }
}

#[test]
fn a_replaced_pod_gets_its_stale_lease_deleted_before_a_new_one() {
    let mut s = world(vec![node("n1", 1)], vec![pod("p", 1, 1), pod("q", 1, 2)]);
    settle(&mut s);
    let mut again = pod("p", 1, 50);
    again.uid = "uid-p-2".into();
    s.pods[0] = again;
    let plan = decide(&s);
    assert_eq!(plan.delete_leases.len(), 1);
    assert_eq!(plan.delete_leases[0].pod_uid, "uid-p");
    assert!(
        plan.create_leases.is_empty(),
        "never two leases for one key"
    );
    apply(&mut s, &plan);
    let plan = decide(&s);
    assert_eq!(plan.create_leases.len(), 1);
    assert_eq!(plan.create_leases[0].pod_uid, "uid-p-2");
    assert_eq!(
        plan.create_leases[0].status.sequence,
        Some(micros(50)),
        "behind q, stamped earlier"
    );
    assert!(lease(&s, "q").sequence < Some(micros(50)));
}

#[test]
fn an_ungated_pod_is_admitted_already_and_bound_once_gpus_are_reported() {
    let mut running = pod("outside", 1, 1);
    running.gated = false;
    running.node_name = Some("n1".into());
    running.phase = PodPhase::Running;
    let mut s = world(vec![node("n1", 2)], vec![running, pod("p2", 2, 2)]);
    let plan = settle(&mut s);
    assert!(plan.admissions.iter().all(|a| a.key != key("outside")));
    assert_eq!(phase(&s, "outside"), LeasePhase::Admitted);
    assert_eq!(lease(&s, "outside").node.as_deref(), Some("n1"));
    assert_eq!(
        phase(&s, "p2"),
        LeasePhase::Queued,
        "the outside pod holds a slot"
    );
    // The device plugin reports the GPU: Admitted → Bound, and it stays Bound.
    let l = s
        .leases
        .iter_mut()
        .find(|l| l.key == key("outside"))
        .expect("lease");
    l.status_mut().as_mut().expect("status").gpus = vec![LeaseGpu {
        index: 1,
        uuid: "GPU-n1-1".into(),
        product: None,
    }];
    s.now = at(1500);
    settle(&mut s);
    let st = lease(&s, "outside");
    assert_eq!(st.phase, LeasePhase::Bound);
    assert_eq!(st.bound_at, Some(Time(at(1500))));
    assert_eq!(
        st.gpus.len(),
        1,
        "GPUs written by the device plugin are kept"
    );
    let slots = &s.classes[0].status.as_ref().expect("status").slots;
    let on_gpu1 = slots.iter().find(|e| e.gpu == 1).expect("gpu 1");
    assert_eq!(on_gpu1.lease.as_deref(), Some("team/outside"));
}

fn condition<'a>(s: &'a Snapshot, class: &str, type_: &str) -> &'a Condition {
    s.classes
        .iter()
        .find(|c| c.name == class)
        .and_then(|c| c.status.as_ref())
        .and_then(|st| st.conditions.iter().find(|c| c.type_ == type_))
        .unwrap_or_else(|| panic!("class {class} has a {type_} condition"))
}

#[test]
fn a_second_default_class_is_invalid_and_the_older_default_keeps_its_queue() {
    let mut labelled = pod("p2", 1, 2);
    labelled.class_label = Some("zz-also-default".into());
    let mut s = world(vec![node("n1", 2)], vec![pod("p1", 1, 1), labelled]);
    s.classes[0].created_at = Some(at(0));
    let mut newcomer = class("aa-newer-default");
    newcomer.spec.default = true;
    newcomer.created_at = Some(at(500));
    s.classes.push(newcomer);
    let mut named = class("zz-also-default");
    named.spec.default = true;
    named.created_at = Some(at(600));
    s.classes.push(named);
    settle(&mut s);
    assert_eq!(condition(&s, "default", CONDITION_READY).status, "True");
    for newer in ["aa-newer-default", "zz-also-default"] {
        let invalid = condition(&s, newer, CONDITION_INVALID);
        assert_eq!(invalid.status, "True");
        assert_eq!(invalid.reason, "MultipleDefaults");
        assert!(
            invalid
                .message
                .contains("class default is already the default"),
            "{}",
            invalid.message
        );
    }
    // An unlabelled pod goes to the older default (not to the newcomer that
    // sorts first by name) and is admitted; a pod naming a newcomer is
    // rejected, saying why.
    assert_eq!(phase(&s, "p1"), LeasePhase::Admitted);
    assert_eq!(phase(&s, "p2"), LeasePhase::Rejected);
    assert!(
        message(&s, "p2").contains("already the default"),
        "{}",
        message(&s, "p2")
    );
    // Once the newcomer steps back, its pods queue and are admitted.
    for c in &mut s.classes {
        if c.name == "zz-also-default" {
            c.spec.default = false;
        }
    }
    settle(&mut s);
    assert_eq!(
        phase(&s, "p2"),
        LeasePhase::Admitted,
        "Rejected is not final"
    );
    assert_eq!(
        condition(&s, "zz-also-default", CONDITION_READY).status,
        "True"
    );
}

#[test]
fn a_class_handing_out_a_builtin_resource_is_invalid() {
    let mut s = world(vec![node("n1", 1)], vec![pod("p1", 1, 1)]);
    let mut cpu = class("cpu");
    cpu.spec.resource_name = "cpu".into();
    s.classes.push(cpu);
    let mut k8s = class("k8s");
    k8s.spec.resource_name = "kubernetes.io/gpu".into();
    s.classes.push(k8s);
    settle(&mut s);
    for name in ["cpu", "k8s"] {
        let invalid = condition(&s, name, CONDITION_INVALID);
        assert_eq!(invalid.status, "True", "{name}");
        assert_eq!(invalid.reason, "InvalidResourceName", "{name}");
    }
    assert_eq!(condition(&s, "default", CONDITION_READY).status, "True");
}

/// Class `alt` covers the same nodes as `default`, as DESIGN §5.9 allows.
fn overlapping_world(nodes: Vec<NodeInfo>, pods: Vec<PodInfo>) -> Snapshot {
    let mut s = world(nodes, pods);
    s.classes.push(class("alt"));
    s
}

fn labelled(mut p: PodInfo, class: &str) -> PodInfo {
    p.class_label = Some(class.into());
    p
}

#[test]
fn helpers_of_another_class_do_not_take_nodes_a_waiting_primary_could_use() {
    // n2 has 2 free slots; the 3-slot primary waits for n2 (the only node
    // large enough). A helper of class alt fits on n2 and on n3, which the
    // primary can never use (1 slot).
    let mut blocker = pod("running", 1, 0);
    blocker.gated = false;
    blocker.node_name = Some("n2".into());
    blocker.phase = PodPhase::Running;
    let mut s = overlapping_world(
        vec![node("n2", 3), node("n3", 1)],
        vec![
            blocker,
            pod("first", 3, 1),
            labelled(helper("h-alt", 1, 3), "alt"),
        ],
    );
    settle(&mut s);
    assert_eq!(phase(&s, "first"), LeasePhase::Queued);
    // The helper is placed only where no waiting primary could go.
    assert_eq!(phase(&s, "h-alt"), LeasePhase::Admitted);
    assert_eq!(lease(&s, "h-alt").node.as_deref(), Some("n3"));
    // A second alt helper finds only nodes kept for the primary, and says so.
    s.pods.push(labelled(helper("h-alt-2", 1, 4), "alt"));
    settle(&mut s);
    assert_eq!(phase(&s, "h-alt-2"), LeasePhase::Queued);
    assert!(
        message(&s, "h-alt-2").contains("kept free for primaries of other classes"),
        "{}",
        message(&s, "h-alt-2")
    );
}

#[test]
fn a_waiting_primary_evicts_helpers_of_any_class_and_of_a_deleted_class() {
    let mut s = overlapping_world(
        vec![node("n1", 2)],
        vec![
            labelled(helper("h-alt", 1, 1), "alt"),
            labelled(helper("h-gone", 1, 2), "gone-soon"),
        ],
    );
    s.classes.push(class("gone-soon"));
    settle(&mut s);
    assert_eq!(phase(&s, "h-alt"), LeasePhase::Admitted);
    assert_eq!(phase(&s, "h-gone"), LeasePhase::Admitted);
    // The helpers' classes are no shield: one is deleted, the other is not
    // the primary's.
    s.classes.retain(|c| c.name != "gone-soon");
    s.now = at(2000);
    s.pods.push(pod("primary", 2, 3));
    let plan = settle(&mut s);
    let _ = plan;
    let evicted: Vec<&str> = s
        .pods
        .iter()
        .filter(|p| p.terminating)
        .map(|p| p.key.name.as_ref())
        .collect();
    assert_eq!(evicted, ["h-alt", "h-gone"], "both helpers are evicted");
    assert_eq!(phase(&s, "h-alt"), LeasePhase::Preempting);
    assert_eq!(
        lease(&s, "h-alt").preempted_by.as_deref(),
        Some("team/primary")
    );
    finish(&mut s, "h-alt");
    finish(&mut s, "h-gone");
    settle(&mut s);
    assert_eq!(phase(&s, "primary"), LeasePhase::Admitted);
}

#[test]
fn the_pod_not_the_lease_says_slots_role_and_class() {
    let mut s = world(
        vec![node("n1", 2)],
        vec![pod("big", 2, 1), pod("next", 1, 2)],
    );
    settle(&mut s);
    assert_eq!(phase(&s, "big"), LeasePhase::Admitted);
    // Someone writes the lease down to 1 slot and calls it a helper.
    for l in &mut s.leases {
        if l.key == key("big") {
            l.spec_mut().slots = 1;
            l.spec_mut().role = Role::Helper;
            l.spec_mut().class_name = "other".into();
        }
    }
    s.pods.push(pod("primary-2", 1, 3));
    let plan = decide(&s);
    assert!(
        plan.admissions.is_empty(),
        "no slot is free: {:?}",
        plan.admissions
    );
    assert!(
        plan.evictions.is_empty(),
        "a primary is never evicted as a helper"
    );
    let repaired = plan.lease_specs.get(&key("big")).expect("spec rewritten");
    assert_eq!(repaired.slots, 2);
    assert_eq!(repaired.role, Role::Primary);
    assert_eq!(repaired.class_name, "default");
    settle(&mut s);
    let spec = &s
        .leases
        .iter()
        .find(|l| l.key == key("big"))
        .expect("lease")
        .spec();
    assert_eq!((spec.slots, spec.role), (2, Role::Primary));
    assert_eq!(phase(&s, "next"), LeasePhase::Queued);
}

#[test]
fn a_deleted_lease_is_recreated_with_its_place_and_state() {
    let mut s = world(
        vec![node("n1", 1)],
        vec![pod("a", 1, 1), pod("b", 1, 2), pod("c", 1, 3)],
    );
    settle(&mut s);
    let before_a = lease(&s, "a").clone();
    let before_c = lease(&s, "c").clone();
    for l in &mut s.leases {
        if l.key == key("a") || l.key == key("c") {
            l.missing = true;
        }
    }
    s.now = at(1500);
    let plan = decide(&s);
    let recreated: BTreeMap<String, &GpuLeaseStatus> = plan
        .create_leases
        .iter()
        .map(|n| (n.key.name.to_string(), &n.status))
        .collect();
    assert_eq!(recreated.len(), 2, "{:?}", plan.create_leases);
    let a = recreated["a"];
    assert_eq!(a.sequence, before_a.sequence);
    assert_eq!(a.phase, LeasePhase::Admitted);
    assert_eq!(a.node, before_a.node);
    assert_eq!(a.admitted_at, before_a.admitted_at);
    let c = recreated["c"];
    assert_eq!(c.sequence, before_c.sequence);
    assert_eq!(c.phase, LeasePhase::Queued);
    assert_eq!(c.position, Some(2), "c stays behind b");
    assert!(
        plan.all_lease_statuses()
            .all(|(k, _)| k != &key("a") && k != &key("c"))
    );
}

#[test]
fn a_lease_lost_with_nothing_remembering_it_comes_back_in_its_stamps_place() {
    // "early" carries another controller's gate, so "late", stamped after
    // it, runs first; "w1" and "w2" wait behind.
    let mut early = pod("early", 1, 1);
    early.other_gate = Some("example.com/quota".into());
    let mut s = world(
        vec![node("n1", 1)],
        vec![early, pod("w1", 1, 2), pod("late", 1, 0), pod("w2", 1, 3)],
    );
    s.pods[2].enqueued_at = Some(at(1) + jiff::SignedDuration::from_millis(500));
    settle(&mut s);
    assert!(phase(&s, "late").holds_slots(), "late runs");
    assert_eq!(lease(&s, "w1").position, Some(2), "behind early");

    // The operator was down while w1's and early's leases were deleted:
    // nothing remembers their numbers (the lease is simply gone).
    s.leases
        .retain(|l| l.key != key("w1") && l.key != key("early"));
    s.pods[0].other_gate = None;
    let plan = decide(&s);
    let recreated: BTreeMap<String, u64> = plan
        .create_leases
        .iter()
        .map(|n| (n.key.name.to_string(), n.status.sequence.expect("sequence")))
        .collect();
    assert_eq!(recreated["w1"], micros(2), "w1's stamp gives its old place");
    let late = lease(&s, "late").sequence.expect("late's sequence");
    assert!(
        recreated["early"] > late,
        "early goes above late, which runs: nothing is admitted out of order"
    );
    assert!(
        recreated["early"] < recreated["w1"],
        "and still ahead of w1"
    );
    apply(&mut s, &plan);
    settle(&mut s);
    assert_eq!(lease(&s, "early").position, Some(1));
    assert_eq!(lease(&s, "w1").position, Some(2));
    assert_eq!(lease(&s, "w2").position, Some(3));
    finish(&mut s, "late");
    settle(&mut s);
    assert!(phase(&s, "early").holds_slots(), "early is admitted first");
    assert_eq!(phase(&s, "w1"), LeasePhase::Queued);
}

#[test]
fn an_unevaluable_node_selector_makes_the_class_invalid() {
    let mut s = world(vec![node("n1", 1)], vec![pod("p1", 1, 1)]);
    s.classes[0].spec.node_selector = Some(LabelSelector {
        match_labels: None,
        match_expressions: Some(vec![LabelSelectorRequirement {
            key: "zone".into(),
            operator: "Near".into(),
            values: None,
        }]),
    });
    settle(&mut s);
    let st = s.classes[0].status.as_ref().expect("status");
    let invalid = st
        .conditions
        .iter()
        .find(|c| c.type_ == CONDITION_INVALID)
        .expect("Invalid");
    assert_eq!(invalid.status, "True");
    assert_eq!(invalid.reason, "InvalidNodeSelector");
    assert!(invalid.message.contains("Near"), "{}", invalid.message);
    assert_eq!(phase(&s, "p1"), LeasePhase::Rejected);
}

#[test]
fn unknown_class_and_bad_role_are_rejected_with_a_message_naming_them() {
    let mut lost = pod("lost", 1, 1);
    lost.class_label = Some("nope".into());
    let mut odd = pod("odd", 1, 2);
    odd.role = RoleLabel::Invalid("boss".into());
    let mut s = world(vec![node("n1", 2)], vec![lost, odd]);
    settle(&mut s);
    assert_eq!(phase(&s, "lost"), LeasePhase::Rejected);
    assert!(message(&s, "lost").contains("GpuLeaseClass nope does not exist"));
    assert_eq!(phase(&s, "odd"), LeasePhase::Rejected);
    assert!(message(&s, "odd").contains("\"boss\""));
    let mut nope = class("nope");
    nope.spec.default = false;
    s.classes.push(nope);
    settle(&mut s);
    assert_eq!(phase(&s, "lost"), LeasePhase::Admitted);
}

#[test]
fn unmanaged_and_terminating_pods_hold_their_slots() {
    let mut stranger = pod("stranger", 0, 0);
    stranger.requests = [(RES.to_owned(), 1)].into();
    stranger.class_label = Some("unrelated".into());
    stranger.requests = [("other/res".to_owned(), 1), (RES.to_owned(), 0)].into();
    let mut pinned = pod("pinned-other", 0, 0);
    pinned.class_label = None;
    pinned.requests = [(RES.to_owned(), 1)].into();
    pinned.gated = false;
    pinned
        .node_selector
        .insert(LABEL_HOSTNAME.into(), "n1".into());
    let mut dying = pod("dying", 1, 0);
    dying.gated = false;
    dying.node_name = Some("n1".into());
    dying.terminating = true;
    let mut s = world(vec![node("n1", 3)], vec![pinned, dying, pod("p", 2, 5)]);
    settle(&mut s);
    assert_eq!(phase(&s, "p"), LeasePhase::Queued, "1 free slot left");
    let st = s.classes[0].status.as_ref().expect("status");
    assert_eq!((st.capacity, st.free), (3, 1));
    finish(&mut s, "dying");
    settle(&mut s);
    assert_eq!(phase(&s, "p"), LeasePhase::Admitted);
}

#[test]
fn an_admitted_lease_holds_its_node_before_the_pod_shows_the_pin_and_is_driven_again() {
    let mut s = world(vec![node("n1", 1)], vec![pod("p1", 1, 1), pod("p2", 1, 2)]);
    let plan = decide(&s);
    apply(&mut s, &plan);
    let plan = decide(&s);
    assert_eq!(plan.admissions.len(), 1);
    // The lease status is written but the pod patch is lost (a restart).
    for l in &mut s.leases {
        if let Some(spec) = plan.lease_specs.get(&l.key) {
            *l.spec_mut() = spec.clone();
        }
        if let Some(st) = plan.lease_status(&l.key) {
            *l.status_mut() = Some(st.clone());
        }
    }
    let plan = decide(&s);
    assert_eq!(plan.admissions.len(), 1, "driven again");
    assert_eq!(plan.admissions[0].key, key("p1"));
    assert_eq!(plan.admissions[0].node, "n1");
    assert!(
        !plan.admissions.iter().any(|a| a.key == key("p2")),
        "slot still held"
    );
}

#[test]
fn class_status_counts_queue_head_and_per_gpu_slots() {
    let mut s = world(
        vec![node("n1", 2), node("n2", 2)],
        vec![
            pod("p1", 1, 1),
            pod("p2", 2, 2),
            pod("p3", 2, 3),
            helper("h1", 1, 4),
            helper("h2", 1, 5),
        ],
    );
    s.classes[0].spec.snapshot.max_slots = 3;
    settle(&mut s);
    let st = s.classes[0].status.as_ref().expect("status");
    assert_eq!(st.observed_generation, Some(1));
    assert_eq!((st.capacity, st.free), (4, 1));
    assert_eq!((st.admitted, st.queued), (2, 1));
    assert_eq!(
        (st.admitted_helpers, st.queued_helpers, st.preempting),
        (0, 2, 0)
    );
    let head: Vec<(&str, Role, u32)> = st
        .queue
        .iter()
        .map(|q| (q.lease.as_str(), q.role, q.position))
        .collect();
    assert_eq!(
        head,
        vec![
            ("team/p3", Role::Primary, 1),
            ("team/h1", Role::Helper, 1),
            ("team/h2", Role::Helper, 2)
        ]
    );
    assert_eq!(st.queue[0].queued_at, Some(Time(at(3))));
    assert_eq!(st.slots.len(), 3);
    assert!(st.slots_truncated);
    assert_eq!(st.slots[0].node, "n1");
    assert_eq!(st.slots[0].uuid.as_deref(), Some("GPU-n1-0"));
    assert!(st.updated_at.is_none(), "the status writer stamps it");
    let held: Vec<Option<&str>> = st.slots.iter().map(|e| e.lease.as_deref()).collect();
    assert_eq!(held, vec![Some("team/p1"), None, Some("team/p2")]);
}

#[test]
fn two_classes_over_shared_nodes_never_admit_into_the_same_slot() {
    let mut narrow = class("narrow");
    narrow.spec.default = false;
    narrow.spec.node_selector = Some(LabelSelector {
        match_labels: Some([("pool".to_owned(), "x".to_owned())].into()),
        match_expressions: None,
    });
    let mut shared = node("shared", 2);
    shared.labels.insert("pool".into(), "x".into());
    let mut a = pod("a", 2, 1);
    a.class_label = Some("narrow".into());
    let mut s = world(vec![shared], vec![a, pod("b", 2, 2)]);
    s.classes.push(narrow);
    settle(&mut s);
    let admitted: Vec<&str> = ["a", "b"]
        .into_iter()
        .filter(|n| phase(&s, n) == LeasePhase::Admitted)
        .collect();
    assert_eq!(
        admitted.len(),
        1,
        "one 2-slot node, one admission: {admitted:?}"
    );
}

#[test]
fn same_snapshot_same_plan_and_a_settled_world_plans_nothing() {
    let mut s = world(
        vec![node("n1", 2), node("n2", 2)],
        vec![
            pod("p1", 1, 1),
            pod("p2", 2, 2),
            pod("p3", 2, 3),
            helper("h1", 1, 4),
        ],
    );
    let first = decide(&s);
    let mut shuffled = s.clone();
    shuffled.pods.reverse();
    shuffled.nodes.reverse();
    assert_eq!(first, decide(&s));
    assert_eq!(first, decide(&shuffled), "input order does not matter");
    let last = settle(&mut s);
    assert!(last.lease_statuses.is_empty() && last.lease_progress.is_empty());
    assert_eq!(decide(&s), last, "stable once applied");
}

#[test]
fn a_refused_eviction_is_asked_for_again_without_choosing_new_victims() {
    let mut s = world(
        vec![node("n1", 2)],
        vec![helper("h1", 1, 1), helper("h2", 1, 2)],
    );
    settle(&mut s);
    s.pods.push(pod("p1", 1, 10));
    let plan = settle_until_eviction(&mut s);
    assert_eq!(plan.evictions.len(), 1);
    let victim = plan.evictions[0].key.clone();
    // A PodDisruptionBudget refused it: the pod is not terminating.
    for p in &mut s.pods {
        p.terminating = false;
    }
    let plan = decide(&s);
    assert_eq!(plan.evictions.len(), 1, "retried, not widened");
    assert_eq!(plan.evictions[0].key, victim);
    assert_eq!(plan.evictions[0].for_primary, key("p1"));
}

#[test]
fn a_helper_whose_admission_was_lost_is_not_started_while_a_primary_queues() {
    let mut s = world(vec![node("n1", 1)], vec![helper("h1", 1, 1)]);
    let plan = decide(&s);
    apply(&mut s, &plan);
    let plan = decide(&s);
    assert_eq!(plan.admissions.len(), 1);
    // Only the lease status landed; then a primary arrives and gets its lease.
    for l in &mut s.leases {
        if let Some(spec) = plan.lease_specs.get(&l.key) {
            *l.spec_mut() = spec.clone();
        }
        if let Some(st) = plan.lease_status(&l.key) {
            *l.status_mut() = Some(st.clone());
        }
    }
    assert_eq!(phase(&s, "h1"), LeasePhase::Admitted);
    s.pods.push(pod("p1", 1, 5));
    let plan = settle(&mut s);
    assert!(plan.admissions.is_empty());
    assert_eq!(
        phase(&s, "p1"),
        LeasePhase::Admitted,
        "the primary gets the slot"
    );
    assert_eq!(phase(&s, "h1"), LeasePhase::Queued);
}

#[test]
fn best_effort_only_the_first_blocked_primary_preempts() {
    let mut s = world(
        vec![node("n1", 2), node("n2", 2)],
        vec![helper("h1", 2, 1), helper("h2", 2, 2)],
    );
    s.classes[0].spec.admission.ordering = Ordering::BestEffortFIFO;
    settle(&mut s);
    s.pods.push(pod("p1", 2, 10));
    s.pods.push(pod("p2", 2, 11));
    let plan = settle_until_eviction(&mut s);
    assert_eq!(plan.evictions.len(), 1, "one helper, for the head only");
    assert_eq!(plan.evictions[0].for_primary, key("p1"));
}

#[test]
fn a_pods_own_node_selector_is_named_when_it_is_why_the_pod_waits() {
    let mut picky = pod("picky", 1, 2);
    picky.node_selector = [("zone".to_owned(), "b".to_owned())].into();
    let mut n2 = node("n2", 1);
    n2.labels = [("zone".to_owned(), "b".to_owned())].into();
    let mut s = world(vec![node("n1", 2), n2], vec![pod("first", 1, 1), picky]);
    // n2 is taken by a pod the operator does not manage.
    let mut other = pod("other", 1, 0);
    other.gated = false;
    other.node_name = Some("n2".into());
    other.phase = PodPhase::Running;
    other.unmanaged = true;
    s.pods.push(other);
    settle(&mut s);
    assert_eq!(phase(&s, "first"), LeasePhase::Admitted);
    assert_eq!(phase(&s, "picky"), LeasePhase::Queued);
    let msg = message(&s, "picky");
    assert!(
        msg.contains(
            "on the one node its own nodeSelector, affinity and tolerations allow (0 free there"
        ),
        "{msg}"
    );
    assert!(
        s.leases.iter().all(|l| l.key != key("other")),
        "a pod in an unmanaged namespace gets no lease"
    );
}

#[test]
fn largest_node_is_the_rule_the_queue_applies() {
    let mut cordoned = node("big-cordoned", 8);
    cordoned.unschedulable = true;
    let mut s = world(vec![cordoned, node("small", 2)], vec![pod("p", 4, 1)]);
    settle(&mut s);
    assert_eq!(
        gpupool_engine::largest_node(&s.classes[0], &s.nodes, &s.pods[0]),
        Ok(Some(("small", 2)))
    );
    assert_eq!(phase(&s, "p"), LeasePhase::Queued);
    assert!(
        message(&s, "p").contains("largest matching node has 2"),
        "{}",
        message(&s, "p")
    );
}

#[test]
fn a_lost_admission_goes_back_behind_an_earlier_primary_that_waits_again() {
    let mut s = world(
        vec![node("n1", 1), node("n2", 2)],
        vec![pod("p0", 1, 1), pod("p1", 2, 2)],
    );
    let plan = decide(&s);
    apply(&mut s, &plan);
    // Both are admitted, but only their lease writes land: the pod patches
    // are lost (the operator restarted in between).
    let plan = decide(&s);
    assert_eq!(plan.admissions.len(), 2);
    for l in &mut s.leases {
        if let Some(st) = plan.lease_status(&l.key) {
            *l.status_mut() = Some(st.clone());
        }
    }
    // p0's node goes away: it waits again, ahead of p1, whose pod never
    // started. StrictFIFO: p0 takes n2 first and p1 waits behind it.
    s.nodes.retain(|n| n.name != "n1");
    let plan = decide(&s);
    let admitted: Vec<(&str, &str)> = plan
        .admissions
        .iter()
        .map(|a| (a.key.name.as_ref(), a.node.as_str()))
        .collect();
    assert_eq!(admitted, [("p0", "n2")]);
    let p1 = plan.lease_status(&key("p1")).expect("p1's status changes");
    assert_eq!(p1.phase, LeasePhase::Queued);
    assert_eq!(
        p1.admitted_at, None,
        "not admitted any more: admitted again later, at that time"
    );
}

#[test]
fn a_refused_eviction_says_so_on_its_lease_and_asks_for_a_retry_pass() {
    let mut s = world(vec![node("n1", 1)], vec![helper("h1", 1, 1)]);
    settle(&mut s);
    s.pods.push(pod("p1", 1, 10));
    let plan = settle_until_eviction(&mut s);
    let victim = plan.evictions[0].key.clone();
    for p in &mut s.pods {
        p.terminating = false;
    }
    // Not refused (lost, say): asked for again, nothing more.
    let plan = decide(&s);
    assert_eq!(plan.evictions.len(), 1);
    assert_eq!(plan.wake_at, None);
    assert!(plan.lease_status(&victim).is_none(), "{plan:?}");

    s.blocked_evictions.insert(
        victim.clone(),
        Refusals {
            first: s.now,
            last: s.now,
        },
    );
    let plan = decide(&s);
    assert_eq!(plan.evictions.len(), 1, "still asked for");
    assert!(!plan.evictions[0].delete, "a budget may delay it for now");
    assert_eq!(
        plan.evictions[0].not_before,
        Some(at(1002)),
        "asked for again {EVICTION_RETRY:?} after the refusal, not at once"
    );
    assert_eq!(
        plan.lease_progress
            .get(&victim)
            .and_then(|st| st.message.as_deref()),
        Some("preempted for primary team/p1; eviction blocked by a PodDisruptionBudget, retrying"),
        "a message change, for the budgeted writer"
    );
    assert_eq!(
        plan.wake_at,
        Some(at(1002)),
        "retried {EVICTION_RETRY:?} later"
    );

    // Refused for as long as its grace period (30 s): the budget has delayed
    // the preemption as long as it may, and the pod is deleted instead.
    s.now = at(1000 + 29);
    let plan = decide(&s);
    assert!(!plan.evictions[0].delete, "29 s of refusals, 30 s grace");
    s.now = at(1000 + 30);
    let plan = decide(&s);
    assert_eq!(plan.evictions.len(), 1);
    assert!(
        plan.evictions[0].delete,
        "deleted once the grace period has passed"
    );

    // Once the eviction goes through, the pod terminates and the key is
    // no longer consulted.
    for p in &mut s.pods {
        if p.key == victim {
            p.terminating = true;
        }
    }
    let plan = decide(&s);
    assert!(plan.evictions.is_empty());
    assert_eq!(plan.wake_at, None);
}

#[test]
fn the_kept_engine_forgets_refusals_of_evictions_no_longer_wanted() {
    let mut engine = Engine::new();
    engine.set_eviction_blocked(&key("h1"), Some(at(1)));
    engine.set_eviction_blocked(&key("h2"), Some(at(2)));
    // A later refusal keeps the first one's time.
    engine.set_eviction_blocked(&key("h2"), Some(at(9)));
    let wanted = Eviction {
        key: key("h2"),
        pod_uid: "uid-h2".into(),
        for_primary: key("p1"),
        grace_period_seconds: 30,
        delete: false,
        not_before: None,
    };
    engine.forget_unwanted_evictions(std::slice::from_ref(&wanted));
    assert_eq!(
        engine.blocked_evictions().iter().collect::<Vec<_>>(),
        vec![(
            &key("h2"),
            &Refusals {
                first: at(2),
                last: at(9)
            }
        )]
    );
    engine.set_eviction_blocked(&key("h2"), None);
    assert!(engine.blocked_evictions().is_empty());
}

/// The class status of `s` with `updatedAt` at `stamp` seconds and one more
/// free slot than the engine will count, so it differs.
fn stale_class_status(s: &Snapshot, stamp: Option<i64>) -> gpupool_api::GpuLeaseClassStatus {
    let mut st = decide(s).class_statuses["default"].clone();
    st.free += 1;
    st.updated_at = stamp.map(|t| Time(at(t)));
    st
}

#[test]
fn a_class_status_is_written_at_most_once_per_period() {
    let mut s = world(vec![node("n1", 2)], vec![]);
    assert_eq!(s.now, at(1000));
    settle(&mut s);

    // Never written: written now, stamped with the pass's time.
    s.classes[0].status = None;
    let plan = decide(&s);
    assert_eq!(plan.class_writes.len(), 1);
    assert_eq!(plan.class_writes[0].class, "default");
    assert_eq!(plan.class_writes[0].updated_at, s.now);
    assert_eq!(plan.class_statuses["default"].updated_at, None, "unstamped");

    // Last written half a period ago: held back and not even built (its
    // per-GPU picture is the costliest part of a pass), its queue depth
    // still counted, a pass asked for when the period ends.
    s.now = at(1000) + jiff::SignedDuration::from_millis(500);
    s.classes[0].status = Some(stale_class_status(&s, Some(1000)));
    let plan = decide(&s);
    assert!(plan.class_writes.is_empty(), "{:?}", plan.class_writes);
    assert!(plan.class_statuses.is_empty(), "{:?}", plan.class_statuses);
    assert_eq!(
        plan.queue_depths["default"],
        gpupool_engine::QueueDepth::default()
    );
    assert_eq!(plan.wake_at, Some(at(1000) + CLASS_STATUS_PERIOD));

    // A whole period later: written.
    s.now = at(1001);
    let plan = decide(&s);
    assert_eq!(plan.class_writes.len(), 1);
    assert_eq!(plan.wake_at, None);

    // A stamp from the future (another replica's clock) holds nothing back.
    s.classes[0].status = Some(stale_class_status(&s, Some(5000)));
    assert_eq!(decide(&s).class_writes.len(), 1);

    // Unchanged apart from the stamp, inside its period: the pass at the
    // period's end builds it, finds nothing to write and asks for nothing.
    let mut same = decide(&s).class_statuses["default"].clone();
    same.updated_at = Some(Time(at(1001)));
    s.classes[0].status = Some(same);
    assert_eq!(decide(&s).wake_at, Some(at(1001) + CLASS_STATUS_PERIOD));
    s.now = at(1002);
    let plan = decide(&s);
    assert!(plan.class_statuses.contains_key("default"));
    assert!(plan.class_writes.is_empty());
    assert_eq!(plan.wake_at, None);
}

#[test]
fn a_class_held_back_by_its_period_still_counts_its_queue() {
    let mut s = world(
        vec![node("n1", 1)],
        vec![
            pod("p1", 1, 1),
            pod("p2", 1, 2),
            pod("p3", 1, 3),
            helper("h1", 1, 4),
        ],
    );
    settle(&mut s);
    let built = decide(&s).class_statuses["default"].clone();
    assert_eq!((built.queued, built.queued_helpers), (2, 1));

    // Written at this very moment: not built again, its depth counted alike.
    let mut written = built.clone();
    written.updated_at = Some(Time(s.now));
    s.classes[0].status = Some(written);
    let plan = decide(&s);
    assert!(!plan.class_statuses.contains_key("default"));
    assert_eq!(
        plan.queue_depths["default"],
        gpupool_engine::QueueDepth {
            primaries: 2,
            helpers: 1
        }
    );
}

/// The status write `plan` makes for class `name`, if any.
fn class_write<'p>(plan: &'p Plan, name: &str) -> Option<&'p gpupool_engine::ClassWrite> {
    plan.class_writes.iter().find(|w| w.class == name)
}

#[test]
fn a_class_owner_is_told_once_when_the_class_turns_invalid() {
    let mut s = world(vec![node("n1", 1)], vec![]);
    settle(&mut s);
    // A second default, newer: it is the invalid one.
    let mut second = class("second");
    second.spec.default = true;
    second.created_at = Some(at(500));
    s.classes[0].created_at = Some(at(1));
    s.classes.push(second);
    let plan = decide(&s);
    let write = class_write(&plan, "second").expect("the new class's status is written");
    assert!(
        write
            .newly_invalid
            .as_deref()
            .is_some_and(|m| m.contains("default")),
        "{write:?}"
    );
    let first = class_write(&plan, "default");
    assert!(first.is_none_or(|w| w.newly_invalid.is_none()), "{first:?}");

    // Written: a later write (the counts changed) says nothing again.
    let invalid = plan.class_statuses["second"].clone();
    s.classes[1].status = Some(gpupool_api::GpuLeaseClassStatus {
        capacity: invalid.capacity + 1,
        ..invalid
    });
    let plan = decide(&s);
    let again = class_write(&plan, "second").expect("the counts changed");
    assert_eq!(again.newly_invalid, None);
}

#[test]
fn a_pass_is_due_when_the_first_young_helper_loses_its_protection() {
    let mut s = world(vec![node("n1", 3)], vec![]);
    s.classes[0].spec.helpers.min_runtime_seconds = 60;
    s.pods.push(helper("h1", 1, 1));
    settle(&mut s);
    // Admitted at the world's time, 1000: protected until 1060.
    assert_eq!(
        lease(&s, "h1").admitted_at.as_ref().map(|t| t.0),
        Some(at(1000))
    );
    assert_eq!(decide(&s).wake_at, Some(at(1060)));
    s.now = at(1030);
    s.pods.push(helper("h2", 1, 2));
    settle(&mut s);
    assert_eq!(decide(&s).wake_at, Some(at(1060)), "the earliest end");
    s.now = at(1061);
    assert_eq!(decide(&s).wake_at, Some(at(1090)), "h1's ended; h2's next");
    s.now = at(1100);
    assert_eq!(decide(&s).wake_at, None);
    s.classes[0].spec.helpers.min_runtime_seconds = 0;
    s.now = at(1030);
    assert_eq!(decide(&s).wake_at, None, "no protection, no wake-up");
}

#[test]
fn a_progress_limit_lists_the_front_of_the_queue_first() {
    // Names sort against queue order: "q9" was enqueued first, "q0" last.
    let names = ["q9", "q7", "q5", "q3", "q1", "q0"];
    let pods = names
        .iter()
        .enumerate()
        .map(|(i, n)| pod(n, 1, i as i64))
        .collect();
    let mut s = world(vec![node("n1", 1)], pods);
    settle(&mut s);
    assert_eq!(phase(&s, "q9"), LeasePhase::Admitted);
    assert_eq!(lease(&s, "q0").position, Some(5));
    // The head finishes: every waiting position moves up by one.
    finish(&mut s, "q9");
    let full = decide(&s);
    assert_eq!(
        full.lease_progress.len(),
        4,
        "{:?}",
        full.lease_progress.keys()
    );
    assert!(!full.progress_truncated);

    s.progress_limit = Some(2);
    let cut = decide(&s);
    let positions: Vec<(String, Option<u32>)> = cut
        .lease_progress
        .iter()
        .map(|(k, st)| (k.name.to_string(), st.position))
        .collect();
    assert_eq!(
        positions,
        vec![("q3".to_owned(), Some(2)), ("q5".to_owned(), Some(1))],
        "the two nearest the head, not the first two names"
    );
    assert!(cut.progress_truncated);
    assert_eq!(cut.lease_statuses, full.lease_statuses);
    assert_eq!(cut.admissions, full.admissions);
}

/// The kubelet refused a pod at admission (a GPU turned unhealthy as it was
/// ungated): the pod is Failed with the kubelet's reason and message, and its
/// lease says them, not only that it failed. A long message is cut.
#[test]
fn a_pod_the_kubelet_refused_is_released_saying_why() {
    let mut s = world(
        vec![node("n1", 3)],
        vec![pod("refused", 2, 1), pod("quiet", 1, 2)],
    );
    settle(&mut s);
    s.now = at(3000);
    let why = "UnexpectedAdmissionError: Allocate failed due to requested number of devices unavailable for gpupool/slot. Requested: 2, Available: 1, which is unexpected";
    for p in &mut s.pods {
        p.phase = PodPhase::Failed;
        if p.key == key("refused") {
            p.failure = Some(why.to_owned());
        }
    }
    settle(&mut s);
    assert_eq!(
        message(&s, "refused"),
        format!("released: pod failed: {why}")
    );
    assert_eq!(message(&s, "quiet"), "released: pod failed");

    let mut s = world(vec![node("n1", 1)], vec![pod("long", 1, 1)]);
    settle(&mut s);
    s.pods[0].phase = PodPhase::Failed;
    s.pods[0].failure = Some(format!("Evicted: {}", "é".repeat(400)));
    settle(&mut s);
    let long = message(&s, "long");
    assert!(
        long.starts_with("released: pod failed: Evicted: é"),
        "{long}"
    );
    assert!(
        long.ends_with('…') && long.len() < 600,
        "{} bytes",
        long.len()
    );
}

/// An admitted pod pinned to `node` that the scheduler has not bound.
fn pinned(mut p: PodInfo, node: &str) -> PodInfo {
    p.gated = false;
    p.node_selector.insert(LABEL_HOSTNAME.into(), node.into());
    p
}

#[test]
fn a_pod_carrying_another_gate_takes_no_slot_and_holds_no_one_up() {
    let mut held = pod("held", 1, 1);
    held.other_gate = Some("example.com/quota".into());
    let mut s = world(vec![node("n1", 1)], vec![held, pod("next", 1, 2)]);
    settle(&mut s);
    assert_eq!(phase(&s, "held"), LeasePhase::Queued);
    assert!(
        message(&s, "held").contains("scheduling gate example.com/quota"),
        "{}",
        message(&s, "held")
    );
    assert_eq!(
        phase(&s, "next"),
        LeasePhase::Admitted,
        "StrictFIFO: the pod behind it is not blocked"
    );
    // Its gate gone, it queues with its place (first): it is admitted when
    // the slot is free again.
    s.pods
        .iter_mut()
        .filter(|p| p.key == key("held"))
        .for_each(|p| p.other_gate = None);
    settle(&mut s);
    assert_eq!(phase(&s, "held"), LeasePhase::Queued);
    assert_eq!(lease(&s, "held").position, Some(1));
    finish(&mut s, "next");
    settle(&mut s);
    assert_eq!(phase(&s, "held"), LeasePhase::Admitted);
}

#[test]
fn an_admitted_pod_the_scheduler_cannot_place_gives_its_slots_back_after_the_timeout() {
    let mut s = world(
        vec![node("n1", 2)],
        vec![pod("big", 2, 1), pod("next", 1, 2)],
    );
    s.classes[0].spec.admission.placement_timeout_seconds = 30;
    // "big" was admitted to n1, but asks for more CPU than n1 has.
    let plan = decide(&s);
    apply(&mut s, &plan);
    let plan = decide(&s);
    assert_eq!(plan.admissions.len(), 1);
    let uid = plan.admissions[0].pod_uid.clone();
    for l in &mut s.leases {
        if let Some(st) = plan.lease_status(&l.key) {
            *l.status_mut() = Some(st.clone());
        }
    }
    let why = "0/1 nodes are available: 1 Insufficient cpu.";
    for p in &mut s.pods {
        if p.key == key("big") {
            *p = pinned(p.clone(), "n1");
            // As Kubernetes reports it: the condition's status has been
            // False since the pod was created gated.
            p.unplaced = Some(gpupool_engine::Unplaced {
                since: at(1),
                message: Some(why.into()),
            });
        }
    }
    // Before the timeout: it holds its slots, and its lease says when it
    // gives them back; a pass is due then.
    s.now = at(1010);
    let plan = decide(&s);
    assert!(plan.give_backs.is_empty());
    assert!(plan.admissions.is_empty(), "n1 is still full");
    assert_eq!(plan.wake_at, Some(at(1030)));
    let st = plan.lease_status(&key("big")).expect("a message change");
    let text = st.message.clone().unwrap_or_default();
    assert!(
        text.contains("cannot place it: 0/1 nodes are available: 1 Insufficient cpu."),
        "{text}"
    );
    // At the timeout: released with the scheduler's reason, and deleted.
    s.now = at(1030);
    let plan = decide(&s);
    assert_eq!(plan.give_backs.len(), 1);
    let g = &plan.give_backs[0];
    assert_eq!(
        (&g.key, &g.pod_uid, g.node.as_str()),
        (&key("big"), &uid, "n1")
    );
    assert!(
        g.reason.contains("for 30s") && g.reason.contains("Insufficient cpu"),
        "{}",
        g.reason
    );
    let st = plan.lease_status(&key("big")).expect("released");
    assert_eq!(st.phase, LeasePhase::Released);
    assert_eq!(st.message.as_deref(), Some(g.reason.as_str()));
    assert!(
        plan.admissions.is_empty(),
        "the slots are free once the pod is gone"
    );
    // A delete that did not happen is asked for again; once the pod is
    // being deleted it holds nothing, and the queue moves on.
    apply(&mut s, &plan);
    let again = decide(&s);
    assert_eq!(again.give_backs.len(), 1);
    for p in &mut s.pods {
        if p.key == key("big") {
            p.terminating = true;
        }
    }
    settle(&mut s);
    assert_eq!(phase(&s, "next"), LeasePhase::Admitted);
    assert_eq!(phase(&s, "big"), LeasePhase::Released);
}

#[test]
fn a_deleted_default_class_keeps_its_queue_and_leaves_running_pods_alone() {
    let mut s = world(
        vec![node("n1", 1)],
        vec![pod("run", 1, 1), pod("q1", 1, 2), pod("q2", 1, 3)],
    );
    settle(&mut s);
    let order: Vec<Option<u64>> = ["q1", "q2"].iter().map(|n| lease(&s, n).sequence).collect();
    let default = s.classes.remove(0);
    settle(&mut s);
    assert_eq!(
        phase(&s, "run"),
        LeasePhase::Admitted,
        "nothing running is released"
    );
    for name in ["q1", "q2"] {
        assert_eq!(phase(&s, name), LeasePhase::Rejected);
        assert!(
            message(&s, name).contains("GpuLeaseClass default does not exist"),
            "{}",
            message(&s, name)
        );
    }
    // Created again (under another name, still the default): the queue
    // comes back in its order.
    let mut again = default;
    again.name = "main".into();
    s.classes.push(again);
    settle(&mut s);
    let back: Vec<Option<u64>> = ["q1", "q2"].iter().map(|n| lease(&s, n).sequence).collect();
    assert_eq!(back, order);
    assert_eq!(lease(&s, "q1").position, Some(1));
    assert_eq!(lease(&s, "q2").position, Some(2));
    finish(&mut s, "run");
    settle(&mut s);
    assert_eq!(phase(&s, "q1"), LeasePhase::Admitted);
    assert_eq!(phase(&s, "q2"), LeasePhase::Queued);
}

#[test]
fn a_waiting_lease_names_the_cordon_and_the_taint_that_keep_it_off_nodes() {
    let mut cordoned = node("n1", 2);
    cordoned.unschedulable = true;
    let mut tainted = node("n2", 2);
    tainted.taints = vec![Taint {
        key: "gpu".into(),
        value: Some("maintenance".into()),
        effect: TaintEffect::NoSchedule,
    }];
    let mut s = world(vec![cordoned, tainted], vec![pod("p", 1, 1)]);
    settle(&mut s);
    assert_eq!(phase(&s, "p"), LeasePhase::Queued);
    assert_eq!(
        message(&s, "p"),
        "waiting: no node of class default is open to the pod \
         (1 node cordoned, 1 node tainted gpu=maintenance:NoSchedule without a toleration in the pod)"
    );
    // With an open node that is full, the note says why the others do not count.
    s.nodes.push(node("n3", 1));
    s.pods.push(pinned(
        PodInfo {
            node_name: Some("n3".into()),
            phase: PodPhase::Running,
            ..pod("other", 1, 0)
        },
        "n3",
    ));
    settle(&mut s);
    let text = message(&s, "p");
    assert!(
        text.ends_with("; 1 node cordoned, 1 node tainted gpu=maintenance:NoSchedule without a toleration in the pod"),
        "{text}"
    );
    // A pod that tolerates the taint is told only of the cordon.
    for p in &mut s.pods {
        if p.key == key("p") {
            p.tolerations = std::sync::Arc::new([Toleration {
                key: Some("gpu".into()),
                operator: TolerationOperator::Exists,
                value: None,
                effect: None,
            }]);
        }
    }
    settle(&mut s);
    assert_eq!(phase(&s, "p"), LeasePhase::Admitted, "n2 is open to it");
}
