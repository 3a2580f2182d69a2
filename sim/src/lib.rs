//! gpupool's simulated cluster (DESIGN §7): a scheduler and per-node kubelets
//! speaking the kubelet's real gRPC protocols around an API server, running
//! the real `gpupool-operator` and `gpupool-device-plugin` binaries; and the
//! `gpupool-sim` command (`apiserver`, `up`, `demo`, `bench`) built on it.
//!
//! The in-memory API server is its own crate, `gpupool-sim-apiserver`,
//! re-exported here as [`apiserver`] so that users of the simulator need one
//! dependency.

pub use gpupool_sim_apiserver as apiserver;

pub mod cli;
pub mod cluster;
pub mod control_plane;
pub mod real_node;
pub mod text;
