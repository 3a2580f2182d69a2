//! The real `kubectl-gpupool` binary against the simulated cluster (the
//! real operator and device plugins): a queue with waiting primaries and
//! helpers, a helper preempted for a primary, `--watch`, the examples, the
//! error paths, and the same commands through `kubectl gpupool` when
//! kubectl is on the PATH.
//!
//! Needs the workspace's binaries: `cargo build --bins` (the simulator
//! finds `gpupool-operator` and `gpupool-device-plugin` next to this test).

#![allow(clippy::unwrap_used)]

use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use gpupool_api::{GpuLease, GpuLeaseClass, LeasePhase};
use gpupool_sim::cluster::{ClusterConfig, OperatorMode, SimCluster};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use kube::api::{DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use kube::core::GroupVersionKind;
use kube::{Api, Client, CustomResourceExt};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};

const NS: &str = "ml";
const PLUGIN: &str = env!("CARGO_BIN_EXE_kubectl-gpupool");

/// What one run of the plugin left.
#[derive(Debug)]
struct Run {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

/// Runs the plugin binary with `--kubeconfig`, no colour settings from the
/// environment and no KUBECONFIG, so only the flag decides.
async fn plugin(kubeconfig: &Path, args: &[&str]) -> Run {
    let out = tokio::process::Command::new(PLUGIN)
        .args(args)
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .env_remove("KUBECONFIG")
        .env_remove("NO_COLOR")
        .output()
        .await
        .expect("the plugin runs");
    Run {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// Runs the plugin and expects success.
async fn ok(kubeconfig: &Path, args: &[&str]) -> String {
    let r = plugin(kubeconfig, args).await;
    assert_eq!(r.code, Some(0), "kubectl-gpupool {args:?}: {r:?}");
    assert!(
        r.stderr.is_empty(),
        "kubectl-gpupool {args:?} stderr: {}",
        r.stderr
    );
    assert!(
        !r.stdout.contains('\x1b'),
        "no colour into a pipe: {}",
        r.stdout
    );
    r.stdout
}

/// Runs the plugin and expects failure with `code` and exactly one line on stderr.
async fn fails(kubeconfig: &Path, args: &[&str], code: i32) -> String {
    let r = plugin(kubeconfig, args).await;
    assert_eq!(r.code, Some(code), "kubectl-gpupool {args:?}: {r:?}");
    assert!(r.stdout.is_empty(), "{r:?}");
    assert!(r.stderr.starts_with("kubectl-gpupool: "), "{r:?}");
    r.stderr
}

/// Polls `f` every 100 ms until it yields, failing after `secs`.
async fn wait_for<T, F, Fut>(what: &str, secs: u64, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {secs}s waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Two simulated clusters started at once in one test process have left
/// the second operator never ready; the cluster tests here take turns.
static ONE_CLUSTER: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn start(
    max_termination: Duration,
) -> (tokio::sync::MutexGuard<'static, ()>, SimCluster, Client) {
    let turn = ONE_CLUSTER.lock().await;
    let cluster = SimCluster::start(ClusterConfig {
        nodes: 2,
        gpus_per_node: 2,
        operator: OperatorMode::Required,
        max_termination,
        ready_timeout: Duration::from_secs(60),
        remove_run_dir: std::env::var_os("GPUPOOL_KEEP_RUN").is_none(),
        ..Default::default()
    })
    .await
    .unwrap_or_else(|e| {
        panic!("the simulated cluster starts (build the binaries first: cargo build --bins): {e}")
    });
    eprintln!(
        "simulated cluster run directory: {}",
        cluster.run_dir().display()
    );
    let client = cluster.client();
    let namespaces: Api<Namespace> = Api::all(client.clone());
    namespaces
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": NS}})).unwrap(),
        )
        .await
        .expect("namespace ml");
    (turn, cluster, client)
}

async fn create_class(client: &Client, name: &str, spec: Value) {
    let api: Api<GpuLeaseClass> = Api::all(client.clone());
    let class: GpuLeaseClass = serde_json::from_value(json!({
        "apiVersion": "gpupool.io/v1alpha1", "kind": "GpuLeaseClass",
        "metadata": {"name": name}, "spec": spec
    }))
    .unwrap();
    api.create(&PostParams::default(), &class)
        .await
        .expect("create class");
    // The webhook learns classes from a watch: give it a moment.
    tokio::time::sleep(Duration::from_millis(300)).await;
}

async fn create_pod(client: &Client, name: &str, slots: u32, role: &str) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {"gpupool.io/role": role}},
        "spec": {"containers": [{"name": "work", "image": "sim",
            "resources": {"limits": {"gpupool/slot": slots.to_string()}}}]}
    }))
    .unwrap();
    pods.create(&PostParams::default(), &pod)
        .await
        .unwrap_or_else(|e| panic!("create pod {name}: {e}"));
}

