//! A streaming JSON scanner: bytes in, in chunks of any size, and the value
//! at each of a meter's paths out, in state bounded by the meter (one frame
//! per path segment, a key prefix as long as the longest segment) however
//! long or deep the document is. Nesting is counted, never recursed into,
//! and nothing is buffered; inside strings it jumps to the next `"` or `\`.

use super::meter::{Meter, Slot, MAX_PATHS};
use super::path::MAX_SEGMENTS;
use super::segments::Segments;

/// Containers this deep are checked (their kinds kept one bit each);
/// deeper ones are only skimmed: brackets counted and strings closed.
const CHECKED_LEVELS: usize = 4096;

/// Where the scanner is in the JSON grammar.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum St {
    /// Expecting a value (the document's, a member's, an element's).
    Value,
    /// After `[`: a value or `]`.
    ArrFirst,
    /// After `{`: a key or `}`.
    ObjFirst,
    /// After `,` in an object: a key.
    Key,
    /// After a key: `:`.
    Colon,
    /// After a value inside a container: `,` or its closing bracket.
    After,
    /// Inside a string (a key, a value or a skimmed one: [`Scanner::ctx`]).
    Str,
    /// After `\` in a string.
    Esc,
    /// After `\u` and this many hex digits.
    Hex(u8),
    /// Inside a number.
    Num(Num),
    /// Inside `true`, `false` or `null`, this many bytes in.
    Lit(&'static [u8], usize),
    /// Inside a container past [`CHECKED_LEVELS`].
    Skim,
    /// The document is complete: only whitespace may follow.
    Done,
    /// Not JSON: the rest is ignored.
    Error,
}

/// Where a number is in its grammar (`-? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Num {
    Minus,
    Zero,
    Int,
    Dot,
    Frac,
    E,
    ESign,
    Exp,
}

/// What a string's bytes are for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ctx {
    /// An object's key a path may name: decoded into [`Scanner::key`].
    Key,
    /// A key no path can name (its object is off every path): only checked.
    OtherKey,
    /// A value: only checked.
    Value,
    /// Inside a skimmed container.
    Skim,
}

/// One open container within the paths' depth.
#[derive(Clone, Copy, Debug, Default)]
struct Frame {
    /// Paths that may still end inside this container.
    mask: u64,
    /// Paths whose segment matched the current member's key.
    child: u64,
    /// The current element's index, in an array.
    index: u64,
}

/// The bounded state of one document's scan against a meter's paths.
#[derive(Debug)]
pub struct Scanner {
    st: St,
    ctx: Ctx,
    /// Open containers.
    depth: usize,
    /// One bit per checked level: set for an array.
    kinds: Vec<u64>,
    /// One frame per level a path reaches.
    frames: Vec<Frame>,
    /// Open containers inside the skimmed one.
    skim: u64,
    /// The current key, decoded, kept up to `key_cap` bytes: a longer key
    /// matches no segment.
    key: Vec<u8>,
    key_cap: usize,
    /// The key holds a lone surrogate: it matches nothing.
    key_bad: bool,
    hex: u32,
    high: Option<u32>,
    num: u64,
    num_neg: bool,
    /// Paths the current number ends.
    num_targets: u64,
    /// The paths in bounds.
    all: u64,
    /// Paths by length: `lens[n]` has the paths of `n` segments.
    lens: [u64; MAX_SEGMENTS + 1],
    /// What the document holds at each path, indexed as [`Meter::paths`].
    slots: Vec<Slot>,
    /// The paths' segments, to match keys and indices against.
    segments: Segments,
}

