//! The page engine of one model (SPEC 6 to 9) as Python classes: `_PagedCacheBase`, the
//! state and the calls both protocols share, and its subclass `FlatKVCache`, the token-level
//! protocol (docs/requests-api.md). The page-level subclass, `PageCache`, is in
//! `page_cache.rs` (docs/engine-api.md). A method of one protocol is absent from the other
//! class, so a cache's requests are all of one kind.
//!
//! The classes are frozen and keep their mutable state behind `Mutex`es, so Python threads can
//! share one object; a subclass method reaches the shared state through `as_super()`, a
//! pointer cast. Locking discipline: a lock is never held while Python code can run
//! (arguments are extracted before locking, results converted after unlocking), so neither a
//! re-entrant call nor a GIL hand-off can deadlock. Long calls (hashing, matching, a step
//! over a slot array, writing block tables) take the lock with the GIL released
//! (`py.detach`); the one-slot readers stay attached because their work is shorter than a
//! detach/attach round trip.

use std::sync::Mutex;

use flat_kvcache_core::engine::coordinator::GroupSpec;
use flat_kvcache_core::engine::host::HostStore;
use flat_kvcache_core::engine::ids::RequestIdRef;
use flat_kvcache_core::engine::policy::EvictionPolicy;
use flat_kvcache_core::engine::pool::{DEFAULT_REUSE_UNCACHED_FIRST, MAX_BLOCKS};
use flat_kvcache_core::engine::tokens::Prompt;
use flat_kvcache_core::engine::FlatTable;
use flat_kvcache_core::engine::{CacheOptions, FlatCache};
use flat_kvcache_core::CoreError;
use numpy::ndarray::Array2;
use numpy::{IntoPyArray, PyArray1, PyArrayMethods};
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::args::{
    arena_geometry, count, counts, eviction_order as eviction_order_arg, eviction_policy as eviction_policy_arg,
    id_to_py, tokens, CountParam, ExtraKeys, FlagParam, GroupSpecs, Passed, RequestId,
};
use crate::convert::{clip, is_masked, signed, IntArg};
use crate::errors::{core, lock};
use crate::events::events_to_py;
use crate::host::{host_pages_count, host_store as host_store_arg, transfer_ids, transfers_to_py, HostPagesArg};
use crate::rows::{as_outs, check_bind, copy_deltas, deltas_to_py, no_deltas, BoundBuffers};
use crate::tables::{borrow_out, table_outs};

/// The read and write slot arrays of `state_slots`.
type SlotArrays<'py> = (Bound<'py, PyArray1<i32>>, Bound<'py, PyArray1<i32>>);

/// The state and the calls shared by `FlatKVCache` (token-level) and `PageCache`
/// (page-level): the constructor's checks, the geometry, counters, events, the host tier's
/// transfers and the invariant check. Calls that name a request are each subclass's own
/// (slots on `FlatKVCache`, ids on `PageCache`). Not constructible
/// itself (no `#[new]`): Python builds one of the two subclasses.
#[pyclass(subclass, frozen, module = "flat_kvcache._native", name = "_PagedCacheBase")]
pub struct PyPagedCache {
    /// The groups as the core normalised them (ids filled in), in group order.
    pub(crate) specs: Vec<GroupSpec>,
    pub(crate) base: u64,
    pub(crate) lcm: u64,
    pub(crate) inner: Mutex<FlatCache>,
}

impl PyPagedCache {
    /// The group ids, in group order.
    pub(crate) fn gids(&self) -> impl Iterator<Item = &str> {
        self.specs.iter().map(|s| s.group_id.as_str())
    }

    /// Run `f` on the engine with the GIL released (for calls whose work can be long).
    pub(crate) fn detached<R: Send>(&self, py: Python<'_>, f: impl FnOnce(&mut FlatCache) -> R + Send) -> PyResult<R> {
        py.detach(|| lock(&self.inner).map(|mut c| f(&mut c)))
    }

