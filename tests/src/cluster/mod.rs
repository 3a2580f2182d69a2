//! Scheduler, kubelets and the processes of a simulated cluster.