impl Scanner {
    /// A scanner for `meter`'s paths: its only allocations.
    pub fn new(meter: &Meter) -> Scanner {
        let mut all = 0u64;
        let mut lens = [0u64; MAX_SEGMENTS + 1];
        let (mut deepest, mut longest) = (0, 0);
        for (i, path) in meter.paths().enumerate().take(MAX_PATHS) {
            if !path.within_bounds() {
                continue;
            }
            all |= 1 << i;
            if let Some(l) = lens.get_mut(path.0.len()) {
                *l |= 1 << i;
            }
            deepest = deepest.max(path.0.len());
            longest = path.0.iter().map(Vec::len).fold(longest, usize::max);
        }
        Scanner {
            st: St::Value,
            ctx: Ctx::Value,
            depth: 0,
            kinds: vec![0; CHECKED_LEVELS / 64],
            frames: vec![Frame::default(); deepest],
            skim: 0,
            key: Vec::with_capacity(longest + 1),
            key_cap: longest + 1,
            key_bad: false,
            hex: 0,
            high: None,
            num: 0,
            num_neg: false,
            num_targets: 0,
            all,
            lens,
            slots: vec![Slot::Absent; meter.paths().count().min(MAX_PATHS)],
            segments: Segments::new(meter.paths().take(MAX_PATHS), deepest),
        }
    }

    /// Ready for the next document, keeping the allocations.
    pub fn reset(&mut self) {
        self.st = St::Value;
        self.depth = 0;
        self.skim = 0;
        self.slots.fill(Slot::Absent);
    }

    /// What the document holds at each path, in the order of the meter's
    /// terms and their `any_of` (meaningful once [`Scanner::complete`]).
    pub fn slots(&self) -> &[Slot] {
        &self.slots
    }

    /// Whether the bytes so far are one complete JSON document (a number at
    /// the top level ends here).
    pub fn complete(&mut self) -> bool {
        if let St::Num(n) = self.st {
            if self.depth == 0 {
                self.end_number(n);
            }
        }
        self.st == St::Done
    }

    /// The heap bytes the scanner holds: fixed at [`Scanner::new`].
    #[cfg(test)]
    pub fn state_bytes(&self) -> usize {
        self.kinds.capacity() * 8
            + self.frames.capacity() * std::mem::size_of::<Frame>()
            + self.key.capacity()
            + self.slots.capacity() * std::mem::size_of::<Slot>()
            + self.segments.heap_bytes()
    }

    /// Scans the next bytes of the document.
    pub fn feed(&mut self, bytes: &[u8]) {
        let mut rest = bytes;
        while let Some((&b, tail)) = rest.split_first() {
            rest = match self.st {
                St::Str => self.string_run(rest),
                St::Skim => self.skim_run(rest),
                St::Num(Num::Int) if b.is_ascii_digit() => self.digits(rest),
                St::Lit(word, at) if rest.starts_with(word.get(at..).unwrap_or_default()) => {
                    self.value_end();
                    self.punctuation(rest.get(word.len() - at..).unwrap_or_default())
                }
                St::Error => return,
                _ => {
                    self.byte(b);
                    tail
                }
            };
        }
    }

