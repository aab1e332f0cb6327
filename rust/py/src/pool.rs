//! `BlockPool`: the page pool of SPEC 5 with string keys, as a Python class.

use std::sync::Mutex;

use flat_kvcache_core::engine::pool::{ArenaGeometry, BlockPool, DEFAULT_REUSE_UNCACHED_FIRST};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::args::{count, counts, page, text_arg, CountParam, FlagParam, INTS};
use crate::convert::{batch_iter, signed, IntArg};
use crate::errors::{core, lock};

/// The page pool of SPEC 5 with string keys:
/// `BlockPool(num_blocks, *, enable_caching=True, reuse_uncached_first=True)`, or in arena mode
/// (SPEC 13.2) `BlockPool.with_arena(unit_bytes, num_units, page_bytes, *, enable_caching=True)`.
///
/// Page 0 is the null page (never free, cached or counted); the free list starts as
/// `1..num_blocks-1` and is the eviction order. Misuse raises `ValueError` and changes nothing.
#[pyclass(frozen, module = "flat_kvcache._native", name = "BlockPool")]
pub struct PyBlockPool {
    num_blocks: usize,
    /// The arena's groups (arena mode), else None.
    groups: Option<usize>,
    inner: Mutex<BlockPool<Box<str>>>,
}

impl PyBlockPool {
    /// A page argument checked to be in range at once, with the core's message (so a list of
    /// pages is range-checked before anything else about it, and a page before a key, as the
    /// reference checks them).
    fn in_range(&self, obj: &Bound<'_, PyAny>) -> PyResult<u64> {
        let p = page(obj, self.num_blocks)?;
        if usize::try_from(p).is_ok_and(|i| i < self.num_blocks) {
            Ok(p)
        } else {
            Err(PyValueError::new_err(format!(
                "page {p} is out of range [0, {})",
                self.num_blocks
            )))
        }
    }

    /// A group argument already read as a count: in arena mode one of the arena's groups
    /// (`ValueError` naming `name`); without an arena any group (the pool ignores it).
    fn checked_group(&self, g: u64, name: &str) -> PyResult<usize> {
        if let Some(groups) = self.groups {
            if g >= groups as u64 {
                return Err(PyValueError::new_err(format!(
                    "{name} must be < {groups} (the arena's groups), got {g}"
                )));
            }
        }
        Ok(usize::try_from(g).unwrap_or(usize::MAX))
    }

    /// A group argument: a count (`TypeError` / `ValueError` / `OverflowError` naming `name`),
    /// then [`Self::checked_group`].
    fn group(&self, obj: &Bound<'_, PyAny>, name: &str) -> PyResult<usize> {
        self.checked_group(count(obj, name)?, name)
    }

    /// Arena mode: at most one need per group (`ValueError`; the core would index past them).
    fn check_needs(&self, needs: &[u64]) -> PyResult<()> {
        match self.groups {
            Some(groups) if needs.len() > groups => Err(PyValueError::new_err(format!(
                "needs has {} entries, more than the arena's {groups} groups",
                needs.len()
            ))),
            _ => Ok(()),
        }
    }
}

