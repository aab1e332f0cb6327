//! The argument types of the page engine and hashing API, extracted and checked: counts,
//! token sequences, page ids, hex hashes, extra keys, request ids, group specs and the
//! eviction order. Every error names the argument (and index) it is about.

use flat_kvcache_core::engine::coordinator::{Coordinator, GroupSpec};
use flat_kvcache_core::engine::group::EvictionOrder;
use flat_kvcache_core::engine::group::{GroupKind, KindError};
use flat_kvcache_core::engine::hash::{parse_hash_lower, parse_hex, ContentHash};
use flat_kvcache_core::engine::ids::RequestIdRef;
use flat_kvcache_core::engine::policy::EvictionPolicy;
use flat_kvcache_core::engine::pool::{ArenaGeometry, MAX_BLOCKS};
use numpy::{PyArray1, PyArrayDescrMethods, PyArrayMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyBytes, PyInt, PyList, PyString, PyTuple, PyType};

use crate::convert::{
    batch_iter, clip, cpu_tensor_numpy, is_masked, masked_error, non_negative, signed, type_name, IntArg,
};
use crate::errors::core;
use crate::npscalar::Scalars;

// ----- counts, tokens and page ids ------------------------------------------------------------

/// A non-negative int argument as `u64` (`TypeError` / `ValueError` / `OverflowError` naming
/// `name`). Exact ints that fit take a fast path without a method call.
#[inline]
pub fn count(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<u64> {
    if obj.is_exact_instance_of::<PyInt>() {
        if let Ok(v) = obj.extract::<u64>() {
            return Ok(v);
        }
    }
    non_negative(obj, name)
}

/// An int argument with a default written in Rust: left out, it takes the default; passed,
/// it is checked by [`count`], so an explicit `None` is a `TypeError` naming it (as the
/// reference's `as_count` refuses it). Extraction only keeps the object, so the checks (and
/// their messages) run in the method body, after the arguments before it.
pub struct CountParam<'py>(Option<Bound<'py, PyAny>>);

impl CountParam<'_> {
    /// The argument left out.
    pub const OMITTED: Self = Self(None);

    /// The count passed, or `default` when the argument was left out.
    pub fn or(&self, default: u64, name: &str) -> PyResult<u64> {
        self.0.as_ref().map_or(Ok(default), |obj| count(obj, name))
    }
}

impl<'a, 'py> FromPyObject<'a, 'py> for CountParam<'py> {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        Ok(Self(Some(obj.to_owned())))
    }
}

/// A bool keyword argument with a default, kept as passed: only a real `bool` is accepted
/// (an int, None or anything else is a `TypeError` naming the argument, as the reference's
/// `as_flag` says), and the default applies only when the argument is left out.
pub struct FlagParam<'py>(Option<Bound<'py, PyAny>>);

impl FlagParam<'_> {
    /// The argument left out.
    pub const OMITTED: Self = Self(None);

    /// The flag passed, or `default` when the argument was left out.
    pub fn or(&self, default: bool, name: &str) -> PyResult<bool> {
        match &self.0 {
            None => Ok(default),
            Some(obj) => match obj.cast::<PyBool>() {
                Ok(flag) => Ok(flag.is_true()),
                Err(_) => Err(PyTypeError::new_err(format!(
                    "{name} must be a bool, got {}",
                    type_name(obj)
                ))),
            },
        }
    }
}

impl<'a, 'py> FromPyObject<'a, 'py> for FlagParam<'py> {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        Ok(Self(Some(obj.to_owned())))
    }
}

/// An argument with a default written in Rust, kept as passed (an explicit `None` is a value
/// like any other): the method body checks it, after the arguments before it.
pub struct Passed<'py>(pub Option<Bound<'py, PyAny>>);

impl Passed<'_> {
    /// The argument left out.
    pub const OMITTED: Self = Self(None);
}

impl<'a, 'py> FromPyObject<'a, 'py> for Passed<'py> {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        Ok(Self(Some(obj.to_owned())))
    }
}

/// An optional non-negative int argument (`None` passes through).
pub fn opt_count(obj: Option<&Bound<'_, PyAny>>, name: &str) -> PyResult<Option<u64>> {
    match obj {
        Some(o) if !o.is_none() => count(o, name).map(Some),
        _ => Ok(None),
    }
}

