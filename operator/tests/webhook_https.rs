//! The webhook's real HTTPS server on 127.0.0.1, called the way the API
//! server calls it: AdmissionReview v1 over TLS, verified against the CA the
//! webhook configurations would carry.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use gpupool_api::{GpuLeaseClass, GpuLeaseClassSpec};
use gpupool_operator::webhook::certs::{self, TlsBundle};
use gpupool_operator::webhook::review::{Identities, StaticView, Users};
use gpupool_operator::webhook::server::{self, CertResolver, Handler, WebhookMetrics};
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use k8s_openapi::ByteString;
use prometheus_client::registry::Registry;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::{Value, json};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;

const TIMEOUT: Duration = Duration::from_secs(10);

struct Webhook {
    addr: std::net::SocketAddr,
    bundle: TlsBundle,
    certs: Arc<CertResolver>,
    registry: Registry,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

fn names() -> Vec<String> {
    vec!["127.0.0.1".to_owned()]
}

/// What a server needs, built as the operator builds it.
struct Parts {
    bundle: TlsBundle,
    certs: Arc<CertResolver>,
    tls: Arc<rustls::ServerConfig>,
    registry: Registry,
    handler: Arc<Handler<StaticView>>,
}

fn parts() -> Parts {
    let bundle = certs::generate(&names(), jiff::Timestamp::now(), None).expect("certificate");
    let certs = CertResolver::new(bundle.certified_key().expect("key"));
    let tls = server::tls_config(certs.clone()).expect("tls config");
    let mut registry = Registry::default();
    let metrics = WebhookMetrics::register(&mut registry);
    let view = StaticView {
        classes: vec![Arc::new(GpuLeaseClass::new(
            "default",
            GpuLeaseClassSpec {
                default: true,
                ..Default::default()
            },
        ))],
        nodes: vec![Arc::new(
            serde_json::from_value(json!({
                "metadata": {"name": "node-1"},
                "status": {"allocatable": {"gpupool/slot": "2"}}
            }))
            .expect("node"),
        )],
        leases: vec![],
    };
    let handler = Arc::new(Handler::new(
        view,
        Identities {
            operator: Users::new([
                "system:serviceaccount:gpupool-system:gpupool-operator".to_owned()
            ]),
            device_plugins: Users::new(Vec::<String>::new()),
        },
        metrics,
    ));
    Parts {
        bundle,
        certs,
        tls,
        registry,
        handler,
    }
}

async fn start_webhook() -> Webhook {
    let Parts {
        bundle,
        certs,
        tls,
        registry,
        handler,
    } = parts();
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(server::serve(listener, tls, handler, async {
        let _ = stopped.await;
    }));
    Webhook {
        addr,
        bundle,
        certs,
        registry,
        stop: Some(stop),
        task,
    }
}

fn client_config(ca_pem: &str, alpn: &[u8]) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(cert.expect("CA PEM")).expect("CA cert");
    }
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("protocols")
    .with_root_certificates(roots)
    .with_no_client_auth();
    config.alpn_protocols = vec![alpn.to_vec()];
    Arc::new(config)
}

async fn connect(
    addr: std::net::SocketAddr,
    ca_pem: &str,
    alpn: &[u8],
) -> std::io::Result<tokio_rustls::client::TlsStream<TcpStream>> {
    let tcp = TcpStream::connect(addr).await?;
    tokio_rustls::TlsConnector::from(client_config(ca_pem, alpn))
        .connect(ServerName::try_from("127.0.0.1").expect("ip"), tcp)
        .await
}

/// POSTs (or sends `method`) over HTTP/1.1, verifying the server with its CA.
async fn call(webhook: &Webhook, method: &str, path: &str, body: Vec<u8>) -> (StatusCode, Bytes) {
    call_at(webhook.addr, &webhook.bundle.ca_pem, method, path, body).await
}

/// [`call`] given the address and CA, for a task that does not borrow the webhook.
async fn call_at(
    addr: std::net::SocketAddr,
    ca_pem: &str,
    method: &str,
    path: &str,
    body: Vec<u8>,
) -> (StatusCode, Bytes) {
    let tls = connect(addr, ca_pem, b"http/1.1")
        .await
        .expect("TLS handshake with the webhook's CA");
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
        .await
        .expect("http1 handshake");
    tokio::spawn(conn);
    let request = Request::builder()
        .method(method)
        .uri(path)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .expect("request");
    let response = tokio::time::timeout(TIMEOUT, sender.send_request(request))
        .await
        .expect("answered in time")
        .expect("response");
    let status = response.status();
    let body = response
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes();
    (status, body)
}

