//! What the webhook needs to know: where it listens, how the API server
//! reaches it, and who may remove the scheduling gate.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::str::FromStr;
use std::time::Duration;

use super::certs::SECRET_NAME;
use super::review::Users;

/// Service account name the operator runs as in the Helm chart; the default
/// gate owner is this account in the operator's namespace.
pub const DEFAULT_SERVICE_ACCOUNT: &str = "gpupool-operator";
/// Service account the device plugins run as, when `--device-plugin-user` is not given.
pub const DEFAULT_DEVICE_PLUGIN_SERVICE_ACCOUNT: &str = "gpupool-device-plugin";
/// Port of the webhook Service when `--webhook-service` names none.
pub const DEFAULT_SERVICE_PORT: u16 = 443;
/// URL path of the mutating (pod CREATE) webhook.
pub const MUTATE_PATH: &str = "/mutate-pods";
/// URL path of the validating (pod UPDATE) webhook.
pub const VALIDATE_PATH: &str = "/validate-pods";
/// Path of the GpuLease validating webhook.
pub const LEASE_PATH: &str = "/validate-gpuleases";
/// Path of the GpuLeaseClass validating webhook.
pub const CLASS_PATH: &str = "/validate-gpuleaseclasses";

/// A webhook flag value that cannot be used; the message names the flag.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// `--webhook-service` is not `NAMESPACE/NAME[:PORT]`.
    #[error(
        "--webhook-service {value:?}: {reason} (expected NAMESPACE/NAME or NAMESPACE/NAME:PORT)"
    )]
    BadService {
        /// The value given.
        value: String,
        /// What is wrong with it.
        reason: String,
    },
    /// `--webhook-url` is not an https URL with a host.
    #[error("--webhook-url {value:?}: {reason} (expected https://HOST[:PORT][/PATH])")]
    BadUrl {
        /// The value given.
        value: String,
        /// What is wrong with it.
        reason: String,
    },
}

/// The Service the API server calls the webhook through (in a cluster).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceRef {
    /// Namespace of the Service.
    pub namespace: String,
    /// Name of the Service.
    pub name: String,
    /// Service port (not the pod's `--webhook-port`).
    pub port: u16,
}

impl FromStr for ServiceRef {
    type Err = ConfigError;

    /// Parses `NAMESPACE/NAME` or `NAMESPACE/NAME:PORT` (port defaults to 443).
    fn from_str(value: &str) -> Result<Self, Self::Err> {
        let bad = |reason: &str| ConfigError::BadService {
            value: value.to_owned(),
            reason: reason.to_owned(),
        };
        let (namespace, rest) = value.split_once('/').ok_or_else(|| bad("no '/'"))?;
        let (name, port) = match rest.split_once(':') {
            None => (rest, DEFAULT_SERVICE_PORT),
            Some((name, port)) => (
                name,
                port.parse::<u16>()
                    .ok()
                    .filter(|p| *p > 0)
                    .ok_or_else(|| bad("the port is not a number from 1 to 65535"))?,
            ),
        };
        for (what, part) in [("namespace", namespace), ("name", name)] {
            if !is_dns_label(part) {
                return Err(bad(&format!(
                    "the {what} {part:?} is not a DNS label (lowercase letters, digits, '-', at most 63)"
                )));
            }
        }
        Ok(Self {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            port,
        })
    }
}

fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// The https URL the API server calls the webhook at (outside a cluster).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WebhookUrl {
    base: String,
    host: String,
}

impl WebhookUrl {
    /// The URL of the webhook at `path` (e.g. [`MUTATE_PATH`]).
    pub fn join(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// The URL's host (without brackets for IPv6), the serving certificate's name.
    pub fn host(&self) -> &str {
        &self.host
    }
}

impl FromStr for WebhookUrl {
    type Err = ConfigError;

