//! `dsv4_kernels._native`: the Python bindings of dsv4-kernels.
//!
//! Tensors cross as plain descriptors of caller memory (see [`desc`]); outputs are
//! preallocated by the Python layer (torch's allocator for torch tensors) and written in
//! place by the core `*_into` functions; core errors become Python exceptions that name
//! the argument (see [`errors`]). The CUDA backend is registered at import.

mod cuda;
mod desc;
mod errors;
mod ops;
mod plan;

use pyo3::prelude::*;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    cuda::register();
    m.add("BackendUnavailableError", m.py().get_type::<errors::BackendUnavailableError>())?;
    m.add("CUDA_LINKED", cfg!(feature = "cuda"))?;
    m.add_class::<plan::Plan>()?;
    m.add_function(wrap_pyfunction!(ops::sparse_attention_fwd, m)?)?;
    m.add_function(wrap_pyfunction!(ops::sparse_attention_bwd, m)?)?;
    m.add_function(wrap_pyfunction!(ops::dense_attention_topk, m)?)?;
    m.add_function(wrap_pyfunction!(ops::plan_sparse_indices, m)?)?;
    m.add_function(wrap_pyfunction!(ops::indexer_scores, m)?)?;
    m.add_function(wrap_pyfunction!(ops::indexer_topk, m)?)?;
    m.add_function(wrap_pyfunction!(ops::lightning_indexer, m)?)?;
    m.add_function(wrap_pyfunction!(ops::indexer_topk_scores, m)?)?;
    m.add_function(wrap_pyfunction!(ops::indexer_topk_scores_bwd, m)?)?;
    m.add_function(wrap_pyfunction!(ops::sinkhorn_fwd, m)?)?;
    m.add_function(wrap_pyfunction!(ops::sinkhorn_bwd, m)?)?;
    m.add_function(wrap_pyfunction!(ops::qnorm_rope_fwd, m)?)?;
    m.add_function(wrap_pyfunction!(ops::qnorm_rope_bwd, m)?)?;
    m.add_function(wrap_pyfunction!(ops::build_indices_width, m)?)?;
    m.add_function(wrap_pyfunction!(ops::build_sparse_topk_indices, m)?)?;
    m.add_function(wrap_pyfunction!(ops::is_kernel_available, m)?)?;
    m.add_function(wrap_pyfunction!(ops::describe, m)?)?;
    m.add_function(wrap_pyfunction!(ops::set_stream, m)?)?;
    m.add_function(wrap_pyfunction!(cuda::set_workspace_allocator, m)?)?;
    Ok(())
}
