//! A real `helm` installs, lists, upgrades and uninstalls the chart under
//! `charts/gpupool` against the simulated API server, and every object the
//! chart renders is checked in the server's store: there after install,
//! changed by the upgrade, gone after uninstall.
//!
//! Helm 4 applies server-side by default (field manager `helm`), and the
//! test keeps Helm's defaults: every object is applied with server-side
//! apply, and its managed fields name Helm. Release records are Secrets
//! written in protobuf by Helm's typed client.
//!
//! `helm` comes from `$HELM` or `.tools/bin/helm` (installed by
//! `.ci/install-helm.sh`). Without either the test fails in CI and is skipped
//! elsewhere; a `$HELM` that does not exist is a failure, never a skip.

mod helm_support;

use helm_support::{helm, repo_root};

use std::collections::BTreeSet;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use gpupool_sim_apiserver::{ADMIN_TOKEN, Admin, ApiServer, ApiServerConfig};
use serde::Deserialize;
use serde_json::Value;

const RELEASE: &str = "gpupool";
const NAMESPACE: &str = "gpupool";
const HELM_DEADLINE: Duration = Duration::from_secs(120);

/// Runs helm with its own kubeconfig and home directories, bounded in time;
/// `Ok(stdout)` on success, `Err(stderr)` otherwise.
fn run_helm(helm: &Path, home: &Path, args: &[&str]) -> Result<String, String> {
    let out_path = home.join("helm.out");
    let err_path = home.join("helm.err");
    let mut child = Command::new(helm)
        .args(args)
        .current_dir(repo_root())
        .env("KUBECONFIG", home.join("kubeconfig"))
        .env("HELM_CACHE_HOME", home.join("cache"))
        .env("HELM_CONFIG_HOME", home.join("config"))
        .env("HELM_DATA_HOME", home.join("data"))
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out_path).expect("stdout file"))
        .stderr(std::fs::File::create(&err_path).expect("stderr file"))
        .spawn()
        .expect("helm starts");
    let started = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait for helm") {
            break s;
        }
        if started.elapsed() > HELM_DEADLINE {
            let _ = child.kill();
            let _ = child.wait();
            panic!("helm {args:?} ran longer than {HELM_DEADLINE:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let stdout = std::fs::read_to_string(&out_path).expect("stdout");
    let stderr = std::fs::read_to_string(&err_path).expect("stderr");
    if status.success() {
        Ok(stdout)
    } else {
        Err(stderr)
    }
}

/// Where the simulator stores a kind the chart renders: (group, plural,
/// namespaced).
fn storage(kind: &str) -> (&'static str, &'static str, bool) {
    match kind {
        "ConfigMap" => ("", "configmaps", true),
        "Service" => ("", "services", true),
        "ServiceAccount" => ("", "serviceaccounts", true),
        "Deployment" => ("apps", "deployments", true),
        "DaemonSet" => ("apps", "daemonsets", true),
        "PodDisruptionBudget" => ("policy", "poddisruptionbudgets", true),
        "ClusterRole" => ("rbac.authorization.k8s.io", "clusterroles", false),
        "ClusterRoleBinding" => ("rbac.authorization.k8s.io", "clusterrolebindings", false),
        "Role" => ("rbac.authorization.k8s.io", "roles", true),
        "RoleBinding" => ("rbac.authorization.k8s.io", "rolebindings", true),
        "GpuLeaseClass" => ("gpupool.io", "gpuleaseclasses", false),
        "ValidatingAdmissionPolicy" => (
            "admissionregistration.k8s.io",
            "validatingadmissionpolicies",
            false,
        ),
        "ValidatingAdmissionPolicyBinding" => (
            "admissionregistration.k8s.io",
            "validatingadmissionpolicybindings",
            false,
        ),
        "NetworkPolicy" => ("networking.k8s.io", "networkpolicies", true),
        other => panic!("the chart renders {other}; add where it is stored"),
    }
}

/// (kind, name) of every object `helm template` renders with these flags.
fn rendered(helm: &Path, home: &Path, set: &[&str]) -> BTreeSet<(String, String)> {
    let mut args = vec!["template", RELEASE, "charts/gpupool", "-n", NAMESPACE];
    args.extend_from_slice(set);
    let yaml = run_helm(helm, home, &args).unwrap_or_else(|e| panic!("helm template: {e}"));
    let mut out = BTreeSet::new();
    for doc in serde_yaml::Deserializer::from_str(&yaml) {
        let v = Value::deserialize(doc).expect("rendered YAML parses");
        if v.is_null() {
            continue;
        }
        out.insert((
            v["kind"].as_str().expect("kind").to_string(),
            v["metadata"]["name"].as_str().expect("name").to_string(),
        ));
    }
    out
}

fn stored(admin: &Admin, kind: &str, name: &str) -> Option<Value> {
    let (group, plural, namespaced) = storage(kind);
    admin.get(group, plural, if namespaced { NAMESPACE } else { "" }, name)
}

fn release_secret(admin: &Admin, revision: u32) -> Option<Value> {
    admin.get(
        "",
        "secrets",
        NAMESPACE,
        &format!("sh.helm.release.v1.{RELEASE}.v{revision}"),
    )
}

/// `helm list -o json` in the namespace: (name, revision, status) each.
fn releases(helm: &Path, home: &Path) -> Vec<(String, String, String)> {
    let json = run_helm(helm, home, &["list", "-n", NAMESPACE, "-o", "json"])
        .unwrap_or_else(|e| panic!("helm list: {e}"));
    let list: Vec<Value> = serde_json::from_str(&json).expect("helm list JSON");
    list.iter()
        .map(|r| {
            (
                r["name"].as_str().expect("name").to_string(),
                r["revision"].as_str().expect("revision").to_string(),
                r["status"].as_str().expect("status").to_string(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn helm_installs_lists_upgrades_and_uninstalls_the_chart() {
    let Some(helm) = helm() else { return };
    let home = tempfile::tempdir().expect("tempdir");
    let home = home.path();
    let server = ApiServer::start(ApiServerConfig::default())
        .await
        .expect("server");
    server
        .write_kubeconfig(&home.join("kubeconfig"), ADMIN_TOKEN)
        .expect("kubeconfig");
    let admin = server.admin();

    let v1 = ["--set", "operator.replicas=2"];
    let objects = rendered(&helm, home, &v1);
    for kind in [
        "Deployment",
        "DaemonSet",
        "Service",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
        "PodDisruptionBudget",
        "GpuLeaseClass",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    ] {
        assert!(
            objects.iter().any(|(k, _)| k == kind),
            "the chart renders a {kind}: {objects:?}"
        );
    }
    let mut install = vec![
        "install",
        RELEASE,
        "charts/gpupool",
        "-n",
        NAMESPACE,
        "--create-namespace",
        "--timeout",
        "60s",
    ];
    install.extend_from_slice(&v1);
    let out = run_helm(&helm, home, &install).unwrap_or_else(|e| panic!("helm install: {e}"));
    assert!(out.contains("STATUS: deployed"), "{out}");
    assert!(
        admin.get("", "namespaces", "", NAMESPACE).is_some(),
        "--create-namespace made the namespace"
    );
    for crd in ["gpuleases.gpupool.io", "gpuleaseclasses.gpupool.io"] {
        assert!(
            admin
                .get("apiextensions.k8s.io", "customresourcedefinitions", "", crd)
                .is_some(),
            "the chart's crds/ installed {crd}"
        );
    }
    for (kind, name) in &objects {
        let obj = stored(&admin, kind, name)
            .unwrap_or_else(|| panic!("{kind} {name} stored after install"));
        assert_eq!(
            obj["metadata"]["labels"]["app.kubernetes.io/managed-by"], "Helm",
            "{kind} {name}"
        );
        assert_eq!(
            obj["metadata"]["annotations"]["meta.helm.sh/release-name"], RELEASE,
            "{kind} {name}"
        );
        let applied_by_helm = obj["metadata"]["managedFields"]
            .as_array()
            .is_some_and(|es| {
                es.iter()
                    .any(|e| e["manager"] == "helm" && e["operation"] == "Apply")
            });
        assert!(
            applied_by_helm,
            "{kind} {name} applied server-side by helm: {}",
            obj["metadata"]["managedFields"]
        );
    }
    let deployment = stored(&admin, "Deployment", "gpupool-operator").expect("operator");
    assert_eq!(deployment["spec"]["replicas"], 2);
    let record = release_secret(&admin, 1).expect("release record");
    assert_eq!(record["type"], "helm.sh/release.v1");
    assert_eq!(record["metadata"]["labels"]["owner"], "helm");
    assert_eq!(record["metadata"]["labels"]["status"], "deployed");
    assert!(
        record["data"]["release"]
            .as_str()
            .is_some_and(|r| !r.is_empty())
    );
    assert_eq!(
        releases(&helm, home),
        [(RELEASE.to_string(), "1".to_string(), "deployed".to_string())]
    );

    let v2 = ["--set", "operator.replicas=3"];
    assert_eq!(rendered(&helm, home, &v2), objects, "same objects");
    let mut upgrade = vec![
        "upgrade",
        RELEASE,
        "charts/gpupool",
        "-n",
        NAMESPACE,
        "--timeout",
        "60s",
    ];
    upgrade.extend_from_slice(&v2);
    run_helm(&helm, home, &upgrade).unwrap_or_else(|e| panic!("helm upgrade: {e}"));
    let deployment = stored(&admin, "Deployment", "gpupool-operator").expect("operator");
    assert_eq!(deployment["spec"]["replicas"], 3, "upgraded");
    assert_eq!(deployment["metadata"]["generation"], 2, "one spec change");
    assert_eq!(
        release_secret(&admin, 1).expect("first record")["metadata"]["labels"]["status"],
        "superseded"
    );
    assert_eq!(
        release_secret(&admin, 2).expect("second record")["metadata"]["labels"]["status"],
        "deployed"
    );
    assert_eq!(
        releases(&helm, home),
        [(RELEASE.to_string(), "2".to_string(), "deployed".to_string())]
    );

    run_helm(
        &helm,
        home,
        &["uninstall", RELEASE, "-n", NAMESPACE, "--timeout", "60s"],
    )
    .unwrap_or_else(|e| panic!("helm uninstall: {e}"));
    for (kind, name) in &objects {
        assert!(
            stored(&admin, kind, name).is_none(),
            "{kind} {name} gone after uninstall"
        );
    }
    assert!(release_secret(&admin, 1).is_none() && release_secret(&admin, 2).is_none());
    assert!(releases(&helm, home).is_empty());
    assert!(
        admin
            .get(
                "apiextensions.k8s.io",
                "customresourcedefinitions",
                "",
                "gpuleases.gpupool.io"
            )
            .is_some(),
        "Helm keeps the CRDs of crds/ on uninstall"
    );
    server.shutdown().await;
}