    /// Parses `https://HOST[:PORT][/PATH]`; no query or fragment.
    fn from_str(value: &str) -> Result<Self, Self::Err> {
        let bad = |reason: &str| ConfigError::BadUrl {
            value: value.to_owned(),
            reason: reason.to_owned(),
        };
        let uri: http::Uri = value.parse().map_err(|e| bad(&format!("{e}")))?;
        if uri.scheme_str() != Some("https") {
            return Err(bad("the scheme must be https"));
        }
        let host = uri
            .host()
            .filter(|h| !h.is_empty())
            .ok_or_else(|| bad("no host"))?;
        if uri.query().is_some() || value.contains('#') {
            return Err(bad("a query or fragment is not allowed"));
        }
        if value.contains('@') {
            return Err(bad("user information is not allowed"));
        }
        let host = host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        let base = value.trim_end_matches('/').to_owned();
        Ok(Self { base, host })
    }
}

/// How the API server reaches the webhook: `--webhook-service` or `--webhook-url`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WebhookEndpoint {
    /// Through a Service (in a cluster).
    Service(ServiceRef),
    /// At a URL (outside a cluster, e.g. the simulator).
    Url(WebhookUrl),
}

impl WebhookEndpoint {
    /// Names the serving certificate must cover: the Service's DNS names, or
    /// the URL's host (an IP address becomes an IP SAN).
    pub fn certificate_names(&self) -> Vec<String> {
        match self {
            WebhookEndpoint::Service(s) => vec![
                format!("{}.{}.svc", s.name, s.namespace),
                format!("{}.{}.svc.cluster.local", s.name, s.namespace),
            ],
            WebhookEndpoint::Url(u) => vec![u.host().to_owned()],
        }
    }
}

/// Everything [`super::start`] needs.
#[derive(Debug, Clone)]
pub struct WebhookConfig {
    /// Address the HTTPS server binds
    /// (`<--webhook-bind-address>:<--webhook-port>`; [`WebhookConfig::new`]
    /// sets `0.0.0.0:<port>`).
    pub listen: SocketAddr,
    /// The operator's own namespace: holds the certificate Secret and is
    /// excluded from the webhooks, as is `kube-system`.
    pub namespace: String,
    /// How the API server reaches the webhook.
    pub endpoint: WebhookEndpoint,
    /// Users who may remove the scheduling gate and write leases: the operator.
    pub gate_owners: Users,
    /// Users the device plugins run as: they may record a pod's GPUs in the
    /// status of leases on their own node, nothing else.
    pub device_plugin_users: Users,
    /// Name of the certificate Secret.
    pub secret_name: String,
    /// Name of the Mutating- and ValidatingWebhookConfiguration.
    pub configuration_name: String,
    /// How often the certificate Secret and the webhook configurations are
    /// checked again (renewal, another replica's renewal, edits by others).
    pub refresh_interval: Duration,
    /// How long to wait for the class, node and lease caches to fill before
    /// giving up at start.
    pub cache_sync_timeout: Duration,
    /// ClusterRole the configurations name as their owner, so the garbage
    /// collector deletes them with it (`--webhook-owner-cluster-role`).
    pub owner_cluster_role: Option<String>,
}