async fn wait_lease(
    client: &Client,
    name: &str,
    what: &str,
    done: impl Fn(&GpuLease) -> bool,
) -> GpuLease {
    let api: Api<GpuLease> = Api::namespaced(client.clone(), NS);
    wait_for(&format!("lease {name} {what}"), 30, || async {
        api.get_opt(name).await.ok().flatten().filter(&done)
    })
    .await
}

fn in_phase(phase: LeasePhase) -> impl Fn(&GpuLease) -> bool {
    move |l| l.status.as_ref().is_some_and(|s| s.phase == phase)
}

/// The `queue -o json` view's rows of one role of one class, as (pod, position, role, slots).
fn rows(view: &Value, class: &str, role: &str) -> Vec<(String, u64, String, u64)> {
    let class = view["classes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == class)
        .unwrap_or_else(|| panic!("class {class} in {view}"));
    class[role]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["pod"].as_str().unwrap().to_owned(),
                r["position"].as_u64().unwrap(),
                r["role"].as_str().unwrap().to_owned(),
                r["slots"].as_u64().unwrap(),
            )
        })
        .collect()
}

fn row(pod: &str, position: u64, role: &str, slots: u64) -> (String, u64, String, u64) {
    (pod.to_owned(), position, role.to_owned(), slots)
}

/// The line of `text` that mentions `needle`.
fn line_with<'a>(text: &'a str, needle: &str) -> &'a str {
    text.lines()
        .find(|l| l.contains(needle))
        .unwrap_or_else(|| panic!("no line with {needle:?} in:\n{text}"))
}

