//! Shared Kubernetes types of gpupool.
//!
//! Everything here is part of gpupool's public contract (DESIGN §2–§4): the
//! `GpuLeaseClass` and `GpuLease` custom resources, the well-known label,
//! annotation and resource names, the Node annotation the device plugin
//! writes, and the few pod-reading rules (requested slots, role, enqueue
//! stamp) that the operator, the device plugin and the simulator must agree on.

pub mod class;
pub mod crdgen;
pub mod kubeconfig;
pub mod lease;
pub mod names;
pub mod node_gpus;
pub mod pod;
pub mod time;

pub use class::{
    AdmissionSpec, GpuLeaseClass, GpuLeaseClassSpec, GpuLeaseClassStatus, HelperSpec, Ordering,
    Placement, Preemption, QueueEntry, SlotEntry, SnapshotSpec,
};
pub use lease::{
    GpuLease, GpuLeaseSpec, GpuLeaseStatus, LeaseGpu, LeasePhase, Role, gpu_indexes, index_list,
};
pub use node_gpus::NodeGpu;
