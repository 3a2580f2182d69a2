//! One kubectl script against the in-memory API server and, when
//! `KUBEBUILDER_ASSETS` is set, against a real kube-apiserver: every
//! command must succeed or fail on both alike, and what the gets print must
//! be equal. The imperative `kubectl create <kind>` commands send protobuf
//! bodies, which the in-memory server must decode for each kind.
//!
//! Then the header line of `kubectl get` for every built-in kind the
//! in-memory server stores (and `-o wide` where the real one adds
//! columns) must match the real server's, and, without one, the headers
//! the real server is known to print.
//!
//! Needs `kubectl` on the PATH and `KUBEBUILDER_ASSETS`: without them, a
//! failure in CI; elsewhere a skip without kubectl and, without
//! `KUBEBUILDER_ASSETS`, a skip of the comparison only: the in-memory
//! server runs alone, and each command's expected outcome is checked.

use std::path::Path;
use std::process::Command;

use gpupool_sim::control_plane::{ControlPlane, ControlPlaneConfig};
use gpupool_sim_apiserver::{ADMIN_TOKEN, ApiServer, ApiServerConfig};

/// Replaced by the path of a `v1 List` of two ConfigMaps.
const LIST: &str = "{list}";
/// Replaced by the path of a Deployment with `replicas: "two"`.
const BAD_REPLICAS: &str = "{bad-replicas}";
/// Replaced by the path of a pod whose container has no image.
const NO_IMAGE: &str = "{no-image}";

const BAD_REPLICAS_YAML: &str = "apiVersion: apps/v1
kind: Deployment
metadata: {name: two, namespace: diff}
spec:
  replicas: 'two'
  selector: {matchLabels: {app: two}}
  template:
    metadata: {labels: {app: two}}
    spec: {containers: [{name: c, image: x}]}
";

const NO_IMAGE_YAML: &str = "apiVersion: v1
kind: Pod
metadata: {name: no-image, namespace: diff}
spec: {containers: [{name: c}]}
";

const LIST_YAML: &str = "apiVersion: v1
kind: List
items:
- apiVersion: v1
  kind: ConfigMap
  metadata: {name: list-a, namespace: diff}
  data: {a: '1'}
- apiVersion: v1
  kind: ConfigMap
  metadata: {name: list-b, namespace: diff}
";

/// Replaced by the path of one object of each kind whose table is checked.
const KINDS: &str = "{kinds}";

const KINDS_YAML: &str = "apiVersion: v1
kind: Secret
metadata: {name: s, namespace: diff}
stringData: {a: b}
---
apiVersion: apps/v1
kind: ReplicaSet
metadata: {name: rs, namespace: diff}
spec:
  replicas: 1
  selector: {matchLabels: {app: rs}}
  template:
    metadata: {labels: {app: rs}}
    spec: {containers: [{name: c, image: x}]}
---
apiVersion: apps/v1
kind: DaemonSet
metadata: {name: ds, namespace: diff}
spec:
  selector: {matchLabels: {app: ds}}
  template:
    metadata: {labels: {app: ds}}
    spec: {nodeSelector: {disk: ssd}, containers: [{name: c, image: x}]}
---
apiVersion: apps/v1
kind: StatefulSet
metadata: {name: sts, namespace: diff}
spec:
  serviceName: sts
  selector: {matchLabels: {app: sts}}
  template:
    metadata: {labels: {app: sts}}
    spec: {containers: [{name: c, image: x}]}
---
apiVersion: v1
kind: Event
metadata: {name: ev, namespace: diff}
involvedObject: {kind: Pod, name: p, namespace: diff}
reason: Tested
message: a message
type: Normal
source: {component: diff}
firstTimestamp: '2024-01-01T00:00:00Z'
lastTimestamp: '2024-01-01T00:00:00Z'
count: 1
---
apiVersion: coordination.k8s.io/v1
kind: Lease
metadata: {name: lease, namespace: diff}
spec: {holderIdentity: me}
---
apiVersion: v1
kind: Endpoints
metadata: {name: manual, namespace: diff}
subsets: [{addresses: [{ip: 10.0.0.1}], ports: [{port: 80}]}]
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata: {name: pdb, namespace: diff}
spec: {minAvailable: 1, selector: {matchLabels: {app: web}}}
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: np, namespace: diff}
spec: {podSelector: {matchLabels: {app: web}}}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: diff-view}
rules: [{apiGroups: [''], resources: [pods], verbs: [get]}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: diff-view}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: diff-view}
subjects: [{kind: Group, name: viewers, apiGroup: rbac.authorization.k8s.io}]
---
apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingWebhookConfiguration
metadata: {name: diff-hook}
webhooks:
- name: diff.example.com
  clientConfig: {service: {name: nothing, namespace: diff}}
  rules: [{apiGroups: [example.com], apiVersions: [v1], operations: [CREATE], resources: [widgets]}]
  failurePolicy: Ignore
  sideEffects: None
  admissionReviewVersions: [v1]
