//! The in-memory Kubernetes API server of the simulated cluster (DESIGN §7).
//!
//! It speaks the real REST and watch protocol over HTTP/1.1 and HTTP/2
//! (offered over ALPN, as kube-apiserver does) on 127.0.0.1 so that kube-rs
//! clients, the real `gpupool-operator` / `gpupool-device-plugin`
//! binaries and `kubectl` work against it unchanged. What it does:
//!
//! - JSON only. Core `v1` and `/apis/<group>/<version>` paths, namespaced and
//!   cluster-scoped; get, list, watch, create, update, patch (JSON Patch,
//!   merge patch, strategic merge patch for built-in types), delete and
//!   deletecollection; `Status` error bodies as the real server sends them.
//! - One global, monotonically increasing resourceVersion; watch streams with
//!   bookmarks and `410 Gone` once a requested version has left the bounded
//!   event window. A watch is woken only by its own resource's events, and a
//!   pod watch selecting `spec.nodeName=<node>` only by that node's pods, as
//!   the real server's watch cache indexes pods by node for its kubelets.
//! - Object semantics: uid, generateName, generation, optimistic
//!   concurrency, status subresources, finalizers, pod grace periods,
//!   background garbage collection by ownerReferences, namespaces.
//! - CustomResourceDefinitions make their resources servable, validated
//!   against their `openAPIV3Schema`; admission webhooks are called over
//!   HTTPS; PodDisruptionBudgets guard evictions.
//! - Discovery and `meta.k8s.io/v1` Table output for kubectl, with the
//!   real server's columns for the built-in kinds. `/openapi/v3`
//!   lists paths and their `fieldValidation` parameter, so kubectl and
//!   Helm leave field validation to the server (unknown fields: 400 under
//!   `fieldValidation=Strict`, dropped with a `Warning` otherwise), and the
//!   schemas of custom resources only (`kubectl explain` works for those);
//!   `/openapi/v2` is an empty document (kubectl, which validates a `List`
//!   client-side, skips the kinds it lacks).
//! - apps/v1 Deployments, DaemonSets, StatefulSets, ReplicaSets and the
//!   rbac.authorization.k8s.io/v1 kinds are stored and served, but no
//!   controller acts on them (no pods are created for a Deployment).
//!
//! Identity: bearer tokens map to users (token → username, uid, groups);
//! requests without a known token get 401. **RBAC is not enforced**: every
//! authenticated user may do everything, and access reviews (`kubectl auth
//! can-i`) say so. Server-side apply works for every stored kind, with
//! `metadata.managedFields` per field manager, conflicts and force (see
//! `objects/apply`); every other write records an `Update` entry for its
//! manager. Protobuf request
//! bodies are decoded for what typed Go clients send (Secrets, ConfigMaps
//! and DeleteOptions from Helm's release storage; Namespaces,
//! ServiceAccounts, Deployments, Pods, Services, RBAC objects and access
//! reviews from `kubectl create`/`run`/`auth`), refused with 415 otherwise,
//! and answers are always JSON (406 for clients that accept only protobuf);
//! `pods/log`, `exec` and the like answer 501. New pods get the real
//! server's defaults (service account and token volume, tolerations,
//! termination-message fields). Write requests are counted per user
//! ([`RunningApiServer::writes_by_user`]). Fault injection ([`Faults`]) is
//! off by default.

pub mod bench;
mod cel;
pub mod error;
mod faults;
mod fields;
mod http;
mod kubeconfig;
mod objects;
pub mod ports;
pub mod registry;
pub mod selectors;
pub mod store;
mod tls;
pub mod tool_check;
mod util;

pub use objects::patch;
/// Standard base64 (RFC 4648 alphabet, `=` padded), as the server writes
/// Secret data and kubeconfig certificates. Public so that the test
/// webhooks encode their patches and CA bundles with the server's own
/// encoder rather than a copy of it.
pub use util::base64_encode;

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};

use serde::Deserialize;
use serde_json::Value;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

pub use faults::{FaultConfig, Faults};

use registry::{Registry, ResourceId};
use store::State;

/// The token [`ApiServerConfig::default`] accepts, for user `admin` in group
/// `system:masters`.
pub const ADMIN_TOKEN: &str = "gpupool-sim-admin-token";

/// Events a resource's watch channel holds for a watcher that lags; one
/// that falls further behind has its stream ended and resumes from the
/// event window, as a real watch does after a `410 Gone`.
const WATCH_CHANNEL_CAPACITY: usize = 16_384;

