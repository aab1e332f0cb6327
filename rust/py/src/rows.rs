//! Persistent block-table rows (`FlatKVCache.bind_rows` / `update_rows`): the caller's
//! buffers, kept between calls, and the deltas of an update as numpy arrays.
//!
//! The buffers are checked once when bound (int32, C-contiguous, writable, one per group, no
//! two sharing memory, the same number of rows) and kept as numpy arrays (a CPU torch tensor
//! through its `.numpy()` view, which keeps the tensor alive and shares its memory); each
//! update borrows them writable again, so a buffer borrowed elsewhere is refused, never
//! aliased.

use flat_kvcache_core::engine::coordinator::GroupSpec;
use flat_kvcache_core::engine::group::GroupKind;
use flat_kvcache_core::engine::TableOut;
use flat_kvcache_core::engine::{RowDelta, RowLayout};
use numpy::ndarray::{ArrayView2, Ix1};
use numpy::{
    BorrowError, PyArray, PyArray1, PyArray2, PyArrayMethods, PyReadwriteArray, PyReadwriteArray1, PyReadwriteArray2,
    PyUntypedArrayMethods,
};
use pyo3::exceptions::{PyKeyError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyMapping};

use crate::convert::{clip, type_name};
use crate::tables::{as_ndarray, borrow_int32, borrow_tables};

/// The bound buffers: one table per group, one offsets vector per windowed group, with the
/// group ids that name them in messages.
pub struct BoundBuffers {
    tables: Vec<Py<PyArray2<i32>>>,
    offsets: Vec<Option<Py<PyArray1<i32>>>>,
    gids: Vec<String>,
    /// The bound shape: rows, and each table's columns.
    max_rows: usize,
    cols: Vec<usize>,
}

/// `offsets['<group id>']`, as messages name an offsets buffer.
fn offsets_label(gid: &str) -> String {
    format!("offsets['{}']", clip(gid).escape_debug())
}

/// Check and borrow the offsets buffers: a mapping of sliding-window group id to a writable
/// C-contiguous int32 vector of `max_rows` values. Groups without an entry are not windowed.
fn borrow_offsets<'py>(
    offsets: &Bound<'py, PyAny>,
    groups: &[GroupSpec],
    max_rows: usize,
) -> PyResult<Vec<Option<PyReadwriteArray1<'py, i32>>>> {
    let mapping = offsets.cast::<PyMapping>().map_err(|_| {
        PyTypeError::new_err(format!(
            "offsets must be a mapping of sliding-window group id to int32 array, got {}",
            type_name(offsets)
        ))
    })?;
    for key in mapping.keys()?.iter() {
        let known = key
            .extract::<String>()
            .is_ok_and(|k| groups.iter().any(|g| g.group_id == k));
        if !known {
            let ids: Vec<String> = groups
                .iter()
                .map(|g| format!("'{}'", clip(&g.group_id).escape_debug()))
                .collect();
            return Err(PyValueError::new_err(format!(
                "offsets has a buffer for {}, which is not a group of this cache ({})",
                key.repr()?,
                ids.join(", ")
            )));
        }
    }
    let mut out = Vec::with_capacity(groups.len());
    for spec in groups {
        let gid = spec.group_id.as_str();
        let item = match mapping.get_item(gid) {
            Ok(item) => item,
            Err(e) if e.is_instance_of::<PyKeyError>(offsets.py()) => {
                out.push(None);
                continue;
            }
            Err(e) => return Err(e),
        };
        let label = offsets_label(gid);
        if !matches!(spec.kind, GroupKind::SlidingWindow { .. }) {
            return Err(PyValueError::new_err(format!(
                "{label}: only sliding-window groups have windowed rows, and '{}' is a {} group",
                clip(gid).escape_debug(),
                spec.kind.name()
            )));
        }
        let arr = as_ndarray(&item, &label)?;
        if arr.ndim() != 1 || arr.shape()[0] != max_rows {
            return Err(PyValueError::new_err(format!(
                "{label} must be 1-D with one value per row ({max_rows}), got shape {:?}",
                arr.shape()
            )));
        }
        out.push(Some(borrow_int32::<Ix1>(
            &arr,
            &label,
            "shares its memory with another bound buffer",
        )?));
    }
    Ok(out)
}

