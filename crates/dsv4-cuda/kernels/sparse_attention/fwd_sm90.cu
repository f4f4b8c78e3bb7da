// Sparse MQA attention with sinks, forward (SPEC.md section 1), Hopper path (sm_90a):
// wgmma products fed by a producer warpgroup, for D = 512 and a block of 64 heads.
//
// One CTA = one query row (b, s) x 64 heads (the wgmma M; heads >= H are zero rows that
// are never stored). Three warpgroups:
//   WG 0, producer (gather_sm90.cuh): loads Q once, then gathers the row's slots in
//        blocks of 32 keys with cp.async into a ring of four 32 KiB buffers (the rows of a
//        block are K and V at once: MQA), with a "ready" and a "free" mbarrier per buffer.
//        The ring holds two iterations, so the next iteration's gathers land while this
//        one computes.
//   WG 1 and WG 2, consumers c = 0, 1: in iteration i, consumer c owns block 2i + c
//        (buffer (2i + c) % 4): S_c = Q K_c^T (64 x 32, 32 wgmma k-steps over D), masked
//        and scaled. The two consumers exchange their row maxima (one named barrier), so
//        both hold the same running max m; P_c = exp2(S_c - m) goes to registers (A of the
//        next product) and to shared memory for the other consumer (second barrier).
//        Consumer c keeps O's columns [256c, 256c + 256) in registers (128 f32 a thread)
//        and adds P_c V_c + P_{1-c} V_{1-c} over its columns; the next iteration's S is
//        issued right behind P V (the tensor cores see no gap between them), and both
//        buffers are freed once P V is done (each free barrier counts both consumers).
//        The running sums are per consumer (each adds its own P) and meet at the end. O is
//        rescaled only in warps where the running max moved.
// The sink starts the running max (m = sink, l = 1 counted once), so an empty row ends
// with out = 0 and lse = sink, and |logits| ~ 1e4 never overflow; logits are kept in log2
// units (sm_scale * log2 e), lse is stored in natural log.
//
// Shared memory (SW128 operand tiles, hopper.cuh): Q [64 x 512] 64 KiB, K/V ring
// 4 x [32 x 512] 128 KiB, P 2 x [64 x 64] 16 KiB (32 columns used), slot keys of the
// ring's blocks (for the masks) and of the producer's current 1024-slot chunk, row
// statistics, barriers. The Q area stages the bf16 output tile at the end (16-byte stores).
//
// dsv4-archs: sm_90a

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

namespace {
constexpr int kD = 512;                  // head dim
constexpr int kHB = 64;                  // heads per CTA (wgmma M)
constexpr int kBN = 32;                  // slots per block (one consumer's S columns)
constexpr int kNBuf = 4;                 // ring of blocks: two iterations
constexpr int kThreads = 384;
constexpr int kGroupBytes = kBN * 128;   // one SW128 group of a block: 64 columns
constexpr int kQGroupBytes = kHB * 128;  // one SW128 group of Q: 64 columns
constexpr int kBlockBytes = 8 * kGroupBytes;  // [32 x 512] bf16
constexpr int kPBytes = kHB * 128;       // [64 x 64] bf16 SW128 (32 columns used)

// Byte offsets from the 1024-aligned base.
constexpr int kQOff = 0;
constexpr int kKvOff = kQOff + 8 * kQGroupBytes;   // [4] buffers
constexpr int kPOff = kKvOff + kNBuf * kBlockBytes;  // [2] P tiles
constexpr int kKeysOff = kPOff + 2 * kPBytes;      // int [4][32]
constexpr int kMaxOff = kKeysOff + kNBuf * kBN * 4;  // float [2][64] row maxima of a block
constexpr int kSumOff = kMaxOff + 2 * kHB * 4;     // float [2][64] final row sums
constexpr int kChunk = 1024;                      // slot keys the producer reads per index pass
constexpr int kRowKeysOff = kSumOff + 2 * kHB * 4; // int [1024] the producer's keys of a chunk of slots
constexpr int kBarOff = kRowKeysOff + kChunk * 4;  // u64: q, ready[4], free[4]
constexpr int kBytes = kBarOff + 9 * 8;
}  // namespace

