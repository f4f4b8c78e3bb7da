// Sinkhorn backward (SPEC.md section 4): recomputes the forward, keeping each step's
// input u_k in shared memory (the tape), then walks the steps in reverse:
//   step k:   v = u / den,  den = sums of u along the step's axis + eps
//   reverse:  g <- (g - sums of g*v along the axis) / den     (v, den recomputed from u_k)
//   softmax:  dx = z * (g - sum_j g_j z_j)                     (y0 = z + eps, so dz = g)
// Shared memory: (2*repeat - 1) * n floats per lane, laid out [step][j][lane] so a warp's
// accesses hit 32 distinct banks.
//
// dsv4-test-defines: SINKHORN_N=8
// dsv4-test-defines: SINKHORN_N=3
// dsv4-test-defines: SINKHORN_N=1
#include "sinkhorn/sinkhorn.cuh"

using namespace sinkhorn;

extern "C" __global__ void __launch_bounds__(256) sinkhorn_bwd(const SinkhornParams p) {
    extern __shared__ float tape[];                  // [2*repeat-1][N][blockDim.x]
    const int lanes = blockDim.x;
    const int row = threadIdx.x % G;
    const int steps = 2 * p.repeat - 1;
    const i64 per_sweep = (i64)gridDim.x * (blockDim.x / G);
    const i64 warp_first = ((i64)blockIdx.x * blockDim.x + (threadIdx.x & ~31)) / G;
    for (i64 base = warp_first; base < p.matrices; base += per_sweep) {
        const i64 m = base + (threadIdx.x & 31) / G;
        const bool valid = m < p.matrices && row < N;
        float x[N], z[N], y[N], g[N];
        load_row(p.x, p.x_layout, m, row, valid, x);
        softmax_row(x, z);
#pragma unroll
        for (int j = 0; j < N; ++j) y[j] = valid ? z[j] + p.eps : 0.f;
        // Forward, recording each step's input.
        for (int k = 0; k < steps; ++k) {
#pragma unroll
            for (int j = 0; j < N; ++j) tape[(k * N + j) * lanes + threadIdx.x] = y[j];
            step(y, is_row_step(k), p.eps);
        }
        load_row(p.dout, p.dout_layout, m, row, valid, g);
        // Reverse: g <- (g - <g, v>_axis) / den.
        for (int k = steps - 1; k >= 0; --k) {
            const bool rows = is_row_step(k);
            float u[N], den[N], gv[N];
#pragma unroll
            for (int j = 0; j < N; ++j) u[j] = tape[(k * N + j) * lanes + threadIdx.x];
            denominators(u, rows, p.eps, den);
#pragma unroll
            for (int j = 0; j < N; ++j) gv[j] = g[j] * (u[j] / den[j]);  // g * v
            if (rows) {
                float dot = 0.f;
#pragma unroll
                for (int j = 0; j < N; ++j) dot += gv[j];
#pragma unroll
                for (int j = 0; j < N; ++j) g[j] = (g[j] - dot) / den[j];
            } else {
#pragma unroll
                for (int j = 0; j < N; ++j) g[j] = (g[j] - dsv4::group_sum(gv[j], G)) / den[j];
            }
        }
        // Softmax over the row: dx = z * (g - <g, z>).
        float s = 0.f;
#pragma unroll
        for (int j = 0; j < N; ++j) s += g[j] * z[j];
        if (valid) {
            float* o = p.out + m * (N * N) + row * N;
#pragma unroll
            for (int j = 0; j < N; ++j) o[j] = z[j] * (g[j] - s);
        }
    }
}
