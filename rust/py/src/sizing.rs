//! Bindings of the sizing API (SPEC 2, 10): extract the arguments as the core sees them, call
//! `flat_kvcache_core::sizing`, convert the result. `flat_kvcache/sizing.py` wraps these.

// PyO3 hands the arguments over by value; most are only read.
#![allow(
    clippy::needless_pass_by_value,
    reason = "pyfunction arguments are extracted by value"
)]

use flat_kvcache_core::sizing::{
    self, GroupSpec, LabelItem, LayerTypesArg, PageCountArgs, SchedulerFacts, SpecArg, Text, WindowEntry, WindowsArg,
};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyList, PyTuple};

use crate::convert::{int_arg, int_to_py, is_sequence, is_str, text, type_has, type_name, IntParam};
use crate::errors::core;

/// `layer_types` as the core sees it: a bare str, a non-sequence, or its items (str or not).
pub fn layer_types_arg(obj: &Bound<'_, PyAny>) -> PyResult<LayerTypesArg> {
    if is_str(obj) {
        return Ok(LayerTypesArg::Str);
    }
    if !is_sequence(obj)? {
        return Ok(LayerTypesArg::NotSequence(type_name(obj)));
    }
    let items = obj
        .try_iter()?
        .map(|item| {
            let item = item?;
            Ok(if is_str(&item) {
                LabelItem::Str(text(&item)?)
            } else {
                LabelItem::Other(type_name(&item))
            })
        })
        .collect::<PyResult<Vec<_>>>()?;
    Ok(LayerTypesArg::Items(items))
}

/// `sliding_window_tokens` as the core sees it (the shape tests of the reference's
/// `_window_entries`: str and bool are refused, a type with `__index__` is an int, then a
/// sequence of None-or-int entries).
pub fn windows_arg(obj: Option<&Bound<'_, PyAny>>) -> PyResult<WindowsArg> {
    let Some(obj) = obj.filter(|obj| !obj.is_none()) else {
        return Ok(WindowsArg::None);
    };
    if is_str(obj) {
        return Ok(WindowsArg::Refused("str".to_owned()));
    }
    if obj.is_instance_of::<PyBool>() {
        return Ok(WindowsArg::Refused("bool".to_owned()));
    }
    // A sequence first: a numpy array's type has `__index__` too, but only a 0-d one is an int.
    let per_layer = is_sequence(obj)?;
    if !per_layer {
        if type_has(obj, "__index__")? {
            return Ok(WindowsArg::Int(int_arg(obj)?));
        }
        return Ok(WindowsArg::Refused(type_name(obj)));
    }
    // `list(window)`, as the reference takes the entries (a length hint, then iteration).
    let entries = obj
        .py()
        .get_type::<PyList>()
        .call1((obj,))?
        .cast_into::<PyList>()?
        .iter()
        .map(|entry| {
            Ok(if entry.is_none() {
                WindowEntry::None
            } else if entry.is_instance_of::<PyBool>() || !type_has(&entry, "__index__")? {
                WindowEntry::Refused(type_name(&entry))
            } else {
                WindowEntry::Int(int_arg(&entry)?)
            })
        })
        .collect::<PyResult<Vec<_>>>()?;
    Ok(WindowsArg::PerLayer(entries))
}

fn text_arg(obj: &Bound<'_, PyAny>) -> PyResult<Text> {
    Ok(if is_str(obj) {
        Text::Str(text(obj)?)
    } else {
        Text::Other(text(obj)?)
    })
}

