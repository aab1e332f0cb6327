//! `BlockPool`: the page pool of SPEC 5 with string keys, as a Python class.

use std::sync::Mutex;

use flat_kvcache_core::engine::pool::{BlockPool, DEFAULT_REUSE_UNCACHED_FIRST};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::args::{count, page, text_arg, FlagParam, INTS};
use crate::convert::{batch_iter, signed, IntArg};
use crate::errors::{core, lock};

/// The page pool of SPEC 5 with string keys:
/// `BlockPool(num_blocks, *, enable_caching=True, reuse_uncached_first=True)`.
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
        for item in batch_iter(pages, "pages", INTS)? {
            ids.push(page(&item?, self.num_blocks)?);
        }
        let result = lock(&self.inner)?.free(&ids);
        core(result)
    }

    /// Register `key` for `page` (no-op with caching off or for page 0); a page that
    /// already holds a key is a `ValueError`.
    fn cache(&self, page: &Bound<'_, PyAny>, key: &Bound<'_, PyAny>) -> PyResult<()> {
        let p = self::page(page, self.num_blocks)?;
        let key = text_arg(key, "key")?;
        let result = lock(&self.inner)?.cache(p, key.into());
        core(result)
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