#[pymethods]
impl PyBlockPool {
    /// Create a pool of `num_blocks >= 1` pages (page 0 included).
    ///
    /// `reuse_uncached_first`: a released page that holds no key joins the front of the free
    /// list (it is handed out before any cached page) instead of the back.
    #[new]
    #[pyo3(
        signature = (num_blocks, *, enable_caching = FlagParam::OMITTED, reuse_uncached_first = FlagParam::OMITTED),
        text_signature = "(num_blocks, *, enable_caching=True, reuse_uncached_first=True)"
    )]
    #[allow(clippy::needless_pass_by_value, reason = "PyO3 extracts arguments by value")]
    fn new(
        num_blocks: &Bound<'_, PyAny>,
        enable_caching: FlagParam<'_>,
        reuse_uncached_first: FlagParam<'_>,
    ) -> PyResult<Self> {
        // The pool holds page 0, so its size is >= 1 (a negative size says so too).
        let too_small = |v: &dyn std::fmt::Display| PyValueError::new_err(format!("num_blocks must be >= 1, got {v}"));
        let num_blocks = match signed(num_blocks, "num_blocks")? {
            IntArg::Small(v) if v < 1 => return Err(too_small(&v)),
            IntArg::HugeNegative => return Err(too_small(num_blocks)),
            IntArg::Small(_) | IntArg::HugePositive => count(num_blocks, "num_blocks")?,
        };
        let enable_caching = enable_caching.or(true, "enable_caching")?;
        let reuse_uncached_first = reuse_uncached_first.or(DEFAULT_REUSE_UNCACHED_FIRST, "reuse_uncached_first")?;
        let mut pool = core(BlockPool::new(num_blocks, enable_caching))?;
        pool.set_reuse_uncached_first(reuse_uncached_first);
        Ok(Self {
            num_blocks: pool.num_blocks(),
            groups: None,
            inner: Mutex::new(pool),
        })
    }

    /// A pool in arena mode (SPEC 13.2): `num_units` units of `unit_bytes` (unit 0 is null),
    /// group `g`'s pages of `page_bytes[g]` bytes; every unit starts free.
    ///
    /// The arguments are checked as ints first (`TypeError` / `ValueError` / `OverflowError`
    /// naming them), then the geometry (`ValueError` naming the problem). Group `g`'s page `p`
    /// is id `group_base(g) + p`; `num_free` is the arena's free credit.
    #[staticmethod]
    #[pyo3(
        signature = (unit_bytes, num_units, page_bytes, *, enable_caching = FlagParam::OMITTED),
        text_signature = "(unit_bytes, num_units, page_bytes, *, enable_caching=True)"
    )]
    #[allow(clippy::needless_pass_by_value, reason = "PyO3 extracts arguments by value")]
    fn with_arena(
        unit_bytes: &Bound<'_, PyAny>,
        num_units: &Bound<'_, PyAny>,
        page_bytes: &Bound<'_, PyAny>,
        enable_caching: FlagParam<'_>,
    ) -> PyResult<Self> {
        let geometry = ArenaGeometry {
            unit_bytes: count(unit_bytes, "unit_bytes")?,
            num_units: count(num_units, "num_units")?,
            page_bytes: counts(page_bytes, "page_bytes")?,
        };
        let enable_caching = enable_caching.or(true, "enable_caching")?;
        let pool = core(BlockPool::with_arena(&geometry, enable_caching))?;
        Ok(Self {
            num_blocks: pool.num_blocks(),
            groups: Some(geometry.page_bytes.len()),
            inner: Mutex::new(pool),
        })
    }

    /// Total pages, the null page included.
    #[getter]
    fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Pages on the free list; in arena mode the free credit (a page of group `g` counts
    /// `page_cost(g)`, a free or idle unit the lcm of the groups' fewest pages per unit).
    #[getter]
    fn num_free(&self) -> PyResult<usize> {
        Ok(lock(&self.inner)?.num_free())
    }

    /// What `num_free` counts when nothing is allocated: the pages but the null page; in arena
    /// mode the credit of every unit but the null one.
    #[getter]
    fn num_total(&self) -> PyResult<usize> {
        Ok(lock(&self.inner)?.num_total())
    }

    /// The arena's occupancy, or None without an arena: `unit_bytes units_total units_free
    /// units_idle stranded_bytes`, and `units_bound` and `pages_free` (lists, one entry per
    /// group).
    fn arena_stats<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(a) = lock(&self.inner)?.arena_stats() else {
            return Ok(None);
        };
        let d = PyDict::new(py);
        d.set_item("unit_bytes", a.unit_bytes)?;
        d.set_item("units_total", a.units_total)?;
        d.set_item("units_free", a.units_free)?;
        d.set_item("units_idle", a.units_idle)?;
        d.set_item("units_bound", a.units_bound)?;
        d.set_item("pages_free", a.pages_free)?;
        d.set_item("stranded_bytes", a.stranded_bytes)?;
        d.set_item("pages_cached", a.pages_cached)?;
        d.set_item("cached_bytes", a.cached_bytes)?;
        Ok(Some(d))
    }

    /// Whether the pool is in arena mode.
    #[getter]
    fn is_arena(&self) -> bool {
        self.groups.is_some()
    }

    /// The pool id of group `g`'s view index 0 (0 without an arena).
    fn group_base(&self, g: &Bound<'_, PyAny>) -> PyResult<u32> {
        let g = self.group(g, "g")?;
        Ok(lock(&self.inner)?.group_base(g))
    }

    /// The ids of group `g`'s view, the null page included (without an arena: the pool's
    /// pages).
    fn group_ids(&self, g: &Bound<'_, PyAny>) -> PyResult<usize> {
        let g = self.group(g, "g")?;
        Ok(lock(&self.inner)?.group_ids(g))
    }

    /// What one page of group `g` counts in `num_free`: 1, or its credit in arena mode.
    fn page_cost(&self, g: &Bound<'_, PyAny>) -> PyResult<u64> {
        let g = self.group(g, "g")?;
        Ok(lock(&self.inner)?.page_cost(g))
    }

    /// Whether taking `needs[g]` pages for each group `g` (in group order) succeeds; in arena
    /// mode `needs` may be shorter than the groups, never longer (`ValueError`).
    fn fits(&self, needs: &Bound<'_, PyAny>) -> PyResult<bool> {
        let needs = counts(needs, "needs")?;
        self.check_needs(&needs)?;
        Ok(lock(&self.inner)?.fits(needs.into_iter()))
    }

    /// Whether claiming `claimed` (one more reference on each: any counts, repeats allowed, 0
    /// entries skipped) and then taking `needs[g]` pages per group succeeds. Checked first:
    /// each claimed page in range, `needs` as in `fits`, then in arena mode each claimed page
    /// of count 0 claimable as `touch` requires. Nothing changes.
    fn fits_after_claim(&self, claimed: &Bound<'_, PyAny>, needs: &Bound<'_, PyAny>) -> PyResult<bool> {
        let mut ids = Vec::new();
        for item in batch_iter(claimed, "claimed", INTS)? {
            // In range: < num_blocks <= MAX_BLOCKS, so it fits u32.
            ids.push(u32::try_from(self.in_range(&item?)?).unwrap_or(u32::MAX));
        }
        let needs = counts(needs, "needs")?;
        self.check_needs(&needs)?;
        ids.retain(|&id| id != 0);
        let pool = lock(&self.inner)?;
        for &id in &ids {
            core(pool.check_arena_page(u64::from(id)))?;
        }
        Ok(pool.fits_after_claim(&ids, &needs))
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
    ///
    /// In arena mode the pages are `group`'s (one of the arena's groups, else `ValueError`);
    /// without an arena `group` is checked as a count and otherwise ignored.
    #[pyo3(signature = (n, group = CountParam::OMITTED), text_signature = "($self, n, group=0)")]
    #[allow(clippy::needless_pass_by_value, reason = "PyO3 extracts arguments by value")]
    fn allocate(&self, n: &Bound<'_, PyAny>, group: CountParam<'_>) -> PyResult<Vec<u32>> {
        let n = usize::try_from(count(n, "n")?).unwrap_or(usize::MAX);
        let g = self.checked_group(group.or(0, "group")?, "group")?;
        let mut pool = lock(&self.inner)?;
        if self.groups.is_none() {
            return Ok(pool.allocate(n));
        }
        let mut out = Vec::new();
        pool.allocate_group_into(&mut out, g, n);
        Ok(out)
    }

    /// Claim one more reference on `page` (removing it from the free list at count 0);
    /// page 0 is a no-op. In arena mode a page of count 0 must lie in a unit bound to its
    /// group (`ValueError` otherwise).
    fn touch(&self, page: &Bound<'_, PyAny>) -> PyResult<()> {
        let p = self.in_range(page)?;
        let mut pool = lock(&self.inner)?;
        core(pool.check_arena_page(p))?;
        core(pool.touch(p))
    }

    /// Release `pages` in reverse order (0 entries skipped); at count 0 a page goes to the
    /// back of the free list with its key intact. Validated first: nothing changes on error.
    fn free(&self, pages: &Bound<'_, PyAny>) -> PyResult<()> {
        let mut ids = Vec::new();
        for item in batch_iter(pages, "pages", INTS)? {
            ids.push(self.in_range(&item?)?);
        }
        let result = lock(&self.inner)?.free(&ids);
        core(result)
    }

    /// Register `key` for `page` (no-op with caching off or for page 0); a page that
    /// already holds a key is a `ValueError`.
    ///
    /// In arena mode a page of count 0 must lie in a unit bound to its group (`ValueError`
    /// otherwise, checked last).
    fn cache(&self, page: &Bound<'_, PyAny>, key: &Bound<'_, PyAny>) -> PyResult<()> {
        let p = self.in_range(page)?;
        let key = text_arg(key, "key")?;
        let mut pool = lock(&self.inner)?;
        if pool.caching_enabled() && p != 0 && !core(pool.is_cached(p))? {
            core(pool.check_arena_page(p))?;
        }
        core(pool.cache(p, key.into()))
    }

    /// The earliest-registered page still holding `key`, or None.
    fn lookup(&self, key: &Bound<'_, PyAny>) -> PyResult<Option<u32>> {
        let key = text_arg(key, "key")?;
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

    /// Drop the key of every cached page of count 0 (they stay free, in place; not counted as
    /// evictions); returns the dropped keys in free-list order (arena mode: each group's free
    /// pages, then the idle units least recently idle first, ids ascending). For tests.
    fn _clear_cached_free(&self) -> PyResult<Vec<String>> {
        let dropped = lock(&self.inner)?.clear_cached_free();
        Ok(dropped.into_iter().map(String::from).collect())
    }

    /// Keep (or stop keeping, dropping those kept) the keys that allocations evict. For tests.
    #[allow(clippy::needless_pass_by_value, reason = "PyO3 extracts arguments by value")]
    fn _set_record_evictions(&self, on: FlagParam<'_>) -> PyResult<()> {
        let on = on.or(false, "on")?;
        lock(&self.inner)?.set_record_evictions(on);
        Ok(())
    }

    /// The keys evicted since the last call, in eviction order (empty unless recording).
    fn _take_evicted(&self) -> PyResult<Vec<String>> {
        let evicted = lock(&self.inner)?.take_evicted();
        Ok(evicted.into_iter().map(String::from).collect())
    }

    /// The first broken invariant of the pool (lists, counts, key map, arena), described, or
    /// None. For tests.
    fn _check(&self) -> PyResult<Option<String>> {
        Ok(lock(&self.inner)?.check().err())
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
