//! The simulated API server against a real kube 5 client: CRUD, conflicts,
//! status split, patches, selectors, pagination, watches, GC, finalizers,
//! grace periods, evictions and CRD validation.

use std::collections::BTreeMap;
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use gpupool_api::{GpuLease, GpuLeaseSpec, Role};
use gpupool_sim_apiserver::{ADMIN_TOKEN, ApiServer, ApiServerConfig, RunningApiServer};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{
    Api, DeleteParams, EvictParams, ListParams, Patch, PatchParams, PostParams, WatchEvent,
    WatchParams,
};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource, ResourceExt};
use serde_json::json;

async fn start() -> (RunningApiServer, Client) {
    start_with(ApiServerConfig::default()).await
}

async fn start_with(cfg: ApiServerConfig) -> (RunningApiServer, Client) {
    let server = ApiServer::start(cfg).await.expect("server starts");
    // kube retries 429 for minutes by default; tests want to see it.
    let mut config = server.kube_config(ADMIN_TOKEN).await.expect("config");
    config.default_retry = false;
    let client = Client::try_from(config).expect("client builds");
    (server, client)
}

fn cm(name: &str, labels: &[(&str, &str)]) -> ConfigMap {
    let mut c = ConfigMap::default();
    c.metadata.name = Some(name.into());
    if !labels.is_empty() {
        c.metadata.labels = Some(
            labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        );
    }
    c.data = Some(BTreeMap::from([("k".to_string(), "v".to_string())]));
    c
}

fn pod(name: &str) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {"app": "x"}},
        "spec": {"containers": [{"name": "c", "image": "busybox"}]}
    }))
    .expect("valid pod")
}

fn api_err(e: kube::Error) -> kube::core::Status {
    match e {
        kube::Error::Api(s) => *s,
        other => panic!("expected an API error, got {other:?}"),
    }
}

async fn eventually<F, Fut>(what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    for _ in 0..100 {
        if f().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("timed out waiting for {what}");
}

async fn install_crds(server: &RunningApiServer) {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../crds");
    for f in ["gpuleaseclasses.yaml", "gpuleases.yaml"] {
        let yaml = std::fs::read_to_string(dir.join(f)).expect("crd file");
        server
            .create_crds_from_yaml(&yaml)
            .await
            .expect("crd created");
    }
}

fn lease(name: &str, slots: u32) -> GpuLease {
    GpuLease::new(
        name,
        GpuLeaseSpec {
            class_name: "default".into(),
            pod_name: name.into(),
            pod_uid: "uid-1".into(),
            role: Role::Primary,
            slots,
        },
    )
}

#[tokio::test]
async fn crud_and_conflict_on_stale_update() {
    let (_s, client) = start().await;
    let api: Api<ConfigMap> = Api::namespaced(client, "default");
    let created = api
        .create(&PostParams::default(), &cm("a", &[]))
        .await
        .expect("create");
    assert!(created.metadata.uid.is_some());
    assert!(created.metadata.creation_timestamp.is_some());
    let rv1 = created.resource_version().expect("rv");
    let err = api_err(
        api.create(&PostParams::default(), &cm("a", &[]))
            .await
            .expect_err("duplicate"),
    );
    assert_eq!((err.code, err.reason.as_str()), (409, "AlreadyExists"));
    assert_eq!(err.message, "configmaps \"a\" already exists");

    let mut fresh = api.get("a").await.expect("get");
    fresh.data = Some(BTreeMap::from([("k".to_string(), "v2".to_string())]));
    let updated = api
        .replace("a", &PostParams::default(), &fresh)
        .await
        .expect("replace");
    assert!(
        updated
            .resource_version()
            .expect("rv")
            .parse::<u64>()
            .expect("num")
            > rv1.parse::<u64>().expect("num")
    );

    // `fresh` still carries the old resourceVersion.
    let err = api_err(
        api.replace("a", &PostParams::default(), &fresh)
            .await
            .expect_err("stale"),
    );
    assert_eq!((err.code, err.reason.as_str()), (409, "Conflict"));
    assert!(
        err.message.contains("the object has been modified"),
        "{}",
        err.message
    );

    let stale_patch = json!({"metadata": {"resourceVersion": rv1}, "data": {"k": "v3"}});
    let err = api_err(
        api.patch("a", &PatchParams::default(), &Patch::Merge(&stale_patch))
            .await
            .expect_err("stale patch"),
    );
    assert_eq!(err.code, 409);

    let err = api_err(api.get("missing").await.expect_err("missing"));
    assert_eq!(
        (err.code, err.reason.as_str(), err.message.as_str()),
        (404, "NotFound", "configmaps \"missing\" not found")
    );

    api.delete("a", &DeleteParams::default())
        .await
        .expect("delete");
    assert!(api.get_opt("a").await.expect("get_opt").is_none());
}

#[tokio::test]
async fn unknown_namespace_generate_name_and_dry_run() {
    let (_s, client) = start().await;
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), "nope");
    let err = api_err(
        api.create(&PostParams::default(), &cm("a", &[]))
            .await
            .expect_err("no ns"),
    );
    assert_eq!(
        (err.code, err.message.as_str()),
        (404, "namespaces \"nope\" not found")
    );

    let api: Api<ConfigMap> = Api::namespaced(client, "default");
    let mut c = cm("", &[]);
    c.metadata.name = None;
    c.metadata.generate_name = Some("gen-".into());
    let made = api
        .create(&PostParams::default(), &c)
        .await
        .expect("generateName");
    assert!(
        made.name_any().starts_with("gen-") && made.name_any().len() == 9,
        "{}",
        made.name_any()
    );

    let dry = PostParams {
        dry_run: true,
        ..Default::default()
    };
    api.create(&dry, &cm("dry", &[]))
        .await
        .expect("dry run create");
    assert!(
        api.get_opt("dry").await.expect("get").is_none(),
        "dry run must not persist"
    );

    let mut bad = cm("Bad_Name", &[]);
    bad.metadata.name = Some("Bad_Name".into());
    let err = api_err(
        api.create(&PostParams::default(), &bad)
            .await
            .expect_err("bad name"),
    );
    assert_eq!(err.code, 422);
    assert!(
        err.message
            .contains("metadata.name: Invalid value: \"Bad_Name\""),
        "{}",
        err.message
    );
}