---
apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingAdmissionPolicy
metadata: {name: diff-policy}
spec:
  failurePolicy: Ignore
  matchConstraints:
    resourceRules: [{apiGroups: [example.com], apiVersions: [v1], operations: [CREATE], resources: [widgets]}]
  validations: [{expression: 'true'}]
---
apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingAdmissionPolicyBinding
metadata: {name: diff-binding}
spec: {policyName: diff-policy, validationActions: [Deny]}
---
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: {name: widgets.diff.example.com}
spec:
  group: diff.example.com
  names: {kind: Widget, plural: widgets}
  scope: Namespaced
  versions:
  - name: v1
    served: true
    storage: true
    schema: {openAPIV3Schema: {type: object}}
---
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: {name: gadgets.diff.example.com}
spec:
  group: diff.example.com
  names: {kind: Gadget, plural: gadgets}
  scope: Namespaced
  versions:
  - name: v1
    served: true
    storage: true
    schema:
      openAPIV3Schema:
        type: object
        x-kubernetes-preserve-unknown-fields: true
        properties:
          status: {type: object, x-kubernetes-preserve-unknown-fields: true, description: What the gadget last saw.}
    additionalPrinterColumns:
    - {name: Items, type: string, jsonPath: '.status.items[*].idx'}
    - {name: Count, type: integer, jsonPath: .status.count}
    - {name: CountText, type: string, jsonPath: .status.count}
    - {name: Ratio, type: number, jsonPath: .status.ratio}
    - {name: Ready, type: boolean, jsonPath: .status.ready}
    - {name: ReadyText, type: string, jsonPath: .status.ready}
    - {name: Obj, type: string, jsonPath: .status.obj}
    - {name: NotInt, type: integer, jsonPath: .status.name}
    - {name: Missing, type: string, jsonPath: .status.missing}
";

/// Replaced by the path of a Gadget whose printer columns read a list, a
/// number, a boolean, an object, a string and nothing.
const GADGET: &str = "{gadget}";

const GADGET_YAML: &str = "apiVersion: diff.example.com/v1
kind: Gadget
metadata: {name: g1, namespace: diff}
status: {items: [{idx: 3}, {idx: 5}], count: 7, ratio: 0.5, ready: true, obj: {a: 1}, name: x}
";

/// The Gadget's row as the real API server fills its printer columns: a
/// path with several results shows the first, a `string` column prints
/// a number or a boolean as text and an object as JSON, and an `integer`
/// column over a string, like a missing field, is empty.
const GADGET_ROW: &str = r#"g1 3 7 7 0.5 true true {"a":1}"#;

