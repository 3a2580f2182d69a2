//! `kubectl gpupool why POD`: one paragraph on a pod's lease, its place, and
//! what blocks it (the operator's message, node fit, its own selector,
//! helpers being preempted for it).

use gpupool_api::names::DEFAULT_RESOURCE_NAME;
use gpupool_api::{GpuLease, GpuLeaseClass, LeasePhase, Role};
use jiff::Timestamp;
use k8s_openapi::api::core::v1::{Node, Pod};

use gpupool_engine::fit;
use gpupool_engine::{NodeInfo, PodInfo};

use crate::error::Error;
use crate::model;
use crate::queue::ordering_name;
use crate::rules;
use crate::style::{self, Paint, Style};
use crate::unseen::{self, Unseen};

/// Everything `why` reads, already fetched.
#[derive(Debug, Clone, Copy)]
pub struct WhyInput<'a> {
    /// The pod asked about.
    pub pod: &'a Pod,
    /// Its lease (same namespace and name), if any.
    pub lease: Option<&'a GpuLease>,
    /// Every class (none when `classes_visible` is false).
    pub classes: &'a [GpuLeaseClass],
    /// Whether the reader may list classes: when not, nothing is said of
    /// the class's capacity, ordering or existence.
    pub classes_visible: bool,
    /// The leases the reader may list (every namespace when `all_visible`).
    pub leases: &'a [GpuLease],
    /// Whether `leases` holds every namespace's leases.
    pub all_visible: bool,
    /// The nodes, when the reader may list them.
    pub nodes: Option<&'a [Node]>,
    /// The pods the reader may list: with the nodes and leases, the engine
    /// counts each node's free slots from them.
    pub pods: &'a [Pod],
    /// Whether `pods` holds every namespace's pods; when not, a lease
    /// whose pod is not listed holds what its status says.
    pub all_pods_visible: bool,
    /// The time ages are measured to.
    pub now: Timestamp,
    /// What the credentials could not list, said after the paragraph of a
    /// waiting pod (the only one that reads classes, nodes and other
    /// namespaces' leases).
    pub unseen: &'a [Unseen],
}

