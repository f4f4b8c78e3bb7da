// The producer warpgroup of the Hopper attention kernels (fwd_sm90.cu, bwd_sm90.cu): the
// 64-head tiles of a query row (Q, dO) and the row's slots gathered in blocks of 32 keys
// into a ring of SW128 buffers, each buffer with a "ready" mbarrier (this warpgroup's 128
// threads' copies landed), a "keys" one (the block's slot keys stored) and a "free" one
// (the consumers arrive).
#pragma once

#include "common.cuh"
#include "hopper.cuh"
#include "sparse_attention/tile.cuh"

// Backward diagnostics for the bench only (results are wrong; default 0, bwd_sm90.cu):
// DSV4_SA90_BWD_DIAG=1 gather_blocks issues no K/V copies; =2 the consumers issue no
// wgmma; =3 no dkv reductions or stores (atomic: the flush's arithmetic stays; the 16-bit
// deterministic flush: the compiler drops it, and with it the dKV products of 7 of the 8
// chunks, whose accumulators are then dead: 144 HGMMA instead of 200, so not a measure of
// the flush alone); =4 no reductions or stores, with the flush's arithmetic and every
// product kept (the stores' predicates false at run time); =5 / =6 the 16-bit flush
// without its scale stores / without its value stores; =7 each chunk's flush replaced by a
// sum of its accumulators (products kept, the flush's arithmetic and memory gone); =8
// (the atomic kernel, SA90_BWD_ATOMIC) the flush's reductions as plain `st.global.v4` to
// the same addresses: L2 writes of the same bytes and shape without the reduction; =9 the
// consumers as =7 (no flush) while the producer warpgroup issues the same reductions (of
// zeros, 4 key rows x 128 B a warp instruction) into the dkv rows of each block's keys once
// the consumers free its buffer (when their dKV products of it begin; after the next
// block's copies are issued): the time a flush taken off the consumers' instruction
// stream could reach (a bench of one 1024-slot chunk of keys a row: T <= 1024). Each
// against the default says what that part costs.
#ifndef DSV4_SA90_BWD_DIAG
#define DSV4_SA90_BWD_DIAG 0
#endif

namespace dsv4 {
namespace sa90 {

// The producer thread's hand-off of its copies (and stores) since the last one to `bar`
// (count: the producer's 128 threads): one asynchronous arrival (.noinc) that fires when
// this thread's cp.async copies have landed. (Timed against the producer waiting for its
// copies, fencing and arriving: 1-2 % slower, docs/perf/LOG.md v7.)
__device__ __forceinline__ void producer_handoff(u64* bar) { hopper::mbar_arrive_after_cp_async(bar); }

// What a consumer does after its wait on a "ready" barrier, before wgmma reads the data:
// the cp.async writes were generic-proxy writes, wgmma reads through the async proxy.
__device__ __forceinline__ void consumer_after_ready() { hopper::fence_proxy_async(); }

// 2^x for the softmax: ex2.approx.ftz (exp2f adds range fix-ups for results below 2^-126;
// here they flush to zero, where P <= 1 and the row sum >= 1). 1.3 % faster forward (v7).
__device__ __forceinline__ float exp2_p(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// One 16-byte K/V gather copy; `valid == false` zero-fills. (L2 hints alone, evict_last on
// the gathered rows or .L2::256B prefetch, were timed: no change, docs/perf/LOG.md v7 and v18;
// the forward pairs evict_last with streaming output stores, kv_copy16_policy below.)
__device__ __forceinline__ void kv_copy16(u32 dst, const void* src, bool valid) { hopper::cp_async16_to(dst, src, valid); }
// The same with an L2 cache policy (createpolicy): the forward's gathers as evict_last,
// which pays together with its streaming output stores (docs/perf/LOG.md v18).
__device__ __forceinline__ void kv_copy16_policy(u32 dst, const void* src, bool valid, u64 policy) { hopper::cp_async16_to(dst, src, valid, policy); }

// Bring the 128-byte line holding `p` (global memory) into L2; no result, no ordering.
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p)); }

// One 16-byte copy of a Q / dO head tile.
__device__ __forceinline__ void tile_copy16(u32 dst, const void* src, bool valid) { hopper::cp_async16_to(dst, src, valid); }

