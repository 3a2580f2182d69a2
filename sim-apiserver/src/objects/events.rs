//! `events.k8s.io/v1` Events are mirrored into `v1` Events (as the real
//! server stores both in one place), so `kubectl describe` and
//! `kubectl get events` show what controllers record through either API.

use serde_json::{Map, Value, json};

use crate::registry::ResourceId;
use crate::store::State;

/// Whether a resource is `events.k8s.io` Events.
pub fn is_new_events(id: &ResourceId) -> bool {
    id.group == "events.k8s.io" && id.plural == "events"
}

/// The `v1` Event equivalent of an `events.k8s.io/v1` Event.
pub fn to_core(ev: &Value) -> Value {
    let mut out = Map::new();
    out.insert("apiVersion".into(), json!("v1"));
    out.insert("kind".into(), json!("Event"));
    out.insert(
        "metadata".into(),
        ev.get("metadata").cloned().unwrap_or(json!({})),
    );
    let copy = |out: &mut Map<String, Value>, from: &str, to: &str| {
        if let Some(v) = ev.get(from).filter(|v| !v.is_null()) {
            out.insert(to.into(), v.clone());
        }
    };
    copy(&mut out, "regarding", "involvedObject");
    copy(&mut out, "note", "message");
    copy(&mut out, "reason", "reason");
    copy(&mut out, "type", "type");
    copy(&mut out, "action", "action");
    copy(&mut out, "related", "related");
    copy(&mut out, "eventTime", "eventTime");
    copy(&mut out, "reportingController", "reportingComponent");
    copy(&mut out, "reportingInstance", "reportingInstance");
    copy(&mut out, "deprecatedFirstTimestamp", "firstTimestamp");
    copy(&mut out, "deprecatedLastTimestamp", "lastTimestamp");
    copy(&mut out, "deprecatedCount", "count");
    if let Some(series) = ev.get("series").filter(|s| s.is_object()) {
        let mut s = Map::new();
        if let Some(c) = series.get("count") {
            s.insert("count".into(), c.clone());
            out.insert("count".into(), c.clone());
        }
        if let Some(t) = series.get("lastObservedTime") {
            s.insert("lastObservedTime".into(), t.clone());
        }
        out.insert("series".into(), Value::Object(s));
    }
    let mut source = Map::new();
    if let Some(c) = ev
        .get("reportingController")
        .or_else(|| ev.pointer("/deprecatedSource/component"))
    {
        source.insert("component".into(), c.clone());
    }
    if let Some(h) = ev.pointer("/deprecatedSource/host") {
        source.insert("host".into(), h.clone());
    }
    out.insert("source".into(), Value::Object(source));
    Value::Object(out)
}

/// Mirrors a stored `events.k8s.io` Event (or its removal) into `v1`.
pub fn mirror(st: &mut State, ns: &str, name: &str, stored: Option<&Value>) {
    let core = ResourceId::new("", "events");
    match stored {
        Some(ev) => {
            st.put(&core, ns, name, to_core(ev));
        }
        None => {
            st.remove(&core, ns, name);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_event_maps_to_core_fields() {
        let ev = json!({
            "metadata": {"name": "e", "namespace": "default"},
            "regarding": {"kind": "Pod", "name": "p"},
            "note": "admitted to node-1",
            "reason": "Admitted",
            "type": "Normal",
            "reportingController": "gpupool.io/operator",
            "series": {"count": 3, "lastObservedTime": "2026-01-01T00:00:00.000000Z"}
        });
        let core = to_core(&ev);
        assert_eq!(core["involvedObject"]["name"], "p");
        assert_eq!(core["message"], "admitted to node-1");
        assert_eq!(core["source"]["component"], "gpupool.io/operator");
        assert_eq!(core["count"], 3);
        assert_eq!(core["kind"], "Event");
    }
}
