//! The memory plan (SPEC 3): memory components of layers, page geometry, and tensor plans
//! that turn a byte budget into a page count.
//!
//! As in [`crate::sizing`], inputs arrive as the bindings saw them and are checked exactly, in
//! the reference's order, before any arithmetic. Sizes are then computed exactly (quotients
//! capped at `2^64`, see [`capped_quotient`]), so a sum of rows beyond `u64` still gives the
//! exact "need at least 2 blocks" error, and a size multiplied by zero may be of any size. Only
//! the sizes a plan reports (bytes per block, block counts, tensor bytes, offsets) must fit `u64`;
//! the caller's own values it hands back (layers, component sizes, an unchanged block size) are
//! carried exactly.

use std::collections::HashMap;

use crate::error::{CoreError, CoreResult};
use crate::num::checked;
use crate::num::int::{capped_ceil_quotient, capped_quotient, sum, Int, IntArg};
use crate::sizing::{self, LabelItem, LayerTypesArg, WindowsArg};

/// `occurrence_index`: for each layer, the number of earlier layers with the same label (any
/// str label; `layer_types` must be a sequence of str).
pub fn occurrence_index(layer_types: &LayerTypesArg) -> CoreResult<Vec<usize>> {
    let mut seen: HashMap<String, usize> = HashMap::new();
    Ok(sizing::layer_labels(layer_types)?
        .into_iter()
        .map(|label| {
            let count = seen.entry(label).or_default();
            let index = *count;
            *count += 1;
            index
        })
        .collect())
}

/// The `shape` argument of `state_const_bytes`, as the bindings saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ShapeArg {
    /// A str or a non-sequence; holds the type name.
    NotSequence(String),
    /// A sequence of dimensions.
    Dims(Vec<IntArg>),
}

/// `state_const_bytes`: `prod(shape) * itemsize` bytes per page (an empty shape is one
/// element). Every dimension is checked (an int >= 0), then `itemsize` (an int > 0).
pub fn state_const_bytes(shape: &ShapeArg, itemsize: &IntArg) -> CoreResult<u64> {
    let dims = match shape {
        ShapeArg::NotSequence(type_name) => {
            return Err(CoreError::Type(format!(
                "shape must be a sequence of ints, not {type_name}"
            )));
        }
        ShapeArg::Dims(dims) => dims
            .iter()
            .enumerate()
            .map(|(i, dim)| dim.non_negative(&format!("shape[{i}]")))
            .collect::<CoreResult<Vec<_>>>()?,
    };
    let itemsize = itemsize.positive("itemsize")?;
    // A zero dimension makes the product 0 whatever the others are (they need not fit u64).
    if dims.iter().any(|dim| dim.is_zero()) {
        return Ok(0);
    }
    let what = "state_const_bytes: prod(shape) * itemsize";
    let mut bytes = itemsize.u64("itemsize")?;
    for (i, dim) in dims.iter().enumerate() {
        bytes = checked::mul(bytes, dim.u64(&format!("shape[{i}]"))?, what)?;
    }
    Ok(bytes)
}

/// The `state_component_bytes` argument of `components_from_layers`, as the bindings saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StateComponentsArg {
    /// `None`.
    None,
    /// Not a mapping; holds the type name.
    NotMapping(String),
    /// The mapping's items, in its order.
    Items(Vec<StateItemArg>),
}

/// One `(name, bytes per page)` item of `state_component_bytes`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StateItemArg {
    /// The key (a str, else its type name).
    pub name: LabelItem,
    /// `repr(key)`, for messages.
    pub repr: String,
    /// The value.
    pub nbytes: IntArg,
}

/// One memory component (the fields of `ComponentSpec`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ComponentSpec {
    /// The group of the layer.
    pub group_id: String,
    /// The absolute layer index.
    pub layer: usize,
    /// The component name (`kv` for history layers).
    pub component: String,
    /// Bytes per token slot, exactly as given.
    pub bytes_per_slot: Int,
    /// Bytes per page, exactly as given.
    pub const_bytes: Int,
}

/// One checked state component: its name and its size (exact).
struct StateItem<'a> {
    name: &'a str,
    nbytes: &'a Int,
}

