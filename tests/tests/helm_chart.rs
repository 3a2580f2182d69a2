//! The Helm chart under `charts/gpupool`, rendered by a real `helm`.
//!
//! Every rendered manifest is parsed into its Kubernetes type (k8s-openapi, or
//! gpupool-api for `GpuLeaseClass`) and serialised back; a field the type does
//! not know is lost on that round trip and fails the test. On top of that the
//! test checks what the chart promises: RBAC without wildcards and with exactly
//! the calls the binaries make, locked-down containers, directory (not socket)
//! host mounts, and that bad values are refused with a message naming them.
//!
//! `helm` comes from `$HELM` or `.tools/bin/helm` (installed by
//! `.ci/install-helm.sh`). Without either the helm tests fail in CI and are
//! skipped elsewhere; CI installs helm and sets `$HELM` first, and a `$HELM` that does not
//! exist is a failure, never a skip.

mod helm_support;

use helm_support::{helm, repo_root};

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use gpupool_api::GpuLeaseClass;
use k8s_openapi::api::admissionregistration::v1::{
    ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
};
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{ConfigMap, Container, PodSpec, Service, ServiceAccount};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

const RELEASE: &str = "gpupool";
const NAMESPACE: &str = "gpupool-system";
const KIND_VALUES: &str = "ci/kind-values.yaml";

fn chart_dir() -> PathBuf {
    repo_root().join("charts/gpupool")
}

