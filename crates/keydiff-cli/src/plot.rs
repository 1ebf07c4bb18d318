//! SVG figures drawn with plotters: TTFT by chunk size (the KeyDiff paper's latency figure).

use std::path::Path;

use anyhow::{anyhow, Result};
use keydiff::bench::{Provenance, TtftResult};
use plotters::prelude::*;

/// A fixed colour per policy, so that figures agree with each other.
pub fn policy_color(policy: &str, fallback: usize) -> RGBColor {
    match policy {
        "full" => RGBColor(0, 0, 0),
        "keydiff" => RGBColor(214, 39, 40),
        "tova" => RGBColor(31, 119, 180),
        "snapkv" => RGBColor(44, 160, 44),
        "h2o" => RGBColor(255, 127, 14),
        "sink" => RGBColor(148, 103, 189),
        _ => {
            let c = Palette99::pick(fallback + 7).to_rgba();
            RGBColor(c.0, c.1, c.2)
        }
    }
}

fn err(e: impl std::fmt::Display) -> anyhow::Error {
    anyhow!("cannot draw figure: {e}")
}

/// TTFT (median, with min–max bars) against chunk size B, one series per policy, one panel per
/// prompt length and budget (`full` appears in every panel of its prompt length).
pub fn ttft_svg(path: &Path, results: &[TtftResult], prov: &Provenance) -> Result<()> {
    let mut panels: Vec<(usize, Option<usize>)> = Vec::new();
    for r in results {
        let key = (r.prompt_len, r.budget);
        if r.budget.is_some() && !panels.contains(&key) {
            panels.push(key);
        }
    }
    if panels.is_empty() {
        // Only `full` was measured.
        for r in results {
            if !panels.contains(&(r.prompt_len, None)) {
                panels.push((r.prompt_len, None));
            }
        }
    }
    let cols = panels.len().min(3);
    let rows = panels.len().div_ceil(cols);
    let (w, h) = ((560 * cols as u32).max(900), 420 * rows as u32 + 40);
    let root = SVGBackend::new(path, (w, h)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let title = format!(
        "TTFT by chunk size: {} on {} {} (commit {})",
        prov.model,
        prov.device,
        prov.dtype,
        prov.code()
    );
    let root = root
        .titled(&title, ("sans-serif", 18).into_font())
        .map_err(err)?;
    let areas = root.split_evenly((rows, cols));
    let mut policies: Vec<String> = Vec::new();
    for r in results {
        if !policies.contains(&r.policy) {
            policies.push(r.policy.clone());
        }
    }
    for (area, &(len, budget)) in areas.iter().zip(&panels) {
        let in_panel =
            |r: &&TtftResult| r.prompt_len == len && (r.budget == budget || r.budget.is_none());
        let rs: Vec<&TtftResult> = results.iter().filter(in_panel).collect();
        let lg = |b: usize| (b as f64).log2();
        let xmin = rs.iter().map(|r| lg(r.chunk)).fold(f64::INFINITY, f64::min);
        let xmax = rs
            .iter()
            .map(|r| lg(r.chunk))
            .fold(f64::NEG_INFINITY, f64::max);
        let ymax = rs.iter().map(|r| r.ttft.max).fold(0.0, f64::max) * 1.15;
        let caption = match budget {
            Some(n) => format!("prompt {len} tokens, budget N = {n}"),
            None => format!("prompt {len} tokens"),
        };
        let mut chart = ChartBuilder::on(area)
            .caption(caption, ("sans-serif", 15))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(55)
            .build_cartesian_2d((xmin - 0.4)..(xmax + 0.4), 0.0..ymax.max(1e-6))
            .map_err(err)?;
        chart
            .configure_mesh()
            .light_line_style(TRANSPARENT)
            .x_desc("chunk size B")
            .y_desc("TTFT (s)")
            .x_labels(((xmax - xmin) * 4.0) as usize + 4)
            .x_label_formatter(&|x| {
                if (x - x.round()).abs() < 1e-6 {
                    format!("{}", 2f64.powf(x.round()) as usize)
                } else {
                    String::new()
                }
            })
            .draw()
            .map_err(err)?;
        for (i, p) in policies.iter().enumerate() {
            let mut pts: Vec<&TtftResult> = rs.iter().copied().filter(|r| &r.policy == p).collect();
            if pts.is_empty() {
                continue;
            }
            pts.sort_by_key(|r| r.chunk);
            let color = policy_color(p, i);
            let line: Vec<(f64, f64)> = pts.iter().map(|r| (lg(r.chunk), r.ttft.median)).collect();
            chart
                .draw_series(LineSeries::new(line.clone(), color.stroke_width(2)))
                .map_err(err)?
                .label(p.as_str())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
                });
            chart
                .draw_series(line.iter().map(|&pt| Circle::new(pt, 3, color.filled())))
                .map_err(err)?;
            chart
                .draw_series(pts.iter().map(|r| {
                    ErrorBar::new_vertical(
                        lg(r.chunk),
                        r.ttft.min,
                        r.ttft.median,
                        r.ttft.max,
                        color.stroke_width(1),
                        6,
                    )
                }))
                .map_err(err)?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(err)?;
    }
    root.present().map_err(err)?;
    Ok(())
}

