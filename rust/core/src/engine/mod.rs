//! The page engine of one model (SPEC 6-9): [`FlatCache`] holds each live request's per-group
//! tables over one [`coordinator::Coordinator`], in a slab whose positions are the requests'
//! slots; page-level requests are found by id, token-level ones by slot.
//!
//! Components, bottom up:
//! - [`ids`]: request ids.
//! - [`hash`]: content hashes and group keys (SPEC 4).
//! - [`lru`]: the intrusive O(1) LRU list the pool's free list and the host tier share.
//! - [`pool`]: the block pool (SPEC 5).
//! - [`table`]: one request's pages in one group.
//! - [`group`]: group kinds and their rules, one file per kind (SPEC 6).
//! - [`host`]: the host-memory tier, below the coordinator: host pages, their keys and LRU,
//!   transfers; it sees the device only through a narrow view of the pool.
//! - [`coordinator`]: all groups of a model over one pool (SPEC 7), with the host tier when
//!   one is configured.
//! - [`events`]: KV-cache events recorded by the engine.
//! - [`tokens`]: hashed prompts and the token state of token-level requests.
//!
//! [`FlatCache`] is defined here with private fields and its slab (adding and releasing a
//! request); its calls are `impl` blocks in [`calls`], one file per concern.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use hashbrown::HashMap;
use rustc_hash::FxBuildHasher;

use crate::error::{CoreError, CoreResult};
use coordinator::{Coordinator, GroupSpec};
use group::EvictionOrder;
use ids::{RequestId, RequestIdRef};
use table::Table;
use tokens::TokenState;

pub mod coordinator;
pub mod events;
pub mod group;
pub mod hash;
pub mod host;
pub mod ids;
pub mod lru;
pub mod policy;
pub mod pool;
pub mod prefixes;
pub mod table;
pub mod tokens;

pub mod calls;

pub use calls::rows::{RowDelta, RowLayout};
pub use calls::stats::{CacheStats, HostStats, PoolStats};
pub use calls::tables::{FlatTable, TableOut};
pub use pool::{ArenaGeometry, ArenaStats};

#[cfg(test)]
mod testing;

/// Options of a cache (the keyword arguments of the Python constructor).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(
    clippy::struct_excessive_bools,
    reason = "each bool is an independent keyword flag of the Python constructor, not a state"
)]
pub struct CacheOptions {
    /// Prefix caching on (register, match, claim).
    pub enable_caching: bool,
    /// How freeing a request orders its pages on the free list.
    pub eviction_order: EvictionOrder,
    /// Record KV events for [`FlatCache::take_events`].
    pub enable_kv_events: bool,
    /// A released page that holds no key joins the front of the free list (reused before any
    /// cached page) instead of the back; see [`pool::BlockPool::set_reuse_uncached_first`].
    pub reuse_uncached_first: bool,
    /// Pages of the host-memory tier (0: no tier; see [`host`]); over an arena, the pages of
    /// every group's own host space ([`FlatCache::with_arena`]).
    pub host_pages: u64,
    /// When pages are copied to the host tier.
    pub host_store: host::HostStore,
    /// Which state checkpoints are kept (SPEC 13.8, [`policy`]).
    pub eviction_policy: policy::EvictionPolicy,
    /// A state group's acquire moves the request's working page to the new last slot when
    /// that page holds no key (SPEC 13.4, the default); when false it always takes a fresh
    /// page there and the previous one stays in its slot until reclaim releases it (vLLM's
    /// `MambaManager` in mode "align"; [`group::GroupManager::set_moves_working_page`]).
    pub move_state_pages: bool,
    /// Token-level requests register the full pages of a scheduled chunk when `schedule`
    /// takes it, not at their next `schedule` (SPEC 8, "Same-step sharing"): a request
    /// admitted later in the same step hits them, as vLLM's scheduler does (it caches a page
    /// when it allocates it). Exact for attention groups only (every layer writes a step's
    /// K/V before its attention reads any), so a model with state groups ignores it.
    pub register_on_schedule: bool,
}

impl Default for CacheOptions {
    fn default() -> Self {
        Self {
            enable_caching: true,
            eviction_order: EvictionOrder::Hybrid,
            enable_kv_events: false,
            reuse_uncached_first: pool::DEFAULT_REUSE_UNCACHED_FIRST,
            host_pages: 0,
            host_store: host::HostStore::WriteThrough,
            eviction_policy: policy::EvictionPolicy::Lru,
            move_state_pages: true,
            register_on_schedule: false,
        }
    }
}

/// One live request: its id, its tables (one per group), its token state if it is
/// token-level, and the pages promised to its next decode.
#[derive(Clone, Debug, Default)]
struct Entry {
    /// Whether the slot holds a live request.
    live: bool,
    /// The id it was added with (`None` only in a free slot).
    id: Option<RequestId>,
    /// One table per group, in group order.
    tables: Vec<Table>,
    /// `Some` for a request created by `add_request`.
    tokens: Option<TokenState>,
    /// Pages reserved for this request's next decode (docs/requests-api.md `reserve`).
    reserve: u64,
    /// Host-tier loads into this request's pages not acknowledged yet (it cannot be
    /// scheduled before they are).
    loading: u64,
    /// A number no other request of this cache had, so a late load acknowledgement can tell
    /// this request from a later one in the same slot.
    serial: u64,
}