fn kubectl_available() -> bool {
    std::process::Command::new("kubectl")
        .args(["version", "--client"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// `kubectl gpupool …` with the plugin's directory first on the PATH.
async fn via_kubectl(kubeconfig: &Path, args: &[&str]) -> String {
    let dir = Path::new(PLUGIN).parent().unwrap();
    let path = std::env::var_os("PATH").unwrap_or_default();
    let mut dirs = vec![dir.to_path_buf()];
    dirs.extend(std::env::split_paths(&path));
    let out = tokio::process::Command::new("kubectl")
        .arg("gpupool")
        .args(args)
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .env("PATH", std::env::join_paths(dirs).unwrap())
        .env_remove("KUBECONFIG")
        .output()
        .await
        .expect("kubectl runs");
    assert!(
        out.status.success(),
        "kubectl gpupool {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_top_and_why_show_waiting_primaries_helpers_and_a_preemption() {
    // Evicted helpers take up to 30 s to terminate, so the preemption can be watched.
    let (_turn, cluster, client) = start(Duration::from_secs(30)).await;
    let kc = cluster.kubeconfig().to_path_buf();
    create_class(
        &client,
        "default",
        json!({"default": true, "helpers": {"gracePeriodSeconds": 30}}),
    )
    .await;

    create_pod(&client, "train-a", 2, "primary").await;
    let a = wait_lease(&client, "train-a", "Bound", in_phase(LeasePhase::Bound)).await;
    let a_node = a.status.as_ref().and_then(|s| s.node.clone()).unwrap();
    create_pod(&client, "backfill", 1, "helper").await;
    let b = wait_lease(&client, "backfill", "Bound", in_phase(LeasePhase::Bound)).await;
    let b_node = b.status.as_ref().and_then(|s| s.node.clone()).unwrap();
    assert_ne!(a_node, b_node);
    create_pod(&client, "train-b", 2, "primary").await;
    wait_lease(&client, "backfill", "Preempting for ml/train-b", |l| {
        l.status.as_ref().is_some_and(|s| {
            s.phase == LeasePhase::Preempting && s.preempted_by.as_deref() == Some("ml/train-b")
        })
    })
    .await;
    create_pod(&client, "train-c", 2, "primary").await;
    create_pod(&client, "train-d", 1, "primary").await;
    create_pod(&client, "helper-2", 1, "helper").await;
    for name in ["train-b", "train-c", "train-d", "helper-2"] {
        wait_lease(&client, name, "Queued with a sequence and a message", |l| {
            l.status.as_ref().is_some_and(|s| {
                s.phase == LeasePhase::Queued && s.sequence.is_some() && s.message.is_some()
            })
        })
        .await;
    }

    // queue -o json: the exact FIFO order, positions per role, from sequences.
    let view: Value = serde_json::from_str(&ok(&kc, &["queue", "-A", "-o", "json"]).await).unwrap();
    assert_eq!(view["positionsFrom"], "sequence");
    assert_eq!(
        rows(&view, "default", "primaries"),
        [
            row("train-b", 1, "primary", 2),
            row("train-c", 2, "primary", 2),
            row("train-d", 3, "primary", 1)
        ]
    );
    assert_eq!(
        rows(&view, "default", "helpers"),
        [row("helper-2", 1, "helper", 1)]
    );
    // The order is the sequences' order, as the API has them.
    let leases: Api<GpuLease> = Api::namespaced(client.clone(), NS);
    let seq = |name: &'static str| {
        let leases = leases.clone();
        async move {
            leases
                .get(name)
                .await
                .unwrap()
                .status
                .unwrap()
                .sequence
                .unwrap()
        }
    };
    assert!(seq("train-b").await < seq("train-c").await);
    assert!(seq("train-c").await < seq("train-d").await);

    // queue as text: primaries, then helpers apart, with the operator's reasons.
    let text = ok(&kc, &["queue", "-n", NS]).await;
    assert!(
        text.starts_with("CLASS default (StrictFIFO): 4 slots, "),
        "{text}"
    );
    assert!(
        text.contains("; 3 primaries and 1 helper waiting\n"),
        "{text}"
    );
    let lines: Vec<&str> = text.lines().collect();
    let header = lines[1].split_whitespace().collect::<Vec<_>>().join(" ");
    assert_eq!(header, "# POD NAMESPACE ROLE SLOTS WAITING WHY");
    let order: Vec<Vec<&str>> = lines[2..5]
        .iter()
        .map(|l| l.split_whitespace().take(5).collect())
        .collect();
    assert_eq!(
        order,
        [
            ["1", "train-b", "ml", "primary", "2"],
            ["2", "train-c", "ml", "primary", "2"],
            ["3", "train-d", "ml", "primary", "1"]
        ]
    );
    assert_eq!(lines[5], "", "helpers are a table of their own:\n{text}");
    let helper = line_with(&text, "helper-2");
    assert!(
        helper.trim_start().starts_with("1   helper-2   ml"),
        "{helper}"
    );
    assert!(
        helper.contains("primaries of class default are queued"),
        "{helper}"
    );
    assert!(line_with(&text, "train-c").contains("ahead"), "{text}");
    // -o wide adds each lease's sequence.
    let wide = ok(&kc, &["queue", "default", "-n", NS, "-o", "wide"]).await;
    // Sequences are microsecond stamps: the column is as wide as they are.
    let header = line_with(&wide, "POD")
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    assert!(header.contains("SEQUENCE QUEUED AT"), "{wide}");
    let b_seq = seq("train-b").await.to_string();
    assert!(
        line_with(&wide, "train-b")
            .split_whitespace()
            .any(|w| w == b_seq),
        "{wide}"
    );
    // Another namespace has no rows, and -o yaml is the same view.
    let other = ok(&kc, &["queue", "-n", "default"]).await;
    assert!(
        other.contains("  no pod waits in namespace default\n"),
        "{other}"
    );
    let yaml: Value = serde_yaml::from_str(&ok(&kc, &["queue", "-A", "-o", "yaml"]).await).unwrap();
    assert_eq!(
        rows(&yaml, "default", "helpers"),
        [row("helper-2", 1, "helper", 1)]
    );

    // top: class counts, then who holds each GPU; the helper marked and preempted.
    let top = ok(&kc, &["top"]).await;
    let class_line: Vec<&str> = line_with(&top, "default ").split_whitespace().collect();
    assert_eq!(&class_line[..3], ["default", "true", "4"], "{top}");
    assert!(
        top.contains(&format!("NODE {a_node}: 2 GPUs, 2 slots, 0 free\n")),
        "{top}"
    );
    let a_rows: Vec<&str> = top.lines().filter(|l| l.contains("ml/train-a")).collect();
    assert_eq!(a_rows.len(), 2, "train-a holds two GPUs:\n{top}");
    assert!(
        a_rows.iter().all(|l| l.contains("primary   Bound")),
        "{top}"
    );
    let helper_row = line_with(&top, "ml/backfill");
    assert!(helper_row.contains("helper*   Preempting"), "{helper_row}");
    assert!(
        helper_row.ends_with("evicted for ml/train-b"),
        "{helper_row}"
    );
    assert!(top.contains("helper*: runs only on idle GPUs"), "{top}");

    // why: one paragraph each, naming the place and what blocks it.
    let why_b = ok(&kc, &["why", "train-b", "-n", NS]).await;
    assert_eq!(why_b.lines().count(), 1, "{why_b}");
    for want in [
        "Pod ml/train-b is a primary waiting for ",
        "for 2 slots in class default, at position 1 of 3 waiting primaries",
        "The operator says: ",
        &format!("Helper ml/backfill on {b_node} is being preempted to make room for it"),
        "Under StrictFIFO it holds back the 2 primaries behind it.",
    ] {
        assert!(why_b.contains(want), "missing {want:?} in {why_b}");
    }
    let why_d = ok(&kc, &["why", "train-d", "-n", NS]).await;
    assert!(
        why_d.contains("at position 3 of 3 waiting primaries"),
        "{why_d}"
    );
    assert!(
        why_d.contains("Ahead of it: ml/train-b (2 slots), ml/train-c (2 slots)."),
        "{why_d}"
    );
    let why_h = ok(&kc, &["why", "helper-2", "-n", NS]).await;
    assert!(why_h.contains("is a helper waiting"), "{why_h}");
    assert!(why_h.contains("position 1 of 1 waiting helpers"), "{why_h}");
    assert!(
        why_h.contains("Helpers wait while any primary of the class does (3 primaries waiting"),
        "{why_h}"
    );
    let why_back = ok(&kc, &["why", "backfill", "-n", NS]).await;
    assert!(
        why_back.contains("is a helper being evicted from GPU "),
        "{why_back}"
    );
    assert!(
        why_back.contains(&format!("on {b_node} to make room for primary ml/train-b")),
        "{why_back}"
    );
    let why_a = ok(&kc, &["why", "train-a", "-n", NS]).await;
    assert!(
        why_a.contains(&format!("is a primary holding GPUs 0 and 1 on {a_node}")),
        "{why_a}"
    );
    assert!(why_a.contains("Nothing blocks it."), "{why_a}");

    // Errors: what is missing, exit 1; bad flags exit 2.
    let err = fails(&kc, &["why", "nope", "-n", NS], 1).await;
    assert_eq!(
        err,
        "kubectl-gpupool: pod \"nope\" not found in namespace \"ml\"\n"
    );
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    pods.create(
        &PostParams::default(),
        &serde_json::from_value(json!({"metadata": {"name": "cpu-only"},
            "spec": {"containers": [{"name": "c", "image": "sim"}]}}))
        .unwrap(),
    )
    .await
    .expect("a pod without slots");
    let err = fails(&kc, &["why", "cpu-only", "-n", NS], 1).await;
    assert_eq!(
        err,
        "kubectl-gpupool: pod ml/cpu-only does not request a GPU slot (no container asks for gpupool/slot), so it has no GpuLease\n"
    );
    let err = fails(&kc, &["queue", "nope"], 1).await;
    assert_eq!(
        err,
        "kubectl-gpupool: no GpuLeaseClass named \"nope\" (kubectl get gpuleaseclasses)\n"
    );
    let err = fails(&kc, &["queue", "-o", "xml"], 2).await;
    assert!(err.contains("invalid value 'xml'"), "{err}");
    fails(&kc, &["why", "train-b", "-A"], 2).await;

    // Through kubectl's plugin lookup, when kubectl is here.
    if kubectl_available() {
        let view: Value =
            serde_json::from_str(&via_kubectl(&kc, &["queue", "-A", "-o", "json"]).await).unwrap();
        assert_eq!(
            rows(&view, "default", "primaries")[0],
            row("train-b", 1, "primary", 2)
        );
        let why = via_kubectl(&kc, &["why", "-n", NS, "helper-2"]).await;
        assert!(why.contains("position 1 of 1 waiting helpers"), "{why}");
        let top = via_kubectl(&kc, &["top"]).await;
        assert!(top.contains("ml/backfill"), "{top}");
    } else {
        gpupool_sim_apiserver::tool_check::missing(
            "kubectl gpupool through kubectl",
            "kubectl",
            "kubectl is not on the PATH (the binary itself was tested)",
        );
    }

    // --watch: a line per change; train-a leaving lets train-b in.
    let mut child = tokio::process::Command::new(PLUGIN)
        .args(["queue", "-n", NS, "-o", "json", "--watch", "--kubeconfig"])
        .arg(&kc)
        .env_remove("KUBECONFIG")
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("watch starts");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let first = next_view(&mut lines).await;
    assert_eq!(rows(&first, "default", "primaries")[0].0, "train-b");
    pods.delete("train-a", &DeleteParams::default().grace_period(0))
        .await
        .expect("delete train-a");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let view = next_view(&mut lines).await;
        let primaries = rows(&view, "default", "primaries");
        if primaries.iter().all(|r| r.0 != "train-b") {
            assert_eq!(primaries[0], row("train-c", 1, "primary", 2), "{view}");
            break;
        }
        assert!(Instant::now() < deadline, "train-b never left the queue");
    }
    child.kill().await.expect("stop the watch");

    cluster.shutdown().await.expect("cluster stops");
}

type WatchLines = tokio::io::Lines<BufReader<tokio::process::ChildStdout>>;

/// The next document a `queue -o json --watch` prints.
async fn next_view(lines: &mut WatchLines) -> Value {
    let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await
        .expect("the watch shows a change within 30 s")
        .expect("reads")
        .expect("the watch is still running");
    serde_json::from_str::<Value>(&line).expect("one JSON document per line")
}

/// The examples' files in the order a user applies them: classes first.
fn example_files() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    files.sort_by_key(|p| {
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        (!name.starts_with("class-"), name)
    });
    files
}

/// Creates every object of a manifest file through the API, as `kubectl
/// apply` would for new objects; returns the kinds and names created.
async fn apply_file(client: &Client, path: &Path, namespace: &str) -> Vec<(String, String)> {
    let text = std::fs::read_to_string(path).unwrap();
    let mut created = Vec::new();
    for doc in serde_yaml::Deserializer::from_str(&text) {
        let value: Value = serde::Deserialize::deserialize(doc).unwrap();
        if value.is_null() {
            continue;
        }
        let obj: DynamicObject = serde_json::from_value(value.clone())
            .unwrap_or_else(|e| panic!("{}: not a Kubernetes object: {e}", path.display()));
        let types = obj.types.clone().expect("apiVersion and kind");
        let gvk = GroupVersionKind::try_from(&types).unwrap();
        let (resource, caps) = kube::discovery::pinned_kind(client, &gvk)
            .await
            .unwrap_or_else(|e| panic!("{}: kind {} unknown: {e}", path.display(), types.kind));
        let api: Api<DynamicObject> = if caps.scope == kube::discovery::Scope::Namespaced {
            Api::namespaced_with(client.clone(), namespace, &resource)
        } else {
            Api::all_with(client.clone(), &resource)
        };
        let name = obj.metadata.name.clone().expect("a name");
        api.create(&PostParams::default(), &obj)
            .await
            .unwrap_or_else(|e| panic!("{} ({} {name}) refused: {e}", path.display(), types.kind));
        created.push((types.kind, name));
    }
    created
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_example_is_accepted_and_the_pinned_pod_is_explained() {
    let (_turn, cluster, client) = start(Duration::from_secs(1)).await;
    let kc = cluster.kubeconfig().to_path_buf();
    let files = example_files();
    let names: Vec<String> = files
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    for want in [
        "class-default.yaml",
        "class-large.yaml",
        "primary-1-slot.yaml",
        "primary-2-slots.yaml",
        "helper.yaml",
        "pod-with-node-selector.yaml",
    ] {
        assert!(
            names.iter().any(|n| n == want),
            "examples/{want} exists: {names:?}"
        );
    }
    let mut created = Vec::new();
    for file in &files {
        let objs = apply_file(&client, file, NS).await;
        assert!(!objs.is_empty(), "{} holds an object", file.display());
        if file
            .file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with("class-"))
        {
            // The webhook learns classes from a watch.
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        created.extend(objs);
    }
    // Each pod got a lease: the webhook took every example pod.
    for (kind, name) in &created {
        if kind == "Pod" {
            wait_lease(&client, name, "created", |_| true).await;
        }
    }
    let classes: Api<GpuLeaseClass> = Api::all(client.clone());
    let large = classes.get("large").await.unwrap();
    assert!(large.spec.node_selector.is_some());

    // The pinned pod waits: no node carries gpu-pool=large yet.
    wait_lease(&client, "train-pinned", "Queued with a message", |l| {
        l.status
            .as_ref()
            .is_some_and(|s| s.phase == LeasePhase::Queued && s.message.is_some())
    })
    .await;
    let why = ok(&kc, &["why", "train-pinned", "-n", NS]).await;
    assert!(
        why.contains("Its own nodeSelector (gpu-pool=large) allows none of them"),
        "{why}"
    );
    // Labelling a node brings it into class large and lets the pinned pod in.
    let nodes: Api<Node> = Api::all(client.clone());
    nodes
        .patch(
            "node-2",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"gpu-pool": "large"}}})),
        )
        .await
        .expect("label node-2");
    wait_for("class large to count node-2", 30, || async {
        let c = classes.get("large").await.ok()?;
        (c.status?.capacity == 2).then_some(())
    })
    .await;
    let queue = ok(&kc, &["queue", "large", "-n", NS]).await;
    assert!(
        queue.starts_with("CLASS large (BestEffortFIFO): 2 slots, "),
        "{queue}"
    );
    assert!(queue.contains("no pod waits in namespace ml"), "{queue}");
    cluster.shutdown().await.expect("cluster stops");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_crds_and_classes_are_named() {
    use gpupool_sim::apiserver::{ADMIN_TOKEN, ApiServer, ApiServerConfig};
    let server = ApiServer::start(ApiServerConfig::default())
        .await
        .expect("API server starts");
    let dir = tempfile::tempdir().unwrap();
    let kc = dir.path().join("kubeconfig");
    server.write_kubeconfig(&kc, ADMIN_TOKEN).unwrap();

    // No CRDs: every command says which one is missing.
    for args in [
        &["queue"][..],
        &["queue", "-A", "--watch"],
        &["top"],
        &["why", "p"],
    ] {
        let err = if args[0] == "why" {
            // why reads the pod first: a missing pod is named before the CRD.
            fails(&kc, args, 1).await
        } else {
            let err = fails(&kc, args, 1).await;
            assert_eq!(
                err,
                "kubectl-gpupool: the GpuLease CRD is not installed (kubectl get crd gpuleases.gpupool.io)\n",
                "{args:?}"
            );
            err
        };
        assert!(!err.contains("Api("), "{err}");
    }
    let client = server.client().await.unwrap();
    let crds: Api<k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition> =
        Api::all(client.clone());
    crds.create(&PostParams::default(), &GpuLease::crd())
        .await
        .unwrap();
    let err = fails(&kc, &["queue"], 1).await;
    assert_eq!(
        err,
        "kubectl-gpupool: the GpuLeaseClass CRD is not installed (kubectl get crd gpuleaseclasses.gpupool.io)\n"
    );
    crds.create(&PostParams::default(), &GpuLeaseClass::crd())
        .await
        .unwrap();
    // CRDs but no class.
    let err = fails(&kc, &["queue", "-A"], 1).await;
    assert_eq!(
        err,
        "kubectl-gpupool: no GpuLeaseClass exists, so no pod can queue: create one (kubectl apply -f examples/class-default.yaml)\n"
    );
    let err = fails(&kc, &["queue", "big"], 1).await;
    assert_eq!(
        err,
        "kubectl-gpupool: no GpuLeaseClass named \"big\" (kubectl get gpuleaseclasses)\n"
    );
    let top = ok(&kc, &["top"]).await;
    assert!(top.starts_with("no GpuLeaseClass exists"), "{top}");
    assert!(top.contains("no node has GPU slots"), "{top}");
    // A pod asking for a slot that the webhook never saw has no lease.
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    pods.create(
        &PostParams::default(),
        &serde_json::from_value(json!({"metadata": {"name": "unseen"},
            "spec": {"containers": [{"name": "c", "image": "sim",
                "resources": {"limits": {"gpupool/slot": "1"}}}]}}))
        .unwrap(),
    )
    .await
    .unwrap();
    let err = fails(&kc, &["why", "unseen"], 1).await;
    assert!(
        err.starts_with("kubectl-gpupool: pod default/unseen requests 1 slot of gpupool/slot but has no GpuLease"),
        "{err}"
    );
    // A kubeconfig that does not exist, and a context it lacks.
    let err = fails(&dir.path().join("missing"), &["top"], 1).await;
    assert!(
        err.contains("cannot read kubeconfig") && err.ends_with("missing: no such file\n"),
        "{err}"
    );
    let err = fails(&kc, &["top", "--context", "elsewhere"], 1).await;
    assert!(
        err.starts_with("kubectl-gpupool: context \"elsewhere\" not found in kubeconfig"),
        "{err}"
    );
    server.shutdown().await;
}