#[tokio::test]
async fn unauthenticated_requests_get_401() {
    let (server, _client) = start().await;
    let bad = server
        .client_with_token("wrong-token")
        .await
        .expect("client");
    let api: Api<ConfigMap> = Api::namespaced(bad, "default");
    let err = api_err(api.list(&ListParams::default()).await.expect_err("401"));
    assert_eq!((err.code, err.reason.as_str()), (401, "Unauthorized"));
}

#[tokio::test]
async fn status_subresource_is_split_for_pods_and_crs() {
    let (server, client) = start().await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    pods.create(&PostParams::default(), &pod("p"))
        .await
        .expect("create");
    // A status write through the main resource is ignored...
    let p = pods
        .patch(
            "p",
            &PatchParams::default(),
            &Patch::Merge(
                json!({"metadata": {"labels": {"l": "1"}}, "status": {"phase": "Running"}}),
            ),
        )
        .await
        .expect("patch main");
    assert_eq!(p.labels().get("l").map(String::as_str), Some("1"));
    assert_eq!(
        p.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Pending")
    );
    // ...and a spec or label write through /status is ignored.
    let p = pods
        .patch_status("p", &PatchParams::default(), &Patch::Merge(json!({"metadata": {"labels": {"l": "2"}}, "spec": {"activeDeadlineSeconds": 5}, "status": {"phase": "Running"}})))
        .await
        .expect("patch status");
    assert_eq!(
        p.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Running")
    );
    assert_eq!(p.labels().get("l").map(String::as_str), Some("1"));
    assert_eq!(
        p.spec.as_ref().and_then(|s| s.active_deadline_seconds),
        None
    );

    install_crds(&server).await;
    let leases: Api<GpuLease> = Api::namespaced(client, "default");
    let mut l = lease("l1", 1);
    l.status = Some(Default::default());
    let created = leases
        .create(&PostParams::default(), &l)
        .await
        .expect("create lease");
    assert!(created.status.is_none(), "status dropped on create");
    assert_eq!(created.metadata.generation, Some(1));
    let st = leases
        .patch_status(
            "l1",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"phase": "Queued", "position": 2}})),
        )
        .await
        .expect("status");
    assert_eq!(st.status.as_ref().and_then(|s| s.position), Some(2));
    assert_eq!(
        st.metadata.generation,
        Some(1),
        "status writes do not bump generation"
    );
    let spec = leases
        .patch(
            "l1",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"slots": 2}, "status": {"position": 9}})),
        )
        .await
        .expect("spec");
    assert_eq!(
        spec.metadata.generation,
        Some(2),
        "spec change bumps generation"
    );
    assert_eq!(
        spec.status.as_ref().and_then(|s| s.position),
        Some(2),
        "status kept"
    );
}

