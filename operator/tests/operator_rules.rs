//! One test per admission rule (DESIGN §5), each on a simulated cluster
//! running the real operator and device-plugin binaries, checked through
//! what a user sees: leases, pod gates and pins, events, class status.

mod operator_support;

use std::collections::BTreeMap;

use gpupool_api::LeasePhase;
use operator_support::{PodSpec, Sim, gated, wait_for};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifo_order_with_shrinking_positions() {
    let sim = Sim::start(1, 1).await;
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

    // Users see it in events too.
    let events = sim.events("p3").await;
    let reasons: Vec<&str> = events.iter().map(|(r, _)| r.as_str()).collect();
    assert!(reasons.contains(&"Queued"), "{events:?}");
    assert!(reasons.contains(&"Admitted"), "{events:?}");
    assert!(reasons.contains(&"Released"), "{events:?}");
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
