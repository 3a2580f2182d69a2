//! The `gpupool-sim` subcommands, one module each, and what they share:
//! where logs go ([`logging`]) and how a detached cluster is found and
//! stopped ([`detach`]).

pub mod apiserver;
pub mod bench;
pub mod bench_node;
pub mod demo;
pub mod detach;
pub mod logging;
pub mod up;
