//! flat-kvcache core: the pure-Rust engine behind the `flat_kvcache` Python package.
//!
//! This crate has no Python dependency. Every size derived from user input uses checked
//! arithmetic ([`num::checked`]) and every failure is a [`CoreError`] with context.
//!
//! Module map (dependencies point down: `num` and `error` depend on nothing else, `sizing`
//! on `num`, `engine` on `num`):
//! - [`error`]: the one error type.
//! - [`num`]: checked arithmetic, [`num::Divisor`], exact integers at the Python boundary.
//! - [`sizing`]: group specs, page counts, capture widths, slab predicate, scheduler checks
//!   (SPEC 2, 10), and [`sizing::plan`], the memory plan, bytes -> pages (SPEC 3).
//! - [`engine`]: the page engine (SPEC 4-9): ids, hashes, pool, tables, group kinds,
//!   coordinator, and [`engine::FlatCache`] with its page-level and token-level calls.

pub mod engine;
pub mod error;
pub mod num;
pub mod sizing;

pub use error::{CoreError, CoreResult};

/// True when the crate was compiled with the `flat` feature (the flat per-group layout).
pub const FLAT_KVCACHE: bool = cfg!(feature = "flat");
