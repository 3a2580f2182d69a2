//! Leader election on a `coordination.k8s.io/v1` Lease in the operator's
//! namespace: only the holder runs decision passes and writes.
//!
//! The protocol is the one Kubernetes' own controllers use: the holder
//! renews `renewTime` every [`RETRY`] with an optimistic-concurrency update;
//! another replica takes the Lease over only after it has watched the same
//! record unchanged for the full lease duration (measured on its own clock,
//! so clock skew between replicas does not matter). A leader that has not
//! renewed within [`RENEW_DEADLINE`] steps down at once, before its Lease
//! can expire, so two replicas never write at the same time. It uses plain
//! GET/POST/PUT, which every API server supports.

use std::time::Duration;

use jiff::Timestamp;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::PostParams;
use kube::{Api, Client};
use tokio::sync::watch;
use tokio::time::Instant;

/// Name of the coordination Lease the replicas compete for.
pub const LEASE_NAME: &str = gpupool_api::names::LEADER_ELECTION_LEASE;
/// How long a Lease is valid after its last renewal.
pub const LEASE_DURATION: Duration = Duration::from_secs(15);
/// A leader that could not renew for this long stops leading.
pub const RENEW_DEADLINE: Duration = Duration::from_secs(10);
/// Period of renewals and of attempts to acquire.
pub const RETRY: Duration = Duration::from_secs(2);

/// Leadership as a watch channel: `true` while this replica leads.
pub struct Leadership {
    /// Current leadership; changes are pushed as they happen.
    pub rx: watch::Receiver<bool>,
    // Keeps a fixed leadership's channel open.
    _fixed: Option<watch::Sender<bool>>,
    election: Option<Election>,
}

struct Election {
    task: tokio::task::JoinHandle<()>,
    api: Api<Lease>,
    identity: String,
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
    pub fn elect(client: Client, namespace: &str, identity: &str) -> Self {
        let (tx, rx) = watch::channel(false);
        let api: Api<Lease> = Api::namespaced(client, namespace);
        let mut elector = Elector {
            api: api.clone(),
            identity: identity.to_owned(),
            observed: None,
            last_renew: None,
        };
        let task = tokio::spawn(async move {
            loop {
                let leading = elector.step(Timestamp::now(), Instant::now()).await;
                tx.send_if_modified(|cur| {
                    let changed = *cur != leading;
                    *cur = leading;
                    changed
                });
                // While leading, step down the moment the renew deadline passes.
                let next = match (leading, elector.last_renew) {
                    (true, Some(at)) => (Instant::now() + RETRY).min(at + RENEW_DEADLINE),
                    _ => Instant::now() + RETRY,
                };
                tokio::time::sleep_until(next).await;
            }
        });
        Self {
            rx,
            _fixed: None,
            election: Some(Election {
                task,
                api,
                identity: identity.to_owned(),
            }),
        }
    }

    /// Stops competing and, if this replica holds the Lease, gives it up so
    /// another replica takes over at once instead of after it expires.
    pub async fn release(mut self) {
        let Some(election) = self.election.take() else {
            return;
        };
        election.task.abort();
        if let Ok(Some(mut lease)) = election.api.get_opt(LEASE_NAME).await {
            let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
            if spec.holder_identity.as_deref() == Some(election.identity.as_str()) {
                spec.holder_identity = None;
                spec.lease_duration_seconds = Some(1);
                spec.renew_time = Some(MicroTime(Timestamp::now()));
                match election
                    .api
                    .replace(LEASE_NAME, &PostParams::default(), &lease)
                    .await
                {
                    Ok(_) => tracing::info!("released leadership"),
                    Err(e) => tracing::warn!(error = %e, "could not release leadership"),
                }
            }
        }
    }
}

impl Drop for Leadership {
    fn drop(&mut self) {
        if let Some(e) = &self.election {
            e.task.abort();
        }
    }
}

/// The record last seen on the Lease and when this replica first saw it.
#[derive(Debug, Clone, PartialEq)]
struct Observed {
    holder: Option<String>,
    renew: Option<Timestamp>,
    duration: Duration,
    since: Instant,
}

struct Elector {
    api: Api<Lease>,
    identity: String,
    observed: Option<Observed>,
    last_renew: Option<Instant>,
}

impl Elector {
    /// One round: acquire or renew. Returns whether this replica leads now.
    async fn step(&mut self, now: Timestamp, at: Instant) -> bool {
        match self.try_step(now, at).await {
            Ok(leading) => {
                if leading {
                    self.last_renew = Some(at);
                }
                leading
            }
            Err(e) => {
                tracing::warn!(error = %e, "leader election round failed");
                self.still_within_deadline(Instant::now())
            }
        }
    }

    fn still_within_deadline(&self, now: Instant) -> bool {
        self.last_renew
            .is_some_and(|t| now.duration_since(t) < RENEW_DEADLINE)
    }

    async fn try_step(&mut self, now: Timestamp, at: Instant) -> Result<bool, kube::Error> {
        let Some(mut lease) = self.api.get_opt(LEASE_NAME).await? else {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(LEASE_NAME.to_owned()),
                    ..Default::default()
                },
                spec: Some(self.record(now, None, 0)),
            };
            return match self.api.create(&PostParams::default(), &lease).await {
                Ok(_) => {
                    tracing::info!(identity = %self.identity, "acquired leadership (new lease)");
                    Ok(true)
                }
                Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
                Err(e) => Err(e),
            };
        };
        let spec = lease.spec.clone().unwrap_or_default();
        let holder = spec.holder_identity.clone().filter(|h| !h.is_empty());
        let duration = spec
            .lease_duration_seconds
            .and_then(|s| u64::try_from(s).ok())
            .map_or(LEASE_DURATION, Duration::from_secs);
        let record = Observed {
            holder: holder.clone(),
            renew: spec.renew_time.as_ref().map(|t| t.0),
            duration,
            since: at,
        };
        match &self.observed {
            Some(o) if o.holder == record.holder && o.renew == record.renew => {}
            _ => self.observed = Some(record),
        }
        let mine = holder.as_deref() == Some(self.identity.as_str());
        let expired = self
            .observed
            .as_ref()
            .is_some_and(|o| at.duration_since(o.since) >= o.duration);
        if !mine && holder.is_some() && !expired {
            self.last_renew = None;
            return Ok(false);
        }
        let transitions = spec.lease_transitions.unwrap_or(0);
        let acquire = if mine {
            spec.acquire_time.clone()
        } else {
            None
        };
        lease.spec = Some(self.record(
            now,
            acquire,
            if mine { transitions } else { transitions + 1 },
        ));
        match self
            .api
            .replace(LEASE_NAME, &PostParams::default(), &lease)
            .await
        {
            Ok(_) => {
                if !mine {
                    tracing::info!(identity = %self.identity, previous = ?holder, "acquired leadership");
                }
                Ok(true)
            }
            // Another replica wrote first; it leads unless this one still does.
            Err(kube::Error::Api(s)) if s.code == 409 => {
                Ok(mine && self.still_within_deadline(Instant::now()))
            }
            Err(e) => Err(e),
        }
    }

    fn record(&self, now: Timestamp, acquire: Option<MicroTime>, transitions: i32) -> LeaseSpec {
        LeaseSpec {
            holder_identity: Some(self.identity.clone()),
            lease_duration_seconds: i32::try_from(LEASE_DURATION.as_secs()).ok(),
            acquire_time: Some(acquire.unwrap_or(MicroTime(now))),
            renew_time: Some(MicroTime(now)),
            lease_transitions: Some(transitions),
            ..Default::default()
        }
    }
}
