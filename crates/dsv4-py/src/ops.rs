//! One Python function per core operation: descriptors in, outputs written into the
//! caller's preallocated memory (the GIL released around a reference compute; see
//! `cuda::compute`).
//!
//! Every function builds its views from descriptors with `Desc::view`/`view_mut`.
//! SAFETY (for every `unsafe` block below that does so): `dsv4_kernels` (the only
//! caller) builds each descriptor from a torch tensor or numpy array that it holds for
//! the whole call — data pointer, dtype, shape and strides read off the object itself —
//! and allocates every output fresh or takes it as the user's `out=`, which it checks
//! does not overlap an input; the core validates shapes, dtypes, devices and output
//! layouts before touching memory.

use dsv4_core::ops::indexer::{self, IndexerArgs, IndexerTopkScoresBwdArgs};
use dsv4_core::ops::qnorm_rope::{self, QNormRopeArgs};
use dsv4_core::ops::sinkhorn::{self, SinkhornArgs};
use dsv4_core::ops::sparse_attention::{self as sa, BackwardImpl, SparseAttentionArgs, SparseAttentionBwdArgs, SparseIndices};
use dsv4_core::ops::sparse_indices::{self as si, BuildIndicesArgs, SparseIndexPlan};
use dsv4_core::{BackendName, Device, TensorView};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::desc::Desc;
use crate::errors::IntoPy;
use crate::plan::Plan;

fn backend_name(name: &str) -> PyResult<BackendName> {
    name.parse().py_err()
}

/// The arguments of a sparse-attention call; exactly one of `topk_idxs` and `plan`.
#[allow(clippy::too_many_arguments)]
fn attention_args<'a>(op: &'static str, q: TensorView<'a>, kv: TensorView<'a>, sinks: TensorView<'a>, topk_idxs: Option<TensorView<'a>>, plan: Option<&'a SparseIndexPlan>, sm_scale: f32, reference_rounding: bool, all_rows_nonempty: bool) -> PyResult<SparseAttentionArgs<'a>> {
    let indices = match (topk_idxs, plan) {
        (_, Some(p)) => SparseIndices::Plan(p),
        (Some(i), None) => SparseIndices::TopK(i),
        (None, None) => return Err(PyValueError::new_err(format!("{op}: argument `topk_idxs` is None and no `plan` was given"))),
    };
    Ok(SparseAttentionArgs { q, kv, sinks, indices, sm_scale, reference_rounding, all_rows_nonempty })
}

/// Sparse attention forward into `out [B,S,H,D]` (q's dtype) and `lse [B,S,H]` f32.
#[pyfunction]
#[pyo3(signature = (*, backend, q, kv, sinks, topk_idxs, plan, sm_scale, reference_rounding, all_rows_nonempty, out, lse))]
#[allow(clippy::too_many_arguments)]
pub fn sparse_attention_fwd(py: Python<'_>, backend: &str, q: Desc, kv: Desc, sinks: Desc, topk_idxs: Option<Desc>, plan: Option<PyRef<'_, Plan>>, sm_scale: f32, reference_rounding: bool, all_rows_nonempty: bool, out: Desc, lse: Desc) -> PyResult<()> {
    const OP: &str = "sparse_attention";
    let be = backend_name(backend)?;
    let plan = plan.as_deref().map(|p| &p.inner);
    // SAFETY: see the module documentation.
    let (qv, kvv, sv, iv, mut ov, mut lv) = unsafe { (q.view(OP, "q")?, kv.view(OP, "kv")?, sinks.view(OP, "sinks")?, topk_idxs.as_ref().map(|d| d.view(OP, "topk_idxs")).transpose()?, out.view_mut(OP, "out")?, lse.view_mut(OP, "lse")?) };
    let args = attention_args(OP, qv, kvv, sv, iv, plan, sm_scale, reference_rounding, all_rows_nonempty)?;
    crate::cuda::compute(py, be, || sa::sparse_attention_into(be, &args, &mut ov, &mut lv)).py_err()
}

