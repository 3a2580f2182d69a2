//! Command-line flags (DESIGN §8), each also readable from an environment
//! variable, and their validation into [`Settings`].

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;

use clap::{Parser, ValueEnum};
use gpupool_api::names::DEFAULT_RESOURCE_NAME;

use crate::cdi::{CdiKind, DEFAULT_CDI_KIND, DeviceListStrategies};
use crate::discovery::DeviceFilter;
use crate::server::DeviceListing;
use crate::slots::MAX_SESSIONS_PER_GPU;

/// Which discovery backend to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DiscoveryKind {
    /// NVML if the NVIDIA library loads, else no GPUs.
    Auto,
    /// NVML; exit 1 if the NVIDIA library cannot be loaded.
    Nvml,
    /// GPUs from --static-gpus or --static-config.
    Static,
}

/// gpupool's kubelet device plugin: advertises every GPU as slots of an
/// extended resource and reports which pod holds which GPU.
#[derive(Debug, Parser)]
#[command(
    name = "gpupool-device-plugin",
    version,
    about,
    after_help = "Kubernetes access (GpuLease reports, the gpupool.io/gpus Node annotation): KUBECONFIG, else in-cluster config; without either the plugin still serves the kubelet.\nLogs: RUST_LOG (default info), coloured only on a terminal without NO_COLOR."
)]
pub struct Args {
    /// The kubelet's directory; sockets live in its device-plugins/ and pod-resources/.
    #[arg(long, env = "GPUPOOL_KUBELET_DIR", default_value = "/var/lib/kubelet")]
    pub kubelet_dir: PathBuf,

    /// Extended resource to advertise.
    #[arg(long, env = "GPUPOOL_RESOURCE_NAME", default_value = DEFAULT_RESOURCE_NAME)]
    pub resource_name: String,

    /// How GPUs are found: auto (NVML if the NVIDIA library loads, else no
    /// GPUs), nvml (exit 1 if the library cannot be loaded), static (GPUs
    /// from --static-gpus or --static-config).
    #[arg(
        long,
        env = "GPUPOOL_DISCOVERY",
        value_enum,
        default_value_t = DiscoveryKind::Auto,
        hide_possible_values = true
    )]
    pub discovery: DiscoveryKind,

    /// With --discovery static: this many simulated GPUs, indices 0..N.
    #[arg(long, env = "GPUPOOL_STATIC_GPUS", conflicts_with = "static_config")]
    pub static_gpus: Option<u32>,

    /// With --discovery static: YAML list of {index, uuid, product, vendor,
    /// memoryMiB, healthy, numaNode}; re-read when it changes.
    #[arg(long, env = "GPUPOOL_STATIC_CONFIG")]
    pub static_config: Option<PathBuf>,

    /// Advertise only these GPUs: comma-separated indices or UUIDs. Naming a
    /// GPU the node does not have at startup is a configuration error.
    #[arg(long, env = "GPUPOOL_DEVICES")]
    pub devices: Option<String>,

    /// Slots (concurrent sessions) per GPU.
    #[arg(
        long,
        env = "GPUPOOL_SESSIONS_PER_GPU",
        default_value_t = 1,
        value_parser = clap::value_parser!(u32).range(1..=i64::from(MAX_SESSIONS_PER_GPU))
    )]
    pub sessions_per_gpu: u32,

    /// This node's name, for the gpupool.io/gpus Node annotation.
    #[arg(long, env = "NODE_NAME")]
    pub node_name: Option<String>,

    /// Port of /metrics and /healthz.
    #[arg(long, env = "GPUPOOL_METRICS_PORT", default_value_t = 8081)]
    pub metrics_port: u16,

    /// Address the metrics port listens on.
    #[arg(long, env = "GPUPOOL_METRICS_ADDRESS", default_value = "0.0.0.0")]
    pub metrics_address: IpAddr,

    /// Where the host's /dev is visible to the plugin; device nodes found
    /// here are handed to containers as /dev/<name>.
    #[arg(long, env = "GPUPOOL_DEV_DIR", default_value = "/dev")]
    pub dev_dir: PathBuf,

    /// How Allocate names the GPUs to the container runtime: envvar
    /// (NVIDIA_VISIBLE_DEVICES and device nodes), cdi-annotations (CDI
    /// names in a cdi.k8s.io/ container annotation), cdi-cri (CDI names in
    /// the CRI's CDI device field); several may be given, comma-separated.
    #[arg(long, env = "GPUPOOL_DEVICE_LIST_STRATEGY", default_value = "envvar")]
    pub device_list_strategy: String,

    /// CDI kind (<vendor>/<class>) of the GPUs' CDI names, <kind>=<UUID>;
    /// the default is what `nvidia-ctk cdi generate` writes.
    #[arg(long, env = "GPUPOOL_CDI_KIND", default_value = DEFAULT_CDI_KIND)]
    pub cdi_kind: String,
}

