//! The simulated API server speaks both protocols kube-apiserver does:
//! HTTP/2 to a client that offers it over ALPN (client-go, kubectl), with
//! requests and watches multiplexed on one connection, and HTTP/1.1 to one
//! that does not (kube-rs).

use std::sync::Arc;

use bytes::Bytes;
use gpupool_sim_apiserver::{ADMIN_TOKEN, ApiServer, ApiServerConfig, RunningApiServer};
use http::{Request, StatusCode, header};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

async fn server() -> RunningApiServer {
    ApiServer::start(ApiServerConfig::default())
        .await
        .expect("API server starts")
}

/// A TLS connection to `server` offering `alpn`, trusting its CA.
async fn connect(server: &RunningApiServer, alpn: &[&[u8]]) -> TlsStream<TcpStream> {
    let mut roots = rustls::RootCertStore::empty();
    let pem = server.ca_pem().expect("the server serves TLS");
    for cert in rustls_pemfile::certs(&mut pem.as_bytes()) {
        roots.add(cert.expect("CA certificate")).expect("CA added");
    }
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("protocol versions")
    .with_root_certificates(roots)
    .with_no_client_auth();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    let tcp = TcpStream::connect(server.addr())
        .await
        .expect("TCP connect");
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1").expect("server name");
    tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(name, tcp)
        .await
        .expect("TLS handshake")
}

fn request(method: &str, path: &str, body: &str) -> Request<Full<Bytes>> {
    Request::builder()
        .method(method)
        .uri(format!("https://127.0.0.1{path}"))
        .header(header::AUTHORIZATION, format!("Bearer {ADMIN_TOKEN}"))
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body.to_owned())))
        .expect("request")
}

fn config_map(name: &str) -> String {
    serde_json::json!({"metadata": {"name": name}}).to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_offering_h2_gets_requests_and_a_watch_on_one_connection() {
    let server = server().await;
    let tls = connect(&server, &[b"h2", b"http/1.1"]).await;
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
    let (sender, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls))
            .await
            .expect("HTTP/2 handshake");
    tokio::spawn(conn);

    let mut watch = sender
        .clone()
        .send_request(request(
            "GET",
            "/api/v1/namespaces/default/configmaps?watch=true",
            "",
        ))
        .await
        .expect("watch opens");
    assert_eq!(watch.status(), StatusCode::OK);
    assert_eq!(watch.version(), http::Version::HTTP_2);

    let creates = (0..32).map(|i| {
        let mut sender = sender.clone();
        async move {
            sender
                .send_request(request(
                    "POST",
                    "/api/v1/namespaces/default/configmaps",
                    &config_map(&format!("m{i}")),
                ))
                .await
                .map(|r| r.status())
        }
    });
    let statuses = futures::future::join_all(creates).await;
    assert!(
        statuses
            .iter()
            .all(|s| matches!(s, Ok(StatusCode::CREATED))),
        "{statuses:?}"
    );

    let frame = tokio::time::timeout(std::time::Duration::from_secs(5), watch.body_mut().frame())
        .await
        .expect("a watch event within 5 s")
        .expect("the stream is open")
        .expect("a frame");
    let data = frame.into_data().expect("a data frame");
    let event: serde_json::Value =
        serde_json::from_slice(data.split(|b| *b == b'\n').next().unwrap_or_default())
            .expect("one JSON watch event per line");
    assert_eq!(event["type"], "ADDED");
    assert_eq!(event["object"]["kind"], "ConfigMap");
}

#[tokio::test]
async fn a_client_offering_only_http1_is_served_http1() {
    let server = server().await;
    let tls = connect(&server, &[b"http/1.1"]).await;
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"http/1.1"[..]));
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
        .await
        .expect("HTTP/1.1 handshake");
    tokio::spawn(conn);
    let response = sender
        .send_request(request(
            "POST",
            "/api/v1/namespaces/default/configmaps",
            &config_map("plain"),
        ))
        .await
        .expect("create");
    assert_eq!(response.status(), StatusCode::CREATED);
    assert_eq!(response.version(), http::Version::HTTP_11);
}
