//! `gpupool-sim apiserver`: runs only the in-memory API server, writes a
//! kubeconfig for it and serves until SIGTERM/SIGINT.

use std::path::PathBuf;

use anyhow::Context;

use gpupool_sim_apiserver::{ADMIN_TOKEN, ApiServer, ApiServerConfig};

/// Arguments of `gpupool-sim apiserver`. Every value is checked while the
/// flags are parsed, so a bad one exits 2 with a message naming the flag.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Port on 127.0.0.1 to serve on (0 picks a free one).
    #[arg(long, env = "GPUPOOL_SIM_PORT", default_value_t = 0)]
    pub port: u16,
    /// Where to write the kubeconfig (token authentication); missing parent
    /// directories are created.
    #[arg(long, env = "GPUPOOL_SIM_KUBECONFIG", value_parser = parse_kubeconfig_path)]
    pub kubeconfig: PathBuf,
    /// Bearer token the kubeconfig uses (user `admin`, group `system:masters`).
    #[arg(long, env = "GPUPOOL_SIM_TOKEN", default_value = ADMIN_TOKEN, value_parser = parse_token)]
    pub token: String,
}

/// A bearer token travels in an HTTP header as `Bearer <token>`: it must be
/// non-empty and made of visible ASCII characters only.
fn parse_token(s: &str) -> Result<String, String> {
    if s.is_empty() {
        return Err("the token must not be empty".into());
    }
    if let Some(c) = s.chars().find(|c| !c.is_ascii_graphic()) {
        return Err(format!(
            "the token may hold only visible ASCII characters, not {c:?}"
        ));
    }
    Ok(s.to_string())
}

/// The kubeconfig path must name a file: not empty, not a directory.
fn parse_kubeconfig_path(s: &str) -> Result<PathBuf, String> {
    if s.trim().is_empty() {
        return Err("the kubeconfig path must not be empty".into());
    }
    let path = PathBuf::from(s);
    if s.ends_with('/') || path.is_dir() {
        return Err(format!("{s} is a directory, not a file path"));
    }
    Ok(path)
}

/// Runs `gpupool-sim apiserver`.
pub async fn run(args: Args) -> anyhow::Result<()> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_must_be_visible_ascii() {
        assert!(parse_token("abc-123").is_ok());
        assert!(parse_token("").is_err());
        assert!(parse_token("two words").is_err());
        assert!(parse_token("tab\there").is_err());
    }

    #[test]
    fn kubeconfig_must_name_a_file() {
        assert!(parse_kubeconfig_path("/tmp/some/kc.yaml").is_ok());
        assert!(parse_kubeconfig_path("").is_err());
        assert!(parse_kubeconfig_path("/tmp/").is_err());
        assert!(parse_kubeconfig_path("/").is_err());
    }
}
