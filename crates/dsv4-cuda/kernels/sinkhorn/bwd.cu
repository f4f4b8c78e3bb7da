// Sinkhorn backward (SPEC.md section 4), in f64: the backward of 2*repeat - 1 steps is
// ill-conditioned enough (the softmax and the converged normalisations cancel most of
// dout) that any f32 evaluation, the f32 CPU reference included, lands ~3e-5 of the row
// scale away from the exact result on 65k random matrices; f64 keeps it below 1e-9 (any
// f32 stage, the softmax included, misses the per-row 1e-5 bound:
// research/sinkhorn_bwd_emulate.py).
//
// One thread per matrix. Recompute the forward from x (f64), storing a few numbers per
// step in shared memory, laid out [entry][thread] (consecutive threads, consecutive
// 8-byte words: conflict-free), then walk the steps in reverse. Two kernels by n:
//
// n <= 6: scaled-gradient sweep. The forward runs on scale factors,
//   y = diag(a) K diag(b) with K = softmax + eps, keeping alpha = 1/a and beta = 1/b:
//     rows: alpha_i = sum_j K_ij b_j + eps alpha_i (= den_i / a_i), a_i = 1 / alpha_i
//   The reverse walks gt = dL/dy * (a b^T) (= h / K with h = y * dL/dy), for which a
//   step's reverse has no division:
//     rows:  H_i = sum_j K_ij gt_ij,  gt -= (a * H) b^T
//     cols:  C_j = sum_i K_ij gt_ij,  gt -= a (b * C)^T
//   gt starts as dout * (a b^T) and ends as dL/dy0 (a = b = 1 before step 0). Per step
//   ~64 f64 instructions and 4 MUFU.RCP64H at n = 4. Reciprocals: one Newton step (error
//   ~1e-12; the result moves by ~1e-9 of the row scale).
//   Checkpoints: the tape holds the forward state (al, be: all a row and a column step
//   read besides K) before every SINKHORN_BWD_CKPT_PAIRS = P (row, column) pairs, 2n
//   doubles per group, ceil((repeat-1)/P) groups; the reverse recomputes a group's factors
//   from its checkpoint into registers with the forward's own operations (bitwise the
//   same factors) and reverses the group from them: one more forward step per reversed
//   step, for a tape about P times smaller than a factor per step, so more warps an SM.
//   The first group is the short one and the last group's factors stay in registers from
//   the forward pass (not recomputed). The launcher picks P and sizes the tape.
//   research/sinkhorn_bwd_ckpt_emulate.py checks the indexing (bitwise equal factors).
//
// n >= 7: the tape holds each step's n denominators, and the matrix v lives in shared
// memory too ([e][thread], after the tape): v and g together would not fit in registers.
//   step k:   v = u / den                        (v: the step's output)
//   reverse:  g <- (g - sums of g*v along the axis) / den
//             u  = v * den                        (the step's input, reconstructed)
//   softmax:  dx = z * (g - sum_j g_j z_j),  z = y0 - eps   (y0 = z + eps, so dz = g)
// The reconstruction error is a random walk of ~1 f64 ulp per step.
//
// Defines: those of sinkhorn.cuh; SINKHORN_DVEC (1: dout is contiguous and 16-byte
// aligned, float4 loads; 0: strided); SINKHORN_BWD_CKPT_PAIRS = P >= 1 (n <= 6, above).
#include "sinkhorn/sinkhorn.cuh"

using namespace sinkhorn;

constexpr bool DVEC = SINKHORN_DVEC != 0;
static_assert(!DVEC || NN % 4 == 0, "SINKHORN_DVEC needs n*n to be a multiple of 4");
static_assert(SINKHORN_BWD_CKPT_PAIRS >= 1, "SINKHORN_BWD_CKPT_PAIRS must be >= 1");

// Element (i, j) of a step: a = the denominator's index (i for rows, j for columns),
// b = the summed index.
template <bool ROWS> __device__ __forceinline__ int at(int a, int b) { return ROWS ? a * N + b : b * N + a; }

