//! Exact integers at the Python boundary.
//!
//! Python ints have no size limit, and the contract (docs/sizing-api.md) says that every check
//! that does not need arithmetic (sign, `> 0`, `in {0, 1}`, equality of windows, the error
//! messages that print a value) must behave exactly like the pure-Python reference. So the core
//! first sees each integer argument as an [`IntArg`] holding an exact [`Int`], validates it
//! exactly, and only then converts the operands of a formula to `u64` (an [`Overflow`] naming
//! the argument when one does not fit).
//!
//! [`Overflow`]: crate::CoreError::Overflow

use std::cmp::Ordering;
use std::fmt::{self, Write as _};

use crate::error::{CoreError, CoreResult};

/// An exact signed integer of any size (the value of a Python `int`).
///
/// Sign and magnitude; the magnitude is little-endian base-2^32 limbs without trailing zero
/// limbs, and zero is never negative, so derived equality and hashing are exact.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Int {
    negative: bool,
    limbs: Vec<u32>,
}

impl Int {
    /// Zero.
    pub fn zero() -> Self {
        Self::default()
    }

    /// The integer with the given sign and little-endian magnitude bytes (as Python's
    /// `abs(v).to_bytes(n, "little")` gives them).
    pub fn from_magnitude_le_bytes(negative: bool, bytes: &[u8]) -> Self {
        let limbs = bytes
            .chunks(4)
            .map(|chunk| {
                chunk
                    .iter()
                    .rev()
                    .fold(0u32, |limb, &byte| (limb << 8) | u32::from(byte))
            })
            .collect();
        Self { negative, limbs }.normalized()
    }

    /// The little-endian bytes of `|self|`, without trailing zero bytes (empty for zero).
    pub fn magnitude_le_bytes(&self) -> Vec<u8> {
        let mut bytes: Vec<u8> = self.limbs.iter().flat_map(|limb| limb.to_le_bytes()).collect();
        while bytes.last() == Some(&0) {
            bytes.pop();
        }
        bytes
    }

    /// True for values `< 0`.
    pub fn is_negative(&self) -> bool {
        self.negative
    }

    /// True for zero.
    pub fn is_zero(&self) -> bool {
        self.limbs.is_empty()
    }

    /// True for values `> 0`.
    pub fn is_positive(&self) -> bool {
        !self.negative && !self.limbs.is_empty()
    }

    /// The value as `u64`, or None when it is negative or too large.
    pub fn to_u64(&self) -> Option<u64> {
        if self.negative {
            return None;
        }
        u64::try_from(self.magnitude()?).ok()
    }

    /// The value as `i128`, or None when it does not fit.
    pub fn to_i128(&self) -> Option<i128> {
        let magnitude = self.magnitude()?;
        if self.negative {
            0i128.checked_sub_unsigned(magnitude)
        } else {
            i128::try_from(magnitude).ok()
        }
    }

    /// The value as `u64` (`what` names it in the [`CoreError::Overflow`] when it does not fit).
    ///
    /// Callers validate the sign first; a negative value is reported as an overflow too, since
    /// it does not fit an unsigned integer either.
    pub fn u64(&self, what: &str) -> CoreResult<u64> {
        self.to_u64().ok_or_else(|| CoreError::overflow(what))
    }

    /// The exact product.
    #[must_use]
    pub fn mul(&self, other: &Int) -> Int {
        let mut limbs = vec![0u32; self.limbs.len() + other.limbs.len()];
        for (i, &a) in self.limbs.iter().enumerate() {
            let mut carry = 0u64;
            for (j, &b) in other.limbs.iter().enumerate() {
                // a * b + limb + carry <= (2^32 - 1)^2 + 2 * (2^32 - 1) = 2^64 - 1: never wraps.
                let cur = u64::from(a) * u64::from(b) + u64::from(limbs[i + j]) + carry;
                limbs[i + j] = low_limb(u128::from(cur));
                carry = cur >> 32;
            }
            // Rows before i wrote no further than position i - 1 + len(other), so the final
            // carry (< 2^32) lands alone at i + len(other), inside the len(self) + len(other) limbs.
            limbs[i + other.limbs.len()] = low_limb(u128::from(carry));
        }
        Self {
            negative: self.negative != other.negative,
            limbs,
        }
        .normalized()
    }

