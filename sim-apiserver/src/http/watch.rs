//! Watch streams: newline-delimited `{"type","object"}` events, initial
//! state, resumption from a resourceVersion within the retained window
//! (410 Gone otherwise), bookmarks and timeouts.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use http::{HeaderValue, Response, header};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use serde_json::{Value, json};
use tokio::sync::{broadcast, mpsc};

use crate::Shared;
use crate::error::{ApiError, Reason};
use crate::http::request::{Body, Filter, Req, parse_rv};
use crate::http::table;
use crate::registry::ResourceDef;
use crate::store::{EventType, WatchEvent, encode_event};

const BOOKMARK_EVERY: Duration = Duration::from_secs(5);
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(1800);

fn gone(rv: u64, oldest: u64) -> Value {
    ApiError::new(
        Reason::Gone,
        format!("too old resource version: {rv} ({oldest})"),
    )
    .status_body()
}

/// Starts a watch; the response streams until timeout, shutdown, a fault
/// drop, or the client leaving.
pub fn start(
    sh: &Arc<Shared>,
    def: &ResourceDef,
    ns: Option<&str>,
    r: &Req,
    as_table: bool,
) -> Result<Response<Body>, ApiError> {
    let filter = Filter::from_req(def, r)?;
    let rv = parse_rv(r)?;
    let bookmarks = matches!(
        r.query.get("allowWatchBookmarks").map(String::as_str),
        Some("true" | "1")
    );
    let send_initial = matches!(
        r.query.get("sendInitialEvents").map(String::as_str),
        Some("true" | "1")
    );
    if send_initial && !bookmarks {
        return Err(ApiError::invalid(
            "meta.k8s.io",
            "ListOptions",
            "",
            vec![crate::error::FieldCause::forbidden(
                "allowWatchBookmarks",
                "allowWatchBookmarks required when sendInitialEvents is set",
            )],
        ));
    }
    let timeout =
        match r.query.get("timeoutSeconds").filter(|s| !s.is_empty()) {
            Some(s) => Duration::from_secs(s.parse::<u64>().map_err(|_| {
                ApiError::bad_request(format!("timeoutSeconds: invalid value {s:?}"))
            })?),
            None => DEFAULT_TIMEOUT,
        };
    let id = def.id();
    let ns = ns.map(str::to_string);
    let mut initial: Vec<Bytes> = Vec::new();
    let (rx, start_rv) = {
        let mut st = sh.lock();
        let rx = st.subscribe(&id, filter.fields.required("spec.nodeName"));
        let current = st.current_rv();
        let mut first_table = true;
        let mut enc = |etype: &str, obj: &Value| -> Bytes {
            if as_table {
                let b = table_event(
                    def,
                    etype,
                    obj,
                    r.query.get("includeObject").map(String::as_str),
                    first_table,
                );
                first_table = false;
                b
            } else {
                encode_event(etype, obj)
            }
        };
        match rv {
            Some(v) if v != 0 && !send_initial => {
                if v < st.compacted_rv() {
                    initial.push(encode_event("ERROR", &gone(v, st.compacted_rv() + 1)));
                    return Ok(stream_response(
                        sh,
                        initial,
                        None,
                        0,
                        timeout,
                        bookmarks,
                        filter,
                        def.clone(),
                        ns,
                        as_table,
                        r,
                    ));
                }
                if v > current {
                    return Err(ApiError::new(
                        Reason::Timeout,
                        format!("Too large resource version: {v}, current: {current}"),
                    ));
                }
                for ev in st.events_since(v) {
                    if ev.resource != id || ns.as_deref().is_some_and(|n| n != ev.namespace) {
                        continue;
                    }
                    if let Some((etype, obj)) = transition(&ev, &filter) {
                        initial.push(if as_table {
                            enc(etype.as_str(), &obj)
                        } else if etype == ev.etype {
                            ev.encoded()
                        } else {
                            encode_event(etype.as_str(), &obj)
                        });
                    }
                }
            }
            _ => {
                for (_, obj) in st.list(&id, ns.as_deref(), None) {
                    if filter.matches(obj) {
                        initial.push(enc("ADDED", obj));
                    }
                }
                if send_initial {
                    initial.push(encode_event(
                        "BOOKMARK",
                        &bookmark_object(def, current, true),
                    ));
                }
            }
        }
        (rx, current)
    };
    Ok(stream_response(
        sh,
        initial,
        Some(rx),
        start_rv,
        timeout,
        bookmarks,
        filter,
        def.clone(),
        ns,
        as_table,
        r,
    ))
}

