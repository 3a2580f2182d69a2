//! Every way the plugin fails, each worded for the person at the terminal:
//! what is missing, and the command that shows it.

/// A failure of a plugin command. Its `Display` is the whole message the
/// user sees after the `kubectl-gpupool: ` prefix; it never carries Rust
/// debug text.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The `gpuleases.gpupool.io` CRD is absent: gpupool is not installed.
    #[error("the GpuLease CRD is not installed (kubectl get crd gpuleases.gpupool.io)")]
    LeaseCrdMissing,
    /// The `gpuleaseclasses.gpupool.io` CRD is absent.
    #[error("the GpuLeaseClass CRD is not installed (kubectl get crd gpuleaseclasses.gpupool.io)")]
    ClassCrdMissing,
    /// A class the user named does not exist and no lease names it.
    #[error("no GpuLeaseClass named \"{0}\" (kubectl get gpuleaseclasses)")]
    NoSuchClass(String),
    /// There is no class at all, so nothing can queue.
    #[error(
        "no GpuLeaseClass exists, so no pod can queue: create one (kubectl apply -f examples/class-default.yaml)"
    )]
    NoClasses,
    /// The pod `why` was asked about does not exist.
    #[error("pod \"{name}\" not found in namespace \"{namespace}\"")]
    PodNotFound {
        /// Namespace looked in.
        namespace: String,
        /// Pod name.
        name: String,
    },
    /// The pod requests no GPU slot, so it never gets a lease.
    #[error(
        "pod {namespace}/{name} does not request a GPU slot (no container asks for {resources}), so it has no GpuLease"
    )]
    NoSlotRequest {
        /// Pod namespace.
        namespace: String,
        /// Pod name.
        name: String,
        /// The resource names looked for, in prose.
        resources: String,
    },
    /// The pod requests slots but has no lease.
    #[error(
        "pod {namespace}/{name} requests {request} but has no GpuLease: the operator's webhook did not see it, or the operator has not caught up (kubectl get mutatingwebhookconfiguration gpupool; kubectl get pods -A -l app.kubernetes.io/name=gpupool)"
    )]
    NoLease {
        /// Pod namespace.
        namespace: String,
        /// Pod name.
        name: String,
        /// What it requests, e.g. `1 slot of gpupool/slot`.
        request: String,
    },
    /// No usable kubeconfig.
    #[error("{0}")]
    Kubeconfig(String),
    /// The API server refused a read.
    #[error("cannot {what}: forbidden ({message})")]
    Forbidden {
        /// What was being read, e.g. `list nodes`.
        what: String,
        /// The API server's message.
        message: String,
    },
    /// `-A` asked for every namespace's leases, and the credentials may list
    /// one namespace's only.
    #[error(
        "cannot list gpuleases in all namespaces: forbidden ({message}); without -A it shows namespace {namespace}"
    )]
    AllNamespacesForbidden {
        /// The namespace shown without `-A`.
        namespace: String,
        /// The API server's message.
        message: String,
    },
    /// Any other failed API request.
    #[error("cannot {what}: {detail}")]
    Api {
        /// What was being done, e.g. `list gpuleases`.
        what: String,
        /// Why, in words.
        detail: String,
    },
    /// Output could not be encoded (JSON or YAML).
    #[error("cannot encode the output as {format}: {detail}")]
    Encode {
        /// `json` or `yaml`.
        format: &'static str,
        /// The encoder's message.
        detail: String,
    },
    /// Flags that parse but do not go together; exits 2 like any bad flag.
    #[error("{0}")]
    Usage(String),
    /// Standard output could not be written.
    #[error("cannot write the output: {0}")]
    Output(#[source] std::io::Error),
}

impl Error {
    /// The process exit status for this error: 2 for a usage error, else 1.
    pub fn exit_code(&self) -> i32 {
        match self {
            Error::Usage(_) => 2,
            _ => 1,
        }
    }
}
