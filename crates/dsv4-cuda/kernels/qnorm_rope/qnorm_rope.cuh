// Q RMSNorm + partial interleaved RoPE (SPEC.md section 5): params and helpers shared by
// the forward and the backward.
//
// One warp per row (b, s, h), rows in token-major order r = (b*S + s)*H + h, so
// consecutive warps write consecutive rows of the token-major output. Each warp stages its
// row in shared memory (f32) so a channel can read its RoPE partner.
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
