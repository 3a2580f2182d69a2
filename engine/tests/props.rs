//! Property tests: the engine driven through random event sequences in a
//! small in-test world that applies plans step by step as the controller
//! does (and can lose the tail of a plan, as an operator restart does),
//! checking DESIGN §5.8's invariants after every step, plus determinism,
//! stability and liveness.

use std::collections::{BTreeMap, BTreeSet};

use gpupool_api::names::LABEL_HOSTNAME;
use gpupool_api::{
    GpuLeaseClassSpec, GpuLeaseClassStatus, GpuLeaseStatus, LeaseGpu, LeasePhase, NodeGpu,
    Ordering, Placement, Preemption, Role,
};
use gpupool_engine::fixtures;
use gpupool_engine::{
    ClassInfo, EVICTION_RETRY, Engine, LeaseInfo, NodeInfo, ObjectKey, Plan, PodInfo, PodPhase,
    Refusals, Snapshot, Unplaced, decide,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, Time};
use proptest::prelude::*;

mod reference;

use gpupool_engine::fixtures::{RESOURCE as RES, at};

const CASES: u32 = 256;

/// Settings of one generated class.
#[derive(Debug, Clone)]
struct ClassCfg {
    strict: bool,
    spread: bool,
    admit_while_queued: bool,
    evict: bool,
    min_runtime: u32,
}

fn class_cfg() -> impl Strategy<Value = ClassCfg> {
    (
        any::<bool>(),
        any::<bool>(),
        prop::bool::weighted(0.25),
        prop::bool::weighted(0.75),
        prop_oneof![3 => Just(0u32), 1 => Just(30u32)],
    )
        .prop_map(
            |(strict, spread, admit_while_queued, evict, min_runtime)| ClassCfg {
                strict,
                spread,
                admit_while_queued,
                evict,
                min_runtime,
            },
        )
}

fn class_info(name: &str, cfg: &ClassCfg, narrow: bool) -> ClassInfo {
    let mut spec = GpuLeaseClassSpec {
        default: !narrow,
        ..GpuLeaseClassSpec::default()
    };
    spec.admission.ordering = if cfg.strict {
        Ordering::StrictFIFO
    } else {
        Ordering::BestEffortFIFO
    };
    spec.admission.placement = if cfg.spread {
        Placement::Spread
    } else {
        Placement::Pack
    };
    spec.helpers.admit_while_queued = cfg.admit_while_queued;
    spec.helpers.preemption = if cfg.evict {
        Preemption::Evict
    } else {
        Preemption::Never
    };
    spec.helpers.min_runtime_seconds = cfg.min_runtime;
    spec.snapshot.max_slots = 12;
    if narrow {
        spec.node_selector = Some(LabelSelector {
            match_labels: Some([("pool".to_owned(), "x".to_owned())].into()),
            match_expressions: None,
        });
    }
    ClassInfo {
        spec,
        ..fixtures::class(name)
    }
}

/// What can happen in the world between and during passes.
#[derive(Debug, Clone)]
enum Event {
    /// A pod arrives (class 0 = default, 1 = narrow, 2 = a class that does not exist).
    AddPod {
        name: u8,
        class: u8,
        helper: bool,
        slots: u32,
        ungated: bool,
    },
    /// One decision pass; `cut` loses the plan's tail (an operator restart).
    Pass {
        cut: Option<u16>,
        statuses_first: bool,
    },
    /// The scheduler binds pinned or placeable ungated pods.
    Bind,
    /// Device plugins report the GPUs of running admitted pods.
    Plugin,
    /// A pod finishes (Succeeded or Failed).
    Finish {
        pick: u8,
        fail: bool,
    },
    /// A pod is deleted (it terminates first when it runs).
    Delete {
        pick: u8,
    },
    /// Terminating pods are gone.
    Terminated,
    /// The garbage collector deletes leases whose pod is gone.
    Gc,
    AddNode {
        alloc: u32,
        pool: bool,
    },
    RemoveNode {
        pick: u8,
    },
    Resize {
        pick: u8,
        alloc: u32,
    },
    Tick {
        secs: u32,
    },
    /// A PodDisruptionBudget starts (or stops) refusing every eviction.
    Pdb {
        refuses: bool,
    },
    /// Someone edits a lease's spec behind the operator's back: its slots,
    /// and with `flip` its role.
    EditLease {
        pick: u8,
        slots: u32,
        flip: bool,
    },
    /// Another controller's scheduling gate on a pod arrives with it
    /// (`add`) or is removed from it.
    OtherGate {
        pick: u8,
        add: bool,
    },
    /// The pod can never be placed on its node (it asks for more CPU than
    /// the node has): the scheduler reports it unschedulable.
    Unfit {
        pick: u8,
    },
    /// A lease is deleted while the operator is down: the next pass knows
    /// nothing of it.
    LoseLease {
        pick: u8,
    },
    /// The class at `pick` is deleted, or the last deleted one is created
    /// again.
    ToggleClass {
        pick: u8,
    },
}

fn event() -> impl Strategy<Value = Event> {
    prop_oneof![
        6 => (0u8..12, prop_oneof![6 => Just(0u8), 3 => Just(1u8), 1 => Just(2u8)],
              prop::bool::weighted(0.35), 1u32..=3, prop::bool::weighted(0.1))
            .prop_map(|(name, class, helper, slots, ungated)| Event::AddPod { name, class, helper, slots, ungated }),
        8 => (prop::option::weighted(0.2, any::<u16>()), any::<bool>())
            .prop_map(|(cut, statuses_first)| Event::Pass { cut, statuses_first }),
        3 => Just(Event::Bind),
        2 => Just(Event::Plugin),
        3 => (any::<u8>(), any::<bool>()).prop_map(|(pick, fail)| Event::Finish { pick, fail }),
        1 => any::<u8>().prop_map(|pick| Event::Delete { pick }),
        2 => Just(Event::Terminated),
        1 => Just(Event::Gc),
        1 => (1u32..=4, any::<bool>()).prop_map(|(alloc, pool)| Event::AddNode { alloc, pool }),
        1 => any::<u8>().prop_map(|pick| Event::RemoveNode { pick }),
        1 => (any::<u8>(), 0u32..=4).prop_map(|(pick, alloc)| Event::Resize { pick, alloc }),
        2 => (1u32..=40).prop_map(|secs| Event::Tick { secs }),
        1 => any::<bool>().prop_map(|refuses| Event::Pdb { refuses }),
        1 => (any::<u8>(), 1u32..=3, any::<bool>())
            .prop_map(|(pick, slots, flip)| Event::EditLease { pick, slots, flip }),
        1 => (any::<u8>(), any::<bool>()).prop_map(|(pick, add)| Event::OtherGate { pick, add }),
        1 => any::<u8>().prop_map(|pick| Event::Unfit { pick }),
        1 => any::<u8>().prop_map(|pick| Event::LoseLease { pick }),
        1 => any::<u8>().prop_map(|pick| Event::ToggleClass { pick }),
    ]
}

/// A generated scenario: classes, starting nodes and events.
#[derive(Debug, Clone)]
struct Scenario {
    classes: Vec<ClassCfg>,
    nodes: Vec<(u32, bool)>,
    events: Vec<Event>,
}

fn scenario() -> impl Strategy<Value = Scenario> {
    (
        prop::collection::vec(class_cfg(), 1..=2),
        prop::collection::vec((1u32..=4, any::<bool>()), 1..=4),
        prop::collection::vec(event(), 1..40),
    )
        .prop_map(|(classes, nodes, events)| Scenario {
            classes,
            nodes,
            events,
        })
}

