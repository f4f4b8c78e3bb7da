//! The lightning indexer (SPEC.md sections 2 and 3): causal scores over compressed keys,
//! top-k selection, the scores of a selection and their backward.

pub mod cases;
pub mod reference;

pub use reference::{Causal, Dims};

use crate::backend::{alloc_output, common_device, select, BackendName};
use crate::check;
use crate::error::{Error, Result};
use crate::tensor::{DType, Device, Tensor, TensorView, TensorViewMut};

const OP: &str = "indexer";

/// Inputs shared by every indexer operation.
#[derive(Clone, Debug)]
pub struct IndexerArgs<'a> {
    /// `[B,S,H,D]` bf16 (f32 accepted by the reference).
    pub q: TensorView<'a>,
    /// `[B,P,D]`, q's dtype.
    pub pooled_kv: TensorView<'a>,
    /// `[B,S,H]` f32.
    pub weights: TensorView<'a>,
    pub softmax_scale: f32,
    /// `r >= 1`: pooled key `p` covers tokens `[p*r, (p+1)*r)`.
    pub compress_ratio: usize,
    /// Global position of local query 0 (context parallelism).
    pub query_start: usize,
    /// Length of the whole sequence (default `query_start + S`); checked, not used.
    pub query_total_len: Option<usize>,
}

impl<'a> IndexerArgs<'a> {
    pub fn new(q: TensorView<'a>, pooled_kv: TensorView<'a>, weights: TensorView<'a>, softmax_scale: f32, compress_ratio: usize) -> Self {
        IndexerArgs { q, pooled_kv, weights, softmax_scale, compress_ratio, query_start: 0, query_total_len: None }
    }

    pub fn causal(&self) -> Causal {
        Causal { compress_ratio: self.compress_ratio, query_start: self.query_start }
    }

    pub fn validate(&self) -> Result<(Dims, Device)> {
        check::dtype(OP, "q", &self.q, check::FLOATS)?;
        check::shape(OP, "q", &self.q, "[B,S,H,D]", &[None; 4])?;
        let (b, s, h, d) = (self.q.shape()[0], self.q.shape()[1], self.q.shape()[2], self.q.shape()[3]);
        check::at_least(OP, "q.shape[2] (heads)", h, 1)?;
        check::at_least(OP, "q.shape[3] (head_dim)", d, 1)?;
        check::dtype(OP, "pooled_kv", &self.pooled_kv, &[self.q.dtype()])?;
        check::shape(OP, "pooled_kv", &self.pooled_kv, "[B,P,D]", &[Some(b), None, Some(d)])?;
        check::dtype(OP, "weights", &self.weights, &[DType::F32])?;
        check::shape(OP, "weights", &self.weights, "[B,S,H]", &[Some(b), Some(s), Some(h)])?;
        check::finite(OP, "softmax_scale", self.softmax_scale as f64)?;
        check::at_least(OP, "compress_ratio", self.compress_ratio, 1)?;
        if let Some(total) = self.query_total_len {
            if self.query_start + s > total {
                return Err(Error::value(OP, "query_total_len", format!(">= query_start + S = {}", self.query_start + s), total));
            }
        }
        let device = common_device(OP, &[("q", &self.q), ("pooled_kv", &self.pooled_kv), ("weights", &self.weights)])?;
        Ok((Dims { b, s, h, d, p: self.pooled_kv.shape()[1] }, device))
    }

    fn validate_topk(&self, topk_indices: &TensorView) -> Result<(Dims, usize, Device)> {
        let (dm, device) = self.validate()?;
        check::dtype(OP, "topk_indices", topk_indices, check::INTS)?;
        check::shape(OP, "topk_indices", topk_indices, "[B,S,T]", &[Some(dm.b), Some(dm.s), None])?;
        common_device(OP, &[("q", &self.q), ("topk_indices", topk_indices)])?;
        Ok((dm, topk_indices.shape()[2], device))
    }
}

