//! A small HTTPS admission webhook server that records every AdmissionReview
//! it receives and answers by path (allow, deny, patch, stall, drop), shared by
//! the API server's webhook tests and the cluster tests that look at who a
//! request came from. It speaks HTTP/1.1, or HTTP/2 where asked to offer it.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use gpupool_sim_apiserver::base64_encode;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{Value, json};

/// A small HTTPS webhook server that records the reviews it receives.
pub struct Hook {
    /// Where it listens (127.0.0.1).
    pub addr: SocketAddr,
    /// Base64 of its self-signed certificate, for `caBundle`.
    pub ca_b64: String,
    /// Every review received, as `{"path", "review", "version"}` (the
    /// HTTP version it came over), in arrival order.
    pub seen: Arc<Mutex<Vec<Value>>>,
    /// TCP connections accepted.
    pub connections: Arc<AtomicUsize>,
    /// The most requests one connection had in flight at once.
    pub most_in_flight: Arc<AtomicUsize>,
    cut: Arc<tokio::sync::Notify>,
}

impl Hook {
    /// Closes every open connection at once, without a goodbye (no HTTP/2
    /// GOAWAY, no TLS close_notify), as a restarted server does.
    pub fn cut_connections(&self) {
        self.cut.notify_waiters();
    }
}

/// Most streams at once on one of a hook server's HTTP/2 connections.
pub const MAX_STREAMS: u32 = 16;

/// What a hook server offers over ALPN.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Offer {
    /// Nothing: the client speaks HTTP/1.1.
    Http1,
    /// `h2` and `http/1.1`.
    Http2,
}

fn answer(path: &str, review: &Value) -> Value {
    let uid = review["request"]["uid"].clone();
    let response = match path {
        "/mutate" => {
            let patch =
                json!([{"op": "add", "path": "/metadata/labels", "value": {"mutated": "yes"}}]);
            json!({"uid": uid, "allowed": true, "patchType": "JSONPatch", "patch": base64_encode(patch.to_string().as_bytes())})
        }
        "/deny" => {
            json!({"uid": uid, "allowed": false, "status": {"code": 403, "message": "no GPUs for you"}})
        }
        "/deny400" => {
            json!({"uid": uid, "allowed": false, "status": {"code": 400, "message": "bad slot count"}})
        }
        "/wrong-uid" => json!({"uid": "nope", "allowed": true}),
        // Gates every pod, as the operator's pod webhook does.
        "/gate" => {
            let patch = json!([{"op": "add", "path": "/spec/schedulingGates", "value": [{"name": "gpupool.io/admission"}]}]);
            json!({"uid": uid, "allowed": true, "patchType": "JSONPatch", "patch": base64_encode(patch.to_string().as_bytes())})
        }
        // Adds a field ConfigMaps do not declare.
        "/unknown" => {
            let patch = json!([{"op": "add", "path": "/colour", "value": "red"}]);
            json!({"uid": uid, "allowed": true, "patchType": "JSONPatch", "patch": base64_encode(patch.to_string().as_bytes())})
        }
        // Records what it saw of the label `/second` sets.
        "/first" => {
            let mut labels = review["request"]["object"]["metadata"]["labels"].clone();
            let saw = labels["second"].as_str().unwrap_or("absent").to_string();
            labels["first"] = json!(saw);
            let patch = json!([{"op": "add", "path": "/metadata/labels", "value": labels}]);
            json!({"uid": uid, "allowed": true, "patchType": "JSONPatch", "patch": base64_encode(patch.to_string().as_bytes())})
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
            json!({"uid": uid, "allowed": true, "patchType": "JSONPatch", "patch": base64_encode(patch.to_string().as_bytes())})
        }
        _ => json!({"uid": uid, "allowed": true}),
    };
    json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response})
}

/// A TLS acceptor with a fresh self-signed certificate for 127.0.0.1 and
/// `hook.gpupool-system.svc`, offering `offer`; and the certificate as a
/// `caBundle`.
fn tls_acceptor(offer: Offer) -> (tokio_rustls::TlsAcceptor, String) {
    let key = rcgen::KeyPair::generate().expect("key");
    let params = rcgen::CertificateParams::new(vec![
        "127.0.0.1".to_string(),
        "hook.gpupool-system.svc".to_string(),
    ])
    .expect("params");
    let cert = params.self_signed(&key).expect("cert");
    let ca_b64 = base64_encode(cert.pem().as_bytes());
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
    let mut config = config;
    if offer == Offer::Http2 {
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    }
    (tokio_rustls::TlsAcceptor::from(Arc::new(config)), ca_b64)
}

/// Starts an HTTP/1.1 webhook server on a free port of 127.0.0.1.
pub async fn start_hook() -> Hook {
    start_hook_offering(Offer::Http1).await
}