/// `kubectl get` commands and the header line (columns separated by one
/// space) the real server prints for them.
const HEADERS: &[(&[&str], &str)] = &[
    (&["get", "namespace", "diff"], "NAME STATUS AGE"),
    (&["get", "configmaps", "-n", "diff"], "NAME DATA AGE"),
    (&["get", "secrets", "-n", "diff"], "NAME TYPE DATA AGE"),
    (&["get", "serviceaccounts", "-n", "diff"], "NAME AGE"),
    (
        &["get", "services", "-n", "diff"],
        "NAME TYPE CLUSTER-IP EXTERNAL-IP PORT(S) AGE",
    ),
    (
        &["get", "services", "-n", "diff", "-o", "wide"],
        "NAME TYPE CLUSTER-IP EXTERNAL-IP PORT(S) AGE SELECTOR",
    ),
    (
        &["get", "deployments", "-n", "diff"],
        "NAME READY UP-TO-DATE AVAILABLE AGE",
    ),
    (
        &["get", "deployments", "-n", "diff", "-o", "wide"],
        "NAME READY UP-TO-DATE AVAILABLE AGE CONTAINERS IMAGES SELECTOR",
    ),
    (
        &["get", "replicaset", "rs", "-n", "diff"],
        "NAME DESIRED CURRENT READY AGE",
    ),
    (
        &["get", "daemonsets", "-n", "diff", "-o", "wide"],
        "NAME DESIRED CURRENT READY UP-TO-DATE AVAILABLE NODE SELECTOR AGE CONTAINERS IMAGES SELECTOR",
    ),
    (&["get", "statefulsets", "-n", "diff"], "NAME READY AGE"),
    (
        &["get", "endpoints", "manual", "-n", "diff"],
        "NAME ENDPOINTS AGE",
    ),
    (
        &["get", "event", "ev", "-n", "diff"],
        "LAST SEEN TYPE REASON OBJECT MESSAGE",
    ),
    (&["get", "leases", "-n", "diff"], "NAME HOLDER AGE"),
    (
        &["get", "poddisruptionbudgets", "-n", "diff"],
        "NAME MIN AVAILABLE MAX UNAVAILABLE ALLOWED DISRUPTIONS AGE",
    ),
    (
        &["get", "networkpolicies", "-n", "diff"],
        "NAME POD-SELECTOR AGE",
    ),
    (&["get", "roles", "-n", "diff"], "NAME CREATED AT"),
    (&["get", "rolebindings", "-n", "diff"], "NAME ROLE AGE"),
    (
        &["get", "rolebindings", "-n", "diff", "-o", "wide"],
        "NAME ROLE AGE USERS GROUPS SERVICEACCOUNTS",
    ),
    (&["get", "clusterrole", "diff-view"], "NAME CREATED AT"),
    (
        &["get", "clusterrolebinding", "diff-view", "-o", "wide"],
        "NAME ROLE AGE USERS GROUPS SERVICEACCOUNTS",
    ),
    (
        &["get", "validatingwebhookconfigurations", "diff-hook"],
        "NAME WEBHOOKS AGE",
    ),
    (
        &["get", "validatingadmissionpolicies", "diff-policy"],
        "NAME VALIDATIONS PARAMKIND AGE",
    ),
    (
        &["get", "validatingadmissionpolicybindings", "diff-binding"],
        "NAME POLICYNAME PARAMREF AGE",
    ),
    (
        &["get", "crd", "widgets.diff.example.com"],
        "NAME CREATED AT",
    ),
    (
        &["get", "gadgets", "-n", "diff"],
        "NAME ITEMS COUNT COUNTTEXT RATIO READY READYTEXT OBJ NOTINT MISSING",
    ),
];