/// The state mapping, checked: a mapping of str to non-negative ints.
fn state_items(state_component_bytes: &StateComponentsArg) -> CoreResult<Vec<StateItem<'_>>> {
    match state_component_bytes {
        StateComponentsArg::None => Ok(Vec::new()),
        StateComponentsArg::NotMapping(type_name) => Err(CoreError::Type(format!(
            "state_component_bytes must be a mapping of component name to bytes per page, not {type_name}"
        ))),
        StateComponentsArg::Items(items) => items
            .iter()
            .map(|item| match &item.name {
                LabelItem::Str(name) => Ok(StateItem {
                    name,
                    nbytes: item
                        .nbytes
                        .non_negative(&format!("state_component_bytes[{}]", item.repr))?,
                }),
                LabelItem::Other(type_name) => Err(CoreError::Type(format!(
                    "state_component_bytes keys must be str, not {type_name}"
                ))),
            })
            .collect(),
    }
}

/// `components_from_layers`: the memory components of every layer, layer by layer.
///
/// Checks, in order: `kv_bytes_per_slot > 0`, the state mapping (a mapping of str to
/// non-negative ints), the layers (as `layer_group_ids`), then each state layer needs a
/// non-empty mapping. The sizes are carried exactly (nothing is computed from them here).
pub fn components_from_layers(
    layer_types: &LayerTypesArg,
    kv_bytes_per_slot: &IntArg,
    state_component_bytes: &StateComponentsArg,
    windows: &WindowsArg,
) -> CoreResult<Vec<ComponentSpec>> {
    let kv_bytes = kv_bytes_per_slot.positive("kv_bytes_per_slot")?;
    let state = state_items(state_component_bytes)?;
    // (group id, layer, the state item or None for `kv`)
    let mut layout: Vec<(String, usize, Option<&StateItem<'_>>)> = Vec::new();
    for (i, layer) in sizing::grouped_layers(layer_types, windows)?.into_iter().enumerate() {
        if !layer.kind.is_state() {
            layout.push((layer.group_id, i, None));
            continue;
        }
        if state.is_empty() {
            return Err(CoreError::invalid(format!(
                "layer {i} ({}) needs state_component_bytes",
                layer.kind.label()
            )));
        }
        layout.extend(state.iter().map(|item| (layer.group_id.clone(), i, Some(item))));
    }
    Ok(layout
        .into_iter()
        .map(|(group_id, layer, item)| match item {
            None => ComponentSpec {
                group_id,
                layer,
                component: "kv".to_owned(),
                bytes_per_slot: kv_bytes.clone(),
                const_bytes: Int::zero(),
            },
            Some(item) => ComponentSpec {
                group_id,
                layer,
                component: item.name.to_owned(),
                bytes_per_slot: Int::zero(),
                const_bytes: item.nbytes.clone(),
            },
        })
        .collect())
}

/// A component as the bindings read it from a `ComponentSpec` (or any object with its fields).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ComponentArg {
    /// Equal keys mean equal `group_id`s (the bindings key them by Python equality).
    pub group_key: usize,
    /// `str(group_id)`, for messages and tensor names.
    pub group_id: String,
    /// `layer`.
    pub layer: IntArg,
    /// `str(component)`, for tensor names.
    pub component: String,
    /// `bytes_per_slot`.
    pub bytes_per_slot: IntArg,
    /// `const_bytes`.
    pub const_bytes: IntArg,
}

/// Component arguments from component specs, groups keyed by their id (for Rust callers; the
/// bindings key groups by Python equality instead).
pub fn component_args(specs: &[ComponentSpec]) -> Vec<ComponentArg> {
    let mut keys: HashMap<&str, usize> = HashMap::new();
    specs
        .iter()
        .map(|spec| {
            let next = keys.len();
            ComponentArg {
                group_key: *keys.entry(spec.group_id.as_str()).or_insert(next),
                group_id: spec.group_id.clone(),
                layer: IntArg::Int(Int::from(spec.layer)),
                component: spec.component.clone(),
                bytes_per_slot: IntArg::Int(spec.bytes_per_slot.clone()),
                const_bytes: IntArg::Int(spec.const_bytes.clone()),
            }
        })
        .collect()
}

/// A checked component: exact layer and sizes.
pub(crate) struct Checked<'a> {
    pub(crate) arg: &'a ComponentArg,
    layer: &'a Int,
    pub(crate) bytes_per_slot: &'a Int,
    pub(crate) const_bytes: &'a Int,
}

impl Checked<'_> {
    /// The row bytes of this component at `page` tokens per page: `bytes_per_slot * P +
    /// const_bytes`, exactly.
    fn row(&self, page: &Int) -> Int {
        self.bytes_per_slot.mul(page).add(self.const_bytes)
    }
}

