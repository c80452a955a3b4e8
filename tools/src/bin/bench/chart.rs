//! BENCHMARKS.svg: requests/s and the measured Envoy's CPU time per request
//! for each variant (bars: mean, whiskers: min–max over the rounds), p50 and
//! p99 latency per variant, and the gateway against raw `EVALSHA`.

use std::path::Path;

use anyhow::{anyhow, Context, Result};
use plotters::coord::types::{RangedCoordf64, RangedCoordusize};
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use crate::stats::{group, Spread};
use crate::{Session, VARIANTS};

/// One bar group of the chart.
struct Bar {
    label: String,
    rps: Spread,
    p50: Spread,
    p99: Spread,
    cpu: Spread,
    color: RGBColor,
}

fn color_of(id: &str) -> RGBColor {
    match id {
        "a" | "a2" | "a3" => RGBColor(140, 140, 140),
        "b" => RGBColor(230, 145, 56),
        "b-f" => RGBColor(246, 196, 140),
        "c1" | "c4" | "cc" | "cm" | "c1-1k" | "c1-64k" => RGBColor(54, 110, 190),
        "cu-1k" | "cu-64k" => RGBColor(90, 160, 200),
        "c1-f" => RGBColor(140, 175, 225),
        "d" | "d1" | "d2" | "dg" => RGBColor(120, 80, 170),
        "e" => RGBColor(170, 130, 210),
        "g" => RGBColor(60, 150, 120),
        _ => RGBColor(80, 80, 80),
    }
}

fn bars(s: &Session) -> Vec<Bar> {
    VARIANTS
        .iter()
        .filter_map(|v| {
            let runs: Vec<_> = s.runs.iter().filter(|r| r.variant == v.id).collect();
            if runs.is_empty() {
                return None;
            }
            let of = |f: &dyn Fn(&crate::Run) -> f64| {
                Spread::of(&runs.iter().map(|r| f(r)).collect::<Vec<_>>())
            };
            Some(Bar {
                label: v.id.to_string(),
                rps: of(&|r| r.wrk.rps),
                p50: of(&|r| r.wrk.p50_ms),
                p99: of(&|r| r.wrk.p99_ms),
                cpu: of(&|r| r.envoy_cpu_us),
                color: color_of(v.id),
            })
        })
        .collect()
}

/// Writes the chart to `path`.
pub fn write(path: &Path, s: &Session) -> Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    draw(path, s).map_err(|e| anyhow!("drawing {}: {e}", path.display()))
}

type Chart<'a, 'b> = ChartContext<
    'a,
    SVGBackend<'b>,
    Cartesian2d<plotters::coord::ranged1d::SegmentedCoord<RangedCoordusize>, RangedCoordf64>,
>;

fn centered(size: u32) -> TextStyle<'static> {
    TextStyle::from(("sans-serif", size).into_font()).pos(Pos::new(HPos::Center, VPos::Bottom))
}

/// How to draw a series of bars.
struct BarStyle {
    /// Left and right margins of each bar inside its segment, in pixels.
    margins: (u32, u32),
    /// Decimals of the value written above each bar.
    decimals: usize,
    /// Horizontal offset of that value from the segment's centre, in pixels.
    label_dx: i32,
    /// Draw min–max whiskers (at the segment's centre).
    whiskers: bool,
}

/// Bars of `values` (mean), optionally with min–max whiskers, and the mean
/// written above each bar.
fn bar_series(
    chart: &mut Chart<'_, '_>,
    values: &[(usize, Spread, RGBColor)],
    style: &BarStyle,
) -> Result<(), Box<dyn std::error::Error>> {
    chart.draw_series(values.iter().map(|(i, v, c)| {
        let mut bar = Rectangle::new(
            [
                (SegmentValue::Exact(*i), 0.0),
                (SegmentValue::Exact(*i + 1), v.mean),
            ],
            c.filled(),
        );
        bar.set_margin(0, 0, style.margins.0, style.margins.1);
        bar
    }))?;
    if style.whiskers {
        chart.draw_series(values.iter().map(|(i, v, _)| {
            PathElement::new(
                vec![
                    (SegmentValue::CenterOf(*i), v.min),
                    (SegmentValue::CenterOf(*i), v.max),
                ],
                BLACK.stroke_width(2),
            )
        }))?;
    }
    let font = if style.decimals == 0 { 12 } else { 10 };
    chart.draw_series(values.iter().map(|(i, v, _)| {
        let top = if style.whiskers {
            v.max.max(v.mean)
        } else {
            v.mean
        };
        EmptyElement::at((SegmentValue::CenterOf(*i), top))
            + Text::new(
                group(v.mean, style.decimals),
                (style.label_dx, -2),
                centered(font),
            )
    }))?;
    Ok(())
}

/// One panel of bars per variant with min–max whiskers: `value` of each bar,
/// the y axis up to `headroom` × the largest maximum.
fn whisker_panel(
    area: &DrawingArea<SVGBackend, plotters::coord::Shift>,
    bars: &[Bar],
    label_of: &dyn Fn(&SegmentValue<usize>) -> String,
    caption: &str,
    y_desc: &str,
    value: fn(&Bar) -> Spread,
    headroom: f64,
) -> Result<(), Box<dyn std::error::Error>> {
    let n = bars.len().max(1);
    let y_max = bars.iter().map(|b| value(b).max).fold(1.0, f64::max) * headroom;
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 15))
        .margin(12)
        .x_label_area_size(30)
        .y_label_area_size(70)
        .build_cartesian_2d((0..n - 1).into_segmented(), 0f64..y_max)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .light_line_style(TRANSPARENT)
        .x_labels(n)
        .x_label_formatter(label_of)
        .x_label_style(("sans-serif", 14))
        .y_desc(y_desc)
        .y_label_formatter(&|y| group(*y, 0))
        .draw()?;
    let values: Vec<(usize, Spread, RGBColor)> = bars
        .iter()
        .enumerate()
        .map(|(i, b)| (i, value(b), b.color))
        .collect();
    bar_series(
        &mut chart,
        &values,
        &BarStyle {
            margins: (14, 14),
            decimals: 0,
            label_dx: 0,
            whiskers: true,
        },
    )
}

