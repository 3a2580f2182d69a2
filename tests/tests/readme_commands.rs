//! Every command the READMEs and `docs/*.md` show, as written.
//!
//! - A ```` ```sh ```` block (in `README.md`, `examples/README.md` or any
//!   `docs/*.md`) either runs as written (bash, `-euo pipefail`, its own
//!   process group, killed afterwards so a `&` leaves nothing behind) or
//!   opens with `# needs: <what and why>`. Such a block needs something these
//!   machines lack (Docker, a GPU cluster, an installed release); it still
//!   runs, as written, with `helm`, `docker`, `kind` and `kubectl` replaced
//!   by checks: `helm install|upgrade` becomes `helm template` with the same
//!   arguments, `docker build --target T` needs stage `T` in the Dockerfile,
//!   `bash .ci/SCRIPT` needs the script, `gpupool-sim up` must parse its
//!   flags (it would start real nodes as root), `cargo test --test T`
//!   needs the suite `T` (it would run it inside this one), and every file
//!   a command names must exist.
//! - A block runs with the reader's PATH: the caller's, less this
//!   checkout's `target/debug` and `.tools/bin`, plus whatever `export
//!   PATH=` lines the README's blocks above it ran. So a block that calls
//!   `helm` or `kubectl gpupool` fails here when the README never said how
//!   to put them on the PATH.
//! - `cargo build --workspace --bins` on a line of its own is the first
//!   half of the test command, done before this test ran; it is not run
//!   again (cargo would wait for the lock the running tests hold).
//! - The README's first shell block is its promise: the test command is what
//!   `.ci/run` runs (it is running now, so it is not run again), and the
//!   demo runs with nothing but its story on the terminal.
//! - `examples/README.md`'s script runs against a simulated cluster of 2
//!   nodes × 2 GPUs, and then every `$ command` of the README's transcripts
//!   runs there too: each table header the README shows must be printed,
//!   and every other output starts as the README says. Transcripts in
//!   `docs/*.md` are held to the same.
//! - Every relative link in these files names a file that exists and, with
//!   a `#fragment`, a heading in it.
//!
//! Needs the workspace's binaries (`cargo build --workspace --bins`, the
//! first half of the test command), `kubectl` and `helm`
//! (`.ci/install-helm.sh`); without them it fails in CI, and is skipped elsewhere.

mod helm_support;

use std::ffi::OsString;
use std::io::Read;
use std::os::unix::process::CommandExt;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use gpupool_api::GpuLease;
use gpupool_sim::cluster::{ClusterConfig, OperatorMode, SimCluster};
use helm_support::repo_root;
use kube::Api;

/// What a block that cannot run here must open with.
const NEEDS: &str = "# needs: ";

/// The build every README section starts from.
const BUILD_COMMAND: &str = "cargo build --workspace --bins";

/// The README's opening commands, exactly.
const DEMO_COMMAND: &str = "cargo build --workspace --bins && ./target/debug/gpupool-sim demo";
const TEST_COMMAND: &str = "cargo build --workspace --bins && cargo test --workspace";

/// Longest any one block may run.
const BLOCK_TIMEOUT: Duration = Duration::from_secs(300);

/// One fenced code block.
#[derive(Debug)]
struct Block {
    file: String,
    /// 1-based line of the opening fence.
    line: usize,
    /// The fence's info string (`sh`, `yaml`, empty).
    info: String,
    body: Vec<String>,
}

impl Block {
    fn is_shell(&self) -> bool {
        self.info.split_whitespace().next() == Some("sh")
    }

    /// The reason after `# needs: `, when the block opens with one.
    fn needs(&self) -> Option<&str> {
        self.body.first()?.strip_prefix(NEEDS)
    }