fn review(operation: &str, user: &str, object: Value, old: Option<Value>) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "5a0c8f0e-1111-4000-8000-00000000beef",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "name": "train",
            "namespace": "ml",
            "operation": operation,
            "userInfo": {"username": user, "groups": ["system:authenticated"]},
            "object": object,
            "oldObject": old,
            "dryRun": false
        }
    }))
    .expect("review")
}

fn pod(class: Option<&str>, slots: &str, gated: bool) -> Value {
    let mut pod = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "train", "namespace": "ml", "labels": {}},
        "spec": {"containers": [{"name": "main", "image": "trainer",
            "resources": {"limits": {"gpupool/slot": slots}}}]}
    });
    if let Some(class) = class {
        pod["metadata"]["labels"]["gpupool.io/class"] = json!(class);
    }
    if gated {
        pod["spec"]["schedulingGates"] = json!([{"name": "gpupool.io/admission"}]);
    }
    pod
}

fn response(body: &Bytes) -> Value {
    let v: Value = serde_json::from_slice(body).expect("AdmissionReview JSON");
    assert_eq!(v["apiVersion"], json!("admission.k8s.io/v1"));
    assert_eq!(v["kind"], json!("AdmissionReview"));
    assert_eq!(
        v["response"]["uid"],
        json!("5a0c8f0e-1111-4000-8000-00000000beef")
    );
    v["response"].clone()
}

