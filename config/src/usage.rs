//! Charging from the response: where a request's real cost is read
//! (`cost_from`: a response header, JSON Pointers into its body, or a
//! provider's preset), and which statuses are charged at all (`charge_on`).
//! The filter reserves `reserve` when the request arrives and settles the
//! difference to the real cost, at most `max`, when the response ends.

use serde::Deserialize;
use std::fmt;

/// Most terms one `cost_from.json` sums.
pub const MAX_TERMS: usize = 8;
/// Most segments of one JSON Pointer.
pub const MAX_POINTER_SEGMENTS: usize = 16;
/// Longest segment of one JSON Pointer, in bytes.
pub const MAX_SEGMENT_LEN: usize = 128;
/// Largest weight of one term.
pub const MAX_WEIGHT: u64 = 1_000_000;
/// Default `scan_limit`: bytes of a response body scanned for its usage.
pub const DEFAULT_SCAN_LIMIT: u64 = 1 << 20;
/// Bounds of `scan_limit`.
pub const MIN_SCAN_LIMIT: u64 = 1024;
/// Upper bound of `scan_limit`.
pub const MAX_SCAN_LIMIT: u64 = 64 << 20;
/// Default `request_body_limit`: bytes of a request body read for the
/// reservation or rewritten by `ensure_stream_usage`.
pub const DEFAULT_REQUEST_BODY_LIMIT: u64 = 64 << 10;
/// Lower bound of `request_body_limit`.
pub const MIN_REQUEST_BODY_LIMIT: u64 = 1024;
/// Upper bound of `request_body_limit`: Envoy's default per-connection
/// buffer is 1 MiB, and a body is held whole in the VM while it is read.
pub const MAX_REQUEST_BODY_LIMIT: u64 = 1 << 20;

/// Where a request's real cost is read from its response.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CostFrom {
    /// A response header holding the cost as a decimal integer.
    #[serde(default)]
    pub header: Option<String>,
    /// A weighted sum of values in the JSON body (or the events of an SSE stream).
    #[serde(default)]
    pub json: Option<Vec<UsageTerm>>,
    /// The shape a provider's API reports usage in.
    #[serde(default)]
    pub preset: Option<UsagePreset>,
    /// The most one response may charge; a larger reported cost charges this.
    pub max: u64,
    /// Tokens held when the request arrives: the bucket must hold them. A
    /// number, or read from the request's JSON body.
    #[serde(default)]
    pub reserve: Reserve,
    /// Bytes of the body scanned for the usage; a longer body charges `reserve`.
    #[serde(default = "default_scan_limit")]
    pub scan_limit: u64,
    /// Bytes of the request body the filter holds to read `reserve` from it
    /// or to rewrite it (`ensure_stream_usage`); a longer body is passed on
    /// unread and unchanged.
    #[serde(default = "default_request_body_limit")]
    pub request_body_limit: u64,
    /// Adds `"stream_options": {"include_usage": true}` to a request whose
    /// JSON body asks for a stream (`"stream": true`) without it, so that an
    /// OpenAI-style stream reports its usage.
    #[serde(default)]
    pub ensure_stream_usage: bool,
}

pub(super) fn default_reserve() -> u64 {
    1
}

pub(super) fn default_request_body_limit() -> u64 {
    DEFAULT_REQUEST_BODY_LIMIT
}

/// What a request reserves when it arrives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reserve {
    /// A fixed number of tokens.
    Fixed(u64),
    /// A number in the request's JSON body (`max_tokens`), or `default`.
    FromBody(ReserveFrom),
}

impl Default for Reserve {
    fn default() -> Self {
        Reserve::Fixed(default_reserve())
    }
}

/// A reservation read from the request body: the integer at `pointer`, or
/// `default` when the body has none (absent, not a whole number of at least
/// 1, not JSON, longer than `request_body_limit`, or no body at all).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReserveFrom {
    /// Where the value is (RFC 6901), e.g. `/max_tokens`.
    pub pointer: JsonPointer,
    /// The reservation when the body has no usable value.
    #[serde(default = "default_reserve")]
    pub default: u64,
}

/// What the configuration says `reserve` may be, in errors.
pub const RESERVE_EXPECTED: &str = "a number of tokens or an object with pointer and default";

impl Reserve {
    /// The fixed reservation, or the default of one read from the body: what
    /// a request without a usable body reserves, and the least bound checks hold.
    pub fn upfront(&self) -> u64 {
        match self {
            Reserve::Fixed(n) => *n,
            Reserve::FromBody(f) => f.default,
        }
    }

    /// The pointer read from the request body, if any.
    pub fn pointer(&self) -> Option<&JsonPointer> {
        match self {
            Reserve::Fixed(_) => None,
            Reserve::FromBody(f) => Some(&f.pointer),
        }
    }

