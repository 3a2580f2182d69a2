//! HTTP/1.1 and HTTP/2 serving, authentication, path routing and the REST verbs.

use std::convert::Infallible;
use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, header};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{Value, json};
use tokio::net::TcpListener;

use crate::error::{ApiError, Reason, success_status};
use crate::objects::patch::PatchType;
use crate::objects::pods;
use crate::objects::{self, Change, DeleteOpts, Part, WriteCtx};
use crate::registry::ResourceDef;
use crate::util::{base64_decode, base64_encode, meta_str, parse_query};
use crate::{Shared, UserInfo};

mod discovery;
mod openapi;
mod printers;
mod protobuf;
mod protobuf_kinds;
mod request;
mod table;
mod watch;

use request::bytes_response;
pub use request::{Body, Filter, Req, error_response, json_response, parse_rv};

const MAX_BODY: usize = 3 * 1024 * 1024;

/// Streams one HTTP/2 connection may carry at once: what kube-apiserver
/// offers by default (Go's HTTP/2 server default, since
/// `--http2-max-streams-per-connection` defaults to 0). A client with more
/// requests in flight queues them, as it would against the real server.
const MAX_STREAMS_PER_CONNECTION: u32 = 250;

/// Accepts connections until the server is cancelled; with `tls`, each
/// connection is wrapped in TLS first.
pub async fn serve(sh: Arc<Shared>, listener: TcpListener, tls: Option<Arc<rustls::ServerConfig>>) {
    let acceptor = tls.map(tokio_rustls::TlsAcceptor::from);
    loop {
        let (stream, _) = tokio::select! {
            r = listener.accept() => match r {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    continue;
                }
            },
            _ = sh.cancel.cancelled() => return,
        };
        let _ = stream.set_nodelay(true);
        let sh = sh.clone();
        let acceptor = acceptor.clone();
        tokio::spawn(async move {
            match acceptor {
                Some(acceptor) => match acceptor.accept(stream).await {
                    Ok(tls) => serve_connection(sh, TokioIo::new(tls)).await,
                    Err(e) => tracing::debug!(error = %e, "TLS handshake failed"),
                },
                None => serve_connection(sh, TokioIo::new(stream)).await,
            }
        });
    }
}

async fn serve_connection<IO>(sh: Arc<Shared>, io: IO)
where
    IO: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let svc_sh = sh.clone();
    let service = hyper::service::service_fn(move |req| {
        let sh = svc_sh.clone();
        async move { Ok::<_, Infallible>(handle(sh, req).await) }
    });
    // Like kube-apiserver, HTTP/2 where the client offers it (ALPN over
    // TLS, or the HTTP/2 preface), HTTP/1.1 otherwise.
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    builder.http1().keep_alive(true);
    builder
        .http2()
        .max_concurrent_streams(MAX_STREAMS_PER_CONNECTION);
    let conn = builder.serve_connection(io, service);
    let mut conn = std::pin::pin!(conn);
    tokio::select! {
        _ = conn.as_mut() => {}
        _ = sh.cancel.cancelled() => {
            conn.as_mut().graceful_shutdown();
            let _ = tokio::time::timeout(std::time::Duration::from_secs(2), conn.as_mut()).await;
        }
    }
}

/// Adds one `Warning: 299 - "…"` header per warning the write collected,
/// as the real server reports dropped unknown fields.
fn with_warnings(mut resp: Response<Body>, ctx: &WriteCtx) -> Response<Body> {
    for w in ctx.warnings.take() {
        let quoted = serde_json::to_string(&w).unwrap_or_default();
        if let Ok(v) = HeaderValue::from_str(&format!("299 - {quoted}")) {
            resp.headers_mut().append(header::WARNING, v);
        }
    }
    resp
}

fn authenticate(sh: &Shared, req: &Request<Incoming>) -> Result<UserInfo, ApiError> {
    let token = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|h| h.to_str().ok())
        .and_then(|h| {
            h.strip_prefix("Bearer ")
                .or_else(|| h.strip_prefix("bearer "))
        })
        .map(str::trim);
    token
        .and_then(|t| sh.config.tokens.get(t).cloned())
        .ok_or_else(|| ApiError::new(Reason::Unauthorized, "Unauthorized"))
}

