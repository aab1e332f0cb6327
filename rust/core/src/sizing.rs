//! The sizing API (SPEC 2 and 10): group specs from layer labels, page counts, capture widths,
//! slab pairing and the scheduler-configuration check.
//!
//! Inputs arrive as the bindings saw them ([`IntArg`], [`LayerTypesArg`], [`WindowsArg`],
//! [`SpecArg`]) and every check runs here, in the order of docs/sizing-api.md and the
//! reference, so that the first error is the same one. Checks are exact (Python ints of any
//! size); only the operands of a formula are converted to `u64`, after all checks, and
//! intermediates are computed in checked `u128`. An overflow therefore means that an operand
//! or the result does not fit `u64`, never that a check was skipped.

use std::collections::{HashMap, HashSet};

use crate::checked;
use crate::error::{CoreError, CoreResult};
use crate::int::{Int, IntArg};

/// Layer label of a full-attention layer.
pub const FULL_ATTENTION: &str = "full_attention";
/// Layer label of a sliding-window attention layer.
pub const SLIDING_ATTENTION: &str = "sliding_attention";
/// Layer label of a linear-attention (state) layer.
pub const LINEAR_ATTENTION: &str = "linear_attention";
/// Retention of a group that keeps every page.
pub const FULL_HISTORY: &str = "full_history";
/// Retention of a group that keeps the pages inside its window.
pub const SLIDING_WINDOW: &str = "sliding_window";
/// Family of a K/V history group.
pub const HISTORY: &str = "history";
/// Family of a recurrent-state group.
pub const STATE: &str = "state";

const KNOWN_LABELS: &str = "full_attention, sliding_attention, linear_attention";

/// The kind of a layer, from its label.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LayerKind {
    /// `full_attention`: keeps all history.
    Full,
    /// `sliding_attention`: keeps the last `W - 1` tokens.
    Sliding,
    /// `linear_attention`: a constant-size recurrent state.
    Linear,
}

impl LayerKind {
    /// The kind of a known label, or None.
    pub fn from_label(label: &str) -> Option<Self> {
        match label {
            FULL_ATTENTION => Some(Self::Full),
            SLIDING_ATTENTION => Some(Self::Sliding),
            LINEAR_ATTENTION => Some(Self::Linear),
            _ => None,
        }
    }

    /// The label of this kind.
    pub fn label(self) -> &'static str {
        match self {
            Self::Full => FULL_ATTENTION,
            Self::Sliding => SLIDING_ATTENTION,
            Self::Linear => LINEAR_ATTENTION,
        }
    }

    /// The retention of the groups of this kind.
    pub fn retention(self) -> &'static str {
        match self {
            Self::Full | Self::Linear => FULL_HISTORY,
            Self::Sliding => SLIDING_WINDOW,
        }
    }

    /// True for state labels (`STATE_LAYER_TYPES`).
    pub fn is_state(self) -> bool {
        self == Self::Linear
    }

    /// The family of the groups of this kind.
    pub fn family(self) -> &'static str {
        if self.is_state() {
            STATE
        } else {
            HISTORY
        }
    }
}

/// A value that should be a `str`, as the bindings saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Text {
    /// A `str` (or subclass): compared by value.
    Str(String),
    /// Anything else, never equal to a label; holds `str(value)` for messages.
    Other(String),
}

impl Text {
    /// True when this is the str `s`.
    pub fn is(&self, s: &str) -> bool {
        matches!(self, Self::Str(v) if v == s)
    }

    /// The text shown in messages (`str(value)`).
    pub fn text(&self) -> &str {
        match self {
            Self::Str(v) | Self::Other(v) => v,
        }
    }
}

impl From<&str> for Text {
    fn from(s: &str) -> Self {
        Self::Str(s.to_owned())
    }
}

/// One item of `layer_types`, as the bindings saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LabelItem {
    /// A `str`.
    Str(String),
    /// Not a str; holds the type name.
    Other(String),
}

/// The `layer_types` argument, as the bindings saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LayerTypesArg {
    /// A bare `str` (refused: a string is not a list of labels).
    Str,
    /// Not a sequence; holds the type name.
    NotSequence(String),
    /// A sequence (indexable and sized, not a mapping), item by item.
    Items(Vec<LabelItem>),
}

impl LayerTypesArg {
    /// A sequence of str labels.
    pub fn labels<S: AsRef<str>>(labels: &[S]) -> Self {
        Self::Items(labels.iter().map(|s| LabelItem::Str(s.as_ref().to_owned())).collect())
    }
}

