// Q RMSNorm + partial interleaved RoPE, forward (SPEC.md section 5):
//   rstd = 1 / sqrt(mean_c x^2 + eps)
//   y    = bf16(x * rstd)                                   (first rounding boundary)
//   last R channels, pairs (a, b) = (y[2j], y[2j+1]) of the rotated block:
//     (a, b) -> bf16(a cos_j - b sin_j), bf16(a sin_j + b cos_j)
// Output token-major [B,S,H,C]; rstd saved token-major [B*S*H].
// One warp per row; dynamic shared memory: C floats per warp.
//
// dsv4-test-defines: QR_X_BF16=1 QR_X_VEC=8 QR_O_VEC=8
// dsv4-test-defines: QR_X_BF16=0 QR_X_VEC=4 QR_O_VEC=4
// dsv4-test-defines: QR_X_BF16=0
// dsv4-test-defines: QR_X_BF16=1 QR_X_VEC=8 QR_O_VEC=8 QR_LPR=32 QR_CPL=1 QR_U=2
// dsv4-test-defines: QR_X_BF16=1 QR_X_VEC=8 QR_O_VEC=8 QR_LPR=1 QR_CPL=1 QR_U=2
// dsv4-test-defines: QR_X_BF16=1 QR_X_VEC=8 QR_O_VEC=8 QR_LPR=32 QR_CPL=4 QR_U=1
// dsv4-test-defines: QR_X_BF16=1 QR_X_VEC=8 QR_O_VEC=8 QR_LPR=32 QR_CPL=2 QR_U=2 QR_CS_VEC=1
// dsv4-test-defines: QR_X_BF16=1 QR_X_VEC=8 QR_O_VEC=8 QR_LPR=32 QR_CPL=2 QR_U=2 QR_CS_VEC=1 DSV4_QNORM_FWD_VARIANT=1
// dsv4-test-defines: QR_X_BF16=1 QR_X_VEC=8 QR_O_VEC=8 QR_LPR=32 QR_CPL=2 QR_U=4 QR_CS_VEC=1 DSV4_QNORM_FWD_VARIANT=2
// dsv4-test-defines: QR_X_BF16=1 QR_X_VEC=8 QR_O_VEC=8 QR_LPR=32 QR_CPL=2 QR_U=2 QR_CS_VEC=1 DSV4_QNORM_FWD_VARIANT=3
// dsv4-test-defines: QR_X_BF16=1 QR_X_VEC=8 QR_O_VEC=8 QR_LPR=32 QR_CPL=2 QR_U=2 QR_CS_VEC=1 DSV4_QNORM_FWD_VARIANT=4
// dsv4-test-defines: QR_X_BF16=1 QR_X_VEC=8 QR_O_VEC=8 QR_LPR=8 QR_CPL=1 QR_U=2 DSV4_QNORM_FWD_VARIANT=4
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

