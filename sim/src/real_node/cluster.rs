//! A real control plane with real nodes: what `gpupool-sim up --kube-assets
//! DIR --real-nodes N` runs, and what the real-node suites install the chart
//! onto.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::Client;
use kube::api::{Api, DeleteParams, ListParams};

use super::host;
use super::network::{HostNetwork, MAX_NODES};
use super::node::RealNode;
use super::{KUBELET, RealNodeError};
use crate::control_plane::{ControlPlane, ControlPlaneConfig};

/// How to start a cluster with real nodes.
#[derive(Debug, Clone)]
pub struct RealClusterConfig {
    /// The envtest assets directory: the control plane's binaries and the
    /// kubelet.
    pub assets: PathBuf,
    /// Run directory: the control plane's and each node's files and logs.
    pub dir: PathBuf,
    /// Number of real nodes (1 ..= 8).
    pub nodes: u32,
    /// Images to load into every node's containerd (docker-archive or OCI
    /// tarballs); must include the pause image [`super::PAUSE_IMAGE`].
    pub images: Vec<PathBuf>,
    /// How long start-up may take for the control plane and for each node.
    pub ready_timeout: Duration,
    /// Node `i` (from 1) is named `<node_prefix><i>`; default
    /// [`DEFAULT_NODE_PREFIX`].
    pub node_prefix: String,
}

/// The default [`RealClusterConfig::node_prefix`]: `real-node-1`, ….
pub const DEFAULT_NODE_PREFIX: &str = "real-node-";

impl RealClusterConfig {
    /// `nodes` real nodes with every `*.tar` in `images_dir` loaded.
    pub fn new(
        assets: impl Into<PathBuf>,
        dir: impl Into<PathBuf>,
        nodes: u32,
        images_dir: &Path,
    ) -> Result<Self, RealNodeError> {
        Ok(RealClusterConfig {
            assets: assets.into(),
            dir: dir.into(),
            nodes,
            images: image_archives(images_dir)?,
            ready_timeout: Duration::from_secs(90),
            node_prefix: DEFAULT_NODE_PREFIX.to_owned(),
        })
    }
}

/// The image tarballs in `dir` (`*.tar`, not the base root's
/// `*.rootfs.tar`), sorted; fails when there are none.
pub fn image_archives(dir: &Path) -> Result<Vec<PathBuf>, RealNodeError> {
    let entries = std::fs::read_dir(dir).map_err(RealNodeError::io("listing the images", dir))?;
    let mut found: Vec<PathBuf> = entries
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| {
            let name = p
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            name.ends_with(".tar") && !name.ends_with(".rootfs.tar")
        })
        .collect();
    found.sort();
    if found.is_empty() {
        return Err(RealNodeError::Io {
            step: "listing the images (build them with `bash .ci/build-images.sh`)".to_owned(),
            path: dir.to_path_buf(),
            source: std::io::Error::new(std::io::ErrorKind::NotFound, "no *.tar image archive"),
        });
    }
    Ok(found)
}

/// A running control plane with real nodes. Stop it with
/// [`RealCluster::shutdown`]; dropping it kills the processes but leaves
/// links, mounts and cgroups behind.
pub struct RealCluster {
    plane: Option<ControlPlane>,
    net: Option<HostNetwork>,
    nodes: Vec<RealNode>,
}

impl RealCluster {
    /// Starts the control plane, the host network and every node, and
    /// waits until each node is Ready. On failure, tears down what started.
    pub async fn start(config: RealClusterConfig) -> Result<Self, RealNodeError> {
        if !(1..=MAX_NODES).contains(&config.nodes) {
            return Err(RealNodeError::NotReady(format!(
                "--real-nodes must be between 1 and {MAX_NODES}, got {}",
                config.nodes
            )));
        }
        host::check_prerequisites(&[
            ("containerd", "containerd"),
            ("runc", "runc"),
            ("ctr", "containerd"),
            ("ip", "iproute2"),
            ("iptables", "iptables"),
            ("umount", "mount"),
            ("unshare", "util-linux"),
            ("nsenter", "util-linux"),
        ])?;
        if !Path::new("/usr/lib/cni/bridge").is_file() {
            return Err(RealNodeError::MissingTool {
                tool: "the CNI bridge plugin".to_owned(),
                hint: "/usr/lib/cni/bridge, Debian package containernetworking-plugins".to_owned(),
            });
        }
        // Absolute: the kubelet is started from inside the node's mount
        // namespace, where the working directory is not this one.
        let kubelet = config.assets.join(KUBELET);
        let kubelet = match std::fs::canonicalize(&kubelet) {
            Ok(path) if path.is_file() => path,
            _ => {
                return Err(RealNodeError::MissingTool {
                    tool: "the kubelet".to_owned(),
                    hint: format!("{} (`.ci/install-k8s.sh` unpacks it)", kubelet.display()),
                });
            }
        };
        let mut cluster = RealCluster {
            plane: None,
            net: Some(HostNetwork::create(&config.dir).await?),
            nodes: Vec::new(),
        };
        match cluster.bring_up(&config, &kubelet).await {
            Ok(()) => Ok(cluster),
            Err(e) => {
                cluster.teardown().await;
                Err(e)
            }
        }
    }

