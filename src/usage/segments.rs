//! The meter's path segments, laid out flat once per scan: per path and
//! level, its bytes and the array index it names, so that a key or an
//! index is matched against the paths of a mask without walking the terms.

use super::path::{array_index, Path};

/// One path's segment at one level.
#[derive(Clone, Copy, Debug, Default)]
struct Span {
    /// The path has a segment at this level.
    present: bool,
    start: usize,
    len: usize,
    /// The array index the segment names, if it names one.
    index: Option<u64>,
}

/// Every path's segments, `deepest` spans a path, their bytes in one buffer.
#[derive(Debug)]
pub struct Segments {
    deepest: usize,
    spans: Vec<Span>,
    bytes: Vec<u8>,
}

impl Segments {
    /// The segments of `paths` (levels past `deepest` are cut; a path out
    /// of [`Path::within_bounds`] gets none).
    pub fn new<'a>(paths: impl Iterator<Item = &'a Path> + Clone, deepest: usize) -> Segments {
        let usable = |p: &&Path| p.within_bounds();
        let total = paths
            .clone()
            .filter(usable)
            .flat_map(|p| &p.0)
            .map(Vec::len)
            .sum();
        let mut table = Segments {
            deepest,
            spans: Vec::with_capacity(paths.clone().count() * deepest),
            bytes: Vec::with_capacity(total),
        };
        for path in paths {
            if !path.within_bounds() {
                table
                    .spans
                    .extend(std::iter::repeat_n(Span::default(), deepest));
                continue;
            }
            for level in 0..deepest {
                let span = path.0.get(level).map_or(Span::default(), |s| Span {
                    present: true,
                    start: table.bytes.len(),
                    len: s.len(),
                    index: array_index(s),
                });
                table
                    .bytes
                    .extend_from_slice(path.0.get(level).map_or(&[][..], Vec::as_slice));
                table.spans.push(span);
            }
        }
        table
    }

    /// The paths of `mask` whose segment at `level` is `key`.
    pub fn key(&self, mask: u64, level: usize, key: &[u8]) -> u64 {
        self.select(mask, level, |span| {
            span.len == key.len() && self.bytes.get(span.start..span.start + span.len) == Some(key)
        })
    }

    /// The paths of `mask` whose segment at `level` is array index `index`.
    pub fn index(&self, mask: u64, level: usize, index: u64) -> u64 {
        self.select(mask, level, |span| span.index == Some(index))
    }

    /// The paths of `mask` with a segment at `level` that `pick`s.
    fn select(&self, mask: u64, level: usize, pick: impl Fn(&Span) -> bool) -> u64 {
        let mut rest = mask;
        let mut out = 0;
        while rest != 0 {
            let i = rest.trailing_zeros() as usize;
            rest &= rest - 1;
            let span = self.spans.get(i * self.deepest + level);
            if span.is_some_and(|s| s.present && pick(s)) {
                out |= 1 << i;
            }
        }
        out
    }

    /// The heap bytes the table holds.
    #[cfg(test)]
    pub fn heap_bytes(&self) -> usize {
        self.spans.capacity() * std::mem::size_of::<Span>() + self.bytes.capacity()
    }
}
