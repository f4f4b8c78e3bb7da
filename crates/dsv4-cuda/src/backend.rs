//! [`CudaBackend`]: dsv4-core's `KernelBackend` on this crate's runtime and kernels, and
//! [`register`], which makes it the `cuda` backend of dsv4-core's dispatch.
//!
//! Each op resolves the [`Gpu`] of its tensors' device and delegates to the launcher of
//! its family (`sinkhorn`, `qnorm_rope`, `sparse_indices`, `sparse_attention`, `indexer`).

use dsv4_core::backend::{register_cuda_backend, KernelBackend};
use dsv4_core::ops::indexer::{IndexerArgs, IndexerTopkScoresBwdArgs};
use dsv4_core::ops::qnorm_rope::QNormRopeArgs;
use dsv4_core::ops::sinkhorn::SinkhornArgs;
use dsv4_core::ops::sparse_attention::{SparseAttentionArgs, SparseAttentionBwdArgs};
use dsv4_core::ops::sparse_indices::{BuildIndicesArgs, SparseIndexPlan};
use dsv4_core::{DType, Device, Error, Result, Tensor, TensorView, TensorViewMut};

use crate::runtime::{self, gpu, ordinal_of, Gpu};
use crate::{indexer, nvrtc, qnorm_rope, sinkhorn, sparse_attention, sparse_indices};

/// The CUDA backend. Created by [`register`]'s factory once a driver, a device and NVRTC
/// were found.
pub struct CudaBackend {
    _private: (),
}

/// Make the CUDA backend known to dsv4-core's dispatch (`cuda`, `auto`). The backend is
/// created on first use; when there is no driver, device or NVRTC, the reason is kept and
/// reported by every call that asks for `cuda`.
pub fn register() {
    register_cuda_backend(factory);
}

fn factory() -> std::result::Result<Box<dyn KernelBackend>, String> {
    CudaBackend::new().map(|b| Box::new(b) as Box<dyn KernelBackend>).map_err(|e| e.to_string())
}

impl CudaBackend {
    /// Check that device 0 and NVRTC can be used.
    pub fn new() -> Result<Self> {
        gpu(0)?;
        nvrtc::nvrtc()?;
        Ok(CudaBackend { _private: () })
    }
}

