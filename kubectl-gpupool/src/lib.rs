//! `kubectl gpupool`: a kubectl plugin that shows gpupool's queue, who
//! holds which GPU, and why a pod waits, reading only the API.
//!
//! The views (`queue`, `top`, `why`) are pure: API objects and the time in,
//! a `String` out, so they are tested without a cluster. `read` holds every
//! API call; [`run`] puts the two together.

pub mod cli;
pub mod error;
pub mod model;
pub mod queue;
pub mod read;
pub mod rules;
pub mod style;
pub mod table;
pub mod top;
pub mod unseen;
pub mod why;

use std::collections::BTreeMap;
use std::io::Write;
use std::time::Duration;

use futures::StreamExt;
use gpupool_api::{GpuLease, GpuLeaseClass};
use jiff::Timestamp;
use kube::Api;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};

pub use error::Error;

use cli::{Cli, Command, DataOutput, QueueOutput};
use read::Cluster;
use style::Style;
use unseen::Unseen;

/// Runs one command, writing its output to `out`. Returns when the output is
/// written (or, with `queue --watch`, when the watch ends or writing fails).
pub async fn run(cli: Cli, style: Style, out: &mut dyn Write) -> Result<(), Error> {
    let g = &cli.global;
    let all_namespaces = cli.all_namespaces();
    if all_namespaces && g.namespace.is_some() {
        return Err(Error::Usage(
            "-A and -n cannot be used together: -A shows every namespace".to_owned(),
        ));
    }
    let cluster = read::connect(g.kubeconfig.as_deref(), g.context.as_deref()).await?;
    let namespace = g
        .namespace
        .clone()
        .unwrap_or_else(|| cluster.default_namespace.clone());
    match cli.command {
        Command::Queue {
            class,
            output,
            watch,
            ..
        } => {
            let rows_ns = (!all_namespaces).then_some(namespace.as_str());
            let args = QueueArgs {
                class: class.as_deref(),
                rows_ns,
                all_namespaces,
                output,
                style,
            };
            if watch {
                watch_queue(&cluster, &args, &namespace, out).await
            } else {
                let leases = cluster.leases(&namespace, all_namespaces).await?;
                let classes = cluster.classes(true).await?;
                let text = render_queue(&args, &leases, classes.as_deref())?;
                write(out, &text)
            }
        }
        Command::Top { output, .. } => {
            // -A does not apply to top: it shows every namespace it may.
            let leases = cluster.leases(&namespace, false).await?;
            let classes = cluster.classes(true).await?;
            let nodes = cluster.nodes(true).await?;
            // Pods only count where free slots are shown: every node and
            // every lease seen.
            let pods = match (&nodes, leases.all_visible) {
                (Some(_), true) => Some(cluster.pods(&namespace).await?),
                _ => None,
            };
            let mut view = top::build_visible(
                classes.as_deref(),
                nodes.as_deref(),
                pods.as_ref().map_or(&[], |p| p.items.as_slice()),
                pods.as_ref().is_some_and(|p| p.all_visible),
                &leases.items,
                leases.namespace.as_deref(),
            );
            view.unseen = unseen_lines(
                &leases,
                ": only the GPUs its pods hold",
                classes.is_none().then_some("class capacity is not shown"),
                nodes.is_none().then_some(
                    "showing the GPUs that leases hold, without the nodes' free GPUs or their health",
                ),
                pods.as_ref(),
            );
            let text = match output {
                Some(DataOutput::Json) => to_json(&view)?,
                Some(DataOutput::Yaml) => to_yaml(&view)?,
                None => {
                    let mut text = top::render(&view, Timestamp::now(), style);
                    if let Some(legend) = top::legend(&view) {
                        text.push('\n');
                        text.push_str(&style.paint(legend, style::Paint::Dim));
                        text.push('\n');
                    }
                    text
                }
            };
            write(out, &text)
        }
        Command::Why { pod, .. } => {
            if all_namespaces {
                return Err(Error::Usage(
                    "why looks at one pod: give its namespace with -n, not -A".to_owned(),
                ));
            }
            let p = cluster.pod(&namespace, &pod).await?;
            let leases = cluster.leases(&namespace, false).await?;
            let classes = cluster.classes(true).await?;
            let nodes = cluster.nodes(true).await?;
            // Pods only count where node fit is shown.
            let pods = match nodes {
                Some(_) => Some(cluster.pods(&namespace).await?),
                None => None,
            };
            let unseen = unseen_lines(
                &leases,
                POSITIONS_FROM_STATUS,
                classes
                    .is_none()
                    .then_some("the class's capacity and ordering are not shown"),
                nodes.is_none().then_some("node fit is not shown"),
                pods.as_ref(),
            );
            let lease = leases.items.iter().find(|l| {
                model::namespace(l) == namespace && l.metadata.name.as_deref() == Some(pod.as_str())
            });
            let text = why::explain(
                why::WhyInput {
                    pod: &p,
                    lease,
                    classes: classes.as_deref().unwrap_or_default(),
                    classes_visible: classes.is_some(),
                    leases: &leases.items,
                    all_visible: leases.all_visible,
                    nodes: nodes.as_deref(),
                    pods: pods.as_ref().map_or(&[], |p| p.items.as_slice()),
                    all_pods_visible: pods.as_ref().is_some_and(|p| p.all_visible),
                    now: Timestamp::now(),
                    unseen: &unseen,
                },
                style,
            )?;
            write(out, &text)
        }
    }
}

