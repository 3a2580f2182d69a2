//! The simulated cluster's fault controls over HTTP on 127.0.0.1, for
//! `gpupool-sim up` (API-level faults are delegated to the API server):
//!
//! | request | effect |
//! |---|---|
//! | `GET /sim/status` | nodes, child PIDs, whether the operator runs |
//! | `POST /sim/operator/kill` · `/sim/operator/restart` | SIGKILL / (re)start the operator |
//! | `POST /sim/nodes/NODE/plugin/kill` · `.../plugin/restart` | the same for a node's device plugin |
//! | `POST /sim/nodes/NODE/kubelet/restart` | restart a kubelet (plugin must re-register) |
//! | `POST /sim/nodes/NODE/gpus/INDEX/healthy` · `.../unhealthy` | flip a GPU in the static config |
//! | `PUT /sim/faults` (JSON `{errorRate, errorCode, latencyMs, includeWatches, failNext}`) · `DELETE /sim/faults` · `POST /sim/faults/drop-watches` | API server faults |

use std::convert::Infallible;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use super::SimCluster;
use gpupool_sim_apiserver::FaultConfig;

/// One control request, answered through `reply` with (status, JSON body).
pub struct AdminRequest {
    /// What to do.
    pub command: AdminCommand,
    /// Where the answer goes.
    pub reply: oneshot::Sender<(StatusCode, serde_json::Value)>,
}

/// A control the cluster applies.
#[derive(Debug, Clone, PartialEq)]
pub enum AdminCommand {
    /// Report status.
    Status,
    /// SIGKILL the operator.
    KillOperator,
    /// (Re)start the operator.
    RestartOperator,
    /// SIGKILL a node's plugin.
    KillPlugin(String),
    /// (Re)start a node's plugin.
    RestartPlugin(String),
    /// Restart a node's kubelet.
    RestartKubelet(String),
    /// Flip a GPU's health.
    GpuHealth(String, u32, bool),
    /// Set API server faults.
    SetFaults(FaultConfig),
    /// Clear API server faults.
    ClearFaults,
    /// End every watch stream.
    DropWatches,
}

impl std::fmt::Display for AdminCommand {
    /// What the control did, in words: the `done` field of its answer.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AdminCommand::Status => f.write_str("reported the status"),
            AdminCommand::KillOperator => f.write_str("killed the operator"),
            AdminCommand::RestartOperator => f.write_str("restarted the operator"),
            AdminCommand::KillPlugin(node) => write!(f, "killed the device plugin of {node}"),
            AdminCommand::RestartPlugin(node) => {
                write!(f, "restarted the device plugin of {node}")
            }
            AdminCommand::RestartKubelet(node) => write!(f, "restarted the kubelet of {node}"),
            AdminCommand::GpuHealth(node, index, healthy) => write!(
                f,
                "marked GPU {index} of {node} {}",
                if *healthy { "healthy" } else { "unhealthy" }
            ),
            AdminCommand::SetFaults(faults) => write!(
                f,
                "set API server faults: error rate {}, the next {} requests failing, error code {}, latency {} ms, {}",
                faults.error_rate,
                faults.fail_next,
                faults.error_code,
                faults.latency_ms,
                if faults.include_watches {
                    "watches included"
                } else {
                    "watches excluded"
                }
            ),
            AdminCommand::ClearFaults => f.write_str("cleared API server faults"),
            AdminCommand::DropWatches => f.write_str("ended every watch stream"),
        }
    }
}

