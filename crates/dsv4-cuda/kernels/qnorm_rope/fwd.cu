// Q RMSNorm + partial interleaved RoPE, forward (SPEC.md section 5):
//   rstd = 1 / sqrt(mean_c x^2 + eps)
//   y    = bf16(x * rstd)                                   (first rounding boundary)
//   last R channels, pairs (a, b) = (y[2j], y[2j+1]) of the rotated block:
//     (a, b) -> bf16(a cos_j - b sin_j), bf16(a sin_j + b cos_j)
// Output token-major [B,S,H,C]; rstd saved token-major [B*S*H].
// One warp per row; dynamic shared memory: C floats per warp. The fast kernel for bf16 rows
// is fwd_fast.cu (see qnorm_rope.cuh).
//
// Defines: QR_X_BF16 (x's and the output's dtype: 1 bf16, 0 f32; the two bf16 rounding
// boundaries of SPEC section 5 apply when x is bf16); QR_X_VEC, QR_O_VEC (elements per
// access of x and of the output: 16 bytes' worth where the launcher checked unit channel
// stride and 16-byte aligned rows, else 1).
#include "qnorm_rope/qnorm_rope.cuh"

using namespace qnorm_rope;

constexpr bool X_BF16 = QR_X_BF16 != 0;
using X = Elem<X_BF16>::T;

extern "C" __global__ void __launch_bounds__(256) qnorm_rope_fwd(const QNormRopeParams p) {
    extern __shared__ float rows[];                       // [warps][C]
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    float* y = rows + (i64)warp * p.C;
    const i64 n_rows = p.B * p.S * p.H, rot0 = p.C - p.R;
    const X* xs = static_cast<const X*>(p.x);
    X* outs = static_cast<X*>(p.out);
    for (i64 r = (i64)blockIdx.x * warps + warp; r < n_rows; r += (i64)gridDim.x * warps) {
        const RowIndex ix = row_index(p, r);
        const X* xr = xs + ix.b * p.x_stride[0] + ix.h * p.x_stride[1] + ix.s * p.x_stride[2];
        // sum_c x^2, staging x in shared memory.
        float ss = 0.f;
        for (i64 c0 = lane * QR_X_VEC; c0 < p.C; c0 += 32 * QR_X_VEC) {
            float v[QR_X_VEC];
            load_chunk<QR_X_VEC>(xr, c0, p.x_stride[3], v);
#pragma unroll
            for (int i = 0; i < QR_X_VEC; ++i) {
                y[c0 + i] = v[i];
                ss += v[i] * v[i];
            }
        }
        ss = dsv4::warp_sum(ss);
        const float rstd = 1.f / sqrtf(ss / (float)p.C + p.eps);
        if (lane == 0) p.rstd_out[r] = rstd;
        // y = bf16(x * rstd): each lane rescales the channels it staged.
        for (i64 c0 = lane * QR_X_VEC; c0 < p.C; c0 += 32 * QR_X_VEC) {
#pragma unroll
            for (int i = 0; i < QR_X_VEC; ++i) y[c0 + i] = boundary<X_BF16>(y[c0 + i] * rstd);
        }
        __syncwarp();
        // Rotate the pairs of the last R channels; store the row token-major.
        const float* cs = p.cos + ix.b * p.cos_stride[0] + ix.s * p.cos_stride[1];
        const float* sn = p.sin + ix.b * p.sin_stride[0] + ix.s * p.sin_stride[1];
        X* o = outs + r * p.C;
        for (i64 c0 = lane * QR_O_VEC; c0 < p.C; c0 += 32 * QR_O_VEC) {
            float v[QR_O_VEC];
#pragma unroll
            for (int i = 0; i < QR_O_VEC; ++i) {
                const i64 c = c0 + i;
                if (c < rot0) {
                    v[i] = y[c];
                } else {
                    const i64 j = (c - rot0) / 2, e = rot0 + 2 * j;
                    const float a = y[e], b = y[e + 1];
                    const float cj = cs[j * p.cos_stride[2]], sj = sn[j * p.sin_stride[2]];
                    // even: a cos - b sin; odd: a sin + b cos (no FMA contraction: the
                    // products round separately, as in the reference)
                    v[i] = ((c - rot0) % 2 == 0) ? boundary<X_BF16>(__fsub_rn(__fmul_rn(a, cj), __fmul_rn(b, sj)))
                                                 : boundary<X_BF16>(__fadd_rn(__fmul_rn(a, sj), __fmul_rn(b, cj)));
                }
            }
            store_chunk<QR_O_VEC>(o, c0, v);
        }
        __syncwarp();  // the next row reuses this warp's staging buffer
    }
}
