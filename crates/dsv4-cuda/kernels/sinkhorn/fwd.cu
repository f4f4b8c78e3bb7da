// Sinkhorn forward (SPEC.md section 4): one pass over x, f32.
//   y = softmax(x, rows) + eps
//   y = y / (column sums + eps)
//   repeat - 1 times: y = y / (row sums + eps); y = y / (column sums + eps)
// Block: blockDim.x lanes = blockDim.x / G matrices per sweep, grid-stride over matrices.
//
// dsv4-test-defines: SINKHORN_N=8
// dsv4-test-defines: SINKHORN_N=3
// dsv4-test-defines: SINKHORN_N=1
#include "sinkhorn/sinkhorn.cuh"

using namespace sinkhorn;

extern "C" __global__ void __launch_bounds__(256) sinkhorn_fwd(const SinkhornParams p) {
    const int row = threadIdx.x % G;                 // i: the row this lane holds
    const i64 per_sweep = (i64)gridDim.x * (blockDim.x / G);
    // Every lane of a warp runs the same number of sweeps (the shuffles need the whole
    // warp); lanes past the last matrix compute on zeros and store nothing.
    const i64 warp_first = ((i64)blockIdx.x * blockDim.x + (threadIdx.x & ~31)) / G;
    for (i64 base = warp_first; base < p.matrices; base += per_sweep) {
        const i64 m = base + (threadIdx.x & 31) / G;
        const bool valid = m < p.matrices && row < N;
        float x[N], y[N];
        load_row(p.x, p.x_layout, m, row, valid, x);
        softmax_row(x, y);
#pragma unroll
        for (int j = 0; j < N; ++j) y[j] = valid ? y[j] + p.eps : 0.f;  // y = z + eps
        for (int k = 0; k < 2 * p.repeat - 1; ++k) step(y, is_row_step(k), p.eps);
        if (valid) {
            float* o = p.out + m * (N * N) + row * N;
#pragma unroll
            for (int j = 0; j < N; ++j) o[j] = y[j];
        }
    }
}
