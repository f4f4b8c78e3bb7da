// Sinkhorn forward (SPEC.md section 4): one pass over x, f32, one thread per matrix.
//   y = softmax(x, rows) + eps
//   y = y / (column sums + eps)
//   repeat - 1 times: y = y / (row sums + eps); y = y / (column sums + eps)
// Each denominator is inverted once (denominators are positive normal floats >= eps) and
// becomes a scale factor (below); some of the reciprocals run on the FMA pipe instead of
// the MUFU (rcp_fma, SINKHORN_FWD_NEWTON).
//
// Defines: those of sinkhorn.cuh, and SINKHORN_FWD_NEWTON = R >= 0 (below).
#include "sinkhorn/sinkhorn.cuh"

using namespace sinkhorn;

// The softmax's exponentials: e^(x - mx) = ex2.approx(x log2 e - mx log2 e), one FFMA and
// the MUFU (m2 = mx log2 e is rounded once per row, a common factor of the row that the
// normalisation cancels). research/sinkhorn_fwd_emulate.py: with the approximation's
// +-2 ulp the per-row error stays ~6e-7 (bound 1e-5).
constexpr float kLog2e = 1.44269504088896341f;
__device__ __forceinline__ float softmax_exp(float x, float m2) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(fmaf(x, kLog2e, -m2)));
    return y;
}

// 1 / d for a normal positive d: the hardware approximation (within 1 ulp). The forward is
// contractive: emulated with a random 1-ulp reciprocal error on 65k matrices, repeat 20,
// its max error stays 5e-7 of the row scale (bound 1e-5), as with exact division.
__device__ __forceinline__ float rcp(float d) {
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d));
    return r;
}

// SINKHORN_FWD_NEWTON = R: with R > 0 the rounds run in pairs (row, column, row, column),
// and in each pair R of the reciprocals, the last factors of the two column steps ((R + 1)
// / 2 in the first, R / 2 in the second, each at most n), are computed on the FMA pipe
// (rcp_fma) instead of the MUFU: a reciprocal moved costs 5 issue slots and frees 8 MUFU
// cycles. R = 0: one round a loop iteration, every reciprocal from the MUFU (the launcher's
// choice for eps below rcp_fma's range).
constexpr int FMA_RCPS = SINKHORN_FWD_NEWTON;
static_assert(FMA_RCPS >= 0, "SINKHORN_FWD_NEWTON must be >= 0");

// 1 / d for a positive normal d on the FMA pipe: a bit-trick seed (relative error <= 5.1 %),
// one third-order step (x (1 + e + e^2), e = 1 - d x: error <= e^3) and one Newton step:
// within 0.78 ulp of 1/d over [1e-7, 1e7] (4M random d, every FMA rounded once), i.e. no
// less accurate than rcp.approx. An IADD and 5 FFMA.
__device__ __forceinline__ float rcp_fma(float d) {
    float x = __int_as_float(0x7EF311C3 - __float_as_int(d));
    float e = fmaf(-d, x, 1.f);
    x = fmaf(x, fmaf(e, e, e), x);
    e = fmaf(-d, x, 1.f);
    return fmaf(x, e, x);
}

// The steps as diagonal scalings: y = diag(a) K diag(b) with K = softmax + eps, so a step
// touches n scale factors, not n*n entries. Each factor is kept with its inverse
// (alpha = 1/a, beta = 1/b), since a row step's denominator divided by a_i is
//   alpha_i' = den_i / a_i = sum_j K_ij b_j + eps alpha_i,   a_i' = 1 / alpha_i'
// (columns alike): 5 FP32 instructions and one MUFU a factor, no multiply by the old
// factor (the same denominators as summing the scaled entries, up to rounding).
__device__ __forceinline__ void row_step(const float (&K)[NN], float (&a)[N], float (&al)[N], const float (&b)[N], float eps) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
        float s = eps * al[i];
#pragma unroll
        for (int j = 0; j < N; ++j) s = fmaf(K[i * N + j], b[j], s);
        al[i] = s;
    }
#pragma unroll
    for (int i = 0; i < N; ++i) a[i] = rcp(al[i]);
}

// RCPS_ON_FMA: how many of the last factors take rcp_fma instead of the MUFU.
template <int RCPS_ON_FMA = 0>
__device__ __forceinline__ void col_step(const float (&K)[NN], const float (&a)[N], float (&b)[N], float (&be)[N], float eps) {
#pragma unroll
    for (int j = 0; j < N; ++j) {
        float s = eps * be[j];
#pragma unroll
        for (int i = 0; i < N; ++i) s = fmaf(K[i * N + j], a[i], s);
        be[j] = s;
    }
#pragma unroll
    for (int i = 0; i < N; ++i) b[i] = i >= N - RCPS_ON_FMA ? rcp_fma(be[i]) : rcp(be[i]);
}

// One matrix in registers, x in, y out: the softmax, the steps, the final scaling.
__device__ __forceinline__ void sinkhorn_matrix(float (&K)[NN], const SinkhornParams& p) {
    // K = softmax over each row + eps.
#pragma unroll
    for (int i = 0; i < N; ++i) {
        float mx = K[i * N];
#pragma unroll
        for (int j = 1; j < N; ++j) mx = fmaxf(mx, K[i * N + j]);
        const float m2 = mx * kLog2e;
        float s = 0.f;
#pragma unroll
        for (int j = 0; j < N; ++j) {
            K[i * N + j] = softmax_exp(K[i * N + j], m2);
            s = __fadd_rn(s, K[i * N + j]);
        }
        const float inv = rcp(s);
        // z + eps as one FFMA.
#pragma unroll
        for (int j = 0; j < N; ++j) K[i * N + j] = fmaf(K[i * N + j], inv, p.eps);
    }

    float a[N], b[N], al[N], be[N];  // the factors and their inverses
#pragma unroll
    for (int i = 0; i < N; ++i) a[i] = 1.f, b[i] = 1.f, al[i] = 1.f, be[i] = 1.f;
    col_step(K, a, b, be, p.eps);
    int k = 1;
    if constexpr (FMA_RCPS > 0) {
        constexpr int kFmaRcps1 = (FMA_RCPS + 1) / 2 < N ? (FMA_RCPS + 1) / 2 : N;
        constexpr int kFmaRcps2 = FMA_RCPS / 2 < N ? FMA_RCPS / 2 : N;
        for (; k + 1 < p.repeat; k += 2) {
            row_step(K, a, al, b, p.eps);
            col_step<kFmaRcps1>(K, a, b, be, p.eps);
            row_step(K, a, al, b, p.eps);
            col_step<kFmaRcps2>(K, a, b, be, p.eps);
        }
    }
    for (; k < p.repeat; ++k) {
        row_step(K, a, al, b, p.eps);
        col_step(K, a, b, be, p.eps);
    }
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
        for (int j = 0; j < N; ++j) K[i * N + j] = __fmul_rn(__fmul_rn(K[i * N + j], a[i]), b[j]);
}

extern "C" __global__ void __launch_bounds__(256) sinkhorn_fwd(const SinkhornParams p) {
    const i64 m = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (m >= p.matrices) return;
    float K[NN];
    load_matrix<VEC>(p.x, p.x_layout, m, K);
    sinkhorn_matrix(K, p);
    store_matrix(p.out, m, K);
}
