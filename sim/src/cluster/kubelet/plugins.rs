//! The device-plugin side of the kubelet: connecting back to a registered
//! plugin, consuming its ListAndWatch stream into the [`DeviceBook`], and
//! replacing the endpoint when the same resource registers again.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use gpupool_kubelet_api::proto::deviceplugin::v1beta1::{
    DevicePluginOptions, Empty, RegisterRequest, device_plugin_client::DevicePluginClient,
};
use gpupool_kubelet_api::transport::{TransportError, connect_unix};
use tonic::transport::Channel;

use super::Shared;
#[cfg(doc)]
use super::devices::DeviceBook;

/// Device health value a plugin reports for a usable device.
pub const HEALTHY: &str = "Healthy";

/// How long the kubelet waits to connect back to a plugin that registered.
pub const DIAL_TIMEOUT: Duration = Duration::from_secs(5);

/// Why a plugin that registered could not be connected to.
#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    /// The plugin's socket did not accept a connection.
    #[error("cannot dial the device plugin back: {0}")]
    Dial(#[from] TransportError),
    /// The plugin's socket did not answer in time.
    #[error("device plugin socket {0} did not answer within {DIAL_TIMEOUT:?}")]
    Timeout(PathBuf),
    /// The plugin failed GetDevicePluginOptions, which the kubelet asks
    /// before using it.
    #[error("the device plugin failed GetDevicePluginOptions: {0}")]
    Options(String),
}

/// A registered plugin the kubelet talks to.
pub struct PluginEndpoint {
    /// Socket file name inside `device-plugins/`.
    pub endpoint: String,
    /// Registration number, so a replaced endpoint's stream cannot touch state.
    pub generation: u64,
    /// Client for Allocate and GetPreferredAllocation.
    pub client: DevicePluginClient<Channel>,
    /// Whether the plugin implements GetPreferredAllocation.
    pub preferred_allocation: bool,
    /// What the plugin answered to GetDevicePluginOptions.
    pub options: DevicePluginOptions,
    watcher: tokio::task::AbortHandle,
}

impl PluginEndpoint {
    /// Stops consuming the plugin's ListAndWatch stream.
    pub fn disconnect(&self) {
        self.watcher.abort();
    }
}

/// Dials the plugin named by a valid registration and starts consuming its
/// devices; a previous endpoint for the same resource is replaced.
pub async fn connect(shared: Arc<Shared>, req: RegisterRequest) -> Result<(), PluginError> {
    let path = shared
        .dir
        .join(super::DEVICE_PLUGINS_DIR)
        .join(&req.endpoint);
    let channel = tokio::time::timeout(DIAL_TIMEOUT, connect_unix(&path))
        .await
        .map_err(|_| PluginError::Timeout(path.clone()))??;
    let mut client = DevicePluginClient::new(channel);
    // Like the kubelet, trust the options the plugin answers over those it
    // registered with.
    let options = tokio::time::timeout(DIAL_TIMEOUT, client.get_device_plugin_options(Empty {}))
        .await
        .map_err(|_| PluginError::Timeout(path.clone()))?
        .map_err(|status| PluginError::Options(status.message().to_owned()))?
        .into_inner();
    let resource = req.resource_name.clone();
    let generation = shared.next_generation();
    let old = {
        let mut state = shared.lock();
        // Started under the lock: the watcher's first update asks which
        // endpoint is current, and must find this one, not the one it
        // replaces (which would make it stop, leaving the old devices).
        let watcher = tokio::spawn(watch_devices(
            shared.clone(),
            client.clone(),
            resource.clone(),
            generation,
        ))
        .abort_handle();
        let endpoint = PluginEndpoint {
            endpoint: req.endpoint.clone(),
            generation,
            client,
            preferred_allocation: options.get_preferred_allocation_available,
            options,
            watcher,
        };
        state.record_registration(req.clone());
        state.listed.remove(&resource);
        state.plugins.insert(resource.clone(), endpoint)
    };
    if let Some(old) = old {
        old.disconnect();
        tracing::info!(node = %shared.node_name, resource, old = %old.endpoint, new = %req.endpoint, "device plugin registered again; replaced the old endpoint");
    } else {
        tracing::info!(node = %shared.node_name, resource, endpoint = %req.endpoint, "device plugin registered");
    }
    shared.registered.send_modify(|n| *n += 1);
    Ok(())
}

async fn watch_devices(
    shared: Arc<Shared>,
    mut client: DevicePluginClient<Channel>,
    resource: String,
    generation: u64,
) {
    let stream = client.list_and_watch(Empty {}).await;
    let mut stream = match stream {
        Ok(s) => s.into_inner(),
        Err(e) => {
            tracing::warn!(node = %shared.node_name, resource, error = %e, "ListAndWatch failed");
            lost(&shared, &resource, generation);
            return;
        }
    };
    // The first list is written to the Node at once; later changes (a
    // device's health) reach its allocatable at the next status update, as
    // with kubelet, whose device manager admits pods against them at once:
    // a pod bound in between is refused (UnexpectedAdmissionError).
    let mut listed_once = false;
    loop {
        match stream.message().await {
            Ok(Some(update)) => {
                let current = {
                    let mut state = shared.lock();
                    let current = state
                        .plugins
                        .get(&resource)
                        .is_none_or(|p| p.generation == generation);
                    if current {
                        state
                            .listed
                            .insert(resource.clone(), update.devices.clone());
                        state.book.set_devices(
                            &resource,
                            update
                                .devices
                                .iter()
                                .map(|d| (d.id.clone(), d.health == HEALTHY)),
                        );
                    }
                    current
                };
                if !current {
                    return;
                }
                tracing::info!(node = %shared.node_name, resource, devices = update.devices.len(), "device list updated");
                if !std::mem::replace(&mut listed_once, true) {
                    shared.node_dirty.notify_one();
                }
            }
            Ok(None) => break,
            Err(e) => {
                tracing::warn!(node = %shared.node_name, resource, error = %e, "ListAndWatch stream failed");
                break;
            }
        }
    }
    lost(&shared, &resource, generation);
}

