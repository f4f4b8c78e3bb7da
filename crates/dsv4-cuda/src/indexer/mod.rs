//! The lightning indexer on the GPU (SPEC.md sections 2 and 3): launchers for
//! `kernels/indexer/`.
//!
//! - `scores`: tensor-core causal scores (`scores.cu`): per CTA a block of queries with all
//!   their heads against streamed tiles of pooled keys, relu + weighted head sum in
//!   registers, tiles past the causal limit never computed.
//! - `topk`: one CTA per row (`topk.cu`): radix select on order-preserving keys, gather of
//!   the keys above the threshold, bitonic sort, ties at the threshold taken in index order.
//! - `fused_topk`: the scores kernel keeps each query's row of scores in shared memory and
//!   selects its top-k there with the same block-wide selection as `topk`
//!   (`select.cuh`): memory O(S × k), one launch. Rows too long for shared memory (P
//!   beyond ~10.8K at H = 64, D = 128, k = 512; see [`FUSED_SMEM_BYTES`]) fall back to
//!   scores of a bounded block of queries in a scratch (at most [`FUSED_SCRATCH_BYTES`])
//!   followed by `topk`, block after block.
//! - On Hopper (`Gpu::hopper()`: sm_90a, unless `DSV4_PORTABLE=1`) and H <= 64, D <= 128,
//!   dense scores and the fused top-k run `scores_sm90.cu` instead (wgmma, a producer warp
//!   streaming key tiles through an mbarrier ring; fused: a persistent grid whose CTAs
//!   keep their rows of scores in a scratch slot in L2 and select with the same
//!   `select.cuh`). [`ScoresPath`] forces either kernel (tests, benchmarks). The default
//!   selection on Hopper is the chunked path over those dense scores, measured faster than
//!   the fused Hopper kernel (see `fused_topk_with`).
//! - `topk_scores`: the scores kernel in gather mode (the key tile is the query's selection;
//!   the indices are fetched two tiles ahead of the row copies).
//! - `topk_scores_backward`: `bwd_mma.cu` on tensor cores for H <= 64, D <= 128 (per query
//!   and 64-slot tile: A = q kv^T, G = g*scale*w*[A>0], dq += G kv, dkv_tile = G^T q), else
//!   `bwd.cu` on CUDA cores; dkv by atomics or by per-CTA partial slices summed in a fixed
//!   order (deterministic). On Hopper, atomic mode, H <= 64 and D <= 128 a multiple of 8,
//!   `bwd_sm90.cu` instead (the same products on wgmma: a persistent grid, a producer
//!   warpgroup gathering each consumer's kv tiles through an mbarrier ring, two independent
//!   consumer warpgroups); `DSV4_INDEXER_BWD_PORTABLE=1` keeps `bwd_mma.cu` (to compare),
//!   [`BwdPath`] forces either kernel (tests).
//!
//! q and pooled_kv must be bf16; inputs may have any strides (the tensor-core loaders read
//! 16-byte rows; other layouts are first packed by `pack.cu`). Outputs are contiguous.

use std::mem::size_of;

use dsv4_core::ops::indexer::{IndexerArgs, IndexerTopkScoresBwdArgs};
use dsv4_core::{DType, Error, Result, TensorView, TensorViewMut};

use crate::runtime::{Gpu, Scratch, TmaDesc};

/// Whether these kernels can run (`is_kernel_available("indexer")`).
pub const READY: bool = true;

/// Shared memory a CTA of the fully fused scores + top-k may use (its rows of P scores and
/// sort buffer included); beyond it `fused_topk` takes the chunked path. 160 KiB keeps one
/// CTA per SM with room on Hopper (227 KiB) and A100 (163 KiB opt-in).
pub const FUSED_SMEM_BYTES: usize = 160 << 10;

/// Bytes of `SelectSmem` (select.cuh).
const SELECT_SMEM_BYTES: usize = 2304;

/// Bound on the scores scratch of `fused_topk`'s chunked path, in bytes.
pub const FUSED_SCRATCH_BYTES: usize = 256 << 20;

/// Bound on the partial-dkv workspace of the deterministic backward, in bytes.
pub const BWD_WORKSPACE_BYTES: usize = 256 << 20;

// ---------------------------------------------------------------------------------------
// Params structs, mirrored by kernels/indexer/params.cuh (same field order and types).

/// `IndexerScoresParams` of `params.cuh`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct IndexerScoresParams {
    /// `[B,S,H,D]` bf16, d-stride 1, rows 16-byte aligned.
    pub q: u64,
    /// `[B,P,D]` bf16, same row rules.
    pub kv: u64,
    /// `[B,S,H]` f32.
    pub w: u64,
    /// `[B,S,T]` i32/i64 (gather mode), else 0.
    pub topk: u64,
    /// dense `[B, s_count, P]`, gather `[B, s_count, T]`, fused: values `[B, s_count, K]`
    /// f32, last dim contiguous.
    pub out: u64,
    /// fused: indices `[B, s_count, K]` i32 at out's strides; else 0.
    pub idx: u64,
    /// `scores_sm90.cu` fused: per-CTA scratch rows `[grid, 4, P]` f32; else 0.
    pub rows: u64,
    pub q_sb: i64,
    pub q_ss: i64,
    pub q_sh: i64,
    pub kv_sb: i64,
    pub kv_sp: i64,
    pub w_sb: i64,
    pub w_ss: i64,
    pub w_sh: i64,
    pub t_sb: i64,
    pub t_ss: i64,
    pub t_st: i64,
    pub out_sb: i64,
    pub out_ss: i64,
    pub b: i32,
    pub s: i32,
    pub h: i32,
    pub d: i32,
    pub p: i32,
    pub t: i32,
    pub s_begin: i32,
    pub s_count: i32,
    pub query_start: i32,
    pub compress_ratio: i32,
    pub topk_is_i64: i32,
    /// fused: min(k, P)
    pub k: i32,
    /// fused: power of two >= k
    pub sort_cap: i32,
    pub scale: f32,
    /// dense: 1 = only each row's visible keys are written (the rest left as it was), for
    /// a caller that reads the visible prefix only; 0 = the whole row (-inf past them).
    pub visible_only: i32,
}