/// Sparse attention backward into `dq` (q's dtype), `dkv` (kv's dtype), `dsinks [H]` f32.
#[pyfunction]
#[pyo3(signature = (*, backend, q, kv, sinks, topk_idxs, plan, sm_scale, reference_rounding, all_rows_nonempty, out, lse, dout, backward_impl, backward_workspace_bytes, dq, dkv, dsinks))]
#[allow(clippy::too_many_arguments)]
pub fn sparse_attention_bwd(
    py: Python<'_>,
    backend: &str,
    q: Desc,
    kv: Desc,
    sinks: Desc,
    topk_idxs: Option<Desc>,
    plan: Option<PyRef<'_, Plan>>,
    sm_scale: f32,
    reference_rounding: bool,
    all_rows_nonempty: bool,
    out: Desc,
    lse: Desc,
    dout: Desc,
    backward_impl: &str,
    backward_workspace_bytes: usize,
    dq: Desc,
    dkv: Desc,
    dsinks: Desc,
) -> PyResult<()> {
    const OP: &str = "sparse_attention_backward";
    let be = backend_name(backend)?;
    let imp: BackwardImpl = backward_impl.parse().py_err()?;
    let plan = plan.as_deref().map(|p| &p.inner);
    // SAFETY: see the module documentation.
    let (qv, kvv, sv, iv) = unsafe { (q.view(OP, "q")?, kv.view(OP, "kv")?, sinks.view(OP, "sinks")?, topk_idxs.as_ref().map(|d| d.view(OP, "topk_idxs")).transpose()?) };
    // SAFETY: see the module documentation.
    let (ov, lv, dov) = unsafe { (out.view(OP, "out")?, lse.view(OP, "lse")?, dout.view(OP, "dout")?) };
    // SAFETY: see the module documentation.
    let (mut dqv, mut dkvv, mut dsv) = unsafe { (dq.view_mut(OP, "dq")?, dkv.view_mut(OP, "dkv")?, dsinks.view_mut(OP, "dsinks")?) };
    let fwd = attention_args(OP, qv, kvv, sv, iv, plan, sm_scale, reference_rounding, all_rows_nonempty)?;
    let args = SparseAttentionBwdArgs { fwd, out: ov, lse: lv, dout: dov, backward_impl: imp, backward_workspace_bytes };
    crate::cuda::compute(py, be, || sa::sparse_attention_backward_into(be, &args, &mut dqv, &mut dkvv, &mut dsv)).py_err()
}

/// The dense oracle into `out [B,S,H,D]` (q's dtype).
#[pyfunction]
#[pyo3(signature = (*, backend, q, kv, sinks, topk_idxs, sm_scale, out))]
#[allow(clippy::too_many_arguments)]
pub fn dense_attention_topk(py: Python<'_>, backend: &str, q: Desc, kv: Desc, sinks: Desc, topk_idxs: Desc, sm_scale: f32, out: Desc) -> PyResult<()> {
    const OP: &str = "dense_attention_topk";
    let be = backend_name(backend)?;
    // SAFETY: see the module documentation.
    let (qv, kvv, sv, iv, mut ov) = unsafe { (q.view(OP, "q")?, kv.view(OP, "kv")?, sinks.view(OP, "sinks")?, topk_idxs.view(OP, "topk_idxs")?, out.view_mut(OP, "out")?) };
    let args = attention_args(OP, qv, kvv, sv, Some(iv), None, sm_scale, false, false)?;
    crate::cuda::compute(py, be, || sa::dense_attention_topk_into(be, &args, &mut ov)).py_err()
}

