//! Rate-limit response headers: `X-RateLimit-*` and the IETF
//! draft-ietf-httpapi-ratelimit-headers-11 `RateLimit` / `RateLimit-Policy`.
//!
//! The IETF fields list every limit a request was checked against, one
//! policy each, in the order of its reports; the legacy ones, which hold one
//! number each, show the most constraining limit alone.

use crate::config::HeaderStyle;
use crate::limits::limiter::Report;
use crate::limits::token_bucket::ceil_secs;
use crate::policy::plan::{push_policy_name, LimitText, Plan, RulePlan};
use crate::respond::digits;

/// One limit as a response reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shown<'a> {
    /// The rule's name, the policy name of its first limit in the IETF
    /// fields.
    pub policy: &'a str,
    /// The limit's place in its rule's list: limit `n > 0` is the policy
    /// `<rule>/<n>` ([`policy_name`](crate::policy::plan::policy_name)).
    pub limit: usize,
    /// Bucket capacity.
    pub quota: u64,
    /// `per` in seconds.
    pub window_secs: u64,
    /// Tokens left.
    pub remaining: u64,
    /// Seconds until the bucket is full again.
    pub reset_secs: u64,
    /// Seconds until the request could pass, for denials (at least 1).
    pub retry_after_secs: u64,
    /// `quota` and the policy field as the plan wrote them, for this
    /// filter's own limits (`None`: a limit the gateway stated).
    pub text: Option<&'a LimitText>,
    /// A concurrency limit: `quota` slots, no window.
    pub in_flight: bool,
}

fn shown<'a>(plan: &'a Plan, r: &Report) -> Option<Shown<'a>> {
    let rule = plan.rules.get(r.rule)?;
    // A gateway answer says which limit it enforced: that one is shown.
    let (quota, window_secs, text) = match r.enforced {
        Some(e) => (e.requests, e.window_secs(), None),
        None => {
            let (limit, window_secs) = rule.limits(r.variant).get(r.limit)?;
            let text = rule
                .variants
                .get(r.variant)
                .and_then(|v| v.texts.get(r.limit));
            (limit.capacity, *window_secs, text)
        }
    };
    Some(Shown {
        policy: &rule.name,
        limit: r.limit,
        quota,
        window_secs,
        remaining: r.check.remaining,
        reset_secs: ceil_secs(r.check.reset_ns),
        retry_after_secs: ceil_secs(r.check.retry_after_ns).max(1),
        text,
        in_flight: rule.in_flight,
    })
}

/// For an allowed request: the limit closest to exhaustion (fewest tokens
/// left; on a tie, the one that takes longest to refill).
pub fn closest<'a>(plan: &'a Plan, reports: &[Report]) -> Option<Shown<'a>> {
    closest_report(reports).and_then(|r| shown(plan, r))
}

/// The report [`closest`] shows.
pub fn closest_report(reports: &[Report]) -> Option<&Report> {
    reports
        .iter()
        .min_by_key(|r| (r.check.remaining, std::cmp::Reverse(r.check.reset_ns)))
}

/// Header lines to send.
pub type HeaderLines = Vec<(&'static str, String)>;

/// The headers of a response that goes ahead. The decision's reports are
/// kept (moved, not copied) and the closest limit's lines written out only
/// when the response's headers are set: rendered into five `String`s at the
/// decision, they cost c1 more than the `set_map_value` calls that send them
/// (BENCHMARKS.md, instructions per decision).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Passing {
    /// Every limit's report; the one closest to exhaustion is shown.
    pub reports: Vec<Report>,
    /// Lines after the limit's (a graduated rule's warning).
    pub extra: HeaderLines,
}

impl Passing {
    /// The headers of a response whose limits reported `reports`.
    pub fn of(reports: Vec<Report>) -> Passing {
        Passing {
            reports,
            extra: Vec::new(),
        }
    }

