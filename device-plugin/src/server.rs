//! The kubelet-facing `DevicePlugin` gRPC service.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;

use futures::{Stream, StreamExt};
use gpupool_api::names::{ENV_GPU_INDICES, ENV_GPU_UUIDS, ENV_NVIDIA_VISIBLE_DEVICES};
use tokio::sync::watch;
use tokio_stream::wrappers::WatchStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::discovery::Gpu;
use crate::discovery::nvml::NVIDIA_VENDOR;
use crate::metrics::Metrics;
use crate::proto::deviceplugin::v1beta1 as api;
use crate::proto::deviceplugin::v1beta1::device_plugin_server::DevicePlugin;
use crate::slots::{HEALTHY, SlotTable, UNHEALTHY};

/// Control device nodes every NVIDIA container needs, handed out when present.
pub const NVIDIA_CONTROL_DEVICES: [&str; 3] = ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"];

/// The options this plugin registers with and reports.
pub fn plugin_options() -> api::DevicePluginOptions {
    api::DevicePluginOptions {
        pre_start_required: false,
        get_preferred_allocation_available: true,
    }
}

/// The `DevicePlugin` service over the current slot table.
#[derive(Clone)]
pub struct DevicePluginService {
    table: watch::Receiver<Arc<SlotTable>>,
    dev_dir: PathBuf,
    metrics: Metrics,
    stop: CancellationToken,
}

impl DevicePluginService {
    /// A service answering from `table`. Device nodes are looked for under
    /// `dev_dir` (where the host's `/dev` is visible to the plugin) and handed
    /// to the kubelet as `/dev/...`. ListAndWatch streams end when `stop` fires.
    pub fn new(
        table: watch::Receiver<Arc<SlotTable>>,
        dev_dir: PathBuf,
        metrics: Metrics,
        stop: CancellationToken,
    ) -> Self {
        DevicePluginService {
            table,
            dev_dir,
            metrics,
            stop,
        }
    }

    fn current(&self) -> Arc<SlotTable> {
        self.table.borrow().clone()
    }

    /// Builds the response for one container, or the error naming the first
    /// bad device.
    pub fn allocate_container(
        &self,
        table: &SlotTable,
        position: usize,
        request: &api::ContainerAllocateRequest,
    ) -> Result<api::ContainerAllocateResponse, Status> {
        if request.devices_ids.is_empty() {
            return Err(Status::invalid_argument(format!(
                "container request {position} lists no device IDs"
            )));
        }
        let mut gpus: Vec<&Gpu> = Vec::new();
        let mut seen: BTreeSet<&str> = BTreeSet::new();
        for id in &request.devices_ids {
            if !seen.insert(id) {
                return Err(Status::invalid_argument(format!(
                    "device ID {id:?} is listed twice in container request {position}"
                )));
            }
            let Some(slot) = table.lookup(id) else {
                return Err(Status::invalid_argument(format!(
                    "unknown device ID {id:?} in container request {position}: this plugin advertises no such device"
                )));
            };
            if !slot.gpu.node.healthy {
                return Err(Status::failed_precondition(format!(
                    "device ID {id:?} is {UNHEALTHY}: GPU {} ({}) failed its health check",
                    slot.gpu.node.index, slot.gpu.node.uuid
                )));
            }
            if !gpus.iter().any(|g| g.node.uuid == slot.gpu.node.uuid) {
                gpus.push(slot.gpu);
            }
        }
        gpus.sort_by_key(|g| g.node.index);
        let uuids = gpus
            .iter()
            .map(|g| g.node.uuid.as_str())
            .collect::<Vec<_>>()
            .join(",");
        let indices = gpus
            .iter()
            .map(|g| g.node.index.to_string())
            .collect::<Vec<_>>()
            .join(",");
        let envs = [
            (ENV_NVIDIA_VISIBLE_DEVICES.to_owned(), uuids.clone()),
            (ENV_GPU_INDICES.to_owned(), indices),
            (ENV_GPU_UUIDS.to_owned(), uuids),
        ]
        .into_iter()
        .collect();
        Ok(api::ContainerAllocateResponse {
            envs,
            devices: self.device_nodes(&gpus),
            ..Default::default()
        })
    }

