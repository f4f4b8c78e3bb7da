//! The CPU reference backend: reads the (validated) views into f32, runs each op's
//! `reference.rs` math with f32 accumulation, writes the outputs in their dtypes.

use crate::backend::KernelBackend;
use crate::error::{Error, Result};
use crate::ops::indexer::{self, IndexerArgs, IndexerTopkScoresBwdArgs};
use crate::ops::qnorm_rope::{self, QNormRopeArgs};
use crate::ops::sinkhorn::{self, SinkhornArgs};
use crate::ops::sparse_attention::{self, SparseAttentionArgs, SparseAttentionBwdArgs};
use crate::ops::sparse_indices::{self, BuildIndicesArgs, SparseIndexPlan};
use crate::tensor::{DType, Device, Tensor, TensorView, TensorViewMut};

pub struct Reference;

fn host_only(op: &'static str) -> Error {
    Error::Unavailable { backend: "reference".into(), op, reason: "the reference backend computes on CPU tensors".into() }
}

impl KernelBackend for Reference {
    fn name(&self) -> &'static str {
        "reference"
    }

    fn describe(&self) -> Vec<String> {
        vec![format!("reference: CPU, f32 accumulation, {} threads (rayon)", rayon::current_num_threads())]
    }

    fn family_available(&self, _family: &str) -> bool {
        true
    }

    fn alloc(&self, dtype: DType, shape: &[usize], device: Device) -> Result<Tensor> {
        match device {
            Device::Cpu => Ok(Tensor::zeros(dtype, shape)),
            _ => Err(host_only("alloc")),
        }
    }

    fn upload(&self, src: &TensorView, device: Device) -> Result<Tensor> {
        match device {
            Device::Cpu => src.to_tensor(),
            _ => Err(host_only("upload")),
        }
    }

    fn synchronize(&self, _device: Device) -> Result<()> {
        Ok(())
    }

    fn sparse_attention_fwd(&self, a: &SparseAttentionArgs, out: &mut TensorViewMut, lse: &mut TensorViewMut) -> Result<()> {
        let (dm, _) = a.validate()?;
        let (idx, width) = a.host_indices(dm)?;
        let (o, l) = sparse_attention::reference::forward::<f32>(dm, &a.q.to_f32_vec()?, &a.kv.to_f32_vec()?, &a.sinks.to_f32_vec()?, &idx, width, a.sm_scale, false);
        out.write_f32(&o)?;
        lse.write_f32(&l)
    }

    fn sparse_attention_bwd(&self, a: &SparseAttentionBwdArgs, dq: &mut TensorViewMut, dkv: &mut TensorViewMut, dsinks: &mut TensorViewMut) -> Result<()> {
        let (dm, _) = a.validate()?;
        let f = &a.fwd;
        let (idx, width) = f.host_indices(dm)?;
        let g = sparse_attention::reference::backward::<f32>(
            dm,
            &f.q.to_f32_vec()?,
            &f.kv.to_f32_vec()?,
            &f.sinks.to_f32_vec()?,
            &idx,
            width,
            f.sm_scale,
            &a.out.to_f32_vec()?,
            &a.lse.to_f32_vec()?,
            &a.dout.to_f32_vec()?,
        );
        dq.write_f32(&g.dq)?;
        dkv.write_f32(&g.dkv)?;
        dsinks.write_f32(&g.dsinks)
    }

    fn dense_attention_topk(&self, a: &SparseAttentionArgs, out: &mut TensorViewMut) -> Result<()> {
        let (dm, _) = a.validate()?;
        let (idx, width) = a.host_indices(dm)?;
        let (o, _) = sparse_attention::reference::forward::<f32>(dm, &a.q.to_f32_vec()?, &a.kv.to_f32_vec()?, &a.sinks.to_f32_vec()?, &idx, width, a.sm_scale, true);
        out.write_f32(&o)
    }

    fn indexer_scores(&self, a: &IndexerArgs, scores: &mut TensorViewMut) -> Result<()> {
        let (dm, _) = a.validate()?;
        let s = indexer::reference::scores::<f32>(dm, &a.q.to_f32_vec()?, &a.pooled_kv.to_f32_vec()?, &a.weights.to_f32_vec()?, a.softmax_scale, a.causal());
        scores.write_f32(&s)
    }

    fn indexer_topk(&self, scores: &TensorView, k: usize, indices: &mut TensorViewMut, values: &mut TensorViewMut) -> Result<()> {
        let p = scores.shape()[2];
        let (i, v) = indexer::reference::topk::<f32>(&scores.to_f32_vec()?, p, k.min(p));
        indices.write_i64(&i)?;
        values.write_f32(&v)
    }

    fn indexer_topk_scores(&self, a: &IndexerArgs, topk_indices: &TensorView, out: &mut TensorViewMut) -> Result<()> {
        let (dm, _) = a.validate()?;
        let t = topk_indices.shape()[2];
        let s = indexer::reference::topk_scores::<f32>(dm, &a.q.to_f32_vec()?, &a.pooled_kv.to_f32_vec()?, &a.weights.to_f32_vec()?, &topk_indices.to_i64_vec()?, t, a.softmax_scale, a.causal());
        out.write_f32(&s)
    }

    fn indexer_topk_scores_bwd(&self, a: &IndexerTopkScoresBwdArgs, dq: &mut TensorViewMut, dweights: &mut TensorViewMut, dpooled_kv: &mut TensorViewMut) -> Result<()> {
        let (dm, t, _) = a.validate()?;
        let f = &a.fwd;
        let g = indexer::reference::topk_scores_backward::<f32>(
            dm,
            &f.q.to_f32_vec()?,
            &f.pooled_kv.to_f32_vec()?,
            &f.weights.to_f32_vec()?,
            &a.topk_indices.to_i64_vec()?,
            t,
            &a.grad.to_f32_vec()?,
            f.softmax_scale,
            f.causal(),
        );
        dq.write_f32(&g.dq)?;
        dweights.write_f32(&g.dweights)?;
        dpooled_kv.write_f32(&g.dpooled_kv)
    }

    fn sinkhorn_fwd(&self, a: &SinkhornArgs, out: &mut TensorViewMut) -> Result<()> {
        let (_, n, _) = a.validate()?;
        out.write_f32(&sinkhorn::reference::forward::<f32>(&a.x.to_f32_vec()?, n, a.repeat, a.eps))
    }

    /// Evaluated in f64: the backward is ill-conditioned (dx is a cancellation down to
    /// ~1e-2 of dout over 2*repeat-1 steps), so an f32 evaluation is itself up to ~6e-5
    /// of the row scale from the exact result, over the 1e-5 bound backends are judged by.
    fn sinkhorn_bwd(&self, a: &SinkhornArgs, dout: &TensorView, dx: &mut TensorViewMut) -> Result<()> {
        let (_, n, _) = a.validate()?;
        let d = sinkhorn::reference::backward::<f64>(&a.x.to_f64_vec()?, &dout.to_f64_vec()?, n, a.repeat, a.eps as f64);
        dx.write_f32(&d.iter().map(|&v| v as f32).collect::<Vec<_>>())
    }

    fn qnorm_rope_fwd(&self, a: &QNormRopeArgs, out: &mut TensorViewMut, rstd: &mut TensorViewMut) -> Result<()> {
        let (dm, _) = a.validate()?;
        let round = a.x.dtype() == DType::BF16;
        let (o, r) = qnorm_rope::reference::forward::<f32>(dm, &a.x.to_f32_vec()?, &a.cos.to_f32_vec()?, &a.sin.to_f32_vec()?, a.eps, round);
        out.write_f32(&o)?;
        rstd.write_f32(&r)
    }

    fn qnorm_rope_bwd(&self, a: &QNormRopeArgs, rstd: &TensorView, grad: &TensorView, dx: &mut TensorViewMut) -> Result<()> {
        let (dm, _) = a.validate()?;
        let round = a.x.dtype() == DType::BF16;
        let d = qnorm_rope::reference::backward::<f32>(dm, &a.x.to_f32_vec()?, &a.cos.to_f32_vec()?, &a.sin.to_f32_vec()?, &rstd.to_f32_vec()?, &grad.to_f32_vec()?, round);
        dx.write_f32(&d)
    }

    fn build_sparse_topk_indices(&self, a: &BuildIndicesArgs, out: &mut TensorViewMut) -> Result<()> {
        let (dm, _) = a.validate()?;
        let idx = sparse_indices::reference::build(&dm, &a.host_inputs(&dm)?);
        out.write_i64(&idx)
    }

    fn plan_sparse_indices(&self, topk_idxs: &TensorView, kv_len: usize, all_rows_nonempty: bool) -> Result<SparseIndexPlan> {
        let (b, s, t) = (topk_idxs.shape()[0], topk_idxs.shape()[1], topk_idxs.shape()[2]);
        let (indices, lengths, valid_rows) = sparse_indices::reference::plan(&topk_idxs.to_i64_vec()?, b, s, t, kv_len, t);
        let to_i32 = |v: Vec<i64>| v.into_iter().map(|x| x as i32).collect::<Vec<_>>();
        Ok(SparseIndexPlan {
            backend: "reference",
            indices: Tensor::from_i32(&[b * s, 1, t], to_i32(indices))?,
            topk_length: Some(Tensor::from_i32(&[b * s], to_i32(lengths))?),
            valid_rows: if all_rows_nonempty { None } else { Some(Tensor::from_i64(&[valid_rows.len()], valid_rows)?) },
            kv_len,
            batch: b,
            seq: s,
            slots: t,
            all_rows_nonempty,
            derived: Default::default(),
        })
    }
}