/// A step: the kubectl arguments and whether it must succeed.
const SCRIPT: &[(&[&str], bool)] = &[
    (&["create", "namespace", "diff"], true),
    (&["create", "serviceaccount", "robot", "-n", "diff"], true),
    (&["create", "-f", KINDS], true),
    (
        &[
            "create",
            "deployment",
            "web",
            "--image=nginx:1",
            "--replicas=2",
            "--port=8080",
            "-n",
            "diff",
        ],
        true,
    ),
    (
        &[
            "create",
            "role",
            "reader",
            "--verb=get,list",
            "--resource=pods",
            "-n",
            "diff",
        ],
        true,
    ),
    (
        &[
            "create",
            "rolebinding",
            "reader-robot",
            "--role=reader",
            "--serviceaccount=diff:robot",
            "-n",
            "diff",
        ],
        true,
    ),
    (
        &[
            "create",
            "clusterrole",
            "diff-nodes",
            "--verb=get",
            "--resource=nodes",
        ],
        true,
    ),
    (
        &[
            "create",
            "clusterrolebinding",
            "diff-nodes",
            "--clusterrole=diff-nodes",
            "--user=alice",
        ],
        true,
    ),
    (
        &[
            "create",
            "service",
            "clusterip",
            "web",
            "--tcp=80:8080",
            "-n",
            "diff",
        ],
        true,
    ),
    (
        &[
            "get",
            "deployment",
            "web",
            "-n",
            "diff",
            "-o",
            "jsonpath={.spec.replicas} {.spec.selector.matchLabels} {.spec.template.spec.containers[0].image} {.spec.template.spec.containers[0].ports[0].containerPort}",
        ],
        true,
    ),
    (
        &[
            "get",
            "serviceaccount",
            "robot",
            "-n",
            "diff",
            "-o",
            "jsonpath={.metadata.name}",
        ],
        true,
    ),
    (
        &[
            "get",
            "role",
            "reader",
            "-n",
            "diff",
            "-o",
            "jsonpath={.rules}",
        ],
        true,
    ),
    (
        &[
            "get",
            "rolebinding",
            "reader-robot",
            "-n",
            "diff",
            "-o",
            "jsonpath={.subjects} {.roleRef}",
        ],
        true,
    ),
    (
        &[
            "get",
            "clusterrole",
            "diff-nodes",
            "-o",
            "jsonpath={.rules}",
        ],
        true,
    ),
    (
        &[
            "get",
            "clusterrolebinding",
            "diff-nodes",
            "-o",
            "jsonpath={.subjects} {.roleRef}",
        ],
        true,
    ),
    (
        &[
            "get",
            "service",
            "web",
            "-n",
            "diff",
            "-o",
            "jsonpath={.spec.ports} {.spec.selector} {.spec.type}",
        ],
        true,
    ),
    (&["run", "diff-pod", "--image=nginx", "-n", "default"], true),
    (
        &[
            "get",
            "pod",
            "diff-pod",
            "-n",
            "default",
            "-o",
            "jsonpath={.spec.serviceAccountName} {.spec.tolerations} {.spec.containers[0].imagePullPolicy} {.spec.containers[0].terminationMessagePath} {.spec.containers[0].terminationMessagePolicy} {.spec.containers[0].volumeMounts[0].mountPath}",
        ],
        true,
    ),
    (
        &["auth", "can-i", "create", "deployments", "-n", "diff"],
        true,
    ),
    (&["auth", "can-i", "get", "/healthz"], true),
    (&["create", "-f", LIST], true),
    (&["apply", "-f", LIST], true),
    (&["apply", "--server-side", "-f", LIST], true),
    (
        &[
            "get",
            "configmap",
            "list-b",
            "-n",
            "diff",
            "-o",
            "jsonpath={.metadata.managedFields[*].manager} {.metadata.managedFields[*].operation}",
        ],
        true,
    ),
    (
        &[
            "get",
            "configmap",
            "list-a",
            "-n",
            "diff",
            "-o",
            "jsonpath={.data}",
        ],
        true,
    ),
    (&["create", "-f", GADGET], true),
    (&["get", "gadgets", "-n", "diff"], true),
    (&["explain", "gadgets.status"], true),
    (&["explain", "gadgets.nothing"], false),
    (&["create", "namespace", "diff"], false),
    (&["create", "-f", BAD_REPLICAS], false),
    (&["create", "-f", NO_IMAGE], false),
    (&["get", "pods", "-n", "diff", "-l", "app in (web"], false),
    (
        &["create", "role", "broken", "--verb=get", "-n", "diff"],
        false,
    ),
    (&["delete", "clusterrolebinding", "diff-nodes"], true),
    (&["delete", "clusterrole", "diff-nodes"], true),
    (&["get", "clusterrole", "diff-nodes"], false),
];

/// (success, stdout or stderr) of one kubectl run.
fn kubectl(kubeconfig: &Path, args: &[&str]) -> (bool, String) {
    let out = Command::new("kubectl")
        .env("KUBECONFIG", kubeconfig)
        .args(args)
        .output()
        .expect("kubectl runs");
    let text = if out.status.success() {
        String::from_utf8_lossy(&out.stdout).into_owned()
    } else {
        String::from_utf8_lossy(&out.stderr)
            .lines()
            // Version-skew warnings differ by server version, not behaviour.
            .filter(|l| !l.starts_with("Warning:"))
            .collect::<Vec<_>>()
            .join("\n")
    };
    (out.status.success(), text)
}

