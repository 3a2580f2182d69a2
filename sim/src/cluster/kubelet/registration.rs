//! The kubelet's `Registration` service on `device-plugins/kubelet.sock`:
//! validates a plugin's request as kubelet does, then connects back to it.

use std::sync::Arc;

use gpupool_kubelet_api::proto::deviceplugin::v1beta1::{
    Empty, RegisterRequest, registration_server::Registration,
};
use tonic::{Request, Response, Status};

use super::Shared;
use super::plugins;
use crate::cluster::scheduler::plan::is_extended_resource;

/// The only device-plugin API version kubelet accepts.
pub const SUPPORTED_VERSION: &str = "v1beta1";

/// Why a registration is refused; the text is what the plugin receives.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegistrationError {
    /// Version other than v1beta1.
    #[error(
        "requested device plugin API version {0:?} is not supported; this kubelet supports {SUPPORTED_VERSION}"
    )]
    Version(String),
    /// Resource name is not an extended resource name.
    #[error(
        "resource name {0:?} is not an extended resource name (want domain/name outside kubernetes.io)"
    )]
    ResourceName(String),
    /// Endpoint is not a plain socket file name inside device-plugins/.
    #[error("endpoint {0:?} must be a socket file name inside the device-plugins directory")]
    Endpoint(String),
}

/// Checks a registration request the way kubelet's device manager does.
pub fn validate(req: &RegisterRequest) -> Result<(), RegistrationError> {
    if req.version != SUPPORTED_VERSION {
        return Err(RegistrationError::Version(req.version.clone()));
    }
    if !is_extended_resource(&req.resource_name) || !is_qualified_name(&req.resource_name) {
        return Err(RegistrationError::ResourceName(req.resource_name.clone()));
    }
    if req.endpoint.is_empty()
        || req.endpoint.contains('/')
        || req.endpoint == "."
        || req.endpoint == ".."
        || req.endpoint == super::KUBELET_SOCKET
    {
        return Err(RegistrationError::Endpoint(req.endpoint.clone()));
    }
    Ok(())
}

/// `prefix/name` with a DNS-subdomain prefix and a qualified-name part.
fn is_qualified_name(s: &str) -> bool {
    let Some((prefix, name)) = s.split_once('/') else {
        return false;
    };
    let dns_ok = !prefix.is_empty()
        && prefix.len() <= 253
        && prefix.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        });
    let name_ok = !name.is_empty()
        && name.len() <= 63
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name.ends_with(|c: char| c.is_ascii_alphanumeric());
    dns_ok && name_ok
}

/// The gRPC service; one per kubelet incarnation.
pub struct RegistrationService {
    pub(super) shared: Arc<Shared>,
}

#[tonic::async_trait]
impl Registration for RegistrationService {
    async fn register(&self, request: Request<RegisterRequest>) -> Result<Response<Empty>, Status> {
        let req = request.into_inner();
        if let Err(e) = validate(&req) {
            tracing::warn!(node = %self.shared.node_name, error = %e, "refused device plugin registration");
            return Err(Status::invalid_argument(e.to_string()));
        }
        plugins::connect(self.shared.clone(), req)
            .await
            .map_err(|e| Status::unavailable(e.to_string()))?;
        Ok(Response::new(Empty {}))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(version: &str, resource: &str, endpoint: &str) -> RegisterRequest {
        RegisterRequest {
            version: version.into(),
            endpoint: endpoint.into(),
            resource_name: resource.into(),
            options: None,
        }
    }

    #[test]
    fn accepts_what_kubelet_accepts() {
        assert_eq!(
            validate(&req("v1beta1", "gpupool/slot", "gpupool.sock")),
            Ok(())
        );
        assert_eq!(
            validate(&req("v1beta1", "example.com/gpu-1", "x.sock")),
            Ok(())
        );
    }

    #[test]
    fn refuses_bad_versions_names_and_endpoints() {
        assert_eq!(
            validate(&req("v1alpha", "gpupool/slot", "a.sock")),
            Err(RegistrationError::Version("v1alpha".into()))
        );
        for bad in [
            "cpu",
            "kubernetes.io/gpu",
            "Bad_Domain/x",
            "gpupool/",
            "gpupool/-x",
            "requests.a/b",
        ] {
            assert_eq!(
                validate(&req("v1beta1", bad, "a.sock")),
                Err(RegistrationError::ResourceName(bad.into())),
                "{bad}"
            );
        }
        for bad in ["", "../x.sock", "kubelet.sock", "a/b"] {
            assert_eq!(
                validate(&req("v1beta1", "gpupool/slot", bad)),
                Err(RegistrationError::Endpoint(bad.into())),
                "{bad}"
            );
        }
        let msg = RegistrationError::Version("v9".into()).to_string();
        assert!(msg.contains("v9") && msg.contains("v1beta1"), "{msg}");
    }
}
