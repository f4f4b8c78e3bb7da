// Sparse MQA attention with sinks, forward (SPEC.md section 1), Hopper path (sm_90a):
// wgmma products fed by a producer warpgroup, for D = 512 and a block of 64 heads.
// The running max is a chain between the two consumers, and each block's buffer goes back
// to the producer as soon as both its P V products are done.
//
// dsv4-archs: sm_90a
//
// Defines (the launcher's, src/sparse_attention/forward.rs): SA90_Q_TMA (1: the row's Q
// tile by TMA through `q_map`; 0: by the producer's cp.async, where q cannot be mapped).
//
// One wave of CTAs (the launcher's grid: min(rows, SMs / head blocks) x head blocks), each
// CTA taking query rows (b, s) = blockIdx.x, + gridDim.x, ... x 64 heads (the wgmma M;
// heads >= H are zero rows that are never stored). The ring, its barriers' phases and the
// chain run on across a CTA's rows. Three warpgroups:
//   WG 0, producer: per row loads Q (SA90_Q_TMA: eight TMA loads from one thread, one
//        SW128 group of 64 heads x 64 columns each, heads >= H read as zeros, on the Q
//        barrier with its bytes expected; else the 128 threads' cp.async), then gathers
//        the row's slots in blocks of 64 keys with cp.async into two 64 KiB buffers
//        (block 2i + c into buffer c; the rows of a block are K and V at once: MQA).
//        Each buffer is two column halves L (columns 0-255) and R (256-511), each with a
//        "ready" mbarrier (the producer's 128 threads) and a "free" one (both consumers'
//        256 threads). Per iteration the halves are refilled in the order they are
//        freed: 0 L, 1 R (early), 0 R, 1 L (late). The next row's Q goes in once buffer
//        0 L's last free of a row completes (both consumers' last S done), so its copies
//        and the next row's first blocks overlap the row's last products and epilogue.
//        It also prefetches into L2 the Q tile and slot keys of its CTA's next row.
//   WG 1 and WG 2, consumers c = 0, 1: consumer c owns block 2i + c of iteration i and
//        O's columns [256c, 256c + 256) (128 f32 a thread). S_c = Q K_c^T (64 x 64, m64n64k16
//        over D as two wgmma groups, one per column half: consumer 0 L first, consumer 1 R
//        first, the half of its buffer freed early).
//   Per iteration (mx: consumer 0's running max, my: the pair's; barriers M0, M1, P1, P0):
//     c0: mx = max(m, rowmax S0) published (M0); P0 = exp2(S0 - mx) kept in f32; O_L, l
//         rescaled to mx; O_L += P0 V0_L issued (A from registers); once done, buffer 0 L
//         is freed;
//     c1: (M0) my = max(mx, rowmax S1) published (M1); O_R, l rescaled to my; P1 =
//         exp2(S1 - my); O_R += P1 V1_R issued (A from registers); P1 -> shared (P1);
//     c0: (M1) P0 rescaled to my -> shared (P0); O_L, l rescaled to my; (P1) O_L += P1
//         V1_L (A from shared memory), then buffer 1 L is freed;
//     c1: (P0) O_R += P0 V0_R (A from shared memory); buffers 1 R, then 0 R are freed.
//   This is FlashMLA's order: each buffer has a half freed early, on which the owner's next
//   S starts. Both consumers end the iteration at my; each issues its next S after the
//   frees that the other consumer's next S needs (the end of the loop says in which order).
// The sink starts the running max (m = sink, l = 1 counted once by consumer 0), so an
// empty row ends with out = 0 and lse = sink, and |logits| ~ 1e4 never overflow; logits
// are kept in log2 units (sm_scale * log2 e), lse is stored in natural log.
//
// Shared memory (SW128 operand tiles, hopper.cuh): Q [64 x 512] 64 KiB, K/V 2 x [64 x 512]
// 128 KiB, P 2 x [64 x 64] 16 KiB, slot keys of the two blocks (for the masks) and of the
// producer's current 1024-slot chunk, the published maxima, row sums, barriers. The output
// goes from registers to global memory (the Q area holds the next row's Q by then).