    /// Inside a string: everything up to the closing `"` at once. A
    /// one-letter escape outside a key is checked here and the run goes on,
    /// so prose with a `\n` every line costs no trip through [`Scanner::byte`].
    fn string_run<'a>(&mut self, mut bytes: &'a [u8]) -> &'a [u8] {
        loop {
            let end = memchr::memchr2(b'"', b'\\', bytes);
            let (run, stop) = match end {
                Some(n) => bytes.split_at(n),
                None => (bytes, &[][..]),
            };
            if self.ctx == Ctx::Key && !run.is_empty() {
                self.key_bytes(run);
            }
            match stop {
                [b'"', tail @ ..] => {
                    self.string_end();
                    return self.punctuation(tail);
                }
                [b'\\', c, tail @ ..] if self.ctx != Ctx::Key && plain_escape(*c) => bytes = tail,
                [_, tail @ ..] => {
                    self.st = St::Esc;
                    return tail;
                }
                [] => return stop,
            }
        }
    }

    /// Inside an integer: its digits at once, saturating.
    fn digits<'a>(&mut self, bytes: &'a [u8]) -> &'a [u8] {
        let n = bytes.iter().position(|b| !b.is_ascii_digit());
        let (digits, rest) = bytes.split_at(n.unwrap_or(bytes.len()));
        self.num = digits.iter().fold(self.num, |acc, &d| {
            acc.saturating_mul(10).saturating_add(u64::from(d - b'0'))
        });
        match rest.first() {
            Some(b'.' | b'e' | b'E') | None => rest,
            Some(_) => {
                self.end_number(Num::Int);
                self.punctuation(rest)
            }
        }
    }

    /// Right after a key, a string, a number or a literal: the `:` or `,`
    /// (and the next key's `"`) that compact JSON puts there, read at once
    /// rather than a byte a turn.
    fn punctuation<'a>(&mut self, bytes: &'a [u8]) -> &'a [u8] {
        match (self.st, bytes) {
            (St::Colon, [b':', rest @ ..]) => {
                self.st = St::Value;
                rest
            }
            (St::After, [b',', rest @ ..]) => {
                self.next_member();
                match (self.st, rest) {
                    (St::Key, [b'"', after @ ..]) => {
                        self.key_start();
                        after
                    }
                    _ => rest,
                }
            }
            _ => bytes,
        }
    }

    /// Inside a skimmed container: up to the next string or bracket at once.
    fn skim_run<'a>(&mut self, bytes: &'a [u8]) -> &'a [u8] {
        let end = bytes
            .iter()
            .position(|&c| matches!(c, b'"' | b'[' | b'{' | b']' | b'}'));
        let Some((&c, tail)) = end
            .and_then(|n| bytes.get(n..))
            .and_then(|s| s.split_first())
        else {
            return &[];
        };
        match c {
            b'"' => {
                self.ctx = Ctx::Skim;
                self.st = St::Str;
            }
            b'[' | b'{' => self.skim = self.skim.saturating_add(1),
            _ => {
                self.skim -= 1;
                if self.skim == 0 {
                    self.value_end();
                }
            }
        }
        tail
    }

    /// One byte outside strings and skimmed containers.
    fn byte(&mut self, b: u8) {
        let ws = b <= b' ' && matches!(b, b' ' | b'\t' | b'\n' | b'\r');
        match (self.st, b) {
            (St::Value | St::ArrFirst | St::ObjFirst | St::Key | St::Colon | St::After, _)
            | (St::Done, _)
                if ws => {}
            (St::ArrFirst | St::After, b']') => self.close(true),
            (St::ObjFirst | St::After, b'}') => self.close(false),
            (St::Value | St::ArrFirst, _) => self.begin(b),
            (St::ObjFirst | St::Key, b'"') => self.key_start(),
            (St::Colon, b':') => self.st = St::Value,
            (St::After, b',') => self.next_member(),
            (St::Esc, _) => self.escape(b),
            (St::Hex(n), _) => self.hex_digit(n, b),
            (St::Num(n), _) => self.number(n, b),
            (St::Lit(word, at), _) if word.get(at) == Some(&b) => {
                self.st = St::Lit(word, at + 1);
                if at + 1 == word.len() {
                    self.value_end();
                }
            }
            _ => self.st = St::Error,
        }
    }
}

