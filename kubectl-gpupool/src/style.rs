//! Terminal styling and the small wording helpers every view shares:
//! colour (only when it is wanted), plurals and kubectl-style ages.

use jiff::Timestamp;

/// How a piece of text is painted on a colour terminal.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Paint {
    /// As is.
    #[default]
    Plain,
    /// Bold: headings and names the eye should find.
    Bold,
    /// Dim: secondary detail (free slots, absent values).
    Dim,
    /// Green: free, healthy, running.
    Green,
    /// Yellow: waiting.
    Yellow,
    /// Cyan: helpers.
    Cyan,
    /// Red: preempted, unhealthy, rejected.
    Red,
}

impl Paint {
    fn code(self) -> Option<&'static str> {
        match self {
            Paint::Plain => None,
            Paint::Bold => Some("1"),
            Paint::Dim => Some("2"),
            Paint::Green => Some("32"),
            Paint::Yellow => Some("33"),
            Paint::Cyan => Some("36"),
            Paint::Red => Some("31"),
        }
    }
}

/// Whether output is coloured. Views take it as a value, so rendering stays
/// a pure function of its input.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Style {
    /// True to emit ANSI colour codes.
    pub color: bool,
}

impl Style {
    /// No colour: what pipes, files and tests get.
    pub const PLAIN: Style = Style { color: false };

    /// Decides colour the way well-behaved command-line tools do: only on a
    /// terminal, never when `NO_COLOR` is set to anything non-empty
    /// (<https://no-color.org>), and never for `TERM=dumb`.
    pub fn detect(is_terminal: bool, no_color: Option<&str>, term: Option<&str>) -> Style {
        let color =
            is_terminal && no_color.is_none_or(str::is_empty) && term.is_none_or(|t| t != "dumb");
        Style { color }
    }

    /// `text` painted with `paint`; unchanged without colour. The escape
    /// codes never count toward a column's width (see `table`).
    pub fn paint(self, text: &str, paint: Paint) -> String {
        match (self.color, paint.code()) {
            (true, Some(code)) if !text.is_empty() => format!("\x1b[{code}m{text}\x1b[0m"),
            _ => text.to_owned(),
        }
    }
}

/// `1 slot`, `2 slots`, `0 slots`: the count and the noun in agreement.
pub fn count(n: u64, singular: &str, plural: &str) -> String {
    format!("{n} {}", noun(n, singular, plural))
}

/// The noun alone, in agreement with `n`.
pub fn noun<'a>(n: u64, singular: &'a str, plural: &'a str) -> &'a str {
    if n == 1 { singular } else { plural }
}

/// Time from `since` to `now` the way `kubectl get` prints an AGE: `45s`,
/// `3m12s`, `25m`, `4h10m`, `30h`, `3d4h`, `12d`. A `since` in the future
/// (clock skew between the API server and this machine) reads `0s`.
pub fn age(since: Timestamp, now: Timestamp) -> String {
    let secs = now.as_second().saturating_sub(since.as_second()).max(0);
    let (m, h, d) = (secs / 60, secs / 3600, secs / 86_400);
    if secs < 120 {
        format!("{secs}s")
    } else if m < 10 {
        format_pair(m, "m", secs % 60, "s")
    } else if h < 3 {
        format!("{m}m")
    } else if h < 8 {
        format_pair(h, "h", m % 60, "m")
    } else if d < 2 {
        format!("{h}h")
    } else if d < 8 {
        format_pair(d, "d", h % 24, "h")
    } else {
        format!("{d}d")
    }
}

fn format_pair(big: i64, big_unit: &str, small: i64, small_unit: &str) -> String {
    if small == 0 {
        format!("{big}{big_unit}")
    } else {
        format!("{big}{big_unit}{small}{small_unit}")
    }
}

/// A list in prose: `a`, `a and b`, `a, b and c`.
pub fn join_prose(items: &[String]) -> String {
    match items {
        [] => String::new(),
        [one] => one.clone(),
        [init @ .., last] => format!("{} and {last}", init.join(", ")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn colour_only_on_a_terminal_without_no_color() {
        let cases = [
            (true, None, None, true),
            (true, None, Some("xterm-256color"), true),
            (true, Some(""), None, true),
            (true, Some("1"), None, false),
            (true, None, Some("dumb"), false),
            (false, None, Some("xterm"), false),
        ];
        for (tty, no_color, term, want) in cases {
            assert_eq!(
                Style::detect(tty, no_color, term).color,
                want,
                "tty={tty} NO_COLOR={no_color:?} TERM={term:?}"
            );
        }
    }

    #[test]
    fn paint_wraps_only_with_colour() {
        assert_eq!(Style::PLAIN.paint("x", Paint::Red), "x");
        let c = Style { color: true };
        assert_eq!(c.paint("x", Paint::Red), "\x1b[31mx\x1b[0m");
        assert_eq!(c.paint("x", Paint::Plain), "x");
        assert_eq!(c.paint("", Paint::Bold), "");
    }

    #[test]
    fn plurals_agree() {
        let cases = [(0, "0 slots"), (1, "1 slot"), (2, "2 slots")];
        for (n, want) in cases {
            assert_eq!(count(n, "slot", "slots"), want);
        }
        assert_eq!(count(1, "primary", "primaries"), "1 primary");
        assert_eq!(count(3, "primary", "primaries"), "3 primaries");
    }

    #[test]
    fn ages_read_like_kubectl() {
        let now = Timestamp::from_second(1_000_000).expect("valid");
        let cases = [
            (0, "0s"),
            (45, "45s"),
            (119, "119s"),
            (120, "2m"),
            (192, "3m12s"),
            (25 * 60, "25m"),
            (4 * 3600 + 600, "4h10m"),
            (5 * 3600, "5h"),
            (30 * 3600, "30h"),
            (3 * 86_400 + 4 * 3600, "3d4h"),
            (12 * 86_400, "12d"),
            (-30, "0s"),
        ];
        for (ago, want) in cases {
            let since = Timestamp::from_second(1_000_000 - ago).expect("valid");
            assert_eq!(age(since, now), want, "{ago}s ago");
        }
    }

    #[test]
    fn prose_lists() {
        let s = |v: &[&str]| v.iter().map(|x| (*x).to_owned()).collect::<Vec<_>>();
        assert_eq!(join_prose(&s(&[])), "");
        assert_eq!(join_prose(&s(&["a"])), "a");
        assert_eq!(join_prose(&s(&["a", "b"])), "a and b");
        assert_eq!(join_prose(&s(&["a", "b", "c"])), "a, b and c");
    }
}
