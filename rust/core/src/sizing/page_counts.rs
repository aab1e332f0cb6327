//! Page counts (SPEC 2): the spec checks shared with the capture widths, and the pages each
//! group needs for the given limits; `publish_paged_cache_groups` chains grouping and counts.

use super::grouping::{layer_labels, show, specs_for_labels, GroupSpec, LayerTypesArg, WindowsArg};
use super::labels::{Text, CHUNKED_WINDOW, FULL_ATTENTION, FULL_HISTORY, SLIDING_WINDOW, STATE};
use crate::error::{CoreError, CoreResult};
use crate::num::int::{capped_ceil_quotient, capped_quotient, sum, Int, IntArg};

/// A group spec as the bindings read it from a `PagedCacheGroupSpec` (or any object with its
/// attributes).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpecArg {
    /// `str(spec.group_id)`, for messages.
    pub group_id: String,
    /// `spec.retention`.
    pub retention: Text,
    /// `spec.rows_per_page`.
    pub rows_per_page: IntArg,
    /// `spec.entry_stride_tokens`.
    pub entry_stride_tokens: IntArg,
    /// `spec.sliding_window_tokens` (None for Python `None`).
    pub sliding_window_tokens: Option<IntArg>,
    /// `spec.family`.
    pub family: Text,
}

impl From<&GroupSpec> for SpecArg {
    fn from(spec: &GroupSpec) -> Self {
        Self {
            group_id: spec.group_id.clone(),
            retention: Text::from(spec.retention),
            rows_per_page: IntArg::Int(spec.rows_per_page.clone()),
            entry_stride_tokens: IntArg::from(spec.entry_stride_tokens),
            sliding_window_tokens: spec.sliding_window_tokens.clone().map(IntArg::Int),
            family: Text::from(spec.family),
        }
    }
}

/// A checked spec: its exact `raw` tokens per page (> 0) and its window (sliding only).
pub(super) struct SpecGeometry<'a> {
    pub(super) group_id: &'a str,
    pub(super) raw: Int,
    pub(super) window: Option<&'a Int>,
    state: bool,
}

/// The SPEC 2 spec checks, in order: `raw > 0`, a positive window for sliding specs, a known
/// retention.
pub(super) fn spec_geometry(spec: &SpecArg) -> CoreResult<SpecGeometry<'_>> {
    let gid = &spec.group_id;
    let rows = spec.rows_per_page.int(&format!("group {gid}: rows_per_page"))?;
    let stride = spec
        .entry_stride_tokens
        .int(&format!("group {gid}: entry_stride_tokens"))?;
    let raw = rows.mul(stride);
    if !raw.is_positive() {
        return Err(CoreError::invalid(format!(
            "group {gid}: rows_per_page * entry_stride_tokens must be > 0, got {raw}"
        )));
    }
    // A chunked group is sized as a sliding window of its chunk: the most history a token
    // attends (SPEC 6).
    if spec.retention.is(SLIDING_WINDOW) || spec.retention.is(CHUNKED_WINDOW) {
        let window = match &spec.sliding_window_tokens {
            None => None,
            Some(arg) => Some(arg.int(&format!("group {gid}: sliding_window_tokens"))?),
        };
        return match window {
            Some(w) if w.is_positive() => Ok(SpecGeometry {
                group_id: gid,
                raw,
                window: Some(w),
                state: false,
            }),
            _ => Err(CoreError::invalid(format!(
                "group {gid}: {} retention needs a positive sliding_window_tokens, got {}",
                spec.retention.text(),
                show(window)
            ))),
        };
    }
    if !spec.retention.is(FULL_HISTORY) {
        return Err(CoreError::invalid(format!(
            "group {gid}: unknown retention '{}'",
            spec.retention.text()
        )));
    }
    Ok(SpecGeometry {
        group_id: gid,
        raw,
        window: None,
        state: spec.family.is(STATE),
    })
}

