//! flat-kvcache core: the pure-Rust engine behind the `flat_kvcache` Python package.
//!
//! This crate has no Python dependency. Every size derived from user input uses checked
//! arithmetic ([`checked`]) and every failure is a [`CoreError`] with context.
//!
//! Modules, one concern each:
//! - [`sizing`]: group specs, page counts, capture widths, slab pairing, validation (SPEC 2).
//! - [`plan`]: the memory plan, bytes -> pages (SPEC 3).
//! - [`int`]: exact integers at the Python boundary (checked before any arithmetic).

pub mod checked;
pub mod error;
pub mod int;
pub mod plan;
pub mod sizing;

pub use error::{CoreError, CoreResult};

/// True when the crate was compiled with the `flat` feature (the flat per-group layout).
pub const FLAT_KVCACHE: bool = cfg!(feature = "flat");
