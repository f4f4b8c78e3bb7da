// Q RMSNorm + partial interleaved RoPE (SPEC.md section 5): params and helpers shared by
// the forward and the backward.
//
// Two kernels per direction:
// - `*_fast` (fwd_fast.cu, bwd_fast.cu: bf16 x, and grad backward, with unit channel stride
//   and 16-byte aligned rows; 16-byte aligned output): a group of LPR lanes per row, each
//   lane holding CPL 16-byte chunks of 8 channels (a RoPE pair never straddles a chunk:
//   chunks start at multiples of 8 and C - R is even); sums by shuffles over the group;
//   streaming (evict-first) loads and stores; cos/sin as float4 where CS_VEC.
//   Forward: one block of U rows per lane group, every 16-byte load of the block issued
//   before any use, a grid of every block (not persistent). Backward: persistent (one wave
//   of resident blocks), x, grad and rstd of the next STAGES - 1 row blocks in flight
//   through a shared-memory ring filled by cp.async.
// - the generic kernels (fwd.cu, bwd.cu: any strides, f32 x or grad): one warp per row,
//   staged in shared memory (f32) so a channel can read its RoPE partner.
// Rows run in token-major order r = (b*S + s)*H + h, so consecutive rows are written
// consecutively and the heads of one token, which share cos/sin, run side by side.
#pragma once
#include "common.cuh"

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

// The element type of a tensor: bf16 (BF16) or f32.
template <bool BF16> struct Elem { using T = float; };
template <> struct Elem<true> { using T = bf16; };

// A rounding boundary of the maths: bf16 when x is bf16, nothing for f32 x.
template <bool X_BF16>
__device__ __forceinline__ float boundary(float v) {
    if constexpr (X_BF16) {
        return dsv4::round_bf16(v);
    } else {
        return v;
    }
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
// CS_VEC: cos and sin have unit r stride, 16-byte aligned (b, s) rows and C - R is a
// multiple of 8 (the launcher checks): a chunk's 4 pairs read one float4 of each.
template <bool CS_VEC>
__device__ __forceinline__ void chunk_cos_sin(const QNormRopeParams& p, const float* cs, const float* sn, i64 c0, i64 rot0, float (&cj)[4], float (&sj)[4]) {
    if constexpr (CS_VEC) {
        const i64 j0 = (c0 - rot0) / 2;  // c0 >= rot0: both multiples of 8
        const float4 c = __ldg(reinterpret_cast<const float4*>(cs + j0));
        const float4 s = __ldg(reinterpret_cast<const float4*>(sn + j0));
        cj[0] = c.x, cj[1] = c.y, cj[2] = c.z, cj[3] = c.w;
        sj[0] = s.x, sj[1] = s.y, sj[2] = s.z, sj[3] = s.w;
    } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const i64 e = c0 + 2 * i;
            const i64 j = (e - rot0) / 2;
            cj[i] = e < rot0 ? 1.f : __ldg(cs + j * p.cos_stride[2]);
            sj[i] = e < rot0 ? 0.f : __ldg(sn + j * p.sin_stride[2]);
        }
    }
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

// ---- the backward's shared-memory ring ----------------------------------------------

// 16 (or 4) bytes global -> shared, asynchronously (sm_80+, L1 bypassed for 16); `valid ==
// false` writes zeros and reads nothing (src must still be a mapped address).
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp_async4(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 4 : 0) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Until at most N of this thread's newest groups are pending (its own copies visible to it).
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }
__device__ __forceinline__ uint4 lds16(u32 a) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a) : "memory");
    return v;
}
__device__ __forceinline__ float lds4(u32 a) {
    float v;
    asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(v) : "r"(a) : "memory");
    return v;
}
__device__ __forceinline__ u32 smem_addr(const void* p) { return static_cast<u32>(__cvta_generic_to_shared(p)); }

// ---- the fast kernels' row bodies ----------------------------------------------------

// The fast kernels' row shape: LPR lanes per row (a power of two <= 32), CPL 16-byte chunks
// per lane (LPR * CPL * 8 >= C), CS_VEC as in chunk_cos_sin.
//
// Forward of one row r (token-major) from this lane's CPL raw chunks (chunk k holds
// channels 8 * (gl + LPR * k) .. + 8; zeros past C): every lane of the group calls it
// with the same r (the group's shuffles), rows r >= n_rows store nothing.
//   rstd = 1 / sqrt(mean_c x^2 + eps);  y = bf16(x * rstd);  last R channels rotated.
// bf16(x * rstd) and the rotated values are rounded once, by the store's packing, except y
// of rotated chunks, which the rotation reads rounded (bf16(bf16(v)) = bf16(v): the same
// values as rounding each at its boundary).
template <int LPR, int CPL, bool CS_VEC>
__device__ __forceinline__ void fwd_row(const QNormRopeParams& p, i64 r, i64 n_rows, i64 rot0, bool small, int gl, const uint4 (&raw)[CPL]) {
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < CPL; ++k) {
        float v[8];
        unpack8(raw[k], v);
#pragma unroll
        for (int i = 0; i < 8; ++i) ss = fmaf(v[i], v[i], ss);
    }
    ss = dsv4::group_sum(ss, LPR);
    const float rstd = 1.f / sqrtf(ss / (float)p.C + p.eps);
    if (r >= n_rows) return;  // the whole group: r is the group's
    if (gl == 0) p.rstd_out[r] = rstd;
    const RowIndex ix = row_index_fast(p, r, small);
    const float* cs = p.cos + ix.b * p.cos_stride[0] + ix.s * p.cos_stride[1];
    const float* sn = p.sin + ix.b * p.sin_stride[0] + ix.s * p.sin_stride[1];
    bf16* o = static_cast<bf16*>(p.out) + r * p.C;