    /// Run `f` on the engine for the request id `req` (parsed before the lock is taken).
    pub(crate) fn on_request<R>(
        &self,
        req: &RequestId<'_>,
        f: impl FnOnce(&mut FlatCache, RequestIdRef<'_>) -> flat_kvcache_core::CoreResult<R>,
    ) -> PyResult<R> {
        let id = req.id()?;
        let result = f(&mut *lock(&self.inner)?, id);
        core(result)
    }

    /// Run `f` on the engine for the slot argument `slot` (extracted before the lock is taken).
    pub(crate) fn on_slot<R>(
        &self,
        slot: &Bound<'_, PyAny>,
        f: impl FnOnce(&FlatCache, u64) -> flat_kvcache_core::CoreResult<R>,
    ) -> PyResult<R> {
        let slot = count(slot, "slot")?;
        let result = f(&*lock(&self.inner)?, slot);
        core(result)
    }

    /// The constructor both subclasses share: `specs` (a non-empty sequence of `KVCacheSpec`),
    /// a pool of `num_pages >= 1` pages (page 0 included) and the keyword options.
    ///
    /// `eviction_order` is `"hybrid"` (free a request's pages by slot end token, descending,
    /// across all groups; SPEC 12.3) or `"group"` (group 0's table tail first, then group
    /// 1's, ...). `enable_kv_events` records KV events for `take_events`.
    /// `reuse_uncached_first`: a released page that holds no key joins the front of the free
    /// list (handed out before any cached page) instead of the back.
    #[allow(clippy::too_many_arguments, reason = "the Python constructor's keyword arguments")]
    #[allow(clippy::needless_pass_by_value, reason = "handed on as PyO3 extracted them")]
    pub(crate) fn build(
        specs: GroupSpecs,
        num_pages: Option<&Bound<'_, PyAny>>,
        enable_caching: FlagParam<'_>,
        eviction_order: Passed<'_>,
        enable_kv_events: FlagParam<'_>,
        reuse_uncached_first: FlagParam<'_>,
        host_pages: Option<&Bound<'_, PyAny>>,
        host_store: Passed<'_>,
        eviction_policy: Option<&Passed<'_>>,
        move_state_pages: &FlagParam<'_>,
        register_on_schedule: &FlagParam<'_>,
        arena: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        // docs/engine-api.md, "The checking order": each argument's form in signature order
        // (`specs` was read by its extraction, `arena=` is read against the specs below),
        // then what they say together.
        let arena = arena.filter(|a| !a.is_none());
        let num_pages = num_pages.filter(|n| !n.is_none());
        let pool_size = num_pages.map(pool_size).transpose()?;
        let mut options = CacheOptions {
            enable_caching: enable_caching.or(true, "enable_caching")?,
            eviction_order: eviction_order_arg(&eviction_order)?,
            enable_kv_events: enable_kv_events.or(false, "enable_kv_events")?,
            reuse_uncached_first: reuse_uncached_first.or(DEFAULT_REUSE_UNCACHED_FIRST, "reuse_uncached_first")?,
            host_pages: 0,
            host_store: HostStore::WriteThrough,
            eviction_policy: EvictionPolicy::Lru,
            move_state_pages: true,
            register_on_schedule: false,
        };
        let host = HostPagesArg::extract(host_pages)?;
        options.host_store = host_store_arg(&host_store)?;
        if let Some(policy) = eviction_policy {
            options.eviction_policy = eviction_policy_arg(policy)?;
        }
        options.move_state_pages = move_state_pages.or(true, "move_state_pages")?;
        options.register_on_schedule = register_on_schedule.or(false, "register_on_schedule")?;
        match (num_pages, arena) {
            (Some(n), Some(_)) => Err(PyValueError::new_err(format!(
                "num_pages must be None with arena= (the arena sizes the pool), got {}",
                n.repr()?
            ))),
            (None, None) => Err(PyTypeError::new_err(
                "num_pages must be an int (the pages in the pool, page 0 included) unless arena= is given, got None",
            )),
            (None, Some(plan)) => {
                let geometry = arena_geometry(plan, &specs.0)?;
                let per_group = host.per_group(&specs.0)?;
                let cache = FlatCache::with_arena_host_pages(specs.0, &geometry, options, &per_group);
                Ok(Self::over(core(cache)?))
            }
            (Some(_), None) => {
                options.host_pages = host_pages_count(host_pages)?;
                let size = pool_size.unwrap_or_default();
                Ok(Self::over(core(FlatCache::with_options(specs.0, size, options))?))
            }
        }
    }

    /// The Python object over a built engine.
    fn over(cache: FlatCache) -> Self {
        let coord = cache.coordinator();
        Self {
            specs: coord.specs().to_vec(),
            base: coord.base_page_size(),
            lcm: coord.lcm_page_size(),
            inner: Mutex::new(cache),
        }
    }
}

#[pymethods]
#[allow(clippy::needless_pass_by_value, reason = "PyO3 extracts arguments by value")]
impl PyPagedCache {
    /// The base page size (gcd of the groups' page sizes).
    #[getter]
    fn base_page_size(&self) -> u64 {
        self.base
    }

    /// The lcm of the groups' page sizes.
    #[getter]
    fn lcm_page_size(&self) -> u64 {
        self.lcm
    }

    /// Number of groups.
    #[getter]
    fn num_groups(&self) -> usize {
        self.specs.len()
    }

    /// Group ids in group order.
    #[getter]
    fn group_ids(&self) -> Vec<String> {
        self.gids().map(str::to_owned).collect()
    }

    /// Pages on the free list.
    #[getter]
    fn num_free_pages(&self) -> PyResult<usize> {
        Ok(lock(&self.inner)?.pool_stats().num_free)
    }

    /// Number of live requests.
    #[getter]
    fn num_requests(&self) -> PyResult<usize> {
        Ok(lock(&self.inner)?.num_requests())
    }

    /// Pool counters: `num_blocks num_free num_cached num_cached_free num_cached_pinned`.
    fn pool_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = lock(&self.inner)?.pool_stats();
        let d = PyDict::new(py);
        d.set_item("num_blocks", s.num_blocks)?;
        d.set_item("num_free", s.num_free)?;
        d.set_item("num_cached", s.num_cached)?;
        d.set_item("num_cached_free", s.num_cached_free)?;
        d.set_item("num_cached_pinned", s.num_cached_pinned)?;
        Ok(d)
    }

