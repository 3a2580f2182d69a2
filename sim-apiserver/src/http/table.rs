//! `meta.k8s.io/v1` Table rendering for kubectl: pod and node columns, the
//! other built-in kinds' columns (see `printers`), CRD printer columns
//! (simple JSONPath with `[*]`), NAME/AGE otherwise.

use std::sync::Arc;

use serde_json::{Value, json};

use crate::registry::{Printer, PrinterColumn, ResourceDef};
use crate::util::{human_age, meta_str};

fn col(name: &str, type_: &str, format: &str, priority: i64, description: &str) -> Value {
    json!({"name": name, "type": type_, "format": format, "description": description, "priority": priority})
}

fn columns(def: &ResourceDef) -> Vec<Value> {
    let name = col(
        "Name",
        "string",
        "name",
        0,
        "Name must be unique within a namespace.",
    );
    match &def.printer {
        Printer::Pod => vec![
            name,
            col(
                "Ready",
                "string",
                "",
                0,
                "The aggregate readiness state of this pod for accepting traffic.",
            ),
            col(
                "Status",
                "string",
                "",
                0,
                "The aggregate status of the containers in this pod.",
            ),
            col(
                "Restarts",
                "string",
                "",
                0,
                "The number of times the containers in this pod have been restarted.",
            ),
            col("Age", "string", "", 0, "CreationTimestamp of the object."),
            col("IP", "string", "", 1, "IP address allocated to the pod."),
            col(
                "Node",
                "string",
                "",
                1,
                "Name of the node the pod is assigned to.",
            ),
            col(
                "Nominated Node",
                "string",
                "",
                1,
                "Name of the node where the pod is nominated.",
            ),
            col(
                "Readiness Gates",
                "string",
                "",
                1,
                "Readiness gates of the pod.",
            ),
        ],
        Printer::Node => vec![
            name,
            col("Status", "string", "", 0, "The status of the node"),
            col("Roles", "string", "", 0, "The roles of the node"),
            col("Age", "string", "", 0, "CreationTimestamp of the object."),
            col(
                "Version",
                "string",
                "",
                0,
                "Kubelet Version reported by the node.",
            ),
            col("Internal-IP", "string", "", 1, "List of internal IPs."),
            col("External-IP", "string", "", 1, "List of external IPs."),
            col(
                "OS-Image",
                "string",
                "",
                1,
                "OS Image reported by the node.",
            ),
            col(
                "Kernel-Version",
                "string",
                "",
                1,
                "Kernel Version reported by the node.",
            ),
            col(
                "Container-Runtime",
                "string",
                "",
                1,
                "Container Runtime Version reported by the node.",
            ),
        ],
        Printer::Namespace => vec![
            name,
            col("Status", "string", "", 0, "The status of the namespace"),
            col("Age", "string", "", 0, "CreationTimestamp of the object."),
        ],
        Printer::Default => vec![
            name,
            col("Age", "string", "", 0, "CreationTimestamp of the object."),
        ],
        Printer::Builtin(plural) => match super::printers::columns(plural) {
            Some(cs) => cs,
            None => vec![
                name,
                col("Age", "string", "", 0, "CreationTimestamp of the object."),
            ],
        },
        Printer::Columns(cs) => {
            let mut out = vec![name];
            out.extend(
                cs.iter()
                    .map(|c| col(&c.name, &c.type_, &c.format, c.priority, &c.description)),
            );
            out
        }
    }
}

fn age(obj: &Value) -> Value {
    json!(
        meta_str(obj, "creationTimestamp")
            .map(human_age)
            .unwrap_or_else(|| "<unknown>".into())
    )
}