/// One accuracy value for the heatmap: panel (policy, budget), length, depth.
pub struct HeatCell {
    pub policy: String,
    pub budget: String,
    pub length: usize,
    pub depth: f64,
    pub mean: f64,
}

/// Needle-in-a-haystack heatmaps: context length × needle depth, accuracy as colour (red 0 %,
/// green 100 %), one panel per policy and budget; `full` first.
pub fn heatmap_svg(path: &Path, cells: &[HeatCell], title: &str) -> Result<()> {
    let mut panels: Vec<(String, String)> = Vec::new();
    let mut lengths: Vec<usize> = Vec::new();
    let mut depths: Vec<f64> = Vec::new();
    for c in cells {
        let p = (c.policy.clone(), c.budget.clone());
        if !panels.contains(&p) {
            panels.push(p);
        }
        if !lengths.contains(&c.length) {
            lengths.push(c.length);
        }
        if !depths.iter().any(|d| (d - c.depth).abs() < 1e-9) {
            depths.push(c.depth);
        }
    }
    if panels.is_empty() {
        return Err(anyhow!("no cells to draw"));
    }
    panels.sort_by_key(|(p, _)| p != "full");
    lengths.sort_unstable();
    depths.sort_by(f64::total_cmp);
    let policies = panels
        .iter()
        .filter(|(p, _)| p != "full")
        .map(|(p, _)| p.clone())
        .fold(Vec::<String>::new(), |mut v, p| {
            if !v.contains(&p) {
                v.push(p);
            }
            v
        });
    let cols = policies.len().clamp(1, 6);
    let rows = panels.len().div_ceil(cols);
    let (w, h) = ((300 * cols as u32).max(900), 280 * rows as u32 + 40);
    let root = SVGBackend::new(path, (w, h)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let root = root
        .titled(title, ("sans-serif", 16).into_font())
        .map_err(err)?;
    let areas = root.split_evenly((rows, cols));
    let (nl, nd) = (lengths.len() as f64, depths.len() as f64);
    for (area, (policy, budget)) in areas.iter().zip(&panels) {
        let caption = if budget == "-" {
            policy.clone()
        } else {
            format!("{policy}, N = {budget}")
        };
        let mut chart = ChartBuilder::on(area)
            .caption(caption, ("sans-serif", 14))
            .margin(8)
            .x_label_area_size(30)
            .y_label_area_size(40)
            .build_cartesian_2d(0.0..nl, 0.0..nd)
            .map_err(err)?;
        let ls = lengths.clone();
        let ds = depths.clone();
        chart
            .configure_mesh()
            .disable_mesh()
            .x_labels(lengths.len() * 2 + 1)
            .y_labels(depths.len() * 2 + 1)
            .x_label_formatter(&move |x| label_at(*x, &ls, |l| format!("{l}")))
            .y_label_formatter(&move |y| label_at(*y, &ds, |d| format!("{d:.2}")))
            .x_desc("length")
            .y_desc("depth")
            .draw()
            .map_err(err)?;
        for c in cells
            .iter()
            .filter(|c| &c.policy == policy && &c.budget == budget)
        {
            let x = lengths.iter().position(|&l| l == c.length).unwrap_or(0) as f64;
            let y = depths
                .iter()
                .position(|d| (d - c.depth).abs() < 1e-9)
                .unwrap_or(0) as f64;
            let color = HSLColor(c.mean.clamp(0.0, 1.0) / 3.0, 0.65, 0.55);
            chart
                .draw_series(std::iter::once(Rectangle::new(
                    [(x, y), (x + 1.0, y + 1.0)],
                    color.filled(),
                )))
                .map_err(err)?;
            chart
                .draw_series(std::iter::once(Text::new(
                    format!("{:.0}", 100.0 * c.mean),
                    (x + 0.35, y + 0.6),
                    ("sans-serif", 12).into_font(),
                )))
                .map_err(err)?;
        }
    }
    root.present().map_err(err)?;
    Ok(())
}

/// The label of the category whose cell centre is at `x` (cells are [i, i+1)), else empty.
fn label_at<T: Copy>(x: f64, cats: &[T], f: impl Fn(T) -> String) -> String {
    let i = x - 0.5;
    if (i - i.round()).abs() < 1e-6 && i >= 0.0 && (i.round() as usize) < cats.len() {
        f(cats[i.round() as usize])
    } else {
        String::new()
    }
}
