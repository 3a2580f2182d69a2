//! The GpuLeases admitted to this node, kept current by a watch
//! (`fieldSelector=status.node=<node>`), so that the reporter decides from
//! what the API server holds, at no request per lease, whether a lease
//! lacks its pod's GPUs: one deleted and created again under the same name
//! shows up as a new object within moments.
//!
//! The field selector needs the GpuLease CRD's `selectableFields`
//! (`helm upgrade` does not update CRDs, so an older one may be installed)
//! and the plugin's ClusterRole needs `list` and `watch` on gpuleases. When
//! the API server refuses either, the watch says so once, the reporter
//! looks each lease up instead, and the watch is tried again every
//! [`RETRY_REFUSED`].

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use gpupool_api::GpuLease;
use gpupool_api::names::FIELD_LEASE_NODE;
use kube::ResourceExt;
use kube::api::Api;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::watcher;
use kube::runtime::{WatchStreamExt, watcher::Event};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// How long a refused watch waits before it is tried again (an upgraded
/// CRD or ClusterRole is picked up without restarting the plugin).
pub const RETRY_REFUSED: Duration = Duration::from_secs(300);
/// How long a watch stream that ended waits before it starts again.
const RESTART_DELAY: Duration = Duration::from_secs(1);

/// Where the watch stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WatchState {
    /// Not listed yet: starting, the API server unreachable, or the
    /// GpuLease API not served (the CRDs not installed).
    Starting,
    /// Listed and watched: the store holds the node's leases.
    Watching,
    /// The API server refused the list or the watch; the message says why.
    Refused(Refusal),
}

/// Why the API server refused to list or watch the node's leases.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// The HTTP status code: 400 when the installed CRD declares no
    /// selectable `status.node`, 403 when RBAC lacks `list` or `watch`.
    pub code: u16,
    /// The API server's message.
    pub message: String,
}

impl Refusal {
    /// What an operator should do about it.
    pub fn remedy(&self) -> &'static str {
        match self.code {
            403 => {
                "give the device plugin's ClusterRole list and watch on gpuleases.gpupool.io (the chart's current RBAC)"
            }
            _ => {
                "install the chart's current CRDs, which declare status.node selectable (helm upgrade does not update CRDs: kubectl apply --server-side -f charts/gpupool/crds/)"
            }
        }
    }
}

/// The API server's refusal in a watcher error, if it is one: 400 (a field
/// selector the CRD does not declare) or 403 (no list or watch right).
/// Anything else (unreachable, 404 before the CRDs exist, 5xx) is retried.
pub fn refusal(error: &watcher::Error) -> Option<Refusal> {
    let status = match error {
        watcher::Error::InitialListFailed(kube::Error::Api(s))
        | watcher::Error::WatchStartFailed(kube::Error::Api(s))
        | watcher::Error::WatchFailed(kube::Error::Api(s))
        | watcher::Error::WatchError(s) => s,
        _ => return None,
    };
    matches!(status.code, 400 | 403).then(|| Refusal {
        code: status.code,
        message: status.message.clone(),
    })
}

/// True when the list failed because the GpuLease API is not served (the
/// CRDs not installed): a 404 that is not a `NotFound` Status of an object.
fn not_served(error: &watcher::Error) -> bool {
    matches!(error, watcher::Error::InitialListFailed(kube::Error::Api(s)) if s.code == 404 && s.reason != "NotFound")
}

/// A running watch of the leases admitted to one node.
#[derive(Clone)]
pub struct LeaseWatch {
    store: Store<GpuLease>,
    state: watch::Receiver<WatchState>,
}

impl LeaseWatch {
    /// Starts watching `node`'s leases; the task ends with `shutdown`.
    pub fn spawn(client: kube::Client, node: String, shutdown: CancellationToken) -> Self {
        let (store, writer) = reflector::store();
        let (tx, state) = watch::channel(WatchState::Starting);
        let api: Api<GpuLease> = Api::all(client);
        tokio::spawn(async move {
            tokio::select! {
                () = shutdown.cancelled() => {}
                () = run(api, node, writer, tx) => {}
            }
        });
        LeaseWatch { store, state }
    }

    /// Where the watch stands now.
    pub fn state(&self) -> WatchState {
        self.state.borrow().clone()
    }

    /// The node's watched lease `namespace/name`; `None` when it has none.
    /// Meaningful only while [`LeaseWatch::state`] is `Watching`.
    pub fn get(&self, namespace: &str, name: &str) -> Option<Arc<GpuLease>> {
        self.store.get(&ObjectRef::new(name).within(namespace))
    }
}