/// Containers and values: where each starts and ends, and what it does to
/// the paths.
impl Scanner {
    /// A value starts with `b`: the paths it ends get what it is (decided
    /// at its end for a number), and the paths it leads on to follow it in.
    fn begin(&mut self, b: u8) {
        let mask = self.value_mask();
        let targets = mask & self.lens.get(self.depth).copied().unwrap_or(0);
        if mask != 0 {
            // A duplicate key: the last one wins, whatever the first held.
            self.mark(mask, Slot::Absent);
        }
        match b {
            b'{' | b'[' => {
                self.mark(targets, Slot::Invalid);
                self.open(b == b'[', mask & !targets);
            }
            b'"' => {
                self.mark(targets, Slot::Invalid);
                self.ctx = Ctx::Value;
                self.st = St::Str;
            }
            b'-' | b'0'..=b'9' => {
                self.num_targets = targets;
                self.num_neg = b == b'-';
                self.num = if self.num_neg { 0 } else { u64::from(b - b'0') };
                self.st = St::Num(match b {
                    b'-' => Num::Minus,
                    b'0' => Num::Zero,
                    _ => Num::Int,
                });
            }
            b't' | b'f' | b'n' => {
                if b != b'n' {
                    self.mark(targets, Slot::Invalid);
                }
                let word: &'static [u8] = match b {
                    b't' => b"true",
                    b'f' => b"false",
                    _ => b"null",
                };
                self.st = St::Lit(word, 1);
            }
            _ => self.st = St::Error,
        }
    }

    /// The paths the value about to start may lead to.
    fn value_mask(&self) -> u64 {
        let Some(level) = self.depth.checked_sub(1) else {
            return self.all;
        };
        match self.frames.get(level) {
            Some(f) if f.mask != 0 && self.is_array(level) => {
                self.segments.index(f.mask, level, f.index)
            }
            Some(f) if f.mask != 0 => f.child,
            _ => 0,
        }
    }

    /// Sets the slot of every path in `mask`.
    fn mark(&mut self, mask: u64, slot: Slot) {
        if mask == 0 {
            return;
        }
        for (i, s) in self.slots.iter_mut().enumerate() {
            if mask & (1 << i) != 0 {
                *s = slot;
            }
        }
    }

    /// Whether the container at `level` (0 the outermost) is an array.
    fn is_array(&self, level: usize) -> bool {
        let word = self.kinds.get(level / 64).copied().unwrap_or(0);
        word & (1 << (level % 64)) != 0
    }

    /// A container opens; past [`CHECKED_LEVELS`] it is only skimmed.
    fn open(&mut self, array: bool, mask: u64) {
        let level = self.depth;
        let Some(word) = self.kinds.get_mut(level / 64) else {
            self.skim = 1;
            self.st = St::Skim;
            return;
        };
        let bit = 1 << (level % 64);
        *word = if array { *word | bit } else { *word & !bit };
        if let Some(f) = self.frames.get_mut(level) {
            *f = Frame {
                mask,
                child: 0,
                index: 0,
            };
        }
        self.depth += 1;
        self.st = if array { St::ArrFirst } else { St::ObjFirst };
    }

    /// A closing bracket: it must close the innermost container.
    fn close(&mut self, array: bool) {
        match self.depth.checked_sub(1) {
            Some(level) if self.is_array(level) == array => {
                self.depth = level;
                self.value_end();
            }
            _ => self.st = St::Error,
        }
    }

    /// A value ended: the document, or a member or element of a container.
    fn value_end(&mut self) {
        self.st = if self.depth == 0 { St::Done } else { St::After };
    }

    /// A `,`: the next member's key, or the next element.
    fn next_member(&mut self) {
        let Some(level) = self.depth.checked_sub(1) else {
            self.st = St::Error;
            return;
        };
        if !self.is_array(level) {
            self.st = St::Key;
            return;
        }
        if let Some(f) = self.frames.get_mut(level) {
            f.index = f.index.saturating_add(1);
        }
        self.st = St::Value;
    }

    /// A byte of a number, or the byte after it.
    fn number(&mut self, n: Num, b: u8) {
        let next = match (n, b) {
            (Num::Minus, b'0') => Num::Zero,
            (Num::Minus | Num::Int, b'1'..=b'9') | (Num::Int, b'0') => {
                let digit = u64::from(b - b'0');
                self.num = self.num.saturating_mul(10).saturating_add(digit);
                Num::Int
            }
            (Num::Zero | Num::Int, b'.') => Num::Dot,
            (Num::Dot | Num::Frac, b'0'..=b'9') => Num::Frac,
            (Num::Zero | Num::Int | Num::Frac, b'e' | b'E') => Num::E,
            (Num::E, b'+' | b'-') => Num::ESign,
            (Num::E | Num::ESign | Num::Exp, b'0'..=b'9') => Num::Exp,
            _ => {
                // The byte after the number: the number ends, the byte is
                // read again in the state that follows (never a number).
                self.end_number(n);
                if self.st != St::Error {
                    self.byte(b);
                }
                return;
            }
        };
        self.st = St::Num(next);
    }

    /// The number ended in state `n`: a value at its paths if a
    /// non-negative integer, invalid if another number, an error if cut.
    fn end_number(&mut self, n: Num) {
        if !matches!(n, Num::Zero | Num::Int | Num::Frac | Num::Exp) {
            self.st = St::Error;
            return;
        }
        let slot = match n {
            Num::Zero | Num::Int if !self.num_neg => Slot::Value(self.num),
            _ => Slot::Invalid,
        };
        self.mark(self.num_targets, slot);
        self.value_end();
    }
}