// y0 = softmax(x) + eps in f64 (x: matrix m of p.x), into y(e) for e = i*N + j (a
// register array or the shared-memory matrix of the n >= 7 kernel).
template <class Y> __device__ __forceinline__ void softmax_eps_f64(const SinkhornParams& p, i64 m, double eps, Y&& y) {
    float x[NN];
    load_matrix<VEC>(p.x, p.x_layout, m, x);
#pragma unroll
    for (int i = 0; i < N; ++i) {
        float mx = x[i * N];
#pragma unroll
        for (int j = 1; j < N; ++j) mx = fmaxf(mx, x[i * N + j]);
        double s = 0.0;
#pragma unroll
        for (int j = 0; j < N; ++j) {
            const double e = exp((double)x[i * N + j] - (double)mx);
            y(i * N + j) = e;
            s += e;
        }
        const double inv = 1.0 / s;
#pragma unroll
        for (int j = 0; j < N; ++j) y(i * N + j) = y(i * N + j) * inv + eps;
    }
}

#if SINKHORN_N <= 6
// 1 / d for a normal positive d: MUFU.RCP64H refined by one Newton step.
__device__ __forceinline__ double rcp(double d) {
    double r;
    asm("rcp.approx.ftz.f64 %0, %1;" : "=d"(r) : "d"(d));
    return fma(r, fma(-d, r, 1.0), r);
}

// Reverse of a step with factors (a, b) after it: S_e = sum_k K gt along the axis;
// rows: gt_ij -= (a_i S_i) b_j; columns: gt_ij -= a_i (b_j S_j).
template <bool ROWS>
__device__ __forceinline__ void scaled_bwd_step(const double (&K)[NN], double (&gt)[NN], const double (&a)[N], const double (&b)[N]) {
#pragma unroll
    for (int e = 0; e < N; ++e) {
        double s = 0.0;
#pragma unroll
        for (int k = 0; k < N; ++k) s = fma(K[at<ROWS>(e, k)], gt[at<ROWS>(e, k)], s);
        const double c = (ROWS ? a[e] : b[e]) * s;
#pragma unroll
        for (int k = 0; k < N; ++k) gt[at<ROWS>(e, k)] = fma(-c, ROWS ? b[k] : a[k], gt[at<ROWS>(e, k)]);
    }
}

// Forward step on the factors: rows (ROWS) al_i = sum_j K_ij b_j + eps al_i, a_i = 1/al_i;
// columns alike with (b, be) from a.
template <bool ROWS>
__device__ __forceinline__ void scaled_fwd_step(const double (&K)[NN], double (&f)[N], double (&inv_f)[N], const double (&other)[N], double eps) {
#pragma unroll
    for (int e = 0; e < N; ++e) {
        double s = eps * inv_f[e];
#pragma unroll
        for (int k = 0; k < N; ++k) s = fma(K[at<ROWS>(e, k)], other[k], s);
        inv_f[e] = s;
        f[e] = rcp(s);
    }
}

