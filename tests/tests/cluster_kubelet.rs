//! The simulated kubelet's protocol edges, driven over its real unix
//! sockets: registration refusals, a plugin whose Allocate fails, a resource
//! no plugin serves, duplicate registrations, and PodResources answers.
//! The plugin here is a small DevicePlugin server written for these error
//! paths (the real plugin never fails on purpose); the success paths run
//! against the real binary in `cluster_devices`.

use std::collections::BTreeMap;
use std::pin::Pin;
use std::time::Duration;

use futures::{Stream, StreamExt};
use gpupool_kubelet_api::proto::deviceplugin::v1beta1::{
    AllocateRequest, AllocateResponse, ContainerAllocateResponse, Device, DevicePluginOptions,
    Empty, ListAndWatchResponse, PreStartContainerRequest, PreStartContainerResponse,
    PreferredAllocationRequest, PreferredAllocationResponse, RegisterRequest,
    device_plugin_server::{DevicePlugin, DevicePluginServer},
    registration_client::RegistrationClient,
};
use gpupool_kubelet_api::proto::podresources::v1::{
    AllocatableResourcesRequest, GetPodResourcesRequest, ListPodResourcesRequest,
    pod_resources_lister_client::PodResourcesListerClient,
};
use gpupool_kubelet_api::transport::{connect_unix, serve_unix};
use gpupool_sim::cluster::kubelet::{KubeletConfig, RunningKubelet};
use gpupool_sim::cluster::workload::{phase, wait_pod};
use gpupool_sim_apiserver::{ApiServer, ApiServerConfig, FaultConfig, RunningApiServer};
use k8s_openapi::api::core::v1::{Container, Pod, PodSpec, ResourceRequirements};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::{Api, ObjectMeta, PostParams};
use tokio_util::sync::CancellationToken;
use tonic::{Code, Request, Response, Status};

const RESOURCE: &str = "example.com/widget";
const WAIT: Duration = Duration::from_secs(15);

/// Advertises `devices` and answers Allocate with an env var, or fails it.
struct TestPlugin {
    devices: Vec<&'static str>,
    fail_allocate: bool,
}

