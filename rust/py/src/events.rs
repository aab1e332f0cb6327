//! KV events as the `flat_kvcache.events` dataclasses.
//!
//! The core records plain values; they become `BlockStored` / `BlockRemoved` /
//! `AllBlocksCleared` objects only in `take_events`, through classes imported once.

use flat_kvcache_core::engine::coordinator::GroupSpec;
use flat_kvcache_core::engine::events::KvEvent;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyList, PyType};

static BLOCK_STORED: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static BLOCK_REMOVED: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static ALL_BLOCKS_CLEARED: PyOnceLock<Py<PyType>> = PyOnceLock::new();

const EVENTS_MODULE: &str = "flat_kvcache.events";

/// vLLM's `medium` of pages in host memory.
const MEDIUM_CPU: &str = "CPU";

/// The events as a list of dataclass instances, in order; `groups` are the cache's specs in
/// group order (a `BlockStored` event carries its group's page size, kind and window).
pub fn events_to_py<'py>(py: Python<'py>, events: Vec<KvEvent>, groups: &[GroupSpec]) -> PyResult<Bound<'py, PyList>> {
    let out = PyList::empty(py);
    if events.is_empty() {
        return Ok(out);
    }
    let stored = BLOCK_STORED.import(py, EVENTS_MODULE, "BlockStored")?;
    let removed = BLOCK_REMOVED.import(py, EVENTS_MODULE, "BlockRemoved")?;
    let cleared = ALL_BLOCKS_CLEARED.import(py, EVENTS_MODULE, "AllBlocksCleared")?;
    // The spec of a stored event's group (page size, kind and window go into the event).
    let spec_of = |group: u32| {
        usize::try_from(group).ok().and_then(|g| groups.get(g)).ok_or_else(|| {
            PyRuntimeError::new_err(format!(
                "flat_kvcache: a stored event names group {group}, which the cache does not have"
            ))
        })
    };
    for event in events {
        let obj = match event {
            KvEvent::Stored {
                hashes,
                parent,
                token_ids,
                group,
                extra_keys,
            } => {
                let spec = spec_of(group)?;
                let hashes = PyList::new(py, hashes.iter().map(|h| PyBytes::new(py, h)))?;
                let parent = parent.map(|p| PyBytes::new(py, &p));
                let keys = PyList::new(py, extra_keys.iter().map(String::as_str))?;
                stored.call1((
                    hashes,
                    parent,
                    token_ids,
                    spec.page_size,
                    group,
                    spec.kind.name(),
                    spec.kind.sliding_window(),
                    keys,
                ))?
            }
            KvEvent::Removed { hashes, group } => {
                let hashes = PyList::new(py, hashes.iter().map(|h| PyBytes::new(py, h)))?;
                removed.call1((hashes, group))?
            }
            KvEvent::Cleared => cleared.call0()?,
            KvEvent::HostStored { hash, group } => {
                let spec = spec_of(group)?;
                let hashes = PyList::new(py, [PyBytes::new(py, &hash)])?;
                let no_tokens: Vec<u32> = Vec::new();
                let no_keys: Vec<String> = Vec::new();
                stored.call1((
                    hashes,
                    None::<Bound<'py, PyBytes>>,
                    no_tokens,
                    spec.page_size,
                    group,
                    spec.kind.name(),
                    spec.kind.sliding_window(),
                    no_keys,
                    MEDIUM_CPU,
                ))?
            }
            KvEvent::HostRemoved { hash, group } => {
                let hashes = PyList::new(py, [PyBytes::new(py, &hash)])?;
                removed.call1((hashes, group, MEDIUM_CPU))?
            }
        };
        out.append(obj)?;
    }
    Ok(out)
}
