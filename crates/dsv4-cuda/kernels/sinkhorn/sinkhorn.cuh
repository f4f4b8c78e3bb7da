// Sinkhorn normalisation of n x n matrices (SPEC.md section 4): params and the maths
// shared by the forward and the backward.
//
// Layout: a group of G = pow2ceil(n) lanes per matrix, lane r holding row r in registers
// (lanes r >= n hold zeros and take part in the column sums only). Row sums are
// lane-local; column sums are a butterfly over the group's lanes.
#pragma once
#include "common.cuh"

// n, the matrix size: a compile-time constant, 1 <= n <= 8.
#ifndef SINKHORN_N
#define SINKHORN_N 4
#endif
#if SINKHORN_N < 1 || SINKHORN_N > 8
#error "SINKHORN_N must be in [1, 8]"
#endif

#define SINKHORN_MAX_LEAD 6

// Where element (m, i, j) of a `[..., n, n]` tensor lives: m is the row-major index over
// the leading dims.
struct SinkhornLayout {
    i64 lead_size[SINKHORN_MAX_LEAD];    // leading dims, outermost first, padded with 1
    i64 lead_stride[SINKHORN_MAX_LEAD];  // their strides (elements)
    i64 row_stride;                      // stride of dim -2 (i)
    i64 col_stride;                      // stride of dim -1 (j)
};
DSV4_PARAMS_SIZE(SinkhornLayout, 112);

struct SinkhornParams {
    const float* x;              // [..., n, n] f32, strides in x_layout
    const float* dout;           // [..., n, n] f32, strides in dout_layout; backward only (null forward)
    float* out;                  // [M, n, n] f32 contiguous: y (forward) or dx (backward)
    SinkhornLayout x_layout;
    SinkhornLayout dout_layout;  // backward only
    i64 matrices;                // M = product of the leading dims
    i32 repeat;                  // >= 1: one column step, then (repeat - 1) x (row, column)
    float eps;                   // > 0, added to the softmax and to every denominator
};
DSV4_PARAMS_SIZE(SinkhornParams, 264);

namespace sinkhorn {

constexpr int N = SINKHORN_N;
// Lanes per matrix: the next power of two >= n.
constexpr int G = N <= 1 ? 1 : N <= 2 ? 2 : N <= 4 ? 4 : 8;

// Offset (elements) of element (m, i, 0). Innermost leading dim first; a contiguous
// batch (one merged leading dim) costs one compare, no division.
__device__ __forceinline__ i64 row_offset(const SinkhornLayout& l, i64 m, int i) {
    i64 off = i * l.row_stride;
#pragma unroll
    for (int d = SINKHORN_MAX_LEAD - 1; d >= 0; --d) {
        const i64 size = l.lead_size[d];
        if (m < size) {
            off += m * l.lead_stride[d];
            break;
        }
        off += (m % size) * l.lead_stride[d];
        m /= size;
    }
    return off;
}

__device__ __forceinline__ void load_row(const float* p, const SinkhornLayout& l, i64 m, int i, bool valid, float (&row)[N]) {
    const i64 off = valid ? row_offset(l, m, i) : 0;
#pragma unroll
    for (int j = 0; j < N; ++j) row[j] = valid ? p[off + j * l.col_stride] : 0.f;
}

// z_j = exp(x_j - max x) / sum_k exp(x_k - max x)
__device__ __forceinline__ void softmax_row(const float (&x)[N], float (&z)[N]) {
    float mx = x[0];
#pragma unroll
    for (int j = 1; j < N; ++j) mx = fmaxf(mx, x[j]);
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < N; ++j) {
        z[j] = expf(x[j] - mx);
        s += z[j];
    }
#pragma unroll
    for (int j = 0; j < N; ++j) z[j] = z[j] / s;
}

// Steps 0 .. 2*repeat-2: step 0 and every even step normalise columns, odd steps rows.
__device__ __forceinline__ bool is_row_step(int k) { return (k & 1) != 0; }

// Denominators of a step over its input u: rows: den = sum_j u_ij + eps (this lane's row,
// every entry the same); columns: den_j = sum_i u_ij + eps.
__device__ __forceinline__ void denominators(const float (&u)[N], bool rows, float eps, float (&den)[N]) {
    if (rows) {
        float d = eps;
#pragma unroll
        for (int j = 0; j < N; ++j) d += u[j];
#pragma unroll
        for (int j = 0; j < N; ++j) den[j] = d;
    } else {
#pragma unroll
        for (int j = 0; j < N; ++j) den[j] = dsv4::group_sum(u[j], G) + eps;
    }
}

// v = u / den  (one Sinkhorn step)
__device__ __forceinline__ void step(float (&y)[N], bool rows, float eps) {
    float den[N];
    denominators(y, rows, eps, den);
#pragma unroll
    for (int j = 0; j < N; ++j) y[j] = y[j] / den[j];
}

}  // namespace sinkhorn
