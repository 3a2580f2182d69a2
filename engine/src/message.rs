//! The human messages a lease status carries: why it waits, where it runs,
//! why it was rejected. Kept as data until rendered so that an unchanged
//! status can be recognised without building a new string per lease.

use std::fmt::{self, Write as _};

use gpupool_api::Role;

use super::classes::{Classes, Guards};
use super::model::Taint;
use super::model::{ObjectKey, PodPhase};
use super::pass::PreemptedBy;

/// Why a lease is where it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Message<'a> {
    /// Keep whatever the persisted status says (a final lease).
    Unchanged,
    /// The pod is gone or finished.
    Released(Release<'a>),
    /// Admitted to a node (or admitted outside gpupool and not yet bound).
    Admitted(Option<&'a str>),
    /// Running on the node with GPUs the device plugin reported.
    Bound(&'a str),
    /// Being evicted for a primary.
    Preempting(Option<PreemptedBy<'a>>),
    /// Being evicted for a primary, but a PodDisruptionBudget refused the
    /// last eviction: it is asked for again.
    EvictionBlocked(Option<PreemptedBy<'a>>),
    /// The class does not exist.
    UnknownClass(&'a str),
    /// The class is invalid (index into the pass's classes).
    InvalidClass(usize),
    /// The role label holds something else than primary or helper.
    BadRole(&'a str),
    /// Created in this pass; its first decision is in the next pass.
    NewlyQueued,
    /// The pod carries another controller's scheduling gate (named).
    OtherGate(&'a str),
    /// Admitted, but the scheduler cannot place the pod; it gives its
    /// slots back at `deadline` unless it is placed by then.
    Unplaceable {
        node: Option<&'a str>,
        why: Option<&'a str>,
        deadline: jiff::Timestamp,
    },
    /// Released: the scheduler could not place the admitted pod for its
    /// class's placement timeout, so it was deleted.
    GaveBack {
        node: Option<&'a str>,
        why: Option<&'a str>,
        seconds: u32,
    },
    /// Waits for a reason that holds whatever its own pod asks beyond
    /// its slots (see [`Waiting`]).
    Waiting(Waiting<&'a ObjectKey, &'a Taint>),
    /// The first of its role that does not fit.
    NoFit {
        role: Role,
        ahead: u32,
        slots: u32,
        free: u64,
        nodes: usize,
        /// The pod's own nodeSelector, affinity or tolerations narrow the
        /// class's nodes to this many, with this many free slots.
        own: Option<(usize, u64)>,
        /// Of the class's nodes, those cordoned or tainted against the pod.
        guards: Guards<&'a Taint>,
    },
    /// The helper fits nowhere but on nodes that waiting primaries of other
    /// classes could use.
    KeptForPrimaries { nodes: usize },
    /// The head waits for evicted helpers to terminate.
    VictimsTerminating(Vec<&'a ObjectKey>),
    /// The head cannot fit and no helper may be preempted for it.
    NoVictims {
        slots: u32,
        free: u64,
        young: u32,
        /// As in `NoFit`.
        own: Option<(usize, u64)>,
        /// As in `NoFit`.
        guards: Guards<&'a Taint>,
    },
}

/// How a released lease's message begins when its pod failed and the
/// kubelet said why; the rest is the kubelet's reason and message. The
/// operator raises a Warning event for such a release.
pub const POD_FAILED_BECAUSE: &str = "released: pod failed: ";

/// At most this many bytes of the kubelet's or the scheduler's words go
/// into a lease message.
const FAILURE_SHOWN: usize = 512;

/// Why a lease was released, as its pod tells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Release<'a> {
    /// The pod was deleted: it is gone, or it ended while being deleted
    /// (its containers stopped by the kubelet, whatever their exit code).
    Deleted,
    /// The pod's containers completed.
    Succeeded,
    /// The pod failed on its own, with what the kubelet said when it did
    /// (an admission it refused, say).
    Failed(Option<&'a str>),
}

impl<'a> Release<'a> {
    /// The reason for a lease whose pod is `pod` (`None`: gone), once that
    /// pod no longer runs.
    pub(crate) fn of(pod: Option<&'a super::model::PodInfo>) -> Self {
        match pod {
            None => Release::Deleted,
            Some(p) if p.terminating => Release::Deleted,
            Some(p) if p.phase == PodPhase::Succeeded => Release::Succeeded,
            Some(p) => Release::Failed(p.failure.as_deref()),
        }
    }
}

impl Message<'_> {
    /// Writes the message; `classes` supplies names and problems.
    pub fn render(&self, classes: &Classes<'_>, out: &mut String) {
        // Writing into a String cannot fail.
        let _ = self.write(classes, out);
    }

    fn write(&self, classes: &Classes<'_>, out: &mut String) -> fmt::Result {
        match self {
            Message::Unchanged => Ok(()),
            Message::Released(Release::Deleted) => out.write_str("released: pod deleted"),
            Message::Released(Release::Succeeded) => out.write_str("released: pod succeeded"),
            Message::Released(Release::Failed(None)) => out.write_str("released: pod failed"),
            Message::Released(Release::Failed(Some(why))) => {
                out.push_str(POD_FAILED_BECAUSE);
                push_head(out, why);
                Ok(())
            }
            // The three most common messages (thousands per pass) are built
            // without the formatting machinery; see `push_u64`.
            Message::Admitted(Some(node)) => {
                out.push_str("admitted to node ");
                out.push_str(node);
                Ok(())
            }
            Message::Admitted(None) => {
                out.write_str("admitted without the admission gate; not yet bound to a node")
            }
            Message::Bound(node) => {
                out.push_str("running on node ");
                out.push_str(node);
                Ok(())
            }
            Message::Preempting(Some(primary)) => write!(out, "preempted for primary {primary}"),
            Message::Preempting(None) => out.write_str("preempted"),
            Message::EvictionBlocked(by) => {
                match by {
                    Some(primary) => write!(out, "preempted for primary {primary}; ")?,
                    None => out.write_str("preempted; ")?,
                }
                out.write_str("eviction blocked by a PodDisruptionBudget, retrying")
            }
            Message::UnknownClass(name) => write!(
                out,
                "rejected: GpuLeaseClass {name} does not exist; the lease queues once it is created"
            ),
            Message::InvalidClass(c) => write_invalid_class(out, classes, c),
            Message::BadRole(value) => write!(
                out,
                "rejected: label gpupool.io/role must be \"primary\" or \"helper\", not {value:?}"
            ),
            Message::NewlyQueued => out.write_str("queued; first considered in the next pass"),
            Message::OtherGate(gate) => write!(
                out,
                "waiting: the pod carries scheduling gate {gate}; it takes its place in the queue once gpupool's gate is its only one"
            ),
            Message::Unplaceable {
                node,
                why,
                deadline,
            } => write_unplaceable(out, *node, *why, deadline),
            Message::GaveBack { node, why, seconds } => write_gave_back(out, *node, *why, seconds),
            Message::Waiting(waiting) => write_waiting(out, classes, waiting),
            Message::NoFit {
                role,
                ahead,
                slots,
                free,
                nodes,
                own,
                guards,
            } => write_no_fit(out, role, ahead, slots, free, nodes, own, guards),
            Message::KeptForPrimaries { nodes } => {
                out.push_str("waiting: ");
                count(out, *nodes as u64, "matching node", "matching nodes");
                write!(
                    out,
                    " {} kept free for primaries of other classes that are queued",
                    if *nodes == 1 { "is" } else { "are" }
                )
            }
            Message::VictimsTerminating(victims) => write_victims_terminating(out, victims),
            Message::NoVictims {
                slots,
                free,
                young,
                own,
                guards,
            } => write_no_victims(out, slots, free, young, own, guards),
        }
    }
}

fn write_unplaceable(
    out: &mut String,
    node: Option<&str>,
    why: Option<&str>,
    deadline: &jiff::Timestamp,
) -> fmt::Result {
    match node {
        Some(node) => write!(
            out,
            "admitted to node {node}, but the scheduler cannot place it"
        )?,
        None => out.write_str("admitted, but the scheduler cannot place it")?,
    }
    if let Some(why) = why {
        out.write_str(": ")?;
        push_head(out, why);
    }
    write!(
        out,
        "; it gives its slots back at {deadline} unless it is placed by then"
    )
}

fn write_gave_back(
    out: &mut String,
    node: Option<&str>,
    why: Option<&str>,
    seconds: &u32,
) -> fmt::Result {
    out.write_str("released: the scheduler could not place the pod")?;
    if let Some(node) = node {
        write!(out, " on node {node}")?;
    }
    write!(out, " for {seconds}s")?;
    if let Some(why) = why {
        out.write_str(" (")?;
        push_head(out, why);
        out.write_str(")")?;
    }
    out.write_str("; it was deleted to give its slots back")
}

fn write_no_pod_node(
    out: &mut String,
    classes: &Classes<'_>,
    class: &usize,
    class_nodes: &usize,
    guards: &Guards<&Taint>,
) -> fmt::Result {
    let name = classes.list[*class].name();
    let guarded = (guards.cordoned + guards.tainted) as usize;
    if guarded == *class_nodes {
        // Cordons and taints alone keep the pod off.
        write!(out, "waiting: no node of class {name} is open to the pod")?;
    } else if *class_nodes == 1 {
        write!(
            out,
            "waiting: the one node of class {name} does not fit the pod's nodeSelector, affinity and tolerations"
        )?;
    } else {
        write!(
            out,
            "waiting: none of the {class_nodes} nodes of class {name} fits the pod's nodeSelector, affinity and tolerations"
        )?;
    }
    push_guards(out, guards, " (", ")");
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn write_no_fit(
    out: &mut String,
    role: &Role,
    ahead: &u32,
    slots: &u32,
    free: &u64,
    nodes: &usize,
    own: &Option<(usize, u64)>,
    guards: &Guards<&Taint>,
) -> fmt::Result {
    out.push_str("waiting: ");
    let (one, many) = role_noun(*role);
    count(out, u64::from(*ahead), one, many);
    out.push_str(" ahead; needs ");
    count(out, u64::from(*slots), "slot", "slots");
    match own {
        None => out.push_str(" on one node, "),
        Some((own_nodes, own_free)) => {
            own_nodes_phrase(out, *own_nodes);
            push_u64(out, *own_free);
            out.push_str(" free there); ");
        }
    }
    count(out, *free, "free slot", "free slots");
    out.push_str(" on ");
    count(out, *nodes as u64, "matching node", "matching nodes");
    push_guards(out, guards, "; ", "");
    Ok(())
}

fn write_victims_terminating(out: &mut String, victims: &[&ObjectKey]) -> fmt::Result {
    let one = victims.len() == 1;
    out.write_str(if one {
        "waiting for helper "
    } else {
        "waiting for helpers "
    })?;
    for (i, v) in victims.iter().enumerate() {
        if i > 0 {
            out.write_str(", ")?;
        }
        write!(out, "{v}")?;
    }
    out.write_str(" to terminate")
}

fn write_no_victims(
    out: &mut String,
    slots: &u32,
    free: &u64,
    young: &u32,
    own: &Option<(usize, u64)>,
    guards: &Guards<&Taint>,
) -> fmt::Result {
    out.push_str("waiting: needs ");
    count(out, u64::from(*slots), "slot", "slots");
    match own {
        None => {
            out.push_str(" on one node, ");
            count(out, *free, "free slot", "free slots");
        }
        Some((own_nodes, own_free)) => {
            own_nodes_phrase(out, *own_nodes);
            push_u64(out, *own_free);
            out.push_str(" free there, ");
            push_u64(out, *free);
            out.push_str(" on the class's nodes)");
        }
    }
    out.push_str("; no helper can be preempted to make room");
    if *young > 0 {
        out.push_str(" (");
        count(out, u64::from(*young), "helper is", "helpers are");
        out.push_str(" younger than minRuntimeSeconds)");
    }
    push_guards(out, guards, "; ", "");
    Ok(())
}

fn write_behind(
    out: &mut String,
    role: &Role,
    ahead: &u32,
    head: &ObjectKey,
    head_slots: &u32,
    free: &u64,
    nodes: &usize,
) -> fmt::Result {
    out.push_str("waiting: ");
    let (one, many) = role_noun(*role);
    count(out, u64::from(*ahead), one, many);
    out.push_str(" ahead (head ");
    out.push_str(&head.namespace);
    out.push('/');
    out.push_str(&head.name);
    out.push_str(" needs ");
    count(out, u64::from(*head_slots), "slot", "slots");
    out.push_str("), ");
    count(out, *free, "free slot", "free slots");
    out.push_str(" on ");
    count(out, *nodes as u64, "matching node", "matching nodes");
    Ok(())
}

fn write_invalid_class(out: &mut String, classes: &Classes<'_>, c: &usize) -> fmt::Result {
    let class = &classes.list[*c];
    let problem = class
        .problem
        .as_ref()
        .map(|p| p.message.as_str())
        .unwrap_or("");
    write!(
        out,
        "rejected: class {} is invalid: {problem}; the lease queues once it is fixed",
        class.name()
    )
}

/// A role's noun, singular and plural.
fn role_noun(role: Role) -> (&'static str, &'static str) {
    match role {
        Role::Primary => ("primary", "primaries"),
        Role::Helper => ("helper", "helpers"),
    }
}

/// " on the one node its own … allow (" or " on one of the N nodes …".
fn own_nodes_phrase(out: &mut String, nodes: usize) {
    if nodes == 1 {
        out.push_str(" on the one node its own nodeSelector, affinity and tolerations allow (");
    } else {
        out.push_str(" on one of the ");
        count(out, nodes as u64, "node", "nodes");
        out.push_str(" its own nodeSelector, affinity and tolerations allow (");
    }
}

/// Appends, between `open` and `close`, how many nodes are cordoned and how
/// many tainted (naming the first taint), when any are.
fn push_guards(out: &mut String, guards: &Guards<&Taint>, open: &str, close: &str) {
    if guards.cordoned == 0 && guards.tainted == 0 {
        return;
    }
    out.push_str(open);
    if guards.cordoned > 0 {
        count(
            out,
            u64::from(guards.cordoned),
            "node cordoned",
            "nodes cordoned",
        );
    }
    if let (n @ 1.., Some(taint)) = (guards.tainted, guards.taint) {
        if guards.cordoned > 0 {
            out.push_str(", ");
        }
        count(out, u64::from(n), "node", "nodes");
        out.push_str(" tainted ");
        push_taint(out, taint);
        if n > 1 {
            out.push_str(" or otherwise");
        }
        out.push_str(" without a toleration in the pod");
    }
    out.push_str(close);
}

/// `key=value:Effect`, as kubectl shows a taint.
fn push_taint(out: &mut String, taint: &Taint) {
    out.push_str(&taint.key);
    if let Some(value) = taint.value.as_deref().filter(|v| !v.is_empty()) {
        out.push('=');
        out.push_str(value);
    }
    out.push_str(match taint.effect {
        super::model::TaintEffect::NoSchedule => ":NoSchedule",
        super::model::TaintEffect::PreferNoSchedule => ":PreferNoSchedule",
        super::model::TaintEffect::NoExecute => ":NoExecute",
    });
}

/// Appends at most [`FAILURE_SHOWN`] bytes of what the kubelet or the
/// scheduler said: their messages can be long, and a lease keeps the head.
fn push_head(out: &mut String, why: &str) {
    let mut end = why.len().min(FAILURE_SHOWN);
    while !why.is_char_boundary(end) {
        end -= 1;
    }
    out.push_str(&why[..end]);
    if end < why.len() {
        out.push('…');
    }
}

/// Why a waiting lease waits, when the reason holds whatever its own pod
/// asks beyond its slots: no node of the class, none open to the pod, none
/// large enough, helpers held back, or a blocked StrictFIFO. These are the
/// reasons a parked lease can carry.
///
/// `K` is how it names the head of a blocked queue and `T` how it holds a
/// taint, so that one type is both a pass's message ([`Message::Waiting`],
/// borrowing from the pass) and the one the kept engine remembers a
/// lease's persisted status to render ([`Settled`], owned, outliving the
/// pass). A `Settled` renders what a `Message::Waiting` renders exactly
/// when their borrowed forms are equal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Waiting<K, T> {
    /// No node matches the class (index into the pass's classes).
    NoClassNode(usize),
    /// Nodes match the class but none passes the pod's own constraints;
    /// `guards` says which of them are cordoned or tainted.
    NoPodNode {
        class: usize,
        class_nodes: usize,
        guards: Guards<T>,
    },
    /// The request exceeds every matching node's allocatable.
    TooLarge { slots: u32, largest: u32 },
    /// Helpers wait while primaries of the class do.
    HelpersHeldBack { primaries: u32, class: usize },
    /// Behind a blocked head in StrictFIFO.
    Behind {
        role: Role,
        ahead: u32,
        head: K,
        head_slots: u32,
        free: u64,
        nodes: usize,
    },
}

/// A waiting message a lease's persisted status already renders, which
/// the kept engine remembers so as not to render it again while nothing it
/// names changes.
pub(crate) type Settled = Waiting<ObjectKey, Taint>;

impl<K, T> Waiting<K, T> {
    /// The same reason, naming the head as `key` and holding the taint as
    /// `taint` make them of this one's.
    fn map<'s, K2, T2>(
        &'s self,
        key: impl FnOnce(&'s K) -> K2,
        taint: impl FnOnce(&'s T) -> T2,
    ) -> Waiting<K2, T2> {
        match self {
            Waiting::NoClassNode(c) => Waiting::NoClassNode(*c),
            Waiting::NoPodNode {
                class,
                class_nodes,
                guards,
            } => Waiting::NoPodNode {
                class: *class,
                class_nodes: *class_nodes,
                guards: guards.as_ref().map(taint),
            },
            Waiting::TooLarge { slots, largest } => Waiting::TooLarge {
                slots: *slots,
                largest: *largest,
            },
            Waiting::HelpersHeldBack { primaries, class } => Waiting::HelpersHeldBack {
                primaries: *primaries,
                class: *class,
            },
            Waiting::Behind {
                role,
                ahead,
                head,
                head_slots,
                free,
                nodes,
            } => Waiting::Behind {
                role: *role,
                ahead: *ahead,
                head: key(head),
                head_slots: *head_slots,
                free: *free,
                nodes: *nodes,
            },
        }
    }
}

impl Settled {
    /// What `message` renders, owned, when it is a [`Message::Waiting`].
    pub fn of(message: &Message<'_>) -> Option<Self> {
        let Message::Waiting(waiting) = message else {
            return None;
        };
        Some(waiting.map(|&head| head.clone(), |&taint| taint.clone()))
    }

    /// True when `message` renders what this does.
    pub fn is(&self, message: &Message<'_>) -> bool {
        matches!(message, Message::Waiting(waiting) if self.map(|k| k, |t| t) == *waiting)
    }
}

fn write_waiting(
    out: &mut String,
    classes: &Classes<'_>,
    waiting: &Waiting<&ObjectKey, &Taint>,
) -> fmt::Result {
    match waiting {
        Waiting::NoClassNode(c) => write!(
            out,
            "waiting: no node matches class {} yet",
            classes.list[*c].name()
        ),
        Waiting::NoPodNode {
            class,
            class_nodes,
            guards,
        } => write_no_pod_node(out, classes, class, class_nodes, guards),
        Waiting::TooLarge { slots, largest } => {
            out.push_str("waiting: needs ");
            count(out, u64::from(*slots), "slot", "slots");
            out.push_str("; largest matching node has ");
            push_u64(out, u64::from(*largest));
            Ok(())
        }
        Waiting::HelpersHeldBack { primaries, class } => {
            out.push_str("waiting: ");
            count(out, u64::from(*primaries), "primary", "primaries");
            write!(
                out,
                " of class {} {} queued; helpers are admitted only while none wait",
                classes.list[*class].name(),
                if *primaries == 1 { "is" } else { "are" }
            )
        }
        Waiting::Behind {
            role,
            ahead,
            head,
            head_slots,
            free,
            nodes,
        } => write_behind(out, role, ahead, head, head_slots, free, nodes),
    }
}

/// Appends `n` and the noun that agrees with it: "1 slot", "2 slots".
fn count(out: &mut String, n: u64, one: &str, many: &str) {
    push_u64(out, n);
    out.push(' ');
    out.push_str(if n == 1 { one } else { many });
}

/// Appends the decimal digits of `n`.
fn push_u64(out: &mut String, mut n: u64) {
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    for &d in &digits[i..] {
        out.push(char::from(d));
    }
}

#[cfg(test)]
mod tests {
    use super::{count, push_u64};

    #[test]
    fn counts_agree_with_their_nouns() {
        for (n, want) in [(0, "0 slots"), (1, "1 slot"), (2, "2 slots")] {
            let mut s = String::new();
            count(&mut s, n, "slot", "slots");
            assert_eq!(s, want);
        }
    }

    #[test]
    fn push_u64_writes_decimal() {
        for n in [0u64, 7, 10, 1234, u64::MAX] {
            let mut s = String::from("x");
            push_u64(&mut s, n);
            assert_eq!(s, format!("x{n}"));
        }
    }
}