/// A positive int argument as `u64` (0 or a negative value is a `ValueError` naming `name`:
/// `"<name> must be > 0, got <v>"`, as the reference's `positive` says).
pub fn positive(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<u64> {
    let not_positive = |v: &dyn std::fmt::Display| PyValueError::new_err(format!("{name} must be > 0, got {v}"));
    match signed(obj, name)? {
        IntArg::Small(v) if v <= 0 => Err(not_positive(&v)),
        IntArg::HugeNegative => Err(not_positive(obj)),
        IntArg::Small(_) | IntArg::HugePositive => count(obj, name),
    }
}

/// What an int sequence holds, as messages say it (`<name> must be a sequence of ...`).
pub const INTS: &str = "ints or a 1-D integer array";

/// A page id argument: an int, or the `ValueError` for a value no pool holds.
#[inline]
pub fn page(obj: &Bound<'_, PyAny>, num_blocks: usize) -> PyResult<u64> {
    if obj.is_exact_instance_of::<PyInt>() {
        if let Ok(v) = obj.extract::<u64>() {
            return Ok(v);
        }
    }
    let out_of_range =
        |v: &dyn std::fmt::Display| PyValueError::new_err(format!("page {v} is out of range [0, {num_blocks})"));
    match signed(obj, "page")? {
        IntArg::Small(v) => u64::try_from(v).map_err(|_| out_of_range(&v)),
        IntArg::HugeNegative | IntArg::HugePositive => Err(out_of_range(obj)),
    }
}

/// The value of one element of an int sequence when it is an int-like that fits `T`: an `int`,
/// a numpy integer scalar (what `list(array)` holds) or anything else with `__index__`, never
/// a bool. None sends the element down the checked path, which raises the precise error
/// (a float, a bool, a negative or too large value), so both paths accept the same values.
#[inline]
fn fitting_int<'py, T>(item: &Bound<'py, PyAny>) -> Option<T>
where
    T: for<'a> FromPyObject<'a, 'py>,
{
    if item.is_instance_of::<PyBool>() {
        return None;
    }
    item.extract::<T>().ok()
}

/// One token of `name[index]`: an int that fits `u32`.
#[inline]
fn token(item: &Bound<'_, PyAny>, name: &str, index: usize) -> PyResult<u32> {
    if let Some(v) = fitting_int(item) {
        return Ok(v);
    }
    let label = format!("{name}[{index}]");
    match signed(item, &label)? {
        IntArg::Small(v) => u32::try_from(v).map_err(|_| not_u32(&label, &v)),
        IntArg::HugeNegative | IntArg::HugePositive => Err(not_u32(&label, item)),
    }
}

fn not_u32(label: &str, v: &dyn std::fmt::Display) -> PyErr {
    PyValueError::new_err(format!("{label} = {v} does not fit in u32"))
}

