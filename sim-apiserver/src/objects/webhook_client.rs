//! The API server's HTTPS client for admission webhooks.
//!
//! As the real API server's client does, it offers HTTP/2 and HTTP/1.1
//! over ALPN and keeps connections for later calls:
//! - a server that negotiates HTTP/2 gets its calls multiplexed: as many
//!   at once on one connection as the server allows (at most
//!   [`STREAMS_PER_CONNECTION`]), and a new connection only when every kept
//!   one is that busy; the calls of a burst wait for one dial instead of
//!   each dialling its own, so a webhook under load is not paid a TLS
//!   handshake per call;
//! - a server that speaks HTTP/1.1 only gets one call per connection at a
//!   time, and up to [`IDLE_PER_SERVER`] idle connections are kept for it.
//!
//! A call that fails before its answer on a kept connection (closed by the
//! server as the request went out, say) is tried once more over a
//! connection dialled for it: admission webhooks must tolerate a repeat.
//! A call an HTTP/2 server refused unprocessed (`REFUSED_STREAM`) is sent
//! again, up to [`MAX_REFUSALS`] times.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;

use crate::util::base64_decode;

type Http1 = hyper::client::conn::http1::SendRequest<Full<Bytes>>;
type Http2 = h2::client::SendRequest<Bytes>;

/// Most idle HTTP/1.1 connections kept per webhook server.
const IDLE_PER_SERVER: usize = 16;

/// Most calls in flight at once on one HTTP/2 connection before another is
/// dialled, whatever more the server allows: the Go client's default.
pub(crate) const STREAMS_PER_CONNECTION: usize = 100;

/// Bytes an HTTP/2 webhook may send on one stream, and on one connection,
/// before the client's window update (the Go client's defaults).
const STREAM_WINDOW: u32 = 4 << 20;
const CONNECTION_WINDOW: u32 = 1 << 30;

/// Most times one call is sent again after a server refused its stream
/// unprocessed.
const MAX_REFUSALS: usize = 8;

/// Most webhook call durations kept (4 bytes each); later calls are not
/// recorded, so a long-running server's memory stays bounded.
const MAX_RECORDED_CALLS: usize = 1 << 20;

/// Where a webhook call goes.
pub(crate) struct Endpoint<'a> {
    /// Host (IP or name) and port to connect to.
    pub connect: &'a str,
    /// Name the server certificate must carry.
    pub server_name: &'a str,
    /// Base64 PEM bundle the server certificate must chain to.
    pub ca_bundle: &'a str,
}

impl Endpoint<'_> {
    /// Connections are kept per address, name and trust.
    fn key(&self) -> String {
        format!("{}\n{}\n{}", self.connect, self.server_name, self.ca_bundle)
    }
}

/// An HTTP/2 connection shared by the calls in flight on it.
struct Multiplexed {
    sender: Http2,
    in_flight: AtomicUsize,
    /// Set when the connection ended.
    closed: Arc<AtomicBool>,
}

impl Multiplexed {
    fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Calls it may carry at once: the server's limit, capped.
    fn streams(&self) -> usize {
        self.sender
            .current_max_send_streams()
            .min(STREAMS_PER_CONNECTION)
    }
}

/// One call's claim on a stream of a [`Multiplexed`] connection, given up
/// when the call ends.
struct Stream(Arc<Multiplexed>);

impl Stream {
    /// Claims a stream when the connection is open and has one to spare.
    fn claim(conn: &Arc<Multiplexed>) -> Option<Self> {
        if conn.is_closed() {
            return None;
        }
        let streams = conn.streams();
        conn.in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < streams).then_some(n + 1)
            })
            .ok()
            .map(|_| Stream(conn.clone()))
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A connection one call uses.
enum Conn {
    Http1(Http1),
    Http2(Stream),
}

/// Why a request got no answer.
struct SendError {
    /// The server refused the stream before processing it: sending the
    /// request again anywhere is safe.
    refused: bool,
    /// What failed, with its causes.
    message: String,
}

impl From<String> for SendError {
    fn from(message: String) -> Self {
        SendError {
            refused: false,
            message,
        }
    }
}