#[tonic::async_trait]
impl DevicePlugin for TestPlugin {
    async fn get_device_plugin_options(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<DevicePluginOptions>, Status> {
        Ok(Response::new(DevicePluginOptions::default()))
    }

    type ListAndWatchStream =
        Pin<Box<dyn Stream<Item = Result<ListAndWatchResponse, Status>> + Send + 'static>>;

    async fn list_and_watch(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<Self::ListAndWatchStream>, Status> {
        let first = ListAndWatchResponse {
            devices: self
                .devices
                .iter()
                .map(|id| Device {
                    id: (*id).to_owned(),
                    health: "Healthy".into(),
                    topology: None,
                })
                .collect(),
        };
        let stream =
            futures::stream::once(async move { Ok(first) }).chain(futures::stream::pending());
        Ok(Response::new(Box::pin(stream)))
    }

    async fn get_preferred_allocation(
        &self,
        _: Request<PreferredAllocationRequest>,
    ) -> Result<Response<PreferredAllocationResponse>, Status> {
        Err(Status::unimplemented("not offered"))
    }

    async fn allocate(
        &self,
        request: Request<AllocateRequest>,
    ) -> Result<Response<AllocateResponse>, Status> {
        if self.fail_allocate {
            return Err(Status::internal("widget driver exploded"));
        }
        let container_responses = request
            .into_inner()
            .container_requests
            .into_iter()
            .map(|c| ContainerAllocateResponse {
                envs: [("WIDGETS".to_owned(), c.devices_ids.join(","))].into(),
                ..Default::default()
            })
            .collect();
        Ok(Response::new(AllocateResponse {
            container_responses,
        }))
    }

    async fn pre_start_container(
        &self,
        _: Request<PreStartContainerRequest>,
    ) -> Result<Response<PreStartContainerResponse>, Status> {
        Ok(Response::new(PreStartContainerResponse {}))
    }
}

struct Node {
    api: RunningApiServer,
    kubelet: RunningKubelet,
    client: kube::Client,
    _dir: tempfile::TempDir,
}

async fn node() -> Node {
    let api = ApiServer::start(ApiServerConfig::default())
        .await
        .expect("API server");
    let client = api.client().await.expect("client");
    let dir = tempfile::tempdir().expect("kubelet dir");
    let kubelet = RunningKubelet::start(KubeletConfig {
        node_name: "node-1".into(),
        dir: dir.path().to_path_buf(),
        client: client.clone(),
        max_termination: Duration::from_millis(200),
        index: 1,
        annotate_allocations: true,
    })
    .await
    .expect("kubelet starts");
    Node {
        api,
        kubelet,
        client,
        _dir: dir,
    }
}

fn serve_plugin(node: &Node, endpoint: &str, plugin: TestPlugin) -> CancellationToken {
    let cancel = CancellationToken::new();
    let path = node.kubelet.dir().join("device-plugins").join(endpoint);
    let router = tonic::transport::Server::builder().add_service(DevicePluginServer::new(plugin));
    let stop = cancel.clone();
    tokio::spawn(async move { serve_unix(router, path, stop.cancelled_owned()).await });
    cancel
}

async fn register(
    node: &Node,
    version: &str,
    resource: &str,
    endpoint: &str,
) -> Result<(), Status> {
    let channel = connect_unix(node.kubelet.socket_path())
        .await
        .expect("dial kubelet.sock");
    RegistrationClient::new(channel)
        .register(RegisterRequest {
            version: version.into(),
            endpoint: endpoint.into(),
            resource_name: resource.into(),
            options: None,
        })
        .await
        .map(|_| ())
}

/// Waits until the kubelet counts `want` allocatable devices of `resource`.
async fn wait_devices(node: &Node, resource: &str, want: usize) {
    for _ in 0..200 {
        if node.kubelet.devices(resource).1 == want {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!(
        "the kubelet never counted {want} {resource}: {:?}",
        node.kubelet.devices(resource)
    );
}

fn widget_pod(name: &str, widgets: u32, resource: &str) -> Pod {
    let amount = BTreeMap::from([(resource.to_owned(), Quantity(widgets.to_string()))]);
    Pod {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        spec: Some(PodSpec {
            // Bound at creation, as a static assignment: no scheduler here.
            node_name: Some("node-1".into()),
            containers: vec![Container {
                name: "main".into(),
                image: Some("registry.example/widget:1".into()),
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
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registration_is_validated_like_kubelet() {
    let n = node().await;
    let err = register(&n, "v1alpha1", RESOURCE, "w.sock")
        .await
        .expect_err("old version");
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(
        err.message().contains("v1alpha1") && err.message().contains("v1beta1"),
        "{err}"
    );
    let err = register(&n, "v1beta1", "widget", "w.sock")
        .await
        .expect_err("not extended");
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("\"widget\""), "{err}");
    let err = register(&n, "v1beta1", RESOURCE, "../w.sock")
        .await
        .expect_err("escaping endpoint");
    assert!(err.message().contains("../w.sock"), "{err}");
    let err = register(&n, "v1beta1", RESOURCE, "nobody.sock")
        .await
        .expect_err("nothing listens");
    assert_eq!(err.code(), Code::Unavailable);
    assert!(err.message().contains("nobody.sock"), "{err}");
    assert_eq!(n.kubelet.registrations(), 0);

    // A second registration of the same resource replaces the first endpoint.
    let _a = serve_plugin(
        &n,
        "a.sock",
        TestPlugin {
            devices: vec!["w0"],
            fail_allocate: false,
        },
    );
    let _b = serve_plugin(
        &n,
        "b.sock",
        TestPlugin {
            devices: vec!["w0", "w1", "w2"],
            fail_allocate: false,
        },
    );
    tokio::time::sleep(Duration::from_millis(100)).await;
    register(&n, "v1beta1", RESOURCE, "a.sock")
        .await
        .expect("a registers");
    register(&n, "v1beta1", RESOURCE, "b.sock")
        .await
        .expect("b replaces a");
    assert_eq!(n.kubelet.registrations(), 2);
    let mut devices = (0, 0);
    for _ in 0..100 {
        devices = n.kubelet.devices(RESOURCE);
        if devices == (3, 3) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(devices, (3, 3), "b's devices are the node's");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocation_failures_fail_the_pod_and_pod_resources_answers() {
    let n = node().await;
    let _ok = serve_plugin(
        &n,
        "ok.sock",
        TestPlugin {
            devices: vec!["w0", "w1"],
            fail_allocate: false,
        },
    );
    let _bad = serve_plugin(
        &n,
        "bad.sock",
        TestPlugin {
            devices: vec!["x0"],
            fail_allocate: true,
        },
    );
    tokio::time::sleep(Duration::from_millis(100)).await;
    register(&n, "v1beta1", RESOURCE, "ok.sock")
        .await
        .expect("ok registers");
    register(&n, "v1beta1", "example.com/broken", "bad.sock")
        .await
        .expect("bad registers");
    wait_devices(&n, RESOURCE, 2).await;
    wait_devices(&n, "example.com/broken", 1).await;

    let pods: Api<Pod> = Api::namespaced(n.client.clone(), "default");
    let pp = PostParams::default();
    pods.create(&pp, &widget_pod("good", 2, RESOURCE))
        .await
        .expect("create good");
    pods.create(&pp, &widget_pod("exploding", 1, "example.com/broken"))
        .await
        .expect("create exploding");
    pods.create(&pp, &widget_pod("unserved", 1, "example.com/nothing"))
        .await
        .expect("create unserved");
    pods.create(&pp, &widget_pod("greedy", 1, RESOURCE))
        .await
        .expect("create greedy");

    let good = wait_pod(&pods, "good", WAIT, |p| phase(p) == "Running")
        .await
        .expect("good runs");
    let env = gpupool_sim::cluster::kubelet::pods::allocated_env(&good).expect("env annotation");
    assert_eq!(env["main"]["WIDGETS"], "w0,w1");
    for (name, needle) in [
        ("exploding", "widget driver exploded"),
        ("unserved", "example.com/nothing is not registered"),
        ("greedy", "Requested: 1, Available: 0"),
    ] {
        let p = wait_pod(&pods, name, WAIT, |p| phase(p) == "Failed")
            .await
            .expect("fails");
        let status = p.status.expect("status");
        assert_eq!(
            status.reason.as_deref(),
            Some("UnexpectedAdmissionError"),
            "{name}"
        );
        let message = status.message.unwrap_or_default();
        assert!(message.contains(needle), "{name}: {message}");
    }

    let channel = connect_unix(n.kubelet.dir().join("pod-resources/kubelet.sock"))
        .await
        .expect("dial pod-resources");
    let mut pr = PodResourcesListerClient::new(channel);
    let list = pr
        .list(ListPodResourcesRequest {})
        .await
        .expect("List")
        .into_inner();
    assert_eq!(
        list.pod_resources.len(),
        1,
        "only the running pod holds devices: {list:?}"
    );
    let entry = &list.pod_resources[0];
    assert_eq!(
        (entry.name.as_str(), entry.namespace.as_str()),
        ("good", "default")
    );
    assert_eq!(entry.containers[0].devices[0].device_ids, vec!["w0", "w1"]);
    let got = pr
        .get(GetPodResourcesRequest {
            pod_name: "good".into(),
            pod_namespace: "default".into(),
        })
        .await
        .expect("Get")
        .into_inner();
    assert_eq!(
        got.pod_resources.as_ref().map(|p| p.name.as_str()),
        Some("good")
    );
    let missing = pr
        .get(GetPodResourcesRequest {
            pod_name: "ghost".into(),
            pod_namespace: "default".into(),
        })
        .await
        .expect_err("unknown pod");
    assert_eq!(missing.code(), Code::NotFound);
    assert!(missing.message().contains("ghost"), "{missing}");
    let alloc = pr
        .get_allocatable_resources(AllocatableResourcesRequest {})
        .await
        .expect("GetAllocatableResources")
        .into_inner();
    let widgets = alloc
        .devices
        .iter()
        .find(|d| d.resource_name == RESOURCE)
        .expect("widgets");
    assert_eq!(widgets.device_ids, vec!["w0", "w1"]);

    // Deleting the running pod frees its devices once it is gone.
    pods.delete("good", &Default::default())
        .await
        .expect("delete");
    let mut freed = false;
    for _ in 0..150 {
        let list = pr
            .list(ListPodResourcesRequest {})
            .await
            .expect("List")
            .into_inner();
        if list.pod_resources.is_empty() && pods.get_opt("good").await.ok().flatten().is_none() {
            freed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(freed, "the deleted pod is removed and its devices freed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_deleted_while_the_watch_was_down_frees_its_devices_on_relist() {
    let n = node().await;
    let _ok = serve_plugin(
        &n,
        "ok.sock",
        TestPlugin {
            devices: vec!["w0"],
            fail_allocate: false,
        },
    );
    tokio::time::sleep(Duration::from_millis(100)).await;
    register(&n, "v1beta1", RESOURCE, "ok.sock")
        .await
        .expect("registers");
    wait_devices(&n, RESOURCE, 1).await;
    let pods: Api<Pod> = Api::namespaced(n.client.clone(), "default");
    pods.create(&PostParams::default(), &widget_pod("lost", 1, RESOURCE))
        .await
        .expect("create");
    wait_pod(&pods, "lost", WAIT, |p| phase(p) == "Running")
        .await
        .expect("runs");
    let channel = connect_unix(n.kubelet.dir().join("pod-resources/kubelet.sock"))
        .await
        .expect("dial pod-resources");
    let mut pr = PodResourcesListerClient::new(channel);
    let held = pr
        .list(ListPodResourcesRequest {})
        .await
        .expect("List")
        .into_inner();
    assert_eq!(held.pod_resources.len(), 1);

    // Cut the kubelet's watch, remove the pod behind its back, and forget the
    // event history so that its watch must list again.
    let faults = n.api.faults();
    faults
        .set(FaultConfig {
            error_rate: 1.0,
            include_watches: true,
            ..Default::default()
        })
        .expect("faults");
    faults.drop_watches();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        n.api
            .admin()
            .remove("", "pods", "default", "lost")
            .is_some()
    );
    n.api.admin().compact();
    faults.clear();

    let mut freed = false;
    for _ in 0..300 {
        let list = pr
            .list(ListPodResourcesRequest {})
            .await
            .expect("List")
            .into_inner();
        if list.pod_resources.is_empty() {
            freed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        freed,
        "the kubelet forgot the vanished pod after listing again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kubelet_heartbeats_through_its_node_lease() {
    let node = node().await;
    let leases: Api<k8s_openapi::api::coordination::v1::Lease> =
        Api::namespaced(node.client.clone(), "kube-node-lease");
    let lease = gpupool_sim::cluster::workload::wait_for(
        Duration::from_secs(10),
        || async { leases.get_opt("node-1").await.ok().flatten() },
        |l: &k8s_openapi::api::coordination::v1::Lease| {
            l.spec.as_ref().is_some_and(|s| s.renew_time.is_some())
        },
    )
    .await
    .expect("the heartbeat Lease exists and is renewed");
    let spec = lease.spec.expect("spec");
    assert_eq!(spec.holder_identity.as_deref(), Some("node-1"));
    assert_eq!(spec.lease_duration_seconds, Some(40));
}
