// Sparse MQA attention with sinks, forward (SPEC.md section 1); with SA_DEDUP=1 over a
// sorted plan, the dense oracle (a key repeated in a row counts once).
//
// One CTA = one query row (b, s) x a block of SA_HB heads (the M of the mma, padded to
// 16 with zero rows; padded heads are never read from or written to memory). The row's
// slots are walked in tiles of SA_BN keys gathered by cp.async into a double buffer; the
// same tile serves as K and as V (MQA: one shared head).
//
// Warps form a (HB/16) x WD grid, WD = D / SA_DW. Per tile:
//   S = Q K^T           warp (m, j): heads m*16.., slot blocks j, j+WD, ..  -> smem (scaled, masked)
//   online softmax      one warp per head row: m' = max(m, max S), P = exp(S - m'), l' = l a + sum P, a = exp(m - m')
//   O = a O + P V       warp (m, j): heads m*16.., columns j*DW .. (j+1)*DW, f32 registers
// The running max starts at the sink and l at 1 (= exp(sink - sink)), so an empty row
// ends with out = 0, lse = sink, and |logits| ~ 1e4 never overflow.
// Default arithmetic: exp2 on logits scaled by sm_scale*log2(e); SA_NATURAL_EXP=1
// (reference_rounding): natural exp on logits scaled by sm_scale.
//
// dsv4-test-defines: SA_D=64 SA_HB=16 SA_BN=64 SA_DW=64
// dsv4-test-defines: SA_D=128 SA_HB=64 SA_BN=64 SA_DW=128 SA_NATURAL_EXP=1
// dsv4-test-defines: SA_D=256 SA_HB=32 SA_BN=64 SA_DW=128 SA_DEDUP=1
// dsv4-test-defines: SA_D=448 SA_HB=32 SA_BN=64 SA_DW=64
// dsv4-test-defines: SA_D=320 SA_HB=48 SA_BN=64 SA_DW=64
// dsv4-test-defines: SA_D=512 SA_HB=16 SA_BN=64 SA_DW=128
// dsv4-test-defines: SA_D=512 SA_HB=64 SA_BN=64 SA_DW=128

#include "common.cuh"
#include "sparse_attention/params.cuh"
#include "sparse_attention/tile.cuh"

#ifndef SA_D
#define SA_D 512  // head dim, a multiple of 64, <= 512
#endif
#ifndef SA_HB
#define SA_HB 64  // heads per CTA, a multiple of 16, <= 64
#endif
#ifndef SA_BN
#define SA_BN 32  // slots per tile: 32 or 64
#endif
#ifndef SA_DW
#define SA_DW 128  // O columns per warp: 64 or 128, dividing SA_D
#endif
#ifndef SA_NATURAL_EXP
#define SA_NATURAL_EXP 0
#endif
#ifndef SA_DEDUP
#define SA_DEDUP 0
#endif

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
constexpr int kRowsPass = kThreads / kChunks;              // tile rows gathered per pass of the block
constexpr int kRPT = (kBN + kRowsPass - 1) / kRowsPass;    // tile rows per thread
constexpr int kRPW = (kHB + kNW - 1) / kNW;                // softmax rows per warp
constexpr int kSG = kRPW < 4 ? kRPW : 4;                   // softmax rows a warp works on at once
using L = FwdLayout<kD, kHB, kBN>;
constexpr int QS = L::QS, SS = L::SS, PS = L::PS;

static_assert(kD % 64 == 0 && kD <= 512, "SA_D: a multiple of 64, at most 512");
static_assert(kHB % 16 == 0 && kHB >= 16 && kHB <= 64, "SA_HB: 16, 32, 48 or 64");
static_assert(kBN == 32 || kBN == 64, "SA_BN: 32 or 64");
static_assert((kDW == 64 || kDW == 128) && kD % kDW == 0, "SA_DW: 64 or 128, dividing SA_D");
static_assert(kThreads % kChunks == 0, "the gather assigns whole rows per pass");
static_assert(kThreads <= 1024, "block size");

#if SA_NATURAL_EXP
__device__ __forceinline__ float exp_base(float x) { return expf(x); }
constexpr float kLogScale = 1.0f;  // logits kept in natural-log units
#else
__device__ __forceinline__ float exp_base(float x) { return exp2f(x); }
constexpr float kLogScale = kLog2e;  // logits kept in log2 units
#endif
}  // namespace

