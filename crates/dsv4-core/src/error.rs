//! One error type for the whole library. Every variant names what the user must fix.

use crate::tensor::{DType, Device};

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A tensor argument has the wrong shape.
    #[error("{op}: argument `{arg}` has shape {got:?}, expected {expected}")]
    Shape { op: &'static str, arg: &'static str, expected: String, got: Vec<usize> },

    /// A tensor argument has the wrong dtype.
    #[error("{op}: argument `{arg}` has dtype {got}, expected {expected}")]
    DType { op: &'static str, arg: &'static str, expected: String, got: DType },

    /// Tensors live on different devices, or on a device the backend cannot read.
    #[error("{op}: argument `{arg}` is on {got}, expected {expected}")]
    Device { op: &'static str, arg: &'static str, expected: String, got: Device },

    /// A scalar argument is out of its domain.
    #[error("{op}: argument `{arg}` = {got}, expected {expected}")]
    Value { op: &'static str, arg: &'static str, expected: String, got: String },

    /// A tensor layout the operation cannot take (e.g. an output that is not contiguous).
    #[error("{op}: argument `{arg}`: {reason}")]
    Layout { op: &'static str, arg: &'static str, reason: String },

    /// The named backend cannot run this call; `reason` says why.
    #[error("backend `{backend}` cannot run {op}: {reason}")]
    Unavailable { backend: String, op: &'static str, reason: String },

    /// Unknown backend name.
    #[error("unknown backend `{0}` (expected one of: reference, cuda, auto)")]
    UnknownBackend(String),

    /// A CUDA driver, NVRTC or launch failure.
    #[error("cuda: {0}")]
    Cuda(String),

    /// NVRTC rejected a kernel source.
    #[error("nvrtc: compiling `{kernel}` for {arch} failed (options: {options}):\n{log}")]
    Compile { kernel: String, arch: String, options: String, log: String },

    /// Reading a golden or other data file failed.
    #[error("{0}")]
    Data(String),
}

impl Error {
    pub fn value(op: &'static str, arg: &'static str, expected: impl Into<String>, got: impl ToString) -> Self {
        Error::Value { op, arg, expected: expected.into(), got: got.to_string() }
    }
}
