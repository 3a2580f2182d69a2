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
    let old = {
        let mut state = shared.lock();
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
                shared.node_dirty.notify_one();
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