constexpr int kBN = 32;                 // slots per block
constexpr int kChunk = 1024;            // slot keys read per index pass
constexpr int kGroupBytes = kBN * 128;  // one SW128 group (64 columns) of a block
constexpr int kBlockBytes = 8 * kGroupBytes;  // [32 x 512] bf16
constexpr int kTileGroupBytes = 64 * 128;     // one SW128 group of a 64-row head tile
constexpr int kKeyWriters = 16;               // producer threads that store a block's keys

// L2 prefetch of a [64 heads x 512] bf16 tile of one query row (heads h0 + r < H, head
// stride `sh`, 8 lines a head) by the producer's 128 threads.
__device__ __forceinline__ void prefetch_head_tile(const bf16* row, i64 sh, int h0, int H, int wtid) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int id = wtid + 128 * i, h = id / 8;
        if (h0 + h < H) prefetch_l2(row + (h0 + h) * sh + (id % 8) * 64);
    }
}

// L2 prefetch of a row's first 1024 slot keys (a line per 32 i32 / 16 i64 slots, read as
// slot_key does at element offset `off`, stride `st`) and of its plan length.
__device__ __forceinline__ void prefetch_slot_keys(const void* idx, i64 off, i64 st, i32 is_i64, int T, const i32* row_len, i64 row, int wtid) {
    const int t = wtid * (is_i64 ? 16 : 32);
    if (t < min(T, kChunk)) prefetch_l2(static_cast<const char*>(idx) + ((off + t * st) << (is_i64 ? 3 : 2)));
    if (wtid == 0 && row_len) prefetch_l2(row_len + row);
}

// A [64 heads x 512] bf16 tile of one query row into SW128 groups at `base`: rows h0 + r
// of `row` (head stride `sh`); heads >= H are zero rows (`any`: a mapped address never read).
// Thread t copies 16-byte chunk c = t % 64 of rows t / 64 + 2 i (i < 32): consecutive
// threads take consecutive chunks, and a thread's source advances by two heads a copy (no
// 64-bit multiply a copy: the v12 trace measured ~2,700 cycles to issue this tile when
// each copy recomputed its address). UNROLL copies in flight per step (the backward, which
// loads two tiles back to back, spills its 40 registers beyond 2).
template <int UNROLL>
__device__ __forceinline__ void load_head_tile(u32 base, const bf16* row, i64 sh, const bf16* any, int h0, int H, int wtid) {
    const int c = wtid % 64, r0 = wtid / 64;
    const u32 dst = base + (c / 8) * kTileGroupBytes;
    const bf16* src = row + (h0 + r0) * sh + c * 8;
#pragma unroll UNROLL
    for (int i = 0; i < 32; ++i) {
        const int r = r0 + 2 * i;
        const bool ok = h0 + r < H;
        tile_copy16(dst + hopper::sw128(r, c % 8), ok ? src : any, ok);
        src += 2 * sh;
    }
}

// What the gather reads: the row's slots (as slot_key decodes them) and the kv rows.
struct SlotSource {
    const void* idx;
    i64 idx_row, idx_st, bias;
    i32 idx_is_i64, n_slots, K;
    const bf16* kv_b;  // kv of the row's batch
    const bf16* kv;    // a mapped address for masked rows (never read)
    i64 kv_sk;
};

// The slot keys of chunk [slot0, slot0 + 1024) into `row_keys` (all of its index loads in
// flight at once); named barrier 5 syncs the producer's 128 threads before (the last
// chunk is done with) and after.
__device__ __forceinline__ void load_key_chunk(const SlotSource& src, int slot0, int* row_keys, int wtid) {
    if (slot0 > 0) hopper::named_sync(5, 128);
    int k[kChunk / 128];
#pragma unroll
    for (int i = 0; i < kChunk / 128; ++i) k[i] = sa::slot_key(src.idx, src.idx_row, src.idx_st, src.idx_is_i64, src.bias, src.n_slots, src.K, slot0 + wtid + 128 * i, false);
#pragma unroll
    for (int i = 0; i < kChunk / 128; ++i) row_keys[wtid + 128 * i] = k[i];
    hopper::named_sync(5, 128);
}