    /// Hands each line to `set`, in order: the limits' in `plan`'s style
    /// (the legacy ones of the closest), then the extra lines. `plan` must be
    /// the one that decided.
    /// Values are bytes: the host takes them so, and the lists are written
    /// as bytes (no check that they are UTF-8, which they are).
    pub fn each(&self, plan: &Plan, mut set: impl FnMut(&'static str, &[u8])) {
        if let Some(s) = closest(plan, &self.reports) {
            let all = Listed {
                plan,
                reports: &self.reports,
                refused: false,
            };
            write(plan.header_style, &s, Some(all), &mut |name, value| {
                set(name.as_str(), value)
            });
        }
        for (name, value) in &self.extra {
            set(name, value.as_bytes());
        }
    }

    /// The lines as [`Passing::each`] hands them out.
    pub fn lines(&self, plan: &Plan) -> HeaderLines {
        let mut out = Vec::new();
        self.each(plan, |name, value| {
            out.push((name, String::from_utf8_lossy(value).into_owned()))
        });
        out
    }
}

/// The header lines of a response the filter answers itself (429, 403,
/// 503), written from the start as the proxy-wasm map that
/// `send_local_response` takes: the count, each line's name and value
/// lengths (u32, little-endian), then each name and value NUL-terminated. A
/// `String` per line, a list of pairs borrowed from them and a map built from
/// that list cost a 429 1,082 instructions more (BENCHMARKS.md,
/// instructions per decision).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalHeaders {
    /// The map, the count not yet written: after it the lengths of
    /// `count.max(ROOM)` lines, then the names and values.
    bytes: Vec<u8>,
    /// Lines written.
    count: usize,
}

/// Lines whose lengths have room before the first name; a response with
/// more makes room for each further line by moving the names and values.
const ROOM: usize = 8;
/// Bytes of the count and of one line's two lengths.
const COUNT: usize = 4;
const SIZES: usize = 8;

impl Default for LocalHeaders {
    fn default() -> Self {
        let mut bytes = Vec::with_capacity(COUNT + SIZES * ROOM + 256);
        bytes.resize(COUNT + SIZES * ROOM, 0);
        LocalHeaders { bytes, count: 0 }
    }
}

impl LocalHeaders {
    /// The lines of a refused request whose limits reported `reports`, in
    /// `plan`'s style: the legacy ones of `shown` (none without it), every
    /// limit in the IETF ones, those that let it through [`uncharged`].
    pub fn of(plan: &Plan, shown: Option<&Shown>, reports: &[Report]) -> LocalHeaders {
        let mut out = LocalHeaders::default();
        if let Some(s) = shown {
            let all = Listed {
                plan,
                reports,
                refused: true,
            };
            write(plan.header_style, s, Some(all), &mut |name, value| {
                out.push_named(name, value)
            });
        }
        out
    }

    /// Appends a line.
    pub fn push(&mut self, name: &str, value: &str) {
        self.sizes(name.len(), value.len());
        self.bytes.extend_from_slice(name.as_bytes());
        self.bytes.push(0);
        self.value(value.as_bytes());
    }

    /// Appends a line whose name comes with its NUL: one copy less.
    pub fn push_named(&mut self, name: Name, value: &[u8]) {
        self.sizes(name.as_str().len(), value.len());
        self.bytes.extend_from_slice(name.0.as_bytes());
        self.value(value);
    }

    /// Writes the next line's lengths, making room for them past [`ROOM`].
    fn sizes(&mut self, name: usize, value: usize) {
        let at = COUNT + SIZES * self.count;
        if self.count >= ROOM {
            self.bytes.splice(at..at, [0; SIZES]);
        }
        let len = |n: usize| u32::try_from(n).unwrap_or(u32::MAX).to_le_bytes();
        if let Some(sizes) = self.bytes.get_mut(at..at + SIZES) {
            let (n, v) = sizes.split_at_mut(SIZES / 2);
            n.copy_from_slice(&len(name));
            v.copy_from_slice(&len(value));
        }
    }

    /// Writes the line's value and ends the line.
    fn value(&mut self, value: &[u8]) {
        self.bytes.extend_from_slice(value);
        self.bytes.push(0);
        self.count += 1;
    }

    /// Number of lines.
    pub fn len(&self) -> usize {
        self.count
    }

    /// True when there is no line.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Whether [`LocalHeaders::take_map`] took the map (a map holds at
    /// least its count).
    pub fn is_taken(&self) -> bool {
        self.bytes.is_empty()
    }

    /// The map to hand the host, taken from where it lies (a verdict kept
    /// in its stream); these headers are left empty.
    pub fn take_map(&mut self) -> Vec<u8> {
        if let Some(c) = self.bytes.get_mut(..COUNT) {
            c.copy_from_slice(&u32::try_from(self.count).unwrap_or(u32::MAX).to_le_bytes());
        }
        let (used, room) = (COUNT + SIZES * self.count, COUNT + SIZES * ROOM);
        if used < room && room <= self.bytes.len() {
            // Closes the lengths' unused room.
            self.bytes.drain(used..room);
        }
        self.count = 0;
        std::mem::take(&mut self.bytes)
    }

