//! Admission webhooks called by the simulated API server over HTTPS: the
//! AdmissionReview it sends, patches applied, denials, timeouts and
//! failurePolicy, service references, selectors and CA verification.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DeleteParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};

use gpupool_tests::apiserver::{ADMIN_TOKEN, ApiServer, ApiServerConfig, RunningApiServer};

/// A small HTTPS webhook server that records the reviews it receives.
struct Hook {
    addr: SocketAddr,
    ca_b64: String,
    seen: Arc<Mutex<Vec<Value>>>,
    /// TCP connections accepted.
    connections: Arc<std::sync::atomic::AtomicUsize>,
}

fn b64(data: &[u8]) -> String {
    const T: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in data.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        out.push(T[(n >> 18) as usize & 63] as char);
        out.push(T[(n >> 12) as usize & 63] as char);
        out.push(if chunk.len() > 1 {
            T[(n >> 6) as usize & 63] as char
        } else {
            '='
        });
        out.push(if chunk.len() > 2 {
            T[n as usize & 63] as char
        } else {
            '='
        });
    }
    out
}

fn answer(path: &str, review: &Value) -> Value {
    let uid = review["request"]["uid"].clone();
    let response = match path {
        "/mutate" => {
            let patch =
                json!([{"op": "add", "path": "/metadata/labels", "value": {"mutated": "yes"}}]);
            json!({"uid": uid, "allowed": true, "patchType": "JSONPatch", "patch": b64(patch.to_string().as_bytes())})
        }
        "/deny" => {
            json!({"uid": uid, "allowed": false, "status": {"code": 403, "message": "no GPUs for you"}})
        }
        "/deny400" => {
            json!({"uid": uid, "allowed": false, "status": {"code": 400, "message": "bad slot count"}})
        }
        "/wrong-uid" => json!({"uid": "nope", "allowed": true}),
        // Adds a field ConfigMaps do not declare.
        "/unknown" => {
            let patch = json!([{"op": "add", "path": "/colour", "value": "red"}]);
            json!({"uid": uid, "allowed": true, "patchType": "JSONPatch", "patch": b64(patch.to_string().as_bytes())})
        }
        // Records what it saw of the label `/second` sets.
        "/first" => {
            let mut labels = review["request"]["object"]["metadata"]["labels"].clone();
            let saw = labels["second"].as_str().unwrap_or("absent").to_string();
            labels["first"] = json!(saw);
            let patch = json!([{"op": "add", "path": "/metadata/labels", "value": labels}]);
            json!({"uid": uid, "allowed": true, "patchType": "JSONPatch", "patch": b64(patch.to_string().as_bytes())})
        }
        // Counts its own calls in a label, so every call changes the object.
        "/second" => {
            let mut labels = review["request"]["object"]["metadata"]["labels"].clone();
            let n = labels["second"]
                .as_str()
                .and_then(|v| v.parse::<u32>().ok())
                .unwrap_or(0);
            labels["second"] = json!((n + 1).to_string());
            let patch = json!([{"op": "add", "path": "/metadata/labels", "value": labels}]);
            json!({"uid": uid, "allowed": true, "patchType": "JSONPatch", "patch": b64(patch.to_string().as_bytes())})
        }
        _ => json!({"uid": uid, "allowed": true}),
    };
    json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response})
}

async fn start_hook() -> Hook {
    let key = rcgen::KeyPair::generate().expect("key");
    let params = rcgen::CertificateParams::new(vec![
        "127.0.0.1".to_string(),
        "hook.gpupool-system.svc".to_string(),
    ])
    .expect("params");
    let cert = params.self_signed(&key).expect("cert");
    let ca_b64 = b64(cert.pem().as_bytes());
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("versions")
    .with_no_client_auth()
    .with_single_cert(
        vec![cert.der().clone()],
        rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
    )
    .expect("tls config");
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let seen = Arc::new(Mutex::new(Vec::new()));
    let seen2 = seen.clone();
    let connections = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let accepted = connections.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            accepted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let acceptor = acceptor.clone();
            let seen = seen2.clone();
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(stream).await else {
                    return;
                };
                let svc =
                    hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
                        let seen = seen.clone();
                        async move {
                            let path = req.uri().path().to_string();
                            let body = req.into_body().collect().await.expect("body").to_bytes();
                            let review: Value = serde_json::from_slice(&body).expect("review json");
                            seen.lock()
                                .expect("lock")
                                .push(json!({"path": path, "review": review}));
                            if path == "/slow" {
                                tokio::time::sleep(Duration::from_secs(3)).await;
                            }
                            let out = answer(&path, &review);
                            let mut resp =
                                http::Response::new(Full::new(Bytes::from(out.to_string())));
                            if path == "/close" {
                                resp.headers_mut()
                                    .insert("connection", http::HeaderValue::from_static("close"));
                            }
                            Ok::<_, Infallible>(resp)
                        }
                    });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(tls), svc)
                    .await;
            });
        }
    });
    Hook {
        addr,
        ca_b64,
        seen,
        connections,
    }
}

