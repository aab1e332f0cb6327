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
    /// The handles the memo's objects at the other positions resolved to last time, in order.
    known: Vec<RequestHandle>,
    /// The items that were not the memo's object at their position, parsed, with their
    /// positions (in order).
    parsed: Vec<(usize, Bound<'py, PyAny>, RequestId<'py>)>,
}

/// A batch resolved for the core: all by handle (the steady state), or item by item.
pub enum Batch<'a, 'b> {
    /// Every item is the memo's object at its position, with a current handle.
    Handles(&'a [RequestHandle]),
    /// Anything else.
    Lookups(&'a [Lookup<'b>]),
}

impl Items<'_> {
    /// Number of items.
    pub fn len(&self) -> usize {
        self.known.len() + self.parsed.len()
    }

    /// Whether the batch is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
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
                    known.push(*handle);
                    continue;
                }
            }
            let id = obj.extract::<RequestId<'py>>()?;
            id.id()?; // a str that is not valid UTF-8 fails here, in batch order
            parsed.push((k, obj, id));
        }
        Ok(Items { known, parsed })
    }

    /// Resolve `items` for the locked engine `cache` and run `f` on the result: all by handle
    /// when every item is a remembered object whose handle is current; else item by item (a
    /// known item whose handle is current by handle, any other by the handle its id has now,
    /// remembered, or, for an id that names no live request, by id: the core reports it in
    /// batch order).
    pub fn resolve<'py, R>(
        &mut self,
        py: Python<'py>,
        cache: &mut FlatCache,
        mut items: Items<'py>,
        f: impl for<'a, 'b> FnOnce(&mut FlatCache, Batch<'a, 'b>) -> R,
    ) -> PyResult<R> {
        if items.parsed.is_empty() && items.known.iter().all(|&h| cache.is_current(h)) {
            return Ok(f(cache, Batch::Handles(&items.known)));
        }
        let len = items.len();
        // Positions held by known items, in order (the complement of the parsed positions).
        let mut known_at = Vec::with_capacity(items.known.len());
        let mut next_parsed = items.parsed.iter().map(|p| p.0).peekable();
        for k in 0..len {
            if next_parsed.next_if_eq(&k).is_none() {
                known_at.push(k);
            }
        }
        // A handle whose request is gone: parse its object again (an exact str or int, so no
        // Python code runs) and resolve it like the others.
        let mut handles = Vec::with_capacity(items.known.len());
        for (&k, &handle) in known_at.iter().zip(&items.known) {
            if cache.is_current(handle) {
                handles.push((k, handle));
            } else if let Some(Some((obj, _))) = self.entries.get(k) {
                let obj = obj.bind(py).clone();
                let id = obj.extract::<RequestId<'py>>()?;
                items.parsed.push((k, obj, id));
            }
        }
        items.parsed.sort_by_key(|p| p.0);
        self.entries.resize_with(len, || None);
        let mut out = vec![None; len];
        for &(k, handle) in &handles {
            out[k] = Some(Lookup::Handle(handle));
        }
        for (k, obj, id) in &items.parsed {
            let id = id.id()?;
            out[*k] = Some(if let Some(handle) = cache.handle(id) {
                let plain = obj.is_exact_instance_of::<PyString>() || obj.is_exact_instance_of::<PyInt>();
                self.entries[*k] = plain.then(|| (obj.clone().unbind(), handle));
                Lookup::Handle(handle)
            } else {
                self.entries[*k] = None;
                Lookup::Id(id)
            });
        }
        let Some(lookups) = out.into_iter().collect::<Option<Vec<_>>>() else {
            return Err(PyRuntimeError::new_err(
                "flat_kvcache: internal error: a batch item was lost",
            ));
        };
        Ok(f(cache, Batch::Lookups(&lookups)))
    }
}
