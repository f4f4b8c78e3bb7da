// Sparse MQA attention with sinks, backward (SPEC.md section 1). With p_t = exp(l_t - lse),
// delta = <dout, out>, dS = sm_scale * p (dout.k - delta):
//   dq      = dS K                                  (f32 registers, written once per row)
//   dkv[k] += dS^T Q + P^T dO   over the slots of k (f32: atomics, or per-slot contributions
//                                                   summed per key in a fixed order)
//   dsinks  = - sum_rows p_sink * delta             (per-row partials, summed by bwd_reduce.cu)
//
// One CTA = one chunk: a batch b, a block of SA_HB heads and consecutive rows of b walked
// in order (the launcher uses one row; deterministic mode: row chunk_base + blockIdx.x /
// n_hblk of a wave of rows). Per row, Q and dO (HB x D) sit in shared memory, delta
// is computed from out and dout (the FlashAttention preprocess, fused: one CTA owns the
// row), and the slots are walked in tiles of SA_BN keys gathered into a double buffer that
// serves as K and as V. Per tile:
//   S = Q K^T, dP = dO K^T   warp (m, j): heads m*16.., slot blocks j, j+WD, ..; P and dS -> smem (bf16)
//   dq += dS K               warp (m, j): heads m*16.., columns j*DW ..
//   dKV = dS^T Q + P^T dO    the BN x D tile in two column halves; each half is staged as f32
//                            in the consumed K/V buffer, repeated keys of the tile are summed
//                            into their first slot in slot order (skipped when the tile has
//                            no repeated key), then each (key, 4 columns) is added once: one
//                            16-byte f32 vector reduction red.global.add.v4.f32 (sm_90+; four
//                            atomicAdd on sm_80). Deterministic: no sum here; each valid
//                            slot's f32 row is stored to contributions [rows of the wave, T,
//                            n_hblk, D], and bwd_reduce.cu sums them per key in (row, slot,
//                            head block) order through an inverted index.
//
// dsv4-test-defines: SA_D=64 SA_HB=16 SA_BN=64 SA_DW=64
// dsv4-test-defines: SA_D=128 SA_HB=64 SA_BN=64 SA_DW=128 SA_NATURAL_EXP=1
// dsv4-test-defines: SA_D=256 SA_HB=48 SA_BN=64 SA_DW=128
// dsv4-test-defines: SA_D=448 SA_HB=16 SA_BN=32 SA_DW=64
// dsv4-test-defines: SA_D=512 SA_HB=32 SA_BN=32 SA_DW=128
// dsv4-test-defines: SA_D=512 SA_HB=16 SA_BN=64 SA_DW=128

#include "common.cuh"
#include "sparse_attention/params.cuh"
#include "sparse_attention/tile.cuh"

#ifndef SA_D
#define SA_D 512  // head dim, a multiple of 64, <= 512
#endif
#ifndef SA_HB
#define SA_HB 32  // heads per CTA, a multiple of 16, <= 64 (the launcher keeps <= 256 threads)
#endif
#ifndef SA_BN
#define SA_BN 64  // slots per tile: 32 or 64
#endif
#ifndef SA_DW
#define SA_DW 128  // dq columns per warp: 64 or 128, dividing SA_D
#endif
#ifndef SA_NATURAL_EXP
#define SA_NATURAL_EXP 0
#endif

using namespace dsv4;
using namespace dsv4::sa;