/// Counters behind [`stats::CacheStats`] that the pool does not keep.
#[derive(Clone, Copy, Debug, Default)]
struct Counters {
    prefix_queries_tokens: u64,
    prefix_hits_tokens: u64,
    preemptions: u64,
    /// Of `prefix_hits_tokens`, those at or after the first page any group loads from the
    /// host tier.
    host_hits_tokens: u64,
    /// Prefix hits that restored a state checkpoint (a hit > 0 with state groups).
    checkpoints_hit: u64,
}

/// The page engine of one model: a coordinator plus each live request.
///
/// Requests live in a slab (`entries`): a request's position there is its *slot*, the number
/// token-level callers name it by (docs/requests-api.md "Slots"); `index` maps ids to slots
/// for the calls that take ids. A new request takes the lowest free slot, so slots stay below
/// the peak number of live requests and every engine hands out the same ones.
#[derive(Clone, Debug)]
pub struct FlatCache {
    coord: Coordinator,
    index: HashMap<RequestId, usize, FxBuildHasher>,
    entries: Vec<Entry>,
    /// Free slots below `entries.len()`, lowest first.
    vacant: BinaryHeap<Reverse<usize>>,
    eviction: EvictionOrder,
    /// Sum of every request's `reserve` (u128: a sum of u64 page counts cannot overflow it).
    reserved: u128,
    counters: Counters,
    /// Reused buffer of slots for batch calls.
    scratch: Vec<usize>,
    /// Persistent block-table rows, once bound ([`calls::rows`]).
    rows: Option<calls::rows::RowBinding>,
    /// The serial of the next request.
    next_serial: u64,
    /// [`CacheOptions::register_on_schedule`], false for a model with state groups.
    register_on_schedule: bool,
}

impl FlatCache {
    /// An engine over `specs` with a pool of `num_pages` pages (page 0 included), with the
    /// default options except `enable_caching`.
    pub fn new(specs: Vec<GroupSpec>, num_pages: u64, enable_caching: bool) -> CoreResult<Self> {
        Self::with_options(
            specs,
            num_pages,
            CacheOptions {
                enable_caching,
                ..CacheOptions::default()
            },
        )
    }

    /// An engine over `specs` with a pool of `num_pages` pages (page 0 included).
    pub fn with_options(specs: Vec<GroupSpec>, num_pages: u64, options: CacheOptions) -> CoreResult<Self> {
        let mut coord = Coordinator::new(specs, num_pages, options.enable_caching)?;
        if options.host_pages > 0 {
            coord.set_host(options.host_pages, options.host_store)?;
        }
        Ok(Self::over(coord, options))
    }

    /// An engine over `specs` whose pages live in an arena of `geometry` (SPEC 13.2; see
    /// [`Coordinator::with_arena`]), with `options.host_pages` host pages for every group
    /// (see [`Self::with_arena_host_pages`]). `reuse_uncached_first = false` is not supported
    /// there and is refused.
    pub fn with_arena(specs: Vec<GroupSpec>, geometry: &ArenaGeometry, options: CacheOptions) -> CoreResult<Self> {
        let pages = vec![options.host_pages; specs.len()];
        Self::with_arena_host_pages(specs, geometry, options, &pages)
    }

    /// [`Self::with_arena`] with a host tier of `host_pages[g]` pages of group `g`'s own page
    /// geometry for each group `g` (0: that group is not tiered; all 0: no tier); the host
    /// tier over an arena is per group ([`host`], [`Coordinator::set_host_per_group`]).
    /// `options.host_pages` is not read.
    pub fn with_arena_host_pages(
        specs: Vec<GroupSpec>,
        geometry: &ArenaGeometry,
        options: CacheOptions,
        host_pages: &[u64],
    ) -> CoreResult<Self> {
        if !options.reuse_uncached_first {
            return Err(CoreError::invalid(
                "reuse_uncached_first must be True with arena storage (an arena reuses a unit's free pages first)",
            ));
        }
        let mut coord = Coordinator::with_arena(specs, geometry, options.enable_caching)?;
        coord.set_host_per_group(host_pages, options.host_store)?;
        Ok(Self::over(coord, options))
    }

    /// The engine over `coord` (its host tier, if any, set) with `options` applied.
    fn over(mut coord: Coordinator, options: CacheOptions) -> Self {
        coord.set_kv_events(options.enable_kv_events);
        coord.set_reuse_uncached_first(options.reuse_uncached_first);
        coord.set_eviction_policy(options.eviction_policy);
        coord.set_move_state_pages(options.move_state_pages);
        // A state checkpoint exists only once its chunk is computed, and with state groups
        // a hit ends on one: pages registered early could never extend a hit there.
        let stateless = coord.specs().iter().all(|s| s.kind != group::GroupKind::State);
        Self {
            coord,
            index: HashMap::default(),
            entries: Vec::new(),
            vacant: BinaryHeap::new(),
            eviction: options.eviction_order,
            reserved: 0,
            counters: Counters::default(),
            scratch: Vec::new(),
            rows: None,
            next_serial: 0,
            register_on_schedule: options.register_on_schedule && stateless,
        }
    }

