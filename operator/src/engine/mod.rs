//! The admission engine: pure, deterministic FIFO/helper decisions (DESIGN §5).
//!
//! It reads a [`Snapshot`] and returns a [`Plan`]; it performs no I/O, holds
//! no state between passes and never reads a clock, so the same snapshot
//! always yields the same plan.

pub mod model;

pub use model::*;
