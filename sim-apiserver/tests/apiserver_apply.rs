//! Server-side apply against the simulated API server, over HTTP: with
//! kube's `Patch::Apply` (create, update, field managers, conflicts, force,
//! removal of dropped fields, status, custom resources, dry run) and with
//! the real `kubectl apply --server-side`, which fails in CI and is skipped elsewhere
//! (see `gpupool_sim_apiserver::tool_check`) when `kubectl` is not on the PATH.

use std::io::Write;
use std::process::{Command, Output, Stdio};

use gpupool_sim_apiserver::{ADMIN_TOKEN, ApiServer, ApiServerConfig, RunningApiServer};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ManagedFieldsEntry;
use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};
use kube::core::{ApiResource, GroupVersionKind};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};

async fn start() -> (RunningApiServer, Client) {
    let server = ApiServer::start(ApiServerConfig::default())
        .await
        .expect("server starts");
    let mut config = server.kube_config(ADMIN_TOKEN).await.expect("config");
    config.default_retry = false;
    let client = Client::try_from(config).expect("client builds");
    (server, client)
}

fn api_err(e: kube::Error) -> kube::core::Status {
    match e {
        kube::Error::Api(s) => *s,
        other => panic!("expected an API error, got {other:?}"),
    }
}

fn cm(data: Value) -> Value {
    json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}, "data": data})
}

fn entry<'a>(obj: &'a impl ResourceExt, manager: &str) -> &'a ManagedFieldsEntry {
    obj.managed_fields()
        .iter()
        .find(|e| e.manager.as_deref() == Some(manager))
        .unwrap_or_else(|| panic!("{manager} has an entry: {:?}", obj.managed_fields()))
}

fn fields(e: &ManagedFieldsEntry) -> Value {
    e.fields_v1.as_ref().map(|f| f.0.clone()).expect("fieldsV1")
}

#[tokio::test]
async fn apply_creates_then_updates_and_records_the_manager() {
    let (server, client) = start().await;
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), "default");
    let created = cms
        .patch(
            "c",
            &PatchParams::apply("alpha"),
            &Patch::Apply(cm(json!({"a": "1"}))),
        )
        .await
        .expect("apply creates");
    assert_eq!(created.data.as_ref().expect("data")["a"], "1");
    let e = entry(&created, "alpha");
    assert_eq!(e.operation.as_deref(), Some("Apply"));
    assert_eq!(e.api_version.as_deref(), Some("v1"));
    assert_eq!(e.fields_type.as_deref(), Some("FieldsV1"));
    assert!(e.time.is_some());
    assert_eq!(fields(e), json!({"f:data": {"f:a": {}}}));

    let updated = cms
        .patch(
            "c",
            &PatchParams::apply("alpha"),
            &Patch::Apply(cm(json!({"a": "2", "b": "3"}))),
        )
        .await
        .expect("apply updates");
    assert_eq!(updated.metadata.uid, created.metadata.uid);
    assert_eq!(
        fields(entry(&updated, "alpha")),
        json!({"f:data": {"f:a": {}, "f:b": {}}})
    );

    // Applying the same again writes nothing.
    let again = cms
        .patch(
            "c",
            &PatchParams::apply("alpha"),
            &Patch::Apply(cm(json!({"a": "2", "b": "3"}))),
        )
        .await
        .expect("no-op apply");
    assert_eq!(again.resource_version(), updated.resource_version());

    // A merge patch is an Update by its field manager and takes the field.
    let patched = cms
        .patch(
            "c",
            &PatchParams {
                field_manager: Some("editor".into()),
                ..Default::default()
            },
            &Patch::Merge(json!({"data": {"a": "9"}})),
        )
        .await
        .expect("merge patch");
    let editor = entry(&patched, "editor");
    assert_eq!(editor.operation.as_deref(), Some("Update"));
    assert_eq!(fields(editor), json!({"f:data": {"f:a": {}}}));
    assert_eq!(
        fields(entry(&patched, "alpha")),
        json!({"f:data": {"f:b": {}}})
    );

    // alpha now conflicts on a, and force takes it back.
    let err = api_err(
        cms.patch(
            "c",
            &PatchParams::apply("alpha"),
            &Patch::Apply(cm(json!({"a": "2", "b": "3"}))),
        )
        .await
        .expect_err("conflict"),
    );
    assert_eq!(err.code, 409);
    assert_eq!(err.reason, "Conflict");
    assert_eq!(
        err.message,
        "Apply failed with 1 conflict: conflict with \"editor\" using v1: .data.a"
    );
    let causes = err.details.expect("details").causes;
    assert_eq!(causes.len(), 1);
    assert_eq!(causes[0].reason, "FieldManagerConflict");
    assert_eq!(causes[0].field, ".data.a");
    assert_eq!(causes[0].message, "conflict with \"editor\" using v1");
    let forced = cms
        .patch(
            "c",
            &PatchParams::apply("alpha").force(),
            &Patch::Apply(cm(json!({"a": "2", "b": "3"}))),
        )
        .await
        .expect("forced");
    assert_eq!(forced.data.as_ref().expect("data")["a"], "2");
    assert!(
        forced
            .managed_fields()
            .iter()
            .all(|e| e.manager.as_deref() != Some("editor")),
        "editor lost its only field"
    );

    // Dropping b from the configuration removes it: nobody else owns it.
    let dropped = cms
        .patch(
            "c",
            &PatchParams::apply("alpha"),
            &Patch::Apply(cm(json!({"a": "2"}))),
        )
        .await
        .expect("apply without b");
    assert_eq!(dropped.data.as_ref().expect("data").len(), 1);
    server.shutdown().await;
}

