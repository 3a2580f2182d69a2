//! gpupool's kubelet device plugin: advertises every GPU of a node as
//! `--sessions-per-gpu` slots of an extended resource over the kubelet's
//! device-plugin v1beta1 gRPC protocol, and reports which pod holds which GPU.
//!
//! The kubelet protocol types ([`proto`]) and the unix-socket gRPC helpers
//! ([`transport`]) live in `gpupool-kubelet-api`, shared with the simulated
//! kubelet; they are re-exported here under their old paths.

pub mod app;
pub mod cdi;
pub mod cli;
pub mod discovery;
pub mod lease_watch;
pub mod metrics;
pub mod registration;
pub mod reporter;
pub mod server;
pub mod slots;

pub use gpupool_kubelet_api::{proto, transport};