    /// The exact sum.
    #[must_use]
    pub fn add(&self, other: &Int) -> Int {
        if self.negative == other.negative {
            return Self {
                negative: self.negative,
                limbs: add_magnitudes(&self.limbs, &other.limbs),
            }
            .normalized();
        }
        // Opposite signs: the larger magnitude keeps its sign.
        let (larger, smaller) = match self.cmp_magnitude(other) {
            Ordering::Less => (other, self),
            _ => (self, other),
        };
        Self {
            negative: larger.negative,
            limbs: sub_magnitudes(&larger.limbs, &smaller.limbs),
        }
        .normalized()
    }

    /// The exact difference.
    #[must_use]
    pub fn sub(&self, other: &Int) -> Int {
        let negated = Self {
            negative: !other.negative,
            limbs: other.limbs.clone(),
        }
        .normalized();
        self.add(&negated)
    }

    /// `floor(self / divisor)` for `self >= 0` and `divisor > 0`, when it fits `u64`; None when
    /// it does not (or when the operands are outside that domain).
    ///
    /// The work is bounded by 64 steps over the operands' limbs, whatever their size: only a
    /// quotient below `2^64` is ever computed.
    pub fn quotient_u64(&self, divisor: &Int) -> Option<u64> {
        if self.negative || !divisor.is_positive() {
            return None;
        }
        if let (Some(a), Some(d)) = (self.magnitude(), divisor.magnitude()) {
            return u64::try_from(a / d).ok();
        }
        if divisor.mul(&Int::from(1u128 << 64)) <= *self {
            return None;
        }
        // Schoolbook binary division, one quotient bit at a time from the top.
        let mut rest = self.clone();
        let mut quotient = 0u64;
        for bit in (0..64).rev() {
            let step = divisor.mul(&Int::from(1u64 << bit));
            if step <= rest {
                rest = rest.sub(&step);
                quotient |= 1u64 << bit;
            }
        }
        Some(quotient)
    }

    /// `ceil(self / divisor)` for `self >= 0` and `divisor > 0`, when it fits `u64` (see
    /// [`Int::quotient_u64`]).
    pub fn ceil_quotient_u64(&self, divisor: &Int) -> Option<u64> {
        let floor = self.quotient_u64(divisor)?;
        if divisor.mul(&Int::from(floor)) == *self {
            Some(floor)
        } else {
            floor.checked_add(1)
        }
    }

    /// `|self|` as `u128`, or None when it needs more than 128 bits.
    fn magnitude(&self) -> Option<u128> {
        if self.limbs.len() > 4 {
            return None;
        }
        Some(
            self.limbs
                .iter()
                .rev()
                .fold(0u128, |acc, &limb| (acc << 32) | u128::from(limb)),
        )
    }

    fn normalized(mut self) -> Self {
        while self.limbs.last() == Some(&0) {
            self.limbs.pop();
        }
        if self.limbs.is_empty() {
            self.negative = false;
        }
        self
    }

    fn cmp_magnitude(&self, other: &Self) -> Ordering {
        self.limbs
            .len()
            .cmp(&other.limbs.len())
            .then_with(|| self.limbs.iter().rev().cmp(other.limbs.iter().rev()))
    }
}

/// The sum of two magnitudes (little-endian limbs).
fn add_magnitudes(a: &[u32], b: &[u32]) -> Vec<u32> {
    let (long, short) = if a.len() >= b.len() { (a, b) } else { (b, a) };
    let mut limbs = Vec::with_capacity(long.len() + 1);
    let mut carry = 0u64;
    for (i, &x) in long.iter().enumerate() {
        let cur = u64::from(x) + u64::from(short.get(i).copied().unwrap_or(0)) + carry;
        limbs.push(low_limb(u128::from(cur)));
        carry = cur >> 32;
    }
    limbs.push(low_limb(u128::from(carry)));
    limbs
}

/// `a - b` for magnitudes with `a >= b` (little-endian limbs).
fn sub_magnitudes(a: &[u32], b: &[u32]) -> Vec<u32> {
    let mut limbs = Vec::with_capacity(a.len());
    let mut borrow = 0i64;
    for (i, &x) in a.iter().enumerate() {
        let mut cur = i64::from(x) - i64::from(b.get(i).copied().unwrap_or(0)) - borrow;
        borrow = i64::from(cur < 0);
        if cur < 0 {
            cur += 1i64 << 32;
        }
        limbs.push(u32::try_from(cur).unwrap_or(0));
    }
    limbs
}

/// The low 32 bits of `v` (the truncation is the point: callers carry the high bits separately).
#[allow(
    clippy::cast_possible_truncation,
    reason = "keeps the low limb; callers carry the rest"
)]
fn low_limb(v: u128) -> u32 {
    v as u32
}