/// One entry of a per-layer `sliding_window_tokens` sequence, as the bindings saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WindowEntry {
    /// `None`.
    None,
    /// A value whose type has `__index__` and is not bool (its `__index__` may still fail,
    /// which `IntArg::Other` records).
    Int(IntArg),
    /// A bool or a value whose type has no `__index__`; holds the type name.
    Refused(String),
}

/// The `sliding_window_tokens` argument, as the bindings saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WindowsArg {
    /// `None`: no layer has a window.
    None,
    /// A value whose type has `__index__` (broadcast to the sliding layers).
    Int(IntArg),
    /// A `str`, a `bool` or another non-sequence; holds the type name.
    Refused(String),
    /// A sequence with one entry per layer.
    PerLayer(Vec<WindowEntry>),
}

impl WindowsArg {
    /// One int window for every sliding layer.
    pub fn broadcast(window: i64) -> Self {
        Self::Int(IntArg::from(window))
    }

    /// A per-layer window list of optional ints.
    pub fn per_layer(windows: &[Option<i64>]) -> Self {
        Self::PerLayer(
            windows
                .iter()
                .map(|w| w.map_or(WindowEntry::None, |w| WindowEntry::Int(IntArg::from(w))))
                .collect(),
        )
    }
}

/// One validated layer: its kind, its window (None unless sliding) and its group id.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layer {
    /// The layer's kind.
    pub kind: LayerKind,
    /// The sliding window (positive), for sliding layers only.
    pub window: Option<Int>,
    /// The id of the group the layer belongs to.
    pub group_id: String,
}

/// `layer_types` as a list of str labels (labels are not checked against the known ones).
///
/// A bare str is a `ValueError`, a non-sequence or a non-str item a `TypeError`.
pub fn layer_labels(layer_types: &LayerTypesArg) -> CoreResult<Vec<String>> {
    match layer_types {
        LayerTypesArg::Str => Err(CoreError::invalid("layer_types must be a sequence of str, not str")),
        LayerTypesArg::NotSequence(type_name) => Err(CoreError::Type(format!(
            "layer_types must be a sequence of str, not {type_name}"
        ))),
        LayerTypesArg::Items(items) => items
            .iter()
            .enumerate()
            .map(|(i, item)| match item {
                LabelItem::Str(label) => Ok(label.clone()),
                LabelItem::Other(type_name) => Err(CoreError::Type(format!(
                    "layer_types[{i}] must be a str, not {type_name}"
                ))),
            })
            .collect(),
    }
}

/// Every label must be a known one.
fn known_kinds(labels: &[String]) -> CoreResult<Vec<LayerKind>> {
    labels
        .iter()
        .enumerate()
        .map(|(i, label)| {
            LayerKind::from_label(label).ok_or_else(|| {
                CoreError::invalid(format!(
                    "unknown layer_type '{label}' at layer {i}; expected one of {KNOWN_LABELS}"
                ))
            })
        })
        .collect()
}

fn refused_window(type_name: &str) -> CoreError {
    CoreError::invalid(format!(
        "sliding_window_tokens must be None, an int or a per-layer sequence, not {type_name}"
    ))
}

/// One raw window per layer (shape and types only): an int is broadcast to the sliding layers.
fn window_entries(windows: &WindowsArg, kinds: &[LayerKind]) -> CoreResult<Vec<Option<Int>>> {
    match windows {
        WindowsArg::None => Ok(vec![None; kinds.len()]),
        WindowsArg::Refused(type_name) => Err(refused_window(type_name)),
        WindowsArg::Int(arg) => {
            let window = arg.int("sliding_window_tokens")?;
            Ok(kinds
                .iter()
                .map(|&kind| (kind == LayerKind::Sliding).then(|| window.clone()))
                .collect())
        }
        WindowsArg::PerLayer(entries) => {
            if entries.len() != kinds.len() {
                return Err(CoreError::invalid(format!(
                    "sliding_window_tokens has {} entries but layer_types has {}",
                    entries.len(),
                    kinds.len()
                )));
            }
            entries
                .iter()
                .enumerate()
                .map(|(i, entry)| match entry {
                    WindowEntry::None => Ok(None),
                    WindowEntry::Refused(type_name) => Err(CoreError::invalid(format!(
                        "sliding_window_tokens[{i}] must be None or an int, not {type_name}"
                    ))),
                    WindowEntry::Int(arg) => Ok(Some(arg.int(&format!("sliding_window_tokens[{i}]"))?.clone())),
                })
                .collect()
        }
    }
}

fn show(window: Option<&Int>) -> String {
    window.map_or_else(|| "None".to_owned(), ToString::to_string)
}

