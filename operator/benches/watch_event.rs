//! Reading one watch event's object, as the pod and lease watches do: a
//! pod and a lease as a real API server sends them (managed fields of each
//! writer, owner references, a tenant's labels and annotations), read into
//! the kept form through the watched one, and, for comparison, with the
//! whole `ObjectMeta` the watched form used to carry.

#![allow(missing_docs, clippy::unwrap_used)]

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use gpupool_api::GpuLease;
use gpupool_operator::engine::CachedLease;
use gpupool_operator::index::cached_pod::{CachedPod, CachedPodSpec, CachedPodStatus, WatchedPod};
use gpupool_operator::index::watched::WatchedLease;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::Deserialize;
use serde_json::{Value, json};

/// The same pod read with its whole metadata: the form before
/// `kept_metadata`.
#[derive(Deserialize)]
struct WholeMetaPod {
    metadata: ObjectMeta,
    #[serde(default)]
    spec: Option<CachedPodSpec>,
    #[serde(default)]
    status: Option<CachedPodStatus>,
}

fn managed(manager: &str, subresource: Option<&str>, fields: Value) -> Value {
    let mut entry = json!({
        "manager": manager,
        "operation": "Update",
        "apiVersion": "v1",
        "time": "2026-11-27T10:00:00Z",
        "fieldsType": "FieldsV1",
        "fieldsV1": fields,
    });
    if let Some(s) = subresource {
        entry["subresource"] = json!(s);
    }
    entry
}

/// A queued pod after its creator, the webhook and the kubelet wrote it.
fn pod() -> Vec<u8> {
    let container_fields = json!({
        "f:image": {}, "f:imagePullPolicy": {}, "f:name": {},
        "f:resources": {".": {}, "f:limits": {".": {}, "f:gpupool/slot": {}},
            "f:requests": {".": {}, "f:gpupool/slot": {}}},
        "f:terminationMessagePath": {}, "f:terminationMessagePolicy": {}
    });
    serde_json::to_vec(&json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "train-7f9c4-x2k8q",
            "generateName": "train-7f9c4-",
            "namespace": "ml",
            "uid": "4f1c2a9e-8d7b-4c3a-9e2f-1a2b3c4d5e6f",
            "resourceVersion": "1234567",
            "creationTimestamp": "2026-11-27T10:00:00Z",
            "labels": {
                "gpupool.io/class": "default",
                "gpupool.io/role": "primary",
                "app.kubernetes.io/name": "train",
                "batch.kubernetes.io/job-name": "train-7f9c4",
                "controller-uid": "9a8b7c6d-5e4f-3a2b-1c0d-ef0123456789",
                "team": "vision"
            },
            "annotations": {
                "gpupool.io/enqueued-at": "2026-11-27T10:00:00.123456Z",
                "kubectl.kubernetes.io/last-applied-configuration": format!("{{{}}}", "x".repeat(1500)),
                "prometheus.io/scrape": "true"
            },
            "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": "train-7f9c4",
                "uid": "9a8b7c6d-5e4f-3a2b-1c0d-ef0123456789", "controller": true,
                "blockOwnerDeletion": true}],
            "finalizers": ["batch.kubernetes.io/job-tracking"],
            "managedFields": [
                managed("kube-controller-manager", None, json!({
                    "f:metadata": {"f:finalizers": {".": {}, "v:\"batch.kubernetes.io/job-tracking\"": {}},
                        "f:generateName": {}, "f:labels": {".": {}, "f:app.kubernetes.io/name": {},
                        "f:batch.kubernetes.io/job-name": {}, "f:controller-uid": {}, "f:team": {},
                        "f:gpupool.io/class": {}, "f:gpupool.io/role": {}},
                        "f:ownerReferences": {".": {}, "k:{\"uid\":\"9a8b7c6d\"}": {}}},
                    "f:spec": {"f:containers": {"k:{\"name\":\"train\"}": container_fields},
                        "f:dnsPolicy": {}, "f:enableServiceLinks": {}, "f:restartPolicy": {},
                        "f:schedulerName": {}, "f:securityContext": {},
                        "f:terminationGracePeriodSeconds": {}}
                })),
                managed("gpupool-operator", None, json!({
                    "f:metadata": {"f:annotations": {"f:gpupool.io/enqueued-at": {}}},
                    "f:spec": {"f:schedulingGates": {".": {}, "k:{\"name\":\"gpupool.io/admission\"}": {".": {}, "f:name": {}}}}
                })),
                managed("kubelet", Some("status"), json!({
                    "f:status": {"f:conditions": {"k:{\"type\":\"PodScheduled\"}": {".": {},
                        "f:lastProbeTime": {}, "f:lastTransitionTime": {}, "f:message": {},
                        "f:reason": {}, "f:status": {}, "f:type": {}}}}
                })),
            ]
        },
        "spec": {
            "containers": [{
                "name": "train",
                "image": "registry.example.com/vision/train:2026.11",
                "command": ["python", "-m", "train", "--epochs", "90"],
                "resources": {"limits": {"gpupool/slot": "1"}, "requests": {"gpupool/slot": "1"}}
            }],
            "schedulingGates": [{"name": "gpupool.io/admission"}],
            "tolerations": [
                {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300},
                {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300}
            ]
        },
        "status": {
            "phase": "Pending",
            "conditions": [{"type": "PodScheduled", "status": "False", "reason": "SchedulingGated",
                "message": "Scheduling is blocked due to non-empty scheduling gates"}]
        }
    }))
    .unwrap()
}