/// `overlap_schedule_depth`: an int in {0, 1}.
pub(super) fn overlap_depth(arg: &IntArg) -> CoreResult<bool> {
    let depth = arg.int("overlap_schedule_depth")?;
    if depth.is_zero() {
        Ok(false)
    } else if *depth == Int::from(1u64) {
        Ok(true)
    } else {
        Err(CoreError::invalid(format!(
            "overlap_schedule_depth must be 0 or 1, got {depth}"
        )))
    }
}

/// The arguments of `compute_paged_cache_group_page_counts` other than the specs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PageCountArgs {
    /// B, max live requests.
    pub max_live_requests: IntArg,
    /// S, max scheduled tokens per step.
    pub max_scheduled_tokens: IntArg,
    /// T, max total tokens.
    pub max_total_tokens: IntArg,
    /// C, max context length.
    pub max_context_len: IntArg,
    /// N, decode input tokens per step (default 1).
    pub decode_input_tokens: IntArg,
    /// D, overlap schedule depth (default 0).
    pub overlap_schedule_depth: IntArg,
    /// M, safety margin pages (default 0).
    pub safety_margin: IntArg,
}

impl PageCountArgs {
    /// B, S, T, C with the defaults N = 1, D = 0, M = 0.
    pub fn new(
        max_live_requests: IntArg,
        max_scheduled_tokens: IntArg,
        max_total_tokens: IntArg,
        max_context_len: IntArg,
    ) -> Self {
        Self {
            max_live_requests,
            max_scheduled_tokens,
            max_total_tokens,
            max_context_len,
            decode_input_tokens: IntArg::from(1u64),
            overlap_schedule_depth: IntArg::from(0u64),
            safety_margin: IntArg::from(0u64),
        }
    }
}

/// Checked page-count arguments, exact.
struct Limits<'a> {
    live: &'a Int,
    scheduled: &'a Int,
    total: &'a Int,
    context: &'a Int,
    decode: &'a Int,
    margin: &'a Int,
    overlap: bool,
}

impl<'a> Limits<'a> {
    /// The argument checks, in the reference's order: B, S, T, C, N, M (ints >= 0), then D (0
    /// or 1), then D > 0 needs N > 0.
    fn check(args: &'a PageCountArgs) -> CoreResult<Self> {
        let live = args.max_live_requests.non_negative("max_live_requests")?;
        let scheduled = args.max_scheduled_tokens.non_negative("max_scheduled_tokens")?;
        let total = args.max_total_tokens.non_negative("max_total_tokens")?;
        let context = args.max_context_len.non_negative("max_context_len")?;
        let decode = args.decode_input_tokens.non_negative("decode_input_tokens")?;
        let margin = args.safety_margin.non_negative("safety_margin")?;
        let overlap = overlap_depth(&args.overlap_schedule_depth)?;
        if overlap && decode.is_zero() {
            return Err(CoreError::invalid(
                "overlap_schedule_depth > 0 needs decode_input_tokens > 0",
            ));
        }
        Ok(Self {
            live,
            scheduled,
            total,
            context,
            decode,
            margin,
            overlap,
        })
    }

    /// The pages held back for the overlap horizon: `B * ceil(D*N / raw)`.
    fn protected(&self, raw: &Int) -> Int {
        if self.overlap {
            self.live.mul(&capped_ceil_quotient(self.decode, raw))
        } else {
            Int::zero()
        }
    }