/// A user a bearer token authenticates as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UserInfo {
    /// `username` of the AdmissionReview's userInfo.
    pub username: String,
    /// `uid`.
    pub uid: String,
    /// `groups` (`system:authenticated` is added automatically).
    pub groups: Vec<String>,
    /// `extra`: what the authenticator adds beyond name and groups (a bound
    /// service-account token carries `authentication.kubernetes.io/node-name`
    /// and friends). Sent in every AdmissionReview's `userInfo.extra`,
    /// left out there when empty, as the real server's JSON omits it.
    pub extra: BTreeMap<String, Vec<String>>,
}

impl UserInfo {
    /// A user with uid `<username>-uid` and no extra.
    pub fn new(username: &str, groups: &[&str]) -> Self {
        UserInfo {
            username: username.to_string(),
            uid: format!("{username}-uid"),
            groups: groups.iter().map(|g| g.to_string()).collect(),
            extra: BTreeMap::new(),
        }
    }

    /// Adds one `extra` key with its values (builder style).
    pub fn with_extra(mut self, key: &str, values: &[&str]) -> Self {
        self.extra.insert(
            key.to_string(),
            values.iter().map(|v| v.to_string()).collect(),
        );
        self
    }
}

/// User `admin` in `system:masters`, whom [`ADMIN_TOKEN`] authenticates.
fn admin_user() -> UserInfo {
    UserInfo {
        username: "admin".into(),
        uid: "admin-uid".into(),
        groups: vec!["system:masters".into()],
        extra: BTreeMap::new(),
    }
}

/// How to start the server.
#[derive(Debug, Clone)]
pub struct ApiServerConfig {
    /// TCP port on 127.0.0.1; 0 picks a free one.
    pub port: u16,
    /// Bearer token → user. Requests with any other token get 401.
    pub tokens: HashMap<String, UserInfo>,
    /// Where webhook `service` references go: `"namespace/name"` → a local
    /// address (the port of the reference is ignored in favour of this one).
    pub service_addresses: HashMap<String, SocketAddr>,
    /// How many watch events are retained for watches that resume from an
    /// older resourceVersion; older ones get 410 Gone.
    pub event_window: usize,
    /// Seed of the fault-injection random generator.
    pub fault_seed: u64,
    /// Serve HTTPS with a fresh self-signed CA (the default). kubectl sends
    /// bearer tokens only over TLS; kube-rs clients work either way.
    pub tls: bool,
}

impl Default for ApiServerConfig {
    fn default() -> Self {
        let mut tokens = HashMap::new();
        tokens.insert(ADMIN_TOKEN.to_string(), admin_user());
        ApiServerConfig {
            port: 0,
            tokens,
            service_addresses: HashMap::new(),
            event_window: 50_000,
            fault_seed: 1,
            tls: true,
        }
    }
}

impl ApiServerConfig {
    /// Adds a token for a user with no `extra` (builder style).
    pub fn with_token(self, token: &str, username: &str, groups: &[&str]) -> Self {
        self.with_user(token, UserInfo::new(username, groups))
    }

    /// Adds a token for a user given in full, `extra` included (builder
    /// style); a token added twice authenticates as the last user given.
    pub fn with_user(mut self, token: &str, user: UserInfo) -> Self {
        self.tokens.insert(token.to_string(), user);
        self
    }

