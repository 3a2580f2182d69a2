//! Unknown fields in requests, as the real server treats them: refused
//! with 400 naming the field path under `fieldValidation=Strict`, dropped
//! with a `Warning` header by default (`Warn`), dropped silently under
//! `Ignore` — for built-in kinds and custom resources alike.

use gpupool_sim_apiserver::{ADMIN_TOKEN, ApiServer, RunningApiServer};
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::Client;
use kube::api::{Api, Patch, PatchParams, PostParams, ValidationDirective};
use serde_json::{Value, json};

async fn start() -> (RunningApiServer, Client) {
    let server = ApiServer::start(Default::default())
        .await
        .expect("server starts");
    let mut config = server.kube_config(ADMIN_TOKEN).await.expect("config");
    config.default_retry = false;
    let client = Client::try_from(config).expect("client builds");
    (server, client)
}

/// Sends a request and returns its status, `Warning` headers and JSON body.
async fn send(
    client: &Client,
    method: &str,
    uri: &str,
    content_type: &str,
    body: &Value,
) -> (u16, Vec<String>, Value) {
    let req = http::Request::builder()
        .method(method)
        .uri(uri)
        .header("content-type", content_type)
        .body(kube::client::Body::from(
            serde_json::to_vec(body).expect("json"),
        ))
        .expect("request");
    let resp = client.send(req).await.expect("sent");
    let code = resp.status().as_u16();
    let warnings = resp
        .headers()
        .get_all("warning")
        .iter()
        .map(|v| v.to_str().expect("ascii").to_string())
        .collect();
    let bytes = http_body_util::BodyExt::collect(resp.into_body())
        .await
        .expect("body")
        .to_bytes();
    (
        code,
        warnings,
        serde_json::from_slice(&bytes).expect("json body"),
    )
}

/// Each built-in kind, where to create it, a valid body and the unknown
/// field paths hidden in it.
fn cases() -> Vec<(&'static str, Value, Vec<&'static str>)> {
    vec![
        (
            "/api/v1/namespaces/default/pods",
            json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
                "spec": {"containers": [{"name": "c", "image": "i", "colour": "red"}], "nodeNme": "n"}}),
            vec!["spec.containers[0].colour", "spec.nodeNme"],
        ),
        (
            "/api/v1/nodes",
            json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n", "lables": {"a": "b"}},
                "status": {"allocatable": {"gpupool/slot": "2"}, "gpus": 2}}),
            vec!["metadata.lables", "status.gpus"],
        ),
        (
            "/api/v1/namespaces/default/configmaps",
            json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}, "dta": {"k": "v"}}),
            vec!["dta"],
        ),
        (
            "/api/v1/namespaces/default/secrets",
            json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s"}, "stringData": {"k": "v"}, "secret": true}),
            vec!["secret"],
        ),
        (
            "/api/v1/namespaces",
            json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ns1"}, "spec": {"owner": "me"}}),
            vec!["spec.owner"],
        ),
        (
            "/apis/coordination.k8s.io/v1/namespaces/default/leases",
            json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": "l"},
                "spec": {"holderIdentity": "a", "leaseSeconds": 15}}),
            vec!["spec.leaseSeconds"],
        ),
        (
            "/api/v1/namespaces/default/events",
            json!({"apiVersion": "v1", "kind": "Event", "metadata": {"name": "e"},
                "involvedObject": {"kind": "Pod", "name": "p", "colour": 1}, "reason": "R", "severity": "high"}),
            vec!["involvedObject.colour", "severity"],
        ),
        (
            "/apis/policy/v1/namespaces/default/poddisruptionbudgets",
            json!({"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "b"},
                "spec": {"minAvailable": 1, "selector": {"matchLabels": {"a": "b"}, "matchLabel": {}}}}),
            vec!["spec.selector.matchLabel"],
        ),
        (
            "/apis/apps/v1/namespaces/default/deployments",
            json!({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d"},
                "spec": {"selector": {"matchLabels": {"a": "b"}}, "template": {"metadata": {"labels": {"a": "b"}},
                    "spec": {"containers": [{"name": "c", "image": "i", "port": 80}]}}}}),
            vec!["spec.template.spec.containers[0].port"],
        ),
        (
            "/apis/rbac.authorization.k8s.io/v1/clusterroles",
            json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": "r"},
                "rules": [{"apiGroups": [""], "resources": ["pods"], "verb": ["get"]}]}),
            vec!["rules[0].verb"],
        ),
    ]
}

