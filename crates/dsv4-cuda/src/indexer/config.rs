//! Launch configuration of the indexer kernels: tiles, threads, the shapes each kernel
//! takes, and their shared-memory sizes, mirroring the kernels' layouts (one place each;
//! the launchers and the tests read them from here).

use dsv4_core::Result;

use super::{unavailable, SELECT_SMEM_BYTES};
use crate::runtime::Gpu;

// ---------------------------------------------------------------------------------------
// Tile choice of the scores kernel (the one place; see scores.cu)

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
    pub(super) gather: bool,
    /// Fused scores + top-k: (P, sort_cap) size the rows and sort buffer in shared memory.
    pub(super) fused: Option<(usize, usize)>,
}

/// 8-key n-tiles per warp for head dim `d`: the largest of 4, 2, 1 whose B fragments
/// (2 registers per n-tile and 16-wide k-step) fit in 64 registers; a power of two so that
/// a tile splits into whole warp slabs of NT*8 keys.
pub(super) fn warp_n_tiles(d: usize) -> usize {
    match 32 / d.div_ceil(16) {
        0 | 1 => 1,
        2 | 3 => 2,
        _ => 4,
    }
}

impl ScoresTiles {
    /// - nt: a warp keeps the B fragments of its NT*8 keys for all D/16 k-steps in
    ///   registers (reused across the H/16 m-tiles), 2*NT*D/16 registers: NT = 4 at
    ///   D = 128 (64 registers), fewer for larger D.
    /// - bn: 64 keys per tile for dense scores (with bq = 4 queries: 8 warps, two of them
    ///   per query, ~104 KB of shared memory at H = 64, D = 128: two CTAs, 16 warps per
    ///   SM); 64 slots in gather mode too, where a CTA has one query: with nt <= 2 that is
    ///   4 warps in ~53 KB at H = 64, D = 128, four CTAs (queries) and 16 warps per SM
    ///   (128 slots and nt = 4 were 88 KB: two queries, 8 warps), so that more queries'
    ///   index and row fetches overlap the tensor-core work of others.
    /// - bq: 4 queries per CTA amortise each key tile (its L2 traffic, copies and barriers)
    ///   over four queries while keeping the causal waste of a query block small (the
    ///   fused top-k takes 2, for its rows of scores); both shrink until shared memory fits.
    pub(super) fn choose(gpu: &Gpu, op: &'static str, h: usize, d: usize, gather: bool) -> Result<ScoresTiles> {
        if d > 512 {
            return Err(unavailable(op, format!("head_dim D = {d}: the tensor-core indexer kernels take D <= 512")));
        }
        if h > 1024 {
            return Err(unavailable(op, format!("H = {h} heads: the tensor-core indexer kernels take H <= 1024")));
        }
        let nt = if gather { warp_n_tiles(d).min(2) } else { warp_n_tiles(d) };
        let mut t = ScoresTiles { h, d, bq: if gather { 1 } else { 4 }, bn: 64, nt, gather, fused: None };
        if gather {
            // Tuning knob (bench sweeps): `DSV4_EXTRA_DEFINES=IDX_GATHER_BN=..,IDX_GATHER_NT=..`
            // replaces the gather tile when it is one the kernel takes (NT in 1, 2, 4; BN a
            // multiple of 8 NT, at most 32 NT so one thread per slot fetches the keys).
            let knob = |name| crate::runtime::extra_define(name).and_then(|v| v.parse::<usize>().ok());
            let (bn, nt) = (knob("IDX_GATHER_BN").unwrap_or(t.bn), knob("IDX_GATHER_NT").unwrap_or(t.nt));
            if matches!(nt, 1 | 2 | 4) && bn % (8 * nt) == 0 && bn <= 32 * nt {
                (t.bn, t.nt) = (bn, nt);
            }
        }
        let limit = gpu.props().max_shared_per_block_optin as usize;
        while t.smem_bytes() > limit && t.bq > 1 {
            t.bq -= 1;
        }
        while t.smem_bytes() > limit && t.bn > t.nt * 8 {
            t.bn /= 2;
        }
        if t.smem_bytes() > limit {
            return Err(unavailable(op, format!("H = {h}, D = {d} need {} bytes of shared memory per CTA; the device allows {limit}", t.smem_bytes())));
        }
        Ok(t)
    }