/// The plugin's stream ended: its devices stay in capacity but none is
/// allocatable until it registers again, as with kubelet.
fn lost(shared: &Shared, resource: &str, generation: u64) {
    let mut state = shared.lock();
    if state
        .plugins
        .get(resource)
        .is_some_and(|p| p.generation == generation)
    {
        state.plugins.remove(resource);
        state.listed.remove(resource);
        state.book.mark_unhealthy(resource);
        drop(state);
        tracing::warn!(node = %shared.node_name, resource, "device plugin went away; its devices are unhealthy until it registers again");
        shared.node_dirty.notify_one();
    }
}

#[cfg(test)]
mod tests {
    use std::pin::Pin;

    use futures::Stream;
    use gpupool_kubelet_api::proto::deviceplugin::v1beta1::{
        AllocateRequest, AllocateResponse, ListAndWatchResponse, PreStartContainerRequest,
        PreStartContainerResponse, PreferredAllocationRequest, PreferredAllocationResponse,
        device_plugin_server::{DevicePlugin, DevicePluginServer},
        registration_client::RegistrationClient,
    };
    use gpupool_kubelet_api::transport::serve_unix;
    use gpupool_sim_apiserver::{ApiServer, ApiServerConfig};
    use tokio_util::sync::CancellationToken;
    use tonic::{Code, Request, Response, Status};

    use super::*;
    use crate::cluster::kubelet::{KubeletConfig, RunningKubelet};

    /// A plugin that fails GetDevicePluginOptions and nothing else matters.
    struct NoOptions;

    #[tonic::async_trait]
    impl DevicePlugin for NoOptions {
        async fn get_device_plugin_options(
            &self,
            _: Request<Empty>,
        ) -> Result<Response<DevicePluginOptions>, Status> {
            Err(Status::internal("options exploded"))
        }

        type ListAndWatchStream =
            Pin<Box<dyn Stream<Item = Result<ListAndWatchResponse, Status>> + Send + 'static>>;

        async fn list_and_watch(
            &self,
            _: Request<Empty>,
        ) -> Result<Response<Self::ListAndWatchStream>, Status> {
            Ok(Response::new(Box::pin(futures::stream::pending())))
        }

        async fn get_preferred_allocation(
            &self,
            _: Request<PreferredAllocationRequest>,
        ) -> Result<Response<PreferredAllocationResponse>, Status> {
            Err(Status::unimplemented("no"))
        }

        async fn allocate(
            &self,
            _: Request<AllocateRequest>,
        ) -> Result<Response<AllocateResponse>, Status> {
            Err(Status::unimplemented("no"))
        }

        async fn pre_start_container(
            &self,
            _: Request<PreStartContainerRequest>,
        ) -> Result<Response<PreStartContainerResponse>, Status> {
            Err(Status::unimplemented("no"))
        }
    }

    #[tokio::test]
    async fn a_plugin_failing_get_device_plugin_options_is_not_registered() {
        let api = ApiServer::start(ApiServerConfig::default())
            .await
            .expect("API server");
        let dir = tempfile::tempdir().expect("kubelet dir");
        let kubelet = RunningKubelet::start(KubeletConfig {
            node_name: "node-1".into(),
            dir: dir.path().to_path_buf(),
            client: api.client().await.expect("client"),
            max_termination: Duration::from_millis(200),
            index: 1,
            annotate_allocations: false,
        })
        .await
        .expect("kubelet");
        let stop = CancellationToken::new();
        let router =
            tonic::transport::Server::builder().add_service(DevicePluginServer::new(NoOptions));
        let socket = dir
            .path()
            .join(super::super::DEVICE_PLUGINS_DIR)
            .join("no.sock");
        let serving = stop.clone();
        tokio::spawn(async move { serve_unix(router, socket, serving.cancelled_owned()).await });
        let channel = connect_unix(kubelet.socket_path())
            .await
            .expect("dial kubelet");
        let mut registration = RegistrationClient::new(channel);
        let request = RegisterRequest {
            version: "v1beta1".into(),
            endpoint: "no.sock".into(),
            resource_name: "example.com/widget".into(),
            options: None,
        };
        // The plugin socket may take a moment to appear; refusals until then
        // are dial errors, not the one under test.
        let mut answer = None;
        for _ in 0..100 {
            match registration.register(request.clone()).await {
                Err(e) if e.message().contains("GetDevicePluginOptions") => {
                    answer = Some(e);
                    break;
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
                Ok(_) => panic!("registered a plugin that failed GetDevicePluginOptions"),
            }
        }
        let err = answer.expect("refused for its options");
        assert_eq!(err.code(), Code::Unavailable);
        assert!(err.message().contains("options exploded"), "{err}");
        assert_eq!(kubelet.registrations(), 0);
        assert!(kubelet.registration_requests().is_empty());
        assert_eq!(kubelet.plugin_options("example.com/widget"), None);
        assert_eq!(kubelet.listed_devices("example.com/widget"), None);
        stop.cancel();
        kubelet.stop().await;
    }
}
