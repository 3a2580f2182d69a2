//! `kubectl gpupool queue`: each class's FIFO order, computed from the
//! leases' sequences and phases (reads only), primaries and helpers apart.

use gpupool_api::{GpuLease, GpuLeaseClass, Ordering, Role};
use jiff::Timestamp;
use serde::Serialize;

use crate::error::Error;
use crate::model;
use crate::style::{self, Paint, Style};
use crate::table::{Cell, Table, common_widths};
use crate::unseen::{self, Unseen};

/// What to show.
#[derive(Debug, Clone, Copy)]
pub struct QueueQuery<'a> {
    /// Only this class (`None`: every class).
    pub class: Option<&'a str>,
    /// Only rows of this namespace (`None`: all). Positions stay class-wide.
    pub namespace: Option<&'a str>,
    /// True when `leases` holds every namespace's leases, so positions can be
    /// computed from sequences; false to take the operator's
    /// `status.position` (a reader allowed only one namespace).
    pub all_visible: bool,
    /// True when `classes` holds every class; false when the reader may
    /// not list them, so classes are known only by the names leases give.
    pub classes_visible: bool,
}

/// The queue of every class shown, ready to render or encode.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct QueueView {
    /// Namespace the rows are limited to; absent for all namespaces.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// `sequence` when positions were computed from every lease's sequence,
    /// `leaseStatus` when they are the operator's `status.position`.
    pub positions_from: &'static str,
    /// One entry per class, in name order.
    pub classes: Vec<ClassQueue>,
    /// What the credentials could not list; absent when nothing.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub unseen: Vec<Unseen>,
}

/// One class's queue.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ClassQueue {
    /// Class name.
    pub name: String,
    /// False when leases name a class that no longer exists; absent when
    /// classes could not be listed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exists: Option<bool>,
    /// `StrictFIFO` or `BestEffortFIFO`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ordering: Option<String>,
    /// Slots on the class's nodes (class status); absent when classes
    /// could not be listed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub capacity: Option<u32>,
    /// Free slots (class status); absent when classes could not be listed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub free: Option<u32>,
    /// Waiting primaries in FIFO order.
    pub primaries: Vec<QueueRow>,
    /// Waiting helpers in FIFO order.
    pub helpers: Vec<QueueRow>,
}

/// One waiting pod.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct QueueRow {
    /// 1-based place among the class's waiting leases of its role.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub position: Option<u32>,
    /// Pod namespace.
    pub namespace: String,
    /// Pod name (the lease has the same name).
    pub pod: String,
    /// `primary` or `helper`.
    pub role: Role,
    /// Slots the pod asks for.
    pub slots: u32,
    /// FIFO ticket; absent until the operator has stored it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sequence: Option<u64>,
    /// When the pod was queued.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub queued_at: Option<Timestamp>,
    /// The operator's account of why it waits.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// Builds the queue view. Errors, only when classes are visible (a reader
/// who may not list them cannot tell): [`Error::NoSuchClass`] when the
/// class asked for neither exists nor is named by a lease;
/// [`Error::NoClasses`] when there is no class and no lease at all. Its
/// `unseen` is left empty for the caller to fill.
pub fn build(
    leases: &[GpuLease],
    classes: &[GpuLeaseClass],
    q: QueueQuery<'_>,
) -> Result<QueueView, Error> {
    let mut names: Vec<String> = classes
        .iter()
        .map(|c| model::class_name(c).to_owned())
        .chain(leases.iter().map(|l| l.spec.class_name.clone()))
        .collect();
    names.sort();
    names.dedup();
    if let Some(wanted) = q.class {
        if !names.iter().any(|n| n == wanted) {
            if q.classes_visible {
                return Err(Error::NoSuchClass(wanted.to_owned()));
            }
            names.push(wanted.to_owned());
        }
        names.retain(|n| n == wanted);
    } else if names.is_empty() && q.classes_visible {
        return Err(Error::NoClasses);
    }
    let classes_out = names
        .into_iter()
        .map(|name| {
            let class = classes.iter().find(|c| model::class_name(c) == name);
            let status = class.and_then(|c| c.status.as_ref());
            let rows = |role| rows(leases, &name, role, q);
            let known = |n: u32| q.classes_visible.then_some(n);
            ClassQueue {
                exists: q.classes_visible.then_some(class.is_some()),
                ordering: class.map(|c| ordering_name(c.spec.admission.ordering).to_owned()),
                capacity: known(status.map_or(0, |s| s.capacity)),
                free: known(status.map_or(0, |s| s.free)),
                primaries: rows(Role::Primary),
                helpers: rows(Role::Helper),
                name,
            }
        })
        .collect();
    Ok(QueueView {
        namespace: q.namespace.map(str::to_owned),
        positions_from: if q.all_visible {
            "sequence"
        } else {
            "leaseStatus"
        },
        classes: classes_out,
        unseen: Vec::new(),
    })
}

