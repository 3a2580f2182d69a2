//! The real control plane harness (`gpupool_sim::control_plane`): etcd,
//! kube-apiserver, kube-scheduler and kube-controller-manager from
//! `KUBEBUILDER_ASSETS`. When the variable is unset, a failure in CI and a
//! skip elsewhere (`.ci/run` sets it; `bash .ci/install-k8s.sh` prepares it).

use std::time::Duration;

use gpupool_sim::control_plane::{self, ControlPlane, ControlPlaneConfig};
use k8s_openapi::api::core::v1::{Namespace, Node};
use kube::api::{Api, ListParams, PostParams};

fn assets() -> Option<std::path::PathBuf> {
    gpupool_sim_apiserver::tool_check::kube_assets("the control-plane suite")
}

fn alive(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .unwrap_or_default()
            .contains(") Z ")
}

#[tokio::test]
async fn control_plane_serves_authenticates_by_certificate_and_authorizes_with_rbac_and_node() {
    let Some(assets) = assets() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let mut plane = ControlPlane::start(ControlPlaneConfig::new(&assets, dir.path()))
        .await
        .expect("control plane starts");
    let admin = plane.client().await.expect("admin client");
    let namespaces: Api<Namespace> = Api::all(admin.clone());
    let names: Vec<String> = namespaces
        .list(&ListParams::default())
        .await
        .expect("admin lists namespaces")
        .items
        .into_iter()
        .filter_map(|n| n.metadata.name)
        .collect();
    assert!(names.iter().any(|n| n == "kube-system"), "{names:?}");

    // A kubelet's certificate: the Node authorizer lets it create its own
    // Node, NodeRestriction refuses another's.
    let kc = dir.path().join("node-1.kubeconfig");
    plane
        .write_cert_kubeconfig(&kc, "system:node:node-1", &["system:nodes"])
        .expect("node kubeconfig");
    let node_client = control_plane::client_from_kubeconfig(&kc)
        .await
        .expect("node client");
    let nodes: Api<Node> = Api::all(node_client);
    let node = |name: &str| -> Node {
        serde_json::from_value(serde_json::json!({"metadata": {"name": name}})).expect("node")
    };
    nodes
        .create(&PostParams::default(), &node("node-1"))
        .await
        .expect("a kubelet creates its own Node");
    let err = nodes
        .create(&PostParams::default(), &node("node-2"))
        .await
        .expect_err("a kubelet cannot create another's Node");
    assert!(
        matches!(err, kube::Error::Api(ref e) if e.code == 403),
        "{err}"
    );

    // A user with no bindings is authenticated and refused.
    let kc = dir.path().join("nobody.kubeconfig");
    plane
        .write_cert_kubeconfig(&kc, "nobody", &[])
        .expect("kubeconfig");
    let nobody = control_plane::client_from_kubeconfig(&kc)
        .await
        .expect("client");
    let err = Api::<Namespace>::all(nobody)
        .list(&ListParams::default())
        .await
        .expect_err("RBAC refuses");
    assert!(
        matches!(err, kube::Error::Api(ref e) if e.code == 403),
        "{err}"
    );

    let pids = plane.pids();
    assert_eq!(
        pids.len(),
        4,
        "etcd, apiserver, controller-manager, scheduler"
    );
    plane.stop().await.expect("stops");
    for pid in pids {
        assert!(!alive(pid), "process {pid} outlived stop");
    }
}

#[tokio::test]
async fn a_control_plane_process_that_dies_is_named_with_its_log() {
    let Some(assets) = assets() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    // A fake etcd that exits at once: start names it and its log.
    let fake = dir.path().join("assets");
    std::fs::create_dir_all(&fake).expect("dir");
    for b in [
        "kube-apiserver",
        "kube-scheduler",
        "kube-controller-manager",
    ] {
        std::os::unix::fs::symlink(assets.join(b), fake.join(b)).expect("link");
    }
    let etcd = fake.join("etcd");
    std::fs::write(
        &etcd,
        "#!/bin/sh\necho etcd cannot start here >&2\nexit 3\n",
    )
    .expect("write");
    std::process::Command::new("chmod")
        .arg("+x")
        .arg(&etcd)
        .status()
        .expect("chmod");
    let mut config = ControlPlaneConfig::new(&fake, dir.path().join("run"));
    config.ready_timeout = Duration::from_secs(20);
    let err = match ControlPlane::start(config).await {
        Err(e) => e.to_string(),
        Ok(_) => panic!("started with a broken etcd"),
    };
    assert!(
        err.contains("etcd exited") && err.contains("etcd cannot start here"),
        "{err}"
    );
}
