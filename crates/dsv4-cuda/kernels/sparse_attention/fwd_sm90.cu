// Sparse MQA attention with sinks, forward (SPEC.md section 1), Hopper path (sm_90a):
// wgmma products fed by a producer warpgroup, for D = 512 and a block of 64 heads.
// Staggered schedule: the running max is a chain between the two consumers, so one
// consumer's softmax overlaps the other's products (docs/perf.md v6).
//
// One CTA = one query row (b, s) x 64 heads (the wgmma M; heads >= H are zero rows that
// are never stored). Three warpgroups:
//   WG 0, producer: loads Q once, then gathers the row's slots in blocks of 64 keys with
//        cp.async into two 64 KiB buffers (block 2i + c into buffer c; the rows of a block
//        are K and V at once: MQA). Each buffer is two column halves L (columns 0-255)
//        and R (256-511), each with a "ready" mbarrier (the producer's 128 threads) and a
//        "free" one (both consumers' 256 threads). Per iteration the halves are refilled
//        in the order they are freed: buffer 0 L, buffer 1 R, buffer 0 R, buffer 1 L.
//   WG 1 and WG 2, consumers c = 0, 1: consumer c owns block 2i + c of iteration i and
//        O's columns [256c, 256c + 256) (128 f32 a thread). S_c = Q K_c^T (64 x 64, m64n64k16
//        over D as two wgmma groups, one per half: consumer 0 starts with L, consumer 1
//        with R, the halves the producer refills first).
//   The running max is a chain, so that one consumer's softmax runs while the other's
//   products do (no barrier where both wait for each other's maxima):
//     c0: m0 = max(m, rowmax S0); P0 = exp2(S0 - m0); O_L, l0 rescaled to m0; m0 published
//         (barrier A, arrive); O_L += P0 V0_L issued (A from registers);
//     c1: (A) m1 = max(m0, rowmax S1); P1 = exp2(S1 - m1); O_R, l1 rescaled to m1; m1
//         published (B, arrive); P1 -> shared (D, arrive); O_R += P1 V1_R issued;
//     c0: (B) f = exp2(m0 - m1) <= 1; P0 * f -> shared (C, arrive); (D) O_L, l0 *= f;
//         O_L += P1 V1_L (A from shared memory);
//     c1: (C) O_R += (P0 f) V0_R.
//   Both consumers end the iteration at m1 (the pair's max); each frees each half once its
//   last product on it is done and issues its next S as two halves around those frees
//   (the end of the loop says in which order, and why any other deadlocks).
// The sink starts the running max (m = sink, l = 1 counted once by consumer 0), so an
// empty row ends with out = 0 and lse = sink, and |logits| ~ 1e4 never overflow; logits
// are kept in log2 units (sm_scale * log2 e), lse is stored in natural log.
//
// Shared memory (SW128 operand tiles, hopper.cuh): Q [64 x 512] 64 KiB, K/V 2 x [64 x 512]
// 128 KiB, P 2 x [64 x 64] 16 KiB, slot keys of the two blocks (for the masks) and of the
// producer's current 1024-slot chunk, the published maxima, row sums, barriers. The Q area
// stages the bf16 output tile at the end (16-byte stores).
//
// dsv4-archs: sm_90a
// dsv4-test-defines: DSV4_SA90_DIAG=5
// dsv4-test-defines: SA90_PREFETCH=0
// dsv4-test-defines: DSV4_SA90_DIAG=8

#include "common.cuh"
#include "hopper.cuh"
#include "wgmma.cuh"
#include "sparse_attention/params.cuh"
#include "sparse_attention/tile.cuh"
#include "sparse_attention/gather_sm90.cuh"

using namespace dsv4;
using namespace dsv4::hopper;
using dsv4::sa::kLn2;
using dsv4::sa::kLog2e;
using dsv4::sa::neg_inf;
using dsv4::sa::slot_key;

// Diagnostics for the bench only (results are wrong; default 0), a bit mask:
// DSV4_SA90_DIAG & 1: the producer issues no K/V copies (its arrivals still complete every
// hand-off): the time of the consumers alone (v8: 2.76 ms at S=16384 vs 3.56).
// & 2: the consumers issue no wgmma (the softmax runs on stale registers): the time of the
// producer's gather alone (v8: 2.77 ms).
// & 4: the consumers skip the softmax arithmetic (no scale, mask, maxima, exp2, sums or
// rescales: P = S as bf16, every barrier, store and hand-off kept): what that work costs
// on the consumers' critical path; 5 = 1 + 4: the products and the hand-offs alone.
// & 8: no iterations (Q load, epilogue and the CTA's launch alone).
#ifndef DSV4_SA90_DIAG
#define DSV4_SA90_DIAG 0
#endif

