//! Tables for people, JSON for scripts.

/// Where a command's result goes.
pub struct Out {
    pub json: bool,
}

impl Out {
    /// Prints `value` as JSON with `--json`, else the text `human` makes.
    pub fn print(&self, value: serde_json::Value, human: impl FnOnce() -> String) {
        if self.json {
            println!("{value}");
        } else {
            let text = human();
            println!("{}", text.trim_end());
        }
    }
}

/// A plain-text table with aligned columns.
pub fn table(headers: &[&str], rows: impl Iterator<Item = Vec<String>>) -> String {
    let rows: Vec<Vec<String>> = rows.collect();
    if rows.is_empty() {
        return "(none)\n".to_string();
    }
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in &rows {
        for (i, cell) in row.iter().enumerate() {
            if let Some(width) = widths.get_mut(i) {
                *width = (*width).max(cell.chars().count());
            }
        }
    }
    let line = |cells: Vec<&str>| {
        let mut text = cells
            .iter()
            .zip(&widths)
            .map(|(cell, width)| format!("{cell:<width$}"))
            .collect::<Vec<_>>()
            .join("  ");
        text.truncate(text.trim_end().len());
        text.push('\n');
        text
    };
    let mut text = line(headers.to_vec());
    for row in &rows {
        text.push_str(&line(row.iter().map(String::as_str).collect()));
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

/// A JSON value as plain text (strings without quotes, null as empty).
pub fn plain(value: &serde_json::Value) -> String {
    match value {
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Null => String::new(),
        other => other.to_string(),
    }
}
