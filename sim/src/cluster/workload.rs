//! Pods for the simulated cluster: what the demo submits and what the
//! end-to-end tests create.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use gpupool_api::Role;
use gpupool_api::names::{
    ANNOTATION_SIM_RUN_SECONDS, DEFAULT_RESOURCE_NAME, LABEL_CLASS, LABEL_ROLE,
};
use k8s_openapi::api::core::v1::{Container, Pod, PodSpec, ResourceRequirements};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::{Api, ObjectMeta, PostParams};

use super::ClusterError;

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

/// Dry-run probes a class must pass in a row before the webhook is taken to
/// know it: one webhook address may spread calls over several operator
/// replicas, each with its own class cache.
const CLASS_PROBES_IN_A_ROW: usize = 4;

/// Waits until the pod webhook knows GpuLeaseClass `class`, so that pods
/// created next are not refused for naming a class the webhook's cache has
/// not seen yet. Each probe is a dry-run create (it passes the admission
/// webhooks and stores nothing) in `pods`' namespace of a pod naming the
/// class. The class counts as known after [`CLASS_PROBES_IN_A_ROW`]
/// probes in a row are admitted or refused for another reason than an
/// unknown class; a webhook that cannot be reached is waited for too.
pub async fn wait_until_webhook_knows_class(
    pods: &Api<Pod>,
    class: &str,
    timeout: Duration,
) -> Result<(), ClusterError> {
    let mut probe = slot_pod("gpupool-class-probe", 1, Role::Primary, None);
    probe
        .metadata
        .labels
        .get_or_insert_with(BTreeMap::new)
        .insert(LABEL_CLASS.to_owned(), class.to_owned());
    let dry_run = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    let unknown = format!("GpuLeaseClass {class:?} (label {LABEL_CLASS}) does not exist");
    let deadline = Instant::now() + timeout;
    let mut in_a_row = 0;
    while in_a_row < CLASS_PROBES_IN_A_ROW {
        let known = match pods.create(&dry_run, &probe).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(status))
                if status.code / 100 == 4 && !status.message.contains(&unknown) =>
            {
                Ok(())
            }
            Err(e) => Err(e),
        };
        match known {
            Ok(()) => in_a_row += 1,
            Err(e) => {
                in_a_row = 0;
                if Instant::now() >= deadline {
                    return Err(ClusterError::NotReady(format!(
                        "the pod webhook did not know GpuLeaseClass {class:?} within {} s: {e}",
                        timeout.as_secs()
                    )));
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    Ok(())
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
