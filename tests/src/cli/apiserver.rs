//! `gpupool-sim apiserver`.

/// Arguments of `gpupool-sim apiserver`.
#[derive(Debug, clap::Args)]
pub struct Args {}

/// Runs `gpupool-sim apiserver`.
pub async fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("gpupool-sim apiserver is not available in this build")
}
