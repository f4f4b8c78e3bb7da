//! The sparse top-k index builder (window + compressed + mask + context-parallel positions
//! + vision spans) and index plans shared across layers (SPEC.md section 6).

pub mod cases;
pub mod reference;

use crate::backend::{alloc_output, common_device, select, BackendName};
use crate::check;
use crate::error::{Error, Result};
use crate::tensor::{DType, Device, Tensor, TensorView, TensorViewMut};

const OP: &str = "build_sparse_topk_indices";

/// Arguments of `build_sparse_topk_indices`, named as in the seeds.
#[derive(Clone, Debug)]
pub struct BuildIndicesArgs<'a> {
    pub batch_size: usize,
    pub seq_len: usize,
    pub key_len: usize,
    pub window_size: usize,
    /// Where the result lives when no tensor argument says so.
    pub device: Device,
    /// `[B,1,S,>=K]` additive mask (bf16 or f32): a slot whose entry is `< 0` is masked.
    pub attention_mask: Option<TensorView<'a>>,
    pub compress_ratio: usize,
    /// `[B,S,Tc]` integer indices into the pooled keys (-1 masked).
    pub compressed_topk: Option<TensorView<'a>>,
    pub n_pooled: usize,
    /// Number of uncompressed keys before the pooled ones (default `seq_len`).
    pub vanilla_key_len: Option<usize>,
    /// Global query positions: `[S]`, `[1,S]` or `[B,S]` (default `0..S`).
    pub q_positions: Option<TensorView<'a>>,
    /// `[B,S]`: -1 text, 0 image start, 4 image end (others: inside an image).
    pub vision_token_types: Option<TensorView<'a>>,
    pub max_image_tokens: usize,
}

impl<'a> BuildIndicesArgs<'a> {
    pub fn new(batch_size: usize, seq_len: usize, key_len: usize, window_size: usize) -> Self {
        BuildIndicesArgs {
            batch_size,
            seq_len,
            key_len,
            window_size,
            device: Device::Cpu,
            attention_mask: None,
            compress_ratio: 0,
            compressed_topk: None,
            n_pooled: 0,
            vanilla_key_len: None,
            q_positions: None,
            vision_token_types: None,
            max_image_tokens: 0,
        }
    }

