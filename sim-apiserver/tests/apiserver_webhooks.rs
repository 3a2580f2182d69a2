//! Admission webhooks called by the simulated API server over HTTPS: the
//! AdmissionReview it sends, patches applied, denials, timeouts and
//! failurePolicy, service references, selectors and CA verification.

use std::collections::BTreeSet;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams,
};
use kube::runtime::watcher;
use kube::{Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

mod webhook_support;

use webhook_support::{
    Hook, MAX_STREAMS, Offer, start_hook, start_hook_offering, start_refusing_hook,
};

use gpupool_sim_apiserver::{ADMIN_TOKEN, ApiServer, ApiServerConfig, RunningApiServer, UserInfo};

/// The `userInfo.extra` key naming the node a bound service-account token
/// was issued for (Kubernetes 1.32+).
const NODE_NAME_EXTRA: &str = "authentication.kubernetes.io/node-name";

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

/// A fresh API server whose one validating webhook, on ConfigMaps, is
/// `path` of `hook`; and the ConfigMaps of namespace `default`.
async fn validated_by(hook: &Hook, path: &str) -> (RunningApiServer, Api<ConfigMap>) {
    let server = ApiServer::start(ApiServerConfig::default())
        .await
        .expect("server");
    let url = format!("https://127.0.0.1:{}{path}", hook.addr.port());
    register(
        &server,
        "validatingwebhookconfigurations",
        "ValidatingWebhookConfiguration",
        "hook",
        webhook("hook.gpupool.io", &url, &hook.ca_b64, json!({})),
    )
    .await;
    let api = Api::namespaced(client(&server).await, "default");
    (server, api)
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
    // A call that timed out is recorded too, with the time it was given.
    let durations = server.webhook_call_durations_ms();
    assert_eq!(durations.len(), 1, "{durations:?}");
    assert!(durations[0] >= 999.0, "{durations:?}");
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
    let (server, api) = validated_by(&hook, "/allow").await;
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
    assert_eq!(
        server.webhook_call_durations_ms().len(),
        5,
        "every call's duration is recorded"
    );

    // A server that closes every connection after answering is dialled
    // afresh each time, and every call still succeeds.
    let closing = start_hook().await;
    let (_server, api) = validated_by(&closing, "/close").await;
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
async fn a_kept_alive_connection_closed_as_a_call_goes_out_is_redialled() {
    // The server drops every request that is not its connection's first,
    // unanswered and without a TLS close_notify: what a server whose idle
    // timeout fires just as a kept-alive connection is reused looks like.
    let hook = start_hook().await;
    let (_server, api) = validated_by(&hook, "/drop-reused").await;
    for i in 0..3 {
        api.create(&PostParams::default(), &cm(&format!("d{i}")))
            .await
            .unwrap_or_else(|e| panic!("create d{i}: {e}"));
    }
    assert_eq!(
        hook.seen.lock().expect("lock").len(),
        3,
        "every call answered once"
    );
    assert_eq!(
        hook.connections.load(std::sync::atomic::Ordering::SeqCst),
        3,
        "the first call dials; each later one reuses, is dropped and dials again"
    );
}

#[tokio::test]
async fn a_webhook_that_never_answers_fails_the_call_with_the_cause() {
    let hook = start_hook().await;
    let (_server, api) = validated_by(&hook, "/drop").await;
    let err = api
        .create(&PostParams::default(), &cm("never"))
        .await
        .expect_err("failurePolicy Fail refuses the create");
    let message = api_err(err).message;
    // The connection error carries what closed it, not just "connection error".
    assert!(
        message.contains("failed calling webhook \"hook.gpupool.io\"")
            && message.contains("connection error: "),
        "{message}"
    );
    assert_eq!(
        hook.connections.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "a fresh connection that fails is not tried again"
    );
}

/// Creates ConfigMaps `{prefix}0..{prefix}{n}` all at once; panics naming
/// the first that failed.
async fn create_at_once(api: &Api<ConfigMap>, prefix: &str, n: usize) {
    let creates = (0..n).map(|i| {
        let api = api.clone();
        let name = format!("{prefix}{i}");
        async move {
            api.create(&PostParams::default(), &cm(&name))
                .await
                .map_err(|e| format!("create {name}: {e}"))
        }
    });
    for result in futures::future::join_all(creates).await {
        if let Err(e) = result {
            panic!("{e}");
        }
    }
}

/// The HTTP versions the hook's reviews came over.
fn versions(hook: &Hook) -> BTreeSet<String> {
    hook.seen
        .lock()
        .expect("lock")
        .iter()
        .map(|s| s["version"].as_str().unwrap_or("?").to_owned())
        .collect()
}

#[tokio::test]
async fn calls_at_once_to_a_webhook_offering_http2_share_one_connection() {
    // As the real API server's client does: it negotiates HTTP/2 and
    // multiplexes, where an HTTP/1.1 client would dial a connection (and a
    // TLS handshake) per call in flight.
    let hook = start_hook_offering(Offer::Http2).await;
    let (_server, api) = validated_by(&hook, "/allow").await;
    // Fewer than the server's limit of streams per connection.
    let calls = MAX_STREAMS as usize - 4;
    create_at_once(&api, "m", calls).await;
    assert_eq!(hook.seen.lock().expect("lock").len(), calls);
    assert_eq!(versions(&hook), BTreeSet::from(["HTTP/2.0".to_owned()]));
    assert_eq!(
        hook.connections.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "the burst waits for one dial and shares its connection"
    );

    // The server goes away without a word: the next call dials again.
    hook.cut_connections();
    api.create(&PostParams::default(), &cm("after-cut"))
        .await
        .expect("create after the connection was cut");
    assert_eq!(
        hook.connections.load(std::sync::atomic::Ordering::SeqCst),
        2
    );

    // An HTTP/1.1-only server is still called, one call per connection.
    let plain = start_hook().await;
    let (_server, api) = validated_by(&plain, "/allow").await;
    create_at_once(&api, "p", 5).await;
    assert_eq!(versions(&plain), BTreeSet::from(["HTTP/1.1".to_owned()]));
    assert_eq!(
        plain
            .most_in_flight
            .load(std::sync::atomic::Ordering::SeqCst),
        1
    );
}

#[tokio::test]
async fn a_call_refused_unprocessed_is_sent_again_a_bounded_number_of_times() {
    let (hook, refused) = start_refusing_hook(3).await;
    let (_server, api) = validated_by(&hook, "/allow").await;
    api.create(&PostParams::default(), &cm("r"))
        .await
        .expect("created once the server takes the stream");
    assert_eq!(refused.load(std::sync::atomic::Ordering::SeqCst), 3);
    assert_eq!(hook.seen.lock().expect("lock").len(), 1, "answered once");

    // A server that refuses every stream fails the call, saying so.
    let (hook, refused) = start_refusing_hook(usize::MAX).await;
    let (_server, api) = validated_by(&hook, "/allow").await;
    let err = api
        .create(&PostParams::default(), &cm("never"))
        .await
        .expect_err("failurePolicy Fail refuses the create");
    let message = api_err(err).message;
    assert!(message.contains("refused stream"), "{message}");
    assert_eq!(
        refused.load(std::sync::atomic::Ordering::SeqCst),
        9,
        "sent once and again 8 times"
    );
}

#[tokio::test]
async fn no_http2_connection_carries_more_than_its_share_of_calls() {
    // 150 calls held 3 s each: no connection carries more at once than the
    // server allows, and a connection is added only when the kept ones are
    // full (150 / 16 streams: 10 at the most).
    let hook = start_hook_offering(Offer::Http2).await;
    let (_server, api) = validated_by(&hook, "/slow").await;
    create_at_once(&api, "s", 150).await;
    assert_eq!(hook.seen.lock().expect("lock").len(), 150);
    let most = hook
        .most_in_flight
        .load(std::sync::atomic::Ordering::SeqCst);
    let connections = hook.connections.load(std::sync::atomic::Ordering::SeqCst);
    assert_eq!(
        most, MAX_STREAMS as usize,
        "calls were multiplexed up to the server's limit"
    );
    // More than the client's own cap of 100 calls per connection needs: the
    // server's limit decided.
    let full = 150usize.div_ceil(MAX_STREAMS as usize);
    assert!(
        (3..=full).contains(&connections),
        "{connections} connections for 150 calls"
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

// ---------------------------------------------------------------------------
// Pods: nodeName and scheduling gates, refused as the real server refuses them.

fn pod_json(name: &str, node: Option<&str>, gates: &[&str]) -> Pod {
    let mut spec = json!({"containers": [{"name": "c", "image": "busybox"}]});
    if let Some(n) = node {
        spec["nodeName"] = json!(n);
    }
    if !gates.is_empty() {
        spec["schedulingGates"] =
            json!(gates.iter().map(|g| json!({"name": g})).collect::<Vec<_>>());
    }
    serde_json::from_value(json!({"metadata": {"name": name}, "spec": spec})).expect("pod")
}

const GATED_NODE_NAME: &str =
    "spec.nodeName: Forbidden: cannot be set until all schedulingGates have been cleared";

#[tokio::test]
async fn node_name_with_scheduling_gates_is_invalid_on_create_and_update() {
    let server = ApiServer::start(ApiServerConfig::default())
        .await
        .expect("server");
    let pods: Api<Pod> = Api::namespaced(client(&server).await, "default");

    // Created with both: 422, the field error naming spec.nodeName.
    let err = api_err(
        pods.create(
            &PostParams::default(),
            &pod_json("both", Some("node-1"), &["g"]),
        )
        .await
        .expect_err("nodeName with gates"),
    );
    assert_eq!((err.code, err.reason.as_str()), (422, "Invalid"));
    assert_eq!(
        err.message,
        format!("Pod \"both\" is invalid: {GATED_NODE_NAME}")
    );
    assert!(pods.get_opt("both").await.expect("get").is_none());

    // Either alone is fine.
    pods.create(
        &PostParams::default(),
        &pod_json("named", Some("node-1"), &[]),
    )
    .await
    .expect("nodeName alone");
    pods.create(&PostParams::default(), &pod_json("gated", None, &["a"]))
        .await
        .expect("gates alone");

    // UPDATE: a new gate is refused at its index; removing one is allowed.
    let add = Patch::Merge(json!({"spec": {"schedulingGates": [{"name": "a"}, {"name": "b"}]}}));
    let err = api_err(
        pods.patch("gated", &PatchParams::default(), &add)
            .await
            .expect_err("adding a gate"),
    );
    assert_eq!((err.code, err.reason.as_str()), (422, "Invalid"));
    assert_eq!(
        err.message,
        "Pod \"gated\" is invalid: spec.schedulingGates[1].name: Forbidden: only deletion is allowed, but found new scheduling gate 'b'"
    );
    let err = api_err(
        pods.patch(
            "named",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"schedulingGates": [{"name": "late"}]}})),
        )
        .await
        .expect_err("gating a pod already named to a node"),
    );
    assert!(
        err.message
            .contains("spec.schedulingGates[0].name: Forbidden: only deletion is allowed"),
        "{}",
        err.message
    );

    // UPDATE: naming a node while gated (or at all) is a spec change the
    // real server refuses; only the binding subresource sets nodeName.
    let err = api_err(
        pods.patch(
            "gated",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"nodeName": "node-1"}})),
        )
        .await
        .expect_err("naming a node while gated"),
    );
    assert_eq!(err.code, 422);
    assert!(
        err.message
            .contains("spec: Forbidden: pod updates may not change fields other than"),
        "{}",
        err.message
    );
    let stored = pods.get("gated").await.expect("gated pod");
    assert_eq!(stored.spec.as_ref().and_then(|s| s.node_name.clone()), None);
}

