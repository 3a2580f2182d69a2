//! Admitting a pod on the kubelet: choosing concrete devices for each
//! container (GetPreferredAllocation when the plugin offers it) and calling
//! the plugin's Allocate, as kubelet's device manager does.

use std::collections::BTreeMap;

use gpupool_api::pod::container_slots;
use gpupool_kubelet_api::proto::deviceplugin::v1beta1::{
    AllocateRequest, ContainerAllocateRequest, ContainerPreferredAllocationRequest,
    PreferredAllocationRequest,
};
use k8s_openapi::api::core::v1::{Container, Pod};
use kube::ResourceExt;

use super::Shared;
use super::devices::{AllocationError, ContainerDevices};
use crate::cluster::scheduler::plan::is_extended_resource;

/// Why a pod could not get its devices; the pod fails with
/// `UnexpectedAdmissionError` and this text.
#[derive(Debug, thiserror::Error)]
pub enum AdmissionError {
    /// No device could be chosen.
    #[error(transparent)]
    Devices(#[from] AllocationError),
    /// The container's request is not a whole number.
    #[error(transparent)]
    Request(#[from] gpupool_api::pod::PodError),
    /// The plugin answered Allocate (or GetPreferredAllocation) with an error.
    #[error("device plugin {call} failed for container {container:?}: {message}")]
    Plugin {
        /// The RPC.
        call: &'static str,
        /// The container.
        container: String,
        /// What the plugin said.
        message: String,
    },
    /// The plugin's answer did not have one entry per container request.
    #[error("device plugin answered {call} with {got} container responses, want 1")]
    Malformed {
        /// The RPC.
        call: &'static str,
        /// Entries received.
        got: usize,
    },
}

/// Environment each container got from Allocate, by container name.
pub type AllocatedEnv = BTreeMap<String, BTreeMap<String, String>>;

/// The containers in the order kubelet admits them, with whether each one's
/// devices are reusable afterwards (regular init containers).
fn containers_in_order(pod: &Pod) -> Vec<(&Container, bool)> {
    let Some(spec) = pod.spec.as_ref() else {
        return Vec::new();
    };
    spec.init_containers
        .iter()
        .flatten()
        .map(|c| (c, c.restart_policy.as_deref() != Some("Always")))
        .chain(spec.containers.iter().map(|c| (c, false)))
        .collect()
}

fn extended_requests(c: &Container) -> Vec<String> {
    let mut names: Vec<String> = c
        .resources
        .iter()
        .flat_map(|r| r.requests.iter().chain(r.limits.iter()))
        .flat_map(|m| m.keys())
        .filter(|k| is_extended_resource(k))
        .cloned()
        .collect();
    names.sort();
    names.dedup();
    names
}

/// Gives every container of `pod` its devices. On error the pod holds nothing.
pub async fn allocate(shared: &Shared, pod: &Pod) -> Result<AllocatedEnv, AdmissionError> {
    let result = allocate_all(shared, pod).await;
    if result.is_err()
        && let Some(uid) = pod.uid()
    {
        shared.lock().book.release(&uid);
    }
    result
}

async fn allocate_all(shared: &Shared, pod: &Pod) -> Result<AllocatedEnv, AdmissionError> {
    let uid = pod.uid().unwrap_or_default();
    let namespace = pod.namespace().unwrap_or_default();
    let name = pod.name_any();
    let mut envs = AllocatedEnv::new();
    for (container, reusable) in containers_in_order(pod) {
        for resource in extended_requests(container) {
            let size =
                usize::try_from(container_slots(container, &resource)?).unwrap_or(usize::MAX);
            if size == 0 {
                continue;
            }
            let (candidates, plugin) = {
                let state = shared.lock();
                let plugin = state
                    .plugins
                    .get(&resource)
                    .map(|p| (p.client.clone(), p.preferred_allocation));
                (state.book.candidates(&uid, &resource, size), plugin)
            };
            let Some((mut client, preferred)) = plugin else {
                return Err(AllocationError::UnknownResource(resource).into());
            };
            let candidates = candidates?;
            let mut chosen = candidates.default_choice();
            if preferred {
                let request = PreferredAllocationRequest {
                    container_requests: vec![ContainerPreferredAllocationRequest {
                        available_device_i_ds: candidates.available.clone(),
                        must_include_device_i_ds: candidates.must_include.clone(),
                        allocation_size: i32::try_from(size).unwrap_or(i32::MAX),
                    }],
                };
                let answer = client
                    .get_preferred_allocation(request)
                    .await
                    .map_err(|s| AdmissionError::Plugin {
                        call: "GetPreferredAllocation",
                        container: container.name.clone(),
                        message: s.message().to_owned(),
                    })?;
                let responses = answer.into_inner().container_responses;
                match responses.as_slice() {
                    [one] if candidates.validate(&one.device_i_ds).is_ok() => {
                        chosen = one.device_i_ds.clone();
                    }
                    _ => {
                        tracing::warn!(node = %shared.node_name, pod = %format!("{namespace}/{name}"), "ignoring an invalid preferred allocation")
                    }
                }
            }
            let answer = client
                .allocate(AllocateRequest {
                    container_requests: vec![ContainerAllocateRequest {
                        devices_ids: chosen.clone(),
                    }],
                })
                .await
                .map_err(|s| AdmissionError::Plugin {
                    call: "Allocate",
                    container: container.name.clone(),
                    message: s.message().to_owned(),
                })?;
            let responses = answer.into_inner().container_responses;
            let [response] = responses.as_slice() else {
                return Err(AdmissionError::Malformed {
                    call: "Allocate",
                    got: responses.len(),
                });
            };
            envs.entry(container.name.clone())
                .or_default()
                .extend(response.envs.clone());
            shared.lock().book.assign(
                &uid,
                &namespace,
                &name,
                ContainerDevices {
                    container: container.name.clone(),
                    init: reusable,
                    resource: resource.clone(),
                    devices: chosen,
                },
            );
            tracing::info!(node = %shared.node_name, pod = %format!("{namespace}/{name}"), container = %container.name, resource, "allocated devices");
        }
    }
    Ok(envs)
}