/// A sparse index plan for `backend` (its tensors owned by the plan).
#[pyfunction]
#[pyo3(signature = (*, backend, topk_idxs, kv_len, all_rows_nonempty))]
pub fn plan_sparse_indices(py: Python<'_>, backend: &str, topk_idxs: Desc, kv_len: usize, all_rows_nonempty: bool) -> PyResult<Plan> {
    const OP: &str = "plan_sparse_indices";
    let be = backend_name(backend)?;
    // SAFETY: see the module documentation.
    let iv = unsafe { topk_idxs.view(OP, "topk_idxs")? };
    let inner = crate::cuda::compute(py, be, || si::plan_sparse_indices(be, &iv, kv_len, all_rows_nonempty)).py_err()?;
    Ok(Plan { inner })
}

#[allow(clippy::too_many_arguments)]
fn indexer_args<'a>(q: TensorView<'a>, pooled_kv: TensorView<'a>, weights: TensorView<'a>, softmax_scale: f32, compress_ratio: usize, query_start: usize, query_total_len: Option<usize>) -> IndexerArgs<'a> {
    IndexerArgs { q, pooled_kv, weights, softmax_scale, compress_ratio, query_start, query_total_len }
}

/// Indexer scores `[B,S,P]` f32 with the causal -inf into `out`.
#[pyfunction]
#[pyo3(signature = (*, backend, q, pooled_kv, weights, softmax_scale, compress_ratio, query_start, query_total_len, out))]
#[allow(clippy::too_many_arguments)]
pub fn indexer_scores(py: Python<'_>, backend: &str, q: Desc, pooled_kv: Desc, weights: Desc, softmax_scale: f32, compress_ratio: usize, query_start: usize, query_total_len: Option<usize>, out: Desc) -> PyResult<()> {
    const OP: &str = "indexer_scores";
    let be = backend_name(backend)?;
    // SAFETY: see the module documentation.
    let (qv, kvv, wv, mut ov) = unsafe { (q.view(OP, "q")?, pooled_kv.view(OP, "pooled_kv")?, weights.view(OP, "weights")?, out.view_mut(OP, "out")?) };
    let a = indexer_args(qv, kvv, wv, softmax_scale, compress_ratio, query_start, query_total_len);
    crate::cuda::compute(py, be, || indexer::indexer_scores_into(be, &a, &mut ov)).py_err()
}

/// Top-k of `[B,S,P]` f32 scores into `indices [B,S,min(k,P)]` i32 and `values` f32.
#[pyfunction]
#[pyo3(signature = (*, backend, scores, k, indices, values))]
pub fn indexer_topk(py: Python<'_>, backend: &str, scores: Desc, k: usize, indices: Desc, values: Desc) -> PyResult<()> {
    const OP: &str = "indexer_topk";
    let be = backend_name(backend)?;
    // SAFETY: see the module documentation.
    let (sv, mut iv, mut vv) = unsafe { (scores.view(OP, "scores")?, indices.view_mut(OP, "indices")?, values.view_mut(OP, "values")?) };
    crate::cuda::compute(py, be, || indexer::indexer_topk_into(be, &sv, k, &mut iv, &mut vv))
    .py_err()
}

/// Scores and top-k in one call (the lightning indexer forward) into `indices`/`values`.
#[pyfunction]
#[pyo3(signature = (*, backend, q, pooled_kv, weights, softmax_scale, compress_ratio, query_start, query_total_len, k, indices, values))]
#[allow(clippy::too_many_arguments)]
pub fn lightning_indexer(py: Python<'_>, backend: &str, q: Desc, pooled_kv: Desc, weights: Desc, softmax_scale: f32, compress_ratio: usize, query_start: usize, query_total_len: Option<usize>, k: usize, indices: Desc, values: Desc) -> PyResult<()> {
    const OP: &str = "lightning_indexer";
    let be = backend_name(backend)?;
    // SAFETY: see the module documentation.
    let (qv, kvv, wv) = unsafe { (q.view(OP, "q")?, pooled_kv.view(OP, "pooled_kv")?, weights.view(OP, "weights")?) };
    // SAFETY: see the module documentation.
    let (mut iv, mut vv) = unsafe { (indices.view_mut(OP, "indices")?, values.view_mut(OP, "values")?) };
    let a = indexer_args(qv, kvv, wv, softmax_scale, compress_ratio, query_start, query_total_len);
    crate::cuda::compute(py, be, || indexer::lightning_indexer_into(be, &a, k, &mut iv, &mut vv))
    .py_err()
}