/// Explains the pod in one paragraph (ending in a newline), followed by a
/// line per list the credentials could not read. Errors:
/// [`Error::NoSlotRequest`] for a pod that requests no slot,
/// [`Error::NoLease`] for one that does but has no lease (or only a lease
/// left from an earlier pod of the same name).
pub fn explain(input: WhyInput<'_>, style: Style) -> Result<String, Error> {
    let pod = input.pod;
    let ns = pod.metadata.namespace.clone().unwrap_or_default();
    let name = pod.metadata.name.clone().unwrap_or_default();
    let lease = input.lease.filter(|l| {
        pod.metadata
            .uid
            .as_deref()
            .is_none_or(|uid| uid == l.spec.pod_uid)
    });
    let Some(lease) = lease else {
        return Err(missing_lease(&input, ns, name));
    };
    let key = style.paint(&format!("{ns}/{name}"), Paint::Bold);
    let class = input
        .classes
        .iter()
        .find(|c| model::class_name(c) == lease.spec.class_name);
    let role = lease.spec.role;
    let slots = style::count(lease.spec.slots.into(), "slot", "slots");
    let class_name = &lease.spec.class_name;
    let status = lease.status.as_ref();
    let message = status.and_then(|s| s.message.as_deref());
    let node = status.and_then(|s| s.node.as_deref()).unwrap_or("its node");
    let gpus: Vec<u32> = status
        .map(|s| s.gpus.iter().map(|g| g.index).collect())
        .unwrap_or_default();
    let mut s: Vec<String> = Vec::new();
    let waits = status.is_some() && model::phase(lease) == LeasePhase::Queued;
    match (status, model::phase(lease)) {
        (None, _) => s.push(format!(
            "Pod {key} has a GpuLease in class {class_name} ({role}, {slots}) that the operator has not decided on yet: is the operator running? (kubectl get pods -A -l app.kubernetes.io/name=gpupool)."
        )),
        (Some(_), LeasePhase::Queued) => waiting(&input, lease, class, &key, &mut s),
        (Some(st), LeasePhase::Admitted) => {
            let ago = since(st.admitted_at.as_ref(), input.now);
            s.push(format!(
                "Pod {key} is a {role} admitted to {node}{ago} with {slots} in class {class_name}; it is starting, and the device plugin has not reported its GPUs yet. Nothing blocks it."
            ));
        }
        (Some(st), LeasePhase::Bound) => {
            let ago = since(st.bound_at.as_ref().or(st.admitted_at.as_ref()), input.now);
            s.push(format!(
                "Pod {key} is a {role} holding {} on {node} ({slots} in class {class_name}){ago}. Nothing blocks it.",
                gpu_prose(&gpus)
            ));
        }
        (Some(st), LeasePhase::Preempting) => {
            let by = st.preempted_by.as_deref().unwrap_or("a waiting primary");
            s.push(format!(
                "Pod {key} is a {role} being evicted from {} on {node} to make room for primary {by}; it holds its {slots} until it has terminated.",
                gpu_prose(&gpus)
            ));
        }
        (Some(_), LeasePhase::Released) => s.push(format!(
            "Pod {key}'s lease in class {class_name} is Released (the pod finished or is being deleted): it holds no slot and waits for nothing."
        )),
        (Some(_), LeasePhase::Rejected) => s.push(format!(
            "Pod {key} ({role}, {slots}) can never be admitted in class {class_name}: {}.",
            message.unwrap_or("the operator gave no reason").trim_end_matches('.')
        )),
    }
    let unseen = if waits {
        unseen::render(input.unseen, style)
    } else {
        String::new()
    };
    Ok(format!("{}\n{unseen}", s.join(" ")))
}

fn missing_lease(input: &WhyInput<'_>, namespace: String, name: String) -> Error {
    let pod = input.pod;
    // The class the pod names, else the default one, decides the resource;
    // a pod naming no known class is checked against every class's resource.
    let class = match gpupool_api::pod::class_label(pod) {
        Some(label) => input.classes.iter().find(|c| model::class_name(c) == label),
        None => input.classes.iter().find(|c| c.spec.default),
    };
    let resources: Vec<String> = match class {
        Some(c) => vec![c.spec.resource_name.clone()],
        None => model::resource_names(input.classes),
    };
    let spec = pod.spec.clone().unwrap_or_default();
    let request = resources.iter().find_map(|r| {
        gpupool_api::pod::mentions_resource(&spec, r).then(|| {
            match gpupool_api::pod::requested_slots(&spec, r) {
                Ok(n) => format!("{} of {r}", style::count(n.into(), "slot", "slots")),
                Err(e) => format!("{r} ({e})"),
            }
        })
    });
    match request {
        Some(request) => Error::NoLease {
            namespace,
            name,
            request,
        },
        None => Error::NoSlotRequest {
            namespace,
            name,
            resources: match (resources.is_empty(), input.classes_visible) {
                (_, false) => format!(
                    "{}; GpuLeaseClasses cannot be listed with these credentials, so other classes' resource names are unknown",
                    resources.join(" or ")
                ),
                (true, true) => DEFAULT_RESOURCE_NAME.to_owned(),
                (false, true) => resources.join(" or "),
            },
        },
    }
}

