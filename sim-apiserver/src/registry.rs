//! Which resources the server serves: the built-in ones and those that
//! CustomResourceDefinitions add, with what discovery and printing need.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::fields::KnownFields;

use serde_json::{Value, json};

/// Identifies where a resource's objects are stored: its group and plural.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ResourceId {
    /// API group; empty for core.
    pub group: String,
    /// Plural resource name.
    pub plural: String,
}

impl ResourceId {
    /// A resource id.
    pub fn new(group: &str, plural: &str) -> Self {
        ResourceId {
            group: group.to_string(),
            plural: plural.to_string(),
        }
    }
}

/// One additional printer column of a CRD version.
#[derive(Debug, Clone)]
pub struct PrinterColumn {
    /// Column header.
    pub name: String,
    /// `string`, `integer`, `number`, `boolean` or `date`.
    pub type_: String,
    /// Optional format.
    pub format: String,
    /// Description shown by `kubectl explain`.
    pub description: String,
    /// 0 always shown; higher only under `-o wide`.
    pub priority: i64,
    /// Simple JSONPath such as `.status.gpus[*].index`.
    pub json_path: String,
}

/// How a resource renders as a Table.
#[derive(Debug, Clone)]
pub enum Printer {
    /// NAME and AGE.
    Default,
    /// The pod columns.
    Pod,
    /// The node columns.
    Node,
    /// The namespace columns.
    Namespace,
    /// The columns the real server prints for this built-in plural.
    Builtin(&'static str),
    /// A CRD's additional printer columns.
    Columns(Vec<PrinterColumn>),
}

/// A servable resource in one version.
#[derive(Debug, Clone)]
pub struct ResourceDef {
    /// API group; empty for core.
    pub group: String,
    /// Served version.
    pub version: String,
    /// Kind.
    pub kind: String,
    /// Plural name (the path segment).
    pub plural: String,
    /// Singular name.
    pub singular: String,
    /// Short names for kubectl.
    pub short_names: Vec<String>,
    /// Categories (e.g. `all`).
    pub categories: Vec<String>,
    /// Namespaced or cluster-scoped.
    pub namespaced: bool,
    /// Whether `/status` is a separate subresource.
    pub status_subresource: bool,
    /// Extra subresources (beyond status) listed in discovery.
    pub extra_subresources: Vec<(&'static str, &'static str)>,
    /// Table rendering.
    pub printer: Printer,
    /// The CRD's `openAPIV3Schema` of this version, if it is a custom resource.
    pub schema: Option<Value>,
    /// Whether this is a custom resource.
    pub custom: bool,
    /// Whether this version is the one objects are stored in.
    pub storage: bool,
    /// A custom resource's `selectableFields` of this version, as field
    /// selector labels (`status.node` for the JSON path `.status.node`).
    pub selectable_fields: Vec<String>,
    /// A custom resource's declared fields (compiled from `schema` once,
    /// when the CRD is registered) and the root node.
    pub(crate) known_fields: Option<Arc<(KnownFields, usize)>>,
}

impl ResourceDef {
    /// The storage id of this resource.
    pub fn id(&self) -> ResourceId {
        ResourceId::new(&self.group, &self.plural)
    }

    /// `v1` or `group/version`.
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.clone()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    /// The `APIResource` entries of this resource and its subresources.
    pub fn discovery_entries(&self) -> Vec<Value> {
        let verbs = if self.kind == "Binding" || self.kind == "Eviction" || is_review(&self.kind) {
            json!(["create"])
        } else {
            json!([
                "create",
                "delete",
                "deletecollection",
                "get",
                "list",
                "patch",
                "update",
                "watch"
            ])
        };
        let mut main = json!({
            "name": self.plural,
            "singularName": self.singular,
            "namespaced": self.namespaced,
            "kind": self.kind,
            "verbs": verbs,
        });
        if !self.short_names.is_empty() {
            main["shortNames"] = json!(self.short_names);
        }
        if !self.categories.is_empty() {
            main["categories"] = json!(self.categories);
        }
        let mut out = vec![main];
        if self.status_subresource {
            out.push(json!({
                "name": format!("{}/status", self.plural),
                "singularName": "",
                "namespaced": self.namespaced,
                "kind": self.kind,
                "verbs": ["get", "patch", "update"],
            }));
        }
        for (sub, kind) in &self.extra_subresources {
            let (group, version) = match *kind {
                "Eviction" => ("policy", "v1"),
                "Scale" => ("autoscaling", "v1"),
                _ => ("", "v1"),
            };
            let verbs = if *kind == "Scale" {
                json!(["get", "patch", "update"])
            } else {
                json!(["create"])
            };
            let mut e = json!({
                "name": format!("{}/{sub}", self.plural),
                "singularName": "",
                "namespaced": self.namespaced,
                "kind": kind,
                "verbs": verbs,
            });
            if !group.is_empty() {
                e["group"] = json!(group);
                e["version"] = json!(version);
            }
            out.push(e);
        }
        out
    }
}

/// All resources the server currently serves.
#[derive(Debug, Clone, Default)]
pub struct Registry {
    /// (group, version, plural) → definition.
    defs: BTreeMap<(String, String, String), Arc<ResourceDef>>,
}

/// Whether a kind is an access review: create-only, answered at once.
pub fn is_review(kind: &str) -> bool {
    kind.ends_with("AccessReview") || kind.ends_with("RulesReview")
}

struct Builtin {
    group: &'static str,
    version: &'static str,
    kind: &'static str,
    plural: &'static str,
    short: &'static [&'static str],
    namespaced: bool,
    status: bool,
}

