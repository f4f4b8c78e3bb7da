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
// serves as K and as V; slot keys are read from the index two tiles ahead into a 3-tile
// ring. Per tile, two barriers (A: the tile landed and the previous tile's buffers are
// free, so the next tile's gather starts; B: P and dS written):
//   S = Q K^T, dP = dO K^T   warp (m, j): heads m*16.., slot blocks j, j+WD, ..; P and dS -> smem (bf16)
//   dq += dS K               warp (m, j): heads m*16.., columns j*DW ..
//   dKV = dS^T Q + P^T dO    units of 16 slots x 64 columns spread over the warps, each flushed
//                            straight from its mma accumulators (a lane-pair swap gives each
//                            lane 4 consecutive columns of one slot): atomic: one 16-byte f32
//                            vector reduction red.global.add.v4.f32 per (slot, 4 columns)
//                            (sm_90+; four atomicAdd on sm_80), a key repeated in the tile gets
//                            one per slot. Deterministic: each valid slot's f32 row is stored to
//                            contributions [rows of the wave, T, n_hblk, D], and bwd_reduce.cu
//                            sums them per key in (row, slot, head block) order through an
//                            inverted index.
//
// Defines (the launcher's, src/sparse_attention/tiles.rs, all required): SA_D (head dim, a
// multiple of 64, <= 512), SA_HB (heads per CTA: 16, 32, 48 or 64; the launcher keeps <=
// 256 threads), SA_BN (slots per tile: 32 or 64), SA_DW (dq columns per warp: 64 or 128,
// dividing SA_D), SA_NATURAL_EXP (0/1).

#include "common.cuh"
#include "sparse_attention/params.cuh"
#include "sparse_attention/tile.cuh"


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
constexpr int kKPT = (kBN + kThreads - 1) / kThreads;      // slot keys loaded per thread
constexpr int kKR = 3;                   // slot-key ring: tiles j (masking, flush), j + 1 (gather), j + 2 (being loaded)
constexpr int kUnitsN = kD / 64;         // dKV work unit: 16 slots x 64 columns
constexpr int kUnits = (kBN / 16) * kUnitsN;
using L = BwdLayout<kD, kHB, kBN>;
constexpr int QS = L::QS, PS = L::PS;

static_assert(kD % 64 == 0 && kD <= 512, "SA_D: a multiple of 64, at most 512");
static_assert(kHB % 16 == 0 && kHB >= 16 && kHB <= 64, "SA_HB: 16, 32, 48 or 64");
static_assert(kBN == 32 || kBN == 64, "SA_BN: 32 or 64");
static_assert((kDW == 64 || kDW == 128) && kD % kDW == 0, "SA_DW: 64 or 128, dividing SA_D");
static_assert(kThreads % kChunks == 0, "the gather assigns whole rows per pass");