namespace {
constexpr int kD = SA_D, kHB = SA_HB, kBN = SA_BN, kDW = SA_DW;
constexpr int kWD = kD / kDW;
constexpr int kMW = kHB / 16;
constexpr int kNW = kMW * kWD;
constexpr int kThreads = kNW * 32;
constexpr int kNB = kBN / 8;
constexpr int kNBW = (kNB + kWD - 1) / kWD;
// Every warp owns the same even number of slot blocks: their K fragments load in pairs.
constexpr bool kPairB = kNB % kWD == 0 && kNBW % 2 == 0;
constexpr int kChunks = kD / 8;
constexpr int kRowsPass = kThreads / kChunks;              // tile rows gathered per pass of the block
constexpr int kRPT = (kBN + kRowsPass - 1) / kRowsPass;    // tile rows gathered per thread
constexpr int kKPT = (kBN + kThreads - 1) / kThreads;      // slot keys recorded per thread
constexpr int kHalf = kD / 2;            // dKV columns per staged pass
constexpr int kST = kHalf + 4;           // staged row stride (f32): BN * kST * 4 == BN * QS * 2
constexpr int kUnitsN = kHalf / 32;      // dKV work unit: 16 slots x 32 columns
constexpr int kUnits = (kBN / 16) * kUnitsN;
using L = BwdLayout<kD, kHB, kBN>;
constexpr int QS = L::QS, PS = L::PS;

static_assert(kD % 64 == 0 && kD <= 512, "SA_D: a multiple of 64, at most 512");
static_assert(kHB % 16 == 0 && kHB >= 16 && kHB <= 64, "SA_HB: 16, 32, 48 or 64");
static_assert(kBN == 32 || kBN == 64, "SA_BN: 32 or 64");
static_assert((kDW == 64 || kDW == 128) && kD % kDW == 0, "SA_DW: 64 or 128, dividing SA_D");
static_assert(kThreads % kChunks == 0, "the gather assigns whole rows per pass");
static_assert(kBN * kST * 4 == kBN * QS * 2, "a staged dKV half fills exactly one K/V buffer");
static_assert(kST % 4 == 0 && kHalf % 4 == 0, "staged rows and flushed column groups are 16-byte aligned");

#if SA_NATURAL_EXP
__device__ __forceinline__ float exp_base(float x) { return expf(x); }
constexpr float kLogScale = 1.0f;
#else
__device__ __forceinline__ float exp_base(float x) { return exp2f(x); }
constexpr float kLogScale = kLog2e;
#endif
}  // namespace

// dst[0..4] += v, four f32 atomic adds; one 16-byte vector reduction on sm_90+ (dst
// 16-byte aligned). Each lane's add is atomic on its own; no ordering is implied.
__device__ __forceinline__ void red_add_f32x4(float* dst, float4 v) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.relaxed.gpu.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(dst), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w) : "memory");
#else
    atomicAdd(dst, v.x);
    atomicAdd(dst + 1, v.y);
    atomicAdd(dst + 2, v.z);
    atomicAdd(dst + 3, v.w);
#endif
}

