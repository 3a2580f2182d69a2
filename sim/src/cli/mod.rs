//! The `gpupool-sim` subcommands, one module each.

pub mod apiserver;
pub mod bench;
pub mod demo;
pub mod up;
