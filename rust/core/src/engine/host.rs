//! The host-memory tier (issue 12): evicted or registered device pages kept in host memory
//! and loaded back on a prefix hit, for every group kind.
//!
//! The tier holds `num_pages` host pages of the device pages' geometry; host page ids are
//! their own space `[0, num_pages)` (no null page). Each host page holds at most one group key
//! (the same [`GroupKey`] as the device pool's key map); a key is held by at most one host page.
//!
//! The cache never copies memory itself: it emits transfer operations that the engine runs
//! and then acknowledges, in any order.
//! - A *store* copies device page `d` to host page `h` (one group's layers). While it is in
//!   flight, `d` carries one extra reference (it is never handed out again, evicted or not),
//!   and `h` is reserved under its key but not yet findable. Its acknowledgement makes `h`
//!   findable and drops the extra reference (`d` joins the free list if nothing else holds it).
//! - A *load* copies host page `h` to device page `d`. `d` was allocated for the request that
//!   hit `h` (it sits in the request's table) and carries one extra reference until the load
//!   is acknowledged; `h` is pinned (never overwritten) until then. The acknowledgement
//!   registers `d` under the key (it becomes a device hit for everyone) and drops the pins. A
//!   request with loads in flight cannot be scheduled (see [`crate::engine::FlatCache`]).
//!
//! Store policy ([`HostStore`]):
//! - `WriteThrough` (default): every page newly registered on the device is stored at once (if
//!   its key is not on the host yet). Stores overlap with the request that wrote the page, and
//!   an evicted device page is always already on the host.
//! - `Evict`: a cached page is stored when its last reference goes, i.e. when it would become
//!   evictable; it joins the device free list only once the store is acknowledged. Pages that
//!   are hit again while still held are never copied.
//!
//! Host eviction: a store takes a never-used host page first, else the least recently used
//! findable host page that no load is reading (its key is dropped); with neither, the store
//! is skipped (counted). Storing a key the host already holds (findable or in flight) is
//! skipped silently.

use hashbrown::HashMap;
use rustc_hash::FxBuildHasher;
use std::sync::Arc;

use crate::engine::hash::{ContentHash, GroupKey};
use crate::error::{CoreError, CoreResult};

/// Tag of a host page id inside a tiered prefix match (device page ids are < 2**31).
pub const HOST_BIT: u32 = 1 << 31;

/// Largest host tier: host page ids must stay below [`HOST_BIT`].
pub const MAX_HOST_PAGES: u64 = (HOST_BIT - 1) as u64;

/// When registered device pages are copied to the host tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum HostStore {
    /// Store every newly registered page at once.
    #[default]
    WriteThrough,
    /// Store a cached page when its last reference goes (when it would become evictable).
    Evict,
}

impl HostStore {
    /// The policy named `name` (`"write_through"` or `"evict"`).
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "write_through" => Some(Self::WriteThrough),
            "evict" => Some(Self::Evict),
            _ => None,
        }
    }

    /// The policy's name.
    pub fn name(self) -> &'static str {
        match self {
            Self::WriteThrough => "write_through",
            Self::Evict => "evict",
        }
    }
}

/// The direction of a transfer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransferKind {
    /// Device page -> host page.
    Store,
    /// Host page -> device page.
    Load,
}

/// One transfer handed to the engine by [`crate::engine::FlatCache::take_transfers`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Transfer {
    /// The id to acknowledge it with.
    pub id: u64,
    /// Store or load.
    pub kind: TransferKind,
    /// The group index (whose layers' buffers are copied).
    pub group: u32,
    /// The device page (source of a store, destination of a load).
    pub device: u32,
    /// The host page (destination of a store, source of a load).
    pub host: u32,
}

/// What the `BlockStored` event of a loaded page says once it is registered on the device.
#[derive(Clone, Debug)]
pub(crate) struct LoadEvent {
    pub parent: Option<ContentHash>,
    pub token_ids: Vec<u32>,
    pub extra_keys: Arc<[String]>,
}

