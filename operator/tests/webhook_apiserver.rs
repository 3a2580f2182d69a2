//! The webhook end to end against the simulated API server: it creates its
//! certificate Secret and webhook configurations, the API server calls it
//! over HTTPS for every pod CREATE and gated-pod UPDATE, and users see its
//! patches and its denials exactly as kubectl would.

use std::net::SocketAddr;
use std::time::Duration;

use gpupool_operator::index::Caches;
use gpupool_operator::metrics::Metrics;
use gpupool_operator::webhook::certs::{self, SECRET_NAME, TlsBundle};
use gpupool_operator::webhook::configurations::{
    self, MUTATING_WEBHOOK_NAME, VALIDATING_WEBHOOK_NAME,
};
use gpupool_operator::webhook::{
    self, RunningWebhook, WebhookConfig, WebhookEndpoint, WebhookMetrics,
};
use gpupool_sim_apiserver::{ApiServer, ApiServerConfig, FaultConfig, RunningApiServer};
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use k8s_openapi::api::core::v1::{Namespace, Pod, Secret};
use k8s_openapi::api::rbac::v1::ClusterRole;
use kube::api::{Api, Patch, PatchParams, PostParams};
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use serde_json::{Value, json};
use tokio::sync::oneshot;

const OPERATOR_NS: &str = "gpupool-system";
const OPERATOR_TOKEN: &str = "operator-token";
const OPERATOR_USER: &str = "gpupool-operator";
const ALICE_TOKEN: &str = "alice-token";

/// A port that was free a moment ago: the webhook URL must name its port
/// before the webhook binds it. Picked outside the kernel's ephemeral
/// range and never twice, so no other test's listener takes it meanwhile.
fn free_port() -> u16 {
    let [port] = gpupool_sim_apiserver::ports::free_ports().expect("a free loopback port");
    port
}

async fn cluster() -> RunningApiServer {
    let config = ApiServerConfig::default()
        .with_token(OPERATOR_TOKEN, OPERATOR_USER, &[])
        .with_token(ALICE_TOKEN, "alice", &[]);
    let api = ApiServer::start(config).await.expect("API server starts");
    let crds = ["gpuleaseclasses.yaml", "gpuleases.yaml"]
        .iter()
        .map(|f| {
            std::fs::read_to_string(format!("{}/../crds/{f}", env!("CARGO_MANIFEST_DIR")))
                .expect("CRD file")
        })
        .collect::<Vec<_>>()
        .join("\n---\n");
    api.create_crds_from_yaml(&crds).await.expect("CRDs apply");
    let admin = api.client().await.expect("admin client");
    let namespaces: Api<Namespace> = Api::all(admin);
    for ns in [OPERATOR_NS, "ml"] {
        namespaces
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({"metadata": {"name": ns}})).expect("namespace"),
            )
            .await
            .expect("namespace created");
    }
    api
}

fn put(api: &RunningApiServer, group: &str, plural: &str, obj: Value) {
    api.admin().put(group, plural, obj).expect("stored");
}

fn class(name: &str, spec: Value) -> Value {
    json!({"apiVersion": "gpupool.io/v1alpha1", "kind": "GpuLeaseClass",
        "metadata": {"name": name}, "spec": spec})
}

fn node(name: &str, slots: u32) -> Value {
    json!({"apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
        "status": {"allocatable": {"gpupool/slot": slots.to_string(), "cpu": "8"}}})
}

struct Hook {
    running: Option<RunningWebhook>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<Result<(), webhook::WebhookError>>>,
    ca: String,
}

fn webhook_config(port: u16) -> WebhookConfig {
    let url = format!("https://127.0.0.1:{port}").parse().expect("url");
    let mut config = WebhookConfig::new(
        port,
        OPERATOR_NS,
        WebhookEndpoint::Url(url),
        [OPERATOR_USER.to_owned()],
    );
    config.listen = SocketAddr::from(([127, 0, 0, 1], port));
    config.cache_sync_timeout = Duration::from_secs(10);
    config
}

/// The operator's watch caches, as `main` starts them for the webhook.
fn caches(client: &kube::Client) -> Caches {
    let mut registry = prometheus_client::registry::Registry::default();
    Caches::start(
        client,
        std::sync::Arc::new(tokio::sync::Notify::new()),
        &Metrics::register(&mut registry),
    )
}

