//! The webhook's own caches of GpuLeaseClasses, Nodes and GpuLeases. Every
//! replica keeps them, leader or not, because every replica serves the
//! webhook.

use std::fmt::Debug;
use std::hash::Hash;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use gpupool_api::{GpuLease, GpuLeaseClass};
use k8s_openapi::api::core::v1::Node;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Resource};
use serde::de::DeserializeOwned;
use tokio::task::JoinSet;

use super::review::ClusterView;

/// Reflector stores backing [`ClusterView`], and the tasks that fill them.
pub struct Stores {
    classes: Store<GpuLeaseClass>,
    nodes: Store<Node>,
    leases: Store<GpuLease>,
    tasks: JoinSet<()>,
}

/// A cache that did not fill in time.
#[derive(Debug, thiserror::Error)]
#[error(
    "the {what} cache did not sync within {timeout:?}; can the operator list and watch {what} (is the CRD installed, is RBAC granted)?"
)]
pub struct NotSynced {
    /// Which cache.
    pub what: &'static str,
    /// How long it was given.
    pub timeout: Duration,
}

impl Stores {
    /// Starts watching all three kinds cluster-wide. Managed fields and node
    /// image lists are dropped before caching: the webhook never reads them.
    pub fn spawn(client: kube::Client) -> Self {
        let mut tasks = JoinSet::new();
        let classes = reflect(
            &mut tasks,
            Api::<GpuLeaseClass>::all(client.clone()),
            "GpuLeaseClasses",
            |c| c.metadata.managed_fields = None,
        );
        let nodes = reflect(&mut tasks, Api::<Node>::all(client.clone()), "Nodes", |n| {
            n.metadata.managed_fields = None;
            if let Some(status) = n.status.as_mut() {
                status.images = None;
            }
        });
        let leases = reflect(&mut tasks, Api::<GpuLease>::all(client), "GpuLeases", |l| {
            l.metadata.managed_fields = None
        });
        Self {
            classes,
            nodes,
            leases,
            tasks,
        }
    }

    /// Waits until every cache holds a complete first listing.
    pub async fn wait_until_ready(&self, timeout: Duration) -> Result<(), NotSynced> {
        wait_for("GpuLeaseClasses", &self.classes, timeout).await?;
        wait_for("Nodes", &self.nodes, timeout).await?;
        wait_for("GpuLeases", &self.leases, timeout).await
    }
}

async fn wait_for<K>(
    what: &'static str,
    store: &Store<K>,
    timeout: Duration,
) -> Result<(), NotSynced>
where
    K: Resource + Clone + 'static,
    K::DynamicType: Eq + Hash + Clone,
{
    match tokio::time::timeout(timeout, store.wait_until_ready()).await {
        Ok(Ok(())) => Ok(()),
        _ => Err(NotSynced { what, timeout }),
    }
}

impl Drop for Stores {
    fn drop(&mut self) {
        self.tasks.abort_all();
    }
}

impl ClusterView for Stores {
    fn classes(&self) -> Vec<Arc<GpuLeaseClass>> {
        self.classes.state()
    }
    fn nodes(&self) -> Vec<Arc<Node>> {
        self.nodes.state()
    }
    fn leases(&self) -> Vec<Arc<GpuLease>> {
        self.leases.state()
    }
}

fn reflect<K>(
    tasks: &mut JoinSet<()>,
    api: Api<K>,
    what: &'static str,
    trim: fn(&mut K),
) -> Store<K>
where
    K: Resource + Clone + Debug + DeserializeOwned + Send + Sync + 'static,
    K::DynamicType: Default + Eq + Hash + Clone + Send + Sync,
{
    let (store, writer) = reflector::store();
    let stream = watcher(api, watcher::Config::default())
        .default_backoff()
        .modify(trim)
        .reflect(writer)
        .applied_objects();
    tasks.spawn(async move {
        let mut stream = std::pin::pin!(stream);
        while let Some(event) = stream.next().await {
            if let Err(error) = event {
                tracing::warn!(kind = what, %error, "webhook cache watch failed; retrying");
            }
        }
    });
    store
}