impl From<h2::Error> for SendError {
    fn from(error: h2::Error) -> Self {
        SendError {
            refused: error.is_remote() && error.reason() == Some(h2::Reason::REFUSED_STREAM),
            message: describe(&error),
        }
    }
}

impl Conn {
    /// Sends the request and waits for the answer's head.
    async fn send(&mut self, request: http::Request<Bytes>) -> Result<Answer, SendError> {
        match self {
            Conn::Http1(sender) => {
                let (mut parts, body) = request.into_parts();
                if let Some(host) = parts.uri.host() {
                    let host = http::HeaderValue::from_str(host).map_err(|e| e.to_string())?;
                    parts.headers.insert(http::header::HOST, host);
                }
                // HTTP/1.1 sends the path alone; the host goes in its header.
                parts.uri = parts
                    .uri
                    .path_and_query()
                    .map_or("/", |p| p.as_str())
                    .parse()
                    .map_err(|e: http::uri::InvalidUri| e.to_string())?;
                let request = http::Request::from_parts(parts, Full::new(body));
                let response = sender
                    .send_request(request)
                    .await
                    .map_err(|e| describe(&e))?;
                Ok(Answer::Http1(response))
            }
            Conn::Http2(stream) => {
                let mut sender = stream.0.sender.clone().ready().await?;
                let (parts, body) = request.into_parts();
                let (response, mut out) =
                    sender.send_request(http::Request::from_parts(parts, ()), body.is_empty())?;
                if !body.is_empty() {
                    out.send_data(body, true)?;
                }
                Ok(Answer::Http2(response.await?))
            }
        }
    }
}

/// The head of an answer, its body still to read.
enum Answer {
    Http1(http::Response<hyper::body::Incoming>),
    Http2(http::Response<h2::RecvStream>),
}

impl Answer {
    /// The status and the whole body.
    async fn read(self) -> Result<(http::StatusCode, Bytes), String> {
        match self {
            Answer::Http1(response) => {
                let status = response.status();
                let body = response
                    .into_body()
                    .collect()
                    .await
                    .map_err(|e| describe(&e))?
                    .to_bytes();
                Ok((status, body))
            }
            Answer::Http2(response) => {
                let status = response.status();
                let mut stream = response.into_body();
                let mut body = BytesMut::new();
                while let Some(chunk) = stream.data().await {
                    let chunk = chunk.map_err(|e| describe(&e))?;
                    // Gives the window back, so the server may send on.
                    let _ = stream.flow_control().release_capacity(chunk.len());
                    body.extend_from_slice(&chunk);
                }
                Ok((status, body.freeze()))
            }
        }
    }
}

/// What is kept for one webhook server.
#[derive(Default)]
struct Server {
    /// HTTP/1.1 connections whose last answer was read in full.
    idle: Vec<Http1>,
    /// Open HTTP/2 connections.
    shared: Vec<Arc<Multiplexed>>,
    /// Whether the last connection dialled negotiated HTTP/2; `None` before
    /// the first.
    speaks_h2: Option<bool>,
    /// Held while dialling a server that speaks (or may speak) HTTP/2, so
    /// that the calls of a burst share the connection one of them dials.
    dialling: Arc<tokio::sync::Mutex<()>>,
}

/// Calls webhooks; caches TLS client configurations per CA bundle and keeps
/// connections between calls.
#[derive(Default)]
pub struct WebhookClient {
    tls: Mutex<HashMap<String, Arc<rustls::ClientConfig>>>,
    servers: Mutex<HashMap<String, Server>>,
    /// How long each call took, in milliseconds, in the order they ended.
    durations_ms: Mutex<Vec<f32>>,
}

impl WebhookClient {
    /// A client with nothing cached.
    pub fn new() -> Self {
        WebhookClient::default()
    }

