// Reductions after the sparse-attention backward main kernel (bwd.cu), each in a fixed
// order so the deterministic backward is bitwise reproducible:
//   sparse_attn_dkv_reduce:   acc[b] += sum of the wave's partials of batch b, in chunk order
//   sparse_attn_f32_to_bf16:  dkv = bf16(acc)
//   sparse_attn_dsinks:       dsinks[h] = sum over rows of the per-row partials

#include "common.cuh"
#include "sparse_attention/params.cuh"

using namespace dsv4;

// acc[b, e] += sum_{chunks c of the wave with batch(c) == b, ascending} partial[c - base, e]
extern "C" __global__ void __launch_bounds__(256) sparse_attn_dkv_reduce(const SparseAttnDkvReduceParams p) {
    const i64 total = static_cast<i64>(p.B) * p.n;
    for (i64 i = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += static_cast<i64>(gridDim.x) * blockDim.x) {
        const int b = static_cast<int>(i / p.n);
        const i64 e = i % p.n;
        const int lo = max(p.chunk_base, b * p.chunks_per_batch);
        const int hi = min(p.chunk_base + p.n_chunks, (b + 1) * p.chunks_per_batch);
        if (lo >= hi) continue;
        float sum = p.acc[i];
        for (int c = lo; c < hi; ++c) sum += p.partial[static_cast<i64>(c - p.chunk_base) * p.n + e];
        p.acc[i] = sum;
    }
}

// dst = bf16(src), round to nearest even.
extern "C" __global__ void __launch_bounds__(256) sparse_attn_f32_to_bf16(const SparseAttnConvertParams p) {
    for (i64 i = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x; i < p.n; i += static_cast<i64>(gridDim.x) * blockDim.x) {
        p.dst[i] = from_f32<bf16>(p.src[i]);
    }
}

// One CTA per head: thread t sums rows t, t + 256, ... in order, then a fixed tree.
extern "C" __global__ void __launch_bounds__(256) sparse_attn_dsinks(const SparseAttnDsinksParams p) {
    __shared__ float part[256];
    const int h = blockIdx.x;
    float sum = 0.0f;
    for (i64 r = threadIdx.x; r < p.rows; r += 256) sum += p.part[r * p.H + h];
    part[threadIdx.x] = sum;
    __syncthreads();
    for (int w = 128; w > 0; w /= 2) {
        if (static_cast<int>(threadIdx.x) < w) part[threadIdx.x] += part[threadIdx.x + w];
        __syncthreads();
    }
    if (threadIdx.x == 0) p.dsinks[h] = part[0];
}