fn waiting(
    input: &WhyInput<'_>,
    lease: &GpuLease,
    class: Option<&GpuLeaseClass>,
    key: &str,
    s: &mut Vec<String>,
) {
    let role = lease.spec.role;
    let roles = style::noun(2, role.as_str(), plural(role));
    let class_name = &lease.spec.class_name;
    let slots = style::count(lease.spec.slots.into(), "slot", "slots");
    let waited = since(
        lease.status.as_ref().and_then(|st| st.queued_at.as_ref()),
        input.now,
    );
    let line = model::fifo(input.leases, class_name, role);
    let me = line.iter().position(|l| model::key(l) == model::key(lease));
    let place = match (input.all_visible, me) {
        (true, Some(i)) => format!(", at position {} of {} waiting {roles}", i + 1, line.len()),
        _ => match lease.status.as_ref().and_then(|st| st.position) {
            Some(p) if p > 0 => format!(", at position {p} among waiting {roles}"),
            _ => String::new(),
        },
    };
    let seq = model::sequence(lease)
        .map(|q| format!(" (sequence {q})"))
        .unwrap_or_else(|| " (no sequence yet: the operator has just seen it)".to_owned());
    s.push(format!(
        "Pod {key} is a {role} waiting{waited} for {slots} in class {class_name}{place}{seq}."
    ));
    if let (true, Some(i)) = (input.all_visible, me)
        && i > 0
    {
        let ahead: Vec<String> = line[..i]
            .iter()
            .take(3)
            .map(|l| {
                format!(
                    "{} ({})",
                    model::key(l),
                    style::count(l.spec.slots.into(), "slot", "slots")
                )
            })
            .collect();
        let more = if i > 3 {
            format!(" and {} more", i - 3)
        } else {
            String::new()
        };
        s.push(format!("Ahead of it: {}{more}.", ahead.join(", ")));
    }
    match lease.status.as_ref().and_then(|st| st.message.as_deref()) {
        Some(m) => {
            let m = m.strip_prefix("waiting: ").unwrap_or(m);
            s.push(format!("The operator says: {}.", m.trim_end_matches('.')));
        }
        None => s.push("The operator has not said why yet.".to_owned()),
    }
    match class {
        Some(c) => {
            let st = c.status.clone().unwrap_or_default();
            s.push(format!(
                "Class {class_name} ({}) has {}, {} free as the operator last counted.",
                ordering_name(c.spec.admission.ordering),
                style::count(st.capacity.into(), "slot", "slots"),
                st.free
            ));
            if let Some(nodes) = input.nodes {
                let (sentences, room) = fit(input, lease, c, nodes);
                s.extend(sentences);
                let strict = c.spec.admission.ordering == gpupool_api::Ordering::StrictFIFO;
                if room > 0 && role == Role::Primary && strict && me.is_some_and(|i| i > 0) {
                    s.push(
                        "Under StrictFIFO it still waits for the primaries ahead of it, even where it would fit."
                            .to_owned(),
                    );
                }
            }
            if role == Role::Helper && !c.spec.helpers.admit_while_queued {
                let primaries = model::fifo(input.leases, class_name, Role::Primary).len();
                if primaries > 0 {
                    s.push(format!(
                        "Helpers wait while any primary of the class does ({} waiting; helpers.admitWhileQueued is false).",
                        style::count(primaries as u64, "primary", "primaries")
                    ));
                }
            }
            if role == Role::Primary
                && c.spec.admission.ordering == gpupool_api::Ordering::StrictFIFO
                && input.all_visible
                && let Some(i) = me
            {
                let behind = line.len() - i - 1;
                if behind > 0 {
                    s.push(format!(
                        "Under StrictFIFO it holds back the {} behind it.",
                        style::count(behind as u64, "primary", "primaries")
                    ));
                }
            }
        }
        None if input.classes_visible => s.push(format!(
            "There is no GpuLeaseClass named {class_name} (kubectl get gpuleaseclasses)."
        )),
        // Classes cannot be listed: the line after the paragraph says so.
        None => {}
    }
    let me_key = model::key(lease);
    let victims: Vec<String> = input
        .leases
        .iter()
        .filter(|l| {
            l.status.as_ref().and_then(|st| st.preempted_by.as_deref()) == Some(me_key.as_str())
        })
        .filter(|l| model::phase(l) != LeasePhase::Released)
        .map(|l| {
            let node = l
                .status
                .as_ref()
                .and_then(|st| st.node.as_deref())
                .unwrap_or("?");
            format!("{} on {node}", model::key(l))
        })
        .collect();
    if !victims.is_empty() {
        s.push(format!(
            "{} {} {} being preempted to make room for it; it is admitted once {} terminated.",
            if victims.len() == 1 {
                "Helper"
            } else {
                "Helpers"
            },
            style::join_prose(&victims),
            if victims.len() == 1 { "is" } else { "are" },
            if victims.len() == 1 {
                "that pod has"
            } else {
                "they have"
            },
        ));
    }
}

