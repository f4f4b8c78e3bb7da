//! The scores kernels (`scores.cu` on mma.sync, `scores_sm90.cu` on wgmma): operands, the
//! params both share, their launches, and the dense scores operation.

use dsv4_core::ops::indexer::IndexerArgs;
use dsv4_core::{DType, Result, TensorView, TensorViewMut};

use super::config::{sm90_defines, sm90_fits, sm90_smem_bytes, IdxScores90Config, IdxScoresConfig, IdxTopkScoresConfig, ScoresMode, ScoresTiles, SM90_BQ, SM90_NWG, SM90_THREADS};
use super::pack::{tc_operand, TcOperand};
use super::params::IndexerScoresParams;
use super::{check_bf16, grid_dim, shape_of, strides_i64, to_i32, unavailable, Shape};
use crate::runtime::{Gpu, TmaDesc};
use crate::tuning::configured;

/// Operands of a scores launch prepared once per call.
pub(super) struct ScoresInputs {
    q: TcOperand,
    kv: TcOperand,
    w: Vec<i64>,
    pub(super) tiles: ScoresTiles,
}

/// The operands, and the `scores.cu` tile for `mode` (from the configs).
pub(super) fn scores_inputs(gpu: &Gpu, op: &'static str, a: &IndexerArgs, mode: ScoresMode) -> Result<ScoresInputs> {
    let limit = gpu.props().max_shared_per_block_optin as usize;
    let tiles = ScoresTiles::choose(&configured::<IdxScoresConfig>()?, &configured::<IdxTopkScoresConfig>()?, limit, op, a.q.shape()[2], a.q.shape()[3], mode)?;
    Ok(ScoresInputs { q: tc_operand(gpu, op, &a.q)?, kv: tc_operand(gpu, op, &a.pooled_kv)?, w: strides_i64(&a.weights), tiles })
}

/// Where a launch of `scores.cu` or `scores_sm90.cu` writes: dense or gather scores rows at `out`, or (fused)
/// values at `out` and indices at `idx`, rows of `k` slots.
pub(super) struct ScoresOut {
    pub(super) out: u64,
    pub(super) idx: u64,
    pub(super) k: usize,
    /// Strides of b and of the local query.
    pub(super) strides: (i64, i64),
    /// Dense: write only each row's visible keys (`IndexerScoresParams::visible_only`).
    pub(super) visible_only: bool,
}

/// The params both score kernels (`scores.cu`, `scores_sm90.cu`) share for queries
/// `[s_begin, s_begin + s_count)` written to `dst`; no selection (`topk`, `t` 0), no sort
/// buffer (`sort_cap` 0): the caller sets its own.
fn scores_params(op: &'static str, a: &IndexerArgs, sh: &Shape, inp: &ScoresInputs, dst: &ScoresOut, s_begin: usize, s_count: usize) -> Result<IndexerScoresParams> {
    Ok(IndexerScoresParams {
        q: inp.q.ptr,
        kv: inp.kv.ptr,
        w: a.weights.address(),
        topk: 0,
        out: dst.out,
        idx: dst.idx,
        rows: 0,
        q_sb: inp.q.strides[0],
        q_ss: inp.q.strides[1],
        q_sh: inp.q.strides[2],
        kv_sb: inp.kv.strides[0],
        kv_sp: inp.kv.strides[1],
        w_sb: inp.w[0],
        w_ss: inp.w[1],
        w_sh: inp.w[2],
        t_sb: 0,
        t_ss: 0,
        t_st: 0,
        out_sb: dst.strides.0,
        out_ss: dst.strides.1,
        b: sh.b,
        s: sh.s,
        h: sh.h,
        d: sh.d,
        p: sh.p,
        t: 0,
        s_begin: to_i32(op, "s_begin", s_begin)?,
        s_count: to_i32(op, "s_count", s_count)?,
        query_start: sh.query_start,
        compress_ratio: sh.compress_ratio,
        topk_is_i64: 0,
        k: to_i32(op, "k", dst.k)?,
        sort_cap: 0,
        scale: a.softmax_scale,
        visible_only: dst.visible_only as i32,
    })
}

