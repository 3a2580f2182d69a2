//! The operator's command line (DESIGN §8). Every flag is also read from an
//! environment variable, and every combination that cannot work is refused
//! with an error naming the flag, before anything starts.

use std::net::IpAddr;
use std::time::Duration;

use clap::Parser;

use crate::webhook::WebhookEndpoint;

/// Namespace used when neither `--namespace`, `POD_NAMESPACE` nor the
/// in-cluster service-account namespace file says otherwise.
pub const FALLBACK_NAMESPACE: &str = "gpupool-system";

/// Where the in-cluster service account's namespace is mounted.
const IN_CLUSTER_NAMESPACE_FILE: &str = "/var/run/secrets/kubernetes.io/serviceaccount/namespace";

/// `gpupool-operator`: admits pods to GPU slots in FIFO order, lets helpers
/// use idle GPUs, preempts them for primaries, and serves the pod webhook.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "gpupool-operator",
    version,
    about,
    after_help = "One of --webhook-service NAMESPACE/NAME (in a cluster) or --webhook-url URL (outside one) is required.\nKubernetes access: in-cluster config, else KUBECONFIG. Logs: RUST_LOG (default info), coloured only on a terminal without NO_COLOR."
)]
pub struct Args {
    /// HTTPS port of the pod admission webhook.
    #[arg(long, env = "GPUPOOL_WEBHOOK_PORT", default_value_t = 9443)]
    pub webhook_port: u16,

    /// HTTP port serving /metrics, /healthz and /readyz.
    #[arg(long, env = "GPUPOOL_METRICS_PORT", default_value_t = 8080)]
    pub metrics_port: u16,

    /// IP address the webhook's HTTPS server listens on (0.0.0.0: every
    /// interface, as a Service needs in a cluster; 127.0.0.1 outside one).
    #[arg(long, env = "GPUPOOL_WEBHOOK_BIND_ADDRESS", default_value = "0.0.0.0")]
    pub webhook_bind_address: IpAddr,

    /// IP address the metrics and health server listens on.
    #[arg(long, env = "GPUPOOL_METRICS_BIND_ADDRESS", default_value = "0.0.0.0")]
    pub metrics_bind_address: IpAddr,