    /// Metrics with stable names: `pages_total pages_free pages_in_use pages_cached
    /// pages_cached_free requests prefix_queries_tokens prefix_hits_tokens evictions
    /// preemptions`, `pages_in_use_by_group` (`{group_id: pages}`), the host tier's
    /// `host_*` figures (all 0 without a host tier) and the state checkpoints'
    /// `checkpoints_written checkpoints_hit checkpoints_evicted` (all 0 without state groups).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = lock(&self.inner)?.stats();
        let d = PyDict::new(py);
        d.set_item("pages_total", s.pages_total)?;
        d.set_item("pages_free", s.pages_free)?;
        d.set_item("pages_in_use", s.pages_in_use)?;
        d.set_item("pages_cached", s.pages_cached)?;
        d.set_item("pages_cached_free", s.pages_cached_free)?;
        d.set_item("requests", s.requests)?;
        d.set_item("prefix_queries_tokens", s.prefix_queries_tokens)?;
        d.set_item("prefix_hits_tokens", s.prefix_hits_tokens)?;
        d.set_item("evictions", s.evictions)?;
        d.set_item("preemptions", s.preemptions)?;
        let by_group = PyDict::new(py);
        for (gid, pages) in self.gids().zip(&s.pages_in_use_by_group) {
            by_group.set_item(gid, pages)?;
        }
        d.set_item("pages_in_use_by_group", by_group)?;
        let h = s.host.unwrap_or_default();
        d.set_item("host_pages_total", h.pages_total)?;
        d.set_item("host_pages_used", h.pages_used)?;
        d.set_item("host_hits_tokens", h.hits_tokens)?;
        d.set_item("host_stores", h.stores)?;
        d.set_item("host_stores_skipped", h.stores_skipped)?;
        d.set_item("host_loads", h.loads)?;
        d.set_item("host_evictions", h.evictions)?;
        d.set_item("host_transfers_in_flight", h.transfers_in_flight)?;
        let c = s.checkpoints.unwrap_or_default();
        d.set_item("checkpoints_written", c.written)?;
        d.set_item("checkpoints_hit", c.hit)?;
        d.set_item("checkpoints_evicted", c.evicted)?;
        Ok(d)
    }

    /// The arena's occupancy, or None without arena storage: `unit_bytes units_total
    /// units_free units_idle stranded_bytes cached_bytes`, `units_bound`, `pages_free` and
    /// `pages_cached` (`{group_id: n}`; a group's free pages are those of its busy units,
    /// usable by it only: those without a key are `pages_free`, their bytes `stranded_bytes`;
    /// those with one `pages_cached`, their bytes `cached_bytes`).
    fn arena_stats<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(a) = lock(&self.inner)?.coordinator().pool().arena_stats() else {
            return Ok(None);
        };
        let d = PyDict::new(py);
        d.set_item("unit_bytes", a.unit_bytes)?;
        d.set_item("units_total", a.units_total)?;
        d.set_item("units_free", a.units_free)?;
        d.set_item("units_idle", a.units_idle)?;
        let bound = PyDict::new(py);
        let free = PyDict::new(py);
        let cached = PyDict::new(py);
        for (((gid, units), pages), keyed) in self.gids().zip(&a.units_bound).zip(&a.pages_free).zip(&a.pages_cached) {
            bound.set_item(gid, units)?;
            free.set_item(gid, pages)?;
            cached.set_item(gid, keyed)?;
        }
        d.set_item("units_bound", bound)?;
        d.set_item("pages_free", free)?;
        d.set_item("stranded_bytes", a.stranded_bytes)?;
        d.set_item("pages_cached", cached)?;
        d.set_item("cached_bytes", a.cached_bytes)?;
        Ok(Some(d))
    }

    /// The host-tier transfers emitted since the last call (see `flat_kvcache._native.pyi`).
    fn take_transfers<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let transfers = lock(&self.inner)?.take_transfers();
        transfers_to_py(py, &transfers, &self.specs)
    }

    /// Acknowledge finished transfers by id, in any order (checked first).
    fn ack_transfers(&self, ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let ids = transfer_ids(ids)?;
        core(lock(&self.inner)?.ack_transfers(&ids))
    }

    /// Transfers emitted and not acknowledged yet.
    fn transfers_in_flight(&self) -> PyResult<usize> {
        Ok(lock(&self.inner)?.transfers_in_flight())
    }

    /// The KV events recorded since the last call, oldest first, as `flat_kvcache.events`
    /// dataclasses (always `[]` when `enable_kv_events` is off).
    fn take_events<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let events = lock(&self.inner)?.take_events();
        events_to_py(py, events, &self.specs)
    }

    /// Drop the key of every cached page with count 0 (they stay free; pages held by requests
    /// keep theirs) and return how many keys were dropped. Events: `AllBlocksCleared` when no
    /// request held a cached page (no key is left), else one `BlockRemoved` per group of the
    /// dropped keys.
    fn reset_prefix_cache(&self) -> PyResult<usize> {
        Ok(lock(&self.inner)?.reset_prefix_cache())
    }

    /// Check every engine invariant; `InvariantError` (a `RuntimeError`) describing the first violation.
    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        core(self.detached(py, |c| c.check_invariants())?)
    }

    /// `FlatKVCache(group_ids=[…], num_pages=…, num_free_pages=…, num_requests=…)` (or
    /// `PageCache(...)`: the class's name).
    fn __repr__(slf: &Bound<'_, Self>) -> PyResult<String> {
        let name = slf.get_type().name()?;
        let this = slf.get();
        let (stats, reqs) = {
            let c = lock(&this.inner)?;
            (c.pool_stats(), c.num_requests())
        };
        let shown: Vec<String> = this
            .gids()
            .take(8)
            .map(|g| format!("'{}'", clip(g).escape_debug()))
            .collect();
        let more = if this.specs.len() > 8 { ", ..." } else { "" };
        Ok(format!(
            "{name}(group_ids=[{}{more}], num_pages={}, num_free_pages={}, num_requests={reqs})",
            shown.join(", "),
            stats.num_blocks,
            stats.num_free
        ))
    }
}

/// The token-level protocol (docs/requests-api.md): requests that own their tokens,
/// `FlatKVCache(specs, num_pages, *, enable_caching=True, eviction_order="hybrid",
/// enable_kv_events=False, reuse_uncached_first=True, host_pages=0, host_store="write_through")`.
///
/// `specs` is a non-empty sequence of `KVCacheSpec`; `num_pages` the pool size (page 0
/// included). A request enters with `add_request` / `admit` under an id (`str` or `int`;
/// `5` and `"5"` differ) and gets a slot, the small int every later call names it by (the
/// lowest slot no live request holds; its row in the bound tables). A slot that holds no
/// request is an `UnknownRequestError` (a `KeyError`). The page-level calls are `PageCache`'s;
/// the shared calls are `_PagedCacheBase`'s.
#[pyclass(extends = PyPagedCache, frozen, module = "flat_kvcache._native", name = "FlatKVCache")]
pub struct PyFlatKVCache {
    /// The last prompt hashed, so probing, sizing and adding one prompt hash it once.
    last_prompt: Mutex<Option<Prompt>>,
    /// The buffers bound by `bind_rows` (kept alive and re-borrowed by each update).
    rows: Mutex<Option<BoundBuffers>>,
}

/// A prompt's tokens as read, the first step of hashing it: a `uint32` array kept in place (it
/// holds u32 values, so its form is right; it is compared with the memo without a copy), or the
/// checked tokens.
enum PromptTokens<'py> {
    Array(Bound<'py, PyArray1<u32>>),
    Owned(Vec<u32>),
}