/// Strings: keys decoded (escapes, surrogate pairs) into a bounded buffer
/// and compared with the paths' segments; values only checked.
impl Scanner {
    fn key_start(&mut self) {
        self.st = St::Str;
        let level = self.depth.wrapping_sub(1);
        if self.frames.get(level).is_none_or(|f| f.mask == 0) {
            self.ctx = Ctx::OtherKey;
            return;
        }
        self.key.clear();
        self.key_bad = false;
        self.high = None;
        self.ctx = Ctx::Key;
    }

    /// Decoded key bytes: kept up to `key_cap`, so that a longer key is
    /// still told apart from every segment.
    fn key_bytes(&mut self, bytes: &[u8]) {
        if self.high.take().is_some() {
            self.key_bad = true;
        }
        let room = self.key_cap.saturating_sub(self.key.len());
        self.key
            .extend_from_slice(bytes.get(..room.min(bytes.len())).unwrap_or_default());
    }

    /// The closing `"`: a key picks the paths whose segment it is.
    fn string_end(&mut self) {
        match self.ctx {
            Ctx::Key => {
                if self.high.take().is_some() {
                    self.key_bad = true;
                }
                self.st = St::Colon;
                let Some(level) = self.depth.checked_sub(1) else {
                    return;
                };
                let Some(f) = self.frames.get(level).copied() else {
                    return;
                };
                let child = match self.key_bad {
                    true => 0,
                    false => self.segments.key(f.mask, level, &self.key),
                };
                if let Some(f) = self.frames.get_mut(level) {
                    f.child = child;
                }
            }
            Ctx::OtherKey => self.st = St::Colon,
            Ctx::Value => self.value_end(),
            Ctx::Skim => self.st = St::Skim,
        }
    }

    /// The byte after `\`.
    fn escape(&mut self, b: u8) {
        let decoded = match b {
            b'"' | b'\\' | b'/' => b,
            b'b' => 0x08,
            b'f' => 0x0c,
            b'n' => b'\n',
            b'r' => b'\r',
            b't' => b'\t',
            b'u' => {
                self.hex = 0;
                self.st = St::Hex(0);
                return;
            }
            _ => {
                self.st = St::Error;
                return;
            }
        };
        if self.ctx == Ctx::Key {
            self.key_bytes(&[decoded]);
        }
        self.st = St::Str;
    }

    /// A hex digit of `\uXXXX`, `n` read before it.
    fn hex_digit(&mut self, n: u8, b: u8) {
        let Some(v) = char::from(b).to_digit(16) else {
            self.st = St::Error;
            return;
        };
        self.hex = self.hex << 4 | v;
        if n < 3 {
            self.st = St::Hex(n + 1);
            return;
        }
        self.st = St::Str;
        if self.ctx == Ctx::Key {
            self.code_unit(self.hex);
        }
    }

    /// A UTF-16 code unit of a key: a surrogate pair becomes one character;
    /// a lone surrogate makes the key match nothing.
    fn code_unit(&mut self, unit: u32) {
        let high = self.high.take();
        let c = match (high, unit) {
            (Some(h), 0xDC00..=0xDFFF) => 0x10000 + ((h - 0xD800) << 10) + (unit - 0xDC00),
            (_, 0xD800..=0xDBFF) => {
                self.key_bad |= high.is_some();
                self.high = Some(unit);
                return;
            }
            (_, 0xDC00..=0xDFFF) => {
                self.key_bad = true;
                return;
            }
            _ => {
                self.key_bad |= high.is_some();
                unit
            }
        };
        let mut utf8 = [0; 4];
        let s = char::from_u32(c).unwrap_or(char::REPLACEMENT_CHARACTER);
        self.key_bytes(s.encode_utf8(&mut utf8).as_bytes());
    }
}

/// An escape of one letter after `\` (any but `\u`).
fn plain_escape(c: u8) -> bool {
    matches!(c, b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't')
}