    /// Elect one leader among replicas (a coordination.k8s.io/v1 Lease); only
    /// the leader admits pods and writes. `--leader-elect=false` runs alone.
    #[arg(
        long,
        env = "GPUPOOL_LEADER_ELECT",
        default_value_t = true,
        action = clap::ArgAction::Set,
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true"
    )]
    pub leader_elect: bool,

    /// The operator's own namespace (leader-election Lease, webhook Secret).
    /// Defaults to POD_NAMESPACE, then the in-cluster namespace file, then gpupool-system.
    #[arg(long, env = "GPUPOOL_NAMESPACE")]
    pub namespace: Option<String>,

    /// Service (`NAMESPACE/NAME[:PORT]`) the API server calls the webhook through, in a cluster.
    #[arg(long, env = "GPUPOOL_WEBHOOK_SERVICE", conflicts_with = "webhook_url")]
    pub webhook_service: Option<String>,

    /// URL the API server calls the webhook at, outside a cluster (`https://HOST[:PORT][/PATH]`).
    #[arg(long, env = "GPUPOOL_WEBHOOK_URL")]
    pub webhook_url: Option<String>,

    /// Users allowed to remove the scheduling gate (repeatable or comma-separated).
    /// Default: the service account `system:serviceaccount:<namespace>:gpupool-operator`.
    #[arg(long, env = "GPUPOOL_GATE_OWNERS", value_delimiter = ',')]
    pub gate_owner: Vec<String>,

    /// Users the device plugins run as (repeatable or comma-separated): they
    /// may only record which GPUs a pod got (`status.gpus`, `gpuIndexes`
    /// and `boundAt`) on leases of their own node. Default: the service account
    /// `system:serviceaccount:<namespace>:gpupool-device-plugin`.
    #[arg(long, env = "GPUPOOL_DEVICE_PLUGIN_USERS", value_delimiter = ',')]
    pub device_plugin_user: Vec<String>,

    /// Seconds between decision passes when nothing changes (a safety net;
    /// changes trigger passes at once).
    #[arg(long, env = "GPUPOOL_RESYNC_SECONDS", default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub resync_seconds: u64,

    /// Budget for lease position and message updates (writes per second):
    /// when the queue moves, every waiting lease's position changes, and
    /// these writes are spent front of the queue first, after admissions and
    /// evictions, never before them.
    #[arg(long, env = "GPUPOOL_STATUS_WRITES_PER_SECOND", default_value_t = 200, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub status_writes_per_second: u32,

    /// Worker threads of the operator's runtime (watches, writes, the
    /// decision loop; the webhook serves on threads of its own). Each
    /// thread that allocates gets a malloc arena of its own, so threads
    /// beyond what the one decision loop can use cost memory, not speed.
    #[arg(long, env = "GPUPOOL_WORKER_THREADS", default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..=256))]
    pub worker_threads: u16,

    /// Most API requests the decision loop's writers (admissions, lease
    /// status, queue progress, Events) have in flight at once; more wait
    /// their turn in order. Each request in flight holds a connection of
    /// its own with its buffers, so this bounds the connections, and the
    /// memory, a burst of writes costs. Watches and leader election use
    /// connections of their own and never wait behind writes.
    #[arg(long, env = "GPUPOOL_API_REQUESTS_IN_FLIGHT", default_value_t = 32, value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub api_requests_in_flight: u16,

    /// Identity of this replica in leader election (defaults to POD_NAME, else
    /// the host name and process id).
    #[arg(long, env = "GPUPOOL_IDENTITY")]
    pub identity: Option<String>,

    /// ClusterRole that owns the webhook configurations (ownerReference), so
    /// they are garbage-collected with it, e.g. on `helm uninstall`. Unset:
    /// the configurations outlive the operator and must be deleted by hand.
    #[arg(long, env = "GPUPOOL_WEBHOOK_OWNER_CLUSTER_ROLE")]
    pub webhook_owner_cluster_role: Option<String>,
}

/// Flags that parse but do not make sense together or in themselves.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// Neither way of reaching the webhook was given.
    #[error(
        "one of --webhook-service NAMESPACE/NAME (in a cluster) or --webhook-url URL (outside one) is required"
    )]
    NoWebhookEndpoint,
    /// `--webhook-service` or `--webhook-url` does not parse (the message names the flag).
    #[error(transparent)]
    Webhook(#[from] crate::webhook::ConfigError),
    /// `--namespace` is empty or not a DNS label.
    #[error("--namespace must be a DNS label (lowercase letters, digits, '-'), got {0:?}")]
    BadNamespace(String),
    /// Both listeners were asked for the same port.
    #[error("--metrics-port and --webhook-port must differ (both are {0})")]
    SamePort(u16),
    /// The owner ClusterRole's name is not a valid object name.
    #[error(
        "--webhook-owner-cluster-role {0:?} is not a valid ClusterRole name (lowercase letters, digits, '-', '.' and ':', at most 253 characters)"
    )]
    BadOwnerClusterRole(String),
}

/// The validated configuration the operator runs with.
#[derive(Debug, Clone)]
pub struct Config {
    /// Webhook HTTPS port.
    pub webhook_port: u16,
    /// Metrics/health HTTP port.
    pub metrics_port: u16,
    /// Address the webhook listens on.
    pub webhook_bind_address: IpAddr,
    /// Address the metrics server listens on.
    pub metrics_bind_address: IpAddr,
    /// Whether to run leader election.
    pub leader_elect: bool,
    /// The operator's namespace.
    pub namespace: String,
    /// How the API server reaches the webhook.
    pub webhook_endpoint: WebhookEndpoint,
    /// Users allowed to remove the gate (empty: the operator's service account).
    pub gate_owners: Vec<String>,
    /// Users the device plugins run as (empty: the chart's service account).
    pub device_plugin_users: Vec<String>,
    /// Period of the safety-net pass.
    pub resync: Duration,
    /// Budget of the progress writer.
    pub status_writes_per_second: u32,
    /// Worker threads of the operator's runtime.
    pub worker_threads: usize,
    /// Most requests the decision loop's writers have in flight at once.
    pub api_requests_in_flight: usize,
    /// Leader-election identity.
    pub identity: String,
    /// ClusterRole owning the webhook configurations, if any.
    pub webhook_owner_cluster_role: Option<String>,
}

