//! Translation of core errors into Python exceptions.
//!
//! The failures a caller may want to catch by kind raise the classes of `flat_kvcache.errors`
//! (each subclasses the builtin raised before those classes existed); argument errors stay
//! plain builtins. Messages are the core's, unchanged.

use std::sync::{Mutex, MutexGuard};

use flat_kvcache_core::CoreError;
use pyo3::exceptions::{PyMemoryError, PyOverflowError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;

pyo3::import_exception!(flat_kvcache.errors, ConfigError);
pyo3::import_exception!(flat_kvcache.errors, FlatUnavailableError);
pyo3::import_exception!(flat_kvcache.errors, InvariantError);
pyo3::import_exception!(flat_kvcache.errors, UnknownRequestError);

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
            CoreError::Config(_) => ConfigError::new_err(msg),
            CoreError::FlatUnavailable => FlatUnavailableError::new_err(msg),
            CoreError::Invariant(_) => InvariantError::new_err(msg),
            CoreError::UnknownRequest(_) | CoreError::UnknownSlot { .. } => UnknownRequestError::new_err(msg),
            CoreError::OutOfMemory(_) => PyMemoryError::new_err(msg),
        }
    }
}

/// Map a core result into a Python result.
pub fn core<T>(result: Result<T, CoreError>) -> PyResult<T> {
    result.map_err(|e| PyErr::from(PyCoreError(e)))
}

/// Lock `m`, or a `RuntimeError` if an earlier panic poisoned it.
pub fn lock<T>(m: &Mutex<T>) -> PyResult<MutexGuard<'_, T>> {
    m.lock()
        .map_err(|_| PyRuntimeError::new_err("flat_kvcache: internal state poisoned by an earlier panic"))
}
