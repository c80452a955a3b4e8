//! The demo's chart: requests per second over the steady load, allowed
//! (at once, and after a delay) against limited, with the configured limit.

use std::path::Path;

use anyhow::{anyhow, Context, Result};
use plotters::prelude::*;

use crate::load::Second;

/// What the chart shows besides the counts.
pub struct ChartInfo<'a> {
    /// Title, first line.
    pub title: &'a str,
    /// The limit's refill rate, requests per second.
    pub limit_rate: f64,
    /// The label of the limit line.
    pub limit_label: &'a str,
}

/// Each second's value as a step: flat over `[k, k + 1)`.
fn steps(seconds: &[Second], value: impl Fn(&Second) -> u32) -> Vec<(f64, f64)> {
    seconds
        .iter()
        .enumerate()
        .flat_map(|(k, s)| {
            let v = f64::from(value(s));
            [(k as f64, v), (k as f64 + 1.0, v)]
        })
        .collect()
}

/// Writes the chart of `seconds` to `path` (SVG).
pub fn write(path: &Path, seconds: &[Second], info: &ChartInfo) -> Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    draw(path, seconds, info).map_err(|e| anyhow!("drawing {}: {e}", path.display()))
}

fn draw(
    path: &Path,
    seconds: &[Second],
    info: &ChartInfo,
) -> Result<(), Box<dyn std::error::Error>> {
    let root = SVGBackend::new(path, (960, 540)).into_drawing_area();
    root.fill(&WHITE)?;
    let x_max = seconds.len().max(1) as f64;
    let peak = seconds
        .iter()
        .map(|s| s.sent)
        .max()
        .unwrap_or(0)
        .max(info.limit_rate.ceil() as u32);
    // Head room for the legend, above the data.
    let y_max = (f64::from(peak) * 1.6).ceil().max(1.0);

    let mut chart = ChartBuilder::on(&root)
        .caption(info.title, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(56)
        .build_cartesian_2d(0.0..x_max, 0.0..y_max)?;
    chart
        .configure_mesh()
        .x_desc("time since the load started (s)")
        .y_desc("requests per second")
        .x_labels(seconds.len() + 1)
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| format!("{y:.0}"))
        .light_line_style(WHITE)
        .label_style(("sans-serif", 15))
        .axis_desc_style(("sans-serif", 16))
        .draw()?;

    let green = RGBColor(46, 160, 67);
    let amber = RGBColor(240, 160, 30);
    let red = RGBColor(215, 48, 39);
    let blue = RGBColor(31, 90, 200);
    let grey = RGBColor(110, 110, 110);

    // Stacked: all 200s in amber, then those answered at once in green over
    // them, so the amber band on top is the delayed ones.
    chart
        .draw_series(AreaSeries::new(
            steps(seconds, |s| s.allowed + s.delayed),
            0.0,
            amber.mix(0.75),
        ))?
        .label("200 after a delay (graduated rule)")
        .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 18, y + 6)], amber.filled()));
    chart
        .draw_series(AreaSeries::new(
            steps(seconds, |s| s.allowed),
            0.0,
            green.mix(0.75),
        ))?
        .label("200 at once")
        .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 18, y + 6)], green.filled()));
    chart
        .draw_series(LineSeries::new(
            steps(seconds, |s| s.limited + s.quota),
            red.stroke_width(3),
        ))?
        .label("limited (429 + 403)")
        .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], red.stroke_width(3)));
    chart
        .draw_series(LineSeries::new(
            steps(seconds, |s| s.sent),
            grey.stroke_width(1),
        ))?
        .label("sent")
        .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], grey.stroke_width(1)));
    chart
        .draw_series(DashedLineSeries::new(
            [(0.0, info.limit_rate), (x_max, info.limit_rate)],
            10,
            6,
            blue.stroke_width(2),
        ))?
        .label(info.limit_label)
        .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], blue.stroke_width(2)));

    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .label_font(("sans-serif", 15))
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK.mix(0.4))
        .draw()?;
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_an_svg_with_every_series() {
        let second = |allowed, delayed, limited| {
            let mut s = Second::default();
            (s.allowed, s.delayed, s.limited) = (allowed, delayed, limited);
            s.sent = allowed + delayed + limited;
            s
        };
        let seconds = [second(25, 0, 0), second(7, 17, 1), second(0, 10, 15)];
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/chart.svg");
        let info = ChartInfo {
            title: "t",
            limit_rate: 10.0,
            limit_label: "limit: 20 per 2s = 10 requests/s",
        };
        write(&path, &seconds, &info).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.starts_with("<svg"), "{svg:.80}");
        for label in [
            "200 at once",
            "200 after a delay",
            "limited (429 + 403)",
            "sent",
            "limit: 20 per 2s = 10 requests/s",
        ] {
            assert!(svg.contains(label), "{label} missing");
        }
    }
}
