//! The block pool (SPEC 5): one page-id space, reference counts, an LRU free list and the
//! prefix-cache key map.
//!
//! The free list is an [`LruList`] (the same list type as the host tier's) whose nodes are the
//! page ids themselves: the null page 0 is never free, so its link slot serves as the list's
//! sentinel. Every list operation is O(1) and allocates nothing. Free-list order is eviction
//! order: allocation pops the front, a released page that holds a key is pushed to the back,
//! and a prefix hit on a free page unlinks it from the middle. A released page that holds no
//! key goes to the front when the pool reuses uncached pages first (the default,
//! [`BlockPool::set_reuse_uncached_first`]), else to the back (SPEC 5's order).
//!
//! The pool is generic over the key type: the coordinator uses [`crate::engine::hash::GroupKey`]
//! (fixed-size bytes), the Python `BlockPool` uses strings.

use std::hash::{BuildHasher, Hash};

use hashbrown::hash_table::Entry;
use hashbrown::{Equivalent, HashTable};
use rustc_hash::FxBuildHasher;

use crate::engine::lru::{self, LruList};
use crate::error::{CoreError, CoreResult};

mod arena;

use arena::{Arena, ClaimEffect};
pub use arena::{ArenaGeometry, Place};

/// The null page: never free, never cached, never counted.
pub const NULL_PAGE: u32 = 0;

/// Largest pool size: page ids are written into `int32` block tables.
pub const MAX_BLOCKS: u64 = i32::MAX as u64;

/// Whether a new pool reuses released uncached pages first (see
/// [`BlockPool::set_reuse_uncached_first`]).
pub const DEFAULT_REUSE_UNCACHED_FIRST: bool = true;

/// One key-map slot: the fingerprint (the pool's 64-bit hash of a key) and the pages holding
/// keys with that fingerprint, in registration order.
///
/// The map stores fingerprints, not keys: a slot is 16 bytes where a (key, pages) entry was 64,
/// so the map of a pool's worth of pages stays in the core's L2 cache (registering and evicting
/// a page each touch one slot, and that cache miss was most of their cost). The keys live in
/// `BlockPool::keys`; a lookup compares the candidates' keys there, so two different keys that
/// share a fingerprint are told apart exactly (they share one slot).
#[derive(Clone, Copy, Debug)]
struct Slot {
    fp: u64,
    /// The only page, when `many == 0`.
    page: u32,
    /// 0: one page (`page`); else 1 + the index in `BlockPool::overflow` of the pages' list
    /// (two or more).
    many: u32,
}

/// The fingerprint of a key: its `Hash` through `FxHasher` (one multiply for a
/// [`crate::engine::hash::GroupKey`], whose bytes are already SHA-256 output).
#[inline]
fn fingerprint<Q: Hash + ?Sized>(key: &Q) -> u64 {
    FxBuildHasher.hash_one(key)
}

/// After a page left `slot`'s overflow list `list` (index `at` of `BlockPool::overflow`): with
/// one page left the slot holds it alone again, and the list is returned for reuse.
fn settle_overflow(slot: &mut Slot, list: &mut Vec<u32>, at: usize, overflow_free: &mut Vec<u32>) {
    if let [only] = list.as_slice() {
        slot.page = *only;
        slot.many = 0;
        list.clear();
        overflow_free.push(page_u32(at));
    }
}

/// The page pool of one cache.
#[derive(Clone, Debug)]
#[allow(
    clippy::struct_excessive_bools,
    reason = "independent switches of the pool, each read on its own hot path"
)]
pub struct BlockPool<K> {
    enable_caching: bool,
    /// Whether a released page that holds no key goes to the front of the free list (reused
    /// before any cached page) instead of the back.
    reuse_uncached_first: bool,
    /// Reference count per page (page 0 always 0).
    refs: Vec<u32>,
    /// The free list (pages of count 0), front = next to hand out; page 0 is its sentinel.
    free: LruList,
    /// The key each page holds, if any.
    keys: Vec<Option<K>>,
    /// Fingerprint -> pages holding keys with it, in registration order (see [`Slot`]).
    map: HashTable<Slot>,
    /// Page lists of the slots with two or more pages; `overflow_free` lists the unused ones.
    overflow: Vec<Vec<u32>>,
    overflow_free: Vec<u32>,
    num_cached: usize,
    num_cached_free: usize,
    /// Keys dropped because their page was handed out again (the `evictions` metric).
    evictions: u64,
    /// The group a key belongs to, when the owner counts evictions per group
    /// ([`BlockPool::count_evictions_by`]), and those counts.
    key_group: Option<fn(&K) -> usize>,
    evictions_by_group: Vec<u64>,
    /// Whether evicted keys are kept in `evicted` (for KV events).
    record_evictions: bool,
    /// Keys evicted since the last [`BlockPool::take_evicted`], in eviction order.
    evicted: Vec<K>,
    /// Whether cached pages whose count drops to 0 are kept in `released` (host tier).
    record_released: bool,
    /// Cached pages that joined the free list since the last [`BlockPool::take_released`].
    released: Vec<u32>,
    /// Arena mode (SPEC 13.2): units bound to groups, per-group free lists; `free` is unused.
    arena: Option<Box<Arena>>,
}

/// The occupancy of an arena ([`BlockPool::arena_stats`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArenaStats {
    /// Bytes per unit.
    pub unit_bytes: u64,
    /// Units but the null one.
    pub units_total: usize,
    /// Units bound to no group.
    pub units_free: usize,
    /// Bound units none of whose pages is referenced (each holds a key; evictable whole).
    pub units_idle: usize,
    /// Per group, the units bound to it (idle ones included).
    pub units_bound: Vec<usize>,
    /// Per group, the free pages of its busy units that hold no key (usable by that group
    /// only).
    pub pages_free: Vec<usize>,
    /// Bytes of those pages: memory that holds nothing and only its own group can use until
    /// its unit empties (the stranded memory of docs/architecture.md).
    pub stranded_bytes: u64,
    /// Per group, the free pages of its busy units that hold a key (cached prefixes, evictable
    /// for that group only).
    pub pages_cached: Vec<usize>,
    /// Bytes of those pages.
    pub cached_bytes: u64,
}

/// Allocate a vector of `n` copies of `value`, reporting allocation failure as an error.
fn try_filled<T: Clone>(n: usize, value: T) -> CoreResult<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| out_of_memory(n))?;
    v.resize(n, value);
    Ok(v)
}

/// The error of a pool of `n` pages whose vectors cannot be allocated.
fn out_of_memory(n: usize) -> CoreError {
    CoreError::OutOfMemory(format!("num_blocks = {n}: the page pool does not fit in memory"))
}

