//! Finding the next of two bytes eight at a time (one `u64` compare per
//! eight bytes, also in wasm): how strings and lines are skipped, where the
//! bulk of a body's bytes are.

const ONES: u64 = u64::from_le_bytes([0x01; 8]);
const HIGHS: u64 = u64::from_le_bytes([0x80; 8]);

/// Where the first `a` or `b` in `bytes` is.
pub fn find2(bytes: &[u8], a: u8, b: u8) -> Option<usize> {
    let mut words = bytes.chunks_exact(8);
    let mut at = 0;
    for word in &mut words {
        let Ok(word) = <[u8; 8]>::try_from(word) else {
            break;
        };
        let v = u64::from_le_bytes(word);
        let hits = zero_bytes(v ^ (ONES * u64::from(a))) | zero_bytes(v ^ (ONES * u64::from(b)));
        if hits != 0 {
            // The lowest flagged byte is exact (a borrow only flags bytes
            // above a real zero), and the lowest byte comes first.
            return Some(at + (hits.trailing_zeros() / 8) as usize);
        }
        at += 8;
    }
    let tail = words.remainder().iter().position(|&c| c == a || c == b);
    tail.map(|i| at + i)
}

/// The high bit of each zero byte of `v` set (and maybe of bytes above the
/// first zero byte).
fn zero_bytes(v: u64) -> u64 {
    v.wrapping_sub(ONES) & !v & HIGHS
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn find2_is_position(bytes in prop::collection::vec(prop_oneof![Just(b'"'), Just(b'\\'), Just(0u8), Just(0x80u8), Just(0x22u8 ^ 0x80), any::<u8>()], 0..40), skip in 0usize..8) {
            let bytes = bytes.get(skip.min(bytes.len())..).unwrap();
            let expected = bytes.iter().position(|&c| c == b'"' || c == b'\\');
            prop_assert_eq!(find2(bytes, b'"', b'\\'), expected);
            let expected = bytes.iter().position(|&c| c == b'\r' || c == b'\n');
            prop_assert_eq!(find2(bytes, b'\r', b'\n'), expected);
        }
    }

    #[test]
    fn find2_finds_the_first_of_many() {
        assert_eq!(find2(b"", b'a', b'b'), None);
        assert_eq!(find2(b"xxxxxxxxxxxxxxxb", b'a', b'b'), Some(15));
        assert_eq!(find2(b"xxxxxxxab\x00\x00\x00", b'a', b'b'), Some(7));
        assert_eq!(find2(&[0u8; 9], 0, 1), Some(0));
        assert_eq!(find2(&[1, 0, 0, 0, 0, 0, 0, 0, 1], 0, 2), Some(1));
    }
}
