//! The slab predicate (SPEC 12.6): whether the K/V layers can share slabs, and how many.

use std::collections::{HashMap, HashSet};

use super::grouping::{grouped_layers, LayerTypesArg, WindowsArg};
use super::labels::LayerKind;

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
