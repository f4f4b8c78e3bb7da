//! Top-k selection: `topk.cu` over scores rows, and the scores + top-k operations (fused in
//! one launch, or chunked through a bounded scratch).

use dsv4_core::ops::indexer::IndexerArgs;
use dsv4_core::{Result, TensorView, TensorViewMut};

use super::config::{topk_defines, topk_launch, IdxScoresConfig, IdxTopkConfig, ScoresMode};
use super::params::IndexerTopkParams;
use super::scores::{launch_dense, launch_scores, scores_inputs, use_sm90, ScoresOut, ScoresPath};
use super::{check_bf16, grid_dim, shape_of, strides_i64, to_i32, Shape};
use crate::runtime::Gpu;
use crate::tuning::configured;

/// One launch of `topk.cu` over rows `[B, s_count]` of scores at `scores` with strides
/// `sc`, writing rows of `k` slots at `idx`/`vals` with strides `out`. `causal =
/// Some((query_start, compress_ratio))`: the rows are causal indexer scores of queries at
/// `query_start + s` (-inf past their visible keys), read up to the visible keys only.
fn launch_topk(gpu: &Gpu, op: &'static str, scores: u64, sc: [i64; 3], b: usize, s_count: usize, p: usize, k: usize, idx: u64, vals: u64, out: (i64, i64), causal: Option<(i32, i32)>) -> Result<()> {
    let t = topk_launch(&configured::<IdxTopkConfig>()?, gpu.props().max_shared_per_block_optin as usize, op, p, k)?;
    let prm = IndexerTopkParams {
        scores,
        idx,
        vals,
        sc_sb: sc[0],
        sc_ss: sc[1],
        sc_sp: sc[2],
        out_sb: out.0,
        out_ss: out.1,
        b: to_i32(op, "B", b)?,
        s: to_i32(op, "S", s_count)?,
        p: to_i32(op, "P", p)?,
        k: to_i32(op, "k", k)?,
        sort_cap: to_i32(op, "sort capacity", t.sort_cap)?,
        cache_row: t.cache_row as i32,
        query_start: causal.map_or(0, |c| c.0),
        compress_ratio: causal.map_or(0, |c| c.1),
    };
    let kern = gpu.kernel("indexer/topk.cu", "indexer_topk", &topk_defines(&t))?;
    let grid = [grid_dim(op, "rows", s_count)?, grid_dim(op, "batch", b)?, 1];
    // SAFETY: `scores` addresses B x s_count rows of p f32 at strides `sc` (a live device
    // view or the fused scratch), idx/vals hold B x s_count rows of k slots at strides
    // `out` with the last dim contiguous (validated outputs); shared memory is the layout
    // of topk.cu for (sort_cap, cache_row); the params type is the entry's.
    unsafe { kern.launch(grid, [t.threads, 1, 1], t.smem as u32, &prm) }
}

// ---------------------------------------------------------------------------------------
// The operations

/// Top-k of `[B,S,P]` f32 scores: indices `[B,S,min(k,P)]` i32 and their values, into the
/// validated outputs.
pub(crate) fn topk(gpu: &Gpu, scores: &TensorView, k: usize, idx: &mut TensorViewMut, vals: &mut TensorViewMut) -> Result<()> {
    const OP: &str = "indexer_topk";
    let (b, s, p) = (scores.shape()[0], scores.shape()[1], scores.shape()[2]);
    let kk = k.min(p);
    if b * s * kk == 0 {
        return Ok(());
    }
    let st = strides_i64(scores);
    launch_topk(gpu, OP, scores.address(), [st[0], st[1], st[2]], b, s, p, kk, idx.as_view().address(), vals.as_view().address(), ((s * kk) as i64, kk as i64), None)
}

/// The shape and `min(k, P)` of a selection; `None` when there is nothing to select.
fn selection_shape(op: &'static str, a: &IndexerArgs, k: usize) -> Result<Option<(Shape, usize)>> {
    check_bf16(op, a)?;
    let sh = shape_of(op, a)?;
    let kk = k.min(sh.p as usize);
    Ok((sh.b as usize * sh.s as usize * kk != 0).then_some((sh, kk)))
}

/// Scores + top-k without materialising `[B,S,P]`, into the validated outputs: on Hopper
/// (where `scores_sm90.cu` runs) [`chunked_topk_with`] within `idx_topk.scratch_bytes`;
/// elsewhere fused (`scores.cu` with IDX_FUSED=1: one launch, the scores never leave the
/// chip) when a CTA's rows of scores and its sort buffer fit `idx_scores.fused_smem_bytes`,
/// else chunked as on Hopper.
pub(crate) fn fused_topk(gpu: &Gpu, a: &IndexerArgs, k: usize, idx: &mut TensorViewMut, vals: &mut TensorViewMut) -> Result<()> {
    fused_topk_with(gpu, a, k, idx, vals, ScoresPath::Auto)
}

