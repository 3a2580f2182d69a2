//! The smaps reader the memory measurements share, tested on its own.

#![allow(clippy::unwrap_used)]

#[path = "common/smaps.rs"]
mod smaps;

use smaps::{mappings, parse, rss_by_name};

const SAMPLE: &str = "\
55d0a0000000-55d0a0100000 r-xp 00000000 08:01 42 /usr/bin/plugin
Size:               1024 kB
Rss:                 700 kB
Anonymous:             0 kB
7f0000000000-7f0000d56000 rw-p 00000000 00:00 0
Size:              13656 kB
Rss:               13524 kB
Anonymous:         13524 kB
7f0000e00000-7f0000e21000 rw-p 00000000 00:00 0 [heap]
Size:                132 kB
Rss:                  60 kB
Anonymous:            60 kB
7f0000f00000-7f0000f01000 rw-p 00000000 00:00 0
Size:                  4 kB
Rss:                   4 kB
Anonymous:             4 kB
";

#[test]
fn reads_each_mapping_with_its_name_and_sizes() {
    let m = parse(SAMPLE);
    assert_eq!(m.len(), 4);
    assert_eq!(m[0].name, "/usr/bin/plugin");
    assert_eq!((m[0].size_kib, m[0].rss_kib, m[0].anon_kib), (1024, 700, 0));
    assert_eq!(m[1].start, "7f0000000000");
    assert_eq!(m[1].name, "[anonymous]");
    assert_eq!(m[2].name, "[heap]");
}

#[test]
fn sums_by_name_largest_first() {
    let by_name = rss_by_name(&parse(SAMPLE));
    assert_eq!(
        by_name,
        vec![
            ("[anonymous]".to_owned(), 13528, 13528),
            ("/usr/bin/plugin".to_owned(), 700, 0),
            ("[heap]".to_owned(), 60, 60),
        ]
    );
}

#[test]
fn an_unreadable_process_has_no_mappings() {
    assert!(mappings("no-such-pid").is_empty());
}
