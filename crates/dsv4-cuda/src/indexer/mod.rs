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
//!
//! Files: `params.rs` (the structs of `params.cuh`), `config.rs` (tiles, threads, shapes and
//! shared memory of every kernel), `pack.rs` (tensor-core operands), `scores.rs`, `topk.rs`
//! (with the fused and chunked scores + top-k), `topk_scores.rs`, `backward.rs`.

mod backward;
mod config;
mod pack;
mod params;
mod scores;
#[cfg(test)]
mod tests;
mod topk;
mod topk_scores;

use dsv4_core::ops::indexer::IndexerArgs;
use dsv4_core::{DType, Error, Result, TensorView, TensorViewMut};

pub use backward::{bwd_sm90_unsupported, topk_scores_backward, topk_scores_backward_with, BwdPath};
pub use params::{IndexerBwdParams, IndexerBwdReduceParams, IndexerBwdSm90Params, IndexerPackParams, IndexerScoresParams, IndexerTopkParams, PARAMS_SIZES};
pub use scores::{hopper_scores_supported, scores, scores_with, ScoresPath};
pub use topk::{chunked_topk, chunked_topk_with, fused_topk, fused_topk_with, topk};
pub use topk_scores::topk_scores;

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

/// The kernel variants this family's launchers can select, rendered from their configs
/// (the kernel compile test builds these; see `tuning::compile_variants`). Files not yet
/// listed are compiled from their `// dsv4-test-defines:` lines.
pub fn compile_variants() -> Vec<crate::tuning::Variant> {
    Vec::new()
}