    /// Routes webhook `service` references to `ns/name` to a local address.
    pub fn with_service(mut self, namespace: &str, name: &str, addr: SocketAddr) -> Self {
        self.service_addresses
            .insert(format!("{namespace}/{name}"), addr);
        self
    }
}

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum ApiServerError {
    /// Binding the port failed.
    #[error("cannot listen on 127.0.0.1:{port}: {source}")]
    Bind {
        /// The port asked for.
        port: u16,
        /// The cause.
        source: std::io::Error,
    },
    /// Generating the serving certificate failed.
    #[error("{0}")]
    Tls(String),
    /// Writing the kubeconfig failed.
    #[error("cannot write kubeconfig {path}: {source}")]
    Kubeconfig {
        /// Where.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// Building a client failed.
    #[error("cannot build a kube client: {0}")]
    Client(String),
}

/// State shared by the HTTP handlers and background tasks.
pub(crate) struct Shared {
    state: Mutex<State>,
    config: ApiServerConfig,
    faults: Faults,
    ids: util::SplitMix,
    gc_wakeup: Notify,
    cancel: CancellationToken,
    http_client: objects::webhook_client::WebhookClient,
    /// Write requests (POST, PUT, PATCH, DELETE) per authenticated user,
    /// then per route (see [`write_route`]).
    writes: Mutex<BTreeMap<String, BTreeMap<String, u64>>>,
    /// Services given a cluster IP so far: the next one is 10.96.0.10 on.
    cluster_ips: std::sync::atomic::AtomicU32,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock would be a bug; keep serving anyway.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A cluster IP no Service of this server has had, from the Service
    /// range 10.96.0.0/12 (10.96.0.1 is the `kubernetes` Service's on a
    /// real cluster, so allocation starts above it).
    fn next_cluster_ip(&self) -> String {
        let n = 10
            + self
                .cluster_ips
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let ip = u32::from(std::net::Ipv4Addr::new(10, 96, 0, 0)) + (n % (1 << 20));
        std::net::Ipv4Addr::from(ip).to_string()
    }

    /// Counts one write request by `user`, whatever its outcome: what a
    /// client costs the server is every request it sends.
    fn count_write(&self, user: &str, method: &::http::Method, path: &str) {
        let mut writes = self.writes.lock().unwrap_or_else(|p| p.into_inner());
        *writes
            .entry(user.to_owned())
            .or_default()
            .entry(write_route(method, path))
            .or_default() += 1;
    }
}

/// `METHOD resource[/subresource]` of a request path: what a write did,
/// without which namespace or object it did it to.
fn write_route(method: &::http::Method, path: &str) -> String {
    let mut segments = path.trim_matches('/').split('/');
    // Skip `api/v1` or `apis/<group>/<version>`.
    let skip = match segments.next() {
        Some("api") => 1,
        Some("apis") => 2,
        _ => return format!("{method} {path}"),
    };
    let rest: Vec<&str> = segments.skip(skip).collect();
    let rest = match rest.as_slice() {
        // A namespace's own subresources, not a namespaced resource.
        ["namespaces", _, "status" | "finalize"] => &rest[..],
        ["namespaces", _, tail @ ..] if !tail.is_empty() => tail,
        all => all,
    };
    match rest {
        [resource] | [resource, _] => format!("{method} {resource}"),
        [resource, _, sub, ..] => format!("{method} {resource}/{sub}"),
        [] => format!("{method} {path}"),
    }
}

/// Starts servers.
#[derive(Debug)]
pub struct ApiServer;

impl ApiServer {
    /// Binds 127.0.0.1:`port`, creates the `default`, `kube-system`,
    /// `kube-public` and `kube-node-lease` namespaces and serves until
    /// [`RunningApiServer::shutdown`] (or drop).
    pub async fn start(config: ApiServerConfig) -> Result<RunningApiServer, ApiServerError> {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", config.port))
            .await
            .map_err(|source| ApiServerError::Bind {
                port: config.port,
                source,
            })?;
        let addr = listener
            .local_addr()
            .map_err(|source| ApiServerError::Bind {
                port: config.port,
                source,
            })?;
        let serving = if config.tls {
            Some(tls::generate().map_err(ApiServerError::Tls)?)
        } else {
            None
        };
        let state = State::new(
            Registry::builtin(),
            config.event_window,
            WATCH_CHANNEL_CAPACITY,
        );
        let shared = Arc::new(Shared {
            state: Mutex::new(state),
            faults: Faults::new(config.fault_seed),
            ids: util::SplitMix::new(
                jiff::Timestamp::now().as_nanosecond() as u64 ^ u64::from(addr.port()),
            ),
            config,
            gc_wakeup: Notify::new(),
            cancel: CancellationToken::new(),
            http_client: objects::webhook_client::WebhookClient::new(),
            writes: Mutex::new(BTreeMap::new()),
            cluster_ips: std::sync::atomic::AtomicU32::new(0),
        });
        for ns in ["default", "kube-system", "kube-public", "kube-node-lease"] {
            objects::bootstrap_namespace(&shared, ns);
        }
        let gc_task = tokio::spawn(objects::gc::run(shared.clone()));
        let serve_task = tokio::spawn(http::serve(
            shared.clone(),
            listener,
            serving.as_ref().map(|s| s.config.clone()),
        ));
        tracing::info!(%addr, "simulated API server listening");
        Ok(RunningApiServer {
            addr,
            ca_pem: serving.map(|s| s.ca_pem),
            shared,
            tasks: vec![gc_task, serve_task],
        })
    }
}

/// A server that is serving. Dropping it stops it.
pub struct RunningApiServer {
    addr: SocketAddr,
    ca_pem: Option<String>,
    shared: Arc<Shared>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl std::fmt::Debug for RunningApiServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunningApiServer")
            .field("addr", &self.addr)
            .finish()
    }
}

