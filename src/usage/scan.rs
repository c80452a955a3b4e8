//! One body's scan: chunks in, in order, and its [`Usage`] when it ends.
//! A plain JSON body is one document; an event stream is many, one per
//! event, and each term takes its value from the last event that has it.

use super::json::Scanner;
use super::meter::{Meter, Slot, Usage};
use super::sse::{Framer, Piece};

/// How the body is framed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Framing {
    /// One JSON document (`application/json`).
    Json,
    /// Server-sent events (`text/event-stream`), each event's data one JSON
    /// document; an event whose data is not JSON (`[DONE]`) adds nothing.
    Sse,
}

/// The bounded state of one body's scan: fixed when it is made, whatever
/// the body holds.
#[derive(Debug)]
pub struct Scan {
    json: Scanner,
    /// `Some` for an event stream.
    sse: Option<Framer>,
    /// Per term, in an event stream: its slot in the last event that had it.
    last: Vec<Slot>,
    /// Bytes fed so far (saturating).
    fed: u64,
}

impl Scan {
    /// A scan of a body framed as `framing`, against `meter`; its only
    /// allocations.
    pub fn new(meter: &Meter, framing: Framing) -> Scan {
        Scan {
            json: Scanner::new(meter),
            sse: (framing == Framing::Sse).then(Framer::default),
            last: match framing {
                Framing::Json => Vec::new(),
                Framing::Sse => vec![Slot::Absent; meter.terms.len()],
            },
            fed: 0,
        }
    }

    /// The body's next bytes; past `meter.scan_limit` they are not read.
    /// `meter` is the one the scan was made with.
    pub fn feed(&mut self, meter: &Meter, chunk: &[u8]) {
        let len = u64::try_from(chunk.len()).unwrap_or(u64::MAX);
        self.fed = self.fed.saturating_add(len);
        if self.over_limit(meter) {
            return;
        }
        let Some(sse) = &mut self.sse else {
            return self.json.feed(chunk);
        };
        let mut at = 0;
        while let Some(piece) = sse.next(chunk, &mut at) {
            match piece {
                Piece::Data(bytes) => self.json.feed(bytes),
                Piece::Join => self.json.feed(b"\n"),
                Piece::Dispatch => {
                    merge(meter, &mut self.json, &mut self.last);
                    self.json.reset();
                }
            }
        }
    }

    /// Whether the body has passed `meter.scan_limit`: nothing more is
    /// read, and [`Scan::finish`] will say [`Usage::OverLimit`].
    pub fn over_limit(&self, meter: &Meter) -> bool {
        self.fed > meter.scan_limit
    }

    /// The usage the body reported. An event stream's last event counts
    /// even without its closing blank line, if its data is complete JSON.
    pub fn finish(mut self, meter: &Meter) -> Usage {
        if self.over_limit(meter) {
            return Usage::OverLimit;
        }
        match &self.sse {
            None if self.json.complete() => meter.total(meter.pick(self.json.slots())),
            None => Usage::Missing,
            Some(sse) => {
                if sse.finish() {
                    merge(meter, &mut self.json, &mut self.last);
                }
                meter.total(self.last.iter().copied())
            }
        }
    }

    /// The heap bytes the scan holds: fixed at [`Scan::new`].
    #[cfg(test)]
    pub fn state_bytes(&self) -> usize {
        self.json.state_bytes() + self.last.capacity() * std::mem::size_of::<Slot>()
    }
}

/// An event ended: if its data was one JSON document, each term it has
/// takes its slot from it.
fn merge(meter: &Meter, json: &mut Scanner, last: &mut [Slot]) {
    if !json.complete() {
        return;
    }
    for (slot, found) in last.iter_mut().zip(meter.pick(json.slots())) {
        if found != Slot::Absent {
            *slot = found;
        }
    }
}
