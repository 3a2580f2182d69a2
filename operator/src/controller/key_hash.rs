//! Hash maps keyed by object names, for the maps a pass probes once per
//! cached object (the overlay's writes, the mirrors' keys). SipHash, the
//! standard library's default, was the largest single cost of a pass at
//! 10,000 pods. foldhash is seeded at random per process, so a tenant who
//! picks pod names cannot aim collisions at a running operator without
//! first learning its seed, and a table that does degrade costs time, never
//! a wrong answer.

/// A `HashMap` hashed with foldhash.
pub type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

/// A `HashSet` hashed with foldhash.
pub type HashSet<T> = std::collections::HashSet<T, foldhash::fast::RandomState>;
