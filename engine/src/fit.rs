//! Whether a pod may run on a node: the class's node selector, the pod's
//! `nodeSelector`, required node affinity and tolerations, as kube-scheduler
//! reads them. Capacity is not checked here (see `capacity`).

use gpupool_api::names::LABEL_HOSTNAME;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

use super::model::{
    NodeInfo, NodeSelectorRequirement, NodeSelectorTerm, PodInfo, SelectorOperator, Taint,
    TaintEffect, Toleration, TolerationOperator,
};
use crate::SmallMap;

/// A class `nodeSelector` (a Kubernetes `LabelSelector`) checked once and
/// ready to match nodes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClassSelector {
    labels: Vec<(String, String)>,
    expressions: Vec<LabelRequirement>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct LabelRequirement {
    key: String,
    op: LabelOp,
    values: Vec<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LabelOp {
    In,
    NotIn,
    Exists,
    DoesNotExist,
}

impl ClassSelector {
    /// Compiles a class selector; `None` or an empty selector matches every
    /// node. Errors name the offending entry, as the class's `Invalid`
    /// condition shows it.
    pub fn compile(selector: Option<&LabelSelector>) -> Result<Self, String> {
        let Some(selector) = selector else {
            return Ok(Self::default());
        };
        let mut compiled = Self::default();
        for (key, value) in selector.match_labels.iter().flatten() {
            if key.is_empty() {
                return Err("nodeSelector.matchLabels has an empty key".to_owned());
            }
            compiled.labels.push((key.clone(), value.clone()));
        }
        for (i, req) in selector.match_expressions.iter().flatten().enumerate() {
            let at = format!("nodeSelector.matchExpressions[{i}]");
            if req.key.is_empty() {
                return Err(format!("{at} has an empty key"));
            }
            let op = match req.operator.as_str() {
                "In" => LabelOp::In,
                "NotIn" => LabelOp::NotIn,
                "Exists" => LabelOp::Exists,
                "DoesNotExist" => LabelOp::DoesNotExist,
                other => {
                    return Err(format!(
                        "{at} (key {:?}) has operator {other:?}; expected In, NotIn, Exists or DoesNotExist",
                        req.key
                    ));
                }
            };
            let values = req.values.clone().unwrap_or_default();
            match op {
                LabelOp::In | LabelOp::NotIn if values.is_empty() => {
                    return Err(format!(
                        "{at} (key {:?}) uses {} with no values",
                        req.key, req.operator
                    ));
                }
                LabelOp::Exists | LabelOp::DoesNotExist if !values.is_empty() => {
                    return Err(format!(
                        "{at} (key {:?}) uses {} but lists values",
                        req.key, req.operator
                    ));
                }
                _ => {}
            }
            compiled.expressions.push(LabelRequirement {
                key: req.key.clone(),
                op,
                values,
            });
        }
        Ok(compiled)
    }

    /// True when the node carries every label and satisfies every expression.
    pub fn matches(&self, node: &NodeInfo) -> bool {
        self.labels
            .iter()
            .all(|(k, v)| node_label(node, k) == Some(v.as_str()))
            && self.expressions.iter().all(|req| {
                let value = node_label(node, &req.key);
                match req.op {
                    LabelOp::In => value.is_some_and(|v| req.values.iter().any(|x| x == v)),
                    LabelOp::NotIn => value.is_none_or(|v| !req.values.iter().any(|x| x == v)),
                    LabelOp::Exists => value.is_some(),
                    LabelOp::DoesNotExist => value.is_none(),
                }
            })
    }
}

/// A node label; `kubernetes.io/hostname` falls back to the node name, which
/// is what the operator pins admitted pods with.
fn node_label<'a>(node: &'a NodeInfo, key: &str) -> Option<&'a str> {
    match node.labels.get(key) {
        Some(v) => Some(v.as_str()),
        None if key == LABEL_HOSTNAME => Some(node.name.as_str()),
        None => None,
    }
}

/// The node the pod is pinned to with `nodeSelector kubernetes.io/hostname`.
pub fn pinned_node(pod: &PodInfo) -> Option<&str> {
    pod.node_selector.get(LABEL_HOSTNAME).map(String::as_str)
}

/// True when the pod restricts its nodes beyond what its class does (so the
/// class's precomputed node list cannot be used as is).
pub fn has_own_constraints(pod: &PodInfo) -> bool {
    narrows_nodes(pod) || !pod.tolerations.is_empty()
}

