//! `gpupool-sim apiserver`: runs only the in-memory API server, writes a
//! kubeconfig for it and serves until SIGTERM/SIGINT.

use std::path::PathBuf;

use anyhow::Context;

use crate::apiserver::{ADMIN_TOKEN, ApiServer, ApiServerConfig};

/// Arguments of `gpupool-sim apiserver`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Port on 127.0.0.1 to serve on (0 picks a free one).
    #[arg(long, env = "GPUPOOL_SIM_PORT", default_value_t = 0)]
    pub port: u16,
    /// Where to write the kubeconfig (token authentication).
    #[arg(long, env = "GPUPOOL_SIM_KUBECONFIG")]
    pub kubeconfig: PathBuf,
    /// Bearer token the kubeconfig uses (user `admin`, group `system:masters`).
    #[arg(long, env = "GPUPOOL_SIM_TOKEN", default_value = ADMIN_TOKEN)]
    pub token: String,
}

/// Runs `gpupool-sim apiserver`.
pub async fn run(args: Args) -> anyhow::Result<()> {
    if args.token.trim().is_empty() {
        anyhow::bail!("--token must not be empty");
    }
    let config = ApiServerConfig {
        port: args.port,
        ..ApiServerConfig::default()
    }
    .with_token(&args.token, "admin", &["system:masters"]);
    let server = ApiServer::start(config)
        .await
        .context("starting the API server")?;
    server
        .write_kubeconfig(&args.kubeconfig, &args.token)
        .context("writing the kubeconfig")?;
    println!("ready kubeconfig={}", args.kubeconfig.display());
    wait_for_signal().await?;
    tracing::info!("shutting down");
    server.shutdown().await;
    Ok(())
}

async fn wait_for_signal() -> anyhow::Result<()> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("installing the SIGTERM handler")?;
    tokio::select! {
        r = tokio::signal::ctrl_c() => r.context("waiting for SIGINT")?,
        _ = term.recv() => {}
    }
    Ok(())
}
