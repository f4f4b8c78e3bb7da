// The producer warpgroup of the Hopper attention kernels (fwd_sm90.cu, bwd_sm90.cu): the
// 64-head tiles of a query row (Q, dO) by cp.async, L2 prefetches of the next row, and
// (the backward) the row's slots gathered a pair of 32-key blocks at a time into SW128
// column halves, each with a "ready" mbarrier (this warpgroup's 128 threads' copies
// landed), a "keys" one (the pair's slot keys stored) and a "free" one (the consumer that
// reads it last arrives).
#pragma once

#include "common.cuh"
#include "hopper.cuh"
#include "sparse_attention/tile.cuh"

namespace dsv4 {
namespace sa90 {

// The producer thread's hand-off of its copies (and stores) since the last one to `bar`
// (count: the producer's 128 threads): one asynchronous arrival (.noinc) that fires when
// this thread's cp.async copies have landed.
__device__ __forceinline__ void producer_handoff(u64* bar) { hopper::mbar_arrive_after_cp_async(bar); }

// What a consumer does after its wait on a "ready" barrier, before wgmma reads the data:
// the cp.async writes were generic-proxy writes, wgmma reads through the async proxy.
__device__ __forceinline__ void consumer_after_ready() { hopper::fence_proxy_async(); }

// 2^x for the softmax: ex2.approx.ftz (exp2f adds range fix-ups for results below 2^-126;
// here they flush to zero, where P <= 1 and the row sum >= 1).
__device__ __forceinline__ float exp2_p(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// One 16-byte K/V gather copy; `valid == false` zero-fills.
__device__ __forceinline__ void kv_copy16(u32 dst, const void* src, bool valid) { hopper::cp_async16_to(dst, src, valid); }
// The same with an L2 cache policy (createpolicy): evict_last for gathers that share L2
// with streamed outputs (the forward's out, the deterministic backward's contributions).
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
// 64-bit multiply a copy). UNROLL copies in flight per step (the backward, which loads two
// tiles back to back, spills its 40 registers beyond 2).
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

// The K/V copies of the backward's gather: with an L2 evict_last policy (EVICT_LAST: the
// deterministic mode, whose 16-bit contribution rows stream out through L2) or none.
template <bool EVICT_LAST>
__device__ __forceinline__ void bwd_kv_copy16(u32 dst, const void* src, bool valid, u64 policy) {
    if constexpr (EVICT_LAST) {
        kv_copy16_policy(dst, src, valid, policy);
    } else {
        kv_copy16(dst, src, valid);
    }
}

// bwd_sm90.cu's gather: the row's pairs (64 slots each, pair p = slots
// 64 p ..) gathered into one [64 x 512] SW128 tile at `kv_base` (64-column group gg at
// + gg * GROUP_BYTES, row r at + 128 r) in two column halves, half hh = groups 4 hh .. 4 hh
// + 3: refilled once `free_bar[hh]` fires (consumer hh's dq products, the last reads of
// that half) and handed off on `ready_bar[hh]`, so the next pair's columns 0-255 go in
// as soon as consumer 0 is done with them and its first products start before columns
// 256-511 land. The pair's keys go to `keys_s[64]` after both halves' copies (consumer 1
// reads them until its dq products), published on `keys_bar[0]` (slots 0-31) and [1]
// (32-63), each with count kKeyWriters (the threads with j = 0). Slot keys are read 1024 at
// a time into `row_keys` ([1024] i32, only the producer reads it; named barrier 5 syncs the
// producer's 128 threads); masked rows are zero-filled. Thread t copies chunk j = t % 8 of
// rows t / 8 + 16 i (i < 4) in every group.
template <int GROUP_BYTES, bool EVICT_LAST>
__device__ __forceinline__ void gather_pair_halves(const SlotSource& src, int n_pairs, u32 kv_base, int* keys_s, int* row_keys, u64* ready_bar, u64* keys_bar, u64* free_bar, int wtid) {
    const int j = wtid % 8, r_base = wtid / 8;
    [[maybe_unused]] u64 kv_policy = 0;
    if constexpr (EVICT_LAST) asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;\n" : "=l"(kv_policy));
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
                    bwd_kv_copy16<EVICT_LAST>(kv_base + gg * GROUP_BYTES + hopper::sw128(r, j), keys[i] >= 0 ? rows[i] + gg * 64 : rows[i], keys[i] >= 0, kv_policy);
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