/// True when the pod keeps itself off some nodes a plain pod may use: it
/// has a `nodeSelector` or a required node affinity. (Tolerations only ever
/// let a pod onto more nodes.)
pub fn narrows_nodes(pod: &PodInfo) -> bool {
    !pod.node_selector.is_empty() || pod.required_affinity.is_some()
}

/// True when the node takes no new pods unless they tolerate something:
/// cordoned, or carrying a `NoSchedule`/`NoExecute` taint.
pub fn turns_plain_pods_away(node: &NodeInfo) -> bool {
    node.unschedulable || node.taints.iter().any(blocks)
}

/// The node's first taint that keeps pods without a toleration away.
pub(crate) fn first_blocking_taint(node: &NodeInfo) -> Option<&Taint> {
    node.taints.iter().find(|t| blocks(t))
}

/// The node's first taint that keeps `pod` away: one it does not tolerate.
pub(crate) fn first_untolerated_taint<'n>(pod: &PodInfo, node: &'n NodeInfo) -> Option<&'n Taint> {
    node.taints
        .iter()
        .filter(|t| blocks(t))
        .find(|t| !pod.tolerations.iter().any(|tol| tolerates(tol, t)))
}

fn blocks(taint: &Taint) -> bool {
    matches!(
        taint.effect,
        TaintEffect::NoSchedule | TaintEffect::NoExecute
    )
}

/// True when the pod may be placed on the node: schedulable, its
/// `nodeSelector` and required affinity match, every blocking taint tolerated.
pub fn pod_fits_node(pod: &PodInfo, node: &NodeInfo) -> bool {
    !node.unschedulable
        && selector_matches(&pod.node_selector, node)
        && pod
            .required_affinity
            .as_ref()
            .is_none_or(|terms| terms.iter().any(|t| term_matches(t, node)))
        && node
            .taints
            .iter()
            .filter(|t| blocks(t))
            .all(|t| pod.tolerations.iter().any(|tol| tolerates(tol, t)))
}

fn selector_matches(selector: &SmallMap<String, String>, node: &NodeInfo) -> bool {
    selector
        .iter()
        .all(|(k, v)| node_label(node, k) == Some(v.as_str()))
}

/// A term matches when all its requirements hold; an empty term matches
/// nothing (as in kube-scheduler).
fn term_matches(term: &NodeSelectorTerm, node: &NodeInfo) -> bool {
    if term.match_expressions.is_empty() && term.match_fields.is_empty() {
        return false;
    }
    term.match_expressions
        .iter()
        .all(|r| requirement_matches(r, node_label(node, &r.key)))
        && term.match_fields.iter().all(|r| {
            // metadata.name is the only field kube-scheduler supports here.
            r.key == "metadata.name"
                && matches!(r.operator, SelectorOperator::In | SelectorOperator::NotIn)
                && requirement_matches(r, Some(node.name.as_str()))
        })
}

fn requirement_matches(req: &NodeSelectorRequirement, value: Option<&str>) -> bool {
    let listed = |v: &str| req.values.iter().any(|x| x == v);
    match req.operator {
        SelectorOperator::In => value.is_some_and(listed),
        SelectorOperator::NotIn => value.is_none_or(|v| !listed(v)),
        SelectorOperator::Exists => value.is_some(),
        SelectorOperator::DoesNotExist => value.is_none(),
        SelectorOperator::Gt | SelectorOperator::Lt => {
            let ([bound], Some(v)) = (req.values.as_slice(), value) else {
                return false;
            };
            match (bound.parse::<i64>(), v.parse::<i64>()) {
                (Ok(bound), Ok(v)) if req.operator == SelectorOperator::Gt => v > bound,
                (Ok(bound), Ok(v)) => v < bound,
                _ => false,
            }
        }
    }
}

