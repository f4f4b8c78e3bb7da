//! The params structs of the indexer kernels, mirrored by `kernels/indexer/params.cuh`.

use std::mem::size_of;

// ---------------------------------------------------------------------------------------
// Params structs, mirrored by kernels/indexer/params.cuh (same field order and types).

/// `IndexerScoresParams` of `params.cuh`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct IndexerScoresParams {
    /// `[B,S,H,D]` bf16, d-stride 1, rows 16-byte aligned.
    pub(crate) q: u64,
    /// `[B,P,D]` bf16, same row rules.
    pub(crate) kv: u64,
    /// `[B,S,H]` f32.
    pub(crate) w: u64,
    /// `[B,S,T]` i32/i64 (gather mode), else 0.
    pub(crate) topk: u64,
    /// dense `[B, s_count, P]`, gather `[B, s_count, T]`, fused: values `[B, s_count, K]`
    /// f32, last dim contiguous.
    pub(crate) out: u64,
    /// fused: indices `[B, s_count, K]` i32 at out's strides; else 0.
    pub(crate) idx: u64,
    /// Unused (0): keeps the layout of `params.cuh`.
    pub(crate) rows: u64,
    pub(crate) q_sb: i64,
    pub(crate) q_ss: i64,
    pub(crate) q_sh: i64,
    pub(crate) kv_sb: i64,
    pub(crate) kv_sp: i64,
    pub(crate) w_sb: i64,
    pub(crate) w_ss: i64,
    pub(crate) w_sh: i64,
    pub(crate) t_sb: i64,
    pub(crate) t_ss: i64,
    pub(crate) t_st: i64,
    pub(crate) out_sb: i64,
    pub(crate) out_ss: i64,
    pub(crate) b: i32,
    pub(crate) s: i32,
    pub(crate) h: i32,
    pub(crate) d: i32,
    pub(crate) p: i32,
    pub(crate) t: i32,
    pub(crate) s_begin: i32,
    pub(crate) s_count: i32,
    pub(crate) query_start: i32,
    pub(crate) compress_ratio: i32,
    pub(crate) topk_is_i64: i32,
    /// fused: min(k, P)
    pub(crate) k: i32,
    /// fused: power of two >= k
    pub(crate) sort_cap: i32,
    pub(crate) scale: f32,
    /// dense: 1 = only each row's visible keys are written (the rest left as it was), for
    /// a caller that reads the visible prefix only; 0 = the whole row (-inf past them).
    pub(crate) visible_only: i32,
}

/// `IndexerTopkParams` of `params.cuh`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct IndexerTopkParams {
    /// `[B,S,P]` f32, any strides.
    pub(crate) scores: u64,
    /// `[B,S,K]` i32 out.
    pub(crate) idx: u64,
    /// `[B,S,K]` f32 out, idx's strides.
    pub(crate) vals: u64,
    pub(crate) sc_sb: i64,
    pub(crate) sc_ss: i64,
    pub(crate) sc_sp: i64,
    pub(crate) out_sb: i64,
    pub(crate) out_ss: i64,
    pub(crate) b: i32,
    pub(crate) s: i32,
    pub(crate) p: i32,
    /// min(k, P)
    pub(crate) k: i32,
    /// power of two >= K
    pub(crate) sort_cap: i32,
    pub(crate) cache_row: i32,
    /// > 0: causal rows, row s reads min(P, visible_keys(query_start + s, r)) scores.
    pub(crate) query_start: i32,
    pub(crate) compress_ratio: i32,
}

/// `IndexerBwdParams` of `params.cuh`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct IndexerBwdParams {
    /// `[B,S,H,D]` bf16, any strides.
    pub(crate) q: u64,
    /// `[B,P,D]` bf16, any strides.
    pub(crate) kv: u64,
    /// `[B,S,H]` f32.
    pub(crate) w: u64,
    /// `[B,S,T]` i32/i64.
    pub(crate) topk: u64,
    /// `[B,S,T]` f32.
    pub(crate) grad: u64,
    /// `[B,S,H,D]` bf16 out, contiguous.
    pub(crate) dq: u64,
    /// `[B,S,H]` f32 out, contiguous.
    pub(crate) dw: u64,
    /// atomic: `[B,P,D]` zeroed; deterministic: partials `[B, n_chunks, P, D]` zeroed.
    pub(crate) dkv: u64,
    pub(crate) q_sb: i64,
    pub(crate) q_ss: i64,
    pub(crate) q_sh: i64,
    pub(crate) q_sd: i64,
    pub(crate) kv_sb: i64,
    pub(crate) kv_sp: i64,
    pub(crate) kv_sd: i64,
    pub(crate) w_sb: i64,
    pub(crate) w_ss: i64,
    pub(crate) w_sh: i64,
    pub(crate) t_sb: i64,
    pub(crate) t_ss: i64,
    pub(crate) t_st: i64,
    pub(crate) g_sb: i64,
    pub(crate) g_ss: i64,
    pub(crate) g_st: i64,
    pub(crate) dkv_sb: i64,
    pub(crate) dkv_sc: i64,
    pub(crate) b: i32,
    pub(crate) s: i32,
    pub(crate) h: i32,
    pub(crate) d: i32,
    pub(crate) p: i32,
    pub(crate) t: i32,
    pub(crate) rows_per_cta: i32,
    pub(crate) query_start: i32,
    pub(crate) compress_ratio: i32,
    pub(crate) topk_is_i64: i32,
    pub(crate) deterministic: i32,
    pub(crate) scale: f32,
}