extern "C" __global__ void __launch_bounds__(128) sinkhorn_bwd(const SinkhornParams p) {
    // tape [groups][2][N][T]: (al, be) before each group of (row, column) pairs (steps
    // 2r-1, 2r for pair r = 1 .. repeat-1), G = ceil((repeat-1) / P) groups: group 0 takes
    // the remainder (first0 = 1 + (repeat-1) - (G-1)P is group 1's first pair), the others
    // P pairs each. The last group's factors stay in registers from the forward, so the
    // reverse recomputes only the G - 1 groups before it.
    constexpr int P = SINKHORN_BWD_CKPT_PAIRS;
    extern __shared__ double smem[];
    const int T = blockDim.x, t = threadIdx.x;
    const i64 m = (i64)blockIdx.x * T + t;
    if (m >= p.matrices) return;  // no block-wide synchronisation below
    double* tape = smem + t;
    const i64 ckpt = (i64)2 * N * T;  // one checkpoint's slice of the tape
    const double eps = (double)p.eps;
    const int G = (p.repeat - 1 + P - 1) / P;
    const int first0 = 1 + (p.repeat - 1) - (G - 1) * P;  // group g >= 1 starts at first0 + (g-1) P
    double K[NN];
    softmax_eps_f64(p, m, eps, [&](int e) -> double& { return K[e]; });
    // Forward: step 0 (columns), then (rows, columns) repeat - 1 times, storing (al, be)
    // before every group.
    double a[N], b[N], al[N], be[N];
    double A[P][N], B[P][N];  // a and b set by pair q of a group (row, column steps)
#pragma unroll
    for (int e = 0; e < N; ++e) a[e] = 1.0, b[e] = 1.0, al[e] = 1.0, be[e] = 1.0;
    scaled_fwd_step<false>(K, b, be, a, eps);
    for (int g = 0, r = 1; g < G; ++g) {
        double* c = tape + g * ckpt;
#pragma unroll
        for (int e = 0; e < N; ++e) c[e * T] = al[e], c[(N + e) * T] = be[e];
        if (g == G - 1) break;  // the last group: below, into A and B
        for (const int end = g == 0 ? first0 : first0 + g * P; r < end; ++r) {
            scaled_fwd_step<true>(K, a, al, b, eps);
            scaled_fwd_step<false>(K, b, be, a, eps);
        }
    }
    // The last group (P pairs, or repeat - 1 < P), its factors kept for the reverse.
    if (G > 0) {
        const int pairs = G == 1 ? p.repeat - 1 : P;
#pragma unroll
        for (int q = 0; q < P; ++q) {
            if (q < pairs) {
                scaled_fwd_step<true>(K, A[q], al, q ? B[q - 1] : b, eps);
                scaled_fwd_step<false>(K, B[q], be, A[q], eps);
#pragma unroll
                for (int e = 0; e < N; ++e) a[e] = A[q][e], b[e] = B[q][e];
            }
        }
    }
    double gt[NN];
    {
        float d[NN];
        load_matrix<DVEC>(p.dout, p.dout_layout, m, d);
#pragma unroll
        for (int i = 0; i < N; ++i)
#pragma unroll
            for (int j = 0; j < N; ++j) gt[i * N + j] = (double)d[i * N + j] * a[i] * b[j];
    }
    // Reverse, group by group from the last: recompute the group's factors from its
    // checkpoint (A[q], B[q]; b: the b before the group; the last group's are already
    // there), then reverse its pairs: column step with (A[q], B[q]), row step with (A[q],
    // B[q-1] or b). b ends as the b step 0 set (the final b if repeat = 1). (The group's
    // recompute and the forward's last group are the same loop written twice: one device
    // function for both took ptxas to 232 registers and a stack frame.)
    for (int g = G - 1; g >= 0; --g) {
        const int start = g == 0 ? 1 : first0 + (g - 1) * P;
        const int pairs = (g == 0 ? first0 : first0 + g * P) - start;
        const double* c = tape + g * ckpt;
#pragma unroll
        for (int e = 0; e < N; ++e) al[e] = c[e * T], be[e] = c[(N + e) * T], b[e] = rcp(be[e]);
        if (g != G - 1) {
#pragma unroll
            for (int q = 0; q < P; ++q) {
                if (q < pairs) {
                    scaled_fwd_step<true>(K, A[q], al, q ? B[q - 1] : b, eps);
                    scaled_fwd_step<false>(K, B[q], be, A[q], eps);
                }
            }
        }
#pragma unroll
        for (int q = P - 1; q >= 0; --q) {
            if (q < pairs) {
                scaled_bwd_step<false>(K, gt, A[q], B[q]);
                scaled_bwd_step<true>(K, gt, A[q], q ? B[q - 1] : b);
            }
        }
    }
#pragma unroll
    for (int e = 0; e < N; ++e) a[e] = 1.0;
    scaled_bwd_step<false>(K, gt, a, b);  // step 0: a = 1, b = the b it set
    // Softmax over each row: dx = z * (g - <g, z>), z = K - eps, g = gt.
    float dx[NN];
#pragma unroll
    for (int i = 0; i < N; ++i) {
        double z[N];
        double s = 0.0;
#pragma unroll
        for (int j = 0; j < N; ++j) {
            z[j] = K[i * N + j] - eps;
            s = fma(gt[i * N + j], z[j], s);
        }
#pragma unroll
        for (int j = 0; j < N; ++j) dx[i * N + j] = (float)(z[j] * (gt[i * N + j] - s));
    }
    store_matrix(p.out, m, dx);
}
#else  // n >= 7

// v in shared memory, this thread's column of a [NN][blockDim.x] array.
struct VMat {
    double* p;
    int stride;
    __device__ __forceinline__ double& operator()(int e) { return p[e * stride]; }
};