impl Hook {
    async fn start(api: &RunningApiServer) -> Self {
        let client = api
            .client_with_token(OPERATOR_TOKEN)
            .await
            .expect("operator client");
        let running = webhook::start(
            webhook_config(free_port()),
            client.clone(),
            caches(&client),
            WebhookMetrics::default(),
        )
        .await
        .expect("webhook starts");
        let ca = running.ca_bundle().to_owned();
        Self {
            running: Some(running),
            stop: None,
            task: None,
            ca,
        }
    }

    fn serve(mut self) -> Self {
        let running = self.running.take().expect("not serving yet");
        let (stop, stopped) = oneshot::channel::<()>();
        self.task = Some(tokio::spawn(running.serve(async {
            let _ = stopped.await;
        })));
        self.stop = Some(stop);
        self
    }

    async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            tokio::time::timeout(Duration::from_secs(10), task)
                .await
                .expect("stops in time")
                .expect("no panic")
                .expect("served cleanly");
        }
    }
}

fn gpu_pod(name: &str, labels: Value, slots: &str) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": name, "labels": labels},
        "spec": {"containers": [{"name": "main", "image": "trainer",
            "resources": {"limits": {"gpupool/slot": slots}}}]}
    }))
    .expect("pod")
}

fn denied_message(err: kube::Error) -> String {
    match err {
        kube::Error::Api(status) => {
            assert_eq!(status.code, 403, "{status:?}");
            status.message
        }
        other => panic!("expected an API error, got {other}"),
    }
}

fn mutating_denial(message: &str) -> String {
    format!("admission webhook \"{MUTATING_WEBHOOK_NAME}\" denied the request: {message}")
}