    /// How long each webhook call took, in milliseconds, from choosing a
    /// connection (dialing one when none is kept) to the whole answer read,
    /// failed calls included; at most the first [`MAX_RECORDED_CALLS`].
    pub fn durations_ms(&self) -> Vec<f32> {
        self.durations_ms
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Records how long a call took.
    pub(crate) fn record(&self, took: Duration) {
        let mut durations = self.durations_ms.lock().unwrap_or_else(|p| p.into_inner());
        if durations.len() < MAX_RECORDED_CALLS {
            durations.push(took.as_secs_f32() * 1000.0);
        }
    }

    /// POSTs `body` to `path` on `endpoint` and reads the whole answer:
    /// its status and body. The error says what failed, with its causes.
    pub(crate) async fn post(
        &self,
        endpoint: &Endpoint<'_>,
        path: &str,
        body: Bytes,
    ) -> Result<(http::StatusCode, Bytes), String> {
        let tls = self.tls_config(endpoint.ca_bundle)?;
        let key = endpoint.key();
        let uri = format!("https://{}{path}", endpoint.server_name);
        let request = || {
            http::Request::post(uri.as_str())
                .header("content-type", "application/json")
                .header("accept", "application/json")
                .body(body.clone())
                .map_err(|e| e.to_string())
        };
        let mut refusals = 0;
        let (conn, answer) = loop {
            let (mut conn, kept) = match self.kept(&key).await {
                Some(conn) => (conn, true),
                None => (self.dial(&key, endpoint, tls.clone(), true).await?, false),
            };
            let error = match conn.send(request()?).await {
                Ok(answer) => break (conn, answer),
                Err(error) => error,
            };
            drop(conn);
            if error.refused && refusals < MAX_REFUSALS {
                refusals += 1;
                tracing::debug!(error = %error.message, "webhook refused the call's stream; sending it again");
                continue;
            }
            if !kept || error.refused {
                return Err(error.message);
            }
            tracing::debug!(error = %error.message, "kept webhook connection failed; dialling afresh");
            let mut conn = self.dial(&key, endpoint, tls, false).await?;
            match conn.send(request()?).await {
                Ok(answer) => break (conn, answer),
                Err(error) => return Err(error.message),
            }
        };
        let (status, bytes) = answer.read().await?;
        // An HTTP/2 stream is given back as `conn` drops here.
        if let Conn::Http1(sender) = conn {
            self.keep_idle(&key, sender);
        }
        Ok((status, bytes))
    }

    /// A kept connection that can take a call now: a stream of an open
    /// HTTP/2 connection with one to spare, else an idle HTTP/1.1 one.
    async fn kept(&self, key: &str) -> Option<Conn> {
        loop {
            let mut sender = {
                let mut servers = self.servers.lock().unwrap_or_else(|p| p.into_inner());
                let server = servers.get_mut(key)?;
                if let Some(stream) = server.stream() {
                    return Some(Conn::Http2(stream));
                }
                server.idle.pop()?
            };
            if !sender.is_closed() && sender.ready().await.is_ok() {
                return Some(Conn::Http1(sender));
            }
        }
    }

    /// Dials the server. With `share`, a server that speaks (or may speak)
    /// HTTP/2 is dialled by one call at a time, and a call that waited for
    /// another's dial takes a stream of that connection instead; without
    /// it (a retry after a kept connection failed), the call gets a
    /// connection of its own making.
    async fn dial(
        &self,
        key: &str,
        endpoint: &Endpoint<'_>,
        tls: Arc<rustls::ClientConfig>,
        share: bool,
    ) -> Result<Conn, String> {
        let dialling = {
            let mut servers = self.servers.lock().unwrap_or_else(|p| p.into_inner());
            let server = servers.entry(key.to_owned()).or_default();
            (share && server.speaks_h2 != Some(false)).then(|| server.dialling.clone())
        };
        let turn = match dialling {
            Some(lock) => Some(lock.lock_owned().await),
            None => None,
        };
        if turn.is_some() {
            let mut servers = self.servers.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(stream) = servers.get_mut(key).and_then(Server::stream) {
                return Ok(Conn::Http2(stream));
            }
        }
        let dialled = connect(endpoint, tls).await?;
        let mut servers = self.servers.lock().unwrap_or_else(|p| p.into_inner());
        let server = servers.entry(key.to_owned()).or_default();
        match dialled {
            Dialled::Http1(sender) => {
                server.speaks_h2 = Some(false);
                Ok(Conn::Http1(sender))
            }
            Dialled::Http2(sender, closed) => {
                server.speaks_h2 = Some(true);
                let conn = Arc::new(Multiplexed {
                    sender,
                    in_flight: AtomicUsize::new(1),
                    closed,
                });
                server.shared.push(conn.clone());
                Ok(Conn::Http2(Stream(conn)))
            }
        }
    }

    /// Keeps an HTTP/1.1 connection whose answer was read in full.
    fn keep_idle(&self, key: &str, sender: Http1) {
        if sender.is_closed() {
            return;
        }
        let mut servers = self.servers.lock().unwrap_or_else(|p| p.into_inner());
        let server = servers.entry(key.to_owned()).or_default();
        if server.idle.len() < IDLE_PER_SERVER {
            server.idle.push(sender);
        }
    }

    /// The TLS client configuration trusting `ca_bundle_b64`, built once.
    fn tls_config(&self, ca_bundle_b64: &str) -> Result<Arc<rustls::ClientConfig>, String> {
        let mut cache = self.tls.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = cache.get(ca_bundle_b64) {
            return Ok(c.clone());
        }
        let pem =
            base64_decode(ca_bundle_b64).map_err(|e| format!("caBundle is not base64: {e}"))?;
        let mut roots = rustls::RootCertStore::empty();
        for cert in rustls_pemfile::certs(&mut pem.as_slice()) {
            let cert = cert.map_err(|e| format!("caBundle holds no valid PEM certificate: {e}"))?;
            roots
                .add(cert)
                .map_err(|e| format!("caBundle certificate rejected: {e}"))?;
        }
        if roots.is_empty() {
            return Err("caBundle holds no certificate".into());
        }
        let mut cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
        cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        let cfg = Arc::new(cfg);
        cache.insert(ca_bundle_b64.to_string(), cfg.clone());
        Ok(cfg)
    }
}

impl Server {
    /// Claims a stream of an open HTTP/2 connection with one to spare,
    /// forgetting the connections that closed.
    fn stream(&mut self) -> Option<Stream> {
        self.shared.retain(|c| !c.is_closed());
        self.shared.iter().find_map(Stream::claim)
    }
}

/// A connection as dialled, by the protocol the server chose.
enum Dialled {
    Http1(Http1),
    /// With the flag its driver sets when the connection ends.
    Http2(Http2, Arc<AtomicBool>),
}

/// Opens a TLS connection to a webhook, verified against its CA bundle,
/// and speaks the protocol the server chose over ALPN (HTTP/1.1 when it
/// chose none).
async fn connect(
    endpoint: &Endpoint<'_>,
    tls: Arc<rustls::ClientConfig>,
) -> Result<Dialled, String> {
    let tcp = tokio::net::TcpStream::connect(endpoint.connect)
        .await
        .map_err(|e| format!("dial tcp {}: {e}", endpoint.connect))?;
    let _ = tcp.set_nodelay(true);
    let server_name = rustls::pki_types::ServerName::try_from(endpoint.server_name.to_owned())
        .map_err(|e| format!("invalid server name {}: {e}", endpoint.server_name))?;
    let stream = tokio_rustls::TlsConnector::from(tls)
        .connect(server_name, tcp)
        .await
        .map_err(|e| format!("tls: {e}"))?;
    let h2 = stream.get_ref().1.alpn_protocol() == Some(b"h2".as_slice());
    if h2 {
        // Go's client windows, so answers never wait on a window update.
        let (sender, mut conn) = h2::client::Builder::new()
            .initial_window_size(STREAM_WINDOW)
            .initial_connection_window_size(CONNECTION_WINDOW)
            .handshake(stream)
            .await
            .map_err(|e| describe(&e))?;
        let ping_pong = conn.ping_pong();
        let closed = Arc::new(AtomicBool::new(false));
        let ended = closed.clone();
        tokio::spawn(async move {
            let _ = conn.await;
            ended.store(true, Ordering::Release);
        });
        // The server's SETTINGS come before its answer to a PING: after one
        // round trip the connection knows how many calls it may carry, so a
        // burst does not open streams the server would refuse.
        if let Some(mut ping_pong) = ping_pong {
            ping_pong
                .ping(h2::Ping::opaque())
                .await
                .map_err(|e| describe(&e))?;
        }
        return Ok(Dialled::Http2(sender, closed));
    }
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| describe(&e))?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(Dialled::Http1(sender))
}

/// An HTTP client error with its causes, so that "connection error" says
/// which (reset, closed without close_notify, ...).
fn describe(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