/// Scenarios whose queues grow longer than a class status lists
/// ([`gpupool_engine::QUEUE_HEAD`]): many pods of many names, few nodes.
fn crowded_scenario() -> impl Strategy<Value = Scenario> {
    let crowd = (0u8..64, 0u8..2, prop::bool::weighted(0.3), 1u32..=3).prop_map(
        |(name, class, helper, slots)| Event::AddPod {
            name,
            class,
            helper,
            slots,
            ungated: false,
        },
    );
    (
        prop::collection::vec(class_cfg(), 1..=2),
        prop::collection::vec((1u32..=4, any::<bool>()), 1..=3),
        prop::collection::vec(prop_oneof![3 => crowd, 2 => event()], 60..140),
    )
        .prop_map(|(classes, nodes, events)| Scenario {
            classes,
            nodes,
            events,
        })
}

/// The simulated cluster: the API server's objects and a few counters.
#[derive(Clone)]
struct World {
    s: Snapshot,
    next_uid: u64,
    next_node: u32,
    /// Sequence first seen per pod UID: it must never change.
    sequences: BTreeMap<String, u64>,
    /// A PodDisruptionBudget refuses every eviction.
    pdb_refuses: bool,
    /// Class statuses are written as the operator writes them: only those
    /// a pass says to write, stamped, so that later passes within
    /// [`CLASS_STATUS_PERIOD`] hold them back. Otherwise every class
    /// status a pass builds is stored unstamped.
    paced_class_statuses: bool,
    /// UIDs of pods no node can ever run: the scheduler reports them
    /// unschedulable rather than binding them.
    unfit: BTreeSet<String>,
    /// Classes deleted by `ToggleClass`, the last one first to come back.
    deleted_classes: Vec<ClassInfo>,
}

fn gpus(name: &str, n: u32) -> Vec<NodeGpu> {
    fixtures::node(name, n).gpus
}

fn is_live(p: &PodInfo) -> bool {
    !matches!(p.phase, PodPhase::Succeeded | PodPhase::Failed)
}

fn placed_on(p: &PodInfo) -> Option<&str> {
    p.node_name
        .as_deref()
        .or_else(|| p.node_selector.get(LABEL_HOSTNAME).map(String::as_str))
}

impl World {
    fn new(sc: &Scenario) -> Self {
        let mut classes = vec![class_info("default", &sc.classes[0], false)];
        if let Some(cfg) = sc.classes.get(1) {
            classes.push(class_info("narrow", cfg, true));
        }
        let mut w = World {
            s: Snapshot {
                now: at(0),
                classes,
                nodes: vec![],
                pods: vec![],
                leases: vec![],
                blocked_evictions: Default::default(),
                progress_limit: None,
            },
            next_uid: 0,
            next_node: 0,
            sequences: BTreeMap::new(),
            pdb_refuses: false,
            paced_class_statuses: false,
            unfit: BTreeSet::new(),
            deleted_classes: Vec::new(),
        };
        for &(alloc, pool) in &sc.nodes {
            w.add_node(alloc, pool);
        }
        w
    }

    fn add_node(&mut self, alloc: u32, pool: bool) {
        self.next_node += 1;
        let name = format!("node-{}", self.next_node);
        let mut labels = BTreeMap::new();
        if pool {
            labels.insert("pool".to_owned(), "x".to_owned());
        }
        self.s.nodes.push(NodeInfo {
            labels,
            ..fixtures::node(&name, alloc)
        });
    }

    /// Slots of the resource held per node by live pods bound or pinned there.
    fn usage(&self) -> BTreeMap<String, u32> {
        let mut used = BTreeMap::new();
        // A pod being deleted that is not bound holds nothing: the
        // scheduler never places it.
        for p in self
            .s
            .pods
            .iter()
            .filter(|p| is_live(p) && !(p.terminating && p.node_name.is_none()))
        {
            if let Some(n) = placed_on(p) {
                *used.entry(n.to_owned()).or_default() += p.requests.get(RES).copied().unwrap_or(0);
            }
        }
        used
    }

    fn alloc(&self, node: &str) -> Option<u32> {
        self.s
            .nodes
            .iter()
            .find(|n| n.name == node)
            .map(|n| n.allocatable.get(RES).copied().unwrap_or(0))
    }

    fn pick_pod(&self, pick: u8) -> Option<usize> {
        (!self.s.pods.is_empty()).then(|| pick as usize % self.s.pods.len())
    }

    fn apply_event(&mut self, ev: &Event) -> Result<(), TestCaseError> {
        match *ev {
            Event::AddPod {
                name,
                class,
                helper,
                slots,
                ungated,
            } => {
                let key = ObjectKey::new("team", format!("p{name}"));
                if self.s.pods.iter().any(|p| p.key == key) {
                    return Ok(()); // the API server refuses a second pod of that name
                }
                self.next_uid += 1;
                let default_exists = self.s.classes.iter().any(|c| c.spec.default);
                // Without a default class the webhook leaves an unlabelled
                // pod alone: it is created ungated and never queued.
                let ungated = ungated || (class == 0 && !default_exists);
                let class_label = match class {
                    0 => None,
                    1 if self.s.classes.len() > 1 => Some("narrow".to_owned()),
                    1 => None,
                    _ => Some("ghost".to_owned()),
                };
                let base = if helper {
                    fixtures::helper(&key.name, slots, 0)
                } else {
                    fixtures::pod(&key.name, slots, 0)
                };
                self.s.pods.push(PodInfo {
                    uid: format!("uid-{}", self.next_uid),
                    class_label,
                    enqueued_at: (!ungated).then_some(self.s.now),
                    created_at: self.s.now,
                    gated: !ungated,
                    other_gate: None,
                    unplaced: None,
                    ..base
                });
            }
            Event::Pass {
                cut,
                statuses_first,
            } => {
                self.pass(cut, statuses_first)?;
            }
            Event::Bind => self.bind(),
            Event::Plugin => self.plugin(),
            Event::Finish { pick, fail } => {
                if let Some(i) = self.pick_pod(pick) {
                    let p = &mut self.s.pods[i];
                    if p.phase == PodPhase::Running {
                        p.phase = if fail {
                            PodPhase::Failed
                        } else {
                            PodPhase::Succeeded
                        };
                    }
                }
            }
            Event::Delete { pick } => {
                if let Some(i) = self.pick_pod(pick) {
                    if self.s.pods[i].phase == PodPhase::Running {
                        self.s.pods[i].terminating = true;
                    } else {
                        self.s.pods.remove(i);
                    }
                }
            }
            Event::Terminated => {
                self.s.pods.retain(|p| !p.terminating);
            }
            Event::Gc => {
                let pods: BTreeSet<(ObjectKey, String)> = self
                    .s
                    .pods
                    .iter()
                    .map(|p| (p.key.clone(), p.uid.clone()))
                    .collect();
                self.s
                    .leases
                    .retain(|l| pods.contains(&(l.key.clone(), l.spec().pod_uid.clone())));
            }
            Event::AddNode { alloc, pool } => self.add_node(alloc, pool),
            Event::RemoveNode { pick } => {
                if !self.s.nodes.is_empty() {
                    let i = pick as usize % self.s.nodes.len();
                    let gone = self.s.nodes.remove(i).name;
                    // The pod garbage collector fails pods bound to a deleted node.
                    for p in &mut self.s.pods {
                        if p.node_name.as_deref() == Some(gone.as_str()) {
                            p.phase = PodPhase::Failed;
                        }
                    }
                }
            }
            Event::Resize { pick, alloc } => {
                if !self.s.nodes.is_empty() {
                    let i = pick as usize % self.s.nodes.len();
                    let n = &mut self.s.nodes[i];
                    n.allocatable.insert(RES.to_owned(), alloc);
                    n.gpus = gpus(&n.name, alloc);
                }
            }
            Event::Tick { secs } => {
                self.s.now += jiff::SignedDuration::from_secs(i64::from(secs));
            }
            Event::Pdb { refuses } => self.pdb_refuses = refuses,
            Event::OtherGate { pick, add } => {
                // Gates can only be removed after creation: one is added
                // to a pod that has not reached the queue yet.
                if let Some(i) = self.pick_pod(pick) {
                    let p = &mut self.s.pods[i];
                    if !add {
                        p.other_gate = None;
                    } else if p.gated && !self.s.leases.iter().any(|l| l.key == p.key) {
                        p.other_gate = Some("example.com/quota".into());
                    }
                }
            }
            Event::Unfit { pick } => {
                if let Some(i) = self.pick_pod(pick) {
                    let uid = self.s.pods[i].uid.clone();
                    self.unfit.insert(uid);
                }
            }
            Event::LoseLease { pick } => {
                if !self.s.leases.is_empty() {
                    let i = usize::from(pick) % self.s.leases.len();
                    let lost = self.s.leases.remove(i);
                    // Nothing remembers it: the lease made again is a new
                    // one, with a sequence of its own.
                    self.sequences.remove(&lost.spec().pod_uid);
                }
            }
            Event::ToggleClass { pick } => {
                if let Some(class) = self.deleted_classes.pop() {
                    self.s.classes.push(class);
                } else if !self.s.classes.is_empty() {
                    let i = usize::from(pick) % self.s.classes.len();
                    let gone = self.s.classes.remove(i);
                    self.deleted_classes.push(gone);
                }
            }
            Event::EditLease { pick, slots, flip } => {
                if !self.s.leases.is_empty() {
                    let i = usize::from(pick) % self.s.leases.len();
                    let spec = self.s.leases[i].spec_mut();
                    spec.slots = slots;
                    if flip {
                        spec.role = match spec.role {
                            Role::Primary => Role::Helper,
                            Role::Helper => Role::Primary,
                        };
                    }
                }
            }
        }
        Ok(())
    }

