//! What the credentials could not list, and what a view shows instead: a
//! tenant bound to the namespaced `view` or `edit` role may list its own
//! namespace's GpuLeases and Pods, but neither every namespace's leases nor
//! the cluster-scoped GpuLeaseClasses and Nodes. The views then show what
//! is visible and say, in one line each, what is not.

use serde::Serialize;

use crate::style::{Paint, Style};

/// One list the API server refused, and what the view does without it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Unseen {
    /// What could not be listed, e.g. `GpuLeaseClasses`.
    pub what: String,
    /// What is shown instead, e.g. `classes are shown by name only`.
    pub instead: String,
}

impl Unseen {
    /// Every namespace's GpuLeases were refused; `namespace`'s are shown.
    pub fn leases(namespace: &str, instead: &str) -> Unseen {
        Unseen {
            what: "GpuLeases in all namespaces".to_owned(),
            instead: format!("showing namespace {namespace}{instead}"),
        }
    }

    /// GpuLeaseClasses were refused.
    pub fn classes(instead: &str) -> Unseen {
        Unseen {
            what: "GpuLeaseClasses".to_owned(),
            instead: instead.to_owned(),
        }
    }

    /// Nodes were refused.
    pub fn nodes(instead: &str) -> Unseen {
        Unseen {
            what: "Nodes".to_owned(),
            instead: instead.to_owned(),
        }
    }

    /// Every namespace's Pods were refused: free slots count what the
    /// visible leases hold, and the pods of `namespace` (none when `None`:
    /// not even those could be listed).
    pub fn pods(namespace: Option<&str>) -> Unseen {
        Unseen {
            what: "Pods in all namespaces".to_owned(),
            instead: match namespace {
                Some(ns) => format!(
                    "free slots count what the leases it could see hold, and the pods of namespace {ns} only"
                ),
                None => "free slots count only what the leases it could see hold".to_owned(),
            },
        }
    }

    /// The line a person reads: `cannot list WHAT: forbidden; INSTEAD`.
    pub fn line(&self) -> String {
        format!("cannot list {}: forbidden; {}", self.what, self.instead)
    }
}

/// The lines for `unseen`, dimmed, each ending in a newline (empty for none).
pub fn render(unseen: &[Unseen], style: Style) -> String {
    unseen
        .iter()
        .map(|u| format!("{}\n", style.paint(&u.line(), Paint::Dim)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_line_says_what_was_refused_and_what_is_shown() {
        let all = [
            Unseen::leases("ml", ", at the operator's positions"),
            Unseen::classes("classes are shown by name only"),
            Unseen::nodes("node fit is not shown"),
            Unseen::pods(Some("ml")),
            Unseen::pods(None),
        ];
        assert_eq!(
            render(&all, Style::PLAIN),
            "cannot list GpuLeases in all namespaces: forbidden; showing namespace ml, at the operator's positions\n\
             cannot list GpuLeaseClasses: forbidden; classes are shown by name only\n\
             cannot list Nodes: forbidden; node fit is not shown\n\
             cannot list Pods in all namespaces: forbidden; free slots count what the leases it could see hold, and the pods of namespace ml only\n\
             cannot list Pods in all namespaces: forbidden; free slots count only what the leases it could see hold\n"
        );
        assert_eq!(render(&[], Style::PLAIN), "");
        assert!(render(&all[..1], Style { color: true }).starts_with("\x1b[2m"));
    }
}
