//! The pod admission webhook (DESIGN §5.1).