#[tokio::test]
async fn every_patch_type() {
    let (_s, client) = start().await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let mut p = pod("p");
    p.spec.as_mut().expect("spec").scheduling_gates = Some(vec![
        serde_json::from_value(json!({"name": "gpupool.io/admission"})).expect("gate"),
        serde_json::from_value(json!({"name": "other"})).expect("gate"),
    ]);
    pods.create(&PostParams::default(), &p)
        .await
        .expect("create");

    // JSON patch with a passing and a failing `test`.
    let ok: json_patch::Patch = serde_json::from_value(json!([
        {"op": "test", "path": "/spec/schedulingGates/0/name", "value": "gpupool.io/admission"},
        {"op": "remove", "path": "/spec/schedulingGates/0"},
        {"op": "add", "path": "/spec/nodeSelector", "value": {"kubernetes.io/hostname": "node-1"}}
    ]))
    .expect("patch");
    let out = pods
        .patch("p", &PatchParams::default(), &Patch::Json::<()>(ok))
        .await
        .expect("json patch");
    let spec = out.spec.expect("spec");
    assert_eq!(spec.scheduling_gates.as_ref().map(Vec::len), Some(1));
    assert_eq!(
        spec.node_selector
            .as_ref()
            .and_then(|n| n.get("kubernetes.io/hostname"))
            .map(String::as_str),
        Some("node-1")
    );
    let failing: json_patch::Patch = serde_json::from_value(json!([
        {"op": "test", "path": "/spec/schedulingGates/0/name", "value": "gpupool.io/admission"},
        {"op": "remove", "path": "/spec/schedulingGates/0"}
    ]))
    .expect("patch");
    let err = api_err(
        pods.patch("p", &PatchParams::default(), &Patch::Json::<()>(failing))
            .await
            .expect_err("test fails"),
    );
    assert_eq!(err.code, 422);

    // Strategic merge: gate removed by name, condition merged by type.
    let out = pods
        .patch(
            "p",
            &PatchParams::default(),
            &Patch::Strategic(
                json!({"spec": {"schedulingGates": [{"name": "other", "$patch": "delete"}]}}),
            ),
        )
        .await
        .expect("strategic");
    assert!(
        out.spec
            .expect("spec")
            .scheduling_gates
            .unwrap_or_default()
            .is_empty()
    );
    pods.patch_status(
        "p",
        &PatchParams::default(),
        &Patch::Strategic(
            json!({"status": {"conditions": [{"type": "Ready", "status": "False"}]}}),
        ),
    )
    .await
    .expect("strategic status");
    let out = pods
        .patch_status(
            "p",
            &PatchParams::default(),
            &Patch::Strategic(
                json!({"status": {"conditions": [{"type": "Initialized", "status": "True"}]}}),
            ),
        )
        .await
        .expect("strategic status");
    let types: Vec<String> = out
        .status
        .expect("status")
        .conditions
        .unwrap_or_default()
        .into_iter()
        .map(|c| c.type_)
        .collect();
    assert!(
        types.contains(&"Ready".to_string()) && types.contains(&"Initialized".to_string()),
        "{types:?}"
    );

    // Merge patch on annotations with null deleting.
    pods.patch(
        "p",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"annotations": {"a": "1", "b": "2"}}})),
    )
    .await
    .expect("merge");
    let out = pods
        .patch(
            "p",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {"a": null}}})),
        )
        .await
        .expect("merge");
    assert_eq!(out.annotations().len(), 1);

    // Server-side apply is a patch type like the others.
    let applied = pods
        .patch(
            "p",
            &PatchParams::apply("t"),
            &Patch::Apply(json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "labels": {"applied": "yes"}}})),
        )
        .await
        .expect("apply");
    assert_eq!(
        applied.labels().get("applied").map(String::as_str),
        Some("yes")
    );

    // Adding a scheduling gate after creation is invalid.
    let err = api_err(
        pods.patch(
            "p",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"schedulingGates": [{"name": "new"}]}})),
        )
        .await
        .expect_err("gate added"),
    );
    assert_eq!(err.code, 422);
    assert!(
        err.message.contains("spec.schedulingGates"),
        "{}",
        err.message
    );
}

#[tokio::test]
async fn label_and_field_selectors_and_pagination() {
    let (_s, client) = start().await;
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), "default");
    for i in 0..5 {
        let tier = if i % 2 == 0 { "even" } else { "odd" };
        api.create(
            &PostParams::default(),
            &cm(&format!("c{i}"), &[("tier", tier)]),
        )
        .await
        .expect("create");
    }
    let names = |l: kube::core::ObjectList<ConfigMap>| {
        l.items
            .into_iter()
            .map(|c| c.name_any())
            .collect::<Vec<_>>()
    };
    assert_eq!(
        names(
            api.list(&ListParams::default().labels("tier=even"))
                .await
                .expect("list")
        ),
        vec!["c0", "c2", "c4"]
    );
    assert_eq!(
        names(
            api.list(&ListParams::default().labels("tier notin (even)"))
                .await
                .expect("list")
        ),
        vec!["c1", "c3"]
    );
    assert_eq!(
        names(
            api.list(&ListParams::default().labels("!tier"))
                .await
                .expect("list")
        )
        .len(),
        0
    );
    assert_eq!(
        names(
            api.list(&ListParams::default().fields("metadata.name=c3"))
                .await
                .expect("list")
        ),
        vec!["c3"]
    );
    let err = api_err(
        api.list(&ListParams::default().fields("data.k=v"))
            .await
            .expect_err("unsupported field"),
    );
    assert_eq!(err.code, 400);
    assert!(
        err.message.contains("field label not supported: data.k"),
        "{}",
        err.message
    );

    let mut seen = Vec::new();
    let mut lp = ListParams::default().limit(2);
    for _ in 0..10 {
        let page = api.list(&lp).await.expect("page");
        let cont = page.metadata.continue_.clone();
        seen.extend(names(page));
        match cont {
            Some(c) if !c.is_empty() => lp = ListParams::default().limit(2).continue_token(&c),
            _ => break,
        }
    }
    assert_eq!(seen, vec!["c0", "c1", "c2", "c3", "c4"]);

    let pods: Api<Pod> = Api::namespaced(client, "default");
    for name in ["a", "b"] {
        pods.create(&PostParams::default(), &pod(name))
            .await
            .expect("pod");
    }
    pods.create_subresource::<serde_json::Value, serde_json::Value>(
        "binding",
        "a",
        &PostParams::default(),
        &json!({"apiVersion": "v1", "kind": "Binding", "metadata": {"name": "a"}, "target": {"kind": "Node", "name": "node-1"}}),
    )
    .await
    .expect("bind");
    let on_node = pods
        .list(&ListParams::default().fields("spec.nodeName=node-1"))
        .await
        .expect("list");
    assert_eq!(on_node.items.len(), 1);
    let unbound = pods
        .list(&ListParams::default().fields("spec.nodeName="))
        .await
        .expect("list");
    assert_eq!(
        unbound
            .items
            .iter()
            .map(|p| p.name_any())
            .collect::<Vec<_>>(),
        vec!["b"]
    );
    let err = api_err(
        pods.create_subresource::<serde_json::Value, serde_json::Value>(
            "binding",
            "a",
            &PostParams::default(),
            &json!({"apiVersion": "v1", "kind": "Binding", "metadata": {"name": "a"}, "target": {"kind": "Node", "name": "node-2"}}),
        )
        .await
        .expect_err("already bound"),
    );
    assert_eq!(err.code, 409);
}