/// Maps a request line to a command; `Err` is the 4xx answer.
pub fn parse(
    method: &Method,
    path: &str,
    body: &[u8],
) -> Result<AdminCommand, (StatusCode, String)> {
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    let not_found = || {
        (
            StatusCode::NOT_FOUND,
            format!(
                "unknown control {method} {path}; see GET /sim/status and the module docs of the admin API"
            ),
        )
    };
    let post = |cmd: AdminCommand| {
        if method == Method::POST {
            Ok(cmd)
        } else {
            Err((StatusCode::METHOD_NOT_ALLOWED, format!("{path} takes POST")))
        }
    };
    match parts.as_slice() {
        ["sim", "status"] if method == Method::GET => Ok(AdminCommand::Status),
        ["sim", "operator", "kill"] => post(AdminCommand::KillOperator),
        ["sim", "operator", "restart"] => post(AdminCommand::RestartOperator),
        ["sim", "nodes", node, "plugin", "kill"] => {
            post(AdminCommand::KillPlugin((*node).to_owned()))
        }
        ["sim", "nodes", node, "plugin", "restart"] => {
            post(AdminCommand::RestartPlugin((*node).to_owned()))
        }
        ["sim", "nodes", node, "kubelet", "restart"] => {
            post(AdminCommand::RestartKubelet((*node).to_owned()))
        }
        [
            "sim",
            "nodes",
            node,
            "gpus",
            index,
            health @ ("healthy" | "unhealthy"),
        ] => {
            let index = index.parse().map_err(|_| {
                (
                    StatusCode::BAD_REQUEST,
                    format!("GPU index {index:?} is not a number"),
                )
            })?;
            post(AdminCommand::GpuHealth(
                (*node).to_owned(),
                index,
                *health == "healthy",
            ))
        }
        ["sim", "faults"] if method == Method::PUT => serde_json::from_slice(body)
            .map(AdminCommand::SetFaults)
            .map_err(|e| (StatusCode::BAD_REQUEST, format!("fault config: {e}"))),
        ["sim", "faults"] if method == Method::DELETE => Ok(AdminCommand::ClearFaults),
        ["sim", "faults", "drop-watches"] => post(AdminCommand::DropWatches),
        _ => Err(not_found()),
    }
}

/// Serves the controls on `listener` until `cancel`, passing each command
/// to whoever owns the cluster through `commands`.
pub async fn serve(
    listener: TcpListener,
    commands: mpsc::Sender<AdminRequest>,
    cancel: CancellationToken,
) {
    loop {
        let stream = tokio::select! {
            () = cancel.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    tracing::warn!(error = %e, "admin accept failed");
                    continue;
                }
            },
        };
        let commands = commands.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| handle(req, commands.clone()));
            if let Err(e) = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await
            {
                tracing::debug!(error = %e, "admin connection ended");
            }
        });
    }
}

async fn handle(
    req: Request<Incoming>,
    commands: mpsc::Sender<AdminRequest>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    let body = match req.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => {
            return Ok(answer(
                StatusCode::BAD_REQUEST,
                serde_json::json!({"error": e.to_string()}),
            ));
        }
    };
    let command = match parse(&method, &path, &body) {
        Ok(c) => c,
        Err((code, message)) => return Ok(answer(code, serde_json::json!({"error": message}))),
    };
    let (reply, answered) = oneshot::channel();
    if commands
        .send(AdminRequest { command, reply })
        .await
        .is_err()
    {
        return Ok(answer(
            StatusCode::SERVICE_UNAVAILABLE,
            serde_json::json!({"error": "the cluster is shutting down"}),
        ));
    }
    let (code, body) = answered.await.unwrap_or((
        StatusCode::SERVICE_UNAVAILABLE,
        serde_json::json!({"error": "the cluster is shutting down"}),
    ));
    Ok(answer(code, body))
}

fn answer(code: StatusCode, body: serde_json::Value) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body.to_string())));
    *response.status_mut() = code;
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    response
}

impl SimCluster {
    /// The in-memory API server's faults; a real control plane has none to
    /// inject, and saying so beats pretending the control worked.
    fn api_faults(&self) -> Result<gpupool_sim_apiserver::Faults, super::ClusterError> {
        self.api_server().map(|a| a.faults()).ok_or_else(|| {
            super::ClusterError::Config(
                "API server faults need the in-memory API server; this cluster runs on a real control plane (--kube-assets)".to_owned(),
            )
        })
    }

