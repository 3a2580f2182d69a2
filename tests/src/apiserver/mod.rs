//! The in-memory Kubernetes API server.
