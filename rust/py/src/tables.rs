//! Caller-provided block-table buffers for `FlatKVCache.block_tables(reqs, out=...)`.
//!
//! Each group's buffer is a writable C-contiguous int32 numpy array or a CPU torch tensor.
//! A tensor is viewed through its `.numpy()` method, which shares its memory, so the core
//! writes the caller's storage directly: no copy, no per-element Python object, and the
//! tensor's `data_ptr()` never changes. Rust never depends on torch.

use flat_kvcache_core::engine::coordinator::GroupSpec;
use flat_kvcache_core::engine::TableOut;
use numpy::ndarray::{Dimension, Ix2};
use numpy::{
    BorrowError, PyArray, PyArrayMethods, PyReadwriteArray, PyReadwriteArray2, PyUntypedArray, PyUntypedArrayMethods,
};
use pyo3::exceptions::{PyKeyError, PyTypeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;

use crate::convert::{clip, is_cpu, is_masked, masked_error, tensor_device, type_name};

/// A group id quoted the Python way (`'full'`), for messages.
fn quoted(gid: &str) -> String {
    format!("'{}'", clip(gid).escape_debug())
}

/// `out['<group id>']` (for the argument `name`), as messages name a group's buffer.
fn label(name: &str, gid: &str) -> String {
    format!("{name}[{}]", quoted(gid))
}

/// View one group's buffer as a numpy array: an ndarray as is, a torch tensor (anything with
/// a `device` and a `numpy()` method) through `.numpy()` after checking that it lives on the
/// CPU. A masked array is refused (the cache would write its data and ignore the mask).
pub fn as_ndarray<'py>(item: &Bound<'py, PyAny>, label: &str) -> PyResult<Bound<'py, PyUntypedArray>> {
    if is_masked(item) {
        return Err(masked_error(label));
    }
    if let Ok(arr) = item.cast::<PyUntypedArray>() {
        return Ok(arr.clone());
    }
    let py = item.py();
    let not_a_buffer = || {
        PyTypeError::new_err(format!(
            "{} must be an int32 numpy array or a CPU torch tensor, got {}",
            label,
            type_name(item)
        ))
    };
    let Some(device) = tensor_device(item)? else {
        return Err(not_a_buffer());
    };
    if !is_cpu(&device) {
        return Err(PyValueError::new_err(format!(
            "{} must be a CPU tensor, got one on device {}",
            label,
            device.str()?
        )));
    }
    let view = item
        .call_method0(intern!(py, "numpy"))
        .map_err(|e| PyTypeError::new_err(format!("{label} cannot be viewed as a numpy array: {e}")))?;
    view.cast_into::<PyUntypedArray>().map_err(|e| {
        PyTypeError::new_err(format!(
            "{}.numpy() returned {}, not a numpy array",
            label,
            type_name(&e.into_inner())
        ))
    })
}

/// Borrow a buffer the cache writes, of dimension `D` (checked by the caller): int32,
/// C-contiguous and writable; a buffer some other borrow holds (another group's, or a view of
/// it) is refused with `label` followed by `shared`.
pub fn borrow_int32<'py, D: Dimension>(
    arr: &Bound<'py, PyUntypedArray>,
    label: &str,
    shared: &str,
) -> PyResult<PyReadwriteArray<'py, i32, D>> {
    let Ok(typed) = arr.cast::<PyArray<i32, D>>() else {
        return Err(PyTypeError::new_err(format!(
            "{label} must have dtype int32, got {}",
            arr.dtype().str()?
        )));
    };
    if !arr.is_c_contiguous() {
        return Err(PyValueError::new_err(format!("{label} must be C-contiguous")));
    }
    typed.try_readwrite().map_err(|e| match e {
        BorrowError::NotWriteable => PyValueError::new_err(format!("{label} must be writable")),
        _ => PyValueError::new_err(format!("{label} {shared}")),
    })
}

