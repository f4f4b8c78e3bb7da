//! The indexer kernels' typed configs, and everything a launch derives from a config and a
//! shape, in one place: tiles, threads, the defines each kernel is compiled with, and the
//! shared-memory sizes, mirroring the kernels' layouts. Pure functions (device limits come
//! in as numbers), so the CPU tests check them.

use dsv4_core::Result;

use super::{unavailable, SELECT_SMEM_BYTES};
use crate::kernel_config;

kernel_config! {
    /// `scores.cu` (mma.sync), dense scores and the fused scores + top-k.
    pub struct IdxScoresConfig("idx_scores") {
        /// Queries per CTA of the dense scores: 4 amortise each key tile (its L2 traffic,
        /// copies, barriers) over four queries and keep a query block's causal waste small
        /// (8 warps, ~104 KB at H = 64, D = 128: two CTAs an SM); fewer where memory is short.
        pub dense_bq: usize = 4,
        /// Queries per CTA of the fused scores + top-k: 2, whose rows of P scores stay in
        /// shared memory (two CTAs an SM up to P ~ 4K at H = 64, D = 128).
        pub fused_bq: usize = 2,
        /// Keys per tile: 64 (two warps of 4 n-tiles per query at D <= 128).
        pub bn: usize = 64,
        /// Shared memory a fused CTA may use (rows of scores and sort buffer included);
        /// beyond it the chunked path: 160 KiB keeps one CTA an SM with room on Hopper and
        /// A100.
        pub fused_smem_bytes: usize = 160 << 10,
    }
}

kernel_config! {
    /// `scores.cu` in gather mode (`indexer_topk_scores`).
    pub struct IdxTopkScoresConfig("idx_topk_scores") {
        /// Slots per tile: 64 (tile (64, 2): 0.8451 -> 0.6978 ms with the v9 copy loop,
        /// DECISIONS.md, top-k scores).
        pub bn: usize = 64,
        /// Most 8-slot n-tiles a warp: 2, 4 warps in ~53 KB at H = 64, D = 128: four
        /// queries and 16 warps an SM (128 slots with 4 took 88 KB: two queries, 8 warps).
        pub nt_max: usize = 2,
    }
}

kernel_config! {
    /// `scores_sm90.cu` (the Hopper dense scores).
    pub struct IdxScores90Config("idx_scores90") {
        /// Key-ring stages (3..=8): 4, dense scores 1.0944 ms against 1.0991 with 5
        /// (S=16384, LOG.md v11).
        pub stages: usize = 4,
        /// The ring by TMA where kv can be mapped (else cp.async): dense scores 1.071 ->
        /// 0.915 ms, scores + top-k 1.313 -> 1.154 (DECISIONS.md; LOG.md v12).
        pub tma: bool = true,
    }
}

kernel_config! {
    /// `topk.cu`, and the chunked scores + top-k around it.
    pub struct IdxTopkConfig("idx_topk") {
        /// Threads a CTA (one row; a multiple of 32 in 64..=1024): 128, scores + top-k
        /// 1.4058 ms against 1.4715 with 64 and 1.4954 with 256 (DECISIONS.md; LOG.md v10).
        pub threads: u32 = 128,
        /// A row's keys are cached in shared memory while the CTA stays within this many
        /// bytes (two CTAs an SM on Hopper and A100); longer rows stream at every pass.
        pub row_cache_bytes: usize = 96 << 10,
        /// The chunked path writes each causal row's visible prefix only (topk.cu reads no
        /// more): 1.4224 -> 1.4002 ms (DECISIONS.md; LOG.md v11).
        pub visible_only: bool = true,
        /// Bound on the chunked path's scores scratch (at least one query row): 256 MiB, the
        /// memory beyond inputs and outputs at S = 65536 (DECISIONS.md).
        pub scratch_bytes: usize = 256 << 20,
    }
}

kernel_config! {
    /// `bwd_sm90.cu` (the Hopper backward, atomic mode).
    pub struct IdxBwd90Config("idx_bwd90") {
        /// Taken where it can run (else `bwd_mma.cu`): fwd + bwd 3.416 -> 3.089 ms at
        /// S=16384, 0.795 -> 0.741 at 4096 (DECISIONS.md; LOG.md v7).
        pub enabled: bool = true,
    }
}

kernel_config! {
    /// The deterministic mode of `bwd_mma.cu` and `bwd.cu`: per-CTA partial dkv slices.
    pub struct IdxBwdMmaConfig("idx_bwd_mma") {
        /// Partial slices (query chunks) for about this many CTAs an SM: 2.
        pub det_ctas_per_sm: usize = 2,
        /// Bound on the partial-dkv workspace: 256 MiB.
        pub det_workspace_bytes: usize = 256 << 20,
    }
}

