//! Server-sent events framing (the WHATWG `text/event-stream` rules), as a
//! stream of pieces: the bytes of `data` fields, the line feed that joins
//! two `data` lines of one event, and the blank line that ends an event.
//! No line is buffered: a `data` value is handed on as it arrives.

/// What a stretch of the stream means to the event being read.
#[derive(Debug, PartialEq, Eq)]
pub enum Piece<'a> {
    /// Bytes of the event's data.
    Data(&'a [u8]),
    /// A second (third…) `data` line starts: its value is joined with `\n`.
    Join,
    /// A blank line ended an event that had data.
    Dispatch,
}

/// Where the framer is in a line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Line {
    /// At the start of a line.
    Start,
    /// In a field's name, this many bytes in; `data` while it may still be.
    Name { at: usize, data: bool },
    /// Right after the colon of a `data` line: one space is dropped.
    Space,
    /// In a `data` line's value.
    Data,
    /// In a comment or another field's line.
    Ignore,
}

/// The bounded state of a stream's framing.
#[derive(Debug)]
pub struct Framer {
    line: Line,
    /// The last line ended in `\r`: a `\n` right after it ends no line.
    cr: bool,
    /// The event has had a `data` line.
    has_data: bool,
}

impl Default for Framer {
    fn default() -> Framer {
        Framer {
            line: Line::Start,
            cr: false,
            has_data: false,
        }
    }
}

impl Framer {
    /// The next piece in `bytes` from `*at` on, with `*at` moved past it;
    /// `None` once the chunk is used up.
    pub fn next<'a>(&mut self, bytes: &'a [u8], at: &mut usize) -> Option<Piece<'a>> {
        loop {
            let rest = bytes.get(*at..).unwrap_or_default();
            let &b = rest.first()?;
            if std::mem::take(&mut self.cr) && b == b'\n' {
                // The `\n` of a `\r\n`, maybe in the next chunk.
                *at += 1;
                continue;
            }
            if b == b'\r' || b == b'\n' {
                *at += 1;
                self.cr = b == b'\r';
                match self.end_line() {
                    Some(piece) => return Some(piece),
                    None => continue,
                }
            }
            // Each state reads up to the line's end (or the chunk's) at once,
            // so each byte is looked at once.
            match self.line {
                Line::Start if b == b':' => self.line = Line::Ignore,
                Line::Start | Line::Name { .. } => {
                    if let Some(piece) = self.name(rest, at) {
                        return Some(piece);
                    }
                }
                Line::Space => {
                    *at += usize::from(b == b' ');
                    self.line = Line::Data;
                }
                Line::Data => {
                    let run = rest.get(..line_end(rest)).unwrap_or_default();
                    *at += run.len();
                    return Some(Piece::Data(run));
                }
                Line::Ignore => *at += line_end(rest),
            }
        }
    }

    /// Whether the stream ended inside an event that had data (its blank
    /// line missing).
    pub fn finish(&self) -> bool {
        self.has_data
    }

    /// A stretch of a field's name, up to its colon, the line's end or the
    /// chunk's: whether the field is `data` is decided at the colon.
    fn name(&mut self, rest: &[u8], at: &mut usize) -> Option<Piece<'static>> {
        let (seen, data) = match self.line {
            Line::Name { at, data } => (at, data),
            _ => (0, true),
        };
        let end = memchr::memchr3(b':', b'\r', b'\n', rest);
        let name = rest.get(..end.unwrap_or(rest.len())).unwrap_or_default();
        let colon = rest.get(name.len()).filter(|&&c| c == b':');
        let data = data && b"data".get(seen..).is_some_and(|d| d.starts_with(name));
        let seen = seen.saturating_add(name.len());
        *at += name.len();
        if colon.is_none() {
            self.line = Line::Name { at: seen, data };
            return None;
        }
        *at += 1;
        if data && seen == 4 {
            self.line = Line::Space;
            return self.data_line();
        }
        self.line = Line::Ignore;
        None
    }

    /// A `data` line starts: its value is joined to the event's data.
    fn data_line(&mut self) -> Option<Piece<'static>> {
        let join = std::mem::replace(&mut self.has_data, true);
        join.then_some(Piece::Join)
    }

    /// A line ended: a blank one ends the event, a bare `data` adds an
    /// empty line to it.
    fn end_line(&mut self) -> Option<Piece<'static>> {
        match std::mem::replace(&mut self.line, Line::Start) {
            Line::Start => std::mem::take(&mut self.has_data).then_some(Piece::Dispatch),
            Line::Name { at: 4, data: true } => self.data_line(),
            _ => None,
        }
    }
}

/// Where the line in `bytes` ends (or the chunk, if it does not).
fn line_end(bytes: &[u8]) -> usize {
    memchr::memchr2(b'\r', b'\n', bytes).unwrap_or(bytes.len())
}
