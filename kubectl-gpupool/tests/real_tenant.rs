//! The real `kubectl-gpupool` binary on a real control plane (etcd,
//! kube-apiserver and kube-controller-manager, whose ClusterRole
//! aggregation folds the chart's read rules into `view` and `edit`), run as
//! tenants bound to those roles in one namespace only: RBAC refuses them
//! every namespace's leases, the classes and the nodes, and the plugin shows
//! what they may see instead of failing. No operator runs: the leases and
//! their status are written by the admin, as the operator would.
//!
//! Needs `KUBEBUILDER_ASSETS` (`bash .ci/install-k8s.sh`); prints a skip
//! line without it.

#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::time::{Duration, Instant};

use gpupool_api::{GpuLease, GpuLeaseClass};
use gpupool_sim::control_plane::{ControlPlane, ControlPlaneConfig};
use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::api::rbac::v1::{ClusterRole, RoleBinding};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::{Client, CustomResourceExt};
use serde_json::{Value, json};

const PLUGIN: &str = env!("CARGO_BIN_EXE_kubectl-gpupool");

/// The chart's aggregated read roles, rendered for release `gpupool`: the
/// template's own actions (its name, a comment and a labels include) are
/// all that is dropped or filled in.
fn aggregate_roles() -> Vec<Value> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../charts/gpupool/templates/aggregate-rbac.yaml");
    let template = std::fs::read_to_string(&path).unwrap();
    let mut text = String::new();
    let mut in_comment = false;
    for line in template.lines() {
        let trimmed = line.trim();
        if trimmed.starts_with("{{- /*") {
            in_comment = !trimmed.ends_with("*/ -}}");
            continue;
        }
        if in_comment {
            in_comment = !trimmed.ends_with("*/ -}}");
            continue;
        }
        if trimmed.starts_with("{{") {
            continue;
        }
        let line = line.replace("{{ $base }}", "gpupool");
        assert!(
            !line.contains("{{"),
            "an action the test cannot render: {line}"
        );
        text.push_str(&line);
        text.push('\n');
    }
    serde_yaml::Deserializer::from_str(&text)
        .map(|doc| serde::Deserialize::deserialize(doc).unwrap())
        .filter(|v: &Value| !v.is_null())
        .collect()
}

async fn wait_until<F, Fut>(what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + Duration::from_secs(60);
    while !f().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn create<K>(api: &Api<K>, value: Value) -> K
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + serde::Serialize + std::fmt::Debug,
{
    let obj: K = serde_json::from_value(value).unwrap();
    api.create(&PostParams::default(), &obj).await.unwrap()
}

/// A pod asking 2 slots, and its lease with the status the operator would write.
async fn pod_and_lease(client: &Client, ns: &str, name: &str, status: Value) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let pod = create(
        &pods,
        json!({"metadata": {"name": name}, "spec": {"containers": [{"name": "work", "image": "sim",
            "resources": {"limits": {"gpupool/slot": "2"}}}]}}),
    )
    .await;
    let leases: Api<GpuLease> = Api::namespaced(client.clone(), ns);
    create(
        &leases,
        json!({"apiVersion": "gpupool.io/v1alpha1", "kind": "GpuLease",
            "metadata": {"name": name},
            "spec": {"className": "default", "podName": name, "podUID": pod.metadata.uid,
                "role": "primary", "slots": 2}}),
    )
    .await;
    leases
        .patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": status})),
        )
        .await
        .unwrap();
}

