//! Numbers: checked arithmetic, division by fixed divisors, and exact integers at the Python
//! boundary.
//!
//! - [`checked`]: checked `u64`/`u128` arithmetic whose overflow names the input.
//! - [`divisor`]: [`Divisor`], division by a page size (shift/mask for powers of two).
//! - [`int`]: exact integers ([`int::Int`], [`int::IntArg`]) checked before any arithmetic.

pub mod checked;
pub mod divisor;
pub mod int;

pub use divisor::Divisor;
