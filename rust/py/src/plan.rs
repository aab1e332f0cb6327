//! Bindings of the memory plan (SPEC 3): extract the arguments as the core sees them, call
//! `flat_kvcache_core::plan`, convert the result to tuples. `flat_kvcache/memory.py` turns the
//! tuples into the `_types` dataclasses.

// PyO3 hands the arguments over by value; most are only read.
#![allow(
    clippy::needless_pass_by_value,
    reason = "pyfunction arguments are extracted by value"
)]

use flat_kvcache_core::sizing::plan::{
    self, BlockGeometry, ComponentArg, FlatMemoryPlan, ShapeArg, StateComponentsArg, StateItemArg,
};
use flat_kvcache_core::sizing::{arena, LabelItem};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyList, PyMapping, PyString, PyTuple, PyType};

use crate::convert::{int_arg, int_to_py, is_sequence, is_str, is_text_or_bytes, text, type_name, IntParam};
use crate::errors::core;
use crate::sizing::{layer_types_arg, windows_arg};

/// Per component, the `group_id` and `component` objects a plan hands back.
type HandBack<'py> = Vec<(Bound<'py, PyAny>, Bound<'py, PyAny>)>;

/// `flat_kvcache.ComponentSpec`, imported on first use.
static COMPONENT_SPEC: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// The components as the core sees them, with the objects a plan hands back (each component's
/// `group_id` and `component`). Called after the plan's own scalar arguments are checked (the
/// contract's order: docs/sizing-api.md); every item must be a `ComponentSpec` (a
/// `TypeError` naming `components[k]`), all of them before the core checks their numbers.
///
/// With `key_groups`, equal `group_id`s (Python equality, as dict keys) get equal keys; an
/// unhashable `group_id` is then a `TypeError`, as in the reference's row dicts. With
/// `str_ids` (the arena plan, whose groups are the cache's), `group_id` and `component` must
/// be a `str` UTF-8 can encode.
fn component_args<'py>(
    components: &Bound<'py, PyAny>,
    key_groups: bool,
    str_ids: bool,
) -> PyResult<(Vec<ComponentArg>, HandBack<'py>)> {
    let py = components.py();
    let class = COMPONENT_SPEC.get_or_try_init(py, || -> PyResult<Py<PyType>> {
        Ok(py
            .import("flat_kvcache._types")?
            .getattr("ComponentSpec")?
            .cast_into::<PyType>()?
            .unbind())
    })?;
    let not_a_sequence = || {
        PyTypeError::new_err(format!(
            "components must be a sequence of ComponentSpec, got {}",
            type_name(components)
        ))
    };
    if is_text_or_bytes(components) {
        return Err(not_a_sequence());
    }
    let items = components.try_iter().map_err(|_| not_a_sequence())?;
    let keys = PyDict::new(py);
    let mut args = Vec::new();
    let mut objects = Vec::new();
    for (k, comp) in items.enumerate() {
        let comp = comp?;
        if !comp.is_instance(class.bind(py))? {
            return Err(PyTypeError::new_err(format!(
                "components[{k}] must be a ComponentSpec, got {}",
                type_name(&comp)
            )));
        }
        let group_id = comp.getattr("group_id")?;
        let component = comp.getattr("component")?;
        if str_ids {
            for (name, value) in [("group_id", &group_id), ("component", &component)] {
                let Ok(value) = value.cast::<PyString>() else {
                    return Err(PyTypeError::new_err(format!(
                        "components[{k}].{name} must be a str, got {}",
                        type_name(value)
                    )));
                };
                value.to_str()?; // a lone surrogate: UnicodeEncodeError
            }
        }
        let group_key = if key_groups {
            if let Some(key) = keys.get_item(&group_id)? {
                key.extract::<usize>()?
            } else {
                let key = keys.len();
                keys.set_item(&group_id, key)?;
                key
            }
        } else {
            k
        };
        args.push(ComponentArg {
            group_key,
            group_id: text(&group_id)?,
            layer: int_arg(&comp.getattr("layer")?)?,
            component: text(&component)?,
            bytes_per_slot: int_arg(&comp.getattr("bytes_per_slot")?)?,
            const_bytes: int_arg(&comp.getattr("const_bytes")?)?,
        });
        objects.push((group_id, component));
    }
    Ok((args, objects))
}

