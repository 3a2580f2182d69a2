//! Class resolution and the semantic checks the CRD schema cannot make
//! (DESIGN §3): at most one default class, a node selector that can be
//! evaluated.

use jiff::Timestamp;

use super::capacity::Nodes;
use super::fit::{self, ClassSelector};
use super::model::{ClassInfo, NodeInfo, PodInfo};

/// The class unlabelled pods use when several claim `default: true`: the
/// one that was default first, i.e. the oldest by creation time (a class
/// without one counts as newest), ties broken by name. Every other default
/// is invalid (`MultipleDefaults`) until it steps back, so a newcomer never
/// takes the queue away from the class that already had it. The webhook and
/// the engine both decide with this function.
pub fn established_default<'n>(
    defaults: impl IntoIterator<Item = (&'n str, Option<Timestamp>)>,
) -> Option<&'n str> {
    defaults
        .into_iter()
        .min_by(|a, b| {
            let age = |t: Option<Timestamp>| (t.is_none(), t);
            age(a.1).cmp(&age(b.1)).then_with(|| a.0.cmp(b.0))
        })
        .map(|(name, _)| name)
}

/// True for an extended resource name a class may hand out: a
/// domain-qualified name (`domain/name`) outside the `kubernetes.io`
/// domains, which hold the built-in resources.
pub fn is_extended_resource(name: &str) -> bool {
    let Some((domain, rest)) = name.split_once('/') else {
        return false;
    };
    let label = |s: &str, extra: &[u8]| {
        !s.is_empty()
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || extra.contains(&b))
            && s.as_bytes()[0].is_ascii_alphanumeric()
            && s.as_bytes()[s.len() - 1].is_ascii_alphanumeric()
    };
    let kubernetes = domain == "kubernetes.io" || domain.ends_with(".kubernetes.io");
    domain.len() <= 253
        && rest.len() <= 63
        && label(domain, b".")
        && domain.bytes().all(|b| !b.is_ascii_uppercase())
        && label(rest, b"._")
        && !kubernetes
        && !domain.starts_with("requests.")
}

/// The node the engine could ever place `pod` on with the most slots of
/// `class`'s resource (allocatable, or what the device plugin announces when
/// that is more: see [`NodeInfo::announced`]), ties broken by name: nodes that match the
/// class's selector and advertise the resource, narrowed by the pod's own
/// nodeSelector, affinity and tolerations when it has any, else those that
/// take plain pods (not cordoned, no blocking taint). `Ok(None)` when no node
/// qualifies yet; `Err` names what is wrong with the class's selector. The
/// webhook refuses a pod asking for more than this, and the engine says
/// the same in the lease of one that got past it: one rule, one function.
pub fn largest_node<'n>(
    class: &ClassInfo,
    nodes: impl IntoIterator<Item = &'n NodeInfo>,
    pod: &PodInfo,
) -> Result<Option<(&'n str, u32)>, String> {
    let selector = ClassSelector::compile(class.spec.node_selector.as_ref())?;
    let resource = class.spec.resource_name.as_str();
    let own = fit::has_own_constraints(pod);
    let mut best: Option<(&str, u32)> = None;
    for node in nodes {
        // What the node has or is about to have: the kubelet publishes a
        // plugin's new slots in allocatable some seconds after the plugin
        // announces them.
        let alloc = node
            .allocatable
            .get(resource)
            .copied()
            .unwrap_or(0)
            .max(node.announced.get(resource).copied().unwrap_or(0));
        if alloc == 0 || !selector.matches(node) {
            continue;
        }
        let eligible = if own {
            fit::pod_fits_node(pod, node)
        } else {
            !fit::turns_plain_pods_away(node)
        };
        if !eligible {
            continue;
        }
        let better = best.is_none_or(|(name, slots)| {
            alloc > slots || (alloc == slots && node.name.as_str() < name)
        });
        if better {
            best = Some((node.name.as_str(), alloc));
        }
    }
    Ok(best)
}

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
    /// The rest of `nodes`: cordoned, or with a taint that keeps plain pods
    /// away. Only these can tell apart a pod whose one constraint is its
    /// tolerations from a plain one.
    pub guarded_nodes: Vec<u32>,
    /// Largest allocatable among `plain_nodes`.
    pub largest_plain: u32,
}