#[tokio::test]
async fn gpupool_pod_is_gated_and_stamped_over_https() {
    let webhook = start_webhook().await;
    let before = jiff::Timestamp::now();
    let (status, body) = call(
        &webhook,
        "POST",
        "/mutate-pods",
        review("CREATE", "alice", pod(None, "1", false), None),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let r = response(&body);
    assert_eq!(r["allowed"], json!(true));
    assert_eq!(r["patchType"], json!("JSONPatch"));
    let patch: ByteString = serde_json::from_value(r["patch"].clone()).expect("base64 patch");
    let patch: json_patch::Patch = serde_json::from_slice(&patch.0).expect("JSON patch");
    let mut doc = pod(None, "1", false);
    json_patch::patch(&mut doc, &patch).expect("applies");
    assert_eq!(
        doc["spec"]["schedulingGates"],
        json!([{"name": "gpupool.io/admission"}])
    );
    let stamp = doc["metadata"]["annotations"]["gpupool.io/enqueued-at"]
        .as_str()
        .expect("stamp");
    let stamped = gpupool_api::time::parse_stamp(stamp).expect("RFC 3339");
    assert!(
        stamped >= before - jiff::SignedDuration::from_secs(1),
        "{stamp}"
    );
}

#[tokio::test]
async fn denials_reach_the_caller_with_their_message() {
    let webhook = start_webhook().await;
    let cases = [
        (
            pod(Some("fast"), "1", false),
            "GpuLeaseClass \"fast\" (label gpupool.io/class) does not exist",
        ),
        (
            pod(None, "3", false),
            "the pod requests 3 gpupool/slot slots but the largest node of GpuLeaseClass \"default\" has 2 (node-1)",
        ),
        (
            pod(None, "1500m", false),
            "container \"main\" requests gpupool/slot = \"1500m\": GPU slots are whole numbers",
        ),
    ];
    for (object, message) in cases {
        let (status, body) = call(
            &webhook,
            "POST",
            "/mutate-pods",
            review("CREATE", "alice", object, None),
        )
        .await;
        assert_eq!(status, StatusCode::OK);
        let r = response(&body);
        assert_eq!(r["allowed"], json!(false));
        assert_eq!(r["status"]["code"], json!(403));
        assert_eq!(r["status"]["message"], json!(message));
    }
}

#[tokio::test]
async fn only_the_operator_removes_the_gate() {
    let webhook = start_webhook().await;
    let body = review(
        "UPDATE",
        "alice",
        pod(None, "1", false),
        Some(pod(None, "1", true)),
    );
    let (status, out) = call(&webhook, "POST", "/validate-pods", body).await;
    assert_eq!(status, StatusCode::OK);
    let r = response(&out);
    assert_eq!(r["allowed"], json!(false));
    assert_eq!(
        r["status"]["message"],
        json!(
            "only the gpupool operator (\"system:serviceaccount:gpupool-system:gpupool-operator\") may remove the scheduling gate gpupool.io/admission; user \"alice\" may not"
        )
    );

    let body = review(
        "UPDATE",
        "system:serviceaccount:gpupool-system:gpupool-operator",
        pod(None, "1", false),
        Some(pod(None, "1", true)),
    );
    let (_, out) = call(&webhook, "POST", "/validate-pods", body).await;
    assert_eq!(response(&out)["allowed"], json!(true));
}

#[tokio::test]
async fn bad_requests_get_http_errors_with_a_message() {
    let webhook = start_webhook().await;
    let (status, body) = call(
        &webhook,
        "POST",
        "/mutate-pods",
        b"{\"apiVersion\": 3".to_vec(),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(
        String::from_utf8_lossy(&body).starts_with("malformed AdmissionReview: "),
        "{body:?}"
    );

    let (status, body) = call(&webhook, "POST", "/other", vec![]).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(
        body,
        "no webhook at /other; use /mutate-pods, /validate-pods, /validate-gpuleases or /validate-gpuleaseclasses"
    );

    let (status, body) = call(&webhook, "GET", "/mutate-pods", vec![]).await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(body, "/mutate-pods takes POST, not GET");

    let huge = vec![b' '; server::MAX_BODY_BYTES + 1];
    let (status, _) = call(&webhook, "POST", "/mutate-pods", huge).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
}

#[tokio::test]
async fn http2_is_negotiated_and_served() {
    let webhook = start_webhook().await;
    let tls = connect(webhook.addr, &webhook.bundle.ca_pem, b"h2")
        .await
        .expect("TLS");
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
    let (mut sender, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls))
            .await
            .expect("h2 handshake");
    tokio::spawn(conn);
    let request = Request::builder()
        .method("POST")
        .uri(format!(
            "https://127.0.0.1:{}/mutate-pods",
            webhook.addr.port()
        ))
        .body(Full::new(Bytes::from(review(
            "CREATE",
            "alice",
            pod(None, "1", false),
            None,
        ))))
        .expect("request");
    let response = tokio::time::timeout(TIMEOUT, sender.send_request(request))
        .await
        .expect("in time")
        .expect("response");
    assert_eq!(response.status(), StatusCode::OK);
}

#[tokio::test]
async fn a_client_that_does_not_trust_the_ca_is_refused() {
    let webhook = start_webhook().await;
    let stranger = certs::generate(&names(), jiff::Timestamp::now(), None).expect("other CA");
    let err = connect(webhook.addr, &stranger.ca_pem, b"http/1.1")
        .await
        .expect_err("unknown issuer");
    assert!(
        err.to_string().to_lowercase().contains("certificate"),
        "{err}"
    );
}

#[tokio::test]
async fn a_renewed_certificate_is_served_without_a_restart() {
    let webhook = start_webhook().await;
    let renewed = certs::generate(
        &names(),
        jiff::Timestamp::now(),
        Some(&webhook.bundle.ca_pem),
    )
    .expect("renewal");
    // Trusting only the new CA proves which certificate is presented.
    const END: &str = "-----END CERTIFICATE-----";
    let end = renewed.ca_pem.find(END).expect("a PEM certificate") + END.len();
    let new_ca_only = &renewed.ca_pem[..end];
    assert!(
        connect(webhook.addr, new_ca_only, b"http/1.1")
            .await
            .is_err()
    );
    webhook.certs.replace(renewed.certified_key().expect("key"));
    connect(webhook.addr, new_ca_only, b"http/1.1")
        .await
        .expect("renewed cert presented");
}

#[tokio::test]
async fn latency_is_recorded_by_webhook_and_outcome() {
    let webhook = start_webhook().await;
    call(
        &webhook,
        "POST",
        "/mutate-pods",
        review("CREATE", "alice", pod(None, "1", false), None),
    )
    .await;
    call(
        &webhook,
        "POST",
        "/mutate-pods",
        review("CREATE", "alice", pod(Some("nope"), "1", false), None),
    )
    .await;
    call(&webhook, "POST", "/validate-pods", b"[]".to_vec()).await;
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &webhook.registry).expect("encode");
    for line in [
        "gpupool_webhook_request_duration_seconds_count{webhook=\"mutate\",outcome=\"patched\"} 1",
        "gpupool_webhook_request_duration_seconds_count{webhook=\"mutate\",outcome=\"denied\"} 1",
        "gpupool_webhook_request_duration_seconds_count{webhook=\"validate\",outcome=\"bad_request\"} 1",
    ] {
        assert!(text.contains(line), "missing {line} in\n{text}");
    }
}