/// Copy a 1-D numpy array of integer dtype `T` into `u64` counts, checking every value is >= 0.
fn counts_from_array<T>(arr: &Bound<'_, PyArray1<T>>, name: &str) -> PyResult<Vec<u64>>
where
    T: numpy::Element + Copy + std::fmt::Display,
    u64: TryFrom<T>,
{
    ints_from_array(arr, |i, v| {
        PyValueError::new_err(format!("{name}[{i}] must be >= 0, got {v}"))
    })
}

/// Copy a 1-D numpy array of integer dtype `T` into a vector of `U`; `bad(i, v)` is the
/// error for the first element `v` (at `i`) that does not fit. A contiguous array is
/// checked first and then converted as a slice (a plain copy when `T` is `U`), a strided one
/// element by element; either way into a vector of the exact size (collecting `Result`s
/// would grow it by doubling).
fn ints_from_array<T, U>(arr: &Bound<'_, PyArray1<T>>, bad: impl Fn(usize, T) -> PyErr) -> PyResult<Vec<U>>
where
    T: numpy::Element + Copy,
    U: TryFrom<T> + Default,
{
    let view = arr.readonly();
    if let Ok(slice) = view.as_slice() {
        if let Some(i) = slice.iter().position(|&v| U::try_from(v).is_err()) {
            return Err(bad(i, slice[i]));
        }
        return Ok(slice.iter().map(|&v| U::try_from(v).unwrap_or_default()).collect());
    }
    let view = view.as_array();
    let mut out = Vec::with_capacity(view.len());
    for (i, &v) in view.iter().enumerate() {
        out.push(U::try_from(v).map_err(|_| bad(i, v))?);
    }
    Ok(out)
}

/// One count of `name[index]` (see [`fitting_int`]; the message names the element).
#[inline]
fn count_item(item: &Bound<'_, PyAny>, name: &str, index: usize) -> PyResult<u64> {
    if let Some(v) = fitting_int(item) {
        return Ok(v);
    }
    non_negative(item, &format!("{name}[{index}]"))
}

/// `f(item, index)` for every item of `obj` if it is a list or a tuple, into a vector of its
/// exact size (no iterator protocol); None for any other object.
fn list_or_tuple<'py, T>(
    obj: &Bound<'py, PyAny>,
    mut f: impl FnMut(&Bound<'py, PyAny>, usize) -> PyResult<T>,
) -> Option<PyResult<Vec<T>>> {
    fn collect<'py, T>(
        len: usize,
        items: impl Iterator<Item = Bound<'py, PyAny>>,
        f: &mut impl FnMut(&Bound<'py, PyAny>, usize) -> PyResult<T>,
    ) -> PyResult<Vec<T>> {
        let mut out = Vec::with_capacity(len);
        for (i, item) in items.enumerate() {
            out.push(f(&item, i)?);
        }
        Ok(out)
    }
    if let Ok(list) = obj.cast::<PyList>() {
        return Some(collect(list.len(), list.iter(), &mut f));
    }
    if let Ok(tuple) = obj.cast::<PyTuple>() {
        return Some(collect(tuple.len(), tuple.iter(), &mut f));
    }
    None
}

/// A sequence of ints, a 1-D numpy integer array (any integer dtype, any strides) or a CPU
/// torch integer tensor (viewed through `.numpy()`), element by element: `item` converts one
/// Python item of `name[index]`, `array` converts a whole array (None when its dtype is not an
/// integer one). Shared by [`counts`] and [`tokens`] so both accept exactly the same inputs.
///
/// In a list or tuple, a numpy integer scalar is read in place ([`Scalars`]) and kept when
/// `fits` accepts its value; any other item, or a value `fits` refuses, goes through `item`,
/// which raises the precise error. Text and bytes (`b"a"` is not the token 97), masked arrays
/// and non-iterables are a `TypeError` naming `name` ([`batch_iter`]).
fn int_sequence<'py, E>(
    obj: &Bound<'py, PyAny>,
    name: &str,
    item: impl Fn(&Bound<'py, PyAny>, &str, usize) -> PyResult<E>,
    fits: impl Fn(i128) -> Option<E>,
    array: impl Fn(&Bound<'py, PyUntypedArray>) -> Option<PyResult<Vec<E>>>,
) -> PyResult<Vec<E>> {
    let mut scalars = Scalars::new(obj.py());
    let mut convert = |it: &Bound<'py, PyAny>, i: usize| {
        // A plain int (never a bool: that is a subclass) that fits i64 and `fits`: the common
        // case, in one type check and one conversion.
        if it.is_exact_instance_of::<PyInt>() {
            if let Some(v) = it.extract::<i64>().ok().and_then(|v| fits(i128::from(v))) {
                return Ok(v);
            }
            return item(it, name, i);
        }
        match scalars.value(it).and_then(&fits) {
            Some(v) => Ok(v),
            None => item(it, name, i),
        }
    };
    if let Some(out) = list_or_tuple(obj, &mut convert) {
        return out;
    }
    if is_masked(obj) {
        return Err(masked_error(name));
    }
    let arr = match obj.cast::<PyUntypedArray>() {
        Ok(arr) => Some(arr.clone()),
        Err(_) => cpu_tensor_numpy(obj)?,
    };
    if let Some(arr) = arr {
        if let Some(out) = array(&arr) {
            return out;
        }
        // An integer dtype `array` has no arm for (a non-native byte order): one conversion
        // to the native order, then the same arm.
        if arr.ndim() == 1 && matches!(arr.dtype().kind(), b'i' | b'u') {
            let native = arr.dtype().call_method1(intern!(obj.py(), "newbyteorder"), ("=",))?;
            let converted = arr.call_method1(intern!(obj.py(), "astype"), (native,))?;
            if let Some(out) = converted.cast::<PyUntypedArray>().ok().and_then(&array) {
                return out;
            }
        }
        return Err(PyTypeError::new_err(format!(
            "{name} must be a 1-D integer array, got a {}-D array of dtype {}",
            arr.ndim(),
            arr.dtype()
        )));
    }
    batch_iter(obj, name, INTS)?
        .enumerate()
        .map(|(i, t)| convert(&t?, i))
        .collect()
}

/// Counts (ints >= 0) from any integer form `int_sequence` accepts.
pub fn counts(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<u64>> {
    int_sequence(
        obj,
        name,
        count_item,
        |v| u64::try_from(v).ok(),
        |arr| {
            macro_rules! try_dtype {
            ($($t:ty),*) => {$(
                if let Ok(a) = arr.cast::<PyArray1<$t>>() {
                    return Some(counts_from_array(a, name));
                }
            )*};
        }
            try_dtype!(i64, i32, u64, u32, i16, u16, i8, u8);
            None
        },
    )
}

/// Copy a 1-D numpy array of integer dtype `T` into `u32` tokens, checking every value.
fn tokens_from_array<T>(arr: &Bound<'_, PyArray1<T>>, name: &str) -> PyResult<Vec<u32>>
where
    T: numpy::Element + Copy + std::fmt::Display,
    u32: TryFrom<T>,
{
    ints_from_array(arr, |i, v| not_u32(&format!("{name}[{i}]"), &v))
}

/// Tokens from any integer form `int_sequence` accepts; each value must fit `u32`
/// (`ValueError("<name>[<i>] = <v> does not fit in u32")`).
pub fn tokens(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<u32>> {
    int_sequence(
        obj,
        name,
        token,
        |v| u32::try_from(v).ok(),
        |arr| {
            macro_rules! try_dtype {
            ($($t:ty),*) => {$(
                if let Ok(a) = arr.cast::<PyArray1<$t>>() {
                    return Some(tokens_from_array(a, name));
                }
            )*};
        }
            try_dtype!(u32, i64, i32, u64, u16, i16, u8, i8);
            None
        },
    )
}

/// One page id of `name[index]`: an int in `[0, MAX_BLOCKS)` (page ids are written into
/// int32 tables); anything else is a `ValueError` naming the element (a `TypeError` for a
/// non-int), whatever its size.
fn page_id_item(item: &Bound<'_, PyAny>, name: &str, index: usize) -> PyResult<u32> {
    let label = format!("{name}[{index}]");
    let bad = |v: &dyn std::fmt::Display| {
        PyValueError::new_err(format!("{label} = {v} is not a page id (0 <= id < {MAX_BLOCKS})"))
    };
    match signed(item, &label)? {
        IntArg::Small(v) => u32::try_from(v)
            .ok()
            .filter(|&p| u64::from(p) < MAX_BLOCKS)
            .ok_or_else(|| bad(&v)),
        IntArg::HugeNegative | IntArg::HugePositive => Err(bad(item)),
    }
}

/// Page ids from a sequence of ints, a 1-D integer array or a CPU torch integer tensor (see
/// `page_id_item`). Arrays go through `tolist()`, so both give the same messages; this is not
/// a hot path.
pub fn page_ids(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<u32>> {
    if is_masked(obj) {
        return Err(masked_error(name));
    }
    let arr = match obj.cast::<PyUntypedArray>() {
        Ok(arr) => Some(arr.clone()),
        Err(_) => cpu_tensor_numpy(obj)?,
    };
    if let Some(arr) = arr {
        if arr.ndim() != 1 || !matches!(arr.dtype().kind(), b'i' | b'u') {
            return Err(PyTypeError::new_err(format!(
                "{name} must be a 1-D integer array, got a {}-D array of dtype {}",
                arr.ndim(),
                arr.dtype()
            )));
        }
        return page_ids(&arr.call_method0("tolist")?, name);
    }
    let page = |v: i128| u32::try_from(v).ok().filter(|&p| u64::from(p) < MAX_BLOCKS);
    int_sequence(obj, name, page_id_item, page, |_| None)
}

// ----- hashes and extra keys ------------------------------------------------------------------

/// The raw bytes of a `prior` hash: a `str`, `""` (also when left out) or hex text of even
/// length (either case). Anything else is a `ValueError` showing the text as Python's `repr`
/// of its first 80 characters (a `TypeError` for a non-str).
pub fn prior(param: &Passed<'_>) -> PyResult<Vec<u8>> {
    let Some(obj) = &param.0 else {
        return Ok(Vec::new());
    };
    let Ok(text) = obj.cast::<PyString>() else {
        return Err(not_a_str(obj, "prior"));
    };
    // Text UTF-8 cannot encode (a lone surrogate) is not hex either.
    let parsed = text.to_str().ok().and_then(|t| parse_hex(t.as_bytes()));
    parsed.ok_or_else(|| match shown_text(text) {
        Ok(shown) => PyValueError::new_err(format!("prior must be '' or a hex string of even length, got {shown}")),
        Err(err) => err,
    })
}

/// The `TypeError` for a non-str given as the str argument `name`.
pub fn not_a_str(obj: &Bound<'_, PyAny>, name: &str) -> PyErr {
    PyTypeError::new_err(format!("{name} must be a str, got {}", type_name(obj)))
}

/// A str argument as UTF-8 text: a non-str is a `TypeError` naming `name`; text UTF-8 cannot
/// encode (a lone surrogate) is Python's `UnicodeEncodeError`.
pub fn text_arg<'a>(obj: &'a Bound<'_, PyAny>, name: &str) -> PyResult<&'a str> {
    match obj.cast::<PyString>() {
        Ok(text) => text.to_str(),
        Err(_) => Err(not_a_str(obj, name)),
    }
}

/// Python's `repr` of the first 80 characters of `text` (surrogates escaped, as Python shows
/// them), for messages about a value.
fn shown_text(text: &Bound<'_, PyString>) -> PyResult<String> {
    let cut = text.get_item(pyo3::types::PySlice::new(text.py(), 0, 80, 1))?;
    Ok(cut.repr()?.to_string_lossy().into_owned())
}

/// Extra keys: a sequence of `str` (text, bytes or a non-iterable is a `TypeError`), kept as
/// passed and read by [`ExtraKeys::keys`] after the arguments before it (the checking order of
/// docs/engine-api.md).
#[derive(Default)]
pub struct ExtraKeys<'py>(Option<Bound<'py, PyAny>>);

impl ExtraKeys<'_> {
    /// The keys as UTF-8 strings (none when the argument was left out).
    pub fn keys(&self) -> PyResult<Vec<String>> {
        let Some(obj) = &self.0 else {
            return Ok(Vec::new());
        };
        let mut keys = Vec::new();
        for (i, item) in batch_iter(obj, "extra_keys", "str")?.enumerate() {
            let item = item?;
            let Ok(s) = item.cast::<PyString>() else {
                return Err(PyTypeError::new_err(format!(
                    "extra_keys[{i}] must be a str, got {}",
                    type_name(&item)
                )));
            };
            keys.push(s.to_str()?.to_owned());
        }
        Ok(keys)
    }
}

impl<'a, 'py> FromPyObject<'a, 'py> for ExtraKeys<'py> {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        Ok(Self(Some(obj.to_owned())))
    }
}

/// One content hash at `name[index]`: 64-digit lowercase hex text, or its 32 raw bytes (a
/// `bytes`, as vLLM's block hashes are: no hex to build and parse again).
#[inline]
fn content_hash(item: &Bound<'_, PyAny>, name: &str, index: usize) -> PyResult<ContentHash> {
    let Ok(text) = item.cast::<PyString>() else {
        if let Ok(raw) = item.cast::<PyBytes>() {
            let data = raw.as_bytes();
            return ContentHash::try_from(data).map_err(|_| {
                PyValueError::new_err(format!(
                    "{name}[{index}] must be 32 bytes (a raw content hash), got {} bytes",
                    data.len()
                ))
            });
        }
        return Err(PyTypeError::new_err(format!(
            "{name}[{index}] must be a str or bytes, got {}",
            type_name(item)
        )));
    };
    // Text UTF-8 cannot encode (a lone surrogate) is not a hash either: the same ValueError.
    if let Some(hash) = text.to_str().ok().and_then(|t| parse_hash_lower(t.as_bytes())) {
        return Ok(hash);
    }
    // The value as Python's repr shows it, cut to 80 characters first (as the reference).
    let shown = shown_text(text)?;
    Err(PyValueError::new_err(format!(
        "{name}[{index}] must be a 64-character lowercase hex string, got {shown}"
    )))
}

/// Content hashes: a sequence of 64-character lowercase hex strings or 32-byte `bytes` (the
/// same hash either way), as raw bytes (uppercase is refused: folding hashes the text, so two
/// spellings of one hash would fold differently).
pub fn content_hashes(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<ContentHash>> {
    if let Ok(list) = obj.cast::<PyList>() {
        let mut out = Vec::with_capacity(list.len());
        for (i, item) in list.iter().enumerate() {
            out.push(content_hash(&item, name, i)?);
        }
        return Ok(out);
    }
    if let Ok(tuple) = obj.cast::<PyTuple>() {
        return tuple
            .iter()
            .enumerate()
            .map(|(i, h)| content_hash(&h, name, i))
            .collect();
    }
    batch_iter(obj, name, "str or bytes")?
        .enumerate()
        .map(|(i, h)| content_hash(&h?, name, i))
        .collect()
}

// ----- request ids ----------------------------------------------------------------------------

/// A request id argument: a `str` or an `int` of any size (anything with `__index__`, such as
/// numpy ints, but not a bool); anything else is a `TypeError`. A `str` is kept alive so the
/// core borrows its text without a copy.
pub enum RequestId<'py> {
    /// A string id.
    Str(Bound<'py, PyString>),
    /// An int id that fits `i64`.
    Int(i64),
    /// A larger int id as decimal text.
    Big(String),
}

impl RequestId<'_> {
    /// The borrowed core id.
    #[inline]
    pub fn id(&self) -> PyResult<RequestIdRef<'_>> {
        Ok(match self {
            Self::Str(s) => RequestIdRef::Str(s.to_str()?),
            Self::Int(v) => RequestIdRef::Int(*v),
            Self::Big(s) => RequestIdRef::BigInt(s),
        })
    }
}

impl<'a, 'py> FromPyObject<'a, 'py> for RequestId<'py> {
    type Error = PyErr;

    #[inline]
    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        if let Ok(s) = obj.cast::<PyString>() {
            // Text UTF-8 cannot encode is refused here, with the id's type, before the
            // arguments after it (the UTF-8 form is cached, so `id` reads it again for free).
            s.to_str()?;
            return Ok(Self::Str(s.to_owned()));
        }
        if obj.is_exact_instance_of::<PyInt>() {
            if let Ok(v) = obj.extract::<i64>() {
                return Ok(Self::Int(v));
            }
        }
        let not_an_id = || PyTypeError::new_err(format!("request ids must be str or int, got {}", type_name(&obj)));
        if obj.is_instance_of::<PyBool>() {
            return Err(not_an_id());
        }
        let index = crate::convert::index_of(&obj).map_err(|err| err.unwrap_or_else(not_an_id))?;
        match index.extract::<i64>() {
            Ok(v) => Ok(Self::Int(v)),
            Err(_) => Ok(Self::Big(index.str()?.to_str()?.to_owned())),
        }
    }
}

