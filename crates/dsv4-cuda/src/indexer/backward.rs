//! Backward of the top-k scores: `bwd_sm90.cu` on Hopper, else `bwd_mma.cu` / `bwd.cu`, with
//! the deterministic partial-dkv reduction.

use dsv4_core::ops::indexer::IndexerTopkScoresBwdArgs;
use dsv4_core::{DType, Result, TensorViewMut};

use super::config::{bwd_defines, bwd_mma_fits, bwd_mma_smem_bytes, bwd_sm90_smem_bytes, bwd_smem_bytes, shape_defines, IdxBwd90Config, IdxBwdConfig, IdxBwdMmaConfig, BWD_MMA_THREADS, BWD_SM90_THREADS};
use super::pack::{tc_operand, TcOperand};
use super::params::{IndexerBwdParams, IndexerBwdReduceParams, IndexerBwdSm90Params};
use super::{check_bf16, grid_dim, shape_of, strides_i64, to_i32, unavailable, Shape};
use crate::runtime::{Gpu, Scratch};
use crate::tuning::configured;

// ---------------------------------------------------------------------------------------
// Hopper backward (bwd_sm90.cu): kernel choice and launch

/// Which backward kernel [`topk_scores_backward_with`] uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BwdPath {
    /// `bwd_sm90.cu` where `bwd_sm90_unsupported` has no objection, on a Hopper device
    /// (`Gpu::hopper()`), unless `idx_bwd90.enabled` is off; else the portable kernels.
    Auto,
    /// `bwd_mma.cu` / `bwd.cu`, on any device.
    Portable,
    /// `bwd_sm90.cu`; an `Unavailable` error where it cannot run. Ignores `DSV4_PORTABLE` and
    /// the config, so tests can compare the kernels.
    Hopper,
}

/// Why `bwd_sm90.cu` cannot take this call (`None`: it can): atomic mode only, H <= 64,
/// D <= 128 a multiple of 8 (whole 16-byte rows, 4-column dkv reductions), T >= 1, B*S rows
/// in i32, dq 4-byte and dpooled_kv 16-byte aligned, an sm_90a device with the opt-in
/// shared memory.
fn bwd_sm90_unsupported(gpu: &Gpu, a: &IndexerTopkScoresBwdArgs, dq: &TensorViewMut, dkv: &TensorViewMut) -> Option<String> {
    let (h, d) = (a.fwd.q.shape()[2], a.fwd.q.shape()[3]);
    let (b, s, t) = (a.fwd.q.shape()[0], a.fwd.q.shape()[1], a.topk_indices.shape()[2]);
    if gpu.props().arch != "sm_90a" {
        return Some(format!("the Hopper backward needs sm_90a; this device is {}", gpu.props().arch));
    }
    if a.deterministic {
        return Some("the Hopper backward has no deterministic mode (bwd_mma.cu has)".into());
    }
    if !(1..=64).contains(&h) || !(8..=128).contains(&d) || d % 8 != 0 {
        return Some(format!("the Hopper backward takes H <= 64 and D <= 128 a multiple of 8; got H = {h}, D = {d}"));
    }
    if t == 0 || b * s > i32::MAX as usize {
        return Some(format!("the Hopper backward takes T >= 1 and B*S < 2^31; got T = {t}, B*S = {}", b * s));
    }
    if !dq.as_view().address().is_multiple_of(4) || !dkv.as_view().address().is_multiple_of(16) {
        return Some("the Hopper backward needs dq 4-byte and dpooled_kv 16-byte aligned".into());
    }
    let smem = bwd_sm90_smem_bytes(d);
    if smem > gpu.props().max_shared_per_block_optin as usize {
        return Some(format!("the Hopper backward needs {smem} bytes of shared memory per CTA; the device allows {}", gpu.props().max_shared_per_block_optin));
    }
    None
}

