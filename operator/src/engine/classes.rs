//! Class resolution and the semantic checks the CRD schema cannot make
//! (DESIGN §3): at most one default class, a node selector that can be
//! evaluated.

use super::capacity::Nodes;
use super::fit::{self, ClassSelector};
use super::model::{ClassInfo, PodInfo};

/// Why a class cannot admit anything.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ClassProblem {
    /// Machine-readable reason for the `Invalid` condition.
    pub reason: &'static str,
    /// Human message naming the problem.
    pub message: String,
}

/// One class as this pass sees it.
#[derive(Debug)]
pub(crate) struct ClassView<'a> {
    pub info: &'a ClassInfo,
    pub problem: Option<ClassProblem>,
    /// Index of `spec.resourceName` in the pass's resource list.
    pub res: usize,
    /// Nodes the selector matches that advertise the resource, in name order.
    pub nodes: Vec<u32>,
    /// The subset a pod without constraints of its own may be placed on.
    pub plain_nodes: Vec<u32>,
    /// Largest allocatable among `plain_nodes`.
    pub largest_plain: u32,
}

impl ClassView<'_> {
    /// The class's name.
    pub fn name(&self) -> &str {
        &self.info.name
    }
}

/// Every class, in name order, with the default resolved.
#[derive(Debug)]
pub(crate) struct Classes<'a> {
    pub list: Vec<ClassView<'a>>,
    /// The class unlabelled pods use: the only default, or with several
    /// defaults the first by name (which is then invalid, so its pods are
    /// rejected with a message naming the clash).
    pub default: Option<usize>,
}

/// Why a pod cannot queue, detected before any lease exists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PodClass<'a> {
    /// The pod does not ask for a gpupool resource the way any class manages it.
    Unmanaged,
    /// Resolved to a class (which may be invalid).
    Class(usize),
    /// The pod names a class that does not exist; it asks for a resource some
    /// class manages, so it gets a lease that says so.
    Unknown(&'a str),
}

impl<'a> Classes<'a> {
    /// Resolves and checks every class. `resources` lists the pass's resource
    /// names in order (see `capacity::resource_names`).
    pub fn new(infos: &'a [ClassInfo], resources: &[&str], nodes: &Nodes<'_>) -> Self {
        let mut sorted: Vec<&ClassInfo> = infos.iter().collect();
        sorted.sort_by(|a, b| a.name.cmp(&b.name));
        sorted.dedup_by(|a, b| a.name == b.name);
        let defaults: Vec<&str> = sorted
            .iter()
            .filter(|c| c.spec.default)
            .map(|c| c.name.as_str())
            .collect();
        let mut list = Vec::with_capacity(sorted.len());
        for info in sorted {
            let res = resources
                .binary_search(&info.spec.resource_name.as_str())
                .unwrap_or(0);
            let mut view = ClassView {
                info,
                problem: None,
                res,
                nodes: Vec::new(),
                plain_nodes: Vec::new(),
                largest_plain: 0,
            };
            if info.spec.default && defaults.len() > 1 {
                let others: Vec<&str> = defaults
                    .iter()
                    .copied()
                    .filter(|n| *n != info.name)
                    .collect();
                view.problem = Some(ClassProblem {
                    reason: "MultipleDefaults",
                    message: format!(
                        "class {} and class {} are both marked default: true; at most one class may be the default",
                        info.name,
                        others.join(", ")
                    ),
                });
            }
            match ClassSelector::compile(info.spec.node_selector.as_ref()) {
                Ok(selector) => {
                    for (i, node) in nodes.list.iter().enumerate() {
                        let i = i as u32;
                        if nodes.alloc(res, i) == 0 || !selector.matches(node) {
                            continue;
                        }
                        view.nodes.push(i);
                        if !fit::turns_plain_pods_away(node) {
                            view.plain_nodes.push(i);
                            view.largest_plain = view.largest_plain.max(nodes.alloc(res, i));
                        }
                    }
                }
                Err(message) => {
                    // A selector problem outranks a default clash: it stops the
                    // class from ever matching a node.
                    view.problem = Some(ClassProblem {
                        reason: "InvalidNodeSelector",
                        message: format!("class {}: {message}", info.name),
                    });
                }
            }
            list.push(view);
        }
        let default = list.iter().position(|c| c.info.spec.default);
        Self { list, default }
    }

    /// Index of the class named `name`.
    pub fn find(&self, name: &str) -> Option<usize> {
        self.list
            .binary_search_by(|c| c.info.name.as_str().cmp(name))
            .ok()
    }

    /// The class a pod belongs to: its `gpupool.io/class` label, else the
    /// default class; a pod is managed only when it requests that class's
    /// resource. A label naming no class makes the pod `Unknown` when it
    /// requests any resource a class manages.
    pub fn resolve_pod(&self, pod: &'a PodInfo, resources: &[&str]) -> PodClass<'a> {
        match pod.class_label.as_deref() {
            Some(label) => match self.find(label) {
                Some(c)
                    if pod
                        .requests
                        .contains_key(&self.list[c].info.spec.resource_name) =>
                {
                    PodClass::Class(c)
                }
                Some(_) => PodClass::Unmanaged,
                None if resources.iter().any(|r| pod.requests.contains_key(*r)) => {
                    PodClass::Unknown(label)
                }
                None => PodClass::Unmanaged,
            },
            None => match self.default {
                Some(c)
                    if pod
                        .requests
                        .contains_key(&self.list[c].info.spec.resource_name) =>
                {
                    PodClass::Class(c)
                }
                _ => PodClass::Unmanaged,
            },
        }
    }
}
