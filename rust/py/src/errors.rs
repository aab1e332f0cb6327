//! Translation of core errors into Python exceptions, and checked extraction of Python ints.

use flat_kvcache_core::CoreError;
use pyo3::exceptions::{PyKeyError, PyMemoryError, PyOverflowError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBool;

/// Newtype that lets `?` turn a [`CoreError`] into a `PyErr` (the orphan rule forbids a direct impl).
pub struct PyCoreError(pub CoreError);

impl From<CoreError> for PyCoreError {
    fn from(err: CoreError) -> Self {
        Self(err)
    }
}

impl From<PyCoreError> for PyErr {
    fn from(err: PyCoreError) -> Self {
        let msg = err.0.to_string();
        match err.0 {
            CoreError::InvalidArgument(_) => PyValueError::new_err(msg),
            CoreError::Type(_) => PyTypeError::new_err(msg),
            CoreError::Overflow { .. } => PyOverflowError::new_err(msg),
            CoreError::Config(_) | CoreError::Invariant(_) => PyRuntimeError::new_err(msg),
            CoreError::UnknownRequest(_) => PyKeyError::new_err(msg),
            CoreError::OutOfMemory(_) => PyMemoryError::new_err(msg),
        }
    }
}

/// Map a core result into a Python result.
pub fn core<T>(result: Result<T, CoreError>) -> PyResult<T> {
    result.map_err(|e| PyErr::from(PyCoreError(e)))
}

/// Extract a non-negative Python int of any size as `u64`.
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
    let Ok(index) = obj.call_method0("__index__") else {
        return Err(PyTypeError::new_err(format!(
            "{name} must be an int, got {}",
            obj.get_type().name().map_or_else(|_| "?".to_owned(), |n| n.to_string())
        )));
    };
    if let Ok(v) = index.extract::<i128>() {
        return Ok(IntArg::Small(v));
    }
    if index.lt(0)? {
        Ok(IntArg::HugeNegative)
    } else {
        Ok(IntArg::HugePositive)
    }
}

/// The `OverflowError` raised when an argument does not fit the native type.
pub fn overflow(name: &str) -> PyErr {
    PyOverflowError::new_err(format!("{name}: value does not fit in an unsigned 64-bit integer"))
}