/// Runs helm in the chart directory; `Ok(stdout)` on success, `Err(stderr)` on failure.
fn run_helm(helm: &Path, args: &[&str]) -> Result<String, String> {
    let out = Command::new(helm)
        .args(args)
        .current_dir(chart_dir())
        .output()
        .expect("helm runs");
    if out.status.success() {
        Ok(String::from_utf8(out.stdout).expect("helm prints UTF-8"))
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// `helm template` of the chart (CRDs included) with extra arguments such as `-f` or `--set`.
fn template(helm: &Path, extra: &[&str]) -> Result<String, String> {
    let mut args = vec![
        "template",
        RELEASE,
        ".",
        "--namespace",
        NAMESPACE,
        "--include-crds",
    ];
    args.extend_from_slice(extra);
    run_helm(helm, &args)
}

fn render(helm: &Path, extra: &[&str]) -> Manifests {
    let text = template(helm, extra)
        .unwrap_or_else(|err| panic!("helm template {extra:?} failed:\n{err}"));
    Manifests::parse(&text)
}

// ---------------------------------------------------------------------------
// Strict typing: parse, serialise back, compare.

/// Drops nulls, empty objects and empty arrays: the forms an optional field
/// takes when it is absent, which serialisers write or omit freely.
fn normalise(value: &Value) -> Option<Value> {
    match value {
        Value::Null => None,
        Value::Object(map) => {
            let kept: serde_json::Map<String, Value> = map
                .iter()
                .filter_map(|(k, v)| normalise(v).map(|v| (k.clone(), v)))
                .collect();
            (!kept.is_empty()).then_some(Value::Object(kept))
        }
        Value::Array(items) => {
            let kept: Vec<Value> = items
                .iter()
                .map(|v| normalise(v).unwrap_or(Value::Null))
                .collect();
            (!kept.is_empty()).then_some(Value::Array(kept))
        }
        other => Some(other.clone()),
    }
}

/// Paths where `rendered` has something `typed` does not (or has differently).
fn differences(path: &str, rendered: &Value, typed: Option<&Value>, out: &mut Vec<String>) {
    match (rendered, typed) {
        (Value::Object(have), Some(Value::Object(back))) => {
            for (key, value) in have {
                differences(&format!("{path}.{key}"), value, back.get(key), out);
            }
            for key in back.keys().filter(|k| !have.contains_key(*k)) {
                out.push(format!("{path}.{key}: added by the type"));
            }
        }
        (Value::Array(have), Some(Value::Array(back))) if have.len() == back.len() => {
            for (i, (value, b)) in have.iter().zip(back).enumerate() {
                differences(&format!("{path}[{i}]"), value, Some(b), out);
            }
        }
        (_, None) => out.push(format!("{path}: unknown to the type")),
        (have, Some(back)) if have != back => {
            out.push(format!("{path}: rendered {have}, type gives {back}"))
        }
        _ => {}
    }
}

/// Parses `doc` as `T` and fails, naming every path, if serialising it back
/// loses or changes anything.
fn strictly<T: DeserializeOwned + Serialize>(doc: &Value, what: &str) -> T {
    let typed: T = serde_json::from_value(doc.clone())
        .unwrap_or_else(|err| panic!("{what} does not parse as its type: {err}\n{doc:#}"));
    let back = serde_json::to_value(&typed).expect("typed object serialises");
    let rendered = normalise(doc).unwrap_or(Value::Null);
    let back = normalise(&back).unwrap_or(Value::Null);
    if rendered != back {
        let mut diffs = Vec::new();
        differences("", &rendered, Some(&back), &mut diffs);
        panic!(
            "{what} does not survive a round trip through its type:\n  {}",
            diffs.join("\n  ")
        );
    }
    typed
}

/// A Prometheus Operator ServiceMonitor: no Rust type ships with
/// k8s-openapi, so this is the subset the chart uses, refusing any other field.
#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ServiceMonitor {
    api_version: String,
    kind: String,
    metadata: ObjectMeta,
    spec: ServiceMonitorSpec,
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ServiceMonitorSpec {
    selector: LabelSelector,
    namespace_selector: NamespaceSelector,
    endpoints: Vec<ServiceMonitorEndpoint>,
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct NamespaceSelector {
    match_names: Vec<String>,
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ServiceMonitorEndpoint {
    port: String,
    path: String,
    interval: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    relabelings: Vec<Relabeling>,
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Relabeling {
    source_labels: Vec<String>,
    target_label: String,
}

/// Everything one `helm template` rendered, each object in its type.
#[derive(Default)]
struct Manifests {
    metas: Vec<(String, ObjectMeta)>,
    deployments: Vec<Deployment>,
    daemon_sets: Vec<DaemonSet>,
    services: Vec<Service>,
    service_accounts: Vec<ServiceAccount>,
    config_maps: Vec<ConfigMap>,
    cluster_roles: Vec<ClusterRole>,
    cluster_role_bindings: Vec<ClusterRoleBinding>,
    roles: Vec<Role>,
    role_bindings: Vec<RoleBinding>,
    pdbs: Vec<PodDisruptionBudget>,
    crds: Vec<CustomResourceDefinition>,
    classes: Vec<GpuLeaseClass>,
    service_monitors: Vec<ServiceMonitor>,
    admission_policies: Vec<ValidatingAdmissionPolicy>,
    admission_policy_bindings: Vec<ValidatingAdmissionPolicyBinding>,
    network_policies: Vec<NetworkPolicy>,
}

impl Manifests {
    fn parse(text: &str) -> Self {
        let mut all = Self::default();
        for document in serde_yaml::Deserializer::from_str(text) {
            let doc = Value::deserialize(document).expect("helm renders valid YAML");
            if doc.is_null() {
                continue;
            }
            let api_version = doc["apiVersion"].as_str().unwrap_or_default().to_owned();
            let kind = doc["kind"].as_str().unwrap_or_default().to_owned();
            let name = doc["metadata"]["name"].as_str().unwrap_or_default();
            let what = format!("{kind} {name} ({api_version})");
            let meta: ObjectMeta = strictly(&doc["metadata"], &format!("{what} metadata"));
            all.metas.push((kind.clone(), meta));
            match (api_version.as_str(), kind.as_str()) {
                ("apps/v1", "Deployment") => all.deployments.push(strictly(&doc, &what)),
                ("apps/v1", "DaemonSet") => all.daemon_sets.push(strictly(&doc, &what)),
                ("v1", "Service") => all.services.push(strictly(&doc, &what)),
                ("v1", "ServiceAccount") => all.service_accounts.push(strictly(&doc, &what)),
                ("v1", "ConfigMap") => all.config_maps.push(strictly(&doc, &what)),
                ("rbac.authorization.k8s.io/v1", "ClusterRole") => {
                    all.cluster_roles.push(strictly(&doc, &what))
                }
                ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding") => {
                    all.cluster_role_bindings.push(strictly(&doc, &what))
                }
                ("rbac.authorization.k8s.io/v1", "Role") => all.roles.push(strictly(&doc, &what)),
                ("rbac.authorization.k8s.io/v1", "RoleBinding") => {
                    all.role_bindings.push(strictly(&doc, &what))
                }
                ("policy/v1", "PodDisruptionBudget") => all.pdbs.push(strictly(&doc, &what)),
                ("apiextensions.k8s.io/v1", "CustomResourceDefinition") => {
                    all.crds.push(strictly(&doc, &what))
                }
                ("gpupool.io/v1alpha1", "GpuLeaseClass") => all.classes.push(strictly(&doc, &what)),
                ("monitoring.coreos.com/v1", "ServiceMonitor") => {
                    all.service_monitors.push(strictly(&doc, &what))
                }
                ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicy") => {
                    all.admission_policies.push(strictly(&doc, &what))
                }
                ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicyBinding") => {
                    all.admission_policy_bindings.push(strictly(&doc, &what))
                }
                ("networking.k8s.io/v1", "NetworkPolicy") => {
                    all.network_policies.push(strictly(&doc, &what))
                }
                _ => panic!("{what}: no strict type check for this kind; add one to helm_chart.rs"),
            }
        }
        all
    }

    fn kinds(&self) -> BTreeMap<&str, usize> {
        let mut kinds = BTreeMap::new();
        for (kind, _) in &self.metas {
            *kinds.entry(kind.as_str()).or_default() += 1;
        }
        kinds
    }

    fn operator(&self) -> &Deployment {
        assert_eq!(self.deployments.len(), 1, "exactly one Deployment");
        &self.deployments[0]
    }

    fn device_plugin(&self) -> &DaemonSet {
        assert_eq!(self.daemon_sets.len(), 1, "exactly one DaemonSet");
        &self.daemon_sets[0]
    }

    fn cluster_role(&self, name: &str) -> &ClusterRole {
        self.cluster_roles
            .iter()
            .find(|r| r.metadata.name.as_deref() == Some(name))
            .unwrap_or_else(|| panic!("no ClusterRole {name}"))
    }

    fn service(&self, name: &str) -> &Service {
        self.services
            .iter()
            .find(|s| s.metadata.name.as_deref() == Some(name))
            .unwrap_or_else(|| panic!("no Service {name}"))
    }
}

// ---------------------------------------------------------------------------
// What the chart promises.

fn pod_spec_of_deployment(d: &Deployment) -> &PodSpec {
    d.spec
        .template
        .spec
        .as_ref()
        .expect("Deployment has a pod spec")
}

fn pod_spec_of_daemon_set(d: &DaemonSet) -> &PodSpec {
    d.spec
        .template
        .spec
        .as_ref()
        .expect("DaemonSet has a pod spec")
}

fn all_containers(pod: &PodSpec) -> impl Iterator<Item = &Container> {
    pod.init_containers.iter().flatten().chain(&pod.containers)
}

/// No privilege escalation, no capabilities, read-only root, RuntimeDefault seccomp.
fn assert_locked_down(pod: &PodSpec, owner: &str) {
    let pod_seccomp = pod
        .security_context
        .as_ref()
        .and_then(|s| s.seccomp_profile.as_ref())
        .map(|p| p.type_.as_str());
    assert!(
        pod.host_network != Some(true) && pod.host_pid != Some(true) && pod.host_ipc != Some(true),
        "{owner}: uses a host namespace"
    );
    for c in all_containers(pod) {
        let what = format!("{owner} container {}", c.name);
        let sc = c
            .security_context
            .as_ref()
            .unwrap_or_else(|| panic!("{what}: no securityContext"));
        assert_eq!(
            sc.allow_privilege_escalation,
            Some(false),
            "{what}: allowPrivilegeEscalation"
        );
        assert_eq!(
            sc.read_only_root_filesystem,
            Some(true),
            "{what}: readOnlyRootFilesystem"
        );
        assert_ne!(sc.privileged, Some(true), "{what}: privileged");
        let caps = sc
            .capabilities
            .as_ref()
            .unwrap_or_else(|| panic!("{what}: no capabilities"));
        assert_eq!(
            caps.drop.as_deref(),
            Some(&["ALL".to_owned()][..]),
            "{what}: drop ALL"
        );
        assert!(
            caps.add.as_ref().is_none_or(Vec::is_empty),
            "{what}: adds capabilities"
        );
        let seccomp = sc
            .seccomp_profile
            .as_ref()
            .map(|p| p.type_.as_str())
            .or(pod_seccomp);
        assert_eq!(seccomp, Some("RuntimeDefault"), "{what}: seccomp");
        let resources = c
            .resources
            .as_ref()
            .unwrap_or_else(|| panic!("{what}: no resources"));
        for key in ["cpu", "memory"] {
            assert!(
                resources
                    .requests
                    .as_ref()
                    .is_some_and(|r| r.contains_key(key))
                    && resources
                        .limits
                        .as_ref()
                        .is_some_and(|l| l.contains_key(key)),
                "{what}: needs {key} requests and limits"
            );
        }
    }
}

/// Every (apiGroup, resource, verb, resourceNames) a set of rules grants.
fn grants(rules: &[PolicyRule]) -> BTreeSet<(String, String, String, Vec<String>)> {
    let mut out = BTreeSet::new();
    for rule in rules {
        assert!(rule.non_resource_urls.is_none(), "no nonResourceURLs");
        let groups = rule.api_groups.clone().unwrap_or_default();
        let resources = rule.resources.clone().unwrap_or_default();
        let names = rule.resource_names.clone().unwrap_or_default();
        for field in [&groups, &resources, &rule.verbs, &names] {
            assert!(
                !field.iter().any(|v| v.contains('*')),
                "RBAC wildcard in {rule:?}"
            );
        }
        for g in &groups {
            for r in &resources {
                for v in &rule.verbs {
                    out.insert((g.clone(), r.clone(), v.clone(), names.clone()));
                }
            }
        }
    }
    out
}

fn expected_grants(
    spec: &[(&str, &str, &[&str], &[&str])],
) -> BTreeSet<(String, String, String, Vec<String>)> {
    let mut out = BTreeSet::new();
    for (group, resource, verbs, names) in spec {
        for verb in *verbs {
            out.insert((
                (*group).to_owned(),
                (*resource).to_owned(),
                (*verb).to_owned(),
                names.iter().map(|n| (*n).to_owned()).collect(),
            ));
        }
    }
    out
}

fn args_of(c: &Container) -> Vec<&str> {
    c.args.iter().flatten().map(String::as_str).collect()
}

fn pod_labels(template_labels: Option<&BTreeMap<String, String>>) -> BTreeMap<String, String> {
    template_labels.cloned().unwrap_or_default()
}

fn selects(selector: &BTreeMap<String, String>, labels: &BTreeMap<String, String>) -> bool {
    !selector.is_empty() && selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

/// Checks shared by every profile.
fn check_common(m: &Manifests, version: &str) {
    // Labels and namespaces.
    for (kind, meta) in &m.metas {
        let name = meta.name.as_deref().unwrap_or_default();
        let labels = meta.labels.clone().unwrap_or_default();
        if kind != "CustomResourceDefinition" {
            for key in [
                "app.kubernetes.io/name",
                "app.kubernetes.io/instance",
                "app.kubernetes.io/version",
                "app.kubernetes.io/managed-by",
                "helm.sh/chart",
            ] {
                assert!(labels.contains_key(key), "{kind} {name}: no label {key}");
            }
        }
        let cluster_scoped = matches!(
            kind.as_str(),
            "ClusterRole"
                | "ClusterRoleBinding"
                | "CustomResourceDefinition"
                | "GpuLeaseClass"
                | "ValidatingAdmissionPolicy"
                | "ValidatingAdmissionPolicyBinding"
        );
        let want_ns = (!cluster_scoped).then_some(NAMESPACE);
        assert_eq!(
            meta.namespace.as_deref(),
            want_ns,
            "{kind} {name}: namespace"
        );
    }

    // CRDs: the ones the Rust types generate.
    let crd_names: BTreeSet<&str> = m
        .crds
        .iter()
        .filter_map(|c| c.metadata.name.as_deref())
        .collect();
    assert_eq!(
        crd_names,
        BTreeSet::from(["gpuleaseclasses.gpupool.io", "gpuleases.gpupool.io"])
    );

    // Operator Deployment.
    let op = m.operator();
    let op_name = op.metadata.name.as_deref().expect("named");
    assert_eq!(op_name, "gpupool-operator");
    let op_spec = &op.spec;
    assert_eq!(op_spec.replicas, Some(2), "two operator replicas");
    let op_pod = pod_spec_of_deployment(op);
    assert_locked_down(op_pod, "operator");
    let op_pod_sc = op_pod
        .security_context
        .as_ref()
        .expect("operator pod securityContext");
    assert_eq!(
        op_pod_sc.run_as_non_root,
        Some(true),
        "operator runAsNonRoot"
    );
    assert_eq!(
        op_pod_sc.run_as_user,
        Some(65532),
        "operator runs as 65532, the image's user"
    );
    assert_eq!(op_pod.service_account_name.as_deref(), Some(op_name));
    assert!(
        op_pod
            .topology_spread_constraints
            .as_ref()
            .is_some_and(|t| !t.is_empty()),
        "operator pods spread over nodes"
    );
    let op_container = &op_pod.containers[0];
    assert_eq!(
        op_container.image.as_deref(),
        Some(format!("ghcr.io/gpupool/gpupool-operator:{version}").as_str())
    );
    let args = args_of(op_container);
    let webhook_service = format!("--webhook-service={NAMESPACE}/{op_name}");
    for want in [
        webhook_service.as_str(),
        "--leader-elect=true",
        "--webhook-port=9443",
        "--metrics-port=8080",
        &format!("--namespace={NAMESPACE}"),
    ] {
        assert!(args.contains(&want), "operator args {args:?} lack {want}");
    }
    let port_of = |name: &str| {
        op_container
            .ports
            .iter()
            .flatten()
            .find(|p| p.name.as_deref() == Some(name))
            .map(|p| p.container_port)
    };
    assert_eq!(port_of("webhook"), Some(9443));
    assert_eq!(port_of("metrics"), Some(8080));
    for (probe, path) in [
        (op_container.liveness_probe.as_ref(), "/healthz"),
        (op_container.readiness_probe.as_ref(), "/readyz"),
    ] {
        let get = probe
            .and_then(|p| p.http_get.as_ref())
            .unwrap_or_else(|| panic!("operator probe for {path}"));
        assert_eq!(get.path.as_deref(), Some(path));
        assert_eq!(
            get.port,
            k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String("metrics".into())
        );
    }

    // The webhook Service the --webhook-service flag names: 443 → the webhook port.
    let op_labels = pod_labels(
        op_spec
            .template
            .metadata
            .as_ref()
            .and_then(|m| m.labels.as_ref()),
    );
    let svc = m.service(op_name);
    let svc_spec = svc.spec.as_ref().expect("service spec");
    assert!(selects(
        svc_spec.selector.as_ref().expect("selector"),
        &op_labels
    ));
    let webhook_port = svc_spec
        .ports
        .iter()
        .flatten()
        .find(|p| p.name.as_deref() == Some("webhook"))
        .expect("webhook port");
    assert_eq!(webhook_port.port, 443);
    assert!(
        svc_spec
            .ports
            .iter()
            .flatten()
            .any(|p| p.name.as_deref() == Some("metrics"))
    );

    // Operator PDB selects the operator pods and lets one go.
    assert_eq!(m.pdbs.len(), 1, "one PodDisruptionBudget");
    let pdb = m.pdbs[0].spec.as_ref().expect("pdb spec");
    let pdb_selector = pdb
        .selector
        .as_ref()
        .and_then(|s| s.match_labels.clone())
        .unwrap_or_default();
    assert!(
        selects(&pdb_selector, &op_labels),
        "PDB selects the operator pods"
    );
    assert!(
        op_spec
            .selector
            .match_labels
            .as_ref()
            .is_some_and(|s| selects(s, &op_labels)),
        "Deployment selector matches its pods"
    );

    // Operator RBAC: exactly what it calls.
    let op_role = m.cluster_role(op_name);
    let have = grants(op_role.rules.as_deref().unwrap_or_default());
    let webhook_configs = ["gpupool"];
    let want = expected_grants(&[
        (
            "",
            "pods",
            &["get", "list", "watch", "patch", "delete"],
            &[],
        ),
        ("", "pods/eviction", &["create"], &[]),
        ("", "nodes", &["get", "list", "watch"], &[]),
        ("", "events", &["create", "patch"], &[]),
        ("events.k8s.io", "events", &["create", "patch"], &[]),
        (
            "gpupool.io",
            "gpuleases",
            &[
                "get", "list", "watch", "create", "delete", "patch", "update",
            ],
            &[],
        ),
        (
            "gpupool.io",
            "gpuleases/status",
            &["get", "patch", "update"],
            &[],
        ),
        (
            "gpupool.io",
            "gpuleaseclasses",
            &["get", "list", "watch"],
            &[],
        ),
        (
            "gpupool.io",
            "gpuleaseclasses/status",
            &["get", "patch", "update"],
            &[],
        ),
        // list and watch by name: the operator watches its configurations
        // with fieldSelector metadata.name=gpupool to restore them at once.
        (
            "admissionregistration.k8s.io",
            "mutatingwebhookconfigurations",
            &["get", "list", "watch", "update", "patch"],
            &webhook_configs,
        ),
        (
            "admissionregistration.k8s.io",
            "validatingwebhookconfigurations",
            &["get", "list", "watch", "update", "patch"],
            &webhook_configs,
        ),
        (
            "admissionregistration.k8s.io",
            "mutatingwebhookconfigurations",
            &["create"],
            &[],
        ),
        (
            "admissionregistration.k8s.io",
            "validatingwebhookconfigurations",
            &["create"],
            &[],
        ),
        (
            "rbac.authorization.k8s.io",
            "clusterroles",
            &["get"],
            &[op_name],
        ),
    ]);
    assert_eq!(
        have, want,
        "operator ClusterRole grants exactly the operator's calls"
    );
    assert_eq!(m.roles.len(), 1, "one namespaced Role");
    let role = &m.roles[0];
    assert_eq!(role.metadata.namespace.as_deref(), Some(NAMESPACE));
    assert_eq!(
        grants(role.rules.as_deref().unwrap_or_default()),
        expected_grants(&[
            (
                "coordination.k8s.io",
                "leases",
                &["get", "update", "patch"],
                &["gpupool-operator"]
            ),
            ("coordination.k8s.io", "leases", &["create"], &[]),
            (
                "",
                "secrets",
                &["get", "update", "patch"],
                &["gpupool-webhook-tls"]
            ),
            ("", "secrets", &["create"], &[]),
        ]),
        "operator Role: its leader-election Lease and its certificate Secret, by name"
    );

    // Only the operator's own ServiceAccount may lift the scheduling gate.
    let gate_owner = format!(
        "--gate-owner=system:serviceaccount:{NAMESPACE}:{}",
        op_pod.service_account_name.as_deref().unwrap_or_default()
    );
    assert!(
        args.contains(&gate_owner.as_str()),
        "operator args {args:?} lack {gate_owner}"
    );
    // Its webhook configurations go with its ClusterRole on uninstall.
    let owner = format!("--webhook-owner-cluster-role={op_name}");
    assert!(
        args.contains(&owner.as_str()),
        "operator args {args:?} lack {owner}"
    );

    check_aggregated_roles(m);

    // Every binding binds a role the chart renders to a ServiceAccount it renders.
    let accounts: BTreeSet<&str> = m
        .service_accounts
        .iter()
        .filter_map(|a| a.metadata.name.as_deref())
        .collect();
    let role_names: BTreeSet<(&str, &str)> = m
        .cluster_roles
        .iter()
        .filter_map(|r| r.metadata.name.as_deref().map(|n| ("ClusterRole", n)))
        .chain(
            m.roles
                .iter()
                .filter_map(|r| r.metadata.name.as_deref().map(|n| ("Role", n))),
        )
        .collect();
    let bindings = m
        .cluster_role_bindings
        .iter()
        .map(|b| (&b.role_ref, b.subjects.as_deref()))
        .chain(
            m.role_bindings
                .iter()
                .map(|b| (&b.role_ref, b.subjects.as_deref())),
        );
    for (role_ref, subjects) in bindings {
        assert!(
            role_names.contains(&(role_ref.kind.as_str(), role_ref.name.as_str())),
            "binding to unrendered {} {}",
            role_ref.kind,
            role_ref.name
        );
        for s in subjects.unwrap_or_default() {
            assert_eq!(s.kind, "ServiceAccount");
            assert_eq!(s.namespace.as_deref(), Some(NAMESPACE));
            assert!(
                accounts.contains(s.name.as_str()),
                "binding to unrendered account {}",
                s.name
            );
        }
    }
}

/// The device plugin DaemonSet: its mounts, its RBAC, its flags.
fn check_device_plugin(m: &Manifests, version: &str, want_args: &[&str], kubelet_dir: &str) {
    let ds = m.device_plugin();
    let name = ds.metadata.name.as_deref().expect("named");
    assert_eq!(name, "gpupool-device-plugin");
    let pod = pod_spec_of_daemon_set(ds);
    assert_locked_down(pod, "device plugin");
    assert_eq!(
        pod.priority_class_name.as_deref(),
        Some("system-node-critical")
    );
    assert_eq!(pod.service_account_name.as_deref(), Some(name));
    let container = &pod.containers[0];
    assert_eq!(
        container.image.as_deref(),
        Some(format!("ghcr.io/gpupool/gpupool-device-plugin:{version}").as_str())
    );
    let args = args_of(container);
    for want in want_args {
        assert!(
            args.contains(want),
            "device plugin args {args:?} lack {want}"
        );
    }
    assert!(
        args.contains(&"--node-name=$(NODE_NAME)"),
        "device plugin args {args:?}"
    );
    let liveness = container
        .liveness_probe
        .as_ref()
        .and_then(|p| p.http_get.as_ref())
        .expect("device plugin liveness probe");
    assert_eq!(liveness.path.as_deref(), Some("/healthz"));
    assert_eq!(
        liveness.port,
        k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String("metrics".into())
    );
    let node_name = container
        .env
        .iter()
        .flatten()
        .find(|e| e.name == "NODE_NAME")
        .and_then(|e| e.value_from.as_ref())
        .and_then(|v| v.field_ref.as_ref())
        .map(|f| f.field_path.as_str());
    assert_eq!(
        node_name,
        Some("spec.nodeName"),
        "NODE_NAME from the downward API"
    );

    // Host mounts: the kubelet's directories, never socket files.
    let volumes = pod.volumes.as_deref().unwrap_or_default();
    let mut host_paths = BTreeMap::new();
    for v in volumes {
        if let Some(hp) = &v.host_path {
            assert_eq!(
                hp.type_.as_deref(),
                Some("Directory"),
                "hostPath volume {} must be type Directory",
                v.name
            );
            host_paths.insert(v.name.as_str(), hp.path.as_str());
        }
    }
    let device_plugins = format!("{kubelet_dir}/device-plugins");
    let pod_resources = format!("{kubelet_dir}/pod-resources");
    assert_eq!(
        host_paths,
        BTreeMap::from([
            ("device-plugins", device_plugins.as_str()),
            ("pod-resources", pod_resources.as_str()),
        ]),
        "host mounts"
    );
    let mounts = container.volume_mounts.as_deref().unwrap_or_default();
    for (volume, path) in &host_paths {
        let mount = mounts
            .iter()
            .find(|vm| vm.name == *volume)
            .unwrap_or_else(|| panic!("volume {volume} is not mounted"));
        assert_eq!(
            mount.mount_path, *path,
            "{volume} mounted where the kubelet has it"
        );
    }
    assert!(args.contains(&format!("--kubelet-dir={kubelet_dir}").as_str()));

    let have = grants(m.cluster_role(name).rules.as_deref().unwrap_or_default());
    let want = expected_grants(&[
        ("", "nodes", &["get", "patch"], &[]),
        ("gpupool.io", "gpuleases", &["get", "list", "watch"], &[]),
        ("gpupool.io", "gpuleases/status", &["patch"], &[]),
    ]);
    assert_eq!(have, want, "device plugin ClusterRole");
    let user = format!("system:serviceaccount:{NAMESPACE}:{name}");
    check_node_restriction(m, name, &user);
    // The operator lets this user write only GPUs/Bound of its node's leases.
    let op_args = args_of(&pod_spec_of_deployment(m.operator()).containers[0]);
    let flag = format!("--device-plugin-user={user}");
    assert!(
        op_args.contains(&flag.as_str()),
        "operator args {op_args:?} lack {flag}"
    );

    let ds_labels = pod_labels(
        ds.spec
            .template
            .metadata
            .as_ref()
            .and_then(|m| m.labels.as_ref()),
    );
    let metrics = m.service(&format!("{name}-metrics"));
    let selector = metrics
        .spec
        .as_ref()
        .and_then(|s| s.selector.clone())
        .unwrap_or_default();
    assert!(
        selects(&selector, &ds_labels),
        "metrics Service selects the device plugin pods"
    );
}

/// The two ValidatingAdmissionPolicies holding the device plugin `name`
/// (ServiceAccount user `user`) to the node its token names, each bound with
/// Deny.
fn check_node_restriction(m: &Manifests, name: &str, user: &str) {
    const NODE_VAR: &str = "request.userInfo.extra['authentication.kubernetes.io/node-name']";
    let policies: BTreeMap<&str, &ValidatingAdmissionPolicy> = m
        .admission_policies
        .iter()
        .map(|p| (p.metadata.name.as_deref().unwrap_or_default(), p))
        .collect();
    let nodes_name = format!("{name}-nodes");
    let leases_name = format!("{name}-leases");
    assert_eq!(
        policies.keys().copied().collect::<BTreeSet<_>>(),
        BTreeSet::from([nodes_name.as_str(), leases_name.as_str()]),
        "node-restriction policies"
    );
    let bindings: BTreeMap<&str, &ValidatingAdmissionPolicyBinding> = m
        .admission_policy_bindings
        .iter()
        .map(|b| (b.metadata.name.as_deref().unwrap_or_default(), b))
        .collect();
    for (policy_name, resource, group, checks) in [
        (
            nodes_name.as_str(),
            "nodes",
            "",
            &["object.metadata.name == variables.nodeName"][..],
        ),
        (
            leases_name.as_str(),
            "gpuleases/status",
            "gpupool.io",
            &[
                "oldObject.status.node == variables.nodeName",
                "object.status.node == variables.nodeName",
            ][..],
        ),
    ] {
        let spec = policies[policy_name].spec.as_ref().expect("policy spec");
        assert_eq!(
            spec.failure_policy.as_deref(),
            Some("Fail"),
            "{policy_name}"
        );
        let rules = spec
            .match_constraints
            .as_ref()
            .and_then(|c| c.resource_rules.clone())
            .unwrap_or_default();
        assert_eq!(rules.len(), 1, "{policy_name}: one resource rule");
        assert_eq!(
            rules[0].resources.as_deref(),
            Some(&[resource.to_owned()][..])
        );
        assert_eq!(
            rules[0].api_groups.as_deref(),
            Some(&[group.to_owned()][..])
        );
        assert_eq!(
            rules[0].operations.as_deref(),
            Some(&["UPDATE".to_owned()][..]),
            "{policy_name}: PATCH is admitted as UPDATE"
        );
        // Only requests by the device plugin's ServiceAccount are judged.
        let conditions = spec.match_conditions.clone().unwrap_or_default();
        assert_eq!(conditions.len(), 1, "{policy_name}");
        assert_eq!(
            conditions[0].expression,
            format!("request.userInfo.username == '{user}'"),
            "{policy_name}"
        );
        let variables = spec.variables.clone().unwrap_or_default();
        assert_eq!(variables.len(), 1, "{policy_name}");
        assert_eq!(variables[0].name, "nodeName");
        assert!(
            variables[0].expression.contains(NODE_VAR),
            "{policy_name}: nodeName from the token's extra: {}",
            variables[0].expression
        );
        let validations = spec.validations.clone().unwrap_or_default();
        // A token that names no node is denied outright.
        assert_eq!(
            validations[0].expression, "variables.nodeName != ''",
            "{policy_name}"
        );
        assert!(
            validations[0]
                .message
                .as_deref()
                .is_some_and(|m| m.contains("devicePlugin.nodeRestriction.enabled=false")),
            "{policy_name}: the denial names the value that turns it off"
        );
        for check in checks {
            assert!(
                validations[1].expression.contains(check),
                "{policy_name}: {:?} lacks {check}",
                validations[1].expression
            );
        }
        for v in &validations {
            assert_eq!(v.reason.as_deref(), Some("Forbidden"), "{policy_name}");
        }
        let binding = bindings
            .get(policy_name)
            .map(|b| &b.spec)
            .unwrap_or_else(|| panic!("no binding for {policy_name}"));
        assert_eq!(binding.policy_name, policy_name);
        assert_eq!(binding.validation_actions, ["Deny"], "{policy_name}");
    }
    assert_eq!(bindings.len(), 2, "one binding per policy");
}

/// The ClusterRoles the built-in view/edit/admin roles aggregate: read-only
/// access to leases and classes.
fn check_aggregated_roles(m: &Manifests) {
    let read = expected_grants(&[
        ("gpupool.io", "gpuleases", &["get", "list", "watch"], &[]),
        (
            "gpupool.io",
            "gpuleaseclasses",
            &["get", "list", "watch"],
            &[],
        ),
    ]);
    let aggregated: BTreeMap<&str, BTreeSet<&str>> = m
        .cluster_roles
        .iter()
        .filter_map(|r| {
            let labels: BTreeSet<&str> = r
                .metadata
                .labels
                .iter()
                .flatten()
                .filter(|(k, v)| {
                    k.starts_with("rbac.authorization.k8s.io/aggregate-to-") && v.as_str() == "true"
                })
                .map(|(k, _)| k.trim_start_matches("rbac.authorization.k8s.io/aggregate-to-"))
                .collect();
            (!labels.is_empty()).then(|| (r.metadata.name.as_deref().unwrap_or_default(), labels))
        })
        .collect();
    assert_eq!(
        aggregated,
        BTreeMap::from([
            ("gpupool-edit", BTreeSet::from(["admin", "edit"])),
            ("gpupool-view", BTreeSet::from(["view"])),
        ]),
        "aggregated ClusterRoles and the roles they join"
    );
    for name in aggregated.keys() {
        let role = m.cluster_role(name);
        assert_eq!(
            grants(role.rules.as_deref().unwrap_or_default()),
            read,
            "{name}: read-only on leases and classes"
        );
        assert!(role.aggregation_rule.is_none());
    }
}

fn env_of<'a>(c: &'a Container, name: &str) -> Option<&'a str> {
    c.env
        .iter()
        .flatten()
        .find(|e| e.name == name)
        .and_then(|e| e.value.as_deref())
}

// ---------------------------------------------------------------------------
// Tests that need no helm.

#[test]
fn chart_crds_are_the_generated_crds() {
    let top = repo_root().join("crds");
    let chart = chart_dir().join("crds");
    let names = |dir: &Path| -> BTreeSet<String> {
        std::fs::read_dir(dir)
            .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
            .map(|e| {
                e.expect("dir entry")
                    .file_name()
                    .to_string_lossy()
                    .into_owned()
            })
            .collect()
    };
    let fix =
        "run `cp crds/*.yaml charts/gpupool/crds/` (helm installs only CRDs inside the chart)";
    assert_eq!(
        names(&top),
        names(&chart),
        "charts/gpupool/crds/ and crds/ hold different files; {fix}"
    );
    for file in names(&top) {
        let want = std::fs::read(top.join(&file)).expect("read crds/");
        let have = std::fs::read(chart.join(&file)).expect("read chart crds/");
        assert!(
            have == want,
            "charts/gpupool/crds/{file} differs from crds/{file}; {fix}"
        );
    }
}

#[test]
fn chart_app_version_is_the_workspace_version() {
    let text = std::fs::read_to_string(chart_dir().join("Chart.yaml")).expect("Chart.yaml");
    let chart: Value = serde_yaml::from_str(&text).expect("Chart.yaml parses");
    assert_eq!(chart["apiVersion"], "v2");
    assert_eq!(
        chart["appVersion"].as_str(),
        Some(env!("CARGO_PKG_VERSION")),
        "Chart.yaml appVersion must be the workspace version (the default image tag)"
    );
}

// ---------------------------------------------------------------------------
// Tests that run helm.

#[test]
fn helm_lint_strict_passes_for_both_profiles() {
    let Some(helm) = helm() else { return };
    run_helm(&helm, &["lint", "--strict", "."]).unwrap_or_else(|e| panic!("lint: {e}"));
    run_helm(&helm, &["lint", "--strict", ".", "-f", KIND_VALUES])
        .unwrap_or_else(|e| panic!("lint kind profile: {e}"));
}

#[test]
fn default_values_render_strictly_typed_manifests() {
    let Some(helm) = helm() else { return };
    let version = env!("CARGO_PKG_VERSION");
    let m = render(&helm, &[]);
    assert_eq!(
        m.kinds(),
        BTreeMap::from([
            ("ClusterRole", 4),
            ("ClusterRoleBinding", 2),
            ("CustomResourceDefinition", 2),
            ("DaemonSet", 1),
            ("Deployment", 1),
            ("GpuLeaseClass", 1),
            ("PodDisruptionBudget", 1),
            ("Role", 1),
            ("RoleBinding", 1),
            ("Service", 2),
            ("ServiceAccount", 2),
            ("ValidatingAdmissionPolicy", 2),
            ("ValidatingAdmissionPolicyBinding", 2),
        ])
    );
    check_common(&m, version);
    check_device_plugin(
        &m,
        version,
        &[
            "--discovery=auto",
            "--sessions-per-gpu=1",
            "--resource-name=gpupool/slot",
        ],
        "/var/lib/kubelet",
    );
    // nvml/auto discovery: the NVIDIA runtime exposes the driver to the plugin.
    let c = &pod_spec_of_daemon_set(m.device_plugin()).containers[0];
    assert_eq!(env_of(c, "NVIDIA_VISIBLE_DEVICES"), Some("all"));
    assert!(!args_of(c).iter().any(|a| a.starts_with("--static")));

    let class = &m.classes[0];
    assert_eq!(class.metadata.name.as_deref(), Some("default"));
    assert!(class.spec.default);
    assert_eq!(class.spec.resource_name, "gpupool/slot");
    assert_eq!(class.spec.helpers.grace_period_seconds, 30);
}

#[test]
fn kind_profile_renders_static_gpus() {
    let Some(helm) = helm() else { return };
    let version = env!("CARGO_PKG_VERSION");
    let m = render(&helm, &["-f", KIND_VALUES]);
    check_common(&m, version);
    check_device_plugin(
        &m,
        version,
        &[
            "--discovery=static",
            "--static-config=/etc/gpupool/gpus.yaml",
            "--sessions-per-gpu=2",
        ],
        "/var/lib/kubelet",
    );
    let pod = pod_spec_of_daemon_set(m.device_plugin());
    let c = &pod.containers[0];
    assert_eq!(
        env_of(c, "NVIDIA_VISIBLE_DEVICES"),
        None,
        "static discovery needs no driver"
    );

    // The static GPU list is a ConfigMap in the format --static-config reads.
    assert_eq!(m.config_maps.len(), 1);
    let cm = &m.config_maps[0];
    let gpus_yaml = cm
        .data
        .as_ref()
        .and_then(|d| d.get("gpus.yaml"))
        .expect("gpus.yaml in the ConfigMap");
    // The device plugin's own parser reads it in
    // `the_static_gpu_list_is_what_the_device_plugin_reads`.
    assert!(gpus_yaml.contains("uuid: GPU-"), "{gpus_yaml}");
    let mounted = pod
        .volumes
        .iter()
        .flatten()
        .any(|v| v.config_map.as_ref().map(|c| c.name.as_str()) == cm.metadata.name.as_deref());
    assert!(mounted, "the ConfigMap is mounted into the device plugin");
    assert_eq!(m.classes[0].spec.helpers.grace_period_seconds, 5);
}

#[test]
fn static_gpu_count_and_custom_kubelet_dir_render() {
    let Some(helm) = helm() else { return };
    let m = render(
        &helm,
        &[
            "--set",
            "devicePlugin.discovery=static",
            "--set",
            "devicePlugin.staticGpus=4",
            "--set",
            "devicePlugin.kubeletDir=/var/lib/k0s/kubelet/",
            "--set",
            "devicePlugin.devices={0,2}",
        ],
    );
    check_device_plugin(
        &m,
        env!("CARGO_PKG_VERSION"),
        &["--discovery=static", "--static-gpus=4", "--devices=0,2"],
        "/var/lib/k0s/kubelet",
    );
    assert!(
        m.config_maps.is_empty(),
        "no ConfigMap without staticConfig"
    );
}

#[test]
fn optional_objects_follow_their_switches() {
    let Some(helm) = helm() else { return };
    let m = render(
        &helm,
        &[
            "--set",
            "serviceMonitor.enabled=true",
            "--set",
            "serviceMonitor.labels.release=prometheus",
        ],
    );
    assert_eq!(
        m.service_monitors.len(),
        2,
        "operator and device plugin ServiceMonitors"
    );
    for sm in &m.service_monitors {
        assert_eq!(
            sm.metadata
                .labels
                .as_ref()
                .and_then(|l| l.get("release"))
                .map(String::as_str),
            Some("prometheus")
        );
        assert_eq!(sm.spec.endpoints[0].port, "metrics");
        assert_eq!(sm.spec.namespace_selector.match_names, [NAMESPACE]);
    }

    let m = render(
        &helm,
        &[
            "--set",
            "defaultClass.enabled=false",
            "--set",
            "devicePlugin.enabled=false",
            "--set",
            "operator.podDisruptionBudget.enabled=false",
        ],
    );
    assert!(m.classes.is_empty(), "no default class");
    assert!(m.daemon_sets.is_empty(), "no device plugin");
    assert!(m.pdbs.is_empty(), "no PodDisruptionBudget");
    assert_eq!(
        m.cluster_roles.len(),
        3,
        "the operator's ClusterRole and the two aggregated ones"
    );
    assert!(m.admission_policies.is_empty() && m.admission_policy_bindings.is_empty());
    assert_eq!(m.deployments.len(), 1, "the operator stays");
    let op_args = args_of(&pod_spec_of_deployment(m.operator()).containers[0]);
    assert!(
        !op_args
            .iter()
            .any(|a| a.starts_with("--device-plugin-user")),
        "no device plugin, no device plugin user: {op_args:?}"
    );

    // Node restriction off (clusters whose tokens lack the node name): the
    // plugin runs with its RBAC only.
    let m = render(
        &helm,
        &["--set", "devicePlugin.nodeRestriction.enabled=false"],
    );
    assert_eq!(m.daemon_sets.len(), 1);
    assert!(m.admission_policies.is_empty() && m.admission_policy_bindings.is_empty());
}

#[test]
fn network_policy_admits_only_the_configured_sources() {
    let Some(helm) = helm() else { return };
    assert!(
        render(&helm, &[]).network_policies.is_empty(),
        "no NetworkPolicy by default"
    );
    let m = render(
        &helm,
        &[
            "--set",
            "operator.networkPolicy.enabled=true",
            "--set",
            "operator.networkPolicy.webhook.apiServerCIDRs={10.0.0.0/28,fd00::/64}",
            "--set",
            "operator.networkPolicy.webhook.from[0].namespaceSelector.matchLabels.role=control-plane",
            "--set",
            "operator.networkPolicy.metrics.from[0].namespaceSelector.matchLabels.kubernetes\\.io/metadata\\.name=monitoring",
        ],
    );
    assert_eq!(m.network_policies.len(), 1);
    let np = &m.network_policies[0];
    assert_eq!(np.metadata.name.as_deref(), Some("gpupool-operator"));
    assert_eq!(np.metadata.namespace.as_deref(), Some(NAMESPACE));
    let spec = np.spec.as_ref().expect("spec");
    let op_labels = pod_labels(
        m.operator()
            .spec
            .template
            .metadata
            .as_ref()
            .and_then(|m| m.labels.as_ref()),
    );
    assert!(
        selects(
            spec.pod_selector
                .as_ref()
                .and_then(|s| s.match_labels.as_ref())
                .expect("podSelector"),
            &op_labels
        ),
        "the policy selects the operator pods"
    );
    assert_eq!(
        spec.policy_types.as_deref(),
        Some(&["Ingress".to_owned()][..])
    );
    let rules = spec.ingress.as_deref().unwrap_or_default();
    assert_eq!(rules.len(), 2, "webhook and metrics rules");
    let ports = |i: usize| -> Vec<i32> {
        rules[i]
            .ports
            .iter()
            .flatten()
            .map(|p| match p.port {
                Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(n)) => n,
                ref other => panic!("numeric port expected, got {other:?}"),
            })
            .collect()
    };
    assert_eq!(ports(0), [9443], "webhook port");
    assert_eq!(ports(1), [8080], "metrics port");
    let peers = |i: usize| serde_json::to_value(&rules[i].from).expect("peers");
    assert_eq!(
        peers(0),
        serde_json::json!([
            {"ipBlock": {"cidr": "10.0.0.0/28"}},
            {"ipBlock": {"cidr": "fd00::/64"}},
            {"namespaceSelector": {"matchLabels": {"role": "control-plane"}}},
        ]),
        "the webhook admits the API server only"
    );
    assert_eq!(
        peers(1),
        serde_json::json!([
            {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}},
        ])
    );

    // Without metrics sources, the metrics port gets no rule (closed to pods).
    let m = render(
        &helm,
        &[
            "--set",
            "operator.networkPolicy.enabled=true",
            "--set",
            "operator.networkPolicy.webhook.apiServerCIDRs={192.168.0.10/32}",
            "--set",
            "operator.webhookPort=10250",
        ],
    );
    let rules = m.network_policies[0]
        .spec
        .as_ref()
        .and_then(|s| s.ingress.clone())
        .unwrap_or_default();
    assert_eq!(rules.len(), 1, "the webhook rule only");
    assert_eq!(
        serde_json::to_value(&rules[0]).expect("rule"),
        serde_json::json!({
            "from": [{"ipBlock": {"cidr": "192.168.0.10/32"}}],
            "ports": [{"port": 10250, "protocol": "TCP"}],
        }),
        "follows operator.webhookPort"
    );
}