/// One launch of `scores.cu` over queries `[s_begin, s_begin + s_count)`.
pub(super) fn launch_scores(gpu: &Gpu, op: &'static str, a: &IndexerArgs, sh: &Shape, inp: &ScoresInputs, topk: Option<&TensorView>, dst: &ScoresOut, s_begin: usize, s_count: usize) -> Result<()> {
    let tiles = &inp.tiles;
    let sort_cap = match tiles.mode {
        ScoresMode::Fused { sort_cap, .. } => sort_cap,
        _ => 0,
    };
    let (t_ptr, t_st, t_len, t_i64) = match topk {
        Some(t) => {
            let st = strides_i64(t);
            (t.address(), st, t.shape()[2], t.dtype() == DType::I64)
        }
        None => (0, vec![0; 3], 0, false),
    };
    let prm = IndexerScoresParams {
        topk: t_ptr,
        t_sb: t_st[0],
        t_ss: t_st[1],
        t_st: t_st[2],
        t: to_i32(op, "T", t_len)?,
        topk_is_i64: t_i64 as i32,
        sort_cap: to_i32(op, "sort capacity", sort_cap)?,
        ..scores_params(op, a, sh, inp, dst, s_begin, s_count)?
    };
    let k = gpu.kernel("indexer/scores.cu", "indexer_scores", &tiles.defines())?;
    let grid = [grid_dim(op, "query blocks", s_count.div_ceil(tiles.bq))?, grid_dim(op, "batch", sh.b as usize)?, 1];
    // SAFETY: q/kv rows are 16-byte readable to round_up(D, 8) (tc_operand), weights and
    // topk are live device views whose strides are passed, `out` holds B x s_count rows of
    // P (dense), T (gather) or k (fused, and `idx` likewise) at the given strides (checked
    // by the callers); the dynamic shared memory is the layout of scores.cu for these
    // defines (`smem_bytes`, with the fused rows of P and sort buffer of sort_cap); the
    // params type is the entry's.
    unsafe { k.launch(grid, [tiles.threads(), 1, 1], tiles.smem_bytes() as u32, &prm) }
}

// ---------------------------------------------------------------------------------------
// Hopper scores kernel (scores_sm90.cu): kernel choice and launch

/// Which scores kernel `scores_with` / `fused_topk_with` / `chunked_topk_with` use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScoresPath {
    /// `scores_sm90.cu` where it runs (an sm_90a device, `Gpu::hopper()`; H <= 64,
    /// D <= 128), else `scores.cu`.
    Auto,
    /// `scores.cu` (mma.sync), on any device.
    Portable,
    /// `scores_sm90.cu`; an `Unavailable` error where it cannot run (not sm_90a, or a shape
    /// it does not take). Ignores `DSV4_PORTABLE`, so tests can compare the two paths.
    Hopper,
}

/// The TMA map `scores_sm90.cu` loads key tiles with (IDX90_TMA): kv as a `[B][P][D]` bf16
/// tensor at `kv` (`kv_sb`, `kv_sp` in elements), boxes of 64 keys x 64 head-dim columns
/// (one SW128 group of a ring stage; columns >= D and keys >= P read as zeros). With
/// B = 1 the batch stride is never used (box coordinate 0), so any valid one stands in.
fn sm90_kv_tensor_map(gpu: &Gpu, kv: u64, (b, p, d): (usize, usize, usize), (kv_sb, kv_sp): (i64, i64)) -> Result<TmaDesc> {
    let bytes = |stride: i64| u64::try_from(stride).map_or(0, |s| s.saturating_mul(2)); // negative: 0, refused
    let row = bytes(kv_sp);
    let batch = if b == 1 { row.saturating_mul(p as u64) } else { bytes(kv_sb) };
    gpu.tma_map_bf16(kv, &[d as u64, p as u64, b as u64], &[row, batch], &[64, 64, 1])
}

/// Whether this launch uses `scores_sm90.cu` (`Ok(false)`: `scores.cu`).
pub(super) fn use_sm90(gpu: &Gpu, op: &'static str, path: ScoresPath, h: usize, d: usize) -> Result<bool> {
    let smem = sm90_smem_bytes(&configured::<IdxScores90Config>()?, h, d);
    let smem_ok = smem <= gpu.props().max_shared_per_block_optin as usize;
    match path {
        ScoresPath::Portable => Ok(false),
        ScoresPath::Auto => Ok(gpu.hopper() && sm90_fits(h, d) && smem_ok),
        ScoresPath::Hopper => {
            if gpu.props().arch != "sm_90a" {
                Err(unavailable(op, format!("the Hopper scores kernel needs sm_90a; this device is {}", gpu.props().arch)))
            } else if !sm90_fits(h, d) {
                Err(unavailable(op, format!("the Hopper scores kernel takes H <= 64, D <= 128; got H = {h}, D = {d}")))
            } else if !smem_ok {
                Err(unavailable(op, format!("the Hopper scores kernel needs {smem} bytes of shared memory per CTA here")))
            } else {
                Ok(true)
            }
        }
    }
}