async fn client(server: &RunningApiServer) -> Client {
    let mut cfg = server.kube_config(ADMIN_TOKEN).await.expect("config");
    cfg.default_retry = false;
    Client::try_from(cfg).expect("client")
}

fn cm(name: &str) -> ConfigMap {
    serde_json::from_value(json!({"metadata": {"name": name}, "data": {"k": "v"}})).expect("cm")
}

async fn register(server: &RunningApiServer, plural: &str, kind: &str, name: &str, hook: Value) {
    server
        .create(
            "admissionregistration.k8s.io",
            "v1",
            plural,
            "",
            json!({"apiVersion": "admissionregistration.k8s.io/v1", "kind": kind, "metadata": {"name": name}, "webhooks": [hook]}),
        )
        .await
        .expect("webhook configuration created");
}

fn webhook(name: &str, url: &str, ca: &str, extra: Value) -> Value {
    let mut h = json!({
        "name": name,
        "clientConfig": {"url": url, "caBundle": ca},
        "rules": [{"operations": ["CREATE", "UPDATE"], "apiGroups": [""], "apiVersions": ["v1"], "resources": ["configmaps"]}],
        "sideEffects": "None",
        "admissionReviewVersions": ["v1"],
    });
    if let (Some(h), Some(e)) = (h.as_object_mut(), extra.as_object()) {
        for (k, v) in e {
            h.insert(k.clone(), v.clone());
        }
    }
    h
}

fn api_err(e: kube::Error) -> kube::core::Status {
    match e {
        kube::Error::Api(s) => *s,
        other => panic!("expected an API error, got {other:?}"),
    }
}

#[tokio::test]
async fn mutating_webhook_patch_is_applied_and_review_is_complete() {
    let hook = start_hook().await;
    let server = ApiServer::start(ApiServerConfig::default())
        .await
        .expect("server");
    let url = format!("https://127.0.0.1:{}/mutate", hook.addr.port());
    register(
        &server,
        "mutatingwebhookconfigurations",
        "MutatingWebhookConfiguration",
        "m",
        webhook("mutate.gpupool.io", &url, &hook.ca_b64, json!({})),
    )
    .await;
    let api: Api<ConfigMap> = Api::namespaced(client(&server).await, "default");
    let made = api
        .create(&PostParams::default(), &cm("a"))
        .await
        .expect("create");
    assert_eq!(
        made.labels().get("mutated").map(String::as_str),
        Some("yes")
    );
    let seen = hook.seen.lock().expect("lock").clone();
    assert_eq!(seen.len(), 1);
    let req = &seen[0]["review"]["request"];
    assert_eq!(seen[0]["review"]["kind"], "AdmissionReview");
    assert_eq!(seen[0]["review"]["apiVersion"], "admission.k8s.io/v1");
    assert!(req["uid"].as_str().is_some_and(|u| !u.is_empty()));
    assert_eq!(req["operation"], "CREATE");
    assert_eq!(
        req["kind"],
        json!({"group": "", "version": "v1", "kind": "ConfigMap"})
    );
    assert_eq!(
        req["resource"],
        json!({"group": "", "version": "v1", "resource": "configmaps"})
    );
    assert_eq!(req["namespace"], "default");
    assert_eq!(req["name"], "a");
    assert_eq!(req["userInfo"]["username"], "admin");
    assert!(
        req["userInfo"]["groups"]
            .as_array()
            .expect("groups")
            .contains(&json!("system:masters"))
    );
    assert_eq!(req["object"]["data"]["k"], "v");
    assert!(req["oldObject"].is_null());
    assert_eq!(req["dryRun"], false);

    // UPDATE carries the old object.
    let mut changed = made.clone();
    changed.data = Some([("k".to_string(), "v2".to_string())].into());
    api.replace("a", &PostParams::default(), &changed)
        .await
        .expect("update");
    let seen = hook.seen.lock().expect("lock").clone();
    let upd = &seen[1]["review"]["request"];
    assert_eq!(upd["operation"], "UPDATE");
    assert_eq!(upd["oldObject"]["data"]["k"], "v");
    assert_eq!(upd["object"]["data"]["k"], "v2");
}