#include "common.cuh"
#include "hopper.cuh"
#include "wgmma.cuh"
#include "tma.cuh"
#include "sparse_attention/params.cuh"
#include "sparse_attention/tile.cuh"
#include "sparse_attention/gather_sm90.cuh"

using namespace dsv4;
using namespace dsv4::hopper;
using dsv4::sa::kLn2;
using dsv4::sa::kLog2e;
using dsv4::sa::neg_inf;
using dsv4::sa::slot_key;

namespace {
constexpr int kD = 512;                  // head dim
constexpr int kHB = 64;                  // heads per CTA (wgmma M)
constexpr int kBN = 64;                  // slots per block (one consumer's S columns)
constexpr int kThreads = 384;
constexpr int kGroupBytes = kBN * 128;   // one SW128 group (64 columns) of a block or of Q
constexpr int kBlockBytes = 8 * kGroupBytes;  // [64 x 512] bf16
constexpr int kHalfBytes = 4 * kGroupBytes;   // columns 0-255 or 256-511
constexpr int kPBytes = kHB * 128;       // [64 x 64] bf16 SW128
constexpr u32 kQBytes = kBlockBytes;     // the Q tile: what the Q barrier expects by TMA
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

// Named barriers (0 is __syncthreads): the chain's four hand-offs, the consumers' "row sums
// read" (6, 7), the producer's own (8), the final sums' hand-offs (9, 10); for 6 / 7 and
// 9 / 10 consumer c arrives on the first + c and waits on the other. Every hand-off between
// the consumers is an arrive / sync pair, as their code differs.
constexpr int kBarM0 = 1, kBarM1 = 2, kBarP0 = 3, kBarP1 = 4, kBarSumsRead = 6, kBarSums = 9;
}  // namespace

static_assert(kGroupBytes == sa90::kTileGroupBytes, "Q tiles as gather_sm90.cuh loads them");

