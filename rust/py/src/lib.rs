//! `flat_kvcache._native`: thin `PyO3` bindings over `flat-kvcache-core`.
//!
//! Nothing algorithmic lives here: each entry point extracts its arguments (checked), calls the
//! core, and converts the result or error.

pub mod convert;
pub mod engine;
pub mod errors;
pub mod hashing;

/// The native module. Public names are re-exported by `flat_kvcache/__init__.py`.
#[pyo3::pymodule(gil_used = false)]
mod _native {
    #[allow(non_upper_case_globals)]
    #[pymodule_export]
    const __version__: &str = env!("CARGO_PKG_VERSION");

    /// True when the extension was compiled with the `flat` cargo feature.
    #[pymodule_export]
    const FLAT_KVCACHE: bool = flat_kvcache_core::FLAT_KVCACHE;

    // Page engine (SPEC 4-8).
    #[pymodule_export]
    use crate::engine::{PyBlockPool, PyFlatKVCache, PyPrefixMatch};
    #[pymodule_export]
    use crate::hashing::{fold_hashes, group_key, hash_page, hash_pages};
}
