//! A process's memory mappings as `/proc/<pid>/smaps` lists them, for the
//! measurements that say where resident memory goes (the allocate bench and
//! the `nvml_footprint` example).

#![allow(dead_code)]

/// One mapping: where it starts, what it maps and how much of it is resident.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mapping {
    /// Start address, as smaps writes it (hex, no prefix).
    pub start: String,
    /// A file's path, `[heap]`, `[stack]`, or `[anonymous]` for an unnamed one.
    pub name: String,
    /// Size of the mapping in KiB.
    pub size_kib: u64,
    /// Resident KiB.
    pub rss_kib: u64,
    /// Resident KiB that are anonymous (not backed by the file).
    pub anon_kib: u64,
}

/// The mappings of `/proc/<pid>/smaps` (`pid` may be `self`) in address
/// order; none when the file cannot be read.
pub fn mappings(pid: &str) -> Vec<Mapping> {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap_or_default();
    parse(&smaps)
}

/// The mappings of an smaps listing, in its order.
pub fn parse(smaps: &str) -> Vec<Mapping> {
    let kib = |line: &str| -> u64 {
        line.split_whitespace()
            .nth(1)
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    let mut out: Vec<Mapping> = Vec::new();
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if first.contains('-') && !first.ends_with(':') {
            // A mapping header: address perms offset dev inode [name].
            out.push(Mapping {
                start: first.split('-').next().unwrap_or(first).to_owned(),
                name: line
                    .split_whitespace()
                    .nth(5)
                    .unwrap_or("[anonymous]")
                    .to_owned(),
                size_kib: 0,
                rss_kib: 0,
                anon_kib: 0,
            });
        } else if let Some(mapping) = out.last_mut() {
            match first {
                "Size:" => mapping.size_kib = kib(line),
                "Rss:" => mapping.rss_kib = kib(line),
                "Anonymous:" => mapping.anon_kib = kib(line),
                _ => {}
            }
        }
    }
    out
}

/// Resident KiB (total, anonymous) summed by mapping name, largest first.
pub fn rss_by_name(mappings: &[Mapping]) -> Vec<(String, u64, u64)> {
    let mut totals: std::collections::BTreeMap<&str, (u64, u64)> = Default::default();
    for m in mappings {
        let entry = totals.entry(&m.name).or_default();
        entry.0 += m.rss_kib;
        entry.1 += m.anon_kib;
    }
    let mut list: Vec<(String, u64, u64)> = totals
        .into_iter()
        .map(|(name, (rss, anon))| (name.to_owned(), rss, anon))
        .collect();
    list.sort_by_key(|entry| std::cmp::Reverse(entry.1));
    list
}