kernel_config! {
    /// `bwd.cu` (CUDA cores: H > 64, D > 128, or outputs not aligned for `bwd_mma.cu`).
    pub struct IdxBwdConfig("idx_bwd") {
        /// Threads a CTA (`BWD_THREADS`, a multiple of 32 up to 1024): 256.
        pub threads: usize = 256,
        /// Slots a step (`BWD_NS`): 8.
        pub ns: usize = 8,
    }
}

kernel_config! {
    /// `pack.cu` (operands not laid out for the tensor-core loaders).
    pub struct IdxPackConfig("idx_pack") {
        /// Blocks an SM of the grid-stride copy (256 threads each): 16.
        pub blocks_per_sm: usize = 16,
    }
}

fn config_error(key: &str, want: &str, got: impl ToString) -> dsv4_core::Error {
    dsv4_core::Error::value("tuning", "key", format!("`{key}` {want}"), got.to_string())
}

// ---------------------------------------------------------------------------------------
// scores.cu: tiles and defines

/// The mode of a `scores.cu` launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum ScoresMode {
    Dense,
    /// Fused top-k over rows of P scores with a sort buffer of `sort_cap` entries.
    Fused { p: usize, sort_cap: usize },
    Gather,
}

/// Compile-time tile of `scores.cu`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct ScoresTiles {
    pub(super) h: usize,
    pub(super) d: usize,
    /// Queries per CTA (their q rows stay in shared memory while keys stream).
    pub(super) bq: usize,
    /// Keys (or selection slots) per tile.
    pub(super) bn: usize,
    /// 8-key n-tiles per warp.
    pub(super) nt: usize,
    pub(super) mode: ScoresMode,
}

/// 8-key n-tiles per warp for head dim `d`: the largest of 4, 2, 1 whose B fragments
/// (2 registers per n-tile and 16-wide k-step) fit in 64 registers; a power of two so that
/// a tile splits into whole warp slabs of NT*8 keys. A warp keeps them for all D/16 k-steps
/// (reused across the H/16 m-tiles): NT = 4 at D = 128.
pub(super) fn warp_n_tiles(d: usize) -> usize {
    match 32 / d.div_ceil(16) {
        0 | 1 => 1,
        2 | 3 => 2,
        _ => 4,
    }
}

impl ScoresTiles {
    /// The tile of a launch: the config's, bq (then bn) shrunk until it fits `smem_limit`
    /// (the device's opt-in shared memory per block). Fused: the dense tile with
    /// `fused_bq` queries at most; the caller checks `fused_smem_bytes`.
    pub(super) fn choose(sc: &IdxScoresConfig, tsc: &IdxTopkScoresConfig, smem_limit: usize, op: &'static str, h: usize, d: usize, mode: ScoresMode) -> Result<ScoresTiles> {
        if d > 512 {
            return Err(unavailable(op, format!("head_dim D = {d}: the tensor-core indexer kernels take D <= 512")));
        }
        if h > 1024 {
            return Err(unavailable(op, format!("H = {h} heads: the tensor-core indexer kernels take H <= 1024")));
        }
        let mut t = match mode {
            ScoresMode::Gather => {
                let nt = warp_n_tiles(d).min(tsc.nt_max.max(1));
                ScoresTiles { h, d, bq: 1, bn: tsc.bn, nt, mode }
            }
            _ => ScoresTiles { h, d, bq: sc.dense_bq.max(1), bn: sc.bn, nt: warp_n_tiles(d), mode: ScoresMode::Dense },
        };
        // (The defaults always pass: BN = 64, NT in 1, 2, 4.)
        if !matches!(t.nt, 1 | 2 | 4) || t.bn == 0 || t.bn % (8 * t.nt) != 0 || t.threads() > 1024 {
            return Err(config_error("idx_scores.bn / idx_topk_scores.{bn, nt_max}", "must give NT in 1, 2, 4, BN a multiple of 8 NT and at most 1024 threads", format!("BN = {}, NT = {}", t.bn, t.nt)));
        }
        while t.smem_bytes() > smem_limit && t.bq > 1 {
            t.bq -= 1;
        }
        while t.smem_bytes() > smem_limit && t.bn > t.nt * 8 {
            t.bn /= 2;
        }
        if t.smem_bytes() > smem_limit {
            return Err(unavailable(op, format!("H = {h}, D = {d} need {} bytes of shared memory per CTA; the device allows {smem_limit}", t.smem_bytes())));
        }
        if let ScoresMode::Fused { .. } = mode {
            t = ScoresTiles { bq: t.bq.min(sc.fused_bq.max(1)), mode, ..t };
        }
        Ok(t)
    }