/// `IndexerTopkParams` of `params.cuh`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct IndexerTopkParams {
    /// `[B,S,P]` f32, any strides.
    pub scores: u64,
    /// `[B,S,K]` i32 out.
    pub idx: u64,
    /// `[B,S,K]` f32 out, idx's strides.
    pub vals: u64,
    pub sc_sb: i64,
    pub sc_ss: i64,
    pub sc_sp: i64,
    pub out_sb: i64,
    pub out_ss: i64,
    pub b: i32,
    pub s: i32,
    pub p: i32,
    /// min(k, P)
    pub k: i32,
    /// power of two >= K
    pub sort_cap: i32,
    pub cache_row: i32,
    /// > 0: causal rows, row s reads min(P, visible_keys(query_start + s, r)) scores.
    pub query_start: i32,
    pub compress_ratio: i32,
}

/// `IndexerBwdParams` of `params.cuh`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct IndexerBwdParams {
    /// `[B,S,H,D]` bf16, any strides.
    pub q: u64,
    /// `[B,P,D]` bf16, any strides.
    pub kv: u64,
    /// `[B,S,H]` f32.
    pub w: u64,
    /// `[B,S,T]` i32/i64.
    pub topk: u64,
    /// `[B,S,T]` f32.
    pub grad: u64,
    /// `[B,S,H,D]` bf16 out, contiguous.
    pub dq: u64,
    /// `[B,S,H]` f32 out, contiguous.
    pub dw: u64,
    /// atomic: `[B,P,D]` zeroed; deterministic: partials `[B, n_chunks, P, D]` zeroed.
    pub dkv: u64,
    pub q_sb: i64,
    pub q_ss: i64,
    pub q_sh: i64,
    pub q_sd: i64,
    pub kv_sb: i64,
    pub kv_sp: i64,
    pub kv_sd: i64,
    pub w_sb: i64,
    pub w_ss: i64,
    pub w_sh: i64,
    pub t_sb: i64,
    pub t_ss: i64,
    pub t_st: i64,
    pub g_sb: i64,
    pub g_ss: i64,
    pub g_st: i64,
    pub dkv_sb: i64,
    pub dkv_sc: i64,
    pub b: i32,
    pub s: i32,
    pub h: i32,
    pub d: i32,
    pub p: i32,
    pub t: i32,
    pub rows_per_cta: i32,
    pub query_start: i32,
    pub compress_ratio: i32,
    pub topk_is_i64: i32,
    pub deterministic: i32,
    pub scale: f32,
}

/// `IndexerBwdSm90Params` of `params.cuh`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct IndexerBwdSm90Params {
    /// `[B,S,H,D]` bf16, d-stride 1, rows 16-byte aligned.
    pub q: u64,
    /// `[B,P,D]` bf16, same row rules.
    pub kv: u64,
    /// `[B,S,H]` f32.
    pub w: u64,
    /// `[B,S,T]` i32/i64.
    pub topk: u64,
    /// `[B,S,T]` f32.
    pub grad: u64,
    /// `[B,S,H,D]` bf16 out, contiguous, 4-byte aligned.
    pub dq: u64,
    /// `[B,S,H]` f32 out, contiguous.
    pub dw: u64,
    /// `[B,P,D]` f32, zeroed, contiguous, 16-byte aligned.
    pub dkv: u64,
    pub q_sb: i64,
    pub q_ss: i64,
    pub q_sh: i64,
    pub kv_sb: i64,
    pub kv_sp: i64,
    pub w_sb: i64,
    pub w_ss: i64,
    pub w_sh: i64,
    pub t_sb: i64,
    pub t_ss: i64,
    pub t_st: i64,
    pub g_sb: i64,
    pub g_ss: i64,
    pub g_st: i64,
    pub b: i32,
    pub s: i32,
    pub h: i32,
    pub d: i32,
    pub p: i32,
    pub t: i32,
    pub query_start: i32,
    pub compress_ratio: i32,
    pub topk_is_i64: i32,
    /// Dynamic shared memory of the launch (the kernel traps below its layout's size).
    pub smem_bytes: i32,
    pub scale: f32,
    pub pad_: i32,
}

/// `IndexerBwdReduceParams` of `params.cuh`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct IndexerBwdReduceParams {
    /// `[B, n_chunks, P*D]` f32.
    pub partial: u64,
    /// `[B, P*D]` f32 out.
    pub dkv: u64,
    /// P*D
    pub n: i64,
    pub b: i32,
    pub n_chunks: i32,
}

/// `IndexerPackParams` of `params.cuh`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct IndexerPackParams {
    /// `[n0,n1,n2,n3]` bf16, any strides.
    pub src: u64,
    /// `[n0,n1,n2,n3_pad]` bf16 out, contiguous.
    pub dst: u64,
    pub s0: i64,
    pub s1: i64,
    pub s2: i64,
    pub s3: i64,
    pub n0: i64,
    pub n1: i64,
    pub n2: i64,
    pub n3: i64,
    pub n3_pad: i64,
}

const _: () = assert!(size_of::<IndexerScoresParams>() == 224);
const _: () = assert!(size_of::<IndexerTopkParams>() == 96);
const _: () = assert!(size_of::<IndexerBwdParams>() == 256);
const _: () = assert!(size_of::<IndexerBwdSm90Params>() == 224);
const _: () = assert!(size_of::<IndexerBwdReduceParams>() == 32);
const _: () = assert!(size_of::<IndexerPackParams>() == 88);

/// `(params struct name, size in bytes)` of every params struct of this family.
pub const PARAMS_SIZES: &[(&str, usize)] = &[
    ("IndexerScoresParams", size_of::<IndexerScoresParams>()),
    ("IndexerTopkParams", size_of::<IndexerTopkParams>()),
    ("IndexerBwdParams", size_of::<IndexerBwdParams>()),
    ("IndexerBwdSm90Params", size_of::<IndexerBwdSm90Params>()),
    ("IndexerBwdReduceParams", size_of::<IndexerBwdReduceParams>()),
    ("IndexerPackParams", size_of::<IndexerPackParams>()),
];

// ---------------------------------------------------------------------------------------
// Small helpers

fn unavailable(op: &'static str, reason: String) -> Error {
    Error::Unavailable { backend: "cuda".into(), op, reason }
}

/// A size or position as the kernels' i32.
fn to_i32(op: &'static str, what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| unavailable(op, format!("{what} = {v} exceeds the kernels' 32-bit limit")))
}

fn strides_i64(v: &TensorView) -> Vec<i64> {
    // A dimension of size 1 is never stepped over: its stride does not matter.
    v.shape().iter().zip(v.strides()).map(|(&n, &s)| if n <= 1 { 0 } else { s as i64 }).collect()
}

fn check_bf16(op: &'static str, a: &IndexerArgs) -> Result<()> {
    for (name, t) in [("q", &a.q), ("pooled_kv", &a.pooled_kv)] {
        if t.dtype() != DType::BF16 {
            return Err(unavailable(op, format!("the CUDA indexer takes bf16 `q` and `pooled_kv`; `{name}` is {} (the reference backend takes f32)", t.dtype())));
        }
    }
    Ok(())
}

