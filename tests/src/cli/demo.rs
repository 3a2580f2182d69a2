//! `gpupool-sim demo`.

/// Arguments of `gpupool-sim demo`.
#[derive(Debug, clap::Args)]
pub struct Args {}

/// Runs `gpupool-sim demo`.
pub async fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("gpupool-sim demo is not available in this build")
}
