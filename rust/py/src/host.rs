//! The host-memory tier's arguments and results (`FlatKVCache(host_pages=, host_store=)`,
//! `take_transfers`, `ack_transfers`): extracted, checked and converted here; the tier lives
//! in the core (`engine/host.rs`).

use flat_kvcache_core::engine::coordinator::GroupSpec;
use flat_kvcache_core::engine::host::{HostStore, Transfer, TransferKind};
use numpy::IntoPyArray;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString, PyTuple};

use crate::args::counts;
use crate::convert::clip;

/// The `host_store` keyword: `"write_through"` or `"evict"`.
pub struct HostStoreArg(pub HostStore);

impl<'a, 'py> FromPyObject<'a, 'py> for HostStoreArg {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        let named = obj
            .cast::<PyString>()
            .ok()
            .and_then(|s| s.to_str().ok().and_then(HostStore::from_name));
        named.map(Self).ok_or_else(|| {
            PyValueError::new_err(format!(
                "host_store must be 'write_through' or 'evict', got {}",
                clip(&obj.repr().map_or_else(|_| "?".to_owned(), |r| r.to_string()))
            ))
        })
    }
}

/// The transfer ids of `ack_transfers` (a sequence or 1-D array of non-negative ints).
pub fn transfer_ids(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    counts(obj, "ids")
}

/// `{"store": {group_id: (ids, src, dst)}, "load": {...}}` with int64 arrays, groups in
/// index order and only groups with transfers; a store copies device `src` to host `dst`, a
/// load host `src` to device `dst`.
pub fn transfers_to_py<'py>(
    py: Python<'py>,
    transfers: &[Transfer],
    specs: &[GroupSpec],
) -> PyResult<Bound<'py, PyDict>> {
    let out = PyDict::new(py);
    for (name, kind) in [("store", TransferKind::Store), ("load", TransferKind::Load)] {
        let per_group = PyDict::new(py);
        for (g, spec) in specs.iter().enumerate() {
            let mut ids: Vec<i64> = Vec::new();
            let mut src: Vec<i64> = Vec::new();
            let mut dst: Vec<i64> = Vec::new();
            for t in transfers.iter().filter(|t| t.kind == kind && t.group as usize == g) {
                ids.push(i64::try_from(t.id).unwrap_or(i64::MAX));
                let (s, d) = match kind {
                    TransferKind::Store => (t.device, t.host),
                    TransferKind::Load => (t.host, t.device),
                };
                src.push(i64::from(s));
                dst.push(i64::from(d));
            }
            if ids.is_empty() {
                continue;
            }
            let arrays = PyTuple::new(
                py,
                [
                    ids.into_pyarray(py).into_any(),
                    src.into_pyarray(py).into_any(),
                    dst.into_pyarray(py).into_any(),
                ],
            )?;
            per_group.set_item(&spec.group_id, arrays)?;
        }
        out.set_item(name, per_group)?;
    }
    Ok(out)
}
