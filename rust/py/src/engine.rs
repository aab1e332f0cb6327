//! Python classes of the page engine (SPEC 5 to 8): `BlockPool`, `FlatKVCache`, `PrefixMatch`.
//!
//! Each class is frozen and keeps its mutable state behind a `Mutex`, so Python threads can
//! share one object. Locking discipline: a lock is never held while Python code can run
//! (arguments are extracted before locking, results converted after unlocking), so neither a
//! re-entrant call nor a GIL hand-off can deadlock. Long calls (hashing, matching, a batch
//! step, writing block tables) take the lock with the GIL released (`py.detach`); the
//! per-request calls stay attached because their work is shorter than a detach/attach round
//! trip.

use std::sync::{Mutex, MutexGuard};

use flat_kvcache_core::cache::{CacheOptions, FlatCache, FlatTable, FLAT_UNAVAILABLE};
use flat_kvcache_core::coordinator::{EvictionOrder, GroupSpec, PrefixMatch};
use flat_kvcache_core::pool::BlockPool;
use flat_kvcache_core::request::RequestIdRef;
use flat_kvcache_core::requests::Prompt;
use flat_kvcache_core::table::GroupKind;
use numpy::ndarray::Array2;
use numpy::{IntoPyArray, PyArray1, PyArrayMethods};
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString};

use crate::convert::{
    clip, content_hashes, count, counts, opt_count, page, page_ids, positive, tokens, type_name, ExtraKeys, ReqArg,
};
use crate::errors::{core, overflow};
use crate::events::{events_to_py, GroupMeta};
use crate::tables::{borrow_out, table_outs};

/// Lock `m`, or a `RuntimeError` if an earlier panic poisoned it.
fn lock<T>(m: &Mutex<T>) -> PyResult<MutexGuard<'_, T>> {
    m.lock()
        .map_err(|_| PyRuntimeError::new_err("flat_kvcache: internal state poisoned by an earlier panic"))
}

// ===== BlockPool ============================================================================

/// The page pool of SPEC 5 with string keys: `BlockPool(num_blocks, *, enable_caching=True)`.
///
/// Page 0 is the null page (never free, cached or counted); the free list starts as
/// `1..num_blocks-1` and is the eviction order. Misuse raises `ValueError` and changes nothing.
#[pyclass(frozen, module = "flat_kvcache._native", name = "BlockPool")]
pub struct PyBlockPool {
    num_blocks: usize,
    inner: Mutex<BlockPool<Box<str>>>,
}

#[pymethods]
impl PyBlockPool {
    /// Create a pool of `num_blocks >= 1` pages (page 0 included).
    #[new]
    #[pyo3(signature = (num_blocks, *, enable_caching = true))]
    fn new(num_blocks: &Bound<'_, PyAny>, enable_caching: bool) -> PyResult<Self> {
        let pool = core(BlockPool::new(count(num_blocks, "num_blocks")?, enable_caching))?;
        Ok(Self {
            num_blocks: pool.num_blocks(),
            inner: Mutex::new(pool),
        })
    }

    /// Total pages, the null page included.
    #[getter]
    fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Pages on the free list.
    #[getter]
    fn num_free(&self) -> PyResult<usize> {
        Ok(lock(&self.inner)?.num_free())
    }

    /// Pages holding a key.
    #[getter]
    fn num_cached(&self) -> PyResult<usize> {
        Ok(lock(&self.inner)?.num_cached())
    }

    /// Pages holding a key with reference count 0.
    #[getter]
    fn num_cached_free(&self) -> PyResult<usize> {
        Ok(lock(&self.inner)?.num_cached_free())
    }

    /// Pages holding a key with reference count > 0.
    #[getter]
    fn num_cached_pinned(&self) -> PyResult<usize> {
        Ok(lock(&self.inner)?.num_cached_pinned())
    }

    /// Take `n >= 0` pages from the front of the free list, all or nothing: `[]` (and no
    /// change) when fewer than `n` are free. Taking a cached page evicts its key.
    fn allocate(&self, n: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
        let n = usize::try_from(count(n, "n")?).unwrap_or(usize::MAX);
        Ok(lock(&self.inner)?.allocate(n))
    }

    /// Claim one more reference on `page` (removing it from the free list at count 0);
    /// page 0 is a no-op.
    fn touch(&self, page: &Bound<'_, PyAny>) -> PyResult<()> {
        let p = self::page(page, self.num_blocks)?;
        let result = lock(&self.inner)?.touch(p);
        core(result)
    }

    /// Release `pages` in reverse order (0 entries skipped); at count 0 a page goes to the
    /// back of the free list with its key intact. Validated first: nothing changes on error.
    fn free(&self, pages: &Bound<'_, PyAny>) -> PyResult<()> {
        let mut ids = Vec::new();
        for item in pages.try_iter()? {
            ids.push(page(&item?, self.num_blocks)?);
        }
        let result = lock(&self.inner)?.free(&ids);
        core(result)
    }