async fn handle(sh: Arc<Shared>, req: Request<Incoming>) -> Response<Body> {
    let path = req.uri().path().to_string();
    if matches!(path.as_str(), "/healthz" | "/livez" | "/readyz") {
        let mut r = Response::new(Full::new(Bytes::from_static(b"ok")).boxed());
        r.headers_mut()
            .insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        return r;
    }
    let user = match authenticate(&sh, &req) {
        Ok(u) => u,
        Err(e) => return error_response(&e),
    };
    let method = req.method().clone();
    if matches!(
        method,
        Method::POST | Method::PUT | Method::PATCH | Method::DELETE
    ) {
        sh.count_write(&user.username, &method, &path);
    }
    let query = parse_query(req.uri().query());
    let header_str = |h: header::HeaderName| {
        req.headers()
            .get(h)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string()
    };
    let accept = header_str(header::ACCEPT);
    let content_type = header_str(header::CONTENT_TYPE);
    let user_agent = header_str(header::USER_AGENT);
    let body = match Limited::new(req.into_body(), MAX_BODY).collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => {
            return error_response(&ApiError::new(
                Reason::BadRequest,
                format!("cannot read the request body: {e}"),
            ));
        }
    };
    let segments: Vec<String> = path
        .split('/')
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect();
    let r = Req {
        method,
        segments,
        query,
        accept,
        content_type,
        user,
        user_agent,
        body,
    };
    let started = std::time::Instant::now();
    let resp = match route(&sh, &r).await {
        Ok(resp) => resp,
        Err(e) => error_response(&e),
    };
    tracing::debug!(method = %r.method, %path, status = resp.status().as_u16(), elapsed_us = started.elapsed().as_micros() as u64, "request");
    resp
}

/// The media type of OpenAPI v2 in protobuf, as kubectl asks for it.
const OPENAPI_V2_PROTOBUF: &str = "application/com.github.proto-openapi.spec.v2.v1.0+protobuf";

/// An OpenAPI v2 document with no paths and no definitions: protobuf
/// (gnostic's `openapi_v2.Document`: `swagger` = 1, `info` = 2 with `title`
/// = 1 and `version` = 2) when the client accepts it, JSON otherwise.
fn openapi_v2(r: &Req) -> Response<Body> {
    const TITLE: &str = "Kubernetes (gpupool simulated API server)";
    const VERSION: &str = "v2";
    if r.accept.contains("com.github.proto-openapi.spec.v2") {
        let mut info = vec![0x0a, TITLE.len() as u8];
        info.extend_from_slice(TITLE.as_bytes());
        info.extend_from_slice(&[0x12, VERSION.len() as u8]);
        info.extend_from_slice(VERSION.as_bytes());
        let mut doc = vec![0x0a, 3];
        doc.extend_from_slice(b"2.0");
        doc.extend_from_slice(&[0x12, info.len() as u8]);
        doc.extend_from_slice(&info);
        let mut resp = bytes_response(200, Bytes::from(doc));
        resp.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static(OPENAPI_V2_PROTOBUF),
        );
        return resp;
    }
    json_response(
        200,
        &json!({"swagger": "2.0", "info": {"title": TITLE, "version": VERSION}, "paths": {}, "definitions": {}}),
    )
}

/// Access reviews (`kubectl auth can-i`): this server enforces no RBAC,
/// so every review says allowed, and says why; rules reviews list one rule
/// allowing everything. Nothing is stored, as on a real server.
fn access_review(r: &Req, plural: &str) -> Result<Response<Body>, ApiError> {
    if r.method != Method::POST {
        return Err(ApiError::new(
            Reason::MethodNotAllowed,
            format!(
                "the server does not allow this method on the requested resource ({plural} are create-only)"
            ),
        ));
    }
    let mut review = r.json_body()?;
    if !review.is_object() {
        return Err(ApiError::bad_request(format!(
            "the body of a {plural} request must be an object"
        )));
    }
    review["status"] = if plural.ends_with("rulesreviews") {
        json!({
            "resourceRules": [{"verbs": ["*"], "apiGroups": ["*"], "resources": ["*"]}],
            "nonResourceRules": [{"verbs": ["*"], "nonResourceURLs": ["*"]}],
            "incomplete": false,
        })
    } else {
        json!({
            "allowed": true,
            "reason": "the gpupool simulated API server does not enforce RBAC: every authenticated user may do everything",
        })
    };
    Ok(json_response(201, &review))
}