/// Scores of a selection, `[B,S,T]` f32 (-inf where masked or not visible), into `out`.
#[pyfunction]
#[pyo3(signature = (*, backend, q, pooled_kv, weights, softmax_scale, compress_ratio, query_start, query_total_len, topk_indices, out))]
#[allow(clippy::too_many_arguments)]
pub fn indexer_topk_scores(py: Python<'_>, backend: &str, q: Desc, pooled_kv: Desc, weights: Desc, softmax_scale: f32, compress_ratio: usize, query_start: usize, query_total_len: Option<usize>, topk_indices: Desc, out: Desc) -> PyResult<()> {
    const OP: &str = "indexer_topk_scores";
    let be = backend_name(backend)?;
    // SAFETY: see the module documentation.
    let (qv, kvv, wv, tv, mut ov) = unsafe { (q.view(OP, "q")?, pooled_kv.view(OP, "pooled_kv")?, weights.view(OP, "weights")?, topk_indices.view(OP, "topk_indices")?, out.view_mut(OP, "out")?) };
    let a = indexer_args(qv, kvv, wv, softmax_scale, compress_ratio, query_start, query_total_len);
    crate::cuda::compute(py, be, || indexer::indexer_topk_scores_into(be, &a, &tv, &mut ov))
    .py_err()
}

/// Backward of `indexer_topk_scores` into `dq` (q's dtype), `dweights [B,S,H]` f32 and
/// `dpooled_kv [B,P,D]` f32.
#[pyfunction]
#[pyo3(signature = (*, backend, q, pooled_kv, weights, softmax_scale, compress_ratio, query_start, query_total_len, topk_indices, grad, deterministic, dq, dweights, dpooled_kv))]
#[allow(clippy::too_many_arguments)]
pub fn indexer_topk_scores_bwd(
    py: Python<'_>,
    backend: &str,
    q: Desc,
    pooled_kv: Desc,
    weights: Desc,
    softmax_scale: f32,
    compress_ratio: usize,
    query_start: usize,
    query_total_len: Option<usize>,
    topk_indices: Desc,
    grad: Desc,
    deterministic: bool,
    dq: Desc,
    dweights: Desc,
    dpooled_kv: Desc,
) -> PyResult<()> {
    const OP: &str = "indexer_topk_scores_backward";
    let be = backend_name(backend)?;
    // SAFETY: see the module documentation.
    let (qv, kvv, wv, tv, gv) = unsafe { (q.view(OP, "q")?, pooled_kv.view(OP, "pooled_kv")?, weights.view(OP, "weights")?, topk_indices.view(OP, "topk_indices")?, grad.view(OP, "grad")?) };
    // SAFETY: see the module documentation.
    let (mut dqv, mut dwv, mut dkv) = unsafe { (dq.view_mut(OP, "dq")?, dweights.view_mut(OP, "dweights")?, dpooled_kv.view_mut(OP, "dpooled_kv")?) };
    let fwd = indexer_args(qv, kvv, wv, softmax_scale, compress_ratio, query_start, query_total_len);
    let args = IndexerTopkScoresBwdArgs { fwd, topk_indices: tv, grad: gv, deterministic };
    crate::cuda::compute(py, be, || indexer::indexer_topk_scores_backward_into(be, &args, &mut dqv, &mut dwv, &mut dkv))
    .py_err()
}

/// Sinkhorn forward into `out` (x's shape, f32).
#[pyfunction]
#[pyo3(signature = (*, backend, x, repeat, eps, out))]
pub fn sinkhorn_fwd(py: Python<'_>, backend: &str, x: Desc, repeat: usize, eps: f32, out: Desc) -> PyResult<()> {
    const OP: &str = "sinkhorn_normalize";
    let be = backend_name(backend)?;
    // SAFETY: see the module documentation.
    let (xv, mut ov) = unsafe { (x.view(OP, "x")?, out.view_mut(OP, "out")?) };
    let a = SinkhornArgs { x: xv, repeat, eps };
    crate::cuda::compute(py, be, || sinkhorn::sinkhorn_normalize_into(be, &a, &mut ov)).py_err()
}