// SA90_PREFETCH=1 (default): the producer first prefetches into L2 the Q tile and slot
// keys of the row the next CTA on this SM most likely takes (gather_sm90.cuh), so that
// CTA's pipeline fill reads L2 instead of DRAM: on the H200 3.565 -> 3.361 ms at S=16384,
// 0.819 -> 0.780 at S=4096 (docs/perf.md v9). 0 leaves it out (to compare).
#ifndef SA90_PREFETCH
#define SA90_PREFETCH 1
#endif

namespace {
constexpr int kD = 512;                  // head dim
constexpr int kHB = 64;                  // heads per CTA (wgmma M)
constexpr int kBN = 64;                  // slots per block (one consumer's S columns)
constexpr int kThreads = 384;
constexpr int kGroupBytes = kBN * 128;   // one SW128 group (64 columns) of a block or of Q
constexpr int kBlockBytes = 8 * kGroupBytes;  // [64 x 512] bf16
constexpr int kHalfBytes = 4 * kGroupBytes;   // columns 0-255 or 256-511
constexpr int kPBytes = kHB * 128;       // [64 x 64] bf16 SW128
constexpr int kChunk = 1024;             // slot keys the producer reads per index pass

// Byte offsets from the 1024-aligned base.
constexpr int kQOff = 0;
constexpr int kKvOff = kQOff + kBlockBytes;        // [2] buffers
constexpr int kPOff = kKvOff + 2 * kBlockBytes;    // [2] P tiles
constexpr int kKeysOff = kPOff + 2 * kPBytes;      // int [2][64]
constexpr int kMaxOff = kKeysOff + 2 * kBN * 4;    // float [2][64] published maxima (m0, m1)
constexpr int kSumOff = kMaxOff + 2 * kHB * 4;     // float [2][64] final row sums
constexpr int kRowKeysOff = kSumOff + 2 * kHB * 4; // int [1024] the producer's keys of a chunk of slots
constexpr int kBarOff = kRowKeysOff + kChunk * 4;  // u64: q, ready[2][2], free[2][2], keys[2]
constexpr int kBytes = kBarOff + 11 * 8;

// Named barriers (0 is __syncthreads): the chain's four hand-offs, one per consumer for the
// output staging (6, 7), the producer's own (8), the final sums' hand-offs (9, 10: consumer
// c arrives on 9 + c and waits on the other; every hand-off between the consumers is an
// arrive / sync pair, as their code differs).
constexpr int kBarM0 = 1, kBarM1 = 2, kBarP0 = 3, kBarP1 = 4, kBarStage = 6, kBarSums = 9;
}  // namespace

static_assert(kGroupBytes == sa90::kTileGroupBytes, "Q tiles as gather_sm90.cuh loads them");

// Dynamic shared memory the launcher passes: the layout plus alignment slack.
constexpr int kSa90SmemBytes = kBytes + 1024;
static_assert(kSa90SmemBytes <= 232448, "fits the opt-in shared memory of an H100/H200");
static_assert(kSa90SmemBytes == 219736, "mirrored by SA90_FWD_SMEM_BYTES in src/sparse_attention.rs");

// What a consumer needs from the kernel's preamble.
struct ConsumerCtx {
    u32 q_base, kv_base, p_base;
    int* keys_s;
    float* max_s;
    float* sum_s;
    u64* q_bar;
    u64* ready_bar;
    u64* free_bar;
    u64* keys_bar;
    i64 row;
    int h0, n_iters, wtid;
};

// Consumer CW (0 or 1, a compile-time constant: the two roles differ in the chain, and
// every buffer / half / descriptor choice folds away): its block of each pair is buffer CW,
// its columns of O [256 CW, 256 CW + 256).
// O's rows r0 / r1 (o[i + 0, 1] / o[i + 2, 3], the layout of wgmma.cuh) times f0 / f1,
// skipped when no lane of the warp has a factor other than 1.
__device__ __forceinline__ void rescale_o(float (&o)[128], float f0, float f1) {
    if (__any_sync(DSV4_FULL_MASK, f0 != 1.0f || f1 != 1.0f)) {
#pragma unroll
        for (int i = 0; i < 128; i += 4) {
            o[i + 0] *= f0;
            o[i + 1] *= f0;
            o[i + 2] *= f1;
            o[i + 3] *= f1;
        }
    }
}

