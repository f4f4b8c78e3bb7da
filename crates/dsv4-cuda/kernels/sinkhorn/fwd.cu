// Sinkhorn forward (SPEC.md section 4): one pass over x, f32, one thread per matrix.
//   y = softmax(x, rows) + eps
//   y = y / (column sums + eps)
//   repeat - 1 times: y = y / (row sums + eps); y = y / (column sums + eps)
// Sums run in index order from eps (as the reference); each denominator is inverted once
// (IEEE round-to-nearest reciprocal) and multiplies its row / column.
//
// dsv4-test-defines: SINKHORN_N=8 SINKHORN_VEC=1
// dsv4-test-defines: SINKHORN_N=4 SINKHORN_VEC=1
// dsv4-test-defines: SINKHORN_N=5
// dsv4-test-defines: SINKHORN_N=3
// dsv4-test-defines: SINKHORN_N=1
#include "sinkhorn/sinkhorn.cuh"

using namespace sinkhorn;

// y[i][:] /= (sum_j y[i][j] + eps)
__device__ __forceinline__ void row_step(float (&y)[NN], float eps) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
        float d = eps;
#pragma unroll
        for (int j = 0; j < N; ++j) d = __fadd_rn(d, y[i * N + j]);
        const float inv = __frcp_rn(d);
#pragma unroll
        for (int j = 0; j < N; ++j) y[i * N + j] = __fmul_rn(y[i * N + j], inv);
    }
}

// y[:][j] /= (sum_i y[i][j] + eps)
__device__ __forceinline__ void col_step(float (&y)[NN], float eps) {
#pragma unroll
    for (int j = 0; j < N; ++j) {
        float d = eps;
#pragma unroll
        for (int i = 0; i < N; ++i) d = __fadd_rn(d, y[i * N + j]);
        const float inv = __frcp_rn(d);
#pragma unroll
        for (int i = 0; i < N; ++i) y[i * N + j] = __fmul_rn(y[i * N + j], inv);
    }
}

extern "C" __global__ void __launch_bounds__(256) sinkhorn_fwd(const SinkhornParams p) {
    const i64 m = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (m >= p.matrices) return;
    float y[NN];
    load_matrix(p.x, p.x_layout, m, y);
    // Softmax over each row, then + eps.
#pragma unroll
    for (int i = 0; i < N; ++i) {
        float mx = y[i * N];
#pragma unroll
        for (int j = 1; j < N; ++j) mx = fmaxf(mx, y[i * N + j]);
        float s = 0.f;
#pragma unroll
        for (int j = 0; j < N; ++j) {
            y[i * N + j] = expf(y[i * N + j] - mx);
            s = __fadd_rn(s, y[i * N + j]);
        }
        const float inv = __frcp_rn(s);
#pragma unroll
        for (int j = 0; j < N; ++j) y[i * N + j] = __fadd_rn(__fmul_rn(y[i * N + j], inv), p.eps);
    }
    col_step(y, p.eps);
    for (int k = 1; k < p.repeat; ++k) {
        row_step(y, p.eps);
        col_step(y, p.eps);
    }
    store_matrix(p.out, m, y);
}