/// A transfer in flight.
#[derive(Clone, Debug)]
pub(crate) struct Op {
    pub kind: TransferKind,
    pub group: u32,
    pub device: u32,
    pub host: u32,
    pub key: GroupKey,
    /// Handed out by `take_transfers` (only those can be acknowledged).
    pub taken: bool,
    /// A load's request: (slab position, serial) so a late acknowledgement after the request
    /// ended (or its slot was reused) is recognised.
    pub owner: Option<(usize, u64)>,
    /// A load's event payload.
    pub event: Option<LoadEvent>,
}

/// Counters of the tier (exposed through `stats()`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostCounters {
    /// Stores emitted.
    pub stores: u64,
    /// Stores acknowledged.
    pub stores_done: u64,
    /// Stores skipped because every host page was in flight or being read.
    pub stores_skipped: u64,
    /// Loads emitted (one per page hit on the host).
    pub loads: u64,
    /// Loads acknowledged.
    pub loads_done: u64,
    /// Host keys dropped to make room for a store.
    pub evictions: u64,
}

/// Link of the host LRU list (sentinel at index `num_pages`).
#[derive(Clone, Copy, Debug, Default)]
struct Link {
    prev: u32,
    next: u32,
}

/// The host tier: host pages, their keys, an LRU of findable pages, and the transfers in
/// flight.
#[derive(Clone, Debug)]
pub struct HostTier {
    policy: HostStore,
    /// The key each host page holds (in flight or findable).
    keys: Vec<Option<GroupKey>>,
    /// Whether the page's store was acknowledged (the page is findable).
    ready: Vec<bool>,
    /// Loads in flight reading each page.
    readers: Vec<u32>,
    /// Key -> host page.
    map: HashMap<GroupKey, u32, FxBuildHasher>,
    /// LRU of findable pages no load reads: front = next to evict. Sentinel = `num_pages`.
    links: Vec<Link>,
    in_lru: Vec<bool>,
    /// Host pages never used yet are `[next_unused, num_pages)`.
    next_unused: u32,
    ops: HashMap<u64, Op, FxBuildHasher>,
    /// Ids emitted but not taken, in emission order.
    untaken: Vec<u64>,
    next_id: u64,
    pub(crate) counters: HostCounters,
    /// Keys dropped from the host since the last take (for `BlockRemoved` events).
    pub(crate) evicted: Vec<GroupKey>,
    /// Keys made findable since the last take (for `BlockStored` events on the CPU medium).
    pub(crate) stored: Vec<GroupKey>,
    /// Whether `evicted` and `stored` are kept (KV events on).
    pub(crate) record: bool,
}

impl HostTier {
    /// A tier of `num_pages` host pages (> 0) with the store `policy`.
    pub fn new(num_pages: u64, policy: HostStore) -> CoreResult<Self> {
        if num_pages == 0 || num_pages > MAX_HOST_PAGES {
            return Err(CoreError::invalid(format!(
                "host_pages must be in [1, {MAX_HOST_PAGES}] for a host tier, got {num_pages}"
            )));
        }
        // num_pages < 2**31: both conversions hold.
        let n = usize::try_from(num_pages).map_err(|_| CoreError::overflow("host_pages"))?;
        let sentinel = u32::try_from(num_pages).map_err(|_| CoreError::overflow("host_pages"))?;
        let mut links = Vec::new();
        links
            .try_reserve_exact(n + 1)
            .map_err(|_| CoreError::OutOfMemory(format!("host_pages = {n}: the host tier does not fit in memory")))?;
        links.resize(
            n + 1,
            Link {
                prev: sentinel,
                next: sentinel,
            },
        );
        Ok(Self {
            policy,
            keys: vec![None; n],
            ready: vec![false; n],
            readers: vec![0; n],
            map: HashMap::default(),
            links,
            in_lru: vec![false; n],
            next_unused: 0,
            ops: HashMap::default(),
            untaken: Vec::new(),
            next_id: 1,
            counters: HostCounters::default(),
            evicted: Vec::new(),
            stored: Vec::new(),
            record: false,
        })
    }

    /// The store policy.
    pub fn policy(&self) -> HostStore {
        self.policy
    }

    /// Number of host pages.
    pub fn num_pages(&self) -> usize {
        self.keys.len()
    }

