//! SPEC 2 grouping: layer labels and windows (as the bindings saw them) -> validated layers,
//! their group ids, and one group spec per distinct group.

use std::collections::HashSet;

use super::labels::{known_kinds, LayerKind};
use crate::error::{CoreError, CoreResult};
use crate::num::int::{Int, IntArg};

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
                .map(|&kind| kind.is_windowed().then(|| window.clone()))
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

/// A window as the reference prints it (`None` or the int).
pub(super) fn show(window: Option<&Int>) -> String {
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
        if kind == LayerKind::Chunked && !positive {
            return Err(CoreError::invalid(format!(
                "layer {i} (chunked_attention) needs a positive attention chunk in its window entry, got {}",
                show(window.as_ref())
            )));
        }
        if !kind.is_windowed() && positive {
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
        .map(|(&kind, window)| window.filter(|_| kind.is_windowed()))
        .collect();
    // Several distinct windows (chunks) split the sliding (chunked) layers into one group per
    // window (chunk); each kind is counted apart.
    let distinct = |of: LayerKind| {
        kinds
            .iter()
            .zip(&windows)
            .filter(|(&k, _)| k == of)
            .filter_map(|(_, w)| w.as_ref())
            .collect::<HashSet<_>>()
            .len()
    };
    let several_windows = distinct(LayerKind::Sliding) > 1;
    let several_chunks = distinct(LayerKind::Chunked) > 1;
    Ok(kinds
        .into_iter()
        .zip(windows)
        .map(|(kind, window)| {
            let several = if kind == LayerKind::Chunked {
                several_chunks
            } else {
                several_windows
            };
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
    /// `full_history`, `sliding_window` or `chunked_window`.
    pub retention: &'static str,
    /// Rows per page (the page size), exactly as given.
    pub rows_per_page: Int,
    /// Tokens per row.
    pub entry_stride_tokens: u64,
    /// The window of a sliding group (the chunk of a chunked group), exactly as given.
    pub sliding_window_tokens: Option<Int>,
    /// `history` or `state`.
    pub family: &'static str,
}

/// The specs of checked labels. The page size and the windows are carried exactly (they are the
/// caller's own values; only the sizes computed from them must fit `u64`).
pub(super) fn specs_for_labels(labels: &[String], windows: &WindowsArg, page_size: &Int) -> CoreResult<Vec<GroupSpec>> {
    let layers = group_labels(labels, windows)?;
    let mut specs: Vec<GroupSpec> = Vec::new();
    for layer in layers {
        if specs.iter().any(|spec| spec.group_id == layer.group_id) {
            continue;
        }
        specs.push(GroupSpec {
            group_id: layer.group_id,
            retention: layer.kind.retention(),
            rows_per_page: page_size.clone(),
            entry_stride_tokens: 1,
            sliding_window_tokens: layer.window,
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
