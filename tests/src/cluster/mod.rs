//! Scheduler, kubelets and the processes of a simulated cluster.

pub mod kubelet;
pub mod processes;
pub mod scheduler;