impl<K: Clone + Eq + Hash> BlockPool<K> {
    /// A pool of `num_blocks` pages (page 0 included), all but the null page free in order.
    pub fn new(num_blocks: u64, enable_caching: bool) -> CoreResult<Self> {
        if num_blocks == 0 {
            return Err(CoreError::invalid("num_blocks must be >= 1, got 0"));
        }
        if num_blocks > MAX_BLOCKS {
            return Err(CoreError::invalid(format!(
                "num_blocks must be <= {MAX_BLOCKS} (page ids are int32), got {num_blocks}"
            )));
        }
        // Both conversions hold: num_blocks <= i32::MAX.
        let n = usize::try_from(num_blocks).map_err(|_| CoreError::overflow("num_blocks"))?;
        let last = u32::try_from(num_blocks - 1).map_err(|_| CoreError::overflow("num_blocks"))?;
        let free = LruList::filled(last).map_err(|_| out_of_memory(n))?;
        // Each real page holds at most one key: sized for all of them up front, the key map
        // never rehashes while serving (a rehash of a full map is a millisecond-long step).
        let mut map = HashTable::new();
        if enable_caching {
            map.try_reserve(n - 1, |s: &Slot| s.fp).map_err(|_| {
                CoreError::OutOfMemory(format!("num_blocks = {n}: the page key map does not fit in memory"))
            })?;
        }
        Ok(Self {
            enable_caching,
            reuse_uncached_first: DEFAULT_REUSE_UNCACHED_FIRST,
            refs: try_filled(n, 0)?,
            free,
            keys: try_filled(n, None)?,
            map,
            overflow: Vec::new(),
            overflow_free: Vec::new(),
            num_cached: 0,
            num_cached_free: 0,
            evictions: 0,
            key_group: None,
            evictions_by_group: Vec::new(),
            record_evictions: false,
            evicted: Vec::new(),
            record_released: false,
            released: Vec::new(),
            arena: None,
        })
    }

    /// A pool in arena mode over `geometry` (see [`ArenaGeometry`] and the `arena` module):
    /// group `g`'s page `p` is id `group_base(g) + p`; every unit starts free.
    pub fn with_arena(geometry: &ArenaGeometry, enable_caching: bool) -> CoreResult<Self> {
        let (arena, n) = Arena::new(geometry)?;
        let mut pool = Self::new(n as u64, enable_caching)?;
        // Arena mode lists its pages per group; the plain free list stays empty and holds no
        // links (8 bytes a page id saved).
        pool.free = LruList::empty(0).map_err(|_| out_of_memory(n))?;
        pool.arena = Some(Box::new(arena));
        Ok(pool)
    }

    /// Whether the pool is in arena mode.
    #[inline]
    pub fn is_arena(&self) -> bool {
        self.arena.is_some()
    }

    /// The pool id of group `g`'s view index 0 (0 without an arena): a table value `id`
    /// of group `g` is page `id - group_base(g)` of the group's view (0 stays 0).
    #[inline]
    pub fn group_base(&self, g: usize) -> u32 {
        self.arena.as_ref().map_or(0, |a| a.base[g])
    }

    /// The ids of group `g`'s view, the null page included (arena mode; else the pool's
    /// pages).
    pub fn group_ids(&self, g: usize) -> usize {
        self.arena.as_ref().map_or(self.refs.len(), |a| a.num_ids[g] as usize)
    }

    /// What one page of group `g` counts in [`Self::num_free`]: 1, or its credit in arena
    /// mode.
    #[inline]
    pub fn page_cost(&self, g: usize) -> u64 {
        self.arena.as_ref().map_or(1, |a| a.cost[g])
    }

    /// Whether taking `needs[g]` pages for each group `g` (in group order) succeeds.
    pub fn fits(&self, needs: impl Iterator<Item = u64>) -> bool {
        match &self.arena {
            None => needs.fold(0u64, u64::saturating_add) <= self.free.len() as u64,
            Some(a) => {
                let needs: Vec<u64> = needs.collect();
                a.units_suffice(&needs, &ClaimEffect::default())
            }
        }
    }

    /// Whether claiming `claimed` (real pages, any counts, repeats allowed) and then taking
    /// `needs[g]` pages per group succeeds.
    pub fn fits_after_claim(&self, claimed: &[u32], needs: &[u64]) -> bool {
        let Some(arena) = &self.arena else {
            let mut free: Vec<u32> = claimed
                .iter()
                .copied()
                .filter(|&p| p != NULL_PAGE && self.refs_of(p) == 0)
                .collect();
            free.sort_unstable();
            free.dedup();
            let total = needs.iter().fold(free.len() as u64, |acc, &n| acc.saturating_add(n));
            return total <= self.free.len() as u64;
        };
        // The claimed pages of count 0, by unit.
        let mut free: Vec<(u32, u32)> = claimed
            .iter()
            .filter(|&&p| p != NULL_PAGE && self.refs_of(p) == 0)
            .map(|&p| (arena.unit_of[p as usize], p))
            .collect();
        free.sort_unstable();
        free.dedup();
        let groups = arena.page_bytes.len();
        let mut effect = ClaimEffect {
            taken: vec![(0, 0); groups],
            added: vec![(0, 0); groups],
            ..ClaimEffect::default()
        };
        let tally = |counts: &mut (u64, u64), page: u32| {
            if self.keys[page as usize].is_some() {
                counts.1 += 1;
            } else {
                counts.0 += 1;
            }
        };
        for run in free.chunk_by(|x, y| x.0 == y.0) {
            let unit = run[0].0;
            let group = arena.class[unit as usize] as usize;
            if arena.live[unit as usize] == 0 {
                // An idle unit becomes busy: its other pages join the group's lists.
                effect.woken.push(unit);
                for page in arena.ids_of_unit(group, unit) {
                    if run.binary_search(&(unit, page)).is_err() {
                        tally(&mut effect.added[group], page);
                    }
                }
            } else {
                for &(_, page) in run {
                    tally(&mut effect.taken[group], page);
                    if self.keys[page as usize].is_some() {
                        effect.taken_cached.push(page);
                    }
                }
            }
        }
        // `free` is sorted by unit: `woken` is sorted; `taken_cached` is sorted here.
        effect.taken_cached.sort_unstable();
        arena.units_suffice(needs, &effect)
    }

    // ----- probes -------------------------------------------------------------------------

    /// Total pages, the null page included.
    pub fn num_blocks(&self) -> usize {
        self.refs.len()
    }

    /// Pages on the free list; in arena mode the free credit (see the `arena` module).
    pub fn num_free(&self) -> usize {
        match &self.arena {
            None => self.free.len(),
            Some(a) => usize::try_from(a.credit()).unwrap_or(usize::MAX),
        }
    }

    /// What [`Self::num_free`] counts when nothing is allocated: the pages but the null page;
    /// in arena mode the credit of every unit but the null one.
    pub fn num_total(&self) -> usize {
        match &self.arena {
            None => self.refs.len() - 1,
            Some(a) => usize::try_from((a.class.len() as u64 - 1).saturating_mul(a.scale)).unwrap_or(usize::MAX),
        }
    }

