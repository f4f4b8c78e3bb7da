// Q RMSNorm + partial interleaved RoPE (SPEC.md section 5): params and helpers shared by
// the forward and the backward.
//
// Two kernels per direction:
// - `*_fast` (bf16 x, and grad backward, with unit channel stride and 16-byte aligned
//   rows; 16-byte aligned output): a group of QR_LPR lanes per row, each lane holding
//   QR_CPL 16-byte chunks of 8 channels in registers (a RoPE pair never straddles a
//   chunk: chunks start at multiples of 8 and C - R is even), QR_U rows per group in
//   flight, every load issued before any use; sums by shuffles over the group. Persistent
//   (one wave of resident blocks): each group loads its next QR_U rows before computing
//   the current ones; streaming (evict-first) loads and stores; cos/sin as float4 where
//   QR_CS_VEC.
// - the generic kernels (any strides, f32 x or grad): one warp per row, staged in shared
//   memory (f32) so a channel can read its RoPE partner.
// Rows run in token-major order r = (b*S + s)*H + h, so consecutive rows are written
// consecutively and the heads of one token, which share cos/sin, run side by side.
#pragma once
#include "common.cuh"

// x's dtype (and the output's): 1 = bf16, 0 = f32. The two bf16 rounding boundaries of
// SPEC section 5 apply when x is bf16.
#ifndef QR_X_BF16
#define QR_X_BF16 1
#endif
// grad's dtype (backward): 1 = bf16, 0 = f32.
#ifndef QR_G_BF16
#define QR_G_BF16 1
#endif
// Elements per access: 16 bytes (8 bf16 / 4 f32) where the launcher checked channel
// stride 1 and 16-byte alignment of every row, else 1.
#ifndef QR_X_VEC
#define QR_X_VEC 1
#endif
#ifndef QR_G_VEC
#define QR_G_VEC 1
#endif
#ifndef QR_O_VEC
#define QR_O_VEC 1
#endif
// Fast kernels: lanes per row (a power of two <= 32), 16-byte chunks per lane
// (QR_LPR * QR_CPL * 8 >= C), rows per lane group in flight.
#ifndef QR_LPR
#define QR_LPR 32
#endif
#ifndef QR_CPL
#define QR_CPL 2
#endif
#ifndef QR_U
#define QR_U 2
#endif
// Fast kernels: 1 where cos and sin have unit r stride, 16-byte aligned (b, s) rows and
// C - R is a multiple of 8 (the launcher checks): a chunk's 4 pairs then read one float4
// of cos and one of sin.
#ifndef QR_CS_VEC
#define QR_CS_VEC 0
#endif
// Fast kernels: resident blocks of 256 threads per SM the register budget is sized for
// (__launch_bounds__ minimum); the launcher sizes the persistent grid as SMs x this (the
// same formula lives in qnorm_rope.rs).
#define QR_FWD_MINB ((QR_CPL * QR_U <= 4 && QR_CS_VEC) ? 3 : 2)
#define QR_BWD_MINB ((QR_CPL * QR_U <= 2) ? (QR_CS_VEC ? 3 : 2) : 1)

struct QNormRopeParams {
    const void* x;          // logical [B,H,S,C], x's dtype, strides x_stride
    const float* cos;       // [B,S,R] f32, strides cos_stride; entries j < R/2 used
    const float* sin;       // [B,S,R] f32, strides sin_stride
    const void* grad;       // backward: logical [B,H,S,C] (QR_G_BF16 dtype), strides g_stride; null forward
    const float* rstd_in;   // backward: [B*S*H] f32 token-major; null forward
    void* out;              // [B,S,H,C] contiguous (token-major), x's dtype: y forward, dx backward
    float* rstd_out;        // forward: [B*S*H] f32 token-major; null backward
    i64 x_stride[4];        // strides of x's logical dims b, h, s, c (elements)
    i64 g_stride[4];        // strides of grad's logical dims b, h, s, c
    i64 cos_stride[3];      // b, s, r
    i64 sin_stride[3];      // b, s, r
    i64 B, H, S, C;
    i64 R;                  // rotated trailing channels, even, <= C
    float eps;              // > 0
    i32 pad_;
};
DSV4_PARAMS_SIZE(QNormRopeParams, 216);