impl Args {
    /// Checks the flags and fills in defaults from the environment.
    pub fn validate(self) -> Result<Config, ConfigError> {
        let webhook_endpoint = match (self.webhook_service, self.webhook_url) {
            (Some(svc), None) => WebhookEndpoint::Service(svc.parse()?),
            (None, Some(url)) => WebhookEndpoint::Url(url.parse()?),
            // clap refuses both at once; keep the check total anyway.
            (Some(_), Some(_)) | (None, None) => return Err(ConfigError::NoWebhookEndpoint),
        };
        let namespace = match self.namespace {
            Some(ns) => ns,
            None => default_namespace(),
        };
        if !is_dns_label(&namespace) {
            return Err(ConfigError::BadNamespace(namespace));
        }
        if self.webhook_port == self.metrics_port {
            return Err(ConfigError::SamePort(self.webhook_port));
        }
        let identity = self.identity.unwrap_or_else(default_identity);
        if let Some(name) = &self.webhook_owner_cluster_role
            && !is_cluster_role_name(name)
        {
            return Err(ConfigError::BadOwnerClusterRole(name.clone()));
        }
        Ok(Config {
            webhook_port: self.webhook_port,
            metrics_port: self.metrics_port,
            webhook_bind_address: self.webhook_bind_address,
            metrics_bind_address: self.metrics_bind_address,
            leader_elect: self.leader_elect,
            namespace,
            webhook_endpoint,
            gate_owners: non_empty(self.gate_owner),
            device_plugin_users: non_empty(self.device_plugin_user),
            resync: Duration::from_secs(self.resync_seconds),
            status_writes_per_second: self.status_writes_per_second,
            worker_threads: usize::from(self.worker_threads),
            api_requests_in_flight: usize::from(self.api_requests_in_flight),
            identity,
            webhook_owner_cluster_role: self.webhook_owner_cluster_role,
        })
    }
}

/// Trimmed usernames, empty ones dropped.
fn non_empty(users: Vec<String>) -> Vec<String> {
    users
        .into_iter()
        .map(|u| u.trim().to_owned())
        .filter(|u| !u.is_empty())
        .collect()
}

/// RBAC object names are path segments: non-empty, at most 253 characters,
/// and free of '/' and '%'; the chart's names are lowercase DNS subdomains,
/// optionally with ':' as in the built-in roles.
fn is_cluster_role_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name.bytes().all(|b| {
            b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'-' | b'.' | b':')
        })
}

fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

fn default_namespace() -> String {
    if let Ok(ns) = std::env::var("POD_NAMESPACE")
        && !ns.trim().is_empty()
    {
        return ns.trim().to_owned();
    }
    match std::fs::read_to_string(IN_CLUSTER_NAMESPACE_FILE) {
        Ok(ns) if !ns.trim().is_empty() => ns.trim().to_owned(),
        _ => FALLBACK_NAMESPACE.to_owned(),
    }
}

