//! Decimal numbers appended to a header value in one or two copies: up to
//! three digits from a table, up to eight spread into the bytes of a `u64`
//! by a few multiplications (each 32-bit half holds four, each 16-bit
//! quarter two, each byte one), and what follows the number in the same
//! copy where it fits. A `RateLimit` field holds two numbers per limit;
//! `itoa` into its own buffer and a copy from there cost c4's eight limits
//! (remaining counts of eight and nine digits) about 90 wasm instructions
//! a number, three digits at a time from a table about 80.

/// `000` to `999`, the first digit in the lowest byte.
// Evaluated by the compiler: an index out of bounds fails the build.
#[allow(clippy::indexing_slicing)]
static THREE: [u32; 1000] = {
    let mut t = [0u32; 1000];
    let mut i = 0;
    while i < 1000 {
        let digits = [(i / 100) as u8, (i / 10 % 10) as u8, (i % 10) as u8, 0];
        t[i] = u32::from_le_bytes(digits) + 0x0030_3030;
        i += 1;
    }
    t
};

/// Eight zero digits, `0` in each byte.
const ASCII_ZEROS: u64 = 0x3030_3030_3030_3030;
/// Numbers of up to eight digits.
const E8: u64 = 100_000_000;

/// Appends `n` in decimal, without leading zeros.
pub fn push(out: &mut Vec<u8>, n: u64) {
    if n < 1000 {
        let (skip, digits) = three(n);
        out.extend_from_slice(digits.to_le_bytes().get(skip..3).unwrap_or_default());
    } else if n < E8 {
        let (skip, digits) = eight(n);
        out.extend_from_slice(digits.to_le_bytes().get(skip..).unwrap_or_default());
    } else if n < 1000 * E8 {
        let (skip, digits) = three(n / E8);
        out.extend_from_slice(digits.to_le_bytes().get(skip..3).unwrap_or_default());
        out.extend_from_slice(&(spread(n % E8) + ASCII_ZEROS).to_le_bytes());
    } else {
        large(out, n);
    }
}

/// Appends `n` in decimal and then `tail`, in one copy unless `n` has nine
/// digits or more: a service-limit item's remaining and its `;t=<d>`.
pub fn push_then(out: &mut Vec<u8>, n: u64, tail: [u8; 4]) {
    let tail = u32::from_le_bytes(tail);
    if n < 1000 {
        let (skip, digits) = three(n);
        let both = u64::from(digits) | (u64::from(tail) << 24);
        out.extend_from_slice(both.to_le_bytes().get(skip..7).unwrap_or_default());
    } else if n < E8 {
        let (skip, digits) = eight(n);
        let both = u128::from(digits) | (u128::from(tail) << 64);
        out.extend_from_slice(both.to_le_bytes().get(skip..12).unwrap_or_default());
    } else if n < 1000 * E8 {
        let (skip, digits) = three(n / E8);
        out.extend_from_slice(digits.to_le_bytes().get(skip..3).unwrap_or_default());
        let digits = spread(n % E8) + ASCII_ZEROS;
        let both = u128::from(digits) | (u128::from(tail) << 64);
        out.extend_from_slice(both.to_le_bytes().get(..12).unwrap_or_default());
    } else {
        large(out, n);
        out.extend_from_slice(&tail.to_le_bytes());
    }
}

/// The three digits of `n < 1000`, and how many of them lead with zeros
/// (`0` keeps its one digit).
fn three(n: u64) -> (usize, u32) {
    let skip = usize::from(n < 100) + usize::from(n < 10);
    (skip, THREE.get(n as usize).copied().unwrap_or_default())
}

/// The eight digits of `1000 <= n < 10^8`, and how many of them lead with
/// zeros (the low bytes).
fn eight(n: u64) -> (usize, u64) {
    let digits = spread(n);
    ((digits.trailing_zeros() / 8) as usize, digits + ASCII_ZEROS)
}

/// Appends `n` of twelve digits or more, which no limit reaches. Out of line:
/// its buffer would take a stack frame on every call.
#[inline(never)]
fn large(out: &mut Vec<u8>, n: u64) {
    out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
}

/// The eight decimal digits of `n < 10^8`, one a byte, the first (most
/// significant) in the lowest byte: `n`'s halves (`n / 10^4`, `n % 10^4`)
/// in the low and high 32 bits, each split into two-digit quarters and
/// those into digits. The divisions by 100 and 10 are multiplications and
/// shifts exact below 10^4 and 10^2, and no lane overflows into the next.
fn spread(n: u64) -> u64 {
    let halves = (n / 10_000) | ((n % 10_000) << 32);
    let hundreds = ((halves * 10_486) >> 20) & 0x0000_007F_0000_007F;
    let quarters = ((halves - hundreds * 100) << 16) + hundreds;
    let tens = ((quarters * 103) >> 10) & 0x000F_000F_000F_000F;
    ((quarters - tens * 10) << 8) + tens
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// `n` as [`push`] and [`push_then`] write it after an `x` (the latter
    /// then `;t=7`), checked to be the same.
    fn written(n: u64) -> String {
        let mut out = b"x".to_vec();
        push(&mut out, n);
        let mut then = out.clone();
        then.extend_from_slice(b";t=7");
        let mut with_tail = b"x".to_vec();
        push_then(&mut with_tail, n, *b";t=7");
        assert_eq!(with_tail, then, "{n}");
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn eight_digits_are_spread_one_a_byte_first_lowest() {
        assert_eq!(spread(12_345_678).to_le_bytes(), [1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(spread(0), 0);
        assert_eq!(spread(E8 - 1).to_le_bytes(), [9; 8]);
    }

    #[test]
    fn each_digit_count_is_written_as_display_writes_it() {
        let mut n = 1u64;
        for _ in 0..20 {
            for m in [n - 1, n, n + 1, n.saturating_mul(9)] {
                assert_eq!(written(m), format!("x{m}"));
            }
            n = n.saturating_mul(10);
        }
        assert_eq!(written(u64::MAX), format!("x{}", u64::MAX));
    }

    proptest! {
        #[test]
        fn any_number_is_written_as_display_writes_it(n in any::<u64>(), small in 0u64..2_000_000) {
            prop_assert_eq!(written(n), format!("x{n}"));
            prop_assert_eq!(written(small), format!("x{small}"));
        }

        #[test]
        fn every_eight_digit_number_spreads_into_its_digits(n in 0..E8) {
            let want: Vec<u8> = format!("{n:08}").bytes().map(|b| b - b'0').collect();
            prop_assert_eq!(spread(n).to_le_bytes().to_vec(), want);
        }
    }
}