    /// The block as a reader runs it: what the README had them set, then
    /// the block's lines.
    fn script(&self) -> String {
        reader_setup(&self.file, self.line)
            + &self
                .body
                .iter()
                .map(|line| {
                    if line.trim() == BUILD_COMMAND {
                        ": built by the test command before this test"
                    } else {
                        line
                    }
                })
                .collect::<Vec<_>>()
                .join("\n")
            + "\n"
    }

    fn at(&self) -> String {
        format!("{}:{}", self.file, self.line)
    }
}

/// The documents in `docs/`, relative to the repository root, in name order.
fn docs() -> Vec<String> {
    let mut out: Vec<String> = std::fs::read_dir(repo_root().join("docs"))
        .expect("docs/ reads")
        .map(|e| e.expect("a docs/ entry reads").file_name())
        .filter_map(|n| n.to_str().map(str::to_owned))
        .filter(|n| n.ends_with(".md"))
        .map(|n| format!("docs/{n}"))
        .collect();
    out.sort();
    assert!(!out.is_empty(), "docs/ holds no documents");
    out
}

/// The README and the documents in `docs/`: where the project shows
/// commands and transcripts.
fn readme_and_docs() -> Vec<String> {
    let mut out = vec!["README.md".to_owned()];
    out.extend(docs());
    out
}

/// Every document this test reads.
fn documents() -> Vec<String> {
    let mut out = readme_and_docs();
    out.insert(1, "examples/README.md".to_owned());
    out
}

fn blocks(file: &str) -> Vec<Block> {
    let text = std::fs::read_to_string(repo_root().join(file))
        .unwrap_or_else(|e| panic!("{file} does not read: {e}"));
    let mut out = Vec::new();
    let mut open: Option<Block> = None;
    for (i, line) in text.lines().enumerate() {
        match (&mut open, line.strip_prefix("```")) {
            (None, Some(info)) => {
                open = Some(Block {
                    file: file.to_owned(),
                    line: i + 1,
                    info: info.trim().to_owned(),
                    body: Vec::new(),
                });
            }
            (Some(_), Some(_)) => out.extend(open.take()),
            (Some(block), None) => block.body.push(line.to_owned()),
            (None, None) => {}
        }
    }
    assert!(open.is_none(), "{file}: a code block is never closed");
    out
}

/// Whether kubectl runs; when it does not, `false` after
/// `tool_check::missing` has said so for `test`.
fn kubectl_available(test: &str) -> bool {
    gpupool_sim_apiserver::tool_check::runs(test, "kubectl", &["version", "--client"])
}

/// The PATH a reader starts with: theirs, without this checkout's
/// `target/debug` and `.tools/bin`, which only the README's own
/// `export PATH=` line may add.
fn reader_path() -> OsString {
    let root = repo_root();
    let ours = [root.join("target/debug"), root.join(".tools/bin")];
    let same = |a: &std::path::Path, b: &std::path::Path| {
        a == b || matches!((a.canonicalize(), b.canonicalize()), (Ok(x), Ok(y)) if x == y)
    };
    let theirs: Vec<_> = std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
        .filter(|dir| !ours.iter().any(|o| same(dir, o)))
        .collect();
    std::env::join_paths(theirs).expect("PATH joins")
}

/// What a reader has set by the time they reach line `line` of `file`:
/// the `export PATH=` lines of the README's runnable blocks above it (all
/// of them for the other documents, which a reader opens after the README).
fn reader_setup(file: &str, line: usize) -> String {
    blocks("README.md")
        .into_iter()
        .filter(|b| b.is_shell() && b.needs().is_none())
        .filter(|b| file != "README.md" || b.line < line)
        .flat_map(|b| b.body)
        .filter(|l| l.trim_start().starts_with("export PATH="))
        .map(|l| l + "\n")
        .collect()
}

/// What one script left.
#[derive(Debug)]
struct Ran {
    ok: bool,
    output: String,
}

