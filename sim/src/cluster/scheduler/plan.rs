//! One scheduling pass as a pure function: which pending pod goes to which
//! node, and why the others cannot go anywhere.
//!
//! Resource fit follows kube-scheduler's NodeResourcesFit filter: a node
//! fits when it has room for one more pod (`pods`) and, for CPU, memory,
//! ephemeral storage, huge pages and every extended resource the pod asks
//! for, its allocatable less what the non-terminal pods bound to it request
//! covers the pod's effective request ([`gpupool_api::pod::effective_request`]:
//! init containers, sidecars and app containers as Kubernetes counts them,
//! pod-level CPU and memory when set, plus the pod's overhead).

use std::collections::{BTreeMap, BTreeSet};

use gpupool_api::pod::{
    PodError, container_request, container_slots, effective_request, parse_ceil, parse_milli,
};
use k8s_openapi::api::core::v1::{Container, Node, Pod, PodSpec};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use super::filter::{Rejection, node_admits};

/// What the scheduler does with one pending pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Bind the pod to the node.
    Bind {
        /// Pod namespace.
        namespace: String,
        /// Pod name.
        name: String,
        /// Chosen node.
        node: String,
    },
    /// No node fits; the message says why, in kube-scheduler's words.
    Unschedulable {
        /// Pod namespace.
        namespace: String,
        /// Pod name.
        name: String,
        /// Why, e.g. `0/2 nodes are available: 2 Insufficient gpupool/slot.`
        message: String,
    },
}

/// A pod whose requests cannot be read; it stays Pending with this text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// An extended resource asked for in a fraction, or beyond counting.
    #[error(transparent)]
    Slots(#[from] PodError),
    /// A container's CPU, memory, storage or huge-pages quantity is not a
    /// non-negative quantity.
    #[error(
        "container {container:?} requests {resource} = {quantity:?}, which is not a non-negative quantity"
    )]
    Container {
        /// The container.
        container: String,
        /// The resource.
        resource: String,
        /// The quantity as written.
        quantity: String,
    },
    /// The pod's overhead or pod-level resources hold a quantity that is
    /// not a non-negative quantity.
    #[error(
        "the pod's {field} gives {resource} = {quantity:?}, which is not a non-negative quantity"
    )]
    Pod {
        /// `overhead` or `resources`.
        field: &'static str,
        /// The resource.
        resource: String,
        /// The quantity as written.
        quantity: String,
    },
}

/// True for resource names that are extended resources (`domain/name`
/// outside `kubernetes.io`), the only ones the simulated nodes account for.
pub fn is_extended_resource(name: &str) -> bool {
    name.contains('/') && !name.contains("kubernetes.io/") && !name.starts_with("requests.")
}

/// True for the resources kube-scheduler compares with a node's
/// allocatable: `cpu`, `memory`, `ephemeral-storage`, `hugepages-*` and
/// extended resources. (`pods` is checked for every pod, one each.)
pub fn is_fitted_resource(name: &str) -> bool {
    matches!(name, "cpu" | "memory" | "ephemeral-storage")
        || name.starts_with("hugepages-")
        || is_extended_resource(name)
}

/// A quantity of `resource` as the scheduler counts it: CPU in thousandths
/// of a core, everything else in whole units, fractions rounded up (as
/// Kubernetes' `MilliValue` and `Value` round). `None` when it is negative
/// or malformed.
pub fn amount(resource: &str, q: &Quantity) -> Option<u64> {
    if resource == "cpu" {
        parse_milli(q)
    } else {
        parse_ceil(q)
    }
}

/// The resource every pod takes one of.
const PODS: &str = "pods";

/// True for pods that wait for the scheduler: not gated, not bound, not
/// deleting, not finished, and meant for the default scheduler.
pub fn is_pending(pod: &Pod) -> bool {
    let Some(spec) = pod.spec.as_ref() else {
        return false;
    };
    spec.node_name.as_deref().unwrap_or_default().is_empty()
        && spec
            .scheduling_gates
            .as_deref()
            .unwrap_or_default()
            .is_empty()
        && pod.metadata.deletion_timestamp.is_none()
        && !is_terminal(pod)
        && spec
            .scheduler_name
            .as_deref()
            .is_none_or(|s| s.is_empty() || s == "default-scheduler")
}

/// True once the pod Succeeded or Failed: it holds no resources any more.
pub fn is_terminal(pod: &Pod) -> bool {
    matches!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    )
}