fn default_identity() -> String {
    if let Ok(name) = std::env::var("POD_NAME")
        && !name.is_empty()
    {
        return name;
    }
    let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "gpupool-operator".to_owned());
    format!("{host}-{}", std::process::id())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Config, String> {
        let mut full = vec!["gpupool-operator"];
        full.extend_from_slice(args);
        let args = Args::try_parse_from(full).map_err(|e| e.to_string())?;
        args.validate().map_err(|e| e.to_string())
    }

    #[test]
    fn defaults_follow_the_design() {
        let cfg = parse(&[
            "--webhook-url",
            "https://127.0.0.1:9443",
            "--namespace",
            "gp",
        ])
        .expect("valid");
        assert_eq!(cfg.webhook_port, 9443);
        assert_eq!(cfg.metrics_port, 8080);
        assert!(cfg.leader_elect);
        assert_eq!(cfg.namespace, "gp");
        assert_eq!(
            cfg.webhook_endpoint,
            WebhookEndpoint::Url("https://127.0.0.1:9443".parse().expect("url"))
        );
        assert!(cfg.gate_owners.is_empty());
        assert_eq!(cfg.api_requests_in_flight, 32);
    }

    #[test]
    fn api_requests_in_flight_takes_any_value_in_its_range() {
        for n in [1, 7, 1024] {
            let value = n.to_string();
            let args = [
                "--webhook-url",
                "https://a",
                "--api-requests-in-flight",
                &value,
            ];
            assert_eq!(parse(&args).expect("valid").api_requests_in_flight, n);
        }
    }

    #[test]
    fn leader_elect_false_with_equals() {
        let cfg = parse(&[
            "--webhook-service",
            "ns/svc",
            "--leader-elect=false",
            "--gate-owner",
            "a,b",
        ])
        .expect("valid");
        assert!(!cfg.leader_elect);
        assert_eq!(
            cfg.webhook_endpoint,
            WebhookEndpoint::Service("ns/svc".parse().expect("svc"))
        );
        assert_eq!(cfg.gate_owners, vec!["a".to_owned(), "b".to_owned()]);
    }

    #[test]
    fn webhook_owner_is_optional_and_passed_through() {
        let none = parse(&["--webhook-url", "https://a"]).expect("valid");
        assert_eq!(none.webhook_owner_cluster_role, None);
        let some = parse(&[
            "--webhook-url",
            "https://a",
            "--webhook-owner-cluster-role",
            "gpupool-operator",
        ])
        .expect("valid");
        assert_eq!(
            some.webhook_owner_cluster_role.as_deref(),
            Some("gpupool-operator")
        );
    }

    #[test]
    fn errors_name_the_flag() {
        let cases: &[(&[&str], &str)] = &[
            (&[], "--webhook-service"),
            (&["--webhook-service", "svc"], "--webhook-service"),
            (&["--webhook-url", "http://x"], "--webhook-url"),
            (&["--webhook-url", "https://"], "--webhook-url"),
            (
                &["--webhook-url", "https://a", "--webhook-service", "a/b"],
                "--webhook-service",
            ),
            (
                &["--webhook-url", "https://a", "--namespace", "Bad_NS"],
                "--namespace",
            ),
            (
                &["--webhook-url", "https://a", "--metrics-port", "9443"],
                "--metrics-port",
            ),
            (
                &["--webhook-url", "https://a", "--leader-elect=maybe"],
                "--leader-elect",
            ),
            (
                &["--webhook-url", "https://a", "--resync-seconds", "0"],
                "--resync-seconds",
            ),
            (
                &[
                    "--webhook-url",
                    "https://a",
                    "--api-requests-in-flight",
                    "0",
                ],
                "--api-requests-in-flight",
            ),
            (
                &[
                    "--webhook-url",
                    "https://a",
                    "--api-requests-in-flight",
                    "1025",
                ],
                "--api-requests-in-flight",
            ),
            (
                &[
                    "--webhook-url",
                    "https://a",
                    "--webhook-owner-cluster-role",
                    "",
                ],
                "--webhook-owner-cluster-role",
            ),
            (
                &[
                    "--webhook-url",
                    "https://a",
                    "--webhook-owner-cluster-role",
                    "a/b",
                ],
                "--webhook-owner-cluster-role",
            ),
        ];
        for (args, flag) in cases {
            let err = parse(args).expect_err("invalid flags");
            assert!(err.contains(flag), "{args:?}: {err}");
        }
    }
}
