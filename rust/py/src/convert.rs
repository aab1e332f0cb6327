//! Extraction of Python values into the "as seen" types the core checks: exact ints of any
//! size, type names, str-or-not, sequences.
//!
//! Extraction never decides anything: a bool or a float becomes a fact (`IntArg::Bool`,
//! `IntArg::Other("float")`) and the core raises the error in its own order.

use flat_kvcache_core::num::int::{self, Int};
use numpy::PyUntypedArray;
use pyo3::exceptions::{PyOverflowError, PyTypeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyByteArray, PyBytes, PyIterator, PyMapping, PyMemoryView, PyString, PyType};

/// Extract a non-negative Python int of any size as `u64` (a direct check, for bindings whose
/// core takes plain `u64`).
///
/// A bool or non-int is a `TypeError`, a negative value a `ValueError`, and a value above
/// `u64::MAX` an `OverflowError`; each message names `name`.
pub fn non_negative(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<u64> {
    match signed(obj, name)? {
        IntArg::Small(v) if v < 0 => Err(PyValueError::new_err(format!("{name} must be >= 0, got {v}"))),
        IntArg::Small(v) => u64::try_from(v).map_err(|_| overflow(name)),
        IntArg::HugeNegative => Err(PyValueError::new_err(format!("{name} must be >= 0, got {obj}"))),
        IntArg::HugePositive => Err(overflow(name)),
    }
}

/// A Python int classified by whether it fits an `i128`.
pub enum IntArg {
    /// The value fits an `i128`.
    Small(i128),
    /// A negative value below `i128::MIN`.
    HugeNegative,
    /// A positive value above `i128::MAX`.
    HugePositive,
}

/// Classify a Python int (bools and non-ints are a `TypeError` naming `name`).
pub fn signed(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<IntArg> {
    if obj.is_instance_of::<PyBool>() {
        return Err(PyTypeError::new_err(format!("{name} must be an int, not bool")));
    }
    let index = index_of(obj).map_err(|err| {
        err.unwrap_or_else(|| PyTypeError::new_err(format!("{name} must be an int, got {}", type_name(obj))))
    })?;
    if let Ok(v) = index.extract::<i128>() {
        return Ok(IntArg::Small(v));
    }
    if index.lt(0)? {
        Ok(IntArg::HugeNegative)
    } else {
        Ok(IntArg::HugePositive)
    }
}

/// `operator.index(obj)`, where `Err(None)` is the `TypeError` of an object that is not an
/// int (the caller words it, naming its argument) and `Err(Some(err))` any other exception a
/// custom `__index__` raised, which propagates (as the reference's `as_int` lets it).
pub fn index_of<'py>(obj: &Bound<'py, PyAny>) -> Result<Bound<'py, PyAny>, Option<PyErr>> {
    match obj.call_method0(intern!(obj.py(), "__index__")) {
        Ok(index) => Ok(index),
        Err(err) if err.is_instance_of::<PyTypeError>(obj.py()) => Err(None),
        // No `__index__` on the type at all: not an int.
        Err(_) if !type_has(obj, "__index__").unwrap_or(false) => Err(None),
        Err(err) => Err(Some(err)),
    }
}

/// The `OverflowError` raised when an argument does not fit the native type.
pub fn overflow(name: &str) -> PyErr {
    PyOverflowError::new_err(format!("{name}: value does not fit in an unsigned 64-bit integer"))
}

/// `str(obj)` (as the reference's f-strings print it).
pub fn text(obj: &Bound<'_, PyAny>) -> PyResult<String> {
    Ok(obj.str()?.to_string_lossy().into_owned())
}

