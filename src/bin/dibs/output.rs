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
            line(&value.to_string())
        } else {
            line(human().trim_end())
        }
    }
}

/// Writes `text` and a newline to stdout. A reader that has gone away (`dibs ... | head`)
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
        table.add_row(row);
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
