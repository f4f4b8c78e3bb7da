// Shared device helpers for every dsv4 kernel: fixed-width types, bf16 load/store,
// 16-byte vector access, warp reductions, and the params-size check macro.
//
// Kernels are compiled at run time by NVRTC (src/nvrtc.rs). Headers under kernels/ are
// handed to NVRTC by name: include them by their path under kernels/
// (`#include "sinkhorn/sinkhorn.cuh"`) or, for top-level headers and siblings of the
// file being compiled, by bare name (`#include "common.cuh"`).
//
// Every `.cu` file must compile on its own with its default defines; tests/nvrtc_compile.rs
// compiles each for sm_90a and sm_80, plus one variant per line
// `// dsv4-test-defines: NAME=VALUE ...` near the top of the file. A file that only
// targets some architectures says so with `// dsv4-archs: sm_90a`.
#pragma once

#include <cuda_bf16.h>

typedef signed char i8;
typedef int i32;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;
typedef __nv_bfloat16 bf16;

// The size of a params struct, asserted here and in its Rust mirror (the test
// `params_sizes_match_headers` reads these lines and compares them with the Rust table).
#define DSV4_PARAMS_SIZE(type, bytes) \
    static_assert(sizeof(type) == (bytes), #type " must be " #bytes " bytes, as its #[repr(C)] Rust mirror")

#define DSV4_FULL_MASK 0xffffffffu

namespace dsv4 {

// ---- scalar conversion ---------------------------------------------------------------
__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(bf16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
// Round to nearest even, as torch's `.to(torch.bfloat16)`.
template <> __device__ __forceinline__ bf16 from_f32<bf16>(float x) { return __float2bfloat16_rn(x); }

// `x` rounded through bf16 and back (a rounding boundary of the maths).
__device__ __forceinline__ float round_bf16(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

// ---- 16-byte vectors -----------------------------------------------------------------
// 16 bytes (8 bf16 or 4 f32) with one 128-bit access; the address must be 16-byte
// aligned. Bit operations instead of a union keep the values in registers.
__device__ __forceinline__ float bf16_lo(u32 w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(u32 w) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
    return (u32)__bfloat16_as_ushort(__float2bfloat16_rn(lo)) | ((u32)__bfloat16_as_ushort(__float2bfloat16_rn(hi)) << 16);
}

__device__ __forceinline__ void load16(const bf16* p, float (&out)[8]) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const u32 w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        out[2 * i] = bf16_lo(w[i]);
        out[2 * i + 1] = bf16_hi(w[i]);
    }
}
__device__ __forceinline__ void load16(const float* p, float (&out)[4]) {
    const float4 u = *reinterpret_cast<const float4*>(p);
    out[0] = u.x, out[1] = u.y, out[2] = u.z, out[3] = u.w;
}
__device__ __forceinline__ void store16(bf16* p, const float (&in)[8]) {
    *reinterpret_cast<uint4*>(p) = make_uint4(pack_bf16(in[0], in[1]), pack_bf16(in[2], in[3]), pack_bf16(in[4], in[5]), pack_bf16(in[6], in[7]));
}
__device__ __forceinline__ void store16(float* p, const float (&in)[4]) {
    *reinterpret_cast<float4*>(p) = make_float4(in[0], in[1], in[2], in[3]);
}

// ---- warp reductions -----------------------------------------------------------------
// Sum over the aligned group of `width` lanes (a power of two <= 32; 1-D blocks). The
// shuffles name only the group's own lanes: other groups of the warp may have left a loop
// the group is still in (a full-warp mask would then name exited lanes: undefined).
__device__ __forceinline__ float group_sum(float x, int width) {
    const unsigned lane = threadIdx.x % 32;
    const unsigned mask = width >= 32 ? DSV4_FULL_MASK : ((1u << width) - 1u) << (lane & ~static_cast<unsigned>(width - 1));
    for (int o = width / 2; o > 0; o /= 2) x += __shfl_xor_sync(mask, x, o, width);
    return x;
}
__device__ __forceinline__ float warp_sum(float x) { return group_sum(x, 32); }

// ---- integer tensors of either width -------------------------------------------------
// Element `i` of an integer tensor stored as i32 (`is_i64 == 0`) or i64.
__device__ __forceinline__ i64 load_int(const void* p, i64 i, i32 is_i64) {
    return is_i64 ? static_cast<const i64*>(p)[i] : static_cast<i64>(static_cast<const i32*>(p)[i]);
}

}  // namespace dsv4
