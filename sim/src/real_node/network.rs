//! The host side of real nodes' networking, one block of addresses per run.
//!
//! Run `K` (the lowest `K` whose link `gpn<K>` does not exist yet; creating
//! that link is what claims it) uses:
//! - `198.18.K.1`: the API server's address, and `198.18.K.(10+i)`: node
//!   `i`'s IP, all on the bridge `gpn<K>`, which has no ports;
//! - `198.19.K.(32·i)/27`: node `i`'s pods, on the CNI bridge `gpc<K>n<i>`;
//! - the iptables chain `GPUPOOL-SIM-<K>` in the nat and filter tables: one
//!   DNAT of the `kubernetes` Service's cluster IP to the API server for
//!   this run's pods (kube-proxy's one job here), and a drop of anything
//!   those pods send beyond their subnets and this host.
//!
//! 198.18.0.0/15 is the block set aside for network tests (RFC 2544), so it
//! clashes with no real network.
//!
//! A run records itself as the block's owner in `/run/gpupool-sim/block-<K>`
//! (its pid, that process's start time and its run directory). A run killed
//! before its teardown (SIGKILL, a crash) leaves its block behind; the next
//! run that finds a block whose owner is dead removes what that run left
//! (its pods' processes, shims, cgroups, links and chains) and reuses it, so
//! a machine that has run the harness before starts clean.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

use super::RealNodeError;
use super::host::{self, run, run_for_teardown};
use crate::control_plane::{KUBERNETES_SERVICE_IP, KUBERNETES_SERVICE_PORT};

/// Most nodes one run can have: eight /27 pod subnets fill its /24.
pub const MAX_NODES: u32 = 8;

const IP_FORWARD: &str = "/proc/sys/net/ipv4/ip_forward";

/// Where runs record which block they own.
const OWNERS: &str = "/run/gpupool-sim";

/// One run's addresses, links and iptables chains. [`HostNetwork::remove`]
/// takes them away again.
#[derive(Debug)]
pub struct HostNetwork {
    block: u8,
    /// `ip_forward` before the run (the CNI bridge plugin turns it on).
    ip_forward_before: Option<String>,
    chain_installed: bool,
}

impl HostNetwork {
    /// Claims the lowest free block (reclaiming those of dead runs) for the
    /// run in `run_dir`, and puts the API server's address on its bridge.
    pub async fn create(run_dir: &Path) -> Result<Self, RealNodeError> {
        let ip_forward_before = std::fs::read_to_string(IP_FORWARD).ok();
        std::fs::create_dir_all(OWNERS).map_err(RealNodeError::io("recording the run", OWNERS))?;
        for block in 0..=u8::MAX {
            let link = node_link(block);
            if link_exists(&link) && !reclaim_if_dead(block).await {
                continue;
            }
            // Creating the link fails when another run holds the block.
            if run(
                "claiming an address block",
                "ip",
                ["link", "add", &link, "type", "bridge"],
            )
            .await
            .is_err()
            {
                continue;
            }
            let owner = owner_file(block);
            let record = format!("{}\n{}\n", own_identity(), run_dir.display());
            if let Err(e) = std::fs::write(&owner, record) {
                run_for_teardown("releasing an address block", "ip", ["link", "del", &link]).await;
                return Err(RealNodeError::io("recording the run", &owner)(e));
            }
            let mut net = HostNetwork {
                block,
                ip_forward_before,
                chain_installed: false,
            };
            if let Err(e) = net.set_up().await {
                net.remove().await;
                return Err(e);
            }
            return Ok(net);
        }
        Err(RealNodeError::NoFreeSubnet)
    }

    async fn set_up(&mut self) -> Result<(), RealNodeError> {
        let link = node_link(self.block);
        let host = format!("{}/32", self.api_server_ip());
        run(
            "addressing the node bridge",
            "ip",
            ["addr", "add", &host, "dev", &link],
        )
        .await?;
        run(
            "bringing the node bridge up",
            "ip",
            ["link", "set", &link, "up"],
        )
        .await?;
        let chain = self.chain();
        let pods = self.pods_block();
        self.chain_installed = true;
        for table in ["nat", "filter"] {
            run(
                "adding the run's iptables chain",
                "iptables",
                ["-w", "-t", table, "-N", &chain],
            )
            .await?;
        }
        run(
            "hooking the run's nat chain",
            "iptables",
            ["-w", "-t", "nat", "-I", "PREROUTING", "-j", &chain],
        )
        .await?;
        run(
            "hooking the run's filter chain",
            "iptables",
            ["-w", "-t", "filter", "-I", "FORWARD", "-j", &chain],
        )
        .await?;
        // Pods talk to each other on their bridge and to this host; nothing
        // they send is forwarded anywhere else.
        run(
            "keeping pod traffic on this machine",
            "iptables",
            [
                "-w", "-t", "filter", "-A", &chain, "-s", &pods, "!", "-d", &pods, "-j", "DROP",
            ],
        )
        .await?;
        Ok(())
    }

