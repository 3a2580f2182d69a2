//! Decision-pass cost at cluster scale: 1,000 nodes × 8 GPUs, 6,000 admitted
//! leases filling every slot, 10,000 queued (20% helpers).
//!
//! (a) `full_pass`: a pass over the settled state (nothing to change).
//! (b) `pass_after_pod_finished`: the pass after one running pod is gone:
//!     the head is admitted and every queued lease's position moves.
//! (c) `full_pass_unsorted_input`: (a) with pods and leases in no order.
//! (d) `kept_engine_full_pass`: (a) on the engine's kept state.
//! (e) `kept_engine_after_pod_finished`: (b) on the engine's kept state: the
//!     pod's removal fed to it, then its pass (the pod is put back after
//!     each iteration, which is measured with it).
//! (f) `..._default_tolerations`: (e) with the progress limit, every pod
//!     carrying the two tolerations a real API server adds to each pod.
//! (g) `..._10000_finished`: (e) with the progress limit on a cluster that
//!     also keeps 10,000 finished pods and their Released leases.
//! (h) `kept_engine_settled_pod_arrives_progress_limit_200`: a new pod
//!     arrives behind the settled queue of (a), with the progress limit.
//! (i) `..._class_written`: (e) with the progress limit, the class status
//!     written less than a period ago, as it is for every pass but about
//!     one a second in the operator: its status is not built.

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use gpupool_api::{GpuLeaseStatus, LeaseGpu, LeasePhase, Role};
use gpupool_engine::fixtures::{self, at};
use gpupool_engine::{
    Engine, NodeInfo, ObjectKey, PodInfo, PodPhase, Snapshot, decide, decide_steps,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

const NODES: usize = 1_000;
const GPUS: u32 = 8;
const QUEUED: usize = 10_000;

fn pod(name: &str, role: Role, slots: u32, enq: i64) -> PodInfo {
    match role {
        Role::Primary => fixtures::pod(name, slots, enq),
        Role::Helper => fixtures::helper(name, slots, enq),
    }
}

/// The settled cluster: statuses as the engine itself would write them;
/// with `tolerations`, every pod carries the API server's default ones.
fn cluster(tolerations: bool) -> Snapshot {
    let nodes: Vec<NodeInfo> = (0..NODES)
        .map(|i| {
            let name = format!("node-{i:04}");
            fixtures::node(&name, GPUS)
        })
        .collect();
    let mut pods = Vec::new();
    let mut leases = Vec::new();
    let mut seq = 0u64;
    // Per node: two 2-slot and four 1-slot primaries, all running and bound.
    for (n, node) in nodes.iter().enumerate() {
        let mut gpu = 0u32;
        for (j, slots) in [2u32, 2, 1, 1, 1, 1].into_iter().enumerate() {
            seq += 1;
            let name = format!("run-{n:04}-{j}");
            let mut p = pod(&name, Role::Primary, slots, seq as i64);
            p.gated = false;
            p.phase = PodPhase::Running;
            p.node_name = Some(node.name.clone());
            let gpus = (gpu..gpu + slots)
                .map(|g| LeaseGpu {
                    index: g,
                    uuid: format!("GPU-{}-{g}", node.name),
                    product: None,
                })
                .collect();
            gpu += slots;
            leases.push(fixtures::lease(
                &p,
                "default",
                Some(GpuLeaseStatus {
                    phase: LeasePhase::Bound,
                    sequence: Some(seq),
                    node: Some(node.name.clone()),
                    gpus,
                    admitted_at: Some(Time(at(seq as i64))),
                    ..GpuLeaseStatus::default()
                }),
            ));
            pods.push(p);
        }
    }
    for i in 0..QUEUED {
        seq += 1;
        let role = if i % 5 == 4 {
            Role::Helper
        } else {
            Role::Primary
        };
        let name = format!("wait-{i:05}");
        let p = pod(&name, role, 1, seq as i64);
        leases.push(fixtures::lease(
            &p,
            "default",
            Some(GpuLeaseStatus {
                phase: LeasePhase::Queued,
                sequence: Some(seq),
                ..GpuLeaseStatus::default()
            }),
        ));
        pods.push(p);
    }
    if tolerations {
        // One list shared by every pod, as the operator keeps it.
        let shared: std::sync::Arc<[_]> = fixtures::default_tolerations().into();
        for p in &mut pods {
            p.tolerations = shared.clone();
        }
    }
    let mut s = Snapshot {
        now: at(100_000),
        classes: vec![fixtures::class("default")],
        nodes,
        pods,
        leases,
        blocked_evictions: Default::default(),
        progress_limit: None,
    };
    settle(&mut s);
    s
}

/// Writes the plan's statuses back, as the controller would.
fn settle(s: &mut Snapshot) {
    let plan = decide(s);
    for l in &mut s.leases {
        if let Some(st) = plan.lease_status(&l.key) {
            *l.status_mut() = Some(st.clone());
        }
    }
    for c in &mut s.classes {
        c.status = plan.class_statuses.get(&c.name).cloned();
    }
    let again = decide(s);
    assert!(
        again.all_lease_statuses().next().is_none(),
        "bench state is settled"
    );
    assert!(again.admissions.is_empty() && again.evictions.is_empty());
}

fn bench(c: &mut Criterion) {
    let settled = cluster(false);
    let mut g = c.benchmark_group("engine");
    g.sample_size(30);
    g.bench_function("full_pass", |b| b.iter(|| decide(black_box(&settled))));

    let mut after = settled.clone();
    let gone = ObjectKey::new("team", "run-0500-5");
    after.pods.retain(|p| p.key != gone);
    let plan = decide(&after);
    assert_eq!(plan.admissions.len(), 1, "the head takes the freed slot");
    assert!(plan.lease_progress.len() > QUEUED / 2, "positions move");
    g.bench_function("pass_after_pod_finished", |b| {
        b.iter(|| decide(black_box(&after)))
    });

    // (d) The kept engine, fed the one event (the pod is gone) and deciding.
    let kept = Engine::from_snapshot(&settled);
    let mut full = kept.clone();
    g.bench_function("kept_engine_full_pass", |b| b.iter(|| full.decide()));
    let mut engine = kept.clone();
    let finished = engine.pod(&gone).cloned();
    engine.remove_pod(&gone);
    assert!(
        engine.decide() == plan,
        "the kept engine decides as a full pass"
    );
    if let Some(pod) = finished.clone() {
        engine.upsert_pod(pod);
    }
    // One pod's removal decided on the kept state, then put back for the
    // next iteration.
    let decide_without = |engine: &mut Engine| {
        let finished = engine.remove_pod(&gone);
        let plan = engine.decide();
        if let Some(pod) = finished {
            engine.upsert_pod(pod);
        }
        plan
    };
    g.bench_function("kept_engine_after_pod_finished", |b| {
        b.iter(|| decide_without(&mut engine))
    });

    // (e) As the operator runs it: the kept engine handing over at most
    // one second of the progress writer's default budget per pass.
    let mut limited = kept.clone();
    limited.set_progress_limit(Some(200));
    g.bench_function("kept_engine_after_pod_finished_progress_limit_200", |b| {
        b.iter(|| decide_without(&mut limited))
    });

    // (f) As on a real cluster, where every pod tolerates not-ready and
    // unreachable nodes.
    let mut tolerant = Engine::from_snapshot(&cluster(true));
    tolerant.set_progress_limit(Some(200));
    g.bench_function(
        "kept_engine_after_pod_finished_progress_limit_200_default_tolerations",
        |b| b.iter(|| decide_without(&mut tolerant)),
    );

    // (g) (e) on a cluster that also keeps 10,000 finished pods with their
    // Released leases, as a cluster does whose Jobs leave their pods.
    let mut history = limited.clone();
    for i in 0..QUEUED {
        let mut p = pod(&format!("done-{i:05}"), Role::Primary, 1, i as i64);
        p.gated = false;
        p.phase = PodPhase::Succeeded;
        p.node_name = Some(format!("node-{:04}", i % NODES));
        history.upsert_lease(fixtures::lease(
            &p,
            "default",
            Some(GpuLeaseStatus {
                phase: LeasePhase::Released,
                // Above the rest; a pass does not compare them.
                sequence: Some((2 * QUEUED + i) as u64),
                message: Some("released".into()),
                ..GpuLeaseStatus::default()
            }),
        ));
        history.upsert_pod(p);
    }
    let mut plain = limited.clone();
    assert!(
        decide_without(&mut history) == decide_without(&mut plain),
        "finished pods change nothing"
    );
    g.bench_function(
        "kept_engine_after_pod_finished_progress_limit_200_10000_finished",
        |b| b.iter(|| decide_without(&mut history)),
    );

    // (h) A pod arrives at the back of a settled queue (every position
    // already written), under the progress limit: the pass compares the
    // waiting leases' statuses instead of writing them.
    let mut arrivals = limited.clone();
    let newcomer = pod("new-00000", Role::Primary, 1, 2 * QUEUED as i64);
    g.bench_function("kept_engine_settled_pod_arrives_progress_limit_200", |b| {
        b.iter(|| {
            arrivals.upsert_pod(newcomer.clone());
            let plan = arrivals.decide();
            arrivals.remove_pod(&newcomer.key);
            plan
        })
    });

    // (i) (e) inside the class status's period.
    let mut written = settled.clone();
    for c in &mut written.classes {
        if let Some(st) = &mut c.status {
            st.updated_at = Some(Time(written.now));
        }
    }
    let mut paced = Engine::from_snapshot(&written);
    paced.set_progress_limit(Some(200));
    let held = decide_without(&mut paced);
    assert!(
        held.class_statuses.is_empty() && held.wake_at.is_some(),
        "the class status waits for its period"
    );
    g.bench_function(
        "kept_engine_after_pod_finished_progress_limit_200_class_written",
        |b| b.iter(|| decide_without(&mut paced)),
    );

    let mut unsorted = settled.clone();
    // A fixed permutation: interleave from both ends.
    let reorder = |n: usize| -> Vec<usize> {
        (0..n)
            .map(|i| if i % 2 == 0 { i / 2 } else { n - 1 - i / 2 })
            .collect()
    };
    let order = reorder(unsorted.pods.len());
    unsorted.pods = order.iter().map(|&i| settled.pods[i].clone()).collect();
    let order = reorder(unsorted.leases.len());
    unsorted.leases = order.iter().map(|&i| settled.leases[i].clone()).collect();
    g.bench_function("full_pass_unsorted_input", |b| {
        b.iter(|| decide(black_box(&unsorted)))
    });
    g.finish();

    // Where (b) goes: each step's cost is the difference between the
    // prefixes that end before and after it; the plan is dropped outside
    // the measurement.
    let mut g = c.benchmark_group("steps_after_pod_finished");
    g.sample_size(20);
    for steps in 0..=6 {
        g.bench_function(format!("through_{steps}"), |b| {
            b.iter_with_large_drop(|| decide_steps(black_box(&after), steps))
        });
    }
    let mut kept_after = Engine::from_snapshot(&settled);
    kept_after.remove_pod(&gone);
    for steps in 0..=6 {
        g.bench_function(format!("kept_through_{steps}"), |b| {
            b.iter_with_large_drop(|| kept_after.decide_steps(black_box(steps)))
        });
    }
    g.bench_function("sort_pods_and_leases", |b| {
        b.iter(|| {
            let mut pods: Vec<&PodInfo> = after.pods.iter().collect();
            pods.sort_by(|a, b| a.key.cmp(&b.key));
            let mut leases: Vec<_> = after.leases.iter().collect();
            leases.sort_by(|a, b| a.key.cmp(&b.key));
            (pods.len(), leases.len())
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
