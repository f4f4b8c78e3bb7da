// A strided bf16 tensor (rank <= 4, padded with leading size-1 dims) copied into a
// contiguous one, for sparse-attention inputs whose rows the tensor-core loaders cannot
// read directly (last dim strided, or rows not 16-byte aligned), or whose head dim is not
// a multiple of 64: dst's last dim is n3_dst, column i3 of dst = src column i3 when
// i3 < n3, else 0. The same kernel cuts a padded result back (n3_dst < n3).

#include "common.cuh"
#include "sparse_attention/params.cuh"

using namespace dsv4;

extern "C" __global__ void __launch_bounds__(256) sparse_attn_pack(const SparseAttnPackParams p) {
    const i64 total = p.n0 * p.n1 * p.n2 * p.n3_dst;
    for (i64 i = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += static_cast<i64>(gridDim.x) * blockDim.x) {
        i64 r = i;
        const i64 i3 = r % p.n3_dst;
        r /= p.n3_dst;
        const i64 i2 = r % p.n2;
        r /= p.n2;
        const i64 i1 = r % p.n1;
        const i64 i0 = r / p.n1;
        p.dst[i] = i3 < p.n3 ? p.src[i0 * p.s0 + i1 * p.s1 + i2 * p.s2 + i3 * p.s3] : from_f32<bf16>(0.0f);
    }
}