#[tokio::test]
async fn creates_and_updates_record_update_entries_and_can_be_cleared() {
    let (server, client) = start().await;
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), "default");
    let mut obj: ConfigMap = serde_json::from_value(cm(json!({"k": "v"}))).expect("cm");
    obj.metadata.labels = Some([("l".to_string(), "x".to_string())].into());
    let created = cms
        .create(
            &PostParams {
                field_manager: Some("creator".into()),
                ..Default::default()
            },
            &obj,
        )
        .await
        .expect("create");
    let e = entry(&created, "creator");
    assert_eq!(e.operation.as_deref(), Some("Update"));
    assert_eq!(
        fields(e),
        json!({"f:data": {".": {}, "f:k": {}}, "f:metadata": {"f:labels": {".": {}, "f:l": {}}}})
    );

    // A shared value is owned by both; a second applier sharing it adds no conflict.
    let shared = cms
        .patch(
            "c",
            &PatchParams::apply("other"),
            &Patch::Apply(cm(json!({"k": "v"}))),
        )
        .await
        .expect("shared value");
    assert_eq!(shared.managed_fields().len(), 2);

    let cleared = cms
        .patch(
            "c",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"managedFields": [{}]}})),
        )
        .await
        .expect("clear");
    assert!(
        cleared.managed_fields().is_empty(),
        "{:?}",
        cleared.managed_fields()
    );
    server.shutdown().await;
}