const BUILTINS: &[Builtin] = &[
    Builtin {
        group: "",
        version: "v1",
        kind: "Namespace",
        plural: "namespaces",
        short: &["ns"],
        namespaced: false,
        status: true,
    },
    Builtin {
        group: "",
        version: "v1",
        kind: "Node",
        plural: "nodes",
        short: &["no"],
        namespaced: false,
        status: true,
    },
    Builtin {
        group: "",
        version: "v1",
        kind: "Pod",
        plural: "pods",
        short: &["po"],
        namespaced: true,
        status: true,
    },
    Builtin {
        group: "",
        version: "v1",
        kind: "Event",
        plural: "events",
        short: &["ev"],
        namespaced: true,
        status: false,
    },
    Builtin {
        group: "",
        version: "v1",
        kind: "ConfigMap",
        plural: "configmaps",
        short: &["cm"],
        namespaced: true,
        status: false,
    },
    Builtin {
        group: "",
        version: "v1",
        kind: "Secret",
        plural: "secrets",
        short: &[],
        namespaced: true,
        status: false,
    },
    Builtin {
        group: "",
        version: "v1",
        kind: "ServiceAccount",
        plural: "serviceaccounts",
        short: &["sa"],
        namespaced: true,
        status: false,
    },
    Builtin {
        group: "",
        version: "v1",
        kind: "Service",
        plural: "services",
        short: &["svc"],
        namespaced: true,
        status: true,
    },
    Builtin {
        group: "",
        version: "v1",
        kind: "Endpoints",
        plural: "endpoints",
        short: &["ep"],
        namespaced: true,
        status: false,
    },
    Builtin {
        group: "coordination.k8s.io",
        version: "v1",
        kind: "Lease",
        plural: "leases",
        short: &[],
        namespaced: true,
        status: false,
    },
    Builtin {
        group: "events.k8s.io",
        version: "v1",
        kind: "Event",
        plural: "events",
        short: &["ev"],
        namespaced: true,
        status: false,
    },
    Builtin {
        group: "policy",
        version: "v1",
        kind: "PodDisruptionBudget",
        plural: "poddisruptionbudgets",
        short: &["pdb"],
        namespaced: true,
        status: true,
    },
    Builtin {
        group: "apiextensions.k8s.io",
        version: "v1",
        kind: "CustomResourceDefinition",
        plural: "customresourcedefinitions",
        short: &["crd", "crds"],
        namespaced: false,
        status: true,
    },
    Builtin {
        group: "admissionregistration.k8s.io",
        version: "v1",
        kind: "MutatingWebhookConfiguration",
        plural: "mutatingwebhookconfigurations",
        short: &[],
        namespaced: false,
        status: false,
    },
    Builtin {
        group: "admissionregistration.k8s.io",
        version: "v1",
        kind: "ValidatingWebhookConfiguration",
        plural: "validatingwebhookconfigurations",
        short: &[],
        namespaced: false,
        status: false,
    },
    // Stored objects only: no controller acts on these (no pods are made
    // for Deployments or DaemonSets, admission policies are not evaluated,
    // network policies filter nothing); they are served so that Helm charts
    // and manifests holding them install, list, upgrade and uninstall.
    Builtin {
        group: "admissionregistration.k8s.io",
        version: "v1",
        kind: "ValidatingAdmissionPolicy",
        plural: "validatingadmissionpolicies",
        short: &[],
        namespaced: false,
        status: true,
    },
    Builtin {
        group: "admissionregistration.k8s.io",
        version: "v1",
        kind: "ValidatingAdmissionPolicyBinding",
        plural: "validatingadmissionpolicybindings",
        short: &[],
        namespaced: false,
        status: false,
    },
    Builtin {
        group: "networking.k8s.io",
        version: "v1",
        kind: "NetworkPolicy",
        plural: "networkpolicies",
        short: &["netpol"],
        namespaced: true,
        status: false,
    },
    Builtin {
        group: "apps",
        version: "v1",
        kind: "Deployment",
        plural: "deployments",
        short: &["deploy"],
        namespaced: true,
        status: true,
    },
    Builtin {
        group: "apps",
        version: "v1",
        kind: "DaemonSet",
        plural: "daemonsets",
        short: &["ds"],
        namespaced: true,
        status: true,
    },
    Builtin {
        group: "apps",
        version: "v1",
        kind: "StatefulSet",
        plural: "statefulsets",
        short: &["sts"],
        namespaced: true,
        status: true,
    },
    Builtin {
        group: "apps",
        version: "v1",
        kind: "ReplicaSet",
        plural: "replicasets",
        short: &["rs"],
        namespaced: true,
        status: true,
    },
    // Access reviews: answered, never stored (see `http::access_review`).
    Builtin {
        group: "authorization.k8s.io",
        version: "v1",
        kind: "SelfSubjectAccessReview",
        plural: "selfsubjectaccessreviews",
        short: &[],
        namespaced: false,
        status: false,
    },
    Builtin {
        group: "authorization.k8s.io",
        version: "v1",
        kind: "SelfSubjectRulesReview",
        plural: "selfsubjectrulesreviews",
        short: &[],
        namespaced: false,
        status: false,
    },
    Builtin {
        group: "authorization.k8s.io",
        version: "v1",
        kind: "SubjectAccessReview",
        plural: "subjectaccessreviews",
        short: &[],
        namespaced: false,
        status: false,
    },
    Builtin {
        group: "authorization.k8s.io",
        version: "v1",
        kind: "LocalSubjectAccessReview",
        plural: "localsubjectaccessreviews",
        short: &[],
        namespaced: true,
        status: false,
    },
    Builtin {
        group: "rbac.authorization.k8s.io",
        version: "v1",
        kind: "ClusterRole",
        plural: "clusterroles",
        short: &[],
        namespaced: false,
        status: false,
    },
    Builtin {
        group: "rbac.authorization.k8s.io",
        version: "v1",
        kind: "ClusterRoleBinding",
        plural: "clusterrolebindings",
        short: &[],
        namespaced: false,
        status: false,
    },
    Builtin {
        group: "rbac.authorization.k8s.io",
        version: "v1",
        kind: "Role",
        plural: "roles",
        short: &[],
        namespaced: true,
        status: false,
    },
    Builtin {
        group: "rbac.authorization.k8s.io",
        version: "v1",
        kind: "RoleBinding",
        plural: "rolebindings",
        short: &[],
        namespaced: true,
        status: false,
    },
];

