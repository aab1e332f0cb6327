//! Capture widths (SPEC 2, 12.1): the block-table width of one group's capture buffer.

use super::page_counts::{overlap_depth, spec_geometry, SpecArg};
use crate::error::CoreResult;
use crate::num::int::{capped_ceil_quotient, Int, IntArg};

/// `compute_max_logical_pages_for_capture`: the block-table width of one group's capture
/// buffer (SPEC 2, 12.1). With `horizon = (D+1) * N`: sliding `ceil((min(W, C) + horizon) /
/// raw) + 1`, full history `ceil((C + horizon) / raw)`.
pub fn compute_max_logical_pages_for_capture(
    spec: &SpecArg,
    max_context_len: &IntArg,
    max_tokens_per_req: &IntArg,
    overlap_schedule_depth: &IntArg,
) -> CoreResult<u64> {
    let c = max_context_len.non_negative("max_context_len")?;
    let n = max_tokens_per_req.positive("max_tokens_per_req")?;
    let overlap = overlap_depth(overlap_schedule_depth)?;
    let geometry = spec_geometry(spec)?;
    let what = format!(
        "group {}: capture width from max_context_len, max_tokens_per_req and rows_per_page * entry_stride_tokens",
        geometry.group_id
    );
    // Exact; only the width must fit u64 (a window or context beyond u64 may still give one).
    let horizon = if overlap { Int::from(2u64).mul(n) } else { n.clone() };
    let width = match geometry.window {
        // min(W, C): the larger of the two never matters.
        Some(window) => capped_ceil_quotient(&window.min(c).add(&horizon), &geometry.raw).add(&Int::from(1u64)),
        None => capped_ceil_quotient(&c.add(&horizon), &geometry.raw),
    };
    width.u64(&what)
}