/// Most events one chunk of a watch stream carries.
const MAX_BATCH_EVENTS: usize = 256;
/// Size at which a chunk is sent without waiting for more events.
const MAX_BATCH_BYTES: usize = 256 * 1024;

/// Watch lines gathered into one chunk (a lone line is sent as it is,
/// without copying).
#[derive(Default)]
struct Batch {
    first: Option<Bytes>,
    rest: Vec<u8>,
}

impl Batch {
    fn len(&self) -> usize {
        self.first.as_ref().map_or(0, Bytes::len) + self.rest.len()
    }

    fn push(&mut self, line: Bytes) {
        match &self.first {
            None if self.rest.is_empty() => self.first = Some(line),
            _ => {
                if let Some(first) = self.first.take() {
                    self.rest.extend_from_slice(&first);
                }
                self.rest.extend_from_slice(&line);
            }
        }
    }

    fn finish(self) -> Option<Bytes> {
        match self.first {
            Some(b) => Some(b),
            None if self.rest.is_empty() => None,
            None => Some(Bytes::from(self.rest)),
        }
    }
}

fn bookmark_object(def: &ResourceDef, rv: u64, initial_end: bool) -> Value {
    let mut meta = json!({"resourceVersion": rv.to_string()});
    if initial_end {
        meta["annotations"] = json!({"k8s.io/initial-events-end": "true"});
    }
    json!({"kind": def.kind, "apiVersion": def.api_version(), "metadata": meta})
}

fn table_event(
    def: &ResourceDef,
    etype: &str,
    obj: &Value,
    include: Option<&str>,
    with_columns: bool,
) -> Bytes {
    let rv = obj
        .pointer("/metadata/resourceVersion")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    let t = table::render(def, &[Arc::new(obj.clone())], include, &rv, with_columns);
    encode_event(etype, &t)
}

