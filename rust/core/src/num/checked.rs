//! Checked integer helpers: every size computed from user input goes through these, so a value
//! that does not fit is an [`CoreError::Overflow`] naming the input, never a wrapped number.

use crate::error::{CoreError, CoreResult};

/// `a + b`, or an overflow error naming `what`.
pub fn add(a: u64, b: u64, what: &str) -> CoreResult<u64> {
    a.checked_add(b).ok_or_else(|| CoreError::overflow(what))
}

/// `a * b`, or an overflow error naming `what`.
pub fn mul(a: u64, b: u64, what: &str) -> CoreResult<u64> {
    a.checked_mul(b).ok_or_else(|| CoreError::overflow(what))
}

/// Exact `ceil(a / b)` for `b > 0`; never overflows (computed as `a / b + (a % b != 0)`).
///
/// # Panics
/// Never: a zero divisor is reported as `InvalidArgument` naming `what`.
pub fn ceil_div(a: u64, b: u64, what: &str) -> CoreResult<u64> {
    if b == 0 {
        return Err(CoreError::invalid(format!("{what}: division by zero")));
    }
    Ok(a / b + u64::from(a % b != 0))
}

/// Sum of an iterator of values, or an overflow error naming `what`.
pub fn sum<I: IntoIterator<Item = u64>>(values: I, what: &str) -> CoreResult<u64> {
    values.into_iter().try_fold(0u64, |acc, v| add(acc, v, what))
}

/// `a + b` in the wide type (intermediates of formulas over `u64` operands), or an overflow
/// error naming `what`.
pub fn add_wide(a: u128, b: u128, what: &str) -> CoreResult<u128> {
    a.checked_add(b).ok_or_else(|| CoreError::overflow(what))
}

/// `a * b` in the wide type, or an overflow error naming `what`.
pub fn mul_wide(a: u128, b: u128, what: &str) -> CoreResult<u128> {
    a.checked_mul(b).ok_or_else(|| CoreError::overflow(what))
}

/// Sum in the wide type, or an overflow error naming `what`.
pub fn sum_wide<I: IntoIterator<Item = u128>>(values: I, what: &str) -> CoreResult<u128> {
    values.into_iter().try_fold(0u128, |acc, v| add_wide(acc, v, what))
}

/// Exact `ceil(a / b)` in the wide type; a zero divisor is `InvalidArgument` naming `what`.
pub fn ceil_div_wide(a: u128, b: u128, what: &str) -> CoreResult<u128> {
    if b == 0 {
        return Err(CoreError::invalid(format!("{what}: division by zero")));
    }
    Ok(a / b + u128::from(a % b != 0))
}

/// A wide intermediate as a `u64` result, or an overflow error naming `what`.
pub fn narrow(v: u128, what: &str) -> CoreResult<u64> {
    u64::try_from(v).map_err(|_| CoreError::overflow(what))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ceil_div_is_exact_at_the_top_of_the_range() {
        assert_eq!(ceil_div(u64::MAX, 1, "x"), Ok(u64::MAX));
        assert_eq!(ceil_div(u64::MAX, 2, "x"), Ok(u64::MAX / 2 + 1));
        assert_eq!(ceil_div(0, 7, "x"), Ok(0));
        assert!(ceil_div(1, 0, "x").is_err());
    }

    #[test]
    fn overflow_names_the_argument() {
        let err = mul(u64::MAX, 2, "max_live_requests").unwrap_err();
        assert_eq!(err, CoreError::overflow("max_live_requests"));
        assert!(err.to_string().contains("max_live_requests"));
        assert!(add(u64::MAX, 1, "t").is_err());
        assert_eq!(sum([1, 2, 3], "s"), Ok(6));
    }

    #[test]
    fn wide_helpers_are_checked() {
        let max = u128::from(u64::MAX);
        assert_eq!(mul_wide(max, max, "x"), Ok(max * max));
        assert!(mul_wide(u128::MAX, 2, "x").is_err());
        assert!(add_wide(u128::MAX, 1, "x").is_err());
        assert_eq!(sum_wide([max, max], "x"), Ok(2 * max));
        assert_eq!(ceil_div_wide(max + 1, 2, "x"), Ok(1u128 << 63));
        assert_eq!(ceil_div_wide(7, 2, "x"), Ok(4));
        assert!(ceil_div_wide(7, 0, "x").is_err());
        assert_eq!(narrow(max, "x"), Ok(u64::MAX));
        assert_eq!(narrow(max + 1, "y"), Err(CoreError::overflow("y")));
    }
}
