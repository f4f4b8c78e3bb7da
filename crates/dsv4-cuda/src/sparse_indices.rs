//! `build_sparse_topk_indices` on the GPU (SPEC.md section 6): launcher for
//! `kernels/sparse_indices/build.cu` — a per-batch-row scan of the vision spans (when
//! given), then a block per query row and a thread per slot.

use dsv4_core::ops::sparse_indices::BuildIndicesArgs;
use dsv4_core::{DType, Error, Result, TensorView, TensorViewMut};

use crate::runtime::Gpu;

const OP: &str = "build_sparse_topk_indices";

/// Mirrors `BuildIndicesParams` (kernels/sparse_indices/build.cuh).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct BuildIndicesParams {
    /// `[B,S,W']` i32 contiguous.
    pub out: u64,
    /// `[B,1,S,>=K]` bf16/f32, strides `mask_stride`; 0 = none.
    pub mask: u64,
    /// `[B,S,Tc]` i32/i64, strides `ct_stride`; 0 = none.
    pub compressed_topk: u64,
    /// `[S]`, `[1,S]` or `[B,S]` i32/i64; 0 = `0..S`.
    pub q_positions: u64,
    /// `[B,S]` i32/i64.
    pub vision_types: u64,
    /// `[3][B][S]` i32 scratch (last start, first end, inside); 0 without vision.
    pub spans: u64,
    /// Mask strides of dims b, s, k.
    pub mask_stride: [i64; 3],
    pub ct_stride: [i64; 3],
    /// b (0 when broadcast), s.
    pub qp_stride: [i64; 2],
    pub vt_stride: [i64; 2],
    pub batch: i64,
    pub seq_len: i64,
    pub key_len: i64,
    pub window: i64,
    pub compress_ratio: i64,
    pub n_pooled: i64,
    pub compressed_width: i64,
    pub vanilla_key_len: i64,
    pub max_image_tokens: i64,
    pub window_width: i64,
    pub width: i64,
    pub mask_is_bf16: i32,
    pub ct_is_i64: i32,
    pub qp_is_i64: i32,
    pub vt_is_i64: i32,
    pub vision: i32,
    pub has_compressed_topk: i32,
}

const _: () = assert!(std::mem::size_of::<BuildIndicesParams>() == 240);

pub const PARAMS_SIZES: &[(&str, usize)] = &[("BuildIndicesParams", 240)];

fn is_i64(v: &TensorView) -> i32 {
    (v.dtype() == DType::I64) as i32
}

fn st(v: &TensorView, d: usize) -> i64 {
    v.strides()[d] as i64
}

pub fn build(gpu: &Gpu, a: &BuildIndicesArgs, out: &mut TensorViewMut) -> Result<()> {
    let (dm, _) = a.validate()?;
    if !out.is_contiguous() {
        return Err(Error::Layout { op: OP, arg: "out", reason: "the CUDA kernel writes a contiguous output".into() });
    }
    let (b, s, width) = (dm.batch_size, dm.seq_len, dm.width());
    if (b * s * width) == 0 {
        return Ok(());
    }
    if s > i32::MAX as usize {
        return Err(Error::Unavailable { backend: "cuda".into(), op: OP, reason: format!("seq_len = {s} exceeds the i32 positions of the vision-span scan") });
    }
    let mut p = BuildIndicesParams {
        out: out.address(),
        batch: b as i64,
        seq_len: s as i64,
        key_len: dm.key_len as i64,
        window: dm.window_size as i64,
        compress_ratio: dm.compress_ratio as i64,
        n_pooled: dm.n_pooled as i64,
        compressed_width: dm.compressed_width as i64,
        vanilla_key_len: dm.vanilla_key_len as i64,
        max_image_tokens: dm.max_image_tokens as i64,
        window_width: dm.window_width() as i64,
        width: width as i64,
        vision: dm.vision() as i32,
        has_compressed_topk: (dm.n_pooled > 0 && dm.has_compressed_topk) as i32,
        ..Default::default()
    };
    if let Some(m) = &a.attention_mask {
        p.mask = m.address();
        p.mask_is_bf16 = (m.dtype() == DType::BF16) as i32;
        p.mask_stride = [st(m, 0), st(m, 2), st(m, 3)];
    }
    if let Some(ct) = &a.compressed_topk {
        p.compressed_topk = ct.address();
        p.ct_is_i64 = is_i64(ct);
        p.ct_stride = [st(ct, 0), st(ct, 1), st(ct, 2)];
    }
    if let Some(qp) = &a.q_positions {
        p.q_positions = qp.address();
        p.qp_is_i64 = is_i64(qp);
        // [S] and [1,S] broadcast over the batch (stride 0); [B,S] is per row.
        p.qp_stride = match qp.shape().len() {
            1 => [0, st(qp, 0)],
            _ if qp.shape()[0] == 1 => [0, st(qp, 1)],
            _ => [st(qp, 0), st(qp, 1)],
        };
    }
    let mut scratch = None;
    if dm.vision() {
        let vt = a.vision_token_types.as_ref().expect("validated: vision implies vision_token_types");
        p.vision_types = vt.address();
        p.vt_is_i64 = is_i64(vt);
        p.vt_stride = [st(vt, 0), st(vt, 1)];
        let spans = gpu.scratch(3 * b * s * 4)?;
        p.spans = spans.ptr();
        let k = gpu.kernel("sparse_indices/build.cu", "vision_spans", &[])?;
        // SAFETY: vision_token_types is a validated [B,S] integer view (strides and width
        // passed); `spans` holds 3*B*S i32, the kernel writes [3][B][S]; one block per
        // batch row of 512 threads (SPAN_THREADS, its static shared arrays' size).
        unsafe { k.launch([b as u32, 1, 1], [512, 1, 1], 0, &p)? };
        scratch = Some(spans);
    }
    let k = gpu.kernel("sparse_indices/build.cu", "build_indices", &[])?;
    // A block per query row (grid-stride), its threads over the row's W' slots: up to 256,
    // fewer for narrow rows so that few threads idle.
    let threads = width.next_multiple_of(32).min(256) as u32;
    let grid = (b * s).min(gpu.props().sm_count as usize * 64).max(1) as u32;
    // SAFETY: every optional tensor is a validated view whose strides and integer width
    // are passed (mask [B,1,S,>=K] read only at k < K; compressed_topk [B,S,Tc] at t < Tc;
    // q_positions [S]/[1,S]/[B,S]); `out` is contiguous [B,S,W'] i32 (checked above);
    // `spans` (vision only) was filled by vision_spans on this stream and lives until
    // after the launch is queued (stream-ordered free).
    let r = unsafe { k.launch([grid, 1, 1], [threads, 1, 1], 0, &p) };
    drop(scratch);
    r
}
