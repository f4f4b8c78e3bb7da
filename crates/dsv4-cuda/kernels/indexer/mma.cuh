// Warp-level tensor-core primitives of the indexer (sm_80+): cp.async 16-byte copies,
// ldmatrix fragment loads and mma.sync m16n8k16 bf16 -> f32.
//
// Fragment layouts (PTX ISA, "Matrix fragments for mma.m16n8k16"), with g = lane / 4 and
// c = lane % 4:
//   A (16x16, row-major):  a0 = A[g][2c..2c+1]   a1 = A[g+8][2c..]   a2 = A[g][2c+8..]   a3 = A[g+8][2c+8..]
//   B (16x8, stored n-major as [n][k]):  b0 = B[k=2c..2c+1][n=g]   b1 = B[k=2c+8..][n=g]
//   C (16x8):  c0 = C[g][2c]  c1 = C[g][2c+1]  c2 = C[g+8][2c]  c3 = C[g+8][2c+1]
#pragma once

#include "common.cuh"

namespace dsv4 {
namespace indexer {

__device__ __forceinline__ u32 smem_addr(const void* p) {
    return static_cast<u32>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, asynchronously; `valid == false` writes 16 zero bytes and
// reads nothing (src must still be a mapped address).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
    const int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(n) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// A fragment of a 16x16 bf16 tile whose row r starts at `row_ptr` for lane (r = lane % 16)
// at column (lane / 16) * 8.
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], const void* lane_ptr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(lane_ptr)));
}
// A B fragment (8 keys x 16 k): lanes 0-7 address key rows at k0, lanes 8-15 at k0 + 8.
__device__ __forceinline__ void ldmatrix_x2(u32 (&r)[2], const void* lane_ptr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(smem_addr(lane_ptr)));
}

// Four 8x8 b16 matrices, transposed: lane l addresses row (l % 8) of matrix l / 8, and
// gets elements [2c][g], [2c+1][g] of each (g = lane / 4, c = lane % 4). Reads an operand
// stored k-major ([k][n] rows) as B fragments, or a [k][m]-stored A^T as A fragments.
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], const void* lane_ptr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(lane_ptr)));
}

// C += A * B, bf16 inputs, f32 accumulate.
__device__ __forceinline__ void mma_bf16_16816(float (&c)[4], const u32 (&a)[4], const u32 (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Pooled keys visible to global query position `pos`: p < (pos + 1) / r.
__device__ __forceinline__ i64 visible_keys(i64 pos, i32 r) { return (pos + 1) / r; }

}  // namespace indexer
}  // namespace dsv4
