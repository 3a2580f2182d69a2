//! One real node: a containerd and a kubelet with their own state
//! directories, sockets, cgroup root and CNI bridge, registered with the
//! control plane under a node client certificate (NodeRestriction applies).
//!
//! Each node runs in a mount namespace of its own, where the node's
//! directories are bind-mounted over the paths the kubelet fixes whatever
//! its flags say: `/var/lib/kubelet` (its device-plugin socket directory is
//! always `/var/lib/kubelet/device-plugins`), `/var/log/pods` and
//! `/var/log/containers`. So several nodes share one host, the chart's
//! default `devicePlugin.kubeletDir` is right on every node, and every
//! mount a node makes goes away with its namespace.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Node;
use kube::Client;
use kube::api::Api;

use super::host::{self, run, run_for_teardown};
use super::network::HostNetwork;
use super::{CONTAINERD_NAMESPACE, PAUSE_IMAGE, RealNodeError};
use crate::cluster::processes::{ChildProcess, ProcessSpec};
use crate::control_plane::{ControlPlane, FEATURE_GATES, KUBERNETES_SERVICE_IP};

/// How long a stopped kubelet or containerd gets to exit before SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(10);

/// The paths each node's mount namespace takes from the node's directory.
const NODE_PATHS: [&str; 3] = ["var/lib/kubelet", "var/log/pods", "var/log/containers"];

/// The kubelet's root directory, as the node's processes see it.
pub const KUBELET_DIR: &str = "/var/lib/kubelet";

/// Run by `unshare` in the node's new mount namespace: binds the node's
/// directories (under `$1`) over the paths `$2` lists ([`NODE_PATHS`]),
/// then becomes containerd.
const ENTER_NODE_NAMESPACE: &str = r#"set -e
root="$1"; paths="$2"; shift 2
for d in $paths; do
  mkdir -p "$root/$d" "/$d"
  mount --bind "$root/$d" "/$d"
done
exec "$@"
"#;

/// A running real node. [`RealNode::teardown`] stops it and removes what
/// it added to the host; the caller deletes its pods first, so the kubelet
/// releases their network and mounts itself.
#[derive(Debug)]
pub struct RealNode {
    name: String,
    index: u32,
    ip: Ipv4Addr,
    dir: PathBuf,
    kubelet_spec: ProcessSpec,
    kubelet_bin: PathBuf,
    containerd: Option<ChildProcess>,
    kubelet: Option<ChildProcess>,
    cgroups: Vec<PathBuf>,
}

impl RealNode {
    /// Starts node `index` (named `<prefix><index+1>`) in `run_dir`:
    /// containerd with `images` imported, then the kubelet. Returns once the
    /// kubelet runs; [`RealNode::wait_ready`] waits for the Node to be Ready.
    /// On failure, whatever was started is torn down again.
    pub async fn start(
        plane: &ControlPlane,
        net: &HostNetwork,
        index: u32,
        prefix: &str,
        kubelet_bin: &Path,
        images: &[PathBuf],
        run_dir: &Path,
    ) -> Result<Self, RealNodeError> {
        let name = format!("{prefix}{}", index + 1);
        let dir = run_dir.join("nodes").join(&name);
        let ip = net.add_node_ip(index).await?;
        let mut node = RealNode {
            // The kubelet joins containerd's mount namespace.
            kubelet_spec: ProcessSpec {
                name: "kubelet".into(),
                program: "nsenter".into(),
                args: Vec::new(),
                env: Vec::new(),
            },
            kubelet_bin: kubelet_bin.to_path_buf(),
            name,
            index,
            ip,
            dir,
            containerd: None,
            kubelet: None,
            cgroups: Vec::new(),
        };
        match node.bring_up(plane, net, images).await {
            Ok(()) => Ok(node),
            Err(e) => {
                node.teardown(net).await;
                Err(e)
            }
        }
    }

