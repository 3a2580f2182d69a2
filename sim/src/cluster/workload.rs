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

/// The termination grace period [`run_on`] gives a pod that sets none.
pub const REAL_NODE_GRACE_SECONDS: i64 = 1;

/// What a container of the workload image runs before anything else: it
/// prints the GPU environment Allocate gave it (`GPUPOOL_*`), so a test
/// reads from the container's log what the simulated kubelet records in
/// its `sim.gpupool.io/allocated-env` annotation.
const PRINT_GPU_ENV: &str = "env | grep '^GPUPOOL_' | sort";

/// Makes `pod`, written for the simulated kubelet (whatever image, and
/// the `sim.gpupool.io/run-seconds` annotation), run the same way on
/// `backend`: on [`Backend::RealNodes`] every container runs the workload
/// image ([`crate::real_node::WORKLOAD_IMAGE`], never pulled) with a
/// script doing what the simulated kubelet does. Other backends leave it
/// as it is.
///
/// - an app container runs for the annotation's seconds and exits 0 (the
///   pod's `restartPolicy` becomes `Never` unless it sets one, so the pod
///   Succeeds as a simulated one does), or until it is stopped;
/// - a restartable init container (a sidecar) runs until it is stopped;
/// - a regular init container exits 0 at once;
///
/// and each prints its `GPUPOOL_*` environment first. Every one exits 0
/// on SIGTERM. A container stopped before its shell has set that up (a pod
/// deleted as it starts) ignores SIGTERM, as PID 1 does without a handler,
/// and the kubelet kills it after the pod's grace period: a pod that sets
/// none gets [`REAL_NODE_GRACE_SECONDS`], as the simulated kubelet caps
/// every termination.
pub fn run_on(pod: &mut Pod, backend: &super::Backend) {
    if !backend.is_real_nodes() {
        return;
    }
    let run_seconds = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ANNOTATION_SIM_RUN_SECONDS))
        .and_then(|s| s.parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s >= 0.0);
    let Some(spec) = pod.spec.as_mut() else {
        return;
    };
    if run_seconds.is_some() && spec.restart_policy.is_none() {
        spec.restart_policy = Some("Never".to_owned());
    }
    spec.termination_grace_period_seconds
        .get_or_insert(REAL_NODE_GRACE_SECONDS);
    let until_stopped = format!("trap 'exit 0' TERM; {PRINT_GPU_ENV}; sleep infinity & wait $!");
    let for_app = match run_seconds {
        Some(s) => format!("trap 'exit 0' TERM; {PRINT_GPU_ENV}; sleep {s} & wait $!"),
        None => until_stopped.clone(),
    };
    let init_done = format!("{PRINT_GPU_ENV}; exit 0");
    let as_workload = |c: &mut Container, script: &str| {
        c.image = Some(crate::real_node::WORKLOAD_IMAGE.to_owned());
        c.image_pull_policy = Some("Never".to_owned());
        c.command = Some(vec!["sh".to_owned(), "-c".to_owned(), script.to_owned()]);
        c.args = None;
    };
    for c in spec.init_containers.iter_mut().flatten() {
        let sidecar = c.restart_policy.as_deref() == Some("Always");
        as_workload(c, if sidecar { &until_stopped } else { &init_done });
    }
    for c in &mut spec.containers {
        as_workload(c, &for_app);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::Backend;

    fn scripts(pod: &Pod) -> Vec<String> {
        let spec = pod.spec.as_ref().expect("spec");
        spec.init_containers
            .iter()
            .flatten()
            .chain(&spec.containers)
            .map(|c| c.command.clone().unwrap_or_default().join(" "))
            .collect()
    }

    #[test]
    fn a_simulated_pod_runs_the_workload_image_on_real_nodes_only() {
        let mut pod = slot_pod("p", 1, Role::Primary, Some(2.5));
        let before = pod.clone();
        run_on(&mut pod, &Backend::Simulated);
        assert_eq!(pod, before);
        run_on(
            &mut pod,
            &Backend::RealNodes {
                assets: "a".into(),
                images: "i".into(),
            },
        );
        let c = &pod.spec.as_ref().expect("spec").containers[0];
        assert_eq!(c.image.as_deref(), Some(crate::real_node::WORKLOAD_IMAGE));
        assert_eq!(c.image_pull_policy.as_deref(), Some("Never"));
        assert_eq!(
            scripts(&pod),
            ["sh -c trap 'exit 0' TERM; env | grep '^GPUPOOL_' | sort; sleep 2.5 & wait $!"]
        );
        let spec = pod.spec.as_ref().expect("spec");
        assert_eq!(spec.restart_policy.as_deref(), Some("Never"));
        assert_eq!(
            spec.termination_grace_period_seconds,
            Some(1),
            "slot_pod's own"
        );
    }

    #[test]
    fn init_containers_end_at_once_and_sidecars_run_until_stopped() {
        let mut pod = slot_pod("p", 1, Role::Primary, None);
        let spec = pod.spec.as_mut().expect("spec");
        let init = |name: &str, policy: Option<&str>| Container {
            name: name.into(),
            image: Some("sim".into()),
            restart_policy: policy.map(str::to_owned),
            ..Default::default()
        };
        spec.init_containers = Some(vec![init("side", Some("Always")), init("setup", None)]);
        let real = Backend::RealNodes {
            assets: "a".into(),
            images: "i".into(),
        };
        run_on(&mut pod, &real);
        let until_stopped =
            "sh -c trap 'exit 0' TERM; env | grep '^GPUPOOL_' | sort; sleep infinity & wait $!";
        assert_eq!(
            scripts(&pod),
            [
                until_stopped,
                "sh -c env | grep '^GPUPOOL_' | sort; exit 0",
                until_stopped
            ]
        );
    }
}