/// Backward inputs of `indexer_topk_scores`.
#[derive(Clone, Debug)]
pub struct IndexerTopkScoresBwdArgs<'a> {
    pub fwd: IndexerArgs<'a>,
    /// `[B,S,T]` integer, as given to the forward.
    pub topk_indices: TensorView<'a>,
    /// `[B,S,T]` f32, gradient of the selected scores (ignored where the score is -inf).
    pub grad: TensorView<'a>,
    /// Fixed-order reduction into `dpooled_kv` (bitwise reproducible).
    pub deterministic: bool,
}

impl IndexerTopkScoresBwdArgs<'_> {
    pub fn validate(&self) -> Result<(Dims, usize, Device)> {
        let (dm, t, device) = self.fwd.validate_topk(&self.topk_indices)?;
        check::dtype(OP, "grad", &self.grad, &[DType::F32])?;
        check::shape(OP, "grad", &self.grad, "[B,S,T]", &[Some(dm.b), Some(dm.s), Some(t)])?;
        common_device(OP, &[("q", &self.fwd.q), ("grad", &self.grad)])?;
        Ok((dm, t, device))
    }
}

/// Scores `[B,S,P]` f32 with the causal -inf (SPEC.md section 2).
pub fn indexer_scores(backend: BackendName, a: &IndexerArgs) -> Result<Tensor> {
    let (dm, device) = a.validate()?;
    let be = select(backend, "indexer_scores", device)?;
    let mut out = alloc_output(be, DType::F32, &[dm.b, dm.s, dm.p], device)?;
    be.indexer_scores(a, &mut out.view_mut())?;
    Ok(out)
}

pub fn indexer_scores_into(backend: BackendName, a: &IndexerArgs, out: &mut TensorViewMut) -> Result<()> {
    let (dm, device) = a.validate()?;
    check::output_on("indexer_scores", "out", out, device, DType::F32, &[dm.b, dm.s, dm.p], None)?;
    select(backend, "indexer_scores", device)?.indexer_scores(a, out)
}

fn validate_k(op: &'static str, k: usize) -> Result<()> {
    check::at_least(op, "k", k, 1)
}

/// Checks of `indexer_topk`: returns `(b, s, min(k, P), device)`.
fn validate_topk_input(scores: &TensorView, k: usize) -> Result<(usize, usize, usize, Device)> {
    const OP: &str = "indexer_topk";
    check::dtype(OP, "scores", scores, &[DType::F32])?;
    check::shape(OP, "scores", scores, "[B,S,P]", &[None; 3])?;
    validate_k(OP, k)?;
    Ok((scores.shape()[0], scores.shape()[1], k.min(scores.shape()[2]), scores.device()))
}

fn check_selection_outputs(op: &'static str, device: Device, shape: [usize; 3], indices: &TensorViewMut, values: &TensorViewMut) -> Result<()> {
    check::output_on(op, "indices", indices, device, DType::I32, &shape, None)?;
    check::output_on(op, "values", values, device, DType::F32, &shape, None)
}

/// Top-k of `[B,S,P]` f32 scores: `(indices [B,S,min(k,P)] i32, values f32)` (SPEC.md 3).
pub fn indexer_topk(backend: BackendName, scores: &TensorView, k: usize) -> Result<(Tensor, Tensor)> {
    let (b, s, kk, device) = validate_topk_input(scores, k)?;
    let be = select(backend, "indexer_topk", device)?;
    let mut idx = alloc_output(be, DType::I32, &[b, s, kk], device)?;
    let mut val = alloc_output(be, DType::F32, &[b, s, kk], device)?;
    be.indexer_topk(scores, k, &mut idx.view_mut(), &mut val.view_mut())?;
    Ok((idx, val))
}

/// `indexer_topk` into caller memory.
pub fn indexer_topk_into(backend: BackendName, scores: &TensorView, k: usize, indices: &mut TensorViewMut, values: &mut TensorViewMut) -> Result<()> {
    let (b, s, kk, device) = validate_topk_input(scores, k)?;
    check_selection_outputs("indexer_topk", device, [b, s, kk], indices, values)?;
    select(backend, "indexer_topk", device)?.indexer_topk(scores, k, indices, values)
}

