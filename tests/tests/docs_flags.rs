//! `docs/flags.md` against the binaries' own `--help`.
//!
//! Each binary's `--help` is run, and each subcommand's. Every `--flag` it
//! shows (bar `--help` and `--version`) must be in the first column of a
//! table in the section of `docs/flags.md` headed with the command in
//! backticks (`` ## `gpupool-operator` ``, `` ### `gpupool-sim up` ``), or,
//! for a subcommand, in its parent's section (flags kubectl-style commands
//! accept everywhere); the row must name the flag's environment variable
//! when `--help` shows one. Every flag a section documents must still be in
//! its command's `--help`, and every section must name a command that
//! exists.
//!
//! Needs the workspace's binaries (`cargo build --workspace --bins`, the
//! first half of the README's test command); fails without them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Each binary and the name its commands go by in `docs/flags.md`.
const BINARIES: &[(&str, &str)] = &[
    ("gpupool-operator", "gpupool-operator"),
    ("gpupool-device-plugin", "gpupool-device-plugin"),
    ("gpupool-sim", "gpupool-sim"),
    ("kubectl-gpupool", "kubectl gpupool"),
];

/// Flags every binary has, which the page does not repeat.
const UNDOCUMENTED: &[&str] = &["help", "version"];

/// The repository root (parent of the tests crate).
fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

/// A workspace binary next to this test (or one directory up, from
/// `target/<profile>/deps`), built by `cargo build --workspace --bins`.
fn workspace_binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let dir = exe.parent().expect("test binary has a directory");
    let candidates = [dir.join(name), dir.join("..").join(name)];
    candidates
        .iter()
        .find(|p| p.is_file())
        .cloned()
        .unwrap_or_else(|| {
            panic!(
                "{name} is not built (looked at {candidates:?}); run `cargo build --workspace --bins` first"
            )
        })
}