/// A core request id as the Python value it was given as: a `str` or an `int`.
pub fn id_to_py<'py>(py: Python<'py>, id: &flat_kvcache_core::engine::ids::RequestId) -> PyResult<Bound<'py, PyAny>> {
    use flat_kvcache_core::engine::ids::RequestId as Core;
    match id {
        Core::Str(s) => Ok(PyString::new(py, s).into_any()),
        Core::Int(i) => Ok(PyInt::new(py, *i).into_any()),
        Core::BigInt(text) => py.get_type::<PyInt>().call1((&**text,)),
    }
}

/// The request ids of a batch: a sequence of [`RequestId`] (text, bytes, a masked array or a
/// non-iterable is a `TypeError` naming `reqs`: `b"a"` is not the id 97).
pub struct RequestIds<'py>(Vec<RequestId<'py>>);

impl RequestIds<'_> {
    /// The borrowed core ids, in order.
    pub fn ids(&self) -> PyResult<Vec<RequestIdRef<'_>>> {
        let mut out = Vec::with_capacity(self.0.len());
        for req in &self.0 {
            out.push(req.id()?);
        }
        Ok(out)
    }
}

impl<'a, 'py> FromPyObject<'a, 'py> for RequestIds<'py> {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        // A list or tuple (what a scheduler passes) directly; any other iterable through the
        // iterator protocol.
        if let Some(ids) = list_or_tuple(&obj, |item, _| item.extract::<RequestId<'py>>()) {
            return ids.map(Self);
        }
        let ids = batch_iter(&obj, "reqs", "request ids")?
            .map(|r| r?.extract::<RequestId<'py>>())
            .collect::<PyResult<_>>()?;
        Ok(Self(ids))
    }
}