#if QR_X_BF16 && DSV4_QNORM_FWD_VARIANT == 0
// Fast forward (bf16 x, unit channel stride, 16-byte aligned rows and output): see the
// header. Persistent: lane group `gid` (QR_LPR lanes) handles the row blocks gid, gid +
// groups, ... of QR_U rows each, and issues the next block's loads before computing the
// current one, so loads stay in flight while it computes and stores.
extern "C" __global__ void __launch_bounds__(256, QR_FWD_MINB) qnorm_rope_fwd_fast(const QNormRopeParams p) {
    const int gl = threadIdx.x % QR_LPR;
    const i64 gid = ((i64)blockIdx.x * blockDim.x + threadIdx.x) / QR_LPR;
    const i64 groups = (i64)gridDim.x * blockDim.x / QR_LPR;
    const i64 n_rows = p.B * p.S * p.H, rot0 = p.C - p.R;
    const i64 n_blocks = (n_rows + QR_U - 1) / QR_U;
    const bool small = n_rows <= 0xffffffffll;
    const bf16* xs = static_cast<const bf16*>(p.x);
    bf16* outs = static_cast<bf16*>(p.out);
    // The QR_U rows of row block `blk`: indices and raw chunks (zeros past the end).
    auto load = [&](i64 blk, uint4 (&raw)[QR_U][QR_CPL]) {
#pragma unroll
        for (int u = 0; u < QR_U; ++u) {
            const i64 r = blk * QR_U + u;
            const RowIndex ix = row_index_fast(p, r < n_rows ? r : 0, small);
            const bf16* xr = xs + ix.b * p.x_stride[0] + ix.h * p.x_stride[1] + ix.s * p.x_stride[2];
#pragma unroll
            for (int k = 0; k < QR_CPL; ++k) {
                const i64 c0 = 8 * (gl + (i64)QR_LPR * k);
                raw[u][k] = (r < n_rows && c0 < p.C) ? ld16(xr + c0) : make_uint4(0u, 0u, 0u, 0u);
            }
        }
    };
    uint4 raw[QR_U][QR_CPL];
    load(gid, raw);
    for (i64 blk = gid; blk < n_blocks; blk += groups) {
        uint4 nraw[QR_U][QR_CPL];
        load(blk + groups, nraw);  // zeros past the end
#pragma unroll
        for (int u = 0; u < QR_U; ++u) {
            const i64 r = blk * QR_U + u;
            float ss = 0.f;
#pragma unroll
            for (int k = 0; k < QR_CPL; ++k) {
                float v[8];
                unpack8(raw[u][k], v);
#pragma unroll
                for (int i = 0; i < 8; ++i) ss = fmaf(v[i], v[i], ss);
            }
            ss = dsv4::group_sum(ss, QR_LPR);
            const float rstd = 1.f / sqrtf(ss / (float)p.C + p.eps);
            if (r >= n_rows) continue;  // the whole group: r is the group's
            if (gl == 0) p.rstd_out[r] = rstd;
            const RowIndex ix = row_index_fast(p, r < n_rows ? r : 0, small);  // recomputed: cheaper than holding it
            const float* cs = p.cos + ix.b * p.cos_stride[0] + ix.s * p.cos_stride[1];
            const float* sn = p.sin + ix.b * p.sin_stride[0] + ix.s * p.sin_stride[1];
            bf16* o = outs + r * p.C;
#pragma unroll
            for (int k = 0; k < QR_CPL; ++k) {
                const i64 c0 = 8 * (gl + (i64)QR_LPR * k);
                if (c0 >= p.C) continue;
                float v[8];
                unpack8(raw[u][k], v);
#pragma unroll
                for (int i = 0; i < 8; ++i) v[i] = dsv4::round_bf16(v[i] * rstd);  // y = bf16(x * rstd)
                if (c0 + 8 > rot0) {
                    // Rotate the pairs (a, b) = (y[e], y[e+1]) of the last R channels. No FMA
                    // contraction: the products round separately, as in the reference.
                    float cj[4], sj[4];
                    chunk_cos_sin(p, cs, sn, c0, rot0, cj, sj);
#pragma unroll
                    for (int i = 0; i < 8; i += 2) {
                        if (c0 + i < rot0) continue;
                        const float a = v[i], b = v[i + 1];
                        v[i] = dsv4::round_bf16(__fsub_rn(__fmul_rn(a, cj[i / 2]), __fmul_rn(b, sj[i / 2])));
                        v[i + 1] = dsv4::round_bf16(__fadd_rn(__fmul_rn(a, sj[i / 2]), __fmul_rn(b, cj[i / 2])));
                    }
                }
                st16_cs(o + c0, v);
            }
        }
#pragma unroll
        for (int u = 0; u < QR_U; ++u) {
#pragma unroll
            for (int k = 0; k < QR_CPL; ++k) raw[u][k] = nraw[u][k];
        }
    }
}
#elif QR_X_BF16 && (DSV4_QNORM_FWD_VARIANT == 1 || DSV4_QNORM_FWD_VARIANT == 2)
// Fast forward, variants 1 and 2 (experimental, see the header): lane group `gid` handles
// the one row block gid (QR_U rows: 2 for variant 1, 4 for variant 2 at C = 512, chosen by
// the launcher), every 16-byte load of the block issued before any use; the grid holds
// every block (not persistent), so a finished block's SM slot refills with fresh loads.
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
#elif QR_X_BF16
// Fast forward, variants 3 and 4 (experimental, see the header): persistent like the
// default, but the rows travel through a ring of QR_STAGES row blocks in shared memory, so
// QR_STAGES - 1 blocks per lane group are in flight without holding registers (3 x 2 KiB
// per warp at C = 512, QR_U = 2: 144 KiB per SM at 3 blocks of 8 warps).
//   variant 3: each lane copies its own chunks with 16-byte cp.async and reads back only
//     those (per-thread cp.async groups order them: no barrier). Dynamic shared memory
//     [warps][QR_STAGES][QR_U][QR_CPL][32 lanes] x 16 bytes.
//   variant 4 (sm_90): the group's first lane copies each row with one bulk copy (TMA)
//     completing the stage's mbarrier; the group waits on its phase. Dynamic shared memory
//     [groups][QR_STAGES] mbarriers (padded to 128 bytes), then [groups][QR_STAGES][QR_U][C]
//     bf16 (rows as in memory; C * 2 bytes a multiple of 16).
extern "C" __global__ void __launch_bounds__(256, QR_RING_FWD_MINB) qnorm_rope_fwd_fast(const QNormRopeParams p) {
    extern __shared__ __align__(128) unsigned char ring_smem[];
    const int lane = threadIdx.x % 32, gl = threadIdx.x % QR_LPR;
    const i64 gid = ((i64)blockIdx.x * blockDim.x + threadIdx.x) / QR_LPR;
    const i64 groups = (i64)gridDim.x * blockDim.x / QR_LPR;
    const i64 n_rows = p.B * p.S * p.H, rot0 = p.C - p.R;
    const i64 n_blocks = (n_rows + QR_U - 1) / QR_U;
    const bool small = n_rows <= 0xffffffffll;
    const bf16* xs = static_cast<const bf16*>(p.x);
#if DSV4_QNORM_FWD_VARIANT == 4 && defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900  // the launcher: arch == "sm_90a"
    const int gib = threadIdx.x / QR_LPR, gpb = blockDim.x / QR_LPR;  // group in block, groups per block
    const u32 row_bytes = (u32)p.C * 2;
    const u32 bars = smem_addr(ring_smem) + gib * QR_STAGES * 8;
    const u32 data = smem_addr(ring_smem) + ((gpb * QR_STAGES * 8 + 127) & ~127) + gib * QR_STAGES * QR_U * row_bytes;
    const u32 gmask = group_mask(lane);
    if (gl == 0) {
#pragma unroll
        for (int s = 0; s < QR_STAGES; ++s) mbar_init(bars + 8 * s, 1);
        mbar_init_fence();
    }
    __syncwarp(gmask);
    // Row block `blk` into stage s: one arrival expecting the valid rows' bytes, one bulk
    // copy per row (rows past the end: none; their stale bytes are never stored).
    auto issue = [&](i64 blk, int s) {
        if (gl != 0) return;
        u32 bytes = 0;
#pragma unroll
        for (int u = 0; u < QR_U; ++u) bytes += (blk * QR_U + u < n_rows) ? row_bytes : 0u;
        mbar_arrive_expect_tx(bars + 8 * s, bytes);
#pragma unroll
        for (int u = 0; u < QR_U; ++u) {
            const i64 r = blk * QR_U + u;
            if (r >= n_rows) continue;
            const RowIndex ix = row_index_fast(p, r, small);
            const bf16* xr = xs + ix.b * p.x_stride[0] + ix.h * p.x_stride[1] + ix.s * p.x_stride[2];
            bulk_copy(data + (s * QR_U + u) * row_bytes, xr, row_bytes, bars + 8 * s);
        }
    };
#pragma unroll
    for (int s = 0; s < QR_STAGES - 1; ++s) issue(gid + s * groups, s);
    int s = 0;
    u32 phase = 0;
    for (i64 blk = gid; blk < n_blocks; blk += groups) {
        __syncwarp(gmask);  // every lane of the group has read the stage issued next
        issue(blk + (QR_STAGES - 1) * groups, s == 0 ? QR_STAGES - 1 : s - 1);
        mbar_wait(bars + 8 * s, phase);
        uint4 raw[QR_U][QR_CPL];
#pragma unroll
        for (int u = 0; u < QR_U; ++u) {
#pragma unroll
            for (int k = 0; k < QR_CPL; ++k) {
                const u32 c0 = 8 * (gl + QR_LPR * k);
                raw[u][k] = c0 < (u32)p.C ? lds16(data + (s * QR_U + u) * row_bytes + 2 * c0) : make_uint4(0u, 0u, 0u, 0u);
            }
        }
#pragma unroll
        for (int u = 0; u < QR_U; ++u) fwd_row(p, blk * QR_U + u, n_rows, rot0, small, gl, raw[u]);
        if (++s == QR_STAGES) s = 0, phase ^= 1;
    }
#else
    const int warp = threadIdx.x / 32;
    // This lane's slot of (stage s, row u, chunk k): consecutive lanes, consecutive 16 bytes.
    const u32 ring = smem_addr(ring_smem) + (u32)(warp * QR_STAGES * QR_U * QR_CPL * 32 + lane) * 16;
    auto slot = [&](int s, int u, int k) { return ring + (u32)(((s * QR_U + u) * QR_CPL + k) * 32 * 16); };
    // Row block `blk` into stage s, one cp.async group (zeros past the end and past C).
    auto issue = [&](i64 blk, int s) {
#pragma unroll
        for (int u = 0; u < QR_U; ++u) {
            const i64 r = blk * QR_U + u;
            const bool ok = r < n_rows;
            const RowIndex ix = row_index_fast(p, ok ? r : 0, small);
            const bf16* xr = xs + ix.b * p.x_stride[0] + ix.h * p.x_stride[1] + ix.s * p.x_stride[2];
#pragma unroll
            for (int k = 0; k < QR_CPL; ++k) {
                const i64 c0 = 8 * (gl + (i64)QR_LPR * k);
                const bool in = ok && c0 < p.C;
                cp_async16(slot(s, u, k), in ? xr + c0 : xs, in);
            }
        }
        cp_async_commit();
    };
#pragma unroll
    for (int s = 0; s < QR_STAGES - 1; ++s) issue(gid + s * groups, s);
    int s = 0;
    for (i64 blk = gid; blk < n_blocks; blk += groups) {
        // The stage read last iteration (its values already consumed) takes the block
        // QR_STAGES - 1 ahead; then this block's group is complete.
        issue(blk + (QR_STAGES - 1) * groups, s == 0 ? QR_STAGES - 1 : s - 1);
        cp_async_wait<QR_STAGES - 1>();
        uint4 raw[QR_U][QR_CPL];
#pragma unroll
        for (int u = 0; u < QR_U; ++u) {
#pragma unroll
            for (int k = 0; k < QR_CPL; ++k) raw[u][k] = lds16(slot(s, u, k));
        }
#pragma unroll
        for (int u = 0; u < QR_U; ++u) fwd_row(p, blk * QR_U + u, n_rows, rot0, small, gl, raw[u]);
        if (++s == QR_STAGES) s = 0;
    }
    cp_async_wait<0>();  // no copy outlives the block (the tail's are past the end: zeros)
#endif
}
#endif