__device__ __forceinline__ float exp_base(float x) {
    if constexpr (SA_NATURAL_EXP != 0) {
        return expf(x);
    } else {
        return exp2f(x);
    }
}
constexpr float kLogScale = SA_NATURAL_EXP != 0 ? 1.0f : kLog2e;
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
        const int n_slots = sa::row_slots(p.row_len, row, p.T);
        const int n_tiles = (n_slots + kBN - 1) / kBN;
        const i64 idx_row = b * p.idx_sb + s * p.idx_ss;
        bool any_valid = false;  // this thread saw a valid slot of the row

        // Slot keys travel through a ring of kKR tiles in shared memory, loaded from the index
        // two tiles ahead (as in fwd.cu): thread t loads the keys of slots t, t + threads, ..
        // of tile j + 2 after the first barrier of tile j and stores them at its end, so the
        // index load's latency hides behind a whole tile and the gather of tile j + 1 reads
        // its keys from shared memory.
        auto fetch_keys = [&](int tile, int (&k)[kKPT]) {  // past the row's slots: -1, no load
#pragma unroll
            for (int i = 0; i < kKPT; ++i) {
                const int r = tid + i * kThreads;
                k[i] = r < kBN ? slot_key(p.idx, idx_row, p.idx_st, p.idx_is_i64, bias, n_slots, p.K, tile * kBN + r, false) : -1;
            }
        };
        auto store_keys = [&](int tile, const int (&k)[kKPT]) {
#pragma unroll
            for (int i = 0; i < kKPT; ++i) {
                const int r = tid + i * kThreads;
                if (r < kBN) {
                    key_s[(tile % kKR) * kBN + r] = k[i];
                    any_valid |= k[i] >= 0;
                }
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
        int key_ahead[kKPT], key_next[kKPT];  // keys of tile j + 2 while tile j runs
        fetch_keys(0, key_next);   // both tiles' index loads before the first store:
        fetch_keys(1, key_ahead);  // one load latency per row
        store_keys(0, key_next);
        store_keys(1, key_ahead);
        __syncthreads();  // the keys of tiles 0 and 1
        if (n_tiles > 0) issue_tile(0, 0);
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
            cp_async_wait<0>();  // tile j (and at j == 0 Q, dO) landed
            __syncthreads();     // A: tile j visible; every read of tile j-1 (K/V, keys, P, dS) done
            if (j + 1 < n_tiles) issue_tile(j + 1, buf ^ 1);  // into tile j-1's buffer
            cp_async_commit();
            fetch_keys(j + 2, key_ahead);  // stored at the end of this tile
            bf16* kt = kv_s + buf * kBN * QS;
            const int* keys = key_s + (j % kKR) * kBN;

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
            __syncthreads();  // B: P and dS visible

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

            // dKV = dS^T Q + P^T dO, unit by unit (16 slots x 64 columns), flushed from the
            // accumulators: lanes c4 and c4^1 swap halves so that each lane holds 4
            // consecutive columns of one slot row (even c4: row g, odd c4: row g+8).
            const int t0 = j * kBN;
            const bool odd = c4 & 1;
            for (int u = warp; u < kUnits; u += kNW) {
                const int mt = u / kUnitsN, col0 = (u % kUnitsN) * 64;
                float acc[8][4];
#pragma unroll
                for (int n = 0; n < 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
#pragma unroll
                for (int kk = 0; kk < kHB; kk += 16) {
                    // A = dS^T, P^T (slots x heads) from the head-major tiles, transposed
                    u32 ads[4], ap[4];
                    const int a_off = (kk + (lane & 7) + (lane >> 4) * 8) * PS + mt * 16 + ((lane >> 3) & 1) * 8;
                    ldsm_x4_t(ads, ds_s + a_off);
                    ldsm_x4_t(ap, p_s + a_off);
#pragma unroll
                    for (int n = 0; n < 8; n += 2) {
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
                // Atomic: one 16-byte vector reduction per (slot, 4 columns); a key repeated
                // in the tile simply gets one per slot. Deterministic: each valid slot's row
                // stored to the row's contributions, summed per key later in a fixed order.
                const int r = mt * 16 + g + (odd ? 8 : 0);
                const int key = keys[r];
                float* dst = dkv_t + (p.deterministic ? (static_cast<i64>(t0 + r) * n_hblk + hb) * kD : static_cast<i64>(max(key, 0)) * kD);
#pragma unroll
                for (int n = 0; n < 8; ++n) {
                    const float s0 = odd ? acc[n][0] : acc[n][2], s1 = odd ? acc[n][1] : acc[n][3];
                    const float x0 = __shfl_xor_sync(DSV4_FULL_MASK, s0, 1), x1 = __shfl_xor_sync(DSV4_FULL_MASK, s1, 1);
                    const float4 v = odd ? make_float4(x0, x1, acc[n][2], acc[n][3]) : make_float4(acc[n][0], acc[n][1], x0, x1);
                    float* ptr = dst + col0 + n * 8 + (c4 & 2) * 2;
                    if (key >= 0) {
                        if (p.deterministic)
                            *reinterpret_cast<float4*>(ptr) = v;
                        else
                            red_add_f32x4(ptr, v);
                    }
                }
            }
            store_keys(j + 2, key_ahead);  // into the ring slot of tile j - 1 (read before this tile's first barrier)
        }
        cp_async_wait<0>();  // the Q/dO group when the row has no tile
        const bool row_nonempty = __syncthreads_or(any_valid) || p.all_rows_nonempty;

        // dq, written once; zeros for an empty row (its masked slots' dS = 0 * (dP - delta)
        // is NaN where its dout is not finite, and SPEC.md gives it zero gradients)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int h = h0 + wm * 16 + g + 8 * half;
            if (h < p.H) {
                bf16* qrow = p.dq + (row * p.H + h) * kD + wd * kDW + 2 * c4;
#pragma unroll
                for (int n = 0; n < kDW / 8; ++n) *reinterpret_cast<u32*>(qrow + n * 8) = row_nonempty ? pack_bf16x2(dq[n][2 * half], dq[n][2 * half + 1]) : 0u;
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