/// Read `prompt_token_ids` (a sequence or 1-D integer array of u32); a request's prompt
/// (`required`) must not be empty.
fn prompt_tokens<'py>(tokens: &Bound<'py, PyAny>, required: bool) -> PyResult<PromptTokens<'py>> {
    let read = match tokens.cast::<PyArray1<u32>>().ok().filter(|_| !is_masked(tokens)) {
        Some(arr) => PromptTokens::Array(arr.clone()),
        None => PromptTokens::Owned(self::tokens(tokens, "prompt_token_ids")?),
    };
    let empty = match &read {
        PromptTokens::Array(arr) => arr.len()? == 0,
        PromptTokens::Owned(toks) => toks.is_empty(),
    };
    if required && empty {
        return Err(PyValueError::new_err("prompt_token_ids must not be empty"));
    }
    Ok(read)
}

impl PyFlatKVCache {
    /// Hash a prompt read by [`prompt_tokens`] into base pages with the GIL released and no
    /// lock held.
    ///
    /// A contiguous `uint32` array (what a scheduler keeps prompts in) is first compared with
    /// the memo in place, so probing, sizing and adding one prompt copy its tokens at most once.
    fn prompt(
        &self,
        cache: &PyPagedCache,
        py: Python<'_>,
        tokens: PromptTokens<'_>,
        extra_keys: Vec<String>,
    ) -> PyResult<Prompt> {
        let toks = match tokens {
            PromptTokens::Array(arr) => {
                if let Ok(view) = arr.try_readonly() {
                    if let Ok(slice) = view.as_slice() {
                        let memo = lock(&self.last_prompt)?;
                        if let Some(known) = Prompt::recall(memo.as_ref(), slice, &extra_keys, cache.base) {
                            return Ok(known);
                        }
                    }
                }
                self::tokens(arr.as_any(), "prompt_token_ids")?
            }
            PromptTokens::Owned(toks) => toks,
        };
        let base = cache.base;
        py.detach(|| {
            let mut memo = lock(&self.last_prompt)?;
            core(Prompt::new_memoized(toks, extra_keys, base, &mut memo))
        })
    }
}

/// The `num_pages` argument: a pool size in `[1, MAX_BLOCKS]` (page 0 included; a negative size
/// says ">= 1" too, as in the reference, rather than count's ">= 0"; past `MAX_BLOCKS` the pool
/// would refuse it but name its own argument).
fn pool_size(num_pages: &Bound<'_, PyAny>) -> PyResult<u64> {
    let too_small =
        |shown: &dyn std::fmt::Display| PyValueError::new_err(format!("num_pages must be >= 1, got {shown}"));
    let size = match signed(num_pages, "num_pages")? {
        IntArg::Small(v) if v < 1 => return Err(too_small(&v)),
        IntArg::HugeNegative => return Err(too_small(num_pages)),
        IntArg::Small(_) | IntArg::HugePositive => count(num_pages, "num_pages")?,
    };
    if size > MAX_BLOCKS {
        return Err(PyValueError::new_err(format!(
            "num_pages must be <= {MAX_BLOCKS} (page ids are int32), got {size}"
        )));
    }
    Ok(size)
}

/// The optional `slot` argument of `pages_needed` and `budget`.
fn optional_slot(slot: Option<&Bound<'_, PyAny>>) -> PyResult<Option<u64>> {
    match slot.filter(|s| !s.is_none()) {
        Some(s) => count(s, "slot").map(Some),
        None => Ok(None),
    }
}

