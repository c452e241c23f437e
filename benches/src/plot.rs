//! Line charts as plain SVG: peak memory vs T and time vs T, one line per mode. A few dozen lines of
//! SVG keep the bench free of a plotting dependency.

use std::fmt::Write;

/// One line of a chart: its label, colour and `(x, y)` points.
pub struct Series<'a> {
    pub label: &'a str,
    pub colour: &'a str,
    pub points: Vec<(f64, f64)>,
}

/// An SVG line chart with linear axes starting at zero.
pub fn line_chart(title: &str, x_label: &str, y_label: &str, series: &[Series]) -> String {
    let (w, h, left, bottom, top, right) = (640.0, 400.0, 70.0, 50.0, 40.0, 150.0);
    let all = series.iter().flat_map(|s| s.points.iter());
    let x_max = all.clone().map(|p| p.0).fold(1e-9, f64::max);
    let y_max = all.map(|p| p.1).fold(1e-9, f64::max) * 1.05;
    let px = |x: f64| left + x / x_max * (w - left - right);
    let py = |y: f64| h - bottom - y / y_max * (h - bottom - top);
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{}\" y=\"22\" text-anchor=\"middle\" font-size=\"15\">{title}</text>\n",
        (w - right + left) / 2.0
    );
    // Axes and ticks.
    let (x0, y0, x1, y1) = (px(0.0), py(0.0), px(x_max), py(y_max));
    let _ = writeln!(
        svg,
        "<line x1=\"{x0}\" y1=\"{y0}\" x2=\"{x1}\" y2=\"{y0}\" stroke=\"black\"/>"
    );
    let _ = writeln!(
        svg,
        "<line x1=\"{x0}\" y1=\"{y0}\" x2=\"{x0}\" y2=\"{y1}\" stroke=\"black\"/>"
    );
    for i in 0..=4 {
        let (xv, yv) = (x_max * i as f64 / 4.0, y_max * i as f64 / 4.0);
        let _ = writeln!(
            svg,
            "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{xv:.0}</text>\n<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{}</text>\n<line x1=\"{x0}\" y1=\"{}\" x2=\"{x1}\" y2=\"{}\" stroke=\"#ddd\"/>",
            px(xv),
            y0 + 18.0,
            x0 - 6.0,
            py(yv) + 4.0,
            if y_max >= 10.0 { format!("{yv:.0}") } else { format!("{yv:.2}") },
            py(yv),
            py(yv)
        );
    }
    let _ = writeln!(
        svg,
        "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{x_label}</text>\n<text x=\"16\" y=\"{}\" text-anchor=\"middle\" transform=\"rotate(-90 16 {})\">{y_label}</text>",
        (x0 + x1) / 2.0,
        h - 12.0,
        (y0 + y1) / 2.0,
        (y0 + y1) / 2.0
    );
    // Lines, markers and legend.
    for (i, s) in series.iter().enumerate() {
        let path: Vec<String> = s
            .points
            .iter()
            .map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y)))
            .collect();
        let _ = writeln!(
            svg,
            "<polyline fill=\"none\" stroke=\"{}\" stroke-width=\"2\" points=\"{}\"/>",
            s.colour,
            path.join(" ")
        );
        for &(x, y) in &s.points {
            let _ = writeln!(
                svg,
                "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"3\" fill=\"{}\"/>",
                px(x),
                py(y),
                s.colour
            );
        }
        let ly = top + 20.0 * i as f64;
        let _ = writeln!(
            svg,
            "<line x1=\"{}\" y1=\"{ly}\" x2=\"{}\" y2=\"{ly}\" stroke=\"{}\" stroke-width=\"2\"/><text x=\"{}\" y=\"{}\">{}</text>",
            w - right + 15.0,
            w - right + 40.0,
            s.colour,
            w - right + 46.0,
            ly + 4.0,
            s.label
        );
    }
    svg.push_str("</svg>\n");
    svg
}
