// build_sparse_topk_indices (SPEC.md section 6): params shared by the vision-span scan
// and the index builder.
#pragma once
#include "common.cuh"

struct BuildIndicesParams {
    i32* out;                    // [B,S,W'] i32 contiguous, W' = window_width + compressed slots
    const void* mask;            // [B,1,S,>=K] additive mask (bf16 if mask_is_bf16 else f32), strides mask_stride; null = none
    const void* compressed_topk; // [B,S,Tc] i32/i64 (ct_is_i64), strides ct_stride; null = all P pooled keys
    const void* q_positions;     // [S], [1,S] or [B,S] i32/i64 (qp_is_i64): element (b,s) at b*qp_stride[0] + s*qp_stride[1]; null = 0..S
    const void* vision_types;    // [B,S] i32/i64 (vt_is_i64), strides vt_stride: -1 text, 0 image start, 4 image end
    i32* spans;                  // [3][B][S] scratch written by vision_spans: last start, first end, inside; null without vision
    i64 mask_stride[3];          // mask strides of dims b, s, k (dim 1 has size 1)
    i64 ct_stride[3];            // b, s, t
    i64 qp_stride[2];            // b (0 when broadcast over the batch), s
    i64 vt_stride[2];            // b, s
    i64 batch;                   // B
    i64 seq_len;                 // S
    i64 key_len;                 // K: slots outside [0, K) become -1
    i64 window;                  // W
    i64 compress_ratio;          // r (used without compressed_topk)
    i64 n_pooled;                // P (0 = no compressed part)
    i64 compressed_width;        // Tc
    i64 vanilla_key_len;         // V: pooled key c is key V + c
    i64 max_image_tokens;        // M
    i64 window_width;            // min(V, W) for text, min(S, W + M) with vision spans
    i64 width;                   // W'
    i32 mask_is_bf16;
    i32 ct_is_i64;
    i32 qp_is_i64;
    i32 vt_is_i64;
    i32 vision;                  // vision spans given and M > 0
    i32 has_compressed_topk;
};
DSV4_PARAMS_SIZE(BuildIndicesParams, 240);

#define IMAGE_START 0
#define IMAGE_END 4