// ----- engine configuration -------------------------------------------------------------------

/// The `specs` argument of `FlatKVCache` / `PageCache`: a sequence of `KVCacheSpec`s (any
/// other object, even one with the same fields, is a `TypeError`, as in the reference);
/// text, bytes or a non-iterable is a `TypeError`.
pub struct GroupSpecs(pub Vec<GroupSpec>);

impl<'a, 'py> FromPyObject<'a, 'py> for GroupSpecs {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        let mut groups = Vec::new();
        for (i, spec) in batch_iter(&obj, "specs", "KVCacheSpec")?.enumerate() {
            groups.push(group_spec(i, &spec?)?);
        }
        // What the specs say together (at least one, distinct ids, chunks on page sizes, an
        // lcm that fits u64) is part of their form: checked before the arguments after them.
        core(Coordinator::check_specs(&groups))?;
        Ok(Self(groups))
    }
}

/// `flat_kvcache.KVCacheSpec`, imported on first use.
static KV_CACHE_SPEC: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// Read `specs[i]`; the kind and its window are validated again by [`GroupKind::from_name`]
/// (a frozen dataclass can still be changed with `object.__setattr__`).
fn group_spec(i: usize, spec: &Bound<'_, PyAny>) -> PyResult<GroupSpec> {
    let py = spec.py();
    let class = KV_CACHE_SPEC.get_or_try_init(py, || -> PyResult<Py<PyType>> {
        Ok(py
            .import("flat_kvcache._types")?
            .getattr("KVCacheSpec")?
            .cast_into::<PyType>()?
            .unbind())
    })?;
    if !spec.is_instance(class.bind(py))? {
        return Err(PyTypeError::new_err(format!(
            "specs[{i}] must be a KVCacheSpec, got {}",
            type_name(spec)
        )));
    }
    let field = |name: &str| {
        spec.getattr(name)
            .map_err(|_| PyTypeError::new_err(format!("specs[{i}] must be a KVCacheSpec, got {}", type_name(spec))))
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
    let chunk_obj = field("chunk_size")?;
    let chunk = opt_count(Some(&chunk_obj), &format!("specs[{i}].chunk_size"))?;
    let name = kind_str.to_str()?;
    let kind = GroupKind::from_name(name, window, chunk).map_err(|err| {
        PyValueError::new_err(match err {
            KindError::WindowRequired => {
                format!("specs[{i}].sliding_window must be an int >= 1 for a {name} group, got {window_obj}")
            }
            KindError::WindowNotAllowed => {
                format!("specs[{i}].sliding_window must be None for a {name} group, got {window_obj}")
            }
            KindError::ChunkRequired => {
                format!("specs[{i}].chunk_size must be an int >= 1 for a {name} group, got {chunk_obj}")
            }
            KindError::ChunkNotAllowed => {
                format!("specs[{i}].chunk_size must be None for a {name} group, got {chunk_obj}")
            }
            KindError::UnknownName => {
                format!("specs[{i}].kind must be {}, got {:?}", kind_choices(), clip(name))
            }
        })
    })?;
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

/// The kind names as messages list them: `'full', 'sliding_window', 'state' or 'chunked_local'`.
fn kind_choices() -> String {
    let quoted: Vec<String> = GroupKind::NAMES.iter().map(|n| format!("'{n}'")).collect();
    match quoted.split_last() {
        Some((last, [])) => last.clone(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
        None => String::new(),
    }
}

/// A keyword argument that names one of a few choices (a `str` that `from_name` knows); anything
/// else is a `ValueError` naming `arg` and listing `choices`.
pub fn named_choice<T>(
    obj: Borrowed<'_, '_, PyAny>,
    arg: &str,
    choices: &str,
    from_name: impl Fn(&str) -> Option<T>,
) -> PyResult<T> {
    let named = obj
        .cast::<PyString>()
        .ok()
        .and_then(|s| s.to_str().ok().and_then(&from_name));
    named.ok_or_else(|| {
        PyValueError::new_err(format!(
            "{arg} must be {choices}, got {}",
            clip(&obj.repr().map_or_else(|_| "?".to_owned(), |r| r.to_string()))
        ))
    })
}

/// The `eviction_order` argument (kept as passed): `"hybrid"` (left out) or `"group"`;
/// anything else is a `ValueError`.
pub fn eviction_order(arg: &Passed<'_>) -> PyResult<EvictionOrder> {
    arg.0.as_ref().map_or(Ok(EvictionOrder::Hybrid), |obj| {
        named_choice(
            obj.as_borrowed(),
            "eviction_order",
            "'hybrid' or 'group'",
            EvictionOrder::from_name,
        )
    })
}

/// The `eviction_policy` argument (kept as passed): `"lru"` (left out) or `"reuse"`; anything
/// else is a `ValueError`.
pub fn eviction_policy(arg: &Passed<'_>) -> PyResult<EvictionPolicy> {
    arg.0.as_ref().map_or(Ok(EvictionPolicy::Lru), |obj| {
        named_choice(
            obj.as_borrowed(),
            "eviction_policy",
            "'lru' or 'reuse'",
            EvictionPolicy::from_name,
        )
    })
}

/// `flat_kvcache.ArenaPlan`, `ArenaGroup` and `ArenaComponent`, imported on first use.
static ARENA_PLAN: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static ARENA_GROUP: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static ARENA_COMPONENT: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// The class `name` of `flat_kvcache._types`, kept in `cell`.
fn types_class<'py>(
    py: Python<'py>,
    cell: &'static PyOnceLock<Py<PyType>>,
    name: &str,
) -> PyResult<Bound<'py, PyType>> {
    let class = cell.get_or_try_init(py, || -> PyResult<Py<PyType>> {
        Ok(py
            .import("flat_kvcache._types")?
            .getattr(name)?
            .cast_into::<PyType>()?
            .unbind())
    })?;
    Ok(class.bind(py).clone())
}

/// The items of the plan's field `field` (`arena.groups`, `arena.components`), each an
/// instance of `class` (a `TypeError` naming `arena.<field>[i]` otherwise).
fn plan_items<'py>(
    arena: &Bound<'py, PyAny>,
    field: &str,
    class: &Bound<'py, PyType>,
) -> PyResult<Vec<Bound<'py, PyAny>>> {
    let what = class.name()?.to_string();
    let name = format!("arena.{field}");
    let mut items = Vec::new();
    for (i, item) in batch_iter(&arena.getattr(field)?, &name, &what)?.enumerate() {
        let item = item?;
        if !item.is_instance(class.as_any())? {
            return Err(PyTypeError::new_err(format!(
                "{name}[{i}] must be an {what}, got {}",
                type_name(&item)
            )));
        }
        items.push(item);
    }
    Ok(items)
}

