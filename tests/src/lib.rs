//! gpupool's end-to-end, fault and chart suites (in `tests/`), run against
//! the simulated cluster of `gpupool-sim`.
//!
//! The library only re-exports the simulator under the paths the operator's
//! suites still import (`gpupool_tests::cluster`, `gpupool_tests::apiserver`)
//! until they move here; new code depends on `gpupool-sim` directly.

pub use gpupool_sim::apiserver;
pub use gpupool_sim::cluster;