#[tokio::test]
async fn shutdown_stops_the_server() {
    let mut webhook = start_webhook().await;
    // An idle keep-alive connection must not hold the shutdown up.
    let idle = connect(webhook.addr, &webhook.bundle.ca_pem, b"http/1.1")
        .await
        .expect("TLS");
    webhook
        .stop
        .take()
        .expect("stop")
        .send(())
        .expect("server running");
    tokio::time::timeout(TIMEOUT, &mut webhook.task)
        .await
        .expect("stopped in time")
        .expect("server task");
    drop(idle);
    assert!(
        TcpStream::connect(webhook.addr).await.is_err(),
        "still listening"
    );
}

/// Reads until the peer closes or `within` passes; true when it closed.
async fn closed_within<S: tokio::io::AsyncRead + Unpin>(
    stream: &mut S,
    within: std::time::Duration,
) -> bool {
    use tokio::io::AsyncReadExt;
    let mut buf = [0u8; 1024];
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => continue,
            Err(_) => return false,
        }
    }
}

#[tokio::test]
async fn connections_over_the_cap_wait_their_turn_and_are_served() {
    let webhook = start_webhook().await;
    // Peers that connect and never start TLS hold every slot...
    let mut idle = Vec::new();
    for _ in 0..server::MAX_CONNECTIONS {
        idle.push(TcpStream::connect(webhook.addr).await.expect("connect"));
    }
    // ...so a real review's connection waits in the backlog instead of
    // being closed: it is neither refused nor answered while they hold on.
    let mut extra = TcpStream::connect(webhook.addr).await.expect("connect");
    assert!(
        !closed_within(&mut extra, std::time::Duration::from_secs(1)).await,
        "a connection over the cap was closed instead of waiting"
    );
    drop(extra);
    let waiting = tokio::spawn({
        let addr = webhook.addr;
        let ca = webhook.bundle.ca_pem.clone();
        async move {
            call_at(
                addr,
                &ca,
                "POST",
                "/mutate-pods",
                review("CREATE", "alice", pod(None, "1", false), None),
            )
            .await
        }
    });
    let mut metrics = String::new();
    prometheus_client::encoding::text::encode(&mut metrics, &webhook.registry).expect("encode");
    assert!(
        metrics.contains("gpupool_webhook_connection_limit_reached_total 1"),
        "{metrics}"
    );
    assert!(
        !metrics.contains("reason=\"connections\""),
        "no connection is refused: {metrics}"
    );
    // The stalled peers are dropped at the handshake timeout, and the waiting
    // review is served on a freed slot.
    let (status, body) = tokio::time::timeout(std::time::Duration::from_secs(30), waiting)
        .await
        .expect("the waiting review is served once the stalled peers time out")
        .expect("task");
    assert_eq!(status, StatusCode::OK, "{body:?}");
    assert_eq!(response(&body)["allowed"], json!(true));
    drop(idle);
}

#[tokio::test]
async fn a_peer_that_stalls_in_its_headers_is_cut_off() {
    use tokio::io::AsyncWriteExt;
    let webhook = start_webhook().await;
    let mut tls = connect(webhook.addr, &webhook.bundle.ca_pem, b"http/1.1")
        .await
        .expect("TLS");
    tls.write_all(b"POST /mutate-pods HTTP/1.1\r\nhost: x\r\n")
        .await
        .expect("partial headers");
    assert!(
        closed_within(&mut tls, std::time::Duration::from_secs(10)).await,
        "a connection stalled mid-headers was held"
    );
}

