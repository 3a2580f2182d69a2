//! Exit codes and messages of the real binary for bad flags and missing NVML.

mod common;

use common::run_to_exit;

#[test]
fn bad_flags_exit_2_naming_the_flag() {
    let dir = tempfile::tempdir().expect("dir");
    let missing = dir.path().join("missing.yaml");
    let bad_yaml = dir.path().join("bad.yaml");
    std::fs::write(&bad_yaml, "- {index: 0, uuid: GPU-a, colour: red}\n").expect("write");
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            vec!["--sessions-per-gpu".into(), "0".into()],
            "--sessions-per-gpu",
        ),
        (vec!["--discovery".into(), "bogus".into()], "--discovery"),
        (vec!["--static-gpus".into(), "many".into()], "--static-gpus"),
        (
            vec!["--discovery".into(), "static".into()],
            "--static-gpus N or --static-config",
        ),
        (
            vec!["--static-gpus".into(), "2".into()],
            "--static-gpus needs --discovery static",
        ),
        (vec!["--devices".into(), "0,,1".into()], "--devices"),
        (
            vec!["--device-list-strategy".into(), "cdi".into()],
            "--device-list-strategy",
        ),
        (
            vec!["--cdi-kind".into(), "nvidia.com/".into()],
            "--cdi-kind",
        ),
        (
            vec!["--resource-name".into(), "slot".into()],
            "--resource-name",
        ),
        (vec!["--no-such-flag".into()], "--no-such-flag"),
        (vec!["--node-name".into(), " ".into()], "--node-name"),
        (
            vec![
                "--discovery".into(),
                "static".into(),
                "--static-gpus".into(),
                "1".into(),
                "--static-config".into(),
                "f.yaml".into(),
            ],
            "--static-config",
        ),
        (
            vec![
                "--discovery".into(),
                "static".into(),
                "--static-config".into(),
                missing.display().to_string(),
            ],
            "--static-config",
        ),
        (
            vec![
                "--discovery".into(),
                "static".into(),
                "--static-config".into(),
                bad_yaml.display().to_string(),
            ],
            "colour",
        ),
    ];
    for (args, needle) in cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (code, stderr) = run_to_exit(&args);
        assert_eq!(code, Some(2), "{args:?}: {stderr}");
        assert!(
            stderr.contains(needle),
            "{args:?} should mention {needle}: {stderr}"
        );
    }
}

#[test]
fn devices_naming_a_missing_gpu_exits_2_naming_it() {
    let dir = tempfile::tempdir().expect("dir");
    let config = dir.path().join("gpus.yaml");
    std::fs::write(
        &config,
        "- {index: 0, uuid: GPU-a}\n- {index: 2, uuid: GPU-c}\n",
    )
    .expect("write");
    let config = config.display().to_string();
    let cases: [(&str, &[&str]); 4] = [
        ("1", &["1"]),
        ("0,7", &["7"]),
        ("GPU-zzz", &["GPU-zzz"]),
        ("2,GPU-q,5", &["GPU-q", "5"]),
    ];
    for (devices, missing) in cases {
        let (code, stderr) = run_to_exit(&[
            "--discovery",
            "static",
            "--static-config",
            &config,
            "--devices",
            devices,
        ]);
        assert_eq!(code, Some(2), "--devices {devices}: {stderr}");
        assert!(stderr.contains("--devices"), "{stderr}");
        for name in missing {
            assert!(
                stderr.contains(name),
                "--devices {devices} should name {name}: {stderr}"
            );
        }
        assert!(
            stderr.contains("0 (GPU-a), 2 (GPU-c)"),
            "lists the GPUs it has: {stderr}"
        );
    }
    // A node with no GPU at all is named as such.
    let (code, stderr) = run_to_exit(&[
        "--discovery",
        "static",
        "--static-gpus",
        "0",
        "--devices",
        "0",
    ]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("its GPUs: none"), "{stderr}");
    assert!(
        stderr.contains("--devices names a GPU this node does not have: 0;"),
        "{stderr}"
    );
}

#[test]
fn nvml_discovery_without_the_library_exits_1_saying_so() {
    let (code, stderr) = run_to_exit(&["--discovery", "nvml"]);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("NVIDIA management library"), "{stderr}");
    assert!(stderr.contains("libnvidia-ml"), "{stderr}");
    // Said once, with the binary's name, and what to check next.
    assert_eq!(
        stderr.matches("NVIDIA management library").count(),
        1,
        "{stderr}"
    );
    assert!(
        stderr.starts_with("gpupool-device-plugin: --discovery nvml:"),
        "{stderr}"
    );
    for next in [
        "NVIDIA driver",
        "NVIDIA container toolkit",
        "runtimeClassName: nvidia",
        "--discovery static",
    ] {
        assert!(stderr.contains(next), "should mention {next}: {stderr}");
    }
}

#[test]
fn fatal_errors_print_once_with_the_binary_name() {
    // A bad combination of flags: one line, nothing logged before it.
    let (code, stderr) = run_to_exit(&["--discovery", "static"]);
    assert_eq!(code, Some(2), "{stderr}");
    assert_eq!(
        stderr,
        "gpupool-device-plugin: --discovery static needs --static-gpus N or --static-config FILE\n"
    );
    // A failure after start-up: logged lines may come first, the error once at the end.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = taken.local_addr().expect("addr").port().to_string();
    let (code, stderr) = run_to_exit(&[
        "--discovery",
        "static",
        "--static-gpus",
        "1",
        "--metrics-port",
        &port,
    ]);
    assert_eq!(code, Some(1), "{stderr}");
    assert_eq!(stderr.matches("cannot listen").count(), 1, "{stderr}");
    let last = stderr.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("gpupool-device-plugin: --metrics-port: cannot listen"),
        "{stderr}"
    );
    assert!(
        !stderr.contains("error:") && !stderr.contains("ERROR"),
        "no second prefix and no log line repeating it: {stderr}"
    );
    // Not a terminal: no colour codes in the log lines.
    assert!(stderr.contains("INFO"), "{stderr}");
    assert!(!stderr.contains('\u{1b}'), "{stderr}");
}

#[test]
fn metrics_port_in_use_exits_1() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = taken.local_addr().expect("addr").port().to_string();
    let (code, stderr) = run_to_exit(&[
        "--discovery",
        "static",
        "--static-gpus",
        "1",
        "--metrics-port",
        &port,
    ]);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("--metrics-port"), "{stderr}");
}

#[test]
fn unusable_kubelet_dir_exits_1_naming_the_socket() {
    let dir = tempfile::tempdir().expect("dir");
    let not_a_dir = dir.path().join("file");
    std::fs::write(&not_a_dir, "").expect("write");
    let (code, stderr) = common::run_to_exit(&[
        "--kubelet-dir",
        not_a_dir.to_str().expect("utf-8"),
        "--discovery",
        "static",
        "--static-gpus",
        "1",
    ]);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("gpupool.sock"), "{stderr}");
}
