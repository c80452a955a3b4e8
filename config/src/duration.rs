//! Durations as the configuration writes them: `"10s"`, `"1m"`, `"1h"`, `"1d"` or a number of seconds.

use serde::de::{self, Deserializer, Visitor};
use std::fmt;

/// The longest `per` accepted: a year keeps every bucket computation far from overflow.
pub const MAX_SECONDS: u64 = 366 * 86_400;

/// What a duration is, in the errors of a value of the wrong type.
pub(super) const EXPECTING: &str =
    "a duration such as \"10s\", \"1m\", \"1h\", \"1d\" or a whole number of seconds";

/// A whole number of seconds between 1 and [`MAX_SECONDS`].
/// `Default` is 0, which no parsed duration is: it stands for "not given".
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Seconds(pub u64);

/// Parses `"<integer><s|m|h|d>"` or a bare integer string into seconds.
pub fn parse(text: &str) -> Option<u64> {
    let text = text.trim();
    let (digits, unit) = match text.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => (text.get(..i)?, c),
        _ => (text, 's'),
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    let mult = match unit {
        's' => 1,
        'm' => 60,
        'h' => 3_600,
        'd' => 86_400,
        _ => return None,
    };
    n.checked_mul(mult)
}

/// A whole number of seconds within 1..=[`MAX_SECONDS`], or why not.
pub(super) fn check_range(secs: u64) -> Result<Seconds, String> {
    if secs == 0 {
        Err("must be at least 1 second".into())
    } else if secs > MAX_SECONDS {
        Err(format!("must be at most {MAX_SECONDS} seconds (366 days)"))
    } else {
        Ok(Seconds(secs))
    }
}

impl<'de> serde::Deserialize<'de> for Seconds {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Seconds;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str(EXPECTING)
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Seconds, E> {
                let secs = parse(v).ok_or_else(|| E::custom(format!("{v:?} is not a duration")))?;
                check_range(secs).map_err(E::custom)
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Seconds, E> {
                check_range(v).map_err(E::custom)
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Seconds, E> {
                u64::try_from(v)
                    .map_err(|_| E::custom(format!("{v} is not a duration")))
                    .and_then(|s| check_range(s).map_err(E::custom))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Seconds, E> {
                Err(E::custom(format!("{v} is not a whole number of seconds")))
            }
        }
        d.deserialize_any(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units() {
        assert_eq!(parse("1s"), Some(1));
        assert_eq!(parse("10s"), Some(10));
        assert_eq!(parse("1m"), Some(60));
        assert_eq!(parse("2h"), Some(7200));
        assert_eq!(parse("1d"), Some(86_400));
        assert_eq!(parse("30"), Some(30));
    }

    #[test]
    fn rejects_garbage() {
        for bad in [
            "10x",
            "",
            "s",
            "1.5s",
            "-1s",
            "1 m",
            "m1",
            "1ms",
            "99999999999999999999d",
        ] {
            assert_eq!(parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn deserializes_strings_and_numbers_with_clear_errors() {
        let s: Seconds = serde_json::from_str("\"1m\"").unwrap();
        assert_eq!(s, Seconds(60));
        let n: Seconds = serde_json::from_str("5").unwrap();
        assert_eq!(n, Seconds(5));
        let e = serde_json::from_value::<Seconds>(serde_json::json!("10x")).unwrap_err();
        assert_eq!(e.to_string(), "\"10x\" is not a duration");
        let z = serde_json::from_value::<Seconds>(serde_json::json!(0)).unwrap_err();
        assert_eq!(z.to_string(), "must be at least 1 second");
        let f = serde_json::from_value::<Seconds>(serde_json::json!(1.5)).unwrap_err();
        assert_eq!(f.to_string(), "1.5 is not a whole number of seconds");
    }
}