#[tokio::test]
async fn a_pod_gated_by_a_mutating_webhook_cannot_keep_its_node_name() {
    let hook = start_hook().await;
    let server = ApiServer::start(ApiServerConfig::default())
        .await
        .expect("server");
    let url = format!("https://127.0.0.1:{}/gate", hook.addr.port());
    let mut h = webhook("gate.gpupool.io", &url, &hook.ca_b64, json!({}));
    h["rules"] = json!([{"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"], "resources": ["pods"]}]);
    register(
        &server,
        "mutatingwebhookconfigurations",
        "MutatingWebhookConfiguration",
        "gpupool",
        h,
    )
    .await;
    let pods: Api<Pod> = Api::namespaced(client(&server).await, "default");

    // Validation runs after mutation: the gate the webhook adds makes the
    // node the client named invalid, so the pod cannot skip the queue.
    let err = api_err(
        pods.create(
            &PostParams::default(),
            &pod_json("jumper", Some("node-1"), &[]),
        )
        .await
        .expect_err("gated with nodeName"),
    );
    assert_eq!((err.code, err.reason.as_str()), (422, "Invalid"));
    assert_eq!(
        err.message,
        format!("Pod \"jumper\" is invalid: {GATED_NODE_NAME}")
    );
    assert!(pods.get_opt("jumper").await.expect("get").is_none());
    assert_eq!(
        hook.seen.lock().expect("lock").len(),
        1,
        "the webhook was called"
    );

    // Without nodeName the same webhook gates the pod and it is stored.
    let made = pods
        .create(&PostParams::default(), &pod_json("queued", None, &[]))
        .await
        .expect("gated pod");
    let gates: Vec<String> = made
        .spec
        .and_then(|s| s.scheduling_gates)
        .unwrap_or_default()
        .into_iter()
        .map(|g| g.name)
        .collect();
    assert_eq!(gates, ["gpupool.io/admission"]);
}

