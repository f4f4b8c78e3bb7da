// Q RMSNorm + partial interleaved RoPE, backward (SPEC.md section 5):
//   g'   = bf16(conjugate rotation of g's last R pairs)      (second rounding boundary)
//          (ga, gb) -> (ga cos_j + gb sin_j, gb cos_j - ga sin_j); other channels g' = g
//   xhat = x * rstd                                           (f32)
//   dx   = rstd * (g' - xhat * mean_c(g' * xhat))
// dx token-major [B,S,H,C] in x's dtype. One warp per row; dynamic shared memory: 2*C
// floats per warp (g, then x).
//
// dsv4-test-defines: QR_X_BF16=1 QR_G_BF16=1 QR_X_VEC=8 QR_G_VEC=8 QR_O_VEC=8
// dsv4-test-defines: QR_X_BF16=0 QR_G_BF16=0 QR_X_VEC=4 QR_G_VEC=4 QR_O_VEC=4
// dsv4-test-defines: QR_X_BF16=1 QR_G_BF16=0
// dsv4-test-defines: QR_X_BF16=1 QR_G_BF16=1 QR_X_VEC=8 QR_G_VEC=8 QR_O_VEC=8 QR_LPR=32 QR_CPL=1 QR_U=2
// dsv4-test-defines: QR_X_BF16=1 QR_G_BF16=1 QR_X_VEC=8 QR_G_VEC=8 QR_O_VEC=8 QR_LPR=1 QR_CPL=1 QR_U=2
// dsv4-test-defines: QR_X_BF16=1 QR_G_BF16=1 QR_X_VEC=8 QR_G_VEC=8 QR_O_VEC=8 QR_LPR=32 QR_CPL=4 QR_U=1
// dsv4-test-defines: QR_X_BF16=1 QR_G_BF16=1 QR_X_VEC=8 QR_G_VEC=8 QR_O_VEC=8 QR_LPR=32 QR_CPL=2 QR_U=1 QR_CS_VEC=1
// dsv4-test-defines: QR_X_BF16=1 QR_G_BF16=1 QR_X_VEC=8 QR_G_VEC=8 QR_O_VEC=8 QR_LPR=32 QR_CPL=2 QR_U=1
#include "qnorm_rope/qnorm_rope.cuh"

using namespace qnorm_rope;