impl Registry {
    /// The built-in resources.
    pub fn builtin() -> Self {
        let mut r = Registry::default();
        for b in BUILTINS {
            let printer = match b.plural {
                "pods" => Printer::Pod,
                "nodes" => Printer::Node,
                "namespaces" => Printer::Namespace,
                plural => Printer::Builtin(plural),
            };
            let extra = match b.plural {
                "pods" => vec![("binding", "Binding"), ("eviction", "Eviction")],
                "deployments" | "replicasets" | "statefulsets" => vec![("scale", "Scale")],
                _ => Vec::new(),
            };
            let categories = if matches!(
                b.plural,
                "pods" | "services" | "deployments" | "daemonsets" | "statefulsets" | "replicasets"
            ) {
                vec!["all".to_string()]
            } else {
                Vec::new()
            };
            r.insert(ResourceDef {
                group: b.group.into(),
                version: b.version.into(),
                kind: b.kind.into(),
                plural: b.plural.into(),
                singular: b.kind.to_lowercase(),
                short_names: b.short.iter().map(|s| s.to_string()).collect(),
                categories,
                namespaced: b.namespaced,
                status_subresource: b.status,
                extra_subresources: extra,
                printer,
                schema: None,
                custom: false,
                storage: true,
                selectable_fields: Vec::new(),
                known_fields: None,
            });
        }
        r
    }