fn draw(path: &Path, s: &Session) -> Result<(), Box<dyn std::error::Error>> {
    let bars = bars(s);
    let n = bars.len().max(1);
    let root = SVGBackend::new(path, (1100, 1040)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(
        &format!(
            "ratelimit-wasm: Envoy 1.40, --concurrency 2, wrk {} connections ({} round{} × {} s, {})",
            s.args.connections,
            s.args.repeats,
            if s.args.repeats == 1 { "" } else { "s" },
            s.args.seconds,
            s.started_utc
        ),
        ("sans-serif", 18),
    )?;
    let (top, rest) = root.split_vertically(380);
    let (middle, bottom) = rest.split_vertically(300);
    let (left, right) = bottom.split_horizontally(730);
    let labels: Vec<String> = bars.iter().map(|b| b.label.clone()).collect();
    let label_of = |x: &SegmentValue<usize>| match x {
        SegmentValue::CenterOf(i) => labels.get(*i).cloned().unwrap_or_default(),
        _ => String::new(),
    };

    whisker_panel(
        &top,
        &bars,
        &label_of,
        "requests/s (bar: mean; whisker: min–max over the rounds)",
        "requests/s",
        |b| b.rps,
        1.15,
    )?;
    whisker_panel(
        &middle,
        &bars,
        &label_of,
        "measured Envoy's CPU time per request, µs (user + system, all threads; whisker: min–max)",
        "µs",
        |b| b.cpu,
        1.2,
    )?;

    // Latency: p50 (light) and p99 (dark) side by side.
    let y_max = bars.iter().map(|b| b.p99.max).fold(0.1, f64::max) * 1.2;
    let mut chart = ChartBuilder::on(&left)
        .caption(
            "latency, ms (left bar: p50, right bar: p99; means over the rounds)",
            ("sans-serif", 15),
        )
        .margin(12)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d((0..n - 1).into_segmented(), 0f64..y_max)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .light_line_style(TRANSPARENT)
        .x_labels(n)
        .x_label_formatter(&label_of)
        .x_label_style(("sans-serif", 13))
        .y_desc("ms")
        .draw()?;
    let p50: Vec<(usize, Spread, RGBColor)> = bars
        .iter()
        .enumerate()
        .map(|(i, b)| (i, b.p50, lighter(b.color)))
        .collect();
    let p99: Vec<(usize, Spread, RGBColor)> = bars
        .iter()
        .enumerate()
        .map(|(i, b)| (i, b.p99, b.color))
        .collect();
    // Each segment is about 640 / n pixels wide: p50 on its left half, p99
    // on its right half (no whiskers: the table has the spread).
    let seg = 640 / n as u32;
    let quarter = i32::try_from(seg / 4).unwrap_or(0);
    bar_series(
        &mut chart,
        &p50,
        &BarStyle {
            margins: (4, seg / 2 + 1),
            decimals: 2,
            label_dx: -quarter,
            whiskers: false,
        },
    )?;
    bar_series(
        &mut chart,
        &p99,
        &BarStyle {
            margins: (seg / 2 + 1, 4),
            decimals: 2,
            label_dx: quarter,
            whiskers: false,
        },
    )?;

    // The gateway against raw EVALSHA.
    if !s.gateway_runs.is_empty() {
        let gw = Spread::of(
            &s.gateway_runs
                .iter()
                .map(|g| g.gateway.rps)
                .collect::<Vec<_>>(),
        );
        let raw = Spread::of(
            &s.gateway_runs
                .iter()
                .map(|g| g.redis.rps)
                .collect::<Vec<_>>(),
        );
        let y_max = gw.max.max(raw.max).max(1.0) * 1.2;
        let names = ["gateway", "EVALSHA"];
        let mut chart = ChartBuilder::on(&right)
            .caption("checks/s: gateway vs raw EVALSHA", ("sans-serif", 15))
            .margin(12)
            .x_label_area_size(30)
            .y_label_area_size(70)
            .build_cartesian_2d((0..1usize).into_segmented(), 0f64..y_max)?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .light_line_style(TRANSPARENT)
            .x_labels(2)
            .x_label_formatter(&|x| match x {
                SegmentValue::CenterOf(i) => names.get(*i).copied().unwrap_or("").to_string(),
                _ => String::new(),
            })
            .x_label_style(("sans-serif", 13))
            .y_label_formatter(&|y| group(*y, 0))
            .draw()?;
        bar_series(
            &mut chart,
            &[
                (0, gw, RGBColor(120, 80, 170)),
                (1, raw, RGBColor(200, 60, 60)),
            ],
            &BarStyle {
                margins: (25, 25),
                decimals: 0,
                label_dx: 0,
                whiskers: true,
            },
        )?;
    }
    root.present()?;
    Ok(())
}

fn lighter(c: RGBColor) -> RGBColor {
    let mix = |x: u8| (u16::from(x) + 2 * 255).div_euclid(3) as u8;
    RGBColor(mix(c.0), mix(c.1), mix(c.2))
}