    /// The lines, decoded (for tests and diagnostics).
    pub fn lines(&self) -> Vec<(String, String)> {
        let mut at = COUNT + SIZES * self.count.max(ROOM);
        let mut take = |len: Option<&[u8]>| {
            let len = len
                .and_then(|l| l.try_into().ok())
                .map_or(0, u32::from_le_bytes) as usize;
            let s = self.bytes.get(at..at + len).unwrap_or_default();
            at += len + 1;
            String::from_utf8_lossy(s).into_owned()
        };
        (0..self.count)
            .map(|i| {
                let sizes = COUNT + SIZES * i;
                let name = take(self.bytes.get(sizes..sizes + SIZES / 2));
                (name, take(self.bytes.get(sizes + SIZES / 2..sizes + SIZES)))
            })
            .collect()
    }

    /// The value of the first line named `name`.
    pub fn get(&self, name: &str) -> Option<String> {
        self.lines()
            .into_iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v)
    }
}

/// For a denied request: the failing limit that takes longest to allow it,
/// since every limit must pass; its wait is the `Retry-After`.
pub fn binding<'a>(plan: &'a Plan, reports: &[Report]) -> Option<Shown<'a>> {
    reports
        .iter()
        .filter(|r| !r.check.allowed)
        .max_by_key(|r| r.check.retry_after_ns)
        .and_then(|r| shown(plan, r))
}

/// Names of the rules with a failing limit, each once, in report order.
pub fn violated<'a>(plan: &'a Plan, reports: &'a [Report]) -> Vec<&'a str> {
    violated_rules(plan, reports)
        .map(|r| r.name.as_str())
        .collect()
}

/// The rules with a failing limit, each name once, in report order, without
/// collecting them: a 429 writes them straight into its body.
pub fn violated_rules<'a>(
    plan: &'a Plan,
    reports: &'a [Report],
) -> impl Iterator<Item = &'a RulePlan> {
    let failing = |r: &&Report| !r.check.allowed;
    let name = move |r: &Report| plan.rules.get(r.rule).map(|x| x.name.as_str());
    reports
        .iter()
        .enumerate()
        .filter(move |(i, r)| {
            if r.check.allowed {
                return false;
            }
            let earlier = reports.get(..*i).unwrap_or_default();
            // A rule's limits report one after another: a repeat is nearly
            // always the report before, which keeps a rule whose every
            // limit fails from scanning all earlier reports for each.
            if earlier
                .last()
                .is_some_and(|p| !p.check.allowed && p.rule == r.rule)
            {
                return false;
            }
            !earlier.iter().filter(failing).any(|p| name(p) == name(r))
        })
        .filter_map(move |(_, r)| plan.rules.get(r.rule))
}

/// The warning header of a graduated rule past its `warn_at`: the rule and
/// the share of its limit in use, in percent.
pub fn warning(policy: &str, used_share: f64) -> (&'static str, String) {
    let percent = (used_share * 100.0).round().max(0.0) as u64;
    (WARNING, format!("\"{policy}\";used={percent}"))
}

/// A header name with the NUL that ends it in the host's map, so that a
/// local answer copies both at once: one `Vec` push less a line (a 429's
/// seven lines: 42 wasm instructions; BENCHMARKS.md, instructions per
/// decision).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Name(&'static str);

impl Name {
    /// `with_nul` ends in its one NUL (checked when a constant is built).
    const fn new(with_nul: &'static str) -> Name {
        assert!(matches!(with_nul.as_bytes(), [.., 0]));
        Name(with_nul)
    }

    /// The name, without its NUL.
    pub fn as_str(self) -> &'static str {
        self.0.strip_suffix('\0').unwrap_or(self.0)
    }
}

/// `X-RateLimit-Limit`.
pub const X_LIMIT: Name = Name::new("x-ratelimit-limit\0");
/// `X-RateLimit-Remaining`.
pub const X_REMAINING: Name = Name::new("x-ratelimit-remaining\0");
/// `X-RateLimit-Reset`.
pub const X_RESET: Name = Name::new("x-ratelimit-reset\0");
/// The IETF draft's `RateLimit-Policy`.
pub const POLICY: Name = Name::new("ratelimit-policy\0");
/// The IETF draft's `RateLimit`.
pub const RATELIMIT: Name = Name::new("ratelimit\0");
/// `Retry-After`, on a 429 or 503.
pub const RETRY_AFTER: Name = Name::new("retry-after\0");
/// `Content-Type`, on every local answer with a body.
pub const CONTENT_TYPE: Name = Name::new("content-type\0");

/// Name of the graduated warning header.
pub const WARNING: &str = "x-ratelimit-warning";