// Dynamic shared memory the launcher passes: the layout plus alignment slack.
constexpr int kSa90SmemBytes = kBytes + 1024;
static_assert(kSa90SmemBytes <= 232448, "fits the opt-in shared memory of an H100/H200");
static_assert(kSa90SmemBytes == 219736, "mirrored by SA90_FWD_SMEM_BYTES in src/sparse_attention/forward.rs");

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
    int g;   // this CTA's iterations before this row (the barriers' phases)
    int kq;  // this CTA's rows with slots before this one (the Q barrier's phase)
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
    const int g0 = x.g;  // the phase of iteration it's barriers: (g0 + it) & 1
    const int warp = wtid / 32, lane = wtid % 32;
    const int g = lane / 4, c4 = lane % 4;
    const int r0 = warp * 16 + g, r1 = r0 + 8;  // this thread's rows (heads h0 + r)
    const float s_scale = p.sm_scale * kLog2e;
    // The running max this consumer's O and partial sums are scaled to: the sink, or for a
    // sink of -inf (a head without one) the finite -FLT_MAX, so that a block of masked
    // slots (-inf) before the first valid one gives exp2(-inf - m) = 0, not NaN.
    const float sk0 = (h0 + r0 < p.H ? p.sinks[(h0 + r0) * p.sinks_sh] : 0.0f) * kLog2e;
    const float sk1 = (h0 + r1 < p.H ? p.sinks[(h0 + r1) * p.sinks_sh] : 0.0f) * kLog2e;
    float m0 = sk0 == neg_inf() ? -3.402823466e38f : sk0, m1 = sk1 == neg_inf() ? -3.402823466e38f : sk1;
    // Partial row sums of this thread's columns of this consumer's blocks; the sink's
    // exp2(sink - m) = 1 (0 for a sink of -inf) once per row.
    const bool sink_lane = cw == 0 && c4 == 0;
    float l0 = sink_lane && sk0 != neg_inf() ? 1.0f : 0.0f, l1 = sink_lane && sk1 != neg_inf() ? 1.0f : 0.0f;

    float o[128];  // O[r0 / r1][256 cw + 8 j + 2 c4 + (0, 1)], layout of wgmma.cuh
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.0f;

    if (n_iters > 0) mbar_wait(q_bar, x.kq & 1);
    const u32 my_kv = kv_base + cw * kBlockBytes, other_kv = kv_base + (1 - cw) * kBlockBytes;
    const u64 qd = sw128_desc(q_base, 16, 1024);
    const u64 kd = sw128_desc(my_kv, 16, 1024);
    // V of this consumer's column half (N-major): own block and the other consumer's.
    const u64 my_vd = sw128_desc(my_kv + cw * kHalfBytes, kGroupBytes, 1024);
    const u64 other_vd = sw128_desc(other_kv + cw * kHalfBytes, kGroupBytes, 1024);
    const u32 my_p = p_base + cw * kPBytes;
    const u64 other_pd = sw128_desc(p_base + (1 - cw) * kPBytes, 16, 1024);

    // S = Q K^T of this consumer's block of iteration `it`, into `sc`: one wgmma group per
    // column half (L = columns 0-255 first, the half the producer refills first), each after
    // its half landed.
    float sc[32];
    auto issue_s_half = [&](int it, int half) {
        mbar_wait(ready_bar + cw * 2 + half, (g0 + it) & 1);
        sa90::consumer_after_ready();
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < 16; ++k) {
            const int ks = half * 16 + k;
            const u32 off = (ks / 4) * kGroupBytes + (ks % 4) * 32;
            wgmma_m64n64k16_ss<0>(sc, desc_advance(qd, off), desc_advance(kd, off), half != cw || k > 0);
        }
        wgmma_commit();
    };
    // This block's scores scaled to log2 units and masked (one key a lane, two ballots);
    // returns the rows' maxima of the block in pm0 / pm1.
    auto mask_and_max = [&](int it, float& pm0, float& pm1) {
        mbar_wait(x.keys_bar + cw, (g0 + it) & 1);
        const u32 valid_lo = __ballot_sync(DSV4_FULL_MASK, keys_s[cw * kBN + lane] >= 0);
        const u32 valid_hi = __ballot_sync(DSV4_FULL_MASK, keys_s[cw * kBN + 32 + lane] >= 0);
        pm0 = neg_inf();
        pm1 = neg_inf();
#pragma unroll
        for (int jj = 0; jj < 8; ++jj) {
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
    };
    // P = exp2(S - m) per row into bf16 A fragments `pa` (consumer 1's P1); returns the
    // rows' partial sums. sc is only read (consumer 0 keeps its P0 in sc, in f32, instead).
    auto softmax_p = [&](float mr0, float mr1, u32 (&pa)[4][4], float& ps0, float& ps1) {
        ps0 = 0.0f;
        ps1 = 0.0f;
#pragma unroll
        for (int jj = 0; jj < 8; ++jj) {
            float e[4] = {sc[4 * jj + 0], sc[4 * jj + 1], sc[4 * jj + 2], sc[4 * jj + 3]};
            e[0] = sa90::exp2_p(e[0] - mr0);
            e[1] = sa90::exp2_p(e[1] - mr0);
            e[2] = sa90::exp2_p(e[2] - mr1);
            e[3] = sa90::exp2_p(e[3] - mr1);
            ps0 += e[0] + e[1];
            ps1 += e[2] + e[3];
            pa[jj / 2][(jj % 2) * 2 + 0] = pack_bf16(e[0], e[1]);
            pa[jj / 2][(jj % 2) * 2 + 1] = pack_bf16(e[2], e[3]);
        }
    };
    // This consumer's P tile to shared memory for the other consumer's P V (SW128).
    auto store_p = [&](const u32 (&pa)[4][4]) {
#pragma unroll
        for (int jj = 0; jj < 8; ++jj) {
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(my_p + sw128(r0, jj) + 4 * c4), "r"(pa[jj / 2][(jj % 2) * 2 + 0]) : "memory");
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(my_p + sw128(r1, jj) + 4 * c4), "r"(pa[jj / 2][(jj % 2) * 2 + 1]) : "memory");
        }
        fence_proxy_async();
    };
    // O[:, my half] += P V_c with P from registers (own block) or shared memory (other's).
    auto issue_pv_own = [&](const u32 (&pa)[4][4]) {
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
            wgmma_m64n256k16_rs<1>(o, pa[kk], desc_advance(my_vd, kk * 2048), 1);
        wgmma_commit();
    };
    auto issue_pv_other = [&](int it) {
        mbar_wait(ready_bar + (1 - cw) * 2 + cw, (g0 + it) & 1);  // landed already (the other consumer waited); orders it for this thread
        sa90::consumer_after_ready();
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
            wgmma_m64n256k16_ss<1>(o, desc_advance(other_pd, kk * 32), desc_advance(other_vd, kk * 2048), 1);
        wgmma_commit();
    };

    // This iteration's S done (and every product before it): the two halves this consumer
    // reads no more are the other consumer's (consumer 0: buffer 0 R, read by consumer 1's
    // P0 V0_R only from here, and buffer 1 R, never read by consumer 0; consumer 1: buffer
    // 1 L, read by consumer 0's P1 V1_L only, and buffer 0 L), then the mask and the row
    // maxima of the block.
    auto s_done = [&](int it, float& pm0, float& pm1) {
        wgmma_wait<0>();
        fence_regs(sc);
        fence_regs(o);
        mbar_arrive(free_bar + cw * 2 + (1 - cw));
        mbar_arrive(free_bar + (1 - cw) * 2 + (1 - cw));
        mask_and_max(it, pm0, pm1);
    };

    if (n_iters > 0) {
        issue_s_half(0, cw);
        issue_s_half(0, 1 - cw);
    }

    for (int it = 0; it < n_iters; ++it) {
        const bool more = it + 1 < n_iters;
        u32 pa[4][4];
        float pm0, pm1, ps0, ps1;
        if constexpr (cw == 0) {
            s_done(it, pm0, pm1);  // S0 (and the last iteration's P1 V1_L); frees 0 R, 1 R
            // mx = max(m, rowmax S0), published for consumer 1 (barrier M0).
            const float mx0 = fmaxf(m0, pm0), mx1 = fmaxf(m1, pm1);
            const float al0 = sa90::exp2_p(m0 - mx0), al1 = sa90::exp2_p(m1 - mx1);
            if (c4 == 0) {
                max_s[r0] = mx0;
                max_s[r1] = mx1;
            }
            named_arrive(kBarM0, 256);
            // P0 = exp2(S0 - mx), kept in f32 in sc for the rescale below; O_L += P0 V0_L.
            ps0 = 0.0f;
            ps1 = 0.0f;
#pragma unroll
            for (int jj = 0; jj < 8; ++jj) {
                sc[4 * jj + 0] = sa90::exp2_p(sc[4 * jj + 0] - mx0);
                sc[4 * jj + 1] = sa90::exp2_p(sc[4 * jj + 1] - mx0);
                sc[4 * jj + 2] = sa90::exp2_p(sc[4 * jj + 2] - mx1);
                sc[4 * jj + 3] = sa90::exp2_p(sc[4 * jj + 3] - mx1);
                ps0 += sc[4 * jj + 0] + sc[4 * jj + 1];
                ps1 += sc[4 * jj + 2] + sc[4 * jj + 3];
                pa[jj / 2][(jj % 2) * 2 + 0] = pack_bf16(sc[4 * jj + 0], sc[4 * jj + 1]);
                pa[jj / 2][(jj % 2) * 2 + 1] = pack_bf16(sc[4 * jj + 2], sc[4 * jj + 3]);
            }
            l0 = l0 * al0 + ps0;
            l1 = l1 * al1 + ps1;
            rescale_o(o, al0, al1);
            issue_pv_own(pa);  // O_L += P0 V0_L
            wgmma_wait<0>();  // P0 V0_L
            fence_regs(o);
            mbar_arrive(free_bar + 0 * 2 + 0);  // buffer 0 L: S0 and P0 V0_L done
            // The pair's max my = max(mx, rowmax S1) from consumer 1 (barrier M1); P0 at my
            // to shared memory for consumer 1's P0 V0_R (barrier P0).
            named_sync(kBarM1, 256);
            const float my0 = max_s[kHB + r0], my1 = max_s[kHB + r1];
            const float f0 = sa90::exp2_p(mx0 - my0), f1 = sa90::exp2_p(mx1 - my1);
            m0 = my0;
            m1 = my1;
            l0 *= f0;
            l1 *= f1;
#pragma unroll
            for (int jj = 0; jj < 8; ++jj) {
                pa[jj / 2][(jj % 2) * 2 + 0] = pack_bf16(sc[4 * jj + 0] * f0, sc[4 * jj + 1] * f0);
                pa[jj / 2][(jj % 2) * 2 + 1] = pack_bf16(sc[4 * jj + 2] * f1, sc[4 * jj + 3] * f1);
            }
            store_p(pa);
            named_arrive(kBarP0, 256);
            rescale_o(o, f0, f1);
            named_sync(kBarP1, 256);  // P1 (at my) in shared memory
            issue_pv_other(it);  // O_L += P1 V1_L
            // The next S0's first half (buffer 0 L, refilled since mid-iteration) goes in
            // while P1 V1_L runs; buffer 1 L is freed once P1 V1_L is done.
            if (more) {
                issue_s_half(it + 1, 0);
                wgmma_wait<1>();
            } else {
                wgmma_wait<0>();
            }
            fence_regs(o);
            mbar_arrive(free_bar + 1 * 2 + 0);  // buffer 1 L: P1 V1_L done
            if (more) issue_s_half(it + 1, 1);
        } else {
            s_done(it, pm0, pm1);  // S1 (and the last iteration's products); frees 1 L, 0 L
            // The pair's max my = max(mx, rowmax S1) (mx from consumer 0, barrier M0; >= m:
            // both ended the last iteration at my), published for consumer 0 (barrier M1).
            named_sync(kBarM0, 256);
            const float mx0 = max_s[r0], mx1 = max_s[r1];
            const float my0 = fmaxf(mx0, pm0), my1 = fmaxf(mx1, pm1);
            if (c4 == 0) {
                max_s[kHB + r0] = my0;
                max_s[kHB + r1] = my1;
            }
            named_arrive(kBarM1, 256);
            // O_R, l to my; P1 = exp2(S1 - my); O_R += P1 V1_R first (buffer 1 R freed early),
            // P1 to shared memory for consumer 0's P1 V1_L (barrier P1).
            const float al0 = sa90::exp2_p(m0 - my0), al1 = sa90::exp2_p(m1 - my1);
            m0 = my0;
            m1 = my1;
            rescale_o(o, al0, al1);
            softmax_p(my0, my1, pa, ps0, ps1);
            l0 = l0 * al0 + ps0;
            l1 = l1 * al1 + ps1;
            issue_pv_own(pa);  // O_R += P1 V1_R
            store_p(pa);
            named_arrive(kBarP1, 256);
            named_sync(kBarP0, 256);  // P0 (at my) in shared memory
            issue_pv_other(it);  // O_R += P0 V0_R
            wgmma_wait<1>();  // P1 V1_R (o is still an accumulator of P0 V0_R: not fenced)
            mbar_arrive(free_bar + 1 * 2 + 1);  // buffer 1 R: S1 and P1 V1_R done
            wgmma_wait<0>();
            fence_regs(o);
            mbar_arrive(free_bar + 0 * 2 + 1);  // buffer 0 R: P0 V0_R done
            if (more) {
                issue_s_half(it + 1, 1);
                issue_s_half(it + 1, 0);
            }
        }
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
    named_sync(kBarSums + 1 - cw, 256);
    const float lt0 = sum_s[r0] + sum_s[kHB + r0], lt1 = sum_s[r1] + sum_s[kHB + r1];
    // (Z = 0, an empty row whose sink is -inf: out = 0, lse = -inf.)
    const float inv0 = lt0 > 0.0f ? 1.0f / lt0 : 0.0f, inv1 = lt1 > 0.0f ? 1.0f / lt1 : 0.0f;
    // Both consumers have read the sums before either writes the next row's (an arrive / sync
    // pair each way: a bar.sync of both from their different code is what synccheck calls
    // divergent).
    named_arrive(kBarSumsRead + cw, 256);
    named_sync(kBarSumsRead + 1 - cw, 256);
    // out = O / l from registers. Per 32-column group m a quad holds a 4 x 4 block of
    // 4-byte words (lane k: words 4 t + k, t = jj % 4); two shuffle stages transpose it so
    // that lane k holds words 4 k .. 4 k + 3, 16 contiguous bytes, and a quad writes 64
    // bytes of a head row, two whole 32-byte sectors (4-byte stores wrote half sectors).
    {
        const bool ok0 = h0 + r0 < p.H, ok1 = h0 + r1 < p.H;
        const bool b1 = (c4 & 2) != 0, b0 = (c4 & 1) != 0;
#pragma unroll
        for (int m = 0; m < 8; ++m) {
#pragma unroll
            for (int rr = 0; rr < 2; ++rr) {
                const float inv = rr ? inv1 : inv0;
                u32 a[4];
#pragma unroll
                for (int t = 0; t < 4; ++t) a[t] = pack_bf16(o[4 * (4 * m + t) + 2 * rr] * inv, o[4 * (4 * m + t) + 2 * rr + 1] * inv);
                // stage 1 (lanes k, k ^ 2): keep the words t with bit 1 of t = bit 1 of k
                u32 x = b1 ? a[0] : a[2], y = b1 ? a[1] : a[3];
                x = __shfl_xor_sync(DSV4_FULL_MASK, x, 2);
                y = __shfl_xor_sync(DSV4_FULL_MASK, y, 2);
                a[0] = b1 ? x : a[0], a[1] = b1 ? y : a[1], a[2] = b1 ? a[2] : x, a[3] = b1 ? a[3] : y;
                // stage 2 (lanes k, k ^ 1): then lane k holds word t = k of lanes 0..3 in order
                x = b0 ? a[0] : a[1], y = b0 ? a[2] : a[3];
                x = __shfl_xor_sync(DSV4_FULL_MASK, x, 1);
                y = __shfl_xor_sync(DSV4_FULL_MASK, y, 1);
                a[0] = b0 ? x : a[0], a[1] = b0 ? a[1] : x, a[2] = b0 ? y : a[2], a[3] = b0 ? a[3] : y;
                // .cs (streaming): the output passes through L2 once (the K/V gathers keep
                // theirs with evict_last).
                if (rr ? ok1 : ok0)
                    asm volatile("st.global.cs.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(p.out + (row * p.H + h0 + (rr ? r1 : r0)) * kD + cw * 256 + 32 * m + 8 * c4), "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]) : "memory");
            }
        }
    }
    if (cw == 0 && c4 == 0) {
        if (h0 + r0 < p.H) p.lse[row * p.H + h0 + r0] = (m0 + log2f(lt0)) * kLn2;
        if (h0 + r1 < p.H) p.lse[row * p.H + h0 + r1] = (m1 + log2f(lt1)) * kLn2;
    }
}