#[test]
fn wrong_value_types_fail_through_the_schema() {
    let Some(helm) = helm() else { return };
    let cases: &[(&[&str], &[&str])] = &[
        (
            &["--set", "operator.replicas=two"],
            &["/operator/replicas", "want integer"],
        ),
        (
            &["--set", "devicePlugin.sessionsPerGpu=true"],
            &["/devicePlugin/sessionsPerGpu", "want integer"],
        ),
        (
            &["--set", "devicePlugin.sessionsPerGpu=101"],
            &["/devicePlugin/sessionsPerGpu", "maximum"],
        ),
        (
            &["--set", "devicePlugin.sessionsPerGpu=0"],
            &["/devicePlugin/sessionsPerGpu", "minimum"],
        ),
        (
            &["--set", "devicePlugin.discovery=cuda"],
            &["/devicePlugin/discovery", "static"],
        ),
        (
            &["--set", "unknownKey=1"],
            &["additional properties 'unknownKey' not allowed"],
        ),
        (
            &["--set", "operator.replica=3"],
            &["/operator", "'replica' not allowed"],
        ),
        (
            &["--set", "defaultClass.spec.admission.ordering=LIFO"],
            &["/defaultClass/spec/admission/ordering"],
        ),
        (
            &["--set", "operator.networkPolicy.enabled=yes"],
            &["/operator/networkPolicy/enabled", "want boolean"],
        ),
        (
            &[
                "--set",
                "operator.networkPolicy.webhook.apiServerCIDRs=10.0.0.1/32",
            ],
            &[
                "/operator/networkPolicy/webhook/apiServerCIDRs",
                "want array",
            ],
        ),
        (
            &[
                "--set",
                "operator.networkPolicy.webhook.apiServerCIDRs={apiserver}",
            ],
            &[
                "/operator/networkPolicy/webhook/apiServerCIDRs/0",
                "does not match pattern",
            ],
        ),
        (
            &["--set", "operator.networkPolicy.metrics.from[0].pods=all"],
            &[
                "/operator/networkPolicy/metrics/from/0",
                "'pods' not allowed",
            ],
        ),
        (
            &["--set", "devicePlugin.nodeRestriction.enabled=1"],
            &["/devicePlugin/nodeRestriction/enabled", "want boolean"],
        ),
    ];
    for (args, wants) in cases {
        let err = template(&helm, args).expect_err("helm template must refuse the value");
        assert!(
            err.contains("schema"),
            "{args:?}: not refused by the schema:\n{err}"
        );
        for want in *wants {
            assert!(err.contains(want), "{args:?}: error lacks {want:?}:\n{err}");
        }
    }
}

