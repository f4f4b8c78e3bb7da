// Q RMSNorm + partial interleaved RoPE, forward (SPEC.md section 5), the fast kernel for bf16
// x with unit channel stride and 16-byte aligned rows, and a 16-byte aligned output (the
// maths of fwd.cu; the layout in qnorm_rope.cuh). Lane group `gid` (LPR lanes) handles the
// one row block gid (U rows), every 16-byte load of the block issued before any use; the
// grid holds every block (not persistent), so a finished block's SM slot refills with fresh
// loads.
//
// Defines (the launcher's shape for C channels): QR_LPR lanes per row, QR_CPL 16-byte
// chunks per lane, QR_U rows per block, QR_CS_VEC (float4 cos/sin; qnorm_rope.cuh).
#include "qnorm_rope/qnorm_rope.cuh"

using namespace qnorm_rope;

constexpr int LPR = QR_LPR, CPL = QR_CPL, U = QR_U;
constexpr bool CS_VEC = QR_CS_VEC != 0;
static_assert(LPR >= 1 && LPR <= 32 && (LPR & (LPR - 1)) == 0 && CPL >= 1 && U >= 1, "fast forward shape");

extern "C" __global__ void __launch_bounds__(256, 4) qnorm_rope_fwd_fast(const QNormRopeParams p) {
    const int gl = threadIdx.x % LPR;
    const i64 gid = ((i64)blockIdx.x * blockDim.x + threadIdx.x) / LPR;
    const i64 n_rows = p.B * p.S * p.H, rot0 = p.C - p.R;
    const bool small = n_rows <= 0xffffffffll;
    const bf16* xs = static_cast<const bf16*>(p.x);
    uint4 raw[U][CPL];  // [row of the block][chunk], zeros past the end
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const i64 r = gid * U + u;
        const RowIndex ix = row_index_fast(p, r < n_rows ? r : 0, small);
        const bf16* xr = xs + ix.b * p.x_stride[0] + ix.h * p.x_stride[1] + ix.s * p.x_stride[2];
#pragma unroll
        for (int k = 0; k < CPL; ++k) {
            const i64 c0 = 8 * (gl + (i64)LPR * k);
            raw[u][k] = (r < n_rows && c0 < p.C) ? ld16(xr + c0) : make_uint4(0u, 0u, 0u, 0u);
        }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) fwd_row<LPR, CPL, CS_VEC>(p, gid * U + u, n_rows, rot0, small, gl, raw[u]);
}