static_assert(kBN == sa90::kBN && kGroupBytes == sa90::kGroupBytes && kBlockBytes == sa90::kBlockBytes && kQGroupBytes == sa90::kTileGroupBytes && kChunk == sa90::kChunk, "the producer's layout (gather_sm90.cuh)");

// Dynamic shared memory the launcher passes: the layout plus alignment slack.
constexpr int kSa90SmemBytes = kBytes + 1024;
static_assert(kSa90SmemBytes <= 232448, "fits the opt-in shared memory of an H100/H200");
static_assert(kSa90SmemBytes == 219720, "mirrored by SA90_FWD_SMEM_BYTES in src/sparse_attention.rs");

extern "C" __global__ void __launch_bounds__(kThreads, 1) sparse_attn_fwd_sm90(const SparseAttnFwdParams p) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    if (p.smem_bytes < kSa90SmemBytes) __trap();  // the launcher's layout disagrees with this one
    unsigned char* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
    const u32 q_base = smem_u32(smem + kQOff);
    const u32 kv_base = smem_u32(smem + kKvOff);
    const u32 p_base = smem_u32(smem + kPOff);
    int* keys_s = reinterpret_cast<int*>(smem + kKeysOff);
    float* max_s = reinterpret_cast<float*>(smem + kMaxOff);
    float* sum_s = reinterpret_cast<float*>(smem + kSumOff);
    u64* q_bar = reinterpret_cast<u64*>(smem + kBarOff);
    u64* ready_bar = q_bar + 1;  // [buffer]: the producer's 128 threads
    u64* free_bar = q_bar + 5;   // [buffer]: both consumers' 256 threads

    const int tid = threadIdx.x;
    const int wg = tid / 128, wtid = tid % 128;
    const i64 row = blockIdx.x;  // b * S + s
    const int b = static_cast<int>(row / p.S), s = static_cast<int>(row % p.S);
    const int h0 = blockIdx.y * kHB;
    const int n_slots = p.row_len ? max(0, min(p.row_len[row], p.T)) : p.T;
    const int n_iters = (n_slots + 2 * kBN - 1) / (2 * kBN);  // a pair of blocks each

    if (tid == 0) {
        mbar_init(q_bar, 128);
        for (int i = 0; i < kNBuf; ++i) {
            mbar_init(ready_bar + i, 128);
            mbar_init(free_bar + i, 256);
        }
    }
    __syncthreads();

    if (wg == 0) {
        // ---------------- producer ----------------
        regs_dec<40>();
        const i64 idx_row = b * p.idx_sb + s * p.idx_ss;
        const i64 bias = b * p.idx_bias;
        const bf16* kv_b = p.kv + b * p.kv_sb;
        sa90::load_head_tile<4>(q_base, p.q + b * p.q_sb + s * p.q_ss, p.q_sh, p.q, h0, p.H, wtid);
        mbar_cp_async_arrive(q_bar);
        mbar_arrive(q_bar);
        const sa90::SlotSource src{p.idx, idx_row, p.idx_st, bias, p.idx_is_i64, n_slots, p.K, kv_b, p.kv, p.kv_sk};
        sa90::gather_blocks<kNBuf>(src, 2 * n_iters, kv_base, keys_s, reinterpret_cast<int*>(smem + kRowKeysOff), ready_bar, free_bar, wtid);
        return;
    }

    // ---------------- consumers ----------------
    regs_inc<232>();
    const int cw = wg - 1;  // this consumer's block of each pair and O column half
    const int warp = wtid / 32, lane = wtid % 32;
    const int g = lane / 4, c4 = lane % 4;
    const int r0 = warp * 16 + g, r1 = r0 + 8;  // this thread's rows (heads h0 + r)
    const float s_scale = p.sm_scale * kLog2e;
    float m0 = (h0 + r0 < p.H ? p.sinks[(h0 + r0) * p.sinks_sh] : 0.0f) * kLog2e;
    float m1 = (h0 + r1 < p.H ? p.sinks[(h0 + r1) * p.sinks_sh] : 0.0f) * kLog2e;
    // Partial row sums of this thread's columns; the sink's exp2(0) = 1 once per row.
    float l0 = (cw == 0 && c4 == 0) ? 1.0f : 0.0f, l1 = l0;

    float o[128];  // O[r0 / r1][256 cw + 8 j + 2 c4 + (0, 1)], layout of wgmma.cuh
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.0f;

    mbar_wait(q_bar, 0);

    // S = Q K^T of iteration `it` into `sc` (the 8 column groups, 32 k-steps), once the
    // block has landed; committed as one wgmma group.
    float sc[16];
    const u64 qd = sw128_desc(q_base, 16, 1024);
    auto issue_s = [&](int it) {
        const int blk = 2 * it + cw;
        mbar_wait(ready_bar + blk % kNBuf, (blk / kNBuf) & 1);
        fence_proxy_async();
        wgmma_fence();
        const u64 kd = sw128_desc(kv_base + (blk % kNBuf) * kBlockBytes, 16, 1024);
#pragma unroll
        for (int ks = 0; ks < 32; ++ks) {
            wgmma_m64n32k16_ss<0>(sc, desc_advance(qd, (ks / 4) * kQGroupBytes + (ks % 4) * 32), desc_advance(kd, (ks / 4) * kGroupBytes + (ks % 4) * 32), ks > 0);
        }
        wgmma_commit();
    };
    if (n_iters > 0) issue_s(0);

    // Per iteration the tensor cores run P V of this iteration and S of the next back to
    // back; the buffers are freed as soon as P V is done (wait_group 1), and the next
    // iteration starts when its S is.
    for (int it = 0; it < n_iters; ++it) {
        const int my_blk = 2 * it + cw, other_blk = 2 * it + 1 - cw;
        const u32 par = (my_blk / kNBuf) & 1;  // the same for both blocks of the pair
        const u32 my_kv = kv_base + (my_blk % kNBuf) * kBlockBytes;
        const u32 other_kv = kv_base + (other_blk % kNBuf) * kBlockBytes;
        wgmma_wait<0>();
        fence_regs(sc);
        fence_regs(o);

        // Scale, mask (slot validity: one key per lane, ballot), this block's row maxima
        // -> exchange with the other consumer.
        const u32 valid = __ballot_sync(DSV4_FULL_MASK, keys_s[(my_blk % kNBuf) * kBN + lane] >= 0);
        float pm0 = neg_inf(), pm1 = neg_inf();
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
            const int col = 8 * jj + 2 * c4;
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
        if (c4 == 0) {
            max_s[cw * kHB + r0] = pm0;
            max_s[cw * kHB + r1] = pm1;
        }
        named_sync(1, 256);
        const float mn0 = fmaxf(m0, fmaxf(pm0, max_s[(1 - cw) * kHB + r0]));
        const float mn1 = fmaxf(m1, fmaxf(pm1, max_s[(1 - cw) * kHB + r1]));
        const float al0 = exp2f(m0 - mn0), al1 = exp2f(m1 - mn1);
        const bool moved = mn0 != m0 || mn1 != m1;
        m0 = mn0;
        m1 = mn1;

        // P = exp2(S - m): registers (A of P V) and shared memory (for the other consumer).
        u32 pa[2][4];
        float ps0 = 0.0f, ps1 = 0.0f;
        const u32 my_p = p_base + cw * kPBytes;
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
            const float e0 = exp2f(sc[4 * jj + 0] - mn0), e1 = exp2f(sc[4 * jj + 1] - mn0);
            const float e2 = exp2f(sc[4 * jj + 2] - mn1), e3 = exp2f(sc[4 * jj + 3] - mn1);
            ps0 += e0 + e1;
            ps1 += e2 + e3;
            const u32 w0 = pack_bf16(e0, e1), w1 = pack_bf16(e2, e3);
            pa[jj / 2][(jj % 2) * 2 + 0] = w0;
            pa[jj / 2][(jj % 2) * 2 + 1] = w1;
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(my_p + sw128(r0, jj) + 4 * c4), "r"(w0) : "memory");
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(my_p + sw128(r1, jj) + 4 * c4), "r"(w1) : "memory");
        }
        l0 = l0 * al0 + ps0;
        l1 = l1 * al1 + ps1;
        if (__any_sync(DSV4_FULL_MASK, moved)) {
#pragma unroll
            for (int i = 0; i < 128; i += 4) {
                o[i + 0] *= al0;
                o[i + 1] *= al0;
                o[i + 2] *= al1;
                o[i + 3] *= al1;
            }
        }
        fence_proxy_async();
        named_sync(2, 256);  // both P tiles written

        // O[:, my half] += P_c V_c + P_other V_other (V: N-major, this consumer's 4 groups).
        mbar_wait(ready_bar + other_blk % kNBuf, par);  // done already (the other consumer waited); orders its data for this thread
        fence_proxy_async();
        wgmma_fence();
        const u64 my_vd = sw128_desc(my_kv + cw * 4 * kGroupBytes, kGroupBytes, 1024);
        const u64 other_vd = sw128_desc(other_kv + cw * 4 * kGroupBytes, kGroupBytes, 1024);
        const u64 other_pd = sw128_desc(p_base + (1 - cw) * kPBytes, 16, 1024);
