//! Webhook latency: the pure review of an AdmissionReview body (parse,
//! decide, encode) for a gpupool pod and for an ordinary pod, and the whole
//! HTTPS round trip to the real server on 127.0.0.1. After criterion's
//! figures it prints one JSON line of HTTPS latency percentiles (target: p99
//! ≤ 2 ms).

#![allow(missing_docs, clippy::unwrap_used)]

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{Criterion, criterion_group};
use gpupool_api::{
    GpuLeaseClass, GpuLeaseClassSpec, GpuLeaseSpec, GpuLeaseStatus, LeasePhase, Role,
};
use gpupool_operator::engine::{CachedLease, ClassInfo, PodInfo};
use gpupool_operator::index::store::{Index, tallied_index};
use gpupool_operator::webhook::certs;
use gpupool_operator::webhook::review::{
    ClusterView, Identities, StaticView, Users, WebhookKind, queue_key, queue_tally_key,
    review_body,
};
use gpupool_operator::webhook::server::{self, CertResolver, Handler, WebhookMetrics};
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::{Value, json};

/// What a review sees in the operator: classes and nodes, and the leases
/// in a cache that tallies the queued ones, so `maxQueued` reads a count.
#[derive(Clone)]
struct CachedView {
    base: StaticView,
    leases: Index<CachedLease>,
}

impl ClusterView for CachedView {
    fn classes(&self) -> Vec<Arc<GpuLeaseClass>> {
        self.base.classes()
    }
    fn largest_node(
        &self,
        class: &ClassInfo,
        pod: &PodInfo,
    ) -> Result<Option<(String, u32)>, String> {
        self.base.largest_node(class, pod)
    }
    fn queued(&self, class: &str, role: Role) -> usize {
        self.leases.count(&queue_key(class, role))
    }
}

/// A cluster of 100 nodes × 8 slots, one default class bounded at 5,000
/// queued, and 2,000 leases (half queued), so every cache-backed check runs.
fn view() -> CachedView {
    let base = static_view();
    let (leases, mut writer) = tallied_index(queue_tally_key);
    for lease in &base.leases {
        writer.apply(&kube::runtime::watcher::Event::Apply((**lease).clone()));
    }
    CachedView { base, leases }
}

fn static_view() -> StaticView {
    let class = GpuLeaseClass::new(
        "default",
        GpuLeaseClassSpec {
            default: true,
            admission: gpupool_api::AdmissionSpec {
                max_queued: 5_000,
                ..Default::default()
            },
            ..Default::default()
        },
    );
    let nodes = (1..=100)
        .map(|i| {
            Arc::new(
                serde_json::from_value(json!({
                    "metadata": {"name": format!("node-{i}"), "labels": {"kubernetes.io/hostname": format!("node-{i}")}},
                    "status": {"allocatable": {"gpupool/slot": "8", "cpu": "64", "memory": "512Gi"}}
                }))
                .unwrap(),
            )
        })
        .collect();
    let leases = (0..2_000)
        .map(|i| {
            let status = GpuLeaseStatus {
                phase: if i % 2 == 0 {
                    LeasePhase::Queued
                } else {
                    LeasePhase::Admitted
                },
                ..Default::default()
            };
            Arc::new(CachedLease::new(
                "ml",
                &format!("pod-{i}"),
                GpuLeaseSpec {
                    class_name: "default".into(),
                    pod_name: format!("pod-{i}"),
                    pod_uid: format!("uid-{i}"),
                    role: Role::Primary,
                    slots: 1,
                },
                Some(status),
            ))
        })
        .collect();
    StaticView {
        classes: vec![Arc::new(class)],
        nodes,
        leases,
    }
}

fn pod(resources: Value) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "train", "namespace": "ml",
            "labels": {"app": "trainer", "gpupool.io/role": "primary"},
            "annotations": {"team": "vision"}},
        "spec": {
            "containers": [{"name": "main", "image": "registry.example.com/trainer:1.2.3",
                "command": ["python", "train.py", "--epochs", "10"],
                "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}],
                "resources": resources,
                "volumeMounts": [{"name": "data", "mountPath": "/data"}]}],
            "volumes": [{"name": "data", "emptyDir": {}}],
            "restartPolicy": "Never",
            "tolerations": [{"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300}]
        }
    })
}

fn review(pod: Value) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "5a0c8f0e-1111-4000-8000-00000000beef",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "name": "train", "namespace": "ml", "operation": "CREATE",
            "userInfo": {"username": "alice", "groups": ["system:authenticated"]},
            "object": pod, "dryRun": false
        }
    }))
    .unwrap()
}

fn gpupool_review() -> Vec<u8> {
    review(pod(
        json!({"limits": {"gpupool/slot": "1", "cpu": "4", "memory": "16Gi"}}),
    ))
}