    /// The scheduler: binds pinned ungated pods to their node, and places
    /// unpinned ungated pods (created without the webhook) where they fit.
    fn bind(&mut self) {
        for i in 0..self.s.pods.len() {
            let p = &self.s.pods[i];
            if p.gated || p.node_name.is_some() || !is_live(p) || p.terminating {
                continue;
            }
            let pinned_away = p
                .node_selector
                .get(LABEL_HOSTNAME)
                .is_some_and(|n| self.alloc(n).is_none());
            if self.unfit.contains(&p.uid) || pinned_away {
                let p = &mut self.s.pods[i];
                // Kubernetes keeps the time the pod was created gated.
                let created = p.created_at;
                p.unplaced.get_or_insert_with(|| Unplaced {
                    since: created,
                    message: Some("0/1 nodes are available: 1 Insufficient cpu.".into()),
                });
                continue;
            }
            let target = match p.node_selector.get(LABEL_HOSTNAME) {
                Some(n) => self.alloc(n).map(|_| n.clone()),
                None => {
                    let used = self.usage();
                    let need = p.requests.get(RES).copied().unwrap_or(0);
                    self.s
                        .nodes
                        .iter()
                        .find(|n| {
                            n.allocatable.get(RES).copied().unwrap_or(0)
                                >= used.get(&n.name).copied().unwrap_or(0) + need
                        })
                        .map(|n| n.name.clone())
                }
            };
            if let Some(n) = target {
                let p = &mut self.s.pods[i];
                p.node_name = Some(n);
                p.phase = PodPhase::Running;
                p.unplaced = None;
            }
        }
    }

    /// Device plugins write the GPUs of running pods into their leases.
    fn plugin(&mut self) {
        for i in 0..self.s.leases.len() {
            let l = &self.s.leases[i];
            let Some(pod) = self
                .s
                .pods
                .iter()
                .find(|p| p.key == l.key && p.uid == l.spec().pod_uid)
            else {
                continue;
            };
            let Some(node) = pod
                .node_name
                .clone()
                .filter(|_| pod.phase == PodPhase::Running)
            else {
                continue;
            };
            if l.status().is_none_or(|s| !s.gpus.is_empty()) {
                continue;
            }
            let taken: BTreeSet<u32> = self
                .s
                .leases
                .iter()
                .filter_map(|o| o.status())
                .filter(|s| s.node.as_deref() == Some(node.as_str()) && s.phase.holds_slots())
                .flat_map(|s| s.gpus.iter().map(|g| g.index))
                .collect();
            // The kubelet allocates what the pod requests, whatever its
            // lease says.
            let slots = pod.requests.get(fixtures::RESOURCE).copied().unwrap_or(0);
            let chosen: Vec<LeaseGpu> = (0..16u32)
                .filter(|g| !taken.contains(g))
                .take(slots as usize)
                .map(|g| LeaseGpu {
                    index: g,
                    uuid: format!("GPU-{node}-{g}"),
                    product: None,
                })
                .collect();
            if let Some(st) = self.s.leases[i].status_mut().as_mut() {
                st.gpus = chosen;
            }
        }
    }

    /// Runs one pass, checks the plan, and applies a prefix of its steps.
    fn pass(&mut self, cut: Option<u16>, statuses_first: bool) -> Result<Plan, TestCaseError> {
        let plan = decide(&self.s);
        self.check_plan(&plan)?;
        self.check_blocked_evictions(&plan)?;
        let before = self.usage();
        let steps = steps(&plan, statuses_first);
        let keep = cut.map_or(steps.len(), |c| c as usize % (steps.len() + 1));
        self.s
            .blocked_evictions
            .retain(|k, _| plan.evictions.iter().any(|e| &e.key == k));
        for step in &steps[..keep] {
            self.apply_step(&plan, step)?;
        }
        if self.paced_class_statuses {
            for write in &plan.class_writes {
                let class = self.s.classes.iter_mut().find(|c| c.name == write.class);
                if let (Some(c), Some(st)) = (class, plan.class_statuses.get(&write.class)) {
                    c.status = Some(GpuLeaseClassStatus {
                        updated_at: Some(Time(write.updated_at)),
                        ..st.clone()
                    });
                }
            }
        } else {
            for (name, st) in &plan.class_statuses {
                if let Some(c) = self.s.classes.iter_mut().find(|c| &c.name == name) {
                    c.status = Some(st.clone());
                }
            }
        }
        self.check_world(&before)?;
        Ok(plan)
    }

    /// A helper whose eviction a PodDisruptionBudget refused is asked for
    /// again, its lease says why, and a pass is due for the retry.
    fn check_blocked_evictions(&self, plan: &Plan) -> Result<(), TestCaseError> {
        for e in &plan.evictions {
            if !self.s.blocked_evictions.contains_key(&e.key) || e.delete {
                continue;
            }
            let persisted = self
                .s
                .leases
                .iter()
                .find(|l| l.key == e.key)
                .and_then(|l| l.status());
            // A lease lost and created again carries its status with it.
            let created = plan
                .create_leases
                .iter()
                .find(|n| n.key == e.key)
                .map(|n| &n.status);
            let status = plan.lease_status(&e.key).or(created).or(persisted);
            let message = status.and_then(|s| s.message.as_deref()).unwrap_or("");
            prop_assert!(
                message.contains("blocked by a PodDisruptionBudget"),
                "{} refused, but its lease says {:?}",
                e.key,
                message
            );
            prop_assert!(
                plan.wake_at
                    .is_some_and(|w| w > self.s.now && w <= self.s.now + EVICTION_RETRY),
                "no retry due for {}: {:?}",
                e.key,
                plan.wake_at
            );
        }
        Ok(())
    }