extern "C" __global__ void __launch_bounds__(kThreads, 1) sparse_attn_bwd(const SparseAttnBwdParams p) {
    extern __shared__ __align__(16) unsigned char smem[];
    if (p.smem_bytes < L::bytes) __trap();  // the launcher's layout disagrees with this one
    bf16* q_s = reinterpret_cast<bf16*>(smem + L::q_off);
    bf16* do_s = reinterpret_cast<bf16*>(smem + L::do_off);
    bf16* kv_s = reinterpret_cast<bf16*>(smem + L::kv_off);
    bf16* p_s = reinterpret_cast<bf16*>(smem + L::p_off);
    bf16* ds_s = reinterpret_cast<bf16*>(smem + L::ds_off);
    float* lse_s = reinterpret_cast<float*>(smem + L::stats_off);  // lse in exp-base units
    float* delta_s = lse_s + kHB;                                    // <dout, out>
    int* key_s = reinterpret_cast<int*>(smem + L::keys_off);
    int* first_s = reinterpret_cast<int*>(smem + L::first_off);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp / kWD, wd = warp % kWD;
    const int g = lane >> 2, c4 = lane & 3;

    const int n_hblk = (p.H + kHB - 1) / kHB;
    int b, hb, s_begin, s_end;
    float* dkv_t;  // atomic: dkv of batch b; deterministic: this row's contributions [T, n_hblk, D]
    if (p.deterministic) {
        // blockIdx.x = local * n_hblk + hb: row chunk_base + local of the wave (one row)
        const int local = static_cast<int>(blockIdx.x) / n_hblk;
        hb = static_cast<int>(blockIdx.x) % n_hblk;
        const int row = p.chunk_base + local;
        b = row / p.S;
        s_begin = row % p.S;
        s_end = s_begin + 1;
        dkv_t = p.dkv + static_cast<i64>(local) * p.T * n_hblk * kD;
    } else {
        // chunk c = ((b * n_hblk) + hb) * chunks_per_bh + sr
        const int c = p.chunk_base + static_cast<int>(blockIdx.x);
        const int sr = c % p.chunks_per_bh;
        hb = (c / p.chunks_per_bh) % n_hblk;
        b = c / p.chunks_per_bh / n_hblk;
        s_begin = sr * p.rows_per_chunk;
        s_end = min(p.S, s_begin + p.rows_per_chunk);
        dkv_t = p.dkv + static_cast<i64>(b) * p.K * kD;
    }
    const int h0 = hb * kHB;
    const bf16* kv_b = p.kv + b * p.kv_sb;
    const i64 bias = b * p.idx_bias;
    const float s_scale = p.sm_scale * kLogScale;

    for (int s = s_begin; s < s_end; ++s) {
        const i64 row = static_cast<i64>(b) * p.S + s;
        const int n_slots = p.row_len ? max(0, min(p.row_len[row], p.T)) : p.T;
        const int n_tiles = (n_slots + kBN - 1) / kBN;
        const i64 idx_row = b * p.idx_sb + s * p.idx_ss;
        bool any_valid = false;  // this thread saw a valid slot of the row

        // Gather tile `tile` into buffer `buf`. Every index load of the tile is issued
        // before the first cp.async (whose "memory" clobber would otherwise serialise one
        // load latency per row), so the thread waits for them about once.
        auto load_tile = [&](int tile, int buf) {
            const int t0 = tile * kBN;
            bf16* dst = kv_s + buf * kBN * QS;
            const int col = (tid % kChunks) * 8;
            int kc[kRPT], ks[kKPT];
#pragma unroll
            for (int i = 0; i < kRPT; ++i) {
                const int r = tid / kChunks + i * kRowsPass;
                kc[i] = r < kBN ? slot_key(p.idx, idx_row, p.idx_st, p.idx_is_i64, bias, n_slots, p.K, t0 + r, false) : -1;
            }
#pragma unroll
            for (int i = 0; i < kKPT; ++i) {
                const int r = tid + i * kThreads;
                ks[i] = r < kBN ? slot_key(p.idx, idx_row, p.idx_st, p.idx_is_i64, bias, n_slots, p.K, t0 + r, false) : -1;
            }
#pragma unroll
            for (int i = 0; i < kRPT; ++i) {
                const int r = tid / kChunks + i * kRowsPass;
                if (r < kBN) cp_async16(dst + r * QS + col, kc[i] >= 0 ? kv_b + static_cast<i64>(kc[i]) * p.kv_sk + col : p.kv, kc[i] >= 0);
            }
#pragma unroll
            for (int i = 0; i < kKPT; ++i) {
                const int r = tid + i * kThreads;
                if (r < kBN) {
                    key_s[buf * kBN + r] = ks[i];
                    any_valid |= ks[i] >= 0;
                }
            }
        };

        // Q and dO rows of this head block (heads >= H are zero rows).
        {
            const bf16* q_row = p.q + b * p.q_sb + s * p.q_ss;
            const bf16* do_row = p.dout + b * p.do_sb + s * p.do_ss;
            for (int i = tid; i < kHB * kChunks; i += kThreads) {
                const int r = i / kChunks, col = (i % kChunks) * 8;
                const bool ok = h0 + r < p.H;
                cp_async16(q_s + r * QS + col, ok ? q_row + (h0 + r) * p.q_sh + col : p.q, ok);
                cp_async16(do_s + r * QS + col, ok ? do_row + (h0 + r) * p.do_sh + col : p.dout, ok);
            }
        }
        if (n_tiles > 0) load_tile(0, 0);
        cp_async_commit();

        // delta = <dout, out> and lse per head, one warp per head
        for (int r = warp; r < kHB; r += kNW) {
            const int h = h0 + r;
            float acc = 0.0f;
            if (h < p.H) {
                const bf16* orow = p.out + b * p.o_sb + s * p.o_ss + h * p.o_sh;
                const bf16* drow = p.dout + b * p.do_sb + s * p.do_ss + h * p.do_sh;
                for (int cc = lane; cc < kChunks; cc += 32) {
                    float ov[8], dv[8];
                    load16(orow + cc * 8, ov);
                    load16(drow + cc * 8, dv);
#pragma unroll
                    for (int e = 0; e < 8; ++e) acc += ov[e] * dv[e];
                }
            }
            acc = warp_sum(acc);
            if (lane == 0) {
                delta_s[r] = acc;
                lse_s[r] = h < p.H ? p.lse[b * p.lse_sb + s * p.lse_ss + h * p.lse_sh] * kLogScale : 0.0f;
            }
        }

        float dq[kDW / 8][4];  // dq[heads wm*16 + (g, g+8)][columns wd*DW + n*8 + 2c4 + (0, 1)]
#pragma unroll
        for (int n = 0; n < kDW / 8; ++n) dq[n][0] = dq[n][1] = dq[n][2] = dq[n][3] = 0.0f;

        for (int j = 0; j < n_tiles; ++j) {
            const int buf = j & 1;
            if (j + 1 < n_tiles) load_tile(j + 1, buf ^ 1);
            cp_async_commit();
            cp_async_wait<1>();  // tile j (and Q, dO) landed
            __syncthreads();
            bf16* kt = kv_s + buf * kBN * QS;
            const int* keys = key_s + buf * kBN;

            // S = Q K^T, dP = dO K^T; P = exp(S - lse), dS = sm_scale * P (dP - delta)
            {
                float sacc[kNBW][4], dpacc[kNBW][4];
#pragma unroll
                for (int i = 0; i < kNBW; ++i)
#pragma unroll
                    for (int e = 0; e < 4; ++e) sacc[i][e] = dpacc[i][e] = 0.0f;
#pragma unroll 2
                for (int kk = 0; kk < kD; kk += 16) {
                    u32 aq[4], ado[4];
                    ldsm_x4(aq, q_s + (wm * 16 + (lane & 15)) * QS + kk + (lane >> 4) * 8);
                    ldsm_x4(ado, do_s + (wm * 16 + (lane & 15)) * QS + kk + (lane >> 4) * 8);
                    if constexpr (kPairB) {
                        // Slot blocks i, i+1 in one ldmatrix.x4: matrices (k lo, k hi) of block i, then of i+1.
#pragma unroll
                        for (int i = 0; i < kNBW; i += 2) {
                            u32 bk[4];
                            ldsm_x4(bk, kt + ((wd + (i + (lane >> 4)) * kWD) * 8 + (lane & 7)) * QS + kk + ((lane >> 3) & 1) * 8);
                            mma_bf16(sacc[i], aq, bk[0], bk[1]);
                            mma_bf16(dpacc[i], ado, bk[0], bk[1]);
                            mma_bf16(sacc[i + 1], aq, bk[2], bk[3]);
                            mma_bf16(dpacc[i + 1], ado, bk[2], bk[3]);
                        }
                    } else {
#pragma unroll
                        for (int i = 0; i < kNBW; ++i) {
                            const int nb = wd + i * kWD;
                            if (nb < kNB) {
                                u32 bk[2];
                                ldsm_x2(bk, kt + (nb * 8 + (lane & 7)) * QS + kk + ((lane >> 3) & 1) * 8);
                                mma_bf16(sacc[i], aq, bk[0], bk[1]);
                                mma_bf16(dpacc[i], ado, bk[0], bk[1]);
                            }
                        }
                    }
                }
                const int r0 = wm * 16 + g, r1 = r0 + 8;
                const float lse0 = lse_s[r0], lse1 = lse_s[r1], de0 = delta_s[r0], de1 = delta_s[r1];
#pragma unroll
                for (int i = 0; i < kNBW; ++i) {
                    const int nb = wd + i * kWD;
                    if (nb < kNB) {
                        const int cc = nb * 8 + 2 * c4;
                        const bool v0 = keys[cc] >= 0, v1 = keys[cc + 1] >= 0;
                        const float p00 = v0 ? exp_base(sacc[i][0] * s_scale - lse0) : 0.0f;
                        const float p01 = v1 ? exp_base(sacc[i][1] * s_scale - lse0) : 0.0f;
                        const float p10 = v0 ? exp_base(sacc[i][2] * s_scale - lse1) : 0.0f;
                        const float p11 = v1 ? exp_base(sacc[i][3] * s_scale - lse1) : 0.0f;
                        *reinterpret_cast<u32*>(p_s + r0 * PS + cc) = pack_bf16x2(p00, p01);
                        *reinterpret_cast<u32*>(p_s + r1 * PS + cc) = pack_bf16x2(p10, p11);
                        *reinterpret_cast<u32*>(ds_s + r0 * PS + cc) = pack_bf16x2(p.sm_scale * p00 * (dpacc[i][0] - de0), p.sm_scale * p01 * (dpacc[i][1] - de0));
                        *reinterpret_cast<u32*>(ds_s + r1 * PS + cc) = pack_bf16x2(p.sm_scale * p10 * (dpacc[i][2] - de1), p.sm_scale * p11 * (dpacc[i][3] - de1));
                    }
                }
            }
            // first_s[r]: the first slot of this tile holding r's key (r when unique)
            bool repeat = false;  // this thread saw a repeated key
            for (int r = tid; r < kBN; r += kThreads) {
                const int key = keys[r];
                int f = r;
                if (key >= 0) {
                    for (int r2 = 0; r2 < r; ++r2) {
                        if (keys[r2] == key) {
                            f = r2;
                            break;
                        }
                    }
                }
                first_s[r] = f;
                repeat |= f != r;
            }
            const bool tile_repeats = __syncthreads_or(repeat);  // uniform: the sum below is skipped by all or none

            // dq += dS K
#pragma unroll
            for (int kk = 0; kk < kBN; kk += 16) {
                u32 a[4];
                ldsm_x4(a, ds_s + (wm * 16 + (lane & 15)) * PS + kk + (lane >> 4) * 8);
#pragma unroll
                for (int n = 0; n < kDW / 8; n += 2) {
                    u32 bv[4];
                    ldsm_x4_t(bv, kt + (kk + (lane & 7) + ((lane >> 3) & 1) * 8) * QS + wd * kDW + n * 8 + (lane >> 4) * 8);
                    mma_bf16(dq[n], a, bv[0], bv[1]);
                    mma_bf16(dq[n + 1], a, bv[2], bv[3]);
                }
            }

            // dKV = dS^T Q + P^T dO, in two column halves staged through this tile's buffer
            float* stage = reinterpret_cast<float*>(kt);  // [BN][kST] f32
            for (int half = 0; half < 2; ++half) {
                __syncthreads();  // K/V reads of this tile (half 0) are done: the buffer becomes the stage
                for (int u = warp; u < kUnits; u += kNW) {
                    const int mt = u / kUnitsN, cl0 = (u % kUnitsN) * 32, col0 = half * kHalf + cl0;
                    float acc[4][4];
#pragma unroll
                    for (int n = 0; n < 4; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
#pragma unroll
                    for (int kk = 0; kk < kHB; kk += 16) {
                        // A = dS^T, P^T (slots x heads) from the head-major tiles, transposed
                        u32 ads[4], ap[4];
                        const int a_off = (kk + (lane & 7) + (lane >> 4) * 8) * PS + mt * 16 + ((lane >> 3) & 1) * 8;
                        ldsm_x4_t(ads, ds_s + a_off);
                        ldsm_x4_t(ap, p_s + a_off);
#pragma unroll
                        for (int n = 0; n < 4; n += 2) {
                            // B = Q, dO (heads x columns)
                            u32 bq[4], bo[4];
                            const int b_off = (kk + (lane & 7) + ((lane >> 3) & 1) * 8) * QS + col0 + n * 8 + (lane >> 4) * 8;
                            ldsm_x4_t(bq, q_s + b_off);
                            ldsm_x4_t(bo, do_s + b_off);
                            mma_bf16(acc[n], ads, bq[0], bq[1]);
                            mma_bf16(acc[n + 1], ads, bq[2], bq[3]);
                            mma_bf16(acc[n], ap, bo[0], bo[1]);
                            mma_bf16(acc[n + 1], ap, bo[2], bo[3]);
                        }
                    }
                    const int rr = mt * 16 + g;
#pragma unroll
                    for (int n = 0; n < 4; ++n) {
                        const int cc = cl0 + n * 8 + 2 * c4;
                        *reinterpret_cast<float2*>(stage + rr * kST + cc) = make_float2(acc[n][0], acc[n][1]);
                        *reinterpret_cast<float2*>(stage + (rr + 8) * kST + cc) = make_float2(acc[n][2], acc[n][3]);
                    }
                }
                __syncthreads();
                // Repeated keys (atomic): summed into their first slot, in slot order. The
                // deterministic mode stores every slot's own contribution.
                if (tile_repeats && !p.deterministic) {
                    for (int cc = tid; cc < kHalf; cc += kThreads) {
                        for (int r = 1; r < kBN; ++r) {
                            const int f = first_s[r];
                            if (f != r) stage[f * kST + cc] += stage[r * kST + cc];
                        }
                    }
                    __syncthreads();
                }
                // Atomic: each (key, 4 columns) once, one 16-byte vector reduction (distinct
                // addresses, so any thread may take any). Deterministic: each (slot, 4 columns)
                // stored to the row's contributions, summed per key later in a fixed order.
                float* dst = dkv_t + half * kHalf;
                const int t0 = j * kBN;
                constexpr int kVec = kHalf / 4;  // float4s per staged row
                constexpr int kFlushUnroll = 2;
                for (int e0 = tid; e0 < kBN * kVec; e0 += kThreads * kFlushUnroll) {
                    float* ptr[kFlushUnroll];
                    float4 val[kFlushUnroll];
#pragma unroll
                    for (int u = 0; u < kFlushUnroll; ++u) {
                        const int e = e0 + u * kThreads;
                        ptr[u] = nullptr;
                        val[u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                        if (e < kBN * kVec) {
                            const int r = e / kVec, cc = (e % kVec) * 4;
                            const int key = keys[r];
                            if (key >= 0 && (p.deterministic || first_s[r] == r)) {
                                ptr[u] = dst + (p.deterministic ? (static_cast<i64>(t0 + r) * n_hblk + hb) * kD : static_cast<i64>(key) * kD) + cc;
                                val[u] = *reinterpret_cast<const float4*>(stage + r * kST + cc);
                            }
                        }
                    }
                    if (p.deterministic) {
#pragma unroll
                        for (int u = 0; u < kFlushUnroll; ++u)
                            if (ptr[u]) *reinterpret_cast<float4*>(ptr[u]) = val[u];
                    } else {
#pragma unroll
                        for (int u = 0; u < kFlushUnroll; ++u)
                            if (ptr[u]) red_add_f32x4(ptr[u], val[u]);
                    }
                }
                __syncthreads();  // the stage is free (next half / next tile's prefetch)
            }
        }
        cp_async_wait<0>();  // the Q/dO group when the row has no tile
        const bool row_nonempty = __syncthreads_or(any_valid) || p.all_rows_nonempty;

        // dq, written once (zero for an empty row: every dS was 0)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int h = h0 + wm * 16 + g + 8 * half;
            if (h < p.H) {
                bf16* qrow = p.dq + (row * p.H + h) * kD + wd * kDW + 2 * c4;
#pragma unroll
                for (int n = 0; n < kDW / 8; ++n) *reinterpret_cast<u32*>(qrow + n * 8) = pack_bf16x2(dq[n][2 * half], dq[n][2 * half + 1]);
            }
        }
        // dsinks partial: -p_sink * delta (0 for an empty row)
        for (int r = tid; r < kHB; r += kThreads) {
            const int h = h0 + r;
            if (h < p.H) {
                const float sink = p.sinks[h * p.sinks_sh] * kLogScale;
                p.dsinks_part[row * p.H + h] = row_nonempty ? -exp_base(sink - lse_s[r]) * delta_s[r] : 0.0f;
            }
        }
        __syncthreads();  // lse/delta, Q and dO are free for the next row
    }
}