/// Whether this call runs `bwd_sm90.cu` (`Ok(false)`: the portable kernels).
fn use_bwd_sm90(gpu: &Gpu, op: &'static str, path: BwdPath, a: &IndexerTopkScoresBwdArgs, dq: &TensorViewMut, dkv: &TensorViewMut) -> Result<bool> {
    match path {
        BwdPath::Portable => Ok(false),
        BwdPath::Auto => Ok(gpu.hopper() && configured::<IdxBwd90Config>()?.enabled && bwd_sm90_unsupported(gpu, a, dq, dkv).is_none()),
        BwdPath::Hopper => match bwd_sm90_unsupported(gpu, a, dq, dkv) {
            Some(why) => Err(unavailable(op, why)),
            None => Ok(true),
        },
    }
}

/// One launch of `bwd_sm90.cu` (the caller checked `bwd_sm90_unsupported`): dpooled_kv
/// zeroed, then a persistent grid of at most one CTA per SM, two query rows in flight per CTA.
fn launch_bwd_sm90(gpu: &Gpu, op: &'static str, a: &IndexerTopkScoresBwdArgs, sh: &Shape, dq: u64, dw: u64, dkv: u64) -> Result<()> {
    let f = &a.fwd;
    let (b, s, h, d, p) = (sh.b as usize, sh.s as usize, sh.h as usize, sh.d as usize, sh.p as usize);
    gpu.zero(dkv, b * p * d * 4)?;
    let (tq, tkv) = (tc_operand(gpu, op, &f.q)?, tc_operand(gpu, op, &f.pooled_kv)?);
    let (w, tk, g) = (strides_i64(&f.weights), strides_i64(&a.topk_indices), strides_i64(&a.grad));
    let smem = bwd_sm90_smem_bytes(d);
    let prm = IndexerBwdSm90Params {
        q: tq.ptr,
        kv: tkv.ptr,
        w: f.weights.address(),
        topk: a.topk_indices.address(),
        grad: a.grad.address(),
        dq,
        dw,
        dkv,
        q_sb: tq.strides[0],
        q_ss: tq.strides[1],
        q_sh: tq.strides[2],
        kv_sb: tkv.strides[0],
        kv_sp: tkv.strides[1],
        w_sb: w[0],
        w_ss: w[1],
        w_sh: w[2],
        t_sb: tk[0],
        t_ss: tk[1],
        t_st: tk[2],
        g_sb: g[0],
        g_ss: g[1],
        g_st: g[2],
        b: sh.b,
        s: sh.s,
        h: sh.h,
        d: sh.d,
        p: sh.p,
        t: to_i32(op, "T", a.topk_indices.shape()[2])?,
        query_start: sh.query_start,
        compress_ratio: sh.compress_ratio,
        topk_is_i64: (a.topk_indices.dtype() == DType::I64) as i32,
        smem_bytes: smem as i32,
        scale: f.softmax_scale,
        pad_: 0,
    };
    // One CTA per SM (196 KiB of shared memory, 384 threads at 168 registers), each with two
    // rows in flight (one per consumer); fewer when there are fewer rows.
    let grid = (gpu.props().sm_count as usize).min((b * s).div_ceil(2)).max(1);
    let k = gpu.kernel("indexer/bwd_sm90.cu", "indexer_bwd_sm90", &shape_defines(h, d))?;
    // SAFETY: q / pooled_kv are 16-byte rows readable to D (a multiple of 8; tc_operand,
    // alive until after the launch is queued, scratch frees are stream ordered); weights,
    // topk, grad are live device views read at their own strides; dq / dw are contiguous
    // [B,S,H,D] / [B,S,H] outputs (dq 4-byte aligned), dkv the zeroed contiguous [B,P,D]
    // output, 16-byte aligned (bwd_sm90_unsupported); B*S < 2^31; shared memory is
    // bwd_sm90_smem_bytes(D), which the kernel checks against its layout; the params type
    // is the entry's.
    unsafe { k.launch([grid_dim(op, "CTAs", grid)?, 1, 1], [BWD_SM90_THREADS, 1, 1], smem as u32, &prm) }
}