    fn apply_step(&mut self, plan: &Plan, step: &Step) -> Result<(), TestCaseError> {
        match *step {
            Step::Spec(ref key) => {
                if let (Some(l), Some(spec)) = (
                    self.s.leases.iter_mut().find(|l| &l.key == key),
                    plan.lease_specs.get(key),
                ) {
                    *l.spec_mut() = spec.clone();
                }
            }
            Step::Create(i) => {
                let n = &plan.create_leases[i];
                prop_assert!(
                    !self.s.leases.iter().any(|l| l.key == n.key),
                    "create of {} over an existing lease",
                    n.key
                );
                self.s
                    .leases
                    .push(LeaseInfo::from_parts(n.key.clone(), n.spec.clone(), None));
            }
            Step::CreateStatus(i) => {
                let n = &plan.create_leases[i];
                if let Some(l) = self.s.leases.iter_mut().find(|l| l.key == n.key) {
                    *l.status_mut() = Some(n.status.clone());
                }
            }
            Step::Delete(i) => {
                let d = &plan.delete_leases[i];
                self.s
                    .leases
                    .retain(|l| !(l.key == d.key && l.spec().pod_uid == d.pod_uid));
            }
            Step::Admit(i) => {
                let a = &plan.admissions[i];
                let Some(p) = self
                    .s
                    .pods
                    .iter_mut()
                    .find(|p| p.key == a.key && p.uid == a.pod_uid)
                else {
                    return Ok(());
                };
                prop_assert!(p.gated, "{} admitted twice", a.key);
                p.gated = false;
                p.node_selector
                    .insert(LABEL_HOSTNAME.into(), a.node.clone());
            }
            Step::Evict(i) => {
                let e = &plan.evictions[i];
                // As the operator does: a refusal is remembered for the
                // next pass, anything else clears it.
                // As the operator does: one not due yet waits.
                if e.not_before.is_some_and(|at| at > self.s.now) {
                    return Ok(());
                }
                // A budget refuses evictions, not deletions.
                if self.pdb_refuses && !e.delete {
                    let now = self.s.now;
                    self.s
                        .blocked_evictions
                        .entry(e.key.clone())
                        .and_modify(|r| r.last = now)
                        .or_insert(Refusals {
                            first: now,
                            last: now,
                        });
                    return Ok(());
                }
                self.s.blocked_evictions.remove(&e.key);
                if let Some(p) = self
                    .s
                    .pods
                    .iter_mut()
                    .find(|p| p.key == e.key && p.uid == e.pod_uid)
                {
                    if p.phase == PodPhase::Running || !p.gated {
                        p.terminating = true;
                    } else {
                        p.phase = PodPhase::Failed;
                    }
                }
            }
            Step::GiveBack(i) => {
                let g = &plan.give_backs[i];
                let pod = self
                    .s
                    .pods
                    .iter()
                    .find(|p| p.key == g.key && p.uid == g.pod_uid);
                prop_assert!(
                    pod.is_some_and(|p| p.node_name.is_none() && !p.gated),
                    "{} given back, but it is not an admitted pod waiting for a node",
                    g.key
                );
                // Not bound to a node: the API server deletes it at once.
                self.s
                    .pods
                    .retain(|p| !(p.key == g.key && p.uid == g.pod_uid));
            }
            Step::Status(ref key) => {
                let st = plan.lease_status(key).expect("a wanted status");
                if let Some(l) = self.s.leases.iter_mut().find(|l| &l.key == key) {
                    // The device plugin owns status.gpus; the operator's write keeps them.
                    let gpus = l.status().map(|s| s.gpus.clone()).unwrap_or_default();
                    let mut st = st.clone();
                    if st.gpus.is_empty() {
                        st.gpus = gpus;
                    }
                    *l.status_mut() = Some(st);
                }
            }
        }
        Ok(())
    }

    fn lease_status<'a>(&'a self, plan: &'a Plan, key: &ObjectKey) -> Option<&'a GpuLeaseStatus> {
        plan.lease_status(key).or_else(|| {
            self.s
                .leases
                .iter()
                .find(|l| &l.key == key)
                .and_then(|l| l.status())
                .or_else(|| {
                    plan.create_leases
                        .iter()
                        .find(|n| &n.key == key)
                        .map(|n| &n.status)
                })
        })
    }

    /// True when a primary of `class` asking for `slots` could fit somewhere
    /// by waiting (no constraints of its own in this world).
    fn possible(&self, class: &str, slots: u32) -> bool {
        let narrow = class == "narrow";
        self.s
            .nodes
            .iter()
            .filter(|n| !narrow || n.labels.get("pool").is_some_and(|v| v == "x"))
            .any(|n| n.allocatable.get(RES).copied().unwrap_or(0) >= slots)
    }

    /// Invariants a plan must satisfy against the state it was computed from.
    /// Checks the plan against the world with each lease's spec as the
    /// plan leaves it: a spec someone edited is rewritten from its pod in
    /// the same pass, and the pass decides by the pod.
    fn check_plan(&self, plan: &Plan) -> Result<(), TestCaseError> {
        if plan.lease_specs.is_empty() {
            return self.check_plan_as_written(plan);
        }
        let mut rewritten = self.clone();
        for l in &mut rewritten.s.leases {
            if let Some(spec) = plan.lease_specs.get(&l.key) {
                *l.spec_mut() = spec.clone();
            }
        }
        rewritten.check_plan_as_written(plan)
    }