    /// Register `key` for `page` (no-op with caching off or for page 0); a page that
    /// already holds a key is a `ValueError`.
    fn cache(&self, page: &Bound<'_, PyAny>, key: &str) -> PyResult<()> {
        let p = self::page(page, self.num_blocks)?;
        let result = lock(&self.inner)?.cache(p, key.into());
        core(result)
    }

    /// The earliest-registered page still holding `key`, or None.
    fn lookup(&self, key: &str) -> PyResult<Option<u32>> {
        Ok(lock(&self.inner)?.lookup(key))
    }

    /// Reference count of `page`.
    fn ref_count(&self, page: &Bound<'_, PyAny>) -> PyResult<u32> {
        let p = self::page(page, self.num_blocks)?;
        let result = lock(&self.inner)?.ref_count(p);
        core(result)
    }

    /// Whether `page` holds a key.
    fn is_cached(&self, page: &Bound<'_, PyAny>) -> PyResult<bool> {
        let p = self::page(page, self.num_blocks)?;
        let result = lock(&self.inner)?.is_cached(p);
        core(result)
    }

    /// `BlockPool(num_blocks=…, num_free=…, num_cached=…)`.
    fn __repr__(&self) -> PyResult<String> {
        let pool = lock(&self.inner)?;
        Ok(format!(
            "BlockPool(num_blocks={}, num_free={}, num_cached={})",
            pool.num_blocks(),
            pool.num_free(),
            pool.num_cached()
        ))
    }
}

// ===== PrefixMatch ==========================================================================

/// The result of `FlatKVCache.match_prefix`: per-group matched pages (0 = hole), the number
/// of real pages per group, and the token count every group can resume from.
///
/// A match also remembers the key each real page was matched under, so `claim` refuses it
/// once a page holds another key (or none). Equality compares the three public fields only.
#[pyclass(frozen, eq, module = "flat_kvcache._native", name = "PrefixMatch")]
pub struct PyPrefixMatch {
    inner: PrefixMatch,
}

impl PartialEq for PyPrefixMatch {
    fn eq(&self, other: &Self) -> bool {
        let (a, b) = (&self.inner, &other.inner);
        a.num_common_tokens == b.num_common_tokens && a.pages == b.pages && a.num_hit_pages == b.num_hit_pages
    }
}

#[pymethods]
impl PyPrefixMatch {
    /// Build a match by hand (normally it comes from `FlatKVCache.match_prefix`). It
    /// remembers no keys: `claim` then only requires each real page to hold a key of the
    /// group it is claimed for.
    ///
    /// `pages` is one sequence of page ids per group (each an int in `[0, 2**31 - 1)`, else
    /// `ValueError` naming `pages[g][i]`); `num_hit_pages` one count per group.
    #[new]
    #[pyo3(signature = (num_common_tokens, pages, num_hit_pages))]
    fn new(
        num_common_tokens: &Bound<'_, PyAny>,
        pages: &Bound<'_, PyAny>,
        num_hit_pages: &Bound<'_, PyAny>,
    ) -> PyResult<Self> {
        let common = count(num_common_tokens, "num_common_tokens")?;
        if pages.is_instance_of::<PyString>() {
            return Err(PyTypeError::new_err(
                "pages must be a sequence of page-id sequences, not a str",
            ));
        }
        let Ok(groups) = pages.try_iter() else {
            return Err(PyTypeError::new_err(format!(
                "pages must be a sequence of page-id sequences, got {}",
                type_name(pages)
            )));
        };
        let mut table = Vec::new();
        for (g, group) in groups.enumerate() {
            table.push(page_ids(&group?, &format!("pages[{g}]"))?);
        }
        let hits = counts(num_hit_pages, "num_hit_pages")?
            .into_iter()
            .map(|n| usize::try_from(n).map_err(|_| overflow("num_hit_pages")))
            .collect::<PyResult<_>>()?;
        Ok(Self {
            inner: PrefixMatch::by_hand(common, table, hits),
        })
    }

    /// Tokens every group can resume from (a multiple of the lcm page size).
    #[getter]
    fn num_common_tokens(&self) -> u64 {
        self.inner.num_common_tokens
    }

    /// Per group, the matched page of each slot (0 = hole).
    #[getter]
    fn pages(&self) -> Vec<Vec<u32>> {
        self.inner.pages.clone()
    }

    /// Per group, the number of real (non-hole) matched pages.
    #[getter]
    fn num_hit_pages(&self) -> Vec<usize> {
        self.inner.num_hit_pages.clone()
    }

    /// `PrefixMatch(num_common_tokens=…, num_hit_pages=[…])` (at most 16 groups shown).
    fn __repr__(&self) -> String {
        let hits = &self.inner.num_hit_pages;
        let shown: Vec<String> = hits.iter().take(16).map(ToString::to_string).collect();
        let more = if hits.len() > 16 { ", ..." } else { "" };
        format!(
            "PrefixMatch(num_common_tokens={}, num_hit_pages=[{}{more}])",
            self.inner.num_common_tokens,
            shown.join(", ")
        )
    }
}