    /// The page count of one checked spec, computed exactly (quotients capped at `2^64`, see
    /// [`capped_quotient`]); only the count itself must fit `u64`.
    ///
    /// So an input that reaches the count only through a minimum it loses (`T` in `min(S, T)`,
    /// `C` above the window), a product with zero (`B = 0`) or not at all (`C` for a
    /// full-history group) may be of any size.
    fn pages(&self, spec: &SpecGeometry<'_>) -> CoreResult<u64> {
        let gid = spec.group_id;
        let raw = &spec.raw;
        let one = Int::from(1u64);
        let protected = self.protected(raw);
        if let Some(window) = spec.window {
            let what = format!(
                "group {gid}: page count from max_live_requests, max_context_len, max_scheduled_tokens, \
                 max_total_tokens, decode_input_tokens, safety_margin and rows_per_page * entry_stride_tokens"
            );
            // min(max(W - 1, 0), C): W > 0 was checked.
            let resident = window.sub(&one).min(self.context.clone());
            let history = self.live.mul(&capped_ceil_quotient(&resident, raw));
            let step = capped_ceil_quotient(self.scheduled.min(self.total), raw);
            return sum([&history, &step, self.live, &protected, &one, self.margin]).u64(&what);
        }
        let what = format!(
            "group {gid}: page count from max_total_tokens, max_live_requests, decode_input_tokens, \
             safety_margin and rows_per_page * entry_stride_tokens"
        );
        let full = sum([
            &capped_ceil_quotient(self.total, raw),
            self.live,
            &protected,
            &one,
            self.margin,
        ]);
        if !spec.state {
            return full.u64(&what);
        }
        // Two live pages per request plus snapshots, bounded by the full-history count.
        let state = sum([
            &Int::from(2u64).mul(self.live),
            &capped_quotient(self.total, raw),
            &protected,
            &one,
            self.margin,
        ]);
        state.min(full).u64(&what)
    }
}

/// `compute_paged_cache_group_page_counts`: the pages of each spec, in spec order.
///
/// The arguments are checked first, then every spec in order; only then are the counts computed
/// (so an overflow never hides an error of the reference). Arguments of any size are accepted;
/// a count that does not fit `u64` is an overflow naming the arguments it comes from.
pub fn compute_paged_cache_group_page_counts(specs: &[SpecArg], args: &PageCountArgs) -> CoreResult<Vec<u64>> {
    let limits = Limits::check(args)?;
    let geometries = specs.iter().map(spec_geometry).collect::<CoreResult<Vec<_>>>()?;
    geometries.iter().map(|spec| limits.pages(spec)).collect()
}

/// The result of a publication: the specs and their page counts (in spec order).
pub type Publication = (Vec<GroupSpec>, Vec<u64>);

/// `publish_paged_cache_groups`: None without the `flat` feature; else the specs of
/// `layer_types` (empty -> one full-attention layer) and their counts with `max(0, S)` and the
/// default N, D, M.
///
/// Checks run in the reference's order: `layer_types` types, `page_size`, the layers, the type
/// of `max_scheduled_tokens`, then the page-count arguments.
pub fn publish_paged_cache_groups(
    layer_types: &LayerTypesArg,
    windows: &WindowsArg,
    page_size: &IntArg,
    max_live_requests: &IntArg,
    max_scheduled_tokens: &IntArg,
    max_total_tokens: &IntArg,
    max_context_len: &IntArg,
) -> CoreResult<Option<Publication>> {
    if !crate::FLAT_KVCACHE {
        return Ok(None);
    }
    let mut labels = layer_labels(layer_types)?;
    if labels.is_empty() {
        labels.push(FULL_ATTENTION.to_owned());
    }
    let page_size = page_size.positive("page_size")?;
    let specs = specs_for_labels(&labels, windows, page_size)?;
    let s = max_scheduled_tokens.int("max_scheduled_tokens")?;
    let s = if s.is_negative() { Int::zero() } else { s.clone() };
    let args = PageCountArgs::new(
        max_live_requests.clone(),
        IntArg::Int(s),
        max_total_tokens.clone(),
        max_context_len.clone(),
    );
    let spec_args: Vec<SpecArg> = specs.iter().map(SpecArg::from).collect();
    let counts = compute_paged_cache_group_page_counts(&spec_args, &args)?;
    Ok(Some((specs, counts)))
}
