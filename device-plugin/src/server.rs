//! The kubelet-facing `DevicePlugin` gRPC service.

use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;

use futures::{Stream, StreamExt};
use gpupool_api::names::ENV_NVIDIA_VISIBLE_DEVICES;
use tokio::sync::watch;
use tokio_stream::wrappers::WatchStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::cdi::{CDI_ANNOTATION_KEY, CdiKind, DeviceListStrategies, NVIDIA_VISIBLE_DEVICES_VOID};
use crate::metrics::Metrics;
use crate::proto::deviceplugin::v1beta1 as api;
use crate::proto::deviceplugin::v1beta1::device_plugin_server::DevicePlugin;
use crate::slots::{AllocError, Allocation, HEALTHY, SlotTable, UNHEALTHY};

pub use crate::slots::NVIDIA_CONTROL_DEVICES;

/// The options this plugin registers with and reports.
pub fn plugin_options() -> api::DevicePluginOptions {
    api::DevicePluginOptions {
        pre_start_required: false,
        get_preferred_allocation_available: true,
    }
}

/// How Allocate names the GPUs to the container runtime.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeviceListing {
    /// `--device-list-strategy`.
    pub strategies: DeviceListStrategies,
    /// `--cdi-kind`.
    pub cdi_kind: CdiKind,
}

/// Turns an [`Allocation`] into the kubelet's answer for one container,
/// applying the device-list strategies:
///
/// - `envvar`: the allocation's environment (`NVIDIA_VISIBLE_DEVICES` with
///   the UUIDs) and its device nodes.
/// - `cdi-annotations`: annotation [`CDI_ANNOTATION_KEY`] with the GPUs'
///   qualified CDI names, comma-separated.
/// - `cdi-cri`: the same names as `cdi_devices`.
///
/// `GPUPOOL_GPU_INDICES` and `GPUPOOL_GPU_UUIDS` are always set. Without
/// `envvar`, `NVIDIA_VISIBLE_DEVICES` is `void` and no device nodes are
/// passed: the CDI spec brings the device nodes, and `void` keeps a legacy
/// NVIDIA runtime from injecting the `all` that CUDA images ask for.
pub fn container_response(
    allocation: &Allocation,
    listing: &DeviceListing,
) -> api::ContainerAllocateResponse {
    let strategies = &listing.strategies;
    let mut response = api::ContainerAllocateResponse {
        envs: allocation.envs.iter().cloned().collect(),
        ..Default::default()
    };
    if strategies.envvar {
        response.devices = allocation
            .device_nodes
            .iter()
            .map(|path| api::DeviceSpec {
                container_path: path.clone(),
                host_path: path.clone(),
                permissions: "rw".to_owned(),
            })
            .collect();
    } else {
        response.envs.insert(
            ENV_NVIDIA_VISIBLE_DEVICES.to_owned(),
            NVIDIA_VISIBLE_DEVICES_VOID.to_owned(),
        );
    }
    if strategies.any_cdi() {
        let names: Vec<String> = allocation
            .gpus
            .iter()
            .map(|g| listing.cdi_kind.qualified(&g.uuid))
            .collect();
        if strategies.cdi_annotations {
            response
                .annotations
                .insert(CDI_ANNOTATION_KEY.to_owned(), names.join(","));
        }
        if strategies.cdi_cri {
            response.cdi_devices = names
                .into_iter()
                .map(|name| api::CdiDevice { name })
                .collect();
        }
    }
    response
}

/// The gRPC status for a refused container request.
fn alloc_status(position: usize, error: &AllocError) -> Status {
    let message = format!("container request {position}: {error}");
    if error.is_unavailable() {
        Status::failed_precondition(message)
    } else {
        Status::invalid_argument(message)
    }
}

/// The `DevicePlugin` service over the current slot table.
#[derive(Clone)]
pub struct DevicePluginService {
    table: watch::Receiver<Arc<SlotTable>>,
    dev_dir: PathBuf,
    listing: DeviceListing,
    metrics: Metrics,
    stop: CancellationToken,
}

impl DevicePluginService {
    /// A service answering from `table`. Device nodes are looked for under
    /// `dev_dir` (where the host's `/dev` is visible to the plugin) and handed
    /// to the kubelet as `/dev/...`; `listing` says how GPUs are named to the
    /// container runtime. ListAndWatch streams end when `stop` fires.
    pub fn new(
        table: watch::Receiver<Arc<SlotTable>>,
        dev_dir: PathBuf,
        listing: DeviceListing,
        metrics: Metrics,
        stop: CancellationToken,
    ) -> Self {
        DevicePluginService {
            table,
            dev_dir,
            listing,
            metrics,
            stop,
        }
    }

    fn current(&self) -> Arc<SlotTable> {
        self.table.borrow().clone()
    }

    /// Builds the response for one container, or the status naming the
    /// first bad device.
    pub fn allocate_container(
        &self,
        table: &SlotTable,
        position: usize,
        request: &api::ContainerAllocateRequest,
    ) -> Result<api::ContainerAllocateResponse, Status> {
        table
            .allocate(&request.devices_ids, &self.dev_dir)
            .map(|allocation| container_response(&allocation, &self.listing))
            .map_err(|e| alloc_status(position, &e))
    }
}