#[tokio::test]
async fn keyed_lists_set_lists_and_dry_run() {
    let (server, client) = start().await;
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), "default");
    let d = |image: &str, with_sidecar: bool| {
        let mut containers = vec![json!({"name": "main", "image": image,
            "ports": [{"containerPort": 8080}], "env": [{"name": "A", "value": "1"}]})];
        if with_sidecar {
            containers.push(json!({"name": "sidecar", "image": "s"}));
        }
        json!({"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "d", "finalizers": ["example.com/f"]},
            "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "d"}},
                "template": {"metadata": {"labels": {"app": "d"}}, "spec": {"containers": containers}}}})
    };
    let created = deployments
        .patch(
            "d",
            &PatchParams::apply("helm"),
            &Patch::Apply(d("a", true)),
        )
        .await
        .expect("apply creates");
    let f = fields(entry(&created, "helm"));
    let main = &f["f:spec"]["f:template"]["f:spec"]["f:containers"]["k:{\"name\":\"main\"}"];
    assert_eq!(main["."], json!({}));
    assert_eq!(main["f:image"], json!({}));
    assert_eq!(
        main["f:ports"]["k:{\"containerPort\":8080,\"protocol\":\"TCP\"}"],
        json!({".": {}, "f:containerPort": {}})
    );
    assert_eq!(main["f:env"]["k:{\"name\":\"A\"}"]["f:value"], json!({}));
    assert_eq!(
        f["f:metadata"]["f:finalizers"],
        json!({"v:\"example.com/f\"": {}})
    );
    assert_eq!(
        f["f:spec"]["f:selector"],
        json!({"f:matchLabels": {"f:app": {}}})
    );

    let dry = deployments
        .patch(
            "d",
            &PatchParams::apply("helm").dry_run(),
            &Patch::Apply(d("b", false)),
        )
        .await
        .expect("dry run");
    assert_eq!(
        dry.spec
            .template
            .spec
            .as_ref()
            .expect("pod")
            .containers
            .len(),
        1
    );
    let stored = deployments.get("d").await.expect("get");
    assert_eq!(
        stored.resource_version(),
        created.resource_version(),
        "dry run stores nothing"
    );

    let updated = deployments
        .patch(
            "d",
            &PatchParams::apply("helm"),
            &Patch::Apply(d("b", false)),
        )
        .await
        .expect("apply updates");
    let containers = updated.spec.template.spec.expect("pod").containers;
    assert_eq!(
        containers.len(),
        1,
        "the sidecar helm stopped applying is gone"
    );
    assert_eq!(containers[0].image.as_deref(), Some("b"));
    assert_eq!(updated.metadata.generation, Some(2));
    server.shutdown().await;
}

#[tokio::test]
async fn custom_resources_apply_with_their_status_apart() {
    let (server, client) = start().await;
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../crds");
    let yaml = std::fs::read_to_string(dir.join("gpuleases.yaml")).expect("crd file");
    server.create_crds_from_yaml(&yaml).await.expect("crd");
    let gvk = GroupVersionKind::gvk("gpupool.io", "v1alpha1", "GpuLease");
    let leases: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), "default", &ApiResource::from_gvk(&gvk));
    let lease = json!({"apiVersion": "gpupool.io/v1alpha1", "kind": "GpuLease", "metadata": {"name": "l"},
        "spec": {"className": "default", "podName": "p", "podUID": "u", "role": "primary", "slots": 1},
        "status": {"phase": "Queued"}});
    let created = leases
        .patch("l", &PatchParams::apply("op"), &Patch::Apply(&lease))
        .await
        .expect("apply creates the custom resource");
    assert!(
        created.data.get("status").is_none(),
        "status is its own subresource"
    );
    let f = fields(entry(&created, "op"));
    assert_eq!(f["f:spec"]["f:slots"], json!({}));
    assert!(f.get("f:status").is_none(), "{f}");

    let status = leases
        .patch_status(
            "l",
            &PatchParams::apply("op-status"),
            &Patch::Apply(
                json!({"apiVersion": "gpupool.io/v1alpha1", "kind": "GpuLease",
                "metadata": {"name": "l"}, "status": {"phase": "Queued", "position": 1}}),
            ),
        )
        .await
        .expect("status apply");
    assert_eq!(status.data["status"]["position"], 1);
    let e = entry(&status, "op-status");
    assert_eq!(e.subresource.as_deref(), Some("status"));
    assert_eq!(
        fields(e),
        json!({"f:status": {"f:phase": {}, "f:position": {}}})
    );

    let mut wrong = lease.clone();
    wrong["metadata"]["namespace"] = json!("elsewhere");
    let err = api_err(
        leases
            .patch("l", &PatchParams::apply("op"), &Patch::Apply(&wrong))
            .await
            .expect_err("namespace mismatch"),
    );
    assert_eq!(err.code, 400);
    assert!(
        err.message.contains("elsewhere") && err.message.contains("default"),
        "{}",
        err.message
    );
    server.shutdown().await;
}

