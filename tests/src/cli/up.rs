//! `gpupool-sim up`.

/// Arguments of `gpupool-sim up`.
#[derive(Debug, clap::Args)]
pub struct Args {}

/// Runs `gpupool-sim up`.
pub async fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("gpupool-sim up is not available in this build")
}
