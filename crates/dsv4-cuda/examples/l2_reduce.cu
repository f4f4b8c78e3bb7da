// L2 reduction throughput probe for the attention backward's dkv flush (examples/l2_reduce.rs):
// every launch adds rows x slots key rows of 512 f32 (2 KiB) into dst [keys, 512], one CTA
// (256 threads) a query row, in one of four access shapes:
//   red_quads: a warp instruction = 8 key rows x 64 B (the backward flush's shape: shuffled quads to v13, permuted columns since v14)
//   red_lines: a warp instruction = 4 key rows x 128 B
//   red_rows:  a warp instruction = 1 key row x 512 B
//   bulk:      cp.reduce.async.bulk of whole 2 KiB rows from shared memory (16 keys a
//              stage, two stages)
// CTA i takes row spread(i) (G regions: CTAs running together take rows far apart). With
// `gather` set each warp also reads the 1 KiB bf16 kv row of every key it adds into (the
// backward's K/V gathers through the same L2); the launch's dynamic shared memory (unused
// except by `bulk`) sets how many CTAs share an SM.
typedef unsigned int u32;

__device__ __forceinline__ int spread(int i, int n, int G) {
    if (G <= 1) return i;
    const int q = n / G;
    return i < G * q ? (i % G) * q + i / G : i;
}

// The kv row of `key` (1 KiB: 64 x 16 B), 2 x 16 B a lane, folded into `acc`.
__device__ __forceinline__ void read_row(const uint4* kv, int key, int lane, unsigned& acc) {
    const uint4 a = __ldg(kv + (long long)key * 64 + lane), b = __ldg(kv + (long long)key * 64 + 32 + lane);
    acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w;
}

__device__ __forceinline__ void red_v4(float* dst, float4 v) {
    asm volatile("red.relaxed.gpu.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(dst), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w) : "memory");
}

// R key rows a warp instruction (8: quads, 4: lines, 1: rows), 32 / R lanes a row, each
// lane 16 bytes: a row's 2 KiB in 512 / (4 * 32 / R) instructions.
template <int R>
__device__ __forceinline__ void red_rows_of(float* dst, const int* keys, int slots, int G, const uint4* kv, int gather, unsigned* sink) {
    constexpr int kLanes = 32 / R, kSpan = 4 * kLanes;  // lanes a row, floats an instruction a row
    const int row = spread(blockIdx.x, gridDim.x, G);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const float4 v = make_float4(1.f, 1.f, 1.f, 1.f);
    unsigned acc = 0;
    for (int kb = warp * R; kb < slots; kb += 8 * R) {
        const int key = keys[(long long)row * slots + kb + lane / kLanes];
        if (gather)
            for (int j = 0; j < R; ++j) read_row(kv, __shfl_sync(0xffffffffu, key, kLanes * j), lane, acc);
        float* d = dst + (long long)key * 512 + (lane % kLanes) * 4;
#pragma unroll 8
        for (int c = 0; c < 512 / kSpan; ++c) red_v4(d + c * kSpan, v);
    }
    if (acc == 0x12345678u) *sink = acc;
}

extern "C" __global__ void red_quads(float* dst, const int* keys, int slots, int G, const uint4* kv, int gather, unsigned* sink) {
    red_rows_of<8>(dst, keys, slots, G, kv, gather, sink);
}
extern "C" __global__ void red_lines(float* dst, const int* keys, int slots, int G, const uint4* kv, int gather, unsigned* sink) {
    red_rows_of<4>(dst, keys, slots, G, kv, gather, sink);
}
extern "C" __global__ void red_rows(float* dst, const int* keys, int slots, int G, const uint4* kv, int gather, unsigned* sink) {
    red_rows_of<1>(dst, keys, slots, G, kv, gather, sink);
}

extern "C" __global__ void bulk(float* dst, const int* keys, int slots, int G, const uint4* kv, int gather, unsigned* sink) {
    extern __shared__ __align__(128) float stage[];  // [2][16][512]
    const int row = spread(blockIdx.x, gridDim.x, G);
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    unsigned acc = 0;
    int buf = 0;
    for (int kb = 0; kb < slots; kb += 16, buf ^= 1) {
        float* s = stage + buf * 16 * 512;
        // the stage's previous reductions have read it (wait_group.read below) before anyone writes
        __syncthreads();
#pragma unroll
        for (int i = 0; i < 8; ++i) reinterpret_cast<float4*>(s)[tid + 256 * i] = make_float4(1.f, 1.f, 1.f, 1.f);
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
        if (gather)
            for (int j = 2 * warp; j < 2 * warp + 2; ++j) read_row(kv, keys[(long long)row * slots + kb + j], lane, acc);
        if (tid < 16 && kb + tid < slots) {
            const int key = keys[(long long)row * slots + kb + tid];
            const u32 src = static_cast<u32>(__cvta_generic_to_shared(s + tid * 512));
            asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], 2048;\n" ::"l"(dst + (long long)key * 512), "r"(src) : "memory");
        }
        if (tid < 16) {
            asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
            asm volatile("cp.async.bulk.wait_group.read 1;\n" ::: "memory");
        }
    }
    if (tid < 16) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
    if (acc == 0x12345678u) *sink = acc;
}
