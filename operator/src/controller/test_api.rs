//! Fixtures for tests that write leases through a real (simulated) API
//! server.

use gpupool_api::{GpuLease, GpuLeaseSpec, GpuLeaseStatus, LeasePhase, Role};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Patch, PostParams};
use kube::{Api, Client};

use super::apply::patch_params;
use super::patch;
use crate::engine::CachedLease;

/// A simulated API server with both CRDs and namespace `ns`, and a client
/// of it.
pub async fn api_server() -> (gpupool_sim_apiserver::RunningApiServer, Client) {
    let server =
        gpupool_sim_apiserver::ApiServer::start(gpupool_sim_apiserver::ApiServerConfig::default())
            .await
            .expect("API server starts");
    for file in ["gpuleases.yaml", "gpuleaseclasses.yaml"] {
        let crd = std::fs::read_to_string(format!("{}/../crds/{file}", env!("CARGO_MANIFEST_DIR")))
            .expect("CRD file");
        server
            .create_crds_from_yaml(&crd)
            .await
            .expect("CRD applies");
    }
    let client = server.client().await.expect("client");
    let ns: k8s_openapi::api::core::v1::Namespace =
        serde_json::from_value(serde_json::json!({"metadata": {"name": "ns"}})).expect("namespace");
    Api::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await
        .expect("namespace created");
    (server, client)
}

/// Lease `name` in namespace `ns` with `phase`, as a cache would hold it at
/// resourceVersion `rv`.
pub fn lease(name: &str, rv: &str, phase: LeasePhase) -> GpuLease {
    GpuLease {
        metadata: ObjectMeta {
            namespace: Some("ns".into()),
            name: Some(name.into()),
            uid: Some("u".into()),
            resource_version: Some(rv.into()),
            ..Default::default()
        },
        spec: GpuLeaseSpec {
            class_name: "default".into(),
            pod_name: name.into(),
            pod_uid: "p".into(),
            role: Role::Primary,
            slots: 1,
        },
        status: Some(GpuLeaseStatus {
            phase,
            ..Default::default()
        }),
    }
}

/// [`lease`] as the lease cache keeps it.
pub fn cached_lease(name: &str, rv: &str, phase: LeasePhase) -> CachedLease {
    lease(name, rv, phase).into()
}

/// Creates lease `name` Queued at `position` and returns it as read back,
/// as the lease cache keeps it.
pub async fn queued_lease(api: &Api<GpuLease>, name: &str, position: u32) -> CachedLease {
    let mut new = lease(name, "", LeasePhase::Queued);
    new.metadata.uid = None;
    new.metadata.resource_version = None;
    let created = api
        .create(&PostParams::default(), &new)
        .await
        .expect("lease created");
    let status = GpuLeaseStatus {
        phase: LeasePhase::Queued,
        sequence: Some(7),
        position: Some(position),
        ..Default::default()
    };
    let body =
        patch::lease_status_patch(None, &status, created.metadata.resource_version.as_deref());
    api.patch_status(name, &patch_params(), &Patch::Merge(&body))
        .await
        .expect("status written")
        .into()
}

/// Another writer's `status` for lease `name` over the lease as it was
/// read (`seen`).
pub async fn written_behind(
    api: &Api<GpuLease>,
    name: &str,
    seen: &CachedLease,
    status: &GpuLeaseStatus,
) -> GpuLease {
    let body = patch::lease_status_patch(
        seen.status.as_ref(),
        status,
        seen.metadata.resource_version.as_deref(),
    );
    api.patch_status(name, &patch_params(), &Patch::Merge(&body))
        .await
        .expect("the other write")
}
