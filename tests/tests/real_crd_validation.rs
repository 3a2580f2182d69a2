//! CRD validation answers of the in-memory API server compared with a real
//! kube-apiserver's, for the same CRDs (`crds/`) and the same invalid
//! objects: the HTTP code, the reason and the message must be equal, since
//! users read those messages (`kubectl apply` prints them verbatim).
//!
//! Needs `KUBEBUILDER_ASSETS` (`bash .ci/install-k8s.sh`); without it, a
//! failure in CI and a skip elsewhere.

use std::time::{Duration, Instant};

use gpupool_sim::control_plane::{ControlPlane, ControlPlaneConfig};
use gpupool_sim_apiserver::{ApiServer, ApiServerConfig};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::Client;
use kube::api::{Api, ApiResource, DynamicObject, PostParams};
use serde_json::{Value, json};

fn crds() -> Vec<CustomResourceDefinition> {
    ["gpuleaseclasses.yaml", "gpuleases.yaml"]
        .iter()
        .map(|f| {
            let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../crds")
                .join(f);
            serde_yaml::from_str(&std::fs::read_to_string(&path).expect("crd file"))
                .expect("crd parses")
        })
        .collect()
}

fn resource(kind: &str, plural: &str) -> ApiResource {
    ApiResource {
        group: "gpupool.io".into(),
        version: "v1alpha1".into(),
        api_version: "gpupool.io/v1alpha1".into(),
        kind: kind.into(),
        plural: plural.into(),
    }
}

/// Installs the CRDs and waits until a create of each kind is answered by
/// the resource (not 404), as a new CRD is served only once Established.
async fn install(client: &Client) {
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    for crd in crds() {
        api.create(&PostParams::default(), &crd)
            .await
            .expect("create CRD");
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    for (kind, plural) in [
        ("GpuLeaseClass", "gpuleaseclasses"),
        ("GpuLease", "gpuleases"),
    ] {
        let api: Api<DynamicObject> = Api::all_with(client.clone(), &resource(kind, plural));
        while api.list(&Default::default()).await.is_err() {
            assert!(Instant::now() < deadline, "{plural} never served");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// (code, reason, message) of a create that must fail.
async fn refusal(client: &Client, object: &Value) -> (u16, String, String) {
    let kind = object["kind"].as_str().expect("kind");
    let (plural, namespaced) = match kind {
        "GpuLease" => ("gpuleases", true),
        _ => ("gpuleaseclasses", false),
    };
    let res = resource(kind, plural);
    let api: Api<DynamicObject> = if namespaced {
        Api::namespaced_with(client.clone(), "default", &res)
    } else {
        Api::all_with(client.clone(), &res)
    };
    let obj: DynamicObject = serde_json::from_value(object.clone()).expect("object");
    match api.create(&PostParams::default(), &obj).await {
        Err(kube::Error::Api(e)) => (e.code, e.reason, e.message),
        other => panic!("{object} was not refused: {other:?}"),
    }
}

fn cases() -> Vec<(&'static str, Value)> {
    let class = |spec: Value| {
        json!({"apiVersion": "gpupool.io/v1alpha1", "kind": "GpuLeaseClass",
               "metadata": {"name": "bad"}, "spec": spec})
    };
    let lease = |spec: Value| {
        json!({"apiVersion": "gpupool.io/v1alpha1", "kind": "GpuLease",
               "metadata": {"name": "bad", "namespace": "default"}, "spec": spec})
    };
    let lease_spec =
        json!({"className": "c", "podName": "p", "podUID": "u", "slots": 1, "role": "primary"});
    let with = |k: &str, v: Value| {
        let mut s = lease_spec.clone();
        s[k] = v;
        s
    };
    vec![
        ("enum", class(json!({"admission": {"ordering": "Random"}}))),
        ("minimum", class(json!({"admission": {"maxQueued": -1}}))),
        (
            "maximum",
            class(json!({"helpers": {"gracePeriodSeconds": 100000}})),
        ),
        ("pattern", class(json!({"resourceName": "no-slash"}))),
        ("type", class(json!({"default": "yes"}))),
        ("lease slots minimum", lease(with("slots", json!(0)))),
        ("lease role enum", lease(with("role", json!("boss")))),
        ("lease required", lease(json!({"className": "c"}))),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crd_validation_messages_match_a_real_api_server() {
    let Some(assets) =
        gpupool_sim_apiserver::tool_check::kube_assets("the real CRD validation suite")
    else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let mut config = ControlPlaneConfig::new(&assets, dir.path());
    config.scheduler = false;
    config.controller_manager = false;
    let plane = ControlPlane::start(config)
        .await
        .expect("control plane starts");
    let real = plane.client().await.expect("real client");
    let sim_server = ApiServer::start(ApiServerConfig::default())
        .await
        .expect("in-memory API server");
    let sim = sim_server.client().await.expect("sim client");
    install(&real).await;
    install(&sim).await;

    let mut differences = Vec::new();
    for (what, object) in cases() {
        let want = refusal(&real, &object).await;
        let got = refusal(&sim, &object).await;
        if want != got {
            differences.push(format!(
                "{what}:\n  real:      {want:?}\n  simulated: {got:?}"
            ));
        }
    }
    sim_server.shutdown().await;
    plane.stop().await.expect("control plane stops");
    assert!(
        differences.is_empty(),
        "the in-memory API server answers differently:\n{}",
        differences.join("\n")
    );
}
