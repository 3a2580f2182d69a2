//! The real `gpupool-operator` binary refuses bad flags with exit code 2 and
//! a message naming the flag, and exits 1 when it cannot reach a cluster.

use std::process::{Command, Output};

fn operator(args: &[&str], env: &[(&str, &str)]) -> Output {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_gpupool-operator"));
    cmd.args(args)
        .env_remove("KUBECONFIG")
        .env_remove("POD_NAMESPACE")
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env("HOME", dir.path());
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("the binary runs")
}

#[test]
fn bad_flags_exit_2_naming_the_flag() {
    let cases: &[(&[&str], &str)] = &[
        (&[], "--webhook-service"),
        (&["--webhook-url", "http://127.0.0.1:9443"], "--webhook-url"),
        (&["--webhook-service", "no-slash"], "--webhook-service"),
        (
            &[
                "--webhook-url",
                "https://127.0.0.1",
                "--webhook-service",
                "a/b",
            ],
            "--webhook-service",
        ),
        (
            &["--webhook-url", "https://127.0.0.1", "--metrics-port", "x"],
            "--metrics-port",
        ),
        (
            &[
                "--webhook-url",
                "https://127.0.0.1",
                "--leader-elect=perhaps",
            ],
            "--leader-elect",
        ),
        (
            &[
                "--webhook-url",
                "https://127.0.0.1",
                "--namespace",
                "Not_A_Label",
            ],
            "--namespace",
        ),
        (
            &[
                "--webhook-url",
                "https://127.0.0.1",
                "--metrics-port",
                "9443",
            ],
            "--metrics-port",
        ),
        (
            &[
                "--webhook-url",
                "https://127.0.0.1",
                "--worker-threads",
                "0",
            ],
            "--worker-threads",
        ),
        (&["--no-such-flag"], "--no-such-flag"),
    ];
    for (args, flag) in cases {
        let out = operator(args, &[]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(
            stderr.contains(flag),
            "{args:?} should name {flag}: {stderr}"
        );
    }
}

#[test]
fn flags_are_read_from_the_environment() {
    let out = operator(&[], &[("GPUPOOL_WEBHOOK_URL", "ftp://x")]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--webhook-url"), "{stderr}");
}

#[test]
fn no_cluster_is_fatal_exit_1() {
    let dir = tempfile::tempdir().expect("temp dir");
    let missing = dir.path().join("no-such-kubeconfig");
    let out = operator(
        &[
            "--webhook-url",
            "https://127.0.0.1:9443",
            "--leader-elect=false",
            "--metrics-port",
            "0",
        ],
        &[("KUBECONFIG", missing.to_str().expect("utf-8 path"))],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("Kubernetes client"), "{stderr}");
    // The missing file is named once, as a path, not debug-quoted.
    let path = missing.display().to_string();
    assert_eq!(stderr.matches(&path).count(), 1, "{stderr}");
    assert!(
        stderr.contains(&format!("no kubeconfig at {path}")) && !stderr.contains("'\""),
        "{stderr}"
    );
}

#[test]
fn help_exits_0() {
    let out = operator(&["--help"], &[]);
    assert_eq!(out.status.code(), Some(0));
    let stdout = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--webhook-port",
        "--metrics-port",
        "--leader-elect",
        "--namespace",
        "--webhook-service",
        "--webhook-url",
        "--webhook-bind-address",
        "--device-plugin-user",
        "--status-writes-per-second",
        "--worker-threads",
    ] {
        assert!(stdout.contains(flag), "help lists {flag}");
    }
    assert!(
        stdout.contains("One of --webhook-service NAMESPACE/NAME (in a cluster) or --webhook-url URL (outside one) is required."),
        "{stdout}"
    );
}
