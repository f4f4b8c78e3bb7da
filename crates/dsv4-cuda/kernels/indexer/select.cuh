// Block-wide exact top-k of one row of f32 scores (SPEC.md section 3), shared by the
// top-k kernel (topk.cu, rows in global memory or cached in shared memory) and the fused
// scores + top-k kernel (scores.cu with IDX_FUSED=1, rows in shared memory):
//
//  1. key(x) = an order-preserving u32 of x (finite only; -0 is +0, non-finite is 0 and
//     never selected).
//  2. Radix select, 8 bits a pass from the top: a 256-bin histogram of the keys that
//     share the prefix found so far (first pass: warp-aggregated adds, as most keys share
//     a few top bytes), a suffix scan, and the bin where the count from the
//     top reaches the remaining rank. After 4 passes the threshold T is the K-th largest
//     key and `need` says how many keys equal to T are taken. Early ends ("take all"):
//     the row holds at most K finite keys (all of them are taken), or the selected bin
//     is taken whole (its count equals the remaining rank: exactly K keys are >= the
//     prefix; with continuous scores this usually ends after the third pass). A row of at
//     most K keys (the fused top-k's early queries) skips the passes: all its finite keys
//     are taken, counted by the gather of step 3.
//  3. Keys > T (fewer than K) are gathered as (key << 32 | ~index) (one shared atomic per
//     warp) and bitonic-sorted descending: score descending, index ascending. When the
//     keys == T fit in the sort buffer too (the usual case: few exact ties), they are
//     gathered and sorted with them: their order is index ascending, so the first `need`
//     of them are the ones step 4 would take. "Take all" gathers the keys >= the prefix.
//     The sort (the flip form of the bitonic network: every comparison keeps the larger
//     entry at the lower position) works on 128-entry blocks, one warp a block, four
//     consecutive entries a lane: stages of compare distance <= 64 run in registers
//     (distances 1 and 2 within a lane, the others by shuffles), only the wider ones (3 of
//     the 45 stages of a 512-entry sort) go through shared memory with block barriers.
//  4. Otherwise keys == T are taken in index order (a block-wide ordered scan) right
//     after the sorted ones until `need` are placed. The rest of the row is (-1, -inf).
// Every output slot is written exactly once; the result does not depend on scheduling.
#pragma once

#include "common.cuh"

namespace dsv4 {
namespace indexer {

// Order-preserving key of a finite score; 0 for -inf, +inf and NaN (never selected).
__device__ __forceinline__ u32 score_key(float x) {
    if (!isfinite(x)) return 0u;
    const u32 u = x == 0.0f ? 0u : __float_as_uint(x);  // -0 and +0 tie, like the reference
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);  // -FLT_MAX -> 0x00800000 > 0
}

constexpr int SELECT_BINS = 256;

// Shared scratch of one selection (2304 bytes), besides the sort buffer.
struct SelectSmem {
    u32 hist[SELECT_BINS];
    u32 spare[SELECT_BINS];   // unused (keeps the size the launchers mirror)
    u32 misc[32];             // [0] selected bin, [1] remaining rank, [2] gathered count, [3] keys in the selected bin, [4] keys counted
    u32 warp_sums[32];
};
static_assert(sizeof(SelectSmem) == 2304, "mirrored by the launchers");

// One radix pass's decision, by warp 0 (lane l owns bins [8l, 8l+8)): the counts from the
// top (suffix sums of hist[]) and the bin where they reach `remaining`: misc[0] = the
// bin, misc[1] = the rank left inside it, misc[3] = its keys; misc[4] = all keys counted.
// hist[] is zeroed on the way for the next pass. Ends with a barrier.
__device__ __forceinline__ void select_scan_pick(SelectSmem& sm, u32 remaining) {
    const int tid = threadIdx.x;
    if (tid < 32) {
        u32 h[8], own = 0;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            h[j] = sm.hist[tid * 8 + j];
            own += h[j];
        }
        u32 incl = own;  // sum over lanes >= tid
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const u32 y = __shfl_down_sync(DSV4_FULL_MASK, incl, o);
            if (tid + o < 32) incl += y;
        }
        u32 run = incl - own;  // keys in the bins above this lane's
#pragma unroll
        for (int j = 7; j >= 0; --j) {
            const u32 above = run;
            run += h[j];
            if (above < remaining && run >= remaining) {  // exactly one bin when remaining <= the total
                sm.misc[0] = static_cast<u32>(tid * 8 + j);
                sm.misc[1] = remaining - above;
                sm.misc[3] = h[j];
            }
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) sm.hist[tid * 8 + j] = 0;
        if (tid == 0) sm.misc[4] = incl;
    }
    __syncthreads();
}