/// `binary <args> --help`, in an empty environment so that no variable's
/// value shows in it.
fn help(binary: &Path, args: &[&str]) -> String {
    let out = Command::new(binary)
        .args(args)
        .arg("--help")
        .env_clear()
        .env("NO_COLOR", "1")
        .output()
        .unwrap_or_else(|e| panic!("{} does not run: {e}", binary.display()));
    assert!(
        out.status.success(),
        "{} {} --help exits {}:\n{}",
        binary.display(),
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("--help prints UTF-8")
}

/// The first long flag in `text` (`webhook-port` in `--webhook-port
/// <PORT>`), and where `text` goes on after it.
fn next_long_name(text: &str) -> Option<(String, usize)> {
    let mut from = 0;
    while let Some(at) = text[from..].find("--").map(|i| from + i) {
        let name: String = text[at + 2..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
            .collect();
        if name.starts_with(|c: char| c.is_ascii_alphanumeric()) {
            let end = at + 2 + name.len();
            return Some((name, end));
        }
        from = at + 2;
    }
    None
}

/// The first long flag in `text`.
fn long_name(text: &str) -> Option<String> {
    next_long_name(text).map(|(name, _)| name)
}

/// One flag as `--help` shows it.
#[derive(Debug, PartialEq)]
struct HelpFlag {
    name: String,
    /// The variable in `[env: NAME=]`, when it has one.
    env: Option<String>,
}

/// Whether a help line opens an option: clap puts `-x, --long` after two
/// spaces and a long-only `--long` after six; descriptions are indented
/// further.
fn opens_option(line: &str) -> bool {
    let short = line
        .strip_prefix("  -")
        .is_some_and(|r| r.starts_with(|c: char| c.is_ascii_alphanumeric()));
    short || line.strip_prefix("      --").is_some()
}

/// The long flags a `--help` text shows, with their variables.
fn help_flags(text: &str) -> Vec<HelpFlag> {
    let mut blocks: Vec<String> = Vec::new();
    let mut in_option = false;
    for line in text.lines() {
        if opens_option(line) {
            blocks.push(line.to_owned());
            in_option = true;
        } else if !line.starts_with(' ') && !line.is_empty() {
            // A section title (`Options:`, `Examples:`) or the footer.
            in_option = false;
        } else if in_option && let Some(block) = blocks.last_mut() {
            block.push(' ');
            block.push_str(line.trim());
        }
    }
    blocks
        .iter()
        .filter_map(|block| {
            let name = long_name(block)?;
            let env = block
                .split_once("[env: ")
                .and_then(|(_, rest)| rest.split_once('=').map(|(name, _)| name.trim().to_owned()));
            Some(HelpFlag { name, env })
        })
        .filter(|f| !UNDOCUMENTED.contains(&f.name.as_str()))
        .collect()
}

/// The subcommands a `--help` text lists under `Commands:`, bar `help`.
fn subcommands(text: &str) -> Vec<String> {
    text.lines()
        .skip_while(|l| l.trim() != "Commands:")
        .skip(1)
        .take_while(|l| l.starts_with(' '))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .map(str::to_owned)
        .collect()
}

/// What a section of the page documents: each flag with the text of the
/// table row it is in.
type Section = BTreeMap<String, String>;

/// The page's sections by the command in their heading's backticks.
fn sections(page: &str) -> BTreeMap<String, Section> {
    let mut out: BTreeMap<String, Section> = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in page.lines() {
        if line.starts_with('#') {
            current = line
                .split('`')
                .nth(1)
                .filter(|_| line.matches('`').count() == 2)
                .map(str::to_owned);
            if let Some(command) = &current {
                assert!(
                    out.insert(command.clone(), Section::new()).is_none(),
                    "docs/flags.md has two sections for `{command}`"
                );
            }
            continue;
        }
        let (Some(command), Some(row)) = (&current, line.strip_prefix('|')) else {
            continue;
        };
        let mut rest = row.split('|').next().unwrap_or_default();
        while let Some((name, end)) = next_long_name(rest) {
            out.get_mut(command)
                .expect("the section was opened")
                .insert(name, line.to_owned());
            rest = &rest[end..];
        }
    }
    out
}

#[test]
fn every_flag_of_every_binary_is_on_the_flags_page_and_no_other() {
    let page =
        std::fs::read_to_string(repo_root().join("docs/flags.md")).expect("docs/flags.md reads");
    let sections = sections(&page);
    let mut problems = Vec::new();
    let mut checked = Vec::new();

    for (binary, name) in BINARIES {
        let path = workspace_binary(binary);
        let top = help(&path, &[]);
        let mut commands = vec![(name.to_string(), Vec::new(), top.clone())];
        for sub in subcommands(&top) {
            let text = help(&path, &[sub.as_str()]);
            commands.push((format!("{name} {sub}"), vec![sub], text));
        }
        for (command, args, text) in commands {
            checked.push(command.clone());
            let Some(section) = sections.get(&command) else {
                problems.push(format!(
                    "docs/flags.md has no section headed `{command}` (`{binary} {}--help` exists)",
                    args.iter().map(|a| format!("{a} ")).collect::<String>()
                ));
                continue;
            };
            let parent = (!args.is_empty()).then(|| sections.get(*name)).flatten();
            let shown = help_flags(&text);
            for flag in &shown {
                let row = section
                    .get(&flag.name)
                    .or_else(|| parent.and_then(|p| p.get(&flag.name)));
                match (row, &flag.env) {
                    (None, _) => problems.push(format!(
                        "`{command}`: --{} is in --help but not in docs/flags.md",
                        flag.name
                    )),
                    (Some(row), Some(env)) if !row.contains(env.as_str()) => {
                        problems.push(format!(
                            "`{command}`: docs/flags.md does not name --{}'s variable {env}",
                            flag.name
                        ))
                    }
                    _ => {}
                }
            }
            for documented in section.keys() {
                if !shown.iter().any(|f| &f.name == documented) {
                    problems.push(format!(
                        "`{command}`: docs/flags.md documents --{documented}, which --help no longer shows"
                    ));
                }
            }
        }
    }
    for command in sections.keys() {
        if !checked.contains(command) {
            problems.push(format!(
                "docs/flags.md has a section for `{command}`, which is no command of these binaries"
            ));
        }
    }
    assert!(
        problems.is_empty(),
        "docs/flags.md and --help disagree:\n{}",
        problems.join("\n")
    );
}

#[test]
fn help_texts_are_read_as_clap_writes_them() {
    let text = "\
Usage: x [OPTIONS] <COMMAND>

Commands:
  up    Start it
  help  Print this message

Options:
  -n, --namespace <NAMESPACE>  Namespace to show
      --leader-elect[=<LEADER_ELECT>]
          Elect one leader; `--leader-elect=false` runs alone [env: X_LEADER=] [default: true]
      --discovery <DISCOVERY>
          How GPUs are found

          Possible values:
          - static: GPUs from --static-gpus

          [env: X_DISCOVERY=]
  -h, --help     Print help

Examples:
  x up --nodes 2
";
    assert_eq!(
        help_flags(text),
        [
            HelpFlag {
                name: "namespace".into(),
                env: None
            },
            HelpFlag {
                name: "leader-elect".into(),
                env: Some("X_LEADER".into())
            },
            HelpFlag {
                name: "discovery".into(),
                env: Some("X_DISCOVERY".into())
            },
        ]
    );
    assert_eq!(subcommands(text), ["up"]);

    let page = "\
## `x`

| flag | meaning |
|---|---|
| `-n`, `--namespace NS` | where |

### `x up`

| `--a` (`A`), `--b` | | as for `--c` |
";
    let s = sections(page);
    assert_eq!(s["x"].keys().collect::<Vec<_>>(), ["namespace"]);
    assert_eq!(s["x up"].keys().collect::<Vec<_>>(), ["a", "b"]);
}
