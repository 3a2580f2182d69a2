//! The Table columns the real API server prints for built-in kinds other
//! than pods, nodes and namespaces: the same headers, priorities (wide
//! columns at 1) and cell formats as its printers, computed from the
//! stored objects.

use serde_json::{Value, json};

use crate::util::{human_age, meta_str};

/// One column: header, type, format and priority (1: `-o wide` only).
type Col = (&'static str, &'static str, &'static str, i64);

const NAME: Col = ("Name", "string", "name", 0);
const AGE: Col = ("Age", "string", "", 0);
const CREATED_AT: Col = ("Created At", "date", "", 0);
const CONTAINERS: Col = ("Containers", "string", "", 1);
const IMAGES: Col = ("Images", "string", "", 1);
const SELECTOR: Col = ("Selector", "string", "", 1);

fn cols(plural: &str) -> Option<Vec<Col>> {
    let int = |name| (name, "integer", "", 0);
    let s = |name| (name, "string", "", 0);
    let wide = |name| (name, "string", "", 1);
    Some(match plural {
        "services" => vec![
            NAME,
            s("Type"),
            s("Cluster-IP"),
            s("External-IP"),
            s("Port(s)"),
            AGE,
            SELECTOR,
        ],
        "deployments" => vec![
            NAME,
            s("Ready"),
            int("Up-to-date"),
            int("Available"),
            AGE,
            CONTAINERS,
            IMAGES,
            SELECTOR,
        ],
        "replicasets" => vec![
            NAME,
            int("Desired"),
            int("Current"),
            int("Ready"),
            AGE,
            CONTAINERS,
            IMAGES,
            SELECTOR,
        ],
        "daemonsets" => vec![
            NAME,
            int("Desired"),
            int("Current"),
            int("Ready"),
            int("Up-to-date"),
            int("Available"),
            s("Node Selector"),
            AGE,
            CONTAINERS,
            IMAGES,
            SELECTOR,
        ],
        "statefulsets" => vec![NAME, s("Ready"), AGE, CONTAINERS, IMAGES],
        "configmaps" => vec![NAME, int("Data"), AGE],
        "secrets" => vec![NAME, s("Type"), int("Data"), AGE],
        "endpoints" => vec![NAME, s("Endpoints"), AGE],
        "events" => vec![
            s("Last Seen"),
            s("Type"),
            s("Reason"),
            s("Object"),
            wide("Subobject"),
            wide("Source"),
            s("Message"),
            wide("First Seen"),
            ("Count", "string", "", 1),
            ("Name", "string", "name", 1),
        ],
        "leases" => vec![NAME, s("Holder"), AGE],
        "poddisruptionbudgets" => vec![
            NAME,
            s("Min Available"),
            s("Max Unavailable"),
            int("Allowed Disruptions"),
            AGE,
        ],
        "customresourcedefinitions" | "roles" | "clusterroles" => vec![NAME, CREATED_AT],
        "mutatingwebhookconfigurations" | "validatingwebhookconfigurations" => {
            vec![NAME, int("Webhooks"), AGE]
        }
        "validatingadmissionpolicies" => vec![NAME, int("Validations"), s("ParamKind"), AGE],
        "validatingadmissionpolicybindings" => {
            vec![NAME, s("PolicyName"), s("ParamRef"), AGE]
        }
        "networkpolicies" => vec![NAME, s("Pod-Selector"), AGE],
        "rolebindings" | "clusterrolebindings" => vec![
            NAME,
            s("Role"),
            AGE,
            wide("Users"),
            wide("Groups"),
            wide("ServiceAccounts"),
        ],
        _ => return None,
    })
}

/// The column definitions of a built-in kind's table, if it has its own.
pub fn columns(plural: &str) -> Option<Vec<Value>> {
    cols(plural).map(|cs| {
        cs.into_iter()
            .map(|(name, type_, format, priority)| {
                json!({"name": name, "type": type_, "format": format, "description": "", "priority": priority})
            })
            .collect()
    })
}

fn at<'a>(obj: &'a Value, pointer: &str) -> Option<&'a Value> {
    obj.pointer(pointer).filter(|v| !v.is_null())
}

fn int(obj: &Value, pointer: &str) -> Value {
    json!(at(obj, pointer).and_then(Value::as_i64).unwrap_or(0))
}