// ===== FlatKVCache ==========================================================================

/// Read one spec object (any object with `kind`, `page_size`, `sliding_window`, `group_id`).
fn group_spec(i: usize, spec: &Bound<'_, PyAny>) -> PyResult<GroupSpec> {
    let field = |name: &str| {
        spec.getattr(name).map_err(|_| {
            PyTypeError::new_err(format!(
                "specs[{i}] must be a KVCacheSpec, got {} (no attribute {name:?})",
                type_name(spec)
            ))
        })
    };
    let kind_obj = field("kind")?;
    let Ok(kind_str) = kind_obj.cast::<PyString>() else {
        return Err(PyTypeError::new_err(format!(
            "specs[{i}].kind must be a str, got {}",
            type_name(&kind_obj)
        )));
    };
    let page_size = positive(&field("page_size")?, &format!("specs[{i}].page_size"))?;
    let window_obj = field("sliding_window")?;
    let window = opt_count(Some(&window_obj), &format!("specs[{i}].sliding_window"))?;
    let kind = match (kind_str.to_str()?, window) {
        ("full", None) => GroupKind::Full,
        ("state", None) => GroupKind::State,
        ("sliding_window", Some(w)) if w >= 1 => GroupKind::SlidingWindow { window: w },
        ("sliding_window", _) => {
            return Err(PyValueError::new_err(format!(
                "specs[{i}].sliding_window must be an int >= 1 for a sliding_window group, got {window_obj}"
            )))
        }
        ("full" | "state", Some(_)) => {
            return Err(PyValueError::new_err(format!(
                "specs[{i}].sliding_window must be None for a {kind_str} group, got {window_obj}"
            )))
        }
        (other, _) => {
            return Err(PyValueError::new_err(format!(
                "specs[{i}].kind must be 'full', 'sliding_window' or 'state', got {:?}",
                clip(other)
            )))
        }
    };
    let id_obj = field("group_id")?;
    let group_id = if id_obj.is_none() {
        format!("g{i}")
    } else if let Ok(s) = id_obj.cast::<PyString>() {
        s.to_str()?.to_owned()
    } else {
        return Err(PyTypeError::new_err(format!(
            "specs[{i}].group_id must be a str or None, got {}",
            type_name(&id_obj)
        )));
    };
    Ok(GroupSpec {
        group_id,
        kind,
        page_size,
    })
}

/// Request ids of a batch (kept alive so their text can be borrowed).
fn req_args<'py>(reqs: &Bound<'py, PyAny>) -> PyResult<Vec<ReqArg<'py>>> {
    if reqs.is_instance_of::<PyString>() {
        return Err(PyTypeError::new_err(
            "reqs must be a sequence of request ids, not a str",
        ));
    }
    reqs.try_iter()?.map(|r| ReqArg::new(&r?)).collect()
}

/// The `eviction_order` argument: `"hybrid"` or `"group"`; anything else is a `ValueError`.
#[derive(Clone, Copy)]
pub struct EvictionArg(EvictionOrder);

impl<'a, 'py> FromPyObject<'a, 'py> for EvictionArg {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        let named = obj
            .cast::<PyString>()
            .ok()
            .and_then(|s| s.to_str().ok().and_then(EvictionOrder::from_name));
        match named {
            Some(order) => Ok(Self(order)),
            None => Err(PyValueError::new_err(format!(
                "eviction_order must be 'hybrid' or 'group', got {}",
                clip(&obj.repr().map_or_else(|_| "?".to_owned(), |r| r.to_string()))
            ))),
        }
    }
}

/// The page engine of one model (SPEC 6 to 9, docs/engine-api.md and docs/requests-api.md):
/// `FlatKVCache(specs, num_pages, *, enable_caching=True, eviction_order="hybrid",
/// enable_kv_events=False)`.
///
/// `specs` is a non-empty sequence of `KVCacheSpec`; `num_pages` the pool size (page 0
/// included). Request ids are `str` or `int` (`5` and `"5"` differ); an unknown id is a
/// `KeyError` except for `claim`, `acquire` and `prefill_first_chunk`, which create it.
/// Requests created by `add_request` own their tokens (token-level); the others are
/// page-level, and token-level methods refuse them with `ValueError`.
#[pyclass(frozen, module = "flat_kvcache._native", name = "FlatKVCache")]
pub struct PyFlatKVCache {
    group_ids: Vec<String>,
    groups: Vec<GroupMeta>,
    base: u64,
    lcm: u64,
    inner: Mutex<FlatCache>,
    /// The last prompt hashed, so probing, sizing and adding one prompt hash it once.
    last_prompt: Mutex<Option<Prompt>>,
}

impl PyFlatKVCache {
    /// Run `f` on the engine with the GIL released (for calls whose work can be long).
    fn detached<R: Send>(&self, py: Python<'_>, f: impl FnOnce(&mut FlatCache) -> R + Send) -> PyResult<R> {
        py.detach(|| lock(&self.inner).map(|mut c| f(&mut c)))
    }

