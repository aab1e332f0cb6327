//! KV-cache events (docs/requests-api.md, "KV events"), recorded in order by the engine.
//!
//! The engine records plain values here; the bindings turn them into the
//! `flat_kvcache.events` dataclasses only when the caller takes them, so recording costs no
//! Python objects. Group metadata (page size, kind, window) is not repeated in each event:
//! the group index names it.

use std::sync::Arc;

use crate::engine::hash::ContentHash;

/// One KV-cache event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvEvent {
    /// Pages of one group newly cached by one register call, in slot order.
    Stored {
        /// The (folded) content hash of each newly cached page.
        hashes: Vec<ContentHash>,
        /// The content hash of the slot before the first page (`None` at slot 0, or when a
        /// page-level register call cannot know it).
        parent: Option<ContentHash>,
        /// The pages' tokens (token-level requests only; empty for page-level registers).
        token_ids: Vec<u32>,
        /// The group index.
        group: u32,
        /// The request's extra keys (token-level requests only).
        extra_keys: Arc<[String]>,
    },
    /// Cached pages whose keys one allocation (or a `reset_prefix_cache` that left pinned
    /// pages cached) dropped, all of one group, in eviction order.
    Removed {
        /// The content hashes of the evicted pages.
        hashes: Vec<ContentHash>,
        /// The group the evicted keys belonged to.
        group: u32,
    },
    /// `reset_prefix_cache` dropped every key: no page holds one any more.
    Cleared,
    /// A host-tier store was acknowledged: the key is findable in host memory (medium
    /// `"CPU"`; no parent, tokens or extra keys are carried).
    HostStored {
        /// The content hash of the stored page.
        hash: ContentHash,
        /// The group index.
        group: u32,
    },
    /// A host-tier store evicted a host page: its key left host memory (medium `"CPU"`).
    HostRemoved {
        /// The content hash of the evicted host page.
        hash: ContentHash,
        /// The group index.
        group: u32,
    },
}

/// The recorded events of one cache: off (nothing kept) or an ordered log.
#[derive(Clone, Debug, Default)]
pub struct EventLog {
    enabled: bool,
    events: Vec<KvEvent>,
}

impl EventLog {
    /// A log that records when `enabled`.
    pub fn new(enabled: bool) -> Self {
        Self {
            enabled,
            events: Vec::new(),
        }
    }

    /// Whether events are recorded.
    #[inline]
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Record `event` (dropped when disabled).
    #[inline]
    pub fn push(&mut self, event: KvEvent) {
        if self.enabled {
            self.events.push(event);
        }
    }

    /// The events recorded since the last call, oldest first.
    pub fn take(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }

    /// Number of events waiting to be taken.
    pub fn len(&self) -> usize {
        self.events.len()
    }

    /// Whether no event is waiting.
    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
    }
}