fn check_contiguous(op: &'static str, arg: &'static str, v: &TensorViewMut) -> Result<()> {
    if !v.is_contiguous() {
        return Err(Error::Layout { op, arg, reason: format!("the CUDA indexer writes contiguous outputs; got strides {:?} for shape {:?}", v.strides(), v.shape()) });
    }
    Ok(())
}

/// Scalars shared by every indexer launch, as i32, checked once.
struct Shape {
    b: i32,
    s: i32,
    h: i32,
    d: i32,
    p: i32,
    query_start: i32,
    compress_ratio: i32,
}

fn shape_of(op: &'static str, a: &IndexerArgs) -> Result<Shape> {
    let (dm, _) = a.validate()?;
    to_i32(op, "query_start + S", a.query_start + dm.s)?;
    if dm.b > 65535 {
        return Err(unavailable(op, format!("B = {} exceeds the grid's y limit of 65535", dm.b)));
    }
    Ok(Shape {
        b: to_i32(op, "B", dm.b)?,
        s: to_i32(op, "S", dm.s)?,
        h: to_i32(op, "H", dm.h)?,
        d: to_i32(op, "D", dm.d)?,
        p: to_i32(op, "P", dm.p)?,
        query_start: to_i32(op, "query_start", a.query_start)?,
        compress_ratio: to_i32(op, "compress_ratio", a.compress_ratio)?,
    })
}

fn grid_dim(op: &'static str, what: &str, v: usize) -> Result<u32> {
    u32::try_from(v).ok().filter(|&x| x <= i32::MAX as u32).ok_or_else(|| unavailable(op, format!("{what} = {v} blocks exceed the grid limit")))
}

/// A bf16 operand of the tensor-core loaders: base address and strides (elements) of its
/// leading dims, rows readable as whole 16-byte chunks. Holds the packed copy when one
/// was needed.
struct TcOperand {
    ptr: u64,
    strides: Vec<i64>,
    _packed: Option<Scratch>,
}

/// `v` (bf16, any rank >= 2, last dim = head dim) as a tensor-core operand: used in place
/// when its last dim is contiguous, a multiple of 8 elements, and every row starts
/// 16-byte aligned; otherwise packed into a contiguous copy with the last dim padded
/// with zeros to a multiple of 8.
fn tc_operand(gpu: &Gpu, op: &'static str, v: &TensorView) -> Result<TcOperand> {
    let st = strides_i64(v);
    let rank = v.shape().len();
    let d = v.shape()[rank - 1];
    let in_place = (st[rank - 1] == 1 || d <= 1) && d % 8 == 0 && (v.address() & 15) == 0 && st[..rank - 1].iter().all(|s| s % 8 == 0);
    if in_place {
        return Ok(TcOperand { ptr: v.address(), strides: st[..rank - 1].to_vec(), _packed: None });
    }
    if rank > 4 {
        return Err(unavailable(op, format!("cannot pack a rank-{rank} operand")));
    }
    let d_pad = d.div_ceil(8) * 8;
    // Left-pad shape and strides to rank 4.
    let mut n = [1i64; 4];
    let mut s = [0i64; 4];
    for i in 0..rank {
        n[4 - rank + i] = v.shape()[i] as i64;
        s[4 - rank + i] = st[i];
    }
    let rows: usize = v.shape()[..rank - 1].iter().product();
    let scratch = gpu.scratch(rows * d_pad * 2)?;
    let prm = IndexerPackParams { src: v.address(), dst: scratch.ptr(), s0: s[0], s1: s[1], s2: s[2], s3: s[3], n0: n[0], n1: n[1], n2: n[2], n3: n[3], n3_pad: d_pad as i64 };
    let total = rows * d_pad;
    if total > 0 {
        let k = gpu.kernel("indexer/pack.cu", "indexer_pack_bf16", &[])?;
        let blocks = total.div_ceil(256).min(gpu.props().sm_count as usize * 16).max(1) as u32;
        // SAFETY: src addresses exactly the elements of `v` (its shape and strides, a live
        // device view); dst is a fresh scratch of rows*d_pad bf16; the params type is the
        // entry's.
        unsafe { k.launch([blocks, 1, 1], [256, 1, 1], 0, &prm)? };
    }
    // Contiguous [.., d_pad] strides of the leading dims.
    let mut strides = vec![0i64; rank - 1];
    let mut acc = d_pad as i64;
    for i in (0..rank - 1).rev() {
        strides[i] = if v.shape()[i] <= 1 { 0 } else { acc };
        acc *= v.shape()[i] as i64;
    }
    Ok(TcOperand { ptr: scratch.ptr(), strides, _packed: Some(scratch) })
}

// ---------------------------------------------------------------------------------------
// Tile choice of the scores kernel (the one place; see scores.cu)

/// Compile-time tile of `scores.cu`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct ScoresTiles {
    h: usize,
    d: usize,
    /// Queries per CTA (their q rows stay in shared memory while keys stream).
    bq: usize,
    /// Keys (or selection slots) per tile.
    bn: usize,
    /// 8-key n-tiles per warp.
    nt: usize,
    gather: bool,
    /// Fused scores + top-k: (P, sort_cap) size the rows and sort buffer in shared memory.
    fused: Option<(usize, usize)>,
}