    /// Run `f` on the engine for the request id `req` (parsed before the lock is taken).
    fn on_request<R>(
        &self,
        req: &Bound<'_, PyAny>,
        f: impl FnOnce(&mut FlatCache, RequestIdRef<'_>) -> flat_kvcache_core::CoreResult<R>,
    ) -> PyResult<R> {
        let r = ReqArg::new(req)?;
        let id = r.id()?;
        let result = f(&mut *lock(&self.inner)?, id);
        core(result)
    }

    /// Hash a prompt into base pages with the GIL released and no lock held.
    ///
    /// A contiguous `uint32` array (what a scheduler keeps prompts in) is first compared with
    /// the memo in place, so probing, sizing and adding one prompt copy its tokens at most once.
    fn prompt(&self, py: Python<'_>, tokens: &Bound<'_, PyAny>, extra_keys: ExtraKeys) -> PyResult<Prompt> {
        if let Ok(arr) = tokens.cast::<PyArray1<u32>>() {
            if let Ok(view) = arr.try_readonly() {
                if let Ok(slice) = view.as_slice() {
                    let memo = lock(&self.last_prompt)?;
                    if let Some(known) = Prompt::recall(memo.as_ref(), slice, &extra_keys.0, self.base) {
                        return Ok(known);
                    }
                }
            }
        }
        let toks = self::tokens(tokens, "prompt_token_ids")?;
        let base = self.base;
        py.detach(|| {
            let mut memo = lock(&self.last_prompt)?;
            core(Prompt::new_memoized(toks, extra_keys.0, base, &mut memo))
        })
    }
}

#[pymethods]
impl PyFlatKVCache {
    /// Create the engine over `specs` with a pool of `num_pages >= 1` pages.
    ///
    /// `eviction_order` is `"hybrid"` (free a request's pages by slot end token, descending,
    /// across all groups; SPEC 12.3) or `"group"` (group 0's table tail first, then group
    /// 1's, ...). `enable_kv_events` records KV events for `take_events`.
    #[new]
    #[pyo3(
        signature = (specs, num_pages, *, enable_caching = true, eviction_order = EvictionArg(EvictionOrder::Hybrid), enable_kv_events = false),
        text_signature = "(specs, num_pages, *, enable_caching=True, eviction_order='hybrid', enable_kv_events=False)"
    )]
    fn new(
        specs: &Bound<'_, PyAny>,
        num_pages: &Bound<'_, PyAny>,
        enable_caching: bool,
        eviction_order: EvictionArg,
        enable_kv_events: bool,
    ) -> PyResult<Self> {
        if specs.is_instance_of::<PyString>() {
            return Err(PyTypeError::new_err(
                "specs must be a sequence of KVCacheSpec, not a str",
            ));
        }
        let mut groups = Vec::new();
        for (i, spec) in specs.try_iter()?.enumerate() {
            groups.push(group_spec(i, &spec?)?);
        }
        let num_pages = count(num_pages, "num_pages")?;
        if num_pages == 0 {
            return Err(PyValueError::new_err("num_pages must be >= 1, got 0"));
        }
        let options = CacheOptions {
            enable_caching,
            eviction_order: eviction_order.0,
            enable_kv_events,
        };
        let cache = core(FlatCache::with_options(groups, num_pages, options))?;
        let coord = cache.coordinator();
        Ok(Self {
            group_ids: coord.specs().iter().map(|s| s.group_id.clone()).collect(),
            groups: coord
                .specs()
                .iter()
                .map(|s| GroupMeta::new(s.kind, s.page_size))
                .collect(),
            base: coord.base_page_size(),
            lcm: coord.lcm_page_size(),
            inner: Mutex::new(cache),
            last_prompt: Mutex::new(None),
        })
    }

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
        self.group_ids.len()
    }

    /// Group ids in group order.
    #[getter]
    fn group_ids(&self) -> Vec<String> {
        self.group_ids.clone()
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

    /// Whether `req` has tables.
    fn has_request(&self, req: &Bound<'_, PyAny>) -> PyResult<bool> {
        let r = ReqArg::new(req)?;
        let id = r.id()?;
        Ok(lock(&self.inner)?.has_request(id))
    }

    /// The hybrid prefix match of base-page content hashes (64-char hex); read-only.
    /// Releases the GIL while matching.
    fn match_prefix(&self, py: Python<'_>, content_hashes: &Bound<'_, PyAny>) -> PyResult<PyPrefixMatch> {
        let hashes = self::content_hashes(content_hashes, "content_hashes")?;
        let result = self.detached(py, |c| c.match_prefix(&hashes))?;
        Ok(PyPrefixMatch { inner: core(result)? })
    }

    /// Take references on `match`'s pages and make them `req`'s tables (created if new).
    /// `ValueError` (and no change) if the tables already hold pages, the match has the wrong
    /// number of groups, or a matched page no longer holds the key it was matched under.
    #[pyo3(signature = (req, r#match))]
    fn claim(&self, req: &Bound<'_, PyAny>, r#match: &Bound<'_, PyPrefixMatch>) -> PyResult<()> {
        let r = ReqArg::new(req)?;
        let id = r.id()?;
        let result = lock(&self.inner)?.claim(id, &r#match.get().inner);
        core(result)
    }

    /// Make room for `num_tokens` more tokens in every group of `req` (created if new),
    /// check-then-act: False (and no change) when the pool has too few free pages.
    fn acquire(&self, req: &Bound<'_, PyAny>, num_tokens: &Bound<'_, PyAny>) -> PyResult<bool> {
        let r = ReqArg::new(req)?;
        let id = r.id()?;
        let n = count(num_tokens, "num_tokens")?;
        Ok(lock(&self.inner)?.acquire(id, n))
    }

    /// Register base-page hashes (`content_hashes[j]` is base page `first_slot + j`) in every
    /// group; state groups register only the last key when the range ends at `end_tokens`
    /// on their page boundary. Does nothing with caching off.
    #[pyo3(
        signature = (req, content_hashes, *, first_slot = None, end_tokens = None),
        text_signature = "(self, req, content_hashes, *, first_slot=0, end_tokens=None)"
    )]
    fn register(
        &self,
        py: Python<'_>,
        req: &Bound<'_, PyAny>,
        content_hashes: &Bound<'_, PyAny>,
        first_slot: Option<&Bound<'_, PyAny>>,
        end_tokens: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let r = ReqArg::new(req)?;
        let id = r.id()?;
        let hashes = self::content_hashes(content_hashes, "content_hashes")?;
        let first = opt_count(first_slot, "first_slot")?.unwrap_or(0);
        let end = opt_count(end_tokens, "end_tokens")?;
        let result = self.detached(py, |c| c.register(id, &hashes, first, end))?;
        core(result)
    }

    /// Free the pages of `req` that slid out of every window at `num_computed_tokens`.
    fn reclaim(&self, req: &Bound<'_, PyAny>, num_computed_tokens: &Bound<'_, PyAny>) -> PyResult<()> {
        let r = ReqArg::new(req)?;
        let id = r.id()?;
        let n = count(num_computed_tokens, "num_computed_tokens")?;
        let result = lock(&self.inner)?.reclaim(id, n);
        core(result)
    }

    /// Release all of `req`'s pages (in the cache's eviction order), drop its reserve and
    /// forget it.
    fn free(&self, req: &Bound<'_, PyAny>) -> PyResult<()> {
        self.on_request(req, FlatCache::free)
    }

    /// Pages an acquire of `num_tokens` would allocate for `req` (a fresh request if None).
    #[pyo3(signature = (num_tokens, req = None))]
    fn pages_needed(&self, num_tokens: &Bound<'_, PyAny>, req: Option<&Bound<'_, PyAny>>) -> PyResult<u64> {
        let n = count(num_tokens, "num_tokens")?;
        let r = req.filter(|r| !r.is_none()).map(ReqArg::new).transpose()?;
        let id = r.as_ref().map(ReqArg::id).transpose()?;
        let result = lock(&self.inner)?.pages_needed(n, id);
        core(result)
    }

    /// Pages a reclaim of `req` at `num_computed_tokens` would return to the free list
    /// (only pages whose last reference is `req`; only cached ones unless `count_uncached`).
    #[pyo3(signature = (req, num_computed_tokens, *, count_uncached = true))]
    fn pages_reclaimable(
        &self,
        req: &Bound<'_, PyAny>,
        num_computed_tokens: &Bound<'_, PyAny>,
        count_uncached: bool,
    ) -> PyResult<usize> {
        let r = ReqArg::new(req)?;
        let id = r.id()?;
        let n = count(num_computed_tokens, "num_computed_tokens")?;
        let result = lock(&self.inner)?.pages_reclaimable(id, n, count_uncached);
        core(result)
    }

    /// Distinct real pages of `match` with count 0 (what a claim takes off the free list).
    #[pyo3(signature = (r#match))]
    fn pages_consumed_by_claim(&self, r#match: &Bound<'_, PyPrefixMatch>) -> PyResult<usize> {
        let result = lock(&self.inner)?.pages_consumed_by_claim(&r#match.get().inner);
        core(result)
    }

    /// `req`'s page ids per group (holes 0).
    fn page_ids(&self, req: &Bound<'_, PyAny>) -> PyResult<Vec<Vec<u32>>> {
        self.on_request(req, |c, id| c.page_ids(id))
    }

    /// `req`'s free token slots in the last page, per group.
    fn tail_available(&self, req: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
        self.on_request(req, |c, id| c.tail_available(id))
    }

    /// First chunk: `claim(req, match)` then `acquire(req, num_tokens)` (on False the claim
    /// stays).
    #[pyo3(signature = (req, r#match, num_tokens))]
    fn prefill_first_chunk(
        &self,
        req: &Bound<'_, PyAny>,
        r#match: &Bound<'_, PyPrefixMatch>,
        num_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        let r = ReqArg::new(req)?;
        let id = r.id()?;
        let n = count(num_tokens, "num_tokens")?;
        let result = lock(&self.inner)?.prefill_first_chunk(id, &r#match.get().inner, n);
        core(result)
    }

    /// Later chunk: register the full pages so far (`content_hashes` from base page 0, cut
    /// to `num_computed_tokens // base`), then reclaim, then acquire `num_tokens`.
    fn prefill_chunk(
        &self,
        py: Python<'_>,
        req: &Bound<'_, PyAny>,
        content_hashes: &Bound<'_, PyAny>,
        num_tokens: &Bound<'_, PyAny>,
        num_computed_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        let r = ReqArg::new(req)?;
        let id = r.id()?;
        let hashes = self::content_hashes(content_hashes, "content_hashes")?;
        let n = count(num_tokens, "num_tokens")?;
        let computed = count(num_computed_tokens, "num_computed_tokens")?;
        let result = self.detached(py, |c| c.prefill_chunk(id, &hashes, n, computed))?;
        core(result)
    }

    /// Decode step: register (`content_hashes` start at base page `first_page_slot`, cut so
    /// that `first_page_slot + len <= num_computed_tokens // base`), reclaim, then acquire
    /// `num_tokens`. Returns whether the acquire succeeded.
    fn decode_step(
        &self,
        req: &Bound<'_, PyAny>,
        content_hashes: &Bound<'_, PyAny>,
        first_page_slot: &Bound<'_, PyAny>,
        num_tokens: &Bound<'_, PyAny>,
        num_computed_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        let r = ReqArg::new(req)?;
        let id = r.id()?;
        let hashes = self::content_hashes(content_hashes, "content_hashes")?;
        let first = count(first_page_slot, "first_page_slot")?;
        let n = count(num_tokens, "num_tokens")?;
        let computed = count(num_computed_tokens, "num_computed_tokens")?;
        let result = lock(&self.inner)?.decode_step(id, &hashes, first, n, computed);
        core(result)
    }

    /// Flat per-group block tables of a batch, rows in the order given (repeats allowed).
    ///
    /// Without `out`: `{group_id: int32 array [len(reqs), max_cols]}` in group order, holes
    /// 0, padding -1. With `out` (a mapping `group_id` -> writable C-contiguous int32 numpy
    /// array or CPU torch tensor of shape `[>= len(reqs), cols]` for every group): row r of
    /// each buffer gets the request's page ids then -1 up to `cols`, written in place with
    /// the GIL released; rows past `len(reqs)` are untouched; a table wider than `cols` is a
    /// `ValueError` naming the group and nothing is written. Returns `out`.
    /// `RuntimeError` naming the build when compiled without the `flat` feature.
    #[pyo3(signature = (reqs, out = None))]
    fn block_tables<'py>(
        &self,
        py: Python<'py>,
        reqs: &Bound<'py, PyAny>,
        out: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        if !flat_kvcache_core::FLAT_KVCACHE {
            return Err(PyRuntimeError::new_err(FLAT_UNAVAILABLE));
        }
        let args = req_args(reqs)?;
        let ids: Vec<RequestIdRef<'_>> = args.iter().map(ReqArg::id).collect::<PyResult<_>>()?;
        if let Some(out) = out.filter(|o| !o.is_none()) {
            let mut arrays = borrow_out(out, &self.group_ids)?;
            let mut outs = table_outs(&mut arrays)?;
            core(self.detached(py, |c| c.write_block_tables(&ids, &mut outs))?)?;
            return Ok(out.clone());
        }
        let tables = core(self.detached(py, |c| c.block_tables(&ids))?)?;
        let dict = PyDict::new(py);
        for (gid, FlatTable { rows, cols, data }) in self.group_ids.iter().zip(tables) {
            let arr = Array2::from_shape_vec((rows, cols), data)
                .map_err(|e| PyRuntimeError::new_err(format!("block_tables: {e}")))?;
            dict.set_item(gid, arr.into_pyarray(py))?;
        }
        Ok(dict.into_any())
    }

    // ----- token-level requests (docs/requests-api.md) --------------------------------------

    /// Add a token-level request for `prompt_token_ids` (a non-empty list or 1-D integer
    /// array of u32) under a new id. Every full base page is hashed (chained, `extra_keys` on
    /// every page) with the GIL released; with caching on and `use_prefix_cache`, the prefix
    /// match over all but the last prompt token is claimed. Returns the hit in tokens (the
    /// request's computed tokens); allocates nothing else.
    #[pyo3(
        signature = (req, prompt_token_ids, *, extra_keys = ExtraKeys::default(), use_prefix_cache = true),
        text_signature = "(self, req, prompt_token_ids, *, extra_keys=(), use_prefix_cache=True)"
    )]
    fn add_request(
        &self,
        py: Python<'_>,
        req: &Bound<'_, PyAny>,
        prompt_token_ids: &Bound<'_, PyAny>,
        extra_keys: ExtraKeys,
        use_prefix_cache: bool,
    ) -> PyResult<u64> {
        let r = ReqArg::new(req)?;
        let id = r.id()?;
        let prompt = self.prompt(py, prompt_token_ids, extra_keys)?;
        core(self.detached(py, |c| c.add_request(id, prompt, use_prefix_cache))?)
    }

    /// Append newly known tokens (a list or 1-D integer array of u32) to a token-level
    /// request; each base page that fills is hashed once, chained to the previous one.
    fn append_tokens(&self, req: &Bound<'_, PyAny>, token_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let r = ReqArg::new(req)?;
        let id = r.id()?;
        let toks = tokens(token_ids, "token_ids")?;
        let result = lock(&self.inner)?.append_tokens(id, &toks);
        core(result)
    }

    /// Append newly known tokens to many token-level requests in one call (a decode step's
    /// sampled tokens): request `i` gets the next `num_tokens[i]` entries of the flat
    /// `token_ids`, or exactly one each when `num_tokens` is None. Same result as calling
    /// `append_tokens` per request in order; everything is validated first (unknown id:
    /// `KeyError`; page-level request or lengths that do not add up: `ValueError`; nothing
    /// changes then). The GIL is released while appending.
    #[pyo3(
        signature = (reqs, token_ids, num_tokens = None),
        text_signature = "(self, reqs, token_ids, num_tokens=None)"
    )]
    fn append_tokens_batch(
        &self,
        py: Python<'_>,
        reqs: &Bound<'_, PyAny>,
        token_ids: &Bound<'_, PyAny>,
        num_tokens: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let args = req_args(reqs)?;
        let ids: Vec<RequestIdRef<'_>> = args.iter().map(ReqArg::id).collect::<PyResult<_>>()?;
        let toks = tokens(token_ids, "token_ids")?;
        let ns = match num_tokens {
            Some(obj) if !obj.is_none() => Some(counts(obj, "num_tokens")?),
            _ => None,
        };
        core(self.detached(py, |c| c.append_tokens_batch(&ids, &toks, ns.as_deref()))?)
    }

    /// Schedule the next `num_new_tokens` known tokens of a token-level request: register
    /// its completed full pages, reclaim slid-out pages, then acquire room for them plus
    /// `lookahead` slots, all or nothing. True: the position moved and the reserve was
    /// released; False: nothing was allocated and the position stays. Asking for more
    /// tokens than are known and not computed is a `ValueError`.
    #[pyo3(
        signature = (req, num_new_tokens, *, lookahead = None),
        text_signature = "(self, req, num_new_tokens, *, lookahead=0)"
    )]
    fn schedule(
        &self,
        req: &Bound<'_, PyAny>,
        num_new_tokens: &Bound<'_, PyAny>,
        lookahead: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        let r = ReqArg::new(req)?;
        let id = r.id()?;
        let n = count(num_new_tokens, "num_new_tokens")?;
        let ahead = opt_count(lookahead, "lookahead")?.unwrap_or(0);
        let result = lock(&self.inner)?.schedule(id, n, ahead);
        core(result)
    }

    /// Schedule a whole step in one call: `num_new_tokens` holds one int per request (a
    /// sequence or a 1-D integer array). Everything is validated first (unknown id:
    /// `KeyError`; page-level request or too many tokens: `ValueError`; nothing changes
    /// then); each request is then scheduled in order exactly like `schedule(req, n)`.
    /// Returns a numpy bool array. The GIL is released while scheduling.
    fn schedule_batch<'py>(
        &self,
        py: Python<'py>,
        reqs: &Bound<'py, PyAny>,
        num_new_tokens: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<bool>>> {
        let args = req_args(reqs)?;
        let ids: Vec<RequestIdRef<'_>> = args.iter().map(ReqArg::id).collect::<PyResult<_>>()?;
        let ns = counts(num_new_tokens, "num_new_tokens")?;
        if ns.len() != ids.len() {
            return Err(PyValueError::new_err(format!(
                "num_new_tokens has {} entries but reqs has {}",
                ns.len(),
                ids.len()
            )));
        }
        let scheduled = core(self.detached(py, |c| c.schedule_batch(&ids, &ns))?)?;
        Ok(scheduled.into_pyarray(py))
    }

    /// Register a token-level request's completed full pages, free all its pages (in the
    /// eviction order), release its reserve and forget the id (it may be used again).
    fn finish(&self, req: &Bound<'_, PyAny>) -> PyResult<()> {
        self.on_request(req, FlatCache::finish)
    }

    /// `finish`, counted as a preemption; returns the request's whole token list (prompt
    /// plus generated), the folded prompt to re-add with `add_request` for recompute.
    fn preempt(&self, req: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
        self.on_request(req, FlatCache::preempt)
    }

    /// Tokens a token-level request has computed (its position).
    fn num_computed_tokens(&self, req: &Bound<'_, PyAny>) -> PyResult<u64> {
        self.on_request(req, |c, id| c.num_computed_tokens(id))
    }

    /// Tokens a token-level request knows (prompt plus appended).
    fn num_tokens(&self, req: &Bound<'_, PyAny>) -> PyResult<u64> {
        self.on_request(req, |c, id| c.num_tokens(id))
    }

    // ----- admission accounting (SPEC 9) ----------------------------------------------------

    /// The prefix hit `add_request` would get for this prompt (capped so the last token is
    /// recomputed), read-only.
    #[pyo3(
        signature = (prompt_token_ids, *, extra_keys = ExtraKeys::default()),
        text_signature = "(self, prompt_token_ids, *, extra_keys=())"
    )]
    fn prefix_hit_tokens(
        &self,
        py: Python<'_>,
        prompt_token_ids: &Bound<'_, PyAny>,
        extra_keys: ExtraKeys,
    ) -> PyResult<u64> {
        let prompt = self.prompt(py, prompt_token_ids, extra_keys)?;
        core(self.detached(py, |c| c.prefix_hit_tokens(&prompt))?)
    }

    /// Pages admitting this prompt would take: the capped match's claim (its free cached
    /// pages) plus `pages_needed(num_new_tokens + reserve_tokens)` on fresh tables.
    #[pyo3(
        signature = (prompt_token_ids, num_new_tokens, reserve_tokens = None, *, extra_keys = ExtraKeys::default()),
        text_signature = "(self, prompt_token_ids, num_new_tokens, reserve_tokens=0, *, extra_keys=())"
    )]
    fn pages_needed_to_admit(
        &self,
        py: Python<'_>,
        prompt_token_ids: &Bound<'_, PyAny>,
        num_new_tokens: &Bound<'_, PyAny>,
        reserve_tokens: Option<&Bound<'_, PyAny>>,
        extra_keys: ExtraKeys,
    ) -> PyResult<u64> {
        let n = count(num_new_tokens, "num_new_tokens")?;
        let reserve = opt_count(reserve_tokens, "reserve_tokens")?.unwrap_or(0);
        let prompt = self.prompt(py, prompt_token_ids, extra_keys)?;
        core(self.detached(py, |c| c.pages_needed_to_admit(&prompt, n, reserve))?)
    }

    /// Promise `pages_needed(tokens, req)` pages to `req`'s next decode (replacing its
    /// previous reserve; 0 clears it). Released by a successful `schedule`, `finish`,
    /// `preempt` and `free`.
    fn reserve(&self, req: &Bound<'_, PyAny>, tokens: &Bound<'_, PyAny>) -> PyResult<()> {
        let r = ReqArg::new(req)?;
        let id = r.id()?;
        let n = count(tokens, "tokens")?;
        let result = lock(&self.inner)?.reserve(id, n);
        core(result)
    }

    /// Free pages minus the reserves of every request other than `req` (may be negative).
    #[pyo3(signature = (req = None))]
    fn budget(&self, req: Option<&Bound<'_, PyAny>>) -> PyResult<i128> {
        let r = req.filter(|r| !r.is_none()).map(ReqArg::new).transpose()?;
        let id = r.as_ref().map(ReqArg::id).transpose()?;
        let result = lock(&self.inner)?.budget(id);
        core(result)
    }

    // ----- metrics and events ---------------------------------------------------------------

    /// Metrics with stable names: `pages_total pages_free pages_in_use pages_cached
    /// pages_cached_free requests prefix_queries_tokens prefix_hits_tokens evictions
    /// preemptions` and `pages_in_use_by_group` (`{group_id: pages}`).
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
        for (gid, pages) in self.group_ids.iter().zip(&s.pages_in_use_by_group) {
            by_group.set_item(gid, pages)?;
        }
        d.set_item("pages_in_use_by_group", by_group)?;
        Ok(d)
    }

    /// The KV events recorded since the last call, oldest first, as `flat_kvcache.events`
    /// dataclasses (always `[]` when `enable_kv_events` is off).
    fn take_events<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let events = lock(&self.inner)?.take_events();
        events_to_py(py, events, &self.groups)
    }

    /// Drop the key of every cached page with count 0 (they stay free; no `BlockRemoved`),
    /// record `AllBlocksCleared`, and return how many keys were dropped.
    fn reset_prefix_cache(&self) -> PyResult<usize> {
        Ok(lock(&self.inner)?.reset_prefix_cache())
    }

    /// Check every engine invariant; `RuntimeError` describing the first violation.
    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        core(self.detached(py, |c| c.check_invariants())?)
    }

    /// `FlatKVCache(group_ids=[…], num_pages=…, num_free_pages=…, num_requests=…)`.
    fn __repr__(&self) -> PyResult<String> {
        let (stats, reqs) = {
            let c = lock(&self.inner)?;
            (c.pool_stats(), c.num_requests())
        };
        let shown: Vec<String> = self
            .group_ids
            .iter()
            .take(8)
            .map(|g| format!("'{}'", clip(g).escape_debug()))
            .collect();
        let more = if self.group_ids.len() > 8 { ", ..." } else { "" };
        Ok(format!(
            "FlatKVCache(group_ids=[{}{more}], num_pages={}, num_free_pages={}, num_requests={reqs})",
            shown.join(", "),
            stats.num_blocks,
            stats.num_free
        ))
    }
}
