//! Capture widths (SPEC 2, 12.1): the block-table width of one group's capture buffer.

use super::page_counts::{overlap_depth, spec_geometry, SpecArg};
use crate::error::CoreResult;
use crate::num::checked;
use crate::num::int::IntArg;

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
    let raw = geometry.raw()?;
    let what = format!(
        "group {}: capture width from max_context_len and max_tokens_per_req",
        geometry.group_id
    );
    let c = u128::from(c.u64("max_context_len")?);
    let n = u128::from(n.u64("max_tokens_per_req")?);
    let horizon = if overlap { checked::mul_wide(2, n, &what)? } else { n };
    let width = if let Some(window) = geometry.window {
        // min(W, C), exactly (a window beyond u64 exceeds C).
        let covered = window.to_u64().map_or(c, |w| u128::from(w).min(c));
        let pages = checked::ceil_div_wide(checked::add_wide(covered, horizon, &what)?, raw, &what)?;
        checked::add_wide(pages, 1, &what)?
    } else {
        checked::ceil_div_wide(checked::add_wide(c, horizon, &what)?, raw, &what)?
    };
    checked::narrow(width, &what)
}