/// Sinkhorn backward into `dx` (x's shape, f32); `dout` may have any strides.
#[pyfunction]
#[pyo3(signature = (*, backend, x, repeat, eps, dout, dx))]
pub fn sinkhorn_bwd(py: Python<'_>, backend: &str, x: Desc, repeat: usize, eps: f32, dout: Desc, dx: Desc) -> PyResult<()> {
    const OP: &str = "sinkhorn_normalize_backward";
    let be = backend_name(backend)?;
    // SAFETY: see the module documentation.
    let (xv, gv, mut dv) = unsafe { (x.view(OP, "x")?, dout.view(OP, "dout")?, dx.view_mut(OP, "dx")?) };
    let a = SinkhornArgs { x: xv, repeat, eps };
    crate::cuda::compute(py, be, || sinkhorn::sinkhorn_normalize_backward_into(be, &a, &gv, &mut dv)).py_err()
}

/// qnorm_rope forward into `out` (logical `[B,H,S,C]`, token-major storage) and `rstd [B*S*H]`.
#[pyfunction]
#[pyo3(signature = (*, backend, x, cos, sin, rotary, eps, out, rstd))]
#[allow(clippy::too_many_arguments)]
pub fn qnorm_rope_fwd(py: Python<'_>, backend: &str, x: Desc, cos: Desc, sin: Desc, rotary: usize, eps: f32, out: Desc, rstd: Desc) -> PyResult<()> {
    const OP: &str = "qnorm_rope";
    let be = backend_name(backend)?;
    // SAFETY: see the module documentation.
    let (xv, cv, sv, mut ov, mut rv) = unsafe { (x.view(OP, "x")?, cos.view(OP, "cos")?, sin.view(OP, "sin")?, out.view_mut(OP, "out")?, rstd.view_mut(OP, "rstd")?) };
    let a = QNormRopeArgs { x: xv, cos: cv, sin: sv, rotary, eps };
    crate::cuda::compute(py, be, || qnorm_rope::qnorm_rope_into(be, &a, &mut ov, &mut rv)).py_err()
}

/// qnorm_rope backward into `dx` (logical `[B,H,S,C]`, token-major); `grad` any strides.
#[pyfunction]
#[pyo3(signature = (*, backend, x, cos, sin, rotary, eps, rstd, grad, dx))]
#[allow(clippy::too_many_arguments)]
pub fn qnorm_rope_bwd(py: Python<'_>, backend: &str, x: Desc, cos: Desc, sin: Desc, rotary: usize, eps: f32, rstd: Desc, grad: Desc, dx: Desc) -> PyResult<()> {
    const OP: &str = "qnorm_rope_backward";
    let be = backend_name(backend)?;
    // SAFETY: see the module documentation.
    let (xv, cv, sv, rv, gv, mut dv) = unsafe { (x.view(OP, "x")?, cos.view(OP, "cos")?, sin.view(OP, "sin")?, rstd.view(OP, "rstd")?, grad.view(OP, "grad")?, dx.view_mut(OP, "dx")?) };
    let a = QNormRopeArgs { x: xv, cos: cv, sin: sv, rotary, eps };
    crate::cuda::compute(py, be, || qnorm_rope::qnorm_rope_backward_into(be, &a, &rv, &gv, &mut dv)).py_err()
}

