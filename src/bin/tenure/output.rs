//! Tables for people, JSON for scripts, and writes that survive a reader gone away.

use std::io::{IsTerminal, Write};

use comfy_table::{Table, presets};

use crate::{Failure, Outcome};

/// Where a command's result goes.
pub struct Out {
    pub json: bool,
}

impl Out {
    /// Prints `value` as JSON with `--json`, else the text `human` makes.
    pub fn print(&self, value: serde_json::Value, human: impl FnOnce() -> String) -> Outcome {
        if self.json {
            line(&json_text(&value))
        } else {
            // Every command's text goes through here: whatever a stored value holds, it
            // cannot reach the terminal as an escape sequence.
            line(&clean_lines(human().trim_end()))
        }
    }
}

/// Writes `text` and a newline to stdout. A reader that has gone away (`tenure ... | head`)
/// is not an error: the output is not wanted any more, and the command's status stays that
/// of what it did. Any other write error (a full disk) is exit code 1.
pub fn line(text: &str) -> Outcome {
    let mut stdout = std::io::stdout().lock();
    let written = writeln!(stdout, "{text}").and_then(|()| stdout.flush());
    match written {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(Failure::new(1, format!("cannot write the output: {e}")))
        }
        _ => Ok(()),
    }
}

/// A table with aligned columns: light rules on a terminal, plain space-separated columns
/// (no box characters) when the output goes to a file or a pipe.
pub fn table(headers: &[&str], rows: impl Iterator<Item = Vec<String>>) -> String {
    let mut table = Table::new();
    let preset = if std::io::stdout().is_terminal() {
        presets::UTF8_HORIZONTAL_ONLY
    } else {
        presets::NOTHING
    };
    table.load_style(preset).set_header(headers.to_vec());
    let mut empty = true;
    for row in rows {
        // A cell is one line: a stored newline or escape would break the columns.
        table.add_row(row.iter().map(|cell| clean(cell)).collect::<Vec<_>>());
        empty = false;
    }
    if empty {
        return "(none)\n".to_string();
    }
    let lines: Vec<String> = table.lines().collect();
    // Each cell is padded by a space: the first column's is not needed.
    let indent = usize::from(lines.iter().all(|line| line.starts_with(' ')));
    let mut text = String::new();
    for line in &lines {
        text.push_str(line[indent..].trim_end());
        text.push('\n');
    }
    text
}

/// A duration for people: `1.2s`, `3m04s`, `2h05m`, `3d04h`.
pub fn age(duration: chrono::Duration) -> String {
    let ms = duration.num_milliseconds();
    let sign = if ms < 0 { "-" } else { "" };
    let ms = ms.unsigned_abs();
    let s = ms / 1000;
    let text = if s < 60 {
        format!("{:.1}s", ms as f64 / 1000.0)
    } else if s < 3600 {
        format!("{}m{:02}s", s / 60, s % 60)
    } else if s < 86400 {
        format!("{}h{:02}m", s / 3600, (s % 3600) / 60)
    } else {
        format!("{}d{:02}h", s / 86400, (s % 86400) / 3600)
    };
    format!("{sign}{text}")
}

/// The first `max` characters of one line of `text`.
pub fn short(text: &str, max: usize) -> String {
    let line = text.lines().next().unwrap_or("");
    if line.chars().count() <= max {
        return line.to_string();
    }
    let mut cut: String = line.chars().take(max.saturating_sub(1)).collect();
    cut.push('…');
    cut
}

/// `value` as JSON text in which the control characters JSON allows raw in strings (DEL,
/// C1 codes) and bidirectional overrides are `\u` escapes too: the same JSON, safe on a
/// terminal.
fn json_text(value: &serde_json::Value) -> String {
    json_safe(value.to_string())
}

/// JSON text (compact or pretty) with the escapes of [`json_text`].
pub fn json_safe(text: String) -> String {
    // Whitespace between tokens stays; inside strings serde_json escaped it already.
    let harmful = |c: char| (c.is_control() && !c.is_ascii_whitespace()) || is_bidi_control(c);
    if !text.chars().any(harmful) {
        return text;
    }
    let mut out = String::with_capacity(text.len() + 16);
    for c in text.chars() {
        if harmful(c) {
            // All of them are in the Basic Multilingual Plane: one escape each.
            out.push_str(&format!("\\u{:04x}", c as u32));
        } else {
            out.push(c);
        }
    }
    out
}

/// Database text for one line of output: control characters (newlines, escape sequences,
/// carriage returns, C1 codes) and bidirectional overrides written as Rust escapes (`\n`,
/// `\u{1b}`), so that a stored value cannot move the cursor, recolour or retitle the
/// terminal, hide text or break the layout.
pub fn clean(text: &str) -> String {
    escape(text, false)
}

/// [`clean`], keeping line breaks and tabs: for text of several lines (a result, an output).
pub fn clean_lines(text: &str) -> String {
    escape(text, true)
}

fn escape(text: &str, keep_lines: bool) -> String {
    let harmful = |c: char| {
        let kept = keep_lines && matches!(c, '\n' | '\t');
        !kept && (c.is_control() || is_bidi_control(c))
    };
    if !text.chars().any(harmful) {
        return text.to_string();
    }
    let mut out = String::with_capacity(text.len() + 16);
    for c in text.chars() {
        if harmful(c) {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

/// Characters that reorder the text around them ("Trojan Source").
fn is_bidi_control(c: char) -> bool {
    matches!(c, '\u{061c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

/// A job's progress: a fraction as a percentage (`42%`), any other number as it is.
pub fn progress(value: f64) -> String {
    if (0.0..=1.0).contains(&value) {
        format!("{:.0}%", value * 100.0)
    } else {
        value.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stored_text_cannot_drive_the_terminal() {
        assert_eq!(clean("a\u{1b}[31mb\r\n"), "a\\u{1b}[31mb\\r\\n");
        assert_eq!(clean("\u{9b}2J \u{202e}txt"), "\\u{9b}2J \\u{202e}txt");
        assert_eq!(clean_lines("a\n\tb\u{7}"), "a\n\tb\\u{7}");
        assert_eq!(clean("<script>é</script>"), "<script>é</script>");
    }

    #[test]
    fn json_stays_json_without_raw_controls() {
        let value = serde_json::json!({"k": "a\u{1b}\u{7f}\u{9b}\u{202e}b\n"});
        let text = json_text(&value);
        assert!(text.is_ascii(), "{text}");
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(&text).unwrap(),
            value
        );
    }

    #[test]
    fn progress_is_a_percentage_or_a_number() {
        assert_eq!(progress(0.42), "42%");
        assert_eq!(progress(1.0), "100%");
        assert_eq!(progress(1500.0), "1500");
        assert_eq!(progress(-2.5), "-2.5");
    }
}