/// Runs `script` with bash in its own process group from the repository
/// root, and kills the whole group afterwards (or at the timeout).
fn run_script(script: &str, envs: &[(&str, OsString)]) -> Ran {
    // A block's temporary files and default run directories (`up --detach`
    // uses one under the temp dir) are the test's own, never a user's.
    let tmp = tempfile::tempdir().expect("tempdir");
    let mut cmd = Command::new("bash");
    cmd.arg("-c")
        .arg(format!("set -euo pipefail\n{script}"))
        .current_dir(repo_root())
        .env("PATH", reader_path())
        .env("PWD", repo_root())
        .env_remove("KUBECONFIG")
        .env("TMPDIR", tmp.path())
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("bash starts");
    let pid = child.id() as i32;
    let mut stdout = child.stdout.take().expect("stdout piped");
    let mut stderr = child.stderr.take().expect("stderr piped");
    let out_reader = std::thread::spawn(move || {
        let mut s = Vec::new();
        let _ = stdout.read_to_end(&mut s);
        s
    });
    let err_reader = std::thread::spawn(move || {
        let mut s = Vec::new();
        let _ = stderr.read_to_end(&mut s);
        s
    });
    let deadline = Instant::now() + BLOCK_TIMEOUT;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for bash") {
            break Some(status);
        }
        if Instant::now() > deadline {
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    // Whatever the script left running in the background goes with it.
    if let Some(group) = rustix::process::Pid::from_raw(pid) {
        let _ = rustix::process::kill_process_group(group, rustix::process::Signal::KILL);
    }
    let _ = child.wait();
    let mut output = String::from_utf8_lossy(&out_reader.join().unwrap_or_default()).into_owned();
    output.push_str(&String::from_utf8_lossy(
        &err_reader.join().unwrap_or_default(),
    ));
    Ran {
        ok: status.is_some_and(|s| s.success()),
        output: match status {
            Some(_) => output,
            None => format!("timed out after {BLOCK_TIMEOUT:?}\n{output}"),
        },
    }
}