    /// Sends this run's pods' connections to the `kubernetes` Service's
    /// cluster IP to the API server on `api_port`.
    pub async fn route_kubernetes_service(&self, api_port: u16) -> Result<(), RealNodeError> {
        let to = format!("{}:{api_port}", self.api_server_ip());
        run(
            "routing the kubernetes Service to the API server",
            "iptables",
            [
                "-w",
                "-t",
                "nat",
                "-A",
                &self.chain(),
                "-s",
                &self.pods_block(),
                "-d",
                &format!("{KUBERNETES_SERVICE_IP}/32"),
                "-p",
                "tcp",
                "--dport",
                &KUBERNETES_SERVICE_PORT.to_string(),
                "-j",
                "DNAT",
                "--to-destination",
                &to,
            ],
        )
        .await
        .map(drop)
    }

    /// Puts node `index`'s IP on the node bridge.
    pub async fn add_node_ip(&self, index: u32) -> Result<Ipv4Addr, RealNodeError> {
        let ip = self.node_ip(index);
        run(
            "addressing a node",
            "ip",
            [
                "addr",
                "add",
                &format!("{ip}/32"),
                "dev",
                &node_link(self.block),
            ],
        )
        .await?;
        Ok(ip)
    }

    /// The API server's address, which pods and kubelets reach.
    pub fn api_server_ip(&self) -> Ipv4Addr {
        Ipv4Addr::new(198, 18, self.block, 1)
    }

    /// Node `index`'s IP (`index` < [`MAX_NODES`]).
    pub fn node_ip(&self, index: u32) -> Ipv4Addr {
        Ipv4Addr::new(198, 18, self.block, 10 + index as u8)
    }

    /// Node `index`'s pod subnet, as `a.b.c.d/27`.
    pub fn pod_subnet(&self, index: u32) -> String {
        format!("198.19.{}.{}/27", self.block, 32 * index)
    }

    /// Node `index`'s CNI bridge (at most 15 characters, as Linux requires).
    pub fn cni_bridge(&self, index: u32) -> String {
        format!("gpc{}n{index}", self.block)
    }

    /// Removes node `index`'s CNI bridge (the bridge plugin creates it with
    /// the first pod and never deletes it).
    pub async fn remove_cni_bridge(&self, index: u32) {
        let link = self.cni_bridge(index);
        if link_exists(&link) {
            run_for_teardown("removing a CNI bridge", "ip", ["link", "del", &link]).await;
        }
    }

    /// A name unique to this run among concurrent ones (cgroups, CNI).
    pub fn run_name(&self) -> String {
        format!("gpupool-sim-{}", self.block)
    }

    /// The block of the API server's and the nodes' addresses, `/24`.
    pub fn host_block(&self) -> String {
        format!("198.18.{}.0/24", self.block)
    }

    fn pods_block(&self) -> String {
        format!("198.19.{}.0/24", self.block)
    }

    fn chain(&self) -> String {
        chain_name(self.block)
    }

    /// Removes the node bridge and the run's chains, and puts `ip_forward`
    /// back. Every step runs even when an earlier one fails.
    pub async fn remove(self) {
        run_for_teardown(
            "removing the node bridge",
            "ip",
            ["link", "del", &node_link(self.block)],
        )
        .await;
        if self.chain_installed {
            remove_chains(self.block).await;
        }
        let _ = std::fs::remove_file(owner_file(self.block));
        if let Some(before) = &self.ip_forward_before
            && std::fs::read_to_string(IP_FORWARD).ok().as_deref() != Some(before.as_str())
            && let Err(e) = std::fs::write(IP_FORWARD, before)
        {
            tracing::warn!(error = %e, "cannot restore net.ipv4.ip_forward");
        }
    }
}

/// The bridge holding run `block`'s host and node addresses.
fn node_link(block: u8) -> String {
    format!("gpn{block}")
}

fn link_exists(link: &str) -> bool {
    Path::new("/sys/class/net").join(link).exists()
}