/// Node fit, as the engine decides it: the class's nodes with their free
/// slots, and what the pod's own nodeSelector, required affinity and
/// tolerations (against cordons and taints) leave of them. Returns the
/// sentences and on how many nodes the pod could start now.
fn fit(
    input: &WhyInput<'_>,
    lease: &GpuLease,
    class: &GpuLeaseClass,
    nodes: &[Node],
) -> (Vec<String>, usize) {
    let res = &class.spec.resource_name;
    let want = u64::from(lease.spec.slots);
    let snapshot = rules::snapshot(input.classes, nodes, input.pods, input.leases, input.now);
    let room = rules::room(&snapshot, input.all_pods_visible);
    let class_nodes: Vec<(&NodeInfo, u64)> = room
        .class_nodes(model::class_name(class))
        .iter()
        .filter_map(|name| snapshot.nodes.iter().find(|n| n.name == *name))
        .map(|n| {
            let free = room.free(res, &n.name).unwrap_or(0).max(0) as u64;
            (n, free)
        })
        .collect();
    let mut out = Vec::new();
    if class_nodes.is_empty() {
        out.push(format!(
            "No node offers {res} and matches the class's nodeSelector."
        ));
        return (out, 0);
    }
    let describe = |list: &[(&NodeInfo, u64)]| -> String {
        let parts: Vec<String> = list
            .iter()
            .take(6)
            .map(|(n, free)| format!("{} {free} free", n.name))
            .collect();
        let more = if list.len() > 6 {
            format!(", and {} more", list.len() - 6)
        } else {
            String::new()
        };
        format!("{}{more}", parts.join(", "))
    };
    let me = rules::pod_info(&snapshot, input.pod);
    // The engine's own test, with the pod's choice of nodes (nodeSelector,
    // required affinity) left out, tells the nodes that turn it away
    // (cordoned, or tainted against it) apart from those it does not choose.
    let unchoosy = me.as_ref().map(|me| PodInfo {
        node_selector: Default::default(),
        required_affinity: None,
        ..me.clone()
    });
    let open = |n: &NodeInfo| unchoosy.as_ref().is_none_or(|p| fit::pod_fits_node(p, n));
    let fitting = class_nodes
        .iter()
        .filter(|(n, f)| *f >= want && open(n))
        .count();
    out.push(format!(
        "Of the class's {}, counted now from pods and leases ({}), {} room for {}.",
        style::count(class_nodes.len() as u64, "node", "nodes"),
        describe(&class_nodes),
        match fitting {
            0 => "none has".to_owned(),
            1 => "1 has".to_owned(),
            n => format!("{n} have"),
        },
        style::count(want, "slot", "slots"),
    ));
    let turned_away: Vec<String> = class_nodes
        .iter()
        .filter(|(n, _)| !open(n))
        .map(|(n, _)| n.name.clone())
        .collect();
    if !turned_away.is_empty() {
        out.push(format!(
            "{} {} cordoned or {} a taint it does not tolerate.",
            style::join_prose(&turned_away),
            if turned_away.len() == 1 { "is" } else { "are" },
            if turned_away.len() == 1 {
                "has"
            } else {
                "have"
            },
        ));
    }
    let Some(me) = me else {
        return (out, fitting);
    };
    // Of those, the nodes its own nodeSelector and affinity choose.
    let chosen: Vec<(&NodeInfo, u64)> = class_nodes
        .iter()
        .copied()
        .filter(|(n, _)| {
            let open = NodeInfo {
                unschedulable: false,
                taints: Vec::new(),
                ..(*n).clone()
            };
            fit::pod_fits_node(&me, &open)
        })
        .collect();
    let usable: Vec<(&NodeInfo, u64)> = chosen
        .iter()
        .copied()
        .filter(|(n, _)| fit::pod_fits_node(&me, n))
        .collect();
    if fit::narrows_nodes(&me) {
        let mut own: Vec<String> = Vec::new();
        if !me.node_selector.is_empty() {
            let sel: Vec<String> = me
                .node_selector
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect();
            own.push(format!("nodeSelector ({})", sel.join(", ")));
        }
        if me.required_affinity.is_some() {
            own.push("required node affinity".to_owned());
        }
        let own = own.join(" and ");
        if chosen.is_empty() {
            out.push(format!(
                "Its own {own} allows none of them, so it cannot start until such a node joins the class."
            ));
        } else {
            out.push(format!(
                "Its own {own} allows {} of them ({}).",
                chosen.len(),
                describe(&chosen)
            ));
        }
    }
    let room_now = usable.iter().filter(|(_, f)| *f >= want).count();
    (out, room_now)
}