// g'[c]: the conjugate rotation of channel c's pair, rounded at the boundary.
__device__ __forceinline__ float rotate_back(const float* g, i64 c, i64 rot0, const float* cs, const float* sn, i64 cstr, i64 sstr) {
    if (c < rot0) return g[c];
    const i64 j = (c - rot0) / 2, e = rot0 + 2 * j;
    const float ga = g[e], gb = g[e + 1];
    const float cj = cs[j * cstr], sj = sn[j * sstr];
    return ((c - rot0) % 2 == 0) ? boundary(__fadd_rn(__fmul_rn(ga, cj), __fmul_rn(gb, sj)))
                                 : boundary(__fsub_rn(__fmul_rn(gb, cj), __fmul_rn(ga, sj)));
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

#if QR_X_BF16 && QR_G_BF16
// Fast backward (bf16 x and grad, unit channel stride, 16-byte aligned rows and output):
// see the header. Persistent like the fast forward: lane group `gid` handles the row
// blocks gid, gid + groups, ... of QR_U rows, the next block's loads issued first.
extern "C" __global__ void __launch_bounds__(256, QR_BWD_MINB) qnorm_rope_bwd_fast(const QNormRopeParams p) {
    const int gl = threadIdx.x % QR_LPR;
    const i64 gid = ((i64)blockIdx.x * blockDim.x + threadIdx.x) / QR_LPR;
    const i64 groups = (i64)gridDim.x * blockDim.x / QR_LPR;
    const i64 n_rows = p.B * p.S * p.H, rot0 = p.C - p.R;
    const i64 n_blocks = (n_rows + QR_U - 1) / QR_U;
    const bool small = n_rows <= 0xffffffffll;
    const bf16* xs = static_cast<const bf16*>(p.x);
    const bf16* gs = static_cast<const bf16*>(p.grad);
    bf16* outs = static_cast<bf16*>(p.out);
    auto load = [&](i64 blk, uint4 (&xraw)[QR_U][QR_CPL], uint4 (&graw)[QR_U][QR_CPL], float (&rstd)[QR_U]) {
#pragma unroll
        for (int u = 0; u < QR_U; ++u) {
            const i64 r = blk * QR_U + u;
            const bool ok = r < n_rows;
            const RowIndex ix = row_index_fast(p, ok ? r : 0, small);
            const bf16* xr = xs + ix.b * p.x_stride[0] + ix.h * p.x_stride[1] + ix.s * p.x_stride[2];
            const bf16* gr = gs + ix.b * p.g_stride[0] + ix.h * p.g_stride[1] + ix.s * p.g_stride[2];
            rstd[u] = ok ? __ldg(p.rstd_in + r) : 0.f;
#pragma unroll
            for (int k = 0; k < QR_CPL; ++k) {
                const i64 c0 = 8 * (gl + (i64)QR_LPR * k);
                const bool in = ok && c0 < p.C;
                xraw[u][k] = in ? ld16(xr + c0) : make_uint4(0u, 0u, 0u, 0u);
                graw[u][k] = in ? ld16(gr + c0) : make_uint4(0u, 0u, 0u, 0u);
            }
        }
    };
    uint4 xraw[QR_U][QR_CPL], graw[QR_U][QR_CPL];
    float rstd[QR_U];
    load(gid, xraw, graw, rstd);
    for (i64 blk = gid; blk < n_blocks; blk += groups) {
        uint4 nxraw[QR_U][QR_CPL], ngraw[QR_U][QR_CPL];
        float nrstd[QR_U];
        load(blk + groups, nxraw, ngraw, nrstd);  // zeros past the end
#pragma unroll
        for (int u = 0; u < QR_U; ++u) {
            const i64 r = blk * QR_U + u;
            const RowIndex ix = row_index_fast(p, r < n_rows ? r : 0, small);  // recomputed: cheaper than holding it
            const float* cs = p.cos + ix.b * p.cos_stride[0] + ix.s * p.cos_stride[1];
            const float* sn = p.sin + ix.b * p.sin_stride[0] + ix.s * p.sin_stride[1];
            // g' = bf16(conjugate rotation of g's last R pairs), in place in gp.
            float gp[QR_CPL][8];
            float dot = 0.f;
#pragma unroll
            for (int k = 0; k < QR_CPL; ++k) {
                const i64 c0 = 8 * (gl + (i64)QR_LPR * k);
                unpack8(graw[u][k], gp[k]);
                if (r < n_rows && c0 < p.C && c0 + 8 > rot0) {
                    float cj[4], sj[4];
                    chunk_cos_sin(p, cs, sn, c0, rot0, cj, sj);
#pragma unroll
                    for (int i = 0; i < 8; i += 2) {
                        if (c0 + i < rot0) continue;
                        const float ga = gp[k][i], gb = gp[k][i + 1];
                        gp[k][i] = dsv4::round_bf16(__fadd_rn(__fmul_rn(ga, cj[i / 2]), __fmul_rn(gb, sj[i / 2])));
                        gp[k][i + 1] = dsv4::round_bf16(__fsub_rn(__fmul_rn(gb, cj[i / 2]), __fmul_rn(ga, sj[i / 2])));
                    }
                }
                float xv[8];
                unpack8(xraw[u][k], xv);
#pragma unroll
                for (int i = 0; i < 8; ++i) dot += gp[k][i] * xv[i] * rstd[u];  // mean_c(g' * xhat)
            }
            const float mean = dsv4::group_sum(dot, QR_LPR) / (float)p.C;
            if (r >= n_rows) continue;  // the whole group: r is the group's
            bf16* o = outs + r * p.C;
#pragma unroll
            for (int k = 0; k < QR_CPL; ++k) {
                const i64 c0 = 8 * (gl + (i64)QR_LPR * k);
                if (c0 >= p.C) continue;
                float xv[8], v[8];
                unpack8(xraw[u][k], xv);
#pragma unroll
                for (int i = 0; i < 8; ++i) v[i] = rstd[u] * (gp[k][i] - xv[i] * rstd[u] * mean);  // dx
                st16_cs(o + c0, v);
            }
        }
#pragma unroll
        for (int u = 0; u < QR_U; ++u) {
            rstd[u] = nrstd[u];
#pragma unroll
            for (int k = 0; k < QR_CPL; ++k) xraw[u][k] = nxraw[u][k], graw[u][k] = ngraw[u][k];
        }
    }
}
#endif
