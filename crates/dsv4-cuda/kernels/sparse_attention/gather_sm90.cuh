// The producer warpgroup of the Hopper attention kernels (fwd_sm90.cu, bwd_sm90.cu): the
// 64-head tiles of a query row (Q, dO) and the row's slots gathered in blocks of 32 keys
// into a ring of SW128 buffers, each buffer with a "ready" mbarrier (this warpgroup's 128
// threads' copies landed), a "keys" one (the block's slot keys stored) and a "free" one
// (the consumers arrive).
#pragma once

#include "common.cuh"
#include "hopper.cuh"
#include "sparse_attention/tile.cuh"

// Variants timed through DSV4_EXTRA_DEFINES (docs/perf.md v6; defaults are production):
// DSV4_SA90_HANDOFF, how the producer's cp.async data reaches the consumers' wgmma (which
// reads shared memory through the async proxy):
//   0 (default): one asynchronous arrival per producer thread (.noinc); each consumer
//     issues fence.proxy.async after its wait.
//   1: DIAGNOSTIC ONLY, no proxy fence anywhere (not valid by the PTX memory model; it
//     measures what the consumers' fences cost).
//   2: the producer waits for its own copies, fences and arrives (a plain arrival: its
//     stores are released too); the consumers do not fence. Copies of one hand-off are no
//     longer in flight while the producer issues the next.
// DSV4_SA90_L2_PREFETCH=1: the K/V gathers ask L2 to fetch the 256-byte segment around
// each 16-byte copy (.L2::256B; a kv row is 1 KiB, copied by 8 threads x 16 bytes a group).
// DSV4_SA90_L2_POLICY=1: L2 cache hints, evict_last on the K/V gathers (rows shared by many
// queries: keep them in L2) and evict_first on the Q / dO tiles (read once), so the streamed
// tiles do not push the gathered rows out and the refill of a freed buffer half hits L2.
// DSV4_SA90_FAST_EXP2=1: the consumers' exp2 is ex2.approx.ftz (exp2f adds range fix-ups
// for results below 2^-126; flushed to zero instead, where P <= 1 and the row sum >= 1).
#ifndef DSV4_SA90_HANDOFF
#define DSV4_SA90_HANDOFF 0
#endif
#ifndef DSV4_SA90_L2_PREFETCH
#define DSV4_SA90_L2_PREFETCH 0
#endif
#ifndef DSV4_SA90_FAST_EXP2
#define DSV4_SA90_FAST_EXP2 0
#endif
#ifndef DSV4_SA90_L2_POLICY
#define DSV4_SA90_L2_POLICY 0
#endif

namespace dsv4 {
namespace sa90 {

// The producer thread's hand-off of its copies (and stores) since the last one to `bar`
// (count: the producer's 128 threads).
__device__ __forceinline__ void producer_handoff(u64* bar) {
#if DSV4_SA90_HANDOFF == 2
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    hopper::fence_proxy_async();
    hopper::mbar_arrive(bar);
#else
    hopper::mbar_arrive_after_cp_async(bar);
#endif
}

// What a consumer does after its wait on a "ready" barrier, before wgmma reads the data.
__device__ __forceinline__ void consumer_after_ready() {
#if DSV4_SA90_HANDOFF == 0
    hopper::fence_proxy_async();
#endif
}

// 2^x for the softmax (see DSV4_SA90_FAST_EXP2).
__device__ __forceinline__ float exp2_p(float x) {
#if DSV4_SA90_FAST_EXP2
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
#else
    return exp2f(x);
#endif
}

#if DSV4_SA90_L2_POLICY
// An L2 eviction-priority policy (not volatile: the compiler may hoist and share it).
__device__ __forceinline__ u64 l2_evict_last() {
    u64 pol;
    asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;\n" : "=l"(pol));
    return pol;
}
__device__ __forceinline__ u64 l2_evict_first() {
    u64 pol;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(pol));
    return pol;
}
#endif

// One 16-byte K/V gather copy (see DSV4_SA90_L2_PREFETCH, DSV4_SA90_L2_POLICY);
// `valid == false` zero-fills.
__device__ __forceinline__ void kv_copy16(u32 dst, const void* src, bool valid) {
#if DSV4_SA90_L2_POLICY && DSV4_SA90_L2_PREFETCH
    asm volatile("cp.async.cg.shared.global.L2::cache_hint.L2::256B [%0], [%1], 16, %2, %3;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0), "l"(l2_evict_last()) : "memory");
#elif DSV4_SA90_L2_POLICY
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0), "l"(l2_evict_last()) : "memory");
#elif DSV4_SA90_L2_PREFETCH
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0) : "memory");
#else
    hopper::cp_async16_to(dst, src, valid);