#[tokio::test]
async fn denial_is_reported_like_the_real_server() {
    let hook = start_hook().await;
    let server = ApiServer::start(ApiServerConfig::default())
        .await
        .expect("server");
    let url = format!("https://127.0.0.1:{}/deny", hook.addr.port());
    register(
        &server,
        "validatingwebhookconfigurations",
        "ValidatingWebhookConfiguration",
        "v",
        webhook("deny.gpupool.io", &url, &hook.ca_b64, json!({})),
    )
    .await;
    let api: Api<ConfigMap> = Api::namespaced(client(&server).await, "default");
    let err = api_err(
        api.create(&PostParams::default(), &cm("a"))
            .await
            .expect_err("denied"),
    );
    assert_eq!(err.code, 403);
    assert_eq!(
        err.message,
        "admission webhook \"deny.gpupool.io\" denied the request: no GPUs for you"
    );
    assert!(api.get_opt("a").await.expect("get").is_none());

    let url400 = format!("https://127.0.0.1:{}/deny400", hook.addr.port());
    let server2 = ApiServer::start(ApiServerConfig::default())
        .await
        .expect("server");
    register(
        &server2,
        "validatingwebhookconfigurations",
        "ValidatingWebhookConfiguration",
        "v",
        webhook("deny400.gpupool.io", &url400, &hook.ca_b64, json!({})),
    )
    .await;
    let api2: Api<ConfigMap> = Api::namespaced(client(&server2).await, "default");
    let err = api_err(
        api2.create(&PostParams::default(), &cm("a"))
            .await
            .expect_err("denied"),
    );
    assert_eq!((err.code, err.reason.as_str()), (400, "BadRequest"));
}

#[tokio::test]
async fn timeouts_and_failure_policy() {
    let hook = start_hook().await;
    let url = format!("https://127.0.0.1:{}/slow", hook.addr.port());
    let server = ApiServer::start(ApiServerConfig::default())
        .await
        .expect("server");
    register(
        &server,
        "validatingwebhookconfigurations",
        "ValidatingWebhookConfiguration",
        "v",
        webhook(
            "slow.gpupool.io",
            &url,
            &hook.ca_b64,
            json!({"timeoutSeconds": 1, "failurePolicy": "Fail"}),
        ),
    )
    .await;
    let api: Api<ConfigMap> = Api::namespaced(client(&server).await, "default");
    let err = api_err(
        api.create(&PostParams::default(), &cm("a"))
            .await
            .expect_err("timeout fails closed"),
    );
    assert_eq!(err.code, 500);
    assert!(
        err.message
            .contains("failed calling webhook \"slow.gpupool.io\"")
            && err.message.contains("context deadline exceeded"),
        "{}",
        err.message
    );

    let server = ApiServer::start(ApiServerConfig::default())
        .await
        .expect("server");
    register(
        &server,
        "validatingwebhookconfigurations",
        "ValidatingWebhookConfiguration",
        "v",
        webhook(
            "slow.gpupool.io",
            &url,
            &hook.ca_b64,
            json!({"timeoutSeconds": 1, "failurePolicy": "Ignore"}),
        ),
    )
    .await;
    let api: Api<ConfigMap> = Api::namespaced(client(&server).await, "default");
    api.create(&PostParams::default(), &cm("a"))
        .await
        .expect("Ignore lets it through");

    // A response for another request is a failure too.
    let server = ApiServer::start(ApiServerConfig::default())
        .await
        .expect("server");
    let wrong = format!("https://127.0.0.1:{}/wrong-uid", hook.addr.port());
    register(
        &server,
        "validatingwebhookconfigurations",
        "ValidatingWebhookConfiguration",
        "v",
        webhook("uid.gpupool.io", &wrong, &hook.ca_b64, json!({})),
    )
    .await;
    let api: Api<ConfigMap> = Api::namespaced(client(&server).await, "default");
    let err = api_err(
        api.create(&PostParams::default(), &cm("a"))
            .await
            .expect_err("wrong uid"),
    );
    assert!(err.message.contains("response.uid"), "{}", err.message);
}

#[tokio::test]
async fn untrusted_certificate_fails_the_call() {
    let hook = start_hook().await;
    let other = start_hook().await;
    let server = ApiServer::start(ApiServerConfig::default())
        .await
        .expect("server");
    let url = format!("https://127.0.0.1:{}/allow", hook.addr.port());
    register(
        &server,
        "validatingwebhookconfigurations",
        "ValidatingWebhookConfiguration",
        "v",
        webhook("tls.gpupool.io", &url, &other.ca_b64, json!({})),
    )
    .await;
    let api: Api<ConfigMap> = Api::namespaced(client(&server).await, "default");
    let err = api_err(
        api.create(&PostParams::default(), &cm("a"))
            .await
            .expect_err("bad CA"),
    );
    assert_eq!(err.code, 500);
    assert!(err.message.contains("tls"), "{}", err.message);
    assert!(
        hook.seen.lock().expect("lock").is_empty(),
        "no review reached an untrusted server"
    );
}