impl RunningApiServer {
    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `https://127.0.0.1:PORT` (or `http://` when TLS is off).
    pub fn base_url(&self) -> String {
        let scheme = if self.ca_pem.is_some() {
            "https"
        } else {
            "http"
        };
        format!("{scheme}://{}", self.addr)
    }

    /// PEM of the CA that signed the serving certificate (None without TLS).
    pub fn ca_pem(&self) -> Option<&str> {
        self.ca_pem.as_deref()
    }

    /// A kubeconfig (cluster `gpupool-sim`, namespace `default`) that
    /// authenticates with `token` and trusts the server's CA.
    pub fn kubeconfig_yaml(&self, token: &str) -> String {
        kubeconfig::render(&self.base_url(), self.ca_pem.as_deref(), token)
    }

    /// Writes [`Self::kubeconfig_yaml`] to `path` (mode 0600).
    pub fn write_kubeconfig(&self, path: &Path, token: &str) -> Result<(), ApiServerError> {
        kubeconfig::write(path, &self.kubeconfig_yaml(token)).map_err(|source| {
            ApiServerError::Kubeconfig {
                path: path.display().to_string(),
                source,
            }
        })
    }

    /// A kube client authenticated with [`ADMIN_TOKEN`] (or the first
    /// configured token when that one is not configured).
    pub async fn client(&self) -> Result<kube::Client, ApiServerError> {
        let token = if self.shared.config.tokens.contains_key(ADMIN_TOKEN) {
            ADMIN_TOKEN.to_string()
        } else {
            self.shared
                .config
                .tokens
                .keys()
                .next()
                .cloned()
                .unwrap_or_default()
        };
        self.client_with_token(&token).await
    }

    /// A kube client authenticated with `token`, built from the kubeconfig.
    pub async fn client_with_token(&self, token: &str) -> Result<kube::Client, ApiServerError> {
        let cfg = self.kube_config(token).await?;
        kube::Client::try_from(cfg).map_err(|e| ApiServerError::Client(e.to_string()))
    }

    /// The kube client configuration for `token` (to adjust before building
    /// a client, e.g. `default_retry = false` so a 429 surfaces at once
    /// instead of being retried by kube's default policy).
    pub async fn kube_config(&self, token: &str) -> Result<kube::Config, ApiServerError> {
        let kc = kube::config::Kubeconfig::from_yaml(&self.kubeconfig_yaml(token))
            .map_err(|e| ApiServerError::Client(e.to_string()))?;
        kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
            .await
            .map_err(|e| ApiServerError::Client(e.to_string()))
    }

    /// Creates an object through the normal create path (defaults,
    /// validation, admission webhooks) as user `admin`; CRDs created this way
    /// become servable at once.
    pub async fn create(
        &self,
        group: &str,
        version: &str,
        plural: &str,
        namespace: &str,
        obj: Value,
    ) -> Result<Value, error::ApiError> {
        let def = self
            .shared
            .lock()
            .registry
            .get(group, version, plural)
            .cloned()
            .ok_or_else(|| error::ApiError::not_found(group, plural, ""))?;
        let ctx = objects::WriteCtx::internal(admin_user(), objects::FieldValidation::Warn);
        objects::create(&self.shared, &def, namespace, obj, &ctx)
            .await
            .map(|o| (*o).clone())
    }

    /// Creates every CustomResourceDefinition in a multi-document YAML
    /// string (such as the files under `crds/`).
    pub async fn create_crds_from_yaml(&self, yaml: &str) -> Result<usize, error::ApiError> {
        let mut n = 0;
        for doc in serde_yaml::Deserializer::from_str(yaml) {
            let v = Value::deserialize(doc)
                .map_err(|e| error::ApiError::bad_request(format!("invalid CRD YAML: {e}")))?;
            if v.is_null() {
                continue;
            }
            self.create(
                "apiextensions.k8s.io",
                "v1",
                "customresourcedefinitions",
                "",
                v,
            )
            .await?;
            n += 1;
        }
        Ok(n)
    }

    /// Direct access to the stored objects, bypassing HTTP, admission and
    /// validation.
    pub fn admin(&self) -> Admin {
        Admin {
            shared: self.shared.clone(),
        }
    }

