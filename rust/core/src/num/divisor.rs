//! Division by a divisor fixed at construction (page sizes, fold widths, the lcm).
//!
//! The engine divides token counts by page sizes on every step; a 64-bit `div` costs tens of
//! cycles on common x86 cores, while realistic page sizes are powers of two, where a shift
//! and a mask do the same job.

/// A positive divisor with a shift/mask fast path for powers of two.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Divisor {
    d: u64,
    /// `log2(d)` when `d` is a power of two.
    shift: Option<u32>,
}

impl Divisor {
    /// A divisor of `d`; `0` is treated as `1` (callers validate sizes before building one).
    pub fn new(d: u64) -> Self {
        let d = d.max(1);
        Self {
            d,
            shift: d.is_power_of_two().then(|| d.trailing_zeros()),
        }
    }

    /// The divisor.
    #[inline]
    pub fn get(self) -> u64 {
        self.d
    }

    /// `x / d`.
    #[inline]
    pub fn quotient(self, x: u64) -> u64 {
        match self.shift {
            Some(s) => x >> s,
            None => x / self.d,
        }
    }

    /// `x % d`.
    #[inline]
    pub fn remainder(self, x: u64) -> u64 {
        match self.shift {
            Some(_) => x & (self.d - 1),
            None => x % self.d,
        }
    }

    /// Exact `ceil(x / d)`, never overflowing.
    #[inline]
    pub fn ceil_div(self, x: u64) -> u64 {
        self.quotient(x) + u64::from(self.remainder(x) != 0)
    }

    /// `x` rounded down to a multiple of `d`.
    #[inline]
    pub fn align_down(self, x: u64) -> u64 {
        x - self.remainder(x)
    }
}

#[cfg(test)]
mod tests {
    use super::Divisor;

    #[test]
    fn agrees_with_plain_division() {
        for d in [1u64, 2, 3, 4, 6, 16, 17, 64, 1 << 40, u64::MAX] {
            let div = Divisor::new(d);
            for x in [0u64, 1, 2, 15, 16, 17, 1000, u64::MAX - 1, u64::MAX] {
                assert_eq!(div.quotient(x), x / d, "{x} / {d}");
                assert_eq!(div.remainder(x), x % d, "{x} % {d}");
                assert_eq!(div.ceil_div(x), x / d + u64::from(x % d != 0));
                assert_eq!(div.align_down(x), x - x % d);
            }
        }
        assert_eq!(Divisor::new(0).get(), 1);
    }
}