#endif
}

// One 16-byte copy of a Q / dO head tile (see DSV4_SA90_L2_POLICY).
__device__ __forceinline__ void tile_copy16(u32 dst, const void* src, bool valid) {
#if DSV4_SA90_L2_POLICY
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0), "l"(l2_evict_first()) : "memory");
#else
    hopper::cp_async16_to(dst, src, valid);
#endif
}

constexpr int kBN = 32;                 // slots per block
constexpr int kChunk = 1024;            // slot keys read per index pass
constexpr int kGroupBytes = kBN * 128;  // one SW128 group (64 columns) of a block
constexpr int kBlockBytes = 8 * kGroupBytes;  // [32 x 512] bf16
constexpr int kTileGroupBytes = 64 * 128;     // one SW128 group of a 64-row head tile
constexpr int kKeyWriters = 16;               // producer threads that store a block's keys

// A [64 heads x 512] bf16 tile of one query row into SW128 groups at `base`: rows h0 + r
// of `row` (head stride `sh`); heads >= H are zero rows (`any`: a mapped address never read).
// Consecutive threads take consecutive 16-byte chunks; UNROLL copies in flight per step (the
// backward, which loads two tiles back to back, spills its 40 registers beyond 2).
template <int UNROLL>
__device__ __forceinline__ void load_head_tile(u32 base, const bf16* row, i64 sh, const bf16* any, int h0, int H, int wtid) {
#pragma unroll UNROLL
    for (int i = 0; i < 32; ++i) {
        const int id = wtid + i * 128;
        const int r = id / 64, c = id % 64;
        const bool ok = h0 + r < H;
        tile_copy16(base + (c / 8) * kTileGroupBytes + hopper::sw128(r, c % 8), ok ? row + (h0 + r) * sh + c * 8 : any, ok);
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

// Gather blocks 0 .. n_blocks - 1 of the row into the ring of NBUF buffers at `kv_base`:
// block blk goes to buffer blk % NBUF once that buffer's previous block is freed. Slot keys
// are read 1024 at a time (all of a chunk's index loads in flight at once) into `row_keys`
// ([1024] i32, only the producer reads it); each block's keys also go to `keys_s[buf][32]`
// (-1: masked) for the consumers' masks, published by `keys_bar[buf]` (count kKeyWriters:
// the threads with j = 0). Thread t copies chunk j = t % 8 of rows t / 8 and t / 8 + 16 in
// every group; masked rows are zero-filled. Named barrier 5 syncs the producer's 128
// threads.
template <int NBUF>
__device__ __forceinline__ void gather_blocks(const SlotSource& src, int n_blocks, u32 kv_base, int* keys_s, int* row_keys, u64* ready_bar, u64* keys_bar, u64* free_bar, int wtid) {
    const int j = wtid % 8, r_base = wtid / 8;
    for (int blk = 0; blk < n_blocks; ++blk) {
        const int slot0 = blk * kBN;
        if (slot0 % kChunk == 0) {
            if (slot0 > 0) hopper::named_sync(5, 128);  // every producer thread is done with the last chunk
            int k[kChunk / 128];
#pragma unroll
            for (int i = 0; i < kChunk / 128; ++i) k[i] = sa::slot_key(src.idx, src.idx_row, src.idx_st, src.idx_is_i64, src.bias, src.n_slots, src.K, slot0 + wtid + 128 * i, false);
#pragma unroll
            for (int i = 0; i < kChunk / 128; ++i) row_keys[wtid + 128 * i] = k[i];
            hopper::named_sync(5, 128);
        }
        const int keys[2] = {row_keys[slot0 % kChunk + r_base], row_keys[slot0 % kChunk + r_base + 16]};
        const int buf = blk % NBUF;
        if (blk >= NBUF) hopper::mbar_wait(free_bar + buf, ((blk / NBUF) - 1) & 1);
        if (j == 0) {
            keys_s[buf * kBN + r_base] = keys[0];
            keys_s[buf * kBN + r_base + 16] = keys[1];
            hopper::mbar_arrive(keys_bar + buf);
        }
        const u32 dst = kv_base + buf * kBlockBytes;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int r = r_base + 16 * i;
            const int key = keys[i];
            const bf16* row = key >= 0 ? src.kv_b + static_cast<i64>(key) * src.kv_sk + j * 8 : src.kv;
#pragma unroll
            for (int gg = 0; gg < 8; ++gg) kv_copy16(dst + gg * kGroupBytes + hopper::sw128(r, j), key >= 0 ? row + gg * 64 : row, key >= 0);
        }
        producer_handoff(ready_bar + buf);
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
}

}  // namespace sa90
}  // namespace dsv4