#[tokio::test]
async fn strict_refuses_unknown_fields_of_builtin_kinds_naming_each_path() {
    let (server, client) = start().await;
    for (path, body, unknown) in cases() {
        let (code, _, status) = send(
            &client,
            "POST",
            &format!("{path}?fieldValidation=Strict"),
            "application/json",
            &body,
        )
        .await;
        assert_eq!(code, 400, "{path}: {status}");
        assert_eq!(status["reason"], "BadRequest", "{path}");
        let message = status["message"].as_str().expect("message");
        let kind = body["kind"].as_str().expect("kind");
        assert!(
            message.starts_with(&format!("{kind} in version \"")),
            "{message}"
        );
        assert!(message.contains("strict decoding error"), "{message}");
        for f in &unknown {
            assert!(
                message.contains(&format!("unknown field \"{f}\"")),
                "{path}: {message} should name {f}"
            );
        }
        let name = body["metadata"]["name"].as_str().expect("name");
        let plural = path.rsplit('/').next().expect("plural");
        let group = path
            .strip_prefix("/apis/")
            .and_then(|p| p.split('/').next())
            .unwrap_or("");
        let ns = if path.contains("/namespaces/default/") {
            "default"
        } else {
            ""
        };
        assert!(
            server.admin().get(group, plural, ns, name).is_none(),
            "{path}: nothing stored"
        );
    }
}

#[tokio::test]
async fn by_default_unknown_fields_are_dropped_with_a_warning_each() {
    let (server, client) = start().await;
    for (path, body, unknown) in cases() {
        let (code, warnings, stored) = send(&client, "POST", path, "application/json", &body).await;
        assert_eq!(code, 201, "{path}: {stored}");
        let want: Vec<String> = unknown
            .iter()
            .map(|f| format!("299 - \"unknown field \\\"{f}\\\"\""))
            .collect();
        assert_eq!(warnings, want, "{path}");
        let text = stored.to_string();
        for f in &unknown {
            let leaf = f.rsplit(['.', ']']).next().expect("leaf");
            assert!(
                !text.contains(&format!("\"{leaf}\"")),
                "{path}: {leaf} dropped: {text}"
            );
        }
    }
    let pod = server
        .admin()
        .get("", "pods", "default", "p")
        .expect("stored");
    assert_eq!(
        pod["spec"]["containers"][0]["image"], "i",
        "known fields kept"
    );
    assert!(pod["spec"].get("nodeNme").is_none());
}

#[tokio::test]
async fn ignore_drops_silently_and_warn_is_explicit_too() {
    let (_server, client) = start().await;
    let body =
        json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "quiet"}, "dta": 1});
    let (code, warnings, stored) = send(
        &client,
        "POST",
        "/api/v1/namespaces/default/configmaps?fieldValidation=Ignore",
        "application/json",
        &body,
    )
    .await;
    assert_eq!((code, warnings.len()), (201, 0));
    assert!(stored.get("dta").is_none());
    let mut loud = body.clone();
    loud["metadata"]["name"] = json!("loud");
    let (code, warnings, _) = send(
        &client,
        "POST",
        "/api/v1/namespaces/default/configmaps?fieldValidation=Warn",
        "application/json",
        &loud,
    )
    .await;
    assert_eq!(code, 201);
    assert_eq!(warnings, ["299 - \"unknown field \\\"dta\\\"\""]);
    let (code, _, status) = send(
        &client,
        "POST",
        "/api/v1/namespaces/default/configmaps?fieldValidation=Loose",
        "application/json",
        &body,
    )
    .await;
    assert_eq!(code, 400);
    assert!(
        status["message"]
            .as_str()
            .is_some_and(|m| m.contains("fieldValidation")),
        "{status}"
    );
}