    /// Write requests (POST, PUT, PATCH, DELETE, refused ones included) per
    /// authenticated username since the server started.
    pub fn writes_by_user(&self) -> BTreeMap<String, u64> {
        self.shared
            .writes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(user, routes)| (user.clone(), routes.values().sum()))
            .collect()
    }

    /// `user`'s write requests since the server started, by route: the
    /// method and the resource (with its subresource), namespaces and names
    /// left out, e.g. `PATCH gpuleases/status`.
    pub fn writes_by_route(&self, user: &str) -> BTreeMap<String, u64> {
        self.shared
            .writes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(user)
            .cloned()
            .unwrap_or_default()
    }

    /// How long each admission webhook call took, in milliseconds, as this
    /// server saw it: from picking a kept connection (or dialing one) to the
    /// whole answer read, failed calls included; the first 2^20 calls.
    pub fn webhook_call_durations_ms(&self) -> Vec<f32> {
        self.shared.http_client.durations_ms()
    }

    /// The fault-injection controls (all off by default).
    pub fn faults(&self) -> Faults {
        self.shared.faults.clone()
    }

    /// Stops serving: closes the listener and every watch stream.
    pub async fn shutdown(mut self) {
        self.shared.cancel.cancel();
        for t in self.tasks.drain(..) {
            let _ = t.await;
        }
    }
}

impl Drop for RunningApiServer {
    fn drop(&mut self) {
        self.shared.cancel.cancel();
    }
}

/// Reads and writes stored objects directly, for tests and the simulator.
#[derive(Clone)]
pub struct Admin {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Admin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Admin")
    }
}

impl Admin {
    /// One object by group (`""` for core), plural, namespace (`""` when
    /// cluster-scoped) and name.
    pub fn get(&self, group: &str, plural: &str, namespace: &str, name: &str) -> Option<Value> {
        self.shared
            .lock()
            .get(&ResourceId::new(group, plural), namespace, name)
            .map(|o| (*o).clone())
    }

    /// Every object of a resource, optionally in one namespace.
    pub fn list(&self, group: &str, plural: &str, namespace: Option<&str>) -> Vec<Value> {
        self.shared
            .lock()
            .list(&ResourceId::new(group, plural), namespace, None)
            .map(|(_, o)| (**o).clone())
            .collect()
    }

    /// The latest resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.shared.lock().current_rv()
    }

    /// Stores an object as given (metadata.name/namespace must be set; uid
    /// and creationTimestamp are filled in when absent), emitting the watch
    /// event. No admission, no validation.
    pub fn put(&self, group: &str, plural: &str, obj: Value) -> Result<Value, error::ApiError> {
        objects::admin_put(&self.shared, group, plural, obj)
    }

    /// Removes an object at once, ignoring finalizers and grace periods.
    pub fn remove(&self, group: &str, plural: &str, namespace: &str, name: &str) -> Option<Value> {
        let removed = self
            .shared
            .lock()
            .remove(&ResourceId::new(group, plural), namespace, name)
            .map(|o| (*o).clone());
        self.shared.gc_wakeup.notify_one();
        removed
    }

    /// Forgets every retained watch event, so any watch resuming from an
    /// older resourceVersion gets 410 Gone.
    pub fn compact(&self) {
        self.shared.lock().compact_all();
    }
}

#[cfg(test)]
mod write_route_tests {
    use super::write_route;
    use ::http::Method;

    #[test]
    fn routes_name_the_resource_and_subresource_only() {
        let cases = [
            (Method::POST, "/api/v1/namespaces", "POST namespaces"),
            (Method::DELETE, "/api/v1/namespaces/ml", "DELETE namespaces"),
            (
                Method::PUT,
                "/api/v1/namespaces/ml/finalize",
                "PUT namespaces/finalize",
            ),
            (Method::POST, "/api/v1/namespaces/ml/pods", "POST pods"),
            (Method::PATCH, "/api/v1/namespaces/ml/pods/a", "PATCH pods"),
            (
                Method::POST,
                "/api/v1/namespaces/ml/pods/a/eviction",
                "POST pods/eviction",
            ),
            (
                Method::PATCH,
                "/apis/gpupool.io/v1alpha1/namespaces/ml/gpuleases/a/status",
                "PATCH gpuleases/status",
            ),
            (
                Method::PATCH,
                "/apis/gpupool.io/v1alpha1/gpuleaseclasses/default/status",
                "PATCH gpuleaseclasses/status",
            ),
            (Method::PATCH, "/api/v1/nodes/node-1", "PATCH nodes"),
            (Method::POST, "/healthz", "POST /healthz"),
        ];
        for (method, path, want) in cases {
            assert_eq!(write_route(&method, path), want, "{path}");
        }
    }
}