#pragma unroll
        for (int kk = 0; kk < 2; ++kk) wgmma_m64n256k16_rs<1>(o, pa[kk], desc_advance(my_vd, kk * 2048), 1);
#pragma unroll
        for (int kk = 0; kk < 2; ++kk) wgmma_m64n256k16_ss<1>(o, desc_advance(other_pd, kk * 32), desc_advance(other_vd, kk * 2048), 1);
        wgmma_commit();
        if (it + 1 < n_iters) {
            issue_s(it + 1);
            wgmma_wait<1>();  // P V done (groups complete in order); S of it + 1 may run on
        } else {
            wgmma_wait<0>();
            fence_regs(o);
        }
        mbar_arrive(free_bar + my_blk % kNBuf);
        mbar_arrive(free_bar + other_blk % kNBuf);
    }

    // Nothing is in flight here (the last iteration waited for all its products); the
    // explicit wait tells ptxas so, which would otherwise inject one (C7517).
    wgmma_wait<0>();
    fence_regs(o);

    // Row sums: this thread's quad, then the two consumers.
    l0 += __shfl_xor_sync(DSV4_FULL_MASK, l0, 1);
    l1 += __shfl_xor_sync(DSV4_FULL_MASK, l1, 1);
    l0 += __shfl_xor_sync(DSV4_FULL_MASK, l0, 2);
    l1 += __shfl_xor_sync(DSV4_FULL_MASK, l1, 2);
    if (c4 == 0) {
        sum_s[cw * kHB + r0] = l0;
        sum_s[cw * kHB + r1] = l1;
    }
    named_sync(1, 256);  // also: every S product is done, so the Q area is free
    const float lt0 = sum_s[r0] + sum_s[kHB + r0], lt1 = sum_s[r1] + sum_s[kHB + r1];
    const float inv0 = 1.0f / lt0, inv1 = 1.0f / lt1;

    // out = O / l staged as bf16 in the Q area (SW128), then 16-byte coalesced stores.
