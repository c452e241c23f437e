//! Line charts as SVG, drawn with plotters: the bench's memory and time charts, and the metrics of a
//! training run (`<output-dir>/plots/metrics.svg`, one panel per metric against the step).

use std::path::Path;

use plotters::coord::ranged1d::ValueFormatter;
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;

use crate::{Result, TrainError};

/// One line of a chart.
#[derive(Debug, Clone)]
pub struct Series {
    /// The legend's text.
    pub label: String,
    /// `(x, y)` in drawing order; non-finite points are left out.
    pub points: Vec<(f64, f64)>,
}

/// One chart: a title, axis labels and its lines.
#[derive(Debug, Clone)]
pub struct Chart {
    /// Shown above the panel.
    pub title: String,
    /// The horizontal axis's description.
    pub x_label: String,
    /// The vertical axis's description.
    pub y_label: String,
    /// The lines, each in its own colour.
    pub series: Vec<Series>,
    /// A logarithmic vertical axis (for values spanning orders of magnitude, as memory against T
    /// across modes); points at or below 0 are then left out.
    pub log_y: bool,
}

/// Draws `charts` into the SVG file `path`, in a grid of `columns` panels of 640 × 400 points.
pub fn draw(path: &Path, charts: &[Chart], columns: usize) -> Result<()> {
    let failed = |e: String| TrainError::Io {
        action: "draw",
        path: path.to_path_buf(),
        error: std::io::Error::other(e),
    };
    let columns = columns.clamp(1, charts.len().max(1));
    let rows = charts.len().div_ceil(columns).max(1);
    let size = (640 * columns as u32, 400 * rows as u32);
    let root = SVGBackend::new(path, size).into_drawing_area();
    root.fill(&WHITE).map_err(|e| failed(e.to_string()))?;
    for (chart, area) in charts.iter().zip(root.split_evenly((rows, columns))) {
        draw_one(&area, chart).map_err(failed)?;
    }
    root.present().map_err(|e| failed(e.to_string()))
}

fn draw_one<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    chart: &Chart,
) -> std::result::Result<(), String> {
    let points = chart.series.iter().flat_map(|s| s.points.iter());
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in points.filter(|(x, y)| x.is_finite() && y.is_finite()) {
        (x0, x1, y0, y1) = (x0.min(x), x1.max(x), y0.min(y), y1.max(y));
    }
    if x0 > x1 {
        (x0, x1, y0, y1) = (0.0, 1.0, 0.0, 1.0);
    }
    let x1 = if x1 > x0 { x1 } else { x0 + 1.0 };
    let mut builder = ChartBuilder::on(area);
    builder
        .caption(&chart.title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70);
    if chart.log_y {
        // From the smallest positive value to the largest, a margin of a fifth of a decade each way.
        let positive = chart.series.iter().flat_map(|s| s.points.iter());
        let (low, high) = positive
            .filter(|(_, y)| y.is_finite() && *y > 0.0)
            .fold((f64::MAX, f64::MIN), |(l, h), &(_, y)| (l.min(y), h.max(y)));
        let (low, high) = match low <= high {
            true => (low / 1.6, high * 1.6),
            false => (1.0, 10.0),
        };
        let ctx = builder
            .build_cartesian_2d(x0.min(0.0)..x1, (low..high).log_scale())
            .map_err(|e| e.to_string())?;
        return fill(ctx, chart, |y| y > 0.0);
    }
    // Axes from zero where the data is positive (memory, time), a margin otherwise.
    let y0 = if y0 >= 0.0 {
        0.0
    } else {
        y0 - 0.05 * (y1 - y0).abs()
    };
    // A flat series (one evaluation, or all zero) still gets an axis with readable ticks.
    let y1 = match y1 - y0 > 1e-9 {
        true => y1 + 0.05 * (y1 - y0),
        false => y0 + 1.0,
    };
    let ctx = builder
        .build_cartesian_2d(x0.min(0.0)..x1, y0..y1)
        .map_err(|e| e.to_string())?;
    fill(ctx, chart, |_| true)
}

