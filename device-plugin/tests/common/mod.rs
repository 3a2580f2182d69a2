//! The simulator's kubelet (`gpupool-sim`'s `RunningKubelet`, speaking
//! Registration, the plugin's DevicePlugin service and PodResources over
//! real unix sockets, on the simulator's in-memory API server) as the
//! plugin's node, and a handle on the real `gpupool-device-plugin` binary.

#![allow(dead_code, clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use gpupool_device_plugin::proto::deviceplugin::v1beta1 as dp;
use gpupool_device_plugin::proto::deviceplugin::v1beta1::device_plugin_client::DevicePluginClient;
use gpupool_device_plugin::transport;
use gpupool_sim::apiserver::{ApiServer, ApiServerConfig, RunningApiServer};
use gpupool_sim::cluster::kubelet::{KubeletConfig, RunningKubelet};
use gpupool_sim::cluster::workload::{phase, wait_pod};
use k8s_openapi::api::core::v1::{Container, Pod, PodSpec, ResourceRequirements};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::{Api, ObjectMeta, PostParams};
use tonic::transport::Channel;

/// Upper bound of every wait in these tests.
pub const WAIT: Duration = Duration::from_secs(15);

/// The node the kubelet runs.
pub const NODE: &str = "node-1";

/// The resource the plugin advertises unless told otherwise.
pub const RESOURCE: &str = "gpupool/slot";

/// Polls `check` every 20 ms until it returns Some, at most `WAIT`.
pub async fn wait_for<T>(what: &str, mut check: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(value) = check() {
            return value;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Like [`wait_for`], for a check that awaits.
pub async fn wait_for_async<T, F: Future<Output = Option<T>>>(
    what: &str,
    mut check: impl FnMut() -> F,
) -> T {
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The simulator's kubelet for node `node-1` in a temp directory, on its
/// own in-memory API server.
pub struct TestKubelet {
    kubelet: RunningKubelet,
    client: kube::Client,
    _api: RunningApiServer,
    dir: tempfile::TempDir,
}

impl TestKubelet {
    pub async fn start() -> Self {
        let api = ApiServer::start(ApiServerConfig::default())
            .await
            .expect("in-memory API server");
        let client = api.client().await.expect("API client");
        let dir = tempfile::tempdir().expect("temp kubelet dir");
        let kubelet = RunningKubelet::start(KubeletConfig {
            node_name: NODE.into(),
            dir: dir.path().to_path_buf(),
            client: client.clone(),
            max_termination: Duration::from_millis(200),
            index: 1,
            annotate_allocations: false,
        })
        .await
        .expect("kubelet starts");
        TestKubelet {
            kubelet,
            client,
            _api: api,
            dir,
        }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    pub fn plugin_socket(&self) -> PathBuf {
        self.path().join("device-plugins/gpupool.sock")
    }

    /// Restarts as a kubelet does: wipes `device-plugins/` and serves a fresh
    /// registration socket; plugins must register again.
    pub async fn restart(&mut self) {
        self.kubelet.restart().await.expect("kubelet restarts");
    }

    /// Successful registrations so far.
    pub fn registrations(&self) -> usize {
        usize::try_from(self.kubelet.registrations()).unwrap()
    }

    pub async fn wait_registrations(&self, n: usize) {
        wait_for(&format!("{n} registration(s)"), || {
            (self.registrations() >= n).then_some(())
        })
        .await;
    }

    /// The registrations the kubelet accepted, oldest first.
    pub fn registration_requests(&self) -> Vec<dp::RegisterRequest> {
        self.kubelet.registration_requests()
    }

    /// What the plugin for `resource` answered to GetDevicePluginOptions.
    pub fn plugin_options(&self, resource: &str) -> Option<dp::DevicePluginOptions> {
        self.kubelet.plugin_options(resource)
    }

    /// The last ListAndWatch list of `gpupool/slot`, if any.
    pub fn devices(&self) -> Option<Vec<dp::Device>> {
        self.kubelet.listed_devices(RESOURCE)
    }

    /// Waits until the last ListAndWatch list satisfies `check`.
    pub async fn wait_devices(
        &self,
        what: &str,
        check: impl Fn(&[dp::Device]) -> bool,
    ) -> Vec<dp::Device> {
        wait_for(what, || self.devices().filter(|d| check(d))).await
    }

    /// Creates pod `default/name` on this node asking for `slots` of
    /// `gpupool/slot`, waits until the kubelet runs it (its devices
    /// allocated by the plugin) and returns the device IDs it got.
    pub async fn run_pod(&self, name: &str, slots: u32) -> Vec<String> {
        let amount = BTreeMap::from([(RESOURCE.to_owned(), Quantity(slots.to_string()))]);
        let pod = Pod {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("default".into()),
                ..Default::default()
            },
            spec: Some(PodSpec {
                // Bound at creation: no scheduler here.
                node_name: Some(NODE.into()),
                containers: vec![Container {
                    name: "main".into(),
                    image: Some("registry.example/gpu:1".into()),
                    resources: Some(ResourceRequirements {
                        requests: Some(amount.clone()),
                        limits: Some(amount),
                        ..Default::default()
                    }),
                    ..Default::default()
                }],
                ..Default::default()
            }),
            ..Default::default()
        };
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), "default");
        pods.create(&PostParams::default(), &pod)
            .await
            .expect("create pod");
        wait_pod(&pods, name, WAIT, |p| phase(p) == "Running")
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        self.kubelet
            .allocated_devices("default", name, RESOURCE)
            .expect("a running pod holds its devices")
    }

    /// A client on the plugin socket.
    pub async fn plugin(&self) -> DevicePluginClient<Channel> {
        let channel = transport::connect_unix(self.plugin_socket())
            .await
            .expect("dial plugin");
        DevicePluginClient::new(channel)
    }
}

/// The real plugin binary, killed when dropped.
pub struct Plugin {
    child: Option<Child>,
    pub log: PathBuf,
    _log_dir: tempfile::TempDir,
}

pub fn binary() -> &'static str {
    env!("CARGO_BIN_EXE_gpupool-device-plugin")
}