// ---------------------------------------------------------------------------------------
// The operation

/// Backward of `topk_scores`: dq `[B,S,H,D]` bf16, dweights `[B,S,H]` f32, dpooled_kv
/// `[B,P,D]` f32 (atomics, or a fixed-order reduction when `a.deterministic`), into the
/// validated outputs. Tensor cores (`bwd_sm90.cu` on Hopper in atomic mode, else
/// `bwd_mma.cu`) for H <= 64, D <= 128; CUDA cores (`bwd.cu`) beyond.
pub(crate) fn topk_scores_backward(gpu: &Gpu, a: &IndexerTopkScoresBwdArgs, dq: &mut TensorViewMut, dw: &mut TensorViewMut, dkv: &mut TensorViewMut) -> Result<()> {
    topk_scores_backward_with(gpu, a, dq, dw, dkv, BwdPath::Auto)
}

/// [`topk_scores_backward`] by the kernel `path` picks (tests compare them); `a` and the
/// outputs as `dsv4_core::ops::indexer::indexer_topk_scores_backward_into` validates them.
pub fn topk_scores_backward_with(gpu: &Gpu, a: &IndexerTopkScoresBwdArgs, dq: &mut TensorViewMut, dw: &mut TensorViewMut, dkv: &mut TensorViewMut, path: BwdPath) -> Result<()> {
    const OP: &str = "indexer_topk_scores_backward";
    let f = &a.fwd;
    check_bf16(OP, f)?;
    let sh = shape_of(OP, f)?;
    let (b, s, h, d, p) = (sh.b as usize, sh.s as usize, sh.h as usize, sh.d as usize, sh.p as usize);
    if b * s > 0 && use_bwd_sm90(gpu, OP, path, a, dq, dkv)? {
        return launch_bwd_sm90(gpu, OP, a, &sh, dq.as_view().address(), dw.as_view().address(), dkv.as_view().address());
    }
    let bwd_cfg = configured::<IdxBwdConfig>()?;
    // bwd_mma.cu writes dq pairs as 4-byte words and adds dkv pairs as 8-byte vectors
    // when D is even: it needs dq and the atomic target aligned to match.
    let aligned = d % 2 == 1 || (dq.as_view().address().is_multiple_of(4) && (a.deterministic || dkv.as_view().address().is_multiple_of(8)));
    let mma = bwd_mma_fits(h, d) && aligned;
    let smem = if mma { bwd_mma_smem_bytes(h, d, a.deterministic) } else { bwd_smem_bytes(&bwd_cfg, h, d) };
    let limit = gpu.props().max_shared_per_block_optin as usize;
    if smem > limit {
        return Err(unavailable(OP, format!("H = {h}, D = {d} need {smem} bytes of shared memory per CTA; the device allows {limit}")));
    }
    let dkv_ptr = dkv.as_view().address();
    let dkv_bytes = b * p * d * 4;
    if b * s == 0 {
        return gpu.zero(dkv_ptr, dkv_bytes); // no query: dpooled_kv = 0 (dq, dw are empty)
    }
    let (n_chunks, rows_per_cta, workspace) = bwd_dkv_chunks(gpu, a, (b, s, p, d), dkv_ptr, dkv_bytes)?;
    let (prm, _packed) = bwd_params(gpu, OP, a, &sh, mma, dq.as_view().address(), dw.as_view().address(), dkv_ptr, &workspace, n_chunks, rows_per_cta)?;
    let grid = [grid_dim(OP, "query chunks", n_chunks)?, grid_dim(OP, "batch", b)?, 1];
    if mma {
        let k = gpu.kernel("indexer/bwd_mma.cu", "indexer_bwd_mma", &shape_defines(h, d))?;
        // SAFETY: q / pooled_kv are 16-byte rows readable to round_up(D, 8) (tc_operand,
        // alive in `_packed` until after the launch is queued; scratch frees are stream
        // ordered), weights, topk, grad are live device views read at their own strides;
        // dq/dw are contiguous outputs of [B,S,H,D] / [B,S,H]; dkv is the zeroed [B,P,D]
        // output (atomic) or the zeroed [B, n_chunks, P, D] workspace whose chunk count
        // matches the grid; shared memory is bwd_mma_smem_bytes(H, D, deterministic) for
        // these defines; the params type is the entry's.
        unsafe { k.launch(grid, [BWD_MMA_THREADS, 1, 1], smem as u32, &prm)? };
    } else {
        let k = gpu.kernel("indexer/bwd.cu", "indexer_bwd", &bwd_defines(&bwd_cfg)?)?;
        // SAFETY: q, pooled_kv, weights, topk, grad are live device views read at their own
        // strides; dq/dw are contiguous outputs of [B,S,H,D] / [B,S,H]; dkv is the zeroed
        // [B,P,D] output (atomic) or the zeroed [B, n_chunks, P, D] workspace whose chunk
        // count matches the grid; shared memory is bwd_smem_bytes(H, D) for the config's
        // BWD_THREADS / BWD_NS, which the kernel is compiled with; the params type is the
        // entry's.
        unsafe { k.launch(grid, [bwd_cfg.threads as u32, 1, 1], smem as u32, &prm)? };
    }
    if let Some(ws) = &workspace {
        launch_bwd_reduce(gpu, OP, &sh, &bwd_cfg, ws, dkv_ptr, n_chunks)?;
    }
    Ok(())
}