    fn insert(&mut self, def: ResourceDef) {
        self.defs.insert(
            (def.group.clone(), def.version.clone(), def.plural.clone()),
            Arc::new(def),
        );
    }

    /// The definition served at `group/version/plural`.
    pub fn get(&self, group: &str, version: &str, plural: &str) -> Option<&ResourceDef> {
        self.shared(group, version, plural).map(|d| &**d)
    }

    /// The definition served at `group/version/plural`, shared (what each
    /// request holds on to, instead of a copy of a CRD's whole schema).
    pub fn shared(&self, group: &str, version: &str, plural: &str) -> Option<&Arc<ResourceDef>> {
        self.defs
            .get(&(group.to_string(), version.to_string(), plural.to_string()))
    }

    /// The storage-version definition of a stored resource.
    pub fn storage_def(&self, id: &ResourceId) -> Option<&ResourceDef> {
        self.all()
            .find(|d| d.group == id.group && d.plural == id.plural && d.storage)
    }

    /// Whether anything is served in this group and version.
    pub fn serves_group_version(&self, group: &str, version: &str) -> bool {
        self.defs.keys().any(|(g, v, _)| g == group && v == version)
    }

    /// Every definition, ordered by group, version, plural.
    pub fn all(&self) -> impl Iterator<Item = &ResourceDef> {
        self.defs.values().map(|d| &**d)
    }

    /// Every served (group, versions) pair of non-core groups, versions in
    /// preference order.
    pub fn groups(&self) -> Vec<(String, Vec<String>)> {
        let mut out: Vec<(String, Vec<String>)> = Vec::new();
        for def in self.defs.values().filter(|d| !d.group.is_empty()) {
            match out.iter_mut().find(|(g, _)| *g == def.group) {
                Some((_, versions)) => {
                    if !versions.contains(&def.version) {
                        versions.push(def.version.clone());
                    }
                }
                None => out.push((def.group.clone(), vec![def.version.clone()])),
            }
        }
        for (_, versions) in &mut out {
            versions.sort_by_key(|v| std::cmp::Reverse(version_priority(v)));
        }
        out
    }

    /// Replaces every definition a CRD contributes (removing old versions).
    pub fn apply_crd(&mut self, crd: &Value) -> Result<(), String> {
        let defs = defs_from_crd(crd)?;
        if let Some(first) = defs.first() {
            let (group, plural) = (first.group.clone(), first.plural.clone());
            self.defs
                .retain(|(g, _, p), d| !(d.custom && *g == group && *p == plural));
        }
        for d in defs {
            self.insert(d);
        }
        Ok(())
    }

    /// Removes a CRD's resources.
    pub fn remove_crd(&mut self, group: &str, plural: &str) {
        self.defs
            .retain(|(g, _, p), d| !(d.custom && g == group && p == plural));
    }

    /// Finds a definition by kind within a group/version (for `kind` checks).
    pub fn by_kind(&self, group: &str, version: &str, kind: &str) -> Option<&ResourceDef> {
        self.all()
            .find(|d| d.group == group && d.version == version && d.kind == kind)
    }
}

/// Orders versions as Kubernetes does: GA > beta > alpha, higher numbers first.
fn version_priority(v: &str) -> (u8, u32, u32) {
    let rest = v.strip_prefix('v').unwrap_or(v);
    let digits: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
    let major = digits.parse().unwrap_or(0);
    let tail = &rest[digits.len()..];
    if tail.is_empty() {
        (3, major, 0)
    } else if let Some(n) = tail.strip_prefix("beta") {
        (2, major, n.parse().unwrap_or(0))
    } else if let Some(n) = tail.strip_prefix("alpha") {
        (1, major, n.parse().unwrap_or(0))
    } else {
        (0, major, 0)
    }
}

fn str_at<'a>(v: &'a Value, path: &[&str]) -> Option<&'a str> {
    let mut cur = v;
    for p in path {
        cur = cur.get(p)?;
    }
    cur.as_str()
}

/// The field selector labels a CRD version's `selectableFields` declare:
/// each JSON path without its leading dot, as the real server names them.
fn selectable_fields(version: &Value) -> Vec<String> {
    version
        .get("selectableFields")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|f| str_at(f, &["jsonPath"]))
        .map(|path| path.strip_prefix('.').unwrap_or(path).to_string())
        .filter(|label| !label.is_empty())
        .collect()
}