    fn check_plan_as_written(&self, plan: &Plan) -> Result<(), TestCaseError> {
        self.check_unrunnable_pods(plan)?;
        // Every class's queue depth is counted, and it is what a status
        // built in the same pass says.
        for class in &self.s.classes {
            let depth = plan.queue_depths.get(&class.name);
            prop_assert!(depth.is_some(), "no queue depth for class {}", class.name);
            if let (Some(d), Some(st)) = (depth, plan.class_statuses.get(&class.name)) {
                prop_assert_eq!((d.primaries, d.helpers), (st.queued, st.queued_helpers));
            }
        }
        // Deletions only ever target leases of replaced pods.
        for d in &plan.delete_leases {
            let pod = self.s.pods.iter().find(|p| p.key == d.key);
            prop_assert!(
                pod.is_some_and(|p| p.uid != d.pod_uid),
                "lease {} deleted though its pod is not replaced",
                d.key
            );
        }
        // One lease per pod key; new sequences follow the pods' stamps
        // (DESIGN §5.2).
        self.check_new_sequences(plan)?;
        // Slots held per node as the engine counts them: placed pods, plus
        // leases that hold slots for a pod not placed yet.
        let mut usage = self.usage();
        for l in &self.s.leases {
            let Some(st) = l.status().filter(|s| s.phase.holds_slots()) else {
                continue;
            };
            let placed = self
                .s
                .pods
                .iter()
                .any(|p| p.key == l.key && is_live(p) && placed_on(p).is_some());
            if let (false, Some(node)) = (placed, st.node.as_deref()) {
                *usage.entry(node.to_owned()).or_default() += l.spec().slots;
            }
        }
        let mut admitted = BTreeSet::new();
        for a in &plan.admissions {
            prop_assert!(
                admitted.insert(a.key.clone()),
                "{} admitted twice in one plan",
                a.key
            );
            let pod = self
                .s
                .pods
                .iter()
                .find(|p| p.key == a.key && p.uid == a.pod_uid);
            prop_assert!(pod.is_some_and(|p| p.gated), "{} is not waiting", a.key);
            let lease = self.s.leases.iter().find(|l| l.key == a.key);
            let persisted = lease.and_then(|l| l.status());
            prop_assert!(
                persisted.is_some_and(|s| s.sequence.is_some()),
                "{} admitted before its sequence was persisted",
                a.key
            );
            // A primary's admission driven again goes to the node already
            // chosen, unless that node is gone or its allocatable shrank
            // below what is held there (then it was queued again and placed
            // afresh). A helper's may move: its pod never started, and it is
            // queued again wherever a waiting primary could use its node.
            // Under StrictFIFO a primary driven again also goes back to the
            // queue while a primary with an earlier sequence has not started
            // (its pod is still gated): the earlier one goes first.
            let earlier_waits = lease.is_some_and(|mine| {
                let seq = persisted.and_then(|s| s.sequence).unwrap_or(0);
                self.s.leases.iter().any(|l| {
                    l.spec().class_name == mine.spec().class_name
                        && l.spec().role == Role::Primary
                        && l.status()
                            .is_none_or(|s| s.sequence.is_none_or(|x| x < seq))
                        && self.s.pods.iter().any(|p| {
                            p.key == l.key && p.uid == l.spec().pod_uid && p.gated && is_live(p)
                        })
                })
            });
            if let Some(st) = persisted.filter(|s| {
                a.role == Role::Primary
                    && !earlier_waits
                    && s.phase == LeasePhase::Admitted
                    && s.node.as_deref().is_some_and(|n| {
                        self.alloc(n)
                            .is_some_and(|alloc| usage.get(n).copied().unwrap_or(0) <= alloc)
                    })
            }) {
                prop_assert_eq!(st.node.as_deref(), Some(a.node.as_str()));
            }
        }
        // Sequences never change.
        for l in &self.s.leases {
            if let (Some(new), Some(old)) = (
                plan.lease_status(&l.key).and_then(|s| s.sequence),
                l.status().and_then(|s| s.sequence),
            ) {
                prop_assert_eq!(new, old, "sequence of {} changed", l.key);
            }
        }
        // Across classes: a helper is never admitted to a node that a waiting
        // primary of another class could use (DESIGN §5.4).
        for a in plan.admissions.iter().filter(|a| a.role == Role::Helper) {
            let helper_class = self
                .s
                .leases
                .iter()
                .find(|l| l.key == a.key)
                .map(|l| l.spec().class_name.as_str());
            let fits = |class: &str, slots: u32| {
                let narrow = class == "narrow";
                self.s.nodes.iter().any(|n| {
                    n.name == a.node
                        && (!narrow || n.labels.get("pool").is_some_and(|v| v == "x"))
                        && n.allocatable.get(RES).copied().unwrap_or(0) >= slots
                })
            };
            let blocking = self.s.leases.iter().find(|l| {
                let Some(st) = self.lease_status(plan, &l.key) else {
                    return false;
                };
                l.spec().role == Role::Primary
                    && Some(l.spec().class_name.as_str()) != helper_class
                    && self.s.classes.iter().any(|c| c.name == l.spec().class_name)
                    && st.phase == LeasePhase::Queued
                    && fits(&l.spec().class_name, l.spec().slots)
                    && self.s.pods.iter().any(|p| {
                        p.key == l.key
                            && p.uid == l.spec().pod_uid
                            && p.gated
                            && p.other_gate.is_none()
                            && is_live(p)
                    })
            });
            prop_assert!(
                blocking.is_none(),
                "helper {} admitted to {} while primary {:?} of another class waits and could use it",
                a.key,
                a.node,
                blocking.map(|l| &l.key)
            );
        }
        // FIFO order and helper gating, per class.
        for class in &self.s.classes {
            let leases: Vec<(&LeaseInfo, &GpuLeaseStatus)> = self
                .s
                .leases
                .iter()
                .filter(|l| l.spec().class_name == class.name)
                .filter_map(|l| Some((l, self.lease_status(plan, &l.key)?)))
                .collect();
            let waiting_after = |role: Role, below: u64| {
                leases.iter().any(|(l, st)| {
                    l.spec().role == role
                        && st.phase == LeasePhase::Queued
                        && st.sequence.is_some_and(|s| s < below)
                        && self.possible(&class.name, l.spec().slots)
                        && self.s.pods.iter().any(|p| {
                            // Another controller's gate holds no one up.
                            p.key == l.key
                                && p.uid == l.spec().pod_uid
                                && p.gated
                                && p.other_gate.is_none()
                                && is_live(p)
                        })
                })
            };
            let new_primary_waiting = plan.create_leases.iter().any(|n| {
                let other_gate = self
                    .s
                    .pods
                    .iter()
                    .any(|p| p.key == n.key && p.other_gate.is_some());
                !other_gate
                    && n.spec.class_name == class.name
                    && n.spec.role == Role::Primary
                    && n.status.phase == LeasePhase::Queued
                    && self.possible(&class.name, n.spec.slots)
            });
            for a in &plan.admissions {
                let Some((l, st)) = leases.iter().find(|(l, _)| l.key == a.key) else {
                    continue;
                };
                let seq = st.sequence.unwrap_or(0);
                if l.spec().role == Role::Primary
                    && class.spec.admission.ordering == Ordering::StrictFIFO
                {
                    prop_assert!(
                        !waiting_after(Role::Primary, seq),
                        "StrictFIFO: {} admitted while an earlier primary waits",
                        a.key
                    );
                }
                if l.spec().role == Role::Helper && !class.spec.helpers.admit_while_queued {
                    prop_assert!(
                        !waiting_after(Role::Primary, u64::MAX) && !new_primary_waiting,
                        "helper {} admitted while a primary of {} waits",
                        a.key,
                        class.name
                    );
                }
            }
            // The per-GPU snapshot gives no lease more entries than slots.
            if let Some(st) = plan.class_statuses.get(&class.name) {
                let mut per_lease: BTreeMap<&str, u32> = BTreeMap::new();
                for e in &st.slots {
                    if let Some(l) = &e.lease {
                        *per_lease.entry(l.as_str()).or_default() += 1;
                    }
                }
                for (lease, n) in per_lease {
                    let slots = self
                        .s
                        .leases
                        .iter()
                        .find(|l| l.key.to_string() == lease)
                        .map(|l| l.spec().slots)
                        .unwrap_or(u32::MAX);
                    prop_assert!(n <= slots, "{lease} shown on {n} slots");
                }
            }
        }
        Ok(())
    }

    /// No slot is held for longer than its class's placement timeout by a
    /// pod the scheduler cannot place, and none is given back sooner; a
    /// pod carrying another controller's gate is never admitted; and
    /// nothing is released while its pod may still run, whatever becomes
    /// of its class (DESIGN §5.3, §5.6).
    /// New sequences, by the rule of DESIGN §5.2: at least the pod's stamp
    /// in microseconds; above every lease of the same class and role whose
    /// pod runs (nothing is admitted out of sequence order); never a number
    /// a lease carries; and ahead of every waiting lease of a pod stamped
    /// later, unless an admitted lease or numbers already taken push it
    /// past that one.
    fn check_new_sequences(&self, plan: &Plan) -> Result<(), TestCaseError> {
        let stamp_of = |key: &ObjectKey| {
            self.s.pods.iter().find(|p| &p.key == key).map(|p| {
                (
                    p.enqueued_at.unwrap_or(p.created_at),
                    p.created_at,
                    p.key.clone(),
                )
            })
        };
        let micros = |t: jiff::Timestamp| u64::try_from(t.as_microsecond()).unwrap_or(0).max(1);
        let mut taken: BTreeSet<u64> = self
            .s
            .leases
            .iter()
            .filter_map(|l| l.status()?.sequence)
            .collect();
        let taken_count = taken.len() + plan.create_leases.len();
        for n in &plan.create_leases {
            prop_assert!(!self.s.leases.iter().any(|l| l.key == n.key));
            let Some(seq) = n.status.sequence else {
                continue;
            };
            prop_assert!(
                taken.insert(seq),
                "{} got sequence {seq}, already taken",
                n.key
            );
            let Some(stamp) = stamp_of(&n.key) else {
                continue;
            };
            let base = micros(stamp.0);
            prop_assert!(
                seq >= base,
                "{} sequenced {seq}, below its stamp {base}",
                n.key
            );
            let same_queue = |l: &&LeaseInfo| {
                l.spec().class_name == n.spec.class_name && l.spec().role == n.spec.role
            };
            let holding = |l: &&LeaseInfo| l.status().is_some_and(|s| s.phase.holds_slots());
            let runs = |l: &&LeaseInfo| {
                self.s
                    .pods
                    .iter()
                    .any(|p| p.key == l.key && p.uid == l.spec().pod_uid && !p.gated && is_live(p))
            };
            let running = self
                .s
                .leases
                .iter()
                .filter(same_queue)
                .filter(holding)
                .filter(runs);
            if let Some(above) = running.max_by_key(|l| l.status().and_then(|s| s.sequence)) {
                prop_assert!(
                    above
                        .status()
                        .and_then(|s| s.sequence)
                        .is_none_or(|a| seq > a),
                    "{} sequenced {seq}, below running {:?} of its class and role ({:?}; pod {:?})",
                    n.key,
                    above,
                    n,
                    self.s.pods.iter().find(|p| p.key == above.key)
                );
            }
            // A lease holds slots when its status says so, or when its pod
            // runs without the gate though the status write was lost.
            let floor = self
                .s
                .leases
                .iter()
                .filter(same_queue)
                .filter(|l| holding(l) || runs(l))
                .filter_map(|l| l.status()?.sequence)
                .max()
                .map_or(base, |f| base.max(f + 1));
            let waits = |l: &&LeaseInfo| {
                self.s
                    .pods
                    .iter()
                    .any(|p| p.key == l.key && p.uid == l.spec().pod_uid && p.gated && is_live(p))
            };
            let waits_behind = self
                .s
                .leases
                .iter()
                .filter(same_queue)
                .filter(waits)
                .find(|l| {
                    let Some(theirs) = l.status().filter(|s| s.phase == LeasePhase::Queued) else {
                        return false;
                    };
                    theirs
                        .sequence
                        .is_some_and(|s| s < seq && s > floor + taken_count as u64)
                        && stamp_of(&l.key).is_some_and(|t| t > stamp)
                });
            prop_assert!(
                waits_behind.is_none(),
                "{} (sequence {seq}) queued behind {:?}, stamped later",
                n.key,
                waits_behind.map(|l| &l.key)
            );
        }
        Ok(())
    }