/// Scores and top-k in one call (the lightning indexer's forward): returns
/// `(indices [B,S,min(k,P)] i32, values f32)`; a fast backend never materialises the
/// `[B,S,P]` scores.
pub fn lightning_indexer(backend: BackendName, a: &IndexerArgs, k: usize) -> Result<(Tensor, Tensor)> {
    const OP: &str = "lightning_indexer";
    let (dm, device) = a.validate()?;
    validate_k(OP, k)?;
    let be = select(backend, OP, device)?;
    let kk = k.min(dm.p);
    let mut idx = alloc_output(be, DType::I32, &[dm.b, dm.s, kk], device)?;
    let mut val = alloc_output(be, DType::F32, &[dm.b, dm.s, kk], device)?;
    be.indexer_fused_topk(a, k, &mut idx.view_mut(), &mut val.view_mut())?;
    Ok((idx, val))
}

/// `lightning_indexer` into caller memory.
pub fn lightning_indexer_into(backend: BackendName, a: &IndexerArgs, k: usize, indices: &mut TensorViewMut, values: &mut TensorViewMut) -> Result<()> {
    const OP: &str = "lightning_indexer";
    let (dm, device) = a.validate()?;
    validate_k(OP, k)?;
    check_selection_outputs(OP, device, [dm.b, dm.s, k.min(dm.p)], indices, values)?;
    select(backend, OP, device)?.indexer_fused_topk(a, k, indices, values)
}

/// Scores of a selection, `[B,S,T]` f32 (-inf where masked or not causally visible).
pub fn indexer_topk_scores(backend: BackendName, a: &IndexerArgs, topk_indices: &TensorView) -> Result<Tensor> {
    let (dm, t, device) = a.validate_topk(topk_indices)?;
    let be = select(backend, "indexer_topk_scores", device)?;
    let mut out = alloc_output(be, DType::F32, &[dm.b, dm.s, t], device)?;
    be.indexer_topk_scores(a, topk_indices, &mut out.view_mut())?;
    Ok(out)
}

/// `indexer_topk_scores` into caller memory.
pub fn indexer_topk_scores_into(backend: BackendName, a: &IndexerArgs, topk_indices: &TensorView, out: &mut TensorViewMut) -> Result<()> {
    let (dm, t, device) = a.validate_topk(topk_indices)?;
    check::output_on("indexer_topk_scores", "out", out, device, DType::F32, &[dm.b, dm.s, t], None)?;
    select(backend, "indexer_topk_scores", device)?.indexer_topk_scores(a, topk_indices, out)
}

/// Backward of `indexer_topk_scores`: `(dq (q's dtype), dweights f32, dpooled_kv f32)`.
pub fn indexer_topk_scores_backward(backend: BackendName, a: &IndexerTopkScoresBwdArgs) -> Result<(Tensor, Tensor, Tensor)> {
    let (dm, _, device) = a.validate()?;
    let be = select(backend, "indexer_topk_scores_backward", device)?;
    let mut dq = alloc_output(be, a.fwd.q.dtype(), &[dm.b, dm.s, dm.h, dm.d], device)?;
    let mut dw = alloc_output(be, DType::F32, &[dm.b, dm.s, dm.h], device)?;
    let mut dkv = alloc_output(be, DType::F32, &[dm.b, dm.p, dm.d], device)?;
    be.indexer_topk_scores_bwd(a, &mut dq.view_mut(), &mut dw.view_mut(), &mut dkv.view_mut())?;
    Ok((dq, dw, dkv))
}

/// `indexer_topk_scores_backward` into caller memory.
pub fn indexer_topk_scores_backward_into(backend: BackendName, a: &IndexerTopkScoresBwdArgs, dq: &mut TensorViewMut, dweights: &mut TensorViewMut, dpooled_kv: &mut TensorViewMut) -> Result<()> {
    const OP: &str = "indexer_topk_scores_backward";
    let (dm, _, device) = a.validate()?;
    check::output_on(OP, "dq", dq, device, a.fwd.q.dtype(), &[dm.b, dm.s, dm.h, dm.d], None)?;
    check::output_on(OP, "dweights", dweights, device, DType::F32, &[dm.b, dm.s, dm.h], None)?;
    check::output_on(OP, "dpooled_kv", dpooled_kv, device, DType::F32, &[dm.b, dm.p, dm.d], None)?;
    select(backend, OP, device)?.indexer_topk_scores_bwd(a, dq, dweights, dpooled_kv)
}