fn plural(role: Role) -> &'static str {
    match role {
        Role::Primary => "primaries",
        Role::Helper => "helpers",
    }
}

fn since(
    t: Option<&k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>,
    now: Timestamp,
) -> String {
    t.map(|t| format!(" for {}", style::age(t.0, now)))
        .unwrap_or_default()
}

fn gpu_prose(gpus: &[u32]) -> String {
    match gpus {
        [] => "slots (GPUs not reported yet)".to_owned(),
        [one] => format!("GPU {one}"),
        many => format!(
            "GPUs {}",
            style::join_prose(&many.iter().map(u32::to_string).collect::<Vec<_>>())
        ),
    }
}

#[cfg(test)]
// Table-driven cases are tuples of the inputs and what is expected.
#[allow(clippy::type_complexity)]
mod tests {
    use super::*;
    use crate::model::fixtures::*;

    fn pod(name: &str, slots: Option<u32>, selector: &[(&str, &str)]) -> Pod {
        let mut v = serde_json::json!({
            "metadata": {"name": name, "namespace": "ml", "uid": format!("uid-{name}")},
            "spec": {"containers": [{"name": "c"}]}
        });
        if let Some(n) = slots {
            v["spec"]["containers"][0]["resources"] =
                serde_json::json!({"limits": {"gpupool/slot": n.to_string()}});
        }
        if !selector.is_empty() {
            let m: serde_json::Map<String, serde_json::Value> = selector
                .iter()
                .map(|(k, val)| ((*k).to_owned(), serde_json::Value::from(*val)))
                .collect();
            v["spec"]["nodeSelector"] = serde_json::Value::Object(m);
        }
        serde_json::from_value(v).expect("pod")
    }

    struct World {
        leases: Vec<GpuLease>,
        classes: Vec<GpuLeaseClass>,
        nodes: Vec<Node>,
    }

