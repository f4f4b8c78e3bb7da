//! `dsv4_core::Error` as Python exceptions; the message is the Rust one, which names the
//! operation and the argument.

use dsv4_core::Error;
use pyo3::create_exception;
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::PyErr;

create_exception!(
    _native,
    BackendUnavailableError,
    PyRuntimeError,
    "The named backend cannot run this call (no driver, CPU tensors for `cuda`, an unsupported dtype or shape); the message says why."
);

/// Shape, layout, scalar and backend-name errors are `ValueError`, dtype errors
/// `TypeError`, an unavailable backend `BackendUnavailableError` (a `RuntimeError`), and
/// device, driver and compile failures `RuntimeError`.
pub fn to_py(e: Error) -> PyErr {
    let msg = e.to_string();
    match e {
        Error::Shape { .. } | Error::Layout { .. } | Error::Value { .. } | Error::UnknownBackend(_) => PyValueError::new_err(msg),
        Error::DType { .. } => PyTypeError::new_err(msg),
        Error::Unavailable { .. } => BackendUnavailableError::new_err(msg),
        _ => PyRuntimeError::new_err(msg),
    }
}

pub trait IntoPy<T> {
    fn py_err(self) -> pyo3::PyResult<T>;
}

impl<T> IntoPy<T> for dsv4_core::Result<T> {
    fn py_err(self) -> pyo3::PyResult<T> {
        self.map_err(to_py)
    }
}