/// Spreads a wait of `secs` upwards by up to `jitter` (a share), from `unit`
/// in `[0, 1)`, rounding up. Only upwards: a client that waits as told must
/// find its request admitted, so no client is sent back early.
pub fn jittered(secs: u64, jitter: f64, unit: f64) -> u64 {
    let factor = 1.0 + jitter * unit.clamp(0.0, 1.0);
    ((secs as f64 * factor).ceil() as u64).max(secs).max(1)
}

/// The header lines for `s` alone in the configured style: a response
/// whose request one limit reported.
pub fn render(style: HeaderStyle, s: &Shown) -> HeaderLines {
    // Room for a 429's `retry-after` and `content-type` after the five.
    let mut out = Vec::with_capacity(7);
    write(style, s, None, &mut |name, value| {
        out.push((name.as_str(), String::from_utf8_lossy(value).into_owned()))
    });
    out
}

/// The reports a response lists in the IETF fields.
#[derive(Clone, Copy)]
struct Listed<'a> {
    plan: &'a Plan,
    reports: &'a [Report],
    /// The request was refused: nothing was charged.
    refused: bool,
}

/// Hands `set` the header lines in the configured style: the legacy ones of
/// `s`, the IETF ones of every report of `all` (of `s` alone without them, or
/// with one). Numbers by `itoa` and copies: `format!` costs several times
/// the instructions on every response; what never changes for a limit comes
/// ready from the plan.
fn write(style: HeaderStyle, s: &Shown, all: Option<Listed>, set: &mut impl FnMut(Name, &[u8])) {
    // Each number formatted once: both styles show remaining and reset.
    let (mut r, mut t) = (itoa::Buffer::new(), itoa::Buffer::new());
    let (remaining, reset) = (r.format(s.remaining), t.format(s.reset_secs));
    if matches!(style, HeaderStyle::Both | HeaderStyle::Legacy) {
        let mut q = itoa::Buffer::new();
        let quota = match s.text {
            Some(text) => text.quota.as_str(),
            None => q.format(s.quota),
        };
        set(X_LIMIT, quota.as_bytes());
        set(X_REMAINING, remaining.as_bytes());
        set(X_RESET, reset.as_bytes());
    }
    if !matches!(style, HeaderStyle::Both | HeaderStyle::Ietf) {
        return;
    }
    match all {
        Some(
            all @ Listed {
                reports: [_, _, ..],
                refused: false,
                ..
            },
        ) => return write_list::<false>(all, set),
        Some(
            all @ Listed {
                reports: [_, _, ..],
                refused: true,
                ..
            },
        ) => return write_list::<true>(all, set),
        _ => {}
    }
    let mut v = String::with_capacity(s.policy.len() + 48);
    match s.text {
        Some(text) => set(POLICY, text.policy().as_bytes()),
        None => {
            push_stated(
                &mut v,
                s.policy,
                s.limit,
                s.quota,
                s.window_secs,
                s.in_flight,
            );
            set(POLICY, v.as_bytes());
            v.clear();
        }
    }
    match s.text {
        Some(text) => v.push_str(text.state()),
        None => {
            push_policy_name(&mut v, s.policy, s.limit);
            v.push_str(";r=");
        }
    }
    for part in [remaining, ";t=", reset] {
        v.push_str(part);
    }
    set(RATELIMIT, v.as_bytes());
}

