//! Real nodes beside the real control plane: each a Debian `containerd`
//! and a real `kubelet` (v1.36.2, from the same assets directory as the
//! control plane), on this machine, with CNI bridge networking.
//!
//! Needs root, `containerd`, `runc`, `ctr`, `ip`, `iptables` and the CNI
//! plugins in `/usr/lib/cni` (`.ci/install-k8s.sh` installs them), and images
//! as docker-archive tarballs (`.ci/build-images.sh` builds them): no
//! registry is reached.
//!
//! What it promises:
//! - All traffic stays on this machine: node and API-server addresses live
//!   on a bridge with no ports, pods on a bridge of their own, and anything
//!   a pod sends past its own subnet and this host is dropped.
//! - Pods reach the API server at the `kubernetes` Service's cluster IP (a
//!   single DNAT rule stands in for kube-proxy), and the API server reaches
//!   webhooks at their Service's endpoints (`--enable-aggregator-routing`).
//! - Teardown ([`RealCluster::shutdown`]) deletes the nodes' pods first,
//!   then stops what it started by pid, and removes what it added to the
//!   host: links, iptables chains, mounts, cgroups and state directories.
//!   Names carry a per-run number, so concurrent runs never share one.

mod cluster;
mod host;
mod network;
mod node;

pub use cluster::{DEFAULT_NODE_PREFIX, RealCluster, RealClusterConfig, image_archives};
pub use network::HostNetwork;
pub use node::RealNode;

use std::path::PathBuf;

use crate::cluster::processes::ProcessError;
use crate::control_plane::ControlPlaneError;

/// The kubelet binary an assets directory holds for real nodes.
pub const KUBELET: &str = "kubelet";

/// The containerd namespace the kubelet's CRI uses.
pub const CONTAINERD_NAMESPACE: &str = "k8s.io";

/// The pod sandbox image `.ci/build-images.sh` builds; every node's
/// containerd is pointed at it, as no registry serves `pause`.
pub const PAUSE_IMAGE: &str = "localhost/gpupool-pause:bookworm";

/// The image `.ci/build-images.sh` builds for test pods: a Debian root
/// with a shell (`sh`, `sleep`, `env`).
pub const WORKLOAD_IMAGE: &str = "localhost/gpupool-workload:bookworm";

/// Why a real node could not be started, used or torn down. Each variant
/// names the step that failed.
#[derive(Debug, thiserror::Error)]
pub enum RealNodeError {
    /// A host tool real nodes need is not installed.
    #[error("real nodes need {tool} ({hint}); `.ci/install-k8s.sh` installs it on Debian")]
    MissingTool {
        /// The tool.
        tool: String,
        /// Where it is looked for or which package has it.
        hint: String,
    },
    /// Real nodes change host networking, cgroups and mounts.
    #[error("real nodes need root (they add links, iptables rules, mounts and cgroups)")]
    NotRoot,
    /// A host command failed.
    #[error("{step}: `{command}` failed ({status}): {stderr}")]
    Command {
        /// What it was for.
        step: String,
        /// The command line.
        command: String,
        /// Its exit status.
        status: String,
        /// What it printed on stderr.
        stderr: String,
    },
    /// A file could not be read or written.
    #[error("{step}: {path}: {source}")]
    Io {
        /// What it was for.
        step: String,
        /// The file.
        path: PathBuf,
        /// OS error.
        #[source]
        source: std::io::Error,
    },
    /// No free per-run address block was left.
    #[error("every 198.18.K.0/24 block is taken on this host; tear down earlier runs")]
    NoFreeSubnet,
    /// The control plane could not start or be used.
    #[error(transparent)]
    ControlPlane(#[from] ControlPlaneError),
    /// containerd or a kubelet could not be started or stopped.
    #[error(transparent)]
    Process(#[from] ProcessError),
    /// An API request failed.
    #[error("{step}: {source}")]
    Api {
        /// What it was for.
        step: String,
        /// The client's error.
        #[source]
        source: kube::Error,
    },
    /// A node did not become Ready; the message names it and its log.
    #[error("{0}")]
    NotReady(String),
}

impl RealNodeError {
    fn io(step: &str, path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Self {
        let (step, path) = (step.to_owned(), path.into());
        move |source| RealNodeError::Io { step, path, source }
    }

    fn api(step: &str) -> impl FnOnce(kube::Error) -> Self + '_ {
        move |source| RealNodeError::Api {
            step: step.to_owned(),
            source,
        }
    }
}