    async fn bring_up(
        &mut self,
        config: &RealClusterConfig,
        kubelet: &Path,
    ) -> Result<(), RealNodeError> {
        let net = self
            .net
            .as_ref()
            .ok_or_else(|| RealNodeError::NotReady("internal: no host network".to_owned()))?;
        let mut plane_config =
            ControlPlaneConfig::new(&config.assets, config.dir.join("control-plane"));
        plane_config.ready_timeout = config.ready_timeout;
        plane_config.real_nodes_host = Some(net.api_server_ip());
        let plane = ControlPlane::start(plane_config).await?;
        net.route_kubernetes_service(plane.api_port()).await?;
        let client = plane.client().await?;
        for index in 0..config.nodes {
            let node = RealNode::start(
                &plane,
                net,
                index,
                &config.node_prefix,
                kubelet,
                &config.images,
                &config.dir,
            )
            .await?;
            self.nodes.push(node);
        }
        self.plane = Some(plane);
        for node in &mut self.nodes {
            node.wait_ready(&client, config.ready_timeout).await?;
        }
        Ok(())
    }

    /// The control plane.
    pub fn control_plane(&self) -> Option<&ControlPlane> {
        self.plane.as_ref()
    }

    /// A client authenticated as the admin.
    pub async fn client(&self) -> Result<Client, RealNodeError> {
        match &self.plane {
            Some(plane) => Ok(plane.client().await?),
            None => Err(RealNodeError::NotReady(
                "the control plane is not running".to_owned(),
            )),
        }
    }

    /// The admin kubeconfig.
    pub fn kubeconfig(&self) -> Option<&Path> {
        self.plane.as_ref().map(ControlPlane::admin_kubeconfig)
    }

    /// The nodes, in index order.
    pub fn nodes(&self) -> &[RealNode] {
        &self.nodes
    }

    /// Node `name`.
    pub fn node_mut(&mut self, name: &str) -> Option<&mut RealNode> {
        self.nodes.iter_mut().find(|n| n.name() == name)
    }

    /// PIDs of every process the cluster started.
    pub fn pids(&mut self) -> Vec<u32> {
        let mut pids: Vec<u32> = self.nodes.iter_mut().flat_map(RealNode::pids).collect();
        if let Some(plane) = &mut self.plane {
            pids.extend(plane.pids());
        }
        pids
    }

    /// Deletes the nodes' pods, then stops the nodes and the control plane
    /// and removes what they added to the host.
    pub async fn shutdown(mut self) {
        self.teardown().await;
    }

    async fn teardown(&mut self) {
        if let Some(plane) = &mut self.plane {
            // Nothing may make or place a pod while the nodes' pods go.
            if let Err(e) = plane.stop_controllers().await {
                tracing::warn!(error = %e, "cannot stop the controllers");
            }
        }
        if let Some(plane) = &self.plane
            && let Ok(client) = plane.client().await
        {
            for node in &self.nodes {
                if let Err(e) = drain(&client, node.name()).await {
                    tracing::warn!(node = node.name(), error = %e, "cannot delete the node's pods; stopping it anyway");
                }
            }
        }
        if let Some(net) = &self.net {
            for node in &mut self.nodes {
                node.teardown(net).await;
            }
        }
        self.nodes.clear();
        if let Some(plane) = self.plane.take()
            && let Err(e) = plane.stop().await
        {
            tracing::warn!(error = %e, "cannot stop the control plane");
        }
        if let Some(net) = self.net.take() {
            net.remove().await;
        }
    }
}

/// Deletes `node`'s pods and waits (30 s at most) until the kubelet has
/// stopped them all, releasing their network and mounts.
async fn drain(client: &Client, node: &str) -> Result<(), RealNodeError> {
    let pods: Api<Pod> = Api::all(client.clone());
    let on_node = ListParams::default().fields(&format!("spec.nodeName={node}"));
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let list = pods
            .list(&on_node)
            .await
            .map_err(RealNodeError::api("listing a node's pods"))?;
        if list.items.is_empty() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(RealNodeError::NotReady(format!(
                "{} pods still on {node} after 30 s",
                list.items.len()
            )));
        }
        for pod in &list.items {
            let (Some(ns), Some(name)) = (
                pod.metadata.namespace.as_deref(),
                pod.metadata.name.as_deref(),
            ) else {
                continue;
            };
            if pod.metadata.deletion_timestamp.is_none() {
                let api: Api<Pod> = Api::namespaced(client.clone(), ns);
                let _ = api.delete(name, &DeleteParams::default()).await;
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}