/// Borrow every group's buffer from the mapping `out` (in the order of `groups`), writable.
///
/// A missing group, a non-array, a dtype other than int32, a shape that is not 2-D, a
/// non-C-contiguous or read-only buffer, or one buffer given for two groups is an error
/// naming the group. Rows and columns are checked by the core against the batch.
pub fn borrow_out<'py>(out: &Bound<'py, PyAny>, groups: &[GroupSpec]) -> PyResult<Vec<PyReadwriteArray2<'py, i32>>> {
    borrow_tables(out, groups, "out", "block_tables")
}

/// [`borrow_out`] for the argument `name` of `method` (messages name `name['<group id>']`).
pub fn borrow_tables<'py>(
    out: &Bound<'py, PyAny>,
    groups: &[GroupSpec],
    name: &str,
    method: &str,
) -> PyResult<Vec<PyReadwriteArray2<'py, i32>>> {
    let py = out.py();
    let mut arrays = Vec::with_capacity(groups.len());
    for GroupSpec { group_id: gid, .. } in groups {
        let item = match out.get_item(gid) {
            Ok(item) => item,
            Err(e) if e.is_instance_of::<PyKeyError>(py) => {
                return Err(PyValueError::new_err(format!(
                    "{method}: {name} has no table for group {}",
                    quoted(gid)
                )))
            }
            Err(e) if e.is_instance_of::<PyTypeError>(py) => {
                return Err(PyTypeError::new_err(format!(
                    "{name} must be a mapping of group id to int32 array, got {}",
                    type_name(out)
                )))
            }
            Err(e) => return Err(e),
        };
        let label = label(name, gid);
        let arr = as_ndarray(&item, &label)?;
        if arr.ndim() != 2 {
            return Err(PyValueError::new_err(format!(
                "{} must be 2-D [rows, cols], got {} dimension(s)",
                label,
                arr.ndim()
            )));
        }
        let shared = "shares its memory with another group's table (or is borrowed elsewhere)";
        arrays.push(borrow_int32::<Ix2>(&arr, &label, shared)?);
    }
    check_out_keys(out, groups, name, method)?;
    Ok(arrays)
}

/// Every key of `out` (when it has `keys()`) must be a group id: a buffer under any other key
/// would be silently left unwritten, so it is a `ValueError` naming `out[<key>]`.
fn check_out_keys(out: &Bound<'_, PyAny>, groups: &[GroupSpec], name: &str, method: &str) -> PyResult<()> {
    let py = out.py();
    if !out.hasattr(intern!(py, "keys"))? {
        return Ok(());
    }
    for key in out.call_method0(intern!(py, "keys"))?.try_iter()? {
        let key = key?;
        let known = key
            .cast::<pyo3::types::PyString>()
            .is_ok_and(|k| k.to_str().is_ok_and(|k| groups.iter().any(|g| g.group_id == k)));
        if !known {
            let ids: Vec<String> = groups.iter().map(|g| quoted(&g.group_id)).collect();
            return Err(PyValueError::new_err(format!(
                "{method}: {name}[{}] is not a group of this cache (groups: {})",
                key.repr()?,
                ids.join(", ")
            )));
        }
    }
    Ok(())
}

/// The borrowed buffers as the core's [`TableOut`]s (C-contiguous, checked in [`borrow_out`]).
pub fn table_outs<'a>(arrays: &'a mut [PyReadwriteArray2<'_, i32>]) -> PyResult<Vec<TableOut<'a>>> {
    let mut outs = Vec::with_capacity(arrays.len());
    for arr in arrays.iter_mut() {
        let (rows, cols) = {
            let shape = arr.shape();
            (shape[0], shape[1])
        };
        let data = arr
            .as_slice_mut()
            .map_err(|e| PyValueError::new_err(format!("block_tables: out buffer: {e}")))?;
        outs.push(TableOut { data, rows, cols });
    }
    Ok(outs)
}