fn text(obj: &Value, pointer: &str) -> String {
    match at(obj, pointer) {
        Some(Value::String(s)) => s.clone(),
        Some(other) => other.to_string(),
        None => String::new(),
    }
}

fn or_none(s: String) -> String {
    if s.is_empty() { "<none>".into() } else { s }
}

fn len(obj: &Value, pointer: &str) -> usize {
    match at(obj, pointer) {
        Some(Value::Array(a)) => a.len(),
        Some(Value::Object(m)) => m.len(),
        _ => 0,
    }
}

fn age_of(obj: &Value) -> Value {
    json!(
        meta_str(obj, "creationTimestamp")
            .map(human_age)
            .unwrap_or_else(|| "<unknown>".into())
    )
}

/// `k=v` pairs sorted by key, joined by commas.
fn labels(map: Option<&Value>) -> String {
    let mut pairs: Vec<String> = map
        .and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or_default()))
                .collect()
        })
        .unwrap_or_default();
    pairs.sort();
    pairs.join(",")
}

/// A label selector as the real server prints it: requirements sorted by
/// key, `<none>` when it selects by nothing.
fn selector(sel: Option<&Value>) -> String {
    let Some(sel) = sel.filter(|s| s.is_object()) else {
        return "<none>".into();
    };
    let mut reqs: Vec<(String, String)> = sel
        .get("matchLabels")
        .and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .map(|(k, v)| (k.clone(), format!("{k}={}", v.as_str().unwrap_or_default())))
                .collect()
        })
        .unwrap_or_default();
    for e in sel
        .get("matchExpressions")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let key = e["key"].as_str().unwrap_or_default().to_string();
        let mut values: Vec<&str> = e["values"]
            .as_array()
            .map(|vs| vs.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        values.sort_unstable();
        let r = match e["operator"].as_str().unwrap_or_default() {
            "In" => format!("{key} in ({})", values.join(",")),
            "NotIn" => format!("{key} notin ({})", values.join(",")),
            "Exists" => key.clone(),
            "DoesNotExist" => format!("!{key}"),
            other => format!("{key} {other}"),
        };
        reqs.push((key, r));
    }
    reqs.sort();
    or_none(
        reqs.into_iter()
            .map(|(_, r)| r)
            .collect::<Vec<_>>()
            .join(","),
    )
}

fn containers(obj: &Value, field: &str) -> String {
    at(obj, "/spec/template/spec/containers")
        .and_then(Value::as_array)
        .map(|cs| {
            cs.iter()
                .map(|c| c[field].as_str().unwrap_or_default())
                .collect::<Vec<_>>()
                .join(",")
        })
        .unwrap_or_default()
}

fn service_external_ip(obj: &Value) -> String {
    let external: Vec<&str> = at(obj, "/spec/externalIPs")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    match text(obj, "/spec/type").as_str() {
        "ExternalName" => text(obj, "/spec/externalName"),
        "LoadBalancer" => {
            let mut ips: Vec<String> = at(obj, "/status/loadBalancer/ingress")
                .and_then(Value::as_array)
                .map(|a| {
                    a.iter()
                        .filter_map(|i| i["ip"].as_str().or_else(|| i["hostname"].as_str()))
                        .map(str::to_string)
                        .collect()
                })
                .unwrap_or_default();
            ips.extend(external.iter().map(|s| s.to_string()));
            if ips.is_empty() {
                "<pending>".into()
            } else {
                ips.join(",")
            }
        }
        _ => or_none(external.join(",")),
    }
}

fn service_ports(obj: &Value) -> String {
    let ports: Vec<String> = at(obj, "/spec/ports")
        .and_then(Value::as_array)
        .map(|ps| {
            ps.iter()
                .map(|p| {
                    let proto = p["protocol"].as_str().unwrap_or("TCP");
                    match p.get("nodePort").and_then(Value::as_i64) {
                        Some(np) if np != 0 => format!("{}:{np}/{proto}", p["port"]),
                        _ => format!("{}/{proto}", p["port"]),
                    }
                })
                .collect()
        })
        .unwrap_or_default();
    or_none(ports.join(","))
}

