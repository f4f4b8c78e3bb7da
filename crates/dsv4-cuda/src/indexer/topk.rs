//! Top-k selection: `topk.cu` over scores rows, and the scores + top-k operations (fused in
//! one launch, or chunked through a bounded scratch).

use dsv4_core::ops::indexer::IndexerArgs;
use dsv4_core::{Result, TensorView, TensorViewMut};

use super::config::{topk_config, topk_threads, ScoresTiles};
use super::params::IndexerTopkParams;
use super::scores::{launch_dense, launch_scores, launch_scores_sm90, scores_inputs, use_sm90, ScoresOut, ScoresPath};
use super::{check_bf16, check_contiguous, grid_dim, shape_of, strides_i64, to_i32, Shape, FUSED_SCRATCH_BYTES, FUSED_SMEM_BYTES};
use crate::runtime::Gpu;

/// One launch of `topk.cu` over rows `[B, s_count]` of scores at `scores` with strides
/// `sc`, writing rows of `k` slots at `idx`/`vals` with strides `out`. `causal =
/// Some((query_start, compress_ratio))`: the rows are causal indexer scores of queries at
/// `query_start + s` (-inf past their visible keys), read up to the visible keys only.
fn launch_topk(gpu: &Gpu, op: &'static str, scores: u64, sc: [i64; 3], b: usize, s_count: usize, p: usize, k: usize, idx: u64, vals: u64, out: (i64, i64), causal: Option<(i32, i32)>) -> Result<()> {
    let (sort_cap, cache, smem) = topk_config(gpu, op, p, k)?;
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
        sort_cap: to_i32(op, "sort capacity", sort_cap)?,
        cache_row: cache as i32,
        query_start: causal.map_or(0, |c| c.0),
        compress_ratio: causal.map_or(0, |c| c.1),
    };
    let threads = topk_threads();
    let kern = gpu.kernel("indexer/topk.cu", "indexer_topk", &[("TOPK_THREADS", threads.to_string())])?;
    let grid = [grid_dim(op, "rows", s_count)?, grid_dim(op, "batch", b)?, 1];
    // SAFETY: `scores` addresses B x s_count rows of p f32 at strides `sc` (a live device
    // view or the fused scratch), idx/vals hold B x s_count rows of k slots at strides
    // `out` with the last dim contiguous (validated outputs); shared memory is the layout
    // of topk.cu for (sort_cap, cache); the params type is the entry's.
    unsafe { kern.launch(grid, [threads, 1, 1], smem as u32, &prm) }
}

// ---------------------------------------------------------------------------------------
// The operations

/// Top-k of `[B,S,P]` f32 scores: indices `[B,S,min(k,P)]` i32 and their values.
pub fn topk(gpu: &Gpu, scores: &TensorView, k: usize, idx: &mut TensorViewMut, vals: &mut TensorViewMut) -> Result<()> {
    const OP: &str = "indexer_topk";
    check_contiguous(OP, "indices", idx)?;
    check_contiguous(OP, "values", vals)?;
    let (b, s, p) = (scores.shape()[0], scores.shape()[1], scores.shape()[2]);
    let kk = k.min(p);
    if b * s * kk == 0 {
        return Ok(());
    }
    let st = strides_i64(scores);
    launch_topk(gpu, OP, scores.address(), [st[0], st[1], st[2]], b, s, p, kk, idx.as_view().address(), vals.as_view().address(), ((s * kk) as i64, kk as i64), None)
}

/// Checks shared by the two selection paths; `None` when there is nothing to select.
/// Returns the shape and `min(k, P)`.
fn selection_shape(op: &'static str, a: &IndexerArgs, k: usize, idx: &TensorViewMut, vals: &TensorViewMut) -> Result<Option<(Shape, usize)>> {
    check_bf16(op, a)?;
    check_contiguous(op, "indices", idx)?;
    check_contiguous(op, "values", vals)?;
    let sh = shape_of(op, a)?;
    let kk = k.min(sh.p as usize);
    Ok((sh.b as usize * sh.s as usize * kk != 0).then_some((sh, kk)))
}

/// Scores + top-k without materialising `[B,S,P]`. On Hopper [`chunked_topk`] with a
/// scratch of at most [`FUSED_SCRATCH_BYTES`] (measured faster than the fused Hopper
/// kernel, see [`fused_topk_with`]). Elsewhere fused when a CTA's rows of scores and its
/// sort buffer fit in [`FUSED_SMEM_BYTES`] of shared memory (one launch, the scores never
/// leave the chip), else [`chunked_topk`] as on Hopper.
pub fn fused_topk(gpu: &Gpu, a: &IndexerArgs, k: usize, idx: &mut TensorViewMut, vals: &mut TensorViewMut) -> Result<()> {
    fused_topk_with(gpu, a, k, idx, vals, ScoresPath::Auto)
}

