//! The params structs of the indexer kernels, mirrored by `kernels/indexer/params.cuh`.

use std::mem::size_of;

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
