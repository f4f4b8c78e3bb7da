// Parameter structs of the sparse-attention kernels (SPEC.md sections 1 and 6). Each is
// passed by value as the single kernel argument and mirrored field by field by a
// #[repr(C)] struct in src/sparse_attention/params.rs; the sizes are asserted on both sides.
// Strides are in elements. 8-byte fields come first so neither side pads.
//
// Index conventions shared by every kernel: a slot of row (b, s) holds `idx - b*idx_bias`
// as its key (idx_bias = 0 for a [B,S,T] selection, K for a plan's global coordinates);
// a key outside [0, K) is a masked slot and is never dereferenced.
#pragma once

#include "common.cuh"

// fwd.cu: `sparse_attention` forward and, with SA_DEDUP=1 over a sorted plan, the dense
// oracle `dense_attention_topk` (duplicate keys collapse).
struct SparseAttnFwdParams {
    const bf16* q;         // [B,S,H,D], d-stride 1, rows 16-byte aligned
    const bf16* kv;        // [B,K,D], d-stride 1, rows 16-byte aligned
    const float* sinks;    // [H] (stride sinks_sh), pre-scaled logits
    const void* idx;       // [B,S,T] i32 or i64 (any strides); plan: [B*S,1,T] i32 global b*K+k, -1 = masked
    const i32* row_len;    // [B*S] valid-prefix length per row (plan), or null: scan all T slots
    bf16* out;             // [B,S,H,D] out, contiguous
    float* lse;            // [B,S,H] out, contiguous, natural log
    i64 q_sb, q_ss, q_sh;  // q strides of b, s, h
    i64 kv_sb, kv_sk;      // kv strides of b, k
    i64 idx_sb, idx_ss, idx_st;  // idx strides of b, s, t
    i64 idx_bias;          // key = idx - b * idx_bias
    i64 sinks_sh;          // sinks stride
    i32 B, S, H, K, T;
    i32 idx_is_i64;        // idx's element type
    i32 smem_bytes;        // dynamic shared memory of the launch (checked against the layout)
    float sm_scale;        // applied to q.k; sinks are not scaled
};
DSV4_PARAMS_SIZE(SparseAttnFwdParams, 168);

// bwd.cu: `sparse_attention` backward, both reductions of dkv.
// Atomic: a CTA owns one chunk = (batch b, head block, consecutive rows s of b); chunk
// c = ((b * n_head_blocks) + head_block) * chunks_per_bh + row_chunk.
// Deterministic: CTA i owns row chunk_base + i / n_head_blocks (a B*S index) and head block
// i % n_head_blocks, and stores its per-slot dkv contributions instead of adding them.
struct SparseAttnBwdParams {
    const bf16* q;         // [B,S,H,D], d-stride 1, rows 16-byte aligned
    const bf16* kv;        // [B,K,D], d-stride 1, rows 16-byte aligned
    const float* sinks;    // [H] (stride sinks_sh)
    const void* idx;       // as SparseAttnFwdParams::idx
    const i32* row_len;    // [B*S] or null, as SparseAttnFwdParams::row_len
    const bf16* out;       // [B,S,H,D] forward output, d-stride 1, rows 16-byte aligned
    const bf16* dout;      // [B,S,H,D] gradient of out, d-stride 1, rows 16-byte aligned
    const float* lse;      // [B,S,H] forward log-normaliser (natural log), any strides
    bf16* dq;              // [B,S,H,D] out, contiguous
    float* dkv;            // atomic: [B,K,D] f32 zeroed; deterministic: contributions [rows of the wave, T, n_head_blocks, D] out
    float* dsinks_part;    // [B*S, H] out: -p_sink * delta per row and head (0 for an empty row)
    i64 q_sb, q_ss, q_sh;  // q strides of b, s, h
    i64 kv_sb, kv_sk;      // kv strides of b, k
    i64 idx_sb, idx_ss, idx_st;  // idx strides of b, s, t
    i64 idx_bias;          // key = idx - b * idx_bias
    i64 sinks_sh;          // sinks stride
    i64 o_sb, o_ss, o_sh;  // out strides of b, s, h
    i64 do_sb, do_ss, do_sh;     // dout strides of b, s, h
    i64 lse_sb, lse_ss, lse_sh;  // lse strides of b, s, h
    i32 B, S, H, K, T;
    i32 idx_is_i64;        // idx's element type
    i32 smem_bytes;        // dynamic shared memory of the launch (checked against the layout)
    i32 rows_per_chunk;    // atomic: consecutive rows one CTA walks through, in order
    i32 chunks_per_bh;     // atomic: row chunks per (batch, head block) = ceil(S / rows_per_chunk)
    i32 chunk_base;        // atomic: chunk of blockIdx.x == 0; deterministic: first row of the wave
    i32 deterministic;     // 1: per-slot contributions stored; 0: f32 atomics into dkv
    i32 all_rows_nonempty; // 1: the caller promises every row has a valid slot
    float sm_scale;
    i32 rows_desc;         // bwd_sm90.cu: 1: launch row v (= chunk_base + blockIdx.x) is row B*S - 1 - v (sa::launch_row)
};
DSV4_PARAMS_SIZE(SparseAttnBwdParams, 296);