    /// Mirrors SMEM_BYTES of scores.cu, plus the fused mode's selection scratch
    /// (SelectSmem, the sort buffer, BQ rows of P scores).
    pub(super) fn smem_bytes(&self) -> usize {
        let hpad = self.h.div_ceil(16) * 16;
        let lds = self.d.div_ceil(16) * 16 + 8;
        let base = (self.bq * hpad * lds + 2 * self.bn * lds) * 2 + self.bq * hpad * 4 + 2 * self.bn * 4;
        base + match self.mode {
            ScoresMode::Fused { p, sort_cap } => SELECT_SMEM_BYTES + sort_cap * 8 + self.bq * p * 4,
            _ => 0,
        }
    }

    pub(super) fn threads(&self) -> u32 {
        (self.bq * (self.bn / (self.nt * 8)) * 32) as u32
    }

    /// The defines of `scores.cu`.
    pub(super) fn defines(&self) -> Vec<(&'static str, String)> {
        vec![
            ("IDX_H", self.h.to_string()),
            ("IDX_D", self.d.to_string()),
            ("IDX_BQ", self.bq.to_string()),
            ("IDX_BN", self.bn.to_string()),
            ("IDX_NT", self.nt.to_string()),
            ("IDX_GATHER", (matches!(self.mode, ScoresMode::Gather) as u8).to_string()),
            ("IDX_FUSED", (matches!(self.mode, ScoresMode::Fused { .. }) as u8).to_string()),
        ]
    }
}

// ---------------------------------------------------------------------------------------
// scores_sm90.cu: shape, shared memory, defines

/// Queries per consumer warpgroup of `scores_sm90.cu` (BQ: one per lane of a quad), and
/// its two consumer warpgroups (one block of 8 queries a CTA).
pub(super) const SM90_BQ: usize = 4;
pub(super) const SM90_NWG: usize = 2;
/// Threads of `scores_sm90.cu`: two consumer warpgroups and one producer warp.
pub(super) const SM90_THREADS: u32 = 288;

/// Whether `scores_sm90.cu` takes heads `h` and head dim `d`: N = 4 queries x heads padded
/// to 16/32/64 fits one wgmma (<= 256), and the head dim fits two 64-wide SW128 groups.
pub(super) fn sm90_fits(h: usize, d: usize) -> bool {
    (1..=64).contains(&h) && (1..=128).contains(&d)
}

/// Shared memory of `scores_sm90.cu`, mirroring its layout: 1024 bytes to align the base,
/// sq [2][DG][N][128 B] | skv [ST][DG][64][128 B] | sw [2][N] f32 | barriers (2 ST u64 in
/// 64-byte units), ST = `cfg.stages`.
pub(super) fn sm90_smem_bytes(cfg: &IdxScores90Config, h: usize, d: usize) -> usize {
    let hpad = if h <= 16 { 16 } else if h <= 32 { 32 } else { 64 };
    let nrows = SM90_BQ * hpad;
    let dg = d.div_ceil(64);
    let st = cfg.stages;
    1024 + SM90_NWG * dg * nrows * 128 + st * dg * 64 * 128 + SM90_NWG * nrows * 4 + (16 * st).next_multiple_of(64)
}

/// The defines of `scores_sm90.cu`; `tma`: the launch passes a TMA map of kv.
pub(super) fn sm90_defines(cfg: &IdxScores90Config, h: usize, d: usize, tma: bool) -> Result<Vec<(&'static str, String)>> {
    if !(3..=8).contains(&cfg.stages) {
        return Err(config_error("idx_scores90.stages", "must be in 3..=8", cfg.stages));
    }
    Ok(vec![("IDX_H", h.to_string()), ("IDX_D", d.to_string()), ("IDX90_STAGES", cfg.stages.to_string()), ("IDX90_TMA", (tma as u8).to_string())])
}

// ---------------------------------------------------------------------------------------
// topk.cu

/// Mirrors the shared-memory layout of topk.cu: SelectSmem, the u64 sort buffer, the
/// optional u32 row cache of `cache` keys (in quads).
fn topk_smem_bytes(sort_cap: usize, cache: usize) -> usize {
    SELECT_SMEM_BYTES + sort_cap * 8 + cache.next_multiple_of(4) * 4
}

/// A `topk.cu` launch for rows of `p` scores and `k` slots: the sort buffer, whether the
/// row is cached, the shared bytes, the threads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct TopkLaunch {
    pub(super) sort_cap: usize,
    pub(super) cache_row: bool,
    pub(super) smem: usize,
    pub(super) threads: u32,
}

