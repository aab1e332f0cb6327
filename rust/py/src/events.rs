//! KV events as the `flat_kvcache.events` dataclasses.
//!
//! The core records plain values; they become `BlockStored` / `BlockRemoved` /
//! `AllBlocksCleared` objects only in `take_events`, through classes imported once.

use flat_kvcache_core::events::KvEvent;
use flat_kvcache_core::table::GroupKind;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyList, PyType};

static BLOCK_STORED: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static BLOCK_REMOVED: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static ALL_BLOCKS_CLEARED: PyOnceLock<Py<PyType>> = PyOnceLock::new();

const EVENTS_MODULE: &str = "flat_kvcache.events";

/// What a `BlockStored` event says of its group.
#[derive(Clone, Debug)]
pub struct GroupMeta {
    /// Tokens per page.
    pub page_size: u64,
    /// `"full"`, `"sliding_window"` or `"state"`.
    pub kind: &'static str,
    /// The sliding window in tokens (None for full and state groups).
    pub window: Option<u64>,
}

impl GroupMeta {
    /// The metadata of a group of `kind` with pages of `page_size` tokens.
    pub fn new(kind: GroupKind, page_size: u64) -> Self {
        let (kind, window) = match kind {
            GroupKind::Full => ("full", None),
            GroupKind::SlidingWindow { window } => ("sliding_window", Some(window)),
            GroupKind::State => ("state", None),
        };
        Self {
            page_size,
            kind,
            window,
        }
    }
}

/// The events as a list of dataclass instances, in order.
pub fn events_to_py<'py>(py: Python<'py>, events: Vec<KvEvent>, groups: &[GroupMeta]) -> PyResult<Bound<'py, PyList>> {
    let out = PyList::empty(py);
    if events.is_empty() {
        return Ok(out);
    }
    let stored = BLOCK_STORED.import(py, EVENTS_MODULE, "BlockStored")?;
    let removed = BLOCK_REMOVED.import(py, EVENTS_MODULE, "BlockRemoved")?;
    let cleared = ALL_BLOCKS_CLEARED.import(py, EVENTS_MODULE, "AllBlocksCleared")?;
    for event in events {
        let obj = match event {
            KvEvent::Stored {
                hashes,
                parent,
                token_ids,
                group,
                extra_keys,
            } => {
                let meta = usize::try_from(group).ok().and_then(|g| groups.get(g));
                let hashes = PyList::new(py, hashes.iter().map(|h| PyBytes::new(py, h)))?;
                let parent = parent.map(|p| PyBytes::new(py, &p));
                let keys = PyList::new(py, extra_keys.iter().map(String::as_str))?;
                stored.call1((
                    hashes,
                    parent,
                    token_ids,
                    meta.map_or(0, |m| m.page_size),
                    group,
                    meta.map_or("full", |m| m.kind),
                    meta.and_then(|m| m.window),
                    keys,
                ))?
            }
            KvEvent::Removed { hashes, group } => {
                let hashes = PyList::new(py, hashes.iter().map(|h| PyBytes::new(py, h)))?;
                removed.call1((hashes, group))?
            }
            KvEvent::Cleared => cleared.call0()?,
        };
        out.append(obj)?;
    }
    Ok(out)
}
