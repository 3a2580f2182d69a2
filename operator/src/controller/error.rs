//! Failures of applying a decision pass's plan. Each names the object it
//! concerns and has a stable metric label.

use crate::engine::ObjectKey;

/// One write of a plan that did not happen.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Creating a lease failed.
    #[error("creating lease {lease}: {source}")]
    CreateLease {
        /// The lease.
        lease: ObjectKey,
        /// Cause.
        #[source]
        source: kube::Error,
    },
    /// Writing a lease's status failed (not a conflict).
    #[error("writing the status of lease {lease}: {source}")]
    LeaseStatus {
        /// The lease.
        lease: ObjectKey,
        /// Cause.
        #[source]
        source: kube::Error,
    },
    /// Rewriting a lease's spec from its pod failed.
    #[error("rewriting the spec of lease {lease} from its pod: {source}")]
    LeaseSpec {
        /// The lease.
        lease: ObjectKey,
        /// Cause.
        #[source]
        source: kube::Error,
    },
    /// The lease changed since the cache showed it: the write was refused.
    #[error("lease {lease} changed since it was read; deciding again on fresh data")]
    LeaseConflict {
        /// The lease.
        lease: ObjectKey,
    },
    /// Deleting a stale lease failed.
    #[error("deleting stale lease {lease}: {source}")]
    DeleteLease {
        /// The lease.
        lease: ObjectKey,
        /// Cause.
        #[source]
        source: kube::Error,
    },
    /// The admission patch failed for a reason other than a conflict.
    #[error("admitting pod {pod} to node {node}: {source}")]
    AdmitPod {
        /// The pod.
        pod: ObjectKey,
        /// Node it was to be pinned to.
        node: String,
        /// Cause.
        #[source]
        source: kube::Error,
    },
    /// The pod changed since the cache showed it (its gate test failed): not admitted now.
    #[error("pod {pod} changed since it was read ({reason}); not admitted, deciding again")]
    AdmissionConflict {
        /// The pod.
        pod: ObjectKey,
        /// What changed.
        reason: String,
    },
    /// Evicting a helper failed.
    #[error("evicting helper {pod}: {source}")]
    Evict {
        /// The helper pod.
        pod: ObjectKey,
        /// Cause.
        #[source]
        source: kube::Error,
    },
    /// A PodDisruptionBudget forbids evicting the helper now.
    #[error("evicting helper {pod} is blocked by a PodDisruptionBudget; retrying")]
    EvictionBlocked {
        /// The helper pod.
        pod: ObjectKey,
    },
    /// Deleting an admitted pod the scheduler cannot place failed; the
    /// engine asks for it again on the next pass.
    #[error("deleting unplaceable pod {pod} to give its slots back: {source}")]
    GiveBack {
        /// The pod.
        pod: ObjectKey,
        /// Cause.
        #[source]
        source: kube::Error,
    },
    /// A chain of writes took longer than its timeout; a later pass retries.
    #[error("API writes for one object timed out; retrying on a later pass")]
    Timeout,
    /// Writing a class's status failed.
    #[error("writing the status of class {class}: {source}")]
    ClassStatus {
        /// The class.
        class: String,
        /// Cause.
        #[source]
        source: kube::Error,
    },
}

impl Error {
    /// Stable label for the `api_errors` metric.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::CreateLease { .. } => "create_lease",
            Error::LeaseStatus { .. } => "lease_status",
            Error::LeaseSpec { .. } => "lease_spec",
            Error::LeaseConflict { .. } => "lease_conflict",
            Error::DeleteLease { .. } => "delete_lease",
            Error::AdmitPod { .. } => "admit_pod",
            Error::AdmissionConflict { .. } => "admission_conflict",
            Error::Evict { .. } => "evict",
            Error::EvictionBlocked { .. } => "eviction_blocked",
            Error::GiveBack { .. } => "give_back",
            Error::ClassStatus { .. } => "class_status",
            Error::Timeout => "timeout",
        }
    }

    /// True for outcomes that are expected under concurrency (conflicts, PDBs):
    /// logged at info, not as failures.
    pub fn is_expected(&self) -> bool {
        matches!(
            self,
            Error::LeaseConflict { .. }
                | Error::AdmissionConflict { .. }
                | Error::EvictionBlocked { .. }
        )
    }
}

/// HTTP status of an API error response, if the error is one.
pub fn api_status(e: &kube::Error) -> Option<u16> {
    match e {
        kube::Error::Api(status) => Some(status.code),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn api_err(code: u16) -> kube::Error {
        kube::Error::Api(Box::new(
            kube::core::Status::failure("boom", "Reason").with_code(code),
        ))
    }

    #[test]
    fn labels_are_distinct_and_messages_name_the_object() {
        let key = || ObjectKey::new("ns", "p");
        let all = vec![
            Error::CreateLease {
                lease: key(),
                source: api_err(500),
            },
            Error::LeaseStatus {
                lease: key(),
                source: api_err(500),
            },
            Error::LeaseConflict { lease: key() },
            Error::DeleteLease {
                lease: key(),
                source: api_err(500),
            },
            Error::AdmitPod {
                pod: key(),
                node: "n".into(),
                source: api_err(500),
            },
            Error::AdmissionConflict {
                pod: key(),
                reason: "gate test failed".into(),
            },
            Error::Evict {
                pod: key(),
                source: api_err(500),
            },
            Error::EvictionBlocked { pod: key() },
            Error::ClassStatus {
                class: "ns".into(),
                source: api_err(500),
            },
            Error::LeaseSpec {
                lease: key(),
                source: api_err(500),
            },
            Error::GiveBack {
                pod: key(),
                source: api_err(500),
            },
        ];
        assert_eq!(Error::Timeout.metric_label(), "timeout");
        let labels: std::collections::BTreeSet<_> = all.iter().map(Error::metric_label).collect();
        assert_eq!(labels.len(), all.len());
        for e in &all {
            assert!(e.to_string().contains("ns"), "{e}");
        }
        assert!(all[2].is_expected() && all[5].is_expected() && all[7].is_expected());
        assert!(!all[0].is_expected() && !all[10].is_expected());
        assert_eq!(api_status(&api_err(429)), Some(429));
    }
}
