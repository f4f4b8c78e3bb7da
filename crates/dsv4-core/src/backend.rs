//! Backend dispatch (SPEC.md section 7).
//!
//! A backend implements [`KernelBackend`]: every operation, forward and backward, writing
//! into caller-provided output views that the dispatcher has already validated. The CPU
//! reference is built in; the CUDA backend registers itself at start-up
//! (`dsv4_cuda::register()`), so this crate never links CUDA.

use std::sync::{OnceLock, RwLock};

use crate::error::{Error, Result};
use crate::ops::indexer::{IndexerArgs, IndexerTopkScoresBwdArgs};
use crate::ops::qnorm_rope::QNormRopeArgs;
use crate::ops::sinkhorn::SinkhornArgs;
use crate::ops::sparse_attention::{SparseAttentionArgs, SparseAttentionBwdArgs};
use crate::ops::sparse_indices::{BuildIndicesArgs, SparseIndexPlan};
use crate::reference::Reference;
use crate::tensor::{DType, Device, Tensor, TensorView, TensorViewMut};

/// The backend a caller asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum BackendName {
    /// The CPU reference: SPEC.md computed directly, f32 accumulation.
    Reference,
    /// This project's CUDA kernels (device tensors only).
    Cuda,
    /// The fastest backend that can take the inputs.
    #[default]
    Auto,
}

impl BackendName {
    pub fn as_str(self) -> &'static str {
        match self {
            BackendName::Reference => "reference",
            BackendName::Cuda => "cuda",
            BackendName::Auto => "auto",
        }
    }
}

impl std::str::FromStr for BackendName {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "reference" | "torch" | "cpu" => Ok(BackendName::Reference),
            "cuda" => Ok(BackendName::Cuda),
            "auto" => Ok(BackendName::Auto),
            other => Err(Error::UnknownBackend(other.to_string())),
        }
    }
}

impl std::fmt::Display for BackendName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Kernel families, as `is_kernel_available` names them.
pub const KERNEL_FAMILIES: [&str; 4] = ["sinkhorn", "sparse_attn", "indexer", "qnorm_rope"];

/// Every operation of SPEC.md sections 1-6. Inputs are validated by the caller (the
/// functions in `ops::*`): shapes, dtypes, one device for all tensors, scalar domains, and
/// outputs of the documented shape and dtype, contiguous unless the op says otherwise.
/// A backend that cannot take a validated call (dtype, size limit) returns
/// [`Error::Unavailable`] saying why, before writing anything.
pub trait KernelBackend: Send + Sync {
    fn name(&self) -> &'static str;
    /// Lines for `dsv4 info`: devices, versions, what was found where.
    fn describe(&self) -> Vec<String>;
    /// Whether the kernels of a family (see [`KERNEL_FAMILIES`]) can run here.
    fn family_available(&self, family: &str) -> bool;

    /// Uninitialised contiguous memory on `device`.
    fn alloc(&self, dtype: DType, shape: &[usize], device: Device) -> Result<Tensor>;
    /// A contiguous copy of a host view on `device`.
    fn upload(&self, src: &TensorView, device: Device) -> Result<Tensor>;
    /// Wait for all work queued by this backend on `device`.
    fn synchronize(&self, device: Device) -> Result<()>;

    /// out `[B,S,H,D]` (q's dtype), lse `[B,S,H]` f32.
    fn sparse_attention_fwd(&self, a: &SparseAttentionArgs, out: &mut TensorViewMut, lse: &mut TensorViewMut) -> Result<()>;
    /// dq `[B,S,H,D]` (q's dtype), dkv `[B,K,D]` (kv's dtype), dsinks `[H]` f32.
    fn sparse_attention_bwd(&self, a: &SparseAttentionBwdArgs, dq: &mut TensorViewMut, dkv: &mut TensorViewMut, dsinks: &mut TensorViewMut) -> Result<()>;
    /// The dense oracle: out `[B,S,H,D]` (q's dtype).
    fn dense_attention_topk(&self, a: &SparseAttentionArgs, out: &mut TensorViewMut) -> Result<()>;

    /// scores `[B,S,P]` f32 with the causal -inf.
    fn indexer_scores(&self, a: &IndexerArgs, scores: &mut TensorViewMut) -> Result<()>;
    /// scores `[B,S,P]` f32 -> indices `[B,S,k']` i32 (descending, -1 past the finite
    /// count), values `[B,S,k']` f32 (-inf at -1); k' = min(k, P).
    fn indexer_topk(&self, scores: &TensorView, k: usize, indices: &mut TensorViewMut, values: &mut TensorViewMut) -> Result<()>;
    /// Section 2 + 3 fused: the top-k of the indexer scores without materialising them.
    /// The default composes the two steps through a temporary `[B,S,P]`.
    fn indexer_fused_topk(&self, a: &IndexerArgs, k: usize, indices: &mut TensorViewMut, values: &mut TensorViewMut) -> Result<()> {
        let (b, s, p) = (a.q.shape()[0], a.q.shape()[1], a.pooled_kv.shape()[1]);
        let mut scores = self.alloc(DType::F32, &[b, s, p], a.q.device())?;
        self.indexer_scores(a, &mut scores.view_mut())?;
        self.indexer_topk(&scores.view(), k, indices, values)
    }
    /// out `[B,S,T]` f32.
    fn indexer_topk_scores(&self, a: &IndexerArgs, topk_indices: &TensorView, out: &mut TensorViewMut) -> Result<()>;
    /// dq `[B,S,H,D]` (q's dtype), dweights `[B,S,H]` f32, dpooled_kv `[B,P,D]` f32.
    fn indexer_topk_scores_bwd(&self, a: &IndexerTopkScoresBwdArgs, dq: &mut TensorViewMut, dweights: &mut TensorViewMut, dpooled_kv: &mut TensorViewMut) -> Result<()>;

