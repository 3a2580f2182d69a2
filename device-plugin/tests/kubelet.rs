//! The real binary against a test kubelet over unix sockets: registration,
//! ListAndWatch, Allocate, GetPreferredAllocation, restarts and shutdown.

#![allow(clippy::unwrap_used)]

mod common;
mod raw_h2;

use common::{Plugin, TestKubelet, write_config};
use gpupool_device_plugin::proto::deviceplugin::v1beta1 as dp;
use tonic::Code;

fn ids(devices: &[dp::Device]) -> Vec<String> {
    devices.iter().map(|d| d.id.clone()).collect()
}

fn allocate_request(containers: &[&[&str]]) -> dp::AllocateRequest {
    dp::AllocateRequest {
        container_requests: containers
            .iter()
            .map(|ids| dp::ContainerAllocateRequest {
                devices_ids: ids.iter().map(|s| (*s).to_owned()).collect(),
            })
            .collect(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registers_with_the_contract_fields() {
    let kubelet = TestKubelet::start().await;
    let _plugin = Plugin::start(
        kubelet.path(),
        &["--discovery", "static", "--static-gpus", "2"],
    );
    kubelet.wait_registrations(1).await;
    let devices = kubelet.wait_devices("two devices", |d| d.len() == 2).await;
    {
        let registrations = kubelet.registration_requests();
        let request = &registrations[0];
        assert_eq!(request.version, "v1beta1");
        assert_eq!(request.endpoint, "gpupool.sock");
        assert_eq!(request.resource_name, "gpupool/slot");
        let options = request.options.expect("options sent");
        assert!(options.get_preferred_allocation_available);
        assert!(!options.pre_start_required);
        assert_eq!(
            kubelet.plugin_options("gpupool/slot"),
            Some(options),
            "GetDevicePluginOptions agrees"
        );
    }
    assert!(devices.iter().all(|d| d.health == "Healthy"));
    assert!(
        devices
            .iter()
            .all(|d| d.id.len() <= 63 && d.id.ends_with("-s0"))
    );

    // PreStartContainer answers for known devices and refuses unknown ones.
    let mut client = kubelet.plugin().await;
    client
        .pre_start_container(dp::PreStartContainerRequest {
            devices_ids: ids(&devices),
        })
        .await
        .expect("known devices");
    let err = client
        .pre_start_container(dp::PreStartContainerRequest {
            devices_ids: vec!["nope".into()],
        })
        .await
        .expect_err("unknown device");
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("nope"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn custom_resource_name_is_registered() {
    let kubelet = TestKubelet::start().await;
    let _plugin = Plugin::start(
        kubelet.path(),
        &[
            "--discovery",
            "static",
            "--static-gpus",
            "1",
            "--resource-name",
            "example.com/gpu-slot",
        ],
    );
    kubelet.wait_registrations(1).await;
    assert_eq!(
        kubelet.registration_requests()[0].resource_name,
        "example.com/gpu-slot"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_flips_both_ways_through_the_config_file() {
    let kubelet = TestKubelet::start().await;
    let config = kubelet.path().join("gpus.yaml");
    write_config(&config, &[(0, "GPU-a", true), (1, "GPU-b", true)]);
    let plugin = Plugin::start(
        kubelet.path(),
        &[
            "--discovery",
            "static",
            "--static-config",
            config.to_str().unwrap(),
        ],
    );
    let initial = kubelet.wait_devices("initial list", |d| d.len() == 2).await;
    assert_eq!(ids(&initial), vec!["GPU-a-s0", "GPU-b-s0"]);
    assert!(initial.iter().all(|d| d.health == "Healthy"));

    write_config(&config, &[(0, "GPU-a", true), (1, "GPU-b", false)]);
    let flipped = kubelet
        .wait_devices("GPU-b Unhealthy", |d| {
            d.iter().any(|x| x.health == "Unhealthy")
        })
        .await;
    let health: Vec<(&str, &str)> = flipped
        .iter()
        .map(|d| (d.id.as_str(), d.health.as_str()))
        .collect();
    assert_eq!(
        health,
        vec![("GPU-a-s0", "Healthy"), ("GPU-b-s0", "Unhealthy")]
    );
    let (_, metrics) = plugin.http_get("/metrics").await;
    assert!(
        metrics.contains(r#"gpupool_device_plugin_devices{health="Unhealthy"} 1"#),
        "{metrics}"
    );

    // An Unhealthy device cannot be allocated, and the error names it.
    let err = kubelet
        .plugin()
        .await
        .allocate(allocate_request(&[&["GPU-b-s0"]]))
        .await
        .expect_err("unhealthy");
    assert_eq!(err.code(), Code::FailedPrecondition);
    assert!(err.message().contains("GPU-b-s0"), "{}", err.message());

    write_config(&config, &[(0, "GPU-a", true), (1, "GPU-b", true)]);
    kubelet
        .wait_devices("GPU-b Healthy again", |d| {
            d.len() == 2 && d.iter().all(|x| x.health == "Healthy")
        })
        .await;

    // A broken edit is logged and the last good list kept.
    std::fs::write(&config, "- {index: oops").expect("write");
    common::wait_for("the bad edit logged", || {
        plugin
            .logs()
            .contains("keeping the last known GPUs")
            .then_some(())
    })
    .await;
    assert_eq!(
        ids(&kubelet.devices().expect("list")),
        vec!["GPU-a-s0", "GPU-b-s0"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_per_gpu_multiplies_slots() {
    let kubelet = TestKubelet::start().await;
    let _plugin = Plugin::start(
        kubelet.path(),
        &[
            "--discovery",
            "static",
            "--static-gpus",
            "2",
            "--sessions-per-gpu",
            "3",
        ],
    );
    let devices = kubelet.wait_devices("six slots", |d| d.len() == 6).await;
    let ids = ids(&devices);
    for (i, id) in ids.iter().enumerate() {
        assert!(id.ends_with(&format!("-s{}", i % 3)), "{id}");
        assert!(id.len() <= 63);
    }
    assert_eq!(
        ids[0].trim_end_matches("-s0"),
        ids[2].trim_end_matches("-s2")
    );
    assert_ne!(
        ids[0].trim_end_matches("-s0"),
        ids[3].trim_end_matches("-s0")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn devices_filter_keeps_sparse_indices() {
    let kubelet = TestKubelet::start().await;
    let config = kubelet.path().join("gpus.yaml");
    write_config(
        &config,
        &[
            (0, "GPU-a", true),
            (1, "GPU-b", true),
            (2, "GPU-c", true),
            (3, "GPU-d", true),
        ],
    );
    let _plugin = Plugin::start(
        kubelet.path(),
        &[
            "--discovery",
            "static",
            "--static-config",
            config.to_str().unwrap(),
            "--devices",
            "1,GPU-d",
        ],
    );
    let devices = kubelet.wait_devices("two kept", |d| !d.is_empty()).await;
    assert_eq!(ids(&devices), vec!["GPU-b-s0", "GPU-d-s0"]);
    let response = kubelet
        .plugin()
        .await
        .allocate(allocate_request(&[&["GPU-d-s0"]]))
        .await
        .expect("allocates")
        .into_inner();
    let envs = &response.container_responses[0].envs;
    assert_eq!(envs["GPUPOOL_GPU_INDICES"], "3", "the index stays as it is");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocate_sets_env_and_device_nodes() {
    let kubelet = TestKubelet::start().await;
    let dev = tempfile::tempdir().expect("dev dir");
    for node in ["nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"] {
        std::fs::write(dev.path().join(node), "").expect("fake device node");
    }
    let config = kubelet.path().join("gpus.yaml");
    write_config(&config, &[(0, "GPU-a", true), (1, "GPU-b", true)]);
    let _plugin = Plugin::start(
        kubelet.path(),
        &[
            "--discovery",
            "static",
            "--static-config",
            config.to_str().unwrap(),
            "--sessions-per-gpu",
            "2",
            "--dev-dir",
            dev.path().to_str().unwrap(),
        ],
    );
    kubelet.wait_devices("four slots", |d| d.len() == 4).await;
    let mut client = kubelet.plugin().await;

    let one = client
        .allocate(allocate_request(&[&["GPU-b-s1"]]))
        .await
        .expect("one slot")
        .into_inner();
    let c = &one.container_responses[0];
    assert_eq!(c.envs["NVIDIA_VISIBLE_DEVICES"], "GPU-b");
    assert_eq!(c.envs["GPUPOOL_GPU_INDICES"], "1");
    assert_eq!(c.envs["GPUPOOL_GPU_UUIDS"], "GPU-b");
    let nodes: Vec<(&str, &str, &str)> = c
        .devices
        .iter()
        .map(|d| {
            (
                d.container_path.as_str(),
                d.host_path.as_str(),
                d.permissions.as_str(),
            )
        })
        .collect();
    assert_eq!(
        nodes,
        vec![
            ("/dev/nvidia1", "/dev/nvidia1", "rw"),
            ("/dev/nvidiactl", "/dev/nvidiactl", "rw"),
            ("/dev/nvidia-uvm", "/dev/nvidia-uvm", "rw"),
        ],
        "nvidia-uvm-tools is absent on this host, so not handed out"
    );

    let two = client
        .allocate(allocate_request(&[
            &["GPU-b-s0", "GPU-a-s0"],
            &["GPU-a-s1", "GPU-a-s0"],
        ]))
        .await
        .expect("two slots, two containers")
        .into_inner();
    assert_eq!(two.container_responses.len(), 2);
    let c = &two.container_responses[0];
    assert_eq!(c.envs["NVIDIA_VISIBLE_DEVICES"], "GPU-a,GPU-b");
    assert_eq!(c.envs["GPUPOOL_GPU_INDICES"], "0,1");
    let paths: Vec<&str> = c.devices.iter().map(|d| d.host_path.as_str()).collect();
    assert_eq!(
        paths,
        vec![
            "/dev/nvidia0",
            "/dev/nvidia1",
            "/dev/nvidiactl",
            "/dev/nvidia-uvm"
        ]
    );
    // Two sessions of one GPU: the GPU appears once.
    assert_eq!(
        two.container_responses[1].envs["GPUPOOL_GPU_UUIDS"],
        "GPU-a"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_sending_the_socket_path_as_authority_is_served() {
    use crate::raw_h2::{RawClient, decode, encode};
    let kubelet = TestKubelet::start().await;
    let config = kubelet.path().join("gpus.yaml");
    write_config(&config, &[(0, "GPU-a", true), (1, "GPU-b", true)]);
    let _plugin = Plugin::start(
        kubelet.path(),
        &[
            "--discovery",
            "static",
            "--static-config",
            config.to_str().unwrap(),
        ],
    );
    kubelet.wait_devices("two slots", |d| d.len() == 2).await;
    let socket = kubelet.plugin_socket();
    let path = socket.to_str().unwrap().to_owned();
    // What gRPC's C core sends for unix:<path> (the path, or since 1.57 its
    // percent-encoding), and what older Go clients sent.
    let authorities = [path.clone(), path.replace('/', "%2F")];
    tokio::task::spawn_blocking(move || {
        for authority in authorities {
            let mut client = RawClient::connect(&socket, &authority);
            let list = client.call(
                "/v1beta1.DevicePlugin/ListAndWatch",
                &encode(&dp::Empty {}),
                true,
            );
            assert_eq!(list.reset, None, "{authority}: {list:?}");
            let list: dp::ListAndWatchResponse = decode(&list);
            assert_eq!(ids(&list.devices), vec!["GPU-a-s0", "GPU-b-s0"]);

            // Later calls reference the authority through the dynamic table.
            for _ in 0..2 {
                let allocated = client.call(
                    "/v1beta1.DevicePlugin/Allocate",
                    &encode(&allocate_request(&[&["GPU-b-s0"]])),
                    false,
                );
                assert_eq!(
                    allocated.grpc_status.as_deref(),
                    Some("0"),
                    "{authority}: {allocated:?}"
                );
                let allocated: dp::AllocateResponse = decode(&allocated);
                assert_eq!(
                    allocated.container_responses[0].envs["GPUPOOL_GPU_UUIDS"],
                    "GPU-b"
                );
            }

            let preferred = client.call(
                "/v1beta1.DevicePlugin/GetPreferredAllocation",
                &encode(&dp::PreferredAllocationRequest {
                    container_requests: vec![dp::ContainerPreferredAllocationRequest {
                        available_device_i_ds: vec!["GPU-a-s0".into(), "GPU-b-s0".into()],
                        must_include_device_i_ds: vec![],
                        allocation_size: 1,
                    }],
                }),
                false,
            );
            assert_eq!(
                preferred.grpc_status.as_deref(),
                Some("0"),
                "{authority}: {preferred:?}"
            );
            let preferred: dp::PreferredAllocationResponse = decode(&preferred);
            assert_eq!(
                preferred.container_responses[0].device_i_ds,
                vec!["GPU-a-s0"]
            );

            // Errors still come back as gRPC statuses, not resets.
            let refused = client.call(
                "/v1beta1.DevicePlugin/Allocate",
                &encode(&allocate_request(&[&["GPU-zzz-s0"]])),
                false,
            );
            assert_eq!(refused.grpc_status.as_deref(), Some("3"), "{refused:?}");
            assert!(
                refused
                    .grpc_message
                    .unwrap_or_default()
                    .contains("GPU-zzz-s0")
            );
        }
    })
    .await
    .expect("raw client");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn numa_topology_is_advertised() {
    let kubelet = TestKubelet::start().await;
    let config = kubelet.path().join("gpus.yaml");
    std::fs::write(
        &config,
        "- {index: 0, uuid: GPU-a, numaNode: 0}\n\
         - {index: 1, uuid: GPU-b, numaNode: 1}\n\
         - {index: 2, uuid: GPU-c}\n",
    )
    .expect("write config");
    let _plugin = Plugin::start(
        kubelet.path(),
        &[
            "--discovery",
            "static",
            "--static-config",
            config.to_str().unwrap(),
            "--sessions-per-gpu",
            "2",
        ],
    );
    let devices = kubelet.wait_devices("six slots", |d| d.len() == 6).await;
    let topology: Vec<(&str, Option<Vec<i64>>)> = devices
        .iter()
        .map(|d| {
            (
                d.id.as_str(),
                d.topology
                    .as_ref()
                    .map(|t| t.nodes.iter().map(|n| n.id).collect()),
            )
        })
        .collect();
    assert_eq!(
        topology,
        vec![
            ("GPU-a-s0", Some(vec![0])),
            ("GPU-a-s1", Some(vec![0])),
            ("GPU-b-s0", Some(vec![1])),
            ("GPU-b-s1", Some(vec![1])),
            ("GPU-c-s0", None),
            ("GPU-c-s1", None),
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cdi_strategies_name_gpus_by_uuid() {
    let kubelet = TestKubelet::start().await;
    let dev = tempfile::tempdir().expect("dev dir");
    for node in ["nvidia0", "nvidiactl"] {
        std::fs::write(dev.path().join(node), "").expect("fake device node");
    }
    let config = kubelet.path().join("gpus.yaml");
    write_config(&config, &[(0, "GPU-a", true), (1, "GPU-b", true)]);
    let _plugin = Plugin::start_with_env(
        kubelet.path(),
        &[
            "--discovery",
            "static",
            "--static-config",
            config.to_str().unwrap(),
            "--dev-dir",
            dev.path().to_str().unwrap(),
            "--cdi-kind",
            "example.com/gpu",
        ],
        // The environment variable works like the flag.
        &[("GPUPOOL_DEVICE_LIST_STRATEGY", "cdi-annotations,cdi-cri")],
    );
    kubelet.wait_devices("two slots", |d| d.len() == 2).await;
    let response = kubelet
        .plugin()
        .await
        .allocate(allocate_request(&[&["GPU-b-s0", "GPU-a-s0"]]))
        .await
        .expect("allocates")
        .into_inner();
    let c = &response.container_responses[0];
    let cdi: Vec<&str> = c.cdi_devices.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(cdi, vec!["example.com/gpu=GPU-a", "example.com/gpu=GPU-b"]);
    assert_eq!(
        c.annotations["cdi.k8s.io/gpupool-device-plugin_gpus"],
        "example.com/gpu=GPU-a,example.com/gpu=GPU-b"
    );
    assert_eq!(c.envs["NVIDIA_VISIBLE_DEVICES"], "void");
    assert_eq!(c.envs["GPUPOOL_GPU_UUIDS"], "GPU-a,GPU-b");
    assert!(c.devices.is_empty(), "the CDI spec brings the device nodes");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocate_errors_name_the_problem() {
    let kubelet = TestKubelet::start().await;
    let config = kubelet.path().join("gpus.yaml");
    write_config(&config, &[(0, "GPU-a", true), (1, "GPU-sick", false)]);
    let plugin = Plugin::start(
        kubelet.path(),
        &[
            "--discovery",
            "static",
            "--static-config",
            config.to_str().unwrap(),
        ],
    );
    kubelet.wait_devices("list", |d| d.len() == 2).await;
    let mut client = kubelet.plugin().await;
    let cases: Vec<(dp::AllocateRequest, Code, &str)> = vec![
        (
            allocate_request(&[]),
            Code::InvalidArgument,
            "no container requests",
        ),
        (
            allocate_request(&[&[]]),
            Code::InvalidArgument,
            "container request 0: lists no device IDs",
        ),
        (
            allocate_request(&[&["GPU-zzz-s0"]]),
            Code::InvalidArgument,
            "GPU-zzz-s0",
        ),
        (
            allocate_request(&[&["GPU-a-s0"], &["GPU-a-s9"]]),
            Code::InvalidArgument,
            "GPU-a-s9",
        ),
        (
            allocate_request(&[&["GPU-sick-s0"]]),
            Code::FailedPrecondition,
            "GPU-sick-s0",
        ),
        (
            allocate_request(&[&["GPU-a-s0", "GPU-a-s0"]]),
            Code::InvalidArgument,
            "listed twice",
        ),
    ];
    for (request, code, needle) in cases {
        let err = client.allocate(request).await.expect_err(needle);
        assert_eq!(err.code(), code, "{needle}: {}", err.message());
        assert!(
            err.message().contains(needle),
            "{needle}: {}",
            err.message()
        );
    }
    let (_, metrics) = plugin.http_get("/metrics").await;
    assert!(
        metrics.contains(r#"gpupool_device_plugin_allocations_total{result="error"} 6"#),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preferred_allocation_spreads_and_honours_must_include() {
    let kubelet = TestKubelet::start().await;
    let config = kubelet.path().join("gpus.yaml");
    write_config(
        &config,
        &[(0, "GPU-a", true), (1, "GPU-b", true), (2, "GPU-c", true)],
    );
    let _plugin = Plugin::start(
        kubelet.path(),
        &[
            "--discovery",
            "static",
            "--static-config",
            config.to_str().unwrap(),
            "--sessions-per-gpu",
            "2",
        ],
    );
    kubelet.wait_devices("six slots", |d| d.len() == 6).await;
    let mut client = kubelet.plugin().await;
    let ask = |available: &[&str], must: &[&str], size: i32| dp::PreferredAllocationRequest {
        container_requests: vec![dp::ContainerPreferredAllocationRequest {
            available_device_i_ds: available.iter().map(|s| (*s).to_owned()).collect(),
            must_include_device_i_ds: must.iter().map(|s| (*s).to_owned()).collect(),
            allocation_size: size,
        }],
    };
    // GPU-a already runs one session: the least-used GPUs come first.
    let available = ["GPU-a-s1", "GPU-b-s0", "GPU-b-s1", "GPU-c-s0", "GPU-c-s1"];
    let pick = client
        .get_preferred_allocation(ask(&available, &[], 2))
        .await
        .expect("ok")
        .into_inner();
    assert_eq!(
        pick.container_responses[0].device_i_ds,
        vec!["GPU-b-s0", "GPU-c-s0"]
    );
    let pick = client
        .get_preferred_allocation(ask(&available, &["GPU-b-s1"], 2))
        .await
        .expect("ok")
        .into_inner();
    assert_eq!(
        pick.container_responses[0].device_i_ds,
        vec!["GPU-b-s1", "GPU-c-s0"]
    );
    let err = client
        .get_preferred_allocation(ask(&["GPU-q-s0"], &[], 1))
        .await
        .expect_err("unknown");
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("GPU-q-s0"));
    let err = client
        .get_preferred_allocation(ask(&available, &[], 9))
        .await
        .expect_err("too many");
    assert_eq!(err.code(), Code::InvalidArgument);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubelet_restart_triggers_reregistration() {
    let mut kubelet = TestKubelet::start().await;
    let plugin = Plugin::start(
        kubelet.path(),
        &["--discovery", "static", "--static-gpus", "1"],
    );
    kubelet.wait_registrations(1).await;
    kubelet.wait_devices("list", |d| d.len() == 1).await;

    kubelet.restart().await;
    kubelet.wait_registrations(2).await;
    kubelet
        .wait_devices("list after restart", |d| d.len() == 1)
        .await;
    assert!(
        kubelet.plugin_socket().exists(),
        "the wiped socket is served again"
    );
    kubelet
        .plugin()
        .await
        .allocate(allocate_request(&[&[&kubelet.devices().unwrap()[0].id]]))
        .await
        .expect("allocates after restart");

    let (_, metrics) = plugin.http_get("/metrics").await;
    assert!(
        metrics.contains(r#"gpupool_device_plugin_registrations_total{result="ok"} 2"#),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registration_is_retried_until_the_kubelet_appears() {
    let mut kubelet = TestKubelet::start().await;
    // No kubelet socket at first: the plugin must wait and retry, not exit.
    std::fs::remove_file(kubelet.path().join("device-plugins/kubelet.sock")).expect("remove");
    let plugin = Plugin::start(
        kubelet.path(),
        &["--discovery", "static", "--static-gpus", "1"],
    );
    common::wait_for("plugin socket", || {
        kubelet.plugin_socket().exists().then_some(())
    })
    .await;
    kubelet.restart().await;
    kubelet.wait_registrations(1).await;
    drop(plugin);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plugin_restart_replaces_a_stale_socket() {
    let kubelet = TestKubelet::start().await;
    std::fs::create_dir_all(kubelet.path().join("device-plugins")).expect("dir");
    std::fs::write(kubelet.plugin_socket(), "stale").expect("stale file");
    let mut first = Plugin::start(
        kubelet.path(),
        &["--discovery", "static", "--static-gpus", "1"],
    );
    kubelet.wait_registrations(1).await;
    // SIGKILL leaves the socket behind, like a crash.
    first.signal("KILL");
    first.wait_exit().await;
    assert!(kubelet.plugin_socket().exists());
    let second = Plugin::start(
        kubelet.path(),
        &["--discovery", "static", "--static-gpus", "1"],
    );
    kubelet.wait_registrations(2).await;
    let id = kubelet.wait_devices("list", |d| d.len() == 1).await[0]
        .id
        .clone();
    kubelet
        .plugin()
        .await
        .allocate(allocate_request(&[&[&id]]))
        .await
        .expect("new plugin answers");
    assert!(
        second.logs().contains("removed stale socket"),
        "{}",
        second.logs()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero_gpu_host_keeps_serving() {
    let kubelet = TestKubelet::start().await;
    // This host has no NVIDIA library: auto finds nothing.
    let plugin = Plugin::start(kubelet.path(), &["--discovery", "auto"]);
    kubelet.wait_registrations(1).await;
    let devices = kubelet.wait_devices("empty list", |_| true).await;
    assert!(devices.is_empty());
    let (status, body) = plugin.http_get("/healthz").await;
    assert!(status.contains("200"), "{status}");
    assert_eq!(body.trim(), "ok");
    let (_, metrics) = plugin.http_get("/metrics").await;
    assert!(
        metrics.contains(r#"gpupool_device_plugin_devices{health="Healthy"} 0"#),
        "{metrics}"
    );
    assert!(plugin.logs().contains("no GPUs found"), "{}", plugin.logs());
    let err = kubelet
        .plugin()
        .await
        .allocate(allocate_request(&[&["GPU-x-s0"]]))
        .await
        .expect_err("nothing to allocate");
    assert_eq!(err.code(), Code::InvalidArgument);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_removes_the_socket_and_exits_zero() {
    let kubelet = TestKubelet::start().await;
    let mut plugin = Plugin::start(
        kubelet.path(),
        &["--discovery", "static", "--static-gpus", "1"],
    );
    kubelet.wait_devices("list", |d| d.len() == 1).await;
    assert!(kubelet.plugin_socket().exists());
    plugin.signal("TERM");
    let status = plugin.wait_exit().await;
    assert_eq!(status.code(), Some(0), "{}", plugin.logs());
    assert!(!kubelet.plugin_socket().exists(), "socket removed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubelet_side_works_without_an_api_server() {
    let kubelet = TestKubelet::start().await;
    let plugin = Plugin::start(
        kubelet.path(),
        &[
            "--discovery",
            "static",
            "--static-gpus",
            "2",
            "--node-name",
            "node-1",
        ],
    );
    let devices = kubelet.wait_devices("list", |d| d.len() == 2).await;
    // A pod holding a slot, run by the kubelet: the plugin reads it from PodResources.
    let held = kubelet.run_pod("p", 1).await;
    assert_eq!(held.len(), 1, "{held:?}");
    // The API server (a closed loopback port) fails every report ...
    common::wait_for("a node report error", || {
        plugin
            .logs()
            .contains(r#"target_kind="node""#)
            .then_some(())
    })
    .await;
    let (_, metrics) = plugin.http_get("/metrics").await;
    assert!(
        metrics.contains(r#"report_errors_total{target="node"}"#),
        "{metrics}"
    );
    // ... while the kubelet side keeps answering.
    kubelet
        .plugin()
        .await
        .allocate(allocate_request(&[&[&devices[1].id]]))
        .await
        .expect("allocates without an API server");
    assert_eq!(kubelet.registrations(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_kube_config_is_reported_and_retried() {
    let kubelet = TestKubelet::start().await;
    let missing = kubelet.path().join("no-such-kubeconfig");
    let plugin = Plugin::start_with_env(
        kubelet.path(),
        &[
            "--discovery",
            "static",
            "--static-gpus",
            "1",
            "--node-name",
            "node-1",
        ],
        &[("KUBECONFIG", missing.to_str().unwrap())],
    );
    let devices = kubelet.wait_devices("list", |d| d.len() == 1).await;
    common::wait_for("a client error in the log", || {
        plugin
            .logs()
            .contains("no Kubernetes client configuration")
            .then_some(())
    })
    .await;
    // Retried (counted every time) but said once, naming the file it looked for.
    let metrics = common::wait_for_async("a second client error", || async {
        let (_, metrics) = plugin.http_get("/metrics").await;
        let failures: u64 = metrics
            .lines()
            .find_map(|l| {
                l.strip_prefix(r#"gpupool_device_plugin_report_errors_total{target="client"} "#)
            })
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or(0);
        (failures >= 2).then_some(metrics)
    })
    .await;
    assert!(
        metrics.contains(r#"gpupool_device_plugin_report_errors_total{target="client"}"#),
        "{metrics}"
    );
    let logs = plugin.logs();
    assert_eq!(
        logs.matches("no Kubernetes client configuration").count(),
        1,
        "{logs}"
    );
    assert!(
        logs.contains(&format!("no kubeconfig at {}", missing.display())),
        "{logs}"
    );
    kubelet
        .plugin()
        .await
        .allocate(allocate_request(&[&[&devices[0].id]]))
        .await
        .expect("allocates without a kube config");
}