#pragma unroll
    for (int jj = 0; jj < 32; ++jj) {
        const u32 grp = q_base + (cw * 4 + jj / 8) * kQGroupBytes;
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(grp + sw128(r0, jj % 8) + 4 * c4), "r"(pack_bf16(o[4 * jj] * inv0, o[4 * jj + 1] * inv0)) : "memory");
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(grp + sw128(r1, jj % 8) + 4 * c4), "r"(pack_bf16(o[4 * jj + 2] * inv1, o[4 * jj + 3] * inv1)) : "memory");
    }
    named_sync(3 + cw, 128);
#pragma unroll 4
    for (int i = 0; i < 16; ++i) {
        const int id = wtid + i * 128;
        const int r = id / 32, cc = id % 32;
        if (h0 + r < p.H) {
            uint4 v;
            asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(q_base + (cw * 4 + cc / 8) * kQGroupBytes + sw128(r, cc % 8)) : "memory");
            *reinterpret_cast<uint4*>(p.out + (row * p.H + h0 + r) * kD + cw * 256 + cc * 8) = v;
        }
    }
    if (cw == 0 && c4 == 0) {
        if (h0 + r0 < p.H) p.lse[row * p.H + h0 + r0] = (m0 + log2f(lt0)) * kLn2;
        if (h0 + r1 < p.H) p.lse[row * p.H + h0 + r1] = (m1 + log2f(lt1)) * kLn2;
    }
}
