//! `kubectl gpupool top`: class capacity at the top, then per node and per
//! GPU which pod holds each slot, from the leases' `status.node` and
//! `status.gpus` and the node's `gpupool.io/gpus` annotation.
//!
//! A reader who may not list Nodes, or every namespace's leases (a tenant
//! with the namespaced `view` or `edit` role), cannot see which GPUs are
//! free: it gets the GPUs its visible leases hold instead, node by node.

use gpupool_api::{GpuLease, GpuLeaseClass, LeasePhase, Role};
use gpupool_engine::Room;
use jiff::Timestamp;
use k8s_openapi::api::core::v1::{Node, Pod};
use serde::Serialize;

use crate::model;
use crate::rules;
use crate::style::{self, Paint, Style};
use crate::table::{Cell, Table, common_widths};
use crate::unseen::{self, Unseen};

/// The whole picture, ready to render or encode.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct TopView {
    /// Every class, in name order, with its status counts; absent when
    /// classes could not be listed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub classes: Option<Vec<ClassLine>>,
    /// Every node that has GPUs, slots or a slot holder, in name order;
    /// empty when `held` is given instead.
    pub nodes: Vec<NodeView>,
    /// When nodes or other namespaces' leases could not be listed: the
    /// GPUs the visible leases hold, by node, pod and GPU.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub held: Option<Vec<HeldGpu>>,
    /// The namespace the leases were limited to; absent for all.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// What the credentials could not list; absent when nothing. Left
    /// empty by [`build`] for the caller to fill.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub unseen: Vec<Unseen>,
}

/// A GPU (or a slot the device plugin has not placed yet) that a visible
/// lease holds, as the lease reports it.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct HeldGpu {
    /// The node the lease is placed on.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// The GPU's index; absent until the device plugin reports it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu: Option<u32>,
    /// The GPU's product name, when the lease gives it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub product: Option<String>,
    /// Who holds it.
    pub holder: Holder,
}

/// A class's counts, from its status.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ClassLine {
    /// Class name.
    pub name: String,
    /// Whether unlabelled pods use it.
    pub default: bool,
    /// Slots on its nodes.
    pub capacity: u32,
    /// Slots nobody holds.
    pub free: u32,
    /// Primaries holding slots.
    pub admitted: u32,
    /// Helpers holding slots.
    pub admitted_helpers: u32,
    /// Primaries waiting.
    pub queued: u32,
    /// Helpers waiting.
    pub queued_helpers: u32,
    /// Helpers being evicted.
    pub preempting: u32,
}

/// One node.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeView {
    /// Node name.
    pub name: String,
    /// Allocatable slots (the classes' resources together).
    pub slots: u64,
    /// Free slots as the operator counts them (the engine's own count,
    /// resource by resource, never below zero): allocatable less what
    /// every live pod bound or pinned there requests, gpupool's or not,
    /// and what leases hold for pods not placed yet.
    pub free: u64,
    /// Its GPUs, from the annotation, in index order.
    pub gpus: Vec<GpuView>,
    /// Holders the device plugin has not placed on a GPU yet (just admitted).
    pub unplaced: Vec<Holder>,
    /// Slots a holder takes beyond the GPUs reported for it, one entry per
    /// slot: the kubelet's PodResources names only the devices of running
    /// containers, so the GPU an ended init container took (and its pod
    /// keeps) is held without a name. Those slots are not free, whatever
    /// the GPU rows say.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub unreported: Vec<Holder>,
    /// Why the GPU list is missing, when it is.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// One GPU.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuView {
    /// Index on the node.
    pub index: u32,
    /// UUID.
    pub uuid: String,
    /// Product name.
    pub product: String,
    /// Passed its last health check.
    pub healthy: bool,
    /// Slots (sessions) it offers.
    pub slots: u64,
    /// Who holds its slots.
    pub holders: Vec<Holder>,
}

/// A pod holding a slot.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Holder {
    /// Pod namespace.
    pub namespace: String,
    /// Pod name.
    pub pod: String,
    /// Its role.
    pub role: Role,
    /// Its class.
    pub class: String,
    /// Its lease's phase (Admitted, Bound or Preempting).
    pub phase: LeasePhase,
    /// Since when it holds the slot (bound, else admitted).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub since: Option<Timestamp>,
    /// For a helper being evicted: the primary it makes room for.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub preempted_by: Option<String>,
}