    /// Set which state checkpoints are kept (SPEC 13.8; before any request exists, as the
    /// constructor's option).
    pub fn set_eviction_policy(&mut self, policy: policy::EvictionPolicy) {
        self.coord.set_eviction_policy(policy);
    }

    /// The coordinator (groups, page sizes, pool).
    pub fn coordinator(&self) -> &Coordinator {
        &self.coord
    }

    /// How freeing a request orders its pages.
    pub fn eviction_order(&self) -> EvictionOrder {
        self.eviction
    }

    /// Number of live requests.
    pub fn num_requests(&self) -> usize {
        self.index.len()
    }

    /// Whether `req` is a live request.
    pub fn has_request(&self, req: RequestIdRef<'_>) -> bool {
        self.index.contains_key(&req)
    }

    /// The slot of `req`, or `UnknownRequest`.
    #[inline]
    fn find(&self, req: RequestIdRef<'_>) -> CoreResult<usize> {
        self.index
            .get(&req)
            .copied()
            .ok_or_else(|| CoreError::UnknownRequest(req.to_string()))
    }

    /// The slot of live request `req`, if it is one.
    pub fn slot_of(&self, req: RequestIdRef<'_>) -> Option<usize> {
        self.index.get(&req).copied()
    }

    /// The slot `slot` if it holds a live request, else `UnknownSlot` for `method`.
    #[inline]
    fn held(&self, method: &str, slot: u64) -> CoreResult<usize> {
        usize::try_from(slot)
            .ok()
            .filter(|&at| self.entries.get(at).is_some_and(|e| e.live))
            .ok_or_else(|| CoreError::UnknownSlot {
                method: method.to_string(),
                slot,
            })
    }

    /// The id of the request in `slot` (`UnknownSlot` if it holds none).
    pub fn id_of(&self, slot: u64) -> CoreResult<RequestIdRef<'_>> {
        let at = self.held("id_of", slot)?;
        Ok(self.id_ref_at(at))
    }

    /// The id of the live request in slot `at`, as messages show it.
    pub(super) fn id_ref_at(&self, at: usize) -> RequestIdRef<'_> {
        self.entries[at]
            .id
            .as_ref()
            .map_or(RequestIdRef::Str("?"), RequestId::as_ref)
    }

    /// A live request as messages name it: `request 'a' (slot 3)`.
    pub(super) fn named(&self, at: usize) -> String {
        format!("request {}", self.labeled(at))
    }

    /// A live request's id and slot: `'a' (slot 3)`.
    pub(super) fn labeled(&self, at: usize) -> String {
        format!("{} (slot {at})", self.id_ref_at(at))
    }

    /// The tables of `req` (one per group), or `UnknownRequest`.
    fn tables(&self, req: RequestIdRef<'_>) -> CoreResult<&[Table]> {
        Ok(&self.entries[self.find(req)?].tables)
    }

    /// The slot the next request would get.
    fn next_slot(&self) -> usize {
        self.vacant.peek().map_or(self.entries.len(), |&Reverse(at)| at)
    }

    /// Add a new request (the caller checked that `req` is not live) in the lowest free slot;
    /// returns the slot.
    fn insert(&mut self, req: RequestIdRef<'_>, tokens: Option<TokenState>) -> usize {
        let entry = Entry {
            live: true,
            id: Some(req.to_id()),
            tables: vec![Table::default(); self.coord.num_groups()],
            tokens,
            reserve: 0,
            loading: 0,
            serial: self.next_serial,
        };
        // A u64 counter of single increments cannot overflow in practice.
        self.next_serial = self.next_serial.saturating_add(1);
        let at = if let Some(Reverse(at)) = self.vacant.pop() {
            self.entries[at] = entry;
            at
        } else {
            self.entries.push(entry);
            self.entries.len() - 1
        };
        self.index.insert(req.to_id(), at);
        if let Some(binding) = self.rows.as_mut() {
            binding.claim(at);
        }
        at
    }

    /// Free the request in slot `at` (its pages in the eviction order, its reserve) and forget
    /// it; returns its token state, if any.
    fn release(&mut self, at: usize) -> Option<TokenState> {
        let mut entry = std::mem::take(&mut self.entries[at]);
        if let Some(id) = &entry.id {
            self.index.remove(id);
        }
        if let Some(binding) = self.rows.as_mut() {
            binding.vacate(at);
        }
        self.coord.free(&mut entry.tables, self.eviction);
        self.reserved -= u128::from(entry.reserve);
        self.vacant.push(Reverse(at));
        entry.tokens
    }
}