    /// The path of the number [`Reserve::upfront`] is, under `at` (`rules[0].cost_from`).
    pub fn field(&self, at: &str) -> String {
        match self {
            Reserve::Fixed(_) => format!("{at}.reserve"),
            Reserve::FromBody(_) => format!("{at}.reserve.default"),
        }
    }
}

impl fmt::Display for Reserve {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reserve::Fixed(n) => write!(f, "{n}"),
            Reserve::FromBody(r) => write!(f, "{} (default {})", r.pointer, r.default),
        }
    }
}

// A number or an object, told apart by the JSON type (not `untagged`, whose
// error hides the path of a bad field inside the object).
impl<'de> Deserialize<'de> for Reserve {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Reserve;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(RESERVE_EXPECTED)
            }
            fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<Reserve, E> {
                Ok(Reserve::Fixed(n))
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<Reserve, A::Error> {
                ReserveFrom::deserialize(serde::de::value::MapAccessDeserializer::new(map))
                    .map(Reserve::FromBody)
            }
        }
        d.deserialize_any(V)
    }
}

pub(super) fn default_scan_limit() -> u64 {
    DEFAULT_SCAN_LIMIT
}

/// One term of a body's cost: the integer at `pointer`, times `weight`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UsageTerm {
    /// Where the value is (RFC 6901).
    pub pointer: JsonPointer,
    /// What one unit of it costs.
    #[serde(default = "default_weight")]
    pub weight: u64,
}

pub(super) fn default_weight() -> u64 {
    1
}

/// A JSON Pointer (RFC 6901), split into its unescaped reference tokens.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(try_from = "String")]
pub struct JsonPointer(pub Vec<String>);

impl JsonPointer {
    /// Parses `/a/b~1c` into `["a", "b/c"]`; the empty pointer is the whole document.
    pub fn parse(s: &str) -> Result<JsonPointer, String> {
        if s.is_empty() {
            return Ok(JsonPointer(Vec::new()));
        }
        let Some(rest) = s.strip_prefix('/') else {
            return Err(format!("{s:?} is not a JSON Pointer: it must start with /"));
        };
        let mut segments = Vec::new();
        for raw in rest.split('/') {
            let segment = unescape(raw).ok_or_else(|| {
                format!("{s:?} is not a JSON Pointer: ~ must be followed by 0 or 1")
            })?;
            if segment.len() > MAX_SEGMENT_LEN {
                return Err(format!(
                    "{s:?}: a segment is longer than {MAX_SEGMENT_LEN} bytes"
                ));
            }
            segments.push(segment);
        }
        if segments.len() > MAX_POINTER_SEGMENTS {
            return Err(format!(
                "{s:?} has more than {MAX_POINTER_SEGMENTS} segments"
            ));
        }
        Ok(JsonPointer(segments))
    }
}

/// One reference token with `~1` read as `/` and `~0` as `~`.
fn unescape(raw: &str) -> Option<String> {
    let mut out = String::with_capacity(raw.len());
    let mut chars = raw.chars();
    while let Some(c) = chars.next() {
        match c {
            '~' => match chars.next() {
                Some('0') => out.push('~'),
                Some('1') => out.push('/'),
                _ => return None,
            },
            c => out.push(c),
        }
    }
    Some(out)
}

impl TryFrom<String> for JsonPointer {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        JsonPointer::parse(&s)
    }
}

impl fmt::Display for JsonPointer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for s in &self.0 {
            write!(f, "/{}", s.replace('~', "~0").replace('/', "~1"))?;
        }
        Ok(())
    }
}

/// How a provider's API reports a response's token usage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UsagePreset {
    /// OpenAI chat completions: `usage` in the body, or in the last event of a
    /// stream (with `stream_options.include_usage`).
    OpenaiChat,
    /// OpenAI Responses: `usage` in the body, or in the `response.completed` event.
    OpenaiResponses,
    /// Anthropic Messages: `usage` in the body; in a stream, input tokens in
    /// `message_start` and the output count in the last `message_delta`.
    AnthropicMessages,
}

/// A term of a preset: the first of several pointers that a body (or
/// event) has, and its weight.
pub type PresetTerm = (&'static [&'static str], u64);

impl UsagePreset {
    /// Every preset, in the order error messages list them.
    pub const ALL: [UsagePreset; 3] = [
        UsagePreset::OpenaiChat,
        UsagePreset::OpenaiResponses,
        UsagePreset::AnthropicMessages,
    ];

