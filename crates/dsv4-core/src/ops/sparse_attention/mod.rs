//! Sparse MQA attention with per-head sinks over per-query top-k slots (SPEC.md section 1),
//! and the dense oracle `dense_attention_topk`.

pub mod cases;
pub mod reference;

pub use reference::Dims;

use crate::backend::{alloc_output, common_device, select, BackendName};
use crate::check;
use crate::error::{Error, Result};
use crate::ops::sparse_indices::SparseIndexPlan;
use crate::tensor::{DType, Device, Tensor, TensorView, TensorViewMut};

const OP: &str = "sparse_attention";

/// Where the key slots of each query come from.
#[derive(Clone, Debug)]
pub enum SparseIndices<'a> {
    /// `[B,S,T]` i32 or i64; entries outside `[0,K)` are masked slots.
    TopK(TensorView<'a>),
    /// A plan from `plan_sparse_indices`, shared by every layer with the same selection.
    Plan(&'a SparseIndexPlan),
}

/// The backward's reduction into `dkv`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum BackwardImpl {
    /// f32 atomics into dkv.
    #[default]
    Atomic,
    /// Fixed-order reduction: bitwise identical results run to run.
    Deterministic,
}

impl std::str::FromStr for BackwardImpl {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "atomic" => Ok(BackwardImpl::Atomic),
            "deterministic" => Ok(BackwardImpl::Deterministic),
            other => Err(Error::value(OP, "backward_impl", "\"atomic\" or \"deterministic\"", format!("{other:?}"))),
        }
    }
}

/// Forward inputs.
#[derive(Clone, Debug)]
pub struct SparseAttentionArgs<'a> {
    /// `[B,S,H,D]` bf16 (f32 accepted by the reference).
    pub q: TensorView<'a>,
    /// `[B,K,D]`, one shared head used as key and value; q's dtype.
    pub kv: TensorView<'a>,
    /// `[H]` f32, pre-scaled logits (not multiplied by `sm_scale`).
    pub sinks: TensorView<'a>,
    pub indices: SparseIndices<'a>,
    pub sm_scale: f32,
    /// Kernel arithmetic of the released inference kernel (rounding only).
    pub reference_rounding: bool,
    /// The caller promises every row has a valid slot.
    pub all_rows_nonempty: bool,
}

impl<'a> SparseAttentionArgs<'a> {
    /// Arguments with the defaults: `sm_scale = D^-0.5`, no options.
    pub fn new(q: TensorView<'a>, kv: TensorView<'a>, sinks: TensorView<'a>, indices: SparseIndices<'a>) -> Self {
        let d = q.shape().last().copied().unwrap_or(1).max(1);
        SparseAttentionArgs { q, kv, sinks, indices, sm_scale: (d as f32).powf(-0.5), reference_rounding: false, all_rows_nonempty: false }
    }

    /// Validate and return the sizes and the device of the call.
    pub fn validate(&self) -> Result<(Dims, Device)> {
        check::dtype(OP, "q", &self.q, check::FLOATS)?;
        check::shape(OP, "q", &self.q, "[B,S,H,D]", &[None; 4])?;
        let (b, s, h, d) = (self.q.shape()[0], self.q.shape()[1], self.q.shape()[2], self.q.shape()[3]);
        check::at_least(OP, "q.shape[2] (heads)", h, 1)?;
        check::at_least(OP, "q.shape[3] (head_dim)", d, 1)?;
        check::dtype(OP, "kv", &self.kv, &[self.q.dtype()])?;
        check::shape(OP, "kv", &self.kv, "[B,K,D]", &[Some(b), None, Some(d)])?;
        let k = self.kv.shape()[1];
        check::dtype(OP, "sinks", &self.sinks, &[DType::F32])?;
        check::shape(OP, "sinks", &self.sinks, "[H]", &[Some(h)])?;
        check::finite(OP, "sm_scale", self.sm_scale as f64)?;
        let mut tensors = vec![("q", &self.q), ("kv", &self.kv), ("sinks", &self.sinks)];
        let t = match &self.indices {
            SparseIndices::TopK(idx) => {
                check::dtype(OP, "topk_idxs", idx, check::INTS)?;
                check::shape(OP, "topk_idxs", idx, "[B,S,T]", &[Some(b), Some(s), None])?;
                tensors.push(("topk_idxs", idx));
                idx.shape()[2]
            }
            SparseIndices::Plan(plan) => {
                plan.check_matches(OP, b, s, k)?;
                plan.slots
            }
        };
        let device = common_device(OP, &tensors)?;
        if let SparseIndices::Plan(plan) = &self.indices {
            if plan.indices.device() != device {
                return Err(Error::Device { op: OP, arg: "plan", expected: format!("{device} (the device of `q`)"), got: plan.indices.device() });
            }
        }
        Ok((Dims { b, s, h, d, k, t }, device))
    }