/// Stand-ins for the tools a `# needs:` block cannot really run here.
const CHECKS: &str = r#"
helm() {
  local verb="$1"; shift
  case "$verb" in
    install|upgrade)
      local args=() a
      for a in "$@"; do
        case "$a" in
          --create-namespace|--wait|--atomic|--install|--reuse-values|--reset-values) ;;
          *) args+=("$a") ;;
        esac
      done
      "$REAL_HELM" template "${args[@]}" >/dev/null ;;
    uninstall|list|status) ;;
    *) echo "no check for helm $verb" >&2; return 1 ;;
  esac
}
docker() {
  [ "$1" = build ] || { echo "no check for docker $1" >&2; return 1; }
  local prev="" a
  for a in "$@"; do
    if [ "$prev" = --target ]; then
      grep -Eq "^FROM .* AS $a\$" Dockerfile || { echo "Dockerfile has no stage $a" >&2; return 1; }
    fi
    prev="$a"
  done
  [ "${!#}" = . ] || { echo "docker build must run from the repository root" >&2; return 1; }
}
kind() { :; }
cargo() {
  case "$1" in
    build) ;;
    test)
      local prev="" a
      for a in "$@"; do
        if [ "$prev" = --test ]; then
          [ -f "tests/tests/$a.rs" ] || { echo "no test suite $a" >&2; return 1; }
        fi
        prev="$a"
      done ;;
    *) echo "no check for cargo $1" >&2; return 1 ;;
  esac
}
bash() {
  case "$1" in
    .ci/*) [ -f "$1" ] || { echo "no script $1" >&2; return 1; }; echo "/checked/by/$1" ;;
    *) command bash "$@" ;;
  esac
}
gpupool-sim() {
  [ "$1" = up ] || { echo "no check for gpupool-sim $1" >&2; return 1; }
  command gpupool-sim "$@" --help >/dev/null
}
kubectl() {
  local prev="" a
  for a in "$@"; do
    if [ "$prev" = -f ] && [ "$a" != - ]; then
      [ -e "$a" ] || { echo "kubectl -f $a: no such file" >&2; return 1; }
    fi
    prev="$a"
  done
}
"#;

#[test]
fn every_shell_block_runs_or_says_what_it_needs() {
    for file in documents() {
        let shell: Vec<Block> = blocks(&file).into_iter().filter(Block::is_shell).collect();
        if !file.starts_with("docs/") {
            assert!(!shell.is_empty(), "{file} shows no commands");
        }
        for block in shell {
            if let Some(reason) = block.needs() {
                assert!(
                    reason.trim().len() >= 10,
                    "{}: `# needs:` must say what the block needs and why",
                    block.at()
                );
            }
            assert!(
                !block.body.iter().any(|l| l.starts_with("$ ")),
                "{}: a shell block holds commands, not a transcript",
                block.at()
            );
        }
    }
}

#[test]
fn blocks_that_need_a_cluster_render_and_name_real_files() {
    let Some(helm) = helm_support::helm() else {
        return;
    };
    let mut checked = 0;
    for block in readme_and_docs().iter().flat_map(|f| blocks(f)) {
        if !block.is_shell() || block.needs().is_none() {
            continue;
        }
        let ran = run_script(
            &format!("{CHECKS}\n{}", block.script()),
            &[("REAL_HELM", helm.clone().into_os_string())],
        );
        assert!(ran.ok, "{} fails as written:\n{}", block.at(), ran.output);
        checked += 1;
    }
    assert!(checked >= 3, "only {checked} blocks need a cluster?");
}

/// What a log line looks like on a terminal: a level among the first words,
/// or colour.
fn looks_like_a_log_line(line: &str) -> bool {
    line.contains('\x1b')
        || line
            .split_whitespace()
            .take(3)
            .any(|w| matches!(w, "TRACE" | "DEBUG" | "INFO" | "WARN" | "ERROR"))
}

/// The README's first shell block: its opening commands.
fn opening_block() -> Block {
    blocks("README.md")
        .into_iter()
        .find(Block::is_shell)
        .expect("the README shows its opening commands")
}

#[test]
fn the_opening_commands_are_the_test_command_and_a_clean_demo() {
    let first = opening_block();
    let commands: Vec<&str> = first
        .body
        .iter()
        .map(|l| l.trim())
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect();
    assert_eq!(
        commands,
        [DEMO_COMMAND, TEST_COMMAND],
        "the README opens with the demo and the test command"
    );
    // The test command is what CI runs, with --locked.
    let ci = std::fs::read_to_string(repo_root().join(".ci/run")).expect(".ci/run reads");
    assert!(ci.contains("cargo build --workspace --bins --locked\n"));
    assert!(ci.contains("cargo test --workspace --locked\n"));

    // The build half is what this test binary was built with; the demo runs
    // as written, and its terminal carries the story only.
    let demo = DEMO_COMMAND.split(" && ").nth(1).expect("the demo command");
    let ran = run_script(demo, &[]);
    assert!(ran.ok, "the demo fails:\n{}", ran.output);
    let logs: Vec<&str> = ran
        .output
        .lines()
        .filter(|l| looks_like_a_log_line(l))
        .collect();
    assert!(
        logs.is_empty(),
        "the demo printed log lines into its story:\n{}",
        logs.join("\n")
    );
}

#[test]
fn runnable_blocks_run_as_written() {
    if !kubectl_available("the documents' commands") {
        return;
    }
    if helm_support::helm().is_none() {
        return;
    }
    // The opening block is the previous test's.
    let opening = opening_block().line;
    let mut ran_blocks = 0;
    for file in readme_and_docs() {
        for block in blocks(&file) {
            if !block.is_shell()
                || block.needs().is_some()
                || (file == "README.md" && block.line == opening)
            {
                continue;
            }
            let ran = run_script(&block.script(), &[]);
            assert!(ran.ok, "{} fails as written:\n{}", block.at(), ran.output);
            ran_blocks += 1;
        }
    }
    assert!(
        ran_blocks >= 4,
        "only {ran_blocks} blocks of the README and docs/ ran"
    );
}

/// A table header: words in capitals only (`#` and `*` allowed).
fn is_header(line: &str) -> bool {
    let words: Vec<&str> = line.split_whitespace().collect();
    words.len() >= 2
        && words.iter().all(|w| {
            w.chars()
                .all(|c| c.is_ascii_uppercase() || "#*-()".contains(c))
        })
}

fn words(line: &str) -> Vec<&str> {
    line.split_whitespace().collect()
}

/// `$ command` lines and the output shown under each, from plain blocks of
/// the README and `docs/`.
fn transcripts() -> Vec<(String, String, Vec<String>)> {
    let mut out = Vec::new();
    for block in documents().iter().flat_map(|f| blocks(f)) {
        if !block.info.is_empty() {
            continue;
        }
        let mut current: Option<(String, String, Vec<String>)> = None;
        for line in &block.body {
            if let Some(cmd) = line.strip_prefix("$ ") {
                out.extend(current.take());
                current = Some((block.at(), cmd.to_owned(), Vec::new()));
            } else if let Some((_, _, shown)) = &mut current
                && !line.trim().is_empty()
            {
                shown.push(line.clone());
            }
        }
        out.extend(current);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_examples_and_the_transcripts_hold_on_the_simulator() {
    if !kubectl_available("the documents' commands") {
        return;
    }
    let cluster = SimCluster::start(ClusterConfig {
        nodes: 2,
        gpus_per_node: 2,
        operator: OperatorMode::Required,
        ready_timeout: Duration::from_secs(60),
        ..Default::default()
    })
    .await
    .expect("the simulated cluster starts (cargo build --workspace --bins first)");
    let env = vec![("KUBECONFIG", cluster.kubeconfig().as_os_str().to_owned())];

    let examples: Vec<Block> = blocks("examples/README.md")
        .into_iter()
        .filter(Block::is_shell)
        .collect();
    assert_eq!(examples.len(), 1, "examples/README.md shows one script");
    let script = examples[0].script();
    let script_env = env.clone();
    let ran = tokio::task::spawn_blocking(move || run_script(&script, &script_env))
        .await
        .expect("the script runs");
    assert!(
        ran.ok,
        "{} fails as written:\n{}",
        examples[0].at(),
        ran.output
    );

    // The transcripts speak of train-c and train-d waiting.
    let leases: Api<GpuLease> = Api::namespaced(cluster.client(), "default");
    let deadline = Instant::now() + Duration::from_secs(30);
    while leases.get_opt("train-d").await.ok().flatten().is_none() {
        assert!(Instant::now() < deadline, "train-d got no lease");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    let all = transcripts();
    assert!(all.len() >= 6, "the documents show {} commands", all.len());
    for (at, cmd, shown) in all {
        // A transcript shows a reader who has followed the README.
        let script = reader_setup("examples/README.md", 0) + &cmd;
        let env = env.clone();
        let ran = tokio::task::spawn_blocking(move || run_script(&script, &env))
            .await
            .expect("the command runs");
        assert!(ran.ok, "{at}: `{cmd}` fails:\n{}", ran.output);
        let printed: Vec<Vec<&str>> = ran.output.lines().map(words).collect();
        for header in shown.iter().filter(|l| is_header(l)) {
            assert!(
                printed.contains(&words(header)),
                "{at}: `{cmd}` no longer prints the header the README shows\n  README: {header}\n  printed:\n{}",
                ran.output
            );
        }
        if let Some(first) = shown.first().filter(|l| !is_header(l)) {
            let want = words(first).first().copied();
            let got = printed.first().and_then(|w| w.first().copied());
            assert_eq!(
                got, want,
                "{at}: `{cmd}` starts differently than the README shows:\n{}",
                ran.output
            );
        }
    }
    cluster.shutdown().await.expect("the cluster stops");
}

/// The anchor GitHub gives a heading: lower case, punctuation other than
/// `-` and `_` dropped, spaces turned into `-`.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            '-' | '_' => Some(c),
            c if c.is_alphanumeric() => Some(c),
            _ => None,
        })
        .flat_map(char::to_lowercase)
        .collect()
}

/// The anchors of a Markdown file's headings (outside code blocks), with
/// GitHub's `-1`, `-2` … for repeats.
fn anchors(text: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut in_code = false;
    for line in text.lines() {
        if line.starts_with("```") {
            in_code = !in_code;
            continue;
        }
        if in_code || !line.starts_with('#') {
            continue;
        }
        let base = anchor(line.trim_start_matches('#'));
        let repeats = out
            .iter()
            .filter(|a| {
                **a == base
                    || a.strip_prefix(&format!("{base}-"))
                        .is_some_and(|n| n.parse::<u32>().is_ok())
            })
            .count();
        out.push(if repeats == 0 {
            base
        } else {
            format!("{base}-{repeats}")
        });
    }
    out
}

/// The targets of the relative links `[text](target)` outside code blocks
/// and inline code, with the line each is on.
fn relative_links(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut in_code = false;
    for (i, line) in text.lines().enumerate() {
        if line.starts_with("```") {
            in_code = !in_code;
            continue;
        }
        if in_code {
            continue;
        }
        // Inline code may show link syntax without being a link.
        let prose: String = line.split('`').step_by(2).collect::<Vec<_>>().join(" ");
        let mut rest = prose.as_str();
        while let Some(at) = rest.find("](") {
            rest = &rest[at + 2..];
            let Some(end) = rest.find(')') else { break };
            let target = &rest[..end];
            rest = &rest[end..];
            if !target.contains("://") && !target.starts_with("mailto:") {
                out.push((i + 1, target.to_owned()));
            }
        }
    }
    out
}

#[test]
fn links_name_files_and_headings_that_exist() {
    let root = repo_root();
    let mut broken = Vec::new();
    for file in documents() {
        let text = std::fs::read_to_string(root.join(&file)).expect("the document reads");
        let dir = root
            .join(&file)
            .parent()
            .expect("a file has a directory")
            .to_path_buf();
        for (line, target) in relative_links(&text) {
            let (path, fragment) = match target.split_once('#') {
                Some((p, f)) => (p, Some(f)),
                None => (target.as_str(), None),
            };
            let resolved = if path.is_empty() {
                root.join(&file)
            } else {
                dir.join(path)
            };
            if !resolved.exists() {
                broken.push(format!("{file}:{line}: {target}: no such file"));
                continue;
            }
            if let Some(fragment) = fragment
                && resolved.extension().is_some_and(|e| e == "md")
            {
                let linked = std::fs::read_to_string(&resolved).expect("the linked file reads");
                if !anchors(&linked).iter().any(|a| a == fragment) {
                    broken.push(format!("{file}:{line}: {target}: no such heading"));
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn anchors_are_githubs() {
    assert_eq!(anchor(" 3. GpuLeaseClass"), "3-gpuleaseclass");
    assert_eq!(anchor(" `gpupool-sim bench`"), "gpupool-sim-bench");
    assert_eq!(anchor(" `kubectl gpupool`"), "kubectl-gpupool");
    assert_eq!(
        anchor(" What its API server does, and does not"),
        "what-its-api-server-does-and-does-not"
    );
    assert_eq!(
        anchors("# A\n## A\n```\n# not a heading\n```\n## A"),
        ["a", "a-1", "a-2"]
    );
    assert_eq!(
        relative_links("see [x](docs/a.md#b) and `[y](no)` or [z](https://e.org)"),
        [(1, "docs/a.md#b".to_owned())]
    );
}