#[test]
fn contradictory_values_fail_with_a_message_naming_them() {
    let Some(helm) = helm() else { return };
    let cases: &[(&[&str], &str)] = &[
        (
            &["--set", "devicePlugin.discovery=static"],
            "devicePlugin.discovery is \"static\" but neither devicePlugin.staticGpus nor devicePlugin.staticConfig is set",
        ),
        (
            &["-f", KIND_VALUES, "--set", "devicePlugin.staticGpus=2"],
            "devicePlugin.staticGpus and devicePlugin.staticConfig are both set",
        ),
        (
            &["--set", "devicePlugin.staticGpus=2"],
            "only used with discovery \"static\"",
        ),
        (
            &["--set", "operator.leaderElect=false"],
            "operator.replicas is 2 but operator.leaderElect is false",
        ),
        (
            &["--set", "operator.replicas=1"],
            "operator.podDisruptionBudget.minAvailable (1) must be below operator.replicas (1)",
        ),
        (
            &["--set", "operator.metricsPort=9443"],
            "operator.webhookPort and operator.metricsPort are both 9443",
        ),
        (
            &["--set", "operator.networkPolicy.enabled=true"],
            "operator.networkPolicy.enabled is true but neither operator.networkPolicy.webhook.apiServerCIDRs nor operator.networkPolicy.webhook.from is set",
        ),
        (
            &["--set", "devicePlugin.resourceName=example.com/gpu"],
            "defaultClass.spec.resourceName (\"gpupool/slot\") differs from devicePlugin.resourceName (\"example.com/gpu\")",
        ),
    ];
    for (args, want) in cases {
        let err =
            template(&helm, args).expect_err("helm template must refuse contradictory values");
        assert!(err.contains(want), "{args:?}: error lacks {want:?}:\n{err}");
    }
    // The same values, made consistent, render.
    template(
        &helm,
        &[
            "--set",
            "operator.replicas=1",
            "--set",
            "operator.podDisruptionBudget.enabled=false",
        ],
    )
    .unwrap_or_else(|e| panic!("one replica without a PDB must render: {e}"));
    template(
        &helm,
        &[
            "--set",
            "operator.replicas=1",
            "--set",
            "operator.leaderElect=false",
            "--set",
            "operator.podDisruptionBudget.minAvailable=0",
        ],
    )
    .unwrap_or_else(|e| panic!("one replica without leader election must render: {e}"));
}

