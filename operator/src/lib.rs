//! gpupool's operator: admits pods to GPU slots in FIFO order, lets helpers
//! use idle GPUs and preempts them for primaries, and publishes lease snapshots.

pub mod controller;
pub mod engine;
pub mod webhook;