    /// Flattened `[B*S, width]` local key positions and the width, from either source
    /// (host tensors only: the reference's view of the indices).
    pub fn host_indices(&self, dm: Dims) -> Result<(Vec<i64>, usize)> {
        match &self.indices {
            SparseIndices::TopK(idx) => Ok((idx.to_i64_vec()?, dm.t)),
            SparseIndices::Plan(plan) => plan.local_rows(),
        }
    }

    fn check_plan_backend(&self, backend: &str) -> Result<()> {
        if let SparseIndices::Plan(plan) = &self.indices {
            if plan.backend != backend {
                return Err(Error::value(OP, "plan", format!("a plan made for backend `{backend}`"), format!("a plan for backend `{}`", plan.backend)));
            }
        }
        Ok(())
    }
}

/// Backward inputs: the forward's, its saved `out` and `lse`, and `dout`.
#[derive(Clone, Debug)]
pub struct SparseAttentionBwdArgs<'a> {
    pub fwd: SparseAttentionArgs<'a>,
    /// `[B,S,H,D]`, the forward output.
    pub out: TensorView<'a>,
    /// `[B,S,H]` f32, natural-log normaliser from the forward.
    pub lse: TensorView<'a>,
    /// `[B,S,H,D]`, gradient of `out`.
    pub dout: TensorView<'a>,
    pub backward_impl: BackwardImpl,
    /// Bound on the partial-dkv workspace of the deterministic backward (the CUDA backend:
    /// the per-slot contributions of a wave of rows and, when it takes at most a quarter
    /// of this, an inverted index of all rows, which a plan keeps after its first
    /// deterministic backward: 4 bytes a slot and `[row blocks <= 4 x SMs, B*K]` i32
    /// counts, 84 MB at B*S = 16384, T = 640, K = 20480; held as long as the plan).
    pub backward_workspace_bytes: usize,
}

pub const DEFAULT_BACKWARD_WORKSPACE_BYTES: usize = 2 << 30;

impl<'a> SparseAttentionBwdArgs<'a> {
    pub fn new(fwd: SparseAttentionArgs<'a>, out: TensorView<'a>, lse: TensorView<'a>, dout: TensorView<'a>) -> Self {
        SparseAttentionBwdArgs { fwd, out, lse, dout, backward_impl: BackwardImpl::Atomic, backward_workspace_bytes: DEFAULT_BACKWARD_WORKSPACE_BYTES }
    }

    pub fn validate(&self) -> Result<(Dims, Device)> {
        let (dm, device) = self.fwd.validate()?;
        let qshape = [dm.b, dm.s, dm.h, dm.d].map(Some);
        check::dtype(OP, "out", &self.out, check::FLOATS)?;
        check::shape(OP, "out", &self.out, "[B,S,H,D]", &qshape)?;
        check::dtype(OP, "lse", &self.lse, &[DType::F32])?;
        check::shape(OP, "lse", &self.lse, "[B,S,H]", &[Some(dm.b), Some(dm.s), Some(dm.h)])?;
        check::dtype(OP, "dout", &self.dout, check::FLOATS)?;
        check::shape(OP, "dout", &self.dout, "[B,S,H,D]", &qshape)?;
        check::at_least(OP, "backward_workspace_bytes", self.backward_workspace_bytes, 1)?;
        common_device(OP, &[("q", &self.fwd.q), ("out", &self.out), ("lse", &self.lse), ("dout", &self.dout)])?;
        Ok((dm, device))
    }
}

fn check_outputs(dm: Dims, device: Device, dtype: DType, out: &TensorViewMut, lse: &TensorViewMut) -> Result<()> {
    check::output_on(OP, "out", out, device, dtype, &[dm.b, dm.s, dm.h, dm.d], None)?;
    check::output_on(OP, "lse", lse, device, DType::F32, &[dm.b, dm.s, dm.h], None)
}

