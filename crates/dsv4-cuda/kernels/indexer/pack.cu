// A strided bf16 tensor copied into a contiguous one whose last dim is padded with zeros
// to a multiple of 8 elements, so that every row starts 16-byte aligned and can be read
// with 16-byte cp.async by the tensor-core kernels (used only when q or pooled_kv is not
// already laid out that way).
#include "indexer/params.cuh"

extern "C" __global__ void __launch_bounds__(256) indexer_pack_bf16(const IndexerPackParams p) {
    const i64 total = p.n0 * p.n1 * p.n2 * p.n3_pad;
    for (i64 i = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += static_cast<i64>(gridDim.x) * blockDim.x) {
        const i64 i3 = i % p.n3_pad;
        const i64 r = i / p.n3_pad;
        const i64 i2 = r % p.n2, i1 = (r / p.n2) % p.n1, i0 = r / (p.n2 * p.n1);
        p.dst[i] = i3 < p.n3 ? p.src[i0 * p.s0 + i1 * p.s1 + i2 * p.s2 + i3 * p.s3] : __float2bfloat16_rn(0.0f);
    }
}