#pragma unroll
    for (int k = 0; k < CPL; ++k) {
        const i64 c0 = 8 * (gl + (i64)LPR * k);
        if (c0 >= p.C) continue;
        float v[8];
        unpack8(raw[k], v);
        if (c0 + 8 > rot0) {
#pragma unroll
            for (int i = 0; i < 8; ++i) v[i] = dsv4::round_bf16(v[i] * rstd);  // y = bf16(x * rstd)
            // (a, b) = (y[e], y[e+1]) -> (a cos - b sin, a sin + b cos), no FMA contraction
            float cj[4], sj[4];
            chunk_cos_sin<CS_VEC>(p, cs, sn, c0, rot0, cj, sj);
#pragma unroll
            for (int i = 0; i < 8; i += 2) {
                if (c0 + i < rot0) continue;
                const float a = v[i], b = v[i + 1];
                v[i] = __fsub_rn(__fmul_rn(a, cj[i / 2]), __fmul_rn(b, sj[i / 2]));
                v[i + 1] = __fadd_rn(__fmul_rn(a, sj[i / 2]), __fmul_rn(b, cj[i / 2]));
            }
        } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) v[i] *= rstd;  // y = bf16(x * rstd), rounded by the store
        }
        st16_cs(o + c0, v);  // pack_bf16: round to nearest even
    }
}

// Backward of one row r from this lane's raw chunks of x and grad (zeros past C) and its
// rstd; every lane of the group calls it with the same r, rows r >= n_rows store nothing:
//   g' = bf16(conjugate rotation of g's last R pairs);  dx = rstd (g' - xhat mean_c(g' xhat)).
template <int LPR, int CPL, bool CS_VEC>
__device__ __forceinline__ void bwd_row(const QNormRopeParams& p, i64 r, i64 n_rows, i64 rot0, bool small, int gl, const uint4 (&xraw)[CPL], const uint4 (&graw)[CPL], float rstd) {
    const RowIndex ix = row_index_fast(p, r < n_rows ? r : 0, small);
    const float* cs = p.cos + ix.b * p.cos_stride[0] + ix.s * p.cos_stride[1];
    const float* sn = p.sin + ix.b * p.sin_stride[0] + ix.s * p.sin_stride[1];
    float gp[CPL][8];
    float dot = 0.f;
#pragma unroll
    for (int k = 0; k < CPL; ++k) {
        const i64 c0 = 8 * (gl + (i64)LPR * k);
        unpack8(graw[k], gp[k]);
        if (r < n_rows && c0 < p.C && c0 + 8 > rot0) {
            float cj[4], sj[4];
            chunk_cos_sin<CS_VEC>(p, cs, sn, c0, rot0, cj, sj);
#pragma unroll
            for (int i = 0; i < 8; i += 2) {
                if (c0 + i < rot0) continue;
                const float ga = gp[k][i], gb = gp[k][i + 1];
                gp[k][i] = dsv4::round_bf16(__fadd_rn(__fmul_rn(ga, cj[i / 2]), __fmul_rn(gb, sj[i / 2])));
                gp[k][i + 1] = dsv4::round_bf16(__fsub_rn(__fmul_rn(gb, cj[i / 2]), __fmul_rn(ga, sj[i / 2])));
            }
        }
        float xv[8];
        unpack8(xraw[k], xv);
#pragma unroll
        for (int i = 0; i < 8; ++i) dot += gp[k][i] * xv[i] * rstd;  // mean_c(g' * xhat)
    }
    const float mean = dsv4::group_sum(dot, LPR) / (float)p.C;
    if (r >= n_rows) return;  // the whole group: r is the group's
    bf16* o = static_cast<bf16*>(p.out) + r * p.C;
#pragma unroll
    for (int k = 0; k < CPL; ++k) {
        const i64 c0 = 8 * (gl + (i64)LPR * k);
        if (c0 >= p.C) continue;
        float xv[8], v[8];
        unpack8(xraw[k], xv);
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = rstd * (gp[k][i] - xv[i] * rstd * mean);  // dx
        st16_cs(o + c0, v);
    }
}

}  // namespace qnorm_rope
