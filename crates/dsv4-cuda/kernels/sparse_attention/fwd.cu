// Sparse MQA attention with sinks, forward (SPEC.md section 1); with SA_DEDUP=1 over a
// sorted plan, the dense oracle (a key repeated in a row counts once).
//
// One CTA = one query row (b, s) x a block of SA_HB heads (the M of the mma, padded to
// 16 with zero rows; padded heads are never read from or written to memory). The row's
// slots are walked in tiles of SA_BN keys gathered by cp.async into a double buffer; the
// same tile serves as K and as V (MQA: one shared head).
//
// Warps form a (HB/16) x WD grid, WD = D / SA_DW. Per tile (three barriers):
//   S = Q K^T           warp (m, j): heads m*16.., slot blocks j, j+WD, .. in registers (scaled, masked);
//                       its partial row maxima (quad shuffles) -> smem                           | barrier
//   online softmax      m' = max(m, partial maxima), P = exp(S - m') -> smem (bf16), partial row
//                       sums -> smem; a = exp(m - m'); m, l live in registers, the same in every
//                       warp of a head group                                                      | barrier
//   O = a O + P V       l' = a l + sum of the partial sums (warp order); warp (m, j): heads m*16..,
//                       columns j*DW .. (j+1)*DW, f32 registers
// The next tile's gather is issued after the barrier that opens a tile (every warp is done
// with the buffer it overwrites) and lands while this tile computes.
// The running max starts at the sink and l at 1 (= exp(sink - sink)), so an empty row
// ends with out = 0, lse = sink, and |logits| ~ 1e4 never overflow.
// Default arithmetic: exp2 on logits scaled by sm_scale*log2(e); SA_NATURAL_EXP=1
// (reference_rounding): natural exp on logits scaled by sm_scale.
//
// Defines (the launcher's, src/sparse_attention/tiles.rs, all required): SA_D (head dim, a
// multiple of 64, <= 512), SA_HB (heads per CTA: 16, 32, 48 or 64), SA_BN (slots per tile:
// 32 or 64), SA_DW (O columns per warp: 64 or 128, dividing SA_D), SA_NATURAL_EXP (0/1),
// SA_DEDUP (0/1).

#include "common.cuh"
#include "sparse_attention/params.cuh"
#include "sparse_attention/tile.cuh"


using namespace dsv4;
using namespace dsv4::sa;

namespace {
constexpr int kD = SA_D, kHB = SA_HB, kBN = SA_BN, kDW = SA_DW;
constexpr int kWD = kD / kDW;            // warps along D
constexpr int kMW = kHB / 16;            // warps along heads
constexpr int kNW = kMW * kWD;           // warps per CTA
constexpr int kThreads = kNW * 32;
constexpr int kNB = kBN / 8;             // 8-slot blocks per tile
constexpr int kNBW = (kNB + kWD - 1) / kWD;  // slot blocks per warp in S = Q K^T
// Every warp owns the same even number of slot blocks: their K fragments load in pairs.
constexpr bool kPairB = kNB % kWD == 0 && kNBW % 2 == 0;
constexpr int kChunks = kD / 8;          // 16-byte chunks per row
constexpr int kKR = 3;                   // slot-key ring: tiles j (masking S), j + 1 (gather), j + 2 (being loaded)
constexpr int kKPT = (kBN + kThreads - 1) / kThreads;  // slot keys a thread loads per tile
constexpr int kRowsPass = kThreads / kChunks;              // tile rows gathered per pass of the block
constexpr int kRPT = (kBN + kRowsPass - 1) / kRowsPass;    // tile rows per thread
using L = FwdLayout<kD, kHB, kBN>;
constexpr int QS = L::QS, PS = L::PS;
static_assert(2 * kWD * kHB <= kHB * L::SS, "the partial row maxima and sums fit the S area");

static_assert(kD % 64 == 0 && kD <= 512, "SA_D: a multiple of 64, at most 512");
static_assert(kHB % 16 == 0 && kHB >= 16 && kHB <= 64, "SA_HB: 16, 32, 48 or 64");
static_assert(kBN == 32 || kBN == 64, "SA_BN: 32 or 64");
static_assert((kDW == 64 || kDW == 128) && kD % kDW == 0, "SA_DW: 64 or 128, dividing SA_D");
static_assert(kThreads % kChunks == 0, "the gather assigns whole rows per pass");
static_assert(kThreads <= 1024, "block size");

__device__ __forceinline__ float exp_base(float x) {
    if constexpr (SA_NATURAL_EXP != 0) {
        return expf(x);
    } else {
        return exp2f(x);
    }
}
constexpr float kLogScale = SA_NATURAL_EXP != 0 ? 1.0f : kLog2e;  // logits kept in natural-log or log2 units
}  // namespace