    /// out: x's shape, f32.
    fn sinkhorn_fwd(&self, a: &SinkhornArgs, out: &mut TensorViewMut) -> Result<()>;
    /// dx: x's shape, f32; `dout` may have any strides.
    fn sinkhorn_bwd(&self, a: &SinkhornArgs, dout: &TensorView, dx: &mut TensorViewMut) -> Result<()>;

    /// out: logical `[B,H,S,C]` in token-major storage (x's dtype); rstd `[B*S*H]` f32.
    fn qnorm_rope_fwd(&self, a: &QNormRopeArgs, out: &mut TensorViewMut, rstd: &mut TensorViewMut) -> Result<()>;
    /// dx: logical `[B,H,S,C]` token-major (x's dtype); `grad` any strides.
    fn qnorm_rope_bwd(&self, a: &QNormRopeArgs, rstd: &TensorView, grad: &TensorView, dx: &mut TensorViewMut) -> Result<()>;

    /// out `[B,S,W']` i32.
    fn build_sparse_topk_indices(&self, a: &BuildIndicesArgs, out: &mut TensorViewMut) -> Result<()>;
    /// A plan in this backend's own layout (see `SparseIndexPlan`).
    fn plan_sparse_indices(&self, topk_idxs: &TensorView, kv_len: usize, all_rows_nonempty: bool) -> Result<SparseIndexPlan>;
}

type Factory = fn() -> std::result::Result<Box<dyn KernelBackend>, String>;

static CUDA_FACTORY: RwLock<Option<Factory>> = RwLock::new(None);
static CUDA: OnceLock<std::result::Result<Box<dyn KernelBackend>, String>> = OnceLock::new();
static REFERENCE: Reference = Reference;

/// Make a CUDA backend known to dispatch. It is created on first use; a creation
/// failure (no driver, no device) is kept and reported as the reason `cuda` cannot run.
pub fn register_cuda_backend(factory: Factory) {
    *CUDA_FACTORY.write().unwrap() = Some(factory);
}

/// The CUDA backend, or why there is none.
pub fn cuda_backend() -> std::result::Result<&'static dyn KernelBackend, String> {
    let factory = *CUDA_FACTORY.read().unwrap();
    let Some(factory) = factory else {
        return Err("this build has no CUDA backend registered".into());
    };
    match CUDA.get_or_init(factory) {
        Ok(b) => Ok(b.as_ref()),
        Err(e) => Err(e.clone()),
    }
}

pub fn reference_backend() -> &'static dyn KernelBackend {
    &REFERENCE
}

/// Pick the backend for an operation whose tensors all live on `device`.
pub fn select(name: BackendName, op: &'static str, device: Device) -> Result<&'static dyn KernelBackend> {
    match (name, device) {
        (BackendName::Reference, Device::Cpu) | (BackendName::Auto, Device::Cpu) => Ok(&REFERENCE),
        (BackendName::Reference, d) => Err(Error::Unavailable {
            backend: "reference".into(),
            op,
            reason: format!("the reference backend computes on CPU tensors; the inputs are on {d}"),
        }),
        (BackendName::Cuda, Device::Cpu) => Err(Error::Unavailable {
            backend: "cuda".into(),
            op,
            reason: "the inputs are CPU tensors; move them to a CUDA device".into(),
        }),
        (BackendName::Cuda, Device::Cuda(_)) | (BackendName::Auto, Device::Cuda(_)) => {
            cuda_backend().map_err(|reason| Error::Unavailable { backend: "cuda".into(), op, reason })
        }
    }
}

/// Whether this project's GPU kernels for `family` (sinkhorn, sparse_attn, indexer,
/// qnorm_rope) can run in this process. No kernel is compiled and nothing is allocated.
pub fn is_kernel_available(family: &str) -> bool {
    KERNEL_FAMILIES.contains(&family) && cuda_backend().map(|b| b.family_available(family)).unwrap_or(false)
}

/// Check that every tensor of an operation lives on the device of the first one.
pub fn common_device(op: &'static str, tensors: &[(&'static str, &TensorView)]) -> Result<Device> {
    let (first_name, first) = tensors[0];
    let device = first.device();
    for (name, t) in &tensors[1..] {
        if t.device() != device {
            return Err(Error::Device { op, arg: name, expected: format!("{device} (the device of `{first_name}`)"), got: t.device() });
        }
    }
    Ok(device)
}

/// Allocate an output for `backend` on `device` (host memory for the reference).
pub fn alloc_output(backend: &dyn KernelBackend, dtype: DType, shape: &[usize], device: Device) -> Result<Tensor> {
    match device {
        Device::Cpu => Ok(Tensor::zeros(dtype, shape)),
        Device::Cuda(_) => backend.alloc(dtype, shape, device),
    }
}