/// The IETF lines of several reports: one policy item and one service-limit
/// item for each, in report order, as RFC 9651 Lists (`, ` between items).
/// `REFUSED`: the request was refused, and nothing was charged.
///
/// Wasmtime charges a copy one instruction a byte, so each byte is written
/// once, as bytes (no `str` checks), and no report is copied. When the
/// reports are a run of the plan's
/// [`PolicyList`](crate::policy::policy_list::PolicyList) (every rule
/// matched), `RateLimit-Policy` is borrowed from it and each `RateLimit`
/// item is one copy of its start from the list and the numbers; else each
/// limit's texts are looked up. Out of line: the common one-rule request
/// never gets here.
#[inline(never)]
fn write_list<const REFUSED: bool>(all: Listed, set: &mut impl FnMut(Name, &[u8])) {
    let Listed { plan, reports, .. } = all;
    let mut states = Vec::with_capacity(48 * reports.len());
    if let Some(items) = plan.policies.items_from(reports) {
        // Checked as it is written: a second pass cost c4 200 instructions.
        let mut listed = true;
        for (r, item) in reports.iter().zip(items) {
            if !item.lists(r) {
                listed = false;
                break;
            }
            states.extend_from_slice(item.listed_state());
            push_figures::<REFUSED>(&mut states, plan, r);
        }
        let policies = plan.policies.text_of(items);
        if let (true, Some(policies), Some(states)) = (listed, policies, states.get(2..)) {
            set(POLICY, policies);
            set(RATELIMIT, states);
            return;
        }
        states.clear();
    }
    let mut policies = Vec::with_capacity(64 * reports.len());
    // Each name once without looking: a request has one bucket per rule,
    // and a global rule and its stand-in, which share a name, never report
    // together (the stand-in decides only when the gateway does not). A
    // look back over the earlier reports cost c4 850 instructions.
    for r in reports {
        let Some(rule) = plan.rules.get(r.rule) else {
            continue;
        };
        let text = rule
            .variants
            .get(r.variant)
            .and_then(|v| v.texts.get(r.limit));
        match (r.enforced, text) {
            (None, Some(text)) => {
                policies.extend_from_slice(text.listed_policy().as_bytes());
                states.extend_from_slice(text.listed_state().as_bytes());
            }
            (Some(e), _) => {
                // A limit the gateway stated: written here, rarely.
                let (quota, window) = (e.requests, e.window_secs());
                let mut item = String::from(", ");
                push_stated(
                    &mut item,
                    &rule.name,
                    r.limit,
                    quota,
                    window,
                    rule.in_flight,
                );
                policies.extend_from_slice(item.as_bytes());
                item.clear();
                item.push_str(", ");
                push_policy_name(&mut item, &rule.name, r.limit);
                item.push_str(";r=");
                states.extend_from_slice(item.as_bytes());
            }
            // A limit the plan does not have: not shown, as [`shown`].
            (None, None) => continue,
        }
        push_figures::<REFUSED>(&mut states, plan, r);
    }
    // Each list without the `, ` before its first item.
    if let (Some(policies), Some(states)) = (policies.get(2..), states.get(2..)) {
        set(POLICY, policies);
        set(RATELIMIT, states);
    }
}

/// Appends the remaining and `;t=<reset>` of `r`'s service-limit item. A
/// refused request's limits that let it through were not charged: they
/// show the figures before it (its denying limits' are already those).
#[inline(always)]
fn push_figures<const REFUSED: bool>(out: &mut Vec<u8>, plan: &Plan, r: &Report) {
    // Read in place unless refused: a copy of a report's figures is 32 bytes.
    let (remaining, reset_ns) = if REFUSED {
        let u = uncharged(plan, r);
        (u.check.remaining, u.check.reset_ns)
    } else {
        (r.check.remaining, r.check.reset_ns)
    };
    match ceil_secs(reset_ns) {
        // Most resets of a request let through are under ten seconds: the
        // `;t=` and the digit copied with the remaining.
        reset @ 0..=9 => {
            let t = RESET_0 + ((reset as u32) << 24);
            digits::push_then(out, remaining, t.to_le_bytes());
        }
        reset => {
            digits::push(out, remaining);
            out.extend_from_slice(b";t=");
            digits::push(out, reset);
        }
    }
}

/// `;t=0`, as the four bytes of a little-endian `u32`: a reset under ten is
/// its digit added to the last byte.
const RESET_0: u32 = u32::from_le_bytes(*b";t=0");

/// `r` as if its limit had not been charged, for a refused request: what is
/// left now ([`Report::uncharged`] against the limit it was checked against,
/// the gateway's own for a limit it stated).
pub fn uncharged(plan: &Plan, r: &Report) -> Report {
    match (r.enforced, plan.limits(r.rule, r.variant).get(r.limit)) {
        (Some(e), _) => r.uncharged(&e.limit()),
        (None, Some((limit, _))) => r.uncharged(limit),
        (None, None) => *r,
    }
}