impl From<u128> for Int {
    fn from(v: u128) -> Self {
        let limbs = (0..4).map(|k| low_limb(v >> (32 * k)));
        Self {
            negative: false,
            limbs: limbs.collect(),
        }
        .normalized()
    }
}

impl From<u64> for Int {
    fn from(v: u64) -> Self {
        Self::from(u128::from(v))
    }
}

impl From<usize> for Int {
    fn from(v: usize) -> Self {
        // usize is at most 128 bits wide on every target Rust supports.
        Self::from(u128::try_from(v).unwrap_or(u128::MAX))
    }
}

impl From<i128> for Int {
    fn from(v: i128) -> Self {
        let mut out = Self::from(v.unsigned_abs());
        out.negative = v < 0;
        out.normalized()
    }
}

impl From<i64> for Int {
    fn from(v: i64) -> Self {
        Self::from(i128::from(v))
    }
}

impl PartialOrd for Int {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Int {
    fn cmp(&self, other: &Self) -> Ordering {
        match (self.negative, other.negative) {
            (false, true) => Ordering::Greater,
            (true, false) => Ordering::Less,
            (false, false) => self.cmp_magnitude(other),
            (true, true) => other.cmp_magnitude(self),
        }
    }
}

impl fmt::Display for Int {
    /// Decimal, like Python's `str(int)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const CHUNK: u64 = 1_000_000_000;
        if self.is_zero() {
            return f.write_str("0");
        }
        // Repeated division of the magnitude by 10^9 yields 9-digit chunks, lowest first.
        let mut limbs = self.limbs.clone();
        let mut chunks = Vec::new();
        while !limbs.is_empty() {
            let mut rem = 0u64;
            for limb in limbs.iter_mut().rev() {
                let cur = (rem << 32) | u64::from(*limb);
                *limb = low_limb(u128::from(cur / CHUNK));
                rem = cur % CHUNK;
            }
            while limbs.last() == Some(&0) {
                limbs.pop();
            }
            chunks.push(rem);
        }
        let mut text = String::with_capacity(chunks.len() * 9 + 1);
        if self.negative {
            text.push('-');
        }
        let mut rest = chunks.iter().rev();
        if let Some(top) = rest.next() {
            write!(text, "{top}")?;
        }
        for chunk in rest {
            write!(text, "{chunk:09}")?;
        }
        f.write_str(&text)
    }
}

/// `2^64`, the stand-in for a quotient that does not fit `u64` (see [`capped_quotient`]).
pub fn beyond_u64() -> Int {
    Int::from(1u128 << 64)
}

/// `floor(a / d)` for `a >= 0`, `d > 0`, capped at `2^64` ([`beyond_u64`]).
///
/// The sizing formulas are sums, products, minimums and maximums of non-negative terms whose
/// result must fit `u64`. A term at or above `2^64` either drops out (multiplied by zero, or the
/// larger side of a minimum) or makes the result too large, and the capped value does exactly
/// the same; so a formula computed with capped quotients fits `u64` exactly when the exact one
/// does, and then has the same value. The cost stays bounded whatever the operands' size.
pub fn capped_quotient(a: &Int, d: &Int) -> Int {
    a.quotient_u64(d).map_or_else(beyond_u64, Int::from)
}

/// `ceil(a / d)` for `a >= 0`, `d > 0`, capped at `2^64` like [`capped_quotient`].
pub fn capped_ceil_quotient(a: &Int, d: &Int) -> Int {
    a.ceil_quotient_u64(d).map_or_else(beyond_u64, Int::from)
}

/// The exact sum of `values`.
pub fn sum<'a, I: IntoIterator<Item = &'a Int>>(values: I) -> Int {
    values.into_iter().fold(Int::zero(), |acc, v| acc.add(v))
}

/// An integer argument as the bindings saw it, before any check.
///
/// The reference checks each argument in turn (type, then value), so the type error of a later
/// argument must not win over the value error of an earlier one: the type is a fact the core
/// checks in its own order, not something the bindings reject up front.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum IntArg {
    /// An int (anything with `__index__`, not a bool), exactly.
    Int(Int),
    /// A `bool` (refused: `True` is not a page count).
    Bool,
    /// Anything else; holds the Python type name for the message.
    Other(String),
}

impl IntArg {
    /// The exact value, or `TypeError("<name> must be an int, ...")`.
    pub fn int(&self, name: &str) -> CoreResult<&Int> {
        match self {
            Self::Int(v) => Ok(v),
            Self::Bool => Err(CoreError::Type(format!("{name} must be an int, not bool"))),
            Self::Other(type_name) => Err(CoreError::Type(format!("{name} must be an int, got {type_name}"))),
        }
    }