namespace qnorm_rope {

#if QR_X_BF16
typedef bf16 X;
#else
typedef float X;
#endif
#if QR_G_BF16
typedef bf16 Gt;
#else
typedef float Gt;
#endif

// A rounding boundary of the maths: bf16 when x is bf16, nothing for f32 x.
__device__ __forceinline__ float boundary(float v) {
#if QR_X_BF16
    return dsv4::round_bf16(v);
#else
    return v;
#endif
}

// Row r (token-major) -> (b, h, s).
struct RowIndex {
    i64 b, h, s;
};
__device__ __forceinline__ RowIndex row_index(const QNormRopeParams& p, i64 r) {
    RowIndex i;
    i.h = r % p.H;
    const i64 t = r / p.H;
    i.s = t % p.S;
    i.b = t / p.S;
    return i;
}

// Row r -> (b, h, s) in 32-bit arithmetic where the row count allows (the fast kernels).
__device__ __forceinline__ RowIndex row_index_fast(const QNormRopeParams& p, i64 r, bool small) {
    if (!small) return row_index(p, r);
    const u32 H = (u32)p.H, S = (u32)p.S, rr = (u32)r;
    const u32 t = rr / H;
    RowIndex i;
    i.h = rr - t * H;
    i.b = t / S;
    i.s = t - (u32)i.b * S;
    return i;
}

// Raw 16-byte chunk: 8 bf16 packed in four words. Streaming (evict-first) loads and
// stores: every byte is touched once, so the output does not evict the input from L2.
__device__ __forceinline__ uint4 ld16(const bf16* p) { return __ldcs(reinterpret_cast<const uint4*>(p)); }
__device__ __forceinline__ void st16_cs(bf16* p, const float (&in)[8]) {
    __stcs(reinterpret_cast<uint4*>(p), make_uint4(dsv4::pack_bf16(in[0], in[1]), dsv4::pack_bf16(in[2], in[3]), dsv4::pack_bf16(in[4], in[5]), dsv4::pack_bf16(in[6], in[7])));
}

// cos_j and sin_j of the 4 pairs (c0 + 2i, c0 + 2i + 1) of the chunk at c0 (c0 + 8 > rot0);
// pairs before rot0 get (1, 0), which the callers skip anyway.
__device__ __forceinline__ void chunk_cos_sin(const QNormRopeParams& p, const float* cs, const float* sn, i64 c0, i64 rot0, float (&cj)[4], float (&sj)[4]) {
#if QR_CS_VEC
    const i64 j0 = (c0 - rot0) / 2;  // c0 >= rot0: both multiples of 8
    const float4 c = __ldg(reinterpret_cast<const float4*>(cs + j0));
    const float4 s = __ldg(reinterpret_cast<const float4*>(sn + j0));
    cj[0] = c.x, cj[1] = c.y, cj[2] = c.z, cj[3] = c.w;
    sj[0] = s.x, sj[1] = s.y, sj[2] = s.z, sj[3] = s.w;
#else
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const i64 e = c0 + 2 * i;
        const i64 j = (e - rot0) / 2;
        cj[i] = e < rot0 ? 1.f : __ldg(cs + j * p.cos_stride[2]);
        sj[i] = e < rot0 ? 0.f : __ldg(sn + j * p.sin_stride[2]);
    }
#endif
}
__device__ __forceinline__ void unpack8(const uint4& u, float (&v)[8]) {
    const u32 w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        v[2 * i] = dsv4::bf16_lo(w[i]);
        v[2 * i + 1] = dsv4::bf16_hi(w[i]);
    }
}

// VEC elements of a row starting at channel c0 (channel stride `cs`), as f32.
template <int VEC, typename T>
__device__ __forceinline__ void load_chunk(const T* row, i64 c0, i64 cs, float (&v)[VEC]) {
    if constexpr (VEC * sizeof(T) == 16) {
        dsv4::load16(row + c0, v);
    } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) v[i] = dsv4::to_f32(row[(c0 + i) * cs]);
    }
}

template <int VEC, typename T>
__device__ __forceinline__ void store_chunk(T* row, i64 c0, const float (&v)[VEC]) {
    if constexpr (VEC * sizeof(T) == 16) {
        dsv4::store16(row + c0, v);
    } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) row[c0 + i] = dsv4::from_f32<T>(v[i]);
    }
}

}  // namespace qnorm_rope