fn owner_file(block: u8) -> PathBuf {
    Path::new(OWNERS).join(format!("block-{block}"))
}

fn chain_name(block: u8) -> String {
    format!("GPUPOOL-SIM-{block}")
}

async fn remove_chains(block: u8) {
    let chain = chain_name(block);
    for (table, hook) in [("nat", "PREROUTING"), ("filter", "FORWARD")] {
        run_for_teardown(
            "unhooking the run's chain",
            "iptables",
            ["-w", "-t", table, "-D", hook, "-j", &chain],
        )
        .await;
        run_for_teardown(
            "emptying the run's chain",
            "iptables",
            ["-w", "-t", table, "-F", &chain],
        )
        .await;
        run_for_teardown(
            "deleting the run's chain",
            "iptables",
            ["-w", "-t", table, "-X", &chain],
        )
        .await;
    }
}

/// This process as an owner record names it: its pid and start time (so a
/// reused pid is not taken for a live owner).
fn own_identity() -> String {
    let pid = std::process::id();
    format!("{pid} {}", start_time(pid).unwrap_or_default())
}

/// A process's start time (field 22 of `/proc/<pid>/stat`).
fn start_time(pid: u32) -> Option<String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces; it ends at the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19).map(str::to_owned)
}

/// When the run that owns `block` is dead, removes what it left and
/// returns true; a live owner, or a block with no owner record (taken by a
/// run still setting up), is left alone.
async fn reclaim_if_dead(block: u8) -> bool {
    let Ok(record) = std::fs::read_to_string(owner_file(block)) else {
        return false;
    };
    let mut lines = record.lines();
    let identity = lines.next().unwrap_or_default();
    let run_dir = lines.next().unwrap_or_default().to_owned();
    let alive = identity
        .split_once(' ')
        .and_then(|(pid, started)| Some((pid.parse::<u32>().ok()?, started)))
        .is_some_and(|(pid, started)| start_time(pid).as_deref() == Some(started));
    if alive {
        return false;
    }
    tracing::warn!(
        block,
        run_dir,
        "reclaiming the address block of a run that died before its teardown"
    );
    if !run_dir.is_empty() {
        // Its shims outlived it; each names its node's socket, under its run directory.
        for pid in host::pids_with_argument_under(&run_dir) {
            if let Some(pid) = rustix::process::Pid::from_raw(pid) {
                let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
            }
        }
    }
    let prefix = format!("gpupool-sim-{block}-");
    let stale: Vec<PathBuf> = host::cgroup_hierarchies()
        .iter()
        .filter_map(|h| std::fs::read_dir(h).ok())
        .flatten()
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
        .map(|e| e.path())
        .collect();
    for cgroup in &stale {
        host::kill_cgroup_tree(cgroup);
    }
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    for cgroup in &stale {
        host::remove_cgroup_tree(cgroup);
    }
    // runc's empty cgroups of the dead run's containers in the v2 hierarchy.
    let unified: Vec<PathBuf> = std::fs::read_dir(host::UNIFIED_HIERARCHY)
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
        .map(|e| e.path())
        .collect();
    for cgroup in &unified {
        host::remove_cgroup_tree(cgroup);
    }
    for index in 0..MAX_NODES {
        let link = format!("gpc{block}n{index}");
        if link_exists(&link) {
            run_for_teardown(
                "removing a dead run's CNI bridge",
                "ip",
                ["link", "del", &link],
            )
            .await;
        }
    }
    run_for_teardown(
        "removing a dead run's node bridge",
        "ip",
        ["link", "del", &node_link(block)],
    )
    .await;
    remove_chains(block).await;
    let _ = std::fs::remove_file(owner_file(block));
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_of_a_block_stay_inside_the_test_range_and_apart() {
        let net = HostNetwork {
            block: 7,
            ip_forward_before: None,
            chain_installed: false,
        };
        assert_eq!(net.api_server_ip(), Ipv4Addr::new(198, 18, 7, 1));
        assert_eq!(net.node_ip(0), Ipv4Addr::new(198, 18, 7, 10));
        assert_eq!(net.pod_subnet(0), "198.19.7.0/27");
        assert_eq!(net.pod_subnet(MAX_NODES - 1), "198.19.7.224/27");
        for i in 0..MAX_NODES {
            assert!(net.cni_bridge(i).len() <= 15);
        }
        let last = HostNetwork { block: 255, ..net };
        assert!(last.cni_bridge(MAX_NODES - 1).len() <= 15);
        assert!(node_link(255).len() <= 15);
    }
}