#[tokio::test]
async fn watch_streams_changes_and_410_after_compaction() {
    let (server, client) = start().await;
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), "default");
    let first = api
        .create(&PostParams::default(), &cm("w0", &[("sel", "yes")]))
        .await
        .expect("create");
    let rv = first.resource_version().expect("rv");
    let mut stream = api
        .watch(&WatchParams::default().labels("sel=yes"), &rv)
        .await
        .expect("watch")
        .boxed();
    api.create(&PostParams::default(), &cm("w1", &[("sel", "yes")]))
        .await
        .expect("create");
    api.create(&PostParams::default(), &cm("other", &[("sel", "no")]))
        .await
        .expect("create");
    api.patch(
        "w1",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"labels": {"sel": "no"}}})),
    )
    .await
    .expect("patch");
    let mut got = Vec::new();
    for _ in 0..2 {
        let ev = tokio::time::timeout(Duration::from_secs(5), stream.try_next())
            .await
            .expect("event in time")
            .expect("ok")
            .expect("some");
        got.push(match ev {
            WatchEvent::Added(o) => format!("ADDED {}", o.name_any()),
            WatchEvent::Modified(o) => format!("MODIFIED {}", o.name_any()),
            WatchEvent::Deleted(o) => format!("DELETED {}", o.name_any()),
            other => format!("{other:?}"),
        });
    }
    // Leaving the selection reads as DELETED to this watcher.
    assert_eq!(got, vec!["ADDED w1", "DELETED w1"]);

    server.admin().compact();
    let mut old = api
        .watch(&WatchParams::default(), &rv)
        .await
        .expect("watch")
        .boxed();
    let ev = tokio::time::timeout(Duration::from_secs(5), old.try_next())
        .await
        .expect("in time")
        .expect("ok")
        .expect("some");
    match ev {
        WatchEvent::Error(e) => {
            assert_eq!(e.code, 410);
            assert!(
                e.message.contains("too old resource version"),
                "{}",
                e.message
            );
        }
        other => panic!("expected 410, got {other:?}"),
    }
}

#[tokio::test]
async fn watcher_recovers_after_410() {
    let cfg = ApiServerConfig {
        event_window: 4,
        ..ApiServerConfig::default()
    };
    let (server, client) = start_with(cfg).await;
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), "default");
    api.create(&PostParams::default(), &cm("r0", &[]))
        .await
        .expect("create");
    let mut stream = watcher(api.clone(), watcher::Config::default())
        .applied_objects()
        .boxed();
    let first = tokio::time::timeout(Duration::from_secs(5), stream.try_next())
        .await
        .expect("in time")
        .expect("ok")
        .expect("obj");
    assert_eq!(first.name_any(), "r0");
    // Drop the stream so the watcher must resume, then make its version too old.
    server.faults().drop_watches();
    for i in 1..=10 {
        api.create(&PostParams::default(), &cm(&format!("r{i}"), &[]))
            .await
            .expect("create");
    }
    server.admin().compact();
    let mut names = std::collections::BTreeSet::new();
    for _ in 0..40 {
        match tokio::time::timeout(Duration::from_secs(5), stream.try_next()).await {
            Ok(Ok(Some(o))) => {
                names.insert(o.name_any());
            }
            Ok(Err(e)) => tracing_free_note(&e),
            other => panic!("watcher ended: {other:?}"),
        }
        if (1..=10).all(|i| names.contains(&format!("r{i}"))) {
            return;
        }
    }
    panic!("watcher did not recover: {names:?}");
}

fn tracing_free_note(e: &watcher::Error) {
    // The watcher reports the 410 and re-lists; anything else is a failure.
    assert!(
        format!("{e:?}").contains("410") || format!("{e:?}").contains("Expired"),
        "{e:?}"
    );
}

