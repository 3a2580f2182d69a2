//! gpupool's operator: admits pods to GPU slots in FIFO order, lets helpers
//! use idle GPUs and preempts them for primaries, and publishes lease snapshots.

pub mod app;
pub mod config;
pub mod controller;
/// The pure admission engine, its own crate so it cannot reach a client or a clock.
pub use gpupool_engine as engine;
pub mod index;
pub mod leader;
pub mod metrics;
pub mod webhook;