/// 8-key n-tiles per warp for head dim `d`: the largest of 4, 2, 1 whose B fragments
/// (2 registers per n-tile and 16-wide k-step) fit in 64 registers; a power of two so that
/// a tile splits into whole warp slabs of NT*8 keys.
fn warp_n_tiles(d: usize) -> usize {
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
    fn choose(gpu: &Gpu, op: &'static str, h: usize, d: usize, gather: bool) -> Result<ScoresTiles> {
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
    fn smem_bytes(&self) -> usize {
        let hpad = self.h.div_ceil(16) * 16;
        let lds = self.d.div_ceil(16) * 16 + 8;
        let base = (self.bq * hpad * lds + 2 * self.bn * lds) * 2 + self.bq * hpad * 4 + 2 * self.bn * 4;
        base + self.fused.map_or(0, |(p, sort_cap)| SELECT_SMEM_BYTES + sort_cap * 8 + self.bq * p * 4)
    }

    fn threads(&self) -> u32 {
        (self.bq * (self.bn / (self.nt * 8)) * 32) as u32
    }

    fn defines(&self) -> Vec<(&'static str, String)> {
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

/// Operands of a scores launch prepared once per call.
struct ScoresInputs {
    q: TcOperand,
    kv: TcOperand,
    w: Vec<i64>,
    tiles: ScoresTiles,
}

fn scores_inputs(gpu: &Gpu, op: &'static str, a: &IndexerArgs, gather: bool) -> Result<ScoresInputs> {
    let tiles = ScoresTiles::choose(gpu, op, a.q.shape()[2], a.q.shape()[3], gather)?;
    Ok(ScoresInputs { q: tc_operand(gpu, op, &a.q)?, kv: tc_operand(gpu, op, &a.pooled_kv)?, w: strides_i64(&a.weights), tiles })
}

/// Where a launch of `scores.cu` writes: dense or gather scores rows at `out`, or (fused)
/// values at `out` and indices at `idx`, rows of `k` slots.
struct ScoresOut {
    out: u64,
    idx: u64,
    k: usize,
    /// Strides of b and of the local query.
    strides: (i64, i64),
    /// Dense: write only each row's visible keys (`IndexerScoresParams::visible_only`).
    visible_only: bool,
}

/// The params both score kernels (`scores.cu`, `scores_sm90.cu`) share for queries
/// `[s_begin, s_begin + s_count)` written to `dst`; no selection (`topk`, `t` 0), no fused
/// scratch (`rows` 0), no sort buffer (`sort_cap` 0): the caller sets its own.
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
fn launch_scores(gpu: &Gpu, op: &'static str, a: &IndexerArgs, sh: &Shape, inp: &ScoresInputs, topk: Option<&TensorView>, dst: &ScoresOut, s_begin: usize, s_count: usize) -> Result<()> {
    let tiles = &inp.tiles;
    let sort_cap = tiles.fused.map_or(0, |(_, cap)| cap);
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
// Hopper scores kernel (scores_sm90.cu): tiles and launch

/// Which scores kernel `scores_with` / `fused_topk_with` / `chunked_topk` use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScoresPath {
    /// `scores_sm90.cu` when [`hopper_scores_supported`], else `scores.cu`.
    Auto,
    /// `scores.cu` (mma.sync), on any device.
    Portable,
    /// `scores_sm90.cu`; an `Unavailable` error where it cannot run (not sm_90a, or a shape
    /// it does not take). Ignores `DSV4_PORTABLE`, so tests can compare the two paths.
    Hopper,
}

/// Queries per consumer warpgroup of `scores_sm90.cu` (BQ: one per lane of an accumulator
/// quad).
const SM90_BQ: usize = 4;
/// Threads of `scores_sm90.cu`: one consumer warpgroup and one producer warp (128 more a
/// second warpgroup).
const SM90_THREADS: u32 = 160;
/// CTAs per SM `scores_sm90.cu` is built for (`__launch_bounds__(160, 2)`).
const SM90_CTAS_PER_SM: usize = 2;

/// Whether `scores_sm90.cu` takes heads `h` and head dim `d`: N = 4 queries x heads padded
/// to 16/32/64 fits one wgmma (<= 256), and the head dim fits two 64-wide SW128 groups.
fn sm90_fits(h: usize, d: usize) -> bool {
    (1..=64).contains(&h) && (1..=128).contains(&d)
}

/// Consumer warpgroups of a `scores_sm90.cu` launch: 2 for the dense scores (one CTA an
/// SM, two blocks of queries sharing a key ring), 1 fused or under
/// `DSV4_EXTRA_DEFINES=IDX90_TWO_WG=0` (the kernel sees the same define).
fn sm90_consumer_groups(fused: bool) -> usize {
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
fn sm90_smem_bytes(h: usize, d: usize, fused_sort_cap: Option<usize>, nwg: usize) -> usize {
    let hpad = if h <= 16 { 16 } else if h <= 32 { 32 } else { 64 };
    let nrows = SM90_BQ * hpad;
    let dg = d.div_ceil(64);
    let st = sm90_stages(nwg);
    1024 + nwg * dg * nrows * 128 + st * dg * 64 * 128 + nwg * nrows * 4 + (16 * st).next_multiple_of(64) + fused_sort_cap.map_or(0, |cap| SELECT_SMEM_BYTES + cap * 8)
}

/// The dense two-warpgroup `scores_sm90.cu` fills its key ring by TMA where
/// [`sm90_kv_tensor_map`] can map kv (the kernel's IDX90_TMA), unless `IDX90_TMA=0` is in
/// `DSV4_EXTRA_DEFINES` (the cp.async ring, to compare).
fn sm90_tma_requested(nwg: usize) -> bool {
    nwg == 2 && crate::runtime::extra_define("IDX90_TMA") != Some("0")
}

/// The TMA map `scores_sm90.cu` loads key tiles with (IDX90_TMA): kv as a `[B][P][D]` bf16
/// tensor at `kv` (`kv_sb`, `kv_sp` in elements), boxes of 64 keys x 64 head-dim columns
/// (one SW128 group of a ring stage; columns >= D and keys >= P read as zeros). With
/// B = 1 the batch stride is never used (box coordinate 0), so any valid one stands in.
fn sm90_kv_tensor_map(gpu: &Gpu, kv: u64, (b, p, d): (usize, usize, usize), (kv_sb, kv_sp): (i64, i64)) -> Result<TmaDesc> {
    let bytes = |stride: i64| u64::try_from(stride).map_or(0, |s| s.saturating_mul(2));  // negative: 0, refused
    let row = bytes(kv_sp);
    let batch = if b == 1 { row.saturating_mul(p as u64) } else { bytes(kv_sb) };
    gpu.tma_map_bf16(kv, &[d as u64, p as u64, b as u64], &[row, batch], &[64, 64, 1])
}

/// Whether `Auto` takes the Hopper kernel for heads `h`, head dim `d` on this device
/// (dense scores; the fused top-k also needs its sort buffer to fit).
pub fn hopper_scores_supported(gpu: &Gpu, h: usize, d: usize) -> bool {
    gpu.hopper() && sm90_fits(h, d)
}

/// Whether this launch uses `scores_sm90.cu` (`Ok(false)`: `scores.cu`).
fn use_sm90(gpu: &Gpu, op: &'static str, path: ScoresPath, h: usize, d: usize, fused_sort_cap: Option<usize>) -> Result<bool> {
    let smem = sm90_smem_bytes(h, d, fused_sort_cap, sm90_consumer_groups(fused_sort_cap.is_some()));
    let smem_ok = smem <= gpu.props().max_shared_per_block_optin as usize;
    match path {
        ScoresPath::Portable => Ok(false),
        ScoresPath::Auto => Ok(hopper_scores_supported(gpu, h, d) && smem_ok),
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

/// One launch of `scores_sm90.cu` over queries `[s_begin, s_begin + s_count)`: dense rows
/// at `dst.out` (`fused_sort_cap == None`), or the fused top-k into `dst.out` / `dst.idx`.
fn launch_scores_sm90(gpu: &Gpu, op: &'static str, a: &IndexerArgs, sh: &Shape, inp: &ScoresInputs, dst: &ScoresOut, s_begin: usize, s_count: usize, fused_sort_cap: Option<usize>) -> Result<()> {
    let (b, h, d, p) = (sh.b as usize, sh.h as usize, sh.d as usize, sh.p as usize);
    let nwg = sm90_consumer_groups(fused_sort_cap.is_some());
    let smem = sm90_smem_bytes(h, d, fused_sort_cap, nwg);
    let items = s_count.div_ceil(nwg * SM90_BQ) * b;
    // Dense: one CTA per (batch row, query block). Fused: a persistent grid of at most two
    // CTAs per SM (what shared memory allows), each with its own scratch slot of 4 rows.
    let grid_x = match fused_sort_cap {
        None => items,
        Some(_) => {
            let per_sm = (gpu.props().max_shared_per_sm as usize / (smem + 1024)).clamp(1, SM90_CTAS_PER_SM);
            items.min(per_sm * gpu.props().sm_count as usize).max(1)
        }
    };
    let rows = match fused_sort_cap {
        Some(_) => Some(gpu.scratch(grid_x * SM90_BQ * p * 4)?),
        None => None,
    };
    let prm = IndexerScoresParams {
        rows: rows.as_ref().map_or(0, |r| r.ptr()),
        sort_cap: to_i32(op, "sort capacity", fused_sort_cap.unwrap_or(0))?,
        ..scores_params(op, a, sh, inp, dst, s_begin, s_count)?
    };
    // The key ring by TMA (dense with two warpgroups, kv mappable, not IDX90_TMA=0),
    // else by cp.async: the define is passed either way (it overrides DSV4_EXTRA_DEFINES,
    // Gpu::kernel), so the kernel is compiled for the ring this launch passes a map for.
    let kv_map = if sm90_tma_requested(nwg) { sm90_kv_tensor_map(gpu, inp.kv.ptr, (b, p, d), (inp.kv.strides[0], inp.kv.strides[1])).ok() } else { None };
    let defines = [("IDX_H", h.to_string()), ("IDX_D", d.to_string()), ("IDX_FUSED", (fused_sort_cap.is_some() as u8).to_string()), ("IDX90_TMA", (kv_map.is_some() as u8).to_string())];
    let k = gpu.kernel("indexer/scores_sm90.cu", "indexer_scores_sm90", &defines)?;
    let grid = [grid_dim(op, "query blocks", grid_x)?, 1, 1];
    // SAFETY: q/kv rows are 16-byte readable to round_up(D, 8) (tc_operand, alive in `inp`
    // until the launch is queued), weights is a live device view whose strides are
    // passed; `out` holds B x s_count rows of P (dense) or k (fused, and `idx` likewise) at
    // the given strides (checked by the callers); `rows` (fused) is a scratch of grid_x x 4
    // x P f32, one slot per CTA, freed in stream order after the kernel; the dynamic shared
    // memory is sm90_smem_bytes for these defines and sort_cap; the params type is the
    // entry's first parameter, TmaDesc its second: the map of kv (B x P x D at kv's strides:
    // TMA reads only elements of kv) with IDX90_TMA=1, zeros (unread) with IDX90_TMA=0.
    unsafe { k.launch2(grid, [SM90_THREADS + (nwg as u32 - 1) * 128, 1, 1], smem as u32, &prm, &kv_map.unwrap_or(TmaDesc::ZERO)) }
}

/// Dense scores rows of queries `[s_begin, s_begin + s_count)` into `dst` by the kernel
/// `path` picks.
fn launch_dense(gpu: &Gpu, op: &'static str, a: &IndexerArgs, sh: &Shape, inp: &ScoresInputs, dst: &ScoresOut, s_begin: usize, s_count: usize, path: ScoresPath) -> Result<()> {
    if use_sm90(gpu, op, path, sh.h as usize, sh.d as usize, None)? {
        launch_scores_sm90(gpu, op, a, sh, inp, dst, s_begin, s_count, None)
    } else {
        launch_scores(gpu, op, a, sh, inp, None, dst, s_begin, s_count)
    }
}

// ---------------------------------------------------------------------------------------
// Top-k launch configuration

/// Threads of a `topk.cu` CTA (one row): 128, or `TOPK_THREADS` from `DSV4_EXTRA_DEFINES`
/// (a multiple of 32 in 64..=1024). Smaller CTAs put more rows in flight an SM: on the
/// H200, 128 threads took the S=16384 scores + top-k from 1.965 ms (512) to 1.706 ms, 256
/// threads 1.782 (docs/perf/LOG.md v8).
fn topk_threads() -> u32 {
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
fn topk_config(gpu: &Gpu, op: &'static str, p: usize, k: usize) -> Result<(usize, bool, usize)> {
    let sort_cap = k.next_power_of_two().max(2); // >= 2: topk.cu's row cache stays 16-byte aligned
    let limit = gpu.props().max_shared_per_block_optin as usize;
    if topk_smem_bytes(sort_cap, 0) > limit {
        return Err(unavailable(op, format!("k = {k} needs a {sort_cap}-entry sort buffer ({} bytes of shared memory); the device allows {limit}", topk_smem_bytes(sort_cap, 0))));
    }
    let cache = topk_smem_bytes(sort_cap, p) <= (96 << 10).min(limit);
    Ok((sort_cap, cache, topk_smem_bytes(sort_cap, if cache { p } else { 0 })))
}

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

/// Scores `[B,S,P]` f32 with the causal -inf (SPEC.md section 2).
pub fn scores(gpu: &Gpu, a: &IndexerArgs, out: &mut TensorViewMut) -> Result<()> {
    scores_with(gpu, a, out, ScoresPath::Auto)
}

/// [`scores`] by the kernel `path` picks (tests and benchmarks compare the two).
pub fn scores_with(gpu: &Gpu, a: &IndexerArgs, out: &mut TensorViewMut, path: ScoresPath) -> Result<()> {
    const OP: &str = "indexer_scores";
    check_bf16(OP, a)?;
    check_contiguous(OP, "out", out)?;
    let sh = shape_of(OP, a)?;
    let (b, s, p) = (sh.b as usize, sh.s as usize, sh.p as usize);
    if b * s * p == 0 {
        return Ok(());
    }
    let inp = scores_inputs(gpu, OP, a, false)?;
    let dst = ScoresOut { out: out.as_view().address(), idx: 0, k: 0, strides: ((s * p) as i64, p as i64), visible_only: false };
    launch_dense(gpu, OP, a, &sh, &inp, &dst, 0, s, path)
}

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
/// benchmarks. Its scores come from the kernel [`scores`] uses (`ScoresPath::Auto`), so
/// its selection is bitwise that of `topk(scores(..))`.
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

/// Scores of a selection `[B,S,T]` f32 (-inf where masked or not visible).
pub fn topk_scores(gpu: &Gpu, a: &IndexerArgs, topk: &TensorView, out: &mut TensorViewMut) -> Result<()> {
    const OP: &str = "indexer_topk_scores";
    check_bf16(OP, a)?;
    check_contiguous(OP, "out", out)?;
    let sh = shape_of(OP, a)?;
    let (b, s, t) = (sh.b as usize, sh.s as usize, topk.shape()[2]);
    if b * s * t == 0 {
        return Ok(());
    }
    let inp = scores_inputs(gpu, OP, a, true)?;
    let dst = ScoresOut { out: out.as_view().address(), idx: 0, k: 0, strides: ((s * t) as i64, t as i64), visible_only: false };
    launch_scores(gpu, OP, a, &sh, &inp, Some(topk), &dst, 0, s)
}

const BWD_THREADS: usize = 256;
const BWD_NS: usize = 8;

/// Mirrors the shared-memory layout of bwd.cu.
fn bwd_smem_bytes(h: usize, d: usize) -> usize {
    let hg = (BWD_THREADS / d).clamp(1, h.max(1));
    (2 * h * d + BWD_NS * d + 2 * BWD_NS * h + hg * BWD_NS * d + 2 * h + BWD_NS) * 4 + BWD_NS * 4
}

/// Threads of `bwd_mma.cu` (4 warps) and its slots per tile.
const BWD_MMA_THREADS: u32 = 128;
const BWD_MMA_BN: usize = 64;

/// Whether `bwd_mma.cu` takes the shape: its dq / dkv accumulators live in registers.
fn bwd_mma_fits(h: usize, d: usize) -> bool {
    (1..=64).contains(&h) && (1..=128).contains(&d)
}

/// Mirrors SMEM_BASE / SMEM_DET of bwd_mma.cu.
fn bwd_mma_smem_bytes(h: usize, d: usize, deterministic: bool) -> usize {
    let hpad = h.div_ceil(16) * 16;
    let dpad = d.div_ceil(16) * 16;
    let (lds, ldg, ldf) = (dpad + 8, BWD_MMA_BN + 8, dpad + 8);
    let base = (hpad * lds + 2 * BWD_MMA_BN * lds + hpad * ldg) * 2 + hpad * 4 + 2 * BWD_MMA_BN * 4 + 2 * BWD_MMA_BN * 4;
    base + if deterministic { BWD_MMA_BN * ldf * 4 } else { 0 }
}

// ---------------------------------------------------------------------------------------
// Hopper backward (bwd_sm90.cu): shape rules, shared memory, launch

/// Which backward kernel [`topk_scores_backward_with`] uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BwdPath {
    /// `bwd_sm90.cu` where [`bwd_sm90_unsupported`] has no objection, on a Hopper device
    /// (`Gpu::hopper()`), unless `DSV4_INDEXER_BWD_PORTABLE=1`; else the portable kernels.
    Auto,
    /// `bwd_mma.cu` / `bwd.cu`, on any device.
    Portable,
    /// `bwd_sm90.cu`; an `Unavailable` error where it cannot run. Ignores `DSV4_PORTABLE` and
    /// `DSV4_INDEXER_BWD_PORTABLE`, so tests can compare the kernels.
    Hopper,
}

/// Threads of `bwd_sm90.cu`: a producer warpgroup and two consumer warpgroups.
const BWD_SM90_THREADS: u32 = 384;
/// Ring stages per consumer of `bwd_sm90.cu` (NST).
const BWD_SM90_STAGES: usize = 3;

/// Mirrors the shared-memory layout of `bwd_sm90.cu`: 1024 bytes to align the base; per
/// consumer two q tiles, the ring and two G^T tiles (SW128 tiles of 64 rows x 128 bytes per
/// 64 columns of D); the slot tables (key i32, g*scale f32 per stage and slot); the
/// mbarriers (qready[2], qfree[2], ready, keys, free per stage).
fn bwd_sm90_smem_bytes(d: usize) -> usize {
    let tile = d.div_ceil(64) * 64 * 128;
    let per_consumer = (2 + BWD_SM90_STAGES) * tile + 2 * 64 * 128;
    1024 + 2 * per_consumer + 2 * 2 * BWD_SM90_STAGES * 64 * 4 + 2 * (4 + 3 * BWD_SM90_STAGES) * 8
}

/// Why `bwd_sm90.cu` cannot take this call (`None`: it can): atomic mode only, H <= 64,
/// D <= 128 a multiple of 8 (whole 16-byte rows, 4-column dkv reductions), T >= 1, B*S rows
/// in i32, dq 4-byte and dpooled_kv 16-byte aligned, an sm_90a device with the opt-in
/// shared memory.
pub fn bwd_sm90_unsupported(gpu: &Gpu, a: &IndexerTopkScoresBwdArgs, dq: &TensorViewMut, dkv: &TensorViewMut) -> Option<String> {
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
        BwdPath::Auto => Ok(gpu.hopper() && std::env::var("DSV4_INDEXER_BWD_PORTABLE").as_deref() != Ok("1") && bwd_sm90_unsupported(gpu, a, dq, dkv).is_none()),
        BwdPath::Hopper => match bwd_sm90_unsupported(gpu, a, dq, dkv) {
            Some(why) => Err(unavailable(op, why)),
            None => Ok(true),
        },
    }
}

/// One launch of `bwd_sm90.cu` (the caller checked [`bwd_sm90_unsupported`]): dpooled_kv
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
    let k = gpu.kernel("indexer/bwd_sm90.cu", "indexer_bwd_sm90", &[("IDX_H", h.to_string()), ("IDX_D", d.to_string())])?;
    // SAFETY: q / pooled_kv are 16-byte rows readable to D (a multiple of 8; tc_operand,
    // alive until after the launch is queued, scratch frees are stream ordered); weights,
    // topk, grad are live device views read at their own strides; dq / dw are contiguous
    // [B,S,H,D] / [B,S,H] outputs (dq 4-byte aligned), dkv the zeroed contiguous [B,P,D]
    // output, 16-byte aligned (bwd_sm90_unsupported); B*S < 2^31; shared memory is
    // bwd_sm90_smem_bytes(D), which the kernel checks against its layout; the params type
    // is the entry's.
    unsafe { k.launch([grid_dim(op, "CTAs", grid)?, 1, 1], [BWD_SM90_THREADS, 1, 1], smem as u32, &prm) }
}

/// Backward of `topk_scores`: dq `[B,S,H,D]` bf16, dweights `[B,S,H]` f32, dpooled_kv
/// `[B,P,D]` f32 (atomics, or a fixed-order reduction when `a.deterministic`).
/// Tensor cores (`bwd_sm90.cu` on Hopper in atomic mode, else `bwd_mma.cu`) for H <= 64,
/// D <= 128; CUDA cores (`bwd.cu`) beyond.
pub fn topk_scores_backward(gpu: &Gpu, a: &IndexerTopkScoresBwdArgs, dq: &mut TensorViewMut, dw: &mut TensorViewMut, dkv: &mut TensorViewMut) -> Result<()> {
    topk_scores_backward_with(gpu, a, dq, dw, dkv, BwdPath::Auto)
}

/// [`topk_scores_backward`] by the kernel `path` picks (tests and benchmarks compare them).
pub fn topk_scores_backward_with(gpu: &Gpu, a: &IndexerTopkScoresBwdArgs, dq: &mut TensorViewMut, dw: &mut TensorViewMut, dkv: &mut TensorViewMut, path: BwdPath) -> Result<()> {
    const OP: &str = "indexer_topk_scores_backward";
    let f = &a.fwd;
    check_bf16(OP, f)?;
    check_contiguous(OP, "dq", dq)?;
    check_contiguous(OP, "dweights", dw)?;
    check_contiguous(OP, "dpooled_kv", dkv)?;
    let sh = shape_of(OP, f)?;
    let (b, s, h, d, p) = (sh.b as usize, sh.s as usize, sh.h as usize, sh.d as usize, sh.p as usize);
    let t = a.topk_indices.shape()[2];
    if b * s > 0 && use_bwd_sm90(gpu, OP, path, a, dq, dkv)? {
        return launch_bwd_sm90(gpu, OP, a, &sh, dq.as_view().address(), dw.as_view().address(), dkv.as_view().address());
    }
    // bwd_mma.cu writes dq pairs as 4-byte words and adds dkv pairs as 8-byte vectors
    // when D is even: it needs dq and the atomic target aligned to match.
    let aligned = d % 2 == 1 || (dq.as_view().address().is_multiple_of(4) && (a.deterministic || dkv.as_view().address().is_multiple_of(8)));
    let mma = bwd_mma_fits(h, d) && aligned;
    let smem = if mma { bwd_mma_smem_bytes(h, d, a.deterministic) } else { bwd_smem_bytes(h, d) };
    let limit = gpu.props().max_shared_per_block_optin as usize;
    if smem > limit {
        return Err(unavailable(OP, format!("H = {h}, D = {d} need {smem} bytes of shared memory per CTA; the device allows {limit}")));
    }
    let dkv_ptr = dkv.as_view().address();
    let dkv_bytes = b * p * d * 4;
    if b * s == 0 {
        return gpu.zero(dkv_ptr, dkv_bytes); // no query: dpooled_kv = 0 (dq, dw are empty)
    }
    // Deterministic: chunks of consecutive queries, each CTA with its own partial slice;
    // about two CTAs per SM, within BWD_WORKSPACE_BYTES.
    let (n_chunks, rows_per_cta, workspace) = if a.deterministic && p * d > 0 {
        let want = (2 * gpu.props().sm_count as usize).div_ceil(b).max(1);
        let fit = (BWD_WORKSPACE_BYTES / (b * p * d * 4)).max(1);
        let rows = s.div_ceil(want.min(fit).min(s));
        let n = s.div_ceil(rows);
        let ws = gpu.scratch(b * n * p * d * 4)?;
        gpu.zero(ws.ptr(), b * n * p * d * 4)?;
        (n, rows, Some(ws))
    } else {
        gpu.zero(dkv_ptr, dkv_bytes)?;
        (s, 1, None)
    };
    let (mut q, mut kv, w, tk, g) = (strides_i64(&f.q), strides_i64(&f.pooled_kv), strides_i64(&f.weights), strides_i64(&a.topk_indices), strides_i64(&a.grad));
    // Tensor cores: q and pooled_kv as 16-byte rows (packed when they are not), d-stride 1.
    let (q_ptr, kv_ptr, _packed) = if mma {
        let (tq, tkv) = (tc_operand(gpu, OP, &f.q)?, tc_operand(gpu, OP, &f.pooled_kv)?);
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
        dq: dq.as_view().address(),
        dw: dw.as_view().address(),
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
        t: to_i32(OP, "T", t)?,
        rows_per_cta: to_i32(OP, "rows per CTA", rows_per_cta)?,
        query_start: sh.query_start,
        compress_ratio: sh.compress_ratio,
        topk_is_i64: (a.topk_indices.dtype() == DType::I64) as i32,
        deterministic: workspace.is_some() as i32,
        scale: f.softmax_scale,
    };
    let grid = [grid_dim(OP, "query chunks", n_chunks)?, grid_dim(OP, "batch", b)?, 1];
    if mma {
        let k = gpu.kernel("indexer/bwd_mma.cu", "indexer_bwd_mma", &[("IDX_H", h.to_string()), ("IDX_D", d.to_string())])?;
        // SAFETY: q / pooled_kv are 16-byte rows readable to round_up(D, 8) (tc_operand,
        // alive in `_packed` until after the launch is queued; scratch frees are stream
        // ordered), weights, topk, grad are live device views read at their own strides;
        // dq/dw are contiguous outputs of [B,S,H,D] / [B,S,H]; dkv is the zeroed [B,P,D]
        // output (atomic) or the zeroed [B, n_chunks, P, D] workspace whose chunk count
        // matches the grid; shared memory is bwd_mma_smem_bytes(H, D, deterministic) for
        // these defines; the params type is the entry's.
        unsafe { k.launch(grid, [BWD_MMA_THREADS, 1, 1], smem as u32, &prm)? };
    } else {
        let k = gpu.kernel("indexer/bwd.cu", "indexer_bwd", &[])?;
        // SAFETY: q, pooled_kv, weights, topk, grad are live device views read at their own
        // strides; dq/dw are contiguous outputs of [B,S,H,D] / [B,S,H]; dkv is the zeroed
        // [B,P,D] output (atomic) or the zeroed [B, n_chunks, P, D] workspace whose chunk
        // count matches the grid; shared memory is bwd_smem_bytes(H, D); the params type is
        // the entry's.
        unsafe { k.launch(grid, [BWD_THREADS as u32, 1, 1], smem as u32, &prm)? };
    }
    if let Some(ws) = &workspace {
        let rp = IndexerBwdReduceParams { partial: ws.ptr(), dkv: dkv_ptr, n: (p * d) as i64, b: sh.b, n_chunks: to_i32(OP, "chunks", n_chunks)? };
        let kr = gpu.kernel("indexer/bwd.cu", "indexer_bwd_reduce", &[])?;
        let blocks = (b * p * d).div_ceil(256).min(gpu.props().sm_count as usize * 8).max(1) as u32;
        // SAFETY: `partial` is the [B, n_chunks, P*D] workspace written above (stream
        // order), `dkv` the contiguous [B,P,D] output; the params type is the entry's.
        unsafe { kr.launch([blocks, 1, 1], [256, 1, 1], 0, &rp)? };
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scores_smem_mirrors_the_kernel_formula() {
        // H = 64, D = 128, BQ = 2, BN = 64: (2*64*136 + 2*64*136)*2 + 2*64*4 + 2*64*4.
        let t = ScoresTiles { h: 64, d: 128, bq: 2, bn: 64, nt: 4, gather: false, fused: None };
        let base = (2 * 64 * 136 + 2 * 64 * 136) * 2 + 2 * 64 * 4 + 2 * 64 * 4;
        assert_eq!(t.smem_bytes(), base);
        assert_eq!(t.threads(), 128);
        // DSV4 at 4K tokens: P = 1024, top-512, fused in ~85 KB.
        let f = ScoresTiles { fused: Some((1024, 512)), ..t };
        assert_eq!(f.smem_bytes(), base + 2304 + 512 * 8 + 2 * 1024 * 4);
        assert!(f.smem_bytes() <= FUSED_SMEM_BYTES);
    }

    #[test]
    fn sm90_smem_mirrors_the_kernel_layout() {
        // H = 64, D = 128: 1024 (alignment) + sq 2 x 256 x 128 + skv 2 x 2 x 64 x 128
        // + sw 256 x 4 + 64 (barriers); fused adds SelectSmem and the sort buffer.
        let dense = 1024 + 2 * 256 * 128 + 2 * 2 * 64 * 128 + 256 * 4 + 64;
        assert_eq!(sm90_smem_bytes(64, 128, None, 1), dense);
        assert_eq!(sm90_smem_bytes(64, 128, Some(512), 1), dense + 2304 + 512 * 8);
        // Two consumer warpgroups (the dense default): two sq and sw, a 4-stage ring, 64 B of
        // barriers; one CTA an SM within the 227 KiB a block may opt in to.
        let two = 1024 + 2 * 2 * 256 * 128 + 4 * 2 * 64 * 128 + 2 * 256 * 4 + 64;
        assert_eq!(sm90_smem_bytes(64, 128, None, 2), two);
        assert!(two <= 227 << 10);
        // Two CTAs per SM on Hopper (228 KiB a SM, 1 KiB reserved per CTA) for the dense
        // scores and the fused top-512 / top-1024.
        for cap in [None, Some(512), Some(1024)] {
            assert!(2 * (sm90_smem_bytes(64, 128, cap, 1) + 1024) <= 228 << 10, "{cap:?}");
        }
        // Heads pad to 16 / 32 / 64 (N = 64 / 128 / 256), the head dim to groups of 64.
        assert_eq!(sm90_smem_bytes(17, 40, None, 1), 1024 + 128 * 128 + 2 * 64 * 128 + 128 * 4 + 64);
        assert!(sm90_fits(64, 128) && sm90_fits(1, 8) && !sm90_fits(65, 128) && !sm90_fits(64, 136));
    }

    #[test]
    fn bwd_mma_smem_mirrors_the_kernel_formula() {
        // H = 64, D = 128: sq 64x136, skv 2x64x136, sG 64x72 bf16; sw 64, sg 2x64, skey 2x64.
        let base = (64 * 136 + 2 * 64 * 136 + 64 * 72) * 2 + 64 * 4 + 2 * 64 * 4 + 2 * 64 * 4;
        assert_eq!(bwd_mma_smem_bytes(64, 128, false), base);
        assert_eq!(bwd_mma_smem_bytes(64, 128, true), base + 64 * 136 * 4);
        // Two CTAs per SM on Hopper even when deterministic; three in atomic mode (the
        // kernel's register bound, __launch_bounds__(128, 3), is sized for them).
        assert!(2 * bwd_mma_smem_bytes(64, 128, true) <= 227 << 10);
        assert!(3 * (bwd_mma_smem_bytes(64, 128, false) + 1024) <= 228 << 10);
        assert!(bwd_mma_fits(64, 128) && bwd_mma_fits(3, 20) && !bwd_mma_fits(65, 128) && !bwd_mma_fits(8, 136));
    }

    #[test]
    fn bwd_sm90_smem_mirrors_the_kernel_layout() {
        // D = 128: per consumer q 2 x 16 KiB, ring 3 x 16 KiB, G^T 2 x 8 KiB; slot tables
        // 2 x 2 x 3 x 64 x 4; 2 x 13 mbarriers; 1024 of alignment slack. One CTA per SM.
        let d128 = 1024 + 2 * (2 * 16384 + 3 * 16384 + 2 * 8192) + 2 * 2 * 3 * 64 * 4 + 2 * 13 * 8;
        assert_eq!(bwd_sm90_smem_bytes(128), d128);
        assert_eq!(d128, 200_912);
        assert!(d128 <= 232_448 && 2 * (d128 + 1024) > 228 << 10);
        // D <= 64: one SW128 group per row.
        assert_eq!(bwd_sm90_smem_bytes(40), bwd_sm90_smem_bytes(64));
        assert_eq!(bwd_sm90_smem_bytes(64), 1024 + 2 * (5 * 8192 + 2 * 8192) + 2 * 2 * 3 * 64 * 4 + 2 * 13 * 8);
    }

    #[test]
    fn warp_slabs_divide_the_tiles() {
        for d in 1..=512 {
            let nt = warp_n_tiles(d);
            assert!(64 % (nt * 8) == 0 && 2 * d.div_ceil(16) * nt <= 64, "D = {d}: NT = {nt}");
        }
    }

    #[test]
    fn params_sizes_are_listed() {
        assert_eq!(PARAMS_SIZES.len(), 6);
        assert!(PARAMS_SIZES.iter().all(|(_, n)| n % 8 == 0));
    }
}