#[test]
fn strict_check_rejects_unknown_fields() {
    // The round trip must catch a field the type does not know, or every
    // other test here proves nothing.
    let doc: Value = serde_json::json!({
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {"name": "x"},
        "automountServiceAcountToken": true,
    });
    let caught = std::panic::catch_unwind(|| strictly::<ServiceAccount>(&doc, "typo"));
    let message = caught
        .expect_err("an unknown field must fail")
        .downcast::<String>()
        .map(|s| *s)
        .unwrap_or_default();
    assert!(
        message.contains(".automountServiceAcountToken: unknown to the type"),
        "{message}"
    );
}

/// Compares the values schema of `defaultClass.spec` with the CRD's schema of
/// `GpuLeaseClass.spec`: same fields, types, enums and bounds, so the chart
/// refuses at `helm install` what the API server would refuse later.
fn assert_schema_mirrors_crd(path: &str, values: &Value, crd: &Value) {
    assert_eq!(values["type"], crd["type"], "defaultClass.spec{path}: type");
    assert_eq!(values["enum"], crd["enum"], "defaultClass.spec{path}: enum");
    for bound in ["minimum", "maximum"] {
        assert_eq!(
            values[bound].as_f64(),
            crd[bound].as_f64(),
            "defaultClass.spec{path}: {bound}"
        );
    }
    let (Some(have), Some(want)) = (
        values["properties"].as_object(),
        crd["properties"].as_object(),
    ) else {
        return;
    };
    let have_keys: BTreeSet<&String> = have.keys().collect();
    let want_keys: BTreeSet<&String> = want.keys().collect();
    assert_eq!(
        have_keys, want_keys,
        "defaultClass.spec{path}: values.schema.json and the GpuLeaseClass CRD list different fields"
    );
    for (key, value) in have {
        assert_schema_mirrors_crd(&format!("{path}.{key}"), value, &want[key]);
    }
}

