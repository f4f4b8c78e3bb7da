// Q RMSNorm + partial interleaved RoPE, backward (SPEC.md section 5):
//   g'   = bf16(conjugate rotation of g's last R pairs)      (second rounding boundary)
//          (ga, gb) -> (ga cos_j + gb sin_j, gb cos_j - ga sin_j); other channels g' = g
//   xhat = x * rstd                                           (f32)
//   dx   = rstd * (g' - xhat * mean_c(g' * xhat))
// dx token-major [B,S,H,C] in x's dtype. Generic kernel: one warp per row; dynamic shared
// memory: 2*C floats per warp (g, then x). The fast kernel (below): see qnorm_rope.cuh.
//
// dsv4-test-defines: QR_X_BF16=1 QR_G_BF16=1 QR_X_VEC=8 QR_G_VEC=8 QR_O_VEC=8
// dsv4-test-defines: QR_X_BF16=0 QR_G_BF16=0 QR_X_VEC=4 QR_G_VEC=4 QR_O_VEC=4
// dsv4-test-defines: QR_X_BF16=1 QR_G_BF16=0
// dsv4-test-defines: QR_X_BF16=1 QR_G_BF16=1 QR_X_VEC=8 QR_G_VEC=8 QR_O_VEC=8 QR_LPR=32 QR_CPL=1 QR_U=1
// dsv4-test-defines: QR_X_BF16=1 QR_G_BF16=1 QR_X_VEC=8 QR_G_VEC=8 QR_O_VEC=8 QR_LPR=1 QR_CPL=1 QR_U=1
// dsv4-test-defines: QR_X_BF16=1 QR_G_BF16=1 QR_X_VEC=8 QR_G_VEC=8 QR_O_VEC=8 QR_LPR=8 QR_CPL=1 QR_U=1
// dsv4-test-defines: QR_X_BF16=1 QR_G_BF16=1 QR_X_VEC=8 QR_G_VEC=8 QR_O_VEC=8 QR_LPR=32 QR_CPL=2 QR_U=1
// dsv4-test-defines: QR_X_BF16=1 QR_G_BF16=1 QR_X_VEC=8 QR_G_VEC=8 QR_O_VEC=8 QR_LPR=32 QR_CPL=2 QR_U=1 QR_CS_VEC=1
// dsv4-test-defines: QR_X_BF16=1 QR_G_BF16=1 QR_X_VEC=8 QR_G_VEC=8 QR_O_VEC=8 QR_LPR=32 QR_CPL=3 QR_U=1
// dsv4-test-defines: QR_X_BF16=1 QR_G_BF16=1 QR_X_VEC=8 QR_G_VEC=8 QR_O_VEC=8 QR_LPR=32 QR_CPL=4 QR_U=1
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
// see the header. Persistent: lane group `gid` (QR_LPR lanes) handles the row blocks gid,
// gid + groups, ... of QR_U rows; x and grad rows travel through a ring of QR_STAGES row
// blocks in shared memory (QR_STAGES - 1 blocks per lane group in flight, no registers
// held: 3 x 2 KiB per warp at C = 512, QR_U = 1), each lane copying its own 16-byte chunks
// by cp.async and reading back only those (per-thread cp.async groups order them: no
// barrier); each lane also copies rstd of the block's rows into its own slot by a 4-byte
// cp.async. Dynamic shared memory: rows [warps][QR_STAGES][QR_U][x, grad][QR_CPL][32
// lanes] x 16 bytes, then rstd [warps][QR_STAGES][QR_U][32 lanes] f32.
extern "C" __global__ void __launch_bounds__(256, QR_BWD_MINB) qnorm_rope_bwd_fast(const QNormRopeParams p) {
    extern __shared__ __align__(128) unsigned char ring_smem[];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, gl = threadIdx.x % QR_LPR;
    const i64 gid = ((i64)blockIdx.x * blockDim.x + threadIdx.x) / QR_LPR;
    const i64 groups = (i64)gridDim.x * blockDim.x / QR_LPR;
    const i64 n_rows = p.B * p.S * p.H, rot0 = p.C - p.R;
    const i64 n_blocks = (n_rows + QR_U - 1) / QR_U;
    const bool small = n_rows <= 0xffffffffll;
    const bf16* xs = static_cast<const bf16*>(p.x);
    const bf16* gs = static_cast<const bf16*>(p.grad);
    const int warps = blockDim.x / 32;
    // This lane's slot of (stage s, row u, tensor t: 0 x / 1 grad, chunk k), and of rstd.
    const u32 ring = smem_addr(ring_smem) + (u32)(warp * QR_STAGES * QR_U * 2 * QR_CPL * 32 + lane) * 16;
    const u32 rs = smem_addr(ring_smem) + (u32)(warps * QR_STAGES * QR_U * 2 * QR_CPL * 32) * 16 + (u32)(warp * QR_STAGES * QR_U * 32 + lane) * 4;
    auto slot = [&](int s, int u, int t, int k) { return ring + (u32)((((s * QR_U + u) * 2 + t) * QR_CPL + k) * 32 * 16); };
    auto issue = [&](i64 blk, int s) {
#pragma unroll
        for (int u = 0; u < QR_U; ++u) {
            const i64 r = blk * QR_U + u;
            const bool ok = r < n_rows;
            const RowIndex ix = row_index_fast(p, ok ? r : 0, small);
            const bf16* xr = xs + ix.b * p.x_stride[0] + ix.h * p.x_stride[1] + ix.s * p.x_stride[2];
            const bf16* gr = gs + ix.b * p.g_stride[0] + ix.h * p.g_stride[1] + ix.s * p.g_stride[2];
            cp_async4(rs + (s * QR_U + u) * 32 * 4, ok ? p.rstd_in + r : p.rstd_in, ok);
#pragma unroll
            for (int k = 0; k < QR_CPL; ++k) {
                const i64 c0 = 8 * (gl + (i64)QR_LPR * k);
                const bool in = ok && c0 < p.C;
                cp_async16(slot(s, u, 0, k), in ? xr + c0 : xs, in);
                cp_async16(slot(s, u, 1, k), in ? gr + c0 : gs, in);
            }
        }
        cp_async_commit();
    };
#pragma unroll
    for (int s = 0; s < QR_STAGES - 1; ++s) issue(gid + s * groups, s);
    int s = 0;
    for (i64 blk = gid; blk < n_blocks; blk += groups) {
        issue(blk + (QR_STAGES - 1) * groups, s == 0 ? QR_STAGES - 1 : s - 1);
        cp_async_wait<QR_STAGES - 1>();
#pragma unroll
        for (int u = 0; u < QR_U; ++u) {
            uint4 xraw[QR_CPL], graw[QR_CPL];
#pragma unroll
            for (int k = 0; k < QR_CPL; ++k) xraw[k] = lds16(slot(s, u, 0, k)), graw[k] = lds16(slot(s, u, 1, k));
            bwd_row(p, blk * QR_U + u, n_rows, rot0, small, gl, xraw, graw, lds4(rs + (s * QR_U + u) * 32 * 4));
        }
        if (++s == QR_STAGES) s = 0;
    }
    cp_async_wait<0>();  // no copy outlives the block (the tail's are past the end: zeros)
}
#endif