    /// Validate; returns the resolved sizes and the device of the result.
    pub fn validate(&self) -> Result<(BuildDims, Device)> {
        let (b, s) = (self.batch_size, self.seq_len);
        check::at_least(OP, "window_size", self.window_size, 1)?;
        let mut tensors: Vec<(&'static str, &TensorView)> = Vec::new();
        let mut mask_width = 0;
        if let Some(m) = &self.attention_mask {
            check::dtype(OP, "attention_mask", m, check::FLOATS)?;
            check::shape(OP, "attention_mask", m, "[B,1,S,>=K]", &[Some(b), Some(1), Some(s), None])?;
            mask_width = m.shape()[3];
            if mask_width < self.key_len {
                return Err(Error::Shape { op: OP, arg: "attention_mask", expected: format!("[{b}, 1, {s}, >= {}] (last dim >= key_len)", self.key_len), got: m.shape().to_vec() });
            }
            tensors.push(("attention_mask", m));
        }
        let mut tc = 0;
        if let Some(ct) = &self.compressed_topk {
            check::dtype(OP, "compressed_topk", ct, check::INTS)?;
            check::shape(OP, "compressed_topk", ct, "[B,S,Tc]", &[Some(b), Some(s), None])?;
            if self.n_pooled == 0 {
                return Err(Error::value(OP, "n_pooled", "> 0 when compressed_topk is given", 0));
            }
            tc = ct.shape()[2];
            tensors.push(("compressed_topk", ct));
        } else if self.n_pooled > 0 {
            check::at_least(OP, "compress_ratio", self.compress_ratio, 1)?;
        }
        if let Some(qp) = &self.q_positions {
            check::dtype(OP, "q_positions", qp, check::INTS)?;
            let ok = match qp.shape() {
                [n] => *n == s,
                [r, n] => (*r == 1 || *r == b) && *n == s,
                _ => false,
            };
            if !ok {
                return Err(Error::Shape { op: OP, arg: "q_positions", expected: format!("[{s}], [1, {s}] or [{b}, {s}]"), got: qp.shape().to_vec() });
            }
            tensors.push(("q_positions", qp));
        }
        if let Some(vt) = &self.vision_token_types {
            check::dtype(OP, "vision_token_types", vt, check::INTS)?;
            check::shape(OP, "vision_token_types", vt, "[B,S]", &[Some(b), Some(s)])?;
            tensors.push(("vision_token_types", vt));
        }
        let device = if tensors.is_empty() { self.device } else { common_device(OP, &tensors)? };
        let dims = BuildDims {
            batch_size: b,
            seq_len: s,
            key_len: self.key_len,
            window_size: self.window_size,
            compress_ratio: self.compress_ratio,
            n_pooled: self.n_pooled,
            compressed_width: tc,
            has_compressed_topk: self.compressed_topk.is_some(),
            vanilla_key_len: self.vanilla_key_len.unwrap_or(s),
            vision: self.vision_token_types.is_some() && self.max_image_tokens > 0,
            max_image_tokens: self.max_image_tokens,
            mask_width,
        };
        Ok((dims, device))
    }

    /// Host copies of the tensor arguments for the reference.
    pub fn host_inputs(&self, dm: &BuildDims) -> Result<reference::BuildInputs> {
        let (b, s) = (dm.batch_size, dm.seq_len);
        let q_positions = match &self.q_positions {
            None => None,
            Some(qp) => {
                let v = qp.to_i64_vec()?;
                // [S] and [1,S] broadcast over the batch; [B,S] is per row.
                Some(if v.len() == s { v.repeat(b) } else { v })
            }
        };
        Ok(reference::BuildInputs {
            attention_mask: self.attention_mask.as_ref().map(|m| m.to_f32_vec().map(|v| (v, dm.mask_width))).transpose()?,
            compressed_topk: self.compressed_topk.as_ref().map(|c| c.to_i64_vec().map(|v| (v, dm.compressed_width))).transpose()?,
            q_positions,
            vision_token_types: self.vision_token_types.as_ref().map(|v| v.to_i64_vec()).transpose()?,
        })
    }
}

/// Resolved sizes of a build.
#[derive(Clone, Copy, Debug)]
pub struct BuildDims {
    pub batch_size: usize,
    pub seq_len: usize,
    pub key_len: usize,
    pub window_size: usize,
    pub compress_ratio: usize,
    pub n_pooled: usize,
    /// `Tc` when `compressed_topk` is given.
    pub compressed_width: usize,
    pub has_compressed_topk: bool,
    pub vanilla_key_len: usize,
    pub vision: bool,
    pub max_image_tokens: usize,
    pub mask_width: usize,
}

impl BuildDims {
    /// Slots of the local window: `min(V, W)` for text, `min(S, W + M)` with vision spans.
    pub fn window_width(&self) -> usize {
        if self.vision {
            self.seq_len.min(self.window_size + self.max_image_tokens)
        } else {
            self.vanilla_key_len.min(self.window_size)
        }
    }
    /// Slots of the compressed part: `Tc` with `compressed_topk`, else `P`.
    pub fn compressed_slots(&self) -> usize {
        match (self.n_pooled, self.has_compressed_topk) {
            (0, _) => 0,
            (_, true) => self.compressed_width,
            (p, false) => p,
        }
    }
    /// `W'`, the last dimension of the result.
    pub fn width(&self) -> usize {
        self.window_width() + self.compressed_slots()
    }
    pub fn vision(&self) -> bool {
        self.vision
    }
}

/// Build `[B,S,W']` i32 key slots (SPEC.md section 6).
pub fn build_sparse_topk_indices(backend: BackendName, a: &BuildIndicesArgs) -> Result<Tensor> {
    let (dm, device) = a.validate()?;
    let be = select(backend, OP, device)?;
    let mut out = alloc_output(be, DType::I32, &[dm.batch_size, dm.seq_len, dm.width()], device)?;
    be.build_sparse_topk_indices(a, &mut out.view_mut())?;
    Ok(out)
}

/// `build_sparse_topk_indices` into caller memory (`[B,S,W']` i32).
pub fn build_sparse_topk_indices_into(backend: BackendName, a: &BuildIndicesArgs, out: &mut TensorViewMut) -> Result<()> {
    let (dm, device) = a.validate()?;
    check::output_on(OP, "out", out, device, DType::I32, &[dm.batch_size, dm.seq_len, dm.width()], None)?;
    let be = select(backend, OP, device)?;
    be.build_sparse_topk_indices(a, out)
}

/// Sparse-attention indices prepared once for every layer that consumes the same
/// selection. Each backend defines its layout; the plan remembers whose it is, and using
/// it with another backend is an error.
///
/// The reference layout (SPEC.md section 6, the seeds' cuDNN layout):
/// - `indices`: i32 `[B*S, 1, width]`, global flat coordinates `b*K + k`, the row's valid
///   keys ascending (duplicates kept) then -1;
/// - `topk_length`: i32 `[B*S]`, valid-prefix lengths;
/// - `valid_rows`: i64 indices of the nonempty rows, unless `all_rows_nonempty`.
///
/// A plan's tensors are read-only: a backend may derive more from them on first use and
/// keep it in `derived` (the CUDA deterministic backward's inverted index), so changing
/// them in place afterwards gives wrong results.
#[derive(Clone, Debug)]
pub struct SparseIndexPlan {
    /// The backend the layout is for (`"reference"`, `"cuda"`).
    pub backend: &'static str,
    pub indices: Tensor,
    pub topk_length: Option<Tensor>,
    pub valid_rows: Option<Tensor>,
    /// K/V positions per batch row the coordinates refer to.
    pub kv_len: usize,
    pub batch: usize,
    pub seq: usize,
    /// Slots per row of the selection the plan was made from (`T`).
    pub slots: usize,
    pub all_rows_nonempty: bool,
    /// What a backend derived from this plan on first use, kept for its later uses
    /// (shared by the plan's clones; a backend checks it was derived from the same
    /// `indices` buffer). `PlanDerived::default()` when making a plan.
    pub derived: PlanDerived,
}

/// A value a backend derives from a plan once ([`PlanDerived::get_or_try_init`]) and keeps
/// with it: the first one stored stays, whatever its type; clones of the plan share it.
#[derive(Clone, Default)]
pub struct PlanDerived(std::sync::Arc<std::sync::OnceLock<std::sync::Arc<dyn std::any::Any + Send + Sync>>>);

impl PlanDerived {
    /// The value stored, made by `make` if there is none yet (an error stores nothing);
    /// `None` when the value stored is not a `T`.
    pub fn get_or_try_init<T: std::any::Any + Send + Sync>(&self, make: impl FnOnce() -> Result<T>) -> Result<Option<std::sync::Arc<T>>> {
        if self.0.get().is_none() {
            let v = make()?;
            // a racing thread's value wins; this one is dropped
            let _ = self.0.set(std::sync::Arc::new(v));
        }
        Ok(self.0.get().and_then(|v| v.clone().downcast::<T>().ok()))
    }

