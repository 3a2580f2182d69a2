//! What a test does when a tool it needs is missing (helm, kubectl, a real
//! control plane's binaries, the images): in CI, where `.ci/run` installs
//! every one of them, it fails, so a broken install step cannot pass
//! unnoticed; elsewhere it prints one line saying what did not run.

/// The environment variable CI sets.
pub const CI_ENV: &str = "CI";

/// Whether this is a CI run (`CI` set and not empty).
pub fn in_ci() -> bool {
    std::env::var_os(CI_ENV).is_some_and(|v| !v.is_empty())
}

/// Reports that `what` (the tool, and how to get it) is missing for
/// `test`: panics in CI; otherwise prints `skipping <test>: <what>`, for
/// the caller to return without checking anything.
pub fn missing(test: &str, what: &str) {
    match verdict(in_ci(), test, what) {
        Ok(line) => eprintln!("{line}"),
        Err(failure) => panic!("{failure}"),
    }
}

/// The skip line, or in CI the failure.
fn verdict(ci: bool, test: &str, what: &str) -> Result<String, String> {
    if ci {
        Err(format!(
            "{CI_ENV} is set, so {test} may not skip, yet {what}"
        ))
    } else {
        Ok(format!("skipping {test}: {what}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_tool_fails_in_ci_and_is_a_skip_line_elsewhere() {
        assert_eq!(
            verdict(true, "the helm suite", "helm is not installed"),
            Err("CI is set, so the helm suite may not skip, yet helm is not installed".to_owned())
        );
        assert_eq!(
            verdict(false, "the helm suite", "helm is not installed"),
            Ok("skipping the helm suite: helm is not installed".to_owned())
        );
    }
}