#[tokio::test]
async fn service_reference_and_selectors() {
    let hook = start_hook().await;
    let cfg = ApiServerConfig::default().with_service("gpupool-system", "hook", hook.addr);
    let server = ApiServer::start(cfg).await.expect("server");
    let mut h = webhook(
        "svc.gpupool.io",
        "unused",
        &hook.ca_b64,
        json!({
            "namespaceSelector": {"matchExpressions": [{"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["kube-system"]}]},
            "objectSelector": {"matchLabels": {"hooked": "yes"}},
        }),
    );
    h["clientConfig"] = json!({"service": {"namespace": "gpupool-system", "name": "hook", "path": "/deny", "port": 443}, "caBundle": hook.ca_b64});
    register(
        &server,
        "validatingwebhookconfigurations",
        "ValidatingWebhookConfiguration",
        "v",
        h,
    )
    .await;
    let c = client(&server).await;
    let api: Api<ConfigMap> = Api::namespaced(c.clone(), "default");
    // Not selected by the object selector: allowed without a call.
    api.create(&PostParams::default(), &cm("plain"))
        .await
        .expect("not selected");
    let mut labelled = cm("hooked");
    labelled.metadata.labels = Some([("hooked".to_string(), "yes".to_string())].into());
    let err = api_err(
        api.create(&PostParams::default(), &labelled)
            .await
            .expect_err("denied via service"),
    );
    assert!(
        err.message
            .starts_with("admission webhook \"svc.gpupool.io\" denied"),
        "{}",
        err.message
    );
    // Excluded namespace: allowed without a call.
    let sys: Api<ConfigMap> = Api::namespaced(c, "kube-system");
    sys.create(&PostParams::default(), &labelled)
        .await
        .expect("namespace excluded");
    assert_eq!(hook.seen.lock().expect("lock").len(), 1);
    // DELETE is not in the rules.
    sys.delete("hooked", &DeleteParams::default())
        .await
        .expect("delete not intercepted");
}

/// Creates a ConfigMap on a fresh server with two mutating webhooks, `a`
/// (calling `/first`, policy `first_policy`) ordered before `b` (calling
/// `b_path`, policy `second_policy`); returns the created object's labels,
/// the paths called in call order and the object each call was sent.
async fn two_mutators(
    first_policy: &str,
    b_path: &str,
    second_policy: &str,
) -> (
    std::collections::BTreeMap<String, String>,
    Vec<String>,
    Vec<Value>,
) {
    let hook = start_hook().await;
    let server = ApiServer::start(ApiServerConfig::default())
        .await
        .expect("server");
    let base = format!("https://127.0.0.1:{}", hook.addr.port());
    register(
        &server,
        "mutatingwebhookconfigurations",
        "MutatingWebhookConfiguration",
        "b-second",
        webhook(
            "second.gpupool.io",
            &format!("{base}{b_path}"),
            &hook.ca_b64,
            json!({"reinvocationPolicy": second_policy}),
        ),
    )
    .await;
    register(
        &server,
        "mutatingwebhookconfigurations",
        "MutatingWebhookConfiguration",
        "a-first",
        webhook(
            "first.gpupool.io",
            &format!("{base}/first"),
            &hook.ca_b64,
            json!({"reinvocationPolicy": first_policy}),
        ),
    )
    .await;
    let api: Api<ConfigMap> = Api::namespaced(client(&server).await, "default");
    let made = api
        .create(&PostParams::default(), &cm("r"))
        .await
        .expect("create");
    let stored = api.get("r").await.expect("get");
    assert_eq!(stored.labels(), made.labels(), "stored as answered");
    let seen = hook.seen.lock().expect("lock").clone();
    let paths = seen
        .iter()
        .map(|s| s["path"].as_str().expect("path").to_string())
        .collect();
    let objects = seen
        .iter()
        .map(|s| s["review"]["request"]["object"].clone())
        .collect();
    (made.labels().clone(), paths, objects)
}

#[tokio::test]
async fn if_needed_webhook_is_called_again_after_a_later_webhook_changed_the_object() {
    let (labels, paths, objects) = two_mutators("IfNeeded", "/second", "Never").await;
    assert_eq!(paths, ["/first", "/second", "/first"]);
    assert_eq!(labels["second"], "1", "Never: called once");
    assert_eq!(labels["first"], "1", "the second call saw the later change");
    assert!(objects[0]["metadata"]["labels"].get("second").is_none());
    assert_eq!(objects[2]["metadata"]["labels"]["first"], "absent");
    assert_eq!(objects[2]["metadata"]["labels"]["second"], "1");
}

#[tokio::test]
async fn never_policy_and_unchanged_objects_are_not_called_again() {
    let (labels, paths, _) = two_mutators("Never", "/second", "Never").await;
    assert_eq!(paths, ["/first", "/second"]);
    assert_eq!(labels["first"], "absent");
    // The later webhook allows without a patch: nothing changed after the
    // first one, and its own change does not ask for it again.
    let (labels, paths, _) = two_mutators("IfNeeded", "/allow", "Never").await;
    assert_eq!(paths, ["/first", "/allow"]);
    assert_eq!(labels["first"], "absent");
}

#[tokio::test]
async fn reinvocation_makes_one_extra_pass_only() {
    // Both ask for reinvocation and `/second` changes the object on every
    // call: the extra pass calls `/first` again, whose change asks for
    // `/second` again within the same pass; then it stops.
    let (labels, paths, _) = two_mutators("IfNeeded", "/second", "IfNeeded").await;
    assert_eq!(paths, ["/first", "/second", "/first", "/second"]);
    assert_eq!(labels["second"], "2");
    assert_eq!(labels["first"], "1");
}

#[tokio::test]
async fn webhook_connections_are_kept_alive_and_redialled_when_closed() {
    let hook = start_hook().await;
    let server = ApiServer::start(ApiServerConfig::default())
        .await
        .expect("server");
    let url = format!("https://127.0.0.1:{}/allow", hook.addr.port());
    register(
        &server,
        "validatingwebhookconfigurations",
        "ValidatingWebhookConfiguration",
        "keep",
        webhook("keep.gpupool.io", &url, &hook.ca_b64, json!({})),
    )
    .await;
    let api: Api<ConfigMap> = Api::namespaced(client(&server).await, "default");
    for i in 0..5 {
        api.create(&PostParams::default(), &cm(&format!("k{i}")))
            .await
            .expect("create");
    }
    assert_eq!(hook.seen.lock().expect("lock").len(), 5);
    assert_eq!(
        hook.connections.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "one kept-alive connection for sequential calls"
    );

    // A server that closes every connection after answering is dialled
    // afresh each time, and every call still succeeds.
    let closing = start_hook().await;
    let url = format!("https://127.0.0.1:{}/close", closing.addr.port());
    let server = ApiServer::start(ApiServerConfig::default())
        .await
        .expect("server");
    register(
        &server,
        "validatingwebhookconfigurations",
        "ValidatingWebhookConfiguration",
        "close",
        webhook("close.gpupool.io", &url, &closing.ca_b64, json!({})),
    )
    .await;
    let api: Api<ConfigMap> = Api::namespaced(client(&server).await, "default");
    for i in 0..3 {
        api.create(&PostParams::default(), &cm(&format!("c{i}")))
            .await
            .expect("create");
    }
    assert_eq!(closing.seen.lock().expect("lock").len(), 3);
    assert_eq!(
        closing
            .connections
            .load(std::sync::atomic::Ordering::SeqCst),
        3
    );
}

#[tokio::test]
async fn fields_a_webhook_adds_that_the_kind_lacks_are_dropped_silently() {
    let hook = start_hook().await;
    let server = ApiServer::start(ApiServerConfig::default())
        .await
        .expect("server");
    let url = format!("https://127.0.0.1:{}/unknown", hook.addr.port());
    register(
        &server,
        "mutatingwebhookconfigurations",
        "MutatingWebhookConfiguration",
        "u",
        webhook("unknown.gpupool.io", &url, &hook.ca_b64, json!({})),
    )
    .await;
    let client = client(&server).await;
    // Even under Strict: only the request's own fields are the client's.
    let req = http::Request::post("/api/v1/namespaces/default/configmaps?fieldValidation=Strict")
        .header("content-type", "application/json")
        .body(
            serde_json::to_vec(
                &json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "a"}}),
            )
            .expect("json"),
        )
        .expect("request");
    let made: Value = client.request(req).await.expect("created");
    assert!(made.get("colour").is_none(), "{made}");
    let stored = server
        .admin()
        .get("", "configmaps", "default", "a")
        .expect("stored");
    assert!(stored.get("colour").is_none());
    assert_eq!(hook.seen.lock().expect("lock").len(), 1, "the webhook ran");
}
