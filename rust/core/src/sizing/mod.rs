//! The sizing API (SPEC 2 and 10): group specs from layer labels, page counts, capture widths,
//! slab pairing and the scheduler-configuration check.
//!
//! Inputs arrive as the bindings saw them ([`IntArg`](crate::num::int::IntArg), [`LayerTypesArg`], [`WindowsArg`],
//! [`SpecArg`]) and every check runs here, in the order of docs/sizing-api.md and the
//! reference, so that the first error is the same one. Checks are exact (Python ints of any
//! size); only the operands of a formula are converted to `u64`, after all checks, and
//! intermediates are computed in checked `u128`. An overflow therefore means that an operand
//! or the result does not fit `u64`, never that a check was skipped.
//!
//! One file per concern:
//! - [`labels`]: the vocabulary (layer labels, retentions, families, layer kinds).
//! - [`grouping`]: layers -> group ids and group specs.
//! - [`page_counts`]: spec checks and the pages of each group.
//! - [`capture`]: capture-buffer widths.
//! - [`slab`]: the slab predicate.
//! - [`scheduler`]: scheduler configuration validation.
//! - [`plan`]: the memory plan, bytes -> pages (SPEC 3).
//! - [`arena`]: the arena plan of the SPEC 13 storage (units bound to one group at a time).
//!
//! The sizing API is re-exported here, so callers write `sizing::layer_group_ids`.

pub mod arena;
pub mod capture;
pub mod grouping;
pub mod labels;
pub mod page_counts;
pub mod plan;
pub mod scheduler;
pub mod slab;

pub use capture::compute_max_logical_pages_for_capture;
pub use grouping::{
    group_specs_from_layer_types, grouped_layers, layer_group_ids, layer_labels, GroupSpec, LabelItem, Layer,
    LayerTypesArg, WindowEntry, WindowsArg,
};
pub use labels::{
    LayerKind, Text, FULL_ATTENTION, FULL_HISTORY, HISTORY, LINEAR_ATTENTION, SLIDING_ATTENTION, SLIDING_WINDOW, STATE,
};
pub use page_counts::{
    compute_paged_cache_group_page_counts, publish_paged_cache_groups, PageCountArgs, Publication, SpecArg,
};
pub use scheduler::{backend_cycle_error, validate_flat_scheduler_config, validation_applies, SchedulerFacts};
pub use slab::hybrid_slab_group_size;