    /// The arena's occupancy (arena mode only).
    pub fn arena_stats(&self) -> Option<ArenaStats> {
        let a = self.arena.as_deref()?;
        let groups = a.page_bytes.len();
        let mut units_bound = vec![0usize; groups];
        for &class in &a.class[1..] {
            if let Some(n) = units_bound.get_mut(class as usize) {
                *n += 1;
            }
        }
        let pages_free: Vec<usize> = (0..groups).map(|g| a.pages.len(arena::fresh_list(g))).collect();
        let pages_cached: Vec<usize> = (0..groups).map(|g| a.pages.len(arena::cached_list(g))).collect();
        let bytes = |pages: &[usize]| {
            pages
                .iter()
                .zip(&a.page_bytes)
                .map(|(&n, &b)| (n as u64).saturating_mul(b))
                .fold(0u64, u64::saturating_add)
        };
        let (stranded, cached_bytes) = (bytes(&pages_free), bytes(&pages_cached));
        Some(ArenaStats {
            unit_bytes: a.unit_bytes,
            units_total: a.class.len() - 1,
            units_free: a.free_units.len(),
            units_idle: a.idle_units.len(),
            units_bound,
            pages_free,
            stranded_bytes: stranded,
            pages_cached,
            cached_bytes,
        })
    }

    /// Pages holding a key.
    pub fn num_cached(&self) -> usize {
        self.num_cached
    }

    /// Pages holding a key with reference count 0 (reusable by a prefix hit, or evictable).
    pub fn num_cached_free(&self) -> usize {
        self.num_cached_free
    }

    /// Pages holding a key with reference count > 0.
    pub fn num_cached_pinned(&self) -> usize {
        self.num_cached - self.num_cached_free
    }

    /// Keys dropped so far because their page was handed out again.
    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    /// Count evictions per group from now on, `group(key)` telling a key's group.
    pub fn count_evictions_by(&mut self, group: fn(&K) -> usize) {
        self.key_group = Some(group);
    }

    /// Evictions of group `g`'s keys (0 unless [`Self::count_evictions_by`] was called).
    pub fn evictions_of_group(&self, g: usize) -> u64 {
        self.evictions_by_group.get(g).copied().unwrap_or(0)
    }

    /// Keep (or stop keeping) the keys that allocations evict, for [`Self::take_evicted`].
    pub fn set_record_evictions(&mut self, on: bool) {
        self.record_evictions = on;
        if !on {
            self.evicted = Vec::new();
        }
    }

    /// Whether evicted keys are being kept.
    #[inline]
    pub fn records_evictions(&self) -> bool {
        self.record_evictions
    }

    /// The keys evicted since the last call, in eviction order (empty unless recording).
    pub fn take_evicted(&mut self) -> Vec<K> {
        std::mem::take(&mut self.evicted)
    }

    /// Keep (or stop keeping) the cached pages whose count drops to 0, for
    /// [`Self::take_released`] (the host tier's store-on-eviction policy).
    pub fn set_record_released(&mut self, on: bool) {
        self.record_released = on;
        self.released.clear();
    }