    /// Mirrors SMEM_BYTES of scores.cu, plus the fused mode's selection scratch
    /// (SelectSmem, the sort buffer, BQ rows of P scores).
    pub(super) fn smem_bytes(&self) -> usize {
        let hpad = self.h.div_ceil(16) * 16;
        let lds = self.d.div_ceil(16) * 16 + 8;
        let base = (self.bq * hpad * lds + 2 * self.bn * lds) * 2 + self.bq * hpad * 4 + 2 * self.bn * 4;
        base + self.fused.map_or(0, |(p, sort_cap)| SELECT_SMEM_BYTES + sort_cap * 8 + self.bq * p * 4)
    }

    pub(super) fn threads(&self) -> u32 {
        (self.bq * (self.bn / (self.nt * 8)) * 32) as u32
    }

    pub(super) fn defines(&self) -> Vec<(&'static str, String)> {
        vec![
            ("IDX_H", self.h.to_string()),
            ("IDX_D", self.d.to_string()),
            ("IDX_BQ", self.bq.to_string()),
            ("IDX_BN", self.bn.to_string()),
            ("IDX_NT", self.nt.to_string()),
            ("IDX_GATHER", (self.gather as u8).to_string()),
            ("IDX_FUSED", (self.fused.is_some() as u8).to_string()),
        ]
    }
}

// ---------------------------------------------------------------------------------------
// Hopper scores kernel (scores_sm90.cu): tiles and shared memory

/// Queries per consumer warpgroup of `scores_sm90.cu` (BQ: one per lane of an accumulator
/// quad).
pub(super) const SM90_BQ: usize = 4;
/// Threads of `scores_sm90.cu`: one consumer warpgroup and one producer warp (128 more a
/// second warpgroup).
pub(super) const SM90_THREADS: u32 = 160;
/// CTAs per SM `scores_sm90.cu` is built for (`__launch_bounds__(160, 2)`).
pub(super) const SM90_CTAS_PER_SM: usize = 2;

/// Whether `scores_sm90.cu` takes heads `h` and head dim `d`: N = 4 queries x heads padded
/// to 16/32/64 fits one wgmma (<= 256), and the head dim fits two 64-wide SW128 groups.
pub(super) fn sm90_fits(h: usize, d: usize) -> bool {
    (1..=64).contains(&h) && (1..=128).contains(&d)
}

/// Consumer warpgroups of a `scores_sm90.cu` launch: 2 for the dense scores (one CTA an
/// SM, two blocks of queries sharing a key ring), 1 fused or under
/// `DSV4_EXTRA_DEFINES=IDX90_TWO_WG=0` (the kernel sees the same define).
pub(super) fn sm90_consumer_groups(fused: bool) -> usize {
    if !fused && crate::runtime::extra_define("IDX90_TWO_WG") != Some("0") {
        2
    } else {
        1
    }
}

/// Key-ring stages of `scores_sm90.cu` with `nwg` consumer warpgroups: 2, or
/// `IDX90_TWO_WG_STAGES` (default 4, 3..=8) with two (the kernel reads the same define).
fn sm90_stages(nwg: usize) -> usize {
    if nwg == 2 {
        crate::runtime::extra_define("IDX90_TWO_WG_STAGES").and_then(|v| v.parse::<usize>().ok()).filter(|s| (3..=8).contains(s)).unwrap_or(4)
    } else {
        2
    }
}

