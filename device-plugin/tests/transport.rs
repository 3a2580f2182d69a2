//! The unix-socket gRPC transport: which `:authority` servers accept and
//! clients send.

#![allow(clippy::unwrap_used)]

mod common;
mod raw_h2;

use std::path::Path;
use std::sync::{Arc, Mutex};

use gpupool_api::NodeGpu;
use gpupool_device_plugin::discovery::Gpu;
use gpupool_device_plugin::metrics::Metrics;
use gpupool_device_plugin::proto::deviceplugin::v1beta1 as dp;
use gpupool_device_plugin::proto::deviceplugin::v1beta1::device_plugin_client::DevicePluginClient;
use gpupool_device_plugin::proto::deviceplugin::v1beta1::device_plugin_server::DevicePluginServer;
use gpupool_device_plugin::server::{DeviceListing, DevicePluginService};
use gpupool_device_plugin::slots::SlotTable;
use gpupool_device_plugin::transport;
use raw_h2::{PROTOCOL_ERROR, RawClient, decode, encode};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tonic::transport::Server;

fn service(stop: &CancellationToken) -> DevicePluginServer<DevicePluginService> {
    let gpu = Gpu::from(NodeGpu {
        index: 0,
        uuid: "GPU-a".to_owned(),
        product: "P".to_owned(),
        vendor: "Simulated".to_owned(),
        memory_mib: 0,
        healthy: true,
    });
    let (_tx, table) = watch::channel(Arc::new(SlotTable::new(vec![gpu], 1)));
    DevicePluginServer::new(DevicePluginService::new(
        table,
        "/nonexistent".into(),
        DeviceListing::default(),
        Metrics::new(),
        stop.clone(),
    ))
}

fn allocate(client: &mut RawClient) -> raw_h2::Outcome {
    let request = dp::AllocateRequest {
        container_requests: vec![dp::ContainerAllocateRequest {
            devices_ids: vec!["GPU-a-s0".to_owned()],
        }],
    };
    client.call("/v1beta1.DevicePlugin/Allocate", &encode(&request), false)
}

async fn raw_call(socket: &Path, authority: &str) -> raw_h2::Outcome {
    let socket = socket.to_path_buf();
    let authority = authority.to_owned();
    tokio::task::spawn_blocking(move || allocate(&mut RawClient::connect(&socket, &authority)))
        .await
        .expect("raw client")
}

/// Why the transport rewrites `:authority`: served by tonic alone, a path
/// authority gets RST_STREAM(PROTOCOL_ERROR) from the HTTP/2 layer. If this
/// starts to pass, h2 accepts such authorities and the rewrite can go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bare_tonic_resets_a_path_authority() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("bare.sock");
    let stop = CancellationToken::new();
    let incoming = transport::bind_unix(&socket).unwrap();
    let router = Server::builder().add_service(service(&stop));
    let signal = stop.clone().cancelled_owned();
    tokio::spawn(router.serve_with_incoming_shutdown(incoming, signal));

    let path = socket.to_str().unwrap().to_owned();
    let outcome = raw_call(&socket, &path).await;
    assert_eq!(outcome.reset, Some(PROTOCOL_ERROR), "{outcome:?}");
    let outcome = raw_call(&socket, &path.replace('/', "%2F")).await;
    assert_eq!(outcome.reset, Some(PROTOCOL_ERROR), "{outcome:?}");
    // The same client with a host authority is served.
    let outcome = raw_call(&socket, "localhost").await;
    assert_eq!(outcome.grpc_status.as_deref(), Some("0"), "{outcome:?}");
    stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn served_sockets_accept_any_authority() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("plugin.sock");
    let stop = CancellationToken::new();
    let router = Server::builder().add_service(service(&stop));
    let signal = stop.clone().cancelled_owned();
    let serving = socket.clone();
    tokio::spawn(async move { transport::serve_unix(router, &serving, signal).await });
    common::wait_for("socket", || socket.exists().then_some(())).await;

    let path = socket.to_str().unwrap().to_owned();
    for authority in [
        path.clone(),
        path.replace('/', "%2F"),
        format!("unix:{}", path.replace('/', "%2F")),
        "localhost".to_owned(),
        "[::1]:50051".to_owned(),
    ] {
        let outcome = raw_call(&socket, &authority).await;
        assert_eq!(outcome.reset, None, "{authority}: {outcome:?}");
        assert_eq!(
            outcome.grpc_status.as_deref(),
            Some("0"),
            "{authority}: {outcome:?}"
        );
        let response: dp::AllocateResponse = decode(&outcome);
        assert_eq!(
            response.container_responses[0].envs["GPUPOOL_GPU_UUIDS"],
            "GPU-a"
        );
    }
    // tonic's own client still works through the rewriting layer.
    let channel = transport::connect_unix(&socket).await.unwrap();
    let options = DevicePluginClient::new(channel)
        .get_device_plugin_options(dp::Empty {})
        .await
        .unwrap()
        .into_inner();
    assert!(options.get_preferred_allocation_available);
    stop.cancel();
}

/// Clients (registration, PodResources) send `localhost`, which every
/// server accepts, whatever its HTTP/2 stack.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_send_localhost() {
    use http_body_util::Full;
    use hyper::body::{Bytes, Incoming};
    use hyper_util::rt::{TokioExecutor, TokioIo};

    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("kubelet.sock");
    let listener = tokio::net::UnixListener::bind(&socket).unwrap();
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let recorder = seen.clone();
    tokio::spawn(async move {
        let (conn, _) = listener.accept().await.unwrap();
        let service = hyper::service::service_fn(move |request: hyper::Request<Incoming>| {
            let authority = request.uri().authority().map(|a| a.to_string());
            recorder.lock().unwrap().push(authority.unwrap_or_default());
            async move {
                // A trailers-only gRPC answer: UNIMPLEMENTED.
                hyper::Response::builder()
                    .header("content-type", "application/grpc")
                    .header("grpc-status", "12")
                    .body(Full::new(Bytes::new()))
            }
        });
        let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
            .serve_connection(TokioIo::new(conn), service)
            .await;
    });
    let channel = transport::connect_unix(&socket).await.unwrap();
    let err = DevicePluginClient::new(channel)
        .get_device_plugin_options(dp::Empty {})
        .await
        .expect_err("the recorder implements nothing");
    assert_eq!(err.code(), tonic::Code::Unimplemented);
    assert_eq!(*seen.lock().unwrap(), vec!["localhost".to_owned()]);
}