/// The full device list the kubelet is sent.
pub fn list_response(table: &SlotTable) -> api::ListAndWatchResponse {
    api::ListAndWatchResponse {
        devices: table
            .devices()
            .map(|(id, healthy, numa_node)| api::Device {
                id,
                health: if healthy { HEALTHY } else { UNHEALTHY }.to_owned(),
                topology: numa_node.map(|node| api::TopologyInfo {
                    nodes: vec![api::NumaNode {
                        id: i64::from(node),
                    }],
                }),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::slots::AllocatedGpu;

    fn allocation() -> Allocation {
        Allocation {
            gpus: vec![
                AllocatedGpu {
                    index: 0,
                    uuid: "GPU-a".to_owned(),
                },
                AllocatedGpu {
                    index: 2,
                    uuid: "GPU-c".to_owned(),
                },
            ],
            envs: vec![
                (
                    "NVIDIA_VISIBLE_DEVICES".to_owned(),
                    "GPU-a,GPU-c".to_owned(),
                ),
                ("GPUPOOL_GPU_INDICES".to_owned(), "0,2".to_owned()),
                ("GPUPOOL_GPU_UUIDS".to_owned(), "GPU-a,GPU-c".to_owned()),
            ],
            device_nodes: vec!["/dev/nvidia0".to_owned(), "/dev/nvidiactl".to_owned()],
        }
    }

    #[test]
    fn device_list_strategies_shape_the_response() {
        struct Case {
            strategies: &'static str,
            kind: &'static str,
            visible: &'static str,
            device_nodes: usize,
            annotation: Option<&'static str>,
            cdi_devices: &'static [&'static str],
        }
        let cases = [
            Case {
                strategies: "envvar",
                kind: "nvidia.com/gpu",
                visible: "GPU-a,GPU-c",
                device_nodes: 2,
                annotation: None,
                cdi_devices: &[],
            },
            Case {
                strategies: "cdi-annotations",
                kind: "nvidia.com/gpu",
                visible: "void",
                device_nodes: 0,
                annotation: Some("nvidia.com/gpu=GPU-a,nvidia.com/gpu=GPU-c"),
                cdi_devices: &[],
            },
            Case {
                strategies: "cdi-cri",
                kind: "example.com/gpu",
                visible: "void",
                device_nodes: 0,
                annotation: None,
                cdi_devices: &["example.com/gpu=GPU-a", "example.com/gpu=GPU-c"],
            },
            Case {
                strategies: "cdi-annotations,cdi-cri",
                kind: "nvidia.com/gpu",
                visible: "void",
                device_nodes: 0,
                annotation: Some("nvidia.com/gpu=GPU-a,nvidia.com/gpu=GPU-c"),
                cdi_devices: &["nvidia.com/gpu=GPU-a", "nvidia.com/gpu=GPU-c"],
            },
            Case {
                strategies: "envvar,cdi-cri",
                kind: "nvidia.com/gpu",
                visible: "GPU-a,GPU-c",
                device_nodes: 2,
                annotation: None,
                cdi_devices: &["nvidia.com/gpu=GPU-a", "nvidia.com/gpu=GPU-c"],
            },
        ];
        for case in cases {
            let listing = DeviceListing {
                strategies: DeviceListStrategies::parse(case.strategies).expect("strategies"),
                cdi_kind: CdiKind::parse(case.kind).expect("kind"),
            };
            let r = container_response(&allocation(), &listing);
            let name = case.strategies;
            assert_eq!(r.envs["NVIDIA_VISIBLE_DEVICES"], case.visible, "{name}");
            assert_eq!(r.envs["GPUPOOL_GPU_INDICES"], "0,2", "{name}");
            assert_eq!(r.envs["GPUPOOL_GPU_UUIDS"], "GPU-a,GPU-c", "{name}");
            assert_eq!(r.devices.len(), case.device_nodes, "{name}");
            assert!(
                r.devices
                    .iter()
                    .all(|d| d.host_path == d.container_path && d.permissions == "rw")
            );
            assert_eq!(
                r.annotations.get(CDI_ANNOTATION_KEY).map(String::as_str),
                case.annotation,
                "{name}"
            );
            assert_eq!(r.annotations.len(), usize::from(case.annotation.is_some()));
            let cdi: Vec<&str> = r.cdi_devices.iter().map(|d| d.name.as_str()).collect();
            assert_eq!(cdi, case.cdi_devices, "{name}");
        }
    }

    #[test]
    fn annotation_key_is_a_valid_cdi_key() {
        // The CDI library accepts `cdi.k8s.io/<name>` with a name of at most
        // 63 characters of letters, digits, '-', '_' and '.'.
        let name = CDI_ANNOTATION_KEY
            .strip_prefix(crate::cdi::CDI_ANNOTATION_PREFIX)
            .expect("prefix");
        assert!(name.len() <= 63);
        assert!(
            name.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        );
    }

    #[test]
    fn refusals_map_to_status_codes() {
        let cases = [
            (AllocError::NoDevices, tonic::Code::InvalidArgument),
            (
                AllocError::UnknownDevice("x".to_owned()),
                tonic::Code::InvalidArgument,
            ),
            (
                AllocError::Duplicate("x".to_owned()),
                tonic::Code::InvalidArgument,
            ),
            (
                AllocError::Unhealthy {
                    id: "x".to_owned(),
                    index: 0,
                    uuid: "GPU-x".to_owned(),
                },
                tonic::Code::FailedPrecondition,
            ),
        ];
        for (error, code) in cases {
            let status = alloc_status(3, &error);
            assert_eq!(status.code(), code, "{error}");
            assert!(status.message().starts_with("container request 3: "));
        }
    }
}