/// [`fused_topk`] with the scores by the kernel `path` picks: `scores_sm90.cu` always takes
/// the chunked path (the dense wgmma scores then `topk.cu` measured faster than a fused
/// Hopper kernel: 1.974 against 2.567 ms at S = 16384, DECISIONS.md; the `lab-v32` tag
/// keeps that kernel). Both paths select bitwise `topk` of their own scores. `a` as
/// `dsv4_core::ops::indexer::lightning_indexer_into` validates it.
pub fn fused_topk_with(gpu: &Gpu, a: &IndexerArgs, k: usize, idx: &mut TensorViewMut, vals: &mut TensorViewMut, path: ScoresPath) -> Result<()> {
    const OP: &str = "lightning_indexer";
    let Some((sh, kk)) = selection_shape(OP, a, k)? else { return Ok(()) };
    let (s, p) = (sh.s as usize, sh.p as usize);
    let scratch = configured::<IdxTopkConfig>()?.scratch_bytes;
    if use_sm90(gpu, OP, path, sh.h as usize, sh.d as usize)? {
        return chunked_topk_with(gpu, a, k, idx, vals, scratch, path);
    }
    let inp = scores_inputs(gpu, OP, a, ScoresMode::Fused { p, sort_cap: kk.next_power_of_two() })?;
    let fused_limit = configured::<IdxScoresConfig>()?.fused_smem_bytes;
    if inp.tiles.smem_bytes() > fused_limit.min(gpu.props().max_shared_per_block_optin as usize) {
        drop(inp);
        return chunked_topk_with(gpu, a, k, idx, vals, scratch, path);
    }
    let dst = ScoresOut { out: vals.as_view().address(), idx: idx.as_view().address(), k: kk, strides: ((s * kk) as i64, kk as i64), visible_only: false };
    launch_scores(gpu, OP, a, &sh, &inp, None, &dst, 0, s)
}

/// Scores + top-k through a bounded scratch: blocks of queries are scored into at most
/// `scratch_bytes` (at least one query row of `[B, P]` f32) and selected by `topk.cu`
/// from there, block after block (stream order, no host synchronisation). The path of
/// `fused_topk` on Hopper and for rows too long for shared memory; public for tests. Its
/// scores come from the kernel [`scores_with`](super::scores_with()) `path` picks, so its
/// selection is bitwise that of `topk(scores(..))`.
pub fn chunked_topk(gpu: &Gpu, a: &IndexerArgs, k: usize, idx: &mut TensorViewMut, vals: &mut TensorViewMut, scratch_bytes: usize) -> Result<()> {
    chunked_topk_with(gpu, a, k, idx, vals, scratch_bytes, ScoresPath::Auto)
}

/// [`chunked_topk`] with the scores by the kernel `path` picks.
fn chunked_topk_with(gpu: &Gpu, a: &IndexerArgs, k: usize, idx: &mut TensorViewMut, vals: &mut TensorViewMut, scratch_bytes: usize, path: ScoresPath) -> Result<()> {
    const OP: &str = "lightning_indexer";
    let Some((sh, kk)) = selection_shape(OP, a, k)? else { return Ok(()) };
    let (b, s, p) = (sh.b as usize, sh.s as usize, sh.p as usize);
    let cfg = configured::<IdxTopkConfig>()?;
    topk_launch(&cfg, gpu.props().max_shared_per_block_optin as usize, OP, p, kk)?; // refuse before writing anything
    let inp = scores_inputs(gpu, OP, a, ScoresMode::Dense)?;
    let (idx_base, val_base) = (idx.as_view().address(), vals.as_view().address());
    let rows = (scratch_bytes / (b * p * 4)).clamp(1, s);
    let scratch = gpu.scratch(b * rows * p * 4)?;
    // topk.cu below reads each causal row's visible prefix only, so the scores kernel may
    // leave the -inf rest of the scratch unwritten (half its bytes at S = 16384, P = 4096).
    let visible_only = sh.compress_ratio > 0 && cfg.visible_only;
    let mut s_begin = 0;
    while s_begin < s {
        let n = rows.min(s - s_begin);
        let dst = ScoresOut { out: scratch.ptr(), idx: 0, k: 0, strides: ((rows * p) as i64, p as i64), visible_only };
        launch_dense(gpu, OP, a, &sh, &inp, &dst, s_begin, n, path)?;
        let off = (s_begin * kk * 4) as u64;
        let causal = Some((to_i32(OP, "query_start + s", sh.query_start as usize + s_begin)?, sh.compress_ratio));
        launch_topk(gpu, OP, scratch.ptr(), [(rows * p) as i64, p as i64, 1], b, n, p, kk, idx_base + off, val_base + off, ((s * kk) as i64, kk as i64), causal)?;
        s_begin += n;
    }
    Ok(())
}