// q_map: the TMA map of q (SA90_Q_TMA=1); zeros (unread) otherwise.
extern "C" __global__ void __launch_bounds__(kThreads, 1) sparse_attn_fwd_sm90(const SparseAttnFwdParams p, const __grid_constant__ TmaDesc q_map) {
    // (Compile-time choices are local constants here: NVRTC emits namespace-scope ones as
    // unused global data.)
    constexpr bool kQTma = SA90_Q_TMA != 0;  // the launcher's: Q tiles by TMA, or the producer's cp.async
    // The register split of setmaxnreg: 2 x 128 consumer threads + 128 producer threads
    // within the 64 K registers of an SM.
    constexpr int kConsumerRegs = 224, kProducerRegs = 56;
    static_assert(2 * 128 * kConsumerRegs + 128 * kProducerRegs <= 65536, "setmaxnreg split beyond the register file");
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
    const int h0 = blockIdx.y * kHB;

    if (tid == 0) {
        mbar_init(q_bar, kQTma ? 1 : 128);
        for (int i = 0; i < 4; ++i) {
            mbar_init(ready_bar + i, 128);
            mbar_init(free_bar + i, 256);
        }
        for (int i = 0; i < 2; ++i) mbar_init(keys_bar + i, sa90::kKeyWriters);
        if constexpr (kQTma) {
            tma::fence_barrier_init();  // the TMA unit completes bytes on q_bar
            tma::prefetch_desc(q_map);
        }
    }
    __syncthreads();

    // This CTA's rows: blockIdx.x, + gridDim.x, ... (row = b * S + s); a row of n_slots
    // takes ceil(n_slots / 128) iterations, a pair of blocks each.
    const i64 n_rows = static_cast<i64>(p.B) * p.S;
    auto iters_of = [](int n_slots) { return (n_slots + 2 * kBN - 1) / (2 * kBN); };
    if (wg == 0) {
        // ---------------- producer ----------------
        regs_dec<kProducerRegs>();
        // Slot keys in chunks of 1024 (16 blocks); thread t copies chunk j = t % 8 of rows
        // t / 8 + 16 i (i < 4) in the 4 groups of a half.
        int* row_keys = reinterpret_cast<int*>(smem + kRowKeysOff);
        const int j = wtid % 8, r_base = wtid / 8;
        int g = 0, kq = 0;  // this CTA's iterations and rows with slots so far
        for (i64 row = blockIdx.x; row < n_rows; row += gridDim.x) {
            const int b = static_cast<int>(row / p.S), s = static_cast<int>(row % p.S);
            const int n_slots = sa::row_slots(p.row_len, row, p.T);
            const int n_iters = iters_of(n_slots);
            if (n_iters == 0) continue;  // no Q, no blocks: the consumers skip the row's waits too
            const i64 idx_row = b * p.idx_sb + s * p.idx_ss;
            const i64 bias = b * p.idx_bias;
            auto load_chunk_keys = [&](int slot0, int (&k)[kChunk / 128]) {
#pragma unroll
                for (int i = 0; i < kChunk / 128; ++i) k[i] = slot_key(p.idx, idx_row, p.idx_st, p.idx_is_i64, bias, n_slots, p.K, slot0 + wtid + 128 * i, false);
            };
            auto store_chunk_keys = [&](const int (&k)[kChunk / 128]) {
#pragma unroll
                for (int i = 0; i < kChunk / 128; ++i) row_keys[wtid + 128 * i] = k[i];
                named_sync(8, 128);
            };
            // The first chunk's index reads go out first; the Q copies' issue covers their
            // latency.
            int k_first[kChunk / 128];
            load_chunk_keys(0, k_first);
            // The Q area is free once both consumers' last S of the previous row is done:
            // buffer 0 L's free barrier of that row's last iteration (consumer 0 arrives after
            // P0 V0_L, which follows its S0; consumer 1 after its S1). Buffer 0 L's refill
            // below waits for the same phase.
            if (g > 0) mbar_wait(free_bar + 0, (g - 1) & 1);
            if constexpr (kQTma) {
                // (the consumers' wgmma reads of the last Q, async proxy, are complete before
                // their arrivals on that free barrier; TMA writes through the same proxy)
                if (wtid == 0) {
                    const u32 bar = smem_u32(q_bar);
                    tma::arrive_expect_tx(bar, kQBytes);
#pragma unroll
                    for (int grp = 0; grp < 8; ++grp) tma::load_4d(q_base + grp * kGroupBytes, q_map, 64 * grp, h0, s, b, bar);
                }
            } else {
                sa90::load_head_tile<4>(q_base, p.q + b * p.q_sb + s * p.q_ss, p.q_sh, p.q, h0, p.H, wtid);
                sa90::producer_handoff(q_bar);
            }
            if (kq > 0) named_sync(8, 128);  // every producer thread is done with the last row's keys
            store_chunk_keys(k_first);
            // L2 prefetch of the next row's Q tile and slot keys: its pipeline fill reads L2.
            if (row + gridDim.x < n_rows) {
                const i64 next = row + gridDim.x;
                const int nb = static_cast<int>(next / p.S), ns = static_cast<int>(next % p.S);
                sa90::prefetch_head_tile(p.q + nb * p.q_sb + ns * p.q_ss, p.q_sh, h0, p.H, wtid);
                sa90::prefetch_slot_keys(p.idx, nb * p.idx_sb + ns * p.idx_ss, p.idx_st, p.idx_is_i64, p.T, p.row_len, next, wtid);
            }
            const u64 kv_row_bytes = static_cast<u64>(p.kv_sk) * sizeof(bf16);
            // The K/V gathers carry an L2 evict_last policy: kv is reread by every row, while
            // q and out stream through L2 once (with the output's .cs stores).
            u64 kv_policy;
            asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;\n" : "=l"(kv_policy));
            const char* kv_col = reinterpret_cast<const char*>(p.kv + b * p.kv_sb) + j * 16;  // this thread's 16-byte chunk j of a 128-byte group
            for (int it = 0; it < n_iters; ++it) {
                const int gi = g + it;  // this CTA's iteration: the barriers' phases
                const int slot0 = it * 2 * kBN;
                if (slot0 > 0 && slot0 % kChunk == 0) {
                    named_sync(8, 128);  // every producer thread is done with the last chunk
                    int k[kChunk / 128];
                    load_chunk_keys(slot0, k);
                    store_chunk_keys(k);
                }
                // (buffer, half) in the order the consumers free them: 0 L, 1 R (early),
                // 0 R, 1 L (late); the first half of each buffer carries its block's keys.
#pragma unroll 1
                for (int step = 0; step < 4; ++step) {
                    const int buf = step % 2;
                    const int half = step < 2 ? buf : 1 - buf;
                    const int* keys = row_keys + (slot0 % kChunk) + buf * kBN;
                    // This thread's four rows r_base + 16 i: their keys first (four independent
                    // loads), then 64-bit row offsets without selects (an invalid key reads row 0
                    // with source size 0: nothing), so that the four rows' address chains overlap.
                    // Keys and source rows before the "free" wait, the block's keys for the
                    // consumers' masks after the copies: only the copies follow the wait (the
                    // refill of a freed half is the critical path).
                    int key[4];
#pragma unroll
                    for (int i = 0; i < 4; ++i) key[i] = keys[r_base + 16 * i];
                    const char* src[4];
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        src[i] = kv_col + half * 512 + static_cast<u64>(max(key[i], 0)) * kv_row_bytes;
                        asm volatile("" : "+l"(src[i]));  // computed here: ptxas would sink it past the wait
                    }
                    if (gi > 0) mbar_wait(free_bar + buf * 2 + half, (gi - 1) & 1);
                    // Rows r_base + 16 i share r % 8, so their SW128 offsets are 16 i rows apart.
                    const u32 dst = kv_base + buf * kBlockBytes + half * kHalfBytes + sw128(r_base, j);
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
#pragma unroll
                        for (int gg = 0; gg < 4; ++gg)
                            sa90::kv_copy16_policy(dst + i * 16 * 128 + gg * kGroupBytes, src[i] + gg * 128, key[i] >= 0, kv_policy);
                    }
                    sa90::producer_handoff(ready_bar + buf * 2 + half);
                    if (half == buf && j == 0) {
#pragma unroll
                        for (int i = 0; i < 4; ++i) keys_s[buf * kBN + r_base + 16 * i] = key[i];
                        mbar_arrive(keys_bar + buf);
                    }
                }
            }
            g += n_iters;
            ++kq;
        }
        asm volatile("cp.async.wait_all;\n" ::: "memory");
        return;
    }

    // ---------------- consumers: the same rows ----------------
    regs_inc<kConsumerRegs>();
    int g = 0, kq = 0;
    for (i64 row = blockIdx.x; row < n_rows; row += gridDim.x) {
        const int n_iters = iters_of(sa::row_slots(p.row_len, row, p.T));
        const ConsumerCtx ctx{q_base, kv_base, p_base, keys_s, max_s, sum_s, q_bar, ready_bar, free_bar, keys_bar, row, h0, n_iters, wtid, g, kq};
        if (wg == 1) {
            consume<0>(p, ctx);
        } else {
            consume<1>(p, ctx);
        }
        if (n_iters > 0) {
            g += n_iters;
            ++kq;
        }
    }
}