template <int CW>
__device__ __forceinline__ void consume(const SparseAttnFwdParams& p, const ConsumerCtx& x) {
    constexpr int cw = CW;
    const u32 q_base = x.q_base, kv_base = x.kv_base, p_base = x.p_base;
    int* const keys_s = x.keys_s;
    float* const max_s = x.max_s;
    float* const sum_s = x.sum_s;
    u64* const q_bar = x.q_bar;
    u64* const ready_bar = x.ready_bar;
    u64* const free_bar = x.free_bar;
    const i64 row = x.row;
    const int h0 = x.h0, n_iters = x.n_iters, wtid = x.wtid;
    const int warp = wtid / 32, lane = wtid % 32;
    const int g = lane / 4, c4 = lane % 4;
    const int r0 = warp * 16 + g, r1 = r0 + 8;  // this thread's rows (heads h0 + r)
    const float s_scale = p.sm_scale * kLog2e;
    // The running max this consumer's O and partial sums are scaled to.
    float m0 = (h0 + r0 < p.H ? p.sinks[(h0 + r0) * p.sinks_sh] : 0.0f) * kLog2e;
    float m1 = (h0 + r1 < p.H ? p.sinks[(h0 + r1) * p.sinks_sh] : 0.0f) * kLog2e;
    // Partial row sums of this thread's columns of this consumer's blocks; the sink's
    // exp2(0) = 1 once per row.
    float l0 = (cw == 0 && c4 == 0) ? 1.0f : 0.0f, l1 = l0;

    float o[128];  // O[r0 / r1][256 cw + 8 j + 2 c4 + (0, 1)], layout of wgmma.cuh
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.0f;

    mbar_wait(q_bar, 0);
    const u32 my_kv = kv_base + cw * kBlockBytes, other_kv = kv_base + (1 - cw) * kBlockBytes;
    const u64 qd = sw128_desc(q_base, 16, 1024);
    const u64 kd = sw128_desc(my_kv, 16, 1024);
    // V of this consumer's column half (N-major): own block and the other consumer's.
    const u64 my_vd = sw128_desc(my_kv + cw * kHalfBytes, kGroupBytes, 1024);
    const u64 other_vd = sw128_desc(other_kv + cw * kHalfBytes, kGroupBytes, 1024);
    const u32 my_p = p_base + cw * kPBytes;
    const u64 other_pd = sw128_desc(p_base + (1 - cw) * kPBytes, 16, 1024);

    // S = Q K^T of this consumer's block of iteration `it`, into `sc`: one wgmma group per
    // column half, half `hh` = 0 first (consumer 0: L, consumer 1: R, the halves the producer
    // refills first), each after its half landed. The two halves are issued apart at the end
    // of an iteration (see there), so each is its own function call.
    float sc[32];
    auto issue_s_half = [&](int it, int hh) {
        const int half = hh ^ cw;
        mbar_wait(ready_bar + cw * 2 + half, it & 1);
        sa90::consumer_after_ready();
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < 16; ++k) {
            const int ks = half * 16 + k;
            const u32 off = (ks / 4) * kGroupBytes + (ks % 4) * 32;
            if constexpr ((DSV4_SA90_DIAG & 2) == 0) wgmma_m64n64k16_ss<0>(sc, desc_advance(qd, off), desc_advance(kd, off), hh > 0 || k > 0);
        }
        wgmma_commit();
    };
    if (n_iters > 0) {
        issue_s_half(0, 0);
        issue_s_half(0, 1);
    }

    for (int it = 0; it < n_iters; ++it) {
        const u32 par = it & 1;
        wgmma_wait<0>();
        fence_regs(sc);
        fence_regs(o);
        // This block's S done: the other half of this buffer (used by the other consumer's
        // P V only) is this consumer's to free now.
        mbar_arrive(free_bar + cw * 2 + (1 - cw));
        // ... and the other buffer's other half, which this consumer never reads.
        mbar_arrive(free_bar + (1 - cw) * 2 + (1 - cw));

        // Scale, mask (one key a lane, two ballots), this block's row maxima.
        mbar_wait(x.keys_bar + cw, it & 1);
        const u32 valid_lo = __ballot_sync(DSV4_FULL_MASK, keys_s[cw * kBN + lane] >= 0);
        const u32 valid_hi = __ballot_sync(DSV4_FULL_MASK, keys_s[cw * kBN + 32 + lane] >= 0);
        float pm0 = neg_inf(), pm1 = neg_inf();
#pragma unroll
        for (int jj = 0; jj < 8 && (DSV4_SA90_DIAG & 4) == 0; ++jj) {
            const int col = 8 * (jj % 4) + 2 * c4;
            const u32 valid = jj < 4 ? valid_lo : valid_hi;
            const bool v0 = (valid >> col) & 1, v1 = (valid >> (col + 1)) & 1;
            sc[4 * jj + 0] = v0 ? sc[4 * jj + 0] * s_scale : neg_inf();
            sc[4 * jj + 1] = v1 ? sc[4 * jj + 1] * s_scale : neg_inf();
            sc[4 * jj + 2] = v0 ? sc[4 * jj + 2] * s_scale : neg_inf();
            sc[4 * jj + 3] = v1 ? sc[4 * jj + 3] * s_scale : neg_inf();
            pm0 = fmaxf(pm0, fmaxf(sc[4 * jj + 0], sc[4 * jj + 1]));
            pm1 = fmaxf(pm1, fmaxf(sc[4 * jj + 2], sc[4 * jj + 3]));
        }
        pm0 = fmaxf(pm0, __shfl_xor_sync(DSV4_FULL_MASK, pm0, 1));
        pm1 = fmaxf(pm1, __shfl_xor_sync(DSV4_FULL_MASK, pm1, 1));
        pm0 = fmaxf(pm0, __shfl_xor_sync(DSV4_FULL_MASK, pm0, 2));
        pm1 = fmaxf(pm1, __shfl_xor_sync(DSV4_FULL_MASK, pm1, 2));

        // The chain: consumer 0 starts from its own running max; consumer 1 from consumer
        // 0's published one (never below its own: both ended the last iteration at m1).
        if constexpr (cw == 1) {
            named_sync(kBarM0, 256);
            pm0 = fmaxf(pm0, max_s[r0]);
            pm1 = fmaxf(pm1, max_s[r1]);
        }
        const float mn0 = (DSV4_SA90_DIAG & 4) ? m0 : fmaxf(m0, pm0), mn1 = (DSV4_SA90_DIAG & 4) ? m1 : fmaxf(m1, pm1);
        const float al0 = (DSV4_SA90_DIAG & 4) ? 1.0f : sa90::exp2_p(m0 - mn0), al1 = (DSV4_SA90_DIAG & 4) ? 1.0f : sa90::exp2_p(m1 - mn1);
        m0 = mn0;
        m1 = mn1;
        if (c4 == 0) {
            max_s[cw * kHB + r0] = mn0;
            max_s[cw * kHB + r1] = mn1;
        }
        named_arrive(cw == 0 ? kBarM0 : kBarM1, 256);

        // P = exp2(S - m) (f32 kept in sc for consumer 0's later rescale), bf16 A fragments.
        u32 pa[4][4];
        float ps0 = 0.0f, ps1 = 0.0f;
#pragma unroll
        for (int jj = 0; jj < 8; ++jj) {
            if constexpr ((DSV4_SA90_DIAG & 4) == 0) {
                sc[4 * jj + 0] = sa90::exp2_p(sc[4 * jj + 0] - mn0);
                sc[4 * jj + 1] = sa90::exp2_p(sc[4 * jj + 1] - mn0);
                sc[4 * jj + 2] = sa90::exp2_p(sc[4 * jj + 2] - mn1);
                sc[4 * jj + 3] = sa90::exp2_p(sc[4 * jj + 3] - mn1);
                ps0 += sc[4 * jj + 0] + sc[4 * jj + 1];
                ps1 += sc[4 * jj + 2] + sc[4 * jj + 3];
            }
            pa[jj / 2][(jj % 2) * 2 + 0] = pack_bf16(sc[4 * jj + 0], sc[4 * jj + 1]);
            pa[jj / 2][(jj % 2) * 2 + 1] = pack_bf16(sc[4 * jj + 2], sc[4 * jj + 3]);
        }
        l0 = l0 * al0 + ps0;
        l1 = l1 * al1 + ps1;
        rescale_o(o, al0, al1);
        if constexpr (cw == 1) {
            // P1 is already at the pair's max: to shared memory for consumer 0 at once.
#pragma unroll
            for (int jj = 0; jj < 8; ++jj) {
                asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(my_p + sw128(r0, jj) + 4 * c4), "r"(pa[jj / 2][(jj % 2) * 2 + 0]) : "memory");
                asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(my_p + sw128(r1, jj) + 4 * c4), "r"(pa[jj / 2][(jj % 2) * 2 + 1]) : "memory");
            }
            fence_proxy_async();
            named_arrive(kBarP1, 256);
        }

        // O[:, my half] += P_c V_c (A from registers).
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
            if constexpr ((DSV4_SA90_DIAG & 2) == 0) wgmma_m64n256k16_rs<1>(o, pa[kk], desc_advance(my_vd, kk * 2048), 1);
        wgmma_commit();

        if constexpr (cw == 0) {
            // P0 V0_L done before waiting for m1: buffer 0 L goes back to the producer (which
            // refills it first) sooner. (After the P0 store, as before: 3.39 against 3.30 ms.)
            wgmma_wait<0>();
            fence_regs(o);
            mbar_arrive(free_bar + 0 * 2 + 0);  // buffer 0 L: S0 and P0 V0_L done
            // Rescale P0 to the pair's max m1 and hand it to consumer 1; O_L and l too.
            named_sync(kBarM1, 256);
            const float f0 = sa90::exp2_p(mn0 - max_s[kHB + r0]), f1 = sa90::exp2_p(mn1 - max_s[kHB + r1]);
#pragma unroll
            for (int jj = 0; jj < 8; ++jj) {
                asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(my_p + sw128(r0, jj) + 4 * c4), "r"(pack_bf16(sc[4 * jj + 0] * f0, sc[4 * jj + 1] * f0)) : "memory");
                asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(my_p + sw128(r1, jj) + 4 * c4), "r"(pack_bf16(sc[4 * jj + 2] * f1, sc[4 * jj + 3] * f1)) : "memory");
            }
            fence_proxy_async();
            named_arrive(kBarP0, 256);
            m0 = max_s[kHB + r0];
            m1 = max_s[kHB + r1];
            l0 *= f0;
            l1 *= f1;
            rescale_o(o, f0, f1);
            named_sync(kBarP1, 256);
        } else {
            named_sync(kBarP0, 256);
        }

        // O[:, my half] += P_other V_other (A from shared memory, both at the pair's max).
        mbar_wait(ready_bar + (1 - cw) * 2 + cw, par);  // landed already (the other consumer waited); orders it for this thread
        sa90::consumer_after_ready();
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
            if constexpr ((DSV4_SA90_DIAG & 2) == 0) wgmma_m64n256k16_ss<1>(o, desc_advance(other_pd, kk * 32), desc_advance(other_vd, kk * 2048), 1);
        wgmma_commit();
        // The next S, as two halves around the frees that let the producer refill the other
        // consumer's buffer (each consumer's next S needs both halves of its buffer, and the
        // other consumer's products on it done: waiting for all products before issuing any of
        // the next S would deadlock the chain or expose the loads).
        //   c0: S_L(it+1) needs buffer 0 L, freed mid-iteration; then P1 V1_L is waited
        //       for and buffer 1 L freed; then S_R(it+1) (buffer 0 R, freed by c1 below).
        //   c1: P1 V1_R is waited for and buffer 1 R freed; S_R(it+1); then P0 V0_R is waited
        //       for and buffer 0 R freed; then S_L(it+1) (buffer 1 L, freed by c0 above).
        const bool more = it + 1 < n_iters;
        if constexpr (cw == 1) {
            wgmma_wait<1>();  // P1 V1_R (groups complete in order)
            mbar_arrive(free_bar + 1 * 2 + 1);  // buffer 1 R: S1 and P1 V1_R done
        }
        if (more) {
            issue_s_half(it + 1, 0);
            wgmma_wait<1>();  // this iteration's last product; the new S half runs on
        } else {
            wgmma_wait<0>();
        }
        fence_regs(o);
        mbar_arrive(free_bar + (1 - cw) * 2 + cw);  // the other buffer's half of my columns
        if (more) issue_s_half(it + 1, 1);
    }
    // Nothing is in flight here (the last iteration waited for all its products); the
    // explicit wait tells ptxas so.
    wgmma_wait<0>();
    fence_regs(o);

    // Row sums: this thread's quad, then the two consumers (both at the same max).
    l0 += __shfl_xor_sync(DSV4_FULL_MASK, l0, 1);
    l1 += __shfl_xor_sync(DSV4_FULL_MASK, l1, 1);
    l0 += __shfl_xor_sync(DSV4_FULL_MASK, l0, 2);
    l1 += __shfl_xor_sync(DSV4_FULL_MASK, l1, 2);
    if (c4 == 0) {
        sum_s[cw * kHB + r0] = l0;
        sum_s[cw * kHB + r1] = l1;
    }
    named_arrive(kBarSums + cw, 256);
    named_sync(kBarSums + 1 - cw, 256);  // also: every S product of both is done, so the Q area is free
    const float lt0 = sum_s[r0] + sum_s[kHB + r0], lt1 = sum_s[r1] + sum_s[kHB + r1];
    const float inv0 = 1.0f / lt0, inv1 = 1.0f / lt1;

    // out = O / l staged as bf16 in the Q area (SW128), then 16-byte coalesced stores.