/// One launch of `scores_sm90.cu`: dense rows of queries `[s_begin, s_begin + s_count)` at
/// `dst.out`, one CTA per (batch row, block of 8 queries).
fn launch_scores_sm90(gpu: &Gpu, op: &'static str, a: &IndexerArgs, sh: &Shape, inp: &ScoresInputs, dst: &ScoresOut, s_begin: usize, s_count: usize) -> Result<()> {
    let (b, h, d, p) = (sh.b as usize, sh.h as usize, sh.d as usize, sh.p as usize);
    let cfg = configured::<IdxScores90Config>()?;
    let smem = sm90_smem_bytes(&cfg, h, d);
    let grid_x = s_count.div_ceil(SM90_NWG * SM90_BQ) * b;
    let prm = scores_params(op, a, sh, inp, dst, s_begin, s_count)?;
    // The key ring by TMA where kv can be mapped, else by cp.async: the define is passed
    // either way, so the kernel is compiled for the ring this launch passes a map for.
    let kv_map = if cfg.tma { sm90_kv_tensor_map(gpu, inp.kv.ptr, (b, p, d), (inp.kv.strides[0], inp.kv.strides[1])).ok() } else { None };
    let k = gpu.kernel("indexer/scores_sm90.cu", "indexer_scores_sm90", &sm90_defines(&cfg, h, d, kv_map.is_some())?)?;
    let grid = [grid_dim(op, "query blocks", grid_x)?, 1, 1];
    // SAFETY: q/kv rows are 16-byte readable to round_up(D, 8) (tc_operand, alive in `inp`
    // until the launch is queued), weights is a live device view whose strides are
    // passed; `out` holds B x s_count rows of P at the given strides (checked by the
    // callers); the dynamic shared memory is sm90_smem_bytes for these defines; the params
    // type is the entry's first parameter, TmaDesc its second: the map of kv (B x P x D at
    // kv's strides: TMA reads only elements of kv) with IDX90_TMA=1, zeros (unread) with
    // IDX90_TMA=0.
    unsafe { k.launch2(grid, [SM90_THREADS, 1, 1], smem as u32, &prm, &kv_map.unwrap_or(TmaDesc::ZERO)) }
}

/// Dense scores rows of queries `[s_begin, s_begin + s_count)` into `dst` by the kernel
/// `path` picks.
pub(super) fn launch_dense(gpu: &Gpu, op: &'static str, a: &IndexerArgs, sh: &Shape, inp: &ScoresInputs, dst: &ScoresOut, s_begin: usize, s_count: usize, path: ScoresPath) -> Result<()> {
    if use_sm90(gpu, op, path, sh.h as usize, sh.d as usize)? {
        launch_scores_sm90(gpu, op, a, sh, inp, dst, s_begin, s_count)
    } else {
        launch_scores(gpu, op, a, sh, inp, None, dst, s_begin, s_count)
    }
}

// ---------------------------------------------------------------------------------------
// The operation

/// Scores `[B,S,P]` f32 with the causal -inf (SPEC.md section 2), into the validated `out`.
pub(crate) fn scores(gpu: &Gpu, a: &IndexerArgs, out: &mut TensorViewMut) -> Result<()> {
    scores_with(gpu, a, out, ScoresPath::Auto)
}

/// The scores by the kernel `path` picks (tests compare the two); `a` and `out` as
/// `dsv4_core::ops::indexer::indexer_scores_into` validates them.
pub fn scores_with(gpu: &Gpu, a: &IndexerArgs, out: &mut TensorViewMut, path: ScoresPath) -> Result<()> {
    const OP: &str = "indexer_scores";
    check_bf16(OP, a)?;
    let sh = shape_of(OP, a)?;
    let (b, s, p) = (sh.b as usize, sh.s as usize, sh.p as usize);
    if b * s * p == 0 {
        return Ok(());
    }
    let inp = scores_inputs(gpu, OP, a, ScoresMode::Dense)?;
    let dst = ScoresOut { out: out.as_view().address(), idx: 0, k: 0, strides: ((s * p) as i64, p as i64), visible_only: false };
    launch_dense(gpu, OP, a, &sh, &inp, &dst, 0, s, path)
}