impl Holder {
    fn of(l: &GpuLease) -> Holder {
        let s = l.status.as_ref();
        Holder {
            namespace: model::namespace(l).to_owned(),
            pod: model::pod(l).to_owned(),
            role: l.spec.role,
            class: l.spec.class_name.clone(),
            phase: model::phase(l),
            since: s
                .and_then(|s| s.bound_at.as_ref().or(s.admitted_at.as_ref()))
                .map(|t| t.0),
            preempted_by: s.and_then(|s| s.preempted_by.clone()),
        }
    }
}

/// Builds the whole picture from every class, node and lease, with no
/// pod: free slots count what the leases hold (as
/// [`build_visible`] does when not every pod could be listed).
pub fn build(classes: &[GpuLeaseClass], nodes: &[Node], leases: &[GpuLease]) -> TopView {
    build_visible(Some(classes), Some(nodes), &[], false, leases, None)
}

/// Builds what can be built from what the reader could list: `classes` and
/// `nodes` are `None` when they could not be listed, `all_pods` says
/// whether `pods` are every namespace's, and `leases_of` names the one
/// namespace `leases` were limited to (`None`: every namespace). The
/// per-node picture needs every node and every lease (a GPU no visible
/// lease holds may be another namespace's); without them the view lists
/// the GPUs the visible leases hold ([`TopView::held`]) instead. Free
/// slots are the engine's count ([`gpupool_engine::room`]) over these
/// objects.
pub fn build_visible(
    classes: Option<&[GpuLeaseClass]>,
    nodes: Option<&[Node]>,
    pods: &[Pod],
    all_pods: bool,
    leases: &[GpuLease],
    leases_of: Option<&str>,
) -> TopView {
    let holding: Vec<&GpuLease> = leases
        .iter()
        .filter(|l| model::phase(l).holds_slots())
        .collect();
    let (node_views, held) = match nodes {
        Some(nodes) if leases_of.is_none() => {
            let classes = classes.unwrap_or_default();
            let resources = model::resource_names(classes);
            let snapshot = rules::snapshot(classes, nodes, pods, leases, Timestamp::UNIX_EPOCH);
            let room = rules::room(&snapshot, all_pods);
            let mut views: Vec<NodeView> = nodes
                .iter()
                .filter_map(|n| node_view(n, &resources, &room, &holding))
                .collect();
            views.sort_by(|a, b| a.name.cmp(&b.name));
            (views, None)
        }
        _ => (Vec::new(), Some(held_gpus(&holding))),
    };
    TopView {
        classes: classes.map(class_lines),
        nodes: node_views,
        held,
        namespace: leases_of.map(str::to_owned),
        unseen: Vec::new(),
    }
}

/// Each GPU a lease reports, or one entry for a lease whose GPUs are not
/// reported yet; by node, then pod, then GPU.
fn held_gpus(holding: &[&GpuLease]) -> Vec<HeldGpu> {
    let mut out: Vec<HeldGpu> = Vec::new();
    for l in holding {
        let status = l.status.as_ref();
        let node = status.and_then(|s| s.node.clone());
        let gpus = status.map(|s| s.gpus.as_slice()).unwrap_or_default();
        if gpus.is_empty() {
            out.push(HeldGpu {
                node: node.clone(),
                gpu: None,
                product: None,
                holder: Holder::of(l),
            });
        }
        for g in gpus {
            out.push(HeldGpu {
                node: node.clone(),
                gpu: Some(g.index),
                product: g.product.clone(),
                holder: Holder::of(l),
            });
        }
    }
    out.sort_by(|a, b| {
        (&a.node, &a.holder.namespace, &a.holder.pod, a.gpu).cmp(&(
            &b.node,
            &b.holder.namespace,
            &b.holder.pod,
            b.gpu,
        ))
    });
    out
}

fn class_lines(classes: &[GpuLeaseClass]) -> Vec<ClassLine> {
    let mut class_lines: Vec<ClassLine> = classes
        .iter()
        .map(|c| {
            let s = c.status.clone().unwrap_or_default();
            ClassLine {
                name: model::class_name(c).to_owned(),
                default: c.spec.default,
                capacity: s.capacity,
                free: s.free,
                admitted: s.admitted,
                admitted_helpers: s.admitted_helpers,
                queued: s.queued,
                queued_helpers: s.queued_helpers,
                preempting: s.preempting,
            }
        })
        .collect();
    class_lines.sort_by(|a, b| a.name.cmp(&b.name));
    class_lines
}