#pragma unroll
    for (int jj = 0; jj < 32; ++jj) {
        const u32 grp = q_base + (cw * 4 + jj / 8) * kGroupBytes;
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(grp + sw128(r0, jj % 8) + 4 * c4), "r"(pack_bf16(o[4 * jj] * inv0, o[4 * jj + 1] * inv0)) : "memory");
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(grp + sw128(r1, jj % 8) + 4 * c4), "r"(pack_bf16(o[4 * jj + 2] * inv1, o[4 * jj + 3] * inv1)) : "memory");
    }
    named_sync(kBarStage + cw, 128);
#pragma unroll 4
    for (int i = 0; i < 16; ++i) {
        const int id = wtid + i * 128;
        const int r = id / 32, cc = id % 32;
        if (h0 + r < p.H) {
            uint4 v;
            asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(q_base + (cw * 4 + cc / 8) * kGroupBytes + sw128(r, cc % 8)) : "memory");
            *reinterpret_cast<uint4*>(p.out + (row * p.H + h0 + r) * kD + cw * 256 + cc * 8) = v;
        }
    }
    if (cw == 0 && c4 == 0) {
        if (h0 + r0 < p.H) p.lse[row * p.H + h0 + r0] = (m0 + log2f(lt0)) * kLn2;
        if (h0 + r1 < p.H) p.lse[row * p.H + h0 + r1] = (m1 + log2f(lt1)) * kLn2;
    }
}

