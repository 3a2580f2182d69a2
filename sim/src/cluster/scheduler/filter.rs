//! Node filters the scheduler applies before resource fit: node selector,
//! required node affinity and taints, with the semantics kube-scheduler gives
//! them; and the reasons a node is filtered out, resource fit's included.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Node, NodeSelectorRequirement, NodeSelectorTerm, Pod, Taint, Toleration,
};

/// Why a node was filtered out, counted per reason in the Unschedulable message.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Rejection {
    /// `spec.unschedulable` is set (cordoned).
    Unschedulable,
    /// The pod's nodeSelector or required node affinity does not match.
    Affinity,
    /// A NoSchedule/NoExecute taint the pod does not tolerate.
    Taint(String),
    /// The node lacks free amount of this resource.
    Insufficient(String),
    /// The node already runs as many pods as its allocatable `pods`.
    TooManyPods,
}

impl Rejection {
    /// The phrase kube-scheduler uses for the reason, after the node count.
    pub fn phrase(&self) -> String {
        match self {
            Rejection::Unschedulable => "node(s) were unschedulable".to_owned(),
            Rejection::Affinity => "node(s) didn't match Pod's node affinity/selector".to_owned(),
            Rejection::Taint(t) => format!("node(s) had untolerated taint {{{t}}}"),
            Rejection::Insufficient(r) => format!("Insufficient {r}"),
            Rejection::TooManyPods => "Too many pods".to_owned(),
        }
    }
}

/// Checks everything but resources; `Err` names the first reason the node is unfit.
pub fn node_admits(pod: &Pod, node: &Node) -> Result<(), Rejection> {
    let spec = pod.spec.as_ref();
    if node.spec.as_ref().and_then(|s| s.unschedulable) == Some(true) {
        return Err(Rejection::Unschedulable);
    }
    let empty = BTreeMap::new();
    let labels = node.metadata.labels.as_ref().unwrap_or(&empty);
    let node_name = node.metadata.name.as_deref().unwrap_or_default();
    if let Some(selector) = spec.and_then(|s| s.node_selector.as_ref())
        && !selector.iter().all(|(k, v)| labels.get(k) == Some(v))
    {
        return Err(Rejection::Affinity);
    }
    let required = spec
        .and_then(|s| s.affinity.as_ref())
        .and_then(|a| a.node_affinity.as_ref())
        .and_then(|a| {
            a.required_during_scheduling_ignored_during_execution
                .as_ref()
        });
    if let Some(required) = required
        && !required
            .node_selector_terms
            .iter()
            .any(|t| term_matches(t, labels, node_name))
    {
        return Err(Rejection::Affinity);
    }
    let tolerations = spec
        .and_then(|s| s.tolerations.as_deref())
        .unwrap_or_default();
    for taint in node
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_deref())
        .unwrap_or_default()
    {
        if (taint.effect == "NoSchedule" || taint.effect == "NoExecute")
            && !tolerations.iter().any(|t| tolerates(t, taint))
        {
            let shown = match taint.value.as_deref() {
                Some(v) if !v.is_empty() => format!("{}: {}", taint.key, v),
                _ => taint.key.clone(),
            };
            return Err(Rejection::Taint(shown));
        }
    }
    Ok(())
}

/// A term matches when all its expressions and fields match; an empty term matches nothing.
fn term_matches(term: &NodeSelectorTerm, labels: &BTreeMap<String, String>, name: &str) -> bool {
    let exprs = term.match_expressions.as_deref().unwrap_or_default();
    let fields = term.match_fields.as_deref().unwrap_or_default();
    if exprs.is_empty() && fields.is_empty() {
        return false;
    }
    exprs
        .iter()
        .all(|r| requirement_matches(r, labels.get(&r.key).map(String::as_str)))
        && fields.iter().all(|r| {
            let value = (r.key == "metadata.name").then_some(name);
            requirement_matches(r, value)
        })
}

fn requirement_matches(r: &NodeSelectorRequirement, value: Option<&str>) -> bool {
    let values = r.values.as_deref().unwrap_or_default();
    let as_int = |s: &str| s.parse::<i64>().ok();
    match r.operator.as_str() {
        "In" => value.is_some_and(|v| values.iter().any(|x| x == v)),
        "NotIn" => value.is_none_or(|v| !values.iter().any(|x| x == v)),
        "Exists" => value.is_some(),
        "DoesNotExist" => value.is_none(),
        "Gt" | "Lt" => {
            let (Some(v), Some(bound)) = (
                value.and_then(as_int),
                values.first().and_then(|b| as_int(b)),
            ) else {
                return false;
            };
            if r.operator == "Gt" {
                v > bound
            } else {
                v < bound
            }
        }
        _ => false,
    }
}