#[tokio::test]
async fn apply_without_a_field_manager_is_invalid() {
    let (server, client) = start().await;
    let req = http::Request::patch("/api/v1/namespaces/default/configmaps/c")
        .header("content-type", "application/apply-patch+yaml")
        .body(b"apiVersion: v1\nkind: ConfigMap\n".to_vec())
        .expect("request");
    let err = api_err(client.request_text(req).await.expect_err("no manager"));
    assert_eq!(err.code, 422);
    assert_eq!(
        err.message,
        "PatchOptions.meta.k8s.io \"\" is invalid: fieldManager: Required value: is required for apply patch"
    );
    let req = http::Request::patch("/api/v1/namespaces/default/configmaps/c?fieldManager=m")
        .header("content-type", "application/apply-patch+yaml")
        .body(b"apiVersion: v1\nkind: ConfigMap\ndata:\n  a: |\n    yaml body\n".to_vec())
        .expect("request");
    let text = client.request_text(req).await.expect("YAML body applies");
    let obj: Value = serde_json::from_str(&text).expect("JSON answer");
    assert_eq!(obj["data"]["a"], "yaml body\n");
    server.shutdown().await;
}

struct Kubectl {
    kubeconfig: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl Kubectl {
    fn new(server: &RunningApiServer) -> Option<Self> {
        if !gpupool_sim_apiserver::tool_check::runs(
            "the kubectl apply test",
            "kubectl",
            &["version", "--client"],
        ) {
            return None;
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let kubeconfig = dir.path().join("kubeconfig");
        server
            .write_kubeconfig(&kubeconfig, ADMIN_TOKEN)
            .expect("kubeconfig");
        Some(Kubectl {
            kubeconfig,
            _dir: dir,
        })
    }

    fn run(&self, args: &[&str], stdin: &str) -> Output {
        let mut child = Command::new("kubectl")
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .arg("--request-timeout=20s")
            .args(args)
            .env_remove("KUBECONFIG")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("kubectl spawns");
        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(stdin.as_bytes())
            .expect("stdin written");
        child.wait_with_output().expect("kubectl finishes")
    }
}

const CM_YAML: &str = "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: k\n  namespace: default\ndata:\n  a: one\n  b: two\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_apply_server_side() {
    let server = ApiServer::start(ApiServerConfig::default())
        .await
        .expect("server");
    let Some(k) = Kubectl::new(&server) else {
        server.shutdown().await;
        return;
    };
    let out = k.run(&["apply", "--server-side", "-f", "-"], CM_YAML);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "configmap/k serverside-applied"
    );
    let admin = server.admin();
    let stored = admin.get("", "configmaps", "default", "k").expect("stored");
    let mf = &stored["metadata"]["managedFields"][0];
    assert_eq!(mf["manager"], "kubectl");
    assert_eq!(mf["operation"], "Apply");
    assert_eq!(mf["fieldsV1"], json!({"f:data": {"f:a": {}, "f:b": {}}}));

    let changed = CM_YAML.replace("a: one", "a: uno");
    let out = k.run(
        &[
            "apply",
            "--server-side",
            "--field-manager=intruder",
            "-f",
            "-",
        ],
        &changed,
    );
    assert!(!out.status.success(), "a conflicting apply fails");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("Apply failed with 1 conflict: conflict with \"kubectl\": .data.a"),
        "{stderr}"
    );
    let out = k.run(
        &[
            "apply",
            "--server-side",
            "--field-manager=intruder",
            "--force-conflicts",
            "-f",
            "-",
        ],
        &changed,
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stored = admin.get("", "configmaps", "default", "k").expect("stored");
    assert_eq!(stored["data"]["a"], "uno");
    // Entries sort by time, then manager: compare them as a set.
    let mut managers: Vec<&str> = stored["metadata"]["managedFields"]
        .as_array()
        .expect("entries")
        .iter()
        .filter_map(|e| e["manager"].as_str())
        .collect();
    managers.sort_unstable();
    assert_eq!(managers, ["intruder", "kubectl"]);

    // The first manager drops b: the intruder still applies it, so it stays.
    let out = k.run(
        &["apply", "--server-side", "-f", "-"],
        &CM_YAML.replace("  a: one\n", ""),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stored = admin.get("", "configmaps", "default", "k").expect("stored");
    assert_eq!(stored["data"], json!({"a": "uno", "b": "two"}));
    server.shutdown().await;
}