fn pod_cells(obj: &Value) -> Vec<Value> {
    let spec = &obj["spec"];
    let status = &obj["status"];
    let total = spec
        .get("containers")
        .and_then(Value::as_array)
        .map_or(0, Vec::len);
    let statuses = status
        .get("containerStatuses")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let ready = statuses.iter().filter(|c| c["ready"] == true).count();
    let restarts: i64 = statuses
        .iter()
        .filter_map(|c| c.get("restartCount").and_then(Value::as_i64))
        .sum();
    let mut reason = status
        .get("reason")
        .and_then(Value::as_str)
        .or_else(|| status.get("phase").and_then(Value::as_str))
        .unwrap_or("Pending")
        .to_string();
    let gated = status
        .get("conditions")
        .and_then(Value::as_array)
        .is_some_and(|cs| {
            cs.iter()
                .any(|c| c["type"] == "PodScheduled" && c["reason"] == "SchedulingGated")
        });
    if gated && reason == "Pending" {
        reason = "SchedulingGated".into();
    }
    for c in &statuses {
        if let Some(w) = c.pointer("/state/waiting/reason").and_then(Value::as_str) {
            reason = w.to_string();
        } else if let Some(t) = c
            .pointer("/state/terminated/reason")
            .and_then(Value::as_str)
        {
            reason = t.to_string();
        }
    }
    if obj.pointer("/metadata/deletionTimestamp").is_some() {
        reason = "Terminating".into();
    }
    vec![
        json!(meta_str(obj, "name").unwrap_or_default()),
        json!(format!("{ready}/{total}")),
        json!(reason),
        json!(restarts.to_string()),
        age(obj),
        json!(
            status
                .get("podIP")
                .and_then(Value::as_str)
                .unwrap_or("<none>")
        ),
        json!(
            spec.get("nodeName")
                .and_then(Value::as_str)
                .unwrap_or("<none>")
        ),
        json!(
            status
                .get("nominatedNodeName")
                .and_then(Value::as_str)
                .unwrap_or("<none>")
        ),
        json!("<none>"),
    ]
}

fn node_cells(obj: &Value) -> Vec<Value> {
    let ready = obj
        .pointer("/status/conditions")
        .and_then(Value::as_array)
        .and_then(|cs| cs.iter().find(|c| c["type"] == "Ready"))
        .map(|c| c["status"] == "True");
    let mut status = match ready {
        Some(true) => "Ready".to_string(),
        Some(false) => "NotReady".to_string(),
        None => "Unknown".to_string(),
    };
    if obj.pointer("/spec/unschedulable") == Some(&json!(true)) {
        status.push_str(",SchedulingDisabled");
    }
    let mut roles: Vec<String> = obj
        .pointer("/metadata/labels")
        .and_then(Value::as_object)
        .map(|l| {
            l.keys()
                .filter_map(|k| {
                    k.strip_prefix("node-role.kubernetes.io/")
                        .map(str::to_string)
                })
                .collect()
        })
        .unwrap_or_default();
    roles.sort();
    let address = |t: &str| {
        obj.pointer("/status/addresses")
            .and_then(Value::as_array)
            .and_then(|a| a.iter().find(|x| x["type"] == t))
            .and_then(|x| x["address"].as_str())
            .unwrap_or("<none>")
            .to_string()
    };
    let info = |k: &str| {
        obj.pointer(&format!("/status/nodeInfo/{k}"))
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string()
    };
    vec![
        json!(meta_str(obj, "name").unwrap_or_default()),
        json!(status),
        json!(if roles.is_empty() {
            "<none>".into()
        } else {
            roles.join(",")
        }),
        age(obj),
        json!(info("kubeletVersion")),
        json!(address("InternalIP")),
        json!(address("ExternalIP")),
        json!(info("osImage")),
        json!(info("kernelVersion")),
        json!(info("containerRuntimeVersion")),
    ]
}

/// Evaluates a simple JSONPath (`.a.b`, `.a[0].b`, `.a[*].b`) to its results.
pub fn json_path<'a>(obj: &'a Value, path: &str) -> Vec<&'a Value> {
    let path = path
        .trim()
        .trim_start_matches('{')
        .trim_end_matches('}')
        .trim_start_matches('$');
    let mut cur: Vec<&Value> = vec![obj];
    for part in path.split('.').filter(|p| !p.is_empty()) {
        let (field, index) = match part.find('[') {
            Some(i) => (&part[..i], Some(part[i + 1..].trim_end_matches(']'))),
            None => (part, None),
        };
        let mut next = Vec::new();
        for v in cur {
            let v = if field.is_empty() {
                Some(v)
            } else {
                v.get(field)
            };
            let Some(v) = v else { continue };
            match index {
                None => next.push(v),
                Some("*") => next.extend(v.as_array().into_iter().flatten()),
                Some(i) => {
                    if let (Some(arr), Ok(i)) = (v.as_array(), i.parse::<usize>()) {
                        next.extend(arr.get(i));
                    }
                }
            }
        }
        cur = next;
    }
    cur
}

/// One printer-column cell, as the API server's CRD table convertor fills
/// it: from the path's first result only (a path that yields several, such
/// as `.items[*].x`, shows the first), a `string` column printing a number
/// or a boolean as text and an object or a list as compact JSON, a `date`
/// column as an age, and the other types only from a value of that type.
fn column_cell(obj: &Value, c: &PrinterColumn) -> Value {
    let Some(first) = json_path(obj, &c.json_path).into_iter().next() else {
        return Value::Null;
    };
    match (c.type_.as_str(), first) {
        (_, Value::Null) => Value::Null,
        ("date", Value::String(ts)) => json!(human_age(ts)),
        ("string", Value::String(s)) => json!(s),
        ("string", other) => json!(other.to_string()),
        ("integer", Value::Number(n)) => n
            .as_i64()
            .or_else(|| n.as_f64().map(|f| f as i64))
            .map_or(Value::Null, |i| json!(i)),
        ("number", n @ Value::Number(_)) | ("boolean", n @ Value::Bool(_)) => n.clone(),
        _ => Value::Null,
    }
}

