//! Python classes of the page engine (SPEC 5 to 8): `BlockPool`, `FlatKVCache`, `PrefixMatch`.
//!
//! Each class is frozen and keeps its mutable state behind a `Mutex`, so Python threads can
//! share one object. Locking discipline: a lock is never held while Python code can run
//! (arguments are extracted before locking, results converted after unlocking), so neither a
//! re-entrant call nor a GIL hand-off can deadlock. Long calls take the lock with the GIL
//! released (`py.detach`); the per-request step calls stay attached because their work is
//! shorter than a detach/attach round trip.

use std::sync::{Mutex, MutexGuard};

use flat_kvcache_core::cache::{FlatCache, FlatTable, FLAT_UNAVAILABLE};
use flat_kvcache_core::coordinator::{GroupSpec, PrefixMatch};
use flat_kvcache_core::pool::BlockPool;
use flat_kvcache_core::request::RequestIdRef;
use flat_kvcache_core::table::GroupKind;
use numpy::ndarray::Array2;
use numpy::IntoPyArray;
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString};

use crate::convert::{clip, content_hashes, count, opt_count, page, positive, type_name, ReqArg};
use crate::errors::core;

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
#[pyclass(frozen, eq, module = "flat_kvcache._native", name = "PrefixMatch")]
#[derive(PartialEq)]
pub struct PyPrefixMatch {
    inner: PrefixMatch,
}

#[pymethods]
impl PyPrefixMatch {
    /// Build a match by hand (normally it comes from `FlatKVCache.match_prefix`).
    #[new]
    #[pyo3(signature = (num_common_tokens, pages, num_hit_pages))]
    fn new(num_common_tokens: &Bound<'_, PyAny>, pages: Vec<Vec<u32>>, num_hit_pages: Vec<usize>) -> PyResult<Self> {
        Ok(Self {
            inner: PrefixMatch {
                num_common_tokens: count(num_common_tokens, "num_common_tokens")?,
                pages,
                num_hit_pages,
            },
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

/// The page engine of one model (SPEC 6 to 8): `FlatKVCache(specs, num_pages, *,
/// enable_caching=True)`.
///
/// `specs` is a non-empty sequence of `KVCacheSpec`; `num_pages` the pool size (page 0
/// included). Request ids are `str` or `int` (`5` and `"5"` differ); an unknown id is a
/// `KeyError` except for `claim`, `acquire` and `prefill_first_chunk`, which create it.
#[pyclass(frozen, module = "flat_kvcache._native", name = "FlatKVCache")]
pub struct PyFlatKVCache {
    group_ids: Vec<String>,
    base: u64,
    lcm: u64,
    inner: Mutex<FlatCache>,
}

impl PyFlatKVCache {
    /// Run `f` on the engine with the GIL released (for calls whose work can be long).
    fn detached<R: Send>(&self, py: Python<'_>, f: impl FnOnce(&mut FlatCache) -> R + Send) -> PyResult<R> {
        py.detach(|| lock(&self.inner).map(|mut c| f(&mut c)))
    }
}

#[pymethods]
impl PyFlatKVCache {
    /// Create the engine over `specs` with a pool of `num_pages >= 1` pages.
    #[new]
    #[pyo3(signature = (specs, num_pages, *, enable_caching = true))]
    fn new(specs: &Bound<'_, PyAny>, num_pages: &Bound<'_, PyAny>, enable_caching: bool) -> PyResult<Self> {
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
        let cache = core(FlatCache::new(groups, num_pages, enable_caching))?;
        let coord = cache.coordinator();
        Ok(Self {
            group_ids: coord.specs().iter().map(|s| s.group_id.clone()).collect(),
            base: coord.base_page_size(),
            lcm: coord.lcm_page_size(),
            inner: Mutex::new(cache),
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
    /// number of groups, or a matched page no longer holds a key.
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

    /// Release all of `req`'s pages (group order, each table tail first) and forget it.
    fn free(&self, req: &Bound<'_, PyAny>) -> PyResult<()> {
        let r = ReqArg::new(req)?;
        let id = r.id()?;
        let result = lock(&self.inner)?.free(id);
        core(result)
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
        let r = ReqArg::new(req)?;
        let id = r.id()?;
        let result = lock(&self.inner)?.page_ids(id);
        core(result)
    }

    /// `req`'s free token slots in the last page, per group.
    fn tail_available(&self, req: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
        let r = ReqArg::new(req)?;
        let id = r.id()?;
        let result = lock(&self.inner)?.tail_available(id);
        core(result)
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

    /// Flat per-group block tables of a batch: `{group_id: int32 array [len(reqs),
    /// max_cols]}` in group order, holes 0, padding -1, rows in the order given.
    /// `RuntimeError` naming the build when compiled without the `flat` feature.
    fn block_tables<'py>(&self, py: Python<'py>, reqs: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyDict>> {
        if !flat_kvcache_core::FLAT_KVCACHE {
            return Err(PyRuntimeError::new_err(FLAT_UNAVAILABLE));
        }
        let args = req_args(reqs)?;
        let ids: Vec<RequestIdRef<'_>> = args.iter().map(ReqArg::id).collect::<PyResult<_>>()?;
        let tables = core(self.detached(py, |c| c.block_tables(&ids))?)?;
        let out = PyDict::new(py);
        for (gid, FlatTable { rows, cols, data }) in self.group_ids.iter().zip(tables) {
            let arr = Array2::from_shape_vec((rows, cols), data)
                .map_err(|e| PyRuntimeError::new_err(format!("block_tables: {e}")))?;
            out.set_item(gid, arr.into_pyarray(py))?;
        }
        Ok(out)
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