fn tolerates(t: &Toleration, taint: &Taint) -> bool {
    if let Some(effect) = t.effect.as_deref()
        && !effect.is_empty()
        && effect != taint.effect
    {
        return false;
    }
    let key_ok = match t.key.as_deref() {
        None | Some("") => t.operator.as_deref() == Some("Exists"),
        Some(k) => k == taint.key,
    };
    if !key_ok {
        return false;
    }
    match t.operator.as_deref() {
        Some("Exists") => true,
        _ => t.value.as_deref().unwrap_or_default() == taint.value.as_deref().unwrap_or_default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{Affinity, NodeAffinity, NodeSelector, NodeSpec, PodSpec};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn node(name: &str, labels: &[(&str, &str)], taints: Vec<Taint>) -> Node {
        Node {
            metadata: ObjectMeta {
                name: Some(name.into()),
                labels: Some(
                    labels
                        .iter()
                        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                        .collect(),
                ),
                ..Default::default()
            },
            spec: Some(NodeSpec {
                taints: Some(taints),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn pod(spec: PodSpec) -> Pod {
        Pod {
            spec: Some(spec),
            ..Default::default()
        }
    }

    fn req(key: &str, op: &str, values: &[&str]) -> NodeSelectorRequirement {
        NodeSelectorRequirement {
            key: key.into(),
            operator: op.into(),
            values: Some(values.iter().map(|v| (*v).to_owned()).collect()),
        }
    }

    fn affinity(terms: Vec<NodeSelectorTerm>) -> PodSpec {
        PodSpec {
            affinity: Some(Affinity {
                node_affinity: Some(NodeAffinity {
                    required_during_scheduling_ignored_during_execution: Some(NodeSelector {
                        node_selector_terms: terms,
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn node_selector_must_match_every_label() {
        let n = node("n1", &[("zone", "a"), ("gpu", "yes")], vec![]);
        let mut spec = PodSpec {
            node_selector: Some(BTreeMap::from([("zone".into(), "a".into())])),
            ..Default::default()
        };
        assert_eq!(node_admits(&pod(spec.clone()), &n), Ok(()));
        spec.node_selector = Some(BTreeMap::from([("zone".into(), "b".into())]));
        assert_eq!(node_admits(&pod(spec), &n), Err(Rejection::Affinity));
    }

    #[test]
    fn required_affinity_ors_terms_and_ands_expressions() {
        let n = node("n1", &[("zone", "a"), ("size", "8")], vec![]);
        let no = NodeSelectorTerm {
            match_expressions: Some(vec![req("zone", "In", &["b"])]),
            ..Default::default()
        };
        let yes = NodeSelectorTerm {
            match_expressions: Some(vec![
                req("zone", "NotIn", &["b"]),
                req("size", "Gt", &["4"]),
                req("gone", "DoesNotExist", &[]),
            ]),
            ..Default::default()
        };
        assert_eq!(
            node_admits(&pod(affinity(vec![no.clone(), yes])), &n),
            Ok(())
        );
        assert_eq!(
            node_admits(&pod(affinity(vec![no])), &n),
            Err(Rejection::Affinity)
        );
        let by_name = NodeSelectorTerm {
            match_fields: Some(vec![req("metadata.name", "In", &["n1"])]),
            ..Default::default()
        };
        assert_eq!(node_admits(&pod(affinity(vec![by_name])), &n), Ok(()));
        let lt = NodeSelectorTerm {
            match_expressions: Some(vec![req("size", "Lt", &["4"])]),
            ..Default::default()
        };
        assert_eq!(
            node_admits(&pod(affinity(vec![lt])), &n),
            Err(Rejection::Affinity)
        );
    }

    #[test]
    fn taints_need_tolerations() {
        let taint = Taint {
            key: "gpu".into(),
            value: Some("only".into()),
            effect: "NoSchedule".into(),
            ..Default::default()
        };
        let n = node("n1", &[], vec![taint]);
        assert_eq!(
            node_admits(&pod(PodSpec::default()), &n),
            Err(Rejection::Taint("gpu: only".into()))
        );
        let equal = Toleration {
            key: Some("gpu".into()),
            operator: Some("Equal".into()),
            value: Some("only".into()),
            effect: Some("NoSchedule".into()),
            ..Default::default()
        };
        let spec = PodSpec {
            tolerations: Some(vec![equal]),
            ..Default::default()
        };
        assert_eq!(node_admits(&pod(spec), &n), Ok(()));
        let wrong_value = Toleration {
            key: Some("gpu".into()),
            value: Some("other".into()),
            ..Default::default()
        };
        let spec = PodSpec {
            tolerations: Some(vec![wrong_value]),
            ..Default::default()
        };
        assert!(node_admits(&pod(spec), &n).is_err());
        let everything = Toleration {
            operator: Some("Exists".into()),
            ..Default::default()
        };
        let spec = PodSpec {
            tolerations: Some(vec![everything]),
            ..Default::default()
        };
        assert_eq!(node_admits(&pod(spec), &n), Ok(()));
    }

    #[test]
    fn prefer_no_schedule_and_cordon() {
        let soft = Taint {
            key: "soft".into(),
            effect: "PreferNoSchedule".into(),
            ..Default::default()
        };
        let mut n = node("n1", &[], vec![soft]);
        assert_eq!(node_admits(&pod(PodSpec::default()), &n), Ok(()));
        if let Some(spec) = n.spec.as_mut() {
            spec.unschedulable = Some(true);
        }
        assert_eq!(
            node_admits(&pod(PodSpec::default()), &n),
            Err(Rejection::Unschedulable)
        );
    }
}