struct Run {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

async fn plugin(kubeconfig: &Path, args: &[&str]) -> Run {
    let out = tokio::process::Command::new(PLUGIN)
        .args(args)
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .env_remove("KUBECONFIG")
        .output()
        .await
        .unwrap();
    Run {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

async fn ok(kubeconfig: &Path, args: &[&str]) -> String {
    let r = plugin(kubeconfig, args).await;
    assert_eq!(
        r.code,
        Some(0),
        "{args:?}: stdout {} stderr {}",
        r.stdout,
        r.stderr
    );
    assert!(r.stderr.is_empty(), "{args:?}: {}", r.stderr);
    r.stdout
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn view_and_edit_tenants_see_their_namespace_on_a_real_control_plane() {
    let Some(assets) = gpupool_sim_apiserver::tool_check::kube_assets("the real-tenant suite")
    else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let plane = ControlPlane::start(ControlPlaneConfig {
        scheduler: false,
        ..ControlPlaneConfig::new(assets, dir.path().join("plane"))
    })
    .await
    .unwrap_or_else(|e| panic!("a real control plane: {e}"));
    let admin = plane.client().await.unwrap();

    let crds: Api<CustomResourceDefinition> = Api::all(admin.clone());
    for crd in [GpuLeaseClass::crd(), GpuLease::crd()] {
        crds.create(&PostParams::default(), &crd).await.unwrap();
    }
    let classes: Api<GpuLeaseClass> = Api::all(admin.clone());
    wait_until("the CRDs to serve", || async {
        classes.list(&Default::default()).await.is_ok()
            && Api::<GpuLease>::all(admin.clone())
                .list(&Default::default())
                .await
                .is_ok()
    })
    .await;
    let roles: Api<ClusterRole> = Api::all(admin.clone());
    for role in aggregate_roles() {
        create(&roles, role).await;
    }
    for aggregated in ["view", "edit"] {
        wait_until(
            &format!("ClusterRole {aggregated} to aggregate gpuleases"),
            || async {
                roles.get(aggregated).await.is_ok_and(|r| {
                    r.rules.iter().flatten().any(|rule| {
                        rule.resources
                            .iter()
                            .flatten()
                            .any(|res| res == "gpuleases")
                    })
                })
            },
        )
        .await;
    }
    let namespaces: Api<Namespace> = Api::all(admin.clone());
    for ns in ["ml", "other"] {
        create(&namespaces, json!({"metadata": {"name": ns}})).await;
    }
    let bindings: Api<RoleBinding> = Api::namespaced(admin.clone(), "ml");
    for (user, role) in [("viewer", "view"), ("editor", "edit")] {
        create(
            &bindings,
            json!({"metadata": {"name": user},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
                "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}]}),
        )
        .await;
    }
    create(
        &classes,
        json!({"apiVersion": "gpupool.io/v1alpha1", "kind": "GpuLeaseClass",
            "metadata": {"name": "default"}, "spec": {"default": true}}),
    )
    .await;
    let now = jiff::Timestamp::now().to_string();
    pod_and_lease(
        &admin,
        "ml",
        "train-a",
        json!({"phase": "Bound", "sequence": 1, "node": "node-1", "queuedAt": now,
            "admittedAt": now, "boundAt": now,
            "gpus": [{"index": 0, "uuid": "GPU-0"}, {"index": 1, "uuid": "GPU-1"}]}),
    )
    .await;
    pod_and_lease(
        &admin,
        "other",
        "theirs",
        json!({"phase": "Queued", "sequence": 2, "position": 1, "queuedAt": now,
            "message": "waiting: needs 2 slots on one node"}),
    )
    .await;
    pod_and_lease(
        &admin,
        "ml",
        "train-c",
        json!({"phase": "Queued", "sequence": 3, "position": 2, "queuedAt": now,
            "message": "waiting: 1 primary ahead; needs 2 slots on one node"}),
    )
    .await;

    for user in ["viewer", "editor"] {
        let kc = dir.path().join(format!("{user}.kubeconfig"));
        plane.write_cert_kubeconfig(&kc, user, &[]).unwrap();
        let queue = ok(&kc, &["queue", "-n", "ml"]).await;
        assert!(
            queue.starts_with("CLASS default; 1 primary waiting\n"),
            "{user}: {queue}"
        );
        assert!(!queue.contains("theirs"), "{user}: {queue}");
        let row: Vec<&str> = queue
            .lines()
            .nth(2)
            .unwrap()
            .split_whitespace()
            .take(3)
            .collect();
        assert_eq!(row, ["2", "train-c", "ml"], "{user}: {queue}");
        for line in [
            "cannot list GpuLeases in all namespaces: forbidden; showing namespace ml",
            "cannot list GpuLeaseClasses: forbidden; ",
        ] {
            assert!(queue.contains(line), "{user}: {queue}");
        }

        let why = ok(&kc, &["why", "train-c", "-n", "ml"]).await;
        assert!(
            why.contains("at position 2 among waiting primaries (sequence 3)."),
            "{user}: {why}"
        );
        assert!(
            why.contains("\ncannot list Nodes: forbidden; node fit is not shown\n"),
            "{user}: {why}"
        );

        let top = ok(&kc, &["top", "-n", "ml"]).await;
        let gpu_rows: Vec<&str> = top.lines().filter(|l| l.contains("ml/train-a")).collect();
        assert_eq!(gpu_rows.len(), 2, "{user}: {top}");
        assert!(gpu_rows[0].starts_with("node-1   0"), "{user}: {top}");
        assert!(!top.contains("theirs"), "{user}: {top}");
        assert!(
            top.contains("cannot list Nodes: forbidden; "),
            "{user}: {top}"
        );

        let r = plugin(&kc, &["queue", "-A"]).await;
        assert_eq!(r.code, Some(1), "{user}: {}", r.stderr);
        assert!(
            r.stderr.starts_with(
                "kubectl-gpupool: cannot list gpuleases in all namespaces: forbidden ("
            ),
            "{user}: {}",
            r.stderr
        );
        let r = plugin(&kc, &["queue", "-n", "other"]).await;
        assert_eq!(r.code, Some(1), "{user}: {}", r.stderr);
        assert!(
            r.stderr.starts_with(
                "kubectl-gpupool: cannot list gpuleases in namespace other: forbidden ("
            ),
            "{user}: {}",
            r.stderr
        );
    }

    // The admin still sees everything, positions computed from sequences.
    let kc = plane.admin_kubeconfig();
    let queue = ok(kc, &["queue", "-A"]).await;
    assert!(
        queue.starts_with("CLASS default (StrictFIFO): 0 slots, 0 free as the operator last counted; 2 primaries waiting\n"),
        "{queue}"
    );
    assert!(!queue.contains("cannot list"), "{queue}");

    plane.stop().await.unwrap();
}