    /// The cached pages that joined the free list since the last call, in release order.
    pub fn take_released(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.released)
    }

    /// Where a released page that holds no key joins the free list: the front when `on` (it is
    /// handed out before any cached page, so cached pages stay reusable longer), else the back
    /// (SPEC 5's order: every released page joins the back). Released cached pages always join
    /// the back. Pages already on the free list keep their places.
    pub fn set_reuse_uncached_first(&mut self, on: bool) {
        self.reuse_uncached_first = on;
    }

    /// Whether released uncached pages join the front of the free list.
    pub fn reuse_uncached_first(&self) -> bool {
        self.reuse_uncached_first
    }

    /// Whether prefix caching is on.
    pub fn caching_enabled(&self) -> bool {
        self.enable_caching
    }

    /// Check that `page` is a page id of this pool.
    pub fn check_page(&self, page: u64) -> CoreResult<usize> {
        match usize::try_from(page) {
            Ok(i) if i < self.refs.len() => Ok(i),
            _ => Err(CoreError::invalid(format!(
                "page {page} is out of range [0, {})",
                self.refs.len()
            ))),
        }
    }

    /// Reference count of `page`.
    pub fn ref_count(&self, page: u64) -> CoreResult<u32> {
        Ok(self.refs[self.check_page(page)?])
    }

    /// Whether `page` holds a key.
    pub fn is_cached(&self, page: u64) -> CoreResult<bool> {
        Ok(self.keys[self.check_page(page)?].is_some())
    }

    /// Reference count of a page id known to be in range (tables only hold such ids).
    #[inline]
    pub(crate) fn refs_of(&self, page: u32) -> u32 {
        self.refs[page as usize]
    }

    /// The key a page id known to be in range holds.
    #[inline]
    pub(crate) fn key_of(&self, page: u32) -> Option<&K> {
        self.keys[page as usize].as_ref()
    }

    /// The earliest-registered page still holding `key`, or `None` (always `None` with
    /// caching off). Never changes counts or order.
    #[inline]
    pub fn lookup<Q: Hash + Equivalent<K> + ?Sized>(&self, key: &Q) -> Option<u32> {
        if !self.enable_caching {
            return None;
        }
        let fp = fingerprint(key);
        let slot = self.map.find(fp, |s| s.fp == fp)?;
        self.slot_pages(slot)
            .iter()
            .copied()
            .find(|&page| self.keys[page as usize].as_ref().is_some_and(|k| key.equivalent(k)))
    }

    /// The pages of a map slot, in registration order.
    #[inline]
    fn slot_pages<'a>(&'a self, slot: &'a Slot) -> &'a [u32] {
        if slot.many == 0 {
            std::slice::from_ref(&slot.page)
        } else {
            &self.overflow[slot.many as usize - 1]
        }
    }

    /// Pages on the free list, front (next to evict) first.
    pub fn free_list(&self) -> lru::Iter<'_> {
        self.free.iter()
    }

    /// Take the key of a free `page` out of `keys` and the cached counts (the key map is the
    /// caller's); the key it held, if any.
    fn take_free_key(&mut self, page: u32) -> Option<K> {
        let key = self.keys[page as usize].take()?;
        self.num_cached -= 1;
        self.num_cached_free -= 1;
        Some(key)
    }

    /// Drop the key of a free `page`; returns the key it held, if any.
    fn drop_key(&mut self, page: u32) -> Option<K> {
        let key = self.take_free_key(page)?;
        let fp = fingerprint(&key);
        if let Ok(mut entry) = self.map.find_entry(fp, |s| s.fp == fp) {
            let slot = entry.get_mut();
            if slot.many == 0 {
                if slot.page == page {
                    entry.remove();
                }
            } else {
                let at = slot.many as usize - 1;
                let list = &mut self.overflow[at];
                if let Some(i) = list.iter().position(|&p| p == page) {
                    list.remove(i);
                }
                settle_overflow(slot, list, at, &mut self.overflow_free);
            }
        }
        Some(key)
    }

    /// Drop the key of `page`, a page of count 0 that holds one (it stays free where it is);
    /// returns the key, or `None` (and nothing changes) when the page is referenced or holds
    /// no key. Not counted as an eviction.
    pub fn drop_free_key(&mut self, page: u32) -> Option<K> {
        if self.refs_of(page) != 0 || self.key_of(page).is_none() {
            return None;
        }
        let key = self.drop_key(page);
        if self.arena.is_some() {
            self.arena_on_uncache(page);
        }
        key
    }

    /// Drop `key` from the earliest-registered page holding it when that page is free (count
    /// 0; it stays free where it is): [`Self::lookup`] then [`Self::drop_free_key`] with one
    /// probe of the key map (the whole-prefix drops of `coordinator.rs` make one call per
    /// page). Returns the key dropped, or `None` (nothing changes) when no page holds `key`
    /// or that page is referenced. Not counted as an eviction.
    pub fn drop_free_key_of(&mut self, key: &K) -> Option<K> {
        if !self.enable_caching {
            return None;
        }
        let fp = fingerprint(key);
        let Ok(mut entry) = self.map.find_entry(fp, |s| s.fp == fp) else {
            return None;
        };
        let slot = entry.get_mut();
        let page = if slot.many == 0 {
            let page = slot.page;
            if self.refs[page as usize] != 0 || self.keys[page as usize].as_ref() != Some(key) {
                return None;
            }
            entry.remove();
            page
        } else {
            let at = slot.many as usize - 1;
            let list = &mut self.overflow[at];
            let keys = &self.keys;
            let i = list.iter().position(|&p| keys[p as usize].as_ref() == Some(key))?;
            let page = list[i];
            if self.refs[page as usize] != 0 {
                return None;
            }
            list.remove(i);
            settle_overflow(slot, list, at, &mut self.overflow_free);
            page
        };
        let dropped = self.take_free_key(page);
        if self.arena.is_some() {
            self.arena_on_uncache(page);
        }
        dropped
    }

    /// Drop the key of `page` (a page being handed out again): counted, and kept for KV
    /// events when recording.
    #[inline]
    fn evict(&mut self, page: u32) {
        if let Some(key) = self.drop_key(page) {
            // A u64 counter of single increments cannot overflow in practice; saturate anyway.
            self.evictions = self.evictions.saturating_add(1);
            if let Some(group_of) = self.key_group {
                let g = group_of(&key);
                if g >= self.evictions_by_group.len() {
                    self.evictions_by_group.resize(g + 1, 0);
                }
                self.evictions_by_group[g] = self.evictions_by_group[g].saturating_add(1);
            }
            if self.record_evictions {
                self.evicted.push(key);
            }
        }
    }

    /// Drop the key of every cached page with count 0 (they stay free, in place); returns
    /// the dropped keys in free-list order. Not counted as evictions.
    pub fn clear_cached_free(&mut self) -> Vec<K> {
        let mut dropped = Vec::with_capacity(self.num_cached_free);
        if self.arena.is_some() {
            for page in self.arena_cached_free() {
                dropped.extend(self.drop_key(page));
                self.arena_on_uncache(page);
            }
            return dropped;
        }
        let mut at = self.free.front();
        while let Some(page) = at {
            if self.num_cached_free == 0 {
                break;
            }
            dropped.extend(self.drop_key(page));
            at = self.free.next(page);
        }
        dropped
    }

    // ----- operations ---------------------------------------------------------------------

    /// Take `n` pages from the front of the free list and append them to `out`, all or
    /// nothing: with fewer than `n` free pages nothing changes and `false` is returned.
    /// Taking a cached page evicts its key; new pages have count 1.
    pub fn allocate_into(&mut self, out: &mut Vec<u32>, n: usize) -> bool {
        if self.arena.is_some() || n > self.free.len() {
            return false;
        }
        if n == 0 {
            return true;
        }
        let start = out.len();
        // Pass 1 cuts the first n pages off the free list, reading only their links. Pass 2
        // evicts their keys and takes their counts: each page's loads there are independent
        // of the others', so they overlap instead of waiting behind the next link (most
        // allocated pages are cold).
        self.free.pop_front_into(out, n);
        for &page in &out[start..] {
            self.evict(page);
            self.refs[page as usize] = 1;
        }
        true
    }

    /// [`Self::allocate_into`] for group `g`'s pages: in arena mode from the group's units
    /// (see the `arena` module), else from the one free list.
    #[inline]
    pub fn allocate_group_into(&mut self, out: &mut Vec<u32>, g: usize, n: usize) -> bool {
        if self.arena.is_some() {
            self.arena_allocate_into(out, g, n)
        } else {
            self.allocate_into(out, n)
        }
    }

    /// [`Self::allocate_into`] into a new vector; an empty vector when `n` pages are not free.
    pub fn allocate(&mut self, n: usize) -> Vec<u32> {
        let mut out = Vec::new();
        self.allocate_into(&mut out, n);
        out
    }

    /// Claim one more reference on `page` (unlinking it from the free list if its count was
    /// 0). The null page is a no-op.
    pub fn touch(&mut self, page: u64) -> CoreResult<()> {
        let i = self.check_page(page)?;
        if i == 0 {
            return Ok(());
        }
        let count = self.refs[i];
        let Some(next) = count.checked_add(1) else {
            return Err(CoreError::invalid(format!("page {page}: reference count overflow")));
        };
        self.touch_unchecked(page_u32(i), next);
        Ok(())
    }

    /// Set the count of a real in-range page to `next` (= count + 1), unlinking it if free.
    #[inline]
    fn touch_unchecked(&mut self, page: u32, next: u32) {
        if self.refs[page as usize] == 0 {
            if self.arena.is_some() {
                self.arena_on_take(page);
            } else {
                self.free.unlink(page);
            }
            if self.keys[page as usize].is_some() {
                self.num_cached_free -= 1;
            }
        }
        self.refs[page as usize] = next;
    }

    /// Take one more reference on a real page known to be in range (coordinator use; the
    /// caller has checked that the count cannot overflow). Returns whether the page was free.
    #[inline]
    pub(crate) fn retain(&mut self, page: u32) -> bool {
        let was_free = self.refs[page as usize] == 0;
        let next = self.refs[page as usize].saturating_add(1);
        self.touch_unchecked(page, next);
        was_free
    }

    /// Release one reference on a real page whose count is known to be > 0; at 0 it joins the
    /// free list: at the back with its key intact, or, holding no key, at the front when the
    /// pool reuses uncached pages first. Returns whether the page became free.
    #[inline]
    pub(crate) fn release(&mut self, page: u32) -> bool {
        let count = &mut self.refs[page as usize];
        debug_assert!(*count > 0, "release of page {page} with count 0");
        *count = count.saturating_sub(1);
        if *count == 0 {
            if self.arena.is_some() {
                if self.keys[page as usize].is_some() {
                    self.num_cached_free += 1;
                    if self.record_released {
                        self.released.push(page);
                    }
                }
                self.arena_on_free(page);
            } else if self.keys[page as usize].is_some() {
                self.free.push_back(page);
                self.num_cached_free += 1;
                if self.record_released {
                    self.released.push(page);
                }
            } else if self.reuse_uncached_first {
                self.free.push_front(page);
            } else {
                self.free.push_back(page);
            }
            true
        } else {
            false
        }
    }

    /// The eviction stamp of `page` if it is a cached page of count 0 in arena mode (the pool
    /// evicts lower stamps first); `None` otherwise.
    pub(crate) fn eviction_stamp(&self, page: u32) -> Option<u64> {
        let i = page as usize;
        (self.arena.is_some() && i != 0 && i < self.refs.len() && self.refs[i] == 0 && self.keys[i].is_some())
            .then(|| self.arena_stamp(page))
    }

    /// Date the cached page of count 0 `page` at eviction stamp `stamp` (`None`: now, the
    /// newest): it is evicted after every page and unit stamped earlier and before those
    /// stamped later; `hint`, a [`Self::place`] taken earlier near where it goes, saves the
    /// search when still valid (the place is the same either way). Arena mode only (the free list of a plain pool has no dates: a no-op
    /// there, as for a page that is not cached and free).
    pub(crate) fn date(&mut self, page: u32, stamp: Option<u64>, hint: Option<Place>) {
        if self.eviction_stamp(page).is_some() {
            self.arena_restamp(page, stamp, hint);
        }
    }

    /// Where the cached page of count 0 `page` sits in the eviction order (arena mode), a hint
    /// for a later [`Self::date`] near it; `None` otherwise.
    pub(crate) fn place(&self, page: u32) -> Option<Place> {
        self.eviction_stamp(page).map(|_| self.arena_place(page))
    }

    /// Release `pages` in reverse order (a chain's tail is evicted before its head; uncached
    /// pages pushed to the front therefore end up in list order); null entries are skipped. Validated first: a page out of range or a count that would go
    /// below zero (repeats in the call counted) is an error and changes nothing.
    pub fn free(&mut self, pages: &[u64]) -> CoreResult<()> {
        // Pass 1 tentatively decrements so repeats are counted; on error it rolls back.
        for (done, &page) in pages.iter().enumerate() {
            let bad = match self.check_page(page) {
                Err(e) => Some(e),
                Ok(0) => None,
                Ok(i) if self.refs[i] == 0 => Some(CoreError::invalid(format!(
                    "page {page} is freed more times than it is referenced"
                ))),
                Ok(i) => {
                    self.refs[i] -= 1;
                    None
                }
            };
            if let Some(err) = bad {
                self.undo_decrements(&pages[..done]);
                return Err(err);
            }
        }
        // Pass 2 restores, pass 3 releases for real in reverse order.
        self.undo_decrements(pages);
        for &page in pages.iter().rev() {
            if page != 0 {
                self.release(page_u32(checked_index(page)));
            }
        }
        Ok(())
    }

    /// Add back the decrements of [`Self::free`]'s validation pass (all pages in range).
    fn undo_decrements(&mut self, pages: &[u64]) {
        for &page in pages {
            if page != 0 {
                self.refs[checked_index(page)] += 1;
            }
        }
    }

    /// Register `key` for `page`: a no-op with caching off or for the null page; a page that
    /// already holds a key is an error. Keys are never de-duplicated.
    pub fn cache(&mut self, page: u64, key: K) -> CoreResult<()> {
        let i = self.check_page(page)?;
        if !self.enable_caching || i == 0 {
            return Ok(());
        }
        if self.keys[i].is_some() {
            return Err(CoreError::invalid(format!("page {page} already holds a key")));
        }
        self.cache_unchecked(page_u32(i), key);
        Ok(())
    }

    /// Register `key` for a real, in-range page that holds no key (caching on).
    pub(crate) fn cache_unchecked(&mut self, page: u32, key: K) {
        let fp = fingerprint(&key);
        match self.map.entry(fp, |s| s.fp == fp, |s| s.fp) {
            Entry::Vacant(vacant) => {
                vacant.insert(Slot { fp, page, many: 0 });
            }
            Entry::Occupied(mut occupied) => {
                let slot = occupied.get_mut();
                if slot.many == 0 {
                    let pair = [slot.page, page];
                    let at = if let Some(at) = self.overflow_free.pop() {
                        self.overflow[at as usize].extend_from_slice(&pair);
                        at as usize
                    } else {
                        self.overflow.push(pair.to_vec());
                        self.overflow.len() - 1
                    };
                    // At most one list per pool page, so the count fits `u32`.
                    slot.many = page_u32(at + 1);
                } else {
                    self.overflow[slot.many as usize - 1].push(page);
                }
            }
        }
        self.keys[page as usize] = Some(key);
        self.num_cached += 1;
        if self.refs[page as usize] == 0 {
            self.num_cached_free += 1;
        }
        if self.arena.is_some() {
            self.arena_on_cache(page);
        }
    }

    /// Check the pool's own invariants: free-list links and membership, counters and the
    /// key map. Returns a description of the first violation.
    pub fn check(&self) -> Result<(), String> {
        if self.arena.is_some() {
            self.check_keys()?;
            return self.arena_check();
        }
        let on_list = self.free.check("free list")?;
        if on_list.len() != self.refs.len() {
            return Err("free list and reference counts cover different page ranges".to_owned());
        }
        for (page, (&count, &listed)) in self.refs.iter().zip(&on_list).enumerate().skip(1) {
            if count == 0 && !listed {
                return Err(format!("page {page} has count 0 but is not on the free list"));
            }
            if count > 0 && listed {
                return Err(format!("page {page} has count {count} but is on the free list"));
            }
        }
        if self.refs[0] != 0 || self.keys[0].is_some() || on_list[0] {
            return Err("the null page 0 is counted, cached or free".to_owned());
        }
        self.check_keys()?;
        let in_use = self.refs.iter().filter(|&&c| c > 0).count();
        if self.free.len() + in_use + 1 != self.refs.len() {
            return Err(format!(
                "free ({}) + in use ({in_use}) + 1 != num_pages ({})",
                self.free.len(),
                self.refs.len()
            ));
        }
        Ok(())
    }

    /// Check the key map and the cache counters.
    fn check_keys(&self) -> Result<(), String> {
        if self.refs[0] != 0 || self.keys[0].is_some() {
            return Err("the null page 0 is counted or cached".to_owned());
        }
        let mut fps = std::collections::HashSet::new();
        let mut lists = 0usize;
        for slot in &self.map {
            if !fps.insert(slot.fp) {
                return Err(format!("two key map slots share fingerprint {:#x}", slot.fp));
            }
            let pages = self.slot_pages(slot);
            if slot.many != 0 {
                lists += 1;
                if pages.len() < 2 {
                    return Err(format!("key map slot {:#x} lists {} pages", slot.fp, pages.len()));
                }
            }
            for &page in pages {
                let held = self.keys.get(page as usize).and_then(Option::as_ref);
                if held.is_none_or(|k| fingerprint(k) != slot.fp) {
                    return Err(format!(
                        "key map entry points at page {page}, which does not hold a key with that fingerprint"
                    ));
                }
            }
        }
        if lists + self.overflow_free.len() != self.overflow.len() {
            return Err("key map page lists leak: used + free != allocated".to_owned());
        }
        let cached = self.keys.iter().filter(|k| k.is_some()).count();
        let cached_free = self
            .keys
            .iter()
            .zip(&self.refs)
            .filter(|(k, &c)| k.is_some() && c == 0)
            .count();
        let mapped: usize = self.map.iter().map(|s| self.slot_pages(s).len()).sum();
        if cached != self.num_cached || cached_free != self.num_cached_free || mapped != cached {
            return Err(format!(
                "cache counters disagree: {cached} pages hold keys, {mapped} map entries, \
                 num_cached = {}, {cached_free} cached free vs num_cached_free = {}",
                self.num_cached, self.num_cached_free
            ));
        }
        Ok(())
    }

    // ----- added for the Python binding (rust/py/src/pool.rs): its arena argument check -----

    /// Check that `page` may take a reference ([`Self::touch`], [`Self::fits_after_claim`]) or
    /// a key ([`Self::cache`]) as it is, which those assume in arena mode without checking (a
    /// page of count 0 in a unit not bound to its group would panic or corrupt the lists):
    /// `page` in range and, in arena mode, the null page, a page of count > 0, or a page of
    /// count 0 lying wholly in a unit bound to its own group (on the group's free pages or in an
    /// idle unit). Any other page (in a free unit, a unit of another group, the null unit or
    /// straddling two units) is an error naming it.
    pub fn check_arena_page(&self, page: u64) -> CoreResult<()> {
        let i = self.check_page(page)?;
        let Some(a) = self.arena.as_deref() else {
            return Ok(());
        };
        let u = a.unit_of[i] as usize;
        if i == 0 || self.refs[i] > 0 || (u != 0 && a.class[u] == a.group_of[i]) {
            return Ok(());
        }
        Err(CoreError::invalid(format!(
            "page {page} of group {} lies in no unit bound to that group (arena mode)",
            a.group_of[i]
        )))
    }
}