/// Creates pods (generated names) from `labels` until one is denied with
/// `message`: the webhook's caches follow the API by watch, so a change made
/// a moment ago may not be seen by the first attempt. At most 50 attempts,
/// 100 ms apart; returns the last answer otherwise.
async fn denied_eventually(pods: &Api<Pod>, labels: Value, message: &str) -> String {
    let mut pod = gpu_pod("", labels, "1");
    pod.metadata.name = None;
    pod.metadata.generate_name = Some("try-".to_owned());
    let mut last = String::new();
    for _ in 0..50 {
        last = match pods.create(&PostParams::default(), &pod).await {
            Ok(created) => format!("created {:?}", created.metadata.name),
            Err(e) => denied_message(e),
        };
        if last == message {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    last
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_are_gated_stamped_and_denied_through_the_api_server() {
    let api = cluster().await;
    put(
        &api,
        "gpupool.io",
        "gpuleaseclasses",
        class("default", json!({"default": true})),
    );
    put(
        &api,
        "gpupool.io",
        "gpuleaseclasses",
        class("small", json!({"admission": {"maxQueued": 1}})),
    );
    put(&api, "", "nodes", node("node-1", 2));
    put(&api, "", "nodes", node("node-2", 4));
    let hook = Hook::start(&api).await.serve();

    let alice = api.client_with_token(ALICE_TOKEN).await.expect("alice");
    let pods: Api<Pod> = Api::namespaced(alice.clone(), "ml");
    let pp = PostParams::default();

    // Queued: the gate and the stamp are there when the create returns.
    let created = pods
        .create(&pp, &gpu_pod("train", json!({}), "4"))
        .await
        .expect("gpupool pod admitted to the queue");
    let gates: Vec<String> = created
        .spec
        .as_ref()
        .and_then(|s| s.scheduling_gates.as_ref())
        .map(|g| g.iter().map(|g| g.name.clone()).collect())
        .unwrap_or_default();
    assert_eq!(gates, ["gpupool.io/admission"]);
    let stamp = created
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get("gpupool.io/enqueued-at"))
        .expect("enqueued-at stamped");
    gpupool_api::time::parse_stamp(stamp).expect("an RFC 3339 stamp");

    // Pods that ask for no GPU slot are left alone.
    let web: Pod = serde_json::from_value(json!({
        "metadata": {"name": "web"},
        "spec": {"containers": [{"name": "web", "image": "nginx"}]}
    }))
    .expect("pod");
    let web = pods.create(&pp, &web).await.expect("plain pod");
    assert!(web.spec.and_then(|s| s.scheduling_gates).is_none());
    assert!(
        !web.metadata
            .annotations
            .unwrap_or_default()
            .contains_key("gpupool.io/enqueued-at")
    );

    // Every denial reaches the client as the API server words it.
    let cases = [
        (
            gpu_pod("unknown", json!({"gpupool.io/class": "fast"}), "1"),
            "GpuLeaseClass \"fast\" (label gpupool.io/class) does not exist".to_owned(),
        ),
        (
            gpu_pod("boss", json!({"gpupool.io/role": "boss"}), "1"),
            "label gpupool.io/role must be \"primary\" or \"helper\", not \"boss\"".to_owned(),
        ),
        (
            gpu_pod("half", json!({}), "500m"),
            "container \"main\" requests gpupool/slot = \"500m\": GPU slots are whole numbers".to_owned(),
        ),
        (
            gpu_pod("huge", json!({}), "5"),
            "the pod requests 5 gpupool/slot slots but the largest node of GpuLeaseClass \"default\" has 4 (node-2)".to_owned(),
        ),
    ];
    for (pod, message) in cases {
        let err = pods.create(&pp, &pod).await.expect_err(&message);
        assert_eq!(denied_message(err), mutating_denial(&message));
    }
    assert!(
        pods.get_opt("huge").await.expect("get").is_none(),
        "a denied pod is not stored"
    );

    // maxQueued: one Queued lease fills class "small".
    put(
        &api,
        "gpupool.io",
        "gpuleases",
        json!({"apiVersion": "gpupool.io/v1alpha1", "kind": "GpuLease",
            "metadata": {"name": "first", "namespace": "ml"},
            "spec": {"className": "small", "podName": "first", "podUID": "uid-first", "role": "primary", "slots": 1},
            "status": {"phase": "Queued"}}),
    );
    let full = mutating_denial(
        "GpuLeaseClass \"small\" already has 1 queued primary (admission.maxQueued is 1, counted for primaries and helpers apart); try again once the queue shrinks",
    );
    let answer = denied_eventually(&pods, json!({"gpupool.io/class": "small"}), &full).await;
    assert_eq!(answer, full);

    // No default at all.
    api.admin()
        .remove("gpupool.io", "gpuleaseclasses", "", "default");
    let none = mutating_denial(
        "the pod requests gpupool/slot but names no GpuLeaseClass (label gpupool.io/class) and no class is marked default: true",
    );
    assert_eq!(denied_eventually(&pods, json!({}), &none).await, none);

    hook.stop().await;
}

fn remove_gate() -> Patch<Value> {
    Patch::Json(
        serde_json::from_value(json!([
            {"op": "test", "path": "/spec/schedulingGates/0/name", "value": "gpupool.io/admission"},
            {"op": "remove", "path": "/spec/schedulingGates/0"}
        ]))
        .expect("patch"),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_operator_removes_the_gate_through_the_api_server() {
    let api = cluster().await;
    put(
        &api,
        "gpupool.io",
        "gpuleaseclasses",
        class("default", json!({"default": true})),
    );
    let hook = Hook::start(&api).await.serve();
    let alice = api.client_with_token(ALICE_TOKEN).await.expect("alice");
    let operator = api
        .client_with_token(OPERATOR_TOKEN)
        .await
        .expect("operator");
    let as_alice: Api<Pod> = Api::namespaced(alice, "ml");
    let as_operator: Api<Pod> = Api::namespaced(operator, "ml");
    as_alice
        .create(&PostParams::default(), &gpu_pod("train", json!({}), "1"))
        .await
        .expect("queued");

    // Other updates of a gated pod are fine.
    as_alice
        .patch(
            "train",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"team": "vision"}}})),
        )
        .await
        .expect("label update allowed");

    let err = as_alice
        .patch("train", &PatchParams::default(), &remove_gate())
        .await
        .expect_err("alice may not ungate");
    assert_eq!(
        denied_message(err),
        format!(
            "admission webhook \"{VALIDATING_WEBHOOK_NAME}\" denied the request: only the gpupool operator (\"gpupool-operator\") may remove the scheduling gate gpupool.io/admission; user \"alice\" may not"
        )
    );
    let reviewed = api.webhook_call_durations_ms().len();
    let ungated = as_operator
        .patch("train", &PatchParams::default(), &remove_gate())
        .await
        .expect("the operator ungates");
    assert!(
        ungated
            .spec
            .and_then(|s| s.scheduling_gates)
            .unwrap_or_default()
            .is_empty()
    );
    assert_eq!(
        api.webhook_call_durations_ms().len(),
        reviewed,
        "the operator's own update is not sent for review: an admission does not wait for the webhook"
    );
    hook.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificate_and_configurations_are_written_and_shared() {
    let api = cluster().await;
    let admin = api.client().await.expect("admin");
    let first = Hook::start(&api).await;

    let secrets: Api<Secret> = Api::namespaced(admin.clone(), OPERATOR_NS);
    let secret = secrets.get(SECRET_NAME).await.expect("Secret created");
    assert_eq!(secret.type_.as_deref(), Some("kubernetes.io/tls"));
    let stored = TlsBundle::from_secret(&secret).expect("readable");
    assert_eq!(stored.ca_pem, first.ca);
    stored
        .check(&["127.0.0.1".to_owned()], jiff::Timestamp::now())
        .expect("valid for the URL's IP");

    let mutating: MutatingWebhookConfiguration = Api::all(admin.clone())
        .get("gpupool")
        .await
        .expect("mutating configuration");
    let validating: ValidatingWebhookConfiguration = Api::all(admin.clone())
        .get("gpupool")
        .await
        .expect("validating configuration");
    let m = &mutating.webhooks.expect("webhooks")[0];
    let v = &validating.webhooks.expect("webhooks")[0];
    for (cc, path) in [
        (&m.client_config, "/mutate-pods"),
        (&v.client_config, "/validate-pods"),
    ] {
        assert_eq!(
            cc.ca_bundle.as_ref().map(|b| b.0.as_slice()),
            Some(first.ca.as_bytes())
        );
        assert!(
            cc.url
                .as_deref()
                .is_some_and(|u| u.starts_with("https://127.0.0.1:") && u.ends_with(path)),
            "{cc:?}"
        );
    }
    assert_eq!(m.failure_policy.as_deref(), Some("Fail"));
    assert_eq!(v.timeout_seconds, Some(5));

    // A second replica uses the first one's certificate.
    let second = Hook::start(&api).await;
    assert_eq!(second.ca, first.ca);
    drop((first, second));

    // An expired certificate is renewed, keeping the old CA trusted.
    let long_ago = jiff::Timestamp::now() - jiff::SignedDuration::from_hours(24 * 400);
    let expired = certs::generate(&["127.0.0.1".to_owned()], long_ago, None).expect("old cert");
    let mut replacement = expired.to_secret(OPERATOR_NS, SECRET_NAME);
    replacement.metadata.resource_version = secrets
        .get(SECRET_NAME)
        .await
        .expect("get")
        .metadata
        .resource_version;
    secrets
        .replace(SECRET_NAME, &PostParams::default(), &replacement)
        .await
        .expect("expired cert stored");
    let renewed = Hook::start(&api).await;
    assert_ne!(renewed.ca, expired.ca_pem);
    let ders = |pem: &str| {
        CertificateDer::pem_slice_iter(pem.as_bytes())
            .collect::<Result<Vec<_>, _>>()
            .expect("PEM bundle")
    };
    let bundle = ders(&renewed.ca);
    assert_eq!(bundle.len(), 2, "new CA and the previous one");
    assert_eq!(
        bundle[1],
        ders(&expired.ca_pem)[0],
        "previous CA kept trusted"
    );
    let stored =
        TlsBundle::from_secret(&secrets.get(SECRET_NAME).await.expect("get")).expect("readable");
    assert_eq!(stored.ca_pem, renewed.ca);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_fails_naming_a_cache_that_cannot_sync() {
    let api = ApiServer::start(ApiServerConfig::default())
        .await
        .expect("API server");
    let admin = api.client().await.expect("admin");
    Api::<Namespace>::all(admin)
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": OPERATOR_NS}})).expect("namespace"),
        )
        .await
        .expect("namespace");
    // No CRDs: the GpuLeaseClass watch can never list.
    let mut config = webhook_config(free_port());
    config.cache_sync_timeout = Duration::from_secs(1);
    let client = api.client().await.expect("client");
    let err = webhook::start(
        config,
        client.clone(),
        caches(&client),
        WebhookMetrics::default(),
    )
    .await
    .err()
    .expect("cannot start without the CRDs");
    assert_eq!(
        err.to_string(),
        "the GpuLeaseClasses cache did not sync within 1s; can the operator list and watch GpuLeaseClasses (is the CRD installed, is RBAC granted)?"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_fails_naming_the_port_in_use() {
    let api = cluster().await;
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = taken.local_addr().expect("addr").port();
    let client = api.client().await.expect("client");
    let err = webhook::start(
        webhook_config(port),
        client.clone(),
        caches(&client),
        WebhookMetrics::default(),
    )
    .await
    .err()
    .expect("port in use");
    let message = err.to_string();
    assert!(
        message.starts_with(&format!(
            "cannot listen on 127.0.0.1:{port} (--webhook-port): "
        )),
        "{message}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_errors_name_what_could_not_be_written() {
    let api = cluster().await;
    let client = api.client().await.expect("client");
    api.faults()
        .set(FaultConfig {
            error_rate: 1.0,
            error_code: 500,
            ..Default::default()
        })
        .expect("faults on");
    let err = certs::ensure_secret(
        client.clone(),
        OPERATOR_NS,
        SECRET_NAME,
        &["127.0.0.1".to_owned()],
        jiff::Timestamp::now(),
    )
    .await
    .expect_err("the API fails");
    assert!(
        err.to_string()
            .starts_with("cannot read or write Secret gpupool-system/gpupool-webhook-tls: "),
        "{err}"
    );
    let err = configurations::apply(client, &webhook_config(9443), "ca")
        .await
        .expect_err("the API fails");
    assert!(
        err.to_string()
            .starts_with("cannot write MutatingWebhookConfiguration \"gpupool\": "),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operator_binary_serves_the_webhook() {
    let api = cluster().await;
    // No node: queued pods stay gated, so the gate test below is not raced
    // by an admission.
    put(
        &api,
        "gpupool.io",
        "gpuleaseclasses",
        class("default", json!({"default": true})),
    );
    let dir = tempfile::tempdir().expect("temp dir");
    let kubeconfig = dir.path().join("kubeconfig");
    api.write_kubeconfig(&kubeconfig, OPERATOR_TOKEN)
        .expect("kubeconfig");
    let [port, metrics_port] =
        gpupool_sim_apiserver::ports::free_ports().expect("two free loopback ports");
    let mut operator = tokio::process::Command::new(env!("CARGO_BIN_EXE_gpupool-operator"))
        .args([
            "--webhook-port",
            &port.to_string(),
            "--metrics-port",
            &metrics_port.to_string(),
            "--leader-elect=false",
            "--namespace",
            OPERATOR_NS,
            "--webhook-url",
            &format!("https://127.0.0.1:{port}"),
            "--gate-owner",
            OPERATOR_USER,
        ])
        .env("KUBECONFIG", &kubeconfig)
        .env_remove("POD_NAMESPACE")
        .kill_on_drop(true)
        .spawn()
        .expect("operator starts");

    let alice = api.client_with_token(ALICE_TOKEN).await.expect("alice");
    let pods: Api<Pod> = Api::namespaced(alice, "ml");
    // Until the operator has written its configuration, pods pass unreviewed.
    let unknown = mutating_denial("GpuLeaseClass \"fast\" (label gpupool.io/class) does not exist");
    assert_eq!(
        denied_eventually(&pods, json!({"gpupool.io/class": "fast"}), &unknown).await,
        unknown
    );

    let queued = pods
        .create(&PostParams::default(), &gpu_pod("train", json!({}), "1"))
        .await
        .expect("queued");
    assert!(
        queued
            .metadata
            .annotations
            .unwrap_or_default()
            .contains_key("gpupool.io/enqueued-at")
    );
    let err = pods
        .patch("train", &PatchParams::default(), &remove_gate())
        .await
        .expect_err("alice may not ungate");
    assert!(
        denied_message(err).starts_with(&format!(
            "admission webhook \"{VALIDATING_WEBHOOK_NAME}\" denied the request: only the gpupool operator"
        ))
    );

    let pid = operator.id().expect("running").to_string();
    let sent = tokio::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .await
        .expect("kill runs");
    assert!(sent.success());
    let status = tokio::time::timeout(Duration::from_secs(15), operator.wait())
        .await
        .expect("exits in time")
        .expect("exit status");
    assert_eq!(status.code(), Some(0), "clean shutdown on SIGTERM");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serving_replicas_pick_up_renewals_and_repair_configurations() {
    let api = cluster().await;
    let admin = api.client().await.expect("admin");
    let port = free_port();
    let mut config = webhook_config(port);
    config.refresh_interval = Duration::from_millis(200);
    let operator = api
        .client_with_token(OPERATOR_TOKEN)
        .await
        .expect("operator");
    let running = webhook::start(
        config,
        operator.clone(),
        caches(&operator),
        WebhookMetrics::default(),
    )
    .await
    .expect("webhook starts");
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(running.serve(async {
        let _ = stopped.await;
    }));

    // Another replica renewed the certificate: this one serves it soon after.
    let secrets: Api<Secret> = Api::namespaced(admin.clone(), OPERATOR_NS);
    let renewed =
        certs::generate(&["127.0.0.1".to_owned()], jiff::Timestamp::now(), None).expect("renewal");
    let mut replacement = renewed.to_secret(OPERATOR_NS, SECRET_NAME);
    replacement.metadata.resource_version = secrets
        .get(SECRET_NAME)
        .await
        .expect("get")
        .metadata
        .resource_version;
    secrets
        .replace(SECRET_NAME, &PostParams::default(), &replacement)
        .await
        .expect("renewed Secret stored");
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(renewed.ca_pem.as_bytes()) {
        roots.add(cert.expect("PEM")).expect("CA");
    }
    let client_config = std::sync::Arc::new(
        rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("protocols")
        .with_root_certificates(roots)
        .with_no_client_auth(),
    );
    let mut presented = false;
    for _ in 0..50 {
        let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .expect("listening");
        let server_name =
            rustls::pki_types::ServerName::try_from("127.0.0.1").expect("server name");
        if tokio_rustls::TlsConnector::from(client_config.clone())
            .connect(server_name, tcp)
            .await
            .is_ok()
        {
            presented = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        presented,
        "the renewed certificate was not served within 5 s"
    );

    // Its CA reaches the configurations, and a deleted configuration returns.
    let mutating: Api<MutatingWebhookConfiguration> = Api::all(admin);
    mutating
        .delete("gpupool", &Default::default())
        .await
        .expect("deleted");
    let mut restored = None;
    for _ in 0..50 {
        if let Some(m) = mutating.get_opt("gpupool").await.expect("get") {
            restored = Some(m);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let restored = restored.expect("configuration rewritten within 5 s");
    let ca = restored.webhooks.expect("webhooks")[0]
        .client_config
        .ca_bundle
        .clone()
        .expect("caBundle");
    assert_eq!(ca.0, renewed.ca_pem.as_bytes());

    let _ = stop.send(());
    tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .expect("stops in time")
        .expect("no panic")
        .expect("served cleanly");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn configurations_owned_by_a_cluster_role_go_with_it() {
    let api = cluster().await;
    let admin = api.client().await.expect("admin");
    let mut config = webhook_config(9443);
    config.owner_cluster_role = Some("gpupool-operator".into());

    // The owner must exist: its uid is part of the reference.
    let err = configurations::apply(admin.clone(), &config, "ca")
        .await
        .expect_err("no such ClusterRole");
    assert!(
        err.to_string().contains("ClusterRole \"gpupool-operator\"")
            && err.to_string().contains("--webhook-owner-cluster-role"),
        "{err}"
    );
    let mutating: Api<MutatingWebhookConfiguration> = Api::all(admin.clone());
    assert!(
        mutating.get_opt("gpupool").await.expect("get").is_none(),
        "nothing written without the owner"
    );

    let roles: Api<ClusterRole> = Api::all(admin.clone());
    let role = roles
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "gpupool-operator"}}))
                .expect("role"),
        )
        .await
        .expect("ClusterRole created");
    let uid = role.metadata.uid.expect("uid");
    // Written without an owner first (as by an older operator), then the
    // owner is added on the next apply.
    configurations::apply(admin.clone(), &webhook_config(9443), "ca")
        .await
        .expect("written");
    configurations::apply(admin.clone(), &config, "ca")
        .await
        .expect("written with the owner");
    let validating: Api<ValidatingWebhookConfiguration> = Api::all(admin.clone());
    for owners in [
        mutating
            .get("gpupool")
            .await
            .expect("get")
            .metadata
            .owner_references,
        validating
            .get("gpupool")
            .await
            .expect("get")
            .metadata
            .owner_references,
    ] {
        let owners = owners.expect("owner references");
        assert_eq!(owners.len(), 1);
        assert_eq!(
            (
                owners[0].kind.as_str(),
                owners[0].name.as_str(),
                owners[0].uid.as_str()
            ),
            ("ClusterRole", "gpupool-operator", uid.as_str())
        );
    }

    // Deleting the role (helm uninstall) takes the configurations with it.
    roles
        .delete("gpupool-operator", &Default::default())
        .await
        .expect("role deleted");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let m = mutating.get_opt("gpupool").await.expect("get");
        let v = validating.get_opt("gpupool").await.expect("get");
        if m.is_none() && v.is_none() {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "configurations still there after their owner went"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