/// The str field `name` of `item`, the `index`-th of the plan's `field`.
fn plan_text(item: &Bound<'_, PyAny>, field: &str, index: usize, name: &str) -> PyResult<String> {
    let value = item.getattr(name)?;
    let text = value.cast::<PyString>().map_err(|_| {
        PyTypeError::new_err(format!(
            "arena.{field}[{index}].{name} must be a str, got {}",
            type_name(&value)
        ))
    })?;
    Ok(text.to_str()?.to_owned())
}

/// The `arena=` argument of `FlatKVCache`: an `ArenaPlan` (`flat_kvcache.plan_arena`) laid
/// over the cache's groups `specs`, one page size per group in group order (a state group's
/// page is the whole unit). Read the same way as the reference's `arena_geometry`, in the
/// order of docs/engine-api.md ("Arena"): the plan's fields in their order (each group an
/// `ArenaGroup`, each component an `ArenaComponent`), then the plan in itself (no group
/// twice, every component in one of its groups), then against the specs (the same groups,
/// each laid out as its kind, every page group's pages of `arena.page_size` tokens).
pub fn arena_geometry(arena: &Bound<'_, PyAny>, specs: &[GroupSpec]) -> PyResult<ArenaGeometry> {
    let py = arena.py();
    if !arena.is_instance(types_class(py, &ARENA_PLAN, "ArenaPlan")?.as_any())? {
        return Err(PyTypeError::new_err(format!(
            "arena must be an ArenaPlan (from plan_arena), got {}",
            type_name(arena)
        )));
    }
    let page_size = count(&arena.getattr("page_size")?, "arena.page_size")?;
    count(&arena.getattr("alignment")?, "arena.alignment")?;
    let unit_bytes = count(&arena.getattr("unit_bytes")?, "arena.unit_bytes")?;
    let num_units = count(&arena.getattr("num_units")?, "arena.num_units")?;
    let mut planned: Vec<(String, String, u64)> = Vec::new();
    for (i, group) in plan_items(arena, "groups", &types_class(py, &ARENA_GROUP, "ArenaGroup")?)?
        .iter()
        .enumerate()
    {
        let gid = plan_text(group, "groups", i, "group_id")?;
        let kind = plan_text(group, "groups", i, "kind")?;
        let bytes = count(&group.getattr("item_bytes")?, &format!("arena.groups[{i}].item_bytes"))?;
        planned.push((gid, kind, bytes));
    }
    let mut placed = Vec::new();
    for (i, comp) in plan_items(
        arena,
        "components",
        &types_class(py, &ARENA_COMPONENT, "ArenaComponent")?,
    )?
    .iter()
    .enumerate()
    {
        placed.push(plan_text(comp, "components", i, "group_id")?);
    }
    for (i, (gid, _, _)) in planned.iter().enumerate() {
        if planned[..i].iter().any(|(earlier, _, _)| earlier == gid) {
            return Err(PyValueError::new_err(format!(
                "arena: the plan lists group {:?} twice",
                clip(gid)
            )));
        }
    }
    if let Some((i, gid)) = placed
        .iter()
        .enumerate()
        .find(|(_, gid)| !planned.iter().any(|(planned, _, _)| planned == *gid))
    {
        return Err(PyValueError::new_err(format!(
            "arena: arena.components[{i}] lies in group {:?}, which the plan does not list",
            clip(gid)
        )));
    }
    if let Some((gid, _, _)) = planned
        .iter()
        .find(|(gid, _, _)| !specs.iter().any(|s| &s.group_id == gid))
    {
        return Err(PyValueError::new_err(format!(
            "arena: the plan's group {:?} is not one of the cache's groups",
            clip(gid)
        )));
    }
    let mut page_bytes = Vec::with_capacity(specs.len());
    for spec in specs {
        let Some((_, kind, bytes)) = planned.iter().find(|(gid, _, _)| gid == &spec.group_id) else {
            return Err(PyValueError::new_err(format!(
                "arena: the plan has no group {:?} (a group of specs)",
                clip(&spec.group_id)
            )));
        };
        let want = if spec.kind == GroupKind::State {
            "state"
        } else {
            "pages"
        };
        if kind != want {
            return Err(PyValueError::new_err(format!(
                "arena: group {:?} is a {} group but the plan lays it out as {:?}",
                clip(&spec.group_id),
                spec.kind.name(),
                clip(kind)
            )));
        }
        if spec.kind != GroupKind::State && spec.page_size != page_size {
            return Err(PyValueError::new_err(format!(
                "arena: group {:?} has pages of {} tokens but the plan's pages hold {page_size} (arena.page_size)",
                clip(&spec.group_id),
                spec.page_size,
            )));
        }
        page_bytes.push(if spec.kind == GroupKind::State {
            unit_bytes
        } else {
            *bytes
        });
    }
    Ok(ArenaGeometry {
        unit_bytes,
        num_units,
        page_bytes,
    })
}