fn tolerates(tol: &Toleration, taint: &Taint) -> bool {
    if tol.effect.is_some_and(|e| e != taint.effect) {
        return false;
    }
    match (&tol.key, tol.operator) {
        (None, TolerationOperator::Exists) => true,
        (None, TolerationOperator::Equal) => false,
        (Some(k), _) if *k != taint.key => false,
        (Some(_), TolerationOperator::Exists) => true,
        (Some(_), TolerationOperator::Equal) => {
            tol.value.as_deref().unwrap_or("") == taint.value.as_deref().unwrap_or("")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement;

    fn node(name: &str, labels: &[(&str, &str)]) -> NodeInfo {
        NodeInfo {
            name: name.into(),
            labels: labels
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            ..NodeInfo::default()
        }
    }

    fn pod() -> PodInfo {
        PodInfo {
            requests: SmallMap::new(),
            ..crate::fixtures::pod("p", 0, 0)
        }
    }

    fn req(key: &str, operator: SelectorOperator, values: &[&str]) -> NodeSelectorRequirement {
        NodeSelectorRequirement {
            key: key.into(),
            operator,
            values: values.iter().map(|v| (*v).to_owned()).collect(),
        }
    }

    fn expr(key: &str, op: &str, values: Option<&[&str]>) -> LabelSelectorRequirement {
        LabelSelectorRequirement {
            key: key.into(),
            operator: op.into(),
            values: values.map(|v| v.iter().map(|x| (*x).to_owned()).collect()),
        }
    }

    #[test]
    fn class_selector_labels_and_expressions() {
        let sel = LabelSelector {
            match_labels: Some([("pool".to_owned(), "a".to_owned())].into()),
            match_expressions: Some(vec![
                expr("zone", "In", Some(&["z1", "z2"])),
                expr("tier", "NotIn", Some(&["cheap"])),
                expr("gpu", "Exists", None),
                expr("drain", "DoesNotExist", None),
            ]),
        };
        let c = ClassSelector::compile(Some(&sel)).expect("valid selector");
        let good = node("n", &[("pool", "a"), ("zone", "z2"), ("gpu", "1")]);
        assert!(c.matches(&good));
        let bad_zone = node("n", &[("pool", "a"), ("zone", "z3"), ("gpu", "1")]);
        assert!(!c.matches(&bad_zone));
        let cheap = node(
            "n",
            &[
                ("pool", "a"),
                ("zone", "z1"),
                ("gpu", "1"),
                ("tier", "cheap"),
            ],
        );
        assert!(!c.matches(&cheap));
        let draining = node(
            "n",
            &[("pool", "a"), ("zone", "z1"), ("gpu", "1"), ("drain", "")],
        );
        assert!(!c.matches(&draining));
        assert!(
            ClassSelector::compile(None)
                .expect("none")
                .matches(&node("x", &[]))
        );
    }

    #[test]
    fn class_selector_errors_name_the_entry() {
        let bad_op = LabelSelector {
            match_expressions: Some(vec![expr("zone", "Gt", Some(&["1"]))]),
            ..LabelSelector::default()
        };
        let err = ClassSelector::compile(Some(&bad_op)).expect_err("Gt is not a label op");
        assert!(
            err.contains("matchExpressions[0]") && err.contains("Gt"),
            "{err}"
        );
        let no_values = LabelSelector {
            match_expressions: Some(vec![expr("zone", "In", None)]),
            ..LabelSelector::default()
        };
        let err = ClassSelector::compile(Some(&no_values)).expect_err("In needs values");
        assert!(err.contains("no values"), "{err}");
        let stray_values = LabelSelector {
            match_expressions: Some(vec![expr("zone", "Exists", Some(&["x"]))]),
            ..LabelSelector::default()
        };
        let err = ClassSelector::compile(Some(&stray_values)).expect_err("Exists takes none");
        assert!(err.contains("lists values"), "{err}");
        let empty_key = LabelSelector {
            match_labels: Some([(String::new(), "v".to_owned())].into()),
            ..LabelSelector::default()
        };
        let err = ClassSelector::compile(Some(&empty_key)).expect_err("empty key");
        assert!(err.contains("empty key"), "{err}");
    }

    #[test]
    fn pod_node_selector_and_hostname_pin() {
        let mut p = pod();
        p.node_selector.insert("zone".into(), "z1".into());
        assert!(pod_fits_node(&p, &node("a", &[("zone", "z1")])));
        assert!(!pod_fits_node(&p, &node("a", &[("zone", "z2")])));
        let mut pinned = pod();
        pinned
            .node_selector
            .insert(LABEL_HOSTNAME.into(), "node-2".into());
        assert_eq!(pinned_node(&pinned), Some("node-2"));
        assert!(pod_fits_node(&pinned, &node("node-2", &[])));
        assert!(!pod_fits_node(&pinned, &node("node-3", &[])));
    }

    #[test]
    fn required_affinity_operators() {
        let n = node("node-7", &[("zone", "z1"), ("cores", "64")]);
        let cases = [
            (req("zone", SelectorOperator::In, &["z1"]), true),
            (req("zone", SelectorOperator::In, &["z2"]), false),
            (req("zone", SelectorOperator::NotIn, &["z2"]), true),
            (req("zone", SelectorOperator::NotIn, &["z1"]), false),
            (req("missing", SelectorOperator::NotIn, &["z1"]), true),
            (req("zone", SelectorOperator::Exists, &[]), true),
            (req("missing", SelectorOperator::Exists, &[]), false),
            (req("missing", SelectorOperator::DoesNotExist, &[]), true),
            (req("zone", SelectorOperator::DoesNotExist, &[]), false),
            (req("cores", SelectorOperator::Gt, &["32"]), true),
            (req("cores", SelectorOperator::Gt, &["64"]), false),
            (req("cores", SelectorOperator::Lt, &["65"]), true),
            (req("cores", SelectorOperator::Lt, &["8"]), false),
            (req("zone", SelectorOperator::Gt, &["1"]), false),
            (req("cores", SelectorOperator::Gt, &["1", "2"]), false),
        ];
        for (r, want) in cases {
            let mut p = pod();
            p.required_affinity = Some(vec![NodeSelectorTerm {
                match_expressions: vec![r.clone()],
                match_fields: vec![],
            }]);
            assert_eq!(pod_fits_node(&p, &n), want, "{r:?}");
        }
    }

    #[test]
    fn affinity_terms_are_ored_and_match_fields_names_the_node() {
        let n = node("node-7", &[]);
        let mut p = pod();
        p.required_affinity = Some(vec![
            NodeSelectorTerm {
                match_expressions: vec![req("zone", SelectorOperator::In, &["z1"])],
                match_fields: vec![],
            },
            NodeSelectorTerm {
                match_expressions: vec![],
                match_fields: vec![req("metadata.name", SelectorOperator::In, &["node-7"])],
            },
        ]);
        assert!(pod_fits_node(&p, &n));
        assert!(!pod_fits_node(&p, &node("node-8", &[])));
        p.required_affinity = Some(vec![NodeSelectorTerm::default()]);
        assert!(!pod_fits_node(&p, &n), "an empty term matches nothing");
    }

    #[test]
    fn taints_block_unless_tolerated_and_prefer_never_blocks() {
        let taint = |effect| Taint {
            key: "gpu".into(),
            value: Some("a100".into()),
            effect,
        };
        let mut n = node("n", &[]);
        n.taints = vec![taint(TaintEffect::PreferNoSchedule)];
        assert!(pod_fits_node(&pod(), &n));
        assert!(!turns_plain_pods_away(&n));
        for effect in [TaintEffect::NoSchedule, TaintEffect::NoExecute] {
            n.taints = vec![taint(effect)];
            assert!(!pod_fits_node(&pod(), &n));
            assert!(turns_plain_pods_away(&n));
            let tolerations = [
                Toleration {
                    key: Some("gpu".into()),
                    operator: TolerationOperator::Equal,
                    value: Some("a100".into()),
                    effect: None,
                },
                Toleration {
                    key: Some("gpu".into()),
                    operator: TolerationOperator::Exists,
                    value: None,
                    effect: Some(effect),
                },
                Toleration {
                    key: None,
                    operator: TolerationOperator::Exists,
                    value: None,
                    effect: None,
                },
            ];
            for tol in tolerations {
                let mut p = pod();
                p.tolerations = std::sync::Arc::new([tol.clone()]);
                assert!(pod_fits_node(&p, &n), "{tol:?} tolerates {effect:?}");
            }
            let wrong = [
                Toleration {
                    key: Some("gpu".into()),
                    operator: TolerationOperator::Equal,
                    value: Some("h100".into()),
                    effect: None,
                },
                Toleration {
                    key: Some("gpu".into()),
                    operator: TolerationOperator::Exists,
                    value: None,
                    effect: Some(TaintEffect::PreferNoSchedule),
                },
            ];
            for tol in wrong {
                let mut p = pod();
                p.tolerations = std::sync::Arc::new([tol.clone()]);
                assert!(
                    !pod_fits_node(&p, &n),
                    "{tol:?} does not tolerate {effect:?}"
                );
            }
        }
    }

    #[test]
    fn cordoned_nodes_take_nothing() {
        let mut n = node("n", &[]);
        n.unschedulable = true;
        assert!(!pod_fits_node(&pod(), &n));
        assert!(turns_plain_pods_away(&n));
    }
}