fn gpu_of(op: &'static str, device: Device) -> Result<&'static Gpu> {
    gpu(ordinal_of(op, device)?)
}

impl KernelBackend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn describe(&self) -> Vec<String> {
        let mut lines = Vec::new();
        lines.push(format!("cuda: driver library {}", runtime::driver_library().unwrap_or_else(|e| e)));
        match nvrtc::nvrtc() {
            Ok(nv) => lines.push(format!(
                "cuda: NVRTC {}.{} from {}; CUDA headers {}",
                nv.version.0,
                nv.version.1,
                nv.library,
                nv.include_dir.as_ref().map(|d| d.display().to_string()).unwrap_or_else(|| "(NVRTC built-ins)".into())
            )),
            Err(e) => lines.push(format!("cuda: {e}")),
        }
        lines.push(format!("cuda: kernel cache {}", runtime::cache_dir().map(|d| d.display().to_string()).unwrap_or_else(|| "(none: no HOME or XDG_CACHE_HOME)".into())));
        let n = runtime::device_count().unwrap_or(0);
        for i in 0..n {
            match gpu(i) {
                Ok(g) => {
                    let p = g.props();
                    let (free, _) = g.mem_info().unwrap_or((0, 0));
                    lines.push(format!(
                        "cuda:{i}: {} (compute capability {}.{}, compiled for {}), {} SMs, {:.1} GiB ({:.1} GiB free), {} KiB shared memory per block (opt-in), {} MiB L2, driver {}.{}",
                        p.name,
                        p.compute_capability.0,
                        p.compute_capability.1,
                        p.arch,
                        p.sm_count,
                        p.total_memory as f64 / (1u64 << 30) as f64,
                        free as f64 / (1u64 << 30) as f64,
                        p.max_shared_per_block_optin / 1024,
                        p.l2_bytes >> 20,
                        p.driver_version / 1000,
                        (p.driver_version % 1000) / 10
                    ));
                    for (src, e) in g.compiled_entries() {
                        lines.push(format!("cuda:{i}:   {src}: {e}"));
                    }
                }
                Err(e) => lines.push(format!("cuda:{i}: {e}")),
            }
        }
        for fam in dsv4_core::backend::KERNEL_FAMILIES {
            lines.push(format!("cuda: kernels `{fam}`: {}", if self.family_available(fam) { "available" } else { "not built yet" }));
        }
        lines
    }

    fn family_available(&self, family: &str) -> bool {
        // The backend exists only when the runtime initialised (see `new`).
        match family {
            "sinkhorn" | "qnorm_rope" => true,
            "sparse_attn" => sparse_attention::READY,
            "indexer" => indexer::READY,
            _ => false,
        }
    }

    fn alloc(&self, dtype: DType, shape: &[usize], device: Device) -> Result<Tensor> {
        gpu_of("alloc", device)?.alloc(dtype, shape)
    }

    fn upload(&self, src: &TensorView, device: Device) -> Result<Tensor> {
        if src.device() != Device::Cpu {
            return Err(Error::Device { op: "upload", arg: "src", expected: "a host tensor".into(), got: src.device() });
        }
        let g = gpu_of("upload", device)?;
        let host = src.to_tensor()?; // contiguous host copy
        let t = g.alloc(host.dtype(), host.shape())?;
        let bytes = host.numel() * host.dtype().size();
        // SAFETY: `host` is a contiguous host tensor of `numel` elements of its dtype, so
        // its storage is `bytes` readable bytes starting at its address.
        let src_bytes = unsafe { std::slice::from_raw_parts(host.view().address() as usize as *const u8, bytes) };
        g.upload_bytes(t.view().address(), src_bytes)?;
        Ok(t)
    }

    fn synchronize(&self, device: Device) -> Result<()> {
        match device {
            Device::Cpu => Ok(()),
            d => gpu_of("synchronize", d)?.synchronize(),
        }
    }

    fn sparse_attention_fwd(&self, a: &SparseAttentionArgs, out: &mut TensorViewMut, lse: &mut TensorViewMut) -> Result<()> {
        sparse_attention::forward(gpu_of("sparse_attention", a.q.device())?, a, out, lse)
    }

    fn sparse_attention_bwd(&self, a: &SparseAttentionBwdArgs, dq: &mut TensorViewMut, dkv: &mut TensorViewMut, dsinks: &mut TensorViewMut) -> Result<()> {
        sparse_attention::backward(gpu_of("sparse_attention_backward", a.fwd.q.device())?, a, dq, dkv, dsinks)
    }

    fn dense_attention_topk(&self, a: &SparseAttentionArgs, out: &mut TensorViewMut) -> Result<()> {
        sparse_attention::dense(gpu_of("dense_attention_topk", a.q.device())?, a, out)
    }

    fn indexer_scores(&self, a: &IndexerArgs, scores: &mut TensorViewMut) -> Result<()> {
        indexer::scores(gpu_of("indexer_scores", a.q.device())?, a, scores)
    }

    fn indexer_topk(&self, scores: &TensorView, k: usize, indices: &mut TensorViewMut, values: &mut TensorViewMut) -> Result<()> {
        indexer::topk(gpu_of("indexer_topk", scores.device())?, scores, k, indices, values)
    }

    fn indexer_fused_topk(&self, a: &IndexerArgs, k: usize, indices: &mut TensorViewMut, values: &mut TensorViewMut) -> Result<()> {
        indexer::fused_topk(gpu_of("lightning_indexer", a.q.device())?, a, k, indices, values)
    }

    fn indexer_topk_scores(&self, a: &IndexerArgs, topk_indices: &TensorView, out: &mut TensorViewMut) -> Result<()> {
        indexer::topk_scores(gpu_of("indexer_topk_scores", a.q.device())?, a, topk_indices, out)
    }

    fn indexer_topk_scores_bwd(&self, a: &IndexerTopkScoresBwdArgs, dq: &mut TensorViewMut, dweights: &mut TensorViewMut, dpooled_kv: &mut TensorViewMut) -> Result<()> {
        indexer::topk_scores_backward(gpu_of("indexer_topk_scores_backward", a.fwd.q.device())?, a, dq, dweights, dpooled_kv)
    }

    fn sinkhorn_fwd(&self, a: &SinkhornArgs, out: &mut TensorViewMut) -> Result<()> {
        sinkhorn::forward(gpu_of("sinkhorn_normalize", a.x.device())?, a, out)
    }

    fn sinkhorn_bwd(&self, a: &SinkhornArgs, dout: &TensorView, dx: &mut TensorViewMut) -> Result<()> {
        sinkhorn::backward(gpu_of("sinkhorn_normalize_backward", a.x.device())?, a, dout, dx)
    }

    fn qnorm_rope_fwd(&self, a: &QNormRopeArgs, out: &mut TensorViewMut, rstd: &mut TensorViewMut) -> Result<()> {
        qnorm_rope::forward(gpu_of("qnorm_rope", a.x.device())?, a, out, rstd)
    }

    fn qnorm_rope_bwd(&self, a: &QNormRopeArgs, rstd: &TensorView, grad: &TensorView, dx: &mut TensorViewMut) -> Result<()> {
        qnorm_rope::backward(gpu_of("qnorm_rope_backward", a.x.device())?, a, rstd, grad, dx)
    }

    fn build_sparse_topk_indices(&self, a: &BuildIndicesArgs, out: &mut TensorViewMut) -> Result<()> {
        let (_, device) = a.validate()?;
        sparse_indices::build(gpu_of("build_sparse_topk_indices", device)?, a, out)
    }

    fn plan_sparse_indices(&self, topk_idxs: &TensorView, kv_len: usize, all_rows_nonempty: bool) -> Result<SparseIndexPlan> {
        sparse_attention::plan(gpu_of("plan_sparse_indices", topk_idxs.device())?, topk_idxs, kv_len, all_rows_nonempty)
    }
}