#[tokio::test]
async fn garbage_collection_and_finalizers() {
    let (_s, client) = start().await;
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), "default");
    let owner = api
        .create(&PostParams::default(), &cm("owner", &[]))
        .await
        .expect("owner");
    let mut dep = cm("dep", &[]);
    dep.metadata.owner_references = Some(vec![owner.controller_owner_ref(&()).expect("owner ref")]);
    api.create(&PostParams::default(), &dep).await.expect("dep");
    let mut two_owners = cm("two", &[]);
    let other = api
        .create(&PostParams::default(), &cm("other-owner", &[]))
        .await
        .expect("other");
    two_owners.metadata.owner_references = Some(vec![
        owner.controller_owner_ref(&()).expect("ref"),
        serde_json::from_value(json!({"apiVersion": "v1", "kind": "ConfigMap", "name": "other-owner", "uid": other.uid().expect("uid")})).expect("ref"),
    ]);
    api.create(&PostParams::default(), &two_owners)
        .await
        .expect("two");
    api.delete("owner", &DeleteParams::background())
        .await
        .expect("delete owner");
    let api2 = api.clone();
    eventually("dependent collected", || {
        let api = api2.clone();
        async move { api.get_opt("dep").await.expect("get").is_none() }
    })
    .await;
    assert!(
        api.get_opt("two").await.expect("get").is_some(),
        "an owner remains"
    );

    // Finalizers hold deletion until removed.
    let mut f = cm("fin", &[]);
    f.metadata.finalizers = Some(vec!["example.com/hold".into()]);
    api.create(&PostParams::default(), &f)
        .await
        .expect("create");
    api.delete("fin", &DeleteParams::default())
        .await
        .expect("delete");
    let held = api.get("fin").await.expect("still there");
    assert!(held.metadata.deletion_timestamp.is_some());
    let err = api_err(
        api.patch(
            "fin",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": ["example.com/hold", "new"]}})),
        )
        .await
        .expect_err("no new finalizers while deleting"),
    );
    assert_eq!(err.code, 422);
    api.patch(
        "fin",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"finalizers": null}})),
    )
    .await
    .expect("remove finalizer");
    assert!(api.get_opt("fin").await.expect("get").is_none());
}

#[tokio::test]
async fn pod_grace_periods() {
    let (_s, client) = start().await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    pods.create(&PostParams::default(), &pod("unbound"))
        .await
        .expect("create");
    pods.delete("unbound", &DeleteParams::default())
        .await
        .expect("delete");
    assert!(
        pods.get_opt("unbound").await.expect("get").is_none(),
        "unbound pods go at once"
    );

    let mut p = pod("bound");
    p.spec.as_mut().expect("spec").node_name = Some("node-1".into());
    p.spec
        .as_mut()
        .expect("spec")
        .termination_grace_period_seconds = Some(1);
    pods.create(&PostParams::default(), &p)
        .await
        .expect("create");
    pods.delete("bound", &DeleteParams::default())
        .await
        .expect("delete");
    let t = pods.get("bound").await.expect("terminating");
    assert!(t.metadata.deletion_timestamp.is_some());
    assert_eq!(t.metadata.deletion_grace_period_seconds, Some(1));
    let pods2 = pods.clone();
    eventually("grace period expiry", || {
        let pods = pods2.clone();
        async move { pods.get_opt("bound").await.expect("get").is_none() }
    })
    .await;

    let mut p = pod("kubelet");
    p.spec.as_mut().expect("spec").node_name = Some("node-1".into());
    pods.create(&PostParams::default(), &p)
        .await
        .expect("create");
    pods.delete("kubelet", &DeleteParams::default())
        .await
        .expect("delete");
    assert!(
        pods.get_opt("kubelet").await.expect("get").is_some(),
        "30s grace"
    );
    pods.delete(
        "kubelet",
        &DeleteParams {
            grace_period_seconds: Some(0),
            ..Default::default()
        },
    )
    .await
    .expect("force");
    assert!(
        pods.get_opt("kubelet").await.expect("get").is_none(),
        "grace 0 removes"
    );
}

