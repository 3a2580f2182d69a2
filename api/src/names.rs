//! Well-known names (DESIGN §2). Every string another program or a user sees
//! is defined once, here.

/// API group of gpupool's custom resources.
pub const GROUP: &str = "gpupool.io";
/// API version of gpupool's custom resources.
pub const VERSION: &str = "v1alpha1";
/// `apiVersion` value of gpupool's custom resources.
pub const API_VERSION: &str = "gpupool.io/v1alpha1";

/// Extended resource every GPU slot is advertised as, unless a class names another.
pub const DEFAULT_RESOURCE_NAME: &str = "gpupool/slot";

/// Pod label naming the `GpuLeaseClass`; absent means the class marked `default: true`.
pub const LABEL_CLASS: &str = "gpupool.io/class";
/// Pod label giving the pod's role: `primary` (the default) or `helper`.
pub const LABEL_ROLE: &str = "gpupool.io/role";

/// Scheduling gate the webhook adds and the operator removes on admission.
pub const SCHEDULING_GATE: &str = "gpupool.io/admission";

/// Pod annotation: RFC 3339 time with microseconds at which the webhook queued the pod.
pub const ANNOTATION_ENQUEUED_AT: &str = "gpupool.io/enqueued-at";

/// Node annotation: JSON list of the node's GPUs ([`crate::NodeGpu`]), written by the device plugin.
pub const ANNOTATION_NODE_GPUS: &str = "gpupool.io/gpus";

/// Node annotation: `<resource>=<slots>`, the healthy slots the device plugin
/// advertises to the kubelet, written with [`ANNOTATION_NODE_GPUS`]. The
/// Node's allocatable follows it some seconds later; the webhook and the
/// engine read it so that a request is not refused as too large while
/// capacity is still being published.
pub const ANNOTATION_NODE_SLOTS: &str = "gpupool.io/slots";

/// Node label the operator pins admitted pods to.
pub const LABEL_HOSTNAME: &str = "kubernetes.io/hostname";

/// Name of the operator's Mutating- and ValidatingWebhookConfiguration.
pub const WEBHOOK_CONFIGURATION: &str = "gpupool";

/// Name of the `coordination.k8s.io/v1` Lease the operator replicas elect
/// their leader on, in the operator's namespace.
pub const LEADER_ELECTION_LEASE: &str = "gpupool-operator";

/// Field manager the operator and the device plugin write with.
pub const FIELD_MANAGER_OPERATOR: &str = "gpupool-operator";
/// Field manager the device plugin writes with.
pub const FIELD_MANAGER_DEVICE_PLUGIN: &str = "gpupool-device-plugin";

/// The GpuLease field a list or watch may select by (the CRD's
/// `selectableFields`): `fieldSelector=status.node=<node>` gives the leases
/// admitted to one node.
pub const FIELD_LEASE_NODE: &str = "status.node";

/// Simulated-pod annotation: seconds the pod runs before it Succeeds (simulator only).
pub const ANNOTATION_SIM_RUN_SECONDS: &str = "sim.gpupool.io/run-seconds";

/// Environment variable Allocate sets to the allocated GPUs' UUIDs (NVIDIA container runtime).
pub const ENV_NVIDIA_VISIBLE_DEVICES: &str = "NVIDIA_VISIBLE_DEVICES";
/// Environment variable Allocate sets to the allocated GPUs' indices, comma-separated.
pub const ENV_GPU_INDICES: &str = "GPUPOOL_GPU_INDICES";
/// Environment variable Allocate sets to the allocated GPUs' UUIDs, comma-separated.
pub const ENV_GPU_UUIDS: &str = "GPUPOOL_GPU_UUIDS";
