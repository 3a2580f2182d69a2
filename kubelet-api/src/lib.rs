//! The kubelet's gRPC protocols as gpupool speaks them, in one place so that
//! the device plugin and the simulated kubelet share one wire contract:
//!
//! - [`proto`]: types, clients and servers generated from the kubelet's
//!   device-plugin v1beta1 and PodResources v1 protos;
//! - [`transport`]: gRPC over unix sockets, with servers that accept any
//!   HTTP/2 `:authority` a kubelet sends.

pub mod proto;
pub mod transport;