async fn route(sh: &Arc<Shared>, r: &Req) -> Result<Response<Body>, ApiError> {
    let segs: Vec<&str> = r.segments.iter().map(String::as_str).collect();
    // OpenAPI v2 is published empty: a document with no definitions. kubectl
    // validates a `kind: List` client-side against it (it cannot ask the
    // server to validate a List), and skips kinds the document lacks, so the
    // server still does all field validation; a 404 there made kubectl
    // refuse every List.
    if matches!(segs.as_slice(), ["openapi", "v2"] | ["swagger.json"]) {
        return Ok(openapi_v2(r));
    }
    if matches!(segs.as_slice(), ["openapi", "v2", ..]) {
        return Err(ApiError::new(
            Reason::NotFound,
            "the simulated API server publishes one empty OpenAPI v2 document, at /openapi/v2",
        ));
    }
    if r.accept.contains("protobuf") && !r.accept.contains("json") && !r.accept.contains("*/*") {
        return Err(ApiError::new(
            Reason::NotAcceptable,
            "only application/json is served by the simulated API server",
        ));
    }
    match segs.as_slice() {
        ["version"] => Ok(json_response(200, &discovery::version())),
        ["api"] => Ok(json_response(200, &discovery::api_versions())),
        ["apis"] => Ok(json_response(
            200,
            &discovery::api_groups(&sh.lock().registry),
        )),
        ["api", "v1"] => Ok(json_response(
            200,
            &discovery::resource_list(&sh.lock().registry, "", "v1"),
        )),
        ["apis", g] => discovery::api_group(&sh.lock().registry, g).map(|v| json_response(200, &v)),
        ["apis", g, v] => {
            let reg = &sh.lock().registry;
            if reg.serves_group_version(g, v) {
                Ok(json_response(200, &discovery::resource_list(reg, g, v)))
            } else {
                Err(ApiError::new(
                    Reason::NotFound,
                    "the server could not find the requested resource",
                ))
            }
        }
        ["openapi", "v3"] => Ok(json_response(200, &openapi::root(&sh.lock().registry))),
        ["openapi", "v3", "api", v] => {
            openapi::group_version(&sh.lock().registry, "", v).map(|d| json_response(200, &d))
        }
        ["openapi", "v3", "apis", g, v] => {
            openapi::group_version(&sh.lock().registry, g, v).map(|d| json_response(200, &d))
        }
        ["sim", "faults", rest @ ..] => faults_admin(sh, r, rest),
        ["api", "v1", rest @ ..] => resource(sh, r, "", "v1", rest).await,
        ["apis", "authorization.k8s.io", "v1", rest @ ..]
            if rest
                .last()
                .is_some_and(|p| p.ends_with("accessreviews") || p.ends_with("rulesreviews")) =>
        {
            access_review(r, rest.last().copied().unwrap_or_default())
        }
        ["apis", g, v, rest @ ..] => resource(sh, r, g, v, rest).await,
        _ => Err(ApiError::new(
            Reason::NotFound,
            "the server could not find the requested resource",
        )),
    }
}

fn faults_admin(sh: &Shared, r: &Req, rest: &[&str]) -> Result<Response<Body>, ApiError> {
    let to_json = |c: &crate::FaultConfig| serde_json::to_value(c).unwrap_or_default();
    match (r.method.clone(), rest) {
        (Method::GET, []) => Ok(json_response(200, &to_json(&sh.faults.config()))),
        (Method::PUT | Method::POST, []) => {
            let cfg: crate::FaultConfig = serde_json::from_slice(&r.body)
                .map_err(|e| ApiError::bad_request(format!("invalid fault configuration: {e}")))?;
            sh.faults.set(cfg.clone()).map_err(ApiError::bad_request)?;
            Ok(json_response(200, &to_json(&cfg)))
        }
        (Method::DELETE, []) => {
            sh.faults.clear();
            Ok(json_response(200, &to_json(&sh.faults.config())))
        }
        (Method::POST, ["drop-watches"]) => {
            sh.faults.drop_watches();
            Ok(json_response(200, &success_status(200, None)))
        }
        _ => Err(ApiError::new(
            Reason::MethodNotAllowed,
            "the fault admin API takes GET, PUT or DELETE /sim/faults and POST /sim/faults/drop-watches",
        )),
    }
}