#[tokio::test]
async fn a_stalled_body_gets_408_and_an_oversized_one_413_before_it_is_read() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let webhook = start_webhook().await;
    let mut tls = connect(webhook.addr, &webhook.bundle.ca_pem, b"http/1.1")
        .await
        .expect("TLS");
    tls.write_all(
        b"POST /mutate-pods HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n{\"apiVersion\"",
    )
    .await
    .expect("headers and a little body");
    let mut answer = vec![0u8; 512];
    let n = tokio::time::timeout(std::time::Duration::from_secs(10), tls.read(&mut answer))
        .await
        .expect("answered before the test's own timeout")
        .expect("read");
    let answer = String::from_utf8_lossy(&answer[..n]);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");

    // A declared size over the limit is refused from the headers alone, over
    // HTTP/2 as an answer rather than a reset stream.
    let tls = connect(webhook.addr, &webhook.bundle.ca_pem, b"h2")
        .await
        .expect("TLS");
    let (mut sender, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls))
            .await
            .expect("h2 handshake");
    tokio::spawn(conn);
    use futures::StreamExt;
    // One chunk, then nothing: the server must answer from the headers.
    let chunks = futures::stream::iter([Ok::<_, std::convert::Infallible>(
        hyper::body::Frame::data(Bytes::from_static(b"{")),
    )])
    .chain(futures::stream::pending());
    let body = http_body_util::StreamBody::new(chunks);
    let request = Request::builder()
        .method("POST")
        .uri("https://127.0.0.1/mutate-pods")
        .header("content-length", (server::MAX_BODY_BYTES + 1).to_string())
        .body(body)
        .expect("request");
    let response = tokio::time::timeout(TIMEOUT, sender.send_request(request))
        .await
        .expect("answered in time")
        .expect("a response, not a reset");
    assert_eq!(response.status(), StatusCode::PAYLOAD_TOO_LARGE);
    let text = response
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes();
    assert!(
        String::from_utf8_lossy(&text).contains("larger than"),
        "{text:?}"
    );
}

/// The operator runs the webhook on a runtime of its own: a review is
/// answered even while the runtime that started the server (the one the
/// controller works on) cannot run anything at all.
#[test]
fn reviews_are_answered_while_the_callers_runtime_is_stalled() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let Parts {
            bundle,
            tls,
            handler,
            ..
        } = parts();
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (stop, stopped) = oneshot::channel::<()>();
        let server = tokio::spawn(server::serve_isolated(listener, tls, handler, async {
            let _ = stopped.await;
        }));
        // Let the server task hand the socket over to its own runtime.
        tokio::task::yield_now().await;

        // The client runs on a thread of its own; this runtime's only thread
        // then blocks until the answer comes, so nothing here can serve it.
        let (answered, answer) = std::sync::mpsc::channel();
        let ca = bundle.ca_pem.clone();
        std::thread::spawn(move || {
            let client = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("client runtime");
            let body = review("CREATE", "alice", pod(None, "1", false), None);
            let result = client.block_on(call_at(addr, &ca, "POST", "/mutate-pods", body));
            let _ = answered.send(result);
        });
        let (status, body) = answer
            .recv_timeout(Duration::from_secs(30))
            .expect("the review is answered while the caller's runtime is stalled");
        assert_eq!(status, StatusCode::OK);
        assert_eq!(response(&body)["allowed"], json!(true));

        let _ = stop.send(());
        let served = tokio::time::timeout(TIMEOUT, server)
            .await
            .expect("the server stops when asked")
            .expect("the server task");
        assert!(served.is_ok(), "{served:?}");
    });
}

/// A server that stops by panicking on its own runtime is an error the
/// caller sees (the operator then exits 1), never a quiet end of reviews.
#[tokio::test]
async fn a_server_that_panics_on_its_own_runtime_is_an_error() {
    let Parts { tls, handler, .. } = parts();
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let served = tokio::time::timeout(
        TIMEOUT,
        server::serve_isolated(listener, tls, handler, async {
            panic!("the shutdown signal failed");
        }),
    )
    .await
    .expect("the failed server returns");
    let error = served.expect_err("a panicked server is an error");
    assert!(
        error.to_string().contains("panic"),
        "the error says the server panicked: {error}"
    );
}
