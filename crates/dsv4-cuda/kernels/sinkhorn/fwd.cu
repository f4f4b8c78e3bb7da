// Sinkhorn forward (SPEC.md section 4): one pass over x, f32, one thread per matrix.
//   y = softmax(x, rows) + eps
//   y = y / (column sums + eps)
//   repeat - 1 times: y = y / (row sums + eps); y = y / (column sums + eps)
// Each denominator is inverted once (MUFU reciprocal; denominators are positive normal
// floats >= eps) and multiplies a scale factor (below). 32 FP32 instructions per step at
// n = 4 (16 FFMA sums, 4 FFMA + 4 MUFU + 4 FMUL).
//
// dsv4-test-defines: SINKHORN_N=8 SINKHORN_VEC=1
// dsv4-test-defines: SINKHORN_N=4 SINKHORN_VEC=1
// dsv4-test-defines: SINKHORN_N=5
// dsv4-test-defines: SINKHORN_N=3
// dsv4-test-defines: SINKHORN_N=1
// dsv4-test-defines: SINKHORN_N=4 SINKHORN_VEC=1 SINKHORN_FWD_RCP_GROUP=2
// dsv4-test-defines: SINKHORN_N=4 SINKHORN_VEC=1 SINKHORN_FWD_RCP_GROUP=4 SINKHORN_FWD_ALPHA=1
// dsv4-test-defines: SINKHORN_N=7 SINKHORN_FWD_RCP_GROUP=4 SINKHORN_FWD_MINB=8
#include "sinkhorn/sinkhorn.cuh"

using namespace sinkhorn;

// 1 / d for a normal positive d: the hardware approximation (within 1 ulp). The forward is
// contractive: emulated with a random 1-ulp reciprocal error on 65k matrices, repeat 20,
// its max error stays 5e-7 of the row scale (bound 1e-5), as with exact division.
__device__ __forceinline__ float rcp(float d) {
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d));
    return r;
}

// The steps as diagonal scalings: y = diag(a) K diag(b) with K = softmax + eps, so a step
// touches n scale factors, not n*n entries:
//   rows:    den_i = eps + a_i * sum_j K_ij b_j,  a_i /= den_i
//   columns: den_j = eps + b_j * sum_i K_ij a_i,  b_j /= den_j
// (the same denominators as summing the scaled entries, up to rounding).
__device__ __forceinline__ void row_step(const float (&K)[NN], float (&a)[N], const float (&b)[N], float eps) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
        float s = 0.f;
#pragma unroll
        for (int j = 0; j < N; ++j) s = fmaf(K[i * N + j], b[j], s);
        a[i] = a[i] * rcp(fmaf(a[i], s, eps));
    }
}

__device__ __forceinline__ void col_step(const float (&K)[NN], const float (&a)[N], float (&b)[N], float eps) {
#pragma unroll
    for (int j = 0; j < N; ++j) {
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < N; ++i) s = fmaf(K[i * N + j], a[i], s);
        b[j] = b[j] * rcp(fmaf(b[j], s, eps));
    }
}

// Experiments (defaults: the steps above). SINKHORN_FWD_RCP_GROUP = G in {2, 4}: a step's
// n reciprocals computed G at a time from one MUFU (G = 2: r = rcp(d0 d1), 1/d0 = r d1,
// 1/d1 = r d0; G = 4: the same over the pairs' products, the product checked to lie within
// [2^-100, 2^100], else one MUFU each). SINKHORN_FWD_ALPHA=1: the scale factors kept with
// their inverses (alpha = 1/a, beta = 1/b), so a row step is alpha_i = sum_j K_ij b_j +
// eps alpha_i, a_i = 1/alpha_i (no multiply by the old factor; 8 more live registers).
// SINKHORN_FWD_MINB=8: __launch_bounds__(256, 8), i.e. 32 registers for 2,048 threads an
// SM. Why: ncu (1M, H200) finds the MUFU pipe and the issue slots equally loaded (176 MUFU
// and 1,412 instructions a warp, both 69 % busy), most stall samples waiting on the MIO
// queue at the softmax's EX2s.
#ifndef SINKHORN_FWD_RCP_GROUP
#define SINKHORN_FWD_RCP_GROUP 1
#endif
#ifndef SINKHORN_FWD_ALPHA
#define SINKHORN_FWD_ALPHA 0
#endif
#ifndef SINKHORN_FWD_MINB
#define SINKHORN_FWD_MINB 0
#endif

#if SINKHORN_FWD_RCP_GROUP > 1 || SINKHORN_FWD_ALPHA
// r[i] = 1 / d[i] for positive normal d, G reciprocals from one MUFU where they can.
__device__ __forceinline__ void rcp_grouped(const float (&d)[N], float (&r)[N]) {
    int i = 0;
#if SINKHORN_FWD_RCP_GROUP >= 4
#pragma unroll
    for (; i + 4 <= N; i += 4) {
        const float p01 = d[i] * d[i + 1], p23 = d[i + 2] * d[i + 3];
        const float pp = p01 * p23;
        if (pp > 0x1p-100f && pp < 0x1p100f) {
            const float q = rcp(pp);
            const float q01 = q * p23, q23 = q * p01;
            r[i] = q01 * d[i + 1];
            r[i + 1] = q01 * d[i];
            r[i + 2] = q23 * d[i + 3];
            r[i + 3] = q23 * d[i + 2];
        } else {
#pragma unroll
            for (int t = 0; t < 4; ++t) r[i + t] = rcp(d[i + t]);
        }
    }
#endif
#if SINKHORN_FWD_RCP_GROUP >= 2
#pragma unroll
    for (; i + 2 <= N; i += 2) {
        const float q = rcp(d[i] * d[i + 1]);  // >= (eps)^2 and <= ~(1/eps)^2: normal for eps >= 1e-18
        r[i] = q * d[i + 1];
        r[i + 1] = q * d[i];
    }
#endif
#pragma unroll
    for (; i < N; ++i) r[i] = rcp(d[i]);
}