/// Draws `chart`'s mesh, lines (the points whose value `shown` keeps) and legend into `ctx`.
fn fill<'a, DB, Y>(
    mut ctx: ChartContext<'a, DB, Cartesian2d<RangedCoordf64, Y>>,
    chart: &Chart,
    shown: impl Fn(f64) -> bool + Copy,
) -> std::result::Result<(), String>
where
    DB: DrawingBackend + 'a,
    Y: Ranged<ValueType = f64> + ValueFormatter<f64>,
{
    // Whole numbers (steps) without a decimal point.
    let x_text = |x: &f64| match x.fract() == 0.0 {
        true => format!("{x:.0}"),
        false => format!("{x}"),
    };
    ctx.configure_mesh()
        .x_label_formatter(&x_text)
        .x_desc(chart.x_label.as_str())
        .y_desc(chart.y_label.as_str())
        .draw()
        .map_err(|e| e.to_string())?;
    for (i, s) in chart.series.iter().enumerate() {
        let (r, g, b) = COLOURS[i % COLOURS.len()];
        let colour = RGBColor(r, g, b);
        let line = s
            .points
            .iter()
            .copied()
            .filter(move |(x, y)| x.is_finite() && y.is_finite() && shown(*y));
        ctx.draw_series(LineSeries::new(line.clone(), colour.stroke_width(2)))
            .map_err(|e| e.to_string())?
            .label(s.label.as_str())
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], colour.stroke_width(2)));
        // Markers show where sparse points (evaluations) are; on a dense line they hide the curve.
        if s.points.len() <= MAX_MARKED_POINTS {
            ctx.draw_series(line.map(|p| Circle::new(p, 3, colour.filled())))
                .map_err(|e| e.to_string())?;
        }
    }
    if chart.series.len() > 1 {
        ctx.configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// The most points a series is drawn with markers on.
const MAX_MARKED_POINTS: usize = 50;

/// Line colours, in order (matplotlib's first five: readable on white and told apart).
const COLOURS: [(u8, u8, u8); 5] = [
    (31, 119, 180),
    (255, 127, 14),
    (44, 160, 44),
    (214, 39, 40),
    (148, 103, 189),
];

/// Columns of metrics.jsonl that are bookkeeping rather than something to watch.
const NOT_PLOTTED: [&str; 3] = ["step", "epoch", "seconds"];

/// Plots every numeric metric of a run's `metrics.jsonl` against the step into `dir/metrics.svg`
/// (loss first, then by name; peak memory in MiB).
pub fn plot_metrics(metrics_jsonl: &Path, dir: &Path) -> Result<()> {
    let text =
        std::fs::read_to_string(metrics_jsonl).map_err(TrainError::io("read", metrics_jsonl))?;
    let mut panels: Vec<Series> = Vec::new();
    for line in text.lines() {
        let Ok(serde_json::Value::Object(row)) = serde_json::from_str(line) else {
            continue;
        };
        let Some(step) = row.get("step").and_then(|s| s.as_f64()) else {
            continue;
        };
        for (name, value) in &row {
            let Some(mut v) = value.as_f64() else {
                continue;
            };
            if NOT_PLOTTED.contains(&name.as_str()) {
                continue;
            }
            let label = match name.as_str() {
                "peak_bytes" => {
                    v /= (1u64 << 20) as f64;
                    "peak MiB".to_string()
                }
                other => other.to_string(),
            };
            match panels.iter_mut().find(|p| p.label == label) {
                Some(p) => p.points.push((step, v)),
                None => panels.push(Series {
                    label,
                    points: vec![(step, v)],
                }),
            }
        }
    }
    panels.sort_by_key(|p| p.label != "loss");
    let charts: Vec<Chart> = panels
        .into_iter()
        .map(|s| Chart {
            title: s.label.clone(),
            x_label: "step".into(),
            y_label: s.label.clone(),
            series: vec![s],
            log_y: false,
        })
        .collect();
    if charts.is_empty() {
        return Ok(());
    }
    std::fs::create_dir_all(dir).map_err(TrainError::io("create", dir))?;
    draw(&dir.join("metrics.svg"), &charts, 3)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A dense loss line is drawn without markers, the two evaluations with theirs; step ticks are
    /// whole numbers; a flat panel (accuracy 0 throughout) still has distinct ticks.
    #[test]
    fn dense_lines_unmarked_sparse_points_marked_steps_whole() {
        let dir = tempfile::tempdir().unwrap();
        let mut rows: Vec<String> = (1..=600)
            .map(|s| format!("{{\"step\": {s}, \"loss\": {}}}", 1.0 / s as f64))
            .collect();
        rows.push("{\"step\": 0, \"eval_accuracy\": 0.0, \"flat\": 0.0}".into());
        rows.push("{\"step\": 600, \"eval_accuracy\": 0.9, \"flat\": 0.0}".into());
        let metrics = dir.path().join("metrics.jsonl");
        std::fs::write(&metrics, rows.join("\n")).unwrap();
        plot_metrics(&metrics, dir.path()).unwrap();
        let svg = std::fs::read_to_string(dir.path().join("metrics.svg")).unwrap();
        // Two evaluations, and the flat panel's two points: four markers, none on the loss.
        assert_eq!(svg.matches("<circle").count(), 4);
        // plotters writes each label on a line of its own.
        assert!(!svg.contains("\n200.0\n") && svg.contains("\n200\n"));
        let flat = &svg[svg.rfind("\nflat\n").unwrap()..];
        assert!(flat.contains("\n0.5\n"), "the flat panel spans 0..1");
    }

    /// A logarithmic axis spans lines orders of magnitude apart, leaving out what it cannot show.
    #[test]
    fn a_log_axis_spans_orders_of_magnitude() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log.svg");
        let line = |label: &str, ys: [f64; 3]| Series {
            label: label.into(),
            points: [1024.0, 2048.0, 4096.0].into_iter().zip(ys).collect(),
        };
        let chart = Chart {
            title: "memory".into(),
            x_label: "T".into(),
            y_label: "MiB".into(),
            series: vec![
                line("small", [40.0, 45.0, 0.0]),
                line("large", [700.0, 1500.0, 3000.0]),
            ],
            log_y: true,
        };
        draw(&path, &[chart], 1).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        // Decade ticks between the smallest and largest value, and five markers: the 0 is left out.
        assert!(
            svg.contains("\n100\n") || svg.contains("\n100.0\n"),
            "{svg}"
        );
        assert_eq!(svg.matches("<circle").count(), 5);
    }
}
