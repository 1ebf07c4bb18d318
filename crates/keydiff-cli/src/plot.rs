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
    let (w, h) = (560 * cols as u32, 420 * rows as u32 + 40);
    let root = SVGBackend::new(path, (w, h)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let title = format!(
        "TTFT by chunk size: {} on {} {} (commit {})",
        prov.model, prov.device, prov.dtype, prov.commit
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
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(err)?;
    }
    root.present().map_err(err)?;
    Ok(())
}
