// Sinkhorn forward (SPEC.md section 4): one pass over x, f32, one thread per matrix.
//   y = softmax(x, rows) + eps
//   y = y / (column sums + eps)
//   repeat - 1 times: y = y / (row sums + eps); y = y / (column sums + eps)
// Each denominator is inverted once (MUFU reciprocal; denominators are positive normal
// floats >= eps) and multiplies a scale factor (below). 32 FP32 instructions per step at
// n = 4 (16 FFMA sums, 4 FFMA + 4 MUFU + 4 FMUL).
//
// Variant (untimed, branch exp/sinkhorn-variants): DSV4_SINKHORN_FWD_VARIANT=1 keeps
// alpha = 1/a (and beta = 1/b) beside the factors, so a step is
//   rows: alpha_i = sum_j K_ij b_j + eps * alpha_i  (= den_i / a_i),  a_i = 1 / alpha_i
// (no multiply by the old factor), and the first two denominators of a step share one MUFU:
// r = rcp(alpha_0 alpha_1), 1/alpha_0 = r alpha_1, 1/alpha_1 = r alpha_0. At n = 4 a step is
// 20 FFMA + 3 FMUL + 3 MUFU instead of 24 + 4 MUFU (the MUFU pipe, 16/clk/SM, was the
// bound). Emulated max error 5.5e-7 of the row scale (scripts/sinkhorn_fwd_emulate.py).
//
// dsv4-test-defines: SINKHORN_N=8 SINKHORN_VEC=1
// dsv4-test-defines: SINKHORN_N=4 SINKHORN_VEC=1
// dsv4-test-defines: SINKHORN_N=4 SINKHORN_VEC=1 DSV4_SINKHORN_FWD_VARIANT=1
// dsv4-test-defines: SINKHORN_N=5 DSV4_SINKHORN_FWD_VARIANT=1
// dsv4-test-defines: SINKHORN_N=1 DSV4_SINKHORN_FWD_VARIANT=1
// dsv4-test-defines: SINKHORN_N=4 SINKHORN_VEC=1 DSV4_SINKHORN_FWD_VARIANT=2
// dsv4-test-defines: SINKHORN_N=3 DSV4_SINKHORN_FWD_VARIANT=2
// dsv4-test-defines: SINKHORN_N=5
// dsv4-test-defines: SINKHORN_N=3
// dsv4-test-defines: SINKHORN_N=1
#include "sinkhorn/sinkhorn.cuh"

// 0: the v2 kernel; 1: reciprocal factors, one shared reciprocal per step (above); 2: the
// v2 steps with only the shared reciprocal (below).
#ifndef DSV4_SINKHORN_FWD_VARIANT
#define DSV4_SINKHORN_FWD_VARIANT 0
#endif

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

#if DSV4_SINKHORN_FWD_VARIANT == 1 || DSV4_SINKHORN_FWD_VARIANT == 2
// 1 / d_e for the n denominators of a step: entries 0 and 1 from one reciprocal of their
// product, the rest one each. Variant 2's d are denominators (>= eps, <= n + eps); variant
// 1's alpha, beta stayed in [4e-6, 4e3] in emulation even for logits of +-30: the product
// is a normal float either way.
__device__ __forceinline__ void rcp_step(const float (&d)[N], float (&r)[N]) {
    int e0 = 0;
    if constexpr (N >= 2) {
        const float q = rcp(__fmul_rn(d[0], d[1]));
        r[0] = __fmul_rn(q, d[1]);
        r[1] = __fmul_rn(q, d[0]);
        e0 = 2;
    }
#pragma unroll
    for (int e = e0; e < N; ++e) r[e] = rcp(d[e]);
}
#endif

#if DSV4_SINKHORN_FWD_VARIANT == 1
// rows: al_i = sum_j K_ij b_j + eps al_i (= den_i / a_i), a_i = 1 / al_i.
__device__ __forceinline__ void row_step_rcp(const float (&K)[NN], float (&a)[N], float (&al)[N], const float (&b)[N], float eps) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
        float s = 0.f;
#pragma unroll
        for (int j = 0; j < N; ++j) s = fmaf(K[i * N + j], b[j], s);
        al[i] = fmaf(eps, al[i], s);
    }
    rcp_step(al, a);
}

// columns: be_j = sum_i K_ij a_i + eps be_j, b_j = 1 / be_j.
__device__ __forceinline__ void col_step_rcp(const float (&K)[NN], const float (&a)[N], float (&b)[N], float (&be)[N], float eps) {
#pragma unroll
    for (int j = 0; j < N; ++j) {
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < N; ++i) s = fmaf(K[i * N + j], a[i], s);
        be[j] = fmaf(eps, be[j], s);
    }
    rcp_step(be, b);
}
#endif

#if DSV4_SINKHORN_FWD_VARIANT == 2
// The v2 steps (a_i *= 1 / (a_i s_i + eps)) with the shared reciprocal of rcp_step and no
// 1/a, 1/b kept: 32 registers (variant 1 needs 40: 1536 threads per SM instead of 2048);
// at n = 4 a step is 20 FFMA + 7 FMUL + 3 MUFU.
__device__ __forceinline__ void row_step_pair(const float (&K)[NN], float (&a)[N], const float (&b)[N], float eps) {
    float d[N], r[N];
#pragma unroll
    for (int i = 0; i < N; ++i) {
        float s = 0.f;
#pragma unroll
        for (int j = 0; j < N; ++j) s = fmaf(K[i * N + j], b[j], s);
        d[i] = fmaf(a[i], s, eps);
    }
    rcp_step(d, r);
#pragma unroll
    for (int i = 0; i < N; ++i) a[i] = a[i] * r[i];
}

__device__ __forceinline__ void col_step_pair(const float (&K)[NN], const float (&a)[N], float (&b)[N], float eps) {
    float d[N], r[N];
#pragma unroll
    for (int j = 0; j < N; ++j) {
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < N; ++i) s = fmaf(K[i * N + j], a[i], s);
        d[j] = fmaf(b[j], s, eps);
    }
    rcp_step(d, r);
#pragma unroll
    for (int j = 0; j < N; ++j) b[j] = b[j] * r[j];
}
#endif

extern "C" __global__ void __launch_bounds__(256) sinkhorn_fwd(const SinkhornParams p) {
    const i64 m = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (m >= p.matrices) return;
    float K[NN];
    load_matrix<SINKHORN_VEC>(p.x, p.x_layout, m, K);
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
#if DSV4_SINKHORN_FWD_VARIANT == 1
    float al[N], be[N];  // 1/a, 1/b
#pragma unroll
    for (int i = 0; i < N; ++i) al[i] = 1.f, be[i] = 1.f;
    col_step_rcp(K, a, b, be, p.eps);
    for (int k = 1; k < p.repeat; ++k) {
        row_step_rcp(K, a, al, b, p.eps);
        col_step_rcp(K, a, b, be, p.eps);
    }
#elif DSV4_SINKHORN_FWD_VARIANT == 2
    col_step_pair(K, a, b, p.eps);
    for (int k = 1; k < p.repeat; ++k) {
        row_step_pair(K, a, b, p.eps);
        col_step_pair(K, a, b, p.eps);
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
    store_matrix(p.out, m, K);
}