    fn check_unrunnable_pods(&self, plan: &Plan) -> Result<(), TestCaseError> {
        let given: BTreeSet<&ObjectKey> = plan.give_backs.iter().map(|g| &g.key).collect();
        for p in &self.s.pods {
            let own_lease = self
                .s
                .leases
                .iter()
                .find(|l| l.key == p.key && l.spec().pod_uid == p.uid);
            let Some(report) = p
                .unplaced
                .as_ref()
                .filter(|_| is_live(p) && !p.terminating && !p.gated && p.node_name.is_none())
            else {
                prop_assert!(
                    !given.contains(&p.key),
                    "{} given back though placeable",
                    p.key
                );
                continue;
            };
            let class = own_lease.map(|l| l.spec().class_name.clone());
            let timeout = class
                .and_then(|c| self.s.classes.iter().find(|k| k.name == c))
                .map_or(60, |c| c.spec.admission.placement_timeout_seconds);
            // The clock starts at admission at the earliest.
            let admitted = own_lease
                .and_then(|l| l.status()?.admitted_at.as_ref())
                .map(|t| t.0);
            let since = admitted.map_or(report.since, |a| a.max(report.since));
            let due = since + jiff::SignedDuration::from_secs(i64::from(timeout));
            if own_lease.is_some() && self.s.now >= due {
                prop_assert!(
                    given.contains(&p.key),
                    "{} holds its slots past the timeout",
                    p.key
                );
            } else if self.s.now < due {
                prop_assert!(
                    !given.contains(&p.key),
                    "{} given back before the timeout",
                    p.key
                );
            }
        }
        for a in &plan.admissions {
            let pod = self.s.pods.iter().find(|p| p.key == a.key);
            prop_assert!(
                pod.is_some_and(|p| p.other_gate.is_none()),
                "{} admitted while another gate holds it",
                a.key
            );
        }
        for (key, st) in plan.all_lease_statuses() {
            if st.phase != LeasePhase::Released {
                continue;
            }
            let Some(lease) = self.s.leases.iter().find(|l| &l.key == key) else {
                continue;
            };
            if lease
                .status()
                .is_some_and(|s| s.phase == LeasePhase::Released)
            {
                continue;
            }
            let runs = self.s.pods.iter().any(|p| {
                p.key == *key
                    && p.uid == lease.spec().pod_uid
                    && is_live(p)
                    && !(p.terminating && p.node_name.is_none())
            });
            prop_assert!(
                !runs || given.contains(key),
                "{} released while its pod may still run",
                key
            );
        }
        Ok(())
    }

    /// Invariants of the world after a (possibly partial) plan was applied.
    fn check_world(&mut self, before: &BTreeMap<String, u32>) -> Result<(), TestCaseError> {
        for (node, used) in self.usage() {
            let Some(alloc) = self.alloc(&node) else {
                continue;
            };
            // A node whose allocatable shrank may stay over-committed, but
            // the engine never adds to it.
            let prior = before.get(&node).copied().unwrap_or(0);
            prop_assert!(
                used <= alloc || used <= prior,
                "node {node}: {used} slots held, {alloc} allocatable (was {prior})"
            );
        }
        let mut keys = BTreeSet::new();
        for l in &self.s.leases {
            prop_assert!(keys.insert(&l.key), "two leases for {}", l.key);
            if let Some(seq) = l.status().and_then(|s| s.sequence) {
                let first = *self
                    .sequences
                    .entry(l.spec().pod_uid.clone())
                    .or_insert(seq);
                prop_assert_eq!(first, seq, "sequence of {} changed", l.key);
            }
        }
        Ok(())
    }

    /// Passes (with the scheduler and device plugins running) until a plan
    /// changes nothing; fails if that takes more than `bound` passes.
    fn quiesce(&mut self, bound: usize) -> Result<Plan, TestCaseError> {
        // The budget lets evictions through in the end.
        self.pdb_refuses = false;
        for _ in 0..bound {
            self.bind();
            self.plugin();
            let plan = self.pass(None, false)?;
            if plan.create_leases.is_empty()
                && plan.delete_leases.is_empty()
                && plan.lease_specs.is_empty()
                && plan.admissions.is_empty()
                && plan.evictions.is_empty()
                && plan.lease_statuses.is_empty()
                && plan.lease_progress.is_empty()
                && plan.class_writes.is_empty()
            {
                return Ok(plan);
            }
            // Evicted pods terminate; deleted pods' leases are collected.
            self.apply_event(&Event::Terminated)?;
            // An eviction a budget refused waits for its retry time, as the
            // operator waits for the pass it asked for then.
            if let Some(retry) = plan.evictions.iter().filter_map(|e| e.not_before).max() {
                self.s.now = self.s.now.max(retry);
            }
        }
        Err(TestCaseError::fail(format!(
            "no quiet state after {bound} passes"
        )))
    }

    /// Every live pod that requests the resource and names a class (or the
    /// default) has exactly one lease, with its UID.
    fn check_leases_cover_pods(&self) -> Result<(), TestCaseError> {
        let default_exists = self.s.classes.iter().any(|c| c.spec.default);
        // A pod being deleted before it was bound is gone at once, and a
        // pod without a class label while no default class exists is none
        // of gpupool's (the webhook lets it pass ungated), nor is any pod
        // while no class names the resource it asks for.
        for p in self.s.pods.iter().filter(|p| {
            is_live(p)
                && !(p.terminating && p.node_name.is_none())
                && (p.class_label.is_some() || default_exists)
                && !self.s.classes.is_empty()
        }) {
            let n = self
                .s
                .leases
                .iter()
                .filter(|l| l.key == p.key && l.spec().pod_uid == p.uid)
                .count();
            prop_assert_eq!(n, 1, "live pod {} has {} leases", &p.key, n);
        }
        Ok(())
    }
}

/// One write the controller makes while applying a plan.
#[derive(Debug, Clone)]
enum Step {
    Create(usize),
    CreateStatus(usize),
    Delete(usize),
    Admit(usize),
    Evict(usize),
    GiveBack(usize),
    Status(ObjectKey),
    Spec(ObjectKey),
}