    async fn bring_up(
        &mut self,
        plane: &ControlPlane,
        net: &HostNetwork,
        images: &[PathBuf],
    ) -> Result<(), RealNodeError> {
        for d in [
            self.logs(),
            self.cni_dir(),
            self.kubelet_pki(),
            self.containerd_dir(),
        ] {
            std::fs::create_dir_all(&d)
                .map_err(RealNodeError::io("making a node directory", &d))?;
        }
        write(
            &self.cni_dir().join("10-gpupool.conflist"),
            &self.cni_config(net),
        )?;
        write(
            &self.containerd_dir().join("config.toml"),
            &self.containerd_config(),
        )?;
        let containerd = ProcessSpec {
            name: "containerd".into(),
            program: "unshare".into(),
            args: vec![
                "--mount".into(),
                "--propagation".into(),
                "private".into(),
                "--".into(),
                "/bin/sh".into(),
                "-c".into(),
                ENTER_NODE_NAMESPACE.into(),
                "sh".into(),
                self.host_paths().into(),
                NODE_PATHS.join(" ").into(),
                host::find_on_path("containerd")
                    .unwrap_or_else(|| "containerd".into())
                    .into(),
                "--config".into(),
                self.containerd_dir().join("config.toml").into(),
            ],
            env: Vec::new(),
        };
        let containerd = ChildProcess::spawn(&containerd, &self.logs())?;
        let namespace_pid = containerd.pid();
        self.containerd = Some(containerd);
        self.wait_for_containerd().await?;
        for image in images {
            run(
                "importing an image into containerd",
                "ctr",
                [
                    "--address".as_ref(),
                    self.containerd_socket().as_os_str(),
                    "--namespace".as_ref(),
                    CONTAINERD_NAMESPACE.as_ref(),
                    "images".as_ref(),
                    "import".as_ref(),
                    image.as_os_str(),
                ],
            )
            .await?;
        }

        let cgroup_root = format!("{}-{}", net.run_name(), self.name);
        for hierarchy in host::cgroup_hierarchies() {
            let d = hierarchy.join(&cgroup_root);
            std::fs::create_dir_all(&d)
                .map_err(RealNodeError::io("making the kubelet's cgroup root", &d))?;
            self.cgroups.push(d);
        }
        let pki = self.kubelet_pki();
        let serving = plane
            .ca()
            .kubelet_serving(&self.name, &self.ip.to_string())
            .map_err(crate::control_plane::ControlPlaneError::from)?;
        write(&pki.join("serving.crt"), &serving.cert_pem)?;
        // A private key: readable by its owner only, as the control plane's are.
        crate::control_plane::write_private(&pki.join("serving.key"), &serving.key_pem)?;
        write(&pki.join("ca.crt"), plane.ca_pem())?;
        plane.write_cert_kubeconfig(
            &self.dir.join("kubelet.kubeconfig"),
            &format!("system:node:{}", self.name),
            &["system:nodes"],
        )?;
        let config = self.dir.join("kubelet.yaml");
        write(&config, &self.kubelet_config(&format!("/{cgroup_root}")))?;
        let namespace_pid = namespace_pid.ok_or_else(|| {
            RealNodeError::NotReady(format!("containerd of {} has no pid", self.name))
        })?;
        self.kubelet_spec.args = vec![
            "--target".into(),
            namespace_pid.to_string().into(),
            "--mount".into(),
            "--".into(),
            self.kubelet_bin.clone().into(),
            "--config".into(),
            config.into(),
            "--kubeconfig".into(),
            self.dir.join("kubelet.kubeconfig").into(),
            "--root-dir".into(),
            KUBELET_DIR.into(),
            "--cert-dir".into(),
            pki.into(),
            "--node-ip".into(),
            self.ip.to_string().into(),
            "--hostname-override".into(),
            self.name.clone().into(),
            "--container-runtime-endpoint".into(),
            format!("unix://{}", self.containerd_socket().display()).into(),
            "--v=1".into(),
        ];
        self.kubelet = Some(ChildProcess::spawn(&self.kubelet_spec, &self.logs())?);
        Ok(())
    }