// ---------------------------------------------------------------------------
// userInfo.extra.

#[tokio::test]
async fn user_extra_reaches_the_webhook() {
    let hook = start_hook().await;
    let plugin = UserInfo::new(
        "system:serviceaccount:gpupool-system:gpupool-device-plugin",
        &["system:serviceaccounts"],
    )
    .with_extra(NODE_NAME_EXTRA, &["node-1"])
    .with_extra("authentication.kubernetes.io/pod-name", &["plugin-abc"]);
    let cfg = ApiServerConfig::default().with_user("plugin-token", plugin);
    let server = ApiServer::start(cfg).await.expect("server");
    let url = format!("https://127.0.0.1:{}/allow", hook.addr.port());
    register(
        &server,
        "validatingwebhookconfigurations",
        "ValidatingWebhookConfiguration",
        "v",
        webhook("allow.gpupool.io", &url, &hook.ca_b64, json!({})),
    )
    .await;
    let as_plugin: Api<ConfigMap> = Api::namespaced(
        server
            .client_with_token("plugin-token")
            .await
            .expect("client"),
        "default",
    );
    as_plugin
        .create(&PostParams::default(), &cm("from-plugin"))
        .await
        .expect("create as the plugin");
    let as_admin: Api<ConfigMap> = Api::namespaced(client(&server).await, "default");
    as_admin
        .create(&PostParams::default(), &cm("from-admin"))
        .await
        .expect("create as admin");

    let seen = hook.seen.lock().expect("lock").clone();
    assert_eq!(seen.len(), 2);
    let user = &seen[0]["review"]["request"]["userInfo"];
    assert_eq!(
        user["username"],
        "system:serviceaccount:gpupool-system:gpupool-device-plugin"
    );
    assert_eq!(
        user["extra"],
        json!({
            "authentication.kubernetes.io/node-name": ["node-1"],
            "authentication.kubernetes.io/pod-name": ["plugin-abc"],
        })
    );
    // A user without extra: the key is left out, as the real server's JSON omits it.
    let admin = &seen[1]["review"]["request"]["userInfo"];
    assert_eq!(admin["username"], "admin");
    assert!(admin.get("extra").is_none(), "{admin}");
}

