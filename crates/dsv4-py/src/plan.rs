//! `SparseIndexPlan` held natively: made once by `plan_sparse_indices`, passed by reference
//! to every sparse-attention call that shares the selection.

use dsv4_core::ops::sparse_indices::SparseIndexPlan;
use dsv4_core::Tensor;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::errors::IntoPy;

/// A plan in the layout of the backend it was made for; immutable.
#[pyclass(frozen, name = "NativeSparseIndexPlan", module = "dsv4_kernels._native")]
pub struct Plan {
    pub inner: SparseIndexPlan,
}

/// `(values in logical order, dtype name, shape)` of a plan tensor, copied to the host.
type HostCopy = (Vec<i64>, &'static str, Vec<usize>);

fn host_copy(t: &Tensor) -> PyResult<HostCopy> {
    let dtype = match t.dtype() {
        dsv4_core::DType::I32 => "i32",
        dsv4_core::DType::I64 => "i64",
        other => return Err(PyValueError::new_err(format!("plan tensor of dtype {other}"))),
    };
    Ok((t.to_i64_vec().py_err()?, dtype, t.shape().to_vec()))
}

#[pymethods]
impl Plan {
    /// The backend the layout is for (`"reference"` or `"cuda"`).
    #[getter]
    fn backend(&self) -> &'static str {
        self.inner.backend
    }
    /// K/V positions per batch row the coordinates refer to.
    #[getter]
    fn kv_sequence(&self) -> usize {
        self.inner.kv_len
    }
    #[getter]
    fn batch(&self) -> usize {
        self.inner.batch
    }
    #[getter]
    fn sequence(&self) -> usize {
        self.inner.seq
    }
    /// Slots per row of the selection the plan was made from.
    #[getter]
    fn slots(&self) -> usize {
        self.inner.slots
    }
    #[getter]
    fn all_rows_nonempty(&self) -> bool {
        self.inner.all_rows_nonempty
    }
    /// `"cpu"` or `"cuda:N"`: where the plan's tensors live.
    #[getter]
    fn device(&self) -> String {
        self.inner.indices.device().to_string()
    }
    /// A host copy of `indices`, `topk_length` or `valid_rows` (None where the plan has none).
    fn host_tensor(&self, name: &str) -> PyResult<Option<HostCopy>> {
        let t = match name {
            "indices" => Some(&self.inner.indices),
            "topk_length" => self.inner.topk_length.as_ref(),
            "valid_rows" => self.inner.valid_rows.as_ref(),
            other => return Err(PyValueError::new_err(format!("SparseIndexPlan has no tensor `{other}` (indices, topk_length, valid_rows)"))),
        };
        t.map(host_copy).transpose()
    }
    fn __repr__(&self) -> String {
        let p = &self.inner;
        format!("NativeSparseIndexPlan(backend={:?}, batch={}, sequence={}, slots={}, kv_sequence={}, indices={:?}, device={})", p.backend, p.batch, p.seq, p.slots, p.kv_len, p.indices.shape(), p.indices.device())
    }
}
