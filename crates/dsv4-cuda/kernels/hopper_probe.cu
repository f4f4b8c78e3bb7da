// A check of the Hopper primitives (hopper.cuh, wgmma.cuh) on their own, for the GPU
// tests (tests/gpu_sparse_attention.rs, `small_hopper_wgmma_layouts`): one warpgroup loads
// A, B [64 x 512] bf16 into SW128 tiles and computes, with the descriptors the kernels use,
//   s   = A B^T                         (64 x 64; both operands K-major; 32 k-steps)
//   o_rs = A[:, :64] B[:, 256h : 256h + 256]   (A from registers, B N-major: the P V of
//   o_ss = the same with A from shared memory   the attention forward)
// so a wrong descriptor shows up as a wrong matrix, not as a wrong attention output.
//
// dsv4-archs: sm_90a

#include "common.cuh"
#include "hopper.cuh"
#include "wgmma.cuh"

using namespace dsv4;
using namespace dsv4::hopper;

struct HopperProbeParams {
    const bf16* a;  // [64, 512] row-major
    const bf16* b;  // [64, 512] row-major
    float* s;       // [64, 64] out
    float* o_rs;    // [64, 256] out
    float* o_ss;    // [64, 256] out
    i32 half;       // which 256 columns of B
    i32 pad_;
};
DSV4_PARAMS_SIZE(HopperProbeParams, 48);

extern "C" __global__ void __launch_bounds__(128, 1) hopper_probe(const HopperProbeParams p) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    unsigned char* smem = align_1024(smem_raw);
    const u32 a_base = smem_u32(smem), b_base = a_base + 65536;
    const int tid = threadIdx.x;
    for (int id = tid; id < 64 * 64; id += 128) {
        const int r = id / 64, c = id % 64;
        const uint4 va = *reinterpret_cast<const uint4*>(p.a + r * 512 + c * 8);
        const uint4 vb = *reinterpret_cast<const uint4*>(p.b + r * 512 + c * 8);
        const u32 off = (c / 8) * 8192 + sw128(r, c % 8);
        asm volatile("st.shared.v4.b32 [%0], {%1,%2,%3,%4};\n" ::"r"(a_base + off), "r"(va.x), "r"(va.y), "r"(va.z), "r"(va.w) : "memory");
        asm volatile("st.shared.v4.b32 [%0], {%1,%2,%3,%4};\n" ::"r"(b_base + off), "r"(vb.x), "r"(vb.y), "r"(vb.z), "r"(vb.w) : "memory");
    }
    fence_proxy_async();
    __syncthreads();
    const int warp = tid / 32, lane = tid % 32, g = lane / 4, c4 = lane % 4;
    const int r0 = warp * 16 + g, r1 = r0 + 8;

    float s[32];
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < 32; ++ks) {
        const u32 off = (ks / 4) * 8192 + (ks % 4) * 32;
        wgmma_m64n64k16_ss<0>(s, sw128_desc(a_base + off, 16, 1024), sw128_desc(b_base + off, 16, 1024), ks > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(s);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const int col = 8 * j + 2 * c4;
        p.s[r0 * 64 + col] = s[4 * j];
        p.s[r0 * 64 + col + 1] = s[4 * j + 1];
        p.s[r1 * 64 + col] = s[4 * j + 2];
        p.s[r1 * 64 + col + 1] = s[4 * j + 3];
    }

    for (int mode = 0; mode < 2; ++mode) {
        float o[128];
#pragma unroll
        for (int i = 0; i < 128; ++i) o[i] = 0.0f;
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            const u64 db = sw128_desc(b_base + p.half * 4 * 8192 + kk * 2048, 8192, 1024);
            if (mode == 0) {
                u32 a[4];
                const u32* ar0 = reinterpret_cast<const u32*>(p.a + r0 * 512 + kk * 16 + 2 * c4);
                const u32* ar1 = reinterpret_cast<const u32*>(p.a + r1 * 512 + kk * 16 + 2 * c4);
                a[0] = ar0[0];
                a[1] = ar1[0];
                a[2] = ar0[4];
                a[3] = ar1[4];
                wgmma_m64n256k16_rs<1>(o, a, db, 1);
            } else {
                wgmma_m64n256k16_ss<1>(o, sw128_desc(a_base + kk * 32, 16, 1024), db, 1);
            }
        }
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(o);
        float* out = mode == 0 ? p.o_rs : p.o_ss;
#pragma unroll
        for (int j = 0; j < 32; ++j) {
            const int col = 8 * j + 2 * c4;
            out[r0 * 256 + col] = o[4 * j];
            out[r0 * 256 + col + 1] = o[4 * j + 1];
            out[r1 * 256 + col] = o[4 * j + 2];
            out[r1 * 256 + col + 1] = o[4 * j + 3];
        }
    }
}