/// A `PagedCacheGroupSpec` (or any object with its attributes) as the core sees it, with the
/// `group_id` object itself (the key of the page-count dict).
fn spec_arg<'py>(spec: &Bound<'py, PyAny>) -> PyResult<(Bound<'py, PyAny>, SpecArg)> {
    let group_id = spec.getattr("group_id")?;
    let window = spec.getattr("sliding_window_tokens")?;
    let arg = SpecArg {
        group_id: text(&group_id)?,
        retention: text_arg(&spec.getattr("retention")?)?,
        rows_per_page: int_arg(&spec.getattr("rows_per_page")?)?,
        entry_stride_tokens: int_arg(&spec.getattr("entry_stride_tokens")?)?,
        sliding_window_tokens: if window.is_none() {
            None
        } else {
            Some(int_arg(&window)?)
        },
        family: text_arg(&spec.getattr("family")?)?,
    };
    Ok((group_id, arg))
}

/// A spec as the tuple `(group_id, retention, rows_per_page, entry_stride_tokens,
/// sliding_window_tokens, family)` (the wrapper makes a `PagedCacheGroupSpec` of it).
fn spec_to_py<'py>(py: Python<'py>, spec: &GroupSpec) -> PyResult<Bound<'py, PyTuple>> {
    let window = match &spec.sliding_window_tokens {
        Some(window) => int_to_py(py, window)?,
        None => py.None().into_bound(py),
    };
    PyTuple::new(
        py,
        [
            spec.group_id.clone().into_pyobject(py)?.into_any(),
            spec.retention.into_pyobject(py)?.into_any(),
            int_to_py(py, &spec.rows_per_page)?,
            spec.entry_stride_tokens.into_pyobject(py)?.into_any(),
            window,
            spec.family.into_pyobject(py)?.into_any(),
        ],
    )
}

fn specs_to_py<'py>(py: Python<'py>, specs: &[GroupSpec]) -> PyResult<Bound<'py, PyList>> {
    PyList::new(
        py,
        specs
            .iter()
            .map(|spec| spec_to_py(py, spec))
            .collect::<PyResult<Vec<_>>>()?,
    )
}

/// Whether the module was built with the `flat` cargo feature (`FLAT_KVCACHE`).
#[pyfunction]
pub fn scheduler_ext_flat_kvcache() -> bool {
    flat_kvcache_core::FLAT_KVCACHE
}

/// The group id of every layer (SPEC 2): a sliding layer's id is
/// `sliding_attention_<window>` when sliding layers carry several windows, else its label.
#[pyfunction]
#[pyo3(signature = (layer_types, sliding_window_tokens=None))]
pub fn layer_group_ids(
    layer_types: &Bound<'_, PyAny>,
    sliding_window_tokens: Option<&Bound<'_, PyAny>>,
) -> PyResult<Vec<String>> {
    let layer_types = layer_types_arg(layer_types)?;
    let windows = windows_arg(sliding_window_tokens)?;
    core(sizing::layer_group_ids(&layer_types, &windows))
}

/// One spec per distinct group id (SPEC 2), as tuples `(group_id, retention, rows_per_page,
/// entry_stride_tokens, sliding_window_tokens, family)`.
#[pyfunction]
#[pyo3(signature = (layer_types, sliding_window_tokens=None, *, page_size))]
pub fn group_specs_from_layer_types<'py>(
    py: Python<'py>,
    layer_types: &Bound<'py, PyAny>,
    sliding_window_tokens: Option<&Bound<'py, PyAny>>,
    page_size: IntParam,
) -> PyResult<Bound<'py, PyList>> {
    let layer_types = layer_types_arg(layer_types)?;
    let windows = windows_arg(sliding_window_tokens)?;
    let specs = core(sizing::group_specs_from_layer_types(
        &layer_types,
        &windows,
        &page_size.0,
    ))?;
    specs_to_py(py, &specs)
}

/// Pages each group needs (SPEC 2), as `{group_id: pages}` keyed by the specs' `group_id`s.
#[pyfunction]
#[pyo3(signature = (
    specs,
    *,
    max_live_requests,
    max_scheduled_tokens,
    max_total_tokens,
    max_context_len,
    decode_input_tokens = IntParam::of(1),
    overlap_schedule_depth = IntParam::of(0),
    safety_margin = IntParam::of(0),
), text_signature = "(specs, *, max_live_requests, max_scheduled_tokens, max_total_tokens, max_context_len, \
    decode_input_tokens=1, overlap_schedule_depth=0, safety_margin=0)")]
