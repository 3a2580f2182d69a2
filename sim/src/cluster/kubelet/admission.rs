//! Admitting a pod on the kubelet: choosing concrete devices for each
//! container (GetPreferredAllocation when the plugin offers it) and calling
//! the plugin's Allocate, as kubelet's device manager does.
//!
//! Containers are admitted in order, init containers first. A container
//! takes the devices its pod's finished init containers left (see
//! [`DeviceBook::candidates`](super::devices::DeviceBook::candidates))
//! before any free one; when those are enough, the plugin is not asked for
//! a preference, as kubelet's device manager does not ask it, so an init
//! container asking 2 and an app container asking 1 run on 2 devices.

use std::collections::BTreeMap;

use gpupool_api::pod::{container_slots, is_sidecar};
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
        .map(|c| (c, !is_sidecar(c)))
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
            if preferred && !candidates.settled_by_reuse() {
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
                let preference = match responses.as_slice() {
                    [one] => one.device_i_ds.as_slice(),
                    _ => &[],
                };
                if let Err(e) = candidates.validate(preference) {
                    tracing::warn!(node = %shared.node_name, pod = %format!("{namespace}/{name}"), container = %container.name, error = %e, "the plugin's preferred allocation is not one it could be given; taking what it names that is free, then free devices in ID order");
                }
                chosen = candidates.choose(preference);
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

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::path::Path;
    use std::pin::Pin;
    use std::sync::atomic::AtomicU64;
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use futures::{Stream, StreamExt};
    use gpupool_kubelet_api::proto::deviceplugin::v1beta1::{
        AllocateResponse, ContainerAllocateResponse, ContainerPreferredAllocationResponse, Device,
        DevicePluginOptions, Empty, ListAndWatchResponse, PreStartContainerRequest,
        PreStartContainerResponse, PreferredAllocationResponse, RegisterRequest,
        device_plugin_server::{DevicePlugin, DevicePluginServer},
    };
    use gpupool_kubelet_api::transport::{bind_unix, serve_incoming};
    use tokio::sync::{Notify, watch};
    use tokio_util::sync::CancellationToken;
    use tonic::{Request, Response, Status};

    use super::*;
    use crate::cluster::kubelet::{DEVICE_PLUGINS_DIR, NodeState, plugins};

    const R: &str = "gpupool/slot";

    /// One GetPreferredAllocation request: its must-include devices and size.
    type Preference = (Vec<String>, i32);

    /// What the plugin was asked: each GetPreferredAllocation's
    /// (must-include, size) and each Allocate's devices.
    #[derive(Clone, Default)]
    struct Calls {
        preferred: Arc<Mutex<Vec<Preference>>>,
        allocated: Arc<Mutex<Vec<Vec<String>>>>,
    }

    /// A plugin that prefers as gpupool's does: every must-include device,
    /// then available ones in order, and an error when the must-include
    /// devices alone are more than the size.
    struct Plugin {
        devices: Vec<String>,
        calls: Calls,
    }

    #[tonic::async_trait]
    impl DevicePlugin for Plugin {
        async fn get_device_plugin_options(
            &self,
            _: Request<Empty>,
        ) -> Result<Response<DevicePluginOptions>, Status> {
            Ok(Response::new(DevicePluginOptions {
                get_preferred_allocation_available: true,
                ..Default::default()
            }))
        }

        type ListAndWatchStream =
            Pin<Box<dyn Stream<Item = Result<ListAndWatchResponse, Status>> + Send + 'static>>;

        async fn list_and_watch(
            &self,
            _: Request<Empty>,
        ) -> Result<Response<Self::ListAndWatchStream>, Status> {
            let devices = self
                .devices
                .iter()
                .map(|id| Device {
                    id: id.clone(),
                    health: plugins::HEALTHY.into(),
                    topology: None,
                })
                .collect();
            let first = futures::stream::once(async { Ok(ListAndWatchResponse { devices }) });
            Ok(Response::new(Box::pin(
                first.chain(futures::stream::pending()),
            )))
        }

        async fn get_preferred_allocation(
            &self,
            request: Request<PreferredAllocationRequest>,
        ) -> Result<Response<PreferredAllocationResponse>, Status> {
            let mut container_responses = Vec::new();
            for r in request.into_inner().container_requests {
                let size = usize::try_from(r.allocation_size).unwrap_or(0);
                self.calls
                    .preferred
                    .lock()
                    .expect("calls")
                    .push((r.must_include_device_i_ds.clone(), r.allocation_size));
                if r.must_include_device_i_ds.len() > size {
                    return Err(Status::invalid_argument(format!(
                        "allocation size {size} is impossible: {} devices must be included",
                        r.must_include_device_i_ds.len()
                    )));
                }
                let mut ids = r.must_include_device_i_ds.clone();
                for d in r.available_device_i_ds {
                    if ids.len() < size && !ids.contains(&d) {
                        ids.push(d);
                    }
                }
                container_responses.push(ContainerPreferredAllocationResponse { device_i_ds: ids });
            }
            Ok(Response::new(PreferredAllocationResponse {
                container_responses,
            }))
        }

        async fn allocate(
            &self,
            request: Request<AllocateRequest>,
        ) -> Result<Response<AllocateResponse>, Status> {
            let mut container_responses = Vec::new();
            for r in request.into_inner().container_requests {
                self.calls
                    .allocated
                    .lock()
                    .expect("calls")
                    .push(r.devices_ids.clone());
                container_responses.push(ContainerAllocateResponse {
                    envs: HashMap::from([("DEVICES".to_owned(), r.devices_ids.join(","))]),
                    ..Default::default()
                });
            }
            Ok(Response::new(AllocateResponse {
                container_responses,
            }))
        }

        async fn pre_start_container(
            &self,
            _: Request<PreStartContainerRequest>,
        ) -> Result<Response<PreStartContainerResponse>, Status> {
            Err(Status::unimplemented("not needed"))
        }
    }

    /// A kubelet's shared state (its API client points nowhere: admission
    /// does not use it) with the plugin above registered for `devices`.
    async fn node(dir: &Path, devices: usize, stop: &CancellationToken) -> (Arc<Shared>, Calls) {
        let config = kube::Config::new("http://127.0.0.1:9".parse().expect("uri"));
        let shared = Arc::new(Shared {
            node_name: "node-1".into(),
            dir: dir.to_path_buf(),
            client: kube::Client::try_from(config).expect("client"),
            max_termination: Duration::from_millis(100),
            index: 1,
            annotate_allocations: false,
            state: Mutex::new(NodeState::default()),
            generation: AtomicU64::new(0),
            pod_ips: AtomicU64::new(0),
            node_dirty: Notify::new(),
            registered: watch::Sender::new(0),
        });
        let calls = Calls::default();
        let plugin = Plugin {
            devices: (0..devices).map(|i| format!("d{i}")).collect(),
            calls: calls.clone(),
        };
        let socket = dir.join(DEVICE_PLUGINS_DIR).join("fake.sock");
        let incoming = bind_unix(&socket).expect("plugin socket");
        let router =
            tonic::transport::Server::builder().add_service(DevicePluginServer::new(plugin));
        let serving = stop.clone();
        tokio::spawn(async move {
            serve_incoming(router, &socket, incoming, serving.cancelled_owned()).await
        });
        plugins::connect(
            shared.clone(),
            RegisterRequest {
                version: "v1beta1".into(),
                endpoint: "fake.sock".into(),
                resource_name: R.into(),
                options: None,
            },
        )
        .await
        .expect("plugin registers");
        for _ in 0..200 {
            if shared.lock().book.allocatable(R) == devices {
                return (shared, calls);
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("the plugin's devices never reached the book");
    }

    /// A pod of `uid` whose init containers are (name, slots, sidecar) and
    /// app containers (name, slots).
    fn pod(uid: &str, init: &[(&str, u32, bool)], apps: &[(&str, u32)]) -> Pod {
        let limits = |n: u32| serde_json::json!({"limits": {R: n.to_string()}});
        let init: Vec<serde_json::Value> = init
            .iter()
            .map(|(name, n, sidecar)| {
                let mut c = serde_json::json!({"name": name, "resources": limits(*n)});
                if *sidecar {
                    c["restartPolicy"] = "Always".into();
                }
                c
            })
            .collect();
        let apps: Vec<serde_json::Value> = apps
            .iter()
            .map(|(name, n)| serde_json::json!({"name": name, "resources": limits(*n)}))
            .collect();
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": uid, "namespace": "ns", "uid": uid},
            "spec": {"initContainers": init, "containers": apps},
        }))
        .expect("pod")
    }

    fn held(shared: &Shared, uid: &str) -> Vec<(String, Vec<String>)> {
        shared
            .lock()
            .book
            .pods()
            .get(uid)
            .map(|p| {
                p.containers
                    .iter()
                    .map(|c| (c.container.clone(), c.devices.clone()))
                    .collect()
            })
            .unwrap_or_default()
    }

    fn ids(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| (*s).to_owned()).collect()
    }

    /// Admits `pod` on a node of `devices` devices as [`allocate`] does,
    /// without a plugin (no preference): each container in order takes its
    /// candidates' default choice. The devices the pod holds, or the first
    /// error.
    fn admit_on(pod: &Pod, devices: usize) -> Result<usize, AllocationError> {
        let mut book = super::super::devices::DeviceBook::default();
        book.set_devices(R, (0..devices).map(|i| (format!("d{i:02}"), true)));
        for (container, reusable) in containers_in_order(pod) {
            let size =
                usize::try_from(container_slots(container, R).expect("whole")).expect("small");
            if size == 0 {
                continue;
            }
            let chosen = book.candidates("p", R, size)?.default_choice();
            book.assign(
                "p",
                "ns",
                "p",
                ContainerDevices {
                    container: container.name.clone(),
                    init: reusable,
                    resource: R.into(),
                    devices: chosen,
                },
            );
        }
        let held: std::collections::BTreeSet<&String> = book
            .pods()
            .values()
            .flat_map(|p| p.containers.iter().flat_map(|c| c.devices.iter()))
            .collect();
        Ok(held.len())
    }

    /// Every pod of up to three init containers (regular or sidecar) and two
    /// app containers, each asking 0 to 2: the kubelet's device reuse
    /// admits it on exactly as many devices as Kubernetes' effective
    /// request (what the lease and the scheduler count), holds that many,
    /// and refuses it on one fewer.
    #[test]
    fn property_devices_held_are_the_effective_request_for_every_small_pod() {
        let kinds: Vec<(bool, u32)> = [false, true]
            .into_iter()
            .flat_map(|s| (0..=2).map(move |n| (s, n)))
            .collect();
        let mut inits: Vec<Vec<(bool, u32)>> = vec![vec![]];
        let mut last = vec![vec![]];
        for _ in 0..3 {
            last = last
                .iter()
                .flat_map(|v: &Vec<(bool, u32)>| {
                    kinds.iter().map(move |k| {
                        let mut w = v.clone();
                        w.push(*k);
                        w
                    })
                })
                .collect();
            inits.extend(last.iter().cloned());
        }
        let mut apps: Vec<Vec<u32>> = vec![vec![]];
        apps.extend((0..=2).map(|n| vec![n]));
        apps.extend((0..=2).flat_map(|a| (0..=2).map(move |b| vec![a, b])));
        let mut checked = 0;
        for init in &inits {
            for app in &apps {
                let named_init: Vec<(String, u32, bool)> = init
                    .iter()
                    .enumerate()
                    .map(|(i, (s, n))| (format!("i{i}"), *n, *s))
                    .collect();
                let named_apps: Vec<(String, u32)> = app
                    .iter()
                    .enumerate()
                    .map(|(i, n)| (format!("a{i}"), *n))
                    .collect();
                let init_refs: Vec<(&str, u32, bool)> = named_init
                    .iter()
                    .map(|(n, k, s)| (n.as_str(), *k, *s))
                    .collect();
                let app_refs: Vec<(&str, u32)> =
                    named_apps.iter().map(|(n, k)| (n.as_str(), *k)).collect();
                let p = pod("p", &init_refs, &app_refs);
                let spec = p.spec.as_ref().expect("spec");
                let want =
                    usize::try_from(gpupool_api::pod::requested_slots(spec, R).expect("whole"))
                        .expect("small");
                assert_eq!(admit_on(&p, want), Ok(want), "{init:?} {app:?}");
                assert_eq!(admit_on(&p, want + 3), Ok(want), "{init:?} {app:?}");
                if want > 0 {
                    assert!(
                        matches!(
                            admit_on(&p, want - 1),
                            Err(AllocationError::Insufficient { .. })
                        ),
                        "{init:?} {app:?} fits on {} devices",
                        want - 1
                    );
                }
                checked += 1;
            }
        }
        assert_eq!(checked, 259 * 13);
    }

    #[tokio::test]
    async fn an_app_container_reuses_its_init_containers_devices_without_asking_the_plugin() {
        let dir = tempfile::tempdir().expect("dir");
        let stop = CancellationToken::new();
        let (shared, calls) = node(dir.path(), 2, &stop).await;

        // Init 2, app 1: the app container takes the first of the init
        // container's devices; the plugin is asked to prefer only once.
        let p = pod("init-2-app-1", &[("init", 2, false)], &[("app", 1)]);
        let envs = allocate(&shared, &p).await.expect("admitted on 2 devices");
        assert_eq!(
            held(&shared, "init-2-app-1"),
            [
                ("init".to_owned(), ids(&["d0", "d1"])),
                ("app".to_owned(), ids(&["d0"]))
            ]
        );
        assert_eq!(*calls.preferred.lock().expect("calls"), [(vec![], 2)]);
        assert_eq!(
            *calls.allocated.lock().expect("calls"),
            [ids(&["d0", "d1"]), ids(&["d0"])]
        );
        assert_eq!(envs["app"]["DEVICES"], "d0");
        shared.lock().book.release("init-2-app-1");

        // Init 1, app 2: the app container keeps the init container's device
        // and the plugin chooses the other one around it.
        let p = pod("init-1-app-2", &[("init", 1, false)], &[("app", 2)]);
        allocate(&shared, &p).await.expect("admitted on 2 devices");
        assert_eq!(
            held(&shared, "init-1-app-2")[1],
            ("app".to_owned(), ids(&["d0", "d1"]))
        );
        assert_eq!(
            calls.preferred.lock().expect("calls")[1..],
            [(vec![], 1), (ids(&["d0"]), 2)]
        );
        stop.cancel();
    }

    #[tokio::test]
    async fn a_sidecar_before_an_init_container_needs_its_own_device() {
        let dir = tempfile::tempdir().expect("dir");
        let stop = CancellationToken::new();
        let (shared, _) = node(dir.path(), 2, &stop).await;
        // Sidecar 1, init 2, app 1 counts 3: on 2 devices the init container
        // cannot have its 2, and the pod is left holding nothing.
        let shape: &[(&str, u32, bool)] = &[("sidecar", 1, true), ("init", 2, false)];
        let err = allocate(&shared, &pod("needs-3", shape, &[("app", 1)]))
            .await
            .expect_err("2 devices are too few");
        assert_eq!(
            err.to_string(),
            "requested number of devices unavailable for gpupool/slot. Requested: 2, Available: 1"
        );
        assert!(held(&shared, "needs-3").is_empty());
        stop.cancel();

        let dir = tempfile::tempdir().expect("dir");
        let stop = CancellationToken::new();
        let (shared, _) = node(dir.path(), 3, &stop).await;
        allocate(&shared, &pod("needs-3", shape, &[("app", 1)]))
            .await
            .expect("3 devices are enough");
        assert_eq!(
            held(&shared, "needs-3"),
            [
                ("sidecar".to_owned(), ids(&["d0"])),
                ("init".to_owned(), ids(&["d1", "d2"])),
                ("app".to_owned(), ids(&["d1"]))
            ]
        );
        stop.cancel();
    }
}