/// A queued lease after the operator created it and wrote its status.
fn lease() -> Vec<u8> {
    serde_json::to_vec(&json!({
        "apiVersion": "gpupool.io/v1alpha1",
        "kind": "GpuLease",
        "metadata": {
            "name": "train-7f9c4-x2k8q",
            "namespace": "ml",
            "uid": "0d1e2f3a-4b5c-6d7e-8f90-a1b2c3d4e5f6",
            "resourceVersion": "1234570",
            "generation": 1,
            "creationTimestamp": "2026-11-27T10:00:00Z",
            "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": "train-7f9c4-x2k8q",
                "uid": "4f1c2a9e-8d7b-4c3a-9e2f-1a2b3c4d5e6f", "controller": true,
                "blockOwnerDeletion": false}],
            "managedFields": [
                managed("gpupool-operator", None, json!({
                    "f:metadata": {"f:ownerReferences": {".": {}, "k:{\"uid\":\"4f1c2a9e\"}": {}}},
                    "f:spec": {".": {}, "f:className": {}, "f:podName": {}, "f:podUID": {},
                        "f:role": {}, "f:slots": {}}
                })),
                managed("gpupool-operator", Some("status"), json!({
                    "f:status": {".": {}, "f:message": {}, "f:phase": {}, "f:position": {},
                        "f:queuedAt": {}, "f:sequence": {}}
                })),
            ]
        },
        "spec": {"className": "default", "podName": "train-7f9c4-x2k8q",
            "podUID": "4f1c2a9e-8d7b-4c3a-9e2f-1a2b3c4d5e6f", "role": "primary", "slots": 1},
        "status": {"phase": "Queued", "sequence": 8123, "position": 412,
            "queuedAt": "2026-11-27T10:00:00Z",
            "message": "waiting at position 412 of class default (primary)"}
    }))
    .unwrap()
}

fn read_pod(c: &mut Criterion) {
    let body = pod();
    let mut group = c.benchmark_group("watch_event_pod");
    group.bench_function("kept_metadata", |b| {
        b.iter(|| {
            let watched: WatchedPod = serde_json::from_slice(black_box(&body)).unwrap();
            CachedPod::from(watched)
        })
    });
    group.bench_function("whole_object_meta", |b| {
        b.iter(|| {
            let whole: WholeMetaPod = serde_json::from_slice(black_box(&body)).unwrap();
            CachedPod::from(WatchedPod {
                metadata: whole.metadata,
                spec: whole.spec,
                status: whole.status,
            })
        })
    });
    group.finish();
}

fn read_lease(c: &mut Criterion) {
    let body = lease();
    let mut group = c.benchmark_group("watch_event_lease");
    group.bench_function("kept_metadata", |b| {
        b.iter(|| {
            let watched: WatchedLease = serde_json::from_slice(black_box(&body)).unwrap();
            CachedLease::from(watched)
        })
    });
    group.bench_function("whole_object_meta", |b| {
        b.iter(|| {
            let whole: GpuLease = serde_json::from_slice(black_box(&body)).unwrap();
            CachedLease::from(whole)
        })
    });
    group.finish();
}

criterion_group!(benches, read_pod, read_lease);
criterion_main!(benches);