#[allow(clippy::too_many_arguments, reason = "the keyword signature of the Python contract")]
pub fn compute_paged_cache_group_page_counts<'py>(
    py: Python<'py>,
    specs: &Bound<'py, PyAny>,
    max_live_requests: IntParam,
    max_scheduled_tokens: IntParam,
    max_total_tokens: IntParam,
    max_context_len: IntParam,
    decode_input_tokens: IntParam,
    overlap_schedule_depth: IntParam,
    safety_margin: IntParam,
) -> PyResult<Bound<'py, PyDict>> {
    let (keys, specs): (Vec<_>, Vec<_>) = specs
        .try_iter()?
        .map(|spec| spec_arg(&spec?))
        .collect::<PyResult<Vec<_>>>()?
        .into_iter()
        .unzip();
    let args = PageCountArgs {
        max_live_requests: max_live_requests.0,
        max_scheduled_tokens: max_scheduled_tokens.0,
        max_total_tokens: max_total_tokens.0,
        max_context_len: max_context_len.0,
        decode_input_tokens: decode_input_tokens.0,
        overlap_schedule_depth: overlap_schedule_depth.0,
        safety_margin: safety_margin.0,
    };
    let counts = core(sizing::compute_paged_cache_group_page_counts(&specs, &args))?;
    let out = PyDict::new(py);
    for (key, count) in keys.into_iter().zip(counts) {
        out.set_item(key, count)?;
    }
    Ok(out)
}

/// Publication (SPEC 2): `(spec tuples, {group_id: pages})`, or None when the module was built
/// without the `flat` feature (SPEC 10).
#[pyfunction]
#[pyo3(signature = (
    *,
    layer_types,
    sliding_window_tokens,
    page_size,
    max_live_requests,
    max_scheduled_tokens,
    max_total_tokens,
    max_context_len,
))]
#[allow(clippy::too_many_arguments, reason = "the keyword signature of the Python contract")]
pub fn publish_paged_cache_groups<'py>(
    py: Python<'py>,
    layer_types: &Bound<'py, PyAny>,
    sliding_window_tokens: Option<&Bound<'py, PyAny>>,
    page_size: IntParam,
    max_live_requests: IntParam,
    max_scheduled_tokens: IntParam,
    max_total_tokens: IntParam,
    max_context_len: IntParam,
) -> PyResult<Option<(Bound<'py, PyList>, Bound<'py, PyDict>)>> {
    let layer_types = layer_types_arg(layer_types)?;
    let windows = windows_arg(sliding_window_tokens)?;
    let published = core(sizing::publish_paged_cache_groups(
        &layer_types,
        &windows,
        &page_size.0,
        &max_live_requests.0,
        &max_scheduled_tokens.0,
        &max_total_tokens.0,
        &max_context_len.0,
    ))?;
    let Some((specs, counts)) = published else {
        return Ok(None);
    };
    let out = PyDict::new(py);
    for (spec, count) in specs.iter().zip(counts) {
        out.set_item(&spec.group_id, count)?;
    }
    Ok(Some((specs_to_py(py, &specs)?, out)))
}

/// The block-table width of one group's CUDA-graph capture buffer (SPEC 2, 12.1).
#[pyfunction]
#[pyo3(signature = (
    spec,
    *,
    max_context_len,
    max_tokens_per_req = IntParam::of(1),
    overlap_schedule_depth = IntParam::of(0),
), text_signature = "(spec, *, max_context_len, max_tokens_per_req=1, overlap_schedule_depth=0)")]
pub fn compute_max_logical_pages_for_capture(
    spec: &Bound<'_, PyAny>,
    max_context_len: IntParam,
    max_tokens_per_req: IntParam,
    overlap_schedule_depth: IntParam,
) -> PyResult<u64> {
    let (_, spec) = spec_arg(spec)?;
    core(sizing::compute_max_logical_pages_for_capture(
        &spec,
        &max_context_len.0,
        &max_tokens_per_req.0,
        &overlap_schedule_depth.0,
    ))
}

