//! Observability (docs/requests-api.md, "Metrics"): pool probe counters, the metrics of
//! `stats()`, and draining the recorded KV events.

use crate::engine::events::KvEvent;
use crate::engine::FlatCache;

/// Probe counters of the shared pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolStats {
    /// Total pages, the null page included.
    pub num_blocks: usize,
    /// Pages on the free list.
    pub num_free: usize,
    /// Pages holding a key.
    pub num_cached: usize,
    /// Cached pages with count 0.
    pub num_cached_free: usize,
    /// Cached pages with count > 0.
    pub num_cached_pinned: usize,
}

/// The metrics of `stats()` (docs/requests-api.md, "Metrics").
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Pages of the pool, the null page excluded.
    pub pages_total: usize,
    /// Pages on the free list.
    pub pages_free: usize,
    /// Pages with count > 0.
    pub pages_in_use: usize,
    /// Pages holding a key.
    pub pages_cached: usize,
    /// Pages holding a key with count 0.
    pub pages_cached_free: usize,
    /// Live requests (token-level and page-level).
    pub requests: usize,
    /// Sum of the prompt lengths given to `add_request` with the prefix cache in use.
    pub prefix_queries_tokens: u64,
    /// Sum of the hits `add_request` returned for those prompts.
    pub prefix_hits_tokens: u64,
    /// Cached pages whose key was dropped because the pool handed them out again.
    pub evictions: u64,
    /// Requests preempted.
    pub preemptions: u64,
    /// Per group (index order), the distinct real pages its tables reference.
    pub pages_in_use_by_group: Vec<usize>,
    /// The host tier's figures (`None` without a host tier).
    pub host: Option<HostStats>,
    /// The state checkpoints' figures (`None` without state groups).
    pub checkpoints: Option<CheckpointStats>,
}

/// The state checkpoints' part of `stats()` (SPEC 13.5; docs/architecture.md, "Hybrid
/// storage").
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CheckpointStats {
    /// State pages that took a key: checkpoints a later prefix hit can restore.
    pub written: u64,
    /// Prefix hits (`add_request`, `admit`) that restored one.
    pub hit: u64,
    /// Checkpoints whose key was dropped because their page was handed out again.
    pub evicted: u64,
}

/// The host tier's part of `stats()` (docs/requests-api.md, "Host-memory tier").
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HostStats {
    /// Host pages.
    pub pages_total: usize,
    /// Host pages holding a key (findable or with a store in flight).
    pub pages_used: usize,
    /// Tokens of `prefix_hits_tokens` at or after the first page any group loaded from host.
    pub hits_tokens: u64,
    /// Stores emitted.
    pub stores: u64,
    /// Stores not emitted because every host page was in flight or being read.
    pub stores_skipped: u64,
    /// Loads emitted.
    pub loads: u64,
    /// Host pages whose key a store dropped (host LRU evictions).
    pub evictions: u64,
    /// Transfers emitted and not acknowledged yet.
    pub transfers_in_flight: usize,
}

impl FlatCache {
    /// Probe counters of the pool.
    pub fn pool_stats(&self) -> PoolStats {
        let pool = self.coord.pool();
        PoolStats {
            num_blocks: pool.num_blocks(),
            num_free: pool.num_free(),
            num_cached: pool.num_cached(),
            num_cached_free: pool.num_cached_free(),
            num_cached_pinned: pool.num_cached_pinned(),
        }
    }

    /// The metrics of `stats()`.
    pub fn stats(&self) -> CacheStats {
        let pool = self.coord.pool();
        let total = pool.num_total();
        CacheStats {
            pages_total: total,
            pages_free: pool.num_free(),
            pages_in_use: total - pool.num_free(),
            pages_cached: pool.num_cached(),
            pages_cached_free: pool.num_cached_free(),
            requests: self.index.len(),
            prefix_queries_tokens: self.counters.prefix_queries_tokens,
            prefix_hits_tokens: self.counters.prefix_hits_tokens,
            evictions: pool.evictions(),
            preemptions: self.counters.preemptions,
            pages_in_use_by_group: self.coord.pages_in_use_by_group().to_vec(),
            host: self.coord.host().map(|h| HostStats {
                pages_total: h.num_pages(),
                pages_used: h.num_used(),
                hits_tokens: self.counters.host_hits_tokens,
                stores: h.counters.stores,
                stores_skipped: h.counters.stores_skipped,
                loads: h.counters.loads,
                evictions: h.counters.evictions,
                transfers_in_flight: h.num_in_flight(),
            }),
            checkpoints: self
                .coord
                .checkpoint_counts()
                .map(|(written, evicted)| CheckpointStats {
                    written,
                    hit: self.counters.checkpoints_hit,
                    evicted,
                }),
        }
    }

    /// The KV events recorded since the last call, oldest first (always empty when events
    /// are off).
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        self.coord.take_events()
    }
}

#[cfg(test)]
mod tests {
    use crate::engine::testing::*;

    #[test]
    fn stats_count_pages_per_group_and_requests() {
        let mut c = hybrid(64);
        let sa = add(&mut c, A, toks(0..20)).0;
        assert!(sched(&mut c, sa, 20, 0).unwrap()); // 5 + 5 pages
        assert!(c.acquire(B, 4).unwrap()); // page-level: 1 + 1
        let s = c.stats();
        assert_eq!((s.pages_total, s.pages_free, s.pages_in_use), (63, 51, 12));
        assert_eq!((s.requests, s.pages_in_use_by_group.clone()), (2, vec![6, 6]));
        // Reclaim at 20 frees sliding slots below (20 - 7) // 4 = 3.
        append(&mut c, sa, &[20]).unwrap();
        assert!(sched(&mut c, sa, 1, 0).unwrap());
        assert_eq!(c.stats().pages_in_use_by_group, vec![7, 4]);
        c.finish(&[sa]).unwrap();
        c.free(B).unwrap();
        let s = c.stats();
        assert_eq!(
            (s.requests, s.pages_in_use, s.pages_in_use_by_group),
            (0, 0, vec![0, 0])
        );
        // a's 5 full base pages were registered at c = 20 in both groups (the sliding ones
        // before they were reclaimed); b (page-level) registered nothing.
        assert_eq!((s.pages_cached, s.pages_cached_free), (10, 10));
        c.check_invariants().unwrap();
    }
}