// ---------------------------------------------------------------------------
// Custom resources and their status subresource.

async fn install_crds(server: &RunningApiServer) {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../crds");
    for f in ["gpuleaseclasses.yaml", "gpuleases.yaml"] {
        let yaml = std::fs::read_to_string(dir.join(f)).expect("crd file");
        server
            .create_crds_from_yaml(&yaml)
            .await
            .expect("crd created");
    }
}

fn gpupool_resource(kind: &str, plural: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("gpupool.io", "v1alpha1", kind),
        plural,
    )
}

/// A hook on `resources` of gpupool.io/v1alpha1 (CREATE, UPDATE) calling `path`.
fn gpupool_hook(name: &str, hook: &Hook, path: &str, resources: &[&str]) -> Value {
    let url = format!("https://127.0.0.1:{}{path}", hook.addr.port());
    let mut h = webhook(name, &url, &hook.ca_b64, json!({}));
    h["rules"] = json!([{"operations": ["CREATE", "UPDATE"], "apiGroups": ["gpupool.io"], "apiVersions": ["v1alpha1"], "resources": resources}]);
    h
}

/// The reviews the hook received at `path`, in order, and forgets them all.
fn take(hook: &Hook) -> Vec<(String, Value)> {
    std::mem::take(&mut *hook.seen.lock().expect("lock"))
        .into_iter()
        .map(|s| {
            (
                s["path"].as_str().unwrap_or_default().to_string(),
                s["review"]["request"].clone(),
            )
        })
        .collect()
}

fn paths(reviews: &[(String, Value)]) -> BTreeSet<&str> {
    reviews.iter().map(|(p, _)| p.as_str()).collect()
}