extern "C" __global__ void __launch_bounds__(kThreads, 1) sparse_attn_fwd(const SparseAttnFwdParams p) {
    extern __shared__ __align__(16) unsigned char smem[];
    if (p.smem_bytes < L::bytes) __trap();  // the launcher's layout disagrees with this one
    bf16* q_s = reinterpret_cast<bf16*>(smem + L::q_off);
    bf16* kv_s = reinterpret_cast<bf16*>(smem + L::kv_off);
    float* s_s = reinterpret_cast<float*>(smem + L::s_off);
    bf16* p_s = reinterpret_cast<bf16*>(smem + L::p_off);
    float* m_s = reinterpret_cast<float*>(smem + L::stats_off);  // running max (exp base units)
    float* l_s = m_s + kHB;                                        // running sum
    float* a_s = l_s + kHB;                                        // this tile's rescale
    int* key_s = reinterpret_cast<int*>(smem + L::keys_off);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp / kWD, wd = warp % kWD;
    const int g = lane >> 2, c4 = lane & 3;
    const i64 row = blockIdx.x;  // b * S + s
    const int b = static_cast<int>(row / p.S), s = static_cast<int>(row % p.S);
    const int h0 = blockIdx.y * kHB;
    const int n_slots = p.row_len ? max(0, min(p.row_len[row], p.T)) : p.T;
    const int n_tiles = (n_slots + kBN - 1) / kBN;
    const i64 idx_row = b * p.idx_sb + s * p.idx_ss;
    const i64 bias = b * p.idx_bias;
    const bf16* kv_b = p.kv + b * p.kv_sb;
    const float s_scale = p.sm_scale * kLogScale;

    // The gather is split in two so the index loads of a tile are in flight a whole tile
    // before its cp.async needs them: fetch_keys reads the keys of this thread's rows of
    // tile `tile` into registers (plain loads, all issued back to back; past the row's
    // slots no load at all), issue_tile starts the copies of those rows into buffer `buf`
    // (masked slots become zero rows) and records the keys for the masking of S.
    const int g_col = (tid % kChunks) * 8, g_row = tid / kChunks;
    auto fetch_keys = [&](int tile, int (&k)[kRPT]) {
#pragma unroll
        for (int i = 0; i < kRPT; ++i) {
            const int r = g_row + i * kRowsPass;
            k[i] = r < kBN ? slot_key(p.idx, idx_row, p.idx_st, p.idx_is_i64, bias, n_slots, p.K, tile * kBN + r, SA_DEDUP) : -1;
        }
    };
    auto issue_tile = [&](const int (&k)[kRPT], int buf) {
        bf16* dst = kv_s + buf * kBN * QS;
#pragma unroll
        for (int i = 0; i < kRPT; ++i) {
            const int r = g_row + i * kRowsPass;
            if (r < kBN) {
                cp_async16(dst + r * QS + g_col, k[i] >= 0 ? kv_b + static_cast<i64>(k[i]) * p.kv_sk + g_col : p.kv, k[i] >= 0);
                if (g_col == 0) key_s[buf * kBN + r] = k[i];
            }
        }
    };
    int next_keys[kRPT];  // keys of this thread's rows of the next tile to issue

    // Q rows of this head block (heads >= H are zero rows).
    {
        const bf16* q_row = p.q + b * p.q_sb + s * p.q_ss;
        for (int c = tid; c < kHB * kChunks; c += kThreads) {
            const int r = c / kChunks, col = (c % kChunks) * 8;
            const bool ok = h0 + r < p.H;
            cp_async16(q_s + r * QS + col, ok ? q_row + (h0 + r) * p.q_sh + col : p.q, ok);
        }
    }
    if (n_tiles > 0) {
        fetch_keys(0, next_keys);
        issue_tile(next_keys, 0);
        fetch_keys(1, next_keys);
    }
    cp_async_commit();
    for (int r = tid; r < kHB; r += kThreads) {
        const int h = h0 + r;
        m_s[r] = (h < p.H ? p.sinks[h * p.sinks_sh] : 0.0f) * kLogScale;  // the sink joins the max
        l_s[r] = 1.0f;                                                      // exp(sink - sink)
    }

    float o[kDW / 8][4];  // O[heads wm*16 + (g, g+8)][columns wd*DW + n*8 + 2c4 + (0, 1)]
#pragma unroll
    for (int n = 0; n < kDW / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;

    for (int j = 0; j < n_tiles; ++j) {
        const int buf = j & 1;
        if (j + 1 < n_tiles) {
            issue_tile(next_keys, buf ^ 1);
            fetch_keys(j + 2, next_keys);  // consumed next iteration: the loads overlap this tile
        }
        cp_async_commit();
        cp_async_wait<1>();  // tile j (and Q) landed
        __syncthreads();
        const bf16* kt = kv_s + buf * kBN * QS;
        const int* keys = key_s + buf * kBN;

        // S = Q K^T (scaled into exp-base units; masked slots -inf)
        {
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
#pragma unroll
            for (int i = 0; i < kNBW; ++i) {
                const int nb = wd + i * kWD;
                if (nb < kNB) {
                    const int c = nb * 8 + 2 * c4;
                    const bool v0 = keys[c] >= 0, v1 = keys[c + 1] >= 0;
                    float* r0 = s_s + (wm * 16 + g) * SS + c;
                    float* r1 = r0 + 8 * SS;
                    r0[0] = v0 ? acc[i][0] * s_scale : neg_inf();
                    r0[1] = v1 ? acc[i][1] * s_scale : neg_inf();
                    r1[0] = v0 ? acc[i][2] * s_scale : neg_inf();
                    r1[1] = v1 ? acc[i][3] * s_scale : neg_inf();
                }
            }
        }
        __syncthreads();

        // Online softmax, one warp per head row: m' = max(m, S), P = exp(S - m'), l' = a l + sum P.
        // A warp's rows r = warp + kNW * i are worked on kSG at a time (independent chains of
        // loads and shuffles in flight together); each row's arithmetic is unchanged.
        for (int i0 = 0; i0 < kRPW; i0 += kSG) {
            float m_old[kSG], mx[kSG], sum[kSG], v[kSG][kBN / 32];
#pragma unroll
            for (int u = 0; u < kSG; ++u) {
                const int r = warp + kNW * (i0 + u);
                const bool ok = i0 + u < kRPW && r < kHB;  // warp-uniform
                m_old[u] = ok ? m_s[r] : 0.0f;
                mx[u] = m_old[u];
#pragma unroll
                for (int i = 0; i < kBN / 32; ++i) {
                    v[u][i] = ok ? s_s[r * SS + lane + 32 * i] : 0.0f;
                    mx[u] = fmaxf(mx[u], v[u][i]);
                }
            }
#pragma unroll
            for (int u = 0; u < kSG; ++u) mx[u] = warp_max(mx[u]);
#pragma unroll
            for (int u = 0; u < kSG; ++u) {
                const int r = warp + kNW * (i0 + u);
                const bool ok = i0 + u < kRPW && r < kHB;
                sum[u] = 0.0f;
#pragma unroll
                for (int i = 0; i < kBN / 32; ++i) {
                    const float e = exp_base(v[u][i] - mx[u]);  // masked: exp(-inf) = 0
                    if (ok) p_s[r * PS + lane + 32 * i] = __float2bfloat16_rn(e);
                    sum[u] += e;
                }
            }
#pragma unroll
            for (int u = 0; u < kSG; ++u) sum[u] = warp_sum(sum[u]);
            if (lane == 0) {
#pragma unroll
                for (int u = 0; u < kSG; ++u) {
                    const int r = warp + kNW * (i0 + u);
                    if (i0 + u < kRPW && r < kHB) {
                        const float alpha = exp_base(m_old[u] - mx[u]);
                        a_s[r] = alpha;
                        l_s[r] = l_s[r] * alpha + sum[u];
                        m_s[r] = mx[u];
                    }
                }
            }
        }
        __syncthreads();

        // O = a O + P V
        {
            const float a0 = a_s[wm * 16 + g], a1 = a_s[wm * 16 + g + 8];
#pragma unroll
            for (int n = 0; n < kDW / 8; ++n) {
                o[n][0] *= a0;
                o[n][1] *= a0;
                o[n][2] *= a1;
                o[n][3] *= a1;
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
        __syncthreads();  // buffer `buf`, S and P are free for the next tile
    }
    cp_async_wait<0>();  // the Q group when the row has no tile
    __syncthreads();     // m, l of every row (also when there was no tile)

    // out = O / l ; lse = log(Z) = m + log(l) (natural log)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int r = wm * 16 + g + 8 * half;
        const int h = h0 + r;
        if (h < p.H) {
            const float inv = 1.0f / l_s[r];
            bf16* orow = p.out + (row * p.H + h) * kD + wd * kDW + 2 * c4;
#pragma unroll
            for (int n = 0; n < kDW / 8; ++n) *reinterpret_cast<u32*>(orow + n * 8) = pack_bf16x2(o[n][2 * half] * inv, o[n][2 * half + 1] * inv);
        }
    }
    for (int r = tid; r < kHB; r += kThreads) {
        const int h = h0 + r;
        if (h < p.H) {
#if SA_NATURAL_EXP
            p.lse[row * p.H + h] = m_s[r] + logf(l_s[r]);
#else
            p.lse[row * p.H + h] = (m_s[r] + log2f(l_s[r])) * kLn2;
#endif
        }
    }
}
