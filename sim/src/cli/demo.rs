//! `gpupool-sim demo`: a scripted scenario on a 2-node × 2-GPU simulated
//! cluster — FIFO primaries, helpers filling idle GPUs, a helper preempted
//! for a primary — showing the queue as `kubectl get gpuleases` would and
//! one line per decision, read from the leases the operator writes.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::Context;
use gpupool_api::{GpuLease, GpuLeaseClass, GpuLeaseClassSpec, HelperSpec, LeasePhase, Role};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, PostParams};
use kube::{Client, ResourceExt};

use crate::cluster::workload::{phase, slot_pod, wait_until_webhook_knows_class};
use crate::cluster::{ClusterConfig, OperatorMode, SimCluster};

/// Arguments of `gpupool-sim demo`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The gpupool-operator binary (default: next to gpupool-sim).
    #[arg(long, env = "GPUPOOL_SIM_OPERATOR_BIN")]
    pub operator_bin: Option<std::path::PathBuf>,

    /// The gpupool-device-plugin binary (default: next to gpupool-sim).
    #[arg(long, env = "GPUPOOL_SIM_DEVICE_PLUGIN_BIN")]
    pub device_plugin_bin: Option<std::path::PathBuf>,

    /// Longest the scenario may run, in seconds.
    #[arg(long, env = "GPUPOOL_SIM_DEMO_TIMEOUT", default_value_t = 100, value_parser = clap::value_parser!(u64).range(10..=600))]
    pub timeout_seconds: u64,

    /// Run on a real Kubernetes control plane from this envtest assets
    /// directory (etcd, kube-apiserver, kube-scheduler,
    /// kube-controller-manager) instead of the in-memory API server; the
    /// simulator then runs only the kubelets, device plugins and operator.
    #[arg(long = "kube-assets", env = "KUBEBUILDER_ASSETS", value_name = "DIR")]
    pub kube_assets: Option<std::path::PathBuf>,

    /// Run directory for kubelet dirs, logs and kubeconfigs (default: a new
    /// directory under the system temp dir; kept after exit for its logs).
    #[arg(long, value_name = "DIR")]
    pub run_dir: Option<std::path::PathBuf>,
}

impl Args {
    /// The run directory: --run-dir, else a fresh one.
    pub fn resolved_run_dir(&self) -> std::path::PathBuf {
        self.run_dir
            .clone()
            .unwrap_or_else(crate::cluster::sim::fresh_run_dir)
    }
}

/// What the demo says first: the two kinds of pod its story is about.
const ROLES: &str = "\
gpupool queues pods that ask for GPU slots. Each is one of two roles:
  primary  gets GPUs in strict arrival order (first come, first served)
  helper   uses only GPUs no primary is waiting for, and is evicted
           (preempted) as soon as a primary needs its GPU";

/// How to read the tables, once the operator runs.
const PHASES: &str = "\
Each pod gets a GpuLease; the tables list them as `kubectl get gpuleases` does.
PHASE is the lease's: Queued -> Admitted (given a node) -> Bound (given its
GPUs: running) -> Released (ended). A helper being evicted is Preempting;
when its pod is gone, its lease goes too.";

/// One pod the scenario submits.
#[derive(Debug, Clone, Copy)]
struct Arrival {
    at: f64,
    name: &'static str,
    role: Role,
    slots: u32,
    runs: f64,
}

/// 6 primaries and 3 helpers on 4 GPUs: the helpers take idle GPUs, a
/// 2-GPU primary makes the operator preempt helpers, later primaries queue.
const SCRIPT: [Arrival; 9] = [
    Arrival {
        at: 0.0,
        name: "primary-1",
        role: Role::Primary,
        slots: 1,
        runs: 6.0,
    },
    Arrival {
        at: 0.5,
        name: "helper-1",
        role: Role::Helper,
        slots: 1,
        runs: 30.0,
    },
    Arrival {
        at: 1.0,
        name: "helper-2",
        role: Role::Helper,
        slots: 1,
        runs: 30.0,
    },
    Arrival {
        at: 1.5,
        name: "helper-3",
        role: Role::Helper,
        slots: 1,
        runs: 30.0,
    },
    Arrival {
        at: 4.0,
        name: "primary-2",
        role: Role::Primary,
        slots: 2,
        runs: 5.0,
    },
    Arrival {
        at: 5.0,
        name: "primary-3",
        role: Role::Primary,
        slots: 1,
        runs: 4.0,
    },
    Arrival {
        at: 5.5,
        name: "primary-4",
        role: Role::Primary,
        slots: 2,
        runs: 4.0,
    },
    Arrival {
        at: 6.0,
        name: "primary-5",
        role: Role::Primary,
        slots: 1,
        runs: 3.0,
    },
    Arrival {
        at: 6.5,
        name: "primary-6",
        role: Role::Primary,
        slots: 1,
        runs: 3.0,
    },
];