/// The width `W'` of `build_sparse_topk_indices`'s result for these arguments.
#[pyfunction]
#[pyo3(signature = (*, batch_size, seq_len, key_len, window_size, compress_ratio, n_pooled, compressed_width, vanilla_key_len, vision, max_image_tokens))]
#[allow(clippy::too_many_arguments)]
pub fn build_indices_width(batch_size: usize, seq_len: usize, key_len: usize, window_size: usize, compress_ratio: usize, n_pooled: usize, compressed_width: Option<usize>, vanilla_key_len: Option<usize>, vision: bool, max_image_tokens: usize) -> usize {
    si::BuildDims {
        batch_size,
        seq_len,
        key_len,
        window_size,
        compress_ratio,
        n_pooled,
        compressed_width: compressed_width.unwrap_or(0),
        has_compressed_topk: compressed_width.is_some(),
        vanilla_key_len: vanilla_key_len.unwrap_or(seq_len),
        vision: vision && max_image_tokens > 0,
        max_image_tokens,
        mask_width: 0,
    }
    .width()
}

/// `build_sparse_topk_indices` into `out [B,S,W']` i32 on `device` (-1 host, else CUDA).
#[pyfunction]
#[pyo3(signature = (*, backend, batch_size, seq_len, key_len, window_size, device, attention_mask, compress_ratio, compressed_topk, n_pooled, vanilla_key_len, q_positions, vision_token_types, max_image_tokens, out))]
#[allow(clippy::too_many_arguments)]
pub fn build_sparse_topk_indices(
    py: Python<'_>,
    backend: &str,
    batch_size: usize,
    seq_len: usize,
    key_len: usize,
    window_size: usize,
    device: i64,
    attention_mask: Option<Desc>,
    compress_ratio: usize,
    compressed_topk: Option<Desc>,
    n_pooled: usize,
    vanilla_key_len: Option<usize>,
    q_positions: Option<Desc>,
    vision_token_types: Option<Desc>,
    max_image_tokens: usize,
    out: Desc,
) -> PyResult<()> {
    const OP: &str = "build_sparse_topk_indices";
    let be = backend_name(backend)?;
    fn opt<'a>(d: &'a Option<Desc>, arg: &'static str) -> PyResult<Option<TensorView<'a>>> {
        // SAFETY: see the module documentation.
        d.as_ref().map(|d| unsafe { d.view(OP, arg) }).transpose()
    }
    let mut a = BuildIndicesArgs::new(batch_size, seq_len, key_len, window_size);
    a.device = if device < 0 { Device::Cpu } else { Device::Cuda(device as usize) };
    a.attention_mask = opt(&attention_mask, "attention_mask")?;
    a.compress_ratio = compress_ratio;
    a.compressed_topk = opt(&compressed_topk, "compressed_topk")?;
    a.n_pooled = n_pooled;
    a.vanilla_key_len = vanilla_key_len;
    a.q_positions = opt(&q_positions, "q_positions")?;
    a.vision_token_types = opt(&vision_token_types, "vision_token_types")?;
    a.max_image_tokens = max_image_tokens;
    // SAFETY: see the module documentation.
    let mut ov = unsafe { out.view_mut(OP, "out")? };
    crate::cuda::compute(py, be, || si::build_sparse_topk_indices_into(be, &a, &mut ov)).py_err()
}

/// Whether this project's GPU kernels for `family` can run in this process.
#[pyfunction]
pub fn is_kernel_available(family: &str) -> bool {
    dsv4_core::is_kernel_available(family)
}

/// Lines describing the backends this process can use.
#[pyfunction]
pub fn describe() -> Vec<String> {
    let mut lines = dsv4_core::backend::reference_backend().describe();
    match dsv4_core::backend::cuda_backend() {
        Ok(b) => lines.extend(b.describe()),
        Err(why) => lines.push(format!("cuda: unavailable ({why})")),
    }
    lines
}

/// Make the CUDA backend launch on `stream` (a `cudaStream_t` as an integer; 0 is the
/// legacy default stream) for device `ordinal`. Returns whether a CUDA backend is linked.
#[pyfunction]
pub fn set_stream(ordinal: usize, stream: u64) -> PyResult<bool> {
    crate::cuda::set_stream(ordinal, stream)
}