extern "C" __global__ void __launch_bounds__(kThreads, 1) sparse_attn_fwd(const SparseAttnFwdParams p) {
    extern __shared__ __align__(16) unsigned char smem[];
    if (p.smem_bytes < L::bytes) __trap();  // the launcher's layout disagrees with this one
    bf16* q_s = reinterpret_cast<bf16*>(smem + L::q_off);
    bf16* kv_s = reinterpret_cast<bf16*>(smem + L::kv_off);
    float* mx_part = reinterpret_cast<float*>(smem + L::s_off);  // [WD][HB] per-warp row maxima of a tile (in the S area)
    float* sum_part = mx_part + kWD * kHB;                         // [WD][HB] per-warp row sums of P
    bf16* p_s = reinterpret_cast<bf16*>(smem + L::p_off);
    float* l_s = reinterpret_cast<float*>(smem + L::stats_off);   // [HB] running sums (kept by the warps wd == 0)
    int* key_s = reinterpret_cast<int*>(smem + L::keys_off);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp / kWD, wd = warp % kWD;
    const int g = lane >> 2, c4 = lane & 3;
    const i64 row = blockIdx.x;  // b * S + s
    const int b = static_cast<int>(row / p.S), s = static_cast<int>(row % p.S);
    const int h0 = blockIdx.y * kHB;
    const int n_slots = sa::row_slots(p.row_len, row, p.T);
    const int n_tiles = (n_slots + kBN - 1) / kBN;
    const i64 idx_row = b * p.idx_sb + s * p.idx_ss;
    const i64 bias = b * p.idx_bias;
    const bf16* kv_b = p.kv + b * p.kv_sb;
    const float s_scale = p.sm_scale * kLogScale;

    // Slot keys travel through a ring of kKR tiles in shared memory, loaded from the index
    // two tiles ahead: thread t loads the keys of slots t, t + threads, .. of tile j + 2 at
    // the top of tile j and stores them at the end, so the index load's latency hides behind a whole
    // tile and the gather of tile j + 1 (issue_tile) reads its keys from shared memory.
    auto fetch_keys = [&](int tile, int (&k)[kKPT]) {  // past the row's slots: -1, no load
#pragma unroll
        for (int i = 0; i < kKPT; ++i) {
            const int r = tid + i * kThreads;
            k[i] = r < kBN ? slot_key(p.idx, idx_row, p.idx_st, p.idx_is_i64, bias, n_slots, p.K, tile * kBN + r, SA_DEDUP) : -1;
        }
    };
    auto store_keys = [&](int tile, const int (&k)[kKPT]) {
#pragma unroll
        for (int i = 0; i < kKPT; ++i) {
            const int r = tid + i * kThreads;
            if (r < kBN) key_s[(tile % kKR) * kBN + r] = k[i];
        }
    };
    // Gather the K/V rows of tile `tile` into buffer `buf`; masked slots become zero rows.
    auto issue_tile = [&](int tile, int buf) {
        bf16* dst = kv_s + buf * kBN * QS;
        const int* keys = key_s + (tile % kKR) * kBN;
        const int col = (tid % kChunks) * 8;
#pragma unroll
        for (int i = 0; i < kRPT; ++i) {
            const int r = tid / kChunks + i * kRowsPass;
            if (r < kBN) {
                const int key = keys[r];
                cp_async16(dst + r * QS + col, key >= 0 ? kv_b + static_cast<i64>(key) * p.kv_sk + col : p.kv, key >= 0);
            }
        }
    };

    // Q rows of this head block (heads >= H are zero rows).
    {
        const bf16* q_row = p.q + b * p.q_sb + s * p.q_ss;
        for (int c = tid; c < kHB * kChunks; c += kThreads) {
            const int r = c / kChunks, col = (c % kChunks) * 8;
            const bool ok = h0 + r < p.H;
            cp_async16(q_s + r * QS + col, ok ? q_row + (h0 + r) * p.q_sh + col : p.q, ok);
        }
    }
    int key_ahead[kKPT];  // keys of tile j + 2 while tile j runs
    fetch_keys(0, key_ahead);
    store_keys(0, key_ahead);
    fetch_keys(1, key_ahead);
    store_keys(1, key_ahead);
    __syncthreads();
    if (n_tiles > 0) issue_tile(0, 0);
    cp_async_commit();

    // Running max of this thread's heads r0 = wm*16 + g and r1 = r0 + 8, in registers: every
    // warp of the head group computes the same values from the same inputs. The running
    // sums live in shared memory, updated by the warp wd == 0 of the group.
    const int r0 = wm * 16 + g, r1 = r0 + 8;
    // The sink joins the max; a sink of -inf (a head without one) starts it at the finite
    // -FLT_MAX instead, so that masked slots (-inf) before the first valid one give
    // exp(-inf - m) = 0, not NaN, and l starts at exp(sink - m) = 0.
    const float sk0 = (h0 + r0 < p.H ? p.sinks[(h0 + r0) * p.sinks_sh] : 0.0f) * kLogScale;
    const float sk1 = (h0 + r1 < p.H ? p.sinks[(h0 + r1) * p.sinks_sh] : 0.0f) * kLogScale;
    float m0 = sk0 == neg_inf() ? -3.402823466e38f : sk0, m1 = sk1 == neg_inf() ? -3.402823466e38f : sk1;
    for (int r = tid; r < kHB; r += kThreads) l_s[r] = (h0 + r < p.H && p.sinks[(h0 + r) * p.sinks_sh] == neg_inf()) ? 0.0f : 1.0f;  // exp(sink - m); ordered by the first barrier below

    float o[kDW / 8][4];  // O[heads wm*16 + (g, g+8)][columns wd*DW + n*8 + 2c4 + (0, 1)]
#pragma unroll
    for (int n = 0; n < kDW / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;

    for (int j = 0; j < n_tiles; ++j) {
        const int buf = j & 1;
        cp_async_wait<0>();  // tile j (and Q) landed
        __syncthreads();     // ... for every thread; and every warp is done with tile j - 1 (buffer buf ^ 1, P, partial sums)
        if (j + 1 < n_tiles) issue_tile(j + 1, buf ^ 1);
        cp_async_commit();
        fetch_keys(j + 2, key_ahead);  // stored at the end of this tile
        const bf16* kt = kv_s + buf * kBN * QS;
        const int* keys = key_s + (j % kKR) * kBN;

        // S = Q K^T (scaled into exp-base units; masked slots -inf), kept in registers
        float acc[kNBW][4];
#pragma unroll
        for (int i = 0; i < kNBW; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
#pragma unroll 4
        for (int kk = 0; kk < kD; kk += 16) {
            u32 a[4];
            ldsm_x4(a, q_s + (wm * 16 + (lane & 15)) * QS + kk + (lane >> 4) * 8);
            if constexpr (kPairB) {
                // Slot blocks i, i+1 in one ldmatrix.x4: matrices (k lo, k hi) of block i, then of i+1.
#pragma unroll
                for (int i = 0; i < kNBW; i += 2) {
                    u32 bk[4];
                    ldsm_x4(bk, kt + ((wd + (i + (lane >> 4)) * kWD) * 8 + (lane & 7)) * QS + kk + ((lane >> 3) & 1) * 8);
                    mma_bf16(acc[i], a, bk[0], bk[1]);
                    mma_bf16(acc[i + 1], a, bk[2], bk[3]);
                }
            } else {
#pragma unroll
                for (int i = 0; i < kNBW; ++i) {
                    const int nb = wd + i * kWD;
                    if (nb < kNB) {
                        u32 bk[2];
                        ldsm_x2(bk, kt + (nb * 8 + (lane & 7)) * QS + kk + ((lane >> 3) & 1) * 8);
                        mma_bf16(acc[i], a, bk[0], bk[1]);
                    }
                }
            }
        }
        // This warp's slots: scale, mask, and the partial row max over them (quad shuffles).
        float pm0 = neg_inf(), pm1 = neg_inf();
#pragma unroll
        for (int i = 0; i < kNBW; ++i) {
            const int nb = wd + i * kWD;
            const int c = nb * 8 + 2 * c4;
            const bool v0 = nb < kNB && keys[c] >= 0, v1 = nb < kNB && keys[c + 1] >= 0;
            acc[i][0] = v0 ? acc[i][0] * s_scale : neg_inf();
            acc[i][1] = v1 ? acc[i][1] * s_scale : neg_inf();
            acc[i][2] = v0 ? acc[i][2] * s_scale : neg_inf();
            acc[i][3] = v1 ? acc[i][3] * s_scale : neg_inf();
            pm0 = fmaxf(pm0, fmaxf(acc[i][0], acc[i][1]));
            pm1 = fmaxf(pm1, fmaxf(acc[i][2], acc[i][3]));
        }
        pm0 = fmaxf(pm0, __shfl_xor_sync(DSV4_FULL_MASK, pm0, 1));
        pm1 = fmaxf(pm1, __shfl_xor_sync(DSV4_FULL_MASK, pm1, 1));
        pm0 = fmaxf(pm0, __shfl_xor_sync(DSV4_FULL_MASK, pm0, 2));
        pm1 = fmaxf(pm1, __shfl_xor_sync(DSV4_FULL_MASK, pm1, 2));
        if (c4 == 0) {
            mx_part[wd * kHB + r0] = pm0;
            mx_part[wd * kHB + r1] = pm1;
        }
        __syncthreads();  // partial maxima of every warp

        // m' = max(m, S), P = exp(S - m') (bf16 to shared for P V), partial sums of P
        float mn0 = m0, mn1 = m1;
#pragma unroll
        for (int w = 0; w < kWD; ++w) {
            mn0 = fmaxf(mn0, mx_part[w * kHB + r0]);
            mn1 = fmaxf(mn1, mx_part[w * kHB + r1]);
        }
        float ps0 = 0.0f, ps1 = 0.0f;
#pragma unroll
        for (int i = 0; i < kNBW; ++i) {
            const int nb = wd + i * kWD;
            if (nb < kNB) {
                const float e0 = exp_base(acc[i][0] - mn0), e1 = exp_base(acc[i][1] - mn0);  // masked: exp(-inf) = 0
                const float e2 = exp_base(acc[i][2] - mn1), e3 = exp_base(acc[i][3] - mn1);
                const int c = nb * 8 + 2 * c4;
                *reinterpret_cast<u32*>(p_s + r0 * PS + c) = pack_bf16x2(e0, e1);
                *reinterpret_cast<u32*>(p_s + r1 * PS + c) = pack_bf16x2(e2, e3);
                ps0 += e0 + e1;
                ps1 += e2 + e3;
            }
        }
        ps0 += __shfl_xor_sync(DSV4_FULL_MASK, ps0, 1);
        ps1 += __shfl_xor_sync(DSV4_FULL_MASK, ps1, 1);
        ps0 += __shfl_xor_sync(DSV4_FULL_MASK, ps0, 2);
        ps1 += __shfl_xor_sync(DSV4_FULL_MASK, ps1, 2);
        if (c4 == 0) {
            sum_part[wd * kHB + r0] = ps0;
            sum_part[wd * kHB + r1] = ps1;
        }
        const float al0 = exp_base(m0 - mn0), al1 = exp_base(m1 - mn1);
        m0 = mn0;
        m1 = mn1;
        __syncthreads();  // P and the partial sums of every warp

        // l' = a l + sum P (the partial sums in warp order)
        if (wd == 0 && c4 == 0) {
            float ts0 = 0.0f, ts1 = 0.0f;
#pragma unroll
            for (int w = 0; w < kWD; ++w) {
                ts0 += sum_part[w * kHB + r0];
                ts1 += sum_part[w * kHB + r1];
            }
            l_s[r0] = l_s[r0] * al0 + ts0;
            l_s[r1] = l_s[r1] * al1 + ts1;
        }

        // O = a O + P V
        {
#pragma unroll
            for (int n = 0; n < kDW / 8; ++n) {
                o[n][0] *= al0;
                o[n][1] *= al0;
                o[n][2] *= al1;
                o[n][3] *= al1;
            }
#pragma unroll
            for (int kk = 0; kk < kBN; kk += 16) {
                u32 a[4];
                ldsm_x4(a, p_s + (wm * 16 + (lane & 15)) * PS + kk + (lane >> 4) * 8);
#pragma unroll
                for (int n = 0; n < kDW / 8; n += 2) {
                    u32 bv[4];
                    ldsm_x4_t(bv, kt + (kk + (lane & 7) + ((lane >> 3) & 1) * 8) * QS + wd * kDW + n * 8 + (lane >> 4) * 8);
                    mma_bf16(o[n], a, bv[0], bv[1]);
                    mma_bf16(o[n + 1], a, bv[2], bv[3]);
                }
            }
        }
        store_keys(j + 2, key_ahead);  // into the ring slot of tile j - 1 (read before this tile's first barrier)
    }
    cp_async_wait<0>();  // the Q group when the row has no tile
    __syncthreads();     // l of every row (also when there was no tile)

    // out = O / l ; lse = log(Z) = m + log(l) (natural log)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int r = half ? r1 : r0;
        const int h = h0 + r;
        if (h < p.H) {
            const float l = l_s[r];
            const float inv = l > 0.0f ? 1.0f / l : 0.0f;  // Z = 0: an empty row whose sink is -inf
            bf16* orow = p.out + (row * p.H + h) * kD + wd * kDW + 2 * c4;
#pragma unroll
            for (int n = 0; n < kDW / 8; ++n) *reinterpret_cast<u32*>(orow + n * 8) = pack_bf16x2(o[n][2 * half] * inv, o[n][2 * half + 1] * inv);
            if (wd == 0 && c4 == 0) {
                const float m = half ? m1 : m0;
                if constexpr (SA_NATURAL_EXP != 0) {
                    p.lse[row * p.H + h] = m + logf(l);
                } else {
                    p.lse[row * p.H + h] = (m + log2f(l)) * kLn2;
                }
            }
        }
    }
}