// bwd_reduce.cu: deterministic mode's inverted index of one wave of rows [row_base,
// row_base + n_rows) (B*S indices) and the fixed-order sum of its contributions. An entry
// is local * T + t (row row_base + local, slot t); G = B*K global keys g = b*K + k.
// The rows are split into n_rb blocks of rows_per_rb consecutive rows; per (block, key):
//   counts  (sparse_attn_inv_count)    valid slots of the block holding the key
//   scan    (sparse_attn_inv_scan_rb)  counts[rb][g] -> slots of g in blocks before rb;
//                                      colptr[g + 1] = slots of g in the wave
//           (sparse_attn_inv_scan_keys) colptr = exclusive prefix over g (colptr[0] = 0)
//   fill    (sparse_attn_inv_fill)     entries[colptr[g] + ...] in (row, slot) order per g
//   reduce  (sparse_attn_inv_reduce)   acc[g] += sum over g's entries, in entry order, of
//                                      the head blocks' contributions, in head-block order
struct SparseAttnInvIndexParams {
    const void* idx;       // as SparseAttnBwdParams::idx
    const i32* row_len;    // [B*S] or null, as SparseAttnBwdParams::row_len
    i32* counts;           // [n_rb, G]: zeroed before count; per-block cursors after scan_rb
    i32* colptr;           // [G + 1]
    i32* entries;          // [n_rows * T]: entry ids grouped by key (first colptr[G] used)
    const float* contrib;  // [n_rows, T, n_hblk, D] (reduce)
    float* acc;            // [G, D] in/out f32 (reduce)
    i64 idx_sb, idx_ss, idx_st;  // idx strides of b, s, t
    i64 idx_bias;          // key = idx - b * idx_bias
    i64 G;                 // B * K
    i32 row_base, n_rows, rows_per_rb, n_rb;
    i32 S, K, T, D;
    i32 n_hblk;
    i32 idx_is_i64;
    // reduce: the wave is row blocks [rb_lo, rb_hi) of the index (counts hold each
    // block's end after fill), its contributions' entry ids start at entry_base
    i64 entry_base;
    i32 rb_lo, rb_hi;
    // rows as the main kernel numbers them (SparseAttnBwdParams::rows_desc): row_base and
    // the blocks count launch rows v, row B*S - 1 - v when rows_desc (rows_total = B*S)
    i32 rows_desc, rows_total;
    // reduce_f16, the last wave: dkv_out[g] = bf16(acc[g] + the wave's sum) for every key,
    // in natural column order (acc is not written back); null: acc[g] += the sum
    bf16* dkv_out;         // [G, D] bf16 or null
    // reduce_f16 over several waves: each entry group's running sum of key g kept between
    // waves ([G, groups, D] f32 zeroed before the first, each thread's 8 values at 8 t of its
    // group's row; null: one wave), and, with an index per wave, the entries of g taken by
    // the earlier waves ([G] i32, zeroed before the first; null: a global index, where
    // colptr tells it); last_wave: this launch is the last wave's (it takes the groups' tree)
    float* partials;
    i32* carried;
    i32 last_wave, pad_;
};
DSV4_PARAMS_SIZE(SparseAttnInvIndexParams, 192);

// bwd_reduce.cu: f32 accumulator -> bf16 gradient.
struct SparseAttnConvertParams {
    const float* src;      // [n]
    bf16* dst;             // [n] out
    i64 n;
    int permuted;          // 1: src columns permuted within groups of 16 (bwd_sm90.cu's flush layout)
    int pad_;
};
DSV4_PARAMS_SIZE(SparseAttnConvertParams, 32);

// bwd_reduce.cu: dsinks[h] = sum over rows of dsinks_part[row, h], in a fixed order.
struct SparseAttnDsinksParams {
    const float* part;     // [rows, H]
    float* dsinks;         // [H] out
    i64 rows;
    i32 H;
    i32 pad_;
};
DSV4_PARAMS_SIZE(SparseAttnDsinksParams, 32);

// plan.cu: per row, the valid keys as global b*K+k ascending (duplicates kept), then -1.
struct SparseAttnPlanParams {
    const void* idx;       // [B,S,T] i32 or i64 (any strides), entries outside [0,K) masked
    i32* indices;          // [B*S, 1, T] out
    i32* lengths;          // [B*S] out: valid slots per row
    i64 idx_sb, idx_ss, idx_st;  // idx strides of b, s, t
    i32 B, S, T, K;
    i32 sort_cap;          // power of two >= max(T, 1): the shared sort buffer, in ints
    i32 idx_is_i64;
};
DSV4_PARAMS_SIZE(SparseAttnPlanParams, 72);

// plan.cu: the nonempty rows ascending, then -1 (one CTA; a fixed-length result so the
// plan needs no host round trip).
struct SparseAttnValidRowsParams {
    const i32* lengths;    // [rows]
    i64* valid_rows;       // [rows] out
    i64 rows;
};
DSV4_PARAMS_SIZE(SparseAttnValidRowsParams, 24);

// pack.cu: a strided bf16 tensor copied into a contiguous one whose last dim is n3_dst
// wide: zero columns appended when n3_dst > n3 (inputs padded to the kernels' head dim:
// zero columns change no dot product), columns dropped when n3_dst < n3 (a padded result
// cut back to the real head dim). Also for inputs whose rows are not 16-byte aligned or
// whose last dim is strided (n3_dst == n3).
struct SparseAttnPackParams {
    const bf16* src;       // [n0, n1, n2, n3] (any strides)
    bf16* dst;             // [n0, n1, n2, n3_dst] out, contiguous
    i64 s0, s1, s2, s3;    // src strides
    i64 n0, n1, n2, n3;    // sizes of src
    i64 n3_dst;            // dst's last dim
};
DSV4_PARAMS_SIZE(SparseAttnPackParams, 88);