/// Where a resource request points.
struct Target<'a> {
    ns: Option<&'a str>,
    plural: &'a str,
    name: Option<&'a str>,
    sub: Option<&'a str>,
}

fn parse_target<'a>(rest: &[&'a str]) -> Result<Target<'a>, ApiError> {
    let not_found = || {
        ApiError::new(
            Reason::NotFound,
            "the server could not find the requested resource",
        )
    };
    let t = if rest.len() >= 3
        && rest[0] == "namespaces"
        && !(rest.len() == 3 && matches!(rest[2], "status" | "finalize"))
    {
        if rest.len() > 5 {
            return Err(not_found());
        }
        Target {
            ns: Some(rest[1]),
            plural: rest[2],
            name: rest.get(3).copied(),
            sub: rest.get(4).copied(),
        }
    } else {
        if rest.is_empty() || rest.len() > 3 {
            return Err(not_found());
        }
        Target {
            ns: None,
            plural: rest[0],
            name: rest.get(1).copied(),
            sub: rest.get(2).copied(),
        }
    };
    Ok(t)
}

async fn resource(
    sh: &Arc<Shared>,
    r: &Req,
    group: &str,
    version: &str,
    rest: &[&str],
) -> Result<Response<Body>, ApiError> {
    let t = parse_target(rest)?;
    let is_watch = r.flag("watch");
    sh.faults.before_request(is_watch).await?;
    if group.is_empty() && t.plural == "bindings" && r.method == Method::POST {
        let ns =
            t.ns.ok_or_else(|| ApiError::new(Reason::NotFound, "bindings are namespaced"))?;
        let body = r.json_body()?;
        let name = meta_str(&body, "name").unwrap_or_default().to_string();
        return binding(sh, r, ns, &name, &body);
    }
    let def = sh
        .lock()
        .registry
        .shared(group, version, t.plural)
        .cloned()
        .ok_or_else(|| {
            ApiError::new(
                Reason::NotFound,
                "the server could not find the requested resource",
            )
        })?;
    if def.namespaced && t.ns.is_none() && t.name.is_some() {
        return Err(ApiError::new(
            Reason::NotFound,
            "the server could not find the requested resource",
        ));
    }
    if !def.namespaced && t.ns.is_some() {
        return Err(ApiError::new(
            Reason::NotFound,
            "the server could not find the requested resource",
        ));
    }
    let ns = t.ns.unwrap_or_default();
    if t.sub == Some("scale")
        && def.group == "apps"
        && matches!(
            def.plural.as_str(),
            "deployments" | "replicasets" | "statefulsets"
        )
        && let Some(name) = t.name
    {
        return scale(sh, r, &def, ns, name).await;
    }
    let part = match t.sub {
        None => Part::Main,
        Some("status") if def.status_subresource => Part::Status,
        Some("finalize") if def.group.is_empty() && def.plural == "namespaces" => Part::Main,
        Some("eviction" | "binding") if def.group.is_empty() && def.plural == "pods" => Part::Main,
        Some(
            s @ ("log"
            | "exec"
            | "attach"
            | "portforward"
            | "proxy"
            | "ephemeralcontainers"
            | "resize"
            | "scale"),
        ) => {
            return Err(ApiError::new(
                Reason::NotImplemented,
                format!(
                    "the simulated API server does not support {}/{s}",
                    def.plural
                ),
            ));
        }
        Some(_) => {
            return Err(ApiError::new(
                Reason::NotFound,
                "the server could not find the requested resource",
            ));
        }
    };
    match (&r.method, t.name, t.sub) {
        (&Method::GET, None, None) if is_watch => watch::start(sh, &def, t.ns, r, r.wants_table()),
        (&Method::GET, None, None) => list(sh, &def, t.ns, r),
        (&Method::GET, Some(name), _) => {
            let obj = sh
                .lock()
                .get(&def.id(), ns, name)
                .ok_or_else(|| ApiError::not_found(&def.group, &def.plural, name))?;
            if r.wants_table() && part == Part::Main {
                let rv = meta_str(&obj, "resourceVersion")
                    .unwrap_or_default()
                    .to_string();
                return Ok(json_response(
                    200,
                    &table::render(&def, &[obj], r.q("includeObject"), &rv, true),
                ));
            }
            Ok(bytes_response(
                200,
                Bytes::from(serde_json::to_vec(&*obj).unwrap_or_default()),
            ))
        }
        (&Method::POST, None, None) => {
            let ctx = r.write_ctx()?;
            let obj = objects::create(sh, &def, ns, r.json_body()?, &ctx).await?;
            Ok(with_warnings(
                bytes_response(
                    201,
                    Bytes::from(serde_json::to_vec(&*obj).unwrap_or_default()),
                ),
                &ctx,
            ))
        }
        (&Method::POST, Some(name), Some("binding")) => binding(sh, r, ns, name, &r.json_body()?),
        (&Method::POST, Some(name), Some("eviction")) => eviction(sh, r, &def, ns, name).await,
        (&Method::PUT, Some(name), _) => {
            let ctx = r.write_ctx()?;
            let obj = objects::update(
                sh,
                &def,
                ns,
                name,
                part,
                Change::Replace(r.json_body()?),
                &ctx,
            )
            .await?;
            Ok(with_warnings(
                bytes_response(
                    200,
                    Bytes::from(serde_json::to_vec(&*obj).unwrap_or_default()),
                ),
                &ctx,
            ))
        }
        (&Method::PATCH, Some(name), _) => {
            let ctx = r.write_ctx()?;
            let kind = PatchType::from_content_type(&r.content_type)?;
            if kind == PatchType::Apply {
                let (obj, created) =
                    objects::apply(sh, &def, ns, name, part, &r.body, &ctx).await?;
                return Ok(with_warnings(
                    bytes_response(
                        if created { 201 } else { 200 },
                        Bytes::from(serde_json::to_vec(&*obj).unwrap_or_default()),
                    ),
                    &ctx,
                ));
            }
            let obj = objects::update(
                sh,
                &def,
                ns,
                name,
                part,
                Change::Patch(kind, r.body.clone()),
                &ctx,
            )
            .await?;
            Ok(with_warnings(
                bytes_response(
                    200,
                    Bytes::from(serde_json::to_vec(&*obj).unwrap_or_default()),
                ),
                &ctx,
            ))
        }
        (&Method::DELETE, Some(name), None) => {
            let ctx = r.write_ctx()?;
            let (opts, dry) = delete_options(r)?;
            let ctx = WriteCtx {
                dry_run: ctx.dry_run || dry,
                ..ctx
            };
            let d = objects::delete(sh, &def, ns, name, &opts, &ctx).await?;
            Ok(json_response(d.code, &d.body))
        }
        (&Method::DELETE, None, None) => delete_collection(sh, &def, t.ns, r).await,
        _ => Err(ApiError::new(
            Reason::MethodNotAllowed,
            format!(
                "the server does not allow this method on the requested resource ({} {})",
                r.method, def.plural
            ),
        )),
    }
}

