//! `PageCache`: the page-level protocol (docs/engine-api.md, SPEC 6 to 8) for engines that keep
//! their own request state and bring the content hashes: `match_prefix`, `claim`, `acquire`,
//! `register`, `reclaim`, `free`, the dry runs `pages_reclaimable` / `pages_consumed_by_claim`
//! and the step calls `prefill_first_chunk`, `prefill_chunk`, `decode_step`. The state and the
//! calls shared with `FlatKVCache` are `_PagedCacheBase`'s (`cache.rs`), reached through
//! `as_super()`; the locking discipline is the one described there.

use flat_kvcache_core::engine::FlatCache;
use pyo3::prelude::*;

use crate::args::{
    content_hashes, count, counts, opt_count, CountParam, FlagParam, GroupSpecs, Passed, RequestId, RequestIds,
};
use crate::cache::{tables_to_py, PyPagedCache};
use crate::errors::{core, lock};
use crate::prefix_match::{MatchArg, PyPrefixMatch};
use crate::tables::{borrow_out, table_outs};
use flat_kvcache_core::CoreError;

/// The page-level protocol (docs/engine-api.md): `PageCache(specs, num_pages, *,
/// enable_caching=True, eviction_order="hybrid", enable_kv_events=False,
/// reuse_uncached_first=True, host_pages=0, host_store="write_through", move_state_pages=True)`,
/// the constructor of `FlatKVCache` plus `move_state_pages`.
///
/// For engines that keep their own request state: the caller hashes the tokens and says where
/// each request stands. Request ids are `str` or `int` (`5` and `"5"` differ); an unknown id
/// is an `UnknownRequestError` (a `KeyError`) except for `claim`, `acquire` and
/// `prefill_first_chunk`, which create it. The token-level calls are `FlatKVCache`'s; the
/// shared calls are `_PagedCacheBase`'s.
#[pyclass(extends = PyPagedCache, frozen, module = "flat_kvcache._native", name = "PageCache")]
pub struct PyPageCache;

