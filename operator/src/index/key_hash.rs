//! The maps the operator keys by object: the records of its own writes, the
//! sources of the engine's entries and the watches' change logs.
//!
//! foldhash is seeded at random per process, so a tenant who picks pod
//! names cannot aim collisions at a running operator without first learning
//! its seed, and a collision costs one more key comparison, never a wrong
//! answer.

/// A `HashMap` hashed with foldhash.
pub type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

/// A `HashSet` hashed with foldhash.
pub type HashSet<T> = std::collections::HashSet<T, foldhash::fast::RandomState>;