/// Where the portable kernels accumulate dpooled_kv, as `(n_chunks, rows_per_cta,
/// workspace)`: the zeroed partial slices of the deterministic mode, else `dkv` itself,
/// zeroed (`dkv_ptr`, `dkv_bytes`).
fn bwd_dkv_chunks(gpu: &Gpu, a: &IndexerTopkScoresBwdArgs, (b, s, p, d): (usize, usize, usize, usize), dkv_ptr: u64, dkv_bytes: usize) -> Result<(usize, usize, Option<Scratch>)> {
    // Deterministic: chunks of consecutive queries, each CTA with its own partial slice;
    // about `det_ctas_per_sm` CTAs per SM, within `det_workspace_bytes`.
    if a.deterministic && p * d > 0 {
        let cfg = configured::<IdxBwdMmaConfig>()?;
        let want = (cfg.det_ctas_per_sm.max(1) * gpu.props().sm_count as usize).div_ceil(b).max(1);
        let fit = (cfg.det_workspace_bytes / (b * p * d * 4)).max(1);
        let rows = s.div_ceil(want.min(fit).min(s));
        let n = s.div_ceil(rows);
        let ws = gpu.scratch(b * n * p * d * 4)?;
        gpu.zero(ws.ptr(), b * n * p * d * 4)?;
        Ok((n, rows, Some(ws)))
    } else {
        gpu.zero(dkv_ptr, dkv_bytes)?;
        Ok((s, 1, None))
    }
}