/// True when `type(obj)` has the attribute (the reference's `hasattr(type(obj), name)`).
pub fn type_has(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<bool> {
    obj.get_type().hasattr(name)
}

/// The reference's `is_sequence`: indexable with a length, not a mapping (lists, tuples, 1-D
/// ndarrays and strs pass; callers refuse a bare str first). A 0-d ndarray has `__len__` on its
/// type but `len()` raises `TypeError`, so it is not a sequence.
pub fn is_sequence(obj: &Bound<'_, PyAny>) -> PyResult<bool> {
    if obj.is_instance_of::<PyMapping>() || !type_has(obj, "__getitem__")? {
        return Ok(false);
    }
    match obj.len() {
        Ok(_) => Ok(true),
        Err(err) if err.is_instance_of::<pyo3::exceptions::PyTypeError>(obj.py()) => Ok(false),
        Err(err) => Err(err),
    }
}

/// An int argument as the core sees it ([`int::IntArg`]: the reference's `as_int`, without raising): a bool is
/// `Bool`, anything `operator.index` refuses with `TypeError` is `Other(type name)`, anything
/// else its exact value. Other exceptions of a custom `__index__` propagate.
pub fn int_arg(obj: &Bound<'_, PyAny>) -> PyResult<int::IntArg> {
    if obj.is_instance_of::<PyBool>() {
        return Ok(int::IntArg::Bool);
    }
    // Fast path: most values fit i128 (the extraction goes through `__index__` too).
    if let Ok(v) = obj.extract::<i128>() {
        return Ok(int::IntArg::Int(Int::from(v)));
    }
    let py = obj.py();
    match py.import("operator")?.getattr("index")?.call1((obj,)) {
        Ok(index) => Ok(int::IntArg::Int(exact_int(&index)?)),
        Err(err) if err.is_instance_of::<PyTypeError>(py) => Ok(int::IntArg::Other(type_name(obj))),
        Err(err) => Err(err),
    }
}

/// The exact value of a Python `int` of any size (sign, then the magnitude's bytes).
fn exact_int(index: &Bound<'_, PyAny>) -> PyResult<Int> {
    let negative = index.lt(0)?;
    let magnitude = index.call_method0("__abs__")?;
    let bits: usize = magnitude.call_method0("bit_length")?.extract()?;
    let bytes = magnitude.call_method1("to_bytes", (bits.div_ceil(8), "little"))?;
    let bytes = bytes.cast::<PyBytes>()?;
    Ok(Int::from_magnitude_le_bytes(negative, bytes.as_bytes()))
}

/// An exact integer as a Python `int`.
pub fn int_to_py<'py>(py: Python<'py>, value: &Int) -> PyResult<Bound<'py, PyAny>> {
    if let Some(v) = value.to_i128() {
        return Ok(v.into_pyobject(py)?.into_any());
    }
    let bytes = PyBytes::new(py, &value.magnitude_le_bytes());
    let magnitude = py
        .get_type::<pyo3::types::PyInt>()
        .call_method1("from_bytes", (bytes, "little"))?;
    if value.is_negative() {
        magnitude.neg()
    } else {
        Ok(magnitude)
    }
}

/// An int argument of a `#[pyfunction]` (see [`int_arg`]); defaults are written in Rust, e.g.
/// `decode_input_tokens = IntParam::of(1)`.
pub struct IntParam(pub int::IntArg);

impl IntParam {
    /// A default value.
    pub fn of(v: u64) -> Self {
        Self(int::IntArg::from(v))
    }
}

impl<'a, 'py> FromPyObject<'a, 'py> for IntParam {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        int_arg(&obj).map(Self)
    }
}

/// True for a `str` (or subclass).
pub fn is_str(obj: &Bound<'_, PyAny>) -> bool {
    obj.is_instance_of::<PyString>()
}

/// True for text or bytes (`str`, `bytes`, `bytearray`, `memoryview`, subclasses included):
/// iterable, but never a batch of ids, ints or keys (a `bytes` would otherwise be read as
/// its byte values, `b"a"` as the id or token 97).
pub fn is_text_or_bytes(obj: &Bound<'_, PyAny>) -> bool {
    obj.is_instance_of::<PyString>()
        || obj.is_instance_of::<PyBytes>()
        || obj.is_instance_of::<PyByteArray>()
        || obj.is_instance_of::<PyMemoryView>()
}

/// `numpy.ma.MaskedArray`, looked up the first time an ndarray subclass is seen (None if
/// numpy cannot be imported).
static MASKED_ARRAY: PyOnceLock<Option<Py<PyType>>> = PyOnceLock::new();

