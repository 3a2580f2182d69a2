//! Protobuf decoding of the built-in kinds `kubectl create <kind>` and
//! `kubectl run` send in the protobuf encoding (namespace, serviceaccount,
//! deployment, role, clusterrole, rolebinding, clusterrolebinding, service,
//! pod), driven by
//! tables of each message's fields as upstream's `generated.proto` numbers
//! them.
//!
//! A field a table does not list is refused, naming the message and the
//! field number, rather than dropped: silently losing part of an object
//! would be worse than asking the client for JSON.

use serde_json::{Map, Value, json};

use super::protobuf::{Wire, bytes, fields, int, map_entry, object_meta, string, utf8};

/// How one field is rendered in JSON. Go's protobuf encoder writes every
/// non-pointer field, zero values included, while its JSON encoder leaves
/// the zero values of `omitempty` fields out; the variants that end in `Z`
/// (and every string) leave zeros out, so the JSON matches what a client
/// sending JSON would have sent.
#[derive(Clone, Copy)]
enum F {
    /// A string; empty ones are left out.
    Str(&'static str),
    /// An integer (int32/int64) that is a pointer in Go: kept even when 0.
    Int(&'static str),
    /// A non-pointer integer: left out when 0.
    IntZ(&'static str),
    /// A bool that is a pointer in Go: kept even when false.
    Bool(&'static str),
    /// A non-pointer bool: left out when false.
    BoolZ(&'static str),
    /// Read and dropped: a status the server ignores on create anyway.
    Skip,
    /// A repeated string.
    Strs(&'static str),
    /// A `map<string, string>`.
    StrMap(&'static str),
    /// A `map<string, Quantity>`.
    Quantities(&'static str),
    /// `ObjectMeta`.
    Meta(&'static str),
    /// An `IntOrString`.
    IntOrStr(&'static str),
    /// A nested message.
    Msg(&'static str, &'static Message),
    /// A repeated nested message.
    Msgs(&'static str, &'static Message),
}

/// A message: its name (for errors) and its fields by number.
pub struct Message {
    name: &'static str,
    fields: &'static [(u64, F)],
}

const LABEL_SELECTOR_REQUIREMENT: Message = Message {
    name: "LabelSelectorRequirement",
    fields: &[
        (1, F::Str("key")),
        (2, F::Str("operator")),
        (3, F::Strs("values")),
    ],
};
const LABEL_SELECTOR: Message = Message {
    name: "LabelSelector",
    fields: &[
        (1, F::StrMap("matchLabels")),
        (2, F::Msgs("matchExpressions", &LABEL_SELECTOR_REQUIREMENT)),
    ],
};
const NAMESPACE_SPEC: Message = Message {
    name: "NamespaceSpec",
    fields: &[(1, F::Strs("finalizers"))],
};
const NAMESPACE: Message = Message {
    name: "Namespace",
    fields: &[
        (1, F::Meta("metadata")),
        (2, F::Msg("spec", &NAMESPACE_SPEC)),
        (3, F::Skip),
    ],
};
const OBJECT_REFERENCE: Message = Message {
    name: "ObjectReference",
    fields: &[
        (1, F::Str("kind")),
        (2, F::Str("namespace")),
        (3, F::Str("name")),
        (4, F::Str("uid")),
        (5, F::Str("apiVersion")),
        (6, F::Str("resourceVersion")),
        (7, F::Str("fieldPath")),
    ],
};
const LOCAL_OBJECT_REFERENCE: Message = Message {
    name: "LocalObjectReference",
    fields: &[(1, F::Str("name"))],
};
const SERVICE_ACCOUNT: Message = Message {
    name: "ServiceAccount",
    fields: &[
        (1, F::Meta("metadata")),
        (2, F::Msgs("secrets", &OBJECT_REFERENCE)),
        (3, F::Msgs("imagePullSecrets", &LOCAL_OBJECT_REFERENCE)),
        (4, F::Bool("automountServiceAccountToken")),
    ],
};
const POLICY_RULE: Message = Message {
    name: "PolicyRule",
    fields: &[
        (1, F::Strs("verbs")),
        (2, F::Strs("apiGroups")),
        (3, F::Strs("resources")),
        (4, F::Strs("resourceNames")),
        (5, F::Strs("nonResourceURLs")),
    ],
};
const AGGREGATION_RULE: Message = Message {
    name: "AggregationRule",
    fields: &[(1, F::Msgs("clusterRoleSelectors", &LABEL_SELECTOR))],
};
const ROLE: Message = Message {
    name: "Role",
    fields: &[
        (1, F::Meta("metadata")),
        (2, F::Msgs("rules", &POLICY_RULE)),
    ],
};
const CLUSTER_ROLE: Message = Message {
    name: "ClusterRole",
    fields: &[
        (1, F::Meta("metadata")),
        (2, F::Msgs("rules", &POLICY_RULE)),
        (3, F::Msg("aggregationRule", &AGGREGATION_RULE)),
    ],
};
const SUBJECT: Message = Message {
    name: "Subject",
    fields: &[
        (1, F::Str("kind")),
        (2, F::Str("apiGroup")),
        (3, F::Str("name")),
        (4, F::Str("namespace")),
    ],
};
const ROLE_REF: Message = Message {
    name: "RoleRef",
    fields: &[
        (1, F::Str("apiGroup")),
        (2, F::Str("kind")),
        (3, F::Str("name")),
    ],
};
const ROLE_BINDING: Message = Message {
    name: "RoleBinding",
    fields: &[
        (1, F::Meta("metadata")),
        (2, F::Msgs("subjects", &SUBJECT)),
        (3, F::Msg("roleRef", &ROLE_REF)),
    ],
};
const SERVICE_PORT: Message = Message {
    name: "ServicePort",
    fields: &[
        (1, F::Str("name")),
        (2, F::Str("protocol")),
        (3, F::Int("port")),
        (4, F::IntOrStr("targetPort")),
        (5, F::IntZ("nodePort")),
        (6, F::Str("appProtocol")),
    ],
};
const SERVICE_SPEC: Message = Message {
    name: "ServiceSpec",
    fields: &[
        (1, F::Msgs("ports", &SERVICE_PORT)),
        (2, F::StrMap("selector")),
        (3, F::Str("clusterIP")),
        (4, F::Str("type")),
        (5, F::Strs("externalIPs")),
        (7, F::Str("sessionAffinity")),
        (8, F::Str("loadBalancerIP")),
        (9, F::Strs("loadBalancerSourceRanges")),
        (10, F::Str("externalName")),
        (11, F::Str("externalTrafficPolicy")),
        (12, F::IntZ("healthCheckNodePort")),
        (13, F::BoolZ("publishNotReadyAddresses")),
        (17, F::Str("ipFamilyPolicy")),
        (18, F::Strs("clusterIPs")),
        (19, F::Strs("ipFamilies")),
        (20, F::Bool("allocateLoadBalancerNodePorts")),
        (21, F::Str("loadBalancerClass")),
        (22, F::Str("internalTrafficPolicy")),
    ],
};
const SERVICE: Message = Message {
    name: "Service",
    fields: &[
        (1, F::Meta("metadata")),
        (2, F::Msg("spec", &SERVICE_SPEC)),
        (3, F::Skip),
    ],
};
const CONTAINER_PORT: Message = Message {
    name: "ContainerPort",
    fields: &[
        (1, F::Str("name")),
        (2, F::IntZ("hostPort")),
        (3, F::Int("containerPort")),
        (4, F::Str("protocol")),
        (5, F::Str("hostIP")),
    ],
};
const ENV_VAR: Message = Message {
    name: "EnvVar",
    fields: &[(1, F::Str("name")), (2, F::Str("value"))],
};
const RESOURCE_REQUIREMENTS: Message = Message {
    name: "ResourceRequirements",
    fields: &[(1, F::Quantities("limits")), (2, F::Quantities("requests"))],
};
const CONTAINER: Message = Message {
    name: "Container",
    fields: &[
        (1, F::Str("name")),
        (2, F::Str("image")),
        (3, F::Strs("command")),
        (4, F::Strs("args")),
        (5, F::Str("workingDir")),
        (6, F::Msgs("ports", &CONTAINER_PORT)),
        (7, F::Msgs("env", &ENV_VAR)),
        (8, F::Msg("resources", &RESOURCE_REQUIREMENTS)),
        (13, F::Str("terminationMessagePath")),
        (14, F::Str("imagePullPolicy")),
        (16, F::BoolZ("stdin")),
        (17, F::BoolZ("stdinOnce")),
        (18, F::BoolZ("tty")),
        (20, F::Str("terminationMessagePolicy")),
        (24, F::Str("restartPolicy")),
    ],
};
const POD_SPEC: Message = Message {
    name: "PodSpec",
    fields: &[
        (2, F::Msgs("containers", &CONTAINER)),
        (3, F::Str("restartPolicy")),
        (4, F::Int("terminationGracePeriodSeconds")),
        (5, F::Int("activeDeadlineSeconds")),
        (6, F::Str("dnsPolicy")),
        (7, F::StrMap("nodeSelector")),
        (8, F::Str("serviceAccountName")),
        (9, F::Str("serviceAccount")),
        (10, F::Str("nodeName")),
        (11, F::BoolZ("hostNetwork")),
        (12, F::BoolZ("hostPID")),
        (13, F::BoolZ("hostIPC")),
        (15, F::Msgs("imagePullSecrets", &LOCAL_OBJECT_REFERENCE)),
        (16, F::Str("hostname")),
        (17, F::Str("subdomain")),
        (19, F::Str("schedulerName")),
        (20, F::Msgs("initContainers", &CONTAINER)),
        (21, F::Bool("automountServiceAccountToken")),
        (24, F::Str("priorityClassName")),
        (29, F::Str("runtimeClassName")),
        (31, F::Str("preemptionPolicy")),
    ],
};
const POD_TEMPLATE_SPEC: Message = Message {
    name: "PodTemplateSpec",
    fields: &[(1, F::Meta("metadata")), (2, F::Msg("spec", &POD_SPEC))],
};
const POD: Message = Message {
    name: "Pod",
    fields: &[
        (1, F::Meta("metadata")),
        (2, F::Msg("spec", &POD_SPEC)),
        (3, F::Skip),
    ],
};
const DEPLOYMENT_STRATEGY: Message = Message {
    name: "DeploymentStrategy",
    fields: &[(1, F::Str("type"))],
};
const DEPLOYMENT_SPEC: Message = Message {
    name: "DeploymentSpec",
    fields: &[
        (1, F::Int("replicas")),
        (2, F::Msg("selector", &LABEL_SELECTOR)),
        (3, F::Msg("template", &POD_TEMPLATE_SPEC)),
        (4, F::Msg("strategy", &DEPLOYMENT_STRATEGY)),
        (5, F::IntZ("minReadySeconds")),
        (6, F::Int("revisionHistoryLimit")),
        (7, F::BoolZ("paused")),
        (9, F::Int("progressDeadlineSeconds")),
    ],
};
const DEPLOYMENT: Message = Message {
    name: "Deployment",
    fields: &[
        (1, F::Meta("metadata")),
        (2, F::Msg("spec", &DEPLOYMENT_SPEC)),
        (3, F::Skip),
    ],
};

const RESOURCE_ATTRIBUTES: Message = Message {
    name: "ResourceAttributes",
    fields: &[
        (1, F::Str("namespace")),
        (2, F::Str("verb")),
        (3, F::Str("group")),
        (4, F::Str("version")),
        (5, F::Str("resource")),
        (6, F::Str("subresource")),
        (7, F::Str("name")),
    ],
};
const NON_RESOURCE_ATTRIBUTES: Message = Message {
    name: "NonResourceAttributes",
    fields: &[(1, F::Str("path")), (2, F::Str("verb"))],
};
const SELF_SUBJECT_ACCESS_REVIEW_SPEC: Message = Message {
    name: "SelfSubjectAccessReviewSpec",
    fields: &[
        (1, F::Msg("resourceAttributes", &RESOURCE_ATTRIBUTES)),
        (2, F::Msg("nonResourceAttributes", &NON_RESOURCE_ATTRIBUTES)),
    ],
};
const SELF_SUBJECT_ACCESS_REVIEW: Message = Message {
    name: "SelfSubjectAccessReview",
    fields: &[
        (1, F::Meta("metadata")),
        (2, F::Msg("spec", &SELF_SUBJECT_ACCESS_REVIEW_SPEC)),
        (3, F::Skip),
    ],
};
const SELF_SUBJECT_RULES_REVIEW_SPEC: Message = Message {
    name: "SelfSubjectRulesReviewSpec",
    fields: &[(1, F::Str("namespace"))],
};
const SELF_SUBJECT_RULES_REVIEW: Message = Message {
    name: "SelfSubjectRulesReview",
    fields: &[
        (1, F::Meta("metadata")),
        (2, F::Msg("spec", &SELF_SUBJECT_RULES_REVIEW_SPEC)),
        (3, F::Skip),
    ],
};

/// The message table of a kind, when it is one decoded here.
pub fn message_of(kind: &str) -> Option<&'static Message> {
    Some(match kind {
        "Namespace" => &NAMESPACE,
        "ServiceAccount" => &SERVICE_ACCOUNT,
        "Role" => &ROLE,
        "ClusterRole" => &CLUSTER_ROLE,
        "RoleBinding" | "ClusterRoleBinding" => &ROLE_BINDING,
        "Service" => &SERVICE,
        "Deployment" => &DEPLOYMENT,
        "Pod" => &POD,
        "SelfSubjectAccessReview" => &SELF_SUBJECT_ACCESS_REVIEW,
        "SelfSubjectRulesReview" => &SELF_SUBJECT_RULES_REVIEW,
        _ => return None,
    })
}

/// The kinds [`message_of`] knows, for error messages.
pub const KINDS: &str = "Namespace, ServiceAccount, Role, ClusterRole, RoleBinding, ClusterRoleBinding, Service, Deployment";

fn quantity(b: &[u8]) -> Result<String, String> {
    let mut s = String::new();
    fields(b, |n, w| {
        if n == 1 {
            s = string(w)?;
        }
        Ok(())
    })?;
    Ok(s)
}

fn int_or_string(w: Wire<'_>) -> Result<Value, String> {
    let (mut kind, mut i, mut s) = (0, 0, String::new());
    fields(bytes(w)?, |n, w| {
        match n {
            1 => kind = int(w)?,
            2 => i = int(w)?,
            3 => s = string(w)?,
            _ => {}
        }
        Ok(())
    })?;
    Ok(if kind == 1 { json!(s) } else { json!(i) })
}

/// Decodes one message per its table. Empty nested messages render as
/// `{}`, as Go's JSON encoder renders an empty struct.
pub fn decode(raw: &[u8], message: &Message) -> Result<Value, String> {
    let mut o = Map::new();
    fields(raw, |n, w| {
        let Some((_, field)) = message.fields.iter().find(|(number, _)| *number == n) else {
            return Err(format!(
                "field {n} of {} is not decoded by the simulated API server; send application/json",
                message.name
            ));
        };
        let push = |o: &mut Map<String, Value>, key: &str, v: Value| match o
            .entry(key.to_owned())
            .or_insert_with(|| json!([]))
        {
            Value::Array(a) => a.push(v),
            other => *other = json!([v]),
        };
        let insert_map = |o: &mut Map<String, Value>, key: &str, k: String, v: Value| {
            if let Value::Object(m) = o.entry(key.to_owned()).or_insert_with(|| json!({})) {
                m.insert(k, v);
            }
        };
        match *field {
            F::Str(k) => {
                let v = string(w)?;
                if !v.is_empty() {
                    o.insert(k.into(), json!(v));
                }
            }
            F::Int(k) => {
                // int32 fields carry their sign in a 64-bit varint too.
                o.insert(k.into(), json!(int(w)?));
            }
            F::IntZ(k) => {
                let v = int(w)?;
                if v != 0 {
                    o.insert(k.into(), json!(v));
                }
            }
            F::Bool(k) => {
                o.insert(k.into(), json!(int(w)? != 0));
            }
            F::BoolZ(k) => {
                if int(w)? != 0 {
                    o.insert(k.into(), json!(true));
                }
            }
            F::Skip => {}
            F::Strs(k) => push(&mut o, k, json!(string(w)?)),
            F::StrMap(k) => {
                let (key, v) = map_entry(w)?;
                insert_map(&mut o, k, key, json!(utf8(v)?));
            }
            F::Quantities(k) => {
                let (key, v) = map_entry(w)?;
                insert_map(&mut o, k, key, json!(quantity(v)?));
            }
            F::Meta(k) => {
                o.insert(k.into(), object_meta(w)?);
            }
            F::IntOrStr(k) => {
                o.insert(k.into(), int_or_string(w)?);
            }
            F::Msg(k, m) => {
                o.insert(k.into(), decode(bytes(w)?, m)?);
            }
            F::Msgs(k, m) => {
                let v = decode(bytes(w)?, m)?;
                push(&mut o, k, v);
            }
        }
        Ok(())
    })?;
    Ok(Value::Object(o))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn varint(mut v: u64, out: &mut Vec<u8>) {
        loop {
            let b = (v & 0x7f) as u8;
            v >>= 7;
            if v == 0 {
                out.push(b);
                return;
            }
            out.push(b | 0x80);
        }
    }

    fn bytes_field(n: u64, payload: &[u8], out: &mut Vec<u8>) {
        varint(n << 3 | 2, out);
        varint(payload.len() as u64, out);
        out.extend_from_slice(payload);
    }

    fn int_field(n: u64, v: u64, out: &mut Vec<u8>) {
        varint(n << 3, out);
        varint(v, out);
    }

    #[test]
    fn a_deployment_decodes_to_its_json_form() {
        let mut container = Vec::new();
        bytes_field(1, b"web", &mut container);
        bytes_field(2, b"nginx", &mut container);
        let mut quantity = Vec::new();
        bytes_field(1, b"2", &mut quantity);
        let mut entry = Vec::new();
        bytes_field(1, b"gpupool/slot", &mut entry);
        bytes_field(2, &quantity, &mut entry);
        let mut resources = Vec::new();
        bytes_field(1, &entry, &mut resources);
        bytes_field(8, &resources, &mut container);
        let mut pod_spec = Vec::new();
        bytes_field(2, &container, &mut pod_spec);
        let mut template = Vec::new();
        bytes_field(2, &pod_spec, &mut template);
        let mut spec = Vec::new();
        int_field(1, 3, &mut spec);
        bytes_field(3, &template, &mut spec);
        let mut deployment = Vec::new();
        bytes_field(2, &spec, &mut deployment);
        let v = decode(&deployment, &DEPLOYMENT).expect("decodes");
        assert_eq!(
            v,
            json!({"spec": {"replicas": 3, "template": {"spec": {"containers": [
                {"name": "web", "image": "nginx", "resources": {"limits": {"gpupool/slot": "2"}}}
            ]}}}})
        );
    }

    #[test]
    fn an_unknown_field_is_refused_naming_message_and_number() {
        let mut rule = Vec::new();
        bytes_field(9, b"x", &mut rule);
        let mut role = Vec::new();
        bytes_field(2, &rule, &mut role);
        let err = decode(&role, &ROLE).expect_err("unknown field");
        assert!(err.contains("field 9 of PolicyRule"), "{err}");
    }

    #[test]
    fn int_or_string_keeps_its_type() {
        let mut ios = Vec::new();
        int_field(1, 1, &mut ios);
        bytes_field(3, b"http", &mut ios);
        let mut port = Vec::new();
        int_field(3, 80, &mut port);
        bytes_field(4, &ios, &mut port);
        let v = decode(&port, &SERVICE_PORT).expect("decodes");
        assert_eq!(v, json!({"port": 80, "targetPort": "http"}));
    }
}
