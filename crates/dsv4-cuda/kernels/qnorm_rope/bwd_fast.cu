// Q RMSNorm + partial interleaved RoPE, backward (SPEC.md section 5), the fast kernel for
// bf16 x and grad with unit channel stride and 16-byte aligned rows, and a 16-byte aligned
// dx (the maths of bwd.cu; the layout in qnorm_rope.cuh).
//
// Persistent: lane group `gid` (LPR lanes) handles the row blocks gid, gid + groups, ... of
// U rows; x and grad rows travel through a ring of STAGES row blocks in shared memory
// (STAGES - 1 blocks per lane group in flight, no registers held: 3 x 2 KiB per warp at
// C = 512, U = 1), each lane copying its own 16-byte chunks by cp.async and reading back
// only those (per-thread cp.async groups order them: no barrier); each lane also copies
// rstd of the block's rows into its own slot by a 4-byte cp.async. Dynamic shared memory:
// rows [warps][STAGES][U][x, grad][CPL][32 lanes] x 16 bytes, then rstd
// [warps][STAGES][U][32 lanes] f32.
//
// Defines (the launcher's shape for C channels): QR_LPR lanes per row, QR_CPL 16-byte
// chunks per lane, QR_U rows per block, QR_CS_VEC (float4 cos/sin; qnorm_rope.cuh),
// QR_STAGES ring stages (the launcher sizes the shared memory from the same value).
#include "qnorm_rope/qnorm_rope.cuh"

using namespace qnorm_rope;

constexpr int LPR = QR_LPR, CPL = QR_CPL, U = QR_U, STAGES = QR_STAGES;
constexpr bool CS_VEC = QR_CS_VEC != 0;
static_assert(LPR >= 1 && LPR <= 32 && (LPR & (LPR - 1)) == 0 && CPL >= 1 && U >= 1 && STAGES >= 2, "fast backward shape");
// Resident 256-thread blocks per SM the registers are sized for (the launcher's grid
// mirrors it and also bounds it by shared memory).
constexpr int MIN_BLOCKS = CPL * U <= 2 ? 3 : 2;

extern "C" __global__ void __launch_bounds__(256, MIN_BLOCKS) qnorm_rope_bwd_fast(const QNormRopeParams p) {
    extern __shared__ __align__(128) unsigned char ring_smem[];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, gl = threadIdx.x % LPR;
    const i64 gid = ((i64)blockIdx.x * blockDim.x + threadIdx.x) / LPR;
    const i64 groups = (i64)gridDim.x * blockDim.x / LPR;
    const i64 n_rows = p.B * p.S * p.H, rot0 = p.C - p.R;
    const i64 n_blocks = (n_rows + U - 1) / U;
    const bool small = n_rows <= 0xffffffffll;
    const bf16* xs = static_cast<const bf16*>(p.x);
    const bf16* gs = static_cast<const bf16*>(p.grad);
    const int warps = blockDim.x / 32;
    // This lane's slot of (stage s, row u, tensor t: 0 x / 1 grad, chunk k), and of rstd.
    const u32 ring = smem_addr(ring_smem) + (u32)(warp * STAGES * U * 2 * CPL * 32 + lane) * 16;
    const u32 rs = smem_addr(ring_smem) + (u32)(warps * STAGES * U * 2 * CPL * 32) * 16 + (u32)(warp * STAGES * U * 32 + lane) * 4;
    auto slot = [&](int s, int u, int t, int k) { return ring + (u32)((((s * U + u) * 2 + t) * CPL + k) * 32 * 16); };
    auto issue = [&](i64 blk, int s) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const i64 r = blk * U + u;
            const bool ok = r < n_rows;
            const RowIndex ix = row_index_fast(p, ok ? r : 0, small);
            const bf16* xr = xs + ix.b * p.x_stride[0] + ix.h * p.x_stride[1] + ix.s * p.x_stride[2];
            const bf16* gr = gs + ix.b * p.g_stride[0] + ix.h * p.g_stride[1] + ix.s * p.g_stride[2];
            cp_async4(rs + (s * U + u) * 32 * 4, ok ? p.rstd_in + r : p.rstd_in, ok);
#pragma unroll
            for (int k = 0; k < CPL; ++k) {
                const i64 c0 = 8 * (gl + (i64)LPR * k);
                const bool in = ok && c0 < p.C;
                cp_async16(slot(s, u, 0, k), in ? xr + c0 : xs, in);
                cp_async16(slot(s, u, 1, k), in ? gr + c0 : gs, in);
            }
        }
        cp_async_commit();
    };
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) issue(gid + s * groups, s);
    int s = 0;
    for (i64 blk = gid; blk < n_blocks; blk += groups) {
        issue(blk + (STAGES - 1) * groups, s == 0 ? STAGES - 1 : s - 1);
        cp_async_wait<STAGES - 1>();
#pragma unroll
        for (int u = 0; u < U; ++u) {
            uint4 xraw[CPL], graw[CPL];
#pragma unroll
            for (int k = 0; k < CPL; ++k) xraw[k] = lds16(slot(s, u, 0, k)), graw[k] = lds16(slot(s, u, 1, k));
            bwd_row<LPR, CPL, CS_VEC>(p, blk * U + u, n_rows, rot0, small, gl, xraw, graw, lds4(rs + (s * U + u) * 32 * 4));
        }
        if (++s == STAGES) s = 0;
    }
    cp_async_wait<0>();  // no copy outlives the block (the tail's are past the end: zeros)
}