/// SPEC 2 per-layer grouping of str labels: known labels, window shape and entry types, then
/// each layer's window, then group ids.
fn group_labels(labels: &[String], windows: &WindowsArg) -> CoreResult<Vec<Layer>> {
    let kinds = known_kinds(labels)?;
    let entries = window_entries(windows, &kinds)?;
    for (i, (&kind, window)) in kinds.iter().zip(&entries).enumerate() {
        let positive = window.as_ref().is_some_and(Int::is_positive);
        if kind == LayerKind::Sliding && !positive {
            return Err(CoreError::invalid(format!(
                "layer {i} (sliding_attention) needs a positive sliding window, got {}",
                show(window.as_ref())
            )));
        }
        if kind != LayerKind::Sliding && positive {
            return Err(CoreError::invalid(format!(
                "layer {i} is labelled {} but carries sliding window {}; mislabeled layer_type?",
                kind.label(),
                show(window.as_ref())
            )));
        }
    }
    // Full and linear layers get window None, whatever non-positive entry they carried.
    let windows: Vec<Option<Int>> = kinds
        .iter()
        .zip(entries)
        .map(|(&kind, window)| window.filter(|_| kind == LayerKind::Sliding))
        .collect();
    // Several distinct windows split the sliding layers into one group per window.
    let several = windows.iter().flatten().collect::<HashSet<_>>().len() > 1;
    Ok(kinds
        .into_iter()
        .zip(windows)
        .map(|(kind, window)| {
            let group_id = match &window {
                Some(w) if several => format!("{}_{w}", kind.label()),
                _ => kind.label().to_owned(),
            };
            Layer { kind, window, group_id }
        })
        .collect())
}

/// SPEC 2 per-layer grouping: validated layers with their group ids.
pub fn grouped_layers(layer_types: &LayerTypesArg, windows: &WindowsArg) -> CoreResult<Vec<Layer>> {
    group_labels(&layer_labels(layer_types)?, windows)
}

/// `layer_group_ids`: the group id of every layer.
pub fn layer_group_ids(layer_types: &LayerTypesArg, windows: &WindowsArg) -> CoreResult<Vec<String>> {
    Ok(grouped_layers(layer_types, windows)?
        .into_iter()
        .map(|layer| layer.group_id)
        .collect())
}

/// A paged-cache group spec (the fields of `PagedCacheGroupSpec`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupSpec {
    /// The group id.
    pub group_id: String,
    /// `full_history` or `sliding_window`.
    pub retention: &'static str,
    /// Rows per page (the page size).
    pub rows_per_page: u64,
    /// Tokens per row.
    pub entry_stride_tokens: u64,
    /// The window of a sliding group.
    pub sliding_window_tokens: Option<u64>,
    /// `history` or `state`.
    pub family: &'static str,
}

/// The specs of checked labels. The layers are checked first; then the values the specs carry
/// (the page size and the windows) must fit `u64`.
fn specs_for_labels(labels: &[String], windows: &WindowsArg, page_size: &Int) -> CoreResult<Vec<GroupSpec>> {
    let layers = group_labels(labels, windows)?;
    let rows_per_page = page_size.u64("page_size")?;
    let mut specs: Vec<GroupSpec> = Vec::new();
    for layer in layers {
        if specs.iter().any(|spec| spec.group_id == layer.group_id) {
            continue;
        }
        let window = match &layer.window {
            Some(window) => Some(window.u64("sliding_window_tokens")?),
            None => None,
        };
        specs.push(GroupSpec {
            group_id: layer.group_id,
            retention: layer.kind.retention(),
            rows_per_page,
            entry_stride_tokens: 1,
            sliding_window_tokens: window,
            family: layer.kind.family(),
        });
    }
    Ok(specs)
}

/// `group_specs_from_layer_types`: one spec per distinct group id, in first-appearance order.
///
/// `page_size` is checked first (an int > 0), then the layers.
pub fn group_specs_from_layer_types(
    layer_types: &LayerTypesArg,
    windows: &WindowsArg,
    page_size: &IntArg,
) -> CoreResult<Vec<GroupSpec>> {
    let page_size = page_size.positive("page_size")?;
    specs_for_labels(&layer_labels(layer_types)?, windows, page_size)
}

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
            rows_per_page: IntArg::from(spec.rows_per_page),
            entry_stride_tokens: IntArg::from(spec.entry_stride_tokens),
            sliding_window_tokens: spec.sliding_window_tokens.map(IntArg::from),
            family: Text::from(spec.family),
        }
    }
}

