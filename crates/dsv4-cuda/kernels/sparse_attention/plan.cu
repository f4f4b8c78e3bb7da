// Index plans of sparse attention (SPEC.md section 6), built on the GPU:
//   sparse_attn_plan_rows:   per row, the valid keys as global b*K+k ascending (duplicates
//                            kept) then -1, and the count (a bitonic sort in shared memory)
//   sparse_attn_valid_rows:  the nonempty rows ascending, then -1 (one CTA, block scans)

#include "common.cuh"
#include "sparse_attention/params.cuh"

using namespace dsv4;

namespace {
constexpr int kMasked = 0x7fffffff;  // sorts after every valid coordinate (b*K+k < B*K <= INT_MAX)
}

// One CTA per row; dynamic shared memory: sort_cap ints.
extern "C" __global__ void __launch_bounds__(1024) sparse_attn_plan_rows(const SparseAttnPlanParams p) {
    extern __shared__ __align__(16) unsigned char smem[];
    int* keys = reinterpret_cast<int*>(smem);
    __shared__ int count;
    const i64 row = blockIdx.x;
    const int b = static_cast<int>(row / p.S), s = static_cast<int>(row % p.S);
    const i64 base = b * p.idx_sb + s * p.idx_ss;
    const int n = p.sort_cap;
    if (threadIdx.x == 0) count = 0;
    __syncthreads();
    int mine = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        int v = kMasked;
        if (i < p.T) {
            const i64 k = load_int(p.idx, base + i * p.idx_st, p.idx_is_i64);
            if (k >= 0 && k < p.K) {
                v = static_cast<int>(static_cast<i64>(b) * p.K + k);
                ++mine;
            }
        }
        keys[i] = v;
    }
    if (mine) atomicAdd(&count, mine);  // a count: the order of the adds does not matter
    __syncthreads();
    // Bitonic sort, ascending.
    for (int k = 2; k <= n; k <<= 1) {
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int i = threadIdx.x; i < n; i += blockDim.x) {
                const int ixj = i ^ j;
                if (ixj > i) {
                    const int a = keys[i], c = keys[ixj];
                    const bool up = (i & k) == 0;
                    if ((a > c) == up) {
                        keys[i] = c;
                        keys[ixj] = a;
                    }
                }
            }
            __syncthreads();
        }
    }
    for (int i = threadIdx.x; i < p.T; i += blockDim.x) p.indices[row * p.T + i] = keys[i] == kMasked ? -1 : keys[i];
    if (threadIdx.x == 0) p.lengths[row] = count;
}

// One CTA of 1024 threads walks the rows in blocks of 1024, compacting the nonempty ones.
extern "C" __global__ void __launch_bounds__(1024) sparse_attn_valid_rows(const SparseAttnValidRowsParams p) {
    __shared__ int warp_tot[32];
    __shared__ i64 offset;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (threadIdx.x == 0) offset = 0;
    __syncthreads();
    for (i64 base = 0; base < p.rows; base += 1024) {
        const i64 r = base + threadIdx.x;
        const bool flag = r < p.rows && p.lengths[r] > 0;
        const u32 ballot = __ballot_sync(DSV4_FULL_MASK, flag);
        const int in_warp = __popc(ballot & ((1u << lane) - 1u));
        if (lane == 0) warp_tot[warp] = __popc(ballot);
        __syncthreads();
        int before = 0, total = 0;
        for (int w = 0; w < 32; ++w) {
            before += w < warp ? warp_tot[w] : 0;
            total += warp_tot[w];
        }
        const i64 off = offset;
        if (flag) p.valid_rows[off + before + in_warp] = r;
        __syncthreads();
        if (threadIdx.x == 0) offset = off + total;
        __syncthreads();
    }
    for (i64 r = offset + threadIdx.x; r < p.rows; r += 1024) p.valid_rows[r] = -1;
}