#[tokio::test]
async fn eviction_honours_pod_disruption_budgets() {
    let (_s, client) = start().await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let pdbs: Api<PodDisruptionBudget> = Api::namespaced(client.clone(), "default");
    pdbs.create(
        &PostParams::default(),
        &serde_json::from_value(json!({"metadata": {"name": "b"}, "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "x"}}}})).expect("pdb"),
    )
    .await
    .expect("pdb");
    for name in ["e1", "e2"] {
        let mut p = pod(name);
        p.spec.as_mut().expect("spec").node_name = Some("node-1".into());
        pods.create(&PostParams::default(), &p)
            .await
            .expect("create");
    }
    let ready = json!({"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}});
    pods.patch_status("e1", &PatchParams::default(), &Patch::Merge(&ready))
        .await
        .expect("ready");
    let err = api_err(
        pods.evict("e1", &EvictParams::default())
            .await
            .expect_err("budget"),
    );
    assert_eq!((err.code, err.reason.as_str()), (429, "TooManyRequests"));
    assert!(err.message.contains("disruption budget"), "{}", err.message);

    pods.patch_status("e2", &PatchParams::default(), &Patch::Merge(&ready))
        .await
        .expect("ready");
    pods.evict("e1", &EvictParams::default())
        .await
        .expect("allowed now");
    let e1 = pods.get("e1").await.expect("terminating");
    assert!(e1.metadata.deletion_timestamp.is_some());
    let pdb = pdbs.get("b").await.expect("pdb");
    assert_eq!(pdb.status.expect("status").disruptions_allowed, Some(0));
}

#[tokio::test]
async fn crd_validation_errors_name_the_field() {
    let (server, client) = start().await;
    install_crds(&server).await;
    let leases: Api<GpuLease> = Api::namespaced(client.clone(), "default");
    let err = api_err(
        leases
            .create(&PostParams::default(), &lease("bad", 0))
            .await
            .expect_err("slots 0"),
    );
    assert_eq!((err.code, err.reason.as_str()), (422, "Invalid"));
    assert_eq!(
        err.message,
        "GpuLease.gpupool.io \"bad\" is invalid: spec.slots: Invalid value: 0: spec.slots in body should be greater than or equal to 1"
    );
    let raw: Api<kube::api::DynamicObject> = Api::namespaced_with(
        client,
        "default",
        &kube::api::ApiResource::erase::<GpuLease>(&()),
    );
    let obj: kube::api::DynamicObject = serde_json::from_value(json!({
        "apiVersion": "gpupool.io/v1alpha1", "kind": "GpuLease",
        "metadata": {"name": "x"},
        "spec": {"className": "c", "podName": "p", "podUID": "u", "slots": 1, "role": "boss", "extra": true}
    }))
    .expect("obj");
    let err = api_err(
        raw.create(&PostParams::default(), &obj)
            .await
            .expect_err("enum"),
    );
    assert!(
        err.message
            .contains("spec.role: Unsupported value: \"boss\""),
        "{}",
        err.message
    );
    let mut ok = obj.clone();
    ok.data["spec"]["role"] = json!("helper");
    let made = raw
        .create(&PostParams::default(), &ok)
        .await
        .expect("valid, extra pruned");
    assert!(
        made.data["spec"].get("extra").is_none(),
        "unknown field pruned"
    );
    let defaulted = leases
        .create(&PostParams::default(), &lease("d", 1))
        .await
        .expect("create");
    assert_eq!(defaulted.spec.role, Role::Primary);
}

#[tokio::test]
async fn leases_and_nodes_round_trip() {
    let (_s, client) = start().await;
    let leases: Api<Lease> = Api::namespaced(client.clone(), "kube-system");
    let l: Lease = serde_json::from_value(json!({"metadata": {"name": "gpupool-operator"}, "spec": {"holderIdentity": "a", "leaseDurationSeconds": 15}})).expect("lease");
    leases
        .create(&PostParams::default(), &l)
        .await
        .expect("create");
    let got = leases.get("gpupool-operator").await.expect("get");
    assert_eq!(
        got.spec.and_then(|s| s.holder_identity).as_deref(),
        Some("a")
    );

    let nodes: Api<Node> = Api::all(client);
    let n: Node = serde_json::from_value(
        json!({"metadata": {"name": "node-1"}, "status": {"allocatable": {"gpupool/slot": "2"}}}),
    )
    .expect("node");
    nodes
        .create(&PostParams::default(), &n)
        .await
        .expect("create node");
    let patched = nodes
        .patch(
            "node-1",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {"gpupool.io/gpus": "[]"}}})),
        )
        .await
        .expect("annotate");
    assert_eq!(
        patched
            .annotations()
            .get("gpupool.io/gpus")
            .map(String::as_str),
        Some("[]")
    );
    assert!(
        patched.status.and_then(|s| s.allocatable).is_some(),
        "node status kept on create"
    );
    let _ = Node::kind(&());
}

#[tokio::test]
async fn events_api_events_show_up_as_core_events() {
    use k8s_openapi::api::core::v1::Event as CoreEvent;
    use k8s_openapi::api::events::v1::Event;
    let (_s, client) = start().await;
    let events: Api<Event> = Api::namespaced(client.clone(), "default");
    let ev: Event = serde_json::from_value(json!({
        "metadata": {"name": "p.1"},
        "eventTime": "2026-01-01T00:00:00.000000Z",
        "regarding": {"kind": "Pod", "name": "p", "namespace": "default", "uid": "u1"},
        "note": "admitted to node-1",
        "reason": "Admitted",
        "type": "Normal",
        "action": "Admit",
        "reportingController": "gpupool.io/operator",
        "reportingInstance": "op-1"
    }))
    .expect("event");
    events
        .create(&PostParams::default(), &ev)
        .await
        .expect("create");
    let core: Api<CoreEvent> = Api::namespaced(client, "default");
    let found = core
        .list(&ListParams::default().fields("involvedObject.name=p,involvedObject.kind=Pod"))
        .await
        .expect("list");
    assert_eq!(found.items.len(), 1);
    assert_eq!(
        found.items[0].message.as_deref(),
        Some("admitted to node-1")
    );
    assert_eq!(
        found.items[0]
            .source
            .as_ref()
            .and_then(|s| s.component.as_deref()),
        Some("gpupool.io/operator")
    );
    events
        .delete("p.1", &DeleteParams::default())
        .await
        .expect("delete");
    assert!(
        core.get_opt("p.1").await.expect("get").is_none(),
        "mirror removed"
    );
}

#[tokio::test]
async fn foreground_and_orphan_propagation() {
    let (_s, client) = start().await;
    let api: Api<ConfigMap> = Api::namespaced(client, "default");
    let owner = api
        .create(&PostParams::default(), &cm("fg-owner", &[]))
        .await
        .expect("owner");
    let mut dep = cm("fg-dep", &[]);
    dep.metadata.owner_references = Some(vec![owner.controller_owner_ref(&()).expect("ref")]);
    dep.metadata.finalizers = Some(vec!["example.com/slow".into()]);
    api.create(&PostParams::default(), &dep).await.expect("dep");
    api.delete("fg-owner", &DeleteParams::foreground())
        .await
        .expect("delete");
    let api2 = api.clone();
    eventually("dependent marked for deletion", || {
        let api = api2.clone();
        async move {
            api.get("fg-dep")
                .await
                .expect("get")
                .metadata
                .deletion_timestamp
                .is_some()
        }
    })
    .await;
    let held = api
        .get("fg-owner")
        .await
        .expect("owner waits for its dependents");
    assert!(
        held.finalizers()
            .contains(&"foregroundDeletion".to_string())
    );
    api.patch(
        "fg-dep",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"finalizers": null}})),
    )
    .await
    .expect("release dependent");
    let api2 = api.clone();
    eventually("owner removed after its dependents", || {
        let api = api2.clone();
        async move { api.get_opt("fg-owner").await.expect("get").is_none() }
    })
    .await;

    let owner = api
        .create(&PostParams::default(), &cm("or-owner", &[]))
        .await
        .expect("owner");
    let mut dep = cm("or-dep", &[]);
    dep.metadata.owner_references = Some(vec![owner.controller_owner_ref(&()).expect("ref")]);
    api.create(&PostParams::default(), &dep).await.expect("dep");
    api.delete("or-owner", &DeleteParams::orphan())
        .await
        .expect("delete");
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let kept = api.get("or-dep").await.expect("orphan kept");
    assert!(
        kept.metadata
            .owner_references
            .unwrap_or_default()
            .is_empty(),
        "owner reference removed"
    );
}

