//! How the numeric paths of a model's projections are shown: JSON for `bench` and `--output-format
//! json`, a short summary for the stats line.

use dflash_models::ProjectionPath;
use serde_json::{json, Value};

/// One object per projection: model, name, shape (N x K), format, activations, kernel, and
/// the int8 family that screens its greedy products (null when none does).
pub fn paths_json(paths: &[ProjectionPath]) -> Value {
    json!(paths
        .iter()
        .map(|p| json!({
            "model": p.model,
            "projection": p.name,
            "rows": p.rows,
            "cols": p.cols,
            "format": p.path.format.to_string(),
            "activations": p.path.activations.to_string(),
            "kernel": p.path.kernel,
            "greedy_screen": p.path.greedy_screen,
        }))
        .collect::<Vec<_>>())
}

/// `target layers Q4_1 x int8 (avx512-vnni); target lm_head Q8_0 x f32 (avx512); ...`:
/// per model, the layer projections grouped by path, then the head.
pub fn paths_summary(paths: &[ProjectionPath]) -> String {
    let mut groups: Vec<(String, Vec<&str>)> = Vec::new();
    for p in paths {
        let key = format!("{} {}", p.model, p.path);
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, names)) => names.push(p.name),
            None => groups.push((key, vec![p.name])),
        }
    }
    groups
        .iter()
        .map(|(key, names)| {
            let (model, path) = key.split_once(' ').unwrap_or((key, ""));
            format!("{model} {} {path}", names.join("/"))
        })
        .collect::<Vec<_>>()
        .join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use dflash_runtime::{Activations, DType, WeightPath};

    fn p(model: &'static str, name: &'static str, f: DType, a: Activations) -> ProjectionPath {
        ProjectionPath {
            model,
            name,
            rows: 8,
            cols: 32,
            path: WeightPath {
                format: f,
                activations: a,
                kernel: "k".into(),
                greedy_screen: (name == "lm_head").then(|| "s".into()),
            },
        }
    }

    #[test]
    fn the_summary_groups_projections_by_path() {
        let paths = [
            p("target", "q", DType::Q4_1, Activations::Int8),
            p("target", "k", DType::Q4_1, Activations::Int8),
            p("target", "lm_head", DType::Q8_0, Activations::F32),
            p("draft", "fc", DType::BF16, Activations::F32),
        ];
        assert_eq!(
            paths_summary(&paths),
            "target q/k Q4_1 x int8 (k); target lm_head Q8_0 x f32 (k; greedy rows screened by s); \
             draft fc bf16 x f32 (k)"
        );
        let j = paths_json(&paths);
        assert_eq!(j[2]["activations"], "f32");
        assert_eq!(j[0]["format"], "Q4_1");
        assert_eq!(j[2]["greedy_screen"], "s");
        assert!(j[0]["greedy_screen"].is_null());
    }
}
