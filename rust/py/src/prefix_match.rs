//! `PrefixMatch`: the result of a prefix match, as a Python class.

use flat_kvcache_core::engine::coordinator::PrefixMatch;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;

use crate::args::{count, counts, page_ids};
use crate::convert::{batch_iter, overflow, type_name};

/// The result of `FlatKVCache.match_prefix`: per-group matched pages (0 = hole), the number
/// of real pages per group, and the token count every group can resume from.
///
/// A match also remembers the key each real page was matched under, so `claim` refuses it
/// once a page holds another key (or none). Equality compares the three public fields only.
#[pyclass(frozen, eq, module = "flat_kvcache._native", name = "PrefixMatch")]
pub struct PyPrefixMatch {
    pub(crate) inner: PrefixMatch,
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
        let mut table = Vec::new();
        for (g, group) in batch_iter(pages, "pages", "page-id sequences")?.enumerate() {
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

/// A `match` argument: a `PrefixMatch` (anything else is a `TypeError` naming `match`, as the
/// reference says it).
pub struct MatchArg<'py>(pub Bound<'py, PyPrefixMatch>);

impl<'a, 'py> FromPyObject<'a, 'py> for MatchArg<'py> {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        match obj.cast::<PyPrefixMatch>() {
            Ok(m) => Ok(Self(m.to_owned())),
            Err(_) => Err(PyTypeError::new_err(format!(
                "match must be a PrefixMatch, got {}",
                type_name(&obj)
            ))),
        }
    }
}