    /// An int `>= 0`, or `ValueError("<name> must be >= 0, got <v>")`.
    pub fn non_negative(&self, name: &str) -> CoreResult<&Int> {
        let v = self.int(name)?;
        if v.is_negative() {
            return Err(CoreError::invalid(format!("{name} must be >= 0, got {v}")));
        }
        Ok(v)
    }

    /// An int `> 0`, or `ValueError("<name> must be > 0, got <v>")`.
    pub fn positive(&self, name: &str) -> CoreResult<&Int> {
        let v = self.int(name)?;
        if !v.is_positive() {
            return Err(CoreError::invalid(format!("{name} must be > 0, got {v}")));
        }
        Ok(v)
    }
}

impl From<u64> for IntArg {
    fn from(v: u64) -> Self {
        Self::Int(Int::from(v))
    }
}

impl From<i64> for IntArg {
    fn from(v: i64) -> Self {
        Self::Int(Int::from(v))
    }
}

impl From<Int> for IntArg {
    fn from(v: Int) -> Self {
        Self::Int(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn big(negative: bool, bytes: &[u8]) -> Int {
        Int::from_magnitude_le_bytes(negative, bytes)
    }

    #[test]
    fn display_matches_python_str() {
        assert_eq!(Int::zero().to_string(), "0");
        assert_eq!(Int::from(-7i64).to_string(), "-7");
        assert_eq!(Int::from(u64::MAX).to_string(), "18446744073709551615");
        assert_eq!(
            Int::from(i128::MIN).to_string(),
            "-170141183460469231731687303715884105728"
        );
        // 2**128 = 340282366920938463463374607431768211456
        let two_128 = big(false, &[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]);
        assert_eq!(two_128.to_string(), "340282366920938463463374607431768211456");
        // 10**9 exactly: a zero-padded inner chunk.
        assert_eq!(Int::from(1_000_000_000u64).to_string(), "1000000000");
        assert_eq!(
            Int::from(1_000_000_000_000_000_007u64).to_string(),
            "1000000000000000007"
        );
    }

    #[test]
    fn bytes_round_trip_and_normalize() {
        let v = big(true, &[1, 2, 3, 4, 5, 0, 0]);
        assert_eq!(v.magnitude_le_bytes(), vec![1, 2, 3, 4, 5]);
        assert!(v.is_negative());
        assert_eq!(v, big(true, &[1, 2, 3, 4, 5]));
        let zero = big(true, &[0, 0]);
        assert!(zero.is_zero() && !zero.is_negative() && !zero.is_positive());
        assert_eq!(zero, Int::zero());
        assert_eq!(
            Int::from(0x0102_0304_0506i64).magnitude_le_bytes(),
            vec![6, 5, 4, 3, 2, 1]
        );
    }

    #[test]
    fn conversions_are_exact_at_the_edges() {
        assert_eq!(Int::from(u64::MAX).to_u64(), Some(u64::MAX));
        assert_eq!(Int::from(u128::from(u64::MAX) + 1).to_u64(), None);
        assert_eq!(Int::from(-1i64).to_u64(), None);
        assert_eq!(Int::from(i128::MIN).to_i128(), Some(i128::MIN));
        assert_eq!(Int::from(i128::MAX).to_i128(), Some(i128::MAX));
        assert_eq!(Int::from(i128::MAX as u128 + 1).to_i128(), None);
        assert_eq!(Int::from(-5i64).u64("x"), Err(CoreError::overflow("x")));
    }

    #[test]
    fn multiplication_is_exact() {
        let a = Int::from(u64::MAX);
        let square = a.mul(&a);
        assert_eq!(
            square.to_string(),
            (u128::from(u64::MAX) * u128::from(u64::MAX)).to_string()
        );
        assert_eq!(Int::from(-3i64).mul(&Int::from(4i64)), Int::from(-12i64));
        assert_eq!(Int::from(-3i64).mul(&Int::from(-4i64)), Int::from(12i64));
        assert_eq!(Int::from(-3i64).mul(&Int::zero()), Int::zero());
        // (2**100) * (-(2**100)) = -(2**200)
        let mut bytes = vec![0u8; 13];
        bytes[12] = 0x10;
        let p = big(false, &bytes).mul(&big(true, &bytes));
        assert_eq!(
            p.to_string(),
            "-1606938044258990275541962092341162602522202993782792835301376"
        );
    }

    fn pow2(bits: u32) -> Int {
        let mut bytes = vec![0u8; usize::try_from(bits / 8).unwrap() + 1];
        *bytes.last_mut().unwrap() = 1 << (bits % 8);
        big(false, &bytes)
    }

    #[test]
    fn addition_and_subtraction_are_exact() {
        let max = Int::from(u64::MAX);
        assert_eq!(max.add(&Int::from(1u64)), Int::from(u128::from(u64::MAX) + 1));
        assert_eq!(Int::from(u128::MAX).add(&Int::from(1u64)), pow2(128));
        assert_eq!(pow2(128).sub(&Int::from(1u64)), Int::from(u128::MAX));
        assert_eq!(Int::from(3i64).sub(&Int::from(5i64)), Int::from(-2i64));
        assert_eq!(Int::from(-3i64).add(&Int::from(5i64)), Int::from(2i64));
        assert_eq!(Int::from(-3i64).add(&Int::from(-5i64)), Int::from(-8i64));
        assert_eq!(pow2(200).sub(&pow2(200)), Int::zero());
        assert_eq!(pow2(200).sub(&pow2(200)).to_string(), "0");
        assert_eq!(
            Int::from(i128::MIN).sub(&Int::from(1i64)).to_string(),
            "-170141183460469231731687303715884105729"
        );
    }

    #[test]
    fn quotients_are_exact_below_2_pow_64() {
        let q = |a: &Int, d: &Int| a.quotient_u64(d);
        assert_eq!(q(&Int::from(7u64), &Int::from(2u64)), Some(3));
        assert_eq!(Int::from(7u64).ceil_quotient_u64(&Int::from(2u64)), Some(4));
        assert_eq!(Int::from(8u64).ceil_quotient_u64(&Int::from(2u64)), Some(4));
        assert_eq!(q(&Int::zero(), &pow2(300)), Some(0));
        // Huge operands, small quotient: 2^200 / 2^190 = 1024, (2^200 + 1) / 2^190 rounds up.
        assert_eq!(q(&pow2(200), &pow2(190)), Some(1024));
        let above = pow2(200).add(&Int::from(1u64));
        assert_eq!(q(&above, &pow2(190)), Some(1024));
        assert_eq!(above.ceil_quotient_u64(&pow2(190)), Some(1025));
        assert_eq!(pow2(200).ceil_quotient_u64(&pow2(190)), Some(1024));
        // (2^64 - 1) * 3^... : a quotient of exactly u64::MAX, then one that does not fit.
        let d = pow2(100).add(&Int::from(7u64));
        let a = d.mul(&Int::from(u64::MAX));
        assert_eq!(q(&a, &d), Some(u64::MAX));
        assert_eq!(q(&a.add(&d.sub(&Int::from(1u64))), &d), Some(u64::MAX));
        assert_eq!(a.add(&Int::from(1u64)).ceil_quotient_u64(&d), None);
        assert_eq!(q(&a.add(&d), &d), None);
        assert_eq!(q(&pow2(64), &Int::from(1u64)), None);
        assert_eq!(q(&Int::from(u64::MAX), &Int::from(1u64)), Some(u64::MAX));
        // Outside the domain.
        assert_eq!(q(&Int::from(5u64), &Int::zero()), None);
        assert_eq!(q(&Int::from(-5i64), &Int::from(1u64)), None);
    }

    #[test]
    fn ordering_is_numeric() {
        let values = [
            Int::from(i128::MIN),
            Int::from(-2i64),
            Int::zero(),
            Int::from(3i64),
            Int::from(u64::MAX),
            Int::from(u128::MAX),
        ];
        for (i, a) in values.iter().enumerate() {
            for (j, b) in values.iter().enumerate() {
                assert_eq!(a.cmp(b), i.cmp(&j), "{a} vs {b}");
            }
        }
    }

    #[test]
    fn arg_checks_name_the_argument() {
        let err = IntArg::Bool.int("page_size").unwrap_err();
        assert_eq!(err, CoreError::Type("page_size must be an int, not bool".into()));
        let err = IntArg::Other("float".into()).int("page_size").unwrap_err();
        assert_eq!(err.to_string(), "page_size must be an int, got float");
        let err = IntArg::from(-3i64).non_negative("max_total_tokens").unwrap_err();
        assert_eq!(err.to_string(), "max_total_tokens must be >= 0, got -3");
        let err = IntArg::from(0i64).positive("page_size").unwrap_err();
        assert_eq!(err.to_string(), "page_size must be > 0, got 0");
        assert_eq!(IntArg::from(0u64).non_negative("x"), Ok(&Int::zero()));
    }
}