/// A phase as the API writes it (`Queued`, `Bound`, …).
fn phase_name(phase: LeasePhase) -> String {
    serde_json::to_value(phase)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_default()
}

/// The plural of a role name: `primary` → `primaries`, `helper` → `helpers`.
fn plural_role(role: &str) -> String {
    match role.strip_suffix('y') {
        Some(stem) => format!("{stem}ies"),
        None => format!("{role}s"),
    }
}

/// What the demo shows of one lease.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LeaseView {
    /// Lease name (= pod name).
    pub name: String,
    /// Role.
    pub role: String,
    /// Phase.
    pub phase: String,
    /// Queue position while Queued.
    pub position: Option<u32>,
    /// Node once admitted.
    pub node: Option<String>,
    /// GPU indices the plugin reported.
    pub gpus: Vec<u32>,
    /// Who preempted it.
    pub preempted_by: Option<String>,
    /// The operator's message.
    pub message: Option<String>,
    /// FIFO ticket.
    pub sequence: Option<u64>,
    /// When the pod was queued.
    pub queued_at: Option<jiff::Timestamp>,
    /// When the operator admitted it.
    pub admitted_at: Option<jiff::Timestamp>,
}

impl LeaseView {
    /// Reads the view from a lease.
    pub fn of(lease: &GpuLease) -> Self {
        let status = lease.status.clone().unwrap_or_default();
        let phase = if lease.status.is_some() {
            phase_name(status.phase)
        } else {
            String::new()
        };
        Self {
            name: lease.name_any(),
            role: lease.spec.role.to_string(),
            phase,
            position: status.position,
            node: status.node,
            gpus: status.gpus.iter().map(|g| g.index).collect(),
            preempted_by: status.preempted_by,
            message: status.message,
            sequence: status.sequence,
            queued_at: status.queued_at.map(|t| t.0),
            admitted_at: status.admitted_at.map(|t| t.0),
        }
    }
}

/// Whether a lease in this phase has been admitted (it holds or held a
/// node's slots).
fn was_admitted(v: &LeaseView) -> bool {
    matches!(v.phase.as_str(), "Admitted" | "Bound" | "Preempting")
        || (v.phase == "Released" && v.node.is_some())
}

/// The narration lines for a lease that changed from `before` to `now`:
/// none when nothing a person cares about changed. Only what the lease says
/// is told, in the table's words (`admitted`, `bound`, …), and a lease that
/// went past `Admitted` between two looks still gets its "admitted" line.
pub fn narrate(before: Option<&LeaseView>, now: &LeaseView) -> Vec<String> {
    let name = &now.name;
    let changed_phase = before.is_none_or(|b| b.phase != now.phase);
    let mut lines = Vec::new();
    let admitted_now = was_admitted(now) && !before.is_some_and(was_admitted);
    if admitted_now {
        lines.push(format!(
            "{name}: admitted to {}",
            now.node.as_deref().unwrap_or("a node")
        ));
    }
    let line = match now.phase.as_str() {
        "Queued" if changed_phase || before.is_some_and(|b| b.position != now.position) => {
            let why = now
                .message
                .as_deref()
                .map(|m| format!(" ({m})"))
                .unwrap_or_default();
            match now.position {
                Some(1) => format!("{name}: queued at the head of the {} queue{why}", now.role),
                Some(p) => format!(
                    "{name}: queued behind {}{why}",
                    crate::text::count(p.saturating_sub(1), &now.role, &plural_role(&now.role))
                ),
                None => format!("{name}: queued{why}"),
            }
        }
        "Bound" if changed_phase || before.is_some_and(|b| b.gpus != now.gpus) => format!(
            "{name}: bound to {} GPU {}, running",
            now.node.as_deref().unwrap_or("?"),
            gpupool_api::index_list(now.gpus.iter().copied())
        ),
        "Preempting" if changed_phase => format!(
            "{name}: preempted for {}; evicted within its grace period",
            now.preempted_by.as_deref().unwrap_or("a primary")
        ),
        "Released" if changed_phase => format!("{name}: released its slots"),
        "Rejected" if changed_phase => format!(
            "{name}: rejected: {}",
            now.message.as_deref().unwrap_or("no reason given")
        ),
        _ => return lines,
    };
    lines.push(line);
    lines
}

