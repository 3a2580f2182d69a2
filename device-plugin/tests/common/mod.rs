//! A test kubelet (Registration + PodResources over real unix sockets, dialling
//! the plugin back like the real kubelet does) and a handle on the real
//! `gpupool-device-plugin` binary.

#![allow(dead_code, clippy::unwrap_used)]

pub mod raw_h2;

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gpupool_device_plugin::proto::deviceplugin::v1beta1 as dp;
use gpupool_device_plugin::proto::deviceplugin::v1beta1::device_plugin_client::DevicePluginClient;
use gpupool_device_plugin::proto::deviceplugin::v1beta1::registration_server::{
    Registration, RegistrationServer,
};
use gpupool_device_plugin::proto::podresources::v1 as pr;
use gpupool_device_plugin::proto::podresources::v1::pod_resources_lister_server::{
    PodResourcesLister, PodResourcesListerServer,
};
use gpupool_device_plugin::transport;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tonic::transport::{Channel, Server};
use tonic::{Request, Response, Status};

/// Upper bound of every wait in these tests.
pub const WAIT: Duration = Duration::from_secs(15);

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

/// What the test kubelet saw.
#[derive(Default)]
pub struct Seen {
    /// Every registration request, in order.
    pub registrations: Vec<dp::RegisterRequest>,
    /// Options the plugin answered after each registration.
    pub options: Vec<dp::DevicePluginOptions>,
}

#[derive(Clone)]
struct KubeletRegistration {
    plugin_dir: PathBuf,
    seen: Arc<Mutex<Seen>>,
    devices: watch::Sender<Option<Vec<dp::Device>>>,
    stop: CancellationToken,
}

#[tonic::async_trait]
impl Registration for KubeletRegistration {
    async fn register(
        &self,
        request: Request<dp::RegisterRequest>,
    ) -> Result<Response<dp::Empty>, Status> {
        let request = request.into_inner();
        if request.version != "v1beta1" {
            return Err(Status::invalid_argument("unsupported version"));
        }
        let endpoint = self.plugin_dir.join(&request.endpoint);
        self.seen.lock().unwrap().registrations.push(request);
        // Like the kubelet: dial the plugin back and keep a ListAndWatch open.
        let this = self.clone();
        tokio::spawn(async move {
            let Ok(channel) = transport::connect_unix(&endpoint).await else {
                return;
            };
            let mut client = DevicePluginClient::new(channel);
            if let Ok(options) = client.get_device_plugin_options(dp::Empty {}).await {
                this.seen.lock().unwrap().options.push(options.into_inner());
            }
            let Ok(stream) = client.list_and_watch(dp::Empty {}).await else {
                return;
            };
            let mut stream = stream.into_inner();
            loop {
                tokio::select! {
                    () = this.stop.cancelled() => return,
                    message = stream.message() => match message {
                        Ok(Some(list)) => { this.devices.send_replace(Some(list.devices)); }
                        _ => return,
                    },
                }
            }
        });
        Ok(Response::new(dp::Empty {}))
    }
}

#[derive(Clone)]
struct KubeletPodResources {
    pods: Arc<Mutex<Vec<pr::PodResources>>>,
}

#[tonic::async_trait]
impl PodResourcesLister for KubeletPodResources {
    async fn list(
        &self,
        _request: Request<pr::ListPodResourcesRequest>,
    ) -> Result<Response<pr::ListPodResourcesResponse>, Status> {
        Ok(Response::new(pr::ListPodResourcesResponse {
            pod_resources: self.pods.lock().unwrap().clone(),
        }))
    }

    async fn get_allocatable_resources(
        &self,
        _request: Request<pr::AllocatableResourcesRequest>,
    ) -> Result<Response<pr::AllocatableResourcesResponse>, Status> {
        Err(Status::unimplemented("not needed"))
    }