/// Every fitted resource the pod names anywhere: its containers' requests
/// and limits, its pod-level resources and its overhead.
fn fitted_resources(spec: &PodSpec) -> BTreeSet<String> {
    let containers = spec
        .containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
        .filter_map(|c| c.resources.as_ref());
    containers
        .chain(spec.resources.as_ref())
        .flat_map(|r| r.requests.iter().chain(r.limits.iter()))
        .chain(spec.overhead.as_ref())
        .flat_map(|m| m.keys())
        .filter(|k| is_fitted_resource(k))
        .cloned()
        .collect()
}

/// One container's request of a non-extended resource, as [`amount`] counts it.
fn container_amount(c: &Container, resource: &str) -> Result<u64, RequestError> {
    match container_request(c, resource) {
        None => Ok(0),
        Some(q) => amount(resource, q).ok_or_else(|| RequestError::Container {
            container: c.name.clone(),
            resource: resource.to_owned(),
            quantity: q.0.clone(),
        }),
    }
}

fn pod_amount(field: &'static str, resource: &str, q: &Quantity) -> Result<u64, RequestError> {
    amount(resource, q).ok_or_else(|| RequestError::Pod {
        field,
        resource: resource.to_owned(),
        quantity: q.0.clone(),
    })
}

/// What the pod asks of a node, per resource, as NodeResourcesFit counts
/// it: the effective request of each fitted resource (extended resources
/// in whole units), CPU and memory taken from the pod-level resources when
/// those set them, plus the overhead; and one of `pods`. Resources asked
/// for as zero are left out, as the scheduler skips them.
pub fn pod_requests(spec: &PodSpec) -> Result<BTreeMap<String, u64>, RequestError> {
    let mut out = BTreeMap::from([(PODS.to_owned(), 1)]);
    let pod_level = spec.resources.as_ref();
    for r in fitted_resources(spec) {
        let pod_level = pod_level
            .filter(|_| r == "cpu" || r == "memory")
            .and_then(|p| {
                p.requests
                    .as_ref()
                    .and_then(|m| m.get(&r))
                    .or_else(|| p.limits.as_ref().and_then(|m| m.get(&r)))
            });
        let mut n = match pod_level {
            Some(q) => pod_amount("resources", &r, q)?,
            None if is_extended_resource(&r) => {
                effective_request(spec, |c| container_slots(c, &r))?
            }
            None => effective_request(spec, |c| container_amount(c, &r))?,
        };
        if let Some(q) = spec.overhead.as_ref().and_then(|o| o.get(&r)) {
            n = n.saturating_add(pod_amount("overhead", &r, q)?);
        }
        if n > 0 {
            out.insert(r, n);
        }
    }
    Ok(out)
}

/// The node's allocatable amount of `resource` (0 when it reports none).
fn allocatable(node: &Node, resource: &str) -> u64 {
    node.status
        .as_ref()
        .and_then(|s| s.allocatable.as_ref())
        .and_then(|a| a.get(resource))
        .and_then(|q| amount(resource, q))
        .unwrap_or(0)
}