#[tokio::test]
async fn custom_resources_and_their_status_go_through_the_matching_webhooks() {
    let hook = start_hook().await;
    let server = ApiServer::start(ApiServerConfig::default())
        .await
        .expect("server");
    install_crds(&server).await;
    let cfg = json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": "gpupool"},
        "webhooks": [
            gpupool_hook("leases.gpupool.io", &hook, "/leases", &["gpuleases"]),
            gpupool_hook("status.gpupool.io", &hook, "/status", &["gpuleases/status"]),
            gpupool_hook("any-status.gpupool.io", &hook, "/any-status", &["*/status"]),
            gpupool_hook("everything.gpupool.io", &hook, "/everything", &["*/*"]),
            gpupool_hook("classes.gpupool.io", &hook, "/classes", &["gpuleaseclasses"]),
        ],
    });
    server
        .create(
            "admissionregistration.k8s.io",
            "v1",
            "validatingwebhookconfigurations",
            "",
            cfg,
        )
        .await
        .expect("validating configuration");
    // A mutating webhook on /status that tries to add a label: the status
    // strategy keeps only the status of what it returns.
    server
        .create(
            "admissionregistration.k8s.io",
            "v1",
            "mutatingwebhookconfigurations",
            "",
            json!({
                "apiVersion": "admissionregistration.k8s.io/v1",
                "kind": "MutatingWebhookConfiguration",
                "metadata": {"name": "gpupool"},
                "webhooks": [gpupool_hook("mutate-status.gpupool.io", &hook, "/mutate", &["gpuleases/status"])],
            }),
        )
        .await
        .expect("mutating configuration");
    let c = client(&server).await;
    let leases: Api<DynamicObject> = Api::namespaced_with(
        c.clone(),
        "default",
        &gpupool_resource("GpuLease", "gpuleases"),
    );
    let classes: Api<DynamicObject> = Api::all_with(
        c.clone(),
        &gpupool_resource("GpuLeaseClass", "gpuleaseclasses"),
    );

    // CREATE of the main resource: the plain and the */* rules, no status rule.
    let lease: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "gpupool.io/v1alpha1", "kind": "GpuLease",
        "metadata": {"name": "p1"},
        "spec": {"className": "default", "podName": "p1", "podUID": "u1", "role": "primary", "slots": 1},
    }))
    .expect("lease");
    leases
        .create(&PostParams::default(), &lease)
        .await
        .expect("lease created");
    let reviews = take(&hook);
    assert_eq!(paths(&reviews), BTreeSet::from(["/leases", "/everything"]));
    for (path, req) in &reviews {
        assert_eq!(req["operation"], "CREATE", "{path}");
        assert!(req.get("subResource").is_none(), "{path}: {req}");
        assert_eq!(
            req["resource"],
            json!({"group": "gpupool.io", "version": "v1alpha1", "resource": "gpuleases"})
        );
        assert_eq!(
            req["kind"],
            json!({"group": "gpupool.io", "version": "v1alpha1", "kind": "GpuLease"})
        );
        assert_eq!(req["namespace"], "default");
        assert_eq!(req["name"], "p1");
        assert_eq!(req["object"]["spec"]["slots"], 1);
        assert!(req["oldObject"].is_null());
    }

    // PATCH of /status: the status rules and */*, with the full object
    // after the patch and the object before it.
    let patched = leases
        .patch_status(
            "p1",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"phase": "Bound", "node": "node-1", "gpus": [{"index": 0, "uuid": "GPU-0"}]}})),
        )
        .await
        .expect("status patched");
    let reviews = take(&hook);
    assert_eq!(
        paths(&reviews),
        BTreeSet::from(["/mutate", "/status", "/any-status", "/everything"])
    );
    for (path, req) in &reviews {
        assert_eq!(req["operation"], "UPDATE", "{path}");
        assert_eq!(req["subResource"], "status", "{path}");
        assert_eq!(req["requestSubResource"], "status", "{path}");
        assert_eq!(
            req["resource"],
            json!({"group": "gpupool.io", "version": "v1alpha1", "resource": "gpuleases"}),
            "{path}"
        );
        assert_eq!(
            req["kind"],
            json!({"group": "gpupool.io", "version": "v1alpha1", "kind": "GpuLease"}),
            "{path}"
        );
        assert_eq!(req["userInfo"]["username"], "admin");
        assert_eq!(
            req["object"]["spec"]["podName"], "p1",
            "{path}: the whole object"
        );
        assert_eq!(req["object"]["status"]["node"], "node-1", "{path}");
        assert_eq!(
            req["object"]["status"]["gpus"][0]["uuid"], "GPU-0",
            "{path}"
        );
        assert_eq!(req["oldObject"]["spec"]["slots"], 1, "{path}");
        assert!(req["oldObject"].get("status").is_none(), "{path}");
    }
    assert!(
        !patched.labels().contains_key("mutated"),
        "a /status webhook cannot change metadata: {:?}",
        patched.labels()
    );

    // A status patch that also touches spec: the spec part is dropped
    // before validation, so validating webhooks see the stored spec.
    leases
        .patch_status(
            "p1",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"slots": 2}, "status": {"message": "hi"}})),
        )
        .await
        .expect("status patched");
    for (path, req) in take(&hook) {
        assert_eq!(req["object"]["spec"]["slots"], 1, "{path}");
        assert_eq!(req["object"]["status"]["message"], "hi", "{path}");
    }

    // UPDATE of the main resource: the plain and */* rules only.
    leases
        .patch(
            "p1",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"slots": 3}})),
        )
        .await
        .expect("spec patched");
    let reviews = take(&hook);
    assert_eq!(paths(&reviews), BTreeSet::from(["/leases", "/everything"]));
    for (path, req) in &reviews {
        assert_eq!(req["operation"], "UPDATE");
        assert!(req.get("subResource").is_none(), "{path}");
        assert_eq!(req["oldObject"]["spec"]["slots"], 1, "{path}");
        assert_eq!(req["object"]["spec"]["slots"], 3, "{path}");
        assert_eq!(
            req["object"]["status"]["node"], "node-1",
            "{path}: status kept"
        );
    }

    // A cluster-scoped custom resource: no namespace in the request.
    let class: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "gpupool.io/v1alpha1", "kind": "GpuLeaseClass",
        "metadata": {"name": "default"},
        "spec": {"default": true},
    }))
    .expect("class");
    classes
        .create(&PostParams::default(), &class)
        .await
        .expect("class created");
    let reviews = take(&hook);
    assert_eq!(paths(&reviews), BTreeSet::from(["/classes", "/everything"]));
    for (path, req) in &reviews {
        assert_eq!(
            req["resource"],
            json!({"group": "gpupool.io", "version": "v1alpha1", "resource": "gpuleaseclasses"}),
            "{path}"
        );
        assert_eq!(req["kind"]["kind"], "GpuLeaseClass");
        assert!(req.get("namespace").is_none(), "{path}: {req}");
    }
}