/// What keeps plain pods off a class's guarded nodes, for a message to
/// name: how many are cordoned, how many carry a taint that turns pods
/// away, and the first such taint.
///
/// `T` is how it holds the taint: `&Taint` in a pass's messages, `Taint`
/// in the one the kept engine remembers (see [`crate::message::Settled`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Guards<T> {
    pub cordoned: u32,
    pub tainted: u32,
    pub taint: Option<T>,
}

impl<T> Default for Guards<T> {
    fn default() -> Self {
        Self {
            cordoned: 0,
            tainted: 0,
            taint: None,
        }
    }
}

impl<T> Guards<T> {
    /// The same guards, their taint borrowed.
    pub fn as_ref(&self) -> Guards<&T> {
        Guards {
            cordoned: self.cordoned,
            tainted: self.tainted,
            taint: self.taint.as_ref(),
        }
    }

    /// The same guards, their taint held as `f` makes it.
    pub fn map<U>(self, f: impl FnOnce(T) -> U) -> Guards<U> {
        Guards {
            cordoned: self.cordoned,
            tainted: self.tainted,
            taint: self.taint.map(f),
        }
    }
}

impl<'a> ClassView<'a> {
    /// What keeps plain pods off this class's guarded nodes.
    pub fn guards(&self, nodes: &Nodes<'a>) -> Guards<&'a crate::model::Taint> {
        let mut guards = Guards::default();
        for &n in &self.guarded_nodes {
            let node = nodes.list[n as usize];
            if node.unschedulable {
                guards.cordoned += 1;
            } else if let Some(taint) = fit::first_blocking_taint(node) {
                guards.tainted += 1;
                guards.taint = guards.taint.or(Some(taint));
            }
        }
        guards
    }
}

impl ClassView<'_> {
    /// The class's name.
    pub fn name(&self) -> &str {
        &self.info.name
    }

    /// True when the nodes `pod` may use differ from `plain_nodes`, so they
    /// must be filtered for it: it narrows them (nodeSelector, required
    /// affinity), or it tolerates its way onto a guarded node. A pod whose
    /// only constraints are tolerations that no guarded node calls for
    /// (every pod on a real cluster carries the API server's not-ready and
    /// unreachable ones) uses the plain list, which costs a pass nothing
    /// per class node.
    pub fn pod_has_own_nodes(&self, pod: &PodInfo, nodes: &Nodes<'_>) -> bool {
        fit::narrows_nodes(pod)
            || (!pod.tolerations.is_empty()
                && self
                    .guarded_nodes
                    .iter()
                    .any(|&n| fit::pod_fits_node(pod, nodes.list[n as usize])))
    }
}

/// Every class, in name order, with the default resolved.
#[derive(Debug)]
pub(crate) struct Classes<'a> {
    pub list: Vec<ClassView<'a>>,
    /// The class unlabelled pods use: see [`established_default`].
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
    /// `infos` is sorted by name, one entry per name.
    pub fn new(infos: &[&'a ClassInfo], resources: &[&str], nodes: &Nodes<'_>) -> Self {
        let sorted = infos;
        let established = established_default(
            sorted
                .iter()
                .filter(|c| c.spec.default)
                .map(|c| (c.name.as_str(), c.created_at)),
        );
        let mut list = Vec::with_capacity(sorted.len());
        for &info in sorted {
            let res = resources
                .binary_search(&info.spec.resource_name.as_str())
                .unwrap_or(0);
            let mut view = ClassView {
                info,
                problem: None,
                res,
                nodes: Vec::new(),
                plain_nodes: Vec::new(),
                guarded_nodes: Vec::new(),
                largest_plain: 0,
            };
            if info.spec.default
                && let Some(older) = established.filter(|d| *d != info.name)
            {
                view.problem = Some(ClassProblem {
                    reason: "MultipleDefaults",
                    message: format!(
                        "class {older} is already the default; at most one class may be marked default: true (class {} is ignored until it sets default: false or {older} steps back)",
                        info.name
                    ),
                });
            }
            if !is_extended_resource(&info.spec.resource_name) {
                view.problem = Some(ClassProblem {
                    reason: "InvalidResourceName",
                    message: format!(
                        "class {}: resourceName {:?} is not an extended resource (a domain-qualified name such as gpupool/slot, outside the kubernetes.io domain)",
                        info.name, info.spec.resource_name
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
                        if fit::turns_plain_pods_away(node) {
                            view.guarded_nodes.push(i);
                        } else {
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
        let default = established.and_then(|name| list.iter().position(|c| c.info.name == name));
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