fn cells(def: &ResourceDef, obj: &Value) -> Vec<Value> {
    match &def.printer {
        Printer::Pod => pod_cells(obj),
        Printer::Node => node_cells(obj),
        Printer::Namespace => vec![
            json!(meta_str(obj, "name").unwrap_or_default()),
            json!(
                obj.pointer("/status/phase")
                    .and_then(Value::as_str)
                    .unwrap_or("Active")
            ),
            age(obj),
        ],
        Printer::Default => vec![json!(meta_str(obj, "name").unwrap_or_default()), age(obj)],
        Printer::Builtin(plural) => super::printers::cells(plural, obj),
        Printer::Columns(cs) => {
            let mut out = vec![json!(meta_str(obj, "name").unwrap_or_default())];
            out.extend(cs.iter().map(|c| column_cell(obj, c)));
            out
        }
    }
}

/// A Table of the objects. `include` is the `includeObject` parameter
/// (`None`, `Metadata` (default) or `Object`).
pub fn render(
    def: &ResourceDef,
    objs: &[Arc<Value>],
    include: Option<&str>,
    rv: &str,
    with_columns: bool,
) -> Value {
    let rows: Vec<Value> = objs
        .iter()
        .map(|o| {
            let mut row = json!({"cells": cells(def, o)});
            match include.unwrap_or("Metadata") {
                "None" => {}
                "Object" => row["object"] = (**o).clone(),
                _ => {
                    row["object"] = json!({
                        "kind": "PartialObjectMetadata",
                        "apiVersion": "meta.k8s.io/v1",
                        "metadata": o.get("metadata").cloned().unwrap_or(Value::Null),
                    })
                }
            }
            row
        })
        .collect();
    json!({
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": {"resourceVersion": rv},
        "columnDefinitions": if with_columns { json!(columns(def)) } else { Value::Null },
        "rows": rows,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_path_handles_wildcards_and_indices() {
        let o = json!({"status": {"gpus": [{"index": 0}, {"index": 3}]}});
        let r = json_path(&o, ".status.gpus[*].index");
        assert_eq!(r, vec![&json!(0), &json!(3)]);
        assert_eq!(json_path(&o, ".status.gpus[1].index"), vec![&json!(3)]);
        assert!(json_path(&o, ".status.missing").is_empty());
        let c = PrinterColumn {
            name: "GPU".into(),
            type_: "string".into(),
            format: String::new(),
            description: String::new(),
            priority: 0,
            json_path: ".status.gpus[*].index".into(),
        };
        assert_eq!(
            column_cell(&o, &c),
            json!("0"),
            "the first result only, as the real API server shows it"
        );
        let column = |type_: &str, json_path: &str| PrinterColumn {
            type_: type_.into(),
            json_path: json_path.into(),
            ..c.clone()
        };
        let o = json!({"status": {"n": 2.0, "ok": true, "s": "x", "list": [1, 2], "none": null}});
        assert_eq!(column_cell(&o, &column("integer", ".status.n")), json!(2));
        assert_eq!(
            column_cell(&o, &column("integer", ".status.s")),
            Value::Null
        );
        assert_eq!(
            column_cell(&o, &column("boolean", ".status.ok")),
            json!(true)
        );
        assert_eq!(
            column_cell(&o, &column("string", ".status.ok")),
            json!("true")
        );
        assert_eq!(
            column_cell(&o, &column("string", ".status.list")),
            json!("[1,2]")
        );
        assert_eq!(
            column_cell(&o, &column("string", ".status.none")),
            Value::Null
        );
        assert_eq!(
            column_cell(&o, &column("string", ".status.missing")),
            Value::Null
        );
    }

    #[test]
    fn gated_pod_shows_scheduling_gated() {
        let pod = json!({"metadata": {"name": "p"}, "spec": {"containers": [{}]}, "status": {"phase": "Pending",
            "conditions": [{"type": "PodScheduled", "reason": "SchedulingGated"}]}});
        let c = pod_cells(&pod);
        assert_eq!(c[1], "0/1");
        assert_eq!(c[2], "SchedulingGated");
    }
}