    /// Host pages holding a key (findable or being stored).
    pub fn num_used(&self) -> usize {
        self.map.len()
    }

    /// Findable host pages.
    pub fn num_ready(&self) -> usize {
        self.ready.iter().filter(|&&r| r).count()
    }

    /// Transfers in flight (taken or not).
    pub fn num_in_flight(&self) -> usize {
        self.ops.len()
    }

    fn sentinel(&self) -> u32 {
        // keys.len() < 2**31 (checked in new).
        u32::try_from(self.keys.len()).unwrap_or(u32::MAX)
    }

    /// The findable host page holding `key`, if any (read-only).
    #[inline]
    pub fn lookup(&self, key: &GroupKey) -> Option<u32> {
        let &page = self.map.get(key)?;
        self.ready[page as usize].then_some(page)
    }

    /// Whether the host holds `key` (findable or being stored).
    #[inline]
    pub fn holds(&self, key: &GroupKey) -> bool {
        self.map.contains_key(key)
    }

    /// The key of host page `page` (in range).
    pub(crate) fn key_of(&self, page: u32) -> Option<&GroupKey> {
        self.keys.get(page as usize).and_then(Option::as_ref)
    }

    fn lru_unlink(&mut self, page: u32) {
        let Link { prev, next } = self.links[page as usize];
        self.links[prev as usize].next = next;
        self.links[next as usize].prev = prev;
        self.in_lru[page as usize] = false;
    }

    fn lru_push_back(&mut self, page: u32) {
        let s = self.sentinel();
        let tail = self.links[s as usize].prev;
        self.links[page as usize] = Link { prev: tail, next: s };
        self.links[tail as usize].next = page;
        self.links[s as usize].prev = page;
        self.in_lru[page as usize] = true;
    }

    /// The LRU list, front (next to evict) first.
    pub fn lru_order(&self) -> Vec<u32> {
        let s = self.sentinel();
        let mut out = Vec::new();
        let mut at = self.links[s as usize].next;
        while at != s && out.len() < self.keys.len() {
            out.push(at);
            at = self.links[at as usize].next;
        }
        out
    }

    /// A host page for a new store: a never-used one, else the LRU front (its key dropped and
    /// recorded); `None` when every page is in flight or being read.
    fn take_page(&mut self) -> Option<u32> {
        if (self.next_unused as usize) < self.keys.len() {
            let page = self.next_unused;
            self.next_unused += 1;
            return Some(page);
        }
        let s = self.sentinel();
        let page = self.links[s as usize].next;
        if page == s {
            return None;
        }
        self.lru_unlink(page);
        if let Some(key) = self.keys[page as usize].take() {
            self.map.remove(&key);
            if self.record {
                self.evicted.push(key);
            }
            self.counters.evictions = self.counters.evictions.saturating_add(1);
        }
        self.ready[page as usize] = false;
        Some(page)
    }

    fn push_op(&mut self, op: Op) -> u64 {
        let id = self.next_id;
        // A u64 counter of single increments cannot overflow in practice.
        self.next_id = self.next_id.saturating_add(1);
        self.ops.insert(id, op);
        self.untaken.push(id);
        id
    }

    /// Emit a store of device page `device` (holding `key`) unless the host holds the key or
    /// has no page for it; returns whether a store was emitted (the caller then takes one
    /// more reference on `device`).
    pub(crate) fn store(&mut self, device: u32, key: GroupKey) -> bool {
        if self.map.contains_key(&key) {
            return false;
        }
        let Some(host) = self.take_page() else {
            self.counters.stores_skipped = self.counters.stores_skipped.saturating_add(1);
            return false;
        };
        self.keys[host as usize] = Some(key);
        self.map.insert(key, host);
        self.counters.stores = self.counters.stores.saturating_add(1);
        self.push_op(Op {
            kind: TransferKind::Store,
            group: key.group,
            device,
            host,
            key,
            taken: false,
            owner: None,
            event: None,
        });
        true
    }

