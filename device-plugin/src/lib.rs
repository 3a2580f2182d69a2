//! gpupool's kubelet device plugin: advertises every GPU of a node as
//! `--sessions-per-gpu` slots of an extended resource over the kubelet's
//! device-plugin v1beta1 gRPC protocol, and reports which pod holds which GPU.
//!
//! The generated kubelet protocol types ([`proto`]) and the unix-socket gRPC
//! helpers ([`transport`]) are public so that a simulated kubelet can speak
//! the same wire protocol.

pub mod app;
pub mod cdi;
pub mod cli;
pub mod discovery;
pub mod metrics;
pub mod proto;
pub mod registration;
pub mod reporter;
pub mod server;
pub mod slots;
pub mod transport;