// Gather blocks 0 .. n_blocks - 1 of the row into the ring of NBUF buffers at `kv_base`:
// block blk goes to buffer blk % NBUF once that buffer's previous block is freed. Slot keys
// are read 1024 at a time (all of a chunk's index loads in flight at once) into `row_keys`
// ([1024] i32, only the producer reads it); each block's keys also go to `keys_s[buf][32]`
// (-1: masked) for the consumers' masks, published by `keys_bar[buf]` (count kKeyWriters:
// the threads with j = 0). Thread t copies chunk j = t % 8 of rows t / 8 and t / 8 + 16 in
// every group; masked rows are zero-filled. Named barrier 5 syncs the producer's 128
// threads.
// SA90_BWD_KV_EVICT_LAST=1: the K/V copies carry an L2 evict_last policy (bwd_sm90.cu sets
// it for its deterministic mode, against the 16-bit rows it streams out); 0: none.
#ifndef SA90_BWD_KV_EVICT_LAST
#define SA90_BWD_KV_EVICT_LAST 0
#endif
__device__ __forceinline__ void bwd_kv_copy16(u32 dst, const void* src, bool valid, u64 policy) {
    if constexpr (SA90_BWD_KV_EVICT_LAST != 0) {
        kv_copy16_policy(dst, src, valid, policy);
    } else {
        kv_copy16(dst, src, valid);
    }
}
// DSV4_SA90_BWD_DIAG=9: zeros added by this warpgroup into the D = 512 f32 rows of `dkv_b`
// ([K, 512], the row's batch) of the 32 keys of a block (-1: none): warp w the keys 8 w ..
// 8 w + 7, each instruction 4 keys x 128 B.
__device__ __forceinline__ void diag_reduce_block(float* dkv_b, const int* keys, int wtid) {
    const int w = wtid / 32, l = wtid % 32;
#pragma unroll 1
    for (int q = 0; q < 2; ++q) {
        const int key = keys[8 * w + 4 * q + l / 8];
        float* const row = dkv_b + static_cast<i64>(max(key, 0)) * 512 + (l % 8) * 4;
#pragma unroll 4
        for (int h = 0; h < 16; ++h)
            asm volatile("{\n.reg .pred q;\nsetp.ge.s32 q, %1, 0;\n@q red.relaxed.gpu.global.add.v4.f32 [%0], {%2, %2, %2, %2};\n}\n" ::"l"(row + 32 * h), "r"(key), "f"(0.0f) : "memory");
    }
}

// Block blk's rows go to buffer buf = blk % NBUF at kv_base + buf * BUF_BYTES, its 64-column
// group gg at + gg * GROUP_BYTES (bwd_sm90.cu: the two blocks of a pair interleaved as one
// [64 x 512] tile, BUF_BYTES = 32 rows x 128 B, GROUP_BYTES = 64 rows x 128 B).
template <int NBUF, int BUF_BYTES, int GROUP_BYTES>
__device__ __forceinline__ void gather_blocks(const SlotSource& src, int n_blocks, u32 kv_base, int* keys_s, int* row_keys, u64* ready_bar, u64* keys_bar, u64* free_bar, int wtid, [[maybe_unused]] float* diag_dkv = nullptr) {
    const int j = wtid % 8, r_base = wtid / 8;
    [[maybe_unused]] u64 kv_policy = 0;
    if constexpr (SA90_BWD_KV_EVICT_LAST != 0) asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;\n" : "=l"(kv_policy));
    for (int blk = 0; blk < n_blocks; ++blk) {
        const int slot0 = blk * kBN;
        if (slot0 % kChunk == 0) load_key_chunk(src, slot0, row_keys, wtid);
        const int keys[2] = {row_keys[slot0 % kChunk + r_base], row_keys[slot0 % kChunk + r_base + 16]};
        const int buf = blk % NBUF;
        // The source rows before the "free" wait (pinned there: ptxas would sink them past
        // it), the block's keys for the consumers' masks after the copies: only the copies
        // follow the wait (v28, H200: atomic -0.6 to -2.1 % against both after it).
        const bf16* rows[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            rows[i] = keys[i] >= 0 ? src.kv_b + static_cast<i64>(keys[i]) * src.kv_sk + j * 8 : src.kv;
            asm volatile("" : "+l"(rows[i]));
        }
        if (blk >= NBUF) hopper::mbar_wait(free_bar + buf, ((blk / NBUF) - 1) & 1);
        const u32 dst = kv_base + buf * BUF_BYTES;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int r = r_base + 16 * i;
            const int key = keys[i];
#pragma unroll
            for (int gg = 0; gg < 8; ++gg)
                if constexpr (DSV4_SA90_BWD_DIAG != 1) bwd_kv_copy16(dst + gg * GROUP_BYTES + hopper::sw128(r, j), key >= 0 ? rows[i] + gg * 64 : rows[i], key >= 0, kv_policy);
        }
        producer_handoff(ready_bar + buf);
        if (j == 0) {
            keys_s[buf * kBN + r_base] = keys[0];
            keys_s[buf * kBN + r_base + 16] = keys[1];
            hopper::mbar_arrive(keys_bar + buf);
        }
        if constexpr (DSV4_SA90_BWD_DIAG == 9) {
            // (after this block's copies are issued, so that they do not wait for these)
            if (blk >= NBUF) diag_reduce_block(diag_dkv, row_keys + ((blk - NBUF) * kBN) % kChunk, wtid);
        }
    }
    if constexpr (DSV4_SA90_BWD_DIAG == 9) {
        for (int blk = max(n_blocks - NBUF, 0); blk < n_blocks; ++blk) {
            hopper::mbar_wait(free_bar + blk % NBUF, (blk / NBUF) & 1);
            diag_reduce_block(diag_dkv, row_keys + (blk * kBN) % kChunk, wtid);
        }
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
}