#[tokio::test]
async fn a_status_webhook_denial_refuses_the_status_write() {
    let hook = start_hook().await;
    let server = ApiServer::start(ApiServerConfig::default())
        .await
        .expect("server");
    install_crds(&server).await;
    register(
        &server,
        "validatingwebhookconfigurations",
        "ValidatingWebhookConfiguration",
        "gpupool",
        gpupool_hook("status.gpupool.io", &hook, "/deny", &["gpuleases/status"]),
    )
    .await;
    let leases: Api<DynamicObject> = Api::namespaced_with(
        client(&server).await,
        "default",
        &gpupool_resource("GpuLease", "gpuleases"),
    );
    let lease: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "gpupool.io/v1alpha1", "kind": "GpuLease",
        "metadata": {"name": "p1"},
        "spec": {"className": "default", "podName": "p1", "podUID": "u1", "role": "primary", "slots": 1},
    }))
    .expect("lease");
    leases
        .create(&PostParams::default(), &lease)
        .await
        .expect("main resource not hooked");
    let err = api_err(
        leases
            .patch_status(
                "p1",
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {"sequence": 1}})),
            )
            .await
            .expect_err("status write denied"),
    );
    assert_eq!(err.code, 403);
    assert_eq!(
        err.message,
        "admission webhook \"status.gpupool.io\" denied the request: no GPUs for you"
    );
    let stored = leases.get("p1").await.expect("lease");
    assert!(
        stored
            .data
            .get("status")
            .is_none_or(|s| s.get("sequence").is_none())
    );
    // A replace (PUT) of /status goes through the same webhook.
    let mut body = stored.clone();
    body.data["status"] = json!({"sequence": 2});
    let err = api_err(
        leases
            .replace_status("p1", &PostParams::default(), &body)
            .await
            .expect_err("status replace denied"),
    );
    assert_eq!(err.code, 403);
}

// ---------------------------------------------------------------------------
// Watching the webhook configurations by name.