/// A checked spec: its exact `raw` tokens per page (> 0) and its window (sliding only).
struct SpecGeometry<'a> {
    group_id: &'a str,
    raw: Int,
    window: Option<&'a Int>,
    state: bool,
}

impl SpecGeometry<'_> {
    /// `raw` as a `u64` operand.
    fn raw(&self) -> CoreResult<u128> {
        let what = format!("group {}: rows_per_page * entry_stride_tokens", self.group_id);
        Ok(u128::from(self.raw.u64(&what)?))
    }
}

/// The SPEC 2 spec checks, in order: `raw > 0`, a positive window for sliding specs, a known
/// retention.
fn spec_geometry(spec: &SpecArg) -> CoreResult<SpecGeometry<'_>> {
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
    if spec.retention.is(SLIDING_WINDOW) {
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
                "group {gid}: sliding_window retention needs a positive sliding_window_tokens, got {}",
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
fn overlap_depth(arg: &IntArg) -> CoreResult<bool> {
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

    /// Every argument as an operand: each must fit `u64`, used by a formula or not.
    fn operands(&self) -> CoreResult<Operands> {
        let operand = |v: &Int, name: &str| v.u64(name).map(u128::from);
        Ok(Operands {
            live: operand(self.live, "max_live_requests")?,
            scheduled: operand(self.scheduled, "max_scheduled_tokens")?,
            total: operand(self.total, "max_total_tokens")?,
            context: operand(self.context, "max_context_len")?,
            decode: operand(self.decode, "decode_input_tokens")?,
            margin: operand(self.margin, "safety_margin")?,
            overlap: self.overlap,
        })
    }
}

/// The page-count arguments as `u64` operands, widened for the intermediates.
struct Operands {
    live: u128,
    scheduled: u128,
    total: u128,
    context: u128,
    decode: u128,
    margin: u128,
    overlap: bool,
}

impl Operands {
    /// The pages held back for the overlap horizon: `B * ceil(D*N / raw)`.
    fn protected(&self, raw: u128, what: &str) -> CoreResult<u128> {
        if !self.overlap {
            return Ok(0);
        }
        checked::mul_wide(self.live, checked::ceil_div_wide(self.decode, raw, what)?, what)
    }

    /// The page count of one checked spec.
    fn pages(&self, spec: &SpecGeometry<'_>) -> CoreResult<u64> {
        let gid = spec.group_id;
        let raw = spec.raw()?;
        let (live, margin) = (self.live, self.margin);
        if let Some(window) = spec.window {
            let what = format!(
                "group {gid}: page count from max_live_requests, max_context_len, max_scheduled_tokens, \
                 max_total_tokens, decode_input_tokens and safety_margin"
            );
            // min(max(W - 1, 0), C), exactly: W > 0 was checked, and one beyond u64 exceeds C.
            let resident = window
                .to_u64()
                .map_or(self.context, |w| u128::from(w.saturating_sub(1)).min(self.context));
            let history = checked::mul_wide(live, checked::ceil_div_wide(resident, raw, &what)?, &what)?;
            let step = checked::ceil_div_wide(self.scheduled.min(self.total), raw, &what)?;
            let pages = checked::sum_wide([history, step, live, self.protected(raw, &what)?, 1, margin], &what)?;
            return checked::narrow(pages, &what);
        }
        let what = format!(
            "group {gid}: page count from max_total_tokens, max_live_requests, decode_input_tokens and safety_margin"
        );
        let protected = self.protected(raw, &what)?;
        let full = checked::sum_wide(
            [
                checked::ceil_div_wide(self.total, raw, &what)?,
                live,
                protected,
                1,
                margin,
            ],
            &what,
        );
        if !spec.state {
            return checked::narrow(full?, &what);
        }
        // Two live pages per request plus snapshots, bounded by the full-history count. A
        // wide overflow of one count only means that the other one is the smaller.
        let state = checked::mul_wide(2, live, &what)
            .and_then(|twice| checked::sum_wide([twice, self.total / raw, protected, 1, margin], &what));
        match (state, full) {
            (Ok(state), Ok(full)) => checked::narrow(state.min(full), &what),
            (Ok(pages), Err(_)) | (Err(_), Ok(pages)) => checked::narrow(pages, &what),
            (Err(err), Err(_)) => Err(err),
        }
    }
}

/// `compute_paged_cache_group_page_counts`: the pages of each spec, in spec order.
///
/// The arguments are checked first, then every spec in order; only then are the arguments
/// converted to `u64` operands and the counts computed (so an overflow never hides an error
/// of the reference).
pub fn compute_paged_cache_group_page_counts(specs: &[SpecArg], args: &PageCountArgs) -> CoreResult<Vec<u64>> {
    let limits = Limits::check(args)?;
    let geometries = specs.iter().map(spec_geometry).collect::<CoreResult<Vec<_>>>()?;
    let operands = limits.operands()?;
    geometries.iter().map(|spec| operands.pages(spec)).collect()
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

/// `hybrid_slab_group_size`: how many K/V slabs the layers can share, or None; never fails.
///
/// None without the `flat` feature, for inputs the grouping refuses (SPEC 12.6), with fewer
/// than two labels or any state label, with several sliding windows (more groups than labels),
/// or when the labels have different layer counts; else the common count.
pub fn hybrid_slab_group_size(layer_types: &LayerTypesArg, windows: &WindowsArg) -> Option<u64> {
    if !crate::FLAT_KVCACHE {
        return None;
    }
    let layers = grouped_layers(layer_types, windows).ok()?;
    let mut counts: HashMap<LayerKind, usize> = HashMap::new();
    for layer in &layers {
        *counts.entry(layer.kind).or_default() += 1;
    }
    if counts.len() < 2 || counts.keys().any(|kind| kind.is_state()) {
        return None;
    }
    let groups: HashSet<&str> = layers.iter().map(|layer| layer.group_id.as_str()).collect();
    if groups.len() != counts.len() {
        return None;
    }
    let mut sizes = counts.into_values();
    let first = sizes.next()?;
    if sizes.all(|size| size == first) {
        u64::try_from(first).ok()
    } else {
        None
    }
}

/// What `validate_flat_scheduler_config` needs to know, resolved by the bindings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SchedulerFacts {
    /// `type(resolved_backend).__name__`.
    pub backend: String,
    /// `type(kv_pool).__name__`.
    pub kv_pool: String,
    /// `bool(getattr(backend, "uses_paged_cache_groups", False))`.
    pub uses_paged_cache_groups: bool,
    /// `bool(getattr(backend, "uses_flat_cache_groups", False))`.
    pub uses_flat_cache_groups: bool,
    /// `bool(getattr(backend, "flat_spec_capable", True))`.
    pub flat_spec_capable: bool,
    /// `str(speculative_algorithm)`, or None when it is falsy.
    pub speculative_algorithm: Option<String>,
    /// `len(paged_cache_groups)` (0 for None).
    pub num_groups: usize,
}

/// The error for a `full_attn_backend` chain that comes back to a backend already seen.
pub fn backend_cycle_error() -> CoreError {
    CoreError::Config("attn_backend full_attn_backend chain has a cycle".to_owned())
}

/// Whether `validate_flat_scheduler_config` checks anything: not when `flat_kvcache_ext` is
/// false, and never without the `flat` feature (SPEC 10). Only then are the facts resolved.
pub fn validation_applies(flat_kvcache_ext: bool) -> bool {
    flat_kvcache_ext && crate::FLAT_KVCACHE
}

/// The five checks of `validate_flat_scheduler_config` on resolved facts, in the contract's
/// order (call it when [`validation_applies`]).
pub fn validate_flat_scheduler_config(facts: &SchedulerFacts) -> CoreResult<()> {
    let (b, p) = (&facts.backend, &facts.kv_pool);
    let fail = |msg: String| Err(CoreError::Config(format!("flat KV cache: {msg}")));
    if facts.uses_paged_cache_groups && !facts.uses_flat_cache_groups {
        return fail(format!(
            "backend {b} uses paged cache groups but does not consume flat per-group tables (kv_pool {p})"
        ));
    }
    if let Some(algorithm) = &facts.speculative_algorithm {
        if !facts.flat_spec_capable {
            return fail(format!(
                "speculative algorithm {algorithm} needs a flat-spec-capable backend; {b} is not (kv_pool {p})"
            ));
        }
        if algorithm.to_uppercase() == "DFLASH" {
            return fail(format!(
                "speculative algorithm DFLASH is not supported (backend {b}, kv_pool {p})"
            ));
        }
    }
    if facts.num_groups > 1 && !facts.uses_flat_cache_groups {
        return fail(format!(
            "{} paged cache groups but backend {b} does not consume flat per-group tables; the single-table \
             fallback would serve one group's pages to every layer and silently corrupt KV (kv_pool {p})",
            facts.num_groups
        ));
    }
    if facts.num_groups == 0 {
        return fail(format!(
            "at least one paged cache group is required; state-only pools publish none (backend {b}, kv_pool {p})"
        ));
    }
    Ok(())
}