#[tokio::test]
async fn patches_and_updates_are_checked_like_creates() {
    let (_server, client) = start().await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let pod: Pod = serde_json::from_value(json!({"metadata": {"name": "p"},
        "spec": {"containers": [{"name": "c", "image": "i"}]}}))
    .expect("pod");
    pods.create(&PostParams::default(), &pod)
        .await
        .expect("create");
    let strict = PatchParams {
        field_validation: Some(ValidationDirective::Strict),
        ..Default::default()
    };
    let err = pods
        .patch(
            "p",
            &strict,
            &Patch::Merge(
                json!({"metadata": {"labels": {"a": "b"}}, "spec": {"priorityClass": "x"}}),
            ),
        )
        .await
        .expect_err("strict");
    match err {
        kube::Error::Api(s) => {
            assert_eq!((s.code, s.reason.as_str()), (400, "BadRequest"));
            assert!(
                s.message
                    .contains("Pod in version \"v1\" cannot be handled as a Pod: strict decoding error: unknown field \"spec.priorityClass\""),
                "{}",
                s.message
            );
        }
        other => panic!("{other:?}"),
    }
    assert!(
        pods.get("p").await.expect("get").metadata.labels.is_none(),
        "a refused patch changes nothing"
    );
    let (code, warnings, patched) = send(
        &client,
        "PATCH",
        "/api/v1/namespaces/default/pods/p",
        "application/strategic-merge-patch+json",
        &json!({"metadata": {"labels": {"a": "b"}}, "spec": {"priorityClass": "x"}}),
    )
    .await;
    assert_eq!(code, 200, "{patched}");
    assert_eq!(
        warnings,
        ["299 - \"unknown field \\\"spec.priorityClass\\\"\""]
    );
    assert_eq!(patched["metadata"]["labels"]["a"], "b");
    assert!(patched["spec"].get("priorityClass").is_none());

    // PUT with Strict: same check on the full body.
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), "default");
    let made = cms
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "c"}})).expect("cm"),
        )
        .await
        .expect("create");
    let mut body = serde_json::to_value(&made).expect("json");
    body["binaryDta"] = json!({});
    let (code, _, status) = send(
        &client,
        "PUT",
        "/api/v1/namespaces/default/configmaps/c?fieldValidation=Strict",
        "application/json",
        &body,
    )
    .await;
    assert_eq!(code, 400);
    assert!(
        status["message"]
            .as_str()
            .is_some_and(|m| m.contains("unknown field \"binaryDta\"")),
        "{status}"
    );
}

#[tokio::test]
async fn custom_resources_report_unknown_fields_in_body_and_metadata() {
    let (server, client) = start().await;
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../crds");
    let yaml = std::fs::read_to_string(dir.join("gpuleases.yaml")).expect("crd file");
    server
        .create_crds_from_yaml(&yaml)
        .await
        .expect("crd created");
    let body = json!({
        "apiVersion": "gpupool.io/v1alpha1", "kind": "GpuLease",
        "metadata": {"name": "x", "labelz": {}},
        "spec": {"className": "c", "podName": "p", "podUID": "u", "slots": 1, "extra": true},
    });
    let (code, _, status) = send(
        &client,
        "POST",
        "/apis/gpupool.io/v1alpha1/namespaces/default/gpuleases?fieldValidation=Strict",
        "application/json",
        &body,
    )
    .await;
    assert_eq!(code, 400, "{status}");
    let message = status["message"].as_str().expect("message");
    assert!(
        message.starts_with("GpuLease in version \"v1alpha1\" cannot be handled as a GpuLease: strict decoding error:"),
        "{message}"
    );
    assert!(
        message.contains("unknown field \"metadata.labelz\""),
        "{message}"
    );
    assert!(
        message.contains("unknown field \"spec.extra\""),
        "{message}"
    );
    let (code, warnings, stored) = send(
        &client,
        "POST",
        "/apis/gpupool.io/v1alpha1/namespaces/default/gpuleases",
        "application/json",
        &body,
    )
    .await;
    assert_eq!(code, 201, "{stored}");
    assert_eq!(warnings.len(), 2, "{warnings:?}");
    assert!(stored["spec"].get("extra").is_none());
    assert!(stored["metadata"].get("labelz").is_none());
}