/// The definitions a CRD object declares (one per served version).
pub fn defs_from_crd(crd: &Value) -> Result<Vec<ResourceDef>, String> {
    let spec = crd.get("spec").ok_or("spec: Required value")?;
    let group = str_at(spec, &["group"]).ok_or("spec.group: Required value")?;
    let plural = str_at(spec, &["names", "plural"]).ok_or("spec.names.plural: Required value")?;
    let kind = str_at(spec, &["names", "kind"]).ok_or("spec.names.kind: Required value")?;
    let singular = str_at(spec, &["names", "singular"])
        .map(str::to_string)
        .unwrap_or_else(|| kind.to_lowercase());
    let list_of = |key: &str| -> Vec<String> {
        spec.get("names")
            .and_then(|n| n.get(key))
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(|s| s.as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default()
    };
    let scope = str_at(spec, &["scope"]).ok_or("spec.scope: Required value")?;
    let namespaced = match scope {
        "Namespaced" => true,
        "Cluster" => false,
        other => {
            return Err(format!(
                "spec.scope: Unsupported value: \"{other}\": supported values: \"Cluster\", \"Namespaced\""
            ));
        }
    };
    let versions = spec
        .get("versions")
        .and_then(Value::as_array)
        .ok_or("spec.versions: Required value")?;
    if versions.is_empty() {
        return Err("spec.versions: Invalid value: []: must have exactly one version marked as storage version".into());
    }
    let mut out = Vec::new();
    for v in versions {
        let name = str_at(v, &["name"]).ok_or("spec.versions[].name: Required value")?;
        if v.get("served").and_then(Value::as_bool) == Some(false) {
            continue;
        }
        let storage = v.get("storage").and_then(Value::as_bool).unwrap_or(false);
        let columns = v
            .get("additionalPrinterColumns")
            .and_then(Value::as_array)
            .map(|cols| {
                cols.iter()
                    .map(|c| PrinterColumn {
                        name: str_at(c, &["name"]).unwrap_or_default().to_string(),
                        type_: str_at(c, &["type"]).unwrap_or("string").to_string(),
                        format: str_at(c, &["format"]).unwrap_or_default().to_string(),
                        description: str_at(c, &["description"]).unwrap_or_default().to_string(),
                        priority: c.get("priority").and_then(Value::as_i64).unwrap_or(0),
                        json_path: str_at(c, &["jsonPath"]).unwrap_or_default().to_string(),
                    })
                    .collect::<Vec<_>>()
            });
        let printer = match columns {
            Some(c) if !c.is_empty() => Printer::Columns(c),
            _ => Printer::Columns(vec![PrinterColumn {
                name: "Age".into(),
                type_: "date".into(),
                format: String::new(),
                description: String::new(),
                priority: 0,
                json_path: ".metadata.creationTimestamp".into(),
            }]),
        };
        out.push(ResourceDef {
            group: group.into(),
            version: name.into(),
            kind: kind.into(),
            plural: plural.into(),
            singular: singular.clone(),
            short_names: list_of("shortNames"),
            categories: list_of("categories"),
            namespaced,
            status_subresource: v
                .get("subresources")
                .and_then(|s| s.get("status"))
                .is_some(),
            extra_subresources: Vec::new(),
            printer,
            known_fields: v
                .get("schema")
                .and_then(|s| s.get("openAPIV3Schema"))
                .map(|s| Arc::new(KnownFields::for_custom_resource(s))),
            schema: v
                .get("schema")
                .and_then(|s| s.get("openAPIV3Schema"))
                .cloned(),
            custom: true,
            storage,
            selectable_fields: selectable_fields(v),
        });
    }
    if !out.iter().any(|d| d.storage)
        && let Some(first) = out.first_mut()
    {
        first.storage = true;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_sort_like_kubernetes() {
        let mut v = vec!["v1alpha1", "v2", "v1beta1", "v1"];
        v.sort_by_key(|x| std::cmp::Reverse(version_priority(x)));
        assert_eq!(v, vec!["v2", "v1", "v1beta1", "v1alpha1"]);
    }

    #[test]
    fn crd_without_scope_is_rejected() {
        let crd =
            json!({"spec": {"group": "g", "names": {"plural": "xs", "kind": "X"}, "versions": []}});
        let err = defs_from_crd(&crd).expect_err("no scope");
        assert!(err.contains("spec.scope"), "{err}");
    }
}