    fn world() -> World {
        let mut backfill = holding(
            "ml",
            "backfill",
            Role::Helper,
            LeasePhase::Preempting,
            "node-2",
            &[0],
            2,
        );
        if let Some(s) = backfill.status.as_mut() {
            s.preempted_by = Some("ml/train-b".into());
        }
        let mut pinned = queued(
            "ml",
            "pinned",
            Role::Primary,
            1,
            8,
            1,
            "waiting: 2 primaries ahead",
        );
        pinned.spec.slots = 1;
        World {
            leases: vec![
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
                queued(
                    "ml",
                    "train-b",
                    Role::Primary,
                    2,
                    3,
                    4,
                    "waiting: needs 2 slots on one node, 1 free slots; 1 helper being preempted",
                ),
                queued(
                    "ml",
                    "train-c",
                    Role::Primary,
                    2,
                    5,
                    3,
                    "waiting: 1 primary ahead; needs 2 slots on one node, 1 free slots on 2 matching nodes",
                ),
                pinned,
                queued(
                    "ml",
                    "helper-2",
                    Role::Helper,
                    1,
                    9,
                    2,
                    "waiting: 3 primaries of class default are queued; helpers are admitted only while none wait",
                ),
                holding(
                    "ml",
                    "fresh",
                    Role::Primary,
                    LeasePhase::Admitted,
                    "node-3",
                    &[],
                    10,
                ),
            ],
            classes: vec![class("default", 4, 1, 3)],
            nodes: vec![node("node-1", 2, 1, &[]), node("node-2", 2, 1, &[])],
        }
    }

    fn explain_in(w: &World, p: &Pod, all: bool, with_nodes: bool) -> Result<String, Error> {
        let lease = w
            .leases
            .iter()
            .find(|l| Some(l.spec.pod_name.as_str()) == p.metadata.name.as_deref());
        explain(
            WhyInput {
                pod: p,
                lease,
                classes: &w.classes,
                classes_visible: true,
                leases: &w.leases,
                all_visible: all,
                nodes: with_nodes.then_some(w.nodes.as_slice()),
                pods: &[],
                all_pods_visible: false,
                now: now(),
                unseen: &[],
            },
            Style::PLAIN,
        )
    }

    #[test]
    fn one_paragraph_per_phase() {
        let w = world();
        let cases: &[(&str, u32, &[(&str, &str)], &[&str])] = &[
            (
                "train-b",
                2,
                &[],
                &[
                    "Pod ml/train-b is a primary waiting for 4s for 2 slots in class default, at position 1 of 3 waiting primaries (sequence 3).",
                    "The operator says: needs 2 slots on one node, 1 free slots; 1 helper being preempted.",
                    "Class default (StrictFIFO) has 4 slots, 1 free as the operator last counted.",
                    "Of the class's 2 nodes, counted now from pods and leases (node-1 0 free, node-2 1 free), none has room for 2 slots.",
                    "Under StrictFIFO it holds back the 2 primaries behind it.",
                    "Helper ml/backfill on node-2 is being preempted to make room for it; it is admitted once that pod has terminated.",
                ],
            ),
            (
                "train-c",
                2,
                &[],
                &[
                    "at position 2 of 3 waiting primaries (sequence 5).",
                    "Ahead of it: ml/train-b (2 slots).",
                    "Under StrictFIFO it holds back the 1 primary behind it.",
                ],
            ),
            (
                "pinned",
                1,
                &[("gpu-pool", "large")],
                &[
                    "Pod ml/pinned is a primary waiting for 1s for 1 slot in class default, at position 3 of 3 waiting primaries (sequence 8).",
                    "Ahead of it: ml/train-b (2 slots), ml/train-c (2 slots).",
                    "1 has room for 1 slot.",
                    "Its own nodeSelector (gpu-pool=large) allows none of them, so it cannot start until such a node joins the class.",
                ],
            ),
            (
                "helper-2",
                1,
                &[],
                &[
                    "Pod ml/helper-2 is a helper waiting for 2s for 1 slot in class default, at position 1 of 1 waiting helpers (sequence 9).",
                    "Helpers wait while any primary of the class does (3 primaries waiting; helpers.admitWhileQueued is false).",
                ],
            ),
            (
                "train-a",
                2,
                &[],
                &[
                    "Pod ml/train-a is a primary holding GPUs 0 and 1 on node-1 (2 slots in class default) for 45s. Nothing blocks it.\n",
                ],
            ),
            (
                "backfill",
                1,
                &[],
                &[
                    "Pod ml/backfill is a helper being evicted from GPU 0 on node-2 to make room for primary ml/train-b; it holds its 1 slot until it has terminated.\n",
                ],
            ),
            (
                "fresh",
                1,
                &[],
                &[
                    "Pod ml/fresh is a primary admitted to node-3 for 50s with 1 slot in class default; it is starting",
                ],
            ),
        ];
        for (name, slots, selector, wants) in cases {
            let p = pod(name, Some(*slots), selector);
            let text = explain_in(&w, &p, true, true).expect("explains");
            assert_eq!(text.lines().count(), 1, "one paragraph: {text}");
            for want in *wants {
                assert!(text.contains(want), "{name}: missing {want:?} in\n{text}");
            }
        }
    }

