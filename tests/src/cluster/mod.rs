//! The simulated cluster (DESIGN §7) around the in-memory API server: a
//! scheduler, one kubelet per node speaking the kubelet's real gRPC
//! protocols, and supervision of the real `gpupool-device-plugin` and
//! `gpupool-operator` binaries. [`SimCluster`] puts them together.

#[allow(clippy::module_inception)]
pub mod admin;
pub mod cluster;
pub mod kubelet;
pub mod processes;
pub mod scheduler;
pub mod workload;

pub use cluster::{ClusterConfig, ClusterError, OperatorMode, SimCluster};