fn endpoints(obj: &Value) -> String {
    let mut out = Vec::new();
    for subset in at(obj, "/subsets")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let ports: Vec<i64> = subset["ports"]
            .as_array()
            .map(|ps| ps.iter().filter_map(|p| p["port"].as_i64()).collect())
            .unwrap_or_default();
        for addr in subset["addresses"].as_array().into_iter().flatten() {
            let ip = addr["ip"].as_str().unwrap_or_default();
            if ports.is_empty() {
                out.push(ip.to_string());
            }
            for p in &ports {
                out.push(format!("{ip}:{p}"));
            }
        }
    }
    or_none(out.join(","))
}

/// An event's cells for core/v1 and events.k8s.io/v1 alike.
fn event_cells(obj: &Value) -> Vec<Value> {
    let since = |ts: String| {
        if ts.is_empty() {
            "<unknown>".to_string()
        } else {
            human_age(&ts)
        }
    };
    let first_ts = ["/firstTimestamp", "/deprecatedFirstTimestamp", "/eventTime"]
        .iter()
        .map(|p| text(obj, p))
        .find(|t| !t.is_empty())
        .unwrap_or_default();
    let first = since(first_ts.clone());
    let last_ts = ["/lastTimestamp", "/deprecatedLastTimestamp"]
        .iter()
        .map(|p| text(obj, p))
        .find(|t| !t.is_empty());
    let mut last = last_ts.map(since).unwrap_or_else(|| first.clone());
    let mut count = ["/count", "/deprecatedCount"]
        .iter()
        .find_map(|p| at(obj, p).and_then(Value::as_i64))
        .unwrap_or(0);
    if let Some(series) = at(obj, "/series") {
        last = since(text(series, "/lastObservedTime"));
        count = series["count"].as_i64().unwrap_or(count);
    } else if count == 0 {
        count = 1;
    }
    let involved = at(obj, "/involvedObject")
        .or_else(|| at(obj, "/regarding"))
        .cloned()
        .unwrap_or(Value::Null);
    let kind = involved["kind"].as_str().unwrap_or_default().to_lowercase();
    let target = match involved["name"].as_str() {
        Some(n) if !n.is_empty() => format!("{kind}/{n}"),
        _ => kind,
    };
    let component = [
        "/source/component",
        "/deprecatedSource/component",
        "/reportingController",
    ]
    .iter()
    .map(|p| text(obj, p))
    .find(|t| !t.is_empty())
    .unwrap_or_default();
    let host = [
        "/source/host",
        "/deprecatedSource/host",
        "/reportingInstance",
    ]
    .iter()
    .map(|p| text(obj, p))
    .find(|t| !t.is_empty())
    .unwrap_or_default();
    let source = if host.is_empty() {
        component
    } else {
        format!("{component}, {host}")
    };
    let message = ["/message", "/note"]
        .iter()
        .map(|p| text(obj, p))
        .find(|t| !t.is_empty())
        .unwrap_or_default();
    vec![
        json!(last),
        json!(text(obj, "/type")),
        json!(text(obj, "/reason")),
        json!(target),
        json!(involved["fieldPath"].as_str().unwrap_or_default()),
        json!(source),
        json!(message.trim()),
        json!(first),
        json!(count.to_string()),
        json!(meta_str(obj, "name").unwrap_or_default()),
    ]
}

fn binding_cells(obj: &Value) -> Vec<Value> {
    let subjects: Vec<&Value> = at(obj, "/subjects")
        .and_then(Value::as_array)
        .map(|a| a.iter().collect())
        .unwrap_or_default();
    let of = |kind: &str| {
        subjects
            .iter()
            .filter(|s| s["kind"] == kind)
            .map(|s| {
                let name = s["name"].as_str().unwrap_or_default();
                match s["namespace"].as_str() {
                    Some(ns) if kind == "ServiceAccount" => format!("{ns}:{name}"),
                    _ => name.to_string(),
                }
            })
            .collect::<Vec<_>>()
            .join(", ")
    };
    vec![
        json!(format!(
            "{}/{}",
            text(obj, "/roleRef/kind"),
            text(obj, "/roleRef/name")
        )),
        age_of(obj),
        json!(of("User")),
        json!(of("Group")),
        json!(of("ServiceAccount")),
    ]
}