    async fn get(
        &self,
        _request: Request<pr::GetPodResourcesRequest>,
    ) -> Result<Response<pr::GetPodResourcesResponse>, Status> {
        Err(Status::unimplemented("not needed"))
    }
}

/// A kubelet serving Registration and PodResources in a temp directory.
pub struct TestKubelet {
    pub dir: tempfile::TempDir,
    pub seen: Arc<Mutex<Seen>>,
    pub devices: watch::Receiver<Option<Vec<dp::Device>>>,
    devices_tx: watch::Sender<Option<Vec<dp::Device>>>,
    pub pods: Arc<Mutex<Vec<pr::PodResources>>>,
    stop: CancellationToken,
}

impl TestKubelet {
    pub async fn start() -> Self {
        let dir = tempfile::tempdir().expect("temp kubelet dir");
        let (devices_tx, devices) = watch::channel(None);
        let mut kubelet = TestKubelet {
            dir,
            seen: Arc::default(),
            devices,
            devices_tx,
            pods: Arc::default(),
            stop: CancellationToken::new(),
        };
        kubelet.serve();
        kubelet
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    pub fn plugin_socket(&self) -> PathBuf {
        self.path().join("device-plugins/gpupool.sock")
    }

    fn serve(&mut self) {
        self.stop = CancellationToken::new();
        let plugin_dir = self.path().join("device-plugins");
        let registration = KubeletRegistration {
            plugin_dir: plugin_dir.clone(),
            seen: self.seen.clone(),
            devices: self.devices_tx.clone(),
            stop: self.stop.clone(),
        };
        let router = Server::builder().add_service(RegistrationServer::new(registration));
        let incoming =
            transport::bind_unix(plugin_dir.join("kubelet.sock")).expect("bind kubelet.sock");
        let stop = self.stop.clone();
        tokio::spawn(async move {
            let _ =
                transport::serve_incoming(router, &plugin_dir, incoming, stop.cancelled_owned())
                    .await;
        });
        let pod_dir = self.path().join("pod-resources");
        let router =
            Server::builder().add_service(PodResourcesListerServer::new(KubeletPodResources {
                pods: self.pods.clone(),
            }));
        let stop = self.stop.clone();
        let incoming =
            transport::bind_unix(pod_dir.join("kubelet.sock")).expect("bind pod-resources");
        tokio::spawn(async move {
            let _ =
                transport::serve_incoming(router, &pod_dir, incoming, stop.cancelled_owned()).await;
        });
    }

    /// Stops, wipes `device-plugins/` like a starting kubelet does, and serves again.
    pub async fn restart(&mut self) {
        self.stop.cancel();
        tokio::time::sleep(Duration::from_millis(100)).await;
        for entry in std::fs::read_dir(self.path().join("device-plugins")).expect("read dir") {
            std::fs::remove_file(entry.expect("entry").path()).expect("remove socket");
        }
        self.devices_tx.send_replace(None);
        self.serve();
    }

    pub fn registrations(&self) -> usize {
        self.seen.lock().unwrap().registrations.len()
    }

    pub async fn wait_registrations(&self, n: usize) {
        wait_for(&format!("{n} registration(s)"), || {
            (self.registrations() >= n).then_some(())
        })
        .await;
    }

    /// Waits until the last ListAndWatch list satisfies `check`.
    pub async fn wait_devices(
        &self,
        what: &str,
        check: impl Fn(&[dp::Device]) -> bool,
    ) -> Vec<dp::Device> {
        wait_for(what, || {
            self.devices.borrow().as_ref().filter(|d| check(d)).cloned()
        })
        .await
    }

    /// A client on the plugin socket.
    pub async fn plugin(&self) -> DevicePluginClient<Channel> {
        let channel = transport::connect_unix(self.plugin_socket())
            .await
            .expect("dial plugin");
        DevicePluginClient::new(channel)
    }
}

impl Drop for TestKubelet {
    fn drop(&mut self) {
        self.stop.cancel();
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
