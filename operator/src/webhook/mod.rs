//! The pod admission webhook (DESIGN §5.1).

pub mod certs;
pub mod review;