struct QueueArgs<'a> {
    class: Option<&'a str>,
    rows_ns: Option<&'a str>,
    all_namespaces: bool,
    output: Option<QueueOutput>,
    style: Style,
}

/// How positions are shown when other namespaces' leases cannot be listed.
const POSITIONS_FROM_STATUS: &str = ", at the positions the operator wrote (status.position)";

/// The lines saying what could not be listed: every namespace's leases
/// (when `leases` fell back to one namespace; `leases_instead` follows the
/// namespace's name), then classes and nodes, each with what is shown
/// instead when it could not be listed, then every namespace's pods when
/// `pods` were read and fell short of that.
fn unseen_lines(
    leases: &read::Leases,
    leases_instead: &str,
    classes_instead: Option<&str>,
    nodes_instead: Option<&str>,
    pods: Option<&read::Pods>,
) -> Vec<Unseen> {
    let mut out = Vec::new();
    if let Some(ns) = &leases.namespace {
        out.push(Unseen::leases(ns, leases_instead));
    }
    out.extend(classes_instead.map(Unseen::classes));
    out.extend(nodes_instead.map(Unseen::nodes));
    if let Some(p) = pods.filter(|p| !p.all_visible) {
        out.push(Unseen::pods(p.namespace.as_deref()));
    }
    out
}

/// The queue of what could be listed: `classes` is `None` when the
/// credentials may not list them.
fn queue_view(
    args: &QueueArgs<'_>,
    leases: &read::Leases,
    classes: Option<&[gpupool_api::GpuLeaseClass]>,
) -> Result<queue::QueueView, Error> {
    let mut view = queue::build(
        &leases.items,
        classes.unwrap_or_default(),
        queue::QueueQuery {
            class: args.class,
            namespace: args.rows_ns.or(leases.namespace.as_deref()),
            all_visible: leases.all_visible,
            classes_visible: classes.is_some(),
        },
    )?;
    view.unseen = unseen_lines(
        leases,
        POSITIONS_FROM_STATUS,
        classes
            .is_none()
            .then_some("classes are shown by name, without their capacity or ordering"),
        None,
        None,
    );
    Ok(view)
}

fn render_queue(
    args: &QueueArgs<'_>,
    leases: &read::Leases,
    classes: Option<&[gpupool_api::GpuLeaseClass]>,
) -> Result<String, Error> {
    let view = queue_view(args, leases, classes)?;
    format_queue(args, &view, false)
}

fn format_queue(
    args: &QueueArgs<'_>,
    view: &queue::QueueView,
    stream: bool,
) -> Result<String, Error> {
    Ok(match args.output {
        // A watch writes one compact JSON document per line, so a reader can
        // take them one line at a time.
        Some(QueueOutput::Json) if stream => {
            let mut s = serde_json::to_string(view).map_err(|e| Error::Encode {
                format: "json",
                detail: e.to_string(),
            })?;
            s.push('\n');
            s
        }
        Some(QueueOutput::Json) => to_json(view)?,
        Some(QueueOutput::Yaml) if stream => format!("---\n{}", to_yaml(view)?),
        Some(QueueOutput::Yaml) => to_yaml(view)?,
        Some(QueueOutput::Wide) => queue::render(view, Timestamp::now(), true, args.style),
        None => queue::render(view, Timestamp::now(), false, args.style),
    })
}