/// [`fused_topk`] by the kernel `path` picks. On the Hopper kernel the rows of scores live
/// in a per-CTA scratch (4 x P f32 for each of at most two CTAs per SM), so every P is
/// fused; the portable kernel keeps them in shared memory and takes [`chunked_topk`]
/// beyond [`FUSED_SMEM_BYTES`].
///
/// `ScoresPath::Auto` on Hopper takes [`chunked_topk`] with [`FUSED_SCRATCH_BYTES`]
/// instead of the fused Hopper kernel: the dense wgmma scores then `topk.cu` measured
/// 1.974 ms against the fused kernel's 2.567 ms at S = 16384, P = 4096 (0.238 against
/// 0.261 at S = 4096; H200, docs/perf/LOG.md v7), at the price of a scratch of at most
/// 256 MiB. `DSV4_INDEXER_FUSED_SM90=1` (read once) keeps the fused kernel on `Auto`;
/// `ScoresPath::Hopper` always runs it.
pub fn fused_topk_with(gpu: &Gpu, a: &IndexerArgs, k: usize, idx: &mut TensorViewMut, vals: &mut TensorViewMut, path: ScoresPath) -> Result<()> {
    const OP: &str = "lightning_indexer";
    let Some((sh, kk)) = selection_shape(OP, a, k, idx, vals)? else { return Ok(()) };
    let (s, p) = (sh.s as usize, sh.p as usize);
    let sort_cap = kk.next_power_of_two();
    let sm90 = use_sm90(gpu, OP, path, sh.h as usize, sh.d as usize, Some(sort_cap))?;
    if sm90 && path == ScoresPath::Auto && !fused_sm90_on_auto() {
        return chunked_topk_with(gpu, a, k, idx, vals, FUSED_SCRATCH_BYTES, path);
    }
    let mut inp = scores_inputs(gpu, OP, a, false)?;
    if sm90 {
        let dst = ScoresOut { out: vals.as_view().address(), idx: idx.as_view().address(), k: kk, strides: ((s * kk) as i64, kk as i64), visible_only: false };
        return launch_scores_sm90(gpu, OP, a, &sh, &inp, &dst, 0, s, Some(sort_cap));
    }
    // Two queries per CTA (not the dense four): their rows of P scores stay in shared
    // memory, two CTAs per SM up to P ~ 4K at H = 64, D = 128.
    let fused = ScoresTiles { bq: inp.tiles.bq.min(2), fused: Some((p, kk.next_power_of_two())), ..inp.tiles };
    if fused.smem_bytes() > FUSED_SMEM_BYTES.min(gpu.props().max_shared_per_block_optin as usize) {
        drop(inp);
        return chunked_topk_with(gpu, a, k, idx, vals, FUSED_SCRATCH_BYTES, path);
    }
    inp.tiles = fused;
    let dst = ScoresOut { out: vals.as_view().address(), idx: idx.as_view().address(), k: kk, strides: ((s * kk) as i64, kk as i64), visible_only: false };
    launch_scores(gpu, OP, a, &sh, &inp, None, &dst, 0, s)
}

/// `DSV4_INDEXER_FUSED_SM90=1`: [`fused_topk`] runs the fused Hopper kernel (to compare).
fn fused_sm90_on_auto() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("DSV4_INDEXER_FUSED_SM90").is_ok_and(|v| v == "1"))
}

/// Scores + top-k through a bounded scratch: blocks of queries are scored into at most
/// `scratch_bytes` (at least one query row of `[B, P]` f32) and selected by `topk.cu`
/// from there, block after block (stream order, no host synchronisation). The path of
/// the portable `fused_topk` for rows too long for shared memory; public for tests and
/// benchmarks. Its scores come from the kernel [`scores`](super::scores()) uses
/// (`ScoresPath::Auto`), so its selection is bitwise that of `topk(scores(..))`.
pub fn chunked_topk(gpu: &Gpu, a: &IndexerArgs, k: usize, idx: &mut TensorViewMut, vals: &mut TensorViewMut, scratch_bytes: usize) -> Result<()> {
    chunked_topk_with(gpu, a, k, idx, vals, scratch_bytes, ScoresPath::Auto)
}

/// [`chunked_topk`] with the scores by the kernel `path` picks.
pub fn chunked_topk_with(gpu: &Gpu, a: &IndexerArgs, k: usize, idx: &mut TensorViewMut, vals: &mut TensorViewMut, scratch_bytes: usize, path: ScoresPath) -> Result<()> {
    const OP: &str = "lightning_indexer";
    let Some((sh, kk)) = selection_shape(OP, a, k, idx, vals)? else { return Ok(()) };
    let (b, s, p) = (sh.b as usize, sh.s as usize, sh.p as usize);
    topk_config(gpu, OP, p, kk)?; // refuse before writing anything
    let inp = scores_inputs(gpu, OP, a, false)?;
    let (idx_base, val_base) = (idx.as_view().address(), vals.as_view().address());
    let rows = (scratch_bytes / (b * p * 4)).clamp(1, s);
    let scratch = gpu.scratch(b * rows * p * 4)?;
    // topk.cu below reads each causal row's visible prefix only, so the scores kernel
    // leaves the -inf rest of the scratch unwritten (half its bytes at S = 16384, P = 4096;
    // `DSV4_EXTRA_DEFINES=IDX_VISIBLE_ONLY=0` writes whole rows, to compare).
    let visible_only = sh.compress_ratio > 0 && crate::runtime::extra_define("IDX_VISIBLE_ONLY") != Some("0");
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