/// The free slots of `resource` on `node` as the engine counts them, never
/// below zero; a resource no class uses is counted by nobody, so all its
/// `allocatable` slots are free.
fn free_of(room: &Room, resource: &str, node: &str, allocatable: u64) -> u64 {
    match room.free.get(resource) {
        Some(per_node) => per_node.get(node).copied().unwrap_or(0).max(0) as u64,
        None => allocatable,
    }
}

fn node_view(
    node: &Node,
    resources: &[String],
    room: &Room,
    holding: &[&GpuLease],
) -> Option<NodeView> {
    let name = node.metadata.name.clone().unwrap_or_default();
    let slots: u64 = resources.iter().map(|r| model::allocatable(node, r)).sum();
    let free: u64 = resources
        .iter()
        .map(|r| free_of(room, r, &name, model::allocatable(node, r)))
        .sum();
    let here: Vec<&GpuLease> = holding
        .iter()
        .copied()
        .filter(|l| l.status.as_ref().and_then(|s| s.node.as_deref()) == Some(name.as_str()))
        .collect();
    let (gpus, note) = match model::node_gpus(node) {
        Some(Ok(gpus)) => (gpus, None),
        Some(Err(e)) => (Vec::new(), Some(e)),
        None => (
            Vec::new(),
            Some("no gpupool.io/gpus annotation: is its device plugin running?".to_owned()),
        ),
    };
    if gpus.is_empty() && slots == 0 && here.is_empty() {
        return None;
    }
    // Each GPU offers the same number of sessions (--sessions-per-gpu).
    let per_gpu = if gpus.is_empty() {
        0
    } else {
        slots.div_ceil(gpus.len() as u64).max(1)
    };
    let mut gpu_views: Vec<GpuView> = gpus
        .into_iter()
        .map(|g| GpuView {
            index: g.index,
            uuid: g.uuid,
            product: g.product,
            healthy: g.healthy,
            slots: per_gpu,
            holders: Vec::new(),
        })
        .collect();
    let mut unplaced = Vec::new();
    let mut unreported = Vec::new();
    for l in here {
        let reported = l.status.as_ref().map(|s| s.gpus.as_slice()).unwrap_or(&[]);
        let mut placed = 0u64;
        for g in reported {
            if let Some(view) = gpu_views.iter_mut().find(|v| v.index == g.index) {
                view.holders.push(Holder::of(l));
                placed += 1;
            }
        }
        if placed == 0 {
            unplaced.push(Holder::of(l));
        } else if per_gpu == 1 {
            // One session per GPU: every slot is a GPU of its own.
            for _ in placed..u64::from(l.spec.slots) {
                unreported.push(Holder::of(l));
            }
        }
    }
    for g in &mut gpu_views {
        g.holders
            .sort_by(|a, b| (&a.namespace, &a.pod).cmp(&(&b.namespace, &b.pod)));
    }
    gpu_views.sort_by_key(|g| g.index);
    Some(NodeView {
        name,
        slots,
        free,
        gpus: gpu_views,
        unplaced,
        unreported,
        note,
    })
}

/// Renders the picture: the class table, then each node's heading (GPUs,
/// slots, free) and one row per held slot or free GPU. Helpers are marked in
/// the ROLE column, and a helper being preempted names the primary. Where
/// the picture is partial, a table of the GPUs the visible leases hold
/// stands for the nodes, and a line per list the credentials could not read
/// ends it.
pub fn render(view: &TopView, now: Timestamp, style: Style) -> String {
    let mut out = render_classes(view, style);
    match &view.held {
        Some(held) => out.push_str(&render_held(view, held, now, style)),
        None => out.push_str(&render_nodes(view, now, style)),
    }
    if !view.unseen.is_empty() {
        out.push('\n');
        out.push_str(&unseen::render(&view.unseen, style));
    }
    out
}