// The steps of the default form (den = eps + a s, a *= 1 / den), reciprocals grouped.
__device__ __forceinline__ void row_step_grouped(const float (&K)[NN], float (&a)[N], const float (&b)[N], float eps) {
    float den[N], inv[N];
#pragma unroll
    for (int i = 0; i < N; ++i) {
        float s = 0.f;
#pragma unroll
        for (int j = 0; j < N; ++j) s = fmaf(K[i * N + j], b[j], s);
        den[i] = fmaf(a[i], s, eps);
    }
    rcp_grouped(den, inv);
#pragma unroll
    for (int i = 0; i < N; ++i) a[i] = a[i] * inv[i];
}

__device__ __forceinline__ void col_step_grouped(const float (&K)[NN], const float (&a)[N], float (&b)[N], float eps) {
    float den[N], inv[N];
#pragma unroll
    for (int j = 0; j < N; ++j) {
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < N; ++i) s = fmaf(K[i * N + j], a[i], s);
        den[j] = fmaf(b[j], s, eps);
    }
    rcp_grouped(den, inv);
#pragma unroll
    for (int j = 0; j < N; ++j) b[j] = b[j] * inv[j];
}

// Rows: alpha_i = sum_j K_ij b_j + eps alpha_i, a = 1 / alpha (columns alike).
__device__ __forceinline__ void row_step_inv(const float (&K)[NN], float (&a)[N], float (&al)[N], const float (&b)[N], float eps) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
        float s = eps * al[i];
#pragma unroll
        for (int j = 0; j < N; ++j) s = fmaf(K[i * N + j], b[j], s);
        al[i] = s;
    }
    rcp_grouped(al, a);
}

__device__ __forceinline__ void col_step_inv(const float (&K)[NN], const float (&a)[N], float (&b)[N], float (&be)[N], float eps) {
#pragma unroll
    for (int j = 0; j < N; ++j) {
        float s = eps * be[j];
#pragma unroll
        for (int i = 0; i < N; ++i) s = fmaf(K[i * N + j], a[i], s);
        be[j] = s;
    }
    rcp_grouped(be, b);
}
#endif

// One matrix in registers, x in, y out: the softmax, the steps, the final scaling.
__device__ __forceinline__ void sinkhorn_matrix(float (&K)[NN], const SinkhornParams& p) {
    // K = softmax over each row + eps.
#pragma unroll
    for (int i = 0; i < N; ++i) {
        float mx = K[i * N];
#pragma unroll
        for (int j = 1; j < N; ++j) mx = fmaxf(mx, K[i * N + j]);
        float s = 0.f;
#pragma unroll
        for (int j = 0; j < N; ++j) {
            K[i * N + j] = expf(K[i * N + j] - mx);
            s = __fadd_rn(s, K[i * N + j]);
        }
        const float inv = rcp(s);
#pragma unroll
        for (int j = 0; j < N; ++j) K[i * N + j] = __fadd_rn(__fmul_rn(K[i * N + j], inv), p.eps);
    }

    float a[N], b[N];
#pragma unroll
    for (int i = 0; i < N; ++i) a[i] = 1.f, b[i] = 1.f;
#if SINKHORN_FWD_ALPHA
    float al[N], be[N];
#pragma unroll
    for (int i = 0; i < N; ++i) al[i] = 1.f, be[i] = 1.f;
    col_step_inv(K, a, b, be, p.eps);
    for (int k = 1; k < p.repeat; ++k) {
        row_step_inv(K, a, al, b, p.eps);
        col_step_inv(K, a, b, be, p.eps);
    }
#elif SINKHORN_FWD_RCP_GROUP > 1
    col_step_grouped(K, a, b, p.eps);
    for (int k = 1; k < p.repeat; ++k) {
        row_step_grouped(K, a, b, p.eps);
        col_step_grouped(K, a, b, p.eps);
    }
#else
    col_step(K, a, b, p.eps);
    for (int k = 1; k < p.repeat; ++k) {
        row_step(K, a, b, p.eps);
        col_step(K, a, b, p.eps);
    }
#endif
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
        for (int j = 0; j < N; ++j) K[i * N + j] = __fmul_rn(__fmul_rn(K[i * N + j], a[i]), b[j]);
}

#if SINKHORN_FWD_MINB
extern "C" __global__ void __launch_bounds__(256, SINKHORN_FWD_MINB) sinkhorn_fwd(const SinkhornParams p) {  // 32 registers: 2,048 threads an SM
#else
extern "C" __global__ void __launch_bounds__(256) sinkhorn_fwd(const SinkhornParams p) {
#endif
    const i64 m = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (m >= p.matrices) return;
    float K[NN];
    load_matrix<SINKHORN_VEC>(p.x, p.x_layout, m, K);
    sinkhorn_matrix(K, p);
    store_matrix(p.out, m, K);
}