/// Starts a webhook server on a free port of 127.0.0.1 that offers `offer`.
pub async fn start_hook_offering(offer: Offer) -> Hook {
    let (acceptor, ca_b64) = tls_acceptor(offer);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let seen = Arc::new(Mutex::new(Vec::new()));
    let seen2 = seen.clone();
    let connections = Arc::new(AtomicUsize::new(0));
    let accepted = connections.clone();
    let most_in_flight = Arc::new(AtomicUsize::new(0));
    let most = most_in_flight.clone();
    let cut = Arc::new(tokio::sync::Notify::new());
    let cut2 = cut.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            accepted.fetch_add(1, Ordering::SeqCst);
            let acceptor = acceptor.clone();
            let seen = seen2.clone();
            let most = most.clone();
            let cut = cut2.clone();
            tokio::spawn(async move {
                let cut = cut.notified();
                let Ok(tls) = acceptor.accept(stream).await else {
                    return;
                };
                let h2 = tls.get_ref().1.alpn_protocol() == Some(b"h2".as_slice());
                // Requests this connection has carried, for `/drop-reused`,
                // and has in flight.
                let served = Arc::new(AtomicUsize::new(0));
                let in_flight = Arc::new(AtomicUsize::new(0));
                let svc =
                    hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
                        let seen = seen.clone();
                        let earlier = served.fetch_add(1, Ordering::SeqCst);
                        let in_flight = in_flight.clone();
                        let now = in_flight.fetch_add(1, Ordering::SeqCst) + 1;
                        most.fetch_max(now, Ordering::SeqCst);
                        async move {
                            let _done = Done(in_flight);
                            let path = req.uri().path().to_string();
                            let version = format!("{:?}", req.version());
                            if path == "/drop" || (path == "/drop-reused" && earlier > 0) {
                                // Closes the connection without an answer:
                                // `/drop-reused` as a server whose idle timeout
                                // fires just as a kept-alive connection is
                                // reused, `/drop` as one that always fails.
                                return Err(std::io::Error::other("dropped the request"));
                            }
                            let body = req.into_body().collect().await.expect("body").to_bytes();
                            let review: Value = serde_json::from_slice(&body).expect("review json");
                            seen.lock()
                                .expect("lock")
                                .push(json!({"path": path, "review": review, "version": version}));
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
                            Ok::<_, std::io::Error>(resp)
                        }
                    });
                let io = TokioIo::new(tls);
                if h2 {
                    // Fewer streams than a client may assume (100): the
                    // rest must wait for one, not fail.
                    let conn = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                        .max_concurrent_streams(MAX_STREAMS)
                        .serve_connection(io, svc);
                    tokio::select! {
                        _ = conn => {}
                        _ = cut => {}
                    }
                } else {
                    let conn = hyper::server::conn::http1::Builder::new().serve_connection(io, svc);
                    tokio::select! {
                        _ = conn => {}
                        _ = cut => {}
                    }
                }
            });
        }
    });
    Hook {
        addr,
        ca_b64,
        seen,
        connections,
        most_in_flight,
        cut,
    }
}

/// An HTTP/2 webhook server that refuses the first `refusals` calls it
/// gets unprocessed (`RST_STREAM` with `REFUSED_STREAM`, as a server over
/// its limit of streams does) and allows the rest; `refused` counts them.
pub async fn start_refusing_hook(refusals: usize) -> (Hook, Arc<AtomicUsize>) {
    let (acceptor, ca_b64) = tls_acceptor(Offer::Http2);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let seen = Arc::new(Mutex::new(Vec::new()));
    let connections = Arc::new(AtomicUsize::new(0));
    let refused = Arc::new(AtomicUsize::new(0));
    let hook = Hook {
        addr,
        ca_b64,
        seen: seen.clone(),
        connections: connections.clone(),
        most_in_flight: Arc::new(AtomicUsize::new(0)),
        cut: Arc::new(tokio::sync::Notify::new()),
    };
    let counted = refused.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            connections.fetch_add(1, Ordering::SeqCst);
            let acceptor = acceptor.clone();
            let seen = seen.clone();
            let refused = counted.clone();
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(stream).await else {
                    return;
                };
                let Ok(mut conn) = h2::server::handshake(tls).await else {
                    return;
                };
                while let Some(Ok((request, mut respond))) = conn.accept().await {
                    if refused.fetch_add(1, Ordering::SeqCst) < refusals {
                        respond.send_reset(h2::Reason::REFUSED_STREAM);
                        continue;
                    }
                    refused.fetch_sub(1, Ordering::SeqCst);
                    let path = request.uri().path().to_owned();
                    let mut body = request.into_body();
                    let mut bytes = Vec::new();
                    while let Some(Ok(chunk)) = body.data().await {
                        let _ = body.flow_control().release_capacity(chunk.len());
                        bytes.extend_from_slice(&chunk);
                    }
                    let review: Value = serde_json::from_slice(&bytes).expect("review json");
                    let out = answer(&path, &review);
                    seen.lock()
                        .expect("lock")
                        .push(json!({"path": path, "review": review, "version": "HTTP/2.0"}));
                    let Ok(mut send) = respond.send_response(http::Response::new(()), false) else {
                        continue;
                    };
                    let _ = send.send_data(Bytes::from(out.to_string()), true);
                }
            });
        }
    });
    (hook, refused)
}

/// Counts a request out of its connection's in-flight count when it ends.
struct Done(Arc<AtomicUsize>);

impl Drop for Done {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}