/// Forward into caller memory: `out [B,S,H,D]` (q's dtype), `lse [B,S,H]` f32.
pub fn sparse_attention_into(backend: BackendName, a: &SparseAttentionArgs, out: &mut TensorViewMut, lse: &mut TensorViewMut) -> Result<()> {
    let (dm, device) = a.validate()?;
    check_outputs(dm, device, a.q.dtype(), out, lse)?;
    let be = select(backend, OP, device)?;
    a.check_plan_backend(be.name())?;
    be.sparse_attention_fwd(a, out, lse)
}

/// Forward: returns `(out [B,S,H,D], lse [B,S,H])` on the inputs' device.
pub fn sparse_attention(backend: BackendName, a: &SparseAttentionArgs) -> Result<(Tensor, Tensor)> {
    let (dm, device) = a.validate()?;
    let be = select(backend, OP, device)?;
    a.check_plan_backend(be.name())?;
    let mut out = alloc_output(be, a.q.dtype(), &[dm.b, dm.s, dm.h, dm.d], device)?;
    let mut lse = alloc_output(be, DType::F32, &[dm.b, dm.s, dm.h], device)?;
    be.sparse_attention_fwd(a, &mut out.view_mut(), &mut lse.view_mut())?;
    Ok((out, lse))
}

/// Backward into caller memory: dq (q's dtype), dkv (kv's dtype), dsinks `[H]` f32.
pub fn sparse_attention_backward_into(backend: BackendName, a: &SparseAttentionBwdArgs, dq: &mut TensorViewMut, dkv: &mut TensorViewMut, dsinks: &mut TensorViewMut) -> Result<()> {
    let (dm, device) = a.validate()?;
    check::output_on(OP, "dq", dq, device, a.fwd.q.dtype(), &[dm.b, dm.s, dm.h, dm.d], None)?;
    check::output_on(OP, "dkv", dkv, device, a.fwd.kv.dtype(), &[dm.b, dm.k, dm.d], None)?;
    check::output_on(OP, "dsinks", dsinks, device, DType::F32, &[dm.h], None)?;
    let be = select(backend, OP, device)?;
    a.fwd.check_plan_backend(be.name())?;
    be.sparse_attention_bwd(a, dq, dkv, dsinks)
}

/// Backward: returns `(dq, dkv, dsinks)`.
pub fn sparse_attention_backward(backend: BackendName, a: &SparseAttentionBwdArgs) -> Result<(Tensor, Tensor, Tensor)> {
    let (dm, device) = a.validate()?;
    let be = select(backend, OP, device)?;
    a.fwd.check_plan_backend(be.name())?;
    let mut dq = alloc_output(be, a.fwd.q.dtype(), &[dm.b, dm.s, dm.h, dm.d], device)?;
    let mut dkv = alloc_output(be, a.fwd.kv.dtype(), &[dm.b, dm.k, dm.d], device)?;
    let mut dsinks = alloc_output(be, DType::F32, &[dm.h], device)?;
    be.sparse_attention_bwd(a, &mut dq.view_mut(), &mut dkv.view_mut(), &mut dsinks.view_mut())?;
    Ok((dq, dkv, dsinks))
}

/// The dense oracle (duplicates collapse): returns `out [B,S,H,D]` in q's dtype.
pub fn dense_attention_topk(backend: BackendName, a: &SparseAttentionArgs) -> Result<Tensor> {
    let (dm, device) = a.validate()?;
    let be = select(backend, "dense_attention_topk", device)?;
    a.check_plan_backend(be.name())?;
    let mut out = alloc_output(be, a.q.dtype(), &[dm.b, dm.s, dm.h, dm.d], device)?;
    be.dense_attention_topk(a, &mut out.view_mut())?;
    Ok(out)
}

/// `dense_attention_topk` into caller memory.
pub fn dense_attention_topk_into(backend: BackendName, a: &SparseAttentionArgs, out: &mut TensorViewMut) -> Result<()> {
    let (dm, device) = a.validate()?;
    check::output_on("dense_attention_topk", "out", out, device, a.q.dtype(), &[dm.b, dm.s, dm.h, dm.d], None)?;
    let be = select(backend, "dense_attention_topk", device)?;
    a.check_plan_backend(be.name())?;
    be.dense_attention_topk(a, out)
}
