//! One test per admission rule (DESIGN §5), each on a simulated cluster
//! running the real operator and device-plugin binaries, checked through
//! what a user sees: leases, pod gates and pins, events, class status.

mod operator_support;

use std::collections::BTreeMap;

use gpupool_api::{GpuLeaseClass, LeasePhase};
use kube::Api;
use kube::api::PostParams;
use operator_support::{NS, PodSpec, Sim, gated, wait_for};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifo_order_with_shrinking_positions() {
    let mut sim = Sim::start(1, 1).await;
    sim.class("default", json!({"default": true})).await;
    let names = ["p1", "p2", "p3", "p4", "p5"];
    for (i, n) in names.iter().enumerate() {
        let secs = if i == 0 { 3.0 } else { 0.7 };
        sim.pod(PodSpec::primary(n, 1).runs(secs)).await;
    }
    // While p1 runs, the others wait at positions 1..4.
    let positions = wait_for("positions 1..4", 20, || async {
        let leases = sim.leases().await;
        let pos: Vec<Option<u32>> = names[1..]
            .iter()
            .map(|n| leases.get(*n).and_then(|l| l.status.as_ref()?.position))
            .collect();
        pos.iter().all(Option::is_some).then_some(pos)
    })
    .await;
    assert_eq!(positions, vec![Some(1), Some(2), Some(3), Some(4)]);
    // The queue-depth gauge counts the primaries that wait, on every pass,
    // while the class status is written at most once a second.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let gauge = sim.queue_depth("default", "primary").await;
        let queued = sim
            .leases()
            .await
            .values()
            .filter(|l| l.status.as_ref().map(|s| s.phase) == Some(LeasePhase::Queued))
            .count();
        if queued > 0 && gauge == i64::try_from(queued).ok() {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "queue depth gauge {gauge:?}, {queued} leases queued"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let p1 = sim
        .lease("p1")
        .await
        .and_then(|l| l.status)
        .map(|s| s.phase);
    assert!(
        matches!(p1, Some(LeasePhase::Admitted | LeasePhase::Bound)),
        "p1 holds the GPU: {p1:?}"
    );

    // Positions only ever shrink until each is admitted.
    let last: std::cell::RefCell<BTreeMap<String, u32>> = Default::default();
    let leases = wait_for("every pod released", 40, || {
        let last = &last;
        let sim = &sim;
        async move {
            let leases = sim.leases().await;
            let mut last = last.borrow_mut();
            for (name, l) in &leases {
                if let Some(p) = l.status.as_ref().and_then(|s| s.position) {
                    if let Some(prev) = last.get(name) {
                        assert!(p <= *prev, "{name}: position grew from {prev} to {p}");
                    }
                    last.insert(name.clone(), p);
                }
            }
            let done = leases.len() == names.len()
                && leases.values().all(|l| {
                    l.status
                        .as_ref()
                        .is_some_and(|s| s.phase == LeasePhase::Released)
                });
            done.then_some(leases)
        }
    })
    .await;
    // Admission order = creation order.
    let mut admitted: Vec<(jiff::Timestamp, String)> = leases
        .iter()
        .map(|(n, l)| {
            let at = l
                .status
                .as_ref()
                .and_then(|s| s.admitted_at.as_ref())
                .unwrap_or_else(|| panic!("{n} has admittedAt"))
                .0;
            (at, n.clone())
        })
        .collect();
    admitted.sort();
    let order: Vec<&str> = admitted.iter().map(|(_, n)| n.as_str()).collect();
    assert_eq!(order, names);
    let seqs: Vec<u64> = names
        .iter()
        .map(|n| {
            leases[*n]
                .status
                .as_ref()
                .and_then(|s| s.sequence)
                .expect("sequence")
        })
        .collect();
    assert!(
        seqs.windows(2).all(|w| w[0] < w[1]),
        "sequences follow creation: {seqs:?}"
    );

    // Users see it in events too: queued, then admitted. Its release has
    // none (the pod's phase and the lease's say it), so a finished pod costs
    // the API server no third Event.
    let events = sim.events("p3").await;
    let reasons: Vec<&str> = events.iter().map(|(r, _)| r.as_str()).collect();
    assert!(reasons.contains(&"Queued"), "{events:?}");
    assert!(reasons.contains(&"Admitted"), "{events:?}");
    assert!(!reasons.contains(&"Released"), "{events:?}");
    assert!(
        events
            .iter()
            .any(|(r, n)| r == "Queued" && n.contains("position 2")),
        "{events:?}"
    );
    sim.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn succeeded_pod_frees_its_slot_and_pod_is_pinned() {
    let sim = Sim::start(2, 1).await;
    sim.class("default", json!({"default": true})).await;
    sim.pod(PodSpec::primary("a", 1).runs(1.0)).await;
    sim.pod(PodSpec::primary("b", 1)).await;
    sim.pod(PodSpec::primary("c", 1)).await;
    let node_a = sim.wait_admitted("a", 20).await;
    let node_b = sim.wait_admitted("b", 20).await;
    assert_ne!(node_a, node_b, "one GPU each");
    let c = sim.wait_phase("c", LeasePhase::Queued, 10).await;
    assert_eq!(c.status.and_then(|s| s.position), Some(1));
    // a Succeeds after 1 s: c takes its slot, on a's node.
    sim.wait_phase("a", LeasePhase::Released, 20).await;
    let node_c = sim.wait_admitted("c", 20).await;
    assert_eq!(node_c, node_a);
    let pod = sim.get_pod("c").await.expect("c exists");
    assert!(!gated(&pod));
    // The scheduler bound it where the operator pinned it, and the device plugin reported its GPU.
    let bound = sim.wait_phase("c", LeasePhase::Bound, 20).await;
    let st = bound.status.expect("status");
    assert_eq!(st.node.as_deref(), Some(node_a.as_str()));
    assert_eq!(st.gpus.len(), 1, "GPU column filled by the device plugin");
    sim.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_on_two_gpus_shows_both_in_the_gpu_column() {
    let sim = Sim::start(1, 2).await;
    sim.class("default", json!({"default": true})).await;
    sim.pod(PodSpec::primary("wide", 2)).await;
    let bound = sim.wait_phase("wide", LeasePhase::Bound, 30).await;
    let st = bound.status.expect("status");
    let indexes: Vec<u32> = st.gpus.iter().map(|g| g.index).collect();
    assert_eq!(indexes, [0, 1], "one session per GPU: both GPUs");
    // The device plugin writes the list and its column in one patch.
    assert_eq!(st.gpu_indexes.as_deref(), Some("0,1"));
    let row = sim.lease_row("wide").await;
    assert_eq!(row.get("GPU"), Some(&json!("0,1")), "{row:?}");
    assert_eq!(row.get("Phase"), Some(&json!("Bound")), "{row:?}");
    assert_eq!(row.get("Node"), Some(&json!("node-1")), "{row:?}");
    sim.stop().await;
}

/// Holds `ms` milliseconds and then checks `cond` still holds: used to show
/// that something does NOT happen while a rule forbids it.
async fn stays<F, Fut>(what: &str, ms: u64, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let end = std::time::Instant::now() + std::time::Duration::from_millis(ms);
    while std::time::Instant::now() < end {
        assert!(cond().await, "{what}");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

async fn is_queued(sim: &Sim, name: &str) -> bool {
    let pod = sim.get_pod(name).await;
    let lease = sim.lease(name).await;
    pod.as_ref().is_some_and(gated)
        && lease
            .and_then(|l| l.status)
            .is_some_and(|s| s.phase == LeasePhase::Queued)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strict_fifo_blocks_behind_the_head_best_effort_passes_it() {
    let sim = Sim::start(1, 2).await;
    sim.class("default", json!({"default": true})).await;
    sim.pod(PodSpec::primary("busy", 1)).await;
    sim.wait_admitted("busy", 20).await;
    sim.pod(PodSpec::primary("big", 2)).await;
    sim.pod(PodSpec::primary("small", 1)).await;
    sim.wait_phase("small", LeasePhase::Queued, 10).await;
    stays("StrictFIFO: small waits behind big", 1500, || async {
        is_queued(&sim, "small").await && is_queued(&sim, "big").await
    })
    .await;
    let small = sim
        .lease("small")
        .await
        .and_then(|l| l.status)
        .expect("status");
    assert_eq!(small.position, Some(2));

    sim.class(
        "default",
        json!({"default": true, "admission": {"ordering": "BestEffortFIFO"}}),
    )
    .await;
    sim.wait_admitted("small", 20).await;
    assert!(
        is_queued(&sim, "big").await,
        "big still waits for 2 free slots"
    );
    // When busy and small end, big gets both GPUs.
    sim.delete_pod("busy").await;
    sim.delete_pod("small").await;
    sim.wait_admitted("big", 30).await;
    sim.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn helpers_fill_idle_gpus_but_never_while_a_primary_waits() {
    let sim = Sim::start(2, 1).await;
    sim.class(
        "default",
        json!({"default": true, "helpers": {"preemption": "Never"}}),
    )
    .await;
    sim.pod(PodSpec::helper("h1", 1)).await;
    sim.pod(PodSpec::helper("h2", 1)).await;
    let n1 = sim.wait_admitted("h1", 20).await;
    let n2 = sim.wait_admitted("h2", 20).await;
    assert_ne!(n1, n2, "helpers use both idle GPUs");

    // A primary now waits (no preemption in this class); a new helper must not pass it.
    sim.pod(PodSpec::primary("p", 1)).await;
    sim.wait_phase("p", LeasePhase::Queued, 10).await;
    sim.pod(PodSpec::helper("h3", 1)).await;
    sim.wait_phase("h3", LeasePhase::Queued, 10).await;
    // Free one GPU: the primary gets it, not the helper that is also waiting.
    sim.delete_pod("h1").await;
    let np = sim.wait_admitted("p", 30).await;
    assert_eq!(np, n1);
    assert!(is_queued(&sim, "h3").await, "h3 still waits");
    let class = wait_for("class status shows the waiting helper", 10, || async {
        let c = sim.get_class("default").await;
        c.status
            .filter(|s| s.queued_helpers == 1 && s.admitted == 1 && s.admitted_helpers == 1)
    })
    .await;
    assert_eq!(class.queued, 0);
    assert_eq!(class.capacity, 2);
    assert_eq!(class.free, 0);
    // With no primary waiting, the next free GPU goes to the helper.
    sim.delete_pod("h2").await;
    assert_eq!(sim.wait_admitted("h3", 30).await, n2);
    sim.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn primary_evicts_the_youngest_helper_and_waits_for_it_to_end() {
    let sim = Sim::start(1, 2).await;
    sim.class(
        "default",
        json!({"default": true, "helpers": {"gracePeriodSeconds": 1}}),
    )
    .await;
    sim.pod(PodSpec::helper("old", 1)).await;
    sim.wait_admitted("old", 20).await;
    // admittedAt has one-second resolution: make "younger" unambiguous.
    tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
    sim.pod(PodSpec::helper("young", 1)).await;
    sim.wait_admitted("young", 20).await;
    sim.wait_phase("young", LeasePhase::Bound, 20).await;

    sim.pod(PodSpec::primary("p", 1)).await;
    wait_for("the youngest helper is preempted for p", 20, || async {
        let events = sim.events("young").await;
        events
            .iter()
            .any(|(r, n)| r == "Preempted" && n.contains("ml/p"))
            .then_some(())
    })
    .await;
    // Whenever p is seen admitted, the helper's pod has already ended.
    wait_for("p admitted after the helper ended", 30, || async {
        let p = sim.get_pod("p").await?;
        if gated(&p) {
            return None;
        }
        let young = sim.get_pod("young").await;
        assert!(
            young.as_ref().is_none_or(|y| matches!(
                y.status.as_ref().and_then(|s| s.phase.as_deref()),
                Some("Succeeded" | "Failed")
            )),
            "p was admitted while the helper still held its GPU: {:?}",
            young.map(|y| y.status)
        );
        Some(())
    })
    .await;
    // Exactly the youngest: the old helper still holds its GPU.
    let old = sim.lease("old").await.and_then(|l| l.status).expect("old");
    assert!(
        matches!(old.phase, LeasePhase::Admitted | LeasePhase::Bound),
        "{old:?}"
    );
    assert!(
        sim.get_pod("old")
            .await
            .is_some_and(|p| p.metadata.deletion_timestamp.is_none())
    );
    assert!(
        sim.events("old")
            .await
            .iter()
            .all(|(r, _)| r != "Preempted"),
        "the older helper is not preempted"
    );
    sim.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn min_runtime_protects_a_young_helper() {
    let sim = Sim::start(1, 1).await;
    sim.class(
        "default",
        json!({"default": true, "helpers": {"minRuntimeSeconds": 4, "gracePeriodSeconds": 1}}),
    )
    .await;
    sim.pod(PodSpec::helper("h", 1)).await;
    sim.wait_admitted("h", 20).await;
    let h = sim.wait_phase("h", LeasePhase::Bound, 20).await;
    let h_admitted = h.status.and_then(|s| s.admitted_at).expect("h admitted").0;
    sim.pod(PodSpec::primary("p", 1)).await;
    sim.wait_phase("p", LeasePhase::Queued, 10).await;
    sim.wait_admitted("p", 30).await;
    let p = sim.lease("p").await.and_then(|l| l.status).expect("p");
    let ran = p
        .admitted_at
        .expect("p admitted")
        .0
        .duration_since(h_admitted);
    assert!(
        ran >= jiff::SignedDuration::from_secs(4),
        "the helper kept its GPU for its minimum runtime, got {ran:?}"
    );
    sim.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_disruption_budget_blocks_eviction_until_it_allows_it() {
    let sim = Sim::start(1, 1).await;
    // A budget may hold a helper for its grace period at most (see
    // a_disruption_budget_delays_a_helpers_preemption_by_its_grace_period_at_most):
    // 20 s, so that here the budget is what lets the eviction through.
    sim.class(
        "default",
        json!({"default": true, "helpers": {"gracePeriodSeconds": 20}}),
    )
    .await;
    let mut h = PodSpec::helper("h", 1);
    h.labels.push(("app", "guarded"));
    sim.pod(h).await;
    sim.wait_admitted("h", 20).await;
    sim.wait_phase("h", LeasePhase::Bound, 20).await;
    let pdbs: kube::Api<k8s_openapi::api::policy::v1::PodDisruptionBudget> =
        kube::Api::namespaced(sim.client.clone(), operator_support::NS);
    let pdb = serde_json::from_value(json!({
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": {"name": "guard", "namespace": operator_support::NS},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "guarded"}}}
    }))
    .expect("pdb");
    pdbs.create(&Default::default(), &pdb)
        .await
        .expect("create pdb");

    sim.pod(PodSpec::primary("p", 1)).await;
    let blocked = wait_for("lease says the PDB blocks eviction", 20, || async {
        let l = sim.lease("h").await?;
        let msg = l.status?.message?;
        msg.contains("PodDisruptionBudget").then_some(msg)
    })
    .await;
    assert!(blocked.contains("retrying"), "{blocked}");
    stays("the guarded helper keeps running", 1500, || async {
        sim.get_pod("h")
            .await
            .is_some_and(|p| p.metadata.deletion_timestamp.is_none())
            && is_queued(&sim, "p").await
    })
    .await;
    pdbs.delete("guard", &Default::default())
        .await
        .expect("delete pdb");
    sim.wait_admitted("p", 30).await;
    helper_gone(&sim, "h").await;
    sim.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_queued_pod_renumbers_the_queue() {
    let sim = Sim::start(1, 1).await;
    sim.class("default", json!({"default": true})).await;
    sim.pod(PodSpec::primary("busy", 1)).await;
    sim.wait_admitted("busy", 20).await;
    for n in ["q1", "q2", "q3"] {
        sim.pod(PodSpec::primary(n, 1)).await;
    }
    wait_for("positions 1,2,3", 10, || async {
        let ls = sim.leases().await;
        let pos: Vec<_> = ["q1", "q2", "q3"]
            .iter()
            .map(|n| ls.get(*n).and_then(|l| l.status.as_ref()?.position))
            .collect();
        (pos == vec![Some(1), Some(2), Some(3)]).then_some(())
    })
    .await;
    sim.delete_pod("q2").await;
    wait_for("q3 moves up to 2 and q2's lease goes", 10, || async {
        let ls = sim.leases().await;
        let q3 = ls.get("q3").and_then(|l| l.status.as_ref()?.position);
        let q1 = ls.get("q1").and_then(|l| l.status.as_ref()?.position);
        let q2_gone = ls.get("q2").is_none_or(|l| {
            l.status
                .as_ref()
                .is_some_and(|s| s.phase == LeasePhase::Released)
        });
        (q3 == Some(2) && q1 == Some(1) && q2_gone).then_some(())
    })
    .await;
    sim.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_selector_confines_a_class() {
    let sim = Sim::start(2, 1).await;
    let nodes: kube::Api<k8s_openapi::api::core::v1::Node> = kube::Api::all(sim.client.clone());
    nodes
        .patch(
            "node-2",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"metadata": {"labels": {"pool": "b"}}})),
        )
        .await
        .expect("label node-2");
    sim.class("default", json!({"default": true})).await;
    sim.class(
        "pool-b",
        json!({"nodeSelector": {"matchLabels": {"pool": "b"}}}),
    )
    .await;
    sim.pod(PodSpec::primary("b1", 1).class("pool-b")).await;
    sim.pod(PodSpec::primary("b2", 1).class("pool-b")).await;
    assert_eq!(sim.wait_admitted("b1", 20).await, "node-2");
    sim.wait_phase("b2", LeasePhase::Queued, 10).await;
    stays("b2 never goes to node-1, which is free", 1000, || async {
        is_queued(&sim, "b2").await
    })
    .await;
    // The default class spans both nodes and takes node-1.
    sim.pod(PodSpec::primary("d", 1)).await;
    assert_eq!(sim.wait_admitted("d", 20).await, "node-1");
    let b = wait_for("pool-b status", 10, || async {
        sim.get_class("pool-b")
            .await
            .status
            .filter(|s| s.queued == 1 && s.admitted == 1)
    })
    .await;
    assert_eq!(b.capacity, 1);
    assert_eq!(b.free, 0);
    assert!(
        b.queue
            .iter()
            .any(|q| q.lease == "ml/b2" && q.position == 1),
        "{:?}",
        b.queue
    );
    assert!(
        b.slots
            .iter()
            .any(|s| s.node == "node-2" && s.lease.as_deref() == Some("ml/b1")),
        "{:?}",
        b.slots
    );
    sim.stop().await;
}

/// Checks that helper `name`, whose primary has been admitted, was evicted
/// or deleted: its pod has ended (the primary is admitted only then) and
/// is being deleted, and is gone soon after. A simulated kubelet removes
/// it at once; a real one first reports its containers stopped, and the
/// pod object goes when the kubelet confirms it, a moment after the
/// primary may already be admitted.
async fn helper_gone(sim: &Sim, name: &str) {
    if let Some(pod) = sim.get_pod(name).await {
        assert!(
            pod.metadata.deletion_timestamp.is_some(),
            "the helper {name} was evicted: {:?}",
            pod.status
        );
    }
    wait_for(&format!("the helper {name}'s pod gone"), 30, || async {
        sim.get_pod(name).await.is_none().then_some(())
    })
    .await;
}

/// The class's condition of `type_`, as (status, reason, message).
async fn condition(sim: &Sim, class: &str, type_: &str) -> Option<(String, String, String)> {
    let status = sim.get_class(class).await.status?;
    status
        .conditions
        .into_iter()
        .find(|c| c.type_ == type_)
        .map(|c| (c.status, c.reason, c.message))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_default_class_is_refused_and_the_first_keeps_its_queue() {
    let sim = Sim::start(1, 1).await;
    sim.class("alpha", json!({"default": true})).await;
    let api: Api<GpuLeaseClass> = Api::all(sim.client.clone());
    let beta: GpuLeaseClass = serde_json::from_value(json!({
        "apiVersion": "gpupool.io/v1alpha1", "kind": "GpuLeaseClass",
        "metadata": {"name": "beta"}, "spec": {"default": true}
    }))
    .expect("class");
    let err = api
        .create(&PostParams::default(), &beta)
        .await
        .expect_err("a second default is refused at apply time");
    assert!(
        err.to_string().contains(
            "GpuLeaseClass \"alpha\" is already the default; at most one class may be marked default: true"
        ),
        "{err}"
    );
    // A non-default class may be created and may not become a default later.
    sim.class("beta", json!({})).await;
    let mut edited = api.get("beta").await.expect("beta");
    edited.spec.default = true;
    let err = api
        .replace("beta", &PostParams::default(), &edited)
        .await
        .expect_err("turning a second class into a default is refused");
    assert!(err.to_string().contains("already the default"), "{err}");
    // The default keeps working, for labelled and unlabelled pods alike.
    let (ready, _, _) = wait_for("alpha Ready", 10, || async {
        condition(&sim, "alpha", "Ready")
            .await
            .filter(|(s, _, _)| s == "True")
    })
    .await;
    assert_eq!(ready, "True");
    sim.pod(PodSpec::primary("p", 1)).await;
    assert_eq!(sim.wait_admitted("p", 20).await, "node-1");
    assert_eq!(
        sim.lease("p").await.expect("lease").spec.class_name,
        "alpha"
    );
    sim.stop().await;
}

/// A tenant may put a PodDisruptionBudget on its helper. The budget delays
/// the helper's preemption by at most the class's grace period: the
/// evictions it refuses are asked for again, and once they have been
/// refused for the grace period the operator deletes the helper, as
/// kube-scheduler's preemption does, and the waiting primary runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disruption_budget_delays_a_helpers_preemption_by_its_grace_period_at_most() {
    use k8s_openapi::api::policy::v1::PodDisruptionBudget;

    let sim = Sim::start(1, 1).await;
    sim.class(
        "default",
        json!({"default": true, "helpers": {"gracePeriodSeconds": 3}}),
    )
    .await;
    let mut helper = PodSpec::helper("guarded-helper", 1);
    helper.labels.push(("app", "guarded"));
    sim.pod(helper).await;
    sim.wait_phase("guarded-helper", LeasePhase::Bound, 60)
        .await;
    let budgets: Api<PodDisruptionBudget> = Api::namespaced(sim.client.clone(), NS);
    let budget: PodDisruptionBudget = serde_json::from_value(json!({
        "metadata": {"name": "keep-my-helper", "namespace": NS},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "guarded"}}}
    }))
    .expect("budget");
    budgets
        .create(&kube::api::PostParams::default(), &budget)
        .await
        .expect("the tenant's budget");

    let asked = std::time::Instant::now();
    sim.pod(PodSpec::primary("waiting-primary", 1)).await;
    let blocked = wait_for(
        "the helper's lease to say a budget blocks it",
        30,
        || async {
            let lease = sim.lease("guarded-helper").await?;
            let message = lease.status?.message?;
            message.contains("PodDisruptionBudget").then_some(message)
        },
    )
    .await;
    assert!(blocked.contains("preempted for primary"), "{blocked}");
    sim.wait_admitted("waiting-primary", 60).await;
    let waited = asked.elapsed();
    assert!(
        waited >= std::time::Duration::from_secs(3),
        "the budget held the helper for its grace period first ({waited:?})"
    );
    helper_gone(&sim, "guarded-helper").await;
    sim.stop().await;
}

/// A pod whose init containers (name, slots, restartable) come before one
/// app container `work` asking `app` slots: containers of the simulated
/// image, which [`Sim::create_pod`] makes run on real nodes too.
fn shaped_pod(name: &str, init: &[(&str, u32, bool)], app: u32) -> k8s_openapi::api::core::v1::Pod {
    let container = |name: &str, slots: u32| {
        json!({"name": name, "image": "sim",
            "resources": {"limits": {"gpupool/slot": slots.to_string()}}})
    };
    let init: Vec<_> = init
        .iter()
        .map(|(n, slots, restartable)| {
            let mut c = container(n, *slots);
            if *restartable {
                c["restartPolicy"] = json!("Always");
            }
            c
        })
        .collect();
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"initContainers": init, "containers": [container("work", app)]}
    }))
    .expect("pod")
}

/// The UUIDs Allocate gave container `c` (its `GPUPOOL_GPU_UUIDS`).
fn uuids_of(env: &BTreeMap<String, BTreeMap<String, String>>, c: &str) -> Vec<String> {
    env.get(c)
        .and_then(|e| e.get("GPUPOOL_GPU_UUIDS"))
        .map(|v| v.split(',').map(str::to_owned).collect())
        .unwrap_or_default()
}

/// Checks that pod `name`, asking `slots` by Kubernetes' count, runs with
/// that many slots: its lease says so, the kubelet holds that many devices
/// for it, the class has `free` slots left, and (where the backend records
/// it) Allocate handed its init container `init_uuids` GPUs, of which the
/// app container reuses one, and its sidecar (when `sidecar`) one more.
async fn runs_with(sim: &Sim, name: &str, slots: u32, init_uuids: usize, sidecar: bool, free: u32) {
    let lease = sim.wait_phase(name, LeasePhase::Bound, 60).await;
    assert_eq!(lease.spec.slots, slots, "{name}: the lease's slots");
    let pod = wait_for(&format!("{name} Running"), 60, || async {
        let p = sim.get_pod(name).await?;
        (p.status.as_ref()?.phase.as_deref() == Some("Running")).then_some(p)
    })
    .await;
    let node = pod
        .spec
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .expect("bound");
    let held = sim
        .cluster
        .allocated_devices(&node, &pod, "gpupool/slot")
        .expect("the kubelet's devices");
    assert_eq!(
        held.len(),
        usize::try_from(slots).expect("slots"),
        "{name}: the kubelet holds {held:?}"
    );
    let status = wait_for(&format!("class free = {free}"), 20, || async {
        sim.get_class("default")
            .await
            .status
            .filter(|s| s.free == free)
    })
    .await;
    assert_eq!(status.capacity, 3);
    // The GPUs the running containers use, from PodResources: a finished
    // init container's are not listed, the sidecar's and the app's are.
    let gpus = lease.status.expect("status").gpus;
    assert_eq!(gpus.len(), 1 + usize::from(sidecar), "{name}: {gpus:?}");
    if sim.cluster.backend().is_real() && !sim.cluster.backend().is_real_nodes() {
        return; // simulated kubelets on a real control plane record no environment
    }
    let env = wait_for(&format!("{name}'s allocated environment"), 30, || async {
        let env = sim.allocated_env(name).await?;
        (env.contains_key("work") && env.contains_key("setup")).then_some(env)
    })
    .await;
    let setup = uuids_of(&env, "setup");
    let work = uuids_of(&env, "work");
    assert_eq!(setup.len(), init_uuids, "{env:?}");
    assert_eq!(work.len(), 1, "{env:?}");
    assert!(
        setup.contains(&work[0]),
        "the app reuses its init container's GPU: {env:?}"
    );
    let side = uuids_of(&env, "side");
    if sidecar {
        assert_eq!(side.len(), 1, "{env:?}");
        assert!(
            !setup.contains(&side[0]),
            "the sidecar's GPU is its own: {env:?}"
        );
    } else {
        assert!(side.is_empty(), "{env:?}");
    }
}

/// Slots counted as Kubernetes counts them (KEP-753's effective request):
/// a sidecar (`restartPolicy: Always`) asking 1, then an init container
/// asking 2, then an app container asking 1 take 3 slots (the sidecar runs
/// beside the init container); an init container asking 2 and an app
/// container asking 1 take 2. The operator's lease, the scheduler's and
/// kubelet's accounting, and Allocate agree, on every backend: on real
/// nodes this is the real kube-scheduler and kubelet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn init_containers_and_sidecars_take_the_slots_kubernetes_counts() {
    let sim = Sim::start(1, 3).await;
    sim.class("default", json!({"default": true})).await;
    sim.pod(PodSpec::primary("busy", 1)).await;
    sim.wait_phase("busy", LeasePhase::Bound, 60).await;
    sim.create_pod(shaped_pod(
        "with-sidecar",
        &[("side", 1, true), ("setup", 2, false)],
        1,
    ))
    .await;
    sim.create_pod(shaped_pod("with-init", &[("setup", 2, false)], 1))
        .await;
    let a = sim.wait_phase("with-sidecar", LeasePhase::Queued, 20).await;
    assert_eq!(a.spec.slots, 3, "sidecar 1 + init 2 run side by side");
    let b = sim.wait_phase("with-init", LeasePhase::Queued, 20).await;
    assert_eq!(
        b.spec.slots, 2,
        "the app container reuses the init container's"
    );
    // Two slots are free: the 3-slot pod waits, and the 2-slot pod behind it.
    stays("with-sidecar waits for a third free slot", 2000, || async {
        is_queued(&sim, "with-sidecar").await && is_queued(&sim, "with-init").await
    })
    .await;
    sim.delete_pod("busy").await;
    runs_with(&sim, "with-sidecar", 3, 2, true, 0).await;
    assert!(
        is_queued(&sim, "with-init").await,
        "no slot is left for with-init"
    );
    sim.delete_pod("with-sidecar").await;
    runs_with(&sim, "with-init", 2, 2, false, 1).await;
    sim.stop().await;
}