/// Where the GPUs come from, once the flags are checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DiscoverySource {
    /// `--discovery auto`.
    Auto,
    /// `--discovery nvml`.
    Nvml,
    /// `--discovery static --static-gpus N`.
    StaticCount(u32),
    /// `--discovery static --static-config FILE`.
    StaticFile(PathBuf),
}

impl std::fmt::Display for DiscoverySource {
    /// The flags that chose this source, as a user would type them.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DiscoverySource::Auto => f.write_str("--discovery auto"),
            DiscoverySource::Nvml => f.write_str("--discovery nvml"),
            DiscoverySource::StaticCount(n) => write!(f, "--discovery static --static-gpus {n}"),
            DiscoverySource::StaticFile(path) => {
                write!(f, "--discovery static --static-config {}", path.display())
            }
        }
    }
}

/// Validated settings.
#[derive(Debug, Clone)]
pub struct Settings {
    /// `--kubelet-dir`.
    pub kubelet_dir: PathBuf,
    /// `--resource-name`.
    pub resource_name: String,
    /// `--discovery` with its static source.
    pub discovery: DiscoverySource,
    /// `--devices`.
    pub filter: DeviceFilter,
    /// `--sessions-per-gpu`.
    pub sessions_per_gpu: u32,
    /// `--node-name`.
    pub node_name: Option<String>,
    /// `--metrics-address` and `--metrics-port`.
    pub metrics_addr: SocketAddr,
    /// `--dev-dir`.
    pub dev_dir: PathBuf,
    /// `--device-list-strategy` and `--cdi-kind`.
    pub listing: DeviceListing,
}

/// A flag combination or value that cannot work; the message names the flag.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{0}")]
pub struct ConfigError(pub String);

/// Checks an extended resource name: `<domain>/<name>`, the kubelet's rule.
fn validate_resource_name(name: &str) -> Result<(), ConfigError> {
    let bad = |why: &str| {
        Err(ConfigError(format!(
            "--resource-name {name:?}: {why}; expected <domain>/<name> like gpupool/slot"
        )))
    };
    let Some((domain, resource)) = name.split_once('/') else {
        return bad("no '/'");
    };
    let label_ok = |s: &str, extra: &[char]| {
        !s.is_empty()
            && s.len() <= 63
            && s.chars().all(|c| {
                c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || extra.contains(&c)
            })
            && !s.starts_with('-')
            && !s.ends_with('-')
    };
    if !label_ok(domain, &['.']) || domain.len() > 253 {
        return bad("invalid domain");
    }
    if !label_ok(resource, &['.', '_']) {
        return bad("invalid name");
    }
    if domain == "kubernetes.io" || domain.ends_with(".kubernetes.io") {
        return bad("the kubernetes.io domain is reserved");
    }
    Ok(())
}

impl Args {
    /// Checks flag combinations and values.
    pub fn validate(self) -> Result<Settings, ConfigError> {
        validate_resource_name(&self.resource_name)?;
        let discovery = match (self.discovery, self.static_gpus, self.static_config) {
            (DiscoveryKind::Static, Some(n), None) => DiscoverySource::StaticCount(n),
            (DiscoveryKind::Static, None, Some(path)) => DiscoverySource::StaticFile(path),
            (DiscoveryKind::Static, None, None) => {
                return Err(ConfigError(
                    "--discovery static needs --static-gpus N or --static-config FILE".to_owned(),
                ));
            }
            (DiscoveryKind::Static, Some(_), Some(_)) => {
                return Err(ConfigError(
                    "--static-gpus and --static-config cannot be used together".to_owned(),
                ));
            }
            (kind, Some(_), _) => {
                return Err(ConfigError(format!(
                    "--static-gpus needs --discovery static (got --discovery {})",
                    kind_name(kind)
                )));
            }
            (kind, _, Some(_)) => {
                return Err(ConfigError(format!(
                    "--static-config needs --discovery static (got --discovery {})",
                    kind_name(kind)
                )));
            }
            (DiscoveryKind::Auto, None, None) => DiscoverySource::Auto,
            (DiscoveryKind::Nvml, None, None) => DiscoverySource::Nvml,
        };
        let filter = match &self.devices {
            Some(list) => DeviceFilter::parse(list).map_err(ConfigError)?,
            None => DeviceFilter::default(),
        };
        if let Some(node) = &self.node_name
            && node.trim().is_empty()
        {
            return Err(ConfigError("--node-name is empty".to_owned()));
        }
        let listing = DeviceListing {
            strategies: DeviceListStrategies::parse(&self.device_list_strategy)
                .map_err(ConfigError)?,
            cdi_kind: CdiKind::parse(&self.cdi_kind).map_err(ConfigError)?,
        };
        Ok(Settings {
            kubelet_dir: self.kubelet_dir,
            resource_name: self.resource_name,
            discovery,
            filter,
            sessions_per_gpu: self.sessions_per_gpu,
            node_name: self.node_name,
            metrics_addr: SocketAddr::new(self.metrics_address, self.metrics_port),
            dev_dir: self.dev_dir,
            listing,
        })
    }
}

