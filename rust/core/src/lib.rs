//! flat-kvcache core: the pure-Rust engine behind the `flat_kvcache` Python package.
//!
//! This crate has no Python dependency. Every size derived from user input uses checked
//! arithmetic ([`checked`]) and every failure is a [`CoreError`] with context.
//!
//! Modules, one concern each:
//! - [`sizing`]: group specs, page counts, capture widths, slab pairing, validation (SPEC 2).
//! - [`plan`]: the memory plan, bytes -> pages (SPEC 3).
//! - [`int`]: exact integers at the Python boundary (checked before any arithmetic).
//! - [`hash`]: content hashes and group keys (SPEC 4).
//! - [`pool`]: the block pool (SPEC 5).
//! - [`table`]: per-request tables and the three group managers (SPEC 6).
//! - [`coordinator`]: all groups of a model over one pool (SPEC 7).
//! - [`cache`]: request ids -> tables, step operations, flat block tables, metrics (SPEC 8).
//! - [`requests`]: token-level requests, the scheduler-loop API and admission accounting
//!   (SPEC 8, 9, 12.4; docs/requests-api.md).
//! - [`events`]: KV-cache events recorded by the engine.
//! - [`request`]: request ids.
//! - [`fastdiv`]: division by page sizes (shift/mask for powers of two).

pub mod cache;
pub mod coordinator;
pub mod error;
pub mod events;
pub mod hash;
pub mod num;
pub mod pool;
pub mod request;
pub mod requests;
pub mod sizing;
pub mod table;

pub use error::{CoreError, CoreResult};

// Compatibility paths kept for the bindings until those move to the new paths.
pub use num::int;
pub use sizing::plan;

/// True when the crate was compiled with the `flat` feature (the flat per-group layout).
pub const FLAT_KVCACHE: bool = cfg!(feature = "flat");