    /// Whether a value is stored.
    pub fn is_set(&self) -> bool {
        self.0.get().is_some()
    }
}

impl std::fmt::Debug for PlanDerived {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.is_set() { "PlanDerived(set)" } else { "PlanDerived(empty)" })
    }
}

impl SparseIndexPlan {
    pub fn check_matches(&self, op: &'static str, b: usize, s: usize, k: usize) -> Result<()> {
        if (self.batch, self.seq, self.kv_len) != (b, s, k) {
            return Err(Error::value(op, "plan", format!("a plan for batch {b}, sequence {s}, kv length {k}"), format!("a plan for batch {}, sequence {}, kv length {}", self.batch, self.seq, self.kv_len)));
        }
        Ok(())
    }

    /// `[B*S, width]` local key positions (-1 masked) from the reference layout.
    pub fn local_rows(&self) -> Result<(Vec<i64>, usize)> {
        let rows = self.batch * self.seq;
        // The fields are public: a hand-made plan must not make the reads below overrun.
        if !self.indices.dtype().is_int() || self.indices.shape().len() != 3 || self.indices.shape()[..2] != [rows, 1] {
            return Err(Error::Shape { op: "sparse_attention", arg: "plan", expected: format!("plan.indices: integer [{rows}, 1, width] (batch * seq rows)"), got: self.indices.shape().to_vec() });
        }
        let width = self.indices.shape()[2];
        let g = self.indices.to_i64_vec()?;
        let k = self.kv_len as i64;
        let mut local = vec![-1i64; rows * width];
        for r in 0..rows {
            let b = (r / self.seq.max(1)) as i64;
            for j in 0..width {
                let x = g[r * width + j];
                if x >= 0 {
                    local[r * width + j] = x - b * k;
                }
            }
        }
        Ok((local, width))
    }
}

/// Prepare a selection `[B,S,T]` once for every layer that shares it (SPEC.md section 6).
pub fn plan_sparse_indices(backend: BackendName, topk_idxs: &TensorView, kv_len: usize, all_rows_nonempty: bool) -> Result<SparseIndexPlan> {
    const OP: &str = "plan_sparse_indices";
    check::dtype(OP, "topk_idxs", topk_idxs, check::INTS)?;
    check::shape(OP, "topk_idxs", topk_idxs, "[B,S,T]", &[None; 3])?;
    let b = topk_idxs.shape()[0];
    if (b as u64) * (kv_len as u64) > i32::MAX as u64 {
        return Err(Error::value(OP, "kv_len", format!("batch * kv_len <= {} (int32 flat coordinates)", i32::MAX), b * kv_len));
    }
    let be = select(backend, OP, topk_idxs.device())?;
    be.plan_sparse_indices(topk_idxs, kv_len, all_rows_nonempty)
}
