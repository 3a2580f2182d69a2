//! Custom resource field selectors, as kube-apiserver serves them for a
//! CRD version with `selectableFields`: list and watch select by the
//! declared fields (an absent field reads as the empty string, and an
//! object that starts or stops matching is ADDED or DELETED for a watch),
//! and a field the CRD does not declare is refused with 400 BadRequest
//! `field label not supported: <field>`, also after an update of the CRD
//! takes the field away.

use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use gpupool_sim_apiserver::{ADMIN_TOKEN, ApiServer, ApiServerConfig, RunningApiServer};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, Patch,
    PatchParams, PostParams, WatchEvent, WatchParams,
};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};

const NS: &str = "default";

async fn start() -> (RunningApiServer, Client) {
    let server = ApiServer::start(ApiServerConfig::default())
        .await
        .expect("server starts");
    let mut config = server.kube_config(ADMIN_TOKEN).await.expect("config");
    config.default_retry = false;
    let client = Client::try_from(config).expect("client builds");
    (server, client)
}

fn crd(selectable: &[&str]) -> Value {
    json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "widgets.example.io"},
        "spec": {
            "group": "example.io",
            "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
            "scope": "Namespaced",
            "versions": [{
                "name": "v1", "served": true, "storage": true,
                "subresources": {"status": {}},
                "selectableFields": selectable.iter().map(|p| json!({"jsonPath": p})).collect::<Vec<_>>(),
                "schema": {"openAPIV3Schema": {"type": "object", "properties": {
                    "spec": {"type": "object", "properties": {"size": {"type": "integer"}}},
                    "status": {"type": "object", "properties": {"node": {"type": "string"}}},
                }}},
            }],
        },
    })
}

async fn install(client: &Client, selectable: &[&str]) {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let want: CustomResourceDefinition =
        serde_json::from_value(crd(selectable)).expect("a valid CRD");
    crds.create(&PostParams::default(), &want)
        .await
        .expect("CRD created");
}

fn widgets(client: &Client) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk("example.io", "v1", "Widget");
    Api::namespaced_with(client.clone(), NS, &ApiResource::from_gvk(&gvk))
}

async fn widget(api: &Api<DynamicObject>, name: &str, node: Option<&str>) {
    let obj: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "example.io/v1", "kind": "Widget",
        "metadata": {"name": name}, "spec": {"size": 1},
    }))
    .expect("a widget");
    api.create(&PostParams::default(), &obj)
        .await
        .expect("widget created");
    if let Some(node) = node {
        set_node(api, name, node).await;
    }
}

async fn set_node(api: &Api<DynamicObject>, name: &str, node: &str) {
    api.patch_status(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"node": node}})),
    )
    .await
    .expect("status patched");
}

async fn names(api: &Api<DynamicObject>, selector: &str) -> Vec<String> {
    let mut names: Vec<String> = api
        .list(&ListParams::default().fields(selector))
        .await
        .unwrap_or_else(|e| panic!("list with {selector}: {e}"))
        .items
        .iter()
        .map(ResourceExt::name_any)
        .collect();
    names.sort();
    names
}

fn refusal(e: kube::Error) -> (u16, String, String) {
    match e {
        kube::Error::Api(s) => (s.code, s.reason, s.message),
        other => panic!("not an API refusal: {other}"),
    }
}

#[tokio::test]
async fn a_declared_field_selects_on_list_and_watch() {
    let (server, client) = start().await;
    install(&client, &[".status.node"]).await;
    let api = widgets(&client);
    widget(&api, "a", Some("n1")).await;
    widget(&api, "b", Some("n2")).await;
    widget(&api, "c", None).await;

    assert_eq!(names(&api, "status.node=n1").await, ["a"]);
    assert_eq!(names(&api, "status.node==n2").await, ["b"]);
    assert_eq!(names(&api, "status.node=").await, ["c"], "absent is empty");
    assert_eq!(names(&api, "status.node!=n1").await, ["b", "c"]);
    assert_eq!(
        names(&api, "status.node=n1,metadata.name=a").await,
        ["a"],
        "metadata fields combine with it"
    );

    let rv = api
        .list(&ListParams::default().fields("status.node=n1"))
        .await
        .expect("list")
        .metadata
        .resource_version
        .expect("a list resourceVersion");
    let mut events = api
        .watch(&WatchParams::default().fields("status.node=n1"), &rv)
        .await
        .expect("watch starts")
        .boxed();
    set_node(&api, "b", "n1").await; // moves in: ADDED
    api.patch(
        "c",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"size": 2}})),
    )
    .await
    .expect("patched"); // never matches: nothing
    set_node(&api, "a", "n2").await; // moves out: DELETED
    api.patch(
        "b",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"size": 3}})),
    )
    .await
    .expect("patched"); // still matches: MODIFIED
    api.delete("b", &DeleteParams::default())
        .await
        .expect("deleted"); // was matching: DELETED
    let mut seen = Vec::new();
    while seen.len() < 4 {
        let event = tokio::time::timeout(Duration::from_secs(10), events.try_next())
            .await
            .unwrap_or_else(|_| panic!("no further watch event after {seen:?}"))
            .expect("watch stream")
            .expect("watch stream open");
        match event {
            WatchEvent::Added(o) => seen.push(format!("ADDED {}", o.name_any())),
            WatchEvent::Modified(o) => seen.push(format!("MODIFIED {}", o.name_any())),
            WatchEvent::Deleted(o) => seen.push(format!("DELETED {}", o.name_any())),
            WatchEvent::Bookmark(_) => {}
            WatchEvent::Error(e) => panic!("watch error: {e:?}"),
        }
    }
    assert_eq!(seen, ["ADDED b", "DELETED a", "MODIFIED b", "DELETED b"]);
    server.shutdown().await;
}

#[tokio::test]
async fn an_undeclared_field_is_refused_on_list_and_watch() {
    let (server, client) = start().await;
    install(&client, &[".status.node"]).await;
    let api = widgets(&client);
    widget(&api, "a", Some("n1")).await;

    let want = (
        400,
        "BadRequest".to_owned(),
        "field label not supported: spec.size".to_owned(),
    );
    let e = api
        .list(&ListParams::default().fields("spec.size=1"))
        .await
        .expect_err("spec.size is not declared");
    assert_eq!(refusal(e), want);
    let e = api
        .watch(&WatchParams::default().fields("spec.size=1"), "0")
        .await
        .map(|_| ())
        .expect_err("spec.size is not declared");
    assert_eq!(refusal(e), want);

    // An update that takes the field away takes the selector with it: what
    // a cluster whose CRD predates selectableFields answers.
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    crds.patch(
        "widgets.example.io",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"versions": [crd(&[])["spec"]["versions"][0].clone()]}})),
    )
    .await
    .expect("CRD updated");
    let e = api
        .list(&ListParams::default().fields("status.node=n1"))
        .await
        .expect_err("status.node is no longer declared");
    assert_eq!(
        refusal(e),
        (
            400,
            "BadRequest".to_owned(),
            "field label not supported: status.node".to_owned()
        )
    );
    assert_eq!(names(&api, "metadata.name=a").await, ["a"]);
    server.shutdown().await;
}