fn steps(plan: &Plan, statuses_first: bool) -> Vec<Step> {
    let mut out = Vec::new();
    for i in 0..plan.create_leases.len() {
        out.push(Step::Create(i));
        out.push(Step::CreateStatus(i));
    }
    out.extend((0..plan.delete_leases.len()).map(Step::Delete));
    out.extend(plan.lease_specs.keys().cloned().map(Step::Spec));
    let statuses: Vec<Step> = plan
        .all_lease_statuses()
        .map(|(k, _)| k.clone())
        .map(Step::Status)
        .collect();
    let actions: Vec<Step> = (0..plan.admissions.len())
        .map(Step::Admit)
        .chain((0..plan.evictions.len()).map(Step::Evict))
        .chain((0..plan.give_backs.len()).map(Step::GiveBack))
        .collect();
    if statuses_first {
        out.extend(statuses);
        out.extend(actions);
    } else {
        out.extend(actions);
        out.extend(statuses);
    }
    out
}

fn shuffled(s: &Snapshot) -> Snapshot {
    let mut t = s.clone();
    t.pods.reverse();
    t.leases.reverse();
    t.nodes.reverse();
    t.classes.reverse();
    t
}

/// Feeds the engine what changed from `before` to `after`, object by
/// object, as the controller's watch caches report it.
fn feed(engine: &mut Engine, before: &Snapshot, after: &Snapshot) {
    fn changes<'a, K: Ord, T: std::fmt::Debug>(
        before: &'a [T],
        after: &'a [T],
        key: impl Fn(&'a T) -> K,
    ) -> (Vec<&'a T>, Vec<K>) {
        let old: BTreeMap<K, String> = before.iter().map(|x| (key(x), format!("{x:?}"))).collect();
        let new: BTreeMap<K, &T> = after.iter().map(|x| (key(x), x)).collect();
        let upserts = new
            .iter()
            .filter(|(k, x)| old.get(*k) != Some(&format!("{x:?}")))
            .map(|(_, x)| *x)
            .collect();
        let removes = old.into_keys().filter(|k| !new.contains_key(k)).collect();
        (upserts, removes)
    }
    engine.set_now(after.now);
    let (up, gone) = changes(&before.classes, &after.classes, |c| c.name.clone());
    up.into_iter().for_each(|c| engine.upsert_class(c.clone()));
    gone.iter().for_each(|c| drop(engine.remove_class(c)));
    let (up, gone) = changes(&before.nodes, &after.nodes, |n| n.name.clone());
    up.into_iter().for_each(|n| engine.upsert_node(n.clone()));
    gone.iter().for_each(|n| drop(engine.remove_node(n)));
    let (up, gone) = changes(&before.pods, &after.pods, |p| p.key.clone());
    up.into_iter().for_each(|p| engine.upsert_pod(p.clone()));
    gone.iter().for_each(|p| drop(engine.remove_pod(p)));
    let (up, gone) = changes(&before.leases, &after.leases, |l| l.key.clone());
    up.into_iter().for_each(|l| engine.upsert_lease(l.clone()));
    gone.iter().for_each(|l| drop(engine.remove_lease(l)));
    for key in before
        .blocked_evictions
        .keys()
        .chain(after.blocked_evictions.keys())
    {
        // The kept engine is told the latest refusal; it keeps the first.
        engine.set_eviction_blocked(key, after.blocked_evictions.get(key).map(|r| r.last));
    }
}

fn run_events(w: &mut World, sc: &Scenario) -> Result<(), TestCaseError> {
    for ev in &sc.events {
        w.apply_event(ev)?;
    }
    Ok(())
}

/// Feeds a kept engine every event of `sc` and compares its pass with a
/// full pass over the world's snapshot after each, both cut to `limit`;
/// with `drop_class`, the first class goes away and comes back after the
/// event that number picks.
/// The engine admits what the naive reference (tests/reference) says the
/// rules admit, wherever the reference covers the state.
fn agrees_with_the_reference(s: &Snapshot, plan: &Plan) -> Result<(), TestCaseError> {
    let Some(want) = reference::admissions(s) else {
        return Ok(());
    };
    let got: BTreeMap<ObjectKey, String> = plan
        .admissions
        .iter()
        .map(|a| (a.key.clone(), a.node.clone()))
        .collect();
    prop_assert_eq!(got, want, "admissions differ from the reference's");
    Ok(())
}

