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
}
