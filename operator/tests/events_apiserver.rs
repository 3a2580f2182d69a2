//! Events the operator publishes, written to a real (simulated) API server
//! over its REST protocol: one Event per occurrence, and a repeat counted
//! in the first one's series instead of a new object.

use std::time::Duration;

use gpupool_operator::controller::events::{EventSink, PodEvent};
use gpupool_operator::engine::ObjectKey;
use gpupool_operator::metrics::Metrics;
use gpupool_sim_apiserver::{ApiServer, ApiServerConfig};
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::api::events::v1::Event;
use kube::Api;
use kube::api::{DeleteParams, ListParams, PostParams};
use serde_json::json;

/// Lists the namespace's Events until `done` holds for them.
async fn events_when(api: &Api<Event>, done: impl Fn(&[Event]) -> bool) -> Vec<Event> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let events = api.list(&ListParams::default()).await.expect("list").items;
        if done(&events) || tokio::time::Instant::now() > deadline {
            return events;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn a_repeated_event_counts_up_its_series_and_a_new_one_is_written() {
    let server = ApiServer::start(ApiServerConfig::default())
        .await
        .expect("API server starts");
    let client = server.client().await.expect("client");
    Api::<Namespace>::all(client.clone())
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "ml"}})).expect("namespace"),
        )
        .await
        .expect("namespace");
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = Metrics::register(&mut registry);
    let sink = EventSink::spawn(client.clone(), "replica-1".into(), metrics);
    let pod = ObjectKey::new("ml", "train");
    let queued = || PodEvent::Queued { position: Some(2) };
    sink.emit(&pod, "uid-1", queued());
    sink.emit(&pod, "uid-1", queued());
    sink.emit(&pod, "uid-1", queued());
    sink.emit(
        &pod,
        "uid-1",
        PodEvent::Admitted {
            node: "node-1".into(),
        },
    );

    let api: Api<Event> = Api::namespaced(client, "ml");
    let count = |e: &Event| e.series.as_ref().map_or(1, |s| s.count);
    let events = events_when(&api, |events| {
        events.len() == 2 && events.iter().map(count).sum::<i32>() == 4
    })
    .await;
    let mut seen: Vec<(String, String, i32)> = events
        .iter()
        .map(|e| {
            (
                e.reason.clone().unwrap_or_default(),
                e.note.clone().unwrap_or_default(),
                count(e),
            )
        })
        .collect();
    seen.sort();
    assert_eq!(
        seen,
        [
            (
                "Admitted".to_owned(),
                "admitted to node node-1".to_owned(),
                1
            ),
            (
                "Queued".to_owned(),
                "waiting for a GPU slot at position 2".to_owned(),
                3
            ),
        ]
    );
    for e in &events {
        let regarding = e.regarding.as_ref().expect("regarding");
        assert_eq!(
            (regarding.name.as_deref(), regarding.uid.as_deref()),
            (Some("train"), Some("uid-1"))
        );
        assert_eq!(e.reporting_instance.as_deref(), Some("replica-1"));
        assert_eq!(e.type_.as_deref(), Some("Normal"));
    }

    // The Event a repeat would count up is gone (expired, or deleted by
    // someone): the repeat is written as a new Event.
    let queued_event = events
        .iter()
        .find(|e| e.reason.as_deref() == Some("Queued"))
        .and_then(|e| e.metadata.name.clone())
        .expect("the Queued event");
    api.delete(&queued_event, &DeleteParams::default())
        .await
        .expect("delete");
    sink.emit(&pod, "uid-1", queued());
    let events = events_when(&api, |events| events.len() == 2).await;
    let queued_now: Vec<_> = events
        .iter()
        .filter(|e| e.reason.as_deref() == Some("Queued"))
        .collect();
    assert_eq!(queued_now.len(), 1, "{events:?}");
    assert_ne!(queued_now[0].metadata.name.as_ref(), Some(&queued_event));
    assert_eq!(count(queued_now[0]), 1);
}
