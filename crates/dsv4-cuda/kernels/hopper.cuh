// Hopper (sm_90a) primitives shared by the warp-specialised kernels: shared-memory
// barriers (mbarrier), named barriers, register reallocation between warpgroups, the
// wgmma fences and shared-memory matrix descriptors, and the 128-byte swizzle every wgmma
// operand tile here is stored in. The wgmma instructions themselves are in wgmma.cuh.
//
// Operand tiles ("SW128"): a matrix whose contiguous dimension is split into groups of 64
// bf16 (128 bytes); a group is stored as rows of 128 bytes (row r at r * 128) and the
// 16-byte chunk j of row r sits at chunk position j ^ (r % 8). Groups follow each other
// (group g of a rows-row tile at g * rows * 128). The tile base is 1024-byte aligned.
//   K-major operand (the contiguous dim is the reduction dim, e.g. Q and K in Q K^T):
//     descriptor start = group base + 32 * (k16 step within the group), SBO = 1024
//     (8 rows of 128 bytes), LBO unused.
//   N-major operand (the contiguous dim is N, e.g. V in P V, with TB = 1):
//     start = tile base + 2048 * (k16 step: 16 rows), LBO = the group stride (N groups of
//     64), SBO = 1024 (8 rows along K).
#pragma once

#include "common.cuh"

namespace dsv4 {
namespace hopper {

__device__ __forceinline__ u32 smem_u32(const void* p) { return static_cast<u32>(__cvta_generic_to_shared(p)); }

// The dynamic shared memory rounded up to 1024 bytes (SW128 tiles; the launchers pass
// 1024 bytes of slack).
__device__ __forceinline__ unsigned char* align_1024(unsigned char* smem_raw) { return smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023); }

// Byte offset of (row, 16-byte chunk j within a 64-element group) in one SW128 group.
__device__ __forceinline__ u32 sw128(int row, int j) { return static_cast<u32>(row * 128 + ((j ^ (row & 7)) << 4)); }

// ---- shared-memory matrix descriptor (128-byte swizzle) -------------------------------
__device__ __forceinline__ u64 sw128_desc(u32 smem_addr, u32 lbo_bytes, u32 sbo_bytes) {
    u64 d = 0;
    d |= static_cast<u64>((smem_addr & 0x3FFFF) >> 4);
    d |= static_cast<u64>((lbo_bytes & 0x3FFFF) >> 4) << 16;
    d |= static_cast<u64>((sbo_bytes & 0x3FFFF) >> 4) << 32;
    d |= static_cast<u64>(1) << 62;  // layout type 1: 128-byte swizzle
    return d;
}

// The descriptor of the tile `bytes` further on (bytes a multiple of 16): only the
// start-address field moves, and it cannot carry out (shared addresses < 256 KiB fit its
// 14 bits), so a product's k-steps cost one 32-bit add each instead of a rebuilt descriptor.
__device__ __forceinline__ u64 desc_advance(u64 d, u32 bytes) {
    const u32 lo = static_cast<u32>(d) + (bytes >> 4), hi = static_cast<u32>(d >> 32);
    return (static_cast<u64>(hi) << 32) | lo;
}

// ---- wgmma ordering ------------------------------------------------------------------
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// Keeps the compiler from moving accesses of an accumulator across wgmma issue / wait.
template <int N> __device__ __forceinline__ void fence_regs(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// Generic-proxy shared-memory writes (st.shared) made visible to the async proxy (wgmma
// operands); each writing thread, before the barrier that publishes them.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// ---- register reallocation (the kernel needs __launch_bounds__(threads, 1)) ---------
template <int R> __device__ __forceinline__ void regs_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(R)); }
template <int R> __device__ __forceinline__ void regs_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(R)); }

// ---- named barriers (id 0 is __syncthreads) -----------------------------------------
__device__ __forceinline__ void named_sync(int id, int threads) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory"); }
// Arrive on barrier `id` without waiting (the other side of a hand-off syncs on it).
__device__ __forceinline__ void named_arrive(int id, int threads) { asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory"); }

// ---- mbarrier -------------------------------------------------------------------------
__device__ __forceinline__ void mbar_init(u64* bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
// A plain arrival (release: this thread's earlier shared-memory writes are visible to a
// waiter that sees the phase complete). The arrival's state token goes to the sink `_`:
// the arriving thread never waits on this phase itself (compute-sanitizer's synccheck
// reports a kept but unused token as a missing wait).
__device__ __forceinline__ void mbar_arrive(u64* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
// A copying thread's one arrival per phase: fires once every cp.async this thread issued
// before it has landed (.noinc: it counts as one of the barrier's expected arrivals, so
// init the barrier with one count per copying thread). It does NOT release the thread's
// plain st.shared stores: publish those through a separate barrier (mbar_arrive). One
// arrival per thread and phase is also what compute-sanitizer's synccheck accepts (an
// asynchronous plus a plain arrival of one thread in one phase is reported as
// "Missing wait", docs/perf/LOG.md v6).
__device__ __forceinline__ void mbar_arrive_after_cp_async(u64* bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
// Wait until the phase with parity `parity` has completed.
// DSV4_MBAR_TIMEOUT_POLLS=N (debugging, through DSV4_EXTRA_DEFINES): a wait whose phase has
// not completed after N polls traps (each try_wait suspends the thread for up to a
// hardware time limit, about 1 us: N = 10000000 is roughly 10 s), so a deadlocked pipeline
// fails its launch ("unspecified launch failure") instead of hanging the process.
__device__ __forceinline__ void mbar_wait(u64* bar, u32 parity) {
#ifdef DSV4_MBAR_TIMEOUT_POLLS
    asm volatile(
        "{\n.reg .pred done;\n.reg .u32 n;\n"
        "mov.u32 n, 0;\n"
        "WAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@done bra DONE_%=;\n"
        "add.u32 n, n, 1;\n"
        "setp.gt.u32 done, n, %2;\n"
        "@!done bra WAIT_%=;\n"
        "trap;\n"
        "DONE_%=:\n}\n" ::"r"(smem_u32(bar)),
        "r"(parity), "n"(DSV4_MBAR_TIMEOUT_POLLS)
        : "memory");
#else
    asm volatile(
        "{\n.reg .pred done;\n"
        "WAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT_%=;\n}\n" ::"r"(smem_u32(bar)),
        "r"(parity)
        : "memory");
#endif
}

// 16 bytes global -> shared, asynchronously; `valid == false` writes 16 zero bytes and
// reads nothing (src must still be a mapped address). Shared address as a u32.
__device__ __forceinline__ void cp_async16_to(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0) : "memory");
}
// The same with an L2 cache policy (a `createpolicy` result).
__device__ __forceinline__ void cp_async16_to(u32 dst, const void* src, bool valid, u64 policy) {
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0), "l"(policy) : "memory");
}

}  // namespace hopper
}  // namespace dsv4
