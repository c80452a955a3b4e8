//! Logging what callers send: every caller-supplied value is written
//! [`Escaped`], and the warnings callers can cause at will (400s, and the
//! 503s every request gets while Redis fails) go through [`Warnings`], at
//! most [`WARNINGS_PER_SECOND`] per kind per [`WARNING_WINDOW`].

use std::collections::HashMap;
use std::fmt::{self, Display, Write as _};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use prometheus::IntCounterVec;

/// Most warnings of one kind written per [`WARNING_WINDOW`]; the others are
/// counted, and the next warning written says how many were left out.
pub const WARNINGS_PER_SECOND: u64 = 10;
/// The fixed window of [`WARNINGS_PER_SECOND`].
pub const WARNING_WINDOW: Duration = Duration::from_secs(1);

/// A value written between double quotes with `char::escape_debug`: a
/// caller's newline, CR, ANSI escape or quote comes out as `\n`, `\r`,
/// `\u{1b}`, `\"`, so it can neither end the log line nor forge another
/// field or line.
pub struct Escaped<T>(pub T);

impl<T: Display> Display for Escaped<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_char('"')?;
        // Escapes as the value is formatted, without a copy of it.
        write!(EscapeWriter(f), "{}", self.0)?;
        f.write_char('"')
    }
}

struct EscapeWriter<'a, 'b>(&'a mut fmt::Formatter<'b>);

impl fmt::Write for EscapeWriter<'_, '_> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        for c in s.chars() {
            // A single quote cannot end the double-quoted value: kept as is.
            if c == '\'' {
                self.0.write_char(c)?;
                continue;
            }
            for e in c.escape_debug() {
                self.0.write_char(e)?;
            }
        }
        Ok(())
    }
}

#[derive(Debug, Default)]
struct Window {
    start: Option<Instant>,
    written: u64,
    /// Left out since the last warning written.
    suppressed: u64,
}

/// Rate limit of the caller-caused warnings, per kind (the `kind` label of
/// `ratelimit_gateway_errors_total`).
pub struct Warnings {
    per_window: u64,
    window: Duration,
    kinds: Mutex<HashMap<&'static str, Window>>,
    suppressed: IntCounterVec,
}

impl Warnings {
    /// [`WARNINGS_PER_SECOND`] per [`WARNING_WINDOW`]; each warning left out
    /// is counted in `suppressed` (labelled by kind).
    pub fn new(suppressed: IntCounterVec) -> Warnings {
        Warnings::with_limit(WARNINGS_PER_SECOND, WARNING_WINDOW, suppressed)
    }

    /// `per_window` warnings per kind per `window`.
    pub fn with_limit(per_window: u64, window: Duration, suppressed: IntCounterVec) -> Warnings {
        Warnings {
            per_window,
            window,
            kinds: Mutex::new(HashMap::new()),
            suppressed,
        }
    }

    /// Whether to write a warning of `kind` now: `Some(k)` with the number
    /// of warnings of this kind left out since the last one written, or
    /// `None` (left out and counted).
    pub fn allow(&self, kind: &'static str) -> Option<u64> {
        self.allow_at(kind, Instant::now())
    }

    /// [`Warnings::allow`] at `now` (tests pass their own clock).
    pub fn allow_at(&self, kind: &'static str, now: Instant) -> Option<u64> {
        // A poisoned lock only means another thread panicked while counting.
        let mut kinds = self.kinds.lock().unwrap_or_else(PoisonError::into_inner);
        let w = kinds.entry(kind).or_default();
        let expired = match w.start {
            Some(start) => now.saturating_duration_since(start) >= self.window,
            None => true,
        };
        if expired {
            w.start = Some(now);
            w.written = 0;
        }
        if w.written < self.per_window {
            w.written += 1;
            Some(std::mem::take(&mut w.suppressed))
        } else {
            w.suppressed += 1;
            self.suppressed.with_label_values(&[kind]).inc();
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counter() -> IntCounterVec {
        IntCounterVec::new(prometheus::Opts::new("s", "s"), &["kind"]).unwrap()
    }

    #[test]
    fn escaped_values_stay_on_one_line_and_in_their_quotes() {
        let forged = "x\n2026-01-01T00:00:00Z INFO ratelimit_gateway: forged\r\u{1b}[2K\"a=b\\";
        assert_eq!(
            Escaped(forged).to_string(),
            r#""x\n2026-01-01T00:00:00Z INFO ratelimit_gateway: forged\r\u{1b}[2K\"a=b\\""#
        );
        assert_eq!(Escaped("demo").to_string(), "\"demo\"");
        assert_eq!(Escaped("don't").to_string(), "\"don't\"");
        // Any Display, e.g. an error, is escaped as it is formatted.
        assert_eq!(Escaped(format_args!("a{}b", '\n')).to_string(), r#""a\nb""#);
    }

    #[test]
    fn at_most_n_per_window_then_the_count_of_those_left_out() {
        let c = counter();
        let w = Warnings::with_limit(3, Duration::from_secs(1), c.clone());
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        // 3 written in the first window, 5 left out (and counted).
        let first: Vec<_> = (0..8)
            .map(|i| w.allow_at("bad_request", at(i * 100)))
            .collect();
        assert_eq!(
            first,
            [Some(0), Some(0), Some(0), None, None, None, None, None]
        );
        assert_eq!(c.with_label_values(&["bad_request"]).get(), 5);
        // Another kind has its own budget.
        assert_eq!(w.allow_at("redis", at(900)), Some(0));
        assert_eq!(c.with_label_values(&["redis"]).get(), 0);
        // Still the first window 1 ms before its end.
        assert_eq!(w.allow_at("bad_request", at(999)), None);
        // The next window: the first warning reports the 6 left out, once.
        assert_eq!(w.allow_at("bad_request", at(1000)), Some(6));
        assert_eq!(w.allow_at("bad_request", at(1001)), Some(0));
        assert_eq!(w.allow_at("bad_request", at(1002)), Some(0));
        assert_eq!(w.allow_at("bad_request", at(1003)), None);
        assert_eq!(c.with_label_values(&["bad_request"]).get(), 7);
        // A long quiet spell: the window starts at the next warning.
        assert_eq!(w.allow_at("bad_request", at(60_000)), Some(1));
        assert_eq!(w.allow_at("bad_request", at(60_500)), Some(0));
        assert_eq!(w.allow_at("bad_request", at(60_999)), Some(0));
        assert_eq!(w.allow_at("bad_request", at(60_999)), None);
        // 1000 in one window: exactly 3 written.
        let written = (0..1000)
            .filter(|i| w.allow_at("timeout", at(70_000 + i % 1000)).is_some())
            .count();
        assert_eq!(written, 3);
        assert_eq!(c.with_label_values(&["timeout"]).get(), 997);
        assert_eq!(w.allow_at("timeout", at(71_000)), Some(997));
    }
}