    /// Emit a load of findable host page `host` into device page `device` (already allocated
    /// and pinned by the caller); pins `host` until acknowledged.
    pub(crate) fn load(&mut self, host: u32, device: u32, owner: (usize, u64), event: LoadEvent) {
        let key = self.keys[host as usize].unwrap_or_else(|| unreachable!("a findable host page holds a key"));
        if self.in_lru[host as usize] {
            self.lru_unlink(host);
        }
        self.readers[host as usize] += 1;
        self.counters.loads = self.counters.loads.saturating_add(1);
        self.push_op(Op {
            kind: TransferKind::Load,
            group: key.group,
            device,
            host,
            key,
            taken: false,
            owner: Some(owner),
            event: Some(event),
        });
    }

    /// Hand out the transfers emitted since the last call, in emission order.
    pub fn take(&mut self) -> Vec<Transfer> {
        let ids = std::mem::take(&mut self.untaken);
        let mut out = Vec::with_capacity(ids.len());
        for id in ids {
            if let Some(op) = self.ops.get_mut(&id) {
                op.taken = true;
                out.push(Transfer {
                    id,
                    kind: op.kind,
                    group: op.group,
                    device: op.device,
                    host: op.host,
                });
            }
        }
        out
    }

    /// Check that `ids` can be acknowledged: each in flight, taken, and listed once.
    pub fn check_ack(&self, ids: &[u64]) -> CoreResult<()> {
        let mut seen = hashbrown::HashSet::with_capacity_and_hasher(ids.len(), FxBuildHasher);
        for &id in ids {
            match self.ops.get(&id) {
                None => {
                    return Err(CoreError::invalid(format!(
                        "ack_transfers: transfer {id} is not in flight (unknown or already acknowledged)"
                    )))
                }
                Some(op) if !op.taken => {
                    return Err(CoreError::invalid(format!(
                        "ack_transfers: transfer {id} was not handed out yet (call take_transfers first)"
                    )))
                }
                Some(_) => {}
            }
            if !seen.insert(id) {
                return Err(CoreError::invalid(format!(
                    "ack_transfers: transfer {id} is listed twice"
                )));
            }
        }
        Ok(())
    }

    /// Finish transfer `id` on the host side (checked by [`Self::check_ack`]) and return it:
    /// a store makes its page findable (most recently used); a load unpins its source.
    pub(crate) fn finish(&mut self, id: u64) -> Option<Op> {
        let op = self.ops.remove(&id)?;
        let h = op.host as usize;
        match op.kind {
            TransferKind::Store => {
                self.ready[h] = true;
                if self.record {
                    self.stored.push(op.key);
                }
                self.counters.stores_done = self.counters.stores_done.saturating_add(1);
            }
            TransferKind::Load => {
                self.readers[h] -= 1;
                self.counters.loads_done = self.counters.loads_done.saturating_add(1);
            }
        }
        if self.ready[h] && self.readers[h] == 0 && !self.in_lru[h] {
            self.lru_push_back(op.host);
        }
        Some(op)
    }

    /// Per transfer in flight: the device page it holds a reference on, its group, and a
    /// load's owner.
    pub(crate) fn pins(&self) -> impl Iterator<Item = (u32, u32, Option<(usize, u64)>)> + '_ {
        self.ops.values().map(|op| (op.device, op.group, op.owner))
    }

    /// Check the tier's own bookkeeping; a description of the first violation.
    pub fn check(&self) -> Result<(), String> {
        let n = self.keys.len();
        let mut readers = vec![0u32; n];
        let mut storing = vec![false; n];
        for op in self.ops.values() {
            let h = op.host as usize;
            if h >= n {
                return Err(format!("transfer refers to host page {h} out of range"));
            }
            match op.kind {
                TransferKind::Load => readers[h] += 1,
                TransferKind::Store => storing[h] = true,
            }
            if self.keys[h] != Some(op.key) {
                return Err(format!("host page {h} does not hold the key of its transfer"));
            }
        }
        let lru = self.lru_order();
        let mut on_lru = vec![false; n];
        for &p in &lru {
            on_lru[p as usize] = true;
        }
        for p in 0..n {
            if readers[p] != self.readers[p] {
                return Err(format!(
                    "host page {p} counts {} readers but {} loads read it",
                    self.readers[p], readers[p]
                ));
            }
            if storing[p] == self.ready[p] && self.keys[p].is_some() {
                return Err(format!("host page {p} is both findable and being stored, or neither"));
            }
            if readers[p] > 0 && !self.ready[p] {
                return Err(format!("host page {p} is read before its store was acknowledged"));
            }
            let want = self.ready[p] && readers[p] == 0;
            if on_lru[p] != want || self.in_lru[p] != want {
                return Err(format!(
                    "host page {p} is on the LRU list: {}, expected {want}",
                    on_lru[p]
                ));
            }
            if let Some(k) = &self.keys[p] {
                if self.map.get(k) != Some(&u32::try_from(p).unwrap_or(u32::MAX)) {
                    return Err(format!("host key map does not point at host page {p}"));
                }
            } else if p < self.next_unused as usize {
                return Err(format!("host page {p} is used but holds no key"));
            }
        }
        if self.map.len() != self.keys.iter().filter(|k| k.is_some()).count() {
            return Err("host key map and host pages disagree".to_owned());
        }
        Ok(())
    }
}