/// Watches `K` objects named `gpupool` as the operator does (a kube-rs
/// watcher with a metadata.name field selector) while another object of
/// the kind changes beside it; checks which events arrive.
/// The next watch event summary, or "nothing" after 5 s.
async fn next(rx: &mut tokio::sync::mpsc::UnboundedReceiver<String>) -> String {
    tokio::time::timeout(Duration::from_secs(5), rx.recv())
        .await
        .ok()
        .flatten()
        .unwrap_or_else(|| "nothing".into())
}

async fn watch_by_name<K>(server: &RunningApiServer, plural: &str, kind: &str)
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    let c = client(server).await;
    let make = |name: &str| {
        json!({
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": kind,
            "metadata": {"name": name},
            "webhooks": [],
        })
    };
    let create = |name: &'static str| {
        let obj = make(name);
        async move {
            server
                .create("admissionregistration.k8s.io", "v1", plural, "", obj)
                .await
                .expect("created");
        }
    };
    create("gpupool").await;
    create("other").await;
    let api: Api<K> = Api::all(c.clone());
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let task = tokio::spawn(async move {
        let mut stream = watcher(
            api,
            watcher::Config::default().fields("metadata.name=gpupool"),
        )
        .boxed();
        while let Some(ev) = stream.next().await {
            let summary = match ev {
                Ok(watcher::Event::Init) => "init".to_string(),
                Ok(watcher::Event::InitApply(o)) => {
                    format!("init-apply {}", o.meta().name.clone().unwrap_or_default())
                }
                Ok(watcher::Event::InitDone) => "init-done".to_string(),
                Ok(watcher::Event::Apply(o)) => {
                    format!("apply {}", o.meta().name.clone().unwrap_or_default())
                }
                Ok(watcher::Event::Delete(o)) => {
                    format!("delete {}", o.meta().name.clone().unwrap_or_default())
                }
                Err(e) => format!("error {e}"),
            };
            if tx.send(summary).is_err() {
                return;
            }
        }
    });
    assert_eq!(next(&mut rx).await, "init", "{kind}");
    assert_eq!(
        next(&mut rx).await,
        "init-apply gpupool",
        "{kind}: only the named object is listed"
    );
    assert_eq!(next(&mut rx).await, "init-done", "{kind}");

    let raw: Api<DynamicObject> = Api::all_with(
        c,
        &ApiResource::from_gvk_with_plural(
            &GroupVersionKind::gvk("admissionregistration.k8s.io", "v1", kind),
            plural,
        ),
    );
    let label = |v: &str| Patch::Merge(json!({"metadata": {"labels": {"changed": v}}}));
    // Changes to another object are not seen; changes to the named one are.
    raw.patch("other", &PatchParams::default(), &label("1"))
        .await
        .expect("other changed");
    raw.patch("gpupool", &PatchParams::default(), &label("1"))
        .await
        .expect("gpupool changed");
    assert_eq!(next(&mut rx).await, "apply gpupool", "{kind}");
    raw.delete("other", &DeleteParams::default())
        .await
        .expect("other deleted");
    raw.delete("gpupool", &DeleteParams::default())
        .await
        .expect("gpupool deleted");
    assert_eq!(
        next(&mut rx).await,
        "delete gpupool",
        "{kind}: DELETED event"
    );
    // Restored: seen again.
    create("gpupool").await;
    assert_eq!(next(&mut rx).await, "apply gpupool", "{kind}");
    let quiet = tokio::time::timeout(Duration::from_millis(300), rx.recv()).await;
    assert!(quiet.is_err(), "{kind}: unexpected event {quiet:?}");
    task.abort();
}

#[tokio::test]
async fn webhook_configurations_are_watched_by_name() {
    let server = ApiServer::start(ApiServerConfig::default())
        .await
        .expect("server");
    watch_by_name::<MutatingWebhookConfiguration>(
        &server,
        "mutatingwebhookconfigurations",
        "MutatingWebhookConfiguration",
    )
    .await;
    watch_by_name::<ValidatingWebhookConfiguration>(
        &server,
        "validatingwebhookconfigurations",
        "ValidatingWebhookConfiguration",
    )
    .await;
}