/// The cells of one object's row, the name first where the kind has a
/// name column.
pub fn cells(plural: &str, obj: &Value) -> Vec<Value> {
    let name = json!(meta_str(obj, "name").unwrap_or_default());
    let age = age_of(obj);
    let rest: Vec<Value> = match plural {
        "events" => return event_cells(obj),
        "services" => vec![
            json!(text(obj, "/spec/type")),
            json!(or_none(text(obj, "/spec/clusterIP"))),
            json!(service_external_ip(obj)),
            json!(service_ports(obj)),
            age,
            json!(or_none(labels(at(obj, "/spec/selector")))),
        ],
        "deployments" => vec![
            json!(format!(
                "{}/{}",
                int(obj, "/status/readyReplicas"),
                at(obj, "/spec/replicas")
                    .and_then(Value::as_i64)
                    .unwrap_or(1)
            )),
            int(obj, "/status/updatedReplicas"),
            int(obj, "/status/availableReplicas"),
            age,
            json!(containers(obj, "name")),
            json!(containers(obj, "image")),
            json!(selector(at(obj, "/spec/selector"))),
        ],
        "replicasets" => vec![
            json!(
                at(obj, "/spec/replicas")
                    .and_then(Value::as_i64)
                    .unwrap_or(1)
            ),
            int(obj, "/status/replicas"),
            int(obj, "/status/readyReplicas"),
            age,
            json!(containers(obj, "name")),
            json!(containers(obj, "image")),
            json!(selector(at(obj, "/spec/selector"))),
        ],
        "daemonsets" => vec![
            int(obj, "/status/desiredNumberScheduled"),
            int(obj, "/status/currentNumberScheduled"),
            int(obj, "/status/numberReady"),
            int(obj, "/status/updatedNumberScheduled"),
            int(obj, "/status/numberAvailable"),
            json!(or_none(labels(at(obj, "/spec/template/spec/nodeSelector")))),
            age,
            json!(containers(obj, "name")),
            json!(containers(obj, "image")),
            json!(selector(at(obj, "/spec/selector"))),
        ],
        "statefulsets" => vec![
            json!(format!(
                "{}/{}",
                int(obj, "/status/readyReplicas"),
                at(obj, "/spec/replicas")
                    .and_then(Value::as_i64)
                    .unwrap_or(1)
            )),
            age,
            json!(containers(obj, "name")),
            json!(containers(obj, "image")),
        ],
        "configmaps" => vec![json!(len(obj, "/data") + len(obj, "/binaryData")), age],
        "secrets" => vec![json!(text(obj, "/type")), json!(len(obj, "/data")), age],
        "endpoints" => vec![json!(endpoints(obj)), age],
        "leases" => vec![json!(text(obj, "/spec/holderIdentity")), age],
        "poddisruptionbudgets" => {
            let or_na = |p: &str| {
                let t = text(obj, p);
                if t.is_empty() { "N/A".to_string() } else { t }
            };
            vec![
                json!(or_na("/spec/minAvailable")),
                json!(or_na("/spec/maxUnavailable")),
                int(obj, "/status/disruptionsAllowed"),
                age,
            ]
        }
        "customresourcedefinitions" | "roles" | "clusterroles" => {
            vec![json!(
                meta_str(obj, "creationTimestamp").unwrap_or_default()
            )]
        }
        "mutatingwebhookconfigurations" | "validatingwebhookconfigurations" => {
            vec![json!(len(obj, "/webhooks")), age]
        }
        "validatingadmissionpolicies" => {
            let param = match at(obj, "/spec/paramKind") {
                Some(p) => format!(
                    "{}/{}",
                    p["apiVersion"].as_str().unwrap_or_default(),
                    p["kind"].as_str().unwrap_or_default()
                ),
                None => "<unset>".into(),
            };
            vec![json!(len(obj, "/spec/validations")), json!(param), age]
        }
        "validatingadmissionpolicybindings" => {
            let param = match at(obj, "/spec/paramRef") {
                Some(p) => {
                    let ns = p["namespace"].as_str().unwrap_or_default();
                    let target = p["name"]
                        .as_str()
                        .map(str::to_string)
                        .or_else(|| p.get("selector").map(|s| selector(Some(s))))
                        .unwrap_or_else(|| "*".into());
                    if ns.is_empty() {
                        format!("*/{target}")
                    } else {
                        format!("{ns}/{target}")
                    }
                }
                None => "<unset>".into(),
            };
            vec![json!(text(obj, "/spec/policyName")), json!(param), age]
        }
        "networkpolicies" => vec![json!(selector(at(obj, "/spec/podSelector"))), age],
        "rolebindings" | "clusterrolebindings" => binding_cells(obj),
        _ => vec![age],
    };
    let mut out = Vec::with_capacity(rest.len() + 1);
    out.push(name);
    out.extend(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_with_columns_fills_each_column() {
        for plural in [
            "services",
            "deployments",
            "replicasets",
            "daemonsets",
            "statefulsets",
            "configmaps",
            "secrets",
            "endpoints",
            "events",
            "leases",
            "poddisruptionbudgets",
            "customresourcedefinitions",
            "roles",
            "clusterroles",
            "mutatingwebhookconfigurations",
            "validatingwebhookconfigurations",
            "validatingadmissionpolicies",
            "validatingadmissionpolicybindings",
            "networkpolicies",
            "rolebindings",
            "clusterrolebindings",
        ] {
            let n = columns(plural).expect("columns").len();
            assert_eq!(cells(plural, &json!({})).len(), n, "{plural}");
        }
        // The real server prints NAME and AGE for these.
        assert!(columns("serviceaccounts").is_none());
        assert_eq!(cells("serviceaccounts", &json!({})).len(), 2);
    }

    #[test]
    fn services_print_type_ips_and_ports() {
        let svc = json!({"metadata": {"name": "web"}, "spec": {"type": "NodePort", "clusterIP": "10.0.0.7",
            "ports": [{"port": 80, "nodePort": 30080, "protocol": "TCP"}, {"port": 53, "protocol": "UDP"}],
            "selector": {"b": "2", "a": "1"}}});
        let c = cells("services", &svc);
        assert_eq!(c[1], "NodePort");
        assert_eq!(c[2], "10.0.0.7");
        assert_eq!(c[3], "<none>");
        assert_eq!(c[4], "80:30080/TCP,53/UDP");
        assert_eq!(c[6], "a=1,b=2");
        let lb = json!({"spec": {"type": "LoadBalancer"}});
        assert_eq!(cells("services", &lb)[3], "<pending>");
    }

    #[test]
    fn workloads_events_and_bindings() {
        let d = json!({"metadata": {"name": "web"}, "spec": {"replicas": 2,
            "selector": {"matchLabels": {"app": "web"}, "matchExpressions": [{"key": "tier", "operator": "In", "values": ["b", "a"]}]},
            "template": {"spec": {"containers": [{"name": "c", "image": "nginx:1"}, {"name": "s", "image": "x"}]}}},
            "status": {"readyReplicas": 1, "updatedReplicas": 2}});
        let c = cells("deployments", &d);
        assert_eq!(c[1], "1/2");
        assert_eq!(c[2], 2);
        assert_eq!(c[3], 0);
        assert_eq!(c[5], "c,s");
        assert_eq!(c[6], "nginx:1,x");
        assert_eq!(c[7], "app=web,tier in (a,b)");
        let ev = json!({"metadata": {"name": "e"}, "type": "Normal", "reason": "Started",
            "involvedObject": {"kind": "Pod", "name": "p"}, "message": " hi ", "source": {"component": "kubelet", "host": "n1"}});
        let c = cells("events", &ev);
        assert_eq!(c[3], "pod/p");
        assert_eq!(c[5], "kubelet, n1");
        assert_eq!(c[6], "hi");
        assert_eq!(c[8], "1");
        let rb = json!({"metadata": {"name": "rb"}, "roleRef": {"kind": "Role", "name": "reader"},
            "subjects": [{"kind": "ServiceAccount", "name": "robot", "namespace": "diff"}, {"kind": "User", "name": "alice"}]});
        let c = cells("rolebindings", &rb);
        assert_eq!(c[1], "Role/reader");
        assert_eq!(c[3], "alice");
        assert_eq!(c[5], "diff:robot");
        assert_eq!(
            cells(
                "configmaps",
                &json!({"data": {"a": "1"}, "binaryData": {"b": ""}})
            )[1],
            2
        );
    }
}