/// A kubeconfig pointing at a port where nothing listens.
pub fn unreachable_kubeconfig(dir: &Path) -> PathBuf {
    let path = dir.join("kubeconfig");
    std::fs::write(
        &path,
        "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster: {server: 'http://127.0.0.1:9'}\n\
         contexts:\n- name: c\n  context: {cluster: c, user: u}\ncurrent-context: c\nusers:\n- name: u\n  user: {}\n",
    )
    .expect("write kubeconfig");
    path
}

impl Plugin {
    /// Starts the plugin against `kubelet_dir` with `args` (metrics on a free
    /// loopback port, an unreachable API server).
    pub fn start(kubelet_dir: &Path, args: &[&str]) -> Self {
        Self::start_with_env(kubelet_dir, args, &[])
    }

    /// Like [`Plugin::start`], with extra environment variables.
    pub fn start_with_env(kubelet_dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Self {
        let log_dir = tempfile::tempdir().expect("log dir");
        let log = log_dir.path().join("plugin.log");
        let kubeconfig = unreachable_kubeconfig(log_dir.path());
        let child = Command::new(binary())
            .arg("--kubelet-dir")
            .arg(kubelet_dir)
            .args(["--metrics-address", "127.0.0.1", "--metrics-port", "0"])
            .args(args)
            .env("KUBECONFIG", kubeconfig)
            .env("RUST_LOG", "info")
            .env_remove("NODE_NAME")
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log file"))
            .spawn()
            .expect("start plugin");
        Plugin {
            child: Some(child),
            log,
            _log_dir: log_dir,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The metrics address the plugin logged.
    pub async fn metrics_addr(&self) -> String {
        wait_for("metrics address in the log", || {
            let logs = self.logs();
            let line = logs.lines().find(|l| l.contains("serving /metrics"))?;
            let addr = line.split("addr=").nth(1)?;
            Some(addr.split_whitespace().next()?.to_owned())
        })
        .await
    }

    /// GETs `path` from the metrics endpoint: (status line, body).
    pub async fn http_get(&self, path: &str) -> (String, String) {
        let addr = self.metrics_addr().await;
        let path = path.to_owned();
        tokio::task::spawn_blocking(move || {
            let mut stream = std::net::TcpStream::connect(&addr).expect("connect metrics");
            stream.set_read_timeout(Some(WAIT)).expect("timeout");
            write!(
                stream,
                "GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n"
            )
            .expect("send");
            let mut text = String::new();
            stream.read_to_string(&mut text).expect("read");
            let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
            (
                head.lines().next().unwrap_or("").to_owned(),
                body.to_owned(),
            )
        })
        .await
        .expect("http task")
    }

    pub fn signal(&self, name: &str) {
        let status = Command::new("kill")
            .args([format!("-{name}"), self.pid().to_string()])
            .status()
            .expect("kill");
        assert!(status.success());
    }

    /// Waits (bounded) for the process to exit.
    pub async fn wait_exit(&mut self) -> ExitStatus {
        let mut child = self.child.take().expect("running");
        wait_for("plugin exit", || child.try_wait().expect("try_wait")).await
    }
}

impl Drop for Plugin {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Runs the binary to completion with `args` (bounded): (exit code, stderr).
pub fn run_to_exit(args: &[&str]) -> (Option<i32>, String) {
    let dir = tempfile::tempdir().expect("dir");
    let mut command = Command::new(binary());
    if !args.contains(&"--kubelet-dir") {
        command.arg("--kubelet-dir").arg(dir.path());
    }
    command.args(["--metrics-address", "127.0.0.1"]);
    if !args.contains(&"--metrics-port") {
        command.args(["--metrics-port", "0"]);
    }
    let mut child = command
        .args(args)
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start");
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            let mut stderr = String::new();
            child
                .stderr
                .take()
                .expect("stderr")
                .read_to_string(&mut stderr)
                .expect("read");
            return (status.code(), stderr);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("binary did not exit with {args:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Writes a static config of GPUs `(index, uuid, healthy)` with vendor NVIDIA.
pub fn write_config(path: &Path, gpus: &[(u32, &str, bool)]) {
    let text: String = gpus
        .iter()
        .map(|(index, uuid, healthy)| {
            format!("- {{index: {index}, uuid: {uuid}, product: Test GPU, vendor: NVIDIA, memoryMiB: 1024, healthy: {healthy}}}\n")
        })
        .collect();
    // Write then rename, so the plugin never reads half a file.
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).expect("write config");
    std::fs::rename(&tmp, path).expect("rename config");
}