fn kind_name(kind: DiscoveryKind) -> &'static str {
    match kind {
        DiscoveryKind::Auto => "auto",
        DiscoveryKind::Nvml => "nvml",
        DiscoveryKind::Static => "static",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Settings, ConfigError> {
        let mut argv = vec!["gpupool-device-plugin"];
        argv.extend_from_slice(args);
        Args::try_parse_from(argv).expect("clap accepts").validate()
    }

    #[test]
    fn defaults() {
        let s = parse(&[]).expect("valid");
        assert_eq!(s.kubelet_dir, PathBuf::from("/var/lib/kubelet"));
        assert_eq!(s.resource_name, "gpupool/slot");
        assert_eq!(s.discovery, DiscoverySource::Auto);
        assert_eq!(s.sessions_per_gpu, 1);
        assert_eq!(s.metrics_addr.port(), 8081);
        assert_eq!(s.listing, DeviceListing::default());
        assert_eq!(s.listing.cdi_kind.as_str(), "nvidia.com/gpu");
    }

    #[test]
    fn device_listing_flags() {
        let s = parse(&[
            "--device-list-strategy",
            "cdi-cri,envvar",
            "--cdi-kind",
            "example.com/accel",
        ])
        .expect("valid");
        assert!(s.listing.strategies.envvar && s.listing.strategies.cdi_cri);
        assert!(!s.listing.strategies.cdi_annotations);
        assert_eq!(s.listing.cdi_kind.as_str(), "example.com/accel");
    }

    #[test]
    fn static_sources() {
        let s = parse(&["--discovery", "static", "--static-gpus", "4"]).expect("valid");
        assert_eq!(s.discovery, DiscoverySource::StaticCount(4));
        let s = parse(&["--discovery=static", "--static-config=/x.yaml"]).expect("valid");
        assert_eq!(s.discovery, DiscoverySource::StaticFile("/x.yaml".into()));
    }

    #[test]
    fn bad_combinations_name_the_flag() {
        let cases: [(&[&str], &str); 9] = [
            (
                &["--discovery", "static"],
                "--static-gpus N or --static-config",
            ),
            (
                &["--static-gpus", "2"],
                "--static-gpus needs --discovery static",
            ),
            (
                &["--discovery", "nvml", "--static-config", "f"],
                "--static-config needs",
            ),
            (&["--resource-name", "slot"], "--resource-name"),
            (&["--resource-name", "kubernetes.io/gpu"], "reserved"),
            (&["--devices", "0,,1"], "--devices"),
            (
                &["--device-list-strategy", "volumes"],
                "--device-list-strategy",
            ),
            (&["--device-list-strategy", ""], "--device-list-strategy"),
            (&["--cdi-kind", "nvidia.com"], "--cdi-kind"),
        ];
        for (args, needle) in cases {
            let err = parse(args).expect_err(needle);
            assert!(err.0.contains(needle), "{args:?}: {err}");
        }
    }

    #[test]
    fn clap_rejects_out_of_range_sessions() {
        let err = Args::try_parse_from(["p", "--sessions-per-gpu", "0"]).expect_err("0");
        assert!(err.to_string().contains("--sessions-per-gpu"), "{err}");
        assert!(Args::try_parse_from(["p", "--sessions-per-gpu", "101"]).is_err());
    }
}