// The sort's blocks: SORT_E entries a lane, a warp's block of SORT_BLOCK entries held in
// registers in the blocked layout, entry e = base + SORT_E * lane + j in v[j].
constexpr int SORT_E = 4;
constexpr int SORT_BLOCK = 32 * SORT_E;

// One stage of the flip form of the bitonic network on a warp's block in registers: entry e
// is compared with entry e ^ d and the lower position keeps the larger (every stage sorts
// the same way, descending). d = size - 1 is a merge's first stage (the mirror), d = stride
// the half-cleaners after it. d < SORT_E pairs a lane's own entries; a larger d pairs lane
// l with lane l ^ (d / SORT_E), entry j with entry j ^ (d % SORT_E).
__device__ __forceinline__ void sort_stage(u64 (&v)[SORT_E], int d, int lane) {
    if (d < SORT_E) {
#pragma unroll
        for (int j = 0; j < SORT_E; ++j) {
            const int k = j ^ d;
            if (j < k) {
                const u64 x = v[j], y = v[k];
                const bool sw = x < y;
                v[j] = sw ? y : x;
                v[k] = sw ? x : y;
            }
        }
    } else {
        int hb = d;  // the highest bit of d: where e and its partner first differ
        while (hb & (hb - 1)) hb &= hb - 1;
        const bool is_lo = (lane & (hb / SORT_E)) == 0;
        const int m = d / SORT_E, jx = d % SORT_E;
        u64 nv[SORT_E];
#pragma unroll
        for (int j = 0; j < SORT_E; ++j) {
            const u64 y = __shfl_xor_sync(DSV4_FULL_MASK, v[j ^ jx], m);  // the partner's entry j ^ jx
            nv[j] = (v[j] > y) == is_lo ? v[j] : y;
        }
#pragma unroll
        for (int j = 0; j < SORT_E; ++j) v[j] = nv[j];
    }
}

// The first radix pass's count for a quad of keys (called by every lane of a warp): the top
// byte (sign and high exponent bits) puts most of a row in a few bins, so the lanes of the
// warp that share a bin add once, by their lowest lane. Keys 0 (non-finite) are not counted.
__device__ __forceinline__ void count_top_bytes(SelectSmem& sm, uint4 k4, int lane) {
    const u32 ks[4] = {k4.x, k4.y, k4.z, k4.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const u32 bin = ks[j] != 0u ? (ks[j] >> 24) : SELECT_BINS;  // SELECT_BINS = none
        const u32 peers = __match_any_sync(DSV4_FULL_MASK, bin);
        if (bin < SELECT_BINS && lane == __ffs(peers) - 1) atomicAdd(&sm.hist[bin], static_cast<u32>(__popc(peers)));
    }
}

// Keys i = 4q .. 4q + 3 of a row from `key_at` (0 past P): the `key4_at` of a row that has
// no cache of 16-byte aligned keys.
template <class KeyAt>
__device__ __forceinline__ uint4 key_quad(const KeyAt& key_at, int P, int q) {
    const int i = 4 * q;
    return make_uint4(i < P ? key_at(i) : 0u, i + 1 < P ? key_at(i + 1) : 0u, i + 2 < P ? key_at(i + 2) : 0u, i + 3 < P ? key_at(i + 3) : 0u);
}