    fn device_nodes(&self, gpus: &[&Gpu]) -> Vec<api::DeviceSpec> {
        let nvidia: Vec<&&Gpu> = gpus
            .iter()
            .filter(|g| g.node.vendor == NVIDIA_VENDOR)
            .collect();
        if nvidia.is_empty() {
            return Vec::new();
        }
        nvidia
            .iter()
            .map(|g| format!("nvidia{}", g.device_minor()))
            .chain(NVIDIA_CONTROL_DEVICES.iter().map(|d| (*d).to_owned()))
            .filter(|name| self.dev_dir.join(name).exists())
            .map(|name| api::DeviceSpec {
                container_path: format!("/dev/{name}"),
                host_path: format!("/dev/{name}"),
                permissions: "rw".to_owned(),
            })
            .collect()
    }
}

/// The full device list the kubelet is sent.
pub fn list_response(table: &SlotTable) -> api::ListAndWatchResponse {
    api::ListAndWatchResponse {
        devices: table
            .devices()
            .map(|(id, healthy)| api::Device {
                id,
                health: if healthy { HEALTHY } else { UNHEALTHY }.to_owned(),
                topology: None,
            })
            .collect(),
    }
}

type DeviceStream = Pin<Box<dyn Stream<Item = Result<api::ListAndWatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl DevicePlugin for DevicePluginService {
    async fn get_device_plugin_options(
        &self,
        _request: Request<api::Empty>,
    ) -> Result<Response<api::DevicePluginOptions>, Status> {
        Ok(Response::new(plugin_options()))
    }

    type ListAndWatchStream = DeviceStream;

    async fn list_and_watch(
        &self,
        _request: Request<api::Empty>,
    ) -> Result<Response<Self::ListAndWatchStream>, Status> {
        // WatchStream yields the current table at once, then every change.
        let stream = WatchStream::new(self.table.clone())
            .map(|table| {
                let response = list_response(&table);
                tracing::debug!(devices = response.devices.len(), "sending device list");
                Ok(response)
            })
            .take_until(self.stop.clone().cancelled_owned());
        Ok(Response::new(Box::pin(stream)))
    }

    async fn get_preferred_allocation(
        &self,
        request: Request<api::PreferredAllocationRequest>,
    ) -> Result<Response<api::PreferredAllocationResponse>, Status> {
        let table = self.current();
        let container_responses = request
            .into_inner()
            .container_requests
            .iter()
            .enumerate()
            .map(|(position, c)| {
                table
                    .preferred(
                        &c.available_device_i_ds,
                        &c.must_include_device_i_ds,
                        c.allocation_size,
                    )
                    .map(|device_i_ds| api::ContainerPreferredAllocationResponse { device_i_ds })
                    .map_err(|e| {
                        Status::invalid_argument(format!("container request {position}: {e}"))
                    })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Response::new(api::PreferredAllocationResponse {
            container_responses,
        }))
    }

    async fn allocate(
        &self,
        request: Request<api::AllocateRequest>,
    ) -> Result<Response<api::AllocateResponse>, Status> {
        let request = request.into_inner();
        let table = self.current();
        let result = if request.container_requests.is_empty() {
            Err(Status::invalid_argument(
                "AllocateRequest has no container requests",
            ))
        } else {
            request
                .container_requests
                .iter()
                .enumerate()
                .map(|(position, c)| self.allocate_container(&table, position, c))
                .collect::<Result<Vec<_>, _>>()
        };
        self.metrics.allocation(result.is_ok());
        match result {
            Ok(container_responses) => {
                tracing::info!(
                    containers = container_responses.len(),
                    devices = ?request.container_requests.iter().map(|c| c.devices_ids.as_slice()).collect::<Vec<_>>(),
                    "allocated"
                );
                Ok(Response::new(api::AllocateResponse {
                    container_responses,
                }))
            }
            Err(status) => {
                tracing::warn!(error = %status.message(), "allocate refused");
                Err(status)
            }
        }
    }

    async fn pre_start_container(
        &self,
        request: Request<api::PreStartContainerRequest>,
    ) -> Result<Response<api::PreStartContainerResponse>, Status> {
        let table = self.current();
        if let Some(unknown) = request
            .get_ref()
            .devices_ids
            .iter()
            .find(|id| table.lookup(id).is_none())
        {
            return Err(Status::invalid_argument(format!(
                "unknown device ID {unknown:?}"
            )));
        }
        Ok(Response::new(api::PreStartContainerResponse {}))
    }
}