/// `queue --watch`: leases and classes are followed with watchers; the
/// queue is shown again after each burst of changes (and, on a terminal,
/// every few seconds so that ages stay current), and only when it changed.
async fn watch_queue(
    cluster: &Cluster,
    args: &QueueArgs<'_>,
    namespace: &str,
    out: &mut dyn Write,
) -> Result<(), Error> {
    // A first list decides what may be watched, and fails early with the
    // same errors as a plain `queue`.
    let first = cluster.leases(namespace, args.all_namespaces).await?;
    let classes_visible = cluster.classes(true).await?.is_some();
    let lease_api: Api<GpuLease> = match &first.namespace {
        None => Api::all(cluster.client()),
        Some(ns) => Api::namespaced(cluster.client(), ns),
    };
    let class_api: Api<GpuLeaseClass> = Api::all(cluster.client());
    let mut leases = Mirror::default();
    let mut classes = Mirror::default();
    let mut lease_events = watcher::watcher(lease_api, watcher::Config::default())
        .default_backoff()
        .boxed();
    // Classes that may not be listed are not watched: the queue goes on
    // without them, as a plain `queue` does.
    let mut class_events = if classes_visible {
        watcher::watcher(class_api, watcher::Config::default())
            .default_backoff()
            .boxed()
    } else {
        classes.synced = true;
        futures::stream::pending().boxed()
    };
    let text_output = args.output.is_none_or(|o| o == QueueOutput::Wide);
    let redraw = args.style.color && text_output;
    let mut tick = tokio::time::interval(Duration::from_secs(5));
    let mut last: Option<queue::QueueView> = None;
    loop {
        let mut changed = tokio::select! {
            ev = lease_events.next() => match ev {
                Some(ev) => leases.apply(ev, cluster),
                None => return Ok(()),
            },
            ev = class_events.next() => match ev {
                Some(ev) => classes.apply(ev, cluster),
                None => return Ok(()),
            },
            _ = tick.tick(), if redraw => {
                last = None;
                true
            }
        };
        // Changes come in bursts (one admission touches several leases and
        // its class): take what has already arrived before showing the queue.
        let quiet = Duration::from_millis(150);
        loop {
            tokio::select! {
                Some(ev) = lease_events.next() => changed |= leases.apply(ev, cluster),
                Some(ev) = class_events.next() => changed |= classes.apply(ev, cluster),
                () = tokio::time::sleep(quiet) => break,
            }
        }
        if !changed || !leases.synced || !classes.synced {
            continue;
        }
        let class_items: Vec<GpuLeaseClass> = classes.items.values().cloned().collect();
        let view = queue_view(
            args,
            &read::Leases {
                items: leases.items.values().cloned().collect(),
                all_visible: first.all_visible,
                namespace: first.namespace.clone(),
            },
            classes_visible.then_some(class_items.as_slice()),
        )?;
        if last.as_ref() == Some(&view) {
            continue;
        }
        let mut text = format_queue(args, &view, true)?;
        if redraw {
            // Home and clear: the queue stays in place on a terminal.
            text = format!("\x1b[H\x1b[2J{text}");
        } else if text_output && last.is_some() {
            text = format!("\n{text}");
        }
        write(out, &text)?;
        last = Some(view);
    }
}

/// A watched collection kept in memory, keyed by `namespace/name`.
struct Mirror<K> {
    items: BTreeMap<String, K>,
    pending: BTreeMap<String, K>,
    synced: bool,
}

impl<K> Default for Mirror<K> {
    fn default() -> Self {
        Mirror {
            items: BTreeMap::new(),
            pending: BTreeMap::new(),
            synced: false,
        }
    }
}

impl<K: kube::Resource> Mirror<K> {
    /// Applies one watch event; true when the collection changed.
    fn apply(&mut self, ev: Result<Event<K>, watcher::Error>, cluster: &Cluster) -> bool {
        let key = |o: &K| {
            let m = o.meta();
            format!(
                "{}/{}",
                m.namespace.as_deref().unwrap_or(""),
                m.name.as_deref().unwrap_or("")
            )
        };
        match ev {
            Ok(Event::Init) => {
                self.pending.clear();
                false
            }
            Ok(Event::InitApply(o)) => {
                self.pending.insert(key(&o), o);
                false
            }
            Ok(Event::InitDone) => {
                self.items = std::mem::take(&mut self.pending);
                self.synced = true;
                true
            }
            Ok(Event::Apply(o)) => {
                self.items.insert(key(&o), o);
                true
            }
            Ok(Event::Delete(o)) => {
                self.items.remove(&key(&o));
                true
            }
            Err(e) => {
                // The watcher retries with backoff; the user should know why
                // the picture may be stale meanwhile.
                eprintln!(
                    "kubectl-gpupool: a watch failed and is retried: {}",
                    watch_error(cluster, e)
                );
                false
            }
        }
    }
}

/// A watch failure in words (kube's own text carries debug output).
fn watch_error(cluster: &Cluster, e: watcher::Error) -> String {
    match e {
        watcher::Error::InitialListFailed(e)
        | watcher::Error::WatchStartFailed(e)
        | watcher::Error::WatchFailed(e) => cluster.api_error("watch", e).to_string(),
        watcher::Error::WatchError(status) => format!("cannot watch: {}", status.message),
        other => other.to_string(),
    }
}

fn to_json<T: serde::Serialize>(v: &T) -> Result<String, Error> {
    let mut s = serde_json::to_string_pretty(v).map_err(|e| Error::Encode {
        format: "json",
        detail: e.to_string(),
    })?;
    s.push('\n');
    Ok(s)
}

fn to_yaml<T: serde::Serialize>(v: &T) -> Result<String, Error> {
    serde_yaml::to_string(v).map_err(|e| Error::Encode {
        format: "yaml",
        detail: e.to_string(),
    })
}

fn write(out: &mut dyn Write, text: &str) -> Result<(), Error> {
    out.write_all(text.as_bytes())
        .and_then(|()| out.flush())
        .map_err(Error::Output)
}