/// The first line `kubectl get` prints, its columns separated by one
/// space (widths follow the rows); the error when it fails.
fn header(kubeconfig: &Path, args: &[&str]) -> String {
    let (ok, text) = kubectl(kubeconfig, args);
    if !ok {
        return format!("failed: {text}");
    }
    text.lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_gives_the_same_outcomes_on_the_simulated_and_a_real_api_server() {
    if !gpupool_sim_apiserver::tool_check::runs(
        "the kubectl differential suite",
        "kubectl",
        &["version", "--client"],
    ) {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let server = ApiServer::start(ApiServerConfig::default())
        .await
        .expect("in-memory API server");
    let sim_kc = dir.path().join("sim.kubeconfig");
    server
        .write_kubeconfig(&sim_kc, ADMIN_TOKEN)
        .expect("kubeconfig");

    // Without a real control plane only the in-memory half runs: a failure
    // in CI, a skip (of the comparison) elsewhere.
    let plane = match gpupool_sim_apiserver::tool_check::kube_assets(
        "the kubectl differential suite's real half",
    ) {
        Some(assets) => {
            let mut config = ControlPlaneConfig::new(&assets, dir.path().join("cp"));
            // The controller-manager makes the default ServiceAccount,
            // without which a pod is refused.
            config.scheduler = false;
            Some(ControlPlane::start(config).await.expect("control plane"))
        }
        None => None,
    };

    let files: Vec<(&str, String)> = [
        (LIST, LIST_YAML),
        (BAD_REPLICAS, BAD_REPLICAS_YAML),
        (NO_IMAGE, NO_IMAGE_YAML),
        (KINDS, KINDS_YAML),
        (GADGET, GADGET_YAML),
    ]
    .iter()
    .map(|(placeholder, yaml)| {
        let path = dir
            .path()
            .join(format!("{}.yaml", placeholder.trim_matches(['{', '}'])));
        std::fs::write(&path, yaml).expect("script file");
        (*placeholder, path.to_string_lossy().into_owned())
    })
    .collect();
    let mut findings = Vec::new();
    for (args, must_succeed) in SCRIPT {
        let args: Vec<&str> = args
            .iter()
            .map(|a| {
                files
                    .iter()
                    .find(|(placeholder, _)| placeholder == a)
                    .map_or(*a, |(_, path)| path.as_str())
            })
            .collect();
        let sim_kc = sim_kc.clone();
        let args_owned: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        let sim = tokio::task::spawn_blocking(move || {
            let a: Vec<&str> = args_owned.iter().map(String::as_str).collect();
            kubectl(&sim_kc, &a)
        })
        .await
        .expect("kubectl task");
        if sim.0 != *must_succeed {
            findings.push(format!(
                "kubectl {}: expected {}, the in-memory server gave: {}",
                args.join(" "),
                if *must_succeed {
                    "success"
                } else {
                    "a failure"
                },
                sim.1
            ));
        }
        if let Some(plane) = &plane {
            let real_kc = plane.admin_kubeconfig().to_path_buf();
            let args_owned: Vec<String> = args.iter().map(|s| s.to_string()).collect();
            let real = tokio::task::spawn_blocking(move || {
                let a: Vec<&str> = args_owned.iter().map(String::as_str).collect();
                kubectl(&real_kc, &a)
            })
            .await
            .expect("kubectl task");
            // Outcomes must agree; printed output too where it succeeded.
            if sim.0 != real.0 || (sim.0 && sim.1 != real.1) {
                findings.push(format!(
                    "kubectl {}:\n  real:      {:?} {}\n  simulated: {:?} {}",
                    args.join(" "),
                    real.0,
                    real.1,
                    sim.0,
                    sim.1
                ));
            }
        }
    }
    for (args, expected) in HEADERS {
        let sim_kc = sim_kc.clone();
        let owned: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        let sim = tokio::task::spawn_blocking(move || {
            let a: Vec<&str> = owned.iter().map(String::as_str).collect();
            header(&sim_kc, &a)
        })
        .await
        .expect("kubectl task");
        if sim != *expected {
            findings.push(format!(
                "kubectl {}: header {sim:?}, the real server prints {expected:?}",
                args.join(" ")
            ));
        }
        if let Some(plane) = &plane {
            let real_kc = plane.admin_kubeconfig().to_path_buf();
            let owned: Vec<String> = args.iter().map(|s| s.to_string()).collect();
            let real = tokio::task::spawn_blocking(move || {
                let a: Vec<&str> = owned.iter().map(String::as_str).collect();
                header(&real_kc, &a)
            })
            .await
            .expect("kubectl task");
            if real != sim {
                findings.push(format!(
                    "kubectl {} header:\n  real:      {real}\n  simulated: {sim}",
                    args.join(" ")
                ));
            }
        }
    }
    let gadget = {
        let sim_kc = sim_kc.clone();
        tokio::task::spawn_blocking(move || {
            kubectl(
                &sim_kc,
                &["get", "gadget", "g1", "-n", "diff", "--no-headers"],
            )
        })
        .await
        .expect("kubectl task")
    };
    let row = gadget.1.split_whitespace().collect::<Vec<_>>().join(" ");
    if row != GADGET_ROW {
        findings.push(format!(
            "kubectl get gadget g1: the in-memory server prints {row:?}, the real one {GADGET_ROW:?}"
        ));
    }
    server.shutdown().await;
    if let Some(plane) = plane {
        plane.stop().await.expect("control plane stops");
    }
    assert!(findings.is_empty(), "{}", findings.join("\n"));
}