/// Decides every pending pod, oldest first (creation time; pods created in
/// the same second keep their order in `pods`, which the caller gives in
/// arrival order). Free amount on a node = allocatable − requests of the
/// non-terminal pods bound to it ([`pod_requests`]), updated as this pass
/// binds pods. A node that lacks room reports every resource it is short
/// of (`Insufficient cpu`, `Too many pods`), and the message counts the
/// reasons in kube-scheduler's words and order. Among the nodes that fit,
/// the one with the most free of the extended resources the pod requests
/// wins (ties by name), which spreads GPU pods as kube-scheduler's default
/// scoring spreads load.
pub fn plan(nodes: &[Node], pods: &[Pod]) -> Vec<Decision> {
    let mut used: BTreeMap<&str, BTreeMap<String, u64>> = BTreeMap::new();
    for pod in pods.iter().filter(|p| !is_terminal(p)) {
        let Some(spec) = pod.spec.as_ref() else {
            continue;
        };
        let Some(node) = spec.node_name.as_deref().filter(|n| !n.is_empty()) else {
            continue;
        };
        let entry = used.entry(node).or_default();
        // A bound pod whose requests cannot be read still takes its place.
        let requests =
            pod_requests(spec).unwrap_or_else(|_| BTreeMap::from([(PODS.to_owned(), 1)]));
        for (r, n) in requests {
            let held = entry.entry(r).or_default();
            *held = held.saturating_add(n);
        }
    }
    let mut sorted_nodes: Vec<&Node> = nodes.iter().collect();
    sorted_nodes.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));

    let mut pending: Vec<&Pod> = pods.iter().filter(|p| is_pending(p)).collect();
    // Stable: pods created in the same second keep the caller's order.
    pending.sort_by_key(|p| p.metadata.creation_timestamp.as_ref().map(|t| t.0));

    let mut decisions = Vec::new();
    for pod in pending {
        let namespace = pod.metadata.namespace.clone().unwrap_or_default();
        let name = pod.metadata.name.clone().unwrap_or_default();
        let Some(spec) = pod.spec.as_ref() else {
            continue;
        };
        let requests = match pod_requests(spec) {
            Ok(r) => r,
            Err(e) => {
                decisions.push(Decision::Unschedulable {
                    namespace,
                    name,
                    message: e.to_string(),
                });
                continue;
            }
        };
        let mut rejections: BTreeMap<Rejection, usize> = BTreeMap::new();
        let mut best: Option<(u64, &str)> = None;
        for node in &sorted_nodes {
            let node_name = node.metadata.name.as_deref().unwrap_or_default();
            if let Err(r) = node_admits(pod, node) {
                *rejections.entry(r).or_default() += 1;
                continue;
            }
            let node_used = used.get(node_name);
            let mut free_total = 0u64;
            let mut short = Vec::new();
            for (r, want) in &requests {
                let taken = node_used.and_then(|u| u.get(r)).copied().unwrap_or(0);
                let free = allocatable(node, r).saturating_sub(taken);
                if free < *want {
                    short.push(if r == PODS {
                        Rejection::TooManyPods
                    } else {
                        Rejection::Insufficient(r.clone())
                    });
                } else if is_extended_resource(r) {
                    free_total = free_total.saturating_add(free);
                }
            }
            if !short.is_empty() {
                for r in short {
                    *rejections.entry(r).or_default() += 1;
                }
                continue;
            }
            if best.is_none_or(|(f, _)| free_total > f) {
                best = Some((free_total, node_name));
            }
        }
        match best {
            Some((_, node)) => {
                let entry = used.entry(node).or_default();
                for (r, n) in &requests {
                    let held = entry.entry(r.clone()).or_default();
                    *held = held.saturating_add(*n);
                }
                decisions.push(Decision::Bind {
                    namespace,
                    name,
                    node: node.to_owned(),
                });
            }
            None => {
                // kube-scheduler sorts the counted reasons as strings.
                let mut reasons: Vec<String> = rejections
                    .iter()
                    .map(|(r, n)| format!("{n} {}", r.phrase()))
                    .collect();
                reasons.sort();
                let message = if sorted_nodes.is_empty() {
                    "no nodes available to schedule pods".to_owned()
                } else {
                    format!(
                        "0/{} nodes are available: {}.",
                        sorted_nodes.len(),
                        reasons.join(", ")
                    )
                };
                decisions.push(Decision::Unschedulable {
                    namespace,
                    name,
                    message,
                });
            }
        }
    }
    decisions
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{
        NodeSpec, NodeStatus, PodSchedulingGate, PodStatus, ResourceRequirements, Taint,
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};

    const SLOT: &str = "gpupool/slot";

    /// A node as the simulated kubelet reports one: 16 CPUs, 64Gi of
    /// memory, 110 pods, and `slots` GPU slots.
    fn node(name: &str, slots: u32) -> Node {
        Node {
            metadata: ObjectMeta {
                name: Some(name.into()),
                ..Default::default()
            },
            status: Some(NodeStatus {
                allocatable: Some(
                    [
                        (SLOT, slots.to_string()),
                        ("cpu", "16".to_owned()),
                        ("memory", "64Gi".to_owned()),
                        ("pods", "110".to_owned()),
                    ]
                    .into_iter()
                    .map(|(k, v)| (k.to_owned(), Quantity(v)))
                    .collect(),
                ),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn with_allocatable(mut n: Node, resource: &str, value: &str) -> Node {
        if let Some(a) = n.status.as_mut().and_then(|s| s.allocatable.as_mut()) {
            a.insert(resource.to_owned(), Quantity(value.to_owned()));
        }
        n
    }

    fn quantities(pairs: &[(&str, &str)]) -> BTreeMap<String, Quantity> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), Quantity((*v).to_owned())))
            .collect()
    }

    /// A container requesting `pairs` (as requests and limits alike).
    fn asking(name: &str, pairs: &[(&str, &str)]) -> Container {
        Container {
            name: name.into(),
            resources: Some(ResourceRequirements {
                requests: Some(quantities(pairs)),
                limits: Some(quantities(pairs)),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn sidecar(name: &str, pairs: &[(&str, &str)]) -> Container {
        Container {
            restart_policy: Some("Always".into()),
            ..asking(name, pairs)
        }
    }

    /// A pod created `age_s` after a fixed time with these containers.
    fn shaped(name: &str, age_s: i64, init: Vec<Container>, apps: Vec<Container>) -> Pod {
        let mut p = pod(name, age_s, "0", None);
        if let Some(spec) = p.spec.as_mut() {
            spec.init_containers = Some(init);
            spec.containers = apps;
        }
        p
    }

    fn unschedulable(decision: &Decision) -> &str {
        match decision {
            Decision::Unschedulable { message, .. } => message,
            other => panic!("expected Unschedulable, got {other:?}"),
        }
    }

    fn pod(name: &str, age_s: i64, slots: &str, node: Option<&str>) -> Pod {
        let created = jiff::Timestamp::from_second(1_700_000_000 + age_s).expect("valid time");
        Pod {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("ns".into()),
                creation_timestamp: Some(Time(created)),
                ..Default::default()
            },
            spec: Some(PodSpec {
                node_name: node.map(str::to_owned),
                containers: vec![Container {
                    name: "main".into(),
                    resources: Some(ResourceRequirements {
                        limits: Some(BTreeMap::from([(SLOT.to_owned(), Quantity(slots.into()))])),
                        ..Default::default()
                    }),
                    ..Default::default()
                }],
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn bind(name: &str, node: &str) -> Decision {
        Decision::Bind {
            namespace: "ns".into(),
            name: name.into(),
            node: node.into(),
        }
    }

    #[test]
    fn binds_oldest_first_and_counts_what_it_binds() {
        let nodes = [node("node-1", 2)];
        let pods = [pod("late", 5, "2", None), pod("early", 1, "1", None)];
        let got = plan(&nodes, &pods);
        assert_eq!(got[0], bind("early", "node-1"));
        match &got[1] {
            Decision::Unschedulable { name, message, .. } => {
                assert_eq!(name, "late");
                assert_eq!(
                    message,
                    "0/1 nodes are available: 1 Insufficient gpupool/slot."
                );
            }
            other => panic!("expected Unschedulable, got {other:?}"),
        }
    }

    #[test]
    fn bound_running_pods_use_capacity_but_finished_ones_do_not() {
        let nodes = [node("node-1", 2), node("node-2", 2)];
        let mut done = pod("done", 0, "2", Some("node-2"));
        done.status = Some(PodStatus {
            phase: Some("Succeeded".into()),
            ..Default::default()
        });
        let pods = [
            pod("running", 0, "1", Some("node-1")),
            done,
            pod("new", 3, "2", None),
        ];
        assert_eq!(plan(&nodes, &pods), vec![bind("new", "node-2")]);
    }

    #[test]
    fn spreads_to_the_node_with_most_free() {
        let nodes = [node("node-1", 4), node("node-2", 4)];
        let pods = [pod("a", 0, "1", None), pod("b", 1, "1", None)];
        assert_eq!(
            plan(&nodes, &pods),
            vec![bind("a", "node-1"), bind("b", "node-2")]
        );
    }

    #[test]
    fn gated_deleting_and_bound_pods_are_not_pending() {
        let nodes = [node("node-1", 4)];
        let mut gated = pod("gated", 0, "1", None);
        if let Some(spec) = gated.spec.as_mut() {
            spec.scheduling_gates = Some(vec![PodSchedulingGate {
                name: "gpupool.io/admission".into(),
            }]);
        }
        let mut deleting = pod("deleting", 0, "1", None);
        deleting.metadata.deletion_timestamp = deleting.metadata.creation_timestamp.clone();
        let bound = pod("bound", 0, "1", Some("node-1"));
        assert!(plan(&nodes, &[gated, deleting, bound]).is_empty());
    }

    #[test]
    fn fractional_requests_and_empty_clusters_are_explained() {
        let got = plan(&[node("node-1", 1)], &[pod("frac", 0, "500m", None)]);
        assert!(
            matches!(&got[0], Decision::Unschedulable { message, .. } if message.contains("500m")),
            "{got:?}"
        );
        let got = plan(&[], &[pod("p", 0, "1", None)]);
        assert!(
            matches!(&got[0], Decision::Unschedulable { message, .. } if message == "no nodes available to schedule pods"),
            "{got:?}"
        );
    }

    #[test]
    fn a_pod_asking_more_cpu_than_the_node_has_stays_pending() {
        let nodes = [node("node-1", 2)];
        let greedy = shaped("greedy", 0, vec![], vec![asking("c", &[("cpu", "1000")])]);
        let got = plan(&nodes, &[greedy]);
        assert_eq!(
            unschedulable(&got[0]),
            "0/1 nodes are available: 1 Insufficient cpu."
        );
        // Every resource a node is short of is counted, sorted as kube-scheduler sorts.
        let nodes = [node("node-1", 2), node("node-2", 2)];
        let huge = shaped(
            "huge",
            0,
            vec![],
            vec![asking("c", &[("cpu", "17"), ("memory", "65Gi")])],
        );
        assert_eq!(
            unschedulable(&plan(&nodes, &[huge])[0]),
            "0/2 nodes are available: 2 Insufficient cpu, 2 Insufficient memory."
        );
    }

    #[test]
    fn bound_pods_requests_use_the_nodes_cpu_memory_and_pod_room() {
        let mut busy = shaped("busy", 0, vec![], vec![asking("c", &[("cpu", "10")])]);
        if let Some(spec) = busy.spec.as_mut() {
            spec.node_name = Some("node-1".into());
        }
        let eight = shaped("eight", 1, vec![], vec![asking("c", &[("cpu", "8")])]);
        let six = shaped("six", 2, vec![], vec![asking("c", &[("cpu", "6")])]);
        let got = plan(&[node("node-1", 0)], &[busy.clone(), eight, six]);
        assert_eq!(
            unschedulable(&got[0]),
            "0/1 nodes are available: 1 Insufficient cpu."
        );
        assert_eq!(got[1], bind("six", "node-1"));
        // Thousandths of a core add up: two halves fit one CPU, a third does not.
        let one_cpu = with_allocatable(node("node-1", 0), "cpu", "1");
        let halves: Vec<Pod> = (0..3)
            .map(|i| {
                shaped(
                    &format!("half-{i}"),
                    i,
                    vec![],
                    vec![asking("c", &[("cpu", "500m")])],
                )
            })
            .collect();
        let got = plan(std::slice::from_ref(&one_cpu), &halves);
        assert_eq!(got[0], bind("half-0", "node-1"));
        assert_eq!(got[1], bind("half-1", "node-1"));
        assert_eq!(
            unschedulable(&got[2]),
            "0/1 nodes are available: 1 Insufficient cpu."
        );
        // A node full of pods takes no more, whatever they request.
        let one_pod = with_allocatable(node("node-1", 0), "pods", "1");
        let idle = pod("idle", 3, "0", None);
        assert_eq!(
            unschedulable(&plan(&[one_pod], &[busy, idle])[0]),
            "0/1 nodes are available: 1 Too many pods."
        );
    }

    #[test]
    fn init_containers_and_sidecars_count_as_kubernetes_counts_them() {
        let two_cpus = with_allocatable(node("node-1", 2), "cpu", "2");
        // Sidecar 1, then init 2, then app 1: 3 of each, on a node of 2.
        let shape = |name: &str, r: &str| {
            shaped(
                name,
                0,
                vec![sidecar("s", &[(r, "1")]), asking("i", &[(r, "2")])],
                vec![asking("a", &[(r, "1")])],
            )
        };
        for (r, reason) in [
            ("cpu", "Insufficient cpu"),
            (SLOT, "Insufficient gpupool/slot"),
        ] {
            let got = plan(std::slice::from_ref(&two_cpus), &[shape("p", r)]);
            assert_eq!(
                unschedulable(&got[0]),
                format!("0/1 nodes are available: 1 {reason}."),
                "{r}"
            );
        }
        // Init 2, then app 1: 2, which fits.
        let fits = shaped(
            "fits",
            0,
            vec![asking("i", &[(SLOT, "2")])],
            vec![asking("a", &[(SLOT, "1")])],
        );
        assert_eq!(plan(&[two_cpus], &[fits]), vec![bind("fits", "node-1")]);
    }

    #[test]
    fn pod_level_resources_and_overhead_are_counted() {
        let two_cpus = with_allocatable(node("node-1", 0), "cpu", "2");
        // Pod-level CPU replaces the containers' sum.
        let mut p = shaped("pod-level", 0, vec![], vec![asking("c", &[("cpu", "1")])]);
        if let Some(spec) = p.spec.as_mut() {
            spec.resources = Some(ResourceRequirements {
                requests: Some(quantities(&[("cpu", "3")])),
                ..Default::default()
            });
        }
        assert_eq!(
            pod_requests(p.spec.as_ref().expect("spec")).expect("reads")["cpu"],
            3000
        );
        assert_eq!(
            unschedulable(&plan(std::slice::from_ref(&two_cpus), &[p])[0]),
            "0/1 nodes are available: 1 Insufficient cpu."
        );
        // Overhead adds to the containers' request.
        let mut p = shaped(
            "overhead",
            0,
            vec![],
            vec![asking("c", &[("cpu", "1500m")])],
        );
        if let Some(spec) = p.spec.as_mut() {
            spec.overhead = Some(quantities(&[("cpu", "600m")]));
        }
        let requests = pod_requests(p.spec.as_ref().expect("spec")).expect("reads");
        assert_eq!((requests["cpu"], requests["pods"]), (2100, 1));
        assert_eq!(
            unschedulable(&plan(&[two_cpus], &[p])[0]),
            "0/1 nodes are available: 1 Insufficient cpu."
        );
    }

    #[test]
    fn unreadable_requests_are_named() {
        let bad_container = shaped("a", 0, vec![], vec![asking("work", &[("memory", "lots")])]);
        let mut bad_overhead = shaped("b", 0, vec![], vec![]);
        let mut bad_pod_level = shaped("c", 0, vec![], vec![]);
        if let Some(spec) = bad_overhead.spec.as_mut() {
            spec.overhead = Some(quantities(&[("cpu", "-1")]));
        }
        if let Some(spec) = bad_pod_level.spec.as_mut() {
            spec.resources = Some(ResourceRequirements {
                limits: Some(quantities(&[("memory", "1x")])),
                ..Default::default()
            });
        }
        let got = plan(
            &[node("node-1", 1)],
            &[bad_container, bad_overhead, bad_pod_level],
        );
        let messages: Vec<&str> = got.iter().map(unschedulable).collect();
        assert_eq!(
            messages,
            [
                "container \"work\" requests memory = \"lots\", which is not a non-negative quantity",
                "the pod's overhead gives cpu = \"-1\", which is not a non-negative quantity",
                "the pod's resources gives memory = \"1x\", which is not a non-negative quantity",
            ]
        );
    }

    #[test]
    fn a_taint_and_a_shortage_are_both_counted_in_order() {
        let mut tainted = node("node-1", 4);
        tainted.spec = Some(NodeSpec {
            taints: Some(vec![Taint {
                key: "gpu".into(),
                effect: "NoSchedule".into(),
                ..Default::default()
            }]),
            ..Default::default()
        });
        let nodes = [tainted, node("node-2", 1), node("node-3", 1)];
        assert_eq!(
            unschedulable(&plan(&nodes, &[pod("p", 0, "2", None)])[0]),
            "0/3 nodes are available: 1 node(s) had untolerated taint {gpu}, 2 Insufficient gpupool/slot."
        );
        assert!(is_fitted_resource("hugepages-2Mi") && is_fitted_resource("ephemeral-storage"));
        assert!(!is_fitted_resource("pods") && !is_fitted_resource("storage"));
    }

    #[test]
    fn pods_without_extended_resources_still_bind() {
        let nodes = [node("node-1", 0)];
        let mut p = pod("cpu-only", 0, "1", None);
        if let Some(spec) = p.spec.as_mut() {
            spec.containers[0].resources = None;
        }
        assert_eq!(plan(&nodes, &[p]), vec![bind("cpu-only", "node-1")]);
        assert!(is_extended_resource(SLOT));
        assert!(!is_extended_resource("cpu"));
        assert!(!is_extended_resource("kubernetes.io/foo"));
    }
}