/// The params of `bwd_mma.cu` (`mma`) or `bwd.cu`, dkv into `workspace` when there is one
/// (`n_chunks` partial slices), else into `dkv_ptr`; with the packed tensor-core operands,
/// which must stay alive until the launch is queued.
fn bwd_params(gpu: &Gpu, op: &'static str, a: &IndexerTopkScoresBwdArgs, sh: &Shape, mma: bool, dq: u64, dw: u64, dkv_ptr: u64, workspace: &Option<Scratch>, n_chunks: usize, rows_per_cta: usize) -> Result<(IndexerBwdParams, Option<(TcOperand, TcOperand)>)> {
    let f = &a.fwd;
    let (p, d) = (sh.p as usize, sh.d as usize);
    let t = a.topk_indices.shape()[2];
    let (mut q, mut kv, w, tk, g) = (strides_i64(&f.q), strides_i64(&f.pooled_kv), strides_i64(&f.weights), strides_i64(&a.topk_indices), strides_i64(&a.grad));
    // Tensor cores: q and pooled_kv as 16-byte rows (packed when they are not), d-stride 1.
    let (q_ptr, kv_ptr, packed) = if mma {
        let (tq, tkv) = (tc_operand(gpu, op, &f.q)?, tc_operand(gpu, op, &f.pooled_kv)?);
        q = vec![tq.strides[0], tq.strides[1], tq.strides[2], 1];
        kv = vec![tkv.strides[0], tkv.strides[1], 1];
        (tq.ptr, tkv.ptr, Some((tq, tkv)))
    } else {
        (f.q.address(), f.pooled_kv.address(), None)
    };
    let prm = IndexerBwdParams {
        q: q_ptr,
        kv: kv_ptr,
        w: f.weights.address(),
        topk: a.topk_indices.address(),
        grad: a.grad.address(),
        dq,
        dw,
        dkv: workspace.as_ref().map(|w| w.ptr()).unwrap_or(dkv_ptr),
        q_sb: q[0],
        q_ss: q[1],
        q_sh: q[2],
        q_sd: q[3],
        kv_sb: kv[0],
        kv_sp: kv[1],
        kv_sd: kv[2],
        w_sb: w[0],
        w_ss: w[1],
        w_sh: w[2],
        t_sb: tk[0],
        t_ss: tk[1],
        t_st: tk[2],
        g_sb: g[0],
        g_ss: g[1],
        g_st: g[2],
        dkv_sb: if workspace.is_some() { (n_chunks * p * d) as i64 } else { (p * d) as i64 },
        dkv_sc: if workspace.is_some() { (p * d) as i64 } else { 0 },
        b: sh.b,
        s: sh.s,
        h: sh.h,
        d: sh.d,
        p: sh.p,
        t: to_i32(op, "T", t)?,
        rows_per_cta: to_i32(op, "rows per CTA", rows_per_cta)?,
        query_start: sh.query_start,
        compress_ratio: sh.compress_ratio,
        topk_is_i64: (a.topk_indices.dtype() == DType::I64) as i32,
        deterministic: workspace.is_some() as i32,
        scale: f.softmax_scale,
    };
    Ok((prm, packed))
}

/// The fixed-order sum of the deterministic partial slices `ws` (`[B, n_chunks, P*D]`)
/// into dpooled_kv at `dkv_ptr`.
fn launch_bwd_reduce(gpu: &Gpu, op: &'static str, sh: &Shape, bwd_cfg: &IdxBwdConfig, ws: &Scratch, dkv_ptr: u64, n_chunks: usize) -> Result<()> {
    let (b, p, d) = (sh.b as usize, sh.p as usize, sh.d as usize);
    let rp = IndexerBwdReduceParams { partial: ws.ptr(), dkv: dkv_ptr, n: (p * d) as i64, b: sh.b, n_chunks: to_i32(op, "chunks", n_chunks)? };
    // The reduce entry lives in bwd.cu, whose module needs the backward's defines (the
    // same module as `indexer_bwd`; the reduce itself reads none of them).
    let kr = gpu.kernel("indexer/bwd.cu", "indexer_bwd_reduce", &bwd_defines(bwd_cfg)?)?;
    let blocks = (b * p * d).div_ceil(256).min(gpu.props().sm_count as usize * 8).max(1) as u32;
    // SAFETY: `partial` is the [B, n_chunks, P*D] workspace written above (stream
    // order), `dkv` the contiguous [B,P,D] output; the params type is the entry's.
    unsafe { kr.launch([blocks, 1, 1], [256, 1, 1], 0, &rp) }
}
