//! Leader election on a `coordination.k8s.io/v1` Lease in the operator's
//! namespace: only the holder runs decision passes and writes.

use kube::Client;
use kube_lease_manager::{LeaseManagerBuilder, LeaseManagerError};
use tokio::sync::watch;

/// Name of the coordination Lease the replicas compete for.
pub const LEASE_NAME: &str = "gpupool-operator";
/// Seconds a leader's lock lasts without renewal.
const LEASE_SECONDS: u64 = 15;
/// Seconds before expiry at which the leader renews.
const RENEW_BEFORE_SECONDS: u64 = 5;

/// Why leader election could not start.
#[derive(Debug, thiserror::Error)]
#[error("leader election on Lease {namespace}/{LEASE_NAME} failed to start: {source}")]
pub struct LeaderError {
    /// Namespace of the Lease (`--namespace`).
    pub namespace: String,
    /// Cause.
    #[source]
    pub source: LeaseManagerError,
}

/// Leadership as a watch channel: `true` while this replica leads.
pub struct Leadership {
    /// Current leadership; changes are pushed as they happen.
    pub rx: watch::Receiver<bool>,
    // Keeps a fixed leadership's channel open.
    _fixed: Option<watch::Sender<bool>>,
    // The election runs for as long as this value lives.
    election: Option<tokio::task::JoinHandle<()>>,
}

impl Drop for Leadership {
    fn drop(&mut self) {
        if let Some(task) = &self.election {
            task.abort();
        }
    }
}

impl Leadership {
    /// Always leading (`--leader-elect=false`).
    pub fn always() -> Self {
        let (tx, rx) = watch::channel(true);
        Self {
            rx,
            _fixed: Some(tx),
            election: None,
        }
    }

    /// Competes for the Lease `gpupool-operator` in `namespace` as `identity`.
    pub async fn elect(
        client: Client,
        namespace: &str,
        identity: &str,
    ) -> Result<Self, LeaderError> {
        let manager = LeaseManagerBuilder::new(client, LEASE_NAME)
            .with_namespace(namespace)
            .with_identity(identity)
            .with_duration(LEASE_SECONDS)
            .with_grace(RENEW_BEFORE_SECONDS)
            .with_field_manager(gpupool_api::names::FIELD_MANAGER_OPERATOR)
            .build()
            .await
            .map_err(|source| LeaderError {
                namespace: namespace.to_owned(),
                source,
            })?;
        let (mut inner, handle) = manager.watch().await;
        let (tx, rx) = watch::channel(*inner.borrow());
        let identity = identity.to_owned();
        // Forward changes; the manager keeps renewing while `inner` is alive.
        let task = tokio::spawn(async move {
            let _manager = handle;
            loop {
                let leading = *inner.borrow_and_update();
                tracing::info!(identity = %identity, leading, "leadership");
                if tx.send(leading).is_err() {
                    return;
                }
                if inner.changed().await.is_err() {
                    // The manager stopped: we can no longer claim to lead.
                    let _ = tx.send(false);
                    return;
                }
            }
        });
        Ok(Self {
            rx,
            _fixed: None,
            election: Some(task),
        })
    }
}