/// The ordering as the class spec spells it.
pub fn ordering_name(o: Ordering) -> &'static str {
    match o {
        Ordering::StrictFIFO => "StrictFIFO",
        Ordering::BestEffortFIFO => "BestEffortFIFO",
    }
}

fn rows(leases: &[GpuLease], class: &str, role: Role, q: QueueQuery<'_>) -> Vec<QueueRow> {
    model::fifo(leases, class, role)
        .into_iter()
        .enumerate()
        .filter(|(_, l)| q.namespace.is_none_or(|ns| model::namespace(l) == ns))
        .map(|(i, l)| {
            let status = l.status.as_ref();
            let position = if q.all_visible {
                u32::try_from(i + 1).ok()
            } else {
                status.and_then(|s| s.position).filter(|&p| p > 0)
            };
            QueueRow {
                position,
                namespace: model::namespace(l).to_owned(),
                pod: model::pod(l).to_owned(),
                role,
                slots: l.spec.slots,
                sequence: model::sequence(l),
                queued_at: model::queued_at(l),
                message: status.and_then(|s| s.message.clone()),
            }
        })
        .collect()
}

/// Renders the view as text: per class a heading with its capacity and what
/// waits, then a table of waiting primaries and one of waiting helpers.
/// `wide` adds each lease's sequence and queue time. A line per list the
/// credentials could not read ends it.
pub fn render(view: &QueueView, now: Timestamp, wide: bool, style: Style) -> String {
    let mut out = String::new();
    let scope = view
        .namespace
        .as_deref()
        .map(|ns| format!(" in namespace {ns}"))
        .unwrap_or_default();
    if view.classes.is_empty() {
        // Only when classes cannot be listed: no visible lease names one.
        out.push_str(&format!("no pod waits{scope}\n"));
    }
    for (i, class) in view.classes.iter().enumerate() {
        if i > 0 {
            out.push('\n');
        }
        out.push_str(&heading(class, style));
        out.push('\n');
        let tables: Vec<Table> = [&class.primaries, &class.helpers]
            .into_iter()
            .filter(|rows| !rows.is_empty())
            .map(|rows| table(rows, now, wide))
            .collect();
        if tables.is_empty() {
            out.push_str(&format!("  no pod waits{scope}\n"));
        }
        let refs: Vec<&Table> = tables.iter().collect();
        let widths = common_widths(&refs);
        for (j, t) in tables.iter().enumerate() {
            if j > 0 {
                out.push('\n');
            }
            out.push_str(&t.render_with_widths(style, &widths));
        }
    }
    if !view.unseen.is_empty() {
        out.push('\n');
        out.push_str(&unseen::render(&view.unseen, style));
    }
    out
}

fn heading(class: &ClassQueue, style: Style) -> String {
    let name = style.paint(&class.name, Paint::Bold);
    let mut waiting = Vec::new();
    for (n, one, many) in [
        (class.primaries.len(), "primary", "primaries"),
        (class.helpers.len(), "helper", "helpers"),
    ] {
        if n > 0 {
            waiting.push(style::count(n as u64, one, many));
        }
    }
    let waits = if waiting.is_empty() {
        String::new()
    } else {
        format!("; {} waiting", style::join_prose(&waiting))
    };
    match (&class.ordering, class.exists) {
        (Some(ordering), Some(true)) => format!(
            "CLASS {name} ({ordering}): {}, {} free as the operator last counted{waits}",
            style::count(class.capacity.unwrap_or(0).into(), "slot", "slots"),
            class.free.unwrap_or(0)
        ),
        // Classes could not be listed: the name alone.
        (_, None) => format!("CLASS {name}{waits}"),
        _ => format!(
            "CLASS {name} ({}){waits}",
            style.paint("no such GpuLeaseClass", Paint::Red)
        ),
    }
}

