//! Python entry points of content hashing (SPEC 4): hex text in and out, raw bytes inside.

use flat_kvcache_core::engine::hash::{self, to_hex, ContentHash};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyList, PyString};

use crate::args::{count, positive, prior as parse_prior, text_arg, tokens, ExtraKeys, Passed};
use crate::convert::batch_iter;
use crate::convert::{signed, type_name, IntArg};
use crate::errors::core;

/// The content hash of one page: SHA-256 over little-endian u32 fields (`len(prior raw)`,
/// prior raw bytes, `len(tokens)`, each token, then if `extra_keys` is non-empty their count
/// and each key's UTF-8 length and bytes), as 64 lowercase hex digits.
///
/// `tokens` is a sequence of ints or a 1-D numpy integer array (each must fit u32); `prior`
/// is `""` or hex text of even length; `extra_keys` a sequence of str.
#[pyfunction]
#[allow(clippy::needless_pass_by_value, reason = "PyO3 extracts arguments by value")]
#[pyo3(
    signature = (tokens, prior = Passed::OMITTED, extra_keys = ExtraKeys::default()),
    text_signature = "(tokens, prior='', extra_keys=())"
)]
pub fn hash_page<'py>(
    tokens: &Bound<'py, PyAny>,
    prior: Passed<'py>,
    extra_keys: ExtraKeys<'py>,
) -> PyResult<Bound<'py, PyString>> {
    let toks = self::tokens(tokens, "tokens")?;
    let prior = parse_prior(&prior)?;
    let keys = extra_keys.keys()?;
    Ok(hex_str(tokens.py(), &core(hash::hash_page(&toks, &prior, &keys))?))
}

/// The chained content hashes of the full pages of `token_ids` (`page_size > 0`; a trailing
/// partial page is ignored): `h_0 = hash_page(page_0, prior, extra_keys)`, then
/// `h_i = hash_page(page_i, h_{i-1}, extra_keys)`. Releases the GIL while hashing.
#[pyfunction]
#[allow(clippy::needless_pass_by_value, reason = "PyO3 extracts arguments by value")]
#[pyo3(
    signature = (token_ids, page_size, *, prior = Passed::OMITTED, extra_keys = ExtraKeys::default()),
    text_signature = "(token_ids, page_size, *, prior='', extra_keys=())"
)]
pub fn hash_pages<'py>(
    py: Python<'py>,
    token_ids: &Bound<'py, PyAny>,
    page_size: &Bound<'py, PyAny>,
    prior: Passed<'py>,
    extra_keys: ExtraKeys<'py>,
) -> PyResult<Bound<'py, PyList>> {
    let toks = tokens(token_ids, "token_ids")?;
    let page_size = usize::try_from(positive(page_size, "page_size")?).unwrap_or(usize::MAX);
    let prior = parse_prior(&prior)?;
    let keys = extra_keys.keys()?;
    let hashes = core(py.detach(|| hash::hash_pages(&toks, page_size, &prior, &keys)))?;
    PyList::new(py, hashes.iter().map(|h| hex_str(py, h)))
}

/// A content hash as a Python str of 64 lowercase hex digits, built without a Rust `String`.
pub fn hex_str<'py>(py: Python<'py>, hash: &ContentHash) -> Bound<'py, PyString> {
    let mut text = [0u8; 64];
    hash::hex_into(hash, &mut text);
    // Only ASCII hex digits were written, so this never falls back.
    PyString::new(py, std::str::from_utf8(&text).unwrap_or_default())
}

/// The key of a content hash in group `group_index`: the hash text followed by the group as
/// 8 hex digits (big-endian u32). `content_hash` is any str UTF-8 can encode; `group_index`
/// must fit u32 (`ValueError("group_index = <v> does not fit in u32")`).
#[pyfunction]
pub fn group_key(content_hash: &Bound<'_, PyAny>, group_index: &Bound<'_, PyAny>) -> PyResult<String> {
    let content_hash = text_arg(content_hash, "content_hash")?;
    let bad = |v: &dyn std::fmt::Display| PyValueError::new_err(format!("group_index = {v} does not fit in u32"));
    let group = match signed(group_index, "group_index")? {
        IntArg::Small(v) => u32::try_from(v).map_err(|_| bad(&v))?,
        IntArg::HugeNegative | IntArg::HugePositive => return Err(bad(group_index)),
    };
    Ok(format!("{content_hash}{group:08x}"))
}

/// Fold base-page hashes into the hashes of a group whose page is `m` base pages wide.
///
/// `base_hashes[j]` is the hash of base page `first_base + j`. The fold skips to the first
/// base page index that is a multiple of `m`, then folds each complete run of `m` hashes:
/// `run = ""`, then `run = hash_page([], run, [h])` for each hash `h` of the run (its text is
/// the extra key). Incomplete runs at either end are dropped; `m == 1` returns a copy.
#[pyfunction]
pub fn fold_hashes<'py>(
    py: Python<'py>,
    base_hashes: &Bound<'py, PyAny>,
    first_base: &Bound<'py, PyAny>,
    m: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyList>> {
    let mut items: Vec<Bound<'py, PyString>> = Vec::new();
    for (i, item) in batch_iter(base_hashes, "base_hashes", "str")?.enumerate() {
        let item = item?;
        match item.cast_into::<PyString>() {
            Ok(s) => items.push(s),
            Err(e) => {
                return Err(PyTypeError::new_err(format!(
                    "base_hashes[{i}] must be a str, got {}",
                    type_name(&e.into_inner())
                )))
            }
        }
    }
    // Every hash must be text UTF-8 can encode (a lone surrogate is `UnicodeEncodeError`),
    // also when `m == 1` returns them unchanged.
    let texts: Vec<&str> = items.iter().map(|s| s.to_str()).collect::<PyResult<_>>()?;
    let first_base = count(first_base, "first_base")?;
    let m = positive(m, "m")?;
    if m == 1 {
        return PyList::new(py, items.iter());
    }
    let folded = py.detach(|| -> flat_kvcache_core::CoreResult<Vec<String>> {
        let (skip, runs) = hash::fold_layout(texts.len(), first_base, m)?;
        // runs > 0 implies m <= len, so m fits usize.
        let width = usize::try_from(m).unwrap_or(usize::MAX);
        let mut out = Vec::with_capacity(runs);
        for run in texts[skip..].chunks_exact(width.max(1)).take(runs) {
            let keys: Vec<&[u8]> = run.iter().map(|t| t.as_bytes()).collect();
            out.push(hash::fold_run_keys(&keys)?.map_or_else(String::new, |h| to_hex(&h)));
        }
        Ok(out)
    });
    PyList::new(py, core(folded)?)
}