#[test]
fn default_class_values_schema_mirrors_the_crd() {
    let schema: Value = serde_json::from_str(
        &std::fs::read_to_string(chart_dir().join("values.schema.json")).expect("schema"),
    )
    .expect("values.schema.json is JSON");
    let crd: Value = serde_yaml::from_str(
        &std::fs::read_to_string(repo_root().join("crds/gpuleaseclasses.yaml")).expect("crd"),
    )
    .expect("CRD is YAML");
    let crd_spec = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"];
    assert!(crd_spec.is_object(), "GpuLeaseClass CRD has a spec schema");
    assert_schema_mirrors_crd(
        "",
        &schema["properties"]["defaultClass"]["properties"]["spec"],
        crd_spec,
    );
    assert_eq!(
        schema["additionalProperties"],
        Value::Bool(false),
        "values.schema.json must refuse unknown top-level keys"
    );
}

/// The schema node describing `path` in values.yaml, if the schema declares it.
fn schema_node<'a>(schema: &'a Value, path: &[String]) -> Option<&'a Value> {
    path.iter()
        .try_fold(schema, |node, key| node["properties"].get(key.as_str()))
}

#[test]
fn every_declared_value_has_a_comment() {
    let schema: Value = serde_json::from_str(
        &std::fs::read_to_string(chart_dir().join("values.schema.json")).expect("schema"),
    )
    .expect("values.schema.json is JSON");
    let text = std::fs::read_to_string(chart_dir().join("values.yaml")).expect("values.yaml");
    let mut stack: Vec<(usize, String)> = Vec::new();
    let mut previous_is_comment = false;
    let mut checked = 0;
    let mut missing = Vec::new();
    for (number, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        let indent = line.len() - trimmed.len();
        if trimmed.is_empty() {
            previous_is_comment = false;
            continue;
        }
        if trimmed.starts_with('#') {
            previous_is_comment = true;
            continue;
        }
        let key = trimmed.split_once(':').map(|(k, _)| k);
        match key {
            Some(key) if !trimmed.starts_with('-') && !key.contains(' ') => {
                stack.retain(|(i, _)| *i < indent);
                stack.push((indent, key.to_owned()));
                let path: Vec<String> = stack.iter().map(|(_, k)| k.clone()).collect();
                // Keys inside free-form maps (resources, strategy, ...) are not
                // declared by the schema and are documented by their parent.
                if schema_node(&schema, &path).is_some() {
                    checked += 1;
                    if !previous_is_comment {
                        missing.push(format!("line {}: {}", number + 1, path.join(".")));
                    }
                }
            }
            _ => {}
        }
        previous_is_comment = false;
    }
    assert!(
        checked > 50,
        "only {checked} declared values found in values.yaml"
    );
    assert!(
        missing.is_empty(),
        "values.yaml values without a comment right above them:\n  {}",
        missing.join("\n  ")
    );
}