/// Keeps `writer` current until the API server refuses, then waits
/// [`RETRY_REFUSED`] and starts again.
async fn run(
    api: Api<GpuLease>,
    node: String,
    mut writer: reflector::store::Writer<GpuLease>,
    state: watch::Sender<WatchState>,
) {
    let selector = format!("{FIELD_LEASE_NODE}={node}");
    let config = watcher::Config::default().fields(&selector);
    let mut logged_refusal: Option<Refusal> = None;
    let mut failing: Option<String> = None;
    loop {
        let mut stream = watcher(api.clone(), config.clone())
            // The store keeps what a decision reads, not who wrote it.
            .modify(|lease| lease.managed_fields_mut().clear())
            .default_backoff()
            .boxed();
        let refused = loop {
            match stream.next().await {
                // A watcher retries for ever; it does not end.
                None => break None,
                Some(Ok(event)) => {
                    let listed = matches!(event, Event::InitDone);
                    writer.apply_watcher_event(&event);
                    if listed {
                        if failing.take().is_some() {
                            tracing::info!(node = %node, "watching this node's GpuLeases works again");
                        }
                        let was = state.send_replace(WatchState::Watching);
                        if was != WatchState::Watching {
                            tracing::info!(node = %node, selector = %selector, "watching the GpuLeases admitted to this node; a lease created again is reported within a round");
                        }
                    }
                }
                Some(Err(e)) => {
                    if let Some(refusal) = refusal(&e) {
                        break Some(refusal);
                    }
                    let message = e.to_string();
                    if not_served(&e) {
                        // The reporter says so once; the list is retried.
                        tracing::debug!(node = %node, error = %message, "the GpuLease API is not served yet");
                    } else if failing.as_ref() != Some(&message) {
                        tracing::warn!(node = %node, error = %message, "watching this node's GpuLeases failed; retrying with backoff (the same failure again is logged at debug level)");
                        failing = Some(message);
                    } else {
                        tracing::debug!(node = %node, error = %message, "watching this node's GpuLeases failed again");
                    }
                }
            }
        };
        drop(stream);
        let Some(refusal) = refused else {
            tokio::time::sleep(RESTART_DELAY).await;
            continue;
        };
        if logged_refusal.as_ref() != Some(&refusal) {
            tracing::warn!(
                node = %node,
                code = refusal.code,
                error = %refusal.message,
                remedy = refusal.remedy(),
                retry_secs = RETRY_REFUSED.as_secs(),
                "the API server refused to list or watch this node's GpuLeases (fieldSelector {selector}); falling back to reading each lease, which notices a lease created again under the same name only every {} s",
                crate::reporter::REASSERT_INTERVAL.as_secs()
            );
            logged_refusal = Some(refusal.clone());
        } else {
            tracing::debug!(node = %node, code = refusal.code, error = %refusal.message, "the lease watch is still refused");
        }
        state.send_replace(WatchState::Refused(refusal));
        tokio::time::sleep(RETRY_REFUSED).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn api_error(code: u16, reason: &str, message: &str) -> kube::Error {
        kube::Error::Api(
            kube::core::Status::failure(message, reason)
                .with_code(code)
                .boxed(),
        )
    }

    #[test]
    fn a_refused_selector_or_right_is_a_refusal_and_the_rest_is_retried() {
        let bad = watcher::Error::InitialListFailed(api_error(
            400,
            "BadRequest",
            "field label not supported: status.node",
        ));
        let refused = refusal(&bad).expect("400 refuses");
        assert_eq!(refused.code, 400);
        assert!(refused.remedy().contains("CRDs"), "{}", refused.remedy());
        let forbidden =
            watcher::Error::WatchStartFailed(api_error(403, "Forbidden", "cannot watch"));
        let refused = refusal(&forbidden).expect("403 refuses");
        assert!(refused.remedy().contains("watch"), "{}", refused.remedy());
        for transient in [
            watcher::Error::InitialListFailed(api_error(404, "", "404 page not found")),
            watcher::Error::InitialListFailed(api_error(500, "InternalError", "boom")),
            watcher::Error::WatchFailed(api_error(503, "ServiceUnavailable", "later")),
            watcher::Error::NoResourceVersion,
        ] {
            assert_eq!(refusal(&transient), None, "{transient}");
        }
    }
}