fn table(rows: &[QueueRow], now: Timestamp, wide: bool) -> Table {
    let mut headers = vec!["#", "POD", "NAMESPACE", "ROLE", "SLOTS", "WAITING"];
    if wide {
        headers.extend(["SEQUENCE", "QUEUED AT"]);
    }
    headers.push("WHY");
    let mut t = Table::new(&headers);
    t.indent = 2;
    for r in rows {
        let role_paint = match r.role {
            Role::Primary => Paint::Plain,
            Role::Helper => Paint::Cyan,
        };
        let mut row = vec![
            Cell::from(r.position.map_or("-".to_owned(), |p| p.to_string())),
            Cell::new(r.pod.clone(), Paint::Bold),
            Cell::from(r.namespace.clone()),
            Cell::new(r.role.as_str(), role_paint),
            Cell::from(r.slots.to_string()),
            Cell::from(r.queued_at.map_or("-".to_owned(), |t| style::age(t, now))),
        ];
        if wide {
            row.push(Cell::from(
                r.sequence.map_or("-".to_owned(), |s| s.to_string()),
            ));
            row.push(Cell::from(
                r.queued_at
                    .map_or("-".to_owned(), gpupool_api::time::format_micros),
            ));
        }
        let why = r
            .message
            .as_deref()
            .map(|m| m.strip_prefix("waiting: ").unwrap_or(m))
            .unwrap_or("the operator has not decided on it yet");
        row.push(Cell::new(why, Paint::Yellow));
        t.push(row);
    }
    t
}

#[cfg(test)]
// Table-driven cases are tuples of the inputs and what is expected.
#[allow(clippy::type_complexity)]
mod tests {
    use super::*;
    use crate::model::fixtures::*;
    use gpupool_api::LeasePhase;

    fn sample() -> (Vec<GpuLease>, Vec<GpuLeaseClass>) {
        let leases = vec![
            queued(
                "ml",
                "train-d",
                Role::Primary,
                1,
                7,
                3,
                "waiting: 1 primary ahead",
            ),
            queued(
                "ml",
                "train-c",
                Role::Primary,
                2,
                5,
                4,
                "waiting: needs 2 slots on one node",
            ),
            queued(
                "other",
                "train-e",
                Role::Primary,
                1,
                9,
                2,
                "waiting: 2 primaries ahead",
            ),
            queued(
                "ml",
                "backfill",
                Role::Helper,
                1,
                6,
                2,
                "waiting: 3 primaries of class default are queued",
            ),
            holding(
                "ml",
                "train-a",
                Role::Primary,
                LeasePhase::Bound,
                "node-1",
                &[0, 1],
                1,
            ),
        ];
        (
            leases,
            vec![class("default", 4, 0, 3), class("large", 2, 2, 0)],
        )
    }

    fn q<'a>(class: Option<&'a str>, ns: Option<&'a str>, all: bool) -> QueueQuery<'a> {
        QueueQuery {
            class,
            namespace: ns,
            all_visible: all,
            classes_visible: true,
        }
    }