#[pymethods]
#[allow(clippy::needless_pass_by_value, reason = "PyO3 extracts arguments by value")]
impl PyFlatKVCache {
    /// Create the token-level engine over `specs` with a pool of `num_pages >= 1` pages.
    ///
    /// `eviction_order` is `"hybrid"` (free a request's pages by slot end token, descending,
    /// across all groups; SPEC 12.3) or `"group"` (group 0's table tail first, then group
    /// 1's, ...). `enable_kv_events` records KV events for `take_events`.
    /// `reuse_uncached_first`: a released page that holds no key joins the front of the free
    /// list (handed out before any cached page) instead of the back.
    ///
    /// `arena` (an `ArenaPlan` from `plan_arena`, instead of `num_pages`): the pages live in
    /// the plan's arena of units (SPEC 13.2), each group's page ids index its own view; the
    /// free counts (`budget`, `pages_needed`, `stats()["num_free"]`) are then arena credits.
    /// Not combinable with `reuse_uncached_first=False` (`ValueError`).
    ///
    /// `host_pages` adds a host-memory tier (`take_transfers`). Without an arena it is an int:
    /// that many host pages of the pool's page geometry, shared by every group. Over an arena
    /// the tier is per group, each group's host pages of its own page geometry with ids of
    /// their own: an int gives every group that many, a mapping `{group_id: pages}` the groups
    /// it names (the others none: they are not tiered).
    ///
    /// `eviction_policy` is the state checkpoint policy (SPEC 13.8): both keep every checkpoint
    /// SPEC 13.5 writes until the pool evicts it; `"reuse"` adds the body's end on the sharing
    /// grain learned from the prompts seen and whole hybrid prefixes (`"lru"` is the default).
    ///
    /// `register_on_schedule` (same-step sharing, docs/requests-api.md): `schedule` registers
    /// the full pages of the chunk it takes at once, so a request admitted later in the same
    /// step hits them (the forward writes every layer's K/V before attention reads it); the
    /// caller must then run every chunk it scheduled. Ignored with state groups.
    #[new]
    #[pyo3(
        signature = (specs, num_pages = None, *, arena = None, enable_caching = FlagParam::OMITTED, eviction_order = Passed::OMITTED, enable_kv_events = FlagParam::OMITTED, reuse_uncached_first = FlagParam::OMITTED, host_pages = None, host_store = Passed::OMITTED, eviction_policy = Passed::OMITTED, register_on_schedule = FlagParam::OMITTED),
        text_signature = "(specs, num_pages=None, *, arena=None, enable_caching=True, eviction_order='hybrid', enable_kv_events=False, reuse_uncached_first=True, host_pages=0, host_store='write_through', eviction_policy='lru', register_on_schedule=False)"
    )]
    #[allow(clippy::too_many_arguments, reason = "the Python constructor's keyword arguments")]
    fn new(
        specs: GroupSpecs,
        num_pages: Option<&Bound<'_, PyAny>>,
        arena: Option<&Bound<'_, PyAny>>,
        enable_caching: FlagParam<'_>,
        eviction_order: Passed<'_>,
        enable_kv_events: FlagParam<'_>,
        reuse_uncached_first: FlagParam<'_>,
        host_pages: Option<&Bound<'_, PyAny>>,
        host_store: Passed<'_>,
        eviction_policy: Passed<'_>,
        register_on_schedule: FlagParam<'_>,
    ) -> PyResult<PyClassInitializer<Self>> {
        let cache = PyPagedCache::build(
            specs,
            num_pages,
            enable_caching,
            eviction_order,
            enable_kv_events,
            reuse_uncached_first,
            host_pages,
            host_store,
            Some(&eviction_policy),
            &FlagParam::OMITTED,
            &register_on_schedule,
            arena,
        )?;
        let own = Self {
            last_prompt: Mutex::new(None),
            rows: Mutex::new(None),
        };
        Ok(PyClassInitializer::from(cache).add_subclass(own))
    }

    /// Add a token-level request for `prompt_token_ids` (a non-empty list or 1-D integer
    /// array of u32) under a new id, in the lowest free slot. Every full base page is hashed
    /// (chained, `extra_keys` on every page) with the GIL released; with caching on and
    /// `use_prefix_cache`, the prefix match over all but the last prompt token is claimed.
    /// Returns `(slot, hit)`: the request's slot and its hit in tokens (its computed tokens);
    /// allocates nothing else. With rows bound and every row held, a `ValueError`.
    #[pyo3(
        signature = (req, prompt_token_ids, *, extra_keys = ExtraKeys::default(), use_prefix_cache = FlagParam::OMITTED),
        text_signature = "(self, req, prompt_token_ids, *, extra_keys=(), use_prefix_cache=True)"
    )]
    fn add_request(
        slf: &Bound<'_, Self>,
        py: Python<'_>,
        req: RequestId<'_>,
        prompt_token_ids: &Bound<'_, PyAny>,
        extra_keys: ExtraKeys<'_>,
        use_prefix_cache: FlagParam<'_>,
    ) -> PyResult<(usize, u64)> {
        let (this, cache) = (slf.get(), slf.as_super().get());
        let id = req.id()?;
        let toks = prompt_tokens(prompt_token_ids, true)?;
        let keys = extra_keys.keys()?;
        let use_prefix_cache = use_prefix_cache.or(true, "use_prefix_cache")?;
        let prompt = this.prompt(cache, py, toks, keys)?;
        core(cache.detached(py, |c| c.add_request(id, prompt, use_prefix_cache))?)
    }

    /// SPEC 9 admission in one call (one hash, one prefix match): the first chunk is the
    /// `next_chunk` cut of the prompt after the capped hit, at most `max_new_tokens`
    /// (`min(len(prompt) - hit, max_new_tokens)` without state groups), with one token of
    /// reserve when it completes the prompt. With rows bound and every row held, or if
    /// `pages_needed_to_admit(prompt, chunk, reserve)` exceeds `budget()`, nothing changes and
    /// the answer is None; otherwise the request is added exactly as `add_request(req,
    /// prompt, ...)` would and the answer is `(slot, hit, chunk)`. The caller schedules the
    /// chunk (after acknowledging any host-tier loads).
    #[pyo3(
        signature = (req, prompt_token_ids, max_new_tokens, *, extra_keys = ExtraKeys::default(), use_prefix_cache = FlagParam::OMITTED),
        text_signature = "(self, req, prompt_token_ids, max_new_tokens, *, extra_keys=(), use_prefix_cache=True)"
    )]
    fn admit(
        slf: &Bound<'_, Self>,
        py: Python<'_>,
        req: RequestId<'_>,
        prompt_token_ids: &Bound<'_, PyAny>,
        max_new_tokens: &Bound<'_, PyAny>,
        extra_keys: ExtraKeys<'_>,
        use_prefix_cache: FlagParam<'_>,
    ) -> PyResult<Option<(usize, u64, u64)>> {
        let (this, cache) = (slf.get(), slf.as_super().get());
        let id = req.id()?;
        let toks = prompt_tokens(prompt_token_ids, true)?;
        let max_new_tokens = count(max_new_tokens, "max_new_tokens")?;
        let keys = extra_keys.keys()?;
        let use_prefix_cache = use_prefix_cache.or(true, "use_prefix_cache")?;
        let prompt = this.prompt(cache, py, toks, keys)?;
        core(cache.detached(py, |c| c.admit(id, prompt, max_new_tokens, use_prefix_cache))?)
    }

    /// The slot of live request `req`, or None.
    fn slot_of(slf: &Bound<'_, Self>, req: RequestId<'_>) -> PyResult<Option<usize>> {
        let cache = slf.as_super().get();
        let id = req.id()?;
        Ok(lock(&cache.inner)?.slot_of(id))
    }

    /// The id the request in `slot` was added with.
    fn id_of<'py>(slf: &Bound<'py, Self>, slot: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        let cache = slf.as_super().get();
        let slot = count(slot, "slot")?;
        let id = {
            let c = lock(&cache.inner)?;
            core(c.id_of(slot).map(RequestIdRef::to_id))?
        };
        id_to_py(slf.py(), &id)
    }

    /// Bind persistent block-table rows (docs/requests-api.md "Persistent rows"): `tables`
    /// maps every group id to a writable C-contiguous int32 numpy array or CPU torch tensor
    /// `[max_rows, cols]` (the same `max_rows` for all groups); row `s` shows the request in
    /// slot `s`. `offsets` optionally maps sliding-window group ids to int32 `[max_rows]`
    /// buffers, which makes those groups' rows windowed (a row holds `cols` slots of the
    /// table from `offsets[g][row]`, the slot of column 0, which moves only when the table
    /// no longer fits after it). The buffers are filled with -1 (tables) and 0 (offsets) and
    /// kept; while bound, a new request must get a slot below `max_rows`. Binding again
    /// replaces the buffers (every live slot must be below the new row count); live rows are
    /// rewritten whole on the next update.
    #[pyo3(signature = (tables, *, offsets = None), text_signature = "(self, tables, *, offsets=None)")]
    fn bind_rows(
        slf: &Bound<'_, Self>,
        py: Python<'_>,
        tables: &Bound<'_, PyAny>,
        offsets: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let (this, cache) = (slf.get(), slf.as_super().get());
        if !flat_kvcache_core::FLAT_KVCACHE {
            return core(Err(CoreError::FlatUnavailable));
        }
        let (max_rows, layouts, buffers) = check_bind(tables, offsets, &cache.specs)?;
        let mut bound = lock(&this.rows)?;
        core(lock(&cache.inner)?.bind_rows(max_rows, layouts))?;
        buffers.reset(py)?;
        let previous = bound.replace(buffers);
        // Released only once no lock is held: dropping the last reference to a buffer can
        // run Python code (a finalizer, `__del__`) that calls back into this cache.
        drop(bound);
        drop(previous);
        Ok(())
    }

    /// Forget the bound rows and release the buffers; requests keep their slots.
    fn unbind_rows(slf: &Bound<'_, Self>) -> PyResult<()> {
        let (this, cache) = (slf.get(), slf.as_super().get());
        let mut bound = lock(&this.rows)?;
        lock(&cache.inner)?.unbind_rows();
        let previous = bound.take();
        // As in `bind_rows`: the buffers are released after the locks.
        drop(bound);
        drop(previous);
        Ok(())
    }

    /// Bring the bound tables up to date and return what changed, as
    /// `(cells, offsets)`: `cells[g]` is an int32 `[3, n]` array of (row, col, value) for
    /// every cell written in group `g` since the last update (sorted by row, then column),
    /// so `device_table[g].index_put_((rows, cols), values)` with `rows, cols, values =
    /// torch.from_numpy(cells[g])` (moved to the device) makes a device copy equal;
    /// `offsets[g]` (windowed groups only) is an int32 `[2, m]` array of (row, offset) for
    /// every row whose page offset changed. Only rows whose tables changed are visited.
    /// `full=True` compares every cell of every row with the buffers (a repair after
    /// someone else wrote them). A table wider than its row, a windowed row with a real
    /// page before its first slot, or a bound buffer changed in place since `bind_rows`
    /// (dtype, shape, strides, read-only) is a `ValueError` naming it; a refused update
    /// writes nothing and loses nothing: the next update that succeeds returns every cell
    /// changed since the last one that succeeded.
    #[pyo3(signature = (*, full = FlagParam::OMITTED), text_signature = "(self, *, full=False)")]
    fn update_rows<'py>(
        slf: &Bound<'_, Self>,
        py: Python<'py>,
        full: FlagParam<'_>,
    ) -> PyResult<(Bound<'py, PyDict>, Bound<'py, PyDict>)> {
        let (this, cache) = (slf.get(), slf.as_super().get());
        let full = full.or(false, "full")?;
        if !flat_kvcache_core::FLAT_KVCACHE {
            return core(Err(CoreError::FlatUnavailable));
        }
        let bound = lock(&this.rows)?;
        let Some(buffers) = bound.as_ref() else {
            return core(Err(CoreError::invalid(
                "update_rows: no rows are bound (call bind_rows first)",
            )));
        };
        let windowed = buffers.windowed();
        // Checked (and borrowed) even when nothing changed, so a buffer changed in place is
        // refused at the first update after the change, whatever the engine did meanwhile.
        let (mut tables, mut offsets) = buffers.borrow(py)?;
        if !full && !lock(&cache.inner)?.rows_pending() {
            drop((tables, offsets));
            drop(bound);
            return deltas_to_py(py, cache.gids(), no_deltas(&windowed));
        }
        let (mut outs, mut offs) = as_outs(&mut tables, &mut offsets)?;
        let copies = {
            let mut c = lock(&cache.inner)?;
            core(c.update_rows(&mut outs, &mut offs, full))?;
            copy_deltas(c.row_deltas(), windowed.into_iter())
        };
        drop(bound);
        deltas_to_py(py, cache.gids(), copies)
    }

    /// Schedule a step in one call: the request in `slots[i]` (a sequence or 1-D integer
    /// array) schedules its next `num_new_tokens[i]` known tokens: its completed full pages
    /// are registered, slid-out pages reclaimed, then room acquired for them plus
    /// `lookahead` slots, all or nothing. Returns a numpy bool array: True, the position moved
    /// and the reserve was released; False, nothing was allocated and the position stays.
    /// Everything is validated first (a slot that holds no request: `UnknownRequestError`;
    /// more tokens than are known, counting repeats, or host-tier loads in flight:
    /// `ValueError`; nothing changes then).
    #[pyo3(
        signature = (slots, num_new_tokens, *, lookahead = CountParam::OMITTED),
        text_signature = "(self, slots, num_new_tokens, *, lookahead=0)"
    )]
    fn schedule<'py>(
        slf: &Bound<'py, Self>,
        py: Python<'py>,
        slots: &Bound<'py, PyAny>,
        num_new_tokens: &Bound<'py, PyAny>,
        lookahead: CountParam<'_>,
    ) -> PyResult<Bound<'py, PyArray1<bool>>> {
        let cache = slf.as_super().get();
        let slots = counts(slots, "slots")?;
        let ns = counts(num_new_tokens, "num_new_tokens")?;
        let ahead = lookahead.or(0, "lookahead")?;
        let scheduled = core(cache.detached(py, |c| c.schedule(&slots, &ns, ahead))?)?;
        Ok(PyArray1::from_slice(py, &scheduled))
    }

    /// The state slots of a step (SPEC 13.4), after `schedule(slots, num_new_tokens)`:
    /// `(read, write)`, two int32 arrays of the state group's slot ids, one entry per slot.
    /// The step reads the state after the request's last token before the step from
    /// `read[i]` (0, the all-zero null slot, for a fresh request) and writes the state after
    /// its new tokens to `write[i]`: where they differ, copy `read[i]` into `write[i]` first
    /// and run the step in place on `write[i]`; `read[i]` is then a checkpoint and must stay
    /// as it is. They are equal while a request keeps its working slot (steps after one that
    /// wrote no checkpoint). The model must have exactly one state group
    /// (`ValueError` otherwise); a slot that holds no request is `UnknownRequestError`;
    /// `num_new_tokens[i]` above the request's computed tokens, or other than what its last
    /// `schedule` gave it, is `ValueError`.
    #[pyo3(signature = (slots, num_new_tokens), text_signature = "(self, slots, num_new_tokens)")]
    fn state_slots<'py>(
        slf: &Bound<'py, Self>,
        py: Python<'py>,
        slots: &Bound<'py, PyAny>,
        num_new_tokens: &Bound<'py, PyAny>,
    ) -> PyResult<SlotArrays<'py>> {
        let cache = slf.as_super().get();
        let slots = counts(slots, "slots")?;
        let ns = counts(num_new_tokens, "num_new_tokens")?;
        let (read, write) = core(cache.detached(py, |c| c.state_slots(&slots, &ns))?)?;
        Ok((PyArray1::from_vec(py, read), PyArray1::from_vec(py, write)))
    }

    /// Append newly known tokens (a step's sampled tokens, or any): the request in
    /// `slots[i]` gets the next `num_tokens[i]` entries of the flat `token_ids` (u32), or
    /// exactly one each when `num_tokens` is None, in order; each base page that fills is
    /// hashed once, chained to the previous one. Everything is validated first (lengths that
    /// do not add up: `ValueError`; a slot that holds no request: `UnknownRequestError`;
    /// nothing changes then).
    #[pyo3(
        signature = (slots, token_ids, num_tokens = None),
        text_signature = "(self, slots, token_ids, num_tokens=None)"
    )]
    fn append_tokens(
        slf: &Bound<'_, Self>,
        py: Python<'_>,
        slots: &Bound<'_, PyAny>,
        token_ids: &Bound<'_, PyAny>,
        num_tokens: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let cache = slf.as_super().get();
        let slots = counts(slots, "slots")?;
        let toks = tokens(token_ids, "token_ids")?;
        let ns = match num_tokens {
            Some(obj) if !obj.is_none() => Some(counts(obj, "num_tokens")?),
            _ => None,
        };
        core(cache.detached(py, |c| c.append_tokens(&slots, &toks, ns.as_deref()))?)
    }

    /// Promise `pages_needed(tokens[i], slots[i])` pages to the next decode of the request in
    /// `slots[i]` (replacing its previous reserve; 0 clears it; a repeated slot: the last
    /// one counts). Released by a successful `schedule`, `finish` and `preempt`.
    fn reserve(slf: &Bound<'_, Self>, slots: &Bound<'_, PyAny>, tokens: &Bound<'_, PyAny>) -> PyResult<()> {
        let cache = slf.as_super().get();
        let slots = counts(slots, "slots")?;
        let ns = counts(tokens, "tokens")?;
        let result = lock(&cache.inner)?.reserve(&slots, &ns);
        core(result)
    }

    /// For each request in `slots`: register its completed full pages, free all its pages
    /// (in the eviction order), release its reserve and free its slot and id (both may be
    /// used again). A slot that holds no request or is listed twice is an error and nothing
    /// changes.
    fn finish(slf: &Bound<'_, Self>, py: Python<'_>, slots: &Bound<'_, PyAny>) -> PyResult<()> {
        let cache = slf.as_super().get();
        let slots = counts(slots, "slots")?;
        core(cache.detached(py, |c| c.finish(&slots))?)
    }

    /// `finish`, counted as one preemption per request; returns each request's whole token
    /// list (prompt plus generated), in order: the folded prompts to re-add with
    /// `add_request` for recompute.
    fn preempt(slf: &Bound<'_, Self>, py: Python<'_>, slots: &Bound<'_, PyAny>) -> PyResult<Vec<Vec<u32>>> {
        let cache = slf.as_super().get();
        let slots = counts(slots, "slots")?;
        core(cache.detached(py, |c| c.preempt(&slots))?)
    }

    /// How many of its next known tokens the request in `slot` should schedule, at most
    /// `max_tokens`: all that are left without state groups; with state groups, a cut on their
    /// snapshot grain (the lcm of their page sizes), so the chunk ends where a snapshot is
    /// kept: the rest up to the last boundary before its last token when it fits (then the
    /// tail), else up to the last boundary within `max_tokens`; no cut when no boundary lies
    /// ahead. 0 once every known token is computed. `admit` cuts the first chunk the same way.
    fn next_chunk(slf: &Bound<'_, Self>, slot: &Bound<'_, PyAny>, max_tokens: &Bound<'_, PyAny>) -> PyResult<u64> {
        let cache = slf.as_super().get();
        let slot = count(slot, "slot")?;
        let max_tokens = count(max_tokens, "max_tokens")?;
        core(lock(&cache.inner)?.next_chunk(slot, max_tokens))
    }

    /// Tokens the request in `slot` has computed (its position).
    fn num_computed_tokens(slf: &Bound<'_, Self>, slot: &Bound<'_, PyAny>) -> PyResult<u64> {
        slf.as_super().get().on_slot(slot, FlatCache::num_computed_tokens)
    }

    /// Tokens the request in `slot` knows (prompt plus appended).
    fn num_tokens(slf: &Bound<'_, Self>, slot: &Bound<'_, PyAny>) -> PyResult<u64> {
        slf.as_super().get().on_slot(slot, FlatCache::num_tokens)
    }

    /// The page ids per group (holes 0) of the request in `slot`.
    fn page_ids(slf: &Bound<'_, Self>, slot: &Bound<'_, PyAny>) -> PyResult<Vec<Vec<u32>>> {
        slf.as_super().get().on_slot(slot, FlatCache::page_ids_in)
    }

    /// The free token slots in the last page, per group, of the request in `slot`.
    fn tail_available(slf: &Bound<'_, Self>, slot: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
        slf.as_super().get().on_slot(slot, FlatCache::tail_available_in)
    }

    /// Host-tier loads of the request in `slot` not acknowledged yet (0: it can be scheduled).
    fn loads_in_flight(slf: &Bound<'_, Self>, slot: &Bound<'_, PyAny>) -> PyResult<u64> {
        slf.as_super().get().on_slot(slot, FlatCache::loads_in_flight_in)
    }

    /// Pages an acquire of `num_tokens` would allocate for the request in `slot` (a fresh
    /// request if None).
    #[pyo3(signature = (num_tokens, slot = None))]
    fn pages_needed(
        slf: &Bound<'_, Self>,
        num_tokens: &Bound<'_, PyAny>,
        slot: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<u64> {
        let cache = slf.as_super().get();
        let n = count(num_tokens, "num_tokens")?;
        let slot = optional_slot(slot)?;
        core(lock(&cache.inner)?.pages_needed_in(n, slot))
    }

    /// Flat per-group block tables of the requests in `slots`, rows in the order given
    /// (repeats allowed).
    ///
    /// Without `out`: `{group_id: int32 array [len(slots), max_cols]}` in group order, holes
    /// 0, padding -1. With `out` (a mapping `group_id` -> writable C-contiguous int32 numpy
    /// array or CPU torch tensor of shape `[>= len(slots), cols]` for every group): row r of
    /// each buffer gets the request's page ids then -1 up to `cols`, written in place with
    /// the GIL released; rows past `len(slots)` are untouched; a table wider than `cols` is a
    /// `ValueError` naming the group and nothing is written. Returns `out`.
    /// `FlatUnavailableError` (a `RuntimeError`) naming the build when compiled without the
    /// `flat` feature.
    #[pyo3(signature = (slots, out = None))]
    fn block_tables<'py>(
        slf: &Bound<'py, Self>,
        py: Python<'py>,
        slots: &Bound<'py, PyAny>,
        out: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let cache = slf.as_super().get();
        if !flat_kvcache_core::FLAT_KVCACHE {
            return core(Err(CoreError::FlatUnavailable));
        }
        let slots = counts(slots, "slots")?;
        if let Some(out) = out.filter(|o| !o.is_none()) {
            let mut arrays = borrow_out(out, &cache.specs)?;
            let mut outs = table_outs(&mut arrays)?;
            core(cache.detached(py, |c| c.write_block_tables_in(&slots, &mut outs))?)?;
            return Ok(out.clone());
        }
        let tables = core(cache.detached(py, |c| c.block_tables_in(&slots))?)?;
        tables_to_py(py, cache.gids(), tables)
    }

    /// The prefix hit `add_request` would get for this prompt (capped so the last token is
    /// recomputed), read-only.
    #[pyo3(
        signature = (prompt_token_ids, *, extra_keys = ExtraKeys::default()),
        text_signature = "(self, prompt_token_ids, *, extra_keys=())"
    )]
    fn prefix_hit_tokens(
        slf: &Bound<'_, Self>,
        py: Python<'_>,
        prompt_token_ids: &Bound<'_, PyAny>,
        extra_keys: ExtraKeys<'_>,
    ) -> PyResult<u64> {
        let (this, cache) = (slf.get(), slf.as_super().get());
        let toks = prompt_tokens(prompt_token_ids, false)?;
        let prompt = this.prompt(cache, py, toks, extra_keys.keys()?)?;
        core(cache.detached(py, |c| c.prefix_hit_tokens(&prompt))?)
    }

    /// Pages admitting this prompt would take: the capped match's claim (its free cached
    /// pages) plus `pages_needed(num_new_tokens + reserve_tokens)` on fresh tables.
    #[pyo3(
        signature = (prompt_token_ids, num_new_tokens, reserve_tokens = CountParam::OMITTED, *, extra_keys = ExtraKeys::default()),
        text_signature = "(self, prompt_token_ids, num_new_tokens, reserve_tokens=0, *, extra_keys=())"
    )]
    fn pages_needed_to_admit(
        slf: &Bound<'_, Self>,
        py: Python<'_>,
        prompt_token_ids: &Bound<'_, PyAny>,
        num_new_tokens: &Bound<'_, PyAny>,
        reserve_tokens: CountParam<'_>,
        extra_keys: ExtraKeys<'_>,
    ) -> PyResult<u64> {
        let (this, cache) = (slf.get(), slf.as_super().get());
        let toks = prompt_tokens(prompt_token_ids, false)?;
        let n = count(num_new_tokens, "num_new_tokens")?;
        let reserve = reserve_tokens.or(0, "reserve_tokens")?;
        let prompt = this.prompt(cache, py, toks, extra_keys.keys()?)?;
        core(cache.detached(py, |c| c.pages_needed_to_admit(&prompt, n, reserve))?)
    }

    /// Free pages minus the reserves of every request other than the one in `slot` (may be
    /// negative).
    #[pyo3(signature = (slot = None))]
    fn budget(slf: &Bound<'_, Self>, slot: Option<&Bound<'_, PyAny>>) -> PyResult<i128> {
        let cache = slf.as_super().get();
        let slot = optional_slot(slot)?;
        let result = lock(&cache.inner)?.budget(slot);
        core(result)
    }
}

/// Flat tables as `{group_id: int32 [rows, cols]}`, in group order.
pub(crate) fn tables_to_py<'py, 'a>(
    py: Python<'py>,
    gids: impl Iterator<Item = &'a str>,
    tables: Vec<FlatTable>,
) -> PyResult<Bound<'py, PyAny>> {
    let dict = PyDict::new(py);
    for (gid, FlatTable { rows, cols, data }) in gids.zip(tables) {
        let arr = Array2::from_shape_vec((rows, cols), data)
            .map_err(|e| PyRuntimeError::new_err(format!("block_tables: {e}")))?;
        dict.set_item(gid, arr.into_pyarray(py))?;
    }
    Ok(dict.into_any())
}