/// The `autoscaling/v1` Scale of a workload: its replicas and, in status,
/// the replicas it has and its selector as a string.
fn scale_of(obj: &Value) -> Value {
    let selector = obj
        .pointer("/spec/selector/matchLabels")
        .and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or_default()))
                .collect::<Vec<_>>()
                .join(",")
        })
        .unwrap_or_default();
    let meta = &obj["metadata"];
    json!({
        "kind": "Scale", "apiVersion": "autoscaling/v1",
        "metadata": {
            "name": meta["name"], "namespace": meta["namespace"], "uid": meta["uid"],
            "resourceVersion": meta["resourceVersion"], "creationTimestamp": meta["creationTimestamp"],
        },
        "spec": {"replicas": obj.pointer("/spec/replicas").cloned().unwrap_or(json!(1))},
        "status": {
            "replicas": obj.pointer("/status/replicas").cloned().unwrap_or(json!(0)),
            "selector": selector,
        },
    })
}

/// `deployments|replicasets|statefulsets/<name>/scale`: GET reads the
/// Scale; PUT and PATCH change `spec.replicas` of the workload (a PUT's
/// resourceVersion, when given, must be current) and answer its new Scale.
/// Nothing acts on the replicas: no controller runs here.
async fn scale(
    sh: &Arc<Shared>,
    r: &Req,
    def: &ResourceDef,
    ns: &str,
    name: &str,
) -> Result<Response<Body>, ApiError> {
    let current = sh
        .lock()
        .get(&def.id(), ns, name)
        .ok_or_else(|| ApiError::not_found(&def.group, &def.plural, name))?;
    let before = scale_of(&current);
    let wanted = match r.method {
        Method::GET => return Ok(json_response(200, &before)),
        Method::PUT => r.json_body()?,
        Method::PATCH => {
            let kind = PatchType::from_content_type(&r.content_type)?;
            crate::objects::patch::apply(&before, kind, &r.body)?
        }
        _ => {
            return Err(ApiError::new(
                Reason::MethodNotAllowed,
                format!(
                    "the server does not allow this method on the requested resource ({} {}/scale)",
                    r.method, def.plural
                ),
            ));
        }
    };
    let replicas = wanted.pointer("/spec/replicas").and_then(Value::as_i64);
    let Some(replicas) = replicas.filter(|n| (0..=i64::from(i32::MAX)).contains(n)) else {
        return Err(ApiError::invalid(
            "autoscaling",
            "Scale",
            name,
            vec![crate::error::FieldCause::invalid(
                "spec.replicas",
                wanted.pointer("/spec/replicas").unwrap_or(&Value::Null),
                "must be greater than or equal to 0",
            )],
        ));
    };
    let mut patch = json!({"spec": {"replicas": replicas}});
    if let Some(rv) = wanted
        .pointer("/metadata/resourceVersion")
        .and_then(Value::as_str)
        && r.method == Method::PUT
        && !rv.is_empty()
    {
        patch["metadata"] = json!({"resourceVersion": rv});
    }
    let ctx = r.write_ctx()?;
    let body = serde_json::to_vec(&patch).unwrap_or_default();
    let updated = objects::update(
        sh,
        def,
        ns,
        name,
        Part::Main,
        Change::Patch(PatchType::Merge, Bytes::from(body)),
        &ctx,
    )
    .await?;
    Ok(json_response(200, &scale_of(&updated)))
}