/// A plan as `((block_size, block_bytes, num_blocks), [(name, nbytes, [(slot, group_id, layer,
/// component, nbytes_per_block, row_offset), ...]), ...])`.
fn plan_to_py<'py>(py: Python<'py>, plan: &FlatMemoryPlan, objects: &HandBack<'py>) -> PyResult<Bound<'py, PyTuple>> {
    let missing = || pyo3::exceptions::PyRuntimeError::new_err("plan refers to a component that was not given");
    let mut tensors = Vec::with_capacity(plan.tensors.len());
    for tensor in &plan.tensors {
        let mut bindings = Vec::with_capacity(tensor.bindings.len());
        for binding in &tensor.bindings {
            let (group_id, _) = objects.get(binding.group_source).ok_or_else(missing)?;
            let (_, component) = objects.get(binding.component_source).ok_or_else(missing)?;
            bindings.push(PyTuple::new(
                py,
                [
                    binding.slot.into_pyobject(py)?.into_any(),
                    group_id.clone(),
                    int_to_py(py, &binding.layer)?,
                    component.clone(),
                    binding.nbytes_per_block.into_pyobject(py)?.into_any(),
                    binding.row_offset.into_pyobject(py)?.into_any(),
                ],
            )?);
        }
        tensors.push((tensor.name.clone(), tensor.nbytes, PyList::new(py, bindings)?).into_pyobject(py)?);
    }
    let geometry = &plan.geometry;
    (geometry_to_py(py, geometry)?, PyList::new(py, tensors)?).into_pyobject(py)
}

/// A geometry as `(block_size, block_bytes, num_blocks)` (the block size exactly).
fn geometry_to_py<'py>(py: Python<'py>, geometry: &BlockGeometry) -> PyResult<Bound<'py, PyTuple>> {
    PyTuple::new(
        py,
        [
            int_to_py(py, &geometry.block_size)?,
            geometry.block_bytes.into_pyobject(py)?.into_any(),
            geometry.num_blocks.into_pyobject(py)?.into_any(),
        ],
    )
}

/// For each layer, the number of earlier layers with the same label (SPEC 3).
#[pyfunction]
pub fn occurrence_index(layer_types: &Bound<'_, PyAny>) -> PyResult<Vec<usize>> {
    core(plan::occurrence_index(&layer_types_arg(layer_types)?))
}

/// Bytes per page of one state component: `prod(shape) * itemsize` (SPEC 3).
#[pyfunction]
pub fn state_const_bytes(shape: &Bound<'_, PyAny>, itemsize: IntParam) -> PyResult<u64> {
    let shape = if is_str(shape) || !is_sequence(shape)? {
        ShapeArg::NotSequence(type_name(shape))
    } else {
        ShapeArg::Dims(
            shape
                .try_iter()?
                .map(|dim| int_arg(&dim?))
                .collect::<PyResult<Vec<_>>>()?,
        )
    };
    core(plan::state_const_bytes(&shape, &itemsize.0))
}

fn state_components_arg(obj: Option<&Bound<'_, PyAny>>) -> PyResult<StateComponentsArg> {
    let Some(obj) = obj.filter(|obj| !obj.is_none()) else {
        return Ok(StateComponentsArg::None);
    };
    let Ok(mapping) = obj.cast::<PyMapping>() else {
        return Ok(StateComponentsArg::NotMapping(type_name(obj)));
    };
    let items = mapping
        .items()?
        .iter()
        .map(|item| {
            let (name, nbytes): (Bound<'_, PyAny>, Bound<'_, PyAny>) = item.extract()?;
            Ok(StateItemArg {
                name: if is_str(&name) {
                    LabelItem::Str(text(&name)?)
                } else {
                    LabelItem::Other(type_name(&name))
                },
                repr: name.repr()?.to_string_lossy().into_owned(),
                nbytes: int_arg(&nbytes)?,
            })
        })
        .collect::<PyResult<Vec<_>>>()?;
    Ok(StateComponentsArg::Items(items))
}

/// The memory components of every layer (SPEC 3), as tuples `(group_id, layer, component,
/// bytes_per_slot, const_bytes)`.
#[pyfunction]
#[pyo3(signature = (layer_types, *, kv_bytes_per_slot, state_component_bytes=None, sliding_window_tokens=None))]
pub fn components_from_layers<'py>(
    py: Python<'py>,
    layer_types: &Bound<'py, PyAny>,
    kv_bytes_per_slot: IntParam,
    state_component_bytes: Option<&Bound<'py, PyAny>>,
    sliding_window_tokens: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyList>> {
    let components = core(plan::components_from_layers(
        &layer_types_arg(layer_types)?,
        &kv_bytes_per_slot.0,
        &state_components_arg(state_component_bytes)?,
        &windows_arg(sliding_window_tokens)?,
    ))?;
    let tuples = components
        .iter()
        .map(|c| {
            PyTuple::new(
                py,
                [
                    c.group_id.clone().into_pyobject(py)?.into_any(),
                    c.layer.into_pyobject(py)?.into_any(),
                    c.component.clone().into_pyobject(py)?.into_any(),
                    int_to_py(py, &c.bytes_per_slot)?,
                    int_to_py(py, &c.const_bytes)?,
                ],
            )
        })
        .collect::<PyResult<Vec<_>>>()?;
    PyList::new(py, tuples)
}