/// Every component's `layer` must be an int and its sizes ints >= 0 (named `components[<k>]`).
pub(crate) fn check_components(components: &[ComponentArg]) -> CoreResult<Vec<Checked<'_>>> {
    components
        .iter()
        .enumerate()
        .map(|(k, arg)| {
            Ok(Checked {
                arg,
                layer: arg.layer.int(&format!("components[{k}].layer"))?,
                bytes_per_slot: arg
                    .bytes_per_slot
                    .non_negative(&format!("components[{k}].bytes_per_slot"))?,
                const_bytes: arg.const_bytes.non_negative(&format!("components[{k}].const_bytes"))?,
            })
        })
        .collect()
}

/// Page geometry: tokens per page (`block_size`), bytes per page row, and page count.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockGeometry {
    /// Tokens per page (exact: a block size that nothing multiplies may be of any size).
    pub block_size: Int,
    /// Bytes per page (one row of every buffer together).
    pub block_bytes: u64,
    /// Number of pages (0 when only the geometry was solved).
    pub num_blocks: u64,
}

/// Rows in first-appearance order of their (group, layer) key, with the index of the first
/// component of each row and the indices of all its components.
fn rows_of<'c>(checked: &[Checked<'c>]) -> Vec<(usize, &'c Int, Vec<usize>)> {
    let mut index: HashMap<(usize, &Int), usize> = HashMap::new();
    let mut rows: Vec<(usize, &Int, Vec<usize>)> = Vec::new();
    for (k, comp) in checked.iter().enumerate() {
        let key = (comp.arg.group_key, comp.layer);
        let next = rows.len();
        let row = *index.entry(key).or_insert(next);
        if row == next {
            rows.push((k, comp.layer, Vec::new()));
        }
        if let Some((_, _, members)) = rows.get_mut(row) {
            members.push(k);
        }
    }
    rows
}

/// `solve_page_geometry`: tokens per page and bytes per page (`num_blocks` is 0).
///
/// Per (group, layer) row, per-token and per-page bytes are summed; a row with both is an
/// error. If some row has per-page bytes, a page must hold `needed = ceil(max_const /
/// max_linear)` tokens; when `needed > block_size` the block size grows to `needed` rounded up
/// to `alignment`. `block_bytes = max(max_linear * block_size, max_const)`.
pub fn solve_page_geometry(
    components: &[ComponentArg],
    block_size: &IntArg,
    alignment: &IntArg,
) -> CoreResult<BlockGeometry> {
    let (block, block_bytes) = exact_geometry(components, block_size, alignment)?;
    let what = "block_bytes from bytes_per_slot, const_bytes and block_size";
    Ok(BlockGeometry {
        block_bytes: block_bytes.u64(what)?,
        block_size: block,
        num_blocks: 0,
    })
}

/// The checks of [`solve_page_geometry`], then its block size and block bytes, exactly.
fn exact_geometry(components: &[ComponentArg], block_size: &IntArg, alignment: &IntArg) -> CoreResult<(Int, Int)> {
    let block_size = block_size.positive("block_size")?;
    let alignment = alignment.positive("alignment")?;
    let checked = check_components(components)?;
    let rows = rows_of(&checked);
    // The sizes are >= 0, so a row's sum is > 0 exactly when one of its sizes is: the checks
    // need no arithmetic (and so no operand has to fit u64 yet).
    for (first, layer, members) in &rows {
        let has_linear = members
            .iter()
            .any(|&k| checked.get(k).is_some_and(|c| c.bytes_per_slot.is_positive()));
        let has_const = members
            .iter()
            .any(|&k| checked.get(k).is_some_and(|c| c.const_bytes.is_positive()));
        if has_linear && has_const {
            let group_id = checked.get(*first).map_or("", |c| c.arg.group_id.as_str());
            return Err(CoreError::invalid(format!(
                "group {group_id} layer {layer} mixes per-token and per-page components"
            )));
        }
    }
    let any_const = checked.iter().any(|c| c.const_bytes.is_positive());
    let any_linear = checked.iter().any(|c| c.bytes_per_slot.is_positive());
    if any_const && !any_linear {
        return Err(CoreError::invalid(
            "state components need at least one per-token (history) component to size pages",
        ));
    }
    // Per-row sums, exactly.
    let row_sum = |members: &[usize], linear: bool| -> Int {
        sum(members
            .iter()
            .filter_map(|&k| checked.get(k))
            .map(|c| if linear { c.bytes_per_slot } else { c.const_bytes }))
    };
    let mut max_linear = Int::zero();
    let mut max_const = Int::zero();
    for (_, _, members) in &rows {
        max_linear = max_linear.max(row_sum(members, true));
        max_const = max_const.max(row_sum(members, false));
    }
    let mut block = block_size.clone();
    if max_const.is_positive() {
        // max_linear > 0 here (checked above). needed = ceil(C / L) > block exactly when
        // C > block * L (no division, so exact at any size). A grown block size is computed, so
        // it must fit u64; a quotient capped at 2^64 then gives the exact answer (or the overflow).
        if max_const > block.mul(&max_linear) {
            let needed = capped_ceil_quotient(&max_const, &max_linear);
            let what = "block_size from const_bytes, bytes_per_slot and alignment";
            let grown = alignment.mul(&capped_ceil_quotient(&needed, alignment));
            block = Int::from(grown.u64(what)?);
        }
    }
    let block_bytes = max_linear.mul(&block).max(max_const);
    Ok((block, block_bytes))
}