fn delete_options(r: &Req) -> Result<(DeleteOpts, bool), ApiError> {
    let mut opts = DeleteOpts::default();
    let mut dry = false;
    if !r.body.is_empty() {
        let body: Value = if r.content_type.starts_with(protobuf::CONTENT_TYPE) {
            protobuf::decode(&r.body)?
        } else {
            serde_json::from_slice(&r.body)
                .map_err(|e| ApiError::bad_request(format!("invalid DeleteOptions: {e}")))?
        };
        opts.grace = body.get("gracePeriodSeconds").and_then(Value::as_i64);
        opts.propagation = body
            .get("propagationPolicy")
            .and_then(Value::as_str)
            .map(str::to_string);
        opts.uid = body
            .pointer("/preconditions/uid")
            .and_then(Value::as_str)
            .map(str::to_string);
        opts.resource_version = body
            .pointer("/preconditions/resourceVersion")
            .and_then(Value::as_str)
            .map(str::to_string);
        dry = body
            .get("dryRun")
            .and_then(Value::as_array)
            .is_some_and(|a| a.iter().any(|x| x == "All"));
        if body.get("orphanDependents").and_then(Value::as_bool) == Some(true) {
            opts.propagation = Some("Orphan".into());
        }
    }
    if let Some(g) = r.q("gracePeriodSeconds") {
        opts.grace = Some(g.parse().map_err(|_| {
            ApiError::bad_request(format!("gracePeriodSeconds: invalid value {g:?}"))
        })?);
    }
    if let Some(p) = r.q("propagationPolicy") {
        opts.propagation = Some(p.to_string());
    }
    if let Some(p) = &opts.propagation
        && !matches!(p.as_str(), "Orphan" | "Background" | "Foreground")
    {
        return Err(ApiError::bad_request(format!(
            "propagationPolicy: Unsupported value: \"{p}\": supported values: \"Foreground\", \"Background\", \"Orphan\""
        )));
    }
    Ok((opts, dry))
}

