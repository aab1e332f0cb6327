//! The request ids of the last id-addressed batch, remembered by object.
//!
//! A scheduler passes the same id objects (its requests' id strings) to `schedule_batch` and
//! `append_tokens_batch` step after step, mostly in the same order. [`IdMemo`] keeps, for each
//! position of the last batch, the id object and the core handle it resolved to. A batch item
//! that *is* the remembered object at its position (pointer-equal: the memo holds a reference,
//! so the object is alive and an equal pointer is that same immutable object) whose handle is
//! still current skips parsing and looking up the id, which was most of a batch call's cost.
//!
//! Only exact `str` and `int` objects are remembered: parsing them runs no Python code, so an
//! entry whose handle went stale (its request finished; the id may be live again in another
//! slot) is parsed again with the engine locked.

use flat_kvcache_core::engine::{FlatCache, Lookup, RequestHandle};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::{PyInt, PyList, PyString, PyTuple};

use crate::args::RequestId;

/// Id objects of the last batch by position, with their handles (see the module docs).
#[derive(Default)]
pub struct IdMemo {
    entries: Vec<Option<(Py<PyAny>, RequestHandle)>>,
}

/// The items of a batch before the engine is locked.
pub struct Items<'py> {
    /// Per item: the handle the memo's object at its position resolved to last time, or None.
    known: Vec<Option<RequestHandle>>,
    /// The other items, parsed, with their positions (in order).
    parsed: Vec<(usize, Bound<'py, PyAny>, RequestId<'py>)>,
}

impl Items<'_> {
    /// Number of items.
    pub fn len(&self) -> usize {
        self.known.len()
    }

    /// Whether the batch is empty.
    pub fn is_empty(&self) -> bool {
        self.known.is_empty()
    }
}

impl IdMemo {
    /// The items of `reqs` if it is a list or a tuple (None for anything else): known objects
    /// by handle, the others parsed (a `TypeError` for an item that is not an id). Run with
    /// no lock held: parsing may call `__index__`.
    pub fn items<'py>(&self, reqs: &Bound<'py, PyAny>) -> Option<PyResult<Items<'py>>> {
        if let Ok(list) = reqs.cast::<PyList>() {
            return Some(self.collect(list.len(), list.iter()));
        }
        if let Ok(tuple) = reqs.cast::<PyTuple>() {
            return Some(self.collect(tuple.len(), tuple.iter()));
        }
        None
    }

    /// [`Self::items`] of `len` objects.
    fn collect<'py>(&self, len: usize, objs: impl Iterator<Item = Bound<'py, PyAny>>) -> PyResult<Items<'py>> {
        let mut known = Vec::with_capacity(len);
        let mut parsed = Vec::new();
        for (k, obj) in objs.enumerate() {
            if let Some(Some((remembered, handle))) = self.entries.get(k) {
                if remembered.as_ptr() == obj.as_ptr() {
                    known.push(Some(*handle));
                    continue;
                }
            }
            let id = obj.extract::<RequestId<'py>>()?;
            id.id()?; // a str that is not valid UTF-8 fails here, in batch order
            known.push(None);
            parsed.push((k, obj, id));
        }
        Ok(Items { known, parsed })
    }

    /// The core lookups of `items` for the locked engine `cache`: a known item whose handle is
    /// current by handle, any other by the handle its id has now (remembered) or, for an id
    /// that names no live request, by id (the core reports it in batch order).
    pub fn lookups<'a, 'py>(
        &mut self,
        py: Python<'py>,
        cache: &FlatCache,
        items: &'a mut Items<'py>,
    ) -> PyResult<Vec<Lookup<'a>>> {
        // A handle whose request is gone: parse its object again (an exact str or int, so no
        // Python code runs) and look it up like the others.
        let mut stale = false;
        for (k, (known, entry)) in items.known.iter_mut().zip(&self.entries).enumerate() {
            if let (Some(handle), Some((obj, _))) = (*known, entry) {
                if !cache.is_current(handle) {
                    let obj = obj.bind(py).clone();
                    let id = obj.extract::<RequestId<'py>>()?;
                    items.parsed.push((k, obj, id));
                    *known = None;
                    stale = true;
                }
            }
        }
        if stale {
            items.parsed.sort_by_key(|p| p.0);
        }
        self.entries.resize_with(items.known.len(), || None);
        let mut out = Vec::with_capacity(items.known.len());
        let mut parsed = items.parsed.iter();
        for known in &items.known {
            if let Some(handle) = *known {
                out.push(Lookup::Handle(handle));
                continue;
            }
            // One parsed item per unknown position, in order.
            let Some((k, obj, id)) = parsed.next() else {
                return Err(PyRuntimeError::new_err(
                    "flat_kvcache: internal error: a batch item was lost",
                ));
            };
            let id = id.id()?;
            if let Some(handle) = cache.handle(id) {
                let plain = obj.is_exact_instance_of::<PyString>() || obj.is_exact_instance_of::<PyInt>();
                self.entries[*k] = plain.then(|| (obj.clone().unbind(), handle));
                out.push(Lookup::Handle(handle));
            } else {
                self.entries[*k] = None;
                out.push(Lookup::Id(id));
            }
        }
        Ok(out)
    }
}