// ----- the cache's calls -------------------------------------------------------------------

use super::coordinator::{PrefixMatch, TokenContext};
use super::ids::RequestIdRef;
use super::FlatCache;

impl FlatCache {
    /// Claim a (tiered) match for the new token-level request at slab position `at`: device
    /// hits are claimed, host hits get device destinations and load transfers.
    pub(super) fn claim_with_loads(&mut self, at: usize, m: &PrefixMatch) -> CoreResult<()> {
        let entry = &mut self.entries[at];
        let Some(state) = entry.tokens.as_ref() else {
            return Ok(());
        };
        let ctx = TokenContext {
            tokens: &state.tokens,
            hashes: &state.hashes,
            extra_keys: &state.extra_keys,
        };
        let loads = self.coord.claim_tiered(&mut entry.tables, m, (at, entry.serial), ctx)?;
        entry.loading = u64::try_from(loads).unwrap_or(u64::MAX);
        Ok(())
    }

    /// A request with loads in flight cannot be scheduled: its pages are not filled yet.
    pub(super) fn check_loaded(&self, method: &str, req: RequestIdRef<'_>, at: usize) -> CoreResult<()> {
        match self.entries[at].loading {
            0 => Ok(()),
            n => Err(CoreError::invalid(format!(
                "{method}: request {req} has {n} host page load(s) in flight; run take_transfers() \
                 and ack_transfers() first (loads_in_flight tells when it can be scheduled)"
            ))),
        }
    }

    /// The transfers emitted since the last call, in emission order (empty without a host
    /// tier). The engine runs them, then acknowledges them with [`Self::ack_transfers`].
    pub fn take_transfers(&mut self) -> Vec<Transfer> {
        self.coord.take_transfers()
    }

    /// Acknowledge finished transfers, in any order. Everything is checked first (each id in
    /// flight, handed out by `take_transfers`, listed once): on error nothing changes. A load
    /// acknowledged after its request ended only releases the page (registered under its key).
    pub fn ack_transfers(&mut self, ids: &[u64]) -> CoreResult<()> {
        self.coord.check_ack(ids)?;
        for &id in ids {
            if let Some((at, serial)) = self.coord.finish_transfer(id) {
                if let Some(entry) = self.entries.get_mut(at) {
                    if entry.live && entry.serial == serial {
                        entry.loading = entry.loading.saturating_sub(1);
                    }
                }
            }
        }
        self.coord.store_released();
        Ok(())
    }

    /// Host-tier loads of `req` not acknowledged yet (0: it can be scheduled).
    pub fn loads_in_flight(&self, req: RequestIdRef<'_>) -> CoreResult<u64> {
        Ok(self.entries[self.find(req)?].loading)
    }