    #[test]
    fn rows_in_fifo_order_with_positions_per_role() {
        let (leases, classes) = sample();
        let cases: &[(
            QueueQuery<'_>,
            &[(&str, Option<u32>)],
            &[(&str, Option<u32>)],
        )] = &[
            (
                q(Some("default"), None, true),
                &[
                    ("train-c", Some(1)),
                    ("train-d", Some(2)),
                    ("train-e", Some(3)),
                ],
                &[("backfill", Some(1))],
            ),
            // One namespace: its rows only, class-wide positions kept.
            (
                q(Some("default"), Some("other"), true),
                &[("train-e", Some(3))],
                &[],
            ),
            // Without the other namespaces, positions come from the lease status (0 = none).
            (
                q(Some("default"), Some("ml"), false),
                &[("train-c", None), ("train-d", None)],
                &[("backfill", None)],
            ),
        ];
        for (query, primaries, helpers) in cases {
            let view = build(&leases, &classes, *query).expect("builds");
            let class = &view.classes[0];
            let got = |rows: &[QueueRow]| -> Vec<(String, Option<u32>)> {
                rows.iter().map(|r| (r.pod.clone(), r.position)).collect()
            };
            let want = |rows: &[(&str, Option<u32>)]| -> Vec<(String, Option<u32>)> {
                rows.iter().map(|(n, p)| ((*n).to_owned(), *p)).collect()
            };
            assert_eq!(got(&class.primaries), want(primaries), "{query:?}");
            assert_eq!(got(&class.helpers), want(helpers), "{query:?}");
        }
    }

    #[test]
    fn operator_positions_are_used_when_not_everything_is_visible() {
        let (mut leases, classes) = sample();
        for l in &mut leases {
            if let Some(s) = l.status.as_mut() {
                s.position = Some(42);
            }
        }
        let view = build(&leases, &classes, q(Some("default"), Some("ml"), false)).expect("builds");
        assert_eq!(view.classes[0].primaries[0].position, Some(42));
        assert_eq!(view.positions_from, "leaseStatus");
    }

    #[test]
    fn errors_name_the_missing_class() {
        let (leases, classes) = sample();
        let cases: &[(&[GpuLease], &[GpuLeaseClass], Option<&str>, &str)] = &[
            (
                &leases,
                &classes,
                Some("nope"),
                "no GpuLeaseClass named \"nope\" (kubectl get gpuleaseclasses)",
            ),
            (
                &[],
                &[],
                None,
                "no GpuLeaseClass exists, so no pod can queue: create one (kubectl apply -f examples/class-default.yaml)",
            ),
            (
                &[],
                &[],
                Some("x"),
                "no GpuLeaseClass named \"x\" (kubectl get gpuleaseclasses)",
            ),
        ];
        for (leases, classes, class, want) in cases {
            let err = build(leases, classes, q(*class, None, true)).expect_err("fails");
            assert_eq!(err.to_string(), *want);
        }
    }

    #[test]
    fn a_class_only_leases_name_is_shown_as_missing() {
        let mut l = queued(
            "ml",
            "orphan",
            Role::Primary,
            1,
            1,
            1,
            "waiting: no node matches class gone yet",
        );
        l.spec.class_name = "gone".into();
        let view = build(&[l], &[], q(None, None, true)).expect("builds");
        assert_eq!(view.classes[0].exists, Some(false));
        let text = render(&view, now(), false, Style::PLAIN);
        assert!(
            text.starts_with("CLASS gone (no such GpuLeaseClass); 1 primary waiting\n"),
            "{text}"
        );
    }

    #[test]
    fn renders_every_class_with_plurals_and_ages() {
        let (leases, classes) = sample();
        let view = build(&leases, &classes, q(None, None, true)).expect("builds");
        let text = render(&view, now(), false, Style::PLAIN);
        let want = "\
CLASS default (StrictFIFO): 4 slots, 0 free as the operator last counted; 3 primaries and 1 helper waiting
  #   POD        NAMESPACE   ROLE      SLOTS   WAITING   WHY
  1   train-c    ml          primary   2       4s        needs 2 slots on one node
  2   train-d    ml          primary   1       3s        1 primary ahead
  3   train-e    other       primary   1       2s        2 primaries ahead

  #   POD        NAMESPACE   ROLE      SLOTS   WAITING   WHY
  1   backfill   ml          helper    1       2s        3 primaries of class default are queued

CLASS large (StrictFIFO): 2 slots, 2 free as the operator last counted
  no pod waits
";
        assert_eq!(text, want);
    }