/// `matchConditions` decide, as on the real server, whether a webhook is
/// called at all: a false condition skips it, a condition that cannot be
/// evaluated fails the request under `failurePolicy: Fail` (naming the
/// condition) and skips the webhook under `Ignore`.
#[tokio::test]
async fn match_conditions_decide_whether_a_webhook_is_called() {
    let hook = start_hook().await;
    let server = ApiServer::start(ApiServerConfig::default())
        .await
        .expect("server");
    let url = format!("https://127.0.0.1:{}/deny", hook.addr.port());
    let conditions = json!({"matchConditions": [
        {"name": "not-the-operator", "expression": "!(request.userInfo.username in ['operator'])"},
        {"name": "labelled", "expression": "has(object.metadata.labels) && object.metadata.labels['guard'] == 'yes'"},
    ]});
    register(
        &server,
        "validatingwebhookconfigurations",
        "ValidatingWebhookConfiguration",
        "conditions",
        webhook("conditions.gpupool.io", &url, &hook.ca_b64, conditions),
    )
    .await;
    let api: Api<ConfigMap> = Api::namespaced(client(&server).await, "default");
    let labelled = |name: &str, guard: &str| -> ConfigMap {
        serde_json::from_value(json!({"metadata": {"name": name, "labels": {"guard": guard}}}))
            .expect("cm")
    };

    // A condition is false: the denying webhook is never called.
    api.create(&PostParams::default(), &cm("plain"))
        .await
        .expect("no labels: skipped");
    api.create(&PostParams::default(), &labelled("other", "no"))
        .await
        .expect("another label value: skipped");
    assert_eq!(hook.seen.lock().expect("lock").len(), 0);

    // Every condition holds: it is called, and denies.
    let err = api_err(
        api.create(&PostParams::default(), &labelled("guarded", "yes"))
            .await
            .expect_err("denied"),
    );
    assert!(
        err.message.contains("denied the request"),
        "{}",
        err.message
    );
    assert_eq!(hook.seen.lock().expect("lock").len(), 1);

    // A condition that cannot be evaluated fails the request under Fail...
    let broken = json!({"matchConditions": [
        {"name": "needs-labels", "expression": "object.metadata.labels['guard'] == 'yes'"},
    ], "failurePolicy": "Fail"});
    let allow = format!("https://127.0.0.1:{}/allow", hook.addr.port());
    register(
        &server,
        "validatingwebhookconfigurations",
        "ValidatingWebhookConfiguration",
        "broken",
        webhook("broken.gpupool.io", &allow, &hook.ca_b64, broken),
    )
    .await;
    let err = api_err(
        api.create(&PostParams::default(), &cm("unlabelled"))
            .await
            .expect_err("the condition errs: fail closed"),
    );
    assert_eq!(err.code, 500);
    assert!(
        err.message
            .contains("failed calling webhook \"broken.gpupool.io\"")
            && err.message.contains("\"needs-labels\"")
            && err.message.contains("no such key: labels"),
        "{}",
        err.message
    );
    assert_eq!(hook.seen.lock().expect("lock").len(), 1, "not called");

    // ...and skips the webhook under Ignore.
    let ignoring = webhook(
        "ignoring.gpupool.io",
        &allow,
        &hook.ca_b64,
        json!({"matchConditions": [
            {"name": "needs-labels", "expression": "object.metadata.labels['guard'] == 'yes'"},
        ], "failurePolicy": "Ignore"}),
    );
    let configurations: Api<ValidatingWebhookConfiguration> = Api::all(client(&server).await);
    configurations
        .delete("broken", &Default::default())
        .await
        .expect("deleted");
    register(
        &server,
        "validatingwebhookconfigurations",
        "ValidatingWebhookConfiguration",
        "ignoring",
        ignoring,
    )
    .await;
    api.create(&PostParams::default(), &cm("unlabelled"))
        .await
        .expect("the condition errs: skipped under Ignore");
    assert_eq!(hook.seen.lock().expect("lock").len(), 1, "not called");

    // A webhook that exempts the writer by name is not called for it.
    let mut exempting = webhook(
        "exempt.gpupool.io",
        &url,
        &hook.ca_b64,
        json!({"matchConditions": [
            {"name": "not-admin", "expression": "!(request.userInfo.username in ['admin'])"},
        ]}),
    );
    exempting["rules"][0]["operations"] = json!(["DELETE"]);
    register(
        &server,
        "validatingwebhookconfigurations",
        "ValidatingWebhookConfiguration",
        "exempt",
        exempting,
    )
    .await;
    api.delete("plain", &Default::default())
        .await
        .expect("the admin is exempt from the denying webhook");
    assert_eq!(hook.seen.lock().expect("lock").len(), 1, "not called");
}