// ---------------------------------------------------------------------------
// The rendered command lines, checked by the real binaries' own parsers.

/// A workspace binary next to this test (or one directory up, from
/// `target/<profile>/deps`), built by `cargo build --workspace --bins`.
fn workspace_binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let dir = exe.parent().expect("test binary has a directory");
    let candidates = [dir.join(name), dir.join("..").join(name)];
    candidates
        .iter()
        .find(|p| p.is_file())
        .cloned()
        .unwrap_or_else(|| {
            panic!(
                "{name} is not built (looked at {candidates:?}); run `cargo build --workspace --bins` first"
            )
        })
}

/// Runs `binary <args> --help`: clap parses (and type-checks) every argument
/// before it reaches `--help`, so exit 0 means each flag the chart passes
/// exists and its value parses.
fn parse_with(binary: &Path, args: &[&str]) -> Result<(), String> {
    let out = Command::new(binary)
        .args(args)
        .arg("--help")
        .env_remove("KUBECONFIG")
        .output()
        .expect("binary runs");
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{} {args:?} exited with {}:\n{}",
            binary.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

#[test]
fn the_binaries_accept_the_rendered_flags() {
    let Some(helm) = helm() else { return };
    let operator = workspace_binary("gpupool-operator");
    let device_plugin = workspace_binary("gpupool-device-plugin");
    let profiles: [&[&str]; 3] = [
        &[],
        &["-f", KIND_VALUES],
        &[
            "--set",
            "devicePlugin.discovery=static",
            "--set",
            "devicePlugin.staticGpus=4",
            "--set",
            "devicePlugin.devices={0,2}",
            "--set",
            "operator.leaderElect=false",
            "--set",
            "operator.replicas=1",
            "--set",
            "operator.podDisruptionBudget.enabled=false",
        ],
    ];
    for profile in profiles {
        let m = render(&helm, profile);
        let op_args = args_of(&pod_spec_of_deployment(m.operator()).containers[0]);
        parse_with(&operator, &op_args).unwrap_or_else(|e| panic!("profile {profile:?}: {e}"));
        let dp_args = args_of(&pod_spec_of_daemon_set(m.device_plugin()).containers[0]);
        parse_with(&device_plugin, &dp_args).unwrap_or_else(|e| panic!("profile {profile:?}: {e}"));
    }
    // The check itself: a flag the binary does not have is refused.
    let refused = parse_with(&operator, &["--no-such-flag=1"]);
    assert!(refused.is_err(), "an unknown flag must fail the parse");
}

#[test]
fn the_static_gpu_list_is_what_the_device_plugin_reads() {
    let Some(helm) = helm() else { return };
    let m = render(&helm, &["-f", KIND_VALUES]);
    let gpus_yaml = m.config_maps[0]
        .data
        .as_ref()
        .and_then(|d| d.get("gpus.yaml"))
        .expect("gpus.yaml in the ConfigMap");
    let gpus =
        gpupool_device_plugin::discovery::static_config::parse_config("gpus.yaml", gpus_yaml)
            .unwrap_or_else(|e| {
                panic!("the device plugin refuses the chart's static GPU list: {e}")
            });
    let indices: Vec<u32> = gpus.iter().map(|g| g.index).collect();
    assert_eq!(indices, [0, 1]);
}

#[test]
fn flags_name_the_objects_of_any_release() {
    let Some(helm) = helm() else { return };
    let text = run_helm(
        &helm,
        &["template", "team-a", ".", "--namespace", "ml-infra"],
    )
    .unwrap_or_else(|e| panic!("helm template team-a: {e}"));
    let m = Manifests::parse(&text);
    let op = m.operator();
    let name = op.metadata.name.as_deref().expect("named");
    assert_eq!(name, "team-a-gpupool-operator");
    let pod = pod_spec_of_deployment(op);
    let account = pod
        .service_account_name
        .as_deref()
        .expect("service account");
    assert!(
        m.service_accounts
            .iter()
            .any(|a| a.metadata.name.as_deref() == Some(account)),
        "the pod's ServiceAccount {account} is rendered"
    );
    let args = args_of(&pod.containers[0]);
    let service = m.service(name);
    let webhook_service = format!(
        "--webhook-service=ml-infra/{}",
        service.metadata.name.as_deref().expect("named")
    );
    let gate_owner = format!("--gate-owner=system:serviceaccount:ml-infra:{account}");
    let plugin_user = "system:serviceaccount:ml-infra:team-a-gpupool-device-plugin";
    let device_plugin_user = format!("--device-plugin-user={plugin_user}");
    for want in [
        webhook_service.as_str(),
        gate_owner.as_str(),
        device_plugin_user.as_str(),
        "--namespace=ml-infra",
    ] {
        assert!(args.contains(&want), "operator args {args:?} lack {want}");
    }
    assert_eq!(
        pod_spec_of_daemon_set(m.device_plugin())
            .service_account_name
            .as_deref(),
        Some("team-a-gpupool-device-plugin")
    );
    for policy in &m.admission_policies {
        let conditions = policy
            .spec
            .as_ref()
            .and_then(|s| s.match_conditions.clone())
            .unwrap_or_default();
        assert_eq!(
            conditions[0].expression,
            format!("request.userInfo.username == '{plugin_user}'"),
            "the policies judge this release's device plugin"
        );
    }
    let roles: BTreeSet<&str> = m
        .cluster_roles
        .iter()
        .filter_map(|r| r.metadata.name.as_deref())
        .collect();
    assert!(
        roles.contains("team-a-gpupool-view") && roles.contains("team-a-gpupool-edit"),
        "{roles:?}"
    );
}