// Top-K of the row `key_at(i)` / `val_at(i)`, i < P, into idx_out[0..K) / val_out[0..K).
// `key4_at(q)` gives keys 4q .. 4q + 3 at once (0 for i >= P): the passes over the row read
// a quad a thread (one 16-byte shared load where the keys are cached); `key_quad` builds it
// from `key_at`. Called by every thread of the block (NTHREADS of them); `sort` holds
// `sort_cap` (a power of two >= K) entries. Starts with a barrier (the row may have just
// been written). Keys at i >= P are never read: a caller whose row ends in non-finite
// scores (the causal -inf) may pass the finite prefix's length.
//
// `top_counted`: the caller has already counted the keys' top bytes into sm.hist (zeroed,
// then `count_top_bytes` over every quad of the row, the first radix pass; topk.cu does it
// while it caches the row), unless the row holds at most K keys (then hist is not read).
template <int NTHREADS, class KeyAt, class Key4At, class ValAt>
__device__ void select_topk_row(const KeyAt& key_at, const Key4At& key4_at, const ValAt& val_at, int P, int K, SelectSmem& sm, u64* sort, int sort_cap, int* idx_out, float* val_out, bool top_counted = false) {
    static_assert(NTHREADS % 32 == 0 && NTHREADS >= 32 && NTHREADS <= 1024, "whole warps");
    constexpr int NWARPS = NTHREADS / 32;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

    // ---- 2. radix select ----------------------------------------------------------------
    // `take_all`: every key >= `prefix` (and != 0) is taken, exactly K of them or all
    // finite ones: the row had at most K finite keys, or the selected bin is taken whole
    // (its keys all rank within K), which ends the passes early.
    // A row of at most K keys (block-uniform) takes all its finite keys without a radix
    // pass: the gather below counts them (what the first pass's total would have said).
    const bool row_fits = P <= K;
    u32 prefix = 0, mask = 0, remaining = static_cast<u32>(K), in_bin = 0;
    bool take_all = row_fits;
    int n_all = 0;
    __syncthreads();  // the row is written; the previous users of the scratch are done
    if (!row_fits && !top_counted) {
        for (int i = tid; i < SELECT_BINS; i += NTHREADS) sm.hist[i] = 0;
        __syncthreads();
    }
    const int P4 = (P + 3) / 4;  // quads of keys
    for (int shift = 24; shift >= 0 && !row_fits; shift -= 8) {
        // hist[] is zero here: cleared above, then by each pass's scan.
        if (shift == 24) {
            if (!top_counted) {  // (count_top_bytes: warp-aggregated adds of the top bytes)
                for (int start = 0; start < P4; start += NTHREADS) {  // warp-uniform trip count
                    const int q = start + tid;
                    count_top_bytes(sm, q < P4 ? key4_at(q) : make_uint4(0u, 0u, 0u, 0u), lane);
                }
            }
        } else {
            for (int q = tid; q < P4; q += NTHREADS) {
                const uint4 k4 = key4_at(q);
                const u32 ks[4] = {k4.x, k4.y, k4.z, k4.w};
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    if (ks[j] != 0u && (ks[j] & mask) == prefix) atomicAdd(&sm.hist[(ks[j] >> shift) & 0xffu], 1u);
                }
            }
        }
        __syncthreads();
        // misc is rewritten only here, after the barrier above: the previous pass's
        // readers are done.
        select_scan_pick(sm, remaining);
        if (shift == 24 && sm.misc[4] <= static_cast<u32>(K)) {  // block-uniform
            take_all = true;  // prefix = 0: every finite key
            n_all = static_cast<int>(sm.misc[4]);
            break;
        }
        prefix |= sm.misc[0] << shift;
        mask |= 0xffu << shift;
        remaining = sm.misc[1];
        in_bin = sm.misc[3];  // after the last pass: the count of keys == T
        if (remaining == in_bin) {  // block-uniform: the whole bin is taken, K keys >= prefix
            take_all = true;
            n_all = K;
            break;
        }
    }
    const u32 thr = prefix;  // take_all: the lowest key taken is >= thr; else T itself
    const int need = take_all ? 0 : static_cast<int>(remaining);
    int n_gt = take_all ? n_all : K - need;  // keys > T (or >= thr), all taken (row_fits: counted by the gather)
    // Keys == T sorted along (block-uniform) when they fit.
    const bool ties_sorted = !take_all && static_cast<i64>(n_gt) + static_cast<i64>(in_bin) <= static_cast<i64>(sort_cap);
    int n_sort = ties_sorted ? n_gt + static_cast<int>(in_bin) : n_gt;
    int n_out = ties_sorted ? n_gt + need : n_gt;  // slots filled from the sorted list

    // ---- 3. gather keys > T (and == T when they fit) and sort them (score desc, index asc)
    __syncthreads();  // everyone has read misc
    if (tid == 0) sm.misc[2] = 0;
    __syncthreads();
    const bool take_eq = take_all || ties_sorted;
    for (int start = 0; start < P4; start += NTHREADS) {  // warp-uniform trip count
        const int q = start + tid;
        const uint4 k4 = q < P4 ? key4_at(q) : make_uint4(0u, 0u, 0u, 0u);
        const u32 ks[4] = {k4.x, k4.y, k4.z, k4.w};
        bool take[4];
        u32 n_take = 0;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            take[j] = ks[j] != 0u && (take_eq ? ks[j] >= thr : ks[j] > thr);
            n_take += take[j] ? 1u : 0u;
        }
        if (__any_sync(DSV4_FULL_MASK, n_take != 0u)) {  // one shared atomic per warp
            u32 incl = n_take;  // inclusive scan of the lanes' counts
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const u32 y = __shfl_up_sync(DSV4_FULL_MASK, incl, o);
                if (lane >= o) incl += y;
            }
            u32 pos = 0;
            if (lane == 31) pos = atomicAdd(&sm.misc[2], incl);
            pos = __shfl_sync(DSV4_FULL_MASK, pos, 31) + incl - n_take;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                if (take[j]) sort[pos++] = (static_cast<u64>(ks[j]) << 32) | static_cast<u64>(0xffffffffu - static_cast<u32>(4 * q + j));
            }
        }
    }
    __syncthreads();  // the gathered entries (and their count) are visible
    if (row_fits) n_gt = n_sort = n_out = static_cast<int>(sm.misc[2]);  // every finite key (block-uniform)
    // Bitonic sort (flip form: each merge compares mirror positions first, then halves;
    // every comparison keeps the larger entry at the lower position) of n2 entries (entries
    // [n_sort, n2) are 0 and sort last), in blocks of SORT_BLOCK entries, one warp a block
    // in registers (blocked layout: the distances 1 and 2 within a lane, the others by
    // shuffles); the stages of distance >= SORT_BLOCK run in shared memory with block
    // barriers. A row of fewer than SORT_BLOCK entries is one block whose missing entries
    // are 0 in registers.
    int n2 = 1;
    while (n2 < n_sort) n2 <<= 1;
    const int nblk = n2 < SORT_BLOCK ? 1 : n2 / SORT_BLOCK;
    for (int blk = warp; blk < nblk; blk += NWARPS) {
        const int base = blk * SORT_BLOCK + SORT_E * lane;
        u64 v[SORT_E];
#pragma unroll
        for (int j = 0; j < SORT_E; ++j) v[j] = base + j < n_sort ? sort[base + j] : 0ull;
#pragma unroll
        for (int size = 2; size <= SORT_BLOCK; size <<= 1) {
            sort_stage(v, size - 1, lane);
#pragma unroll
            for (int stride = size >> 2; stride > 0; stride >>= 1) sort_stage(v, stride, lane);
        }
#pragma unroll
        for (int j = 0; j < SORT_E; ++j) {
            if (base + j < n2) sort[base + j] = v[j];
        }
    }
    __syncthreads();
    for (int size = 2 * SORT_BLOCK; size <= n2; size <<= 1) {
        const int half = size >> 1;
        for (int i = tid; i < n2 / 2; i += NTHREADS) {  // the mirror stage
            const int lo = (i / half) * size + i % half, hi = lo + size - 1 - 2 * (i % half);
            const u64 x = sort[lo], y = sort[hi];
            if (x < y) {
                sort[lo] = y;
                sort[hi] = x;
            }
        }
        __syncthreads();
        for (int stride = size >> 2; stride >= SORT_BLOCK; stride >>= 1) {
            for (int i = tid; i < n2 / 2; i += NTHREADS) {
                const int lo = 2 * i - (i & (stride - 1));
                const int hi = lo + stride;
                const u64 x = sort[lo], y = sort[hi];
                if (x < y) {
                    sort[lo] = y;
                    sort[hi] = x;
                }
            }
            __syncthreads();
        }
        for (int blk = warp; blk < nblk; blk += NWARPS) {
            const int base = blk * SORT_BLOCK + SORT_E * lane;
            u64 v[SORT_E];
#pragma unroll
            for (int j = 0; j < SORT_E; ++j) v[j] = sort[base + j];
#pragma unroll
            for (int stride = SORT_BLOCK / 2; stride > 0; stride >>= 1) sort_stage(v, stride, lane);
#pragma unroll
            for (int j = 0; j < SORT_E; ++j) sort[base + j] = v[j];
        }
        __syncthreads();
    }
    for (int j = tid; j < n_out; j += NTHREADS) {
        const int i = static_cast<int>(0xffffffffu - static_cast<u32>(sort[j] & 0xffffffffull));
        idx_out[j] = i;
        val_out[j] = val_at(i);
    }

    // ---- 4. keys == T in index order (unless sorted above), then the unfilled tail ------
    int base = ties_sorted ? need : 0;  // keys == T placed so far (block-uniform)
    for (int start = 0; start < P && base < need; start += NTHREADS) {
        const int i = start + tid;
        const bool hit = i < P && key_at(i) == thr;
        const u32 ballot = __ballot_sync(DSV4_FULL_MASK, hit);
        if (lane == 0) sm.warp_sums[warp] = __popc(ballot);
        __syncthreads();
        int before = 0, total = 0;
        for (int w = 0; w < NWARPS; ++w) {
            const int c = static_cast<int>(sm.warp_sums[w]);
            before += w < warp ? c : 0;
            total += c;
        }
        const int rank = base + before + __popc(ballot & ((1u << lane) - 1u));
        if (hit && rank < need) {
            idx_out[n_gt + rank] = i;
            val_out[n_gt + rank] = val_at(i);
        }
        base += total;
        __syncthreads();  // warp_sums is rewritten next round
    }
    const float neg_inf = -__int_as_float(0x7f800000);
    for (int j = n_gt + need + tid; j < K; j += NTHREADS) {
        idx_out[j] = -1;
        val_out[j] = neg_inf;
    }
    __syncthreads();  // the caller may reuse the row, sort and scratch
}

}  // namespace indexer
}  // namespace dsv4
