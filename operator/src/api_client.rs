//! The operator's Kubernetes API client: every request and watch of the
//! process multiplexed over one HTTP/2 connection, as client-go does.
//!
//! kube's own client offers HTTP/1.1 only, so each request in flight holds
//! a TLS connection of its own. Under a burst of admissions the operator
//! held well over a hundred of them, each with its TLS state, buffers and
//! task (about a tenth of its heap at 10,000 queued pods), and paid a TLS
//! handshake for each new one. Over HTTP/2, requests beyond the server's
//! stream limit wait for a stream on the same connection instead.

use std::time::Duration;

use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use kube::client::ConfigExt;
use tower::ServiceBuilder;

/// How often an idle connection is pinged, so a dead one (a server gone
/// without closing it) is found and replaced before a request waits on it.
/// client-go pings after 30 s without a frame.
const PING_INTERVAL: Duration = Duration::from_secs(30);

/// How long a ping may go unanswered before the connection is closed and
/// everything on it fails (watches restart, writes are retried by their
/// owners). client-go waits 15 s.
const PING_TIMEOUT: Duration = Duration::from_secs(15);

/// Builds a client for `config` that speaks HTTP/2 when the API server
/// offers it over ALPN (every real one does) and HTTP/1.1 otherwise.
///
/// Guarantee: authentication, the cluster's CA, `tls-server-name`, extra
/// headers and the default namespace are `config`'s, as with
/// `kube::Client::try_from`; no request is retried here (the callers
/// retry on their own schedule). A config with a proxy is handed to kube's
/// own client, which knows how to tunnel.
pub fn build(config: kube::Config) -> Result<kube::Client, kube::Error> {
    if config.proxy_url.is_some() {
        return kube::Client::try_from(config);
    }
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_nodelay(true);
    http.set_connect_timeout(config.connect_timeout);
    let mut tls = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(config.rustls_client_config()?)
        .https_or_http();
    if let Some(name) = &config.tls_server_name {
        let name = rustls::pki_types::ServerName::try_from(name.clone()).map_err(|e| {
            kube::Error::Service(format!("invalid tls-server-name {name:?}: {e}").into())
        })?;
        tls = tls.with_server_name_resolver(hyper_rustls::FixedServerNameResolver::new(name));
    }
    let connector = tls.enable_all_versions().wrap_connector(http);
    let client = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        .timer(TokioTimer::new())
        .http2_keep_alive_interval(PING_INTERVAL)
        .http2_keep_alive_timeout(PING_TIMEOUT)
        .http2_keep_alive_while_idle(true)
        .build(connector);
    let service = ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .option_layer(config.auth_layer()?)
        .layer(config.extra_headers_layer()?)
        .map_err(tower::BoxError::from)
        .service(client);
    Ok(kube::Client::new(service, config.default_namespace))
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpupool_sim_apiserver::{ADMIN_TOKEN, ApiServer, ApiServerConfig, RunningApiServer};
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::api::PostParams;
    use kube::config::{KubeConfigOptions, Kubeconfig};
    use kube::{Api, ResourceExt};

    async fn server(tls: bool) -> RunningApiServer {
        ApiServer::start(ApiServerConfig {
            tls,
            ..ApiServerConfig::default()
        })
        .await
        .expect("API server starts")
    }

    async fn config_of(server: &RunningApiServer) -> kube::Config {
        let kubeconfig =
            Kubeconfig::from_yaml(&server.kubeconfig_yaml(ADMIN_TOKEN)).expect("kubeconfig");
        kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
            .await
            .expect("config")
    }

    /// Established TCP connections of this process to `port` on 127.0.0.1,
    /// read from the kernel's table (the test's server and client share it,
    /// so only the client's side has the server's port as remote).
    fn connections_to(port: u16) -> usize {
        let table = std::fs::read_to_string("/proc/net/tcp").expect("/proc/net/tcp");
        let remote = format!("0100007F:{port:04X}");
        table
            .lines()
            .skip(1)
            .filter(|line| {
                let fields: Vec<&str> = line.split_whitespace().collect();
                // Field 3 is the state; 01 is ESTABLISHED.
                fields.get(2) == Some(&remote.as_str()) && fields.get(3) == Some(&"01")
            })
            .count()
    }

    fn config_map(name: &str) -> ConfigMap {
        serde_json::from_value(serde_json::json!({"metadata": {"name": name}}))
            .expect("config map")
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn requests_and_watches_share_one_http2_connection() {
        let server = server(true).await;
        let client = build(config_of(&server).await).expect("client");

        let response = client
            .send(
                http::Request::get("/version")
                    .body(kube::client::Body::empty())
                    .expect("request"),
            )
            .await
            .expect("GET /version");
        assert_eq!(response.version(), http::Version::HTTP_2);

        let maps: Api<ConfigMap> = Api::namespaced(client.clone(), "default");
        let watch = maps
            .watch(&kube::api::WatchParams::default(), "0")
            .await
            .expect("watch opens");
        let creates = (0..64).map(|i| {
            let maps = maps.clone();
            async move {
                maps.create(&PostParams::default(), &config_map(&format!("m{i}")))
                    .await
            }
        });
        let created = futures::future::join_all(creates).await;
        assert!(created.iter().all(Result::is_ok), "{created:?}");
        let listed = maps.list(&Default::default()).await.expect("list");
        assert_eq!(listed.items.len(), 64);
        assert!(listed.items.iter().all(|m| m.name_any().starts_with('m')));

        assert_eq!(connections_to(server.addr().port()), 1);
        drop(watch);
    }

    #[tokio::test]
    async fn a_server_without_tls_is_spoken_to_over_http1() {
        let server = server(false).await;
        let client = build(config_of(&server).await).expect("client");
        let maps: Api<ConfigMap> = Api::namespaced(client, "default");
        let created = maps
            .create(&PostParams::default(), &config_map("plain"))
            .await
            .expect("create over plain HTTP");
        assert_eq!(created.name_any(), "plain");
    }

    #[tokio::test]
    async fn an_invalid_tls_server_name_is_refused_by_name() {
        let server = server(true).await;
        let mut config = config_of(&server).await;
        config.tls_server_name = Some("not a host name".to_owned());
        let Err(error) = build(config) else {
            panic!("a client was built for an invalid tls-server-name");
        };
        assert!(
            error.to_string().contains("invalid tls-server-name \"not a host name\""),
            "{error}"
        );
    }
}