fn plain_review() -> Vec<u8> {
    review(pod(json!({"requests": {"cpu": "1", "memory": "1Gi"}})))
}

fn identities() -> Identities {
    Identities {
        operator: Users::new(["system:serviceaccount:gpupool-system:gpupool-operator".to_owned()]),
        device_plugins: Users::new([
            "system:serviceaccount:gpupool-system:gpupool-device-plugin".to_owned()
        ]),
    }
}

fn pure_review(c: &mut Criterion) {
    let view = view();
    // The common case: no queue bound, so the lease tally is never read.
    let mut unbounded = view.clone();
    unbounded.base.classes = vec![Arc::new(GpuLeaseClass::new(
        "default",
        GpuLeaseClassSpec {
            default: true,
            ..Default::default()
        },
    ))];
    let identities = identities();
    let now = jiff::Timestamp::now();
    let mut group = c.benchmark_group("webhook_review");
    for (name, body, view) in [
        ("gpupool_pod", gpupool_review(), &view),
        ("gpupool_pod_unbounded_queue", gpupool_review(), &unbounded),
        ("plain_pod", plain_review(), &view),
    ] {
        group.bench_function(name, |b| {
            b.iter(|| {
                review_body(
                    WebhookKind::Mutate,
                    black_box(&body),
                    view,
                    &identities,
                    now,
                )
                .unwrap()
            })
        });
    }
    group.finish();
}

/// A running HTTPS webhook and one kept-alive HTTP/1.1 connection to it.
struct Https {
    runtime: tokio::runtime::Runtime,
    sender: hyper::client::conn::http1::SendRequest<Full<Bytes>>,
}

fn https() -> Https {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let sender = runtime.block_on(async {
        let bundle =
            certs::generate(&["127.0.0.1".to_owned()], jiff::Timestamp::now(), None).unwrap();
        let resolver = CertResolver::new(bundle.certified_key().unwrap());
        let tls = server::tls_config(resolver).unwrap();
        let handler = Arc::new(Handler::new(
            view(),
            identities(),
            WebhookMetrics::default(),
        ));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(server::serve(
            listener,
            tls,
            handler,
            std::future::pending(),
        ));

        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(bundle.ca_pem.as_bytes()) {
            roots.add(cert.unwrap()).unwrap();
        }
        let config = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        tcp.set_nodelay(true).unwrap();
        let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
            .connect(ServerName::try_from("127.0.0.1").unwrap(), tcp)
            .await
            .unwrap();
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
            .await
            .unwrap();
        tokio::spawn(conn);
        sender
    });
    Https { runtime, sender }
}

impl Https {
    fn post(&mut self, body: &Bytes) -> Duration {
        let request = Request::post("/mutate-pods")
            .header("content-type", "application/json")
            .body(Full::new(body.clone()))
            .unwrap();
        self.runtime.block_on(async {
            // The connection is reused: wait until it can take the next request.
            self.sender.ready().await.unwrap();
            let started = Instant::now();
            let response = self.sender.send_request(request).await.unwrap();
            assert_eq!(response.status(), 200);
            let _ = response.into_body().collect().await.unwrap();
            started.elapsed()
        })
    }
}

fn https_round_trip(c: &mut Criterion) {
    let mut https = https();
    let mut group = c.benchmark_group("webhook_https");
    for (name, body) in [
        ("gpupool_pod", gpupool_review()),
        ("plain_pod", plain_review()),
    ] {
        let body = Bytes::from(body);
        group.bench_function(name, |b| {
            b.iter_custom(|iters| (0..iters).map(|_| https.post(&body)).sum())
        });
    }
    group.finish();
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64() * 1e3
}

/// p50/p99/max over 10,000 sequential HTTPS reviews of each kind of pod.
fn https_percentiles() {
    let mut https = https();
    let mut figures = serde_json::Map::new();
    for (name, body) in [
        ("gpupool_pod", gpupool_review()),
        ("plain_pod", plain_review()),
    ] {
        let body = Bytes::from(body);
        for _ in 0..500 {
            https.post(&body);
        }
        let mut samples: Vec<Duration> = (0..10_000).map(|_| https.post(&body)).collect();
        samples.sort();
        figures.insert(
            name.to_owned(),
            json!({
                "samples": samples.len(),
                "p50_ms": percentile(&samples, 0.50),
                "p99_ms": percentile(&samples, 0.99),
                "max_ms": percentile(&samples, 1.0),
            }),
        );
    }
    println!("{}", json!({ "webhook_https_latency": figures }));
}

criterion_group!(benches, pure_review, https_round_trip);

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
    https_percentiles();
}