    /// Transfers in flight (taken or not).
    pub fn transfers_in_flight(&self) -> usize {
        self.coord.host().map_or(0, HostTier::num_in_flight)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::testing::*;
    use crate::engine::CacheOptions;

    /// Full P = 4 and sliding P = 4, W = 8 over 8 real device pages and `host` host pages.
    fn tiered(host: u64, policy: HostStore) -> FlatCache {
        cache(
            vec![
                spec("full", crate::engine::group::GroupKind::Full, 4),
                spec("swa", sw(8), 4),
            ],
            9,
            CacheOptions {
                host_pages: host,
                host_store: policy,
                ..CacheOptions::default()
            },
        )
    }

    fn ids(ts: &[Transfer]) -> Vec<u64> {
        ts.iter().map(|t| t.id).collect()
    }

    #[test]
    fn write_through_stores_registered_pages_and_pins_them_until_acknowledged() {
        let mut c = tiered(16, HostStore::WriteThrough);
        add(&mut c, A, toks(0..16));
        assert!(c.schedule(A, 16, 0).unwrap());
        c.finish(A).unwrap(); // registers 4 pages per group, then frees them
        let t = c.take_transfers();
        // One store per registered page: group 0 slots 0..3, then group 1; host pages in order.
        assert_eq!(t.len(), 8);
        assert!(t.iter().all(|x| x.kind == TransferKind::Store));
        assert_eq!(t.iter().map(|x| x.host).collect::<Vec<_>>(), (0..8).collect::<Vec<_>>());
        assert_eq!(
            t.iter().map(|x| x.group).collect::<Vec<_>>(),
            vec![0, 0, 0, 0, 1, 1, 1, 1]
        );
        // Every stored page is still held by its store: nothing can be allocated.
        assert_eq!(c.coordinator().pool().num_free(), 0);
        assert!(!c.acquire(B, 1).unwrap());
        c.check_invariants().unwrap();
        let mut order = ids(&t);
        order.reverse();
        c.ack_transfers(&order).unwrap();
        assert_eq!(c.coordinator().pool().num_free(), 8);
        assert_eq!(c.transfers_in_flight(), 0);
        c.check_invariants().unwrap();
    }

    /// A write-through tier holding `A`'s 16-token prompt (stored and acknowledged) while the
    /// device holds no cached page: a page-level request took all 8 pages, then freed them.
    fn stored_then_evicted() -> FlatCache {
        let mut c = tiered(16, HostStore::WriteThrough);
        run_and_finish(&mut c, A, toks(0..16));
        let stores = c.take_transfers();
        c.ack_transfers(&ids(&stores)).unwrap();
        assert!(c.acquire(B, 16).unwrap());
        c.free(B).unwrap();
        assert_eq!(c.coordinator().pool().num_cached(), 0);
        c
    }

    #[test]
    fn host_hits_load_back_and_the_request_waits_for_them() {
        let mut c = stored_then_evicted();
        // 17 tokens: cap 4 pages. Full hits slots 0..3 on the host; the sliding group needs
        // its window behind 16: ceil(7 / 4) = 2 pages (slots 2, 3). 6 loads, 6 device pages.
        let p = prompt(&c, toks(0..17));
        assert_eq!(c.prefix_hit_tokens(&p).unwrap(), 16);
        assert_eq!(c.pages_needed_to_admit(&p, 1, 0).unwrap(), 6 + 2);
        assert_eq!(add(&mut c, C, toks(0..17)), 16);
        assert_eq!(c.loads_in_flight(C).unwrap(), 6);
        assert!(matches!(c.schedule(C, 1, 0), Err(CoreError::InvalidArgument(_))));
        assert!(c.schedule_batch(&[C], &[1]).is_err());
        let loads = c.take_transfers();
        assert_eq!(loads.len(), 6);
        assert!(loads.iter().all(|x| x.kind == TransferKind::Load));
        let ids_ = c.page_ids(C).unwrap();
        assert_eq!(ids_[0].len(), 4);
        assert_eq!(ids_[1][..2], [0, 0]);
        // Destinations are the request's pages, and the sources the host pages of the keys.
        let dest: Vec<u32> = ids_[0].iter().chain(&ids_[1][2..]).copied().collect();
        assert_eq!(loads.iter().map(|x| x.device).collect::<Vec<_>>(), dest);
        assert_eq!(loads.iter().map(|x| x.host).collect::<Vec<_>>(), vec![0, 1, 2, 3, 6, 7]);
        c.check_invariants().unwrap();
        // Acknowledged in any order; then the pages are device hits and C can run.
        c.ack_transfers(&[loads[3].id, loads[0].id]).unwrap();
        assert_eq!(c.loads_in_flight(C).unwrap(), 4);
        c.check_invariants().unwrap();
        let rest: Vec<u64> = loads[4..].iter().chain(&loads[1..3]).map(|x| x.id).collect();
        c.ack_transfers(&rest).unwrap();
        assert!(c.schedule(C, 1, 0).unwrap());
        c.check_invariants().unwrap();
    }

    #[test]
    fn finishing_during_a_load_loses_no_page_and_late_acks_register_it() {
        let mut c = stored_then_evicted();
        assert_eq!(add(&mut c, C, toks(0..17)), 16);
        let loads = c.take_transfers();
        c.preempt(C).unwrap();
        // The 6 destinations stay pinned by their loads.
        assert_eq!(c.coordinator().pool().num_free(), 2);
        c.check_invariants().unwrap();
        // The same id can be re-added meanwhile; a late ack must not count for it.
        assert_eq!(add(&mut c, C, toks(100..110)), 0);
        let mut late = ids(&loads);
        late.reverse();
        c.ack_transfers(&late).unwrap();
        assert_eq!(c.loads_in_flight(C).unwrap(), 0);
        c.finish(C).unwrap();
        assert_eq!(c.coordinator().pool().num_free(), 8);
        c.check_invariants().unwrap();
        // The loaded pages were registered: a device hit now, no loads.
        assert_eq!(add(&mut c, A, toks(0..17)), 16);
        assert_eq!(c.loads_in_flight(A).unwrap(), 0);
        assert!(c.take_transfers().is_empty());
    }

    #[test]
    fn evict_policy_stores_a_page_when_it_becomes_evictable() {
        let mut c = tiered(16, HostStore::Evict);
        add(&mut c, A, toks(0..12));
        assert!(c.schedule(A, 12, 0).unwrap());
        c.append_tokens(A, &[12]).unwrap();
        // At c = 12: registers 3 + 3 pages (no store: all held), then reclaims sliding slot
        // 0 ((12 - 7) // 4 = 1): that cached page's last reference goes, so it is stored.
        assert!(c.schedule(A, 1, 0).unwrap());
        let first = c.take_transfers();
        assert_eq!(first.len(), 1);
        assert_eq!(
            (first[0].kind, first[0].group, first[0].host),
            (TransferKind::Store, 1, 0)
        );
        c.finish(A).unwrap();
        // The 5 other cached pages are stored as they are released; the partial 4th pages
        // hold no key and are freed at once.
        let rest = c.take_transfers();
        assert_eq!(rest.len(), 5);
        assert_eq!(c.coordinator().pool().num_free(), 2);
        c.check_invariants().unwrap();
        c.ack_transfers(&ids(&rest)).unwrap();
        c.ack_transfers(&ids(&first)).unwrap();
        assert_eq!(c.coordinator().pool().num_free(), 8);
        c.check_invariants().unwrap();
    }

    #[test]
    fn acknowledgements_are_checked_before_anything_changes() {
        let mut c = tiered(4, HostStore::WriteThrough);
        run_and_finish(&mut c, A, toks(0..16));
        // 8 pages registered, 4 host pages: the first 4 stored, the rest skipped.
        assert_eq!(c.coordinator().host().unwrap().counters.stores_skipped, 4);
        let t = c.take_transfers();
        assert_eq!(t.len(), 4);
        for bad in [vec![t[0].id, 999], vec![t[0].id, t[0].id]] {
            assert!(matches!(c.ack_transfers(&bad), Err(CoreError::InvalidArgument(_))));
        }
        assert_eq!(c.transfers_in_flight(), 4);
        c.ack_transfers(&ids(&t)).unwrap();
        assert!(c.ack_transfers(&[t[0].id]).is_err());
        let no_tier = &mut hybrid(8);
        assert!(no_tier.ack_transfers(&[1]).is_err());
        no_tier.ack_transfers(&[]).unwrap();
        c.check_invariants().unwrap();
    }
}