impl WebhookConfig {
    /// The configuration for the flags `--webhook-port`, `--namespace`,
    /// `--webhook-service`/`--webhook-url` and `--gate-owner`. With no gate
    /// owner given, the owner is the service account
    /// `system:serviceaccount:<namespace>:gpupool-operator`. Other fields take
    /// their defaults (Secret `gpupool-webhook-tls`, configurations `gpupool`,
    /// refresh every 10 minutes, caches given 60 seconds to sync).
    pub fn new(
        port: u16,
        namespace: impl Into<String>,
        endpoint: WebhookEndpoint,
        gate_owners: impl IntoIterator<Item = String>,
    ) -> Self {
        let namespace = namespace.into();
        let mut owners = Users::new(gate_owners);
        if owners.users().is_empty() {
            owners = Users::new([Users::service_account(&namespace, DEFAULT_SERVICE_ACCOUNT)]);
        }
        let device_plugin_users = Users::new([Users::service_account(
            &namespace,
            DEFAULT_DEVICE_PLUGIN_SERVICE_ACCOUNT,
        )]);
        Self {
            listen: SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), port),
            device_plugin_users,
            namespace,
            endpoint,
            gate_owners: owners,
            secret_name: SECRET_NAME.to_owned(),
            configuration_name: gpupool_api::names::WEBHOOK_CONFIGURATION.to_owned(),
            refresh_interval: Duration::from_secs(600),
            cache_sync_timeout: Duration::from_secs(60),
            owner_cluster_role: None,
        }
    }

    /// Replaces the device plugins' usernames (`--device-plugin-user`); an
    /// empty list keeps the default service account
    /// `system:serviceaccount:<namespace>:gpupool-device-plugin`.
    pub fn set_device_plugin_users(&mut self, users: impl IntoIterator<Item = String>) {
        let users = Users::new(users);
        if !users.users().is_empty() {
            self.device_plugin_users = users;
        }
    }

    /// Namespaces the webhooks never see: `kube-system` and the operator's own.
    pub fn excluded_namespaces(&self) -> Vec<String> {
        let mut out = vec!["kube-system".to_owned(), self.namespace.clone()];
        out.sort();
        out.dedup();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn service_refs() {
        let s: ServiceRef = "gpupool-system/gpupool-webhook".parse().expect("valid");
        assert_eq!(
            s,
            ServiceRef {
                namespace: "gpupool-system".into(),
                name: "gpupool-webhook".into(),
                port: 443
            }
        );
        let s: ServiceRef = "ns/svc:8443".parse().expect("valid");
        assert_eq!(s.port, 8443);
        for (value, needle) in [
            ("svc", "no '/'"),
            ("ns/svc:http", "port"),
            ("ns/svc:0", "port"),
            ("/svc", "namespace \"\""),
            ("ns/Svc", "name \"Svc\""),
        ] {
            let err = value.parse::<ServiceRef>().expect_err(value).to_string();
            assert!(err.starts_with("--webhook-service"), "{err}");
            assert!(err.contains(needle), "{value}: {err}");
        }
    }

    #[test]
    fn urls() {
        let u: WebhookUrl = "https://127.0.0.1:9443/".parse().expect("valid");
        assert_eq!(u.host(), "127.0.0.1");
        assert_eq!(u.join(MUTATE_PATH), "https://127.0.0.1:9443/mutate-pods");
        let u: WebhookUrl = "https://hooks.example.com/gpupool".parse().expect("valid");
        assert_eq!(
            u.join(VALIDATE_PATH),
            "https://hooks.example.com/gpupool/validate-pods"
        );
        let u: WebhookUrl = "https://[::1]:9443".parse().expect("valid");
        assert_eq!(u.host(), "::1");
        for (value, needle) in [
            ("http://127.0.0.1:9443", "https"),
            ("127.0.0.1:9443", "https"),
            ("https://h/x?a=b", "query"),
            ("https://user@h/", "user"),
            ("not a url", "--webhook-url"),
        ] {
            let err = value.parse::<WebhookUrl>().expect_err(value).to_string();
            assert!(err.starts_with("--webhook-url"), "{err}");
            assert!(err.contains(needle), "{value}: {err}");
        }
    }

    #[test]
    fn certificate_names() {
        let svc = WebhookEndpoint::Service("ns/hook".parse().expect("valid"));
        assert_eq!(
            svc.certificate_names(),
            ["hook.ns.svc", "hook.ns.svc.cluster.local"]
        );
        let url = WebhookEndpoint::Url("https://127.0.0.1:9443".parse().expect("valid"));
        assert_eq!(url.certificate_names(), ["127.0.0.1"]);
    }

    #[test]
    fn gate_owner_defaults_to_the_service_account() {
        let endpoint = WebhookEndpoint::Service("ns/hook".parse().expect("valid"));
        let c = WebhookConfig::new(9443, "gpupool-system", endpoint.clone(), []);
        assert_eq!(
            c.gate_owners.users(),
            ["system:serviceaccount:gpupool-system:gpupool-operator"]
        );
        assert_eq!(c.listen.port(), 9443);
        assert_eq!(c.excluded_namespaces(), ["gpupool-system", "kube-system"]);
        let c = WebhookConfig::new(9443, "kube-system", endpoint, ["sim-operator".to_owned()]);
        assert_eq!(c.gate_owners.users(), ["sim-operator"]);
        assert_eq!(c.excluded_namespaces(), ["kube-system"]);
    }
}