/// Appends the policy item of a limit the plan has no text for (one the
/// gateway stated): the name of limit `limit` of rule `rule`, its quota and
/// window, or for a concurrency limit its unit and no window.
fn push_stated(out: &mut String, rule: &str, limit: usize, quota: u64, window: u64, slots: bool) {
    push_policy_name(out, rule, limit);
    out.push_str(";q=");
    out.push_str(itoa::Buffer::new().format(quota));
    if slots {
        out.push_str(";qu=\"concurrent-requests\"");
    } else {
        out.push_str(";w=");
        out.push_str(itoa::Buffer::new().format(window));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config;
    use crate::limits::limiter::Seen;

    const SEC: u64 = 1_000_000_000;

    fn plan() -> Plan {
        let json = r#"{"domain":"d","rules":[
            {"name":"per-client","limits":[{"requests":60,"per":"1m"},{"requests":10,"per":"1s"}]},
            {"name":"uploads","limits":[{"requests":5,"per":"1m"}]},
            {"name":"streams","limits":[{"concurrent":4}]}]}"#;
        Plan::compile(&config::parse(json.as_bytes()).unwrap(), [0; 16])
    }

    fn report(
        rule: usize,
        limit: usize,
        allowed: bool,
        remaining: u64,
        reset_s: u64,
        retry_ns: u64,
    ) -> Report {
        Report {
            rule,
            limit,
            check: Seen {
                allowed,
                remaining,
                reset_ns: reset_s * SEC,
                retry_after_ns: retry_ns,
            },
            variant: 0,
            used_share: 0.0,
            blocked: false,
            cost: 1,
            enforced: None,
        }
    }

    #[test]
    fn allowed_shows_the_limit_closest_to_exhaustion_in_both_styles() {
        let p = plan();
        let reports = [
            report(0, 0, true, 48, 12, 0),
            report(0, 1, true, 2, 1, 0),
            report(1, 0, true, 4, 12, 0),
        ];
        let s = closest(&p, &reports).unwrap();
        assert_eq!(
            render(HeaderStyle::Both, &s),
            [
                ("x-ratelimit-limit", "10".to_string()),
                ("x-ratelimit-remaining", "2".into()),
                ("x-ratelimit-reset", "1".into()),
                ("ratelimit-policy", "\"per-client/1\";q=10;w=1".into()),
                ("ratelimit", "\"per-client/1\";r=2;t=1".into()),
            ]
        );
        assert_eq!(render(HeaderStyle::Legacy, &s).len(), 3);
        assert_eq!(render(HeaderStyle::Ietf, &s)[0].0, "ratelimit-policy");
        assert!(render(HeaderStyle::None, &s).is_empty());
    }

    const STYLES: [HeaderStyle; 4] = [
        HeaderStyle::Both,
        HeaderStyle::Legacy,
        HeaderStyle::Ietf,
        HeaderStyle::None,
    ];

    /// A limit the gateway stated: 7 per minute, as limit `limit` of `rule`.
    fn stated(rule: usize, limit: usize, remaining: u64, reset_s: u64) -> Report {
        let mut r = report(rule, limit, true, remaining, reset_s, 0);
        r.enforced = Some(crate::limits::limiter::Enforced {
            requests: 7,
            window_ms: 60_000,
        });
        r
    }

    #[test]
    fn one_limit_is_sent_as_render_writes_it_then_the_extra_lines() {
        for style in STYLES {
            let mut p = plan();
            p.header_style = style;
            for one in [report(0, 1, true, 2, 1, 0), stated(1, 0, 1, 30)] {
                let mut passing = Passing::of(vec![one]);
                passing.extra.push(warning("uploads", 0.9));
                let mut want = render(style, &closest(&p, &[one]).unwrap());
                want.push(warning("uploads", 0.9));
                assert_eq!(passing.lines(&p), want);
            }
        }
        assert_eq!(Passing::of(Vec::new()).lines(&plan()), []);
    }

    #[test]
    fn every_limit_is_a_policy_of_its_own_in_each_style() {
        let reports = vec![
            report(0, 0, true, 48, 12, 0),
            report(0, 1, true, 2, 1, 0),
            report(1, 0, true, 4, 12, 0),
        ];
        let legacy = [
            ("x-ratelimit-limit", "10".to_string()),
            ("x-ratelimit-remaining", "2".into()),
            ("x-ratelimit-reset", "1".into()),
        ];
        let ietf = [
            (
                "ratelimit-policy",
                "\"per-client\";q=60;w=60, \"per-client/1\";q=10;w=1, \"uploads\";q=5;w=60"
                    .to_string(),
            ),
            (
                "ratelimit",
                "\"per-client\";r=48;t=12, \"per-client/1\";r=2;t=1, \"uploads\";r=4;t=12".into(),
            ),
        ];
        for (style, want) in [
            (HeaderStyle::Both, [&legacy[..], &ietf[..]].concat()),
            (HeaderStyle::Legacy, legacy.to_vec()),
            (HeaderStyle::Ietf, ietf.to_vec()),
            (HeaderStyle::None, Vec::new()),
        ] {
            let mut p = plan();
            p.header_style = style;
            let mut passing = Passing::of(reports.clone());
            passing.extra.push(warning("uploads", 0.9));
            let mut want = want;
            want.push(warning("uploads", 0.9));
            assert_eq!(passing.lines(&p), want, "{style:?}");
        }
    }

    #[test]
    fn stated_and_concurrency_limits_are_listed_with_their_own_names() {
        let p = plan();
        let reports = vec![
            stated(0, 1, 5, 40),
            report(2, 0, true, 3, 0, 0),
            stated(1, 0, 6, 9),
        ];
        let lines = Passing::of(reports).lines(&p);
        let policy = "\"per-client/1\";q=7;w=60, \"streams\";q=4;qu=\"concurrent-requests\", \
                      \"uploads\";q=7;w=60";
        let state = "\"per-client/1\";r=5;t=40, \"streams\";r=3;t=0, \"uploads\";r=6;t=9";
        assert_eq!(
            lines.get(3..),
            Some(
                &[
                    ("ratelimit-policy", policy.into()),
                    ("ratelimit", state.into())
                ][..]
            )
        );
        // The legacy lines are the closest limit's: 3 slots left.
        assert_eq!(lines.first(), Some(&("x-ratelimit-limit", "4".to_string())));
    }

    /// The proxy-wasm header map as the host SDK encodes it: the count,
    /// each name's and value's length, then each NUL-terminated.
    fn reference_map(lines: &[(String, String)]) -> Vec<u8> {
        let mut map = (lines.len() as u32).to_le_bytes().to_vec();
        for (n, v) in lines {
            map.extend_from_slice(&(n.len() as u32).to_le_bytes());
            map.extend_from_slice(&(v.len() as u32).to_le_bytes());
        }
        for (n, v) in lines {
            map.extend_from_slice(n.as_bytes());
            map.push(0);
            map.extend_from_slice(v.as_bytes());
            map.push(0);
        }
        map
    }

    proptest::proptest! {
        /// Any number of lines, below and past the lengths' room, makes the
        /// map the SDK would have made, and reads back as written.
        #[test]
        fn local_headers_are_the_proxy_wasm_map(
            lines in proptest::collection::vec(("[a-z-]{0,20}", "[ -~]{0,40}"), 0..20),
        ) {
            let mut h = LocalHeaders::default();
            for (n, v) in &lines {
                h.push(n, v);
            }
            proptest::prop_assert_eq!(h.len(), lines.len());
            proptest::prop_assert_eq!(&h.lines(), &lines);
            proptest::prop_assert_eq!(h.take_map(), reference_map(&lines));
        }
    }

    #[test]
    fn a_named_line_is_the_line_its_name_writes() {
        let names = [
            X_LIMIT,
            X_REMAINING,
            X_RESET,
            POLICY,
            RATELIMIT,
            RETRY_AFTER,
            CONTENT_TYPE,
        ];
        let (mut named, mut plain) = (LocalHeaders::default(), LocalHeaders::default());
        for (i, n) in names.iter().enumerate() {
            assert!(!n.as_str().is_empty() && !n.as_str().contains('\0'));
            let value = "v".repeat(i);
            named.push_named(*n, value.as_bytes());
            plain.push(n.as_str(), &value);
            // Plain lines between named ones, past the lengths' room.
            named.push("x-other", "1");
            plain.push("x-other", "1");
        }
        assert_eq!(named.lines(), plain.lines());
        assert_eq!(named.take_map(), plain.take_map());
    }

    #[test]
    fn a_local_answer_lists_every_limit_uncharged() {
        let denied = [
            report(0, 0, false, 0, 60, 1_500_000_000),
            report(0, 1, true, 3, 1, 0),
            report(1, 0, false, 0, 60, 12 * SEC),
        ];
        let owned = |lines: HeaderLines| -> Vec<(String, String)> {
            lines.into_iter().map(|(n, v)| (n.to_string(), v)).collect()
        };
        let denying = [denied[0], denied[2]];
        for style in STYLES {
            let mut p = plan();
            p.header_style = style;
            // Limits that all denied: the IETF lines a passing response of
            // them has (its legacy ones are of the closest, not the binding).
            let ietf = |lines: Vec<(String, String)>| -> Vec<(String, String)> {
                lines
                    .into_iter()
                    .filter(|(n, _)| n.starts_with("ratelimit"))
                    .collect()
            };
            let s = binding(&p, &denying).unwrap();
            let want = ietf(owned(Passing::of(denying.to_vec()).lines(&p)));
            let got = ietf(LocalHeaders::of(&p, Some(&s), &denying).lines());
            let listed = matches!(style, HeaderStyle::Both | HeaderStyle::Ietf);
            assert_eq!(got.len(), if listed { 2 } else { 0 });
            assert_eq!(got, want);
            // One limit: what render writes.
            let s = binding(&p, &denied[2..]).unwrap();
            let want = owned(render(style, &s));
            assert_eq!(LocalHeaders::of(&p, Some(&s), &denied[2..]).lines(), want);
            assert!(LocalHeaders::of(&p, None, &denied).is_empty());
        }
        // The legacy lines of the limit with the longest wait; every limit in
        // the IETF ones, the one that let the request through uncharged: 4
        // left, not the 3 its charge would have left.
        let p = plan();
        let s = binding(&p, &denied).unwrap();
        let want = [
            ("x-ratelimit-limit", "5"),
            ("x-ratelimit-remaining", "0"),
            ("x-ratelimit-reset", "60"),
            (
                "ratelimit-policy",
                "\"per-client\";q=60;w=60, \"per-client/1\";q=10;w=1, \"uploads\";q=5;w=60",
            ),
            (
                "ratelimit",
                "\"per-client\";r=0;t=60, \"per-client/1\";r=4;t=1, \"uploads\";r=0;t=60",
            ),
        ]
        .map(|(n, v)| (n.to_string(), v.to_string()));
        assert_eq!(LocalHeaders::of(&p, Some(&s), &denied).lines(), want);
        assert_eq!(LocalHeaders::default().take_map(), [0, 0, 0, 0]);
    }

    #[test]
    fn a_map_taken_twice_is_empty_the_second_time() {
        let mut h = LocalHeaders::default();
        h.push("retry-after", "3");
        let first = h.take_map();
        assert_eq!(first.get(..4), Some(&1u32.to_le_bytes()[..]));
        assert!(h.is_taken());
        assert_eq!(h.take_map(), Vec::<u8>::new());
    }

    #[test]
    fn the_plans_ready_texts_are_what_render_would_write() {
        let p = plan();
        for (rule, limit) in [(0, 0), (0, 1), (1, 0), (2, 0)] {
            let s = closest(&p, &[report(rule, limit, true, 3, 7, 0)]).unwrap();
            assert!(s.text.is_some());
            let formatted = Shown {
                text: None,
                ..s.clone()
            };
            for style in STYLES {
                assert_eq!(render(style, &s), render(style, &formatted));
            }
        }
    }

    #[test]
    fn jitter_stays_within_its_share_and_warning_format() {
        assert_eq!(jittered(100, 0.1, 0.0), 100);
        assert_eq!(jittered(100, 0.1, 0.5), 105);
        assert_eq!(jittered(100, 0.1, 0.999_999), 110);
        assert_eq!(jittered(1, 0.5, 0.0), 1);
        assert_eq!(jittered(1, 0.5, 0.9), 2);
        for u in [0.0, 0.3, 0.7, 0.999] {
            assert!(jittered(360, 0.1, u) >= 360);
        }
        assert_eq!(
            warning("api", 0.849),
            (WARNING, "\"api\";used=85".to_string())
        );
    }

    #[test]
    fn denial_reports_the_longest_wait_rounded_up_and_each_violated_rule_once() {
        let p = plan();
        let reports = [
            report(0, 0, false, 0, 60, 1_500_000_000),
            report(0, 1, false, 0, 1, 100),
            report(1, 0, false, 0, 60, 12 * SEC),
        ];
        let s = binding(&p, &reports).unwrap();
        assert_eq!((s.policy, s.retry_after_secs, s.quota), ("uploads", 12, 5));
        assert_eq!(violated(&p, &reports), ["per-client", "uploads"]);
        let tiny = [report(0, 1, false, 0, 1, 1)];
        assert_eq!(binding(&p, &tiny).unwrap().retry_after_secs, 1);
    }

    proptest::proptest! {
        /// Each failing rule's name once, in the order of its first failing
        /// report, however the reports interleave (the list it replaced).
        #[test]
        fn violated_names_each_failing_rule_once_in_report_order(
            seen in proptest::collection::vec((0..3usize, proptest::bool::ANY), 0..24),
        ) {
            let p = plan();
            let reports: Vec<Report> = seen
                .iter()
                .map(|&(rule, allowed)| report(rule, 0, allowed, 0, 60, SEC))
                .collect();
            let mut want: Vec<&str> = Vec::new();
            for r in reports.iter().filter(|r| !r.check.allowed) {
                if let Some(rule) = p.rules.get(r.rule) {
                    if !want.contains(&rule.name.as_str()) {
                        want.push(&rule.name);
                    }
                }
            }
            proptest::prop_assert_eq!(violated(&p, &reports), want);
        }
    }
}
