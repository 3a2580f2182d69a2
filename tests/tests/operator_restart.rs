//! Reliability: 200 pods go through a simulated cluster while the real
//! operator is disturbed: killed with SIGKILL at random moments and
//! restarted; run as two leader-elected replicas whose leader is killed;
//! or served by an API server that fails 5% of requests and drops every
//! watch stream now and then. Throughout and afterwards every invariant of
//! DESIGN §5.8 must hold, as seen through the API and the device plugins'
//! reports of the kubelets' allocations (lease `status.gpus`).

mod operator_support;

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::time::{Duration, Instant};

use gpupool_api::{GpuLease, LeasePhase, Role};
use gpupool_sim::apiserver::FaultConfig;
use gpupool_sim::cluster::{Backend, ClusterConfig, OperatorMode};
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::ListParams;
use operator_support::{NS, PodSpec, Sim, gated, pinned_node};
use serde_json::json;

/// A small deterministic generator, so a failing seed can be replayed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// How the operator is disturbed during a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Chaos {
    /// One replica, killed with SIGKILL and restarted, several times.
    KillOperator,
    /// Two leader-elected replicas; the leader is killed and restarted.
    KillLeader,
    /// One replica; 5% of API requests fail with 500 and every watch
    /// stream is dropped every couple of seconds.
    ApiFaults,
}

const PODS: usize = 200;
const NODES: u32 = 4;
const GPUS: u32 = 2;