/// Page geometry (SPEC 3) as `(block_size, block_bytes, 0)`.
#[pyfunction]
pub fn solve_page_geometry<'py>(
    py: Python<'py>,
    components: &Bound<'py, PyAny>,
    block_size: IntParam,
    alignment: IntParam,
) -> PyResult<Bound<'py, PyTuple>> {
    core(block_size.0.positive("block_size"))?;
    core(alignment.0.positive("alignment"))?;
    let (args, _) = component_args(components, true, false)?;
    let geometry = core(plan::solve_page_geometry(&args, &block_size.0, &alignment.0))?;
    geometry_to_py(py, &geometry)
}

/// The block size of `solve_page_geometry`, `alignment` defaulting to `block_size` (SPEC 3).
#[pyfunction]
#[pyo3(signature = (components, block_size, alignment=None))]
pub fn equalized_block_size<'py>(
    py: Python<'py>,
    components: &Bound<'py, PyAny>,
    block_size: IntParam,
    alignment: Option<IntParam>,
) -> PyResult<Bound<'py, PyAny>> {
    core(block_size.0.positive("block_size"))?;
    core(alignment.as_ref().map_or(&block_size.0, |a| &a.0).positive("alignment"))?;
    let (args, _) = component_args(components, true, false)?;
    let block_size = core(plan::equalized_block_size(
        &args,
        &block_size.0,
        alignment.as_ref().map(|a| &a.0),
    ))?;
    int_to_py(py, &block_size)
}

/// The per-component plan (SPEC 3): one tensor per component.
#[pyfunction]
#[pyo3(
    signature = (components, block_size, budget_bytes, *, reserved_bytes_per_block = IntParam::of(0)),
    text_signature = "(components, block_size, budget_bytes, *, reserved_bytes_per_block=0)"
)]
pub fn plan_component_tensors<'py>(
    py: Python<'py>,
    components: &Bound<'py, PyAny>,
    block_size: IntParam,
    budget_bytes: IntParam,
    reserved_bytes_per_block: IntParam,
) -> PyResult<Bound<'py, PyTuple>> {
    core(block_size.0.positive("block_size"))?;
    core(budget_bytes.0.non_negative("budget_bytes"))?;
    core(reserved_bytes_per_block.0.non_negative("reserved_bytes_per_block"))?;
    let (args, objects) = component_args(components, false, false)?;
    let plan = core(plan::plan_component_tensors(
        &args,
        &block_size.0,
        &budget_bytes.0,
        &reserved_bytes_per_block.0,
    ))?;
    plan_to_py(py, &plan, &objects)
}

/// The slab plan (SPEC 3): slot j is one tensor shared by the j-th layer of every group.
#[pyfunction]
pub fn plan_tensors<'py>(
    py: Python<'py>,
    components: &Bound<'py, PyAny>,
    block_size: IntParam,
    budget_bytes: IntParam,
) -> PyResult<Bound<'py, PyTuple>> {
    core(block_size.0.positive("block_size"))?;
    core(budget_bytes.0.non_negative("budget_bytes"))?;
    let (args, objects) = component_args(components, true, false)?;
    let plan = core(plan::plan_tensors(&args, &block_size.0, &budget_bytes.0))?;
    plan_to_py(py, &plan, &objects)
}

/// The arena plan (SPEC 13 storage, docs/sizing-api.md "Arena plan"), as
/// `(page_size, alignment, unit_bytes, num_units, [(first component index, kind, item_bytes,
/// per_unit, num_ids, slack_bytes), ...], [(offset, nbytes), ...])`; the Python wrapper names
/// the groups and components from the input.
#[pyfunction]
#[pyo3(
    signature = (components, page_size, budget_bytes, *, alignment = IntParam::of(256), max_live_requests = IntParam::of(0)),
    text_signature = "(components, page_size, budget_bytes, *, alignment=256, max_live_requests=0)"
)]
pub fn plan_arena<'py>(
    py: Python<'py>,
    components: &Bound<'py, PyAny>,
    page_size: IntParam,
    budget_bytes: IntParam,
    alignment: IntParam,
    max_live_requests: IntParam,
) -> PyResult<Bound<'py, PyTuple>> {
    core(arena::check_scalars(
        &page_size.0,
        &budget_bytes.0,
        &alignment.0,
        &max_live_requests.0,
    ))?;
    let (args, _) = component_args(components, true, true)?;
    let plan = core(arena::plan_arena(
        &args,
        &page_size.0,
        &budget_bytes.0,
        &alignment.0,
        &max_live_requests.0,
    ))?;
    let groups: Vec<_> = plan
        .groups
        .iter()
        .map(|g| {
            (
                g.group_source,
                g.kind,
                g.item_bytes,
                g.per_unit,
                g.num_ids,
                g.slack_bytes,
            )
        })
        .collect();
    let placed: Vec<_> = plan.components.iter().map(|c| (c.offset, c.nbytes)).collect();
    (
        plan.page_size,
        plan.alignment,
        plan.unit_bytes,
        plan.num_units,
        PyList::new(py, groups)?,
        PyList::new(py, placed)?,
    )
        .into_pyobject(py)
}
