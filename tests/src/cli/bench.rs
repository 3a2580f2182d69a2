//! `gpupool-sim bench`.

/// Arguments of `gpupool-sim bench`.
#[derive(Debug, clap::Args)]
pub struct Args {}

/// Runs `gpupool-sim bench`.
pub async fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("gpupool-sim bench is not available in this build")
}