/// True for a numpy masked array (`numpy.ma.MaskedArray` or a subclass): its data would be
/// read with the mask ignored, so no argument accepts one. A plain ndarray answers with one
/// type comparison and never imports `numpy.ma`.
pub fn is_masked(obj: &Bound<'_, PyAny>) -> bool {
    if obj.is_exact_instance_of::<PyUntypedArray>() || !obj.is_instance_of::<PyUntypedArray>() {
        return false;
    }
    let py = obj.py();
    let masked = MASKED_ARRAY.get_or_init(py, || {
        py.import("numpy.ma")
            .and_then(|ma| ma.getattr("MaskedArray"))
            .and_then(|ty| Ok(ty.cast_into::<PyType>()?.unbind()))
            .ok()
    });
    masked
        .as_ref()
        .is_some_and(|ty| obj.is_instance(ty.bind(py)).unwrap_or(false))
}

/// The `TypeError` for a masked array given as `name` (see [`is_masked`]).
pub fn masked_error(name: &str) -> PyErr {
    PyTypeError::new_err(format!("{name} must not be a masked array (its mask would be ignored)"))
}

/// The `TypeError` for `obj` given as the batch argument `name`, a sequence of `what`.
pub fn not_a_sequence(obj: &Bound<'_, PyAny>, name: &str, what: &str) -> PyErr {
    PyTypeError::new_err(format!("{name} must be a sequence of {what}, got {}", type_name(obj)))
}

/// The items of the batch argument `name` (a sequence of `what`) through the iterator
/// protocol: text or bytes ([`is_text_or_bytes`]), a masked array ([`is_masked`]) or anything
/// that is not iterable (`iter()` raises `TypeError`) is a `TypeError` naming `name`.
pub fn batch_iter<'py>(obj: &Bound<'py, PyAny>, name: &str, what: &str) -> PyResult<Bound<'py, PyIterator>> {
    if is_masked(obj) {
        return Err(masked_error(name));
    }
    if is_text_or_bytes(obj) {
        return Err(not_a_sequence(obj, name, what));
    }
    obj.try_iter().map_err(|err| {
        if err.is_instance_of::<PyTypeError>(obj.py()) {
            not_a_sequence(obj, name, what)
        } else {
            err
        }
    })
}

/// `type(obj).__name__`, for messages.
pub fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map_or_else(|_| "?".to_owned(), |name| name.to_string_lossy().into_owned())
}

/// At most 80 characters of `text`, for messages.
pub fn clip(text: &str) -> &str {
    text.char_indices().nth(80).map_or(text, |(i, _)| &text[..i])
}

/// The `device` of a torch tensor (anything with a `device` attribute and a `numpy()` method;
/// Rust never depends on torch), or None for anything else.
pub fn tensor_device<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Option<Bound<'py, PyAny>>> {
    let py = obj.py();
    let Ok(device) = obj.getattr(intern!(py, "device")) else {
        return Ok(None);
    };
    Ok(obj.hasattr(intern!(py, "numpy"))?.then_some(device))
}

/// Whether a tensor's `device` is the CPU (`device.type == "cpu"`).
pub fn is_cpu(device: &Bound<'_, PyAny>) -> bool {
    device.getattr(intern!(device.py(), "type")).is_ok_and(|kind| {
        kind.cast::<PyString>()
            .is_ok_and(|k| k.to_str().is_ok_and(|k| k == "cpu"))
    })
}

/// The numpy view of a CPU torch tensor (`.numpy()` shares its memory), or None for anything
/// else, including a tensor `numpy()` refuses (its elements are then read one by one, as for
/// any iterable).
pub fn cpu_tensor_numpy<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Option<Bound<'py, PyUntypedArray>>> {
    if !tensor_device(obj)?.is_some_and(|device| is_cpu(&device)) {
        return Ok(None);
    }
    Ok(obj
        .call_method0(intern!(obj.py(), "numpy"))
        .ok()
        .and_then(|view| view.cast_into::<PyUntypedArray>().ok()))
}
