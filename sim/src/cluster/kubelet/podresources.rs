//! The kubelet's PodResources v1 service on `pod-resources/kubelet.sock`,
//! answered from the kubelet's own device bookkeeping.

use std::collections::BTreeMap;
use std::sync::Arc;

use gpupool_kubelet_api::proto::podresources::v1::{
    AllocatableResourcesRequest, AllocatableResourcesResponse, ContainerDevices,
    ContainerResources, GetPodResourcesRequest, GetPodResourcesResponse, ListPodResourcesRequest,
    ListPodResourcesResponse, PodResources, pod_resources_lister_server::PodResourcesLister,
};
use tonic::{Request, Response, Status};

use super::Shared;
use super::devices::PodDevices;

/// The gRPC service.
pub struct PodResourcesService {
    pub(super) shared: Arc<Shared>,
}

/// One pod's entry: its app containers with the devices they hold (init
/// containers have finished, so kubelet does not list them).
fn pod_resources(pod: &PodDevices) -> PodResources {
    let mut containers: BTreeMap<&str, Vec<ContainerDevices>> = BTreeMap::new();
    for c in pod.containers.iter().filter(|c| !c.init) {
        containers
            .entry(c.container.as_str())
            .or_default()
            .push(ContainerDevices {
                resource_name: c.resource.clone(),
                device_ids: c.devices.clone(),
                topology: None,
            });
    }
    PodResources {
        name: pod.name.clone(),
        namespace: pod.namespace.clone(),
        containers: containers
            .into_iter()
            .map(|(name, devices)| ContainerResources {
                name: name.to_owned(),
                devices,
                ..Default::default()
            })
            .collect(),
    }
}

#[tonic::async_trait]
impl PodResourcesLister for PodResourcesService {
    async fn list(
        &self,
        _request: Request<ListPodResourcesRequest>,
    ) -> Result<Response<ListPodResourcesResponse>, Status> {
        let state = self.shared.lock();
        let pod_resources = state.book.pods().values().map(pod_resources).collect();
        Ok(Response::new(ListPodResourcesResponse { pod_resources }))
    }

    async fn get_allocatable_resources(
        &self,
        _request: Request<AllocatableResourcesRequest>,
    ) -> Result<Response<AllocatableResourcesResponse>, Status> {
        let state = self.shared.lock();
        let devices = state
            .book
            .resources()
            .map(|r| ContainerDevices {
                resource_name: r.to_owned(),
                device_ids: state.book.healthy_devices(r),
                topology: None,
            })
            .collect();
        Ok(Response::new(AllocatableResourcesResponse {
            devices,
            ..Default::default()
        }))
    }

    async fn get(
        &self,
        request: Request<GetPodResourcesRequest>,
    ) -> Result<Response<GetPodResourcesResponse>, Status> {
        let req = request.into_inner();
        let state = self.shared.lock();
        let found = state
            .book
            .pods()
            .values()
            .find(|p| p.name == req.pod_name && p.namespace == req.pod_namespace)
            .map(pod_resources)
            .or_else(|| {
                // A running pod that holds no devices is still known to kubelet.
                state
                    .running
                    .contains(&(req.pod_namespace.clone(), req.pod_name.clone()))
                    .then(|| PodResources {
                        name: req.pod_name.clone(),
                        namespace: req.pod_namespace.clone(),
                        containers: Vec::new(),
                    })
            });
        match found {
            Some(p) => Ok(Response::new(GetPodResourcesResponse {
                pod_resources: Some(p),
            })),
            None => Err(Status::not_found(format!(
                "pod {} not found in namespace {} on this node",
                req.pod_name, req.pod_namespace
            ))),
        }
    }
}