    /// The names of [`Self::ALL`], in its order.
    // Evaluated when compiling: an index out of range fails the build.
    #[allow(clippy::indexing_slicing)]
    pub const NAMES: [&'static str; 3] = {
        let mut names = [""; 3];
        let mut i = 0;
        while i < names.len() {
            names[i] = Self::ALL[i].name();
            i += 1;
        }
        names
    };

    /// The name in configuration.
    pub const fn name(self) -> &'static str {
        match self {
            UsagePreset::OpenaiChat => "openai_chat",
            UsagePreset::OpenaiResponses => "openai_responses",
            UsagePreset::AnthropicMessages => "anthropic_messages",
        }
    }

    /// The terms it sums: each the first pointer of its list that the body
    /// (or, in a stream, the last event having one) holds, weight 1.
    pub const fn terms(self) -> &'static [PresetTerm] {
        match self {
            UsagePreset::OpenaiChat => &[
                (&["/usage/prompt_tokens"], 1),
                (&["/usage/completion_tokens"], 1),
            ],
            UsagePreset::OpenaiResponses => &[
                (&["/usage/input_tokens", "/response/usage/input_tokens"], 1),
                (
                    &["/usage/output_tokens", "/response/usage/output_tokens"],
                    1,
                ),
            ],
            UsagePreset::AnthropicMessages => &[
                (&["/usage/input_tokens", "/message/usage/input_tokens"], 1),
                (&["/usage/output_tokens", "/message/usage/output_tokens"], 1),
            ],
        }
    }
}

/// Statuses a rule charges: a class (`"2xx"`) or one code (`"404"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(try_from = "String")]
pub enum StatusMatch {
    /// Every status of a class: 1 to 5 for `1xx` to `5xx`.
    Class(u8),
    /// One status code, 100 to 599.
    Code(u16),
}

impl StatusMatch {
    /// Reads `"2xx"` or `"404"`.
    pub fn parse(s: &str) -> Result<StatusMatch, String> {
        let bad =
            || format!("{s:?} is not a status class (1xx to 5xx) or a status code (100 to 599)");
        let b = s.as_bytes();
        match b {
            [c @ b'1'..=b'5', b'x', b'x'] => Ok(StatusMatch::Class(c - b'0')),
            [b'1'..=b'5', b'0'..=b'9', b'0'..=b'9'] => {
                s.parse().map(StatusMatch::Code).map_err(|_| bad())
            }
            _ => Err(bad()),
        }
    }

    /// Whether `status` is one this matches.
    pub fn matches(self, status: u16) -> bool {
        match self {
            StatusMatch::Class(c) => status / 100 == u16::from(c),
            StatusMatch::Code(code) => status == code,
        }
    }
}

impl TryFrom<String> for StatusMatch {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        StatusMatch::parse(&s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pointers_unescape_and_refuse_bad_escapes() {
        assert_eq!(JsonPointer::parse("").unwrap().0, Vec::<String>::new());
        assert_eq!(
            JsonPointer::parse("/usage/total_tokens").unwrap().0,
            ["usage", "total_tokens"]
        );
        assert_eq!(
            JsonPointer::parse("/a~1b/~0c/").unwrap().0,
            ["a/b", "~c", ""]
        );
        assert_eq!(
            JsonPointer::parse("/a~1b/~0c").unwrap().to_string(),
            "/a~1b/~0c"
        );
        assert!(JsonPointer::parse("usage").is_err());
        assert!(JsonPointer::parse("/a~2").is_err());
        assert!(JsonPointer::parse("/a~").is_err());
        assert!(JsonPointer::parse(&"/a".repeat(17)).is_err());
        assert!(JsonPointer::parse(&format!("/{}", "x".repeat(129))).is_err());
    }

    #[test]
    fn statuses_are_classes_or_codes() {
        assert_eq!(StatusMatch::parse("2xx"), Ok(StatusMatch::Class(2)));
        assert_eq!(StatusMatch::parse("404"), Ok(StatusMatch::Code(404)));
        for bad in ["6xx", "0xx", "2XX", "099", "600", "20", "2000", "x", ""] {
            assert!(StatusMatch::parse(bad).is_err(), "{bad}");
        }
        assert!(StatusMatch::Class(2).matches(204));
        assert!(!StatusMatch::Class(2).matches(304));
        assert!(StatusMatch::Code(404).matches(404));
        assert!(!StatusMatch::Code(404).matches(403));
    }

    #[test]
    fn presets_name_valid_pointers() {
        for p in UsagePreset::ALL {
            for (pointers, _) in p.terms() {
                for s in *pointers {
                    assert!(JsonPointer::parse(s).is_ok(), "{s}");
                }
            }
        }
        assert_eq!(
            UsagePreset::NAMES,
            ["openai_chat", "openai_responses", "anthropic_messages"]
        );
    }
}