extern "C" __global__ void __launch_bounds__(kThreads, 1) sparse_attn_fwd_sm90(const SparseAttnFwdParams p) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    if (p.smem_bytes < kSa90SmemBytes) __trap();  // the launcher's layout disagrees with this one
    unsigned char* smem = align_1024(smem_raw);
    const u32 q_base = smem_u32(smem + kQOff);
    const u32 kv_base = smem_u32(smem + kKvOff);
    const u32 p_base = smem_u32(smem + kPOff);
    int* keys_s = reinterpret_cast<int*>(smem + kKeysOff);
    float* max_s = reinterpret_cast<float*>(smem + kMaxOff);
    float* sum_s = reinterpret_cast<float*>(smem + kSumOff);
    u64* q_bar = reinterpret_cast<u64*>(smem + kBarOff);
    u64* ready_bar = q_bar + 1;  // [buffer][half]: the producer's 128 threads
    u64* free_bar = q_bar + 5;   // [buffer][half]: both consumers' 256 threads
    u64* keys_bar = q_bar + 9;   // [buffer]: the producer's key writers

    const int tid = threadIdx.x;
    const int wg = tid / 128, wtid = tid % 128;
    const i64 row = blockIdx.x;  // b * S + s
    const int b = static_cast<int>(row / p.S), s = static_cast<int>(row % p.S);
    const int h0 = blockIdx.y * kHB;
    const int n_slots = sa::row_slots(p.row_len, row, p.T);
    const int n_iters = (DSV4_SA90_DIAG & 8) ? 0 : (n_slots + 2 * kBN - 1) / (2 * kBN);  // a pair of blocks each

    if (tid == 0) {
        mbar_init(q_bar, 128);
        for (int i = 0; i < 4; ++i) {
            mbar_init(ready_bar + i, 128);
            mbar_init(free_bar + i, 256);
        }
        for (int i = 0; i < 2; ++i) mbar_init(keys_bar + i, sa90::kKeyWriters);
    }
    __syncthreads();

    if (wg == 0) {
        // ---------------- producer ----------------
        regs_dec<40>();
        sa90::load_head_tile<4>(q_base, p.q + b * p.q_sb + s * p.q_ss, p.q_sh, p.q, h0, p.H, wtid);
        sa90::producer_handoff(q_bar);
#if SA90_PREFETCH
        {
            const i64 next = sa90::next_row_on_sm(row);
            if (next >= 0) {
                const int nb = static_cast<int>(next / p.S), ns = static_cast<int>(next % p.S);
                sa90::prefetch_head_tile(p.q + nb * p.q_sb + ns * p.q_ss, p.q_sh, h0, p.H, wtid);
                sa90::prefetch_slot_keys(p.idx, nb * p.idx_sb + ns * p.idx_ss, p.idx_st, p.idx_is_i64, p.T, p.row_len, next, wtid);
            }
        }
#endif
        // Slot keys in chunks of 1024 (16 blocks); thread t copies chunk j = t % 8 of rows
        // t / 8 + 16 i (i < 4) in the 4 groups of a half.
        int* row_keys = reinterpret_cast<int*>(smem + kRowKeysOff);
        const i64 idx_row = b * p.idx_sb + s * p.idx_ss;
        const i64 bias = b * p.idx_bias;
        const bf16* kv_b = p.kv + b * p.kv_sb;
        const int j = wtid % 8, r_base = wtid / 8;
        for (int it = 0; it < n_iters; ++it) {
            const int slot0 = it * 2 * kBN;
            if (slot0 % kChunk == 0) {
                if (slot0 > 0) named_sync(8, 128);  // every producer thread is done with the last chunk
                int k[kChunk / 128];
#pragma unroll
                for (int i = 0; i < kChunk / 128; ++i) k[i] = slot_key(p.idx, idx_row, p.idx_st, p.idx_is_i64, bias, n_slots, p.K, slot0 + wtid + 128 * i, false);
#pragma unroll
                for (int i = 0; i < kChunk / 128; ++i) row_keys[wtid + 128 * i] = k[i];
                named_sync(8, 128);
            }
            // (buffer, half) in the order the consumers free them. (Refilling them in the
            // order they are actually freed, lane 0 of each warp polling the four "free"
            // barriers, measured 3.94 against 3.39 ms: docs/perf.md v9.)
#pragma unroll 1
            for (int step = 0; step < 4; ++step) {
                const int buf = (step == 1 || step == 3) ? 1 : 0;
                const int half = (step == 1 || step == 2) ? 1 : 0;
                if (it > 0) mbar_wait(free_bar + buf * 2 + half, (it - 1) & 1);
                const int* keys = row_keys + (slot0 % kChunk) + buf * kBN;
                if (step < 2 && j == 0) {  // the first half of each buffer carries the block's keys
#pragma unroll
                    for (int i = 0; i < 4; ++i) keys_s[buf * kBN + r_base + 16 * i] = keys[r_base + 16 * i];
                    mbar_arrive(keys_bar + buf);
                }
                const u32 dst = kv_base + buf * kBlockBytes + half * kHalfBytes;
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int r = r_base + 16 * i;
                    const int key = keys[r];
                    const bf16* src = key >= 0 ? kv_b + static_cast<i64>(key) * p.kv_sk + half * 256 + j * 8 : p.kv;
#pragma unroll
                    for (int gg = 0; gg < 4; ++gg)
                        if constexpr ((DSV4_SA90_DIAG & 1) == 0) sa90::kv_copy16(dst + gg * kGroupBytes + sw128(r, j), key >= 0 ? src + gg * 64 : src, key >= 0);
                }
                sa90::producer_handoff(ready_bar + buf * 2 + half);
            }
        }
        asm volatile("cp.async.wait_all;\n" ::: "memory");
        return;
    }

    // ---------------- consumers ----------------
    regs_inc<232>();
    const ConsumerCtx ctx{q_base, kv_base, p_base, keys_s, max_s, sum_s, q_bar, ready_bar, free_bar, keys_bar, row, h0, n_iters, wtid};
    if (wg == 1) {
        consume<0>(p, ctx);
    } else {
        consume<1>(p, ctx);
    }
}
