//! Pods for the simulated cluster: what the demo submits and what the
//! end-to-end tests create.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use gpupool_api::Role;
use gpupool_api::names::{ANNOTATION_SIM_RUN_SECONDS, DEFAULT_RESOURCE_NAME, LABEL_ROLE};
use k8s_openapi::api::core::v1::{Container, Pod, PodSpec, ResourceRequirements};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::{Api, ObjectMeta};

/// A pod whose one container asks for `slots` of `gpupool/slot` (requests
/// = limits), with the given role, and that runs for `run_seconds` when set.
pub fn slot_pod(name: &str, slots: u32, role: Role, run_seconds: Option<f64>) -> Pod {
    let amount = BTreeMap::from([(
        DEFAULT_RESOURCE_NAME.to_owned(),
        Quantity(slots.to_string()),
    )]);
    let annotations = run_seconds
        .map(|s| BTreeMap::from([(ANNOTATION_SIM_RUN_SECONDS.to_owned(), s.to_string())]));
    Pod {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            labels: Some(BTreeMap::from([(
                LABEL_ROLE.to_owned(),
                role.as_str().to_owned(),
            )])),
            annotations,
            ..Default::default()
        },
        spec: Some(PodSpec {
            containers: vec![Container {
                name: "main".into(),
                image: Some("registry.example/train:1".into()),
                resources: Some(ResourceRequirements {
                    requests: Some(amount.clone()),
                    limits: Some(amount),
                    ..Default::default()
                }),
                ..Default::default()
            }],
            termination_grace_period_seconds: Some(1),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Polls `get` every 50 ms until `done` holds for what it returns, for at
/// most `timeout`; returns the last value read, or `Err` with it on timeout.
pub async fn wait_for<T, F, Fut, P>(timeout: Duration, mut get: F, done: P) -> Result<T, Option<T>>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
    P: Fn(&T) -> bool,
{
    let deadline = Instant::now() + timeout;
    let mut last = None;
    loop {
        if let Some(v) = get().await {
            if done(&v) {
                return Ok(v);
            }
            last = Some(v);
        }
        if Instant::now() >= deadline {
            return Err(last);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until pod `name` satisfies `done`; `Err` carries a description of
/// the pod's last state, for the test's failure message.
pub async fn wait_pod(
    api: &Api<Pod>,
    name: &str,
    timeout: Duration,
    done: impl Fn(&Pod) -> bool,
) -> Result<Pod, String> {
    wait_for(timeout, || async { api.get_opt(name).await.ok().flatten() }, done)
        .await
        .map_err(|last| match last {
            Some(p) => format!(
                "pod {name} did not get there within {timeout:?}; last seen: spec.nodeName={} status={}",
                p.spec
                    .as_ref()
                    .and_then(|s| s.node_name.as_deref())
                    .unwrap_or("(none)"),
                serde_json::to_string(&p.status).unwrap_or_default()
            ),
            None => format!("pod {name} was not found within {timeout:?}"),
        })
}

/// The pod's phase, `""` when it has none yet.
pub fn phase(pod: &Pod) -> &str {
    pod.status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or_default()
}
