// Parameter structs of the lightning-indexer kernels (SPEC.md sections 2 and 3).
// Each is passed by value as the single kernel argument and mirrored field by field by a
// #[repr(C)] struct in src/indexer/params.rs; the sizes are asserted on both sides.
// Strides are in elements. 8-byte fields come first so neither side pads.
#pragma once

#include "common.cuh"

// scores.cu: `indexer_scores` (dense causal scores); with IDX_GATHER=1,
// `indexer_topk_scores` (the scores of a given selection); with IDX_FUSED=1, the fused
// scores + top-k (the scores of a query never leave shared memory).
// scores_sm90.cu (Hopper wgmma) takes the same struct for dense scores.
struct IndexerScoresParams {
    const bf16* q;        // [B,S,H,D], d-stride 1, rows 16-byte aligned, readable to round_up(D,8)
    const bf16* kv;       // [B,P,D], same row rules as q
    const float* w;       // [B,S,H]
    const void* topk;     // [B,S,T] i32 or i64 (gather mode; null otherwise), -1 = masked
    float* out;           // dense: [B, s_count, P]; gather: [B, s_count, T]; fused: values [B, s_count, K]; last dim contiguous
    int* idx;             // fused: indices [B, s_count, K] at out's strides; null otherwise
    float* rows;          // unused (null): keeps the layout the Rust mirror asserts
    i64 q_sb, q_ss, q_sh;  // q strides of b, s, h
    i64 kv_sb, kv_sp;      // pooled_kv strides of b, p
    i64 w_sb, w_ss, w_sh;  // weights strides of b, s, h
    i64 t_sb, t_ss, t_st;  // topk strides of b, s, t (gather mode)
    i64 out_sb, out_ss;    // out strides of b and of the local query (s - s_begin)
    i32 B, S, H, D, P, T;  // T: slots per query (gather mode)
    i32 s_begin;           // first query of this launch (the chunked top-k scores blocks of queries)
    i32 s_count;           // queries of this launch
    i32 query_start;       // global position of local query 0
    i32 compress_ratio;    // r >= 1: query s sees p < (query_start + s + 1) / r
    i32 topk_is_i64;       // topk's element type
    i32 k;                 // fused: slots per query = min(k, P)
    i32 sort_cap;          // fused: sort buffer entries (power of two >= k)
    float scale;           // softmax_scale
    // dense: 1 = write only each row's visible keys (the rest of the row is left as it
    // was: the caller reads the visible prefix only, as chunked_topk's topk.cu does);
    // 0 = the whole row, -inf past the visible keys. Other modes ignore it.
    i32 visible_only;
};
DSV4_PARAMS_SIZE(IndexerScoresParams, 224);

// topk.cu: `indexer_topk` over rows of f32 scores.
struct IndexerTopkParams {
    const float* scores;   // [B, S, P] (any strides)
    int* idx;              // [B, S, K] out, last dim contiguous; -1 past the finite count
    float* vals;           // [B, S, K] out, same strides as idx; -inf past the finite count
    i64 sc_sb, sc_ss, sc_sp;  // scores strides of b, s, p
    i64 out_sb, out_ss;       // idx / vals strides of b, s
    i32 B, S, P;
    i32 K;                 // slots per row = min(k, P)
    i32 sort_cap;          // capacity of the shared sort buffer (power of two >= K)
    i32 cache_row;         // 1: the row's keys fit in shared memory and are cached there
    // compress_ratio > 0: the rows are causal indexer scores (-inf past the visible keys)
    // and row s reads only its visible prefix, min(P, visible_keys(query_start + s, r));
    // 0: every row reads all P.
    i32 query_start;
    i32 compress_ratio;
};
DSV4_PARAMS_SIZE(IndexerTopkParams, 96);