/// `equalized_block_size`: the block size of [`solve_page_geometry`], `alignment` defaulting to
/// `block_size` (the block bytes are not part of the answer, so they need not fit `u64`).
pub fn equalized_block_size(
    components: &[ComponentArg],
    block_size: &IntArg,
    alignment: Option<&IntArg>,
) -> CoreResult<Int> {
    Ok(exact_geometry(components, block_size, alignment.unwrap_or(block_size))?.0)
}

/// Where one component lives inside a planned tensor (the fields of `LayerBinding`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerBinding {
    /// The tensor (slot) index.
    pub slot: usize,
    /// The input component whose `group_id` the binding carries (the first component of the
    /// group in a slab plan: the group's key object).
    pub group_source: usize,
    /// The input component whose `component` name the binding carries.
    pub component_source: usize,
    /// The layer, as checked.
    pub layer: Int,
    /// Bytes of this component per page.
    pub nbytes_per_block: u64,
    /// Byte offset of this component inside the tensor's page row.
    pub row_offset: u64,
}

/// One buffer of the plan (the fields of `TensorPlan`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorPlan {
    /// The tensor name.
    pub name: String,
    /// Total bytes.
    pub nbytes: u64,
    /// The components it serves.
    pub bindings: Vec<LayerBinding>,
}

/// A memory plan (the fields of `FlatMemoryPlan`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FlatMemoryPlan {
    /// The page geometry, with the page count.
    pub geometry: BlockGeometry,
    /// The tensors to allocate.
    pub tensors: Vec<TensorPlan>,
}

/// How many whole blocks of `bytes_per_block` fit the budget (round down); fewer than 2 (one is
/// the null page) is an error, more than `u64` holds an overflow naming `budget_bytes`.
fn num_blocks(budget: &Int, bytes_per_block: &Int) -> CoreResult<u64> {
    // A zero divisor gives 0 blocks (the error below), whatever the budget.
    let blocks = if bytes_per_block.is_positive() {
        capped_quotient(budget, bytes_per_block)
    } else {
        Int::zero()
    };
    if blocks <= Int::from(1u64) {
        return Err(CoreError::invalid(format!(
            "budget_bytes={budget} gives {blocks} blocks of {bytes_per_block} bytes; need at least 2 (one is the null page)"
        )));
    }
    blocks.u64("num_blocks = budget_bytes // bytes per block")
}

/// A size the plan reports, which must fit `u64` (`what` names the inputs it comes from).
fn plan_size(v: &Int, what: &str) -> CoreResult<u64> {
    v.u64(what)
}

/// `plan_component_tensors`: one tensor per component, each with `num_blocks` rows of
/// `bytes_per_slot * P + const_bytes` bytes; `num_blocks = budget // (sum of rows +
/// reserved_bytes_per_block)`.
pub fn plan_component_tensors(
    components: &[ComponentArg],
    block_size: &IntArg,
    budget_bytes: &IntArg,
    reserved_bytes_per_block: &IntArg,
) -> CoreResult<FlatMemoryPlan> {
    let page = block_size.positive("block_size")?;
    let budget = budget_bytes.non_negative("budget_bytes")?;
    let reserved = reserved_bytes_per_block.non_negative("reserved_bytes_per_block")?;
    let checked = check_components(components)?;
    let rows: Vec<Int> = checked.iter().map(|c| c.row(page)).collect();
    let row_sum = sum(&rows);
    let blocks = num_blocks(budget, &row_sum.add(reserved))?;
    let tensors = checked
        .iter()
        .zip(&rows)
        .enumerate()
        .map(|(k, (comp, row))| {
            let row_bytes = plan_size(row, "bytes_per_slot * block_size + const_bytes of a component")?;
            Ok(TensorPlan {
                name: format!("{}.{}.{}", comp.arg.group_id, comp.layer, comp.arg.component),
                nbytes: checked::mul(blocks, row_bytes, "budget_bytes: num_blocks * row bytes")?,
                bindings: vec![LayerBinding {
                    slot: k,
                    group_source: k,
                    component_source: k,
                    layer: comp.layer.clone(),
                    nbytes_per_block: row_bytes,
                    row_offset: 0,
                }],
            })
        })
        .collect::<CoreResult<Vec<_>>>()?;
    Ok(FlatMemoryPlan {
        geometry: BlockGeometry {
            block_size: page.clone(),
            block_bytes: plan_size(
                &row_sum,
                "bytes_per_slot * block_size + const_bytes summed over components",
            )?,
            num_blocks: blocks,
        },
        tensors,
    })
}