fn render_classes(view: &TopView, style: Style) -> String {
    let mut out = String::new();
    let Some(classes) = &view.classes else {
        return out;
    };
    if classes.is_empty() {
        out.push_str("no GpuLeaseClass exists (kubectl apply -f examples/class-default.yaml)\n");
    } else {
        let mut t = Table::new(&[
            "CLASS",
            "DEFAULT",
            "CAPACITY",
            "FREE",
            "ADMITTED",
            "HELPERS",
            "QUEUED",
            "QUEUED HELPERS",
            "PREEMPTING",
        ]);
        for c in classes {
            t.push(vec![
                Cell::new(c.name.clone(), Paint::Bold),
                Cell::from(c.default.to_string()),
                Cell::from(c.capacity.to_string()),
                Cell::new(c.free.to_string(), Paint::Green),
                Cell::from(c.admitted.to_string()),
                Cell::new(c.admitted_helpers.to_string(), Paint::Cyan),
                Cell::new(c.queued.to_string(), Paint::Yellow),
                Cell::from(c.queued_helpers.to_string()),
                Cell::from(c.preempting.to_string()),
            ]);
        }
        out.push_str(&t.render(style));
        // The two halves are read from different places and may disagree
        // for a moment after a change: say where each comes from.
        let nodes = if view.held.is_none() && !view.nodes.is_empty() {
            "; NODE lines: counted now from pods and leases"
        } else {
            ""
        };
        out.push_str(&style.paint(
            &format!("(class counts: as the operator last counted{nodes})"),
            Paint::Dim,
        ));
        out.push('\n');
    }
    out
}

fn render_held(view: &TopView, held: &[HeldGpu], now: Timestamp, style: Style) -> String {
    let mut out = String::new();
    if view.classes.is_some() {
        out.push('\n');
    }
    if held.is_empty() {
        let scope = view
            .namespace
            .as_deref()
            .map(|ns| format!(" of namespace {ns}"))
            .unwrap_or_default();
        out.push_str(&format!("no pod{scope} holds a GPU\n"));
        return out;
    }
    let mut t = Table::new(&[
        "NODE", "GPU", "PRODUCT", "POD", "ROLE", "PHASE", "SINCE", "NOTE",
    ]);
    for h in held {
        let mut row = vec![
            Cell::new(
                h.node.clone().unwrap_or_else(|| "?".to_owned()),
                Paint::Bold,
            ),
            Cell::from(h.gpu.map_or("?".to_owned(), |g| g.to_string())),
            Cell::from(h.product.clone().unwrap_or_default()),
        ];
        let mut cells = holder_cells(&h.holder, now);
        if h.gpu.is_none()
            && let Some(note) = cells.last_mut()
            && note.text.is_empty()
        {
            *note = Cell::from("GPU not reported yet");
        }
        row.extend(cells);
        t.push(row);
    }
    out.push_str(&t.render(style));
    out
}

fn render_nodes(view: &TopView, now: Timestamp, style: Style) -> String {
    let mut out = String::new();
    if view.nodes.is_empty() {
        out.push_str("\nno node has GPU slots (is the device plugin running? kubectl get nodes)\n");
        return out;
    }
    let tables: Vec<Table> = view.nodes.iter().map(|n| node_table(n, now)).collect();
    let widths = common_widths(&tables.iter().collect::<Vec<_>>());
    for (n, t) in view.nodes.iter().zip(&tables) {
        out.push('\n');
        out.push_str(&node_heading(n, style));
        out.push('\n');
        if !t.rows.is_empty() {
            out.push_str(&t.render_with_widths(style, &widths));
        }
    }
    out
}

fn node_heading(n: &NodeView, style: Style) -> String {
    let mut parts = Vec::new();
    if !n.gpus.is_empty() {
        parts.push(style::count(n.gpus.len() as u64, "GPU", "GPUs"));
    }
    parts.push(style::count(n.slots, "slot", "slots"));
    let free = format!("{} free", n.free);
    parts.push(style.paint(
        &free,
        if n.free > 0 {
            Paint::Green
        } else {
            Paint::Plain
        },
    ));
    let note = n
        .note
        .as_deref()
        .map(|m| format!(" ({})", style.paint(m, Paint::Yellow)))
        .unwrap_or_default();
    format!(
        "NODE {}: {}{note}",
        style.paint(&n.name, Paint::Bold),
        parts.join(", ")
    )
}

