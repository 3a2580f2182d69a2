//! Ports for the processes the simulator starts.

use std::net::TcpListener;

/// `N` distinct TCP ports on 127.0.0.1 that are free now; the child
/// processes bind them a moment later.
///
/// All `N` are held at once while they are picked: a port picked and
/// released before the next pick may be handed out again, which once gave
/// the operator the same metrics and webhook port.
pub fn free_ports<const N: usize>() -> std::io::Result<[u16; N]> {
    let mut held = Vec::with_capacity(N);
    let mut ports = [0; N];
    for port in &mut ports {
        let listener = TcpListener::bind(("127.0.0.1", 0))?;
        *port = listener.local_addr()?.port();
        held.push(listener);
    }
    Ok(ports)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    #[test]
    fn the_ports_of_one_pick_are_distinct_and_free() {
        let ports = free_ports::<64>().expect("ports");
        assert_eq!(ports.iter().collect::<BTreeSet<_>>().len(), 64);
        for port in ports {
            TcpListener::bind(("127.0.0.1", port)).expect("still free after the pick");
        }
    }
}