    /// Applies one control and says how it went.
    pub async fn apply(&mut self, command: AdminCommand) -> (StatusCode, serde_json::Value) {
        let result = match &command {
            AdminCommand::Status => {
                let pids = self.child_pids();
                let running = self.operator_running();
                return (
                    StatusCode::OK,
                    serde_json::json!({
                        "nodes": self.node_names(),
                        "operatorRunning": running,
                        "operatorNote": self.operator_note(),
                        "childPids": pids,
                        "kubeconfig": self.kubeconfig(),
                        "runDir": self.run_dir(),
                    }),
                );
            }
            AdminCommand::KillOperator => self.kill_operator().await,
            AdminCommand::RestartOperator => self.start_operator().await,
            AdminCommand::KillPlugin(node) => self.kill_plugin(node).await,
            AdminCommand::RestartPlugin(node) => self.start_plugin(node).await,
            AdminCommand::RestartKubelet(node) => self.restart_kubelet(node).await,
            AdminCommand::GpuHealth(node, index, healthy) => {
                self.set_gpu_health(node, *index, *healthy)
            }
            AdminCommand::SetFaults(config) => self.api_faults().and_then(|faults| {
                faults
                    .set(config.clone())
                    .map_err(super::ClusterError::Config)
            }),
            AdminCommand::ClearFaults => self.api_faults().map(|faults| faults.clear()),
            AdminCommand::DropWatches => self.api_faults().map(|faults| faults.drop_watches()),
        };
        match result {
            Ok(()) => {
                tracing::info!(%command, "control applied");
                (
                    StatusCode::OK,
                    serde_json::json!({"done": command.to_string()}),
                )
            }
            Err(e) => {
                let code = match e {
                    super::ClusterError::UnknownNode(_) => StatusCode::NOT_FOUND,
                    super::ClusterError::Config(_) => StatusCode::BAD_REQUEST,
                    _ => StatusCode::INTERNAL_SERVER_ERROR,
                };
                (code, serde_json::json!({"error": e.to_string()}))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_control_and_names_bad_ones() {
        let p = |m: Method, path: &str, body: &str| parse(&m, path, body.as_bytes());
        assert_eq!(p(Method::GET, "/sim/status", ""), Ok(AdminCommand::Status));
        assert_eq!(
            p(Method::POST, "/sim/operator/kill", ""),
            Ok(AdminCommand::KillOperator)
        );
        assert_eq!(
            p(Method::POST, "/sim/nodes/node-2/plugin/restart", ""),
            Ok(AdminCommand::RestartPlugin("node-2".into()))
        );
        assert_eq!(
            p(Method::POST, "/sim/nodes/node-1/gpus/1/unhealthy", ""),
            Ok(AdminCommand::GpuHealth("node-1".into(), 1, false))
        );
        assert!(matches!(
            p(Method::PUT, "/sim/faults", r#"{"errorRate":0.5}"#),
            Ok(AdminCommand::SetFaults(FaultConfig { error_rate, .. })) if error_rate == 0.5
        ));
        let (code, msg) = p(Method::GET, "/sim/operator/kill", "").expect_err("GET");
        assert_eq!(code, StatusCode::METHOD_NOT_ALLOWED, "{msg}");
        let (code, msg) =
            p(Method::POST, "/sim/nodes/node-1/gpus/x/healthy", "").expect_err("index");
        assert_eq!(code, StatusCode::BAD_REQUEST);
        assert!(msg.contains("\"x\""), "{msg}");
        let (code, _) = p(Method::POST, "/sim/nope", "").expect_err("unknown");
        assert_eq!(code, StatusCode::NOT_FOUND);
        assert_eq!(
            AdminCommand::GpuHealth("node-2".into(), 0, false).to_string(),
            "marked GPU 0 of node-2 unhealthy"
        );
        assert_eq!(
            AdminCommand::RestartPlugin("node-1".into()).to_string(),
            "restarted the device plugin of node-1"
        );
        let (code, msg) = p(Method::PUT, "/sim/faults", "{").expect_err("bad json");
        assert_eq!(code, StatusCode::BAD_REQUEST);
        assert!(msg.contains("fault config"), "{msg}");
        assert!(matches!(
            p(
                Method::PUT,
                "/sim/faults",
                r#"{"failNext":3,"errorCode":409}"#
            ),
            Ok(AdminCommand::SetFaults(FaultConfig {
                fail_next: 3,
                error_code: 409,
                ..
            }))
        ));
        let (code, msg) =
            p(Method::PUT, "/sim/faults", r#"{"failNext":-1}"#).expect_err("negative count");
        assert_eq!(code, StatusCode::BAD_REQUEST);
        assert!(
            msg.contains("fault config") && msg.contains("`-1`"),
            "names the bad value: {msg}"
        );
    }
}
