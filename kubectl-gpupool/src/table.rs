//! Column-aligned tables in kubectl's layout: upper-case headers, columns
//! separated by at least three spaces, the last column not padded.

use crate::style::{Paint, Style};

/// One cell: its text and how it is painted on a colour terminal.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Cell {
    /// What is shown; its width alone decides the column's width.
    pub text: String,
    /// Colour on a terminal.
    pub paint: Paint,
}

impl Cell {
    /// A cell painted `paint`.
    pub fn new(text: impl Into<String>, paint: Paint) -> Cell {
        Cell {
            text: text.into(),
            paint,
        }
    }
}

impl From<String> for Cell {
    fn from(text: String) -> Cell {
        Cell::new(text, Paint::Plain)
    }
}

impl From<&str> for Cell {
    fn from(text: &str) -> Cell {
        Cell::new(text, Paint::Plain)
    }
}

/// A table to render. Rows shorter than the header leave the rest empty.
#[derive(Debug, Clone, Default)]
pub struct Table {
    /// Column headers.
    pub headers: Vec<String>,
    /// Rows of cells.
    pub rows: Vec<Vec<Cell>>,
    /// Spaces before every line (to nest a table under a heading).
    pub indent: usize,
}

const GAP: usize = 3;

impl Table {
    /// A table with these headers and no rows.
    pub fn new(headers: &[&str]) -> Table {
        Table {
            headers: headers.iter().map(|h| (*h).to_owned()).collect(),
            rows: Vec::new(),
            indent: 0,
        }
    }

    /// Adds a row.
    pub fn push(&mut self, row: Vec<Cell>) {
        self.rows.push(row);
    }

    /// The column widths: the widest header or cell of each column, counted
    /// in characters (never in escape codes, which are added after padding).
    pub fn widths(&self) -> Vec<usize> {
        let mut widths: Vec<usize> = self.headers.iter().map(|h| h.chars().count()).collect();
        for row in &self.rows {
            for (i, cell) in row.iter().enumerate() {
                let w = cell.text.chars().count();
                match widths.get_mut(i) {
                    Some(old) => *old = (*old).max(w),
                    None => widths.push(w),
                }
            }
        }
        widths
    }

    /// The table as text, one line per row after the header line, each
    /// ending in a newline; trailing spaces are never written.
    pub fn render(&self, style: Style) -> String {
        self.render_with_widths(style, &self.widths())
    }

    /// As [`Table::render`], with widths given (so that several tables
    /// line up with each other).
    pub fn render_with_widths(&self, style: Style, widths: &[usize]) -> String {
        let mut out = String::new();
        let header: Vec<Cell> = self
            .headers
            .iter()
            .map(|h| Cell::from(h.as_str()))
            .collect();
        for row in std::iter::once(&header).chain(&self.rows) {
            let mut line = " ".repeat(self.indent);
            // Cells after the last non-empty one are dropped, so no line
            // ends in padding.
            let used = row
                .iter()
                .rposition(|c| !c.text.is_empty())
                .map_or(0, |i| i + 1);
            for (i, cell) in row[..used].iter().enumerate() {
                line.push_str(&style.paint(&cell.text, cell.paint));
                if i + 1 < used {
                    let width = widths.get(i).copied().unwrap_or(0);
                    let pad = width.saturating_sub(cell.text.chars().count()) + GAP;
                    line.push_str(&" ".repeat(pad));
                }
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out
    }
}

/// Widths that fit every table given, column by column.
pub fn common_widths(tables: &[&Table]) -> Vec<usize> {
    let mut widths: Vec<usize> = Vec::new();
    for table in tables {
        for (i, w) in table.widths().into_iter().enumerate() {
            match widths.get_mut(i) {
                Some(old) => *old = (*old).max(w),
                None => widths.push(w),
            }
        }
    }
    widths
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(rows: &[&[&str]]) -> Table {
        let mut t = Table::new(&["NAME", "SLOTS", "WHY"]);
        for r in rows {
            t.push(r.iter().map(|c| Cell::from(*c)).collect());
        }
        t
    }

    #[test]
    fn aligns_columns_without_trailing_spaces() {
        let cases: &[(&[&[&str]], &str)] = &[
            (&[], "NAME   SLOTS   WHY\n"),
            (
                &[&["train-a", "2", "waiting"], &["b", "1", ""]],
                "NAME      SLOTS   WHY\ntrain-a   2       waiting\nb         1\n",
            ),
            (&[&["x"]], "NAME   SLOTS   WHY\nx\n"),
        ];
        for (rows, want) in cases {
            assert_eq!(table(rows).render(Style::PLAIN), *want, "{rows:?}");
        }
    }

    #[test]
    fn colour_codes_do_not_count_toward_width() {
        let mut t = Table::new(&["A", "B"]);
        t.push(vec![Cell::new("xx", Paint::Red), Cell::from("y")]);
        let out = t.render(Style { color: true });
        assert_eq!(out, "A    B\n\x1b[31mxx\x1b[0m   y\n");
    }

    #[test]
    fn indent_and_common_widths() {
        let mut a = table(&[&["long-name", "1", "w"]]);
        let b = table(&[&["s", "1", "w"]]);
        a.indent = 2;
        let widths = common_widths(&[&a, &b]);
        assert_eq!(widths, vec![9, 5, 3]);
        let out = b.render_with_widths(Style::PLAIN, &widths);
        assert_eq!(out, "NAME        SLOTS   WHY\ns           1       w\n");
        assert!(a.render(Style::PLAIN).starts_with("  NAME"));
    }
}