/// Check the buffers of `bind_rows`, returning the row count, each group's layout and the
/// arrays to keep. Nothing is written.
pub fn check_bind(
    tables: &Bound<'_, PyAny>,
    offsets: Option<&Bound<'_, PyAny>>,
    groups: &[GroupSpec],
) -> PyResult<(usize, Vec<RowLayout>, BoundBuffers)> {
    let arrays = borrow_tables(tables, groups, "tables", "bind_rows")?;
    let max_rows = arrays.first().map_or(0, |a| a.shape()[0]);
    for (spec, arr) in groups.iter().zip(&arrays) {
        if arr.shape()[0] != max_rows {
            return Err(PyValueError::new_err(format!(
                "tables['{}'] has {} rows but tables['{}'] has {max_rows}: every group needs the same rows",
                clip(&spec.group_id).escape_debug(),
                arr.shape()[0],
                clip(&groups[0].group_id).escape_debug()
            )));
        }
    }
    let offs = match offsets.filter(|o| !o.is_none()) {
        Some(o) => borrow_offsets(o, groups, max_rows)?,
        None => groups.iter().map(|_| None).collect(),
    };
    let layouts = arrays
        .iter()
        .zip(&offs)
        .map(|(a, o)| RowLayout {
            cols: a.shape()[1],
            windowed: o.is_some(),
        })
        .collect();
    let buffers = BoundBuffers {
        tables: arrays.iter().map(|a| keep2(a)).collect(),
        offsets: offs.iter().map(|o| o.as_ref().map(keep1)).collect(),
        gids: groups.iter().map(|g| g.group_id.clone()).collect(),
        max_rows,
        cols: arrays.iter().map(|a| a.shape()[1]).collect(),
    };
    Ok((max_rows, layouts, buffers))
}

/// A reference to keep of a borrowed 2-D buffer.
fn keep2(a: &PyReadwriteArray2<'_, i32>) -> Py<PyArray2<i32>> {
    let bound: &Bound<'_, PyArray2<i32>> = a;
    bound.clone().unbind()
}

/// A reference to keep of a borrowed 1-D buffer.
fn keep1(a: &PyReadwriteArray1<'_, i32>) -> Py<PyArray1<i32>> {
    let bound: &Bound<'_, PyArray1<i32>> = a;
    bound.clone().unbind()
}

impl BoundBuffers {
    /// Per group, whether its rows are windowed (it has an offsets buffer).
    pub fn windowed(&self) -> Vec<bool> {
        self.offsets.iter().map(Option::is_some).collect()
    }

    /// Fill the buffers as a fresh binding expects them: tables -1, offsets 0.
    pub fn reset(&self, py: Python<'_>) -> PyResult<()> {
        // Checked writable by `check_bind` just before; only another thread could hold them.
        let busy = |e: BorrowError| PyValueError::new_err(format!("bind_rows: a buffer cannot be written now ({e})"));
        for t in &self.tables {
            t.bind(py).try_readwrite().map_err(busy)?.as_array_mut().fill(-1);
        }
        for o in self.offsets.iter().flatten() {
            o.bind(py).try_readwrite().map_err(busy)?.as_array_mut().fill(0);
        }
        Ok(())
    }

    /// Borrow every buffer writable for one update, tables then offsets, each in group order.
    ///
    /// The bound objects are checked again: numpy lets a caller change an array's dtype,
    /// shape, strides or writability in place after `bind_rows`, and a buffer that is no
    /// longer a writable C-contiguous int32 array of its bound shape is refused (nothing is
    /// written, and the next update that succeeds still returns every change). The checks read
    /// the array structs only: no Python code runs (the rows lock is held).
    #[allow(clippy::type_complexity, reason = "one borrow per group, tables then offsets")]
    pub fn borrow<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<(
        Vec<PyReadwriteArray2<'py, i32>>,
        Vec<Option<PyReadwriteArray1<'py, i32>>>,
    )> {
        let mut tables = Vec::with_capacity(self.tables.len());
        let max_rows = self.max_rows;
        for ((t, gid), &cols) in self.tables.iter().zip(&self.gids).zip(&self.cols) {
            let label = format!("tables['{}']", clip(gid).escape_debug());
            tables.push(borrow_again(t.bind(py).as_any(), &label, &[max_rows, cols])?);
        }
        let mut offsets = Vec::with_capacity(self.offsets.len());
        for (o, gid) in self.offsets.iter().zip(&self.gids) {
            offsets.push(match o {
                Some(a) => Some(borrow_again(a.bind(py).as_any(), &offsets_label(gid), &[max_rows])?),
                None => None,
            });
        }
        Ok((tables, offsets))
    }
}

