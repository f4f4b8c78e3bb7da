// A strided bf16 tensor (rank <= 4, padded with leading size-1 dims) copied into a
// contiguous one, for sparse-attention inputs whose rows the tensor-core loaders cannot
// read directly (last dim strided, or rows not 16-byte aligned).

#include "common.cuh"
#include "sparse_attention/params.cuh"

using namespace dsv4;

extern "C" __global__ void __launch_bounds__(256) sparse_attn_pack(const SparseAttnPackParams p) {
    const i64 total = p.n0 * p.n1 * p.n2 * p.n3;
    for (i64 i = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += static_cast<i64>(gridDim.x) * blockDim.x) {
        i64 r = i;
        const i64 i3 = r % p.n3;
        r /= p.n3;
        const i64 i2 = r % p.n2;
        r /= p.n2;
        const i64 i1 = r % p.n1;
        const i64 i0 = r / p.n1;
        p.dst[i] = p.src[i0 * p.s0 + i1 * p.s1 + i2 * p.s2 + i3 * p.s3];
    }
}