/// The line for a lease that is no longer listed: its pod was deleted, and
/// the lease, which the pod owns, with it.
pub fn narrate_gone(last: &LeaseView) -> String {
    match (last.phase.as_str(), last.preempted_by.as_deref()) {
        ("Preempting", Some(by)) => format!(
            "{}: evicted (preempted for {by}); its pod and lease are gone",
            last.name
        ),
        _ => format!("{}: its pod was deleted, and its lease with it", last.name),
    }
}

/// The table `kubectl get gpuleases` would print (without AGE).
pub fn table(views: &[LeaseView]) -> String {
    let mut rows = vec![[
        "NAME".to_owned(),
        "ROLE".to_owned(),
        "PHASE".to_owned(),
        "POSITION".to_owned(),
        "NODE".to_owned(),
        "GPU".to_owned(),
    ]];
    for v in views {
        rows.push([
            v.name.clone(),
            v.role.clone(),
            v.phase.clone(),
            v.position.map(|p| p.to_string()).unwrap_or_default(),
            v.node.clone().unwrap_or_default(),
            gpupool_api::index_list(v.gpus.iter().copied()),
        ]);
    }
    let widths: Vec<usize> = (0..6)
        .map(|c| rows.iter().map(|r| r[c].len()).max().unwrap_or(0))
        .collect();
    rows.iter()
        .map(|r| {
            let cells: Vec<String> = r
                .iter()
                .zip(&widths)
                .map(|(cell, w)| format!("{cell:<w$}"))
                .collect();
            format!("  {}", cells.join("   ").trim_end())
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// When the demo saw a pod arrive and its lease admitted, in seconds since
/// the scenario started: the times its story prints.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Seen {
    /// When the pod was created.
    pub arrived: f64,
    /// When the demo first saw its lease admitted.
    pub admitted: Option<f64>,
}

/// Seconds in whole tenths, rounded as `{:.1}` prints them.
fn tenths(seconds: f64) -> i64 {
    format!("{seconds:.1}")
        .replace('.', "")
        .parse()
        .unwrap_or(0)
}

/// The summary: each pod's wait, as the story told it (a lease's own
/// timestamps count whole seconds only), the preemptions, and, from the
/// leases' timestamps, whether FIFO order and the helper rule held.
pub fn summarize(
    views: &[LeaseView],
    seen: &BTreeMap<String, Seen>,
    preempted: &[(String, String)],
) -> Vec<String> {
    let mut lines = Vec::new();
    let mut by_sequence: Vec<&LeaseView> = views.iter().collect();
    by_sequence.sort_by_key(|v| (v.sequence.unwrap_or(u64::MAX), v.name.clone()));
    for v in &by_sequence {
        let waited = match seen.get(&v.name) {
            Some(Seen {
                arrived,
                admitted: Some(admitted),
            }) => {
                // In tenths, as the story prints them, so the difference is
                // the one a reader computes from the two times shown.
                let (from, to) = (tenths(*arrived), tenths(*admitted));
                format!(
                    "waited {}.{}s to be admitted ({}.{}s → {}.{}s)",
                    (to - from).max(0) / 10,
                    (to - from).max(0) % 10,
                    from / 10,
                    from % 10,
                    to / 10,
                    to % 10
                )
            }
            Some(Seen { admitted: None, .. }) => "was never admitted".to_owned(),
            None => match v.admitted_at {
                Some(_) => "was admitted".to_owned(),
                None => "was never admitted".to_owned(),
            },
        };
        lines.push(format!("{:<10} {:<8} {waited}", v.name, v.role));
    }
    for (helper, by) in preempted {
        lines.push(format!("{helper} was preempted for {by}"));
    }
    let primaries: Vec<&&LeaseView> = by_sequence.iter().filter(|v| v.role == "primary").collect();
    let out_of_order: Vec<String> = primaries
        .windows(2)
        .filter_map(|w| match (w[0].admitted_at, w[1].admitted_at) {
            (Some(a), Some(b)) if b < a => Some(format!("{} before {}", w[1].name, w[0].name)),
            (None, Some(_)) => Some(format!(
                "{} while {} was never admitted",
                w[1].name, w[0].name
            )),
            _ => None,
        })
        .collect();
    if out_of_order.is_empty() {
        lines.push("primaries were admitted in FIFO (sequence) order".to_owned());
    } else {
        lines.push(format!(
            "primaries admitted OUT of FIFO order: {}",
            out_of_order.join("; ")
        ));
    }
    let mut helper_breaches = Vec::new();
    for h in views.iter().filter(|v| v.role == "helper") {
        let Some(h_at) = h.admitted_at else { continue };
        for p in &primaries {
            let waiting =
                p.queued_at.is_some_and(|q| q < h_at) && p.admitted_at.is_none_or(|a| a > h_at);
            if waiting {
                helper_breaches.push(format!("{} admitted while {} waited", h.name, p.name));
            }
        }
    }
    if helper_breaches.is_empty() {
        lines.push("no helper was admitted while a primary waited".to_owned());
    } else {
        lines.push(format!(
            "helper rule broken: {}",
            helper_breaches.join("; ")
        ));
    }
    lines
}

/// Runs `gpupool-sim demo`.
pub async fn run(args: Args) -> anyhow::Result<()> {
    let real = args.kube_assets.is_some();
    let run_dir = args.resolved_run_dir();
    let config = ClusterConfig {
        backend: super::up::backend(args.kube_assets.as_ref()),
        ready_timeout: Duration::from_secs(if real { 90 } else { 30 }),
        nodes: 2,
        gpus_per_node: 2,
        sessions_per_gpu: 1,
        device_plugin_bin: args.device_plugin_bin,
        operator_bin: args.operator_bin,
        operator: OperatorMode::IfAvailable,
        run_dir: Some(run_dir.clone()),
        remove_run_dir: false,
        ..Default::default()
    };
    println!("{ROLES}\n");
    if real {
        println!(
            "Starting a real control plane with 2 simulated nodes × 2 GPUs, the real device plugin on each node…"
        );
    } else {
        println!(
            "Starting a simulated cluster: 2 nodes × 2 GPUs, the real device plugin on each node…"
        );
    }
    println!(
        "(logs in {}; RUST_LOG sets their level)",
        run_dir.join(super::logging::LOG_DIR).display()
    );
    let mut cluster = SimCluster::start(config)
        .await
        .context("starting the simulated cluster")?;
    let outcome = match cluster.operator_note().map(str::to_owned) {
        None => with_operator(&cluster, Duration::from_secs(args.timeout_seconds)).await,
        Some(note) => {
            println!("The operator is not running ({note}).");
            println!(
                "Showing only the device-plugin and scheduler side: pods are scheduled as they come, without gpupool's queue."
            );
            without_operator(&cluster, Duration::from_secs(args.timeout_seconds)).await
        }
    };
    let running = cluster.operator_running();
    let stopped = cluster.shutdown().await;
    outcome?;
    stopped.context("stopping the simulated cluster")?;
    if !running {
        println!(
            "(the operator was not running at the end; its log is in {})",
            run_dir.join(super::logging::LOG_DIR).display()
        );
    }
    Ok(())
}

/// Creates the pods whose time has come, telling each arrival, and returns
/// them with the time the story gave them.
async fn submit_due(
    client: &Client,
    start: Instant,
    next: &mut usize,
) -> anyhow::Result<Vec<(&'static str, f64)>> {
    let mut arrived = Vec::new();
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    while let Some(a) = SCRIPT.get(*next) {
        if start.elapsed().as_secs_f64() < a.at {
            break;
        }
        pods.create(
            &PostParams::default(),
            &slot_pod(a.name, a.slots, a.role, Some(a.runs)),
        )
        .await
        .with_context(|| format!("creating pod {}", a.name))?;
        let at = start.elapsed().as_secs_f64();
        arrived.push((a.name, at));
        println!(
            "[{at:>5.1}s] + {} arrives: {} asking for {}, runs {}s",
            a.name,
            a.role,
            crate::text::count(a.slots, "GPU", "GPUs"),
            a.runs
        );
        *next += 1;
    }
    Ok(arrived)
}

async fn with_operator(cluster: &SimCluster, timeout: Duration) -> anyhow::Result<()> {
    let client = cluster.client();
    let classes: Api<GpuLeaseClass> = Api::all(client.clone());
    let class = GpuLeaseClass::new(
        "default",
        GpuLeaseClassSpec {
            default: true,
            helpers: HelperSpec {
                grace_period_seconds: 1,
                ..Default::default()
            },
            ..Default::default()
        },
    );
    classes
        .create(&PostParams::default(), &class)
        .await
        .context("creating the default GpuLeaseClass")?;
    wait_until_webhook_knows_class(
        &Api::namespaced(client.clone(), "default"),
        "default",
        timeout,
    )
    .await?;
    println!(
        "Created GpuLeaseClass \"default\" (StrictFIFO, helpers preempted with a 1 s grace).\n"
    );
    println!("{PHASES}\n");
    let leases: Api<GpuLease> = Api::namespaced(client.clone(), "default");
    let start = Instant::now();
    let mut next = 0;
    let mut seen: BTreeMap<String, LeaseView> = BTreeMap::new();
    let mut times: BTreeMap<String, Seen> = BTreeMap::new();
    let mut gone: Vec<String> = Vec::new();
    let mut preempted = Vec::new();
    loop {
        for (name, at) in submit_due(&client, start, &mut next).await? {
            times.insert(
                name.to_owned(),
                Seen {
                    arrived: at,
                    admitted: None,
                },
            );
        }
        let list = leases
            .list(&ListParams::default())
            .await
            .context("listing GpuLeases")?;
        let at = start.elapsed().as_secs_f64();
        let mut views: Vec<LeaseView> = list.items.iter().map(LeaseView::of).collect();
        views.sort_by(|a, b| a.name.cmp(&b.name));
        let mut changed = false;
        for v in &views {
            let lines = narrate(seen.get(&v.name), v);
            for line in &lines {
                println!("[{at:>5.1}s] {line}");
            }
            changed |= !lines.is_empty();
            if was_admitted(v)
                && let Some(t) = times.get_mut(&v.name)
            {
                t.admitted.get_or_insert(at);
            }
            if v.phase == "Preempting" && seen.get(&v.name).is_none_or(|b| b.phase != v.phase) {
                preempted.push((v.name.clone(), v.preempted_by.clone().unwrap_or_default()));
            }
            seen.insert(v.name.clone(), v.clone());
        }
        // A deleted pod takes its lease with it: say so rather than let the
        // row vanish from the table.
        for (name, last) in &seen {
            if !gone.contains(name) && !views.iter().any(|v| &v.name == name) {
                println!("[{at:>5.1}s] {}", narrate_gone(last));
                gone.push(name.clone());
                changed = true;
            }
        }
        if changed {
            println!("{}\n", table(&views));
        }
        let all_submitted = next == SCRIPT.len();
        let primaries_done = all_submitted
            && SCRIPT.iter().filter(|a| a.role == Role::Primary).all(|a| {
                seen.get(a.name)
                    .is_some_and(|v| v.phase == phase_name(LeasePhase::Released))
            });
        if primaries_done {
            break;
        }
        if start.elapsed() > timeout {
            anyhow::bail!(
                "the scenario did not finish within {} s (--timeout-seconds); leases now:\n{}",
                timeout.as_secs(),
                table(&views)
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    println!("Summary after {:.1}s:", start.elapsed().as_secs_f64());
    let views: Vec<LeaseView> = seen.into_values().collect();
    for line in summarize(&views, &times, &preempted) {
        println!("  {line}");
    }
    Ok(())
}

async fn without_operator(cluster: &SimCluster, timeout: Duration) -> anyhow::Result<()> {
    let client = cluster.client();
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let start = Instant::now();
    let mut next = 0;
    let mut seen: BTreeMap<String, String> = BTreeMap::new();
    loop {
        submit_due(&client, start, &mut next).await?;
        let list = pods
            .list(&ListParams::default())
            .await
            .context("listing pods")?;
        for p in &list.items {
            let node = p.spec.as_ref().and_then(|s| s.node_name.clone());
            let gpus = crate::cluster::kubelet::pods::allocated_env(p).and_then(|e| {
                e.get("main")
                    .and_then(|m| m.get(gpupool_api::names::ENV_GPU_INDICES).cloned())
            });
            let state = match (phase(p), &node, &gpus) {
                ("Running", Some(n), Some(g)) => format!("running on {n} GPU {g}"),
                ("Succeeded", _, _) => "succeeded".to_owned(),
                ("Failed", _, _) => format!(
                    "failed: {}",
                    p.status
                        .as_ref()
                        .and_then(|s| s.message.clone())
                        .unwrap_or_default()
                ),
                (_, Some(n), _) => format!("scheduled to {n}"),
                _ => "waiting for a free GPU (unschedulable)".to_owned(),
            };
            let name = p.name_any();
            if seen.get(&name) != Some(&state) {
                println!("[{:>5.1}s] {name}: {state}", start.elapsed().as_secs_f64());
                seen.insert(name, state);
            }
        }
        let finished = next == SCRIPT.len()
            && list
                .items
                .iter()
                .all(|p| matches!(phase(p), "Succeeded" | "Failed"))
            && list.items.len() == SCRIPT.len();
        // Helpers run long; stop once every primary is done.
        let primaries_done = next == SCRIPT.len()
            && SCRIPT
                .iter()
                .filter(|a| a.role == Role::Primary)
                .all(|a| seen.get(a.name).is_some_and(|s| s == "succeeded"));
        if finished || primaries_done {
            break;
        }
        if start.elapsed() > timeout {
            anyhow::bail!(
                "the scenario did not finish within {} s (--timeout-seconds)",
                timeout.as_secs()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    println!(
        "Summary after {:.1}s: every pod got distinct GPUs from the real device plugin; without the operator there is no FIFO queue and no preemption.",
        start.elapsed().as_secs_f64()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(phase: &str) -> LeaseView {
        LeaseView {
            name: "p".into(),
            role: "primary".into(),
            phase: phase.into(),
            ..Default::default()
        }
    }

    #[test]
    fn narration_follows_the_lease() {
        let one = |lines: Vec<String>| -> Option<String> {
            assert!(lines.len() <= 1, "{lines:?}");
            lines.into_iter().next()
        };
        let mut queued = view("Queued");
        queued.position = Some(3);
        queued.message = Some("waiting: 2 primaries ahead".into());
        assert_eq!(
            one(narrate(None, &queued)).as_deref(),
            Some("p: queued behind 2 primaries (waiting: 2 primaries ahead)")
        );
        queued.position = Some(2);
        assert_eq!(
            one(narrate(None, &queued)).as_deref(),
            Some("p: queued behind 1 primary (waiting: 2 primaries ahead)")
        );
        queued.position = Some(1);
        assert_eq!(
            one(narrate(None, &queued)).as_deref(),
            Some("p: queued at the head of the primary queue (waiting: 2 primaries ahead)")
        );
        assert!(
            narrate(Some(&queued), &queued).is_empty(),
            "nothing changed"
        );
        let mut admitted = view("Admitted");
        admitted.node = Some("node-2".into());
        assert_eq!(
            one(narrate(Some(&queued), &admitted)).as_deref(),
            Some("p: admitted to node-2")
        );
        let mut bound = admitted.clone();
        bound.phase = "Bound".into();
        bound.gpus = vec![0, 1];
        // The table's word: PHASE says Bound.
        assert_eq!(
            one(narrate(Some(&admitted), &bound)).as_deref(),
            Some("p: bound to node-2 GPU 0,1, running")
        );
        let mut pre = bound.clone();
        pre.phase = "Preempting".into();
        pre.preempted_by = Some("default/primary-2".into());
        assert_eq!(
            one(narrate(Some(&bound), &pre)).as_deref(),
            Some("p: preempted for default/primary-2; evicted within its grace period")
        );
        assert_eq!(
            narrate_gone(&pre),
            "p: evicted (preempted for default/primary-2); its pod and lease are gone"
        );
        assert_eq!(
            narrate_gone(&queued),
            "p: its pod was deleted, and its lease with it"
        );
        let mut released = view("Released");
        released.node = Some("node-2".into());
        assert_eq!(
            one(narrate(Some(&pre), &released)).as_deref(),
            Some("p: released its slots")
        );
        assert!(narrate(None, &view("")).is_empty(), "no status yet");
    }

    /// A lease admitted and bound between two looks still gets its
    /// "admitted" line, before the "bound" one.
    #[test]
    fn an_admission_seen_late_is_still_told() {
        let mut bound = view("Bound");
        bound.node = Some("node-2".into());
        bound.gpus = vec![1];
        let want = ["p: admitted to node-2", "p: bound to node-2 GPU 1, running"];
        assert_eq!(narrate(None, &bound), want);
        assert_eq!(narrate(Some(&view("Queued")), &bound), want);
        // A lease released while queued was never admitted.
        assert_eq!(
            narrate(Some(&view("Queued")), &view("Released")),
            ["p: released its slots"]
        );
    }

    #[test]
    fn the_summary_checks_fifo_and_the_helper_rule_from_timestamps() {
        let t = |s: i64| Some(jiff::Timestamp::from_second(1_700_000_000 + s).expect("time"));
        let lease = |name: &str, role: &str, seq: u64, q: i64, a: Option<i64>| LeaseView {
            name: name.into(),
            role: role.into(),
            phase: "Released".into(),
            sequence: Some(seq),
            queued_at: t(q),
            admitted_at: a.and_then(t),
            ..Default::default()
        };
        let good = [
            lease("p1", "primary", 1, 0, Some(0)),
            lease("h1", "helper", 2, 1, Some(1)),
            lease("p2", "primary", 3, 2, Some(5)),
        ];
        // What the story saw: p2 arrived at 4.1 s and was admitted at 5.3 s
        // (its lease's whole seconds would say 4 and 5).
        let seen: BTreeMap<String, Seen> = [
            ("p1", 0.04, Some(0.2)),
            ("h1", 1.0, Some(1.2)),
            ("p2", 4.12, Some(5.26)),
        ]
        .into_iter()
        .map(|(n, arrived, admitted)| (n.to_owned(), Seen { arrived, admitted }))
        .collect();
        let lines = summarize(&good, &seen, &[("h1".into(), "default/p2".into())]);
        assert!(
            lines.contains(&"primaries were admitted in FIFO (sequence) order".to_owned()),
            "{lines:?}"
        );
        assert!(
            lines.contains(&"no helper was admitted while a primary waited".to_owned()),
            "{lines:?}"
        );
        assert!(
            lines.contains(
                &"p2         primary  waited 1.2s to be admitted (4.1s → 5.3s)".to_owned()
            ),
            "{lines:?}"
        );
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with("p1") && l.contains("waited 0.2s")),
            "{lines:?}"
        );
        assert!(lines.contains(&"h1 was preempted for default/p2".to_owned()));
        let bad = [
            lease("p1", "primary", 1, 0, Some(6)),
            lease("p2", "primary", 2, 1, Some(2)),
            lease("h1", "helper", 3, 3, Some(4)),
        ];
        let lines = summarize(&bad, &BTreeMap::new(), &[]);
        assert!(
            lines
                .iter()
                .any(|l| l.contains("OUT of FIFO order: p2 before p1")),
            "{lines:?}"
        );
        assert!(
            lines
                .iter()
                .any(|l| l.contains("h1 admitted while p1 waited")),
            "{lines:?}"
        );
    }

    #[test]
    fn tenths_round_as_the_story_prints() {
        assert_eq!(tenths(4.12), 41);
        assert_eq!(tenths(5.26), 53);
        assert_eq!(tenths(0.04), 0);
        assert_eq!(tenths(12.96), 130);
    }

    #[test]
    fn phases_and_roles_read_as_words() {
        assert_eq!(phase_name(LeasePhase::Released), "Released");
        assert_eq!(phase_name(LeasePhase::Queued), "Queued");
        assert_eq!(plural_role("primary"), "primaries");
        assert_eq!(plural_role("helper"), "helpers");
    }

    #[test]
    fn table_has_the_kubectl_columns() {
        let mut v = view("Bound");
        v.node = Some("node-1".into());
        v.gpus = vec![1];
        let t = table(&[v]);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 2);
        for col in ["NAME", "ROLE", "PHASE", "POSITION", "NODE", "GPU"] {
            assert!(lines[0].contains(col), "{t}");
        }
        assert!(
            lines[1].contains("node-1") && lines[1].contains("Bound"),
            "{t}"
        );
    }

    #[test]
    fn the_script_has_six_primaries_and_three_helpers_in_time_order() {
        assert_eq!(SCRIPT.iter().filter(|a| a.role == Role::Primary).count(), 6);
        assert_eq!(SCRIPT.iter().filter(|a| a.role == Role::Helper).count(), 3);
        assert!(SCRIPT.windows(2).all(|w| w[0].at <= w[1].at));
    }
}