/// Borrow a bound buffer writable again after checking it is still what `bind_rows` bound.
fn borrow_again<'py, D: numpy::ndarray::Dimension>(
    item: &Bound<'py, PyAny>,
    label: &str,
    shape: &[usize],
) -> PyResult<PyReadwriteArray<'py, i32, D>> {
    let changed = || {
        PyValueError::new_err(format!(
            "update_rows: {label} was changed after bind_rows: it must stay a C-contiguous int32 array of shape \
             {shape:?} (bind it again)"
        ))
    };
    let typed = item.cast::<PyArray<i32, D>>().map_err(|_| changed())?;
    if typed.shape() != shape || !typed.is_c_contiguous() {
        return Err(changed());
    }
    typed.try_readwrite().map_err(|e| match e {
        BorrowError::NotWriteable => PyValueError::new_err(format!(
            "update_rows: {label} is read-only now (bound buffers must stay writable)"
        )),
        _ => PyValueError::new_err(format!("update_rows: {label} is borrowed elsewhere")),
    })
}

/// The borrowed buffers as the core's outputs.
#[allow(clippy::type_complexity, reason = "mirrors BoundBuffers::borrow")]
pub fn as_outs<'a>(
    tables: &'a mut [PyReadwriteArray2<'_, i32>],
    offsets: &'a mut [Option<PyReadwriteArray1<'_, i32>>],
) -> PyResult<(Vec<TableOut<'a>>, Vec<Option<&'a mut [i32]>>)> {
    let mut outs = Vec::with_capacity(tables.len());
    for t in tables.iter_mut() {
        let (rows, cols) = (t.shape()[0], t.shape()[1]);
        let data = t
            .as_slice_mut()
            .map_err(|e| PyValueError::new_err(format!("update_rows: bound table: {e}")))?;
        outs.push(TableOut { data, rows, cols });
    }
    let mut offs = Vec::with_capacity(offsets.len());
    for o in offsets.iter_mut() {
        offs.push(match o {
            Some(a) => Some(
                a.as_slice_mut()
                    .map_err(|e| PyValueError::new_err(format!("update_rows: bound offsets: {e}")))?,
            ),
            None => None,
        });
    }
    Ok((outs, offs))
}

/// One group's changes, copied out of the core: `[rows..., cols..., values...]` and
/// `[offset rows..., offsets...]`.
pub struct DeltaCopy {
    cells: Vec<i32>,
    offsets: Option<Vec<i32>>,
}

/// Copy the core's deltas (while the engine is locked).
pub fn copy_deltas(deltas: &[RowDelta], windowed: impl Iterator<Item = bool>) -> Vec<DeltaCopy> {
    deltas
        .iter()
        .zip(windowed)
        .map(|(d, w)| {
            let mut cells = Vec::with_capacity(3 * d.len());
            cells.extend_from_slice(&d.rows);
            cells.extend_from_slice(&d.cols);
            cells.extend_from_slice(&d.values);
            let offsets = w.then(|| {
                let mut o = Vec::with_capacity(2 * d.offsets.len());
                o.extend_from_slice(&d.offset_rows);
                o.extend_from_slice(&d.offsets);
                o
            });
            DeltaCopy { cells, offsets }
        })
        .collect()
}

/// Empty deltas for every group (`windowed[g]`: whether group `g` reports offsets).
pub fn no_deltas(windowed: &[bool]) -> Vec<DeltaCopy> {
    windowed
        .iter()
        .map(|&w| DeltaCopy {
            cells: Vec::new(),
            offsets: w.then(Vec::new),
        })
        .collect()
}

/// The deltas as `(cells, offsets)`: `{group_id: int32 [3, n]}` for every group and
/// `{group_id: int32 [2, m]}` for the windowed ones.
pub fn deltas_to_py<'py, 'a>(
    py: Python<'py>,
    gids: impl Iterator<Item = &'a str>,
    copies: Vec<DeltaCopy>,
) -> PyResult<(Bound<'py, PyDict>, Bound<'py, PyDict>)> {
    let cells = PyDict::new(py);
    let offsets = PyDict::new(py);
    let shape_err = |e: numpy::ndarray::ShapeError| PyValueError::new_err(format!("update_rows: {e}"));
    for (gid, DeltaCopy { cells: c, offsets: o }) in gids.zip(copies) {
        // Copied into numpy-owned arrays: cheaper than handing numpy the vectors (a
        // container object per array) for the few hundred cells of a step.
        let n = c.len() / 3;
        let view = ArrayView2::from_shape((3, n), &c).map_err(shape_err)?;
        cells.set_item(gid, PyArray2::from_array(py, &view))?;
        if let Some(o) = o {
            let m = o.len() / 2;
            let view = ArrayView2::from_shape((2, m), &o).map_err(shape_err)?;
            offsets.set_item(gid, PyArray2::from_array(py, &view))?;
        }
    }
    Ok((cells, offsets))
}