/// How an event looks to a watcher with a selector: an object leaving the
/// selection is DELETED for it, one entering is ADDED.
fn transition(ev: &WatchEvent, filter: &Filter) -> Option<(EventType, Arc<Value>)> {
    let now = filter.matches(&ev.object);
    match ev.etype {
        EventType::Added => now.then(|| (EventType::Added, ev.object.clone())),
        EventType::Deleted => ev
            .old
            .as_ref()
            .is_some_and(|o| filter.matches(o))
            .then(|| (EventType::Deleted, ev.object.clone())),
        EventType::Modified => {
            let before = ev.old.as_ref().is_some_and(|o| filter.matches(o));
            match (before, now) {
                (true, true) => Some((EventType::Modified, ev.object.clone())),
                (false, true) => Some((EventType::Added, ev.object.clone())),
                (true, false) => Some((EventType::Deleted, ev.object.clone())),
                (false, false) => None,
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn stream_response(
    sh: &Arc<Shared>,
    initial: Vec<Bytes>,
    rx: Option<broadcast::Receiver<Arc<WatchEvent>>>,
    start_rv: u64,
    timeout: Duration,
    bookmarks: bool,
    filter: Filter,
    def: ResourceDef,
    ns: Option<String>,
    as_table: bool,
    r: &Req,
) -> Response<Body> {
    let (tx, out_rx) = mpsc::channel::<Bytes>(256);
    let include = r.query.get("includeObject").cloned();
    let sh = sh.clone();
    tokio::spawn(async move {
        for b in initial {
            if tx.send(b).await.is_err() {
                return;
            }
        }
        let Some(mut rx) = rx else { return };
        let id = def.id();
        let mut seen_rv = start_rv;
        let mut drops = sh.faults.drop_signal();
        drops.borrow_and_update();
        let deadline = tokio::time::sleep(timeout);
        tokio::pin!(deadline);
        let mut tick = tokio::time::interval(BOOKMARK_EVERY);
        tick.tick().await;
        loop {
            tokio::select! {
                ev = rx.recv() => {
                    let ev = match ev {
                        Ok(ev) => ev,
                        // Too slow to keep up: end the stream; the client
                        // resumes from its last resourceVersion.
                        Err(broadcast::error::RecvError::Lagged(_)) | Err(broadcast::error::RecvError::Closed) => return,
                    };
                    // Events already committed go out together, in order, as
                    // one chunk: a busy server then writes once per batch to
                    // each watcher instead of once per event.
                    let mut batch = Batch::default();
                    let mut end = false;
                    let mut ev = ev;
                    for taken in 1..=MAX_BATCH_EVENTS {
                        if ev.rv > seen_rv {
                            seen_rv = ev.rv;
                            if ev.resource == id
                                && ns.as_deref().is_none_or(|n| n == ev.namespace)
                                && let Some((etype, obj)) = transition(&ev, &filter)
                            {
                                batch.push(if as_table {
                                    table_event(&def, etype.as_str(), &obj, include.as_deref(), false)
                                } else if etype == ev.etype {
                                    ev.encoded()
                                } else {
                                    encode_event(etype.as_str(), &obj)
                                });
                            }
                        }
                        // Stop before taking an event this batch has no
                        // room for: it stays queued for the next one.
                        if batch.len() >= MAX_BATCH_BYTES || taken == MAX_BATCH_EVENTS {
                            break;
                        }
                        match rx.try_recv() {
                            Ok(next) => ev = next,
                            Err(broadcast::error::TryRecvError::Empty) => break,
                            // What was read still goes out, then the stream
                            // ends as above.
                            Err(_) => {
                                end = true;
                                break;
                            }
                        }
                    }
                    if let Some(chunk) = batch.finish()
                        && tx.send(chunk).await.is_err()
                    {
                        return;
                    }
                    if end {
                        return;
                    }
                }
                _ = tick.tick(), if bookmarks => {
                    if tx.send(encode_event("BOOKMARK", &bookmark_object(&def, seen_rv, false))).await.is_err() {
                        return;
                    }
                }
                _ = tx.closed() => return,
                _ = &mut deadline => {
                    if bookmarks {
                        let _ = tx.send(encode_event("BOOKMARK", &bookmark_object(&def, seen_rv, false))).await;
                    }
                    return;
                }
                _ = drops.changed() => return,
                _ = sh.cancel.cancelled() => return,
            }
        }
    });
    let stream = tokio_stream::wrappers::ReceiverStream::new(out_rx)
        .map(|b| Ok::<_, std::convert::Infallible>(Frame::data(b)));
    let mut resp = Response::new(BodyExt::boxed(StreamBody::new(stream)));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp.headers_mut().insert(
        header::CACHE_CONTROL,
        HeaderValue::from_static("no-cache, private"),
    );
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_keep_lines_in_order_and_pass_a_lone_line_through() {
        assert!(Batch::default().finish().is_none());
        let mut one = Batch::default();
        one.push(Bytes::from_static(b"a\n"));
        assert_eq!(one.len(), 2);
        assert_eq!(one.finish().as_deref(), Some(&b"a\n"[..]));
        let mut many = Batch::default();
        for line in [&b"a\n"[..], b"bb\n", b"c\n"] {
            many.push(Bytes::copy_from_slice(line));
        }
        assert_eq!(many.len(), 7);
        assert_eq!(many.finish().as_deref(), Some(&b"a\nbb\nc\n"[..]));
    }
}
