//! `flat_kvcache._native`: thin `PyO3` bindings over `flat-kvcache-core`.
//!
//! Nothing algorithmic lives here: each entry point extracts its arguments (checked), calls the
//! core, and converts the result or error.

pub mod args;
pub mod cache;
pub mod convert;
pub mod errors;
pub mod events;
pub mod hashing;
pub mod host;
mod npscalar;
pub mod page_cache;
pub mod plan;
pub mod pool;
pub mod prefix_match;
pub mod rows;
pub mod sizing;
pub mod tables;

/// The native module. Public names are re-exported by `flat_kvcache/__init__.py`.
#[pyo3::pymodule(gil_used = false)]
mod _native {
    #[allow(non_upper_case_globals)]
    #[pymodule_export]
    const __version__: &str = env!("CARGO_PKG_VERSION");

    /// True when the extension was compiled with the `flat` cargo feature.
    #[pymodule_export]
    const FLAT_KVCACHE: bool = flat_kvcache_core::FLAT_KVCACHE;

    // Sizing API (SPEC 2, 10).
    #[pymodule_export]
    use crate::sizing::{
        compute_max_logical_pages_for_capture, compute_paged_cache_group_page_counts, group_specs_from_layer_types,
        hybrid_slab_group_size, layer_group_ids, publish_paged_cache_groups, scheduler_ext_flat_kvcache,
        validate_flat_scheduler_config,
    };

    // Memory plan (SPEC 3).
    #[pymodule_export]
    use crate::plan::{
        components_from_layers, equalized_block_size, occurrence_index, plan_arena, plan_component_tensors,
        plan_tensors, solve_page_geometry, state_const_bytes,
    };

    // Page engine (SPEC 4-8).
    #[pymodule_export]
    use crate::cache::{PyFlatKVCache, PyPagedCache};
    #[pymodule_export]
    use crate::hashing::{fold_hashes, group_key, hash_page, hash_pages};
    #[pymodule_export]
    use crate::page_cache::PyPageCache;
    #[pymodule_export]
    use crate::pool::PyBlockPool;
    #[pymodule_export]
    use crate::prefix_match::PyPrefixMatch;
}