// 1 / d for a normal positive d: the hardware approximation (MUFU.RCP64H, ~20 bits or
// better) refined by two Newton steps (error squared each time: below an f64 ulp or so),
// no slow path. The forward recompute and the backward invert the same d the same way.
__device__ __forceinline__ double rcp(double d) {
    double r;
    asm("rcp.approx.ftz.f64 %0, %1;" : "=d"(r) : "d"(d));
    r = fma(r, fma(-d, r, 1.0), r);
    return fma(r, fma(-d, r, 1.0), r);
}

// Forward step: v /= (sums along the axis + eps); records the denominators in tape[a*T].
template <bool ROWS> __device__ __forceinline__ void fwd_step(VMat& v, double eps, double* tape, int T) {
#pragma unroll
    for (int a = 0; a < N; ++a) {
        double d = eps;
#pragma unroll
        for (int b = 0; b < N; ++b) d = __dadd_rn(d, v(at<ROWS>(a, b)));
        tape[a * T] = d;
        const double inv = rcp(d);
#pragma unroll
        for (int b = 0; b < N; ++b) v(at<ROWS>(a, b)) = __dmul_rn(v(at<ROWS>(a, b)), inv);
    }
}

// Reverse of one step: g <- (g - <g, v>_axis) / den, then v <- v * den (the step's input).
template <bool ROWS> __device__ __forceinline__ void bwd_step(VMat& v, double (&g)[NN], const double* tape, int T) {
#pragma unroll
    for (int a = 0; a < N; ++a) {
        const double d = tape[a * T];
        const double inv = rcp(d);
        double dot = 0.0;
#pragma unroll
        for (int b = 0; b < N; ++b) dot = fma(g[at<ROWS>(a, b)], v(at<ROWS>(a, b)), dot);
#pragma unroll
        for (int b = 0; b < N; ++b) {
            const int e = at<ROWS>(a, b);
            g[e] = (g[e] - dot) * inv;
            v(e) = v(e) * d;
        }
    }
}

extern "C" __global__ void __launch_bounds__(128) sinkhorn_bwd(const SinkhornParams p) {
    extern __shared__ double smem[];  // tape [2*repeat-1][N][T], then v [NN][T]
    const int T = blockDim.x, t = threadIdx.x;
    const i64 m = (i64)blockIdx.x * T + t;
    if (m >= p.matrices) return;  // no block-wide synchronisation below
    double* tape = smem + t;
    const double eps = (double)p.eps;
    VMat v;
    v.p = smem + (i64)(2 * p.repeat - 1) * N * T + t;
    v.stride = T;
    // y0 = softmax(x) + eps, in f64.
    softmax_eps_f64(p, m, eps, v);
    // Forward: step 0 (columns), then (rows, columns) repeat - 1 times.
    fwd_step<false>(v, eps, tape, T);
    for (int r = 1; r < p.repeat; ++r) {
        fwd_step<true>(v, eps, tape + (i64)(2 * r - 1) * N * T, T);
        fwd_step<false>(v, eps, tape + (i64)(2 * r) * N * T, T);
    }
    double g[NN];
    {
        float d[NN];
        load_matrix<DVEC>(p.dout, p.dout_layout, m, d);
#pragma unroll
        for (int e = 0; e < NN; ++e) g[e] = (double)d[e];
    }
    for (int r = p.repeat - 1; r >= 1; --r) {
        bwd_step<false>(v, g, tape + (i64)(2 * r) * N * T, T);
        bwd_step<true>(v, g, tape + (i64)(2 * r - 1) * N * T, T);
    }
    bwd_step<false>(v, g, tape, T);
    // Softmax over each row: dx = z * (g - <g, z>), z = y0 - eps.
    float dx[NN];
#pragma unroll
    for (int i = 0; i < N; ++i) {
        double z[N];
        double s = 0.0;
#pragma unroll
        for (int j = 0; j < N; ++j) {
            z[j] = v(i * N + j) - eps;
            s = fma(g[i * N + j], z[j], s);
        }
#pragma unroll
        for (int j = 0; j < N; ++j) dx[i * N + j] = (float)(z[j] * (g[i * N + j] - s));
    }
    store_matrix(p.out, m, dx);
}
#endif