// bwd_sm90.cu with SA90_BWD_COL_HALVES=1: the row's pairs (64 slots each, pair p = slots
// 64 p ..) gathered into one [64 x 512] SW128 tile at `kv_base` (64-column group gg at
// + gg * GROUP_BYTES, row r at + 128 r) in two column halves, half hh = groups 4 hh .. 4 hh
// + 3: refilled once `free_bar[hh]` fires (consumer hh's dq products, the last reads of
// that half) and handed off on `ready_bar[hh]`, so the next pair's columns 0-255 go in
// as soon as consumer 0 is done with them and its first products start before columns
// 256-511 land. The pair's keys go to `keys_s[64]` after both halves' copies (consumer 1
// reads them until its dq products), published on `keys_bar[0]` (slots 0-31) and [1]
// (32-63). Thread t copies chunk j = t % 8 of rows t / 8 + 16 i (i < 4) in every group.
template <int GROUP_BYTES>
__device__ __forceinline__ void gather_pair_halves(const SlotSource& src, int n_pairs, u32 kv_base, int* keys_s, int* row_keys, u64* ready_bar, u64* keys_bar, u64* free_bar, int wtid) {
    const int j = wtid % 8, r_base = wtid / 8;
    [[maybe_unused]] u64 kv_policy = 0;
    if constexpr (SA90_BWD_KV_EVICT_LAST != 0) asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;\n" : "=l"(kv_policy));
    for (int pr = 0; pr < n_pairs; ++pr) {
        const int slot0 = pr * 2 * kBN;
        if (slot0 % kChunk == 0) load_key_chunk(src, slot0, row_keys, wtid);
        int keys[4];
        const bf16* rows[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            keys[i] = row_keys[slot0 % kChunk + r_base + 16 * i];
            rows[i] = keys[i] >= 0 ? src.kv_b + static_cast<i64>(keys[i]) * src.kv_sk + j * 8 : src.kv;
            asm volatile("" : "+l"(rows[i]));
        }
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            if (pr > 0) hopper::mbar_wait(free_bar + hh, (pr - 1) & 1);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int r = r_base + 16 * i;
#pragma unroll
                for (int g = 0; g < 4; ++g) {
                    const int gg = 4 * hh + g;
                    if constexpr (DSV4_SA90_BWD_DIAG != 1) bwd_kv_copy16(kv_base + gg * GROUP_BYTES + hopper::sw128(r, j), keys[i] >= 0 ? rows[i] + gg * 64 : rows[i], keys[i] >= 0, kv_policy);
                }
            }
            producer_handoff(ready_bar + hh);
        }
        if (j == 0) {
#pragma unroll
            for (int i = 0; i < 4; ++i) keys_s[r_base + 16 * i] = keys[i];
            hopper::mbar_arrive(keys_bar + 0);
            hopper::mbar_arrive(keys_bar + 1);
        }
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
}

}  // namespace sa90
}  // namespace dsv4
