//! One scheduling pass as a pure function: which pending pod goes to which
//! node, and why the others cannot go anywhere.

use std::collections::{BTreeMap, BTreeSet};

use gpupool_api::pod::{parse_whole, requested_slots};
use k8s_openapi::api::core::v1::{Node, Pod, PodSpec};

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

/// True for resource names that are extended resources (`domain/name`
/// outside `kubernetes.io`), the only ones the simulated nodes account for.
pub fn is_extended_resource(name: &str) -> bool {
    name.contains('/') && !name.contains("kubernetes.io/") && !name.starts_with("requests.")
}

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

fn extended_resources(spec: &PodSpec) -> BTreeSet<String> {
    spec.containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
        .filter_map(|c| c.resources.as_ref())
        .flat_map(|r| r.requests.iter().chain(r.limits.iter()))
        .flat_map(|m| m.keys())
        .filter(|k| is_extended_resource(k))
        .cloned()
        .collect()
}

fn pod_requests(spec: &PodSpec) -> Result<BTreeMap<String, u64>, String> {
    extended_resources(spec)
        .into_iter()
        .map(|r| {
            requested_slots(spec, &r)
                .map(|n| (r, u64::from(n)))
                .map_err(|e| e.to_string())
        })
        .collect()
}

/// Decides every pending pod, oldest first (creation time; pods created in
/// the same second keep their order in `pods`, which the caller gives in
/// arrival order). Free amount on a node = allocatable − requests of the
/// non-terminal pods bound to it, updated as this pass binds pods. Among the
/// nodes that fit, the one with the most free of what the pod requests wins
/// (ties by name), which spreads load as kube-scheduler's default scoring does.
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
        for (r, n) in pod_requests(spec).unwrap_or_default() {
            *entry.entry(r).or_default() += n;
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
            Err(message) => {
                decisions.push(Decision::Unschedulable {
                    namespace,
                    name,
                    message,
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
            let mut short = None;
            for (r, want) in &requests {
                let allocatable = node
                    .status
                    .as_ref()
                    .and_then(|s| s.allocatable.as_ref())
                    .and_then(|a| a.get(r))
                    .and_then(parse_whole)
                    .unwrap_or(0);
                let taken = node_used.and_then(|u| u.get(r)).copied().unwrap_or(0);
                let free = allocatable.saturating_sub(taken);
                if free < *want {
                    short = Some(r.clone());
                    break;
                }
                free_total += free;
            }
            if let Some(r) = short {
                *rejections.entry(Rejection::Insufficient(r)).or_default() += 1;
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
                    *entry.entry(r.clone()).or_default() += n;
                }
                decisions.push(Decision::Bind {
                    namespace,
                    name,
                    node: node.to_owned(),
                });
            }
            None => {
                let reasons: Vec<String> = rejections
                    .iter()
                    .map(|(r, n)| format!("{n} {}", r.phrase()))
                    .collect();
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
        Container, NodeStatus, PodSchedulingGate, PodStatus, ResourceRequirements,
    };
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};

    const SLOT: &str = "gpupool/slot";

    fn node(name: &str, slots: u32) -> Node {
        Node {
            metadata: ObjectMeta {
                name: Some(name.into()),
                ..Default::default()
            },
            status: Some(NodeStatus {
                allocatable: Some(BTreeMap::from([(
                    SLOT.to_owned(),
                    Quantity(slots.to_string()),
                )])),
                ..Default::default()
            }),
            ..Default::default()
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
