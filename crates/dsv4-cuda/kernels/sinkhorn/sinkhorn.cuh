// Sinkhorn normalisation of n x n matrices (SPEC.md section 4): params and the maths
// shared by the forward and the backward.
//
// One thread per matrix: the whole n x n matrix lives in the thread's registers (n is a
// compile-time define <= 8), so row and column sums are thread-local, summed in index
// order as the reference does; every denominator is inverted once and the entries
// multiplied by the inverse. No lane ever holds padding: threads past the last matrix
// return before touching memory.
#pragma once
#include "common.cuh"

// Defines (src/sinkhorn.rs renders them from the launch):
//   SINKHORN_N    n, the matrix size, 1 <= n <= 8 (a compile-time constant).
//   SINKHORN_VEC  1: x is contiguous [M, n, n] with a 16-byte aligned base, n*n a multiple
//                 of 4, and out's base is 16-byte aligned: float4 loads of x and stores of
//                 out. 0: the generic strided path (any layout of x; out contiguous, scalar
//                 stores).
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
constexpr int NN = N * N;
constexpr bool VEC = SINKHORN_VEC != 0;
static_assert(N >= 1 && N <= 8, "SINKHORN_N must be in [1, 8]");
static_assert(!VEC || NN % 4 == 0, "SINKHORN_VEC needs n*n to be a multiple of 4");

// Offset (elements) of element (m, 0, 0). Innermost leading dim first; a contiguous
// batch (one merged leading dim) costs one compare, no division.
__device__ __forceinline__ i64 matrix_offset(const SinkhornLayout& l, i64 m) {
    i64 off = 0;
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

// Matrix m as f32, row-major in `a`: float4 loads when VEC (contiguous, aligned).
template <bool VEC>
__device__ __forceinline__ void load_matrix(const float* p, const SinkhornLayout& l, i64 m, float (&a)[NN]) {
    if constexpr (VEC && NN % 4 == 0) {
        const float4* q = reinterpret_cast<const float4*>(p + m * NN);
#pragma unroll
        for (int e = 0; e < NN / 4; ++e) {
            const float4 v = __ldg(q + e);
            a[4 * e] = v.x, a[4 * e + 1] = v.y, a[4 * e + 2] = v.z, a[4 * e + 3] = v.w;
        }
    } else {
        const float* b = p + matrix_offset(l, m);
#pragma unroll
        for (int i = 0; i < N; ++i)
#pragma unroll
            for (int j = 0; j < N; ++j) a[i * N + j] = __ldg(b + i * l.row_stride + j * l.col_stride);
    }
}

// Matrix m of the contiguous [M, n, n] output: float4 stores when VEC.
__device__ __forceinline__ void store_matrix(float* p, i64 m, const float (&a)[NN]) {
    if constexpr (VEC) {
        float4* q = reinterpret_cast<float4*>(p + m * NN);
#pragma unroll
        for (int e = 0; e < NN / 4; ++e) q[e] = make_float4(a[4 * e], a[4 * e + 1], a[4 * e + 2], a[4 * e + 3]);
    } else {
        float* b = p + m * NN;
#pragma unroll
        for (int e = 0; e < NN; ++e) b[e] = a[e];
    }
}

}  // namespace sinkhorn