    #[test]
    fn own_selector_that_some_nodes_satisfy() {
        let mut w = world();
        w.nodes[1]
            .metadata
            .labels
            .get_or_insert_default()
            .insert("gpu-pool".into(), "large".into());
        let p = pod("pinned", Some(1), &[("gpu-pool", "large")]);
        let text = explain_in(&w, &p, true, true).expect("explains");
        assert!(
            text.contains(
                "Its own nodeSelector (gpu-pool=large) allows 1 of them (node-2 1 free)."
            ),
            "{text}"
        );
        assert!(
            text.ends_with(
                "Under StrictFIFO it still waits for the primaries ahead of it, even where it would fit.\n"
            ),
            "{text}"
        );
        // Where its own selector leaves no room, that is not said.
        let text = explain_in(&world(), &p, true, true).expect("explains");
        assert!(!text.contains("even where it would fit"), "{text}");
    }

    #[test]
    fn without_other_namespaces_or_nodes_it_says_less_but_no_wrong() {
        let w = world();
        let mut lease_pos = w.leases.clone();
        if let Some(s) = lease_pos[3].status.as_mut() {
            s.position = Some(2);
        }
        let w2 = World {
            leases: lease_pos,
            ..world()
        };
        let p = pod("train-c", Some(2), &[]);
        let text = explain_in(&w2, &p, false, false).expect("explains");
        assert!(
            text.contains("at position 2 among waiting primaries (sequence 5)."),
            "{text}"
        );
        assert!(!text.contains("Ahead of it"), "{text}");
        assert!(!text.contains("Of the class's"), "{text}");
        assert!(!text.contains("holds back"), "{text}");
    }

    #[test]
    fn rejected_released_unsequenced_and_undecided_leases() {
        let mut w = world();
        let mut rejected = queued(
            "ml",
            "rej",
            Role::Primary,
            9,
            11,
            1,
            "needs 9 slots; largest matching node has 2",
        );
        if let Some(s) = rejected.status.as_mut() {
            s.phase = LeasePhase::Rejected;
        }
        let released = holding(
            "ml",
            "gone",
            Role::Primary,
            LeasePhase::Released,
            "node-1",
            &[],
            0,
        );
        let mut fresh = queued("ml", "new", Role::Primary, 1, 0, 1, "waiting: x");
        if let Some(s) = fresh.status.as_mut() {
            s.sequence = None;
        }
        let undecided = lease("ml", "undecided", "ghost", Role::Primary, 1);
        w.leases.extend([rejected, released, fresh, undecided]);
        let cases: &[(&str, &str)] = &[
            (
                "rej",
                "Pod ml/rej (primary, 9 slots) can never be admitted in class default: needs 9 slots; largest matching node has 2.\n",
            ),
            (
                "gone",
                "Pod ml/gone's lease in class default is Released (the pod finished or is being deleted): it holds no slot and waits for nothing.\n",
            ),
            ("new", "(no sequence yet: the operator has just seen it)."),
            (
                "undecided",
                "has a GpuLease in class ghost (primary, 1 slot) that the operator has not decided on yet",
            ),
        ];
        for (name, want) in cases {
            let text = explain_in(&w, &pod(name, Some(1), &[]), true, true).expect("explains");
            assert!(text.contains(want), "{name}: {text}");
        }
        // A queued lease of a class that does not exist says so.
        let mut orphan = queued(
            "ml",
            "orphan",
            Role::Primary,
            1,
            12,
            1,
            "waiting: no node matches class gone yet",
        );
        orphan.spec.class_name = "gone".into();
        w.leases.push(orphan);
        let text = explain_in(&w, &pod("orphan", Some(1), &[]), true, true).expect("explains");
        assert!(
            text.contains("There is no GpuLeaseClass named gone"),
            "{text}"
        );
    }

