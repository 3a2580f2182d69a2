//! Ports for the processes a simulated cluster or a test starts.
//!
//! A port is picked here, released, and bound by a child process a moment
//! later. In that gap anything else that asks the kernel for a port may be
//! handed the same one: another test's in-process listener binding port 0,
//! or any outgoing connection's local port. Both draw from the kernel's
//! ephemeral range (`net.ipv4.ip_local_port_range`), so ports are picked
//! outside it, and a port this process has handed out is never handed out
//! again. The kernel then has no way to give the port away before the child
//! binds it; only a process binding that fixed port by name still could.

use std::collections::BTreeSet;
use std::net::TcpListener;
use std::ops::RangeInclusive;
use std::sync::Mutex;

/// The lowest port picked: below it lie the well-known and often
/// configured service ports.
const LOWEST: u16 = 10_000;

/// Where the kernel's ephemeral range is read.
const EPHEMERAL_RANGE: &str = "/proc/sys/net/ipv4/ip_local_port_range";

/// The kernel's default ephemeral range, used when it cannot be read.
const DEFAULT_EPHEMERAL: RangeInclusive<u16> = 32_768..=60_999;

/// How many kernel picks already handed out are passed over before one is
/// taken anyway: by then the whole range has been through this process.
const MAX_REFUSED_KERNEL_PICKS: usize = 256;

/// Every port this process has handed out.
static HANDED_OUT: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());

/// `N` distinct TCP ports on 127.0.0.1 that are free now, outside the
/// kernel's ephemeral range and never handed out before by this process;
/// the child processes bind them a moment later.
///
/// Falls back to ports the kernel picks (inside its ephemeral range) only
/// when every port outside it is taken or handed out; those too are ones
/// this process has not handed out, unless hundreds in a row were.
pub fn free_ports<const N: usize>() -> std::io::Result<[u16; N]> {
    let ephemeral = std::fs::read_to_string(EPHEMERAL_RANGE)
        .ok()
        .and_then(|text| parse_range(&text))
        .unwrap_or(DEFAULT_EPHEMERAL);
    let candidates = outside(&ephemeral);
    let mut handed_out = HANDED_OUT
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let start = start_offset(candidates.len());
    let mut ports = [0; N];
    let mut held = Vec::with_capacity(N);
    let mut scan = candidates.iter().cycle().skip(start).take(candidates.len());
    for port in &mut ports {
        let picked = scan.by_ref().find_map(|&candidate| {
            if handed_out.contains(&candidate) {
                return None;
            }
            TcpListener::bind(("127.0.0.1", candidate))
                .ok()
                .map(|listener| (candidate, listener))
        });
        let (picked, listener) = match picked {
            Some(found) => found,
            None => kernel_pick(&handed_out)?,
        };
        handed_out.insert(picked);
        *port = picked;
        // Held until every port of this pick is chosen, so that a fallback
        // pick cannot return one of them.
        held.push(listener);
    }
    Ok(ports)
}

/// A port the kernel picks that this process has not handed out. The
/// refused picks are held until the end, so the kernel moves on.
fn kernel_pick(handed_out: &BTreeSet<u16>) -> std::io::Result<(u16, TcpListener)> {
    let mut refused = Vec::new();
    loop {
        let listener = TcpListener::bind(("127.0.0.1", 0))?;
        let port = listener.local_addr()?.port();
        if !handed_out.contains(&port) || refused.len() >= MAX_REFUSED_KERNEL_PICKS {
            return Ok((port, listener));
        }
        refused.push(listener);
    }
}

/// The `low high` pair the kernel prints for its ephemeral range.
fn parse_range(text: &str) -> Option<RangeInclusive<u16>> {
    let mut parts = text.split_whitespace().map(str::parse::<u16>);
    let low = parts.next()?.ok()?;
    let high = parts.next()?.ok()?;
    (low <= high).then_some(low..=high)
}

/// The ports from [`LOWEST`] up that the kernel never picks by itself.
fn outside(ephemeral: &RangeInclusive<u16>) -> Vec<u16> {
    (LOWEST..=u16::MAX)
        .filter(|port| !ephemeral.contains(port))
        .collect()
}

/// Where this process starts scanning, so that two processes picking at
/// once (two test binaries, two benches) do not walk the same ports.
fn start_offset(len: usize) -> usize {
    if len == 0 {
        return 0;
    }
    let pid = usize::try_from(std::process::id()).unwrap_or(0);
    // Spread neighbouring pids across the range.
    pid.wrapping_mul(7_919) % len
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ports_of_one_pick_are_distinct_and_free() {
        let ports = free_ports::<64>().expect("ports");
        assert_eq!(ports.iter().collect::<BTreeSet<_>>().len(), 64);
        for port in ports {
            TcpListener::bind(("127.0.0.1", port)).expect("still free after the pick");
        }
    }

    #[test]
    fn a_port_is_never_handed_out_twice() {
        let first = free_ports::<32>().expect("ports");
        let second = free_ports::<32>().expect("ports");
        let all: BTreeSet<_> = first.iter().chain(&second).collect();
        assert_eq!(all.len(), 64, "{first:?} and {second:?} overlap");
    }

    #[test]
    fn picks_lie_outside_the_kernels_ephemeral_range() {
        let ephemeral = std::fs::read_to_string(EPHEMERAL_RANGE)
            .ok()
            .and_then(|text| parse_range(&text))
            .unwrap_or(DEFAULT_EPHEMERAL);
        for port in free_ports::<16>().expect("ports") {
            assert!(
                !ephemeral.contains(&port) && port >= LOWEST,
                "{port} lies in the ephemeral range {ephemeral:?}"
            );
        }
    }

    #[test]
    fn the_kernels_fallback_pick_passes_over_ports_handed_out() {
        let mut handed_out = BTreeSet::new();
        for _ in 0..100 {
            let listener = TcpListener::bind(("127.0.0.1", 0)).expect("bind");
            handed_out.insert(listener.local_addr().expect("addr").port());
        }
        let (port, _listener) = kernel_pick(&handed_out).expect("a port");
        assert!(!handed_out.contains(&port), "{port} was handed out before");
    }

    #[test]
    fn the_range_is_read_as_the_kernel_prints_it() {
        assert_eq!(parse_range("32768\t60999\n"), Some(32_768..=60_999));
        assert_eq!(parse_range("1024 65535"), Some(1_024..=65_535));
        assert_eq!(parse_range("60999 32768"), None, "an inverted range");
        assert_eq!(parse_range("32768"), None, "one bound");
        assert_eq!(parse_range("low high"), None, "not numbers");
    }

    #[test]
    fn the_candidates_skip_the_ephemeral_range_and_low_ports() {
        let candidates = outside(&(32_768..=60_999));
        assert_eq!(candidates.first(), Some(&LOWEST));
        assert!(candidates.contains(&32_767));
        assert!(!candidates.contains(&32_768));
        assert!(!candidates.contains(&60_999));
        assert!(candidates.contains(&61_000));
        assert_eq!(candidates.last(), Some(&u16::MAX));
        assert!(outside(&(1_024..=65_535)).is_empty(), "nothing is left");
    }
}