// bwd.cu: backward of `indexer_topk_scores`.
struct IndexerBwdParams {
    const bf16* q;         // [B,S,H,D] (any strides)
    const bf16* kv;        // [B,P,D] (any strides)
    const float* w;        // [B,S,H] (any strides)
    const void* topk;      // [B,S,T] i32 or i64, -1 = masked
    const float* grad;     // [B,S,T] (any strides)
    bf16* dq;              // [B,S,H,D] out, contiguous
    float* dw;             // [B,S,H] out, contiguous
    float* dkv;            // atomic: [B,P,D] zeroed; deterministic: partials [B, n_chunks, P, D] zeroed
    i64 q_sb, q_ss, q_sh, q_sd;  // q strides of b, s, h, d
    i64 kv_sb, kv_sp, kv_sd;     // pooled_kv strides of b, p, d
    i64 w_sb, w_ss, w_sh;        // weights strides
    i64 t_sb, t_ss, t_st;        // topk strides
    i64 g_sb, g_ss, g_st;        // grad strides
    i64 dkv_sb;            // dkv target stride of b (P*D, or n_chunks*P*D for partials)
    i64 dkv_sc;            // stride of the row chunk (0 in atomic mode, P*D for partials)
    i32 B, S, H, D, P, T;
    i32 rows_per_cta;      // consecutive queries one CTA walks through, in order
    i32 query_start, compress_ratio, topk_is_i64;
    i32 deterministic;     // 1: plain read-modify-write of the CTA's own partial slice
    float scale;
};
DSV4_PARAMS_SIZE(IndexerBwdParams, 256);

// bwd_sm90.cu: backward of `indexer_topk_scores` on Hopper (wgmma), atomic mode only.
struct IndexerBwdSm90Params {
    const bf16* q;         // [B,S,H,D], d-stride 1, rows 16-byte aligned, readable to round_up(D,8)
    const bf16* kv;        // [B,P,D], same row rules as q
    const float* w;        // [B,S,H] (any strides)
    const void* topk;      // [B,S,T] i32 or i64 (any strides), -1 = masked
    const float* grad;     // [B,S,T] (any strides)
    bf16* dq;              // [B,S,H,D] out, contiguous, 4-byte aligned
    float* dw;             // [B,S,H] out, contiguous
    float* dkv;            // [B,P,D] zeroed, contiguous, 16-byte aligned (f32 vector reductions)
    i64 q_sb, q_ss, q_sh;  // q strides of b, s, h
    i64 kv_sb, kv_sp;      // pooled_kv strides of b, p
    i64 w_sb, w_ss, w_sh;  // weights strides
    i64 t_sb, t_ss, t_st;  // topk strides
    i64 g_sb, g_ss, g_st;  // grad strides
    i32 B, S, H, D, P, T;
    i32 query_start, compress_ratio, topk_is_i64;
    i32 smem_bytes;        // dynamic shared memory of the launch (checked against the kernel's layout)
    float scale;           // softmax_scale
    i32 pad_;
};
DSV4_PARAMS_SIZE(IndexerBwdSm90Params, 224);

// bwd.cu: deterministic mode's fixed-order sum of the partials.
struct IndexerBwdReduceParams {
    const float* partial;  // [B, n_chunks, P*D]
    float* dkv;            // [B, P*D] out
    i64 n;                 // P*D
    i32 B, n_chunks;
};
DSV4_PARAMS_SIZE(IndexerBwdReduceParams, 32);

// pack.cu: a strided bf16 tensor copied into a contiguous one whose last dim is padded
// with zeros to a multiple of 8 (16 bytes), for the tensor-core loaders.
struct IndexerPackParams {
    const bf16* src;       // [n0, n1, n2, n3] (any strides)
    bf16* dst;             // [n0, n1, n2, n3_pad] out, contiguous
    i64 s0, s1, s2, s3;    // src strides
    i64 n0, n1, n2, n3;    // sizes
    i64 n3_pad;            // round_up(n3, 8)
};
DSV4_PARAMS_SIZE(IndexerPackParams, 88);