fn node_table(n: &NodeView, now: Timestamp) -> Table {
    let mut t = Table::new(&[
        "GPU", "PRODUCT", "HEALTH", "POD", "ROLE", "PHASE", "SINCE", "NOTE",
    ]);
    t.indent = 2;
    for g in &n.gpus {
        let health = if g.healthy {
            Cell::new("healthy", Paint::Green)
        } else {
            Cell::new("unhealthy", Paint::Red)
        };
        let lead = |t: &mut Table, rest: Vec<Cell>| {
            let mut row = vec![
                Cell::from(g.index.to_string()),
                Cell::from(g.product.clone()),
                health.clone(),
            ];
            row.extend(rest);
            t.push(row);
        };
        for h in &g.holders {
            lead(&mut t, holder_cells(h, now));
        }
        let free = g.slots.saturating_sub(g.holders.len() as u64);
        if free > 0 {
            let note = if g.slots > 1 {
                format!("{free} of {} free", style::count(g.slots, "slot", "slots"))
            } else {
                String::new()
            };
            lead(
                &mut t,
                vec![
                    Cell::new("-", Paint::Dim),
                    Cell::from(""),
                    Cell::new("free", Paint::Green),
                    Cell::from(""),
                    Cell::from(note),
                ],
            );
        }
    }
    let unnamed = n
        .unplaced
        .iter()
        .map(|h| (h, "GPU not reported yet"))
        .chain(n.unreported.iter().map(|h| {
            (
                h,
                "a GPU the kubelet does not name (an ended init container's)",
            )
        }));
    for (h, why) in unnamed {
        let mut row = vec![Cell::from("?"), Cell::from(""), Cell::from("")];
        let mut cells = holder_cells(h, now);
        if let Some(note) = cells.last_mut()
            && note.text.is_empty()
        {
            *note = Cell::from(why);
        }
        row.extend(cells);
        t.push(row);
    }
    t
}

fn holder_cells(h: &Holder, now: Timestamp) -> Vec<Cell> {
    let (role, role_paint) = match h.role {
        Role::Primary => ("primary", Paint::Plain),
        Role::Helper => ("helper*", Paint::Cyan),
    };
    let (phase, phase_paint) = match h.phase {
        LeasePhase::Bound => ("Bound", Paint::Green),
        LeasePhase::Admitted => ("Admitted", Paint::Plain),
        LeasePhase::Preempting => ("Preempting", Paint::Red),
        LeasePhase::Queued => ("Queued", Paint::Yellow),
        LeasePhase::Released => ("Released", Paint::Dim),
        LeasePhase::Rejected => ("Rejected", Paint::Red),
    };
    let note = h
        .preempted_by
        .as_deref()
        .map(|p| format!("evicted for {p}"))
        .unwrap_or_default();
    vec![
        Cell::new(format!("{}/{}", h.namespace, h.pod), Paint::Bold),
        Cell::new(role, role_paint),
        Cell::new(phase, phase_paint),
        Cell::from(h.since.map_or("-".to_owned(), |t| style::age(t, now))),
        Cell::new(note, Paint::Red),
    ]
}

