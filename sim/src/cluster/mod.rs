//! The simulated cluster (DESIGN §7) around the in-memory API server: a
//! scheduler, one kubelet per node speaking the kubelet's real gRPC
//! protocols, and supervision of the real `gpupool-device-plugin` and
//! `gpupool-operator` binaries. [`SimCluster`] puts them together.

pub mod admin;
pub mod kubelet;
pub mod processes;
pub mod proxy;
pub mod scheduler;
pub mod sim;
pub mod workload;

pub use sim::{BACKEND_ENV, Backend, ClusterConfig, ClusterError, OperatorMode, SimCluster};