#[tokio::test]
async fn a_burst_of_events_reaches_every_watcher_whole_and_in_order() {
    let (server, client) = start().await;
    let cms: Api<ConfigMap> = Api::namespaced(client, "default");
    let from = server.admin().resource_version().to_string();
    let mut streams = Vec::new();
    for _ in 0..2 {
        streams.push(
            cms.watch(&WatchParams::default().timeout(20), &from)
                .await
                .expect("watch")
                .boxed(),
        );
    }
    // Committed in one go, without yielding: the watchers find far more
    // events queued than one chunk of their stream carries.
    const N: usize = 1000;
    for i in 0..N {
        server
            .admin()
            .put(
                "",
                "configmaps",
                json!({"apiVersion": "v1", "kind": "ConfigMap",
                    "metadata": {"name": format!("burst-{i:04}"), "namespace": "default"}}),
            )
            .expect("put");
    }
    for mut stream in streams {
        let mut names = Vec::new();
        while names.len() < N {
            let ev = tokio::time::timeout(Duration::from_secs(10), stream.try_next())
                .await
                .expect("events keep coming")
                .expect("ok")
                .expect("open");
            match ev {
                WatchEvent::Added(cm) => names.push(cm.name_any()),
                WatchEvent::Bookmark(_) => {}
                other => panic!("{other:?}"),
            }
        }
        let want: Vec<String> = (0..N).map(|i| format!("burst-{i:04}")).collect();
        assert_eq!(names, want);
    }
}

#[tokio::test]
async fn writes_are_counted_per_user_and_reads_are_not() {
    let cfg = ApiServerConfig::default().with_token("other-token", "other", &[]);
    let (server, admin) = start_with(cfg).await;
    let other = server
        .client_with_token("other-token")
        .await
        .expect("other client");
    let before = server.writes_by_user();
    let cms: Api<ConfigMap> = Api::namespaced(admin, "default");
    let cm: ConfigMap =
        serde_json::from_value(json!({"metadata": {"name": "counted"}})).expect("cm");
    cms.create(&PostParams::default(), &cm)
        .await
        .expect("create");
    cms.get("counted").await.expect("a read is not a write");
    // A refused write still costs the server a request.
    cms.create(&PostParams::default(), &cm)
        .await
        .expect_err("already exists");
    let theirs: Api<ConfigMap> = Api::namespaced(other, "default");
    theirs
        .delete("counted", &Default::default())
        .await
        .expect("delete");
    let after = server.writes_by_user();
    let grew =
        |user: &str| after.get(user).copied().unwrap_or(0) - before.get(user).copied().unwrap_or(0);
    assert_eq!((grew("admin"), grew("other")), (2, 1), "{after:?}");
}

