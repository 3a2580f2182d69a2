//! A real `helm`, with Helm's defaults (server-side apply), installs,
//! upgrades and uninstalls `charts/gpupool` on a real control plane: the
//! chart's CRDs, RBAC and workloads are there after install, the upgrade
//! changes the operator Deployment, and uninstall removes what the release
//! created.
//!
//! Needs `KUBEBUILDER_ASSETS` (`bash .ci/install-k8s.sh`) and helm
//! (`bash .ci/install-helm.sh`); without either it fails in CI, and is skipped elsewhere.

mod helm_support;

use helm_support::helm_run;

use gpupool_sim::control_plane::{ControlPlane, ControlPlaneConfig};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::rbac::v1::ClusterRole;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::Api;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn helm_installs_upgrades_and_uninstalls_the_chart_with_its_defaults_on_a_real_control_plane()
{
    let Some(assets) = gpupool_sim_apiserver::tool_check::kube_assets("the real-helm suite") else {
        return;
    };
    let Some(helm) = helm_support::helm() else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let mut config = ControlPlaneConfig::new(&assets, dir.path().join("cp"));
    // Nothing here needs pods scheduled.
    config.scheduler = false;
    let plane = ControlPlane::start(config)
        .await
        .expect("control plane starts");
    let kc = plane.admin_kubeconfig().to_path_buf();
    let home = dir.path();
    let client = plane.client().await.expect("client");

    let installed = helm_run(
        &helm,
        home,
        &kc,
        &[
            "install",
            "gpupool",
            "charts/gpupool",
            "--namespace",
            "gpupool",
            "--create-namespace",
        ],
    );
    assert!(installed.is_ok(), "helm install: {installed:?}");

    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    for name in ["gpuleases.gpupool.io", "gpuleaseclasses.gpupool.io"] {
        assert!(
            crds.get_opt(name).await.expect("get crd").is_some(),
            "{name} installed"
        );
    }
    let roles: Api<ClusterRole> = Api::all(client.clone());
    assert!(
        roles
            .get_opt("gpupool-operator")
            .await
            .expect("get role")
            .is_some()
    );
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), "gpupool");
    let replicas = |d: Option<Deployment>| d.and_then(|d| d.spec.replicas);
    let before = replicas(
        deployments
            .get_opt("gpupool-operator")
            .await
            .expect("get deployment"),
    );
    assert_eq!(before, Some(2), "the chart's default: two replicas");

    let upgraded = helm_run(
        &helm,
        home,
        &kc,
        &[
            "upgrade",
            "gpupool",
            "charts/gpupool",
            "--namespace",
            "gpupool",
            "--set",
            "operator.replicas=3",
        ],
    );
    assert!(upgraded.is_ok(), "helm upgrade: {upgraded:?}");
    let after = replicas(
        deployments
            .get_opt("gpupool-operator")
            .await
            .expect("get deployment"),
    );
    assert_eq!(after, Some(3));
    let list = helm_run(&helm, home, &kc, &["list", "-A", "-o", "json"]).expect("helm list");
    assert!(
        list.contains("\"revision\":\"2\"") && list.contains("\"status\":\"deployed\""),
        "{list}"
    );

    let uninstalled = helm_run(
        &helm,
        home,
        &kc,
        &["uninstall", "gpupool", "--namespace", "gpupool", "--wait"],
    );
    assert!(uninstalled.is_ok(), "helm uninstall: {uninstalled:?}");
    assert!(
        roles
            .get_opt("gpupool-operator")
            .await
            .expect("get role")
            .is_none(),
        "uninstall removes the ClusterRole"
    );
    assert!(
        deployments
            .get_opt("gpupool-operator")
            .await
            .expect("get deployment")
            .is_none(),
        "uninstall removes the Deployment"
    );
    plane.stop().await.expect("control plane stops");
}
