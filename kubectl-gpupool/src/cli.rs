//! The command line: kubectl's own conventions for the connection flags
//! (`-n`, `--context`, `--kubeconfig`, accepted before or after the
//! subcommand; `-A` before it, or after `queue`, the one subcommand that
//! shows several namespaces) and the three subcommands.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

/// `kubectl gpupool`: see the GPU queue, who holds which GPU, and why a pod waits.
#[derive(Debug, Parser)]
#[command(
    name = "kubectl-gpupool",
    bin_name = "kubectl gpupool",
    version,
    about = "See gpupool's GPU queue, who holds which GPU, and why a pod waits",
    long_about = "See gpupool's GPU queue, who holds which GPU, and why a pod waits.\n\n\
        Reads only (GpuLeases, GpuLeaseClasses, Nodes, Pods) with the current kubeconfig; \
        installed on the PATH as kubectl-gpupool, it runs as `kubectl gpupool`.",
    after_help = "Examples:\n  kubectl gpupool queue -A\n  kubectl gpupool queue default -o wide --watch\n  kubectl gpupool top\n  kubectl gpupool why train-c -n ml"
)]
pub struct Cli {
    /// Connection and scope flags.
    #[command(flatten)]
    pub global: GlobalArgs,
    /// What to show.
    #[command(subcommand)]
    pub command: Command,
}

/// The flags kubectl users expect on every command.
#[derive(Debug, Clone, Args)]
pub struct GlobalArgs {
    /// Namespace to show (default: the kubeconfig context's namespace)
    #[arg(short = 'n', long, global = true, value_name = "NAMESPACE")]
    pub namespace: Option<String>,
    /// Show every namespace's waiting pods (queue; top shows all it may read anyway)
    #[arg(short = 'A', long, conflicts_with = "namespace")]
    pub all_namespaces: bool,
    /// Kubeconfig context to use (default: its current-context)
    #[arg(long, global = true, value_name = "NAME")]
    pub context: Option<String>,
    /// Kubeconfig file (default: $KUBECONFIG, else ~/.kube/config)
    #[arg(long, global = true, value_name = "PATH")]
    pub kubeconfig: Option<PathBuf>,
}

/// The subcommands.
#[derive(Debug, Clone, Subcommand)]
pub enum Command {
    /// The FIFO order of each class's waiting pods, primaries and helpers apart
    ///
    /// Positions are computed from the leases' sequences (a class's order
    /// spans namespaces); -n limits the rows shown, not the positions.
    Queue {
        /// Only this GpuLeaseClass
        class: Option<String>,
        /// Output format
        #[arg(short = 'o', long, value_enum, value_name = "FORMAT")]
        output: Option<QueueOutput>,
        /// Keep running and show the queue again whenever a lease changes
        #[arg(short = 'w', long)]
        watch: bool,
        /// Show every namespace's waiting pods
        #[arg(short = 'A', long, conflicts_with = "namespace")]
        all_namespaces: bool,
    },
    /// Class capacity, then per node and GPU which pod holds each slot
    ///
    /// The whole cluster when it may be read; a tenant with rights in one
    /// namespace only sees the GPUs that namespace's pods hold (-n, else
    /// the context's namespace).
    Top {
        /// Output format
        #[arg(short = 'o', long, value_enum, value_name = "FORMAT")]
        output: Option<DataOutput>,
        /// Accepted as kubectl users type it; top shows every namespace it may read anyway
        #[arg(short = 'A', long, hide = true)]
        all_namespaces: bool,
    },
    /// Why a pod waits (or what it holds), in one paragraph
    Why {
        /// The pod (in -n NAMESPACE, default: the context's namespace)
        pod: String,
        /// Refused with a word on -n: why looks at one pod
        #[arg(short = 'A', long, hide = true)]
        all_namespaces: bool,
    },
}

impl Cli {
    /// Whether `-A` was given, before the subcommand or after it.
    pub fn all_namespaces(&self) -> bool {
        self.global.all_namespaces
            || match self.command {
                Command::Queue { all_namespaces, .. }
                | Command::Top { all_namespaces, .. }
                | Command::Why { all_namespaces, .. } => all_namespaces,
            }
    }
}

/// `queue -o`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum QueueOutput {
    /// The queue as one JSON document
    Json,
    /// The queue as one YAML document
    Yaml,
    /// The table with each lease's sequence and queue time
    Wide,
}

/// `top -o`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DataOutput {
    /// One JSON document
    Json,
    /// One YAML document
    Yaml,
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn flags_parse_before_and_after_the_subcommand() {
        let cases: &[(&[&str], Option<&str>, bool)] = &[
            (&["kubectl-gpupool", "queue", "-n", "ml"], Some("ml"), false),
            (&["kubectl-gpupool", "-n", "ml", "queue"], Some("ml"), false),
            (&["kubectl-gpupool", "queue", "-A"], None, true),
            (
                &["kubectl-gpupool", "--namespace=ml", "why", "p"],
                Some("ml"),
                false,
            ),
        ];
        for (args, ns, all) in cases {
            let cli = Cli::try_parse_from(*args).expect("parses");
            assert_eq!(cli.global.namespace.as_deref(), *ns, "{args:?}");
            assert_eq!(cli.all_namespaces(), *all, "{args:?}");
        }
        let cli = Cli::try_parse_from([
            "kubectl-gpupool",
            "queue",
            "big",
            "-o",
            "wide",
            "--watch",
            "--context",
            "c",
            "--kubeconfig",
            "/k",
        ])
        .expect("parses");
        assert_eq!(cli.global.context.as_deref(), Some("c"));
        assert!(matches!(
            cli.command,
            Command::Queue { class: Some(ref c), output: Some(QueueOutput::Wide), watch: true, all_namespaces: false } if c == "big"
        ));
    }

    /// `-A` shows in the help of the commands it changes, and only there.
    #[test]
    fn all_namespaces_is_offered_where_it_applies() {
        let mut cmd = Cli::command();
        let help = |cmd: &mut clap::Command, sub: &str| {
            cmd.find_subcommand_mut(sub)
                .expect("the subcommand exists")
                .render_long_help()
                .to_string()
        };
        assert!(
            cmd.render_long_help()
                .to_string()
                .contains("--all-namespaces")
        );
        assert!(help(&mut cmd, "queue").contains("--all-namespaces"));
        for sub in ["top", "why"] {
            let text = help(&mut cmd, sub);
            assert!(!text.contains("--all-namespaces"), "{sub}:\n{text}");
            assert!(text.contains("--namespace"), "{sub}:\n{text}");
        }
        for args in [
            &["kubectl-gpupool", "-A", "queue"][..],
            &["kubectl-gpupool", "top", "-A"],
            &["kubectl-gpupool", "why", "p", "-A"],
        ] {
            assert!(
                Cli::try_parse_from(args).expect("parses").all_namespaces(),
                "{args:?}"
            );
        }
    }

    #[test]
    fn bad_flags_are_usage_errors() {
        let cases: &[&[&str]] = &[
            &["kubectl-gpupool"],
            &["kubectl-gpupool", "queue", "-o", "xml"],
            &["kubectl-gpupool", "queue", "-n", "a", "-A"],
            &["kubectl-gpupool", "-n", "a", "-A", "queue"],
            &["kubectl-gpupool", "top", "-o", "wide"],
            &["kubectl-gpupool", "why"],
            &["kubectl-gpupool", "frobnicate"],
        ];
        for args in cases {
            let err = Cli::try_parse_from(*args).expect_err("refused");
            assert!(err.use_stderr(), "{args:?}");
            assert_eq!(err.exit_code(), 2, "{args:?}");
        }
    }
}