/// How many K/V slabs the layers can share (SPEC 2, 11), or None; never raises, whatever the
/// arguments (an argument that cannot even be read gives None).
#[pyfunction]
#[pyo3(signature = (layer_types, *, sliding_window_tokens=None))]
pub fn hybrid_slab_group_size(
    layer_types: &Bound<'_, PyAny>,
    sliding_window_tokens: Option<&Bound<'_, PyAny>>,
) -> Option<u64> {
    let layer_types = layer_types_arg(layer_types).ok()?;
    let windows = windows_arg(sliding_window_tokens).ok()?;
    sizing::hybrid_slab_group_size(&layer_types, &windows)
}

/// `getattr(obj, name, default)` for a flag, as a bool (`AttributeError` means the default).
fn flag(obj: &Bound<'_, PyAny>, name: &str, default: bool) -> PyResult<bool> {
    match obj.getattr(name) {
        Ok(value) => value.is_truthy(),
        Err(err) if err.is_instance_of::<pyo3::exceptions::PyAttributeError>(obj.py()) => Ok(default),
        Err(err) => Err(err),
    }
}

/// Follow `full_attn_backend` while it is not None; a backend seen twice (by identity) is a
/// cycle.
fn resolve_backend<'py>(attn_backend: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    let mut chain = vec![attn_backend.clone()];
    let mut backend = attn_backend.clone();
    loop {
        let inner = match backend.getattr("full_attn_backend") {
            Ok(inner) => inner,
            Err(err) if err.is_instance_of::<pyo3::exceptions::PyAttributeError>(backend.py()) => return Ok(backend),
            Err(err) => return Err(err),
        };
        if inner.is_none() {
            return Ok(backend);
        }
        if chain.iter().any(|seen| seen.is(&inner)) {
            return Err(crate::errors::PyCoreError(sizing::backend_cycle_error()).into());
        }
        chain.push(inner.clone());
        backend = inner;
    }
}

/// Refuse scheduler configurations that would corrupt the flat KV cache (SPEC 2): a no-op when
/// `flat_kvcache_ext` is false or the module was built without the `flat` feature; else a
/// `ConfigError` (a `RuntimeError`) for the first of the five problems, in the contract's order.
#[pyfunction]
#[pyo3(signature = (*, flat_kvcache_ext, paged_cache_groups, attn_backend, kv_pool, speculative_algorithm=None))]
pub fn validate_flat_scheduler_config(
    flat_kvcache_ext: &Bound<'_, PyAny>,
    paged_cache_groups: &Bound<'_, PyAny>,
    attn_backend: &Bound<'_, PyAny>,
    kv_pool: &Bound<'_, PyAny>,
    speculative_algorithm: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
    if !sizing::validation_applies(flat_kvcache_ext.is_truthy()?) {
        return Ok(());
    }
    let backend = resolve_backend(attn_backend)?;
    let facts = SchedulerFacts {
        uses_paged_cache_groups: flag(&backend, "uses_paged_cache_groups", false)?,
        uses_flat_cache_groups: flag(&backend, "uses_flat_cache_groups", false)?,
        flat_spec_capable: flag(&backend, "flat_spec_capable", true)?,
        backend: type_name(&backend),
        kv_pool: type_name(kv_pool),
        speculative_algorithm: match speculative_algorithm {
            Some(algorithm) if algorithm.is_truthy()? => Some(text(algorithm)?),
            _ => None,
        },
        num_groups: if paged_cache_groups.is_none() {
            0
        } else {
            paged_cache_groups.len()?
        },
    };
    core(sizing::validate_flat_scheduler_config(&facts))
}