/// `IndexerBwdSm90Params` of `params.cuh`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct IndexerBwdSm90Params {
    /// `[B,S,H,D]` bf16, d-stride 1, rows 16-byte aligned.
    pub(crate) q: u64,
    /// `[B,P,D]` bf16, same row rules.
    pub(crate) kv: u64,
    /// `[B,S,H]` f32.
    pub(crate) w: u64,
    /// `[B,S,T]` i32/i64.
    pub(crate) topk: u64,
    /// `[B,S,T]` f32.
    pub(crate) grad: u64,
    /// `[B,S,H,D]` bf16 out, contiguous, 4-byte aligned.
    pub(crate) dq: u64,
    /// `[B,S,H]` f32 out, contiguous.
    pub(crate) dw: u64,
    /// `[B,P,D]` f32, zeroed, contiguous, 16-byte aligned.
    pub(crate) dkv: u64,
    pub(crate) q_sb: i64,
    pub(crate) q_ss: i64,
    pub(crate) q_sh: i64,
    pub(crate) kv_sb: i64,
    pub(crate) kv_sp: i64,
    pub(crate) w_sb: i64,
    pub(crate) w_ss: i64,
    pub(crate) w_sh: i64,
    pub(crate) t_sb: i64,
    pub(crate) t_ss: i64,
    pub(crate) t_st: i64,
    pub(crate) g_sb: i64,
    pub(crate) g_ss: i64,
    pub(crate) g_st: i64,
    pub(crate) b: i32,
    pub(crate) s: i32,
    pub(crate) h: i32,
    pub(crate) d: i32,
    pub(crate) p: i32,
    pub(crate) t: i32,
    pub(crate) query_start: i32,
    pub(crate) compress_ratio: i32,
    pub(crate) topk_is_i64: i32,
    /// Dynamic shared memory of the launch (the kernel traps below its layout's size).
    pub(crate) smem_bytes: i32,
    pub(crate) scale: f32,
    pub(crate) pad_: i32,
}

/// `IndexerBwdReduceParams` of `params.cuh`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct IndexerBwdReduceParams {
    /// `[B, n_chunks, P*D]` f32.
    pub(crate) partial: u64,
    /// `[B, P*D]` f32 out.
    pub(crate) dkv: u64,
    /// P*D
    pub(crate) n: i64,
    pub(crate) b: i32,
    pub(crate) n_chunks: i32,
}

/// `IndexerPackParams` of `params.cuh`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct IndexerPackParams {
    /// `[n0,n1,n2,n3]` bf16, any strides.
    pub(crate) src: u64,
    /// `[n0,n1,n2,n3_pad]` bf16 out, contiguous.
    pub(crate) dst: u64,
    pub(crate) s0: i64,
    pub(crate) s1: i64,
    pub(crate) s2: i64,
    pub(crate) s3: i64,
    pub(crate) n0: i64,
    pub(crate) n1: i64,
    pub(crate) n2: i64,
    pub(crate) n3: i64,
    pub(crate) n3_pad: i64,
}

const _: () = assert!(size_of::<IndexerScoresParams>() == 224);
const _: () = assert!(size_of::<IndexerTopkParams>() == 96);
const _: () = assert!(size_of::<IndexerBwdParams>() == 256);
const _: () = assert!(size_of::<IndexerBwdSm90Params>() == 224);
const _: () = assert!(size_of::<IndexerBwdReduceParams>() == 32);
const _: () = assert!(size_of::<IndexerPackParams>() == 88);

/// `(params struct name, size in bytes)` of every params struct of this family.
pub(crate) const PARAMS_SIZES: &[(&str, usize)] = &[
    ("IndexerScoresParams", size_of::<IndexerScoresParams>()),
    ("IndexerTopkParams", size_of::<IndexerTopkParams>()),
    ("IndexerBwdParams", size_of::<IndexerBwdParams>()),
    ("IndexerBwdSm90Params", size_of::<IndexerBwdSm90Params>()),
    ("IndexerBwdReduceParams", size_of::<IndexerBwdReduceParams>()),
    ("IndexerPackParams", size_of::<IndexerPackParams>()),
];