fn kept_engine_decides_as_a_full_pass(
    sc: &Scenario,
    drop_class: Option<u8>,
    limit: Option<usize>,
    paced: bool,
) -> Result<(), TestCaseError> {
    let mut w = World::new(sc);
    w.paced_class_statuses = paced;
    // The world writes every status; only the two compared passes cut.
    let full_pass = |s: &Snapshot| {
        decide(&Snapshot {
            progress_limit: limit,
            ..s.clone()
        })
    };
    let mut engine = Engine::from_snapshot(&w.s);
    engine.set_progress_limit(limit);
    prop_assert_eq!(engine.decide(), full_pass(&w.s));
    let dropped_after = drop_class.map(|d| usize::from(d) % sc.events.len());
    for (i, ev) in sc.events.iter().enumerate() {
        let before = w.s.clone();
        w.apply_event(ev)?;
        if dropped_after == Some(i) && !w.s.classes.is_empty() {
            let gone = w.s.classes.remove(0);
            feed(&mut engine, &before, &w.s);
            prop_assert_eq!(
                engine.decide(),
                full_pass(&w.s),
                "without class {}",
                &gone.name
            );
            let before = w.s.clone();
            w.s.classes.insert(0, gone);
            feed(&mut engine, &before, &w.s);
        } else {
            feed(&mut engine, &before, &w.s);
        }
        let plan = engine.decide();
        prop_assert_eq!(&plan, &full_pass(&w.s), "after {:?}", ev);
        agrees_with_the_reference(&w.s, &plan)?;
    }
    let mut settled = Engine::from_snapshot(&w.s);
    settled.set_progress_limit(limit);
    prop_assert_eq!(
        format!("{:?}", settled.to_snapshot()),
        format!("{:?}", engine.to_snapshot())
    );
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig {
        // Failures print their minimal input; nothing is written beside the sources.
        failure_persistence: None,
        ..ProptestConfig::with_cases(CASES)
    })]

    /// DESIGN §5.8 after every step, through restarts that lose plan tails.
    #[test]
    fn invariants_hold_after_every_event(sc in scenario()) {
        let mut w = World::new(&sc);
        run_events(&mut w, &sc)?;
        w.quiesce(12)?;
        w.apply_event(&Event::Gc)?;
        w.quiesce(12)?;
        w.check_leases_cover_pods()?;
    }

    /// The same snapshot gives the same plan, whatever the input order.
    #[test]
    fn decisions_are_deterministic(sc in scenario()) {
        let mut w = World::new(&sc);
        for ev in &sc.events {
            w.apply_event(ev)?;
            let a = decide(&w.s);
            prop_assert_eq!(&a, &decide(&w.s));
            prop_assert_eq!(&a, &decide(&shuffled(&w.s)));
        }
    }

    /// A progress limit cuts `lease_progress` to the front of the queue
    /// (the lowest positions, leases without one first, then by key) and
    /// changes nothing else in the plan.
    #[test]
    fn a_progress_limit_keeps_the_front_of_the_progress_and_nothing_else(
        sc in scenario(),
        limit in 0usize..6,
    ) {
        let mut w = World::new(&sc);
        for ev in &sc.events {
            w.apply_event(ev)?;
            let full = decide(&w.s);
            let mut cut = w.s.clone();
            cut.progress_limit = Some(limit);
            let limited = decide(&cut);
            let mut front: Vec<(u32, &ObjectKey)> = full
                .lease_progress
                .iter()
                .map(|(k, st)| (st.position.unwrap_or(0), k))
                .collect();
            front.sort();
            front.truncate(limit);
            let kept: Vec<&ObjectKey> = limited.lease_progress.keys().collect();
            let mut want: Vec<&ObjectKey> = front.into_iter().map(|(_, k)| k).collect();
            want.sort();
            prop_assert_eq!(kept, want);
            for (k, st) in &limited.lease_progress {
                prop_assert_eq!(Some(st), full.lease_progress.get(k));
            }
            prop_assert_eq!(limited.progress_truncated, full.lease_progress.len() > limit);
            let rest = |p: &Plan| Plan {
                lease_progress: Default::default(),
                progress_truncated: false,
                ..p.clone()
            };
            prop_assert_eq!(rest(&limited), rest(&full));
        }
    }

    /// The kept engine, fed only what changed after each event (passes
    /// applied in part included, and a class that goes away and comes
    /// back), decides exactly what a pass over the whole snapshot decides,
    /// with or without a progress limit, however many of its queued
    /// leases it keeps parked, and whether or not class statuses are held
    /// back by their period.
    #[test]
    fn the_kept_engine_decides_as_a_full_pass(
        sc in scenario(),
        drop_class in any::<u8>(),
        limit in prop::option::of(0usize..4),
        paced in any::<bool>(),
    ) {
        kept_engine_decides_as_a_full_pass(&sc, Some(drop_class), limit, paced)?;
    }

    /// The same, with queues longer than a class status lists, so that
    /// the kept engine counts the back of a FIFO instead of visiting it.
    #[test]
    fn the_kept_engine_decides_as_a_full_pass_over_long_queues(
        sc in crowded_scenario(),
        limit in prop::option::of(0usize..4),
        paced in any::<bool>(),
    ) {
        kept_engine_decides_as_a_full_pass(&sc, None, limit, paced)?;
    }

    /// Once the world is quiet, applying a plan and re-running changes
    /// nothing: no lease status, no class status, no action.
    #[test]
    fn a_quiet_world_is_stable(sc in scenario()) {
        let mut w = World::new(&sc);
        run_events(&mut w, &sc)?;
        let last = w.quiesce(12)?;
        let again = decide(&w.s);
        prop_assert_eq!(&again, &last);
        for c in &w.s.classes {
            prop_assert_eq!(c.status.as_ref(), again.class_statuses.get(&c.name));
        }
    }

    /// When running pods finish and no new ones come, every queued lease is
    /// eventually admitted or reported impossible.
    #[test]
    fn every_queued_lease_is_eventually_admitted_or_impossible(sc in scenario()) {
        let mut w = World::new(&sc);
        run_events(&mut w, &sc)?;
        // Other controllers let their pods go, deleted classes come back,
        // and what could not be placed is given back or placed.
        for p in &mut w.s.pods {
            p.other_gate = None;
        }
        w.s.classes.append(&mut w.deleted_classes);
        let rounds = w.s.pods.len() * 2 + 4;
        for _ in 0..rounds {
            w.quiesce(12)?;
            // Every admitted pod runs and finishes.
            w.bind();
            for p in &mut w.s.pods {
                if p.phase == PodPhase::Running {
                    p.phase = PodPhase::Succeeded;
                }
            }
            w.apply_event(&Event::Terminated)?;
            w.apply_event(&Event::Tick { secs: 60 })?;
        }
        w.quiesce(12)?;
        for l in &w.s.leases {
            let st = l.status().expect("every lease has a status once quiet");
            let pod_live = w.s.pods.iter().any(|p| p.key == l.key && p.uid == l.spec().pod_uid && is_live(p));
            if !pod_live {
                prop_assert_eq!(st.phase, LeasePhase::Released, "{}", &l.key);
                continue;
            }
            let msg = st.message.clone().unwrap_or_default();
            match st.phase {
                LeasePhase::Queued => prop_assert!(
                    !w.possible(&l.spec().class_name, l.spec().slots),
                    "{} still queued though it could fit: {}", &l.key, msg
                ),
                LeasePhase::Rejected => prop_assert!(
                    l.spec().class_name == "ghost", "{} rejected: {}", &l.key, msg
                ),
                // Pending ungated pods the scheduler cannot place yet.
                LeasePhase::Admitted => prop_assert!(
                    w.s.pods.iter().any(|p| p.key == l.key && !p.gated && p.node_name.is_none()),
                    "{} admitted but not running", &l.key
                ),
                other => prop_assert!(false, "{} left {:?}: {}", &l.key, other, msg),
            }
        }
    }
}

/// A pass over the world, the plan cut after `cut` writes if given.
fn pass(cut: Option<u16>) -> Event {
    Event::Pass {
        cut,
        statuses_first: false,
    }
}

/// A pod of class 0 added, gated.
fn add(name: u8, helper: bool, slots: u32) -> Event {
    Event::AddPod {
        name,
        class: 0,
        helper,
        slots,
        ungated: false,
    }
}

/// A helper's eviction is refused by a PodDisruptionBudget, and the write
/// that marked its lease Preempting is lost with the tail of the plan: the
/// next pass preempts it afresh, and its lease must still say the eviction
/// is blocked and a retry must be due. Found by `decisions_are_deterministic`.
#[test]
fn a_fresh_preemption_of_a_refused_helper_says_the_eviction_is_blocked() {
    let class = |evict| ClassCfg {
        strict: false,
        spread: false,
        admit_while_queued: false,
        evict,
        min_runtime: 0,
    };
    let sc = Scenario {
        classes: vec![class(true), class(false)],
        nodes: vec![(1, false), (2, false)],
        events: vec![
            add(0, true, 2),
            Event::Pdb { refuses: true },
            pass(None),
            pass(None),
            add(1, false, 2),
            pass(None),
            // Keeps the eviction (refused) and loses the Preempting status.
            pass(Some(1)),
            pass(None),
        ],
    };
    let mut w = World::new(&sc);
    if let Err(e) = run_events(&mut w, &sc) {
        panic!("{e}");
    }
    let p0 = ObjectKey::new("team", "p0");
    assert!(
        w.s.blocked_evictions.contains_key(&p0),
        "the eviction was refused"
    );
    let lease =
        w.s.leases
            .iter()
            .find(|l| l.key == p0)
            .and_then(|l| l.status());
    assert_eq!(lease.map(|s| s.phase), Some(LeasePhase::Preempting));
}

/// A primary too large for any node lets a later one preempt a helper;
/// then the node grows. The slots held for the later primary must not
/// keep the earlier one, now possible, waiting while StrictFIFO keeps the
/// later one behind it: found by `every_queued_lease_is_eventually_admitted_or_impossible`.
#[test]
fn a_reservation_for_a_later_primary_yields_to_an_earlier_one() {
    let sc = Scenario {
        classes: vec![ClassCfg {
            strict: true,
            spread: false,
            admit_while_queued: false,
            evict: true,
            min_runtime: 0,
        }],
        nodes: vec![(2, false)],
        events: vec![
            add(3, false, 3),
            add(0, true, 1),
            pass(None),
            pass(None),
            add(4, false, 2),
            pass(None),
            pass(None),
            Event::Resize { pick: 0, alloc: 3 },
        ],
    };
    let mut w = World::new(&sc);
    run_events(&mut w, &sc).expect("events");
    w.apply_event(&Event::Terminated)
        .expect("the helper terminates");
    w.quiesce(12).expect("quiet");
    let phase = |name: &str| {
        let key = ObjectKey::new("team", name);
        w.s.leases
            .iter()
            .find(|l| l.key == key)
            .and_then(|l| l.status())
            .map(|s| s.phase)
    };
    assert_eq!(phase("p0"), Some(LeasePhase::Released));
    assert!(
        matches!(phase("p3"), Some(LeasePhase::Admitted | LeasePhase::Bound)),
        "the head takes the grown node: {:?}",
        phase("p3")
    );
    assert_eq!(
        phase("p4"),
        Some(LeasePhase::Queued),
        "and the later one waits behind it"
    );
}
