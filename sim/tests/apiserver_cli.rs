//! `gpupool-sim apiserver` as a process, and fault injection through both
//! the library and the HTTP admin path.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use gpupool_sim_apiserver::{ADMIN_TOKEN, ApiServer, ApiServerConfig, FaultConfig};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use kube::Client;
use kube::api::{Api, ListParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use serde_json::json;

const BIN: &str = env!("CARGO_BIN_EXE_gpupool-sim");

#[tokio::test]
async fn apiserver_command_serves_until_sigterm() {
    let dir = tempfile::tempdir().expect("tempdir");
    let kc = dir.path().join("kc.yaml");
    let mut child = Command::new(BIN)
        .args(["apiserver", "--kubeconfig"])
        .arg(&kc)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let line = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("ready line");
    assert_eq!(line, format!("ready kubeconfig={}", kc.display()));
    let yaml = std::fs::read_to_string(&kc).expect("kubeconfig written");
    let cfg = kube::Config::from_custom_kubeconfig(
        kube::config::Kubeconfig::from_yaml(&yaml).expect("parses"),
        &Default::default(),
    )
    .await
    .expect("config");
    assert!(
        cfg.cluster_url
            .to_string()
            .starts_with("https://127.0.0.1:")
    );
    let client = Client::try_from(cfg).expect("client");
    let ns: Api<Namespace> = Api::all(client);
    let names: Vec<String> = ns
        .list(&ListParams::default())
        .await
        .expect("list")
        .items
        .into_iter()
        .filter_map(|n| n.metadata.name)
        .collect();
    assert!(
        names.contains(&"default".to_string()) && names.contains(&"kube-system".to_string()),
        "{names:?}"
    );
    assert!(
        rx.recv_timeout(Duration::from_millis(200)).is_err(),
        "exactly one stdout line"
    );

    let status = Command::new("kill")
        .arg("-TERM")
        .arg(child.id().to_string())
        .status()
        .expect("kill");
    assert!(status.success());
    let mut code = None;
    for _ in 0..100 {
        if let Some(s) = child.try_wait().expect("wait") {
            code = s.code();
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(code, Some(0), "clean exit on SIGTERM");
}

#[test]
fn missing_kubeconfig_flag_exits_2_naming_it() {
    let out = Command::new(BIN).arg("apiserver").output().expect("run");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--kubeconfig"), "{err}");
    let dir = tempfile::tempdir().expect("tempdir");
    let out = Command::new(BIN)
        .args(["apiserver", "--port", "notaport", "--kubeconfig"])
        .arg(dir.path().join("kc"))
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--port"));
}

/// Runs `gpupool-sim apiserver` with `args` (and extra env) and expects exit
/// 2 with a message on stderr naming `flag`.
fn expect_bad_flag(args: &[&str], env: &[(&str, &str)], flag: &str, why: &str) {
    let mut cmd = Command::new(BIN);
    cmd.arg("apiserver").args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
    assert!(err.contains(flag), "{args:?} should name {flag}: {err}");
    assert!(err.contains(why), "{args:?} should say {why:?}: {err}");
    assert!(out.stdout.is_empty(), "no ready line for {args:?}");
}

#[test]
fn bad_token_and_kubeconfig_values_exit_2_naming_the_flag() {
    let dir = tempfile::tempdir().expect("tempdir");
    let kc = dir.path().join("kc");
    let kc = kc.to_str().expect("utf-8 path");
    let d = dir.path().to_str().expect("utf-8 path");
    expect_bad_flag(
        &["--kubeconfig", kc, "--token", ""],
        &[],
        "--token",
        "must not be empty",
    );
    expect_bad_flag(
        &["--kubeconfig", kc, "--token", "two words"],
        &[],
        "--token",
        "visible ASCII",
    );
    expect_bad_flag(
        &["--kubeconfig", ""],
        &[],
        "--kubeconfig",
        "must not be empty",
    );
    expect_bad_flag(&["--kubeconfig", d], &[], "--kubeconfig", "is a directory");
    expect_bad_flag(
        &["--kubeconfig", kc, "--port", "70000"],
        &[],
        "--port",
        "70000",
    );
    expect_bad_flag(
        &["--kubeconfig", kc],
        &[("GPUPOOL_SIM_PORT", "-1")],
        "--port",
        "-1",
    );
    expect_bad_flag(
        &["--kubeconfig", kc],
        &[("GPUPOOL_SIM_TOKEN", "a\tb")],
        "--token",
        "visible ASCII",
    );
    expect_bad_flag(
        &["--kubeconfig", kc, "--bogus"],
        &[],
        "--bogus",
        "unexpected",
    );
    assert!(!dir.path().join("kc").exists(), "nothing written");
}

#[test]
fn busy_port_is_a_fatal_error() {
    let held = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = held.local_addr().expect("addr").port();
    let dir = tempfile::tempdir().expect("tempdir");
    let out = Command::new(BIN)
        .args(["apiserver", "--port", &port.to_string(), "--kubeconfig"])
        .arg(dir.path().join("kc"))
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains(&format!("cannot listen on 127.0.0.1:{port}"))
    );
}

async fn client_for(server: &gpupool_sim_apiserver::RunningApiServer) -> Client {
    let mut cfg = server.kube_config(ADMIN_TOKEN).await.expect("config");
    cfg.default_retry = false;
    Client::try_from(cfg).expect("client")
}

#[tokio::test]
async fn injected_errors_follow_the_configured_rate_and_code() {
    let server = ApiServer::start(ApiServerConfig {
        fault_seed: 7,
        ..Default::default()
    })
    .await
    .expect("server");
    let api: Api<ConfigMap> = Api::namespaced(client_for(&server).await, "default");
    api.list(&ListParams::default())
        .await
        .expect("no faults by default");
    server
        .faults()
        .set(FaultConfig {
            error_rate: 1.0,
            error_code: 409,
            ..Default::default()
        })
        .expect("set");
    let err = api
        .list(&ListParams::default())
        .await
        .expect_err("always fails");
    match err {
        kube::Error::Api(s) => assert_eq!((s.code, s.reason.as_str()), (409, "Conflict")),
        other => panic!("{other:?}"),
    }
    server
        .faults()
        .set(FaultConfig {
            error_rate: 0.5,
            error_code: 500,
            ..Default::default()
        })
        .expect("set");
    let mut failed = 0;
    for _ in 0..200 {
        if api.list(&ListParams::default()).await.is_err() {
            failed += 1;
        }
    }
    assert!((60..140).contains(&failed), "about half fail: {failed}");
    server.faults().clear();
    api.list(&ListParams::default()).await.expect("cleared");
}

#[tokio::test]
async fn http_admin_path_sets_faults_and_drops_watches() {
    let server = ApiServer::start(ApiServerConfig::default())
        .await
        .expect("server");
    let client = client_for(&server).await;
    let put = http::Request::put("/sim/faults")
        .header("content-type", "application/json")
        .body(serde_json::to_vec(&json!({"errorRate": 1.0, "errorCode": 429})).expect("json"))
        .expect("request");
    let set: serde_json::Value = client.request(put).await.expect("admin accepts");
    assert_eq!(set["errorCode"], 429);
    assert_eq!(server.faults().config().error_code, 429);
    let bad = http::Request::put("/sim/faults")
        .body(serde_json::to_vec(&json!({"errorRate": 3.0})).expect("json"))
        .expect("request");
    let err = client
        .request::<serde_json::Value>(bad)
        .await
        .expect_err("invalid rate");
    assert!(format!("{err:?}").contains("errorRate"), "{err:?}");
    let del = http::Request::delete("/sim/faults")
        .body(Vec::new())
        .expect("request");
    let _: serde_json::Value = client.request(del).await.expect("cleared");
    assert_eq!(server.faults().config(), FaultConfig::default());

    // Dropping watches: the watcher reconnects and still sees later writes.
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), "default");
    let mut stream = watcher(api.clone(), watcher::Config::default())
        .applied_objects()
        .boxed();
    api.create(
        &PostParams::default(),
        &serde_json::from_value(json!({"metadata": {"name": "before"}})).expect("cm"),
    )
    .await
    .expect("create");
    let first = tokio::time::timeout(Duration::from_secs(5), stream.try_next())
        .await
        .expect("in time")
        .expect("ok")
        .expect("obj");
    assert_eq!(first.metadata.name.as_deref(), Some("before"));
    let drop = http::Request::post("/sim/faults/drop-watches")
        .body(Vec::new())
        .expect("request");
    let _: serde_json::Value = client.request(drop).await.expect("dropped");
    api.create(
        &PostParams::default(),
        &serde_json::from_value(json!({"metadata": {"name": "after"}})).expect("cm"),
    )
    .await
    .expect("create");
    let mut seen_after = false;
    for _ in 0..10 {
        match tokio::time::timeout(Duration::from_secs(5), stream.try_next()).await {
            Ok(Ok(Some(o))) if o.metadata.name.as_deref() == Some("after") => {
                seen_after = true;
                break;
            }
            Ok(Ok(Some(_))) | Ok(Err(_)) => {}
            other => panic!("watcher ended: {other:?}"),
        }
    }
    assert!(seen_after);

    let unauth = server.client_with_token("nobody").await.expect("client");
    let get = http::Request::get("/sim/faults")
        .body(Vec::new())
        .expect("request");
    assert!(
        unauth.request::<serde_json::Value>(get).await.is_err(),
        "admin path needs a token"
    );
}
