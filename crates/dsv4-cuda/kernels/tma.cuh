// Hopper (sm_90a) tensor-memory-accelerator (TMA) loads: a tile of a global tensor ->
// shared memory by one thread's cp.async.bulk.tensor, completed on an mbarrier by byte
// count. The mbarrier helpers (init, wait, plain arrive) are hopper.cuh's.
//
// The tensor map (the TMA descriptor: base address, sizes, byte strides, box, swizzle,
// out-of-bounds fill) is encoded on the host (cuTensorMapEncodeTiled, `TmaDesc` in
// src/runtime.rs) and passed by value as a `const __grid_constant__ TmaDesc` kernel
// parameter: the instructions take the parameter's generic address (a __grid_constant__
// parameter is never copied to local memory, so that address stays in the param space).
// <cuda.h>'s CUtensorMap is not among the headers NVRTC gets here (src/nvrtc.rs), hence
// the struct of the same size and alignment.
//
// Protocol for one stage of a ring (one producer thread, the consumers wait on `full`):
//   full initialised with count 1;
//   producer: wait empty, arrive_expect_tx(full, bytes of every box of the stage), then
//   the loads (each completes its bytes on full); the phase completes once the arrival
//   and all the bytes are in.
// The transaction count is the whole box, also where the box lies partly (or wholly)
// outside the tensor: TMA writes every byte of the box in shared memory, out-of-bounds
// elements as zeros (oobFill NONE), and counts them.
// TMA writes through the async proxy, like wgmma reads: a consumer that saw the phase
// complete may issue wgmma on the stage without a proxy fence. No cp.async.wait_group,
// no fence.proxy.async in the producer.
#pragma once

#include "common.cuh"

namespace dsv4 {

// A CUtensorMap: 128 opaque bytes, 64-byte aligned (the driver's requirement).
struct alignas(64) TmaDesc {
    u64 v[16];
};
DSV4_PARAMS_SIZE(TmaDesc, 128);
static_assert(alignof(TmaDesc) == 64, "TmaDesc: 64-byte aligned, as CUtensorMap");

namespace tma {

// The tensor map's generic address (of a __grid_constant__ kernel parameter).
__device__ __forceinline__ u64 desc_addr(const TmaDesc& map) { return reinterpret_cast<u64>(&map); }

// Fetch the descriptor into the TMA unit's cache ahead of the first load (a hint).
__device__ __forceinline__ void prefetch_desc(const TmaDesc& map) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(desc_addr(map)) : "memory");
}

// Make this thread's mbarrier.init visible to the async proxy (the TMA unit completes
// transactions on the barrier): after the inits, before the barrier that publishes them.
__device__ __forceinline__ void fence_barrier_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }

// One arrival on `bar` (shared address) that also expects `bytes` more transaction bytes
// in this phase. Token to the sink `_` (see hopper.cuh's mbar_arrive).
__device__ __forceinline__ void arrive_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

// The box of a 3D tensor map at element coordinates (c0 innermost, c1, c2) -> shared
// memory at `dst` (shared address; 1024-byte aligned for the 128-byte swizzle), completing
// the box's bytes on `bar` (shared address). Coordinates may lie outside the tensor
// (zeros there).
__device__ __forceinline__ void load_3d(u32 dst, const TmaDesc& map, int c0, int c1, int c2, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
        "l"(desc_addr(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
        : "memory");
}

// The same for a 4D tensor map (c0 innermost .. c3).
__device__ __forceinline__ void load_4d(u32 dst, const TmaDesc& map, int c0, int c1, int c2, int c3, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(dst),
        "l"(desc_addr(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
        : "memory");
}

}  // namespace tma
}  // namespace dsv4