/// Retries a read that injected faults may fail, for up to 10 s.
async fn read<T, E, F, Fut>(what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
    E: std::fmt::Display,
{
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match f().await {
            Ok(v) => return v,
            Err(e) if Instant::now() >= deadline => panic!("{what}: {e}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

async fn list_pods(sim: &Sim) -> Vec<Pod> {
    let api: Api<Pod> = Api::namespaced(sim.client.clone(), NS);
    let params = ListParams::default();
    read("list pods", || api.list(&params)).await.items
}

async fn list_leases(sim: &Sim) -> BTreeMap<String, GpuLease> {
    let api: Api<GpuLease> = Api::namespaced(sim.client.clone(), NS);
    let params = ListParams::default();
    read("list leases", || api.list(&params))
        .await
        .items
        .into_iter()
        .map(|l| (l.metadata.name.clone().unwrap_or_default(), l))
        .collect()
}

/// Checks what must hold at every moment; panics naming the violation.
async fn check_now(sim: &Sim) {
    let pods = list_pods(sim).await;
    let mut per_node: BTreeMap<String, u32> = BTreeMap::new();
    for p in &pods {
        let phase = p.status.as_ref().and_then(|s| s.phase.as_deref());
        assert_ne!(
            phase,
            Some("Failed"),
            "pod {:?} failed (a kubelet refused it): {:?}",
            p.metadata.name,
            p.status
        );
        if gated(p) || matches!(phase, Some("Succeeded")) {
            continue;
        }
        if let Some(node) = pinned_node(p) {
            *per_node.entry(node).or_default() += 1;
        }
    }
    for (node, n) in &per_node {
        assert!(
            *n <= GPUS,
            "{n} pods hold or are pinned to {node}, which has {GPUS} slots"
        );
    }
    let running: BTreeSet<String> = pods
        .iter()
        .filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
        .filter_map(|p| p.metadata.name.clone())
        .collect();
    let mut holders: BTreeMap<String, String> = BTreeMap::new();
    for (name, l) in list_leases(sim).await {
        let Some(st) = l.status else { continue };
        // A finished pod's lease may still show its GPUs until the operator
        // (perhaps just restarted) releases it; only running pods hold GPUs.
        if !st.phase.holds_slots() || !running.contains(&name) {
            continue;
        }
        for g in st.gpus {
            if let Some(other) = holders.insert(g.uuid.clone(), name.clone()) {
                panic!("GPU {} held by both {other} and {name}", g.uuid);
            }
        }
    }
}

async fn chaos_run(seed: u64, chaos: Chaos) {
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let mut sim = Sim::start_with(ClusterConfig {
        nodes: NODES,
        gpus_per_node: GPUS,
        operator: OperatorMode::Required,
        operator_replicas: if chaos == Chaos::KillLeader { 2 } else { 1 },
        ready_timeout: Duration::from_secs(60),
        ..Default::default()
    })
    .await;
    sim.class(
        "default",
        json!({"default": true, "helpers": {"gracePeriodSeconds": 1}}),
    )
    .await;
    // Pod name → whether it is a helper (helpers may be evicted, and an
    // evicted pod is deleted together with its lease).
    let mut names: BTreeMap<String, bool> = BTreeMap::new();
    let mut runs = Vec::new();
    for i in 0..PODS {
        let name = format!("w{i:03}");
        let secs = 0.2 + (rng.below(8) as f64) / 10.0;
        let helper = rng.below(5) == 0;
        runs.push((name.clone(), secs));
        names.insert(name, helper);
    }
    // Created a few at a time, so that most of the run is still ahead when
    // the disturbances start, however slow the machine.
    for chunk in runs.chunks(8) {
        futures::future::join_all(chunk.iter().map(|(name, secs)| {
            let spec = if names[name] {
                PodSpec::helper(name, 1)
            } else {
                PodSpec::primary(name, 1)
            };
            sim.pod(spec.runs(*secs))
        }))
        .await;
    }

    // Only the in-memory API server injects faults; the kill runs need none.
    let faults = (chaos == Chaos::ApiFaults).then(|| {
        let faults = sim
            .cluster
            .api_server()
            .expect("fault injection needs the in-memory API server")
            .faults();
        faults
            .set(FaultConfig {
                error_rate: 0.05,
                error_code: 500,
                include_watches: true,
                ..FaultConfig::default()
            })
            .expect("valid fault settings");
        faults
    });

    let deadline = Instant::now() + Duration::from_secs(180);
    // Kills, or watch drops under Chaos::ApiFaults.
    let mut kills = 0;
    let mut next_kill = Instant::now() + Duration::from_millis(300 + rng.below(1500));
    // A disturbance is also due whenever the run passes one of these counts
    // of released leases, so that a fast machine cannot finish the run
    // before the disturbances the test is about have happened.
    let mut milestones: Option<Vec<usize>> = None;
    loop {
        check_now(&sim).await;
        let leases = list_leases(&sim).await;
        let existing = existing_pods(&sim).await;
        let released = leases
            .values()
            .filter(|l| {
                l.status
                    .as_ref()
                    .is_some_and(|s| s.phase == LeasePhase::Released)
            })
            .count();
        let done = existing.iter().all(|n| leases.contains_key(n)) && released == leases.len();
        if done {
            break;
        }
        if Instant::now() >= deadline {
            let pods: Api<Pod> = Api::namespaced(sim.client.clone(), NS);
            let mut stuck = Vec::new();
            for (name, l) in &leases {
                if l.status
                    .as_ref()
                    .is_some_and(|s| s.phase == LeasePhase::Released)
                {
                    continue;
                }
                let pod = pods.get_opt(name).await.ok().flatten();
                stuck.push(format!(
                    "{name}: lease {:?}; pod gated={:?} phase={:?} node={:?}",
                    l.status,
                    pod.as_ref().map(gated),
                    pod.as_ref().and_then(|p| p.status.as_ref()?.phase.clone()),
                    pod.as_ref()
                        .and_then(|p| p.spec.as_ref()?.node_name.clone()),
                ));
            }
            let without_lease: Vec<&String> = existing
                .iter()
                .filter(|n| !leases.contains_key(*n))
                .collect();
            panic!(
                "seed {seed}: not every pod finished within 180 s after {kills} kills; {} leases, pods without one: {without_lease:?}; not released:\n{}",
                leases.len(),
                stuck.join("\n")
            );
        }
        let milestones =
            milestones.get_or_insert_with(|| progress_milestones(&mut rng, chaos, released));
        let milestone_passed = milestones.get(kills).is_some_and(|m| released >= *m);
        if Instant::now() >= next_kill || milestone_passed {
            next_kill = Instant::now() + Duration::from_millis(300 + rng.below(2000));
            match chaos {
                Chaos::KillOperator if kills < disturbances(chaos) => {
                    sim.cluster
                        .kill_operator()
                        .await
                        .expect("kill -9 the operator");
                    kills += 1;
                    tokio::time::sleep(Duration::from_millis(rng.below(400))).await;
                    sim.cluster
                        .start_operator()
                        .await
                        .expect("the operator restarts");
                }
                Chaos::KillLeader if kills < disturbances(chaos) => {
                    // Only a leader that has been elected can be killed;
                    // until the follower takes over there is none.
                    let leader = read("read the leader", || sim.cluster.operator_leader()).await;
                    if let Some(i) = leader {
                        sim.cluster
                            .kill_operator_replica(i)
                            .await
                            .expect("kill -9 the leader");
                        kills += 1;
                        tokio::time::sleep(Duration::from_millis(rng.below(400))).await;
                        sim.cluster
                            .start_operator_replica(i)
                            .await
                            .expect("the killed replica restarts");
                    }
                }
                Chaos::ApiFaults => {
                    if let Some(faults) = &faults {
                        faults.drop_watches();
                    }
                    kills += 1;
                }
                _ => {}
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!("seed {seed}: {kills} disturbances ({chaos:?})");
    assert!(
        kills >= 3,
        "seed {seed}: the run ended after only {kills} disturbances"
    );
    if let Some(faults) = &faults {
        faults.clear();
    }

    // An evicted helper's lease goes with its pod through the garbage
    // collector, which on a real control plane runs a moment later.
    let gc_deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let existing = existing_pods(&sim).await;
        let orphans = list_leases(&sim)
            .await
            .into_keys()
            .filter(|name| !existing.contains(name))
            .count();
        if orphans == 0 || Instant::now() >= gc_deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // Afterwards: every pod ran and finished, with exactly one lease of its own.
    let pods: Api<Pod> = Api::namespaced(sim.client.clone(), NS);
    let pods: BTreeMap<String, Pod> = pods
        .list(&ListParams::default())
        .await
        .expect("list pods")
        .items
        .into_iter()
        .map(|p| (p.metadata.name.clone().unwrap_or_default(), p))
        .collect();
    let leases = list_leases(&sim).await;
    let mut sequences = BTreeSet::new();
    let mut primaries = Vec::new();
    let mut evicted = 0;
    for (name, helper) in &names {
        let Some(pod) = pods.get(name) else {
            // Only an evicted helper may be gone, and the operator said so.
            assert!(*helper, "seed {seed}: primary {name} vanished");
            assert!(
                sim.events(name)
                    .await
                    .iter()
                    .any(|(reason, _)| reason == "Preempted"),
                "seed {seed}: helper {name} is gone without a Preempted event"
            );
            assert!(
                !leases.contains_key(name),
                "seed {seed}: {name}'s lease outlived its pod"
            );
            evicted += 1;
            continue;
        };
        assert_eq!(
            pod.status.as_ref().and_then(|s| s.phase.as_deref()),
            Some("Succeeded"),
            "{name} ran to completion"
        );
        let lease = &leases[name];
        assert_eq!(
            Some(&lease.spec.pod_uid),
            pod.metadata.uid.as_ref(),
            "{name}'s lease is its own"
        );
        let st = lease.status.as_ref().expect("status");
        let seq = st.sequence.expect("sequence");
        assert!(sequences.insert(seq), "sequence {seq} given twice");
        if lease.spec.role == Role::Primary {
            primaries.push((
                seq,
                st.admitted_at.clone().expect("admittedAt").0,
                name.clone(),
            ));
        }
        let admitted_events = sim
            .events(name)
            .await
            .into_iter()
            .filter(|(r, _)| r == "Admitted")
            .count();
        assert!(
            admitted_events <= 1,
            "{name} admitted {admitted_events} times"
        );
    }
    // StrictFIFO: primaries admitted in sequence order (admittedAt has 1 s resolution).
    primaries.sort();
    for w in primaries.windows(2) {
        assert!(
            w[0].1 <= w[1].1,
            "seed {seed}: {} (seq {}) admitted at {} after {} (seq {}) at {}",
            w[0].2,
            w[0].0,
            w[0].1,
            w[1].2,
            w[1].0,
            w[1].1
        );
    }
    assert_eq!(
        leases.len() + evicted,
        PODS,
        "seed {seed}: one lease per pod that still exists"
    );
    sim.stop().await;
}

/// How many disturbances a run of this kind makes.
fn disturbances(chaos: Chaos) -> usize {
    match chaos {
        Chaos::KillOperator => 6,
        Chaos::KillLeader => 3,
        Chaos::ApiFaults => 6,
    }
}

/// Counts of released leases, rising, at which the next disturbance is due
/// at the latest: one per disturbance, spread with a seeded jitter over the
/// first 80% of what is left of the run once `released` leases are done.
fn progress_milestones(rng: &mut Rng, chaos: Chaos, released: usize) -> Vec<usize> {
    let n = disturbances(chaos);
    let step = (PODS.saturating_sub(released) * 8 / 10 / n).max(1);
    (0..n)
        .map(|k| released + step * k + rng.below(step as u64) as usize)
        .collect()
}

/// Names of the pods that exist now.
async fn existing_pods(sim: &Sim) -> BTreeSet<String> {
    list_pods(sim)
        .await
        .into_iter()
        .filter_map(|p| p.metadata.name)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_during_a_200_pod_run_seed_1() {
    chaos_run(1, Chaos::KillOperator).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_during_a_200_pod_run_seed_2() {
    chaos_run(2, Chaos::KillOperator).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_during_a_200_pod_run_seed_3() {
    chaos_run(3, Chaos::KillOperator).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_with_the_leader_killed_during_a_200_pod_run() {
    chaos_run(4, Chaos::KillLeader).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_percent_api_errors_and_dropped_watches_during_a_200_pod_run() {
    if Backend::from_env().is_real() {
        // Asked of a real kube-apiserver, which injects no faults: a failure
        // in CI (which runs this test in memory only), a skip elsewhere.
        gpupool_sim_apiserver::tool_check::missing(
            "the fault-injection run",
            "the in-memory API server",
            "a real kube-apiserver injects no faults (run it without GPUPOOL_E2E_BACKEND)",
        );
        return;
    }
    chaos_run(5, Chaos::ApiFaults).await;
}

/// A pod of `containers` (name, resources) and `init` containers, in `NS`.
fn pod_with(name: &str, containers: serde_json::Value, init: serde_json::Value) -> Pod {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"containers": containers, "initContainers": init}
    }))
    .expect("pod")
}

/// With every operator replica down, the pod webhook cannot answer. A pod
/// that asks for no extended resource is still created at once: the
/// webhook's match condition never sends it there. A pod asking for GPU
/// slots, in a container or an init container, is refused, and the refusal
/// names gpupool's webhook.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_operator_down_plain_pods_are_created_and_gpu_pods_refused() {
    let mut sim = Sim::start(1, 1).await;
    sim.cluster.kill_operator().await.expect("operator killed");
    let pods: Api<Pod> = Api::namespaced(sim.client.clone(), NS);
    let create = |pod: Pod| {
        let pods = pods.clone();
        async move {
            pods.create(&kube::api::PostParams::default(), &pod)
                .await
                .map_err(|e| e.to_string())
        }
    };
    let plain = pod_with("plain", json!([{"name": "c", "image": "sim"}]), json!([]));
    create(plain)
        .await
        .expect("a pod asking for nothing is created");
    let sized = pod_with(
        "sized",
        json!([{"name": "c", "image": "sim",
            "resources": {"requests": {"cpu": "100m", "memory": "64Mi", "hugepages-2Mi": "2Mi"},
                          "limits": {"memory": "64Mi", "hugepages-2Mi": "2Mi"}}}]),
        json!([]),
    );
    create(sized)
        .await
        .expect("a pod asking only for native resources is created");

    let gpu = pod_with(
        "gpu",
        json!([{"name": "c", "image": "sim", "resources": {"limits": {"gpupool/slot": "1"}}}]),
        json!([]),
    );
    let refused = create(gpu).await.expect_err("a GPU pod waits on gpupool");
    assert!(refused.contains("queue.pods.gpupool.io"), "{refused}");
    let init_gpu = pod_with(
        "init-gpu",
        json!([{"name": "c", "image": "sim"}]),
        json!([{"name": "i", "image": "sim", "resources": {"requests": {"gpupool/slot": "1"}, "limits": {"gpupool/slot": "1"}}}]),
    );
    let refused = create(init_gpu)
        .await
        .expect_err("an init container's GPU counts too");
    assert!(refused.contains("queue.pods.gpupool.io"), "{refused}");
    sim.stop().await;
}

/// Two replicas serve the webhook. The certificate Secret is deleted and one
/// replica restarted: it makes a new certificate and writes its CA into the
/// webhook configurations. The other replica adopts the certificate from the
/// Secret rather than restoring its own CA, so the two never overwrite each
/// other: the configurations are written a bounded number of times, and pods
/// are still queued and admitted through the webhook.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_agree_on_one_certificate_after_the_secret_is_deleted() {
    use futures::StreamExt;
    use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
    use k8s_openapi::api::core::v1::Secret;
    use kube::runtime::watcher;

    let mut sim = Sim::start_with(ClusterConfig {
        nodes: 1,
        gpus_per_node: 1,
        operator: OperatorMode::Required,
        operator_replicas: 2,
        ready_timeout: Duration::from_secs(60),
        ..Default::default()
    })
    .await;
    sim.class("default", json!({"default": true})).await;
    let configs: Api<MutatingWebhookConfiguration> = Api::all(sim.client.clone());
    let mut writes = watcher(configs, watcher::Config::default()).boxed();
    // The initial listing, so that every later write is seen.
    while let Some(event) = writes.next().await {
        if matches!(event, Ok(watcher::Event::InitDone)) {
            break;
        }
    }

    let secrets: Api<Secret> = Api::namespaced(sim.client.clone(), "gpupool-system");
    secrets
        .delete("gpupool-webhook-tls", &kube::api::DeleteParams::default())
        .await
        .expect("the webhook Secret deleted");
    sim.cluster
        .kill_operator_replica(1)
        .await
        .expect("replica killed");
    sim.cluster
        .start_operator_replica(1)
        .await
        .expect("replica restarted");

    let window = Instant::now() + Duration::from_secs(30);
    let mut changes = 0;
    while let Ok(Some(event)) = tokio::time::timeout_at(window.into(), writes.next()).await {
        if let Ok(watcher::Event::Apply(config)) = event {
            eprintln!(
                "webhook configuration {} written (resourceVersion {:?})",
                config.metadata.name.unwrap_or_default(),
                config.metadata.resource_version
            );
            changes += 1;
        }
    }
    eprintln!("the mutating webhook configuration was written {changes} times in 30 s");
    assert!(
        changes <= 10,
        "the replicas keep rewriting the webhook configuration: {changes} writes in 30 s"
    );
    sim.pod(PodSpec::primary("after-the-restart", 1)).await;
    sim.wait_admitted("after-the-restart", 60).await;
    sim.stop().await;
}
