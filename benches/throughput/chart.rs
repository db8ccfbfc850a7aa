//! Charts of G's and P's windows as SVG files a person reads at a glance ("flat" or not):
//! one panel per series, stacked, time along the x axis, a phase (the held snapshot) shaded.
//! Written to `TENURE_BENCH_CHARTS` (default `bench-charts/` in the working directory).

use std::fmt::Write as _;
use std::path::PathBuf;

/// One series: its label (with its unit) and its points `(seconds, value)`.
pub struct Series {
    pub label: String,
    pub points: Vec<(f64, f64)>,
}

const WIDTH: f64 = 720.0;
const PANEL: f64 = 150.0;
const LEFT: f64 = 70.0;
const TOP: f64 = 40.0;
const GAP: f64 = 40.0;

/// Writes `name`.svg with `title` over the panels of `series`, shading `shade` (from, to, in
/// seconds, with its label) in each; returns the file's path, or why it could not be written.
pub fn write(
    name: &str,
    title: &str,
    series: &[Series],
    shade: Option<(f64, f64, &str)>,
) -> Result<PathBuf, String> {
    let dir = PathBuf::from(
        std::env::var("TENURE_BENCH_CHARTS").unwrap_or_else(|_| "bench-charts".into()),
    );
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let path = dir.join(format!("{name}.svg"));
    std::fs::write(&path, svg(title, series, shade))
        .map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(path)
}

fn svg(title: &str, series: &[Series], shade: Option<(f64, f64, &str)>) -> String {
    let height = TOP + series.len() as f64 * (PANEL + GAP) + 10.0;
    let t_max = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.0))
        .fold(1.0, f64::max);
    let plot = WIDTH - LEFT - 20.0;
    let x = |t: f64| LEFT + t / t_max * plot;
    let mut out = String::new();
    let _ = write!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" font-family="sans-serif" font-size="11">"#
    );
    let _ = write!(
        out,
        r#"<rect width="100%" height="100%" fill="white"/><text x="{LEFT}" y="20" font-size="14">{}</text>"#,
        escape(title)
    );
    for (i, s) in series.iter().enumerate() {
        let top = TOP + i as f64 * (PANEL + GAP);
        let bottom = top + PANEL;
        // From zero, so that flat reads as flat and growth as growth.
        let v_max = s.points.iter().map(|p| p.1).fold(0.0, f64::max).max(1e-9) * 1.1;
        let y = |v: f64| bottom - v / v_max * PANEL;
        if let Some((from, to, label)) = shade {
            let _ = write!(
                out,
                r##"<rect x="{:.1}" y="{top}" width="{:.1}" height="{PANEL}" fill="#f3e0c0"/><text x="{:.1}" y="{:.1}" fill="#a06000">{}</text>"##,
                x(from),
                (x(to) - x(from)).max(0.0),
                x(from) + 4.0,
                top + 12.0,
                escape(label)
            );
        }
        let _ = write!(
            out,
            r#"<line x1="{LEFT}" y1="{bottom}" x2="{:.1}" y2="{bottom}" stroke="black"/><line x1="{LEFT}" y1="{top}" x2="{LEFT}" y2="{bottom}" stroke="black"/>"#,
            LEFT + plot
        );
        let _ = write!(
            out,
            r#"<text x="{LEFT}" y="{:.1}">{}</text><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text><text x="{:.1}" y="{:.1}" text-anchor="end">0</text>"#,
            top - 6.0,
            escape(&s.label),
            LEFT - 4.0,
            top + 10.0,
            short(v_max / 1.1),
            LEFT - 4.0,
            bottom
        );
        let _ = write!(
            out,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{:.0} s</text>"#,
            LEFT + plot,
            bottom + 14.0,
            t_max
        );
        let points: Vec<String> = s
            .points
            .iter()
            .map(|&(t, v)| format!("{:.1},{:.1}", x(t), y(v)))
            .collect();
        let _ = write!(
            out,
            r##"<polyline fill="none" stroke="#1f5fbf" stroke-width="2" points="{}"/>"##,
            points.join(" ")
        );
    }
    out.push_str("</svg>\n");
    out
}

/// A value short enough for the axis.
fn short(v: f64) -> String {
    if v >= 1e6 {
        format!("{:.1}M", v / 1e6)
    } else if v >= 1e4 {
        format!("{:.0}k", v / 1e3)
    } else if v >= 10.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.2}")
    }
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}