fn binding(
    sh: &Arc<Shared>,
    r: &Req,
    ns: &str,
    name: &str,
    body: &Value,
) -> Result<Response<Body>, ApiError> {
    let ctx = r.write_ctx()?;
    if name.is_empty() {
        return Err(ApiError::invalid(
            "",
            "Binding",
            "",
            vec![crate::error::FieldCause::required("metadata.name", "")],
        ));
    }
    if ctx.dry_run {
        return Ok(json_response(201, &success_status(201, None)));
    }
    pods::bind(&mut sh.lock(), ns, name, body)?;
    Ok(json_response(201, &success_status(201, None)))
}

async fn eviction(
    sh: &Arc<Shared>,
    r: &Req,
    def: &ResourceDef,
    ns: &str,
    name: &str,
) -> Result<Response<Body>, ApiError> {
    let body = r.json_body()?;
    if let Some(n) = meta_str(&body, "name")
        && n != name
    {
        return Err(ApiError::bad_request(format!(
            "name in URL does not match name in Eviction object ({n} != {name})"
        )));
    }
    let ctx = r.write_ctx()?;
    let dry = ctx.dry_run
        || body
            .pointer("/deleteOptions/dryRun")
            .and_then(Value::as_array)
            .is_some_and(|a| a.iter().any(|x| x == "All"));
    {
        let mut st = sh.lock();
        let pod = st
            .get(&def.id(), ns, name)
            .ok_or_else(|| ApiError::not_found("", "pods", name))?;
        let updates = pods::check_eviction(&st, ns, &pod)?;
        if !dry {
            pods::store_pdb_updates(&mut st, ns, updates);
        }
    }
    let opts = DeleteOpts {
        grace: body
            .pointer("/deleteOptions/gracePeriodSeconds")
            .and_then(Value::as_i64),
        propagation: None,
        uid: body
            .pointer("/deleteOptions/preconditions/uid")
            .and_then(Value::as_str)
            .map(str::to_string),
        resource_version: body
            .pointer("/deleteOptions/preconditions/resourceVersion")
            .and_then(Value::as_str)
            .map(str::to_string),
    };
    let ctx = WriteCtx {
        dry_run: dry,
        ..ctx
    };
    objects::delete(sh, def, ns, name, &opts, &ctx).await?;
    Ok(json_response(201, &success_status(201, None)))
}

fn list(
    sh: &Arc<Shared>,
    def: &ResourceDef,
    ns: Option<&str>,
    r: &Req,
) -> Result<Response<Body>, ApiError> {
    let filter = Filter::from_req(def, r)?;
    let limit = match r.q("limit") {
        None => None,
        Some(l) => Some(
            l.parse::<usize>()
                .map_err(|_| ApiError::bad_request(format!("limit: invalid value {l:?}")))?,
        )
        .filter(|l| *l > 0),
    };
    let after = match r.q("continue") {
        None => None,
        Some(c) => Some(decode_continue(c)?),
    };
    let rv = parse_rv(r)?;
    let st = sh.lock();
    let current = st.current_rv();
    match (r.q("resourceVersionMatch"), rv) {
        (Some("Exact"), Some(v)) if v != current => {
            return Err(ApiError::new(
                Reason::Gone,
                format!(
                    "too old resource version: {v} ({current}); the simulated API server serves only the latest state"
                ),
            ));
        }
        (Some("Exact" | "NotOlderThan"), None) => {
            return Err(ApiError::bad_request(
                "resourceVersionMatch is forbidden unless resourceVersion is provided",
            ));
        }
        (Some(m), _) if !matches!(m, "Exact" | "NotOlderThan") => {
            return Err(ApiError::bad_request(format!(
                "resourceVersionMatch: Unsupported value: \"{m}\": supported values: \"Exact\", \"NotOlderThan\""
            )));
        }
        _ => {}
    }
    if let Some(v) = rv
        && v > current
    {
        return Err(ApiError::new(
            Reason::Timeout,
            format!("Too large resource version: {v}, current: {current}"),
        ));
    }
    let mut items: Vec<Arc<Value>> = Vec::new();
    let mut next: Option<(String, String)> = None;
    let mut remaining = 0usize;
    for (key, obj) in st.list(&def.id(), ns, after) {
        if !filter.matches(obj) {
            continue;
        }
        if limit.is_some_and(|l| items.len() >= l) {
            remaining += 1;
            continue;
        }
        items.push(obj.clone());
        next = Some(key.clone());
    }
    drop(st);
    let cont = if remaining > 0 {
        next.map(|k| encode_continue(current, &k))
    } else {
        None
    };
    if r.wants_table() {
        let mut t = table::render(
            def,
            &items,
            r.q("includeObject"),
            &current.to_string(),
            true,
        );
        if let Some(c) = &cont {
            t["metadata"]["continue"] = json!(c);
        }
        return Ok(json_response(200, &t));
    }
    let mut meta = json!({"resourceVersion": current.to_string()});
    if let Some(c) = cont {
        meta["continue"] = json!(c);
        meta["remainingItemCount"] = json!(remaining);
    }
    let mut out = Vec::with_capacity(64 + items.len() * 512);
    out.extend_from_slice(b"{\"kind\":");
    let _ = serde_json::to_writer(&mut out, &format!("{}List", def.kind));
    out.extend_from_slice(b",\"apiVersion\":");
    let _ = serde_json::to_writer(&mut out, &def.api_version());
    out.extend_from_slice(b",\"metadata\":");
    let _ = serde_json::to_writer(&mut out, &meta);
    out.extend_from_slice(b",\"items\":[");
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        let _ = serde_json::to_writer(&mut out, &**item);
    }
    out.extend_from_slice(b"]}");
    Ok(bytes_response(200, Bytes::from(out)))
}

