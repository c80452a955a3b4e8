//! Means and spreads over repeats.

use serde_json::{json, Value};

/// Mean, sample standard deviation, minimum and maximum of some repeats.
#[derive(Debug, Clone, Copy, Default)]
pub struct Spread {
    pub n: usize,
    pub mean: f64,
    pub sd: f64,
    pub min: f64,
    pub max: f64,
}

impl Spread {
    pub fn of(xs: &[f64]) -> Spread {
        let xs: Vec<f64> = xs.iter().copied().filter(|x| x.is_finite()).collect();
        if xs.is_empty() {
            return Spread {
                n: 0,
                mean: f64::NAN,
                sd: f64::NAN,
                min: f64::NAN,
                max: f64::NAN,
            };
        }
        let n = xs.len();
        let mean = xs.iter().sum::<f64>() / n as f64;
        let sd = if n > 1 {
            (xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64).sqrt()
        } else {
            0.0
        };
        Spread {
            n,
            mean,
            sd,
            min: xs.iter().copied().fold(f64::INFINITY, f64::min),
            max: xs.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        }
    }

    pub fn to_json(self) -> Value {
        json!({ "n": self.n, "mean": self.mean, "sd": self.sd, "min": self.min, "max": self.max })
    }

    /// `mean ± sd` with `decimals` decimals.
    pub fn show(self, decimals: usize) -> String {
        if self.n == 0 {
            return "–".to_string();
        }
        format!(
            "{} ± {}",
            group(self.mean, decimals),
            group(self.sd, decimals)
        )
    }
}

/// `x` with `decimals` decimals and thin-space thousands separators.
pub fn group(x: f64, decimals: usize) -> String {
    if !x.is_finite() {
        return "–".to_string();
    }
    let s = format!("{:.*}", decimals, x.abs());
    let (int, frac) = match s.split_once('.') {
        Some((i, f)) => (i.to_string(), Some(f.to_string())),
        None => (s.clone(), None),
    };
    let mut out = String::new();
    for (k, ch) in int.chars().enumerate() {
        if k > 0 && (int.len() - k) % 3 == 0 {
            out.push('\u{202f}');
        }
        out.push(ch);
    }
    if let Some(f) = frac {
        out.push('.');
        out.push_str(&f);
    }
    if x < 0.0 && x.abs() >= 0.5 * 10f64.powi(-(decimals as i32)) {
        out.insert(0, '−');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spreads() {
        let s = Spread::of(&[1.0, 2.0, 3.0]);
        assert_eq!(s.n, 3);
        assert!((s.mean - 2.0).abs() < 1e-12);
        assert!((s.sd - 1.0).abs() < 1e-12);
        assert_eq!((s.min, s.max), (1.0, 3.0));
        assert_eq!(Spread::of(&[]).n, 0);
    }

    #[test]
    fn groups_thousands() {
        assert_eq!(group(12345.678, 0), "12\u{202f}346");
        assert_eq!(group(999.0, 1), "999.0");
        assert_eq!(group(1234567.0, 2), "1\u{202f}234\u{202f}567.00");
        assert_eq!(group(-1500.0, 0), "−1\u{202f}500");
    }
}