/// The legend printed under the picture when a helper is shown.
pub fn legend(view: &TopView) -> Option<&'static str> {
    let any_helper = view.nodes.iter().any(|n| {
        n.unplaced.iter().any(|h| h.role == Role::Helper)
            || n.gpus
                .iter()
                .any(|g| g.holders.iter().any(|h| h.role == Role::Helper))
    }) || view
        .held
        .iter()
        .flatten()
        .any(|h| h.holder.role == Role::Helper);
    any_helper
        .then_some("helper*: runs only on idle GPUs and is evicted when a primary needs its GPU")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::fixtures::*;

    fn sample() -> TopView {
        let mut backfill = holding(
            "ml",
            "backfill",
            Role::Helper,
            LeasePhase::Preempting,
            "node-2",
            &[0],
            3,
        );
        if let Some(s) = backfill.status.as_mut() {
            s.preempted_by = Some("ml/train-b".into());
        }
        let leases = vec![
            holding(
                "ml",
                "train-a",
                Role::Primary,
                LeasePhase::Bound,
                "node-1",
                &[0, 1],
                1,
            ),
            backfill,
            holding(
                "ml",
                "fresh",
                Role::Primary,
                LeasePhase::Admitted,
                "node-2",
                &[],
                4,
            ),
            queued("ml", "train-c", Role::Primary, 2, 5, 4, "waiting: x"),
            holding(
                "ml",
                "done",
                Role::Primary,
                LeasePhase::Released,
                "node-2",
                &[1],
                0,
            ),
        ];
        let mut plain = node("node-9", 0, 1, &[]);
        plain.metadata.annotations = None;
        if let Some(s) = plain.status.as_mut() {
            s.allocatable = None;
        }
        let nodes = vec![node("node-2", 2, 1, &[1]), node("node-1", 2, 1, &[]), plain];
        let mut c = class("default", 4, 0, 1);
        if let Some(s) = c.status.as_mut() {
            s.admitted = 2;
            s.admitted_helpers = 1;
            s.preempting = 1;
        }
        build(&[c], &nodes, &leases)
    }

    #[test]
    fn holders_land_on_their_gpus_and_free_slots_are_counted() {
        let view = sample();
        let names: Vec<&str> = view.nodes.iter().map(|n| n.name.as_str()).collect();
        assert_eq!(
            names,
            ["node-1", "node-2"],
            "a node without GPUs or slots is left out"
        );
        let cases: &[(usize, u32, &[&str])] = &[
            (0, 0, &["train-a"]),
            (0, 1, &["train-a"]),
            (1, 0, &["backfill"]),
            (1, 1, &[]),
        ];
        for (n, gpu, pods) in cases {
            let g = view.nodes[*n]
                .gpus
                .iter()
                .find(|g| g.index == *gpu)
                .expect("gpu");
            let got: Vec<&str> = g.holders.iter().map(|h| h.pod.as_str()).collect();
            assert_eq!(got, *pods, "node {n} gpu {gpu}");
        }
        assert_eq!((view.nodes[0].slots, view.nodes[0].free), (2, 0));
        // backfill (1) and fresh (1) hold slots on node-2; the Released lease does not.
        assert_eq!((view.nodes[1].slots, view.nodes[1].free), (2, 0));
        assert_eq!(view.nodes[1].unplaced[0].pod, "fresh");
    }

    #[test]
    fn renders_classes_then_nodes() {
        let view = sample();
        let text = render(&view, now(), Style::PLAIN);
        let want = "\
CLASS     DEFAULT   CAPACITY   FREE   ADMITTED   HELPERS   QUEUED   QUEUED HELPERS   PREEMPTING
default   true      4          0      2          1         1        0                1
(class counts: as the operator last counted; NODE lines: counted now from pods and leases)

NODE node-1: 2 GPUs, 2 slots, 0 free
  GPU   PRODUCT   HEALTH      POD           ROLE      PHASE        SINCE   NOTE
  0     Sim GPU   healthy     ml/train-a    primary   Bound        45s
  1     Sim GPU   healthy     ml/train-a    primary   Bound        45s

NODE node-2: 2 GPUs, 2 slots, 0 free
  GPU   PRODUCT   HEALTH      POD           ROLE      PHASE        SINCE   NOTE
  0     Sim GPU   healthy     ml/backfill   helper*   Preempting   50s     evicted for ml/train-b
  1     Sim GPU   unhealthy   -                       free
  ?                           ml/fresh      primary   Admitted     50s     GPU not reported yet
";
        assert_eq!(text, want);
        assert!(legend(&view).is_some_and(|l| l.starts_with("helper*")));
    }

    #[test]
    fn several_sessions_per_gpu_and_missing_annotations() {
        let mut n = node("node-1", 1, 2, &[]);
        let leases = vec![holding(
            "ml",
            "a",
            Role::Primary,
            LeasePhase::Bound,
            "node-1",
            &[0],
            1,
        )];
        let classes = [class("default", 2, 1, 0)];
        let view = build(&classes, std::slice::from_ref(&n), &leases);
        assert_eq!(view.nodes[0].gpus[0].slots, 2);
        let text = render(&view, now(), Style::PLAIN);
        assert!(
            text.contains("NODE node-1: 1 GPU, 2 slots, 1 free\n"),
            "{text}"
        );
        assert!(
            text.contains(
                "  0     Sim GPU   healthy   -                free            1 of 2 slots free\n"
            ),
            "{text}"
        );

        n.metadata.annotations = None;
        // Without a class nobody counts the resource: every slot is free.
        let view = build(&[], &[n], &leases);
        let text = render(&view, now(), Style::PLAIN);
        assert!(text.starts_with("no GpuLeaseClass exists"), "{text}");
        assert!(
            text.contains("NODE node-1: 2 slots, 2 free (no gpupool.io/gpus annotation: is its device plugin running?)\n"),
            "{text}"
        );
        assert!(legend(&view).is_none());
        let empty = render(&build(&[], &[], &[]), now(), Style::PLAIN);
        assert!(empty.contains("no node has GPU slots"), "{empty}");
    }

    #[test]
    fn slots_beyond_the_reported_gpus_are_held_not_free() {
        // An init container took 2 GPUs and ended; the app container runs
        // on GPU 0, and PodResources names only that one.
        let mut l = holding(
            "ml",
            "init",
            Role::Primary,
            LeasePhase::Bound,
            "node-1",
            &[0],
            1,
        );
        l.spec.slots = 2;
        let classes = [class("default", 3, 1, 0)];
        let view = build(&classes, &[node("node-1", 3, 1, &[])], &[l]);
        let n = &view.nodes[0];
        assert_eq!(n.free, 1, "the engine counts both slots");
        assert_eq!(n.unreported.len(), 1);
        let text = render(&view, now(), Style::PLAIN);
        assert!(
            text.contains("a GPU the kubelet does not name (an ended init container's)"),
            "{text}"
        );
        assert!(
            text.contains("NODE node-1: 3 GPUs, 3 slots, 1 free\n"),
            "{text}"
        );
    }

    #[test]
    fn json_names_holders() {
        let json = serde_json::to_value(sample()).expect("json");
        assert_eq!(
            json["nodes"][1]["gpus"][0]["holders"][0]["preemptedBy"],
            "ml/train-b"
        );
        assert_eq!(
            json["nodes"][1]["gpus"][0]["holders"][0]["phase"],
            "Preempting"
        );
        assert_eq!(json["classes"][0]["admittedHelpers"], 1);
        assert!(json.get("held").is_none() && json.get("unseen").is_none());
    }

    /// A tenant who may list only its namespace's leases, and neither
    /// classes nor nodes: the GPUs its pods hold, by node, and no claim
    /// about free GPUs.
    #[test]
    fn a_namespace_reader_sees_the_gpus_its_pods_hold() {
        let leases = vec![
            holding(
                "ml",
                "train-a",
                Role::Primary,
                LeasePhase::Bound,
                "node-1",
                &[1, 0],
                1,
            ),
            holding(
                "ml",
                "fresh",
                Role::Helper,
                LeasePhase::Admitted,
                "node-2",
                &[],
                4,
            ),
            queued("ml", "train-c", Role::Primary, 2, 5, 4, "waiting: x"),
        ];
        let mut view = build_visible(None, None, &[], false, &leases, Some("ml"));
        view.unseen = vec![
            Unseen::leases("ml", ": only the GPUs its pods hold"),
            Unseen::classes("class capacity is not shown"),
        ];
        let text = render(&view, now(), Style::PLAIN);
        let want = "\
NODE     GPU   PRODUCT   POD          ROLE      PHASE      SINCE   NOTE
node-1   0     Sim GPU   ml/train-a   primary   Bound      45s
node-1   1     Sim GPU   ml/train-a   primary   Bound      45s
node-2   ?               ml/fresh     helper*   Admitted   50s     GPU not reported yet

cannot list GpuLeases in all namespaces: forbidden; showing namespace ml: only the GPUs its pods hold
cannot list GpuLeaseClasses: forbidden; class capacity is not shown
";
        assert_eq!(text, want);
        assert!(legend(&view).is_some());
        let json = serde_json::to_value(&view).expect("json");
        assert!(json.get("classes").is_none(), "{json}");
        assert_eq!(json["namespace"], "ml");
        assert_eq!(json["held"][0]["holder"]["pod"], "train-a");
        assert_eq!(json["held"][2].get("gpu"), None);
        assert_eq!(json["unseen"][1]["what"], "GpuLeaseClasses");

        // Nodes visible but not every lease: still only what is held, since
        // a GPU no visible lease holds may be another namespace's.
        let nodes = vec![node("node-1", 2, 1, &[])];
        let view = build_visible(Some(&[]), Some(&nodes), &[], false, &leases, Some("ml"));
        assert!(view.nodes.is_empty());
        assert_eq!(view.held.as_ref().map(Vec::len), Some(3));
        let text = render(&view, now(), Style::PLAIN);
        assert!(text.starts_with("no GpuLeaseClass exists"), "{text}");
        // Nothing held in the namespace.
        let view = build_visible(None, None, &[], false, &leases[2..], Some("ml"));
        assert_eq!(
            render(&view, now(), Style::PLAIN),
            "no pod of namespace ml holds a GPU\n"
        );
        assert!(legend(&view).is_none());
    }
}