#[pymethods]
#[allow(clippy::needless_pass_by_value, reason = "PyO3 extracts arguments by value")]
impl PyPageCache {
    /// Create the page-level engine over `specs` with a pool of `num_pages >= 1` pages.
    ///
    /// `eviction_order` is `"hybrid"` (free a request's pages by slot end token, descending,
    /// across all groups; SPEC 12.3) or `"group"` (group 0's table tail first, then group
    /// 1's, ...). `enable_kv_events` records KV events for `take_events`.
    /// `reuse_uncached_first`: a released page that holds no key joins the front of the free
    /// list (handed out before any cached page) instead of the back.
    /// `move_state_pages`: a state group's `acquire` moves the request's working page to the
    /// new last slot when that page holds no key (the default); `False` always takes a fresh
    /// page there, the previous one staying in its slot until `reclaim` releases it (vLLM's
    /// mamba "align" tables).
    #[new]
    #[pyo3(
        signature = (specs, num_pages, *, enable_caching = FlagParam::OMITTED, eviction_order = Passed::OMITTED, enable_kv_events = FlagParam::OMITTED, reuse_uncached_first = FlagParam::OMITTED, host_pages = None, host_store = Passed::OMITTED, move_state_pages = FlagParam::OMITTED),
        text_signature = "(specs, num_pages, *, enable_caching=True, eviction_order='hybrid', enable_kv_events=False, reuse_uncached_first=True, host_pages=0, host_store='write_through', move_state_pages=True)"
    )]
    #[allow(clippy::too_many_arguments, reason = "the Python constructor's keyword arguments")]
    fn new(
        specs: GroupSpecs,
        num_pages: &Bound<'_, PyAny>,
        enable_caching: FlagParam<'_>,
        eviction_order: Passed<'_>,
        enable_kv_events: FlagParam<'_>,
        reuse_uncached_first: FlagParam<'_>,
        host_pages: Option<&Bound<'_, PyAny>>,
        host_store: Passed<'_>,
        move_state_pages: FlagParam<'_>,
    ) -> PyResult<PyClassInitializer<Self>> {
        let cache = PyPagedCache::build(
            specs,
            Some(num_pages),
            enable_caching,
            eviction_order,
            enable_kv_events,
            reuse_uncached_first,
            host_pages,
            host_store,
            None,
            &move_state_pages,
            &FlagParam::OMITTED,
            None,
        )?;
        Ok(PyClassInitializer::from(cache).add_subclass(Self))
    }

    /// The hybrid prefix match of base-page content hashes (64-char hex); read-only.
    /// Releases the GIL while matching.
    fn match_prefix(
        slf: &Bound<'_, Self>,
        py: Python<'_>,
        content_hashes: &Bound<'_, PyAny>,
    ) -> PyResult<PyPrefixMatch> {
        let cache = slf.as_super().get();
        let hashes = self::content_hashes(content_hashes, "content_hashes")?;
        let result = cache.detached(py, |c| c.match_prefix(&hashes))?;
        Ok(PyPrefixMatch { inner: core(result)? })
    }

    /// Take references on `match`'s pages and make them `req`'s tables (created if new).
    /// `ValueError` (and no change) if the tables already hold pages, the match has the wrong
    /// number of groups, or a matched page no longer holds the key it was matched under.
    #[pyo3(signature = (req, r#match))]
    fn claim(slf: &Bound<'_, Self>, req: RequestId<'_>, r#match: MatchArg<'_>) -> PyResult<()> {
        let cache = slf.as_super().get();
        let id = req.id()?;
        let result = lock(&cache.inner)?.claim(id, &r#match.0.get().inner);
        core(result)
    }

    /// Make room for `num_tokens` more tokens in every group of `req` (created if new),
    /// check-then-act: False (and no change) when the pool has too few free pages.
    fn acquire(slf: &Bound<'_, Self>, req: RequestId<'_>, num_tokens: &Bound<'_, PyAny>) -> PyResult<bool> {
        let cache = slf.as_super().get();
        let id = req.id()?;
        let n = count(num_tokens, "num_tokens")?;
        let result = lock(&cache.inner)?.acquire(id, n);
        core(result)
    }

    /// `acquire`, answering what it appended: per group, the page ids (holes 0) of the slots
    /// past the table's length before the call (`[]` where the table did not grow), as
    /// `page_ids` shows them; None (and no change) when the pool has too few free pages. A
    /// state group's working page that moves to the new last slot leaves a hole in its old
    /// slot, which is not repeated here.
    fn acquire_pages(
        slf: &Bound<'_, Self>,
        req: RequestId<'_>,
        num_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<Option<Vec<Vec<u32>>>> {
        let cache = slf.as_super().get();
        let id = req.id()?;
        let n = count(num_tokens, "num_tokens")?;
        let result = lock(&cache.inner)?.acquire_pages(id, n);
        core(result)
    }

    /// Register base-page hashes (`content_hashes[j]` is base page `first_slot + j`) in every
    /// group; state groups register only the last key when the range ends at `end_tokens`
    /// on their page boundary. Does nothing with caching off.
    #[pyo3(
        signature = (req, content_hashes, *, first_slot = CountParam::OMITTED, end_tokens = None, groups = None),
        text_signature = "(self, req, content_hashes, *, first_slot=0, end_tokens=None, groups=None)"
    )]
    #[allow(clippy::too_many_arguments, reason = "the Python signature")]
    fn register(
        slf: &Bound<'_, Self>,
        py: Python<'_>,
        req: RequestId<'_>,
        content_hashes: &Bound<'_, PyAny>,
        first_slot: CountParam<'_>,
        end_tokens: Option<&Bound<'_, PyAny>>,
        groups: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let cache = slf.as_super().get();
        let id = req.id()?;
        let hashes = self::content_hashes(content_hashes, "content_hashes")?;
        let first = first_slot.or(0, "first_slot")?;
        let end = opt_count(end_tokens, "end_tokens")?;
        let groups = groups
            .filter(|g| !g.is_none())
            .map(|g| counts(g, "groups"))
            .transpose()?;
        let result = cache.detached(py, |c| {
            let only = groups.as_deref().map(|g| c.group_indices(g)).transpose()?;
            c.register_groups(id, &hashes, first, end, only.as_deref())
        })?;
        core(result)
    }

    /// Free the pages of `req` that slid out of every window at `num_computed_tokens`.
    fn reclaim(slf: &Bound<'_, Self>, req: RequestId<'_>, num_computed_tokens: &Bound<'_, PyAny>) -> PyResult<()> {
        let cache = slf.as_super().get();
        let id = req.id()?;
        let n = count(num_computed_tokens, "num_computed_tokens")?;
        let result = lock(&cache.inner)?.reclaim(id, n);
        core(result)
    }

    /// Release all of `req`'s pages (in the cache's eviction order), drop its reserve and
    /// forget it.
    fn free(slf: &Bound<'_, Self>, req: RequestId<'_>) -> PyResult<()> {
        let cache = slf.as_super().get();
        cache.on_request(&req, FlatCache::free)
    }

    /// Pages a reclaim of `req` at `num_computed_tokens` would return to the free list
    /// (only pages whose last reference is `req`; only cached ones unless `count_uncached`).
    #[pyo3(
        signature = (req, num_computed_tokens, *, count_uncached = FlagParam::OMITTED),
        text_signature = "(self, req, num_computed_tokens, *, count_uncached=True)"
    )]
    fn pages_reclaimable(
        slf: &Bound<'_, Self>,
        req: RequestId<'_>,
        num_computed_tokens: &Bound<'_, PyAny>,
        count_uncached: FlagParam<'_>,
    ) -> PyResult<usize> {
        let cache = slf.as_super().get();
        let id = req.id()?;
        let n = count(num_computed_tokens, "num_computed_tokens")?;
        let count_uncached = count_uncached.or(true, "count_uncached")?;
        let result = lock(&cache.inner)?.pages_reclaimable(id, n, count_uncached);
        core(result)
    }

    /// Distinct real pages of `match` with count 0 (what a claim takes off the free list).
    #[pyo3(signature = (r#match))]
    fn pages_consumed_by_claim(slf: &Bound<'_, Self>, r#match: MatchArg<'_>) -> PyResult<usize> {
        let cache = slf.as_super().get();
        let result = lock(&cache.inner)?.pages_consumed_by_claim(&r#match.0.get().inner);
        core(result)
    }

    /// First chunk: `claim(req, match)` then `acquire(req, num_tokens)` (on False the claim
    /// stays).
    #[pyo3(signature = (req, r#match, num_tokens))]
    fn prefill_first_chunk(
        slf: &Bound<'_, Self>,
        req: RequestId<'_>,
        r#match: MatchArg<'_>,
        num_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        let cache = slf.as_super().get();
        let id = req.id()?;
        let n = count(num_tokens, "num_tokens")?;
        let result = lock(&cache.inner)?.prefill_first_chunk(id, &r#match.0.get().inner, n);
        core(result)
    }

    /// Later chunk: register the full pages so far (`content_hashes` from base page 0, cut
    /// to `num_computed_tokens // base`), then reclaim, then acquire `num_tokens`.
    fn prefill_chunk(
        slf: &Bound<'_, Self>,
        py: Python<'_>,
        req: RequestId<'_>,
        content_hashes: &Bound<'_, PyAny>,
        num_tokens: &Bound<'_, PyAny>,
        num_computed_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        let cache = slf.as_super().get();
        let id = req.id()?;
        let hashes = self::content_hashes(content_hashes, "content_hashes")?;
        let n = count(num_tokens, "num_tokens")?;
        let computed = count(num_computed_tokens, "num_computed_tokens")?;
        let result = cache.detached(py, |c| c.prefill_chunk(id, &hashes, n, computed))?;
        core(result)
    }

    /// Decode step: register (`content_hashes` start at base page `first_page_slot`, cut so
    /// that `first_page_slot + len <= num_computed_tokens // base`), reclaim, then acquire
    /// `num_tokens`. Returns whether the acquire succeeded.
    fn decode_step(
        slf: &Bound<'_, Self>,
        req: RequestId<'_>,
        content_hashes: &Bound<'_, PyAny>,
        first_page_slot: &Bound<'_, PyAny>,
        num_tokens: &Bound<'_, PyAny>,
        num_computed_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        let cache = slf.as_super().get();
        let id = req.id()?;
        let hashes = self::content_hashes(content_hashes, "content_hashes")?;
        let first = count(first_page_slot, "first_page_slot")?;
        let n = count(num_tokens, "num_tokens")?;
        let computed = count(num_computed_tokens, "num_computed_tokens")?;
        let result = lock(&cache.inner)?.decode_step(id, &hashes, first, n, computed);
        core(result)
    }

    /// Whether `req` has tables.
    fn has_request(slf: &Bound<'_, Self>, req: RequestId<'_>) -> PyResult<bool> {
        let cache = slf.as_super().get();
        let id = req.id()?;
        Ok(lock(&cache.inner)?.has_request(id))
    }

    /// Pages an acquire of `num_tokens` would allocate for `req` (a fresh request if None).
    #[pyo3(signature = (num_tokens, req = None))]
    fn pages_needed(
        slf: &Bound<'_, Self>,
        num_tokens: &Bound<'_, PyAny>,
        req: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<u64> {
        let cache = slf.as_super().get();
        let n = count(num_tokens, "num_tokens")?;
        // The id after the count (signature order): extracted here, not by PyO3.
        let req = req
            .filter(|r| !r.is_none())
            .map(PyAnyMethods::extract::<RequestId<'_>>)
            .transpose()?;
        let id = req.as_ref().map(RequestId::id).transpose()?;
        let result = lock(&cache.inner)?.pages_needed(n, id);
        core(result)
    }

    /// `req`'s page ids per group (holes 0).
    fn page_ids(slf: &Bound<'_, Self>, req: RequestId<'_>) -> PyResult<Vec<Vec<u32>>> {
        slf.as_super().get().on_request(&req, |c, id| c.page_ids(id))
    }

    /// `req`'s free token slots in the last page, per group.
    fn tail_available(slf: &Bound<'_, Self>, req: RequestId<'_>) -> PyResult<Vec<u64>> {
        slf.as_super().get().on_request(&req, |c, id| c.tail_available(id))
    }

    /// Host-tier loads of `req` not acknowledged yet.
    fn loads_in_flight(slf: &Bound<'_, Self>, req: RequestId<'_>) -> PyResult<u64> {
        slf.as_super().get().on_request(&req, |c, id| c.loads_in_flight(id))
    }

    /// Flat per-group block tables of a batch, rows in the order given (repeats allowed).
    ///
    /// Without `out`: `{group_id: int32 array [len(reqs), max_cols]}` in group order, holes
    /// 0, padding -1. With `out` (a mapping `group_id` -> writable C-contiguous int32 numpy
    /// array or CPU torch tensor of shape `[>= len(reqs), cols]` for every group): row r of
    /// each buffer gets the request's page ids then -1 up to `cols`, written in place with
    /// the GIL released; rows past `len(reqs)` are untouched; a table wider than `cols` is a
    /// `ValueError` naming the group and nothing is written. Returns `out`.
    /// `FlatUnavailableError` (a `RuntimeError`) naming the build when compiled without the
    /// `flat` feature.
    #[pyo3(signature = (reqs, out = None))]
    fn block_tables<'py>(
        slf: &Bound<'py, Self>,
        py: Python<'py>,
        reqs: RequestIds<'py>,
        out: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let cache = slf.as_super().get();
        if !flat_kvcache_core::FLAT_KVCACHE {
            return core(Err(CoreError::FlatUnavailable));
        }
        let ids = reqs.ids()?;
        if let Some(out) = out.filter(|o| !o.is_none()) {
            let mut arrays = borrow_out(out, &cache.specs)?;
            let mut outs = table_outs(&mut arrays)?;
            core(cache.detached(py, |c| c.write_block_tables(&ids, &mut outs))?)?;
            return Ok(out.clone());
        }
        let tables = core(cache.detached(py, |c| c.block_tables(&ids))?)?;
        tables_to_py(py, cache.gids(), tables)
    }
}
