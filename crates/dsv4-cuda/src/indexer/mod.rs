//! The lightning indexer on the GPU (SPEC.md sections 2 and 3): launchers for
//! `kernels/indexer/`. Inputs and outputs come validated by `dsv4-core` (its `ops::indexer`
//! functions); the launchers add only what the kernels need (bf16 q and pooled_kv, sizes in
//! i32, shared memory).
//!
//! - `scores`: on Hopper (`Gpu::hopper()`: sm_90a, unless `DSV4_PORTABLE=1`) and H <= 64,
//!   D <= 128, `scores_sm90.cu` (wgmma: two consumer warpgroups of 4 queries sharing a key
//!   ring that a producer warp fills by TMA, or by cp.async where kv cannot be mapped);
//!   elsewhere `scores.cu` (mma.sync: per CTA a block of queries with all their heads
//!   against streamed tiles of pooled keys, relu + weighted head sum in registers, tiles
//!   past the causal limit never computed). [`ScoresPath`] forces either kernel (tests).
//! - `topk`: one CTA per row (`topk.cu`): radix select on order-preserving keys, gather of
//!   the keys above the threshold, bitonic sort, ties at the threshold taken in index order.
//! - `fused_topk` (scores + top-k): on Hopper the chunked path (dense scores of a bounded
//!   block of queries in a scratch, then `topk.cu`, block after block); elsewhere
//!   `scores.cu` keeps each query's row of scores in shared memory and selects its top-k
//!   there with `topk.cu`'s selection (`select.cuh`), one launch, when the rows fit
//!   (`IdxScoresConfig::fused_smem_bytes`), else the chunked path.
//! - `topk_scores`: `scores.cu` in gather mode (the key tile is the query's selection;
//!   the indices are fetched two tiles ahead of the row copies).
//! - `topk_scores_backward`: `bwd_mma.cu` on tensor cores for H <= 64, D <= 128 (per query
//!   and 64-slot tile: A = q kv^T, G = g*scale*w*[A>0], dq += G kv, dkv_tile = G^T q), else
//!   `bwd.cu` on CUDA cores; dkv by atomics or by per-CTA partial slices summed in a fixed
//!   order (deterministic). On Hopper, atomic mode, H <= 64 and D <= 128 a multiple of 8,
//!   `bwd_sm90.cu` instead (the same products on wgmma: a persistent grid, a producer
//!   warpgroup gathering each consumer's kv tiles through an mbarrier ring, two independent
//!   consumer warpgroups); [`BwdPath`] forces either kernel (tests).
//!
//! q and pooled_kv must be bf16; inputs may have any strides (the tensor-core loaders read
//! 16-byte rows; other layouts are first packed by `pack.cu`). Outputs are contiguous.
//!
//! Files: `params.rs` (the structs of `params.cuh`), `config.rs` (the typed configs, and
//! the tiles, defines and shared memory of every kernel), `pack.rs` (tensor-core operands),
//! `scores.rs`, `topk.rs` (with the fused and chunked scores + top-k), `topk_scores.rs`,
//! `backward.rs`, `variants.rs` (the compile variants).

mod backward;
mod config;
mod pack;
mod params;
mod scores;
#[cfg(test)]
mod tests;
mod topk;
mod topk_scores;
mod variants;

use dsv4_core::ops::indexer::IndexerArgs;
use dsv4_core::{DType, Error, Result, TensorView};

pub(crate) use backward::topk_scores_backward;
// For tests/gpu_indexer.rs: the backward by a forced kernel (Hopper against portable).
#[doc(hidden)]
pub use backward::{topk_scores_backward_with, BwdPath};
pub use config::{IdxBwd90Config, IdxBwdConfig, IdxBwdMmaConfig, IdxPackConfig, IdxScores90Config, IdxScoresConfig, IdxTopkConfig, IdxTopkScoresConfig};
pub(crate) use params::PARAMS_SIZES;
pub(crate) use scores::scores;
// For tests/gpu_indexer.rs: the scores by a forced kernel (Hopper against portable).
#[doc(hidden)]
pub use scores::{scores_with, ScoresPath};
// For tests/gpu_indexer.rs: the bounded-scratch path, and the fused call by a forced scores kernel.
#[doc(hidden)]
pub use topk::{chunked_topk, fused_topk_with};
pub(crate) use topk::{fused_topk, topk};
pub(crate) use topk_scores::topk_scores;
pub(crate) use variants::compile_variants;

/// Whether these kernels can run (`is_kernel_available("indexer")`).
pub const READY: bool = true;

/// Bytes of `SelectSmem` (select.cuh).
const SELECT_SMEM_BYTES: usize = 2304;

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

/// The validated dimensions of `a` as the kernels' i32 (`Unavailable` beyond their limits).
fn shape_of(op: &'static str, a: &IndexerArgs) -> Result<Shape> {
    let (q, kv) = (a.q.shape(), a.pooled_kv.shape());
    let (b, s, h, d, p) = (q[0], q[1], q[2], q[3], kv[1]);
    to_i32(op, "query_start + S", a.query_start + s)?;
    if b > 65535 {
        return Err(unavailable(op, format!("B = {b} exceeds the grid's y limit of 65535")));
    }
    Ok(Shape {
        b: to_i32(op, "B", b)?,
        s: to_i32(op, "S", s)?,
        h: to_i32(op, "H", h)?,
        d: to_i32(op, "D", d)?,
        p: to_i32(op, "P", p)?,
        query_start: to_i32(op, "query_start", a.query_start)?,
        compress_ratio: to_i32(op, "compress_ratio", a.compress_ratio)?,
    })
}

fn grid_dim(op: &'static str, what: &str, v: usize) -> Result<u32> {
    u32::try_from(v).ok().filter(|&x| x <= i32::MAX as u32).ok_or_else(|| unavailable(op, format!("{what} = {v} blocks exceed the grid limit")))
}