fn encode_continue(rv: u64, key: &(String, String)) -> String {
    base64_encode(
        json!({"rv": rv, "ns": key.0, "name": key.1})
            .to_string()
            .as_bytes(),
    )
}

fn decode_continue(c: &str) -> Result<(String, String), ApiError> {
    let bad = || ApiError::bad_request(format!("continue key is not valid: {c:?}"));
    let bytes = base64_decode(c).map_err(|_| bad())?;
    let v: Value = serde_json::from_slice(&bytes).map_err(|_| bad())?;
    match (
        v.get("ns").and_then(Value::as_str),
        v.get("name").and_then(Value::as_str),
    ) {
        (Some(ns), Some(name)) => Ok((ns.to_string(), name.to_string())),
        _ => Err(bad()),
    }
}

async fn delete_collection(
    sh: &Arc<Shared>,
    def: &ResourceDef,
    ns: Option<&str>,
    r: &Req,
) -> Result<Response<Body>, ApiError> {
    let filter = Filter::from_req(def, r)?;
    let ctx = r.write_ctx()?;
    let (opts, dry) = delete_options(r)?;
    let ctx = WriteCtx {
        dry_run: ctx.dry_run || dry,
        ..ctx
    };
    let targets: Vec<(String, String)> = sh
        .lock()
        .list(&def.id(), ns, None)
        .filter(|(_, o)| filter.matches(o))
        .map(|(k, _)| k.clone())
        .collect();
    let mut items = Vec::new();
    for (ons, name) in targets {
        match objects::delete(sh, def, &ons, &name, &opts, &ctx).await {
            Ok(d) => items.push(d.body),
            Err(e) if e.reason == Reason::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    let rv = sh.lock().current_rv();
    Ok(json_response(
        200,
        &json!({
            "kind": format!("{}List", def.kind),
            "apiVersion": def.api_version(),
            "metadata": {"resourceVersion": rv.to_string()},
            "items": items,
        }),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_split_into_namespace_resource_name_subresource() {
        let t = parse_target(&["namespaces", "ns", "pods", "p", "status"]).expect("valid");
        assert_eq!(
            (t.ns, t.plural, t.name, t.sub),
            (Some("ns"), "pods", Some("p"), Some("status"))
        );
        let t = parse_target(&["namespaces", "ns", "status"]).expect("valid");
        assert_eq!(
            (t.ns, t.plural, t.name, t.sub),
            (None, "namespaces", Some("ns"), Some("status"))
        );
        let t = parse_target(&["nodes"]).expect("valid");
        assert_eq!((t.plural, t.name), ("nodes", None));
        assert!(parse_target(&[]).is_err());
    }

    #[test]
    fn continue_tokens_round_trip_and_reject_garbage() {
        let tok = encode_continue(5, &("ns".into(), "a".into()));
        assert_eq!(
            decode_continue(&tok).expect("valid"),
            ("ns".into(), "a".into())
        );
        assert_eq!(decode_continue("!!").expect_err("garbage").http_code(), 400);
    }
}