/// Shared memory of `scores_sm90.cu` with `nwg` consumer warpgroups, mirroring its layout:
/// 1024 bytes to align the base, sq [NWG][DG][N][128 B] | skv [ST][DG][64][128 B] |
/// sw [NWG][N] f32 | barriers (2 ST u64 in 64-byte units), ST = [`sm90_stages`], and,
/// fused, SelectSmem and the sort buffer of `sort_cap` entries.
pub(super) fn sm90_smem_bytes(h: usize, d: usize, fused_sort_cap: Option<usize>, nwg: usize) -> usize {
    let hpad = if h <= 16 { 16 } else if h <= 32 { 32 } else { 64 };
    let nrows = SM90_BQ * hpad;
    let dg = d.div_ceil(64);
    let st = sm90_stages(nwg);
    1024 + nwg * dg * nrows * 128 + st * dg * 64 * 128 + nwg * nrows * 4 + (16 * st).next_multiple_of(64) + fused_sort_cap.map_or(0, |cap| SELECT_SMEM_BYTES + cap * 8)
}

// ---------------------------------------------------------------------------------------
// Top-k launch configuration

/// Threads of a `topk.cu` CTA (one row): 128, or `TOPK_THREADS` from `DSV4_EXTRA_DEFINES`
/// (a multiple of 32 in 64..=1024). Smaller CTAs put more rows in flight an SM: on the
/// H200, 128 threads took the S=16384 scores + top-k from 1.965 ms (512) to 1.706 ms, 256
/// threads 1.782 (docs/perf/LOG.md v8).
pub(super) fn topk_threads() -> u32 {
    crate::runtime::extra_define("TOPK_THREADS").and_then(|v| v.parse::<u32>().ok()).filter(|t| t % 32 == 0 && (64..=1024).contains(t)).unwrap_or(128)
}

/// Mirrors the shared-memory layout of topk.cu: SelectSmem, the u64 sort buffer, the
/// optional u32 row cache of `cache` keys (in quads).
fn topk_smem_bytes(sort_cap: usize, cache: usize) -> usize {
    SELECT_SMEM_BYTES + sort_cap * 8 + cache.next_multiple_of(4) * 4
}

/// `(sort_cap, cache_row, shared bytes)` for rows of `p` scores and `k` slots. The row is
/// cached while the whole CTA stays under 96 KiB (two CTAs per SM on Hopper and A100);
/// longer rows stream from global memory at every pass.
pub(super) fn topk_config(gpu: &Gpu, op: &'static str, p: usize, k: usize) -> Result<(usize, bool, usize)> {
    let sort_cap = k.next_power_of_two().max(2); // >= 2: topk.cu's row cache stays 16-byte aligned
    let limit = gpu.props().max_shared_per_block_optin as usize;
    if topk_smem_bytes(sort_cap, 0) > limit {
        return Err(unavailable(op, format!("k = {k} needs a {sort_cap}-entry sort buffer ({} bytes of shared memory); the device allows {limit}", topk_smem_bytes(sort_cap, 0))));
    }
    let cache = topk_smem_bytes(sort_cap, p) <= (96 << 10).min(limit);
    Ok((sort_cap, cache, topk_smem_bytes(sort_cap, if cache { p } else { 0 })))
}

// ---------------------------------------------------------------------------------------
// Backward kernels (bwd.cu, bwd_mma.cu, bwd_sm90.cu): threads, shapes, shared memory

pub(super) const BWD_THREADS: usize = 256;
const BWD_NS: usize = 8;

/// Mirrors the shared-memory layout of bwd.cu.
pub(super) fn bwd_smem_bytes(h: usize, d: usize) -> usize {
    let hg = (BWD_THREADS / d).clamp(1, h.max(1));
    (2 * h * d + BWD_NS * d + 2 * BWD_NS * h + hg * BWD_NS * d + 2 * h + BWD_NS) * 4 + BWD_NS * 4
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