pub(super) fn topk_launch(cfg: &IdxTopkConfig, smem_limit: usize, op: &'static str, p: usize, k: usize) -> Result<TopkLaunch> {
    if !cfg.threads.is_multiple_of(32) || !(64..=1024).contains(&cfg.threads) {
        return Err(config_error("idx_topk.threads", "must be a multiple of 32 in 64..=1024", cfg.threads));
    }
    let sort_cap = k.next_power_of_two().max(2); // >= 2: topk.cu's row cache stays 16-byte aligned
    if topk_smem_bytes(sort_cap, 0) > smem_limit {
        return Err(unavailable(op, format!("k = {k} needs a {sort_cap}-entry sort buffer ({} bytes of shared memory); the device allows {smem_limit}", topk_smem_bytes(sort_cap, 0))));
    }
    let cache_row = topk_smem_bytes(sort_cap, p) <= cfg.row_cache_bytes.min(smem_limit);
    Ok(TopkLaunch { sort_cap, cache_row, smem: topk_smem_bytes(sort_cap, if cache_row { p } else { 0 }), threads: cfg.threads })
}

/// The defines of `topk.cu`.
pub(super) fn topk_defines(t: &TopkLaunch) -> Vec<(&'static str, String)> {
    vec![("TOPK_THREADS", t.threads.to_string())]
}

// ---------------------------------------------------------------------------------------
// Backward kernels (bwd.cu, bwd_mma.cu, bwd_sm90.cu): threads, shapes, shared memory

/// Mirrors the shared-memory layout of bwd.cu.
pub(super) fn bwd_smem_bytes(cfg: &IdxBwdConfig, h: usize, d: usize) -> usize {
    let (threads, ns) = (cfg.threads, cfg.ns);
    let hg = (threads / d).clamp(1, h.max(1));
    (2 * h * d + ns * d + 2 * ns * h + hg * ns * d + 2 * h + ns) * 4 + ns * 4
}

/// The defines of `bwd.cu`.
pub(super) fn bwd_defines(cfg: &IdxBwdConfig) -> Result<Vec<(&'static str, String)>> {
    if !cfg.threads.is_multiple_of(32) || !(32..=1024).contains(&cfg.threads) || cfg.ns == 0 {
        return Err(config_error("idx_bwd.{threads, ns}", "must be a multiple of 32 up to 1024 and >= 1", format!("{} / {}", cfg.threads, cfg.ns)));
    }
    Ok(vec![("BWD_THREADS", cfg.threads.to_string()), ("BWD_NS", cfg.ns.to_string())])
}

/// The defines of `bwd_mma.cu` and `bwd_sm90.cu`: the shape.
pub(super) fn shape_defines(h: usize, d: usize) -> Vec<(&'static str, String)> {
    vec![("IDX_H", h.to_string()), ("IDX_D", d.to_string())]
}

/// Threads of `bwd_mma.cu` (4 warps) and its slots per tile.
pub(super) const BWD_MMA_THREADS: u32 = 128;
const BWD_MMA_BN: usize = 64;

/// Whether `bwd_mma.cu` takes the shape: its dq / dkv accumulators live in registers.
pub(super) fn bwd_mma_fits(h: usize, d: usize) -> bool {
    (1..=64).contains(&h) && (1..=128).contains(&d)
}

/// Mirrors SMEM_BASE / SMEM_DET of bwd_mma.cu.
pub(super) fn bwd_mma_smem_bytes(h: usize, d: usize, deterministic: bool) -> usize {
    let hpad = h.div_ceil(16) * 16;
    let dpad = d.div_ceil(16) * 16;
    let (lds, ldg, ldf) = (dpad + 8, BWD_MMA_BN + 8, dpad + 8);
    let base = (hpad * lds + 2 * BWD_MMA_BN * lds + hpad * ldg) * 2 + hpad * 4 + 2 * BWD_MMA_BN * 4 + 2 * BWD_MMA_BN * 4;
    base + if deterministic { BWD_MMA_BN * ldf * 4 } else { 0 }
}

/// Threads of `bwd_sm90.cu`: a producer warpgroup and two consumer warpgroups.
pub(super) const BWD_SM90_THREADS: u32 = 384;
/// Ring stages per consumer of `bwd_sm90.cu` (NST).
const BWD_SM90_STAGES: usize = 3;

/// Mirrors the shared-memory layout of `bwd_sm90.cu`: 1024 bytes to align the base; per
/// consumer two q tiles, the ring and two G^T tiles (SW128 tiles of 64 rows x 128 bytes per
/// 64 columns of D); the slot tables (key i32, g*scale f32 per stage and slot); the
/// mbarriers (qready[2], qfree[2], ready, keys, free per stage).
pub(super) fn bwd_sm90_smem_bytes(d: usize) -> usize {
    let tile = d.div_ceil(64) * 64 * 128;
    let per_consumer = (2 + BWD_SM90_STAGES) * tile + 2 * 64 * 128;
    1024 + 2 * per_consumer + 2 * 2 * BWD_SM90_STAGES * 64 * 4 + 2 * (4 + 3 * BWD_SM90_STAGES) * 8
}