#[tokio::test]
async fn access_reviews_say_allowed_and_are_create_only() {
    let (_server, client) = start().await;
    let review = json!({"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
        "spec": {"resourceAttributes": {"verb": "delete", "resource": "nodes"}}});
    let req = http::Request::post("/apis/authorization.k8s.io/v1/selfsubjectaccessreviews")
        .header("content-type", "application/json")
        .body(serde_json::to_vec(&review).expect("body"))
        .expect("request");
    let answer: serde_json::Value = client.request(req).await.expect("review answered");
    assert_eq!(answer["status"]["allowed"], true);
    assert!(
        answer["status"]["reason"]
            .as_str()
            .is_some_and(|r| r.contains("does not enforce RBAC")),
        "{answer}"
    );
    assert_eq!(
        answer["spec"], review["spec"],
        "the request comes back with its status"
    );
    let get = http::Request::get("/apis/authorization.k8s.io/v1/selfsubjectaccessreviews")
        .body(Vec::new())
        .expect("request");
    match client.request::<serde_json::Value>(get).await {
        Err(kube::Error::Api(e)) => assert_eq!(e.code, 405, "{e:?}"),
        other => panic!("a GET of reviews must be refused: {other:?}"),
    }
}

#[tokio::test]
async fn services_get_distinct_cluster_ips_unless_headless_or_external() {
    let (_server, client) = start().await;
    let services: Api<k8s_openapi::api::core::v1::Service> = Api::namespaced(client, "default");
    let make = |name: &str, spec: serde_json::Value| {
        serde_json::from_value::<k8s_openapi::api::core::v1::Service>(
            json!({"metadata": {"name": name}, "spec": spec}),
        )
        .expect("service")
    };
    let mut ips = Vec::new();
    for name in ["a", "b"] {
        let made = services
            .create(
                &PostParams::default(),
                &make(name, json!({"ports": [{"port": 80}]})),
            )
            .await
            .expect("create");
        let spec = made.spec.expect("spec");
        assert_eq!(spec.type_.as_deref(), Some("ClusterIP"));
        let port = &spec.ports.expect("ports")[0];
        assert_eq!(port.protocol.as_deref(), Some("TCP"));
        assert_eq!(
            port.target_port,
            Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(80))
        );
        let ip = spec.cluster_ip.expect("cluster IP");
        assert!(ip.starts_with("10.96."), "{ip}");
        ips.push(ip);
    }
    assert_ne!(ips[0], ips[1], "each Service its own IP");
    let headless = services
        .create(
            &PostParams::default(),
            &make("h", json!({"clusterIP": "None"})),
        )
        .await
        .expect("create headless");
    assert_eq!(
        headless.spec.and_then(|s| s.cluster_ip).as_deref(),
        Some("None")
    );
    let external = services
        .create(
            &PostParams::default(),
            &make(
                "x",
                json!({"type": "ExternalName", "externalName": "example.com"}),
            ),
        )
        .await
        .expect("create external");
    assert_eq!(external.spec.and_then(|s| s.cluster_ip), None);
}

#[tokio::test]
async fn deployments_scale_through_their_scale_subresource() {
    let (_server, client) = start().await;
    let deployments: Api<k8s_openapi::api::apps::v1::Deployment> =
        Api::namespaced(client.clone(), "default");
    let d: k8s_openapi::api::apps::v1::Deployment = serde_json::from_value(json!({
        "metadata": {"name": "web"},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "web"}},
                 "template": {"metadata": {"labels": {"app": "web"}},
                              "spec": {"containers": [{"name": "c", "image": "nginx"}]}}}
    }))
    .expect("deployment");
    deployments
        .create(&PostParams::default(), &d)
        .await
        .expect("create");
    let scale = deployments.get_scale("web").await.expect("get scale");
    assert_eq!(scale.spec.and_then(|s| s.replicas), Some(1));
    assert_eq!(
        scale.status.map(|s| s.selector),
        Some(Some("app=web".into()))
    );
    let patched = deployments
        .patch_scale(
            "web",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"spec": {"replicas": 3}})),
        )
        .await
        .expect("patch scale");
    assert_eq!(patched.spec.and_then(|s| s.replicas), Some(3));
    let stored = deployments.get("web").await.expect("get");
    assert_eq!(stored.spec.replicas, Some(3));
    let err = deployments
        .patch_scale(
            "web",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"spec": {"replicas": -1}})),
        )
        .await
        .expect_err("negative replicas");
    assert!(
        matches!(err, kube::Error::Api(ref e) if e.code == 422),
        "{err}"
    );
    let err = deployments
        .get_scale("absent")
        .await
        .expect_err("no such deployment");
    assert!(
        matches!(err, kube::Error::Api(ref e) if e.code == 404),
        "{err}"
    );
}