    async fn wait_for_containerd(&mut self) -> Result<(), RealNodeError> {
        let deadline = Instant::now() + Duration::from_secs(30);
        let socket = self.containerd_socket();
        loop {
            let version = run(
                "asking containerd its version",
                "ctr",
                ["--address".as_ref(), socket.as_os_str(), "version".as_ref()],
            )
            .await;
            match version {
                Ok(_) => return Ok(()),
                Err(e) if Instant::now() >= deadline => {
                    return Err(RealNodeError::NotReady(format!(
                        "containerd of {} did not answer within 30 s ({e}); its log {} ends with:\n{}",
                        self.name,
                        self.logs().join("containerd.log").display(),
                        crate::cluster::sim::log_tail(&self.logs().join("containerd.log"), 20)
                    )));
                }
                Err(_) => {}
            }
            if let Some(status) = self.containerd.as_mut().and_then(ChildProcess::exit_status) {
                return Err(RealNodeError::NotReady(format!(
                    "containerd of {} exited ({status}); its log ends with:\n{}",
                    self.name,
                    crate::cluster::sim::log_tail(&self.logs().join("containerd.log"), 20)
                )));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Waits until the Node is Ready and carries no `not-ready` taint.
    pub async fn wait_ready(
        &mut self,
        client: &Client,
        timeout: Duration,
    ) -> Result<(), RealNodeError> {
        let nodes: Api<Node> = Api::all(client.clone());
        let deadline = Instant::now() + timeout;
        loop {
            let node = nodes
                .get_opt(&self.name)
                .await
                .map_err(RealNodeError::api("reading a real node"))?;
            if node.as_ref().is_some_and(node_is_ready) {
                tracing::info!(node = %self.name, ip = %self.ip, "real node ready");
                return Ok(());
            }
            let exited = self.kubelet.as_mut().and_then(ChildProcess::exit_status);
            if exited.is_some() || Instant::now() >= deadline {
                let how = match exited {
                    Some(status) => format!("its kubelet exited ({status})"),
                    None => format!("it was not Ready within {timeout:?}"),
                };
                return Err(RealNodeError::NotReady(format!(
                    "node {}: {how}; its kubelet log {} ends with:\n{}",
                    self.name,
                    self.logs().join("kubelet.log").display(),
                    crate::cluster::sim::log_tail(&self.logs().join("kubelet.log"), 20)
                )));
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Stops the kubelet (SIGTERM) and starts it again with the same
    /// configuration; containerd and the pods keep running meanwhile.
    pub async fn restart_kubelet(&mut self) -> Result<(), RealNodeError> {
        if let Some(mut kubelet) = self.kubelet.take() {
            kubelet.stop(STOP_GRACE).await?;
        }
        self.kubelet = Some(ChildProcess::spawn(&self.kubelet_spec, &self.logs())?);
        Ok(())
    }

    /// The node's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The node's IP.
    pub fn ip(&self) -> Ipv4Addr {
        self.ip
    }

    /// The kubelet's root directory as seen from the host (inside the
    /// node it is [`KUBELET_DIR`], the chart's default).
    pub fn kubelet_dir(&self) -> PathBuf {
        self.host_paths().join(NODE_PATHS[0])
    }

    /// The directory whose subdirectories the node's namespace binds over
    /// [`NODE_PATHS`].
    fn host_paths(&self) -> PathBuf {
        self.dir.join("paths")
    }

    /// containerd's socket.
    pub fn containerd_socket(&self) -> PathBuf {
        self.containerd_dir().join("containerd.sock")
    }

    /// The directory of this node's logs (`containerd.log`, `kubelet.log`).
    pub fn logs(&self) -> PathBuf {
        self.dir.join("logs")
    }

    /// PIDs of the node's containerd and kubelet.
    pub fn pids(&mut self) -> Vec<u32> {
        [self.containerd.as_mut(), self.kubelet.as_mut()]
            .into_iter()
            .flatten()
            .filter_map(|p| {
                if p.exit_status().is_none() {
                    p.pid()
                } else {
                    None
                }
            })
            .collect()
    }

    fn containerd_dir(&self) -> PathBuf {
        self.dir.join("containerd")
    }

    fn cni_dir(&self) -> PathBuf {
        self.dir.join("cni")
    }

    fn kubelet_pki(&self) -> PathBuf {
        self.dir.join("kubelet-pki")
    }

    /// Stops the kubelet, the node's containers, containerd and its shims,
    /// then removes its mounts, cgroups, CNI bridge and state directories.
    /// Every step runs even when an earlier one fails; the logs stay.
    pub async fn teardown(&mut self, net: &HostNetwork) {
        if let Some(mut kubelet) = self.kubelet.take()
            && let Err(e) = kubelet.stop(STOP_GRACE).await
        {
            tracing::warn!(node = %self.name, error = %e, "cannot stop the kubelet");
        }
        let socket = self.containerd_socket();
        if let Some(mut containerd) = self.containerd.take() {
            self.stop_containers(&socket).await;
            if let Err(e) = containerd.stop(STOP_GRACE).await {
                tracing::warn!(node = %self.name, error = %e, "cannot stop containerd");
            }
        }
        // A shim outlives containerd by design; this node's carry its socket.
        for pid in host::pids_with_argument(&socket.to_string_lossy()) {
            if let Some(pid) = rustix::process::Pid::from_raw(pid) {
                let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
            }
        }
        // Whatever still runs in the node's pods (a shim killed above leaves
        // its container's processes behind) is in the node's cgroups.
        if let Some(cgroup) = self.cgroups.first() {
            host::kill_cgroup_tree(cgroup);
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        for mount in host::mounts_under(&self.dir) {
            run_for_teardown(
                "unmounting a node's mount",
                "umount",
                ["-l".as_ref(), mount.as_os_str()],
            )
            .await;
        }
        let unified = self
            .cgroups
            .first()
            .and_then(|c| c.file_name())
            .and_then(host::unified_cgroup);
        for cgroup in self.cgroups.drain(..).chain(unified) {
            host::remove_cgroup_tree(&cgroup);
        }
        net.remove_cni_bridge(self.index).await;
        for d in [
            self.containerd_dir(),
            self.host_paths(),
            self.dir.join("cni-ipam"),
        ] {
            if let Err(e) = std::fs::remove_dir_all(&d)
                && e.kind() != std::io::ErrorKind::NotFound
            {
                tracing::warn!(dir = %d.display(), error = %e, "cannot remove a node's state");
            }
        }
    }

    /// Kills and deletes every task containerd still runs for this node
    /// (none when the kubelet stopped its pods, as it does for deleted ones).
    async fn stop_containers(&self, socket: &Path) {
        let ctr = |args: &[&str]| {
            let mut all = vec![
                "--address".to_owned(),
                socket.to_string_lossy().into_owned(),
                "--namespace".to_owned(),
                CONTAINERD_NAMESPACE.to_owned(),
            ];
            all.extend(args.iter().map(|a| (*a).to_owned()));
            all
        };
        let Ok(tasks) = run(
            "listing containerd's tasks",
            "ctr",
            ctr(&["tasks", "ls", "-q"]),
        )
        .await
        else {
            return;
        };
        for id in tasks.lines().map(str::trim).filter(|l| !l.is_empty()) {
            // --force kills a running task first.
            run_for_teardown(
                "deleting a container's task",
                "ctr",
                ctr(&["tasks", "delete", "--force", id]),
            )
            .await;
        }
    }

    fn cni_config(&self, net: &HostNetwork) -> String {
        serde_json::json!({
            "cniVersion": "0.4.0",
            "name": format!("{}-{}", net.run_name(), self.name),
            "plugins": [{
                "type": "bridge",
                "bridge": net.cni_bridge(self.index),
                "isGateway": true,
                // Pods' traffic keeps its source address: nothing is
                // masqueraded, as nothing is to leave this machine.
                "ipMasq": false,
                "hairpinMode": true,
                // Routes to this run's host addresses and the `kubernetes`
                // Service only: no default route, so a pod has no way to
                // send anything off this machine.
                "ipam": {
                    "type": "host-local",
                    "dataDir": self.dir.join("cni-ipam"),
                    "ranges": [[{ "subnet": net.pod_subnet(self.index) }]],
                    "routes": [
                        { "dst": net.host_block() },
                        { "dst": format!("{KUBERNETES_SERVICE_IP}/32") },
                    ],
                },
            }],
        })
        .to_string()
    }

    fn containerd_config(&self) -> String {
        let d = self.containerd_dir();
        let d = d.display();
        let cni = self.cni_dir();
        // restrict_oom_score_adj: without CAP_SYS_RESOURCE, runc cannot
        // lower a container's OOM score and every sandbox fails to start.
        // stream_server_port 0: several nodes on one host cannot share one.
        format!(
            r#"version = 2
root = "{d}/root"
state = "{d}/state"
[grpc]
  address = "{d}/containerd.sock"
[ttrpc]
  address = "{d}/containerd.sock.ttrpc"
[debug]
  address = ""
[metrics]
  address = ""
[plugins."io.containerd.internal.v1.opt"]
  path = "{d}/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{cni}"
"#,
            cni = cni.display()
        )
    }

    fn kubelet_config(&self, cgroup_root: &str) -> String {
        let pki = self.kubelet_pki();
        let gates = FEATURE_GATES
            .split(',')
            .filter_map(|g| g.split_once('='))
            .map(|(k, v)| format!("  {k}: {v}\n"))
            .collect::<String>();
        // failCgroupV1: these hosts are cgroup v1. Eviction thresholds and
        // image GC are set so that a full test disk neither evicts the pods
        // nor deletes images that no registry could bring back.
        format!(
            r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
failSwapOn: false
cgroupDriver: cgroupfs
cgroupRoot: {cgroup_root}
address: {ip}
port: 10250
readOnlyPort: 0
healthzPort: 0
tlsCertFile: {pki}/serving.crt
tlsPrivateKeyFile: {pki}/serving.key
authentication:
  anonymous:
    enabled: false
  webhook:
    enabled: true
  x509:
    clientCAFile: {pki}/ca.crt
authorization:
  mode: Webhook
syncFrequency: 5s
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard:
  memory.available: 1Mi
  nodefs.available: 1%
  imagefs.available: 1%
  nodefs.inodesFree: 1%
featureGates:
{gates}"#,
            ip = self.ip,
            pki = pki.display(),
        )
    }
}

fn node_is_ready(node: &Node) -> bool {
    let ready = node
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
    let tainted = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|ts| ts.iter().any(|t| t.key == "node.kubernetes.io/not-ready"));
    ready && !tainted
}

fn write(path: &Path, text: &str) -> Result<(), RealNodeError> {
    std::fs::write(path, text).map_err(RealNodeError::io("writing a node's configuration", path))
}
