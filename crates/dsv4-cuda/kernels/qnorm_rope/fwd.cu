// Q RMSNorm + partial interleaved RoPE, forward (SPEC.md section 5):
//   rstd = 1 / sqrt(mean_c x^2 + eps)
//   y    = bf16(x * rstd)                                   (first rounding boundary)
//   last R channels, pairs (a, b) = (y[2j], y[2j+1]) of the rotated block:
//     (a, b) -> bf16(a cos_j - b sin_j), bf16(a sin_j + b cos_j)
// Output token-major [B,S,H,C]; rstd saved token-major [B*S*H].
// Generic kernel: one warp per row; dynamic shared memory: C floats per warp. The fast
// kernel (below): see qnorm_rope.cuh.
//
// dsv4-test-defines: QR_X_BF16=1 QR_X_VEC=8 QR_O_VEC=8
// dsv4-test-defines: QR_X_BF16=0 QR_X_VEC=4 QR_O_VEC=4
// dsv4-test-defines: QR_X_BF16=0
// dsv4-test-defines: QR_X_BF16=1 QR_X_VEC=8 QR_O_VEC=8 QR_LPR=32 QR_CPL=1 QR_U=4
// dsv4-test-defines: QR_X_BF16=1 QR_X_VEC=8 QR_O_VEC=8 QR_LPR=1 QR_CPL=1 QR_U=4
// dsv4-test-defines: QR_X_BF16=1 QR_X_VEC=8 QR_O_VEC=8 QR_LPR=8 QR_CPL=1 QR_U=4
// dsv4-test-defines: QR_X_BF16=1 QR_X_VEC=8 QR_O_VEC=8 QR_LPR=32 QR_CPL=3 QR_U=2
// dsv4-test-defines: QR_X_BF16=1 QR_X_VEC=8 QR_O_VEC=8 QR_LPR=32 QR_CPL=4 QR_U=2
// dsv4-test-defines: QR_X_BF16=1 QR_X_VEC=8 QR_O_VEC=8 QR_LPR=32 QR_CPL=2 QR_U=4
// dsv4-test-defines: QR_X_BF16=1 QR_X_VEC=8 QR_O_VEC=8 QR_LPR=32 QR_CPL=2 QR_U=4 QR_CS_VEC=1
#include "qnorm_rope/qnorm_rope.cuh"

using namespace qnorm_rope;

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
            for (int i = 0; i < QR_X_VEC; ++i) y[c0 + i] = boundary(y[c0 + i] * rstd);
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
                    v[i] = ((c - rot0) % 2 == 0) ? boundary(__fsub_rn(__fmul_rn(a, cj), __fmul_rn(b, sj)))
                                                 : boundary(__fadd_rn(__fmul_rn(a, sj), __fmul_rn(b, cj)));
                }
            }
            store_chunk<QR_O_VEC>(o, c0, v);
        }
        __syncwarp();  // the next row reuses this warp's staging buffer
    }
}

#if QR_X_BF16
// Fast forward (bf16 x, unit channel stride, 16-byte aligned rows and output): see the
// header. Lane group `gid` (QR_LPR lanes) handles the one row block gid (QR_U rows, 4 at
// C = 512, chosen by the launcher), every 16-byte load of the block issued before any use;
// the grid holds every block (not persistent), so a finished block's SM slot refills with
// fresh loads.
extern "C" __global__ void __launch_bounds__(256, 4) qnorm_rope_fwd_fast(const QNormRopeParams p) {
    const int gl = threadIdx.x % QR_LPR;
    const i64 gid = ((i64)blockIdx.x * blockDim.x + threadIdx.x) / QR_LPR;
    const i64 n_rows = p.B * p.S * p.H, rot0 = p.C - p.R;
    const bool small = n_rows <= 0xffffffffll;
    const bf16* xs = static_cast<const bf16*>(p.x);
    uint4 raw[QR_U][QR_CPL];  // [row of the block][chunk], zeros past the end
#pragma unroll
    for (int u = 0; u < QR_U; ++u) {
        const i64 r = gid * QR_U + u;
        const RowIndex ix = row_index_fast(p, r < n_rows ? r : 0, small);
        const bf16* xr = xs + ix.b * p.x_stride[0] + ix.h * p.x_stride[1] + ix.s * p.x_stride[2];
#pragma unroll
        for (int k = 0; k < QR_CPL; ++k) {
            const i64 c0 = 8 * (gl + (i64)QR_LPR * k);
            raw[u][k] = (r < n_rows && c0 < p.C) ? ld16(xr + c0) : make_uint4(0u, 0u, 0u, 0u);
        }
    }
#pragma unroll
    for (int u = 0; u < QR_U; ++u) fwd_row(p, gid * QR_U + u, n_rows, rot0, small, gl, raw[u]);
}
#endif