/// Convert an index known to be a page id of a pool (< `MAX_BLOCKS`) to `u32`.
#[inline]
#[allow(
    clippy::cast_possible_truncation,
    reason = "page indices are < MAX_BLOCKS = i32::MAX"
)]
fn page_u32(i: usize) -> u32 {
    i as u32
}

/// Convert a page id already validated by [`BlockPool::check_page`] to an index.
#[inline]
#[allow(
    clippy::cast_possible_truncation,
    reason = "validated page ids are < MAX_BLOCKS = i32::MAX"
)]
fn checked_index(page: u64) -> usize {
    page as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    type Pool = BlockPool<String>;

    fn free_list(pool: &Pool) -> Vec<u32> {
        pool.free_list().collect()
    }

    /// A pool in SPEC 5's order: every released page joins the back of the free list.
    fn appending(num_blocks: u64) -> Pool {
        let mut pool = Pool::new(num_blocks, true).unwrap();
        pool.set_reuse_uncached_first(false);
        pool
    }

    #[test]
    fn new_pool_frees_pages_in_order_and_never_the_null_page() {
        let pool = Pool::new(5, true).unwrap();
        assert_eq!(free_list(&pool), vec![1, 2, 3, 4]);
        assert_eq!((pool.num_blocks(), pool.num_free()), (5, 4));
        let single = Pool::new(1, true).unwrap();
        assert_eq!(single.num_free(), 0);
        assert!(free_list(&single).is_empty());
        single.check().unwrap();
        assert!(Pool::new(0, true).is_err());
        assert!(Pool::new(MAX_BLOCKS + 1, true).is_err());
    }

    /// Group keys whose hashes differ only after byte 8 share a fingerprint (the `Hash` of a
    /// `GroupKey` reads the first 8 bytes), so they land in one map slot.
    fn colliding_key(last: u8) -> crate::engine::hash::GroupKey {
        let mut hash = [7u8; 32];
        hash[31] = last;
        crate::engine::hash::GroupKey::new(hash, 0)
    }

    #[test]
    fn keys_sharing_a_fingerprint_are_told_apart() {
        let (a, b) = (colliding_key(1), colliding_key(2));
        assert_eq!(fingerprint(&a), fingerprint(&b));
        let mut pool = BlockPool::new(6, true).unwrap();
        assert_eq!(pool.allocate(4), vec![1, 2, 3, 4]);
        pool.cache(1, a).unwrap();
        pool.cache(2, b).unwrap();
        pool.cache(3, a).unwrap();
        pool.cache(4, b).unwrap();
        pool.check().unwrap();
        // Earliest registration of each key, whatever the other key did in between.
        assert_eq!((pool.lookup(&a), pool.lookup(&b)), (Some(1), Some(2)));
        assert_eq!(pool.lookup(&colliding_key(3)), None);
        // Free 1 and 2, then hand them out again: their keys are evicted, the later holders stay.
        pool.free(&[1, 2]).unwrap();
        let mut again = pool.allocate(3);
        again.sort_unstable();
        assert_eq!(again, vec![1, 2, 5]);
        pool.check().unwrap();
        assert_eq!((pool.lookup(&a), pool.lookup(&b)), (Some(3), Some(4)));
        assert_eq!(pool.num_cached(), 2);
        // Down to one key in the slot, then none; the freed page lists are reused.
        pool.free(&[4]).unwrap();
        assert_eq!(pool.clear_cached_free(), vec![b]);
        assert_eq!((pool.lookup(&a), pool.lookup(&b)), (Some(3), None));
        pool.cache(5, b).unwrap();
        pool.cache(1, a).unwrap();
        pool.check().unwrap();
        assert_eq!((pool.lookup(&a), pool.lookup(&b)), (Some(3), Some(5)));
    }

    #[test]
    fn allocate_is_all_or_nothing_from_the_front() {
        let mut pool = Pool::new(5, true).unwrap();
        assert_eq!(pool.allocate(2), vec![1, 2]);
        assert!(pool.allocate(3).is_empty());
        assert_eq!(pool.num_free(), 2);
        assert_eq!(pool.allocate(0), Vec::<u32>::new());
        assert_eq!(pool.ref_count(1).unwrap(), 1);
        pool.check().unwrap();
    }

    #[test]
    fn free_releases_in_reverse_to_the_back() {
        let mut pool = appending(6);
        let pages = pool.allocate(3); // [1, 2, 3]; free list [4, 5]
        pool.free(&[1, 2, 3]).unwrap();
        // Reverse order: 3, 2, 1 go to the back.
        assert_eq!(free_list(&pool), vec![4, 5, 3, 2, 1]);
        assert_eq!(pages, vec![1, 2, 3]);
        pool.check().unwrap();
    }

    #[test]
    fn uncached_pages_rejoin_the_front_when_reused_first() {
        for on in [true, false] {
            let mut pool = Pool::new(8, true).unwrap();
            pool.set_reuse_uncached_first(on);
            assert_eq!(pool.allocate(5), vec![1, 2, 3, 4, 5]); // free list [6, 7]
            pool.cache(2, "b".into()).unwrap();
            pool.cache(4, "d".into()).unwrap();
            // Released in reverse: 5, 4 (cached), 3, 2 (cached), 1.
            pool.free(&[1, 2, 3, 4, 5]).unwrap();
            let expected = if on {
                // Uncached 5, 3, 1 each go to the front (1 ends first); cached 4, 2 to the back.
                vec![1, 3, 5, 6, 7, 4, 2]
            } else {
                vec![6, 7, 5, 4, 3, 2, 1]
            };
            assert_eq!(free_list(&pool), expected);
            assert_eq!(pool.reuse_uncached_first(), on);
            pool.check().unwrap();
            // Five pages evict no key when uncached pages go first, one (4's) otherwise.
            pool.allocate(5);
            assert_eq!(pool.evictions(), u64::from(!on));
            pool.check().unwrap();
        }
    }

    #[test]
    fn free_validates_before_changing_anything() {
        let mut pool = appending(5);
        pool.allocate(2); // 1, 2 with count 1
        let before = free_list(&pool);
        // Page 1 twice: the second release would go below zero.
        assert!(pool.free(&[1, 2, 1]).is_err());
        assert!(pool.free(&[1, 9]).is_err());
        assert!(pool.free(&[3]).is_err());
        assert_eq!(free_list(&pool), before);
        assert_eq!((pool.ref_count(1).unwrap(), pool.ref_count(2).unwrap()), (1, 1));
        // Null entries are skipped.
        pool.free(&[0, 2, 0]).unwrap();
        assert_eq!(free_list(&pool), vec![3, 4, 2]);
        pool.check().unwrap();
    }

    #[test]
    fn repeats_release_at_the_earliest_occurrence() {
        let mut pool = appending(4);
        pool.allocate(2); // 1, 2
        pool.touch(1).unwrap(); // count 2
        pool.free(&[1, 2, 1]).unwrap(); // reverse: 1 -> 1, 2 -> 0 (back), 1 -> 0 (back)
        assert_eq!(free_list(&pool), vec![3, 2, 1]);
        pool.check().unwrap();
    }

    #[test]
    fn cached_free_page_is_reusable_until_evicted_least_recently_freed_first() {
        let mut pool = Pool::new(4, true).unwrap();
        let p = pool.allocate(3); // [1, 2, 3], free list empty
        pool.cache(1, "a".into()).unwrap();
        pool.cache(2, "b".into()).unwrap();
        pool.free(&[u64::from(p[0])]).unwrap(); // 1 -> back
        pool.free(&[u64::from(p[1])]).unwrap(); // 2 -> back
        assert_eq!(free_list(&pool), vec![1, 2]);
        assert_eq!(
            (pool.num_cached(), pool.num_cached_free(), pool.num_cached_pinned()),
            (2, 2, 0)
        );
        assert_eq!(pool.lookup("a"), Some(1));
        // A prefix hit on the free page 2 unlinks it from the middle/back.
        pool.touch(2).unwrap();
        assert_eq!(free_list(&pool), vec![1]);
        assert_eq!((pool.num_cached_free(), pool.num_cached_pinned()), (1, 1));
        // Allocation evicts page 1's key.
        assert_eq!(pool.allocate(1), vec![1]);
        assert_eq!(pool.lookup("a"), None);
        assert!(!pool.is_cached(1).unwrap());
        assert_eq!(pool.lookup("b"), Some(2));
        pool.check().unwrap();
    }

    #[test]
    fn touch_and_null_page() {
        let mut pool = Pool::new(3, true).unwrap();
        pool.touch(0).unwrap();
        assert_eq!(pool.ref_count(0).unwrap(), 0);
        pool.touch(2).unwrap(); // free page: unlinked, count 1
        assert_eq!(free_list(&pool), vec![1]);
        assert_eq!(pool.ref_count(2).unwrap(), 1);
        assert!(pool.touch(3).is_err());
        pool.cache(0, "x".into()).unwrap();
        assert_eq!(pool.lookup("x"), None);
        pool.check().unwrap();
    }

    #[test]
    fn keys_map_to_several_pages_in_registration_order() {
        let mut pool = Pool::new(5, true).unwrap();
        pool.allocate(3);
        pool.cache(2, "k".into()).unwrap();
        pool.cache(1, "k".into()).unwrap();
        pool.cache(3, "k".into()).unwrap();
        assert_eq!(pool.lookup("k"), Some(2));
        assert!(pool.cache(2, "other".into()).is_err());
        pool.free(&[2]).unwrap();
        // Page 2 is freed (key intact) and evicted by the next allocations: [4, 2].
        assert_eq!(pool.allocate(2), vec![4, 2]);
        assert_eq!(pool.lookup("k"), Some(1));
        pool.free(&[1]).unwrap();
        assert_eq!(pool.allocate(1), vec![1]);
        assert_eq!(pool.lookup("k"), Some(3));
        pool.check().unwrap();
    }

    #[test]
    fn evictions_are_counted_and_recorded_in_order() {
        let mut pool = appending(5);
        pool.allocate(3); // 1, 2, 3
        pool.cache(1, "a".into()).unwrap();
        pool.cache(3, "c".into()).unwrap();
        pool.free(&[1, 2, 3]).unwrap(); // free list [4, 3, 2, 1]
        assert_eq!(pool.allocate(4), vec![4, 3, 2, 1]);
        assert_eq!(pool.evictions(), 2);
        assert!(pool.take_evicted().is_empty(), "not recording");
        pool.set_record_evictions(true);
        pool.cache(2, "b".into()).unwrap();
        pool.cache(4, "d".into()).unwrap();
        pool.free(&[2, 4]).unwrap(); // released 4 then 2
        assert_eq!(pool.allocate(2), vec![4, 2]);
        assert_eq!(pool.take_evicted(), vec!["d".to_owned(), "b".to_owned()]);
        assert!(pool.take_evicted().is_empty());
        assert_eq!(pool.evictions(), 4);
        pool.check().unwrap();
    }

    #[test]
    fn clear_cached_free_drops_only_free_keys_in_place() {
        let mut pool = appending(6);
        pool.allocate(4); // 1..=4
        for (p, k) in [(1, "a"), (2, "b"), (3, "c")] {
            pool.cache(p, k.into()).unwrap();
        }
        pool.free(&[1, 3, 4]).unwrap(); // free list [5, 4, 3, 1]
        assert_eq!(pool.clear_cached_free(), vec!["c".to_owned(), "a".to_owned()]);
        assert_eq!(free_list(&pool), vec![5, 4, 3, 1]);
        assert_eq!(
            (pool.lookup("a"), pool.lookup("c"), pool.lookup("b")),
            (None, None, Some(2))
        );
        assert_eq!((pool.num_cached(), pool.num_cached_free(), pool.evictions()), (1, 0, 0));
        assert!(pool.clear_cached_free().is_empty());
        pool.check().unwrap();
    }

    #[test]
    fn caching_off_registers_nothing() {
        let mut pool = Pool::new(3, false).unwrap();
        pool.allocate(1);
        pool.cache(1, "k".into()).unwrap();
        assert_eq!(pool.lookup("k"), None);
        assert_eq!(pool.num_cached(), 0);
        assert!(pool.cache(7, "k".into()).is_err());
    }
}