    /// A tenant who may list its namespace's leases only, and neither
    /// classes nor nodes: the operator's position and message, nothing
    /// about the class, then what could not be seen.
    #[test]
    fn a_namespace_reader_gets_the_operators_account_and_what_it_cannot_see() {
        let w = world();
        let mut leases = w.leases.clone();
        if let Some(s) = leases[3].status.as_mut() {
            s.position = Some(2);
        }
        let p = pod("train-c", Some(2), &[]);
        let unseen = [
            Unseen::leases("ml", ", at the operator's positions"),
            Unseen::classes("the class's capacity and ordering are not shown"),
            Unseen::nodes("node fit is not shown"),
        ];
        let explain_hidden = |p: &Pod, lease: Option<&GpuLease>| {
            explain(
                WhyInput {
                    pod: p,
                    lease,
                    classes: &[],
                    classes_visible: false,
                    leases: &leases,
                    all_visible: false,
                    nodes: None,
                    pods: &[],
                    all_pods_visible: false,
                    now: now(),
                    unseen: &unseen,
                },
                Style::PLAIN,
            )
        };
        let text = explain_hidden(&p, Some(&leases[3])).expect("explains");
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 4, "{text}");
        assert_eq!(
            lines[0],
            "Pod ml/train-c is a primary waiting for 3s for 2 slots in class default, at position 2 among waiting primaries (sequence 5). \
             The operator says: 1 primary ahead; needs 2 slots on one node, 1 free slots on 2 matching nodes."
        );
        assert_eq!(
            lines[2],
            "cannot list GpuLeaseClasses: forbidden; the class's capacity and ordering are not shown"
        );
        assert!(!text.contains("There is no GpuLeaseClass"), "{text}");
        // A pod holding its GPUs reads nothing that was hidden: no lines.
        let text =
            explain_hidden(&pod("train-a", Some(2), &[]), Some(&leases[0])).expect("explains");
        assert_eq!(text.lines().count(), 1, "{text}");
        // Without classes, a pod asking for no known resource says why it cannot tell more.
        let err = explain_hidden(&pod("no-gpu", None, &[]), None).expect_err("no lease");
        assert_eq!(
            err.to_string(),
            "pod ml/no-gpu does not request a GPU slot (no container asks for gpupool/slot; GpuLeaseClasses cannot be listed with these credentials, so other classes' resource names are unknown), so it has no GpuLease"
        );
    }

    #[test]
    fn pods_without_a_lease_are_errors_naming_what_is_missing() {
        let w = world();
        let cases: &[(Pod, &str)] = &[
            (
                pod("no-gpu", None, &[]),
                "pod ml/no-gpu does not request a GPU slot (no container asks for gpupool/slot), so it has no GpuLease",
            ),
            (
                pod("unseen", Some(2), &[]),
                "pod ml/unseen requests 2 slots of gpupool/slot but has no GpuLease: the operator's webhook did not see it",
            ),
        ];
        for (p, want) in cases {
            let err = explain_in(&w, p, true, true).expect_err("no lease");
            assert!(err.to_string().starts_with(want), "{err}");
        }
        // A lease left by an earlier pod of the same name is not this pod's.
        let mut p = pod("train-a", Some(2), &[]);
        p.metadata.uid = Some("another".into());
        let err = explain_in(&w, &p, true, true).expect_err("stale lease");
        assert!(matches!(err, Error::NoLease { .. }), "{err}");
    }
}
