//! gpupool's simulated cluster: an in-memory Kubernetes API server, a
//! scheduler and per-node kubelets speaking the real protocols, which run the
//! real `gpupool-operator` and `gpupool-device-plugin` binaries for the demo
//! and the end-to-end, fault and benchmark suites (DESIGN §7).

pub mod apiserver;
pub mod cli;
pub mod cluster;