#[cfg(test)]
mod properties {
    use proptest::prelude::*;

    use super::*;

    #[derive(Clone, Debug)]
    enum Op {
        Allocate(usize),
        Touch(u64),
        Free(Vec<u64>),
        Cache(u64, u8),
        Lookup(u8),
        DropKey(u8),
    }

    /// `drop_free_key_of(key)` on `pool` does what `lookup` then `drop_free_key` do on a clone:
    /// the same key dropped, and the same pages, keys and free order after.
    fn drops_like_two_steps<K: Clone + Eq + Hash + std::fmt::Debug>(
        pool: &mut BlockPool<K>,
        key: &K,
    ) -> Result<(), TestCaseError> {
        let mut two = pool.clone();
        let want = two.lookup(key).and_then(|page| two.drop_free_key(page));
        prop_assert_eq!(pool.drop_free_key_of(key), want);
        prop_assert_eq!(&pool.keys, &two.keys);
        prop_assert_eq!(
            (pool.num_cached, pool.num_cached_free),
            (two.num_cached, two.num_cached_free)
        );
        prop_assert_eq!(
            pool.free_list().collect::<Vec<_>>(),
            two.free_list().collect::<Vec<_>>()
        );
        if pool.arena.is_some() {
            prop_assert_eq!(pool.arena_cached_free(), two.arena_cached_free());
            prop_assert_eq!(pool.arena_stats(), two.arena_stats());
        }
        prop_assert_eq!(pool.lookup(key), two.lookup(key));
        Ok(())
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0usize..5).prop_map(Op::Allocate),
            (0u64..10).prop_map(Op::Touch),
            proptest::collection::vec(0u64..10, 0..4).prop_map(Op::Free),
            (0u64..10, 0u8..4).prop_map(|(p, k)| Op::Cache(p, k)),
            (0u8..4).prop_map(Op::Lookup),
            (0u8..4).prop_map(Op::DropKey),
        ]
    }

    proptest! {
        /// Dating a free cached page of an arena (SPEC 13.8b) with a place taken earlier, still
        /// valid or stale, puts it where the search from the young end puts it, and keeps every
        /// invariant. A unit holds one page of group 0 (a state slot) or four of group 1, so
        /// both the idle units and a group's cached pages are dated; the stamps are ones the
        /// pool gave (an earlier page's) or the clock's next.
        #[test]
        fn dating_with_a_hint_places_like_the_search(ops in proptest::collection::vec((0u8..5, 0usize..64, 0usize..64), 0..80)) {
            let geometry = ArenaGeometry { unit_bytes: 4, num_units: 9, page_bytes: vec![4, 1] };
            let mut pool: BlockPool<u32> = BlockPool::with_arena(&geometry, true).unwrap();
            let (mut held, mut places, mut key) = (Vec::new(), Vec::new(), 0u32);
            for (kind, a, b) in ops {
                let free = pool.arena_cached_free();
                match kind {
                    0 => {
                        let mut out = Vec::new();
                        if pool.allocate_group_into(&mut out, a % 2, 1) {
                            key += 1;
                            pool.cache(u64::from(out[0]), key).unwrap();
                            held.push(out[0]);
                        }
                    }
                    1 if !held.is_empty() => {
                        let page = held.swap_remove(a % held.len());
                        pool.free(&[u64::from(page)]).unwrap();
                    }
                    2 if !free.is_empty() => places.extend(pool.place(free[a % free.len()])),
                    3 if !free.is_empty() => {
                        let page = free[a % free.len()];
                        let stamp = (b % 4 != 0).then(|| pool.eviction_stamp(free[b % free.len()])).flatten();
                        let hint = places.get(b % places.len().max(1)).copied();
                        let mut plain = pool.clone();
                        plain.date(page, stamp, None);
                        pool.date(page, stamp, hint);
                        prop_assert_eq!(pool.arena_cached_free(), plain.arena_cached_free());
                        prop_assert_eq!(pool.eviction_stamp(page), plain.eviction_stamp(page));
                    }
                    // Dropping a key in one probe: a free cached page's, a held page's or none.
                    4 => {
                        let k = match b % 3 {
                            0 if !free.is_empty() => pool.key_of(free[a % free.len()]).copied().unwrap(),
                            1 if !held.is_empty() => pool.key_of(held[a % held.len()]).copied().unwrap(),
                            _ => key + 1,
                        };
                        drops_like_two_steps(&mut pool, &k)?;
                    }
                    _ => {}
                }
                prop_assert_eq!(pool.check(), Ok(()));
            }
        }

        /// Random op sequences keep every pool invariant, and failed ops change nothing.
        #[test]
        fn random_ops_keep_invariants(ops in proptest::collection::vec(op(), 0..60), front in any::<bool>()) {
            let mut pool: BlockPool<u8> = BlockPool::new(8, true).unwrap();
            pool.set_reuse_uncached_first(front);
            for op in ops {
                let before: (Vec<u32>, Vec<u32>) = (pool.free_list().collect(), pool.refs.clone());
                let failed = match op {
                    Op::Allocate(n) => {
                        let got = pool.allocate(n);
                        prop_assert!(got.len() == n || got.is_empty());
                        got.len() != n
                    }
                    Op::Touch(p) => pool.touch(p).is_err(),
                    Op::Free(ps) => pool.free(&ps).is_err(),
                    Op::Cache(p, k) => pool.cache(p, k).is_err(),
                    Op::Lookup(k) => {
                        if let Some(p) = pool.lookup(&k) {
                            prop_assert_eq!(pool.key_of(p), Some(&k));
                        }
                        false
                    }
                    Op::DropKey(k) => {
                        drops_like_two_steps(&mut pool, &k)?;
                        false
                    }
                };
                if failed {
                    let after: (Vec<u32>, Vec<u32>) = (pool.free_list().collect(), pool.refs.clone());
                    prop_assert_eq!(before, after);
                }
                prop_assert_eq!(pool.check(), Ok(()));
            }
        }
    }
}