/// One (group, layer) row of a slab plan: its layer and its components `(index, row bytes)`.
struct SlabRow<'a> {
    layer: &'a Int,
    parts: Vec<(usize, Int)>,
}

/// `plan_tensors` (slab plan): slot j is one tensor shared by the j-th layer (first-appearance
/// order) of every group (first-appearance order). A (group, layer) row packs its components
/// at increasing offsets; a slot's row is the largest row bound to it, and `num_blocks = budget
/// // sum(slot rows)`.
pub fn plan_tensors(
    components: &[ComponentArg],
    block_size: &IntArg,
    budget_bytes: &IntArg,
) -> CoreResult<FlatMemoryPlan> {
    let page = block_size.positive("block_size")?;
    let budget = budget_bytes.non_negative("budget_bytes")?;
    let checked = check_components(components)?;
    // Groups in first-appearance order, each with its rows in first-appearance order; the
    // group's first component carries its id.
    let mut group_index: HashMap<usize, usize> = HashMap::new();
    let mut groups: Vec<(usize, Vec<SlabRow<'_>>)> = Vec::new();
    for (k, comp) in checked.iter().enumerate() {
        let row_bytes = comp.row(page);
        let next = groups.len();
        let g = *group_index.entry(comp.arg.group_key).or_insert(next);
        if g == next {
            groups.push((k, Vec::new()));
        }
        let Some((_, rows)) = groups.get_mut(g) else { continue };
        match rows.iter_mut().find(|row| row.layer == comp.layer) {
            Some(row) => row.parts.push((k, row_bytes)),
            None => rows.push(SlabRow {
                layer: comp.layer,
                parts: vec![(k, row_bytes)],
            }),
        }
    }
    let num_slots = groups.iter().map(|(_, rows)| rows.len()).max().unwrap_or(0);
    let mut slot_rows = vec![Int::zero(); num_slots];
    // (slot, group source, component, layer, row bytes, offset), in (group, component) order.
    let mut placed: Vec<(usize, usize, usize, &Int, &Int, Int)> = Vec::new();
    for (group_source, rows) in &groups {
        for (slot, row) in rows.iter().enumerate() {
            let mut offset = Int::zero();
            for (k, bytes) in &row.parts {
                let next = offset.add(bytes);
                placed.push((slot, *group_source, *k, row.layer, bytes, offset));
                offset = next;
            }
            if let Some(slot_row) = slot_rows.get_mut(slot) {
                if offset > *slot_row {
                    *slot_row = offset;
                }
            }
        }
    }
    let total = sum(&slot_rows);
    let blocks = num_blocks(budget, &total)?;
    let mut tensors = slot_rows
        .iter()
        .enumerate()
        .map(|(slot, row)| {
            Ok(TensorPlan {
                name: format!("slab{slot}"),
                nbytes: checked::mul(
                    blocks,
                    plan_size(row, "bytes_per_slot * block_size + const_bytes of a slab row")?,
                    "budget_bytes: num_blocks * slab row bytes",
                )?,
                bindings: Vec::new(),
            })
        })
        .collect::<CoreResult<Vec<_>>>()?;
    for (slot, group_source, k, layer, bytes, offset) in placed {
        let binding = LayerBinding {
            slot,
            group_source,
            component_source: k,
            layer: layer.clone(),
            nbytes_per_block: plan_size(bytes, "bytes_per_slot * block_size + const_bytes of a component")?,
            row_offset: plan_size(
                &offset,
                "slab row offset from bytes_per_slot * block_size + const_bytes",
            )?,
        };
        if let Some(tensor) = tensors.get_mut(slot) {
            tensor.bindings.push(binding);
        }
    }
    Ok(FlatMemoryPlan {
        geometry: BlockGeometry {
            block_size: page.clone(),
            block_bytes: plan_size(
                &total,
                "bytes_per_slot * block_size + const_bytes summed over slab rows",
            )?,
            num_blocks: blocks,
        },
        tensors,
    })
}