    #[test]
    fn wide_adds_sequence_and_queue_time() {
        let (leases, classes) = sample();
        let view =
            build(&leases, &classes, q(Some("default"), Some("other"), true)).expect("builds");
        let text = render(&view, now(), true, Style::PLAIN);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines[0],
            "CLASS default (StrictFIFO): 4 slots, 0 free as the operator last counted; 1 primary waiting"
        );
        assert!(lines[1].contains("SEQUENCE   QUEUED AT"), "{text}");
        assert!(
            lines[2].ends_with("   9          2023-11-14T22:13:18.000000Z   2 primaries ahead"),
            "{text}"
        );
        let empty = build(&leases, &classes, q(Some("large"), Some("ml"), true)).expect("builds");
        let text = render(&empty, now(), true, Style::PLAIN);
        assert!(text.contains("  no pod waits in namespace ml\n"), "{text}");
    }

    #[test]
    fn lease_status_positions_carry_a_note_and_json_says_so() {
        let (leases, classes) = sample();
        let mut view =
            build(&leases, &classes, q(Some("default"), Some("ml"), false)).expect("builds");
        view.unseen = vec![Unseen::leases("ml", ", at the operator's positions")];
        let text = render(&view, now(), false, Style::PLAIN);
        assert!(
            text.ends_with(
                "\ncannot list GpuLeases in all namespaces: forbidden; showing namespace ml, at the operator's positions\n"
            ),
            "{text}"
        );
        let json = serde_json::to_value(&view).expect("json");
        assert_eq!(json["unseen"][0]["what"], "GpuLeases in all namespaces");
        assert_eq!(json["positionsFrom"], "leaseStatus");
        assert_eq!(json["namespace"], "ml");
        assert_eq!(json["classes"][0]["primaries"][0]["pod"], "train-c");
        assert_eq!(json["classes"][0]["primaries"][0]["role"], "primary");
        assert_eq!(
            json["classes"][0]["primaries"][0]["queuedAt"],
            "2023-11-14T22:13:16Z"
        );
    }

    /// A tenant who may list neither classes nor other namespaces' leases:
    /// the classes its leases name, without capacity, and no error for a
    /// class it cannot see.
    #[test]
    fn without_classes_the_leases_name_them() {
        let (leases, _) = sample();
        let mine: Vec<GpuLease> = leases
            .into_iter()
            .filter(|l| model::namespace(l) == "ml")
            .collect();
        let hidden = |class| QueueQuery {
            class,
            namespace: Some("ml"),
            all_visible: false,
            classes_visible: false,
        };
        let mut view = build(&mine, &[], hidden(None)).expect("builds");
        view.unseen = vec![Unseen::classes("classes are shown by name only")];
        let class = &view.classes[0];
        assert_eq!(
            (
                class.name.as_str(),
                class.exists,
                class.capacity,
                class.free
            ),
            ("default", None, None, None)
        );
        let text = render(&view, now(), false, Style::PLAIN);
        assert!(
            text.starts_with("CLASS default; 2 primaries and 1 helper waiting\n"),
            "{text}"
        );
        assert!(
            text.ends_with(
                "\ncannot list GpuLeaseClasses: forbidden; classes are shown by name only\n"
            ),
            "{text}"
        );
        let json = serde_json::to_value(&view).expect("json");
        assert!(json["classes"][0].get("capacity").is_none(), "{json}");
        assert!(json["classes"][0].get("exists").is_none(), "{json}");
        // A class named by no visible lease, and no lease at all: not errors.
        let view = build(&mine, &[], hidden(Some("large"))).expect("builds");
        assert_eq!(view.classes[0].name, "large");
        assert!(view.classes[0].primaries.is_empty());
        let text = render(&view, now(), false, Style::PLAIN);
        assert_eq!(text, "CLASS large\n  no pod waits in namespace ml\n");
        let view = build(&[], &[], hidden(None)).expect("builds");
        assert_eq!(
            render(&view, now(), false, Style::PLAIN),
            "no pod waits in namespace ml\n"
        );
    }

    #[test]
    fn colour_marks_helpers_and_reasons() {
        let (leases, classes) = sample();
        let view = build(&leases, &classes, q(Some("default"), None, true)).expect("builds");
        let text = render(&view, now(), false, Style { color: true });
        assert!(text.contains("\x1b[36mhelper\x1b[0m"), "{text}");
        assert!(text.contains("\x1b[1mdefault\x1b[0m"), "{text}");
        assert!(!render(&view, now(), false, Style::PLAIN).contains('\x1b'));
    }
}
