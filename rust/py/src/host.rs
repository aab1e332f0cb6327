//! The host-memory tier's arguments and results (`FlatKVCache(host_pages=, host_store=)`,
//! `take_transfers`, `ack_transfers`): extracted, checked and converted here; the tier lives
//! in the core (`engine/host.rs`). `host_pages` is a count, or over an arena (where each group
//! has its own host pages) a mapping `{group_id: count}` as well.

use flat_kvcache_core::engine::coordinator::GroupSpec;
use flat_kvcache_core::engine::host::{HostStore, Transfer, TransferKind};
use numpy::IntoPyArray;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyMapping, PyString, PyTuple};

use crate::args::{count, counts, named_choice, Passed};
use crate::convert::{clip, type_name};

/// The `host_pages` keyword as given: a count (`None` or left out: 0), or a mapping
/// `{group_id: count}` (arena storage only; resolved against the groups by `HostPagesArg::per_group`).
pub enum HostPagesArg<'py> {
    /// Host pages: the tier's without an arena, each group's over one.
    Count(u64),
    /// Host pages per group id, groups not named getting none.
    PerGroup(Bound<'py, PyMapping>),
}

/// The `host_pages` keyword without an arena: a count (`None` or left out: 0); a mapping is a
/// `TypeError` naming `host_pages` (per-group host pages need an arena's per-group geometry).
pub fn host_pages_count(obj: Option<&Bound<'_, PyAny>>) -> PyResult<u64> {
    match obj.filter(|o| !o.is_none()) {
        None => Ok(0),
        Some(obj) if obj.cast::<PyMapping>().is_ok() => Err(PyTypeError::new_err(format!(
            "host_pages must be an int without arena= (a {{group_id: pages}} mapping gives each group \
             of an arena its own host pages), got {}",
            type_name(obj)
        ))),
        Some(obj) => count(obj, "host_pages"),
    }
}

impl<'py> HostPagesArg<'py> {
    /// Read `host_pages` over an arena: a count or a mapping.
    pub fn extract(obj: Option<&Bound<'py, PyAny>>) -> PyResult<Self> {
        let Some(obj) = obj.filter(|o| !o.is_none()) else {
            return Ok(Self::Count(0));
        };
        if let Ok(map) = obj.cast::<PyMapping>() {
            return Ok(Self::PerGroup(map.clone()));
        }
        count(obj, "host_pages").map(Self::Count)
    }

    /// The host pages of each group of `specs`, in group order: a count for every group, or
    /// the mapping's count of each group it names (0 for the others). A key that is not a str
    /// is a `TypeError`, one that names no group a `ValueError`, a count that is not one the
    /// error of `count` naming `host_pages[<group id>]`.
    pub fn per_group(&self, specs: &[GroupSpec]) -> PyResult<Vec<u64>> {
        let map = match self {
            Self::Count(n) => return Ok(vec![*n; specs.len()]),
            Self::PerGroup(map) => map,
        };
        let mut pages = vec![0u64; specs.len()];
        for item in map.items()?.iter() {
            let (key, value) = item.extract::<(Bound<'_, PyAny>, Bound<'_, PyAny>)>()?;
            let Ok(gid) = key.cast::<PyString>() else {
                return Err(PyTypeError::new_err(format!(
                    "host_pages keys must be group ids (str), got {}",
                    type_name(&key)
                )));
            };
            // A group id is text UTF-8 can encode, as everywhere (a lone surrogate is a
            // `UnicodeEncodeError`, never shown mangled).
            let gid = gid.to_str()?;
            let Some(g) = specs.iter().position(|s| s.group_id == gid) else {
                return Err(PyValueError::new_err(format!(
                    "host_pages names group {:?}, which is not one of the cache's groups",
                    clip(gid)
                )));
            };
            pages[g] = count(&value, &format!("host_pages[{:?}]", clip(gid)))?;
        }
        Ok(pages)
    }
}

/// The `host_store` argument (kept as passed): `"write_through"` (left out) or `"evict"`;
/// anything else is a `ValueError`.
pub fn host_store(arg: &Passed<'_>) -> PyResult<HostStore> {
    arg.0.as_ref().map_or(Ok(HostStore::WriteThrough), |obj| {
        named_choice(
            obj.as_borrowed(),
            "host_store",
            "'write_through' or 'evict'",
            HostStore::from_name,
        )
    })
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
