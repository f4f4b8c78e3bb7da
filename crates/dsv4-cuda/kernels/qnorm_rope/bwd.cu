// Q RMSNorm + partial interleaved RoPE, backward (SPEC.md section 5):
//   g'   = bf16(conjugate rotation of g's last R pairs)      (second rounding boundary)
//          (ga, gb) -> (ga cos_j + gb sin_j, gb cos_j - ga sin_j); other channels g' = g
//   xhat = x * rstd                                           (f32)
//   dx   = rstd * (g' - xhat * mean_c(g' * xhat))
// dx token-major [B,S,H,C] in x's dtype. One warp per row; dynamic shared memory: 2*C
// floats per warp (g, then x). The fast kernel for bf16 rows is bwd_fast.cu (see
// qnorm_rope.cuh).
//
// Defines: QR_X_BF16, QR_G_BF16 (x's and grad's dtypes: 1 bf16, 0 f32; dx takes x's);
// QR_X_VEC, QR_G_VEC, QR_O_VEC (elements per access of x, grad and dx: 16 bytes' worth where
// the launcher checked unit channel stride and 16-byte aligned rows, else 1).
#include "qnorm_rope/qnorm_rope.cuh"

using namespace qnorm_rope;

constexpr bool X_BF16 = QR_X_BF16 != 0;
using X = Elem<X_BF16>::T;
using Gt = Elem<QR_G_BF16 != 0>::T;

// g'[c]: the conjugate rotation of channel c's pair, rounded at the boundary.
__device__ __forceinline__ float rotate_back(const float* g, i64 c, i64 rot0, const float* cs, const float* sn, i64 cstr, i64 sstr) {
    if (c < rot0) return g[c];
    const i64 j = (c - rot0) / 2, e = rot0 + 2 * j;
    const float ga = g[e], gb = g[e + 1];
    const float cj = cs[j * cstr], sj = sn[j * sstr];
    return ((c - rot0) % 2 == 0) ? boundary<X_BF16>(__fadd_rn(__fmul_rn(ga, cj), __fmul_rn(gb, sj)))
                                 : boundary<X_BF16>(__fsub_rn(__fmul_rn(gb, cj), __fmul_rn(ga, sj)));
}

extern "C" __global__ void __launch_bounds__(256) qnorm_rope_bwd(const QNormRopeParams p) {
    extern __shared__ float rows[];                       // [warps][2][C]
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    float* g = rows + (i64)warp * 2 * p.C;
    float* x = g + p.C;
    const i64 n_rows = p.B * p.S * p.H, rot0 = p.C - p.R;
    const X* xs = static_cast<const X*>(p.x);
    const Gt* gs = static_cast<const Gt*>(p.grad);
    X* outs = static_cast<X*>(p.out);
    for (i64 r = (i64)blockIdx.x * warps + warp; r < n_rows; r += (i64)gridDim.x * warps) {
        const RowIndex ix = row_index(p, r);
        const Gt* gr = gs + ix.b * p.g_stride[0] + ix.h * p.g_stride[1] + ix.s * p.g_stride[2];
        const X* xr = xs + ix.b * p.x_stride[0] + ix.h * p.x_stride[1] + ix.s * p.x_stride[2];
        for (i64 c0 = lane * QR_G_VEC; c0 < p.C; c0 += 32 * QR_G_VEC) {
            float v[QR_G_VEC];
            load_chunk<QR_G_VEC>(gr, c0, p.g_stride[3], v);
#pragma unroll
            for (int i = 0; i < QR_G_VEC; ++i) g[c0 + i] = v[i];
        }
        for (i64 c0 = lane * QR_X_VEC; c0 < p.C; c0 += 32 * QR_X_VEC) {
            float v[QR_X_VEC];
            load_chunk<QR_X_VEC>(xr, c0, p.x_stride[3], v);
#pragma unroll
            for (int i = 0; i < QR_X_VEC; ++i) x[c0 + i] = v[i];
        }
        __syncwarp();
        const float rstd = p.rstd_in[r];
        const float* cs = p.cos + ix.b * p.cos_stride[0] + ix.s * p.cos_stride[1];
        const float* sn = p.sin + ix.b * p.sin_stride[0] + ix.s * p.sin_stride[1];
        // mean_c(g' * xhat), xhat = x * rstd
        float dot = 0.f;
        for (i64 c = lane; c < p.C; c += 32) dot += rotate_back(g, c, rot0, cs, sn, p.cos_stride[2], p.sin_stride[2]) * x[c] * rstd;
        const float mean = dsv4::warp_sum(dot) / (float)p.C;
        // dx = rstd * (g' - xhat * mean)
        X* o = outs + r * p.C;
        for (i64 c0 = lane * QR_O_VEC; c0 < p.C; c0 += 32 * QR_O_VEC) {
            float v[QR_O_VEC];
#pragma unroll
            for (int i = 0; i < QR_O_VEC; ++i) {
                const i64 c = c0 + i;
                const float gp = rotate_back(g, c, rot0, cs, sn, p.cos_stride[2], p.sin_stride[2]);
                v[i] = rstd * (gp - x[c] * rstd * mean);
            }
            store_chunk<QR_O_VEC>(o, c0, v);
        }
        __syncwarp();  // the next row reuses this warp's staging buffers
    }
}
