// Tensor-core and copy primitives of the sparse-attention kernels (sm_80+), the slot
// decoding every kernel shares, and the shared-memory layouts (mirrored by
// `fwd_smem_bytes` / `bwd_smem_bytes` in src/sparse_attention/tiles.rs).
//
// Fragment layouts of mma.m16n8k16 (PTX ISA), g = lane / 4, c = lane % 4:
//   A (16x16, row-major):      a0 = A[g][2c..2c+1]  a1 = A[g+8][2c..]  a2 = A[g][2c+8..]  a3 = A[g+8][2c+8..]
//   B (16x8, k x n):           b0 = B[2c..2c+1][g]  b1 = B[2c+8..2c+9][g]
//   C (16x8, f32):             c0 = C[g][2c]  c1 = C[g][2c+1]  c2 = C[g+8][2c]  c3 = C[g+8][2c+1]
// Shared tiles are row-major bf16 with rows padded by 16 bytes, so the 8 row addresses of
// one ldmatrix fall in 8 distinct bank quads.
#pragma once

#include "common.cuh"

namespace dsv4 {
namespace sa {

constexpr float kLog2e = 1.4426950408889634f;  // log2(e): exp(x) = exp2(x * log2(e))
constexpr float kLn2 = 0.6931471805599453f;    // ln(2)

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000u); }

__device__ __forceinline__ u32 smem_addr(const void* p) { return static_cast<u32>(__cvta_generic_to_shared(p)); }

// 16 bytes global -> shared, asynchronously; `valid == false` writes 16 zero bytes and
// reads nothing (src must still be a mapped address).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
    const int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(n) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// Four 8x8 bf16 matrices; lane l addresses row (l % 8) of matrix l / 8.
__device__ __forceinline__ void ldsm_x4(u32 (&r)[4], const bf16* lane_ptr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(lane_ptr))
                 : "memory");
}
// The same, each matrix transposed.
__device__ __forceinline__ void ldsm_x4_t(u32 (&r)[4], const bf16* lane_ptr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(lane_ptr))
                 : "memory");
}
// Two 8x8 matrices (lanes 0-15 address them).
__device__ __forceinline__ void ldsm_x2(u32 (&r)[2], const bf16* lane_ptr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(smem_addr(lane_ptr))
                 : "memory");
}

// C += A B, bf16 inputs, f32 accumulation.
__device__ __forceinline__ void mma_bf16(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// (lo, hi) rounded to bf16 and packed as one 32-bit word (lo in the low half).
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<u32*>(&v);
}

__device__ __forceinline__ float warp_max(float x) {
    for (int o = 16; o > 0; o /= 2) x = fmaxf(x, __shfl_xor_sync(DSV4_FULL_MASK, x, o));
    return x;
}

// The row (b * S + s) of launch row v of the backward (`desc`: the rows from the last to
// the first, so the costliest rows of a causal selection run first and the cheap ones fill
// each wave's last round of CTAs).
__device__ __forceinline__ i64 launch_row(i64 v, i64 rows_total, int desc) { return desc ? rows_total - 1 - v : v; }

// Slots of a row to scan: its plan length (`row_len`, [B*S]) clamped to [0, T], or all T.
__device__ __forceinline__ int row_slots(const i32* row_len, i64 row, int T) { return row_len ? max(0, min(row_len[row], T)) : T; }

// The key of slot t of a row (or -1 when masked): t past the row's slots, an entry outside
// [0, K) after the per-batch bias, or (dedup) a repeat of the previous slot of a sorted row.
__device__ __forceinline__ int slot_key(const void* idx, i64 row_off, i64 st, i32 is_i64, i64 bias, int n_slots, int K, int t, bool dedup) {
    if (t >= n_slots) return -1;
    const i64 v = load_int(idx, row_off + t * st, is_i64) - bias;
    if (v < 0 || v >= K) return -1;
    if (dedup && t > 0 && load_int(idx, row_off + (t - 1) * st, is_i64) - bias == v) return -1;
    return static_cast<int>(v);
}

// Shared-memory layout of fwd.cu (byte offsets). QS, SS, PS: row strides in elements.
template <int D, int HB, int BN> struct FwdLayout {
    static constexpr int QS = D + 8;   // Q and K/V tile rows (bf16)
    static constexpr int SS = BN + 4;  // S rows (f32)
    static constexpr int PS = BN + 8;  // P rows (bf16)
    static constexpr int q_off = 0;                           // Q      [HB][QS] bf16
    static constexpr int kv_off = q_off + HB * QS * 2;        // K/V    [2][BN][QS] bf16 (double buffer)
    static constexpr int s_off = kv_off + 2 * BN * QS * 2;    // [HB][SS] f32: holds the per-warp partial row maxima and sums [2][D/DW][HB] f32
    static constexpr int p_off = s_off + HB * SS * 4;         // P      [HB][PS] bf16
    static constexpr int stats_off = p_off + HB * PS * 2;     // l [HB] f32 (of [3][HB] reserved)
    static constexpr int keys_off = stats_off + 3 * HB * 4;   // keys   [3][BN] i32 (ring: tiles j, j+1, j+2)
    static constexpr int bytes = keys_off + 3 * BN * 4;
};

// Shared-memory layout of bwd.cu (byte offsets).
template <int D, int HB, int BN> struct BwdLayout {
    static constexpr int QS = D + 8;   // Q, dO and K/V tile rows (bf16)
    static constexpr int PS = BN + 8;  // P and dS rows (bf16)
    static constexpr int q_off = 0;                           // Q      [HB][QS] bf16
    static constexpr int do_off = q_off + HB * QS * 2;        // dO     [HB][QS] bf16
    static constexpr int kv_off = do_off + HB * QS * 2;       // K/V    [2][BN][QS] bf16
    static constexpr int p_off = kv_off + 2 * BN * QS * 2;    // P      [HB][PS] bf16
    static constexpr int ds_off = p_off + HB * PS * 2;        // dS     [HB][PS] bf16 (sm_scale * dl)
    static constexpr int stats_off = ds_off + HB * PS * 2;    // lse (exp base), delta [2][HB] f32
    static constexpr int keys_off = stats_off + 2 * HB * 4;   // keys   [3][BN] i32 (ring: tiles j, j+1, j+2)
    static constexpr int bytes = keys_off + 3 * BN * 4;
};

}  // namespace sa
}  // namespace dsv4
