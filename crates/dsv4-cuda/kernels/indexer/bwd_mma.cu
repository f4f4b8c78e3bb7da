// Backward of `indexer_topk_scores` on tensor cores (SPEC.md section 3). For every slot t
// of query (b,s) whose index p is valid and visible and whose gradient g_t is nonzero,
// with a_h = <q[b,s,h], kv[b,p]> and G[h,t] = g_t * scale * w[b,s,h] * [a_h > 0]:
//
//   dw[b,s,h]  += g_t * scale * relu(a_h)
//   dq[b,s,h]  += G[h,t] * kv[b,p]
//   dkv[b,p]   += sum_h G[h,t] * q[b,s,h]
//
// A CTA (4 warps) walks `rows_per_cta` consecutive queries of one batch row in order. Per
// query, q [HPAD, D] (bf16) stays in shared memory and the selection streams through in
// tiles of BN = 64 slots whose kv rows are gathered by cp.async into a double buffer.
// Per tile:
//   1. warp w (< HPAD/16) owns heads [16w, 16w+16): A = q_w @ kv_tile^T (mma m16n8k16,
//      M = heads, N = slots, K = D), then in registers dw += g*scale*relu(A) and
//      G = g*scale*w*[A>0]. G's accumulators are reused in place as the A operand of
//      dq_w += G @ kv_tile (M = heads, N = D, K = slots; kv read with ldmatrix.trans);
//      dq_w stays in registers for the whole query. G (bf16) also goes to shared memory.
//   2. warp w owns slots [16w, 16w+16): dkv_tile = G^T @ q (M = slots, N = D, K = heads;
//      both operands read with ldmatrix.trans).
//      - atomic mode: added to dkv [B,P,D] from the registers. On sm_90 with D % 4 == 0,
//        lane pairs swap halves so that each lane adds 4 columns of one row: one float4
//        atomic (dkv 16-byte aligned) or two float2; else float2 atomics on sm_90.
//      - deterministic mode: staged in shared memory and added to the CTA's own partial
//        slice [P,D] (zeroed) by plain read-modify-write; each address is touched once
//        per tile when the tile's keys are distinct, and otherwise by the owner of its
//        column slot after slot: the order is (query, tile, slot) whatever the schedule.
//        `indexer_bwd_reduce` (bwd.cu) then sums the slices in chunk order.
// dq (bf16) and dw of a query are written once, from the registers.
//
// Registers: at most 168 a thread (__launch_bounds__(128, 3)), so that three CTAs share an
// SM on Hopper (3 x 62 KB of shared memory at H = 64, D = 128; atomic mode): step 1 runs
// in two halves of 32 slots and step 2 in two halves of D, so that only half of A's or
// dkv's accumulators live next to dq's 64; the k-step loops are unrolled by 2 and the copy
// loops not at all (fully unrolled, ptxas hoists their loads and addresses past the
// limit). Every accumulator sums the same products in the same order as unsplit.
//
// G is rounded to bf16 for the tensor cores (f32 accumulate), like q and kv themselves;
// dw uses the f32 products. Shape limits (the host falls back to bwd.cu beyond them):
// H <= 64, D <= 128.
//
// Defines: IDX_H heads, IDX_D head dim.
#include "indexer/params.cuh"
#include "indexer/mma.cuh"

namespace {

using namespace dsv4;
using namespace dsv4::indexer;

constexpr int H = IDX_H;
constexpr int D = IDX_D;
constexpr int HPAD = (H + 15) / 16 * 16;  // zero q rows and zero weights past H
constexpr int MT = HPAD / 16;             // head m-tiles, one warp each
constexpr int DPAD = (D + 15) / 16 * 16;
constexpr int KSTEPS = DPAD / 16;         // k-steps of A = q kv^T
constexpr int NDT = DPAD / 8;             // 8-wide d n-tiles of dq and dkv
constexpr int DCH = (D + 7) / 8;          // 16-byte chunks of a global row
constexpr int DCH_PAD = DPAD / 8;
constexpr int LDS = DPAD + 8;             // bf16 row stride of sq / skv (+16 bytes: conflict-free ldmatrix)
constexpr int BN = 64;                    // slots per tile
constexpr int NTN = BN / 8;               // slot n-tiles of A
constexpr int NTH = NTN / 2;              // n-tiles of A per half (an even count: 16-slot k-steps of dq)
constexpr int DCHUNK = NDT % 4 == 0 ? NDT / 2 : NDT;  // d n-tiles of dkv accumulated at a time (even)
constexpr int LDG = BN + 8;               // bf16 row stride of sG
constexpr int LDF = DPAD + 8;             // f32 row stride of the staged dkv tile
constexpr int NWARPS = 4;
constexpr int NTHREADS = NWARPS * 32;
static_assert(MT <= NWARPS, "one warp per 16-head m-tile: H <= 64");
static_assert(BN == 16 * NWARPS, "one warp per 16-slot m-tile of dkv");
static_assert(BN == 64, "a warp votes over a tile's keys two per lane");
static_assert(DPAD <= 128, "dq and dkv accumulators live in registers: D <= 128");
static_assert(NTH % 2 == 0 && NTN % NTH == 0, "halves of whole 16-slot k-steps of dq");
static_assert(DCHUNK % 2 == 0 && NDT % DCHUNK == 0, "dkv chunks of whole ldmatrix.x4 pairs");

// Shared memory (bytes), mirrored by `bwd_mma_smem_bytes` in src/indexer/config.rs:
//   sq [HPAD][LDS] bf16 | skv [2][BN][LDS] bf16 | sG [HPAD][LDG] bf16 | sw [HPAD] f32 |
//   sg [2][BN] f32 | skey [2][BN] i32 | (deterministic only) sdkv [BN][LDF] f32
constexpr int SMEM_BASE = (HPAD * LDS + 2 * BN * LDS + HPAD * LDG) * 2 + HPAD * 4 + 2 * BN * 4 + 2 * BN * 4;
constexpr int SMEM_DET = SMEM_BASE + BN * LDF * 4;
static_assert(SMEM_BASE % 16 == 0, "sdkv stays aligned");
static_assert(SMEM_DET <= 227 * 1024, "shared memory");

// dst[0] += x, dst[1] += y atomically: one 8-byte vector atomic on sm_90 when D is even
// (then the element offset key*D + d is even; the host guarantees an 8-byte aligned dkv).
__device__ __forceinline__ void add2(float* dst, float x, float y) {
#if __CUDA_ARCH__ >= 900
    if (D % 2 == 0) {
        atomicAdd(reinterpret_cast<float2*>(dst), make_float2(x, y));
        return;
    }
#endif
    atomicAdd(dst, x);
    atomicAdd(dst + 1, y);
}

// Atomic-mode dkv on sm_90 with D % 4 == 0: lane pairs swap halves of their 8-column
// accumulators so that each lane adds 4 consecutive columns of one row (rows and
// 4-column groups are then 16-byte aligned when dkv is).
#if __CUDA_ARCH__ >= 900
constexpr bool SWAP4 = D % 4 == 0;
#else
constexpr bool SWAP4 = false;
#endif

// dst[0..4) += v atomically: one 16-byte vector atomic (sm_90; the caller checks alignment).
__device__ __forceinline__ void add4(float* dst, float4 v) {
#if __CUDA_ARCH__ >= 900
    atomicAdd(reinterpret_cast<float4*>(dst), v);
#else
    atomicAdd(dst, v.x);
    atomicAdd(dst + 1, v.y);
    atomicAdd(dst + 2, v.z);
    atomicAdd(dst + 3, v.w);
#endif
}

// dst[0] = x and, when `second`, dst[1] = y, as bf16: one 4-byte store when D is even
// (then the element offset is even; the host guarantees a 4-byte aligned dq).
__device__ __forceinline__ void store_pair(bf16* dst, float x, float y, bool second) {
    if (D % 2 == 0) {
        *reinterpret_cast<u32*>(dst) = pack_bf16(x, y);
    } else {
        dst[0] = from_f32<bf16>(x);
        if (second) dst[1] = from_f32<bf16>(y);
    }
}

}  // namespace

extern "C" __global__ void __launch_bounds__(NTHREADS, 3) indexer_bwd_mma(const IndexerBwdParams p) {
    extern __shared__ __align__(16) unsigned char smem[];
    bf16* sq = reinterpret_cast<bf16*>(smem);
    bf16* skv = sq + HPAD * LDS;
    bf16* sG = skv + 2 * BN * LDS;
    float* sw = reinterpret_cast<float*>(sG + HPAD * LDG);
    float* sg = sw + HPAD;
    int* skey = reinterpret_cast<int*>(sg + 2 * BN);
    float* sdkv = reinterpret_cast<float*>(smem + SMEM_BASE);  // deterministic only

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, c4 = lane & 3;
    const i64 b = blockIdx.y;
    const i64 chunk = blockIdx.x;
    const i64 s_lo = chunk * p.rows_per_cta;
    const i64 s_hi = min(static_cast<i64>(p.S), s_lo + p.rows_per_cta);
    float* dkv = p.dkv + b * p.dkv_sb + chunk * p.dkv_sc;  // [P, D]: this CTA's target
    const bool det = p.deterministic != 0;
    // SWAP4: atomic dkv by 16-byte vectors when the target is 16-byte aligned (else two
    // 8-byte ones from the same lanes).
    const bool v4 = (reinterpret_cast<unsigned long long>(dkv) & 15ull) == 0ull;
    const int n_tiles = (p.T + BN - 1) / BN;

    for (i64 s = s_lo; s < s_hi; ++s) {
        // ---- q rows (cp.async, zero past H and D) and weights ------------------------------
#pragma unroll 1
        for (int e = tid; e < HPAD * DCH_PAD; e += NTHREADS) {
            const int c = e % DCH_PAD, h = e / DCH_PAD;
            const bool valid = h < H && c < DCH;
            const bf16* src = valid ? p.q + b * p.q_sb + s * p.q_ss + h * p.q_sh + c * 8 : p.q;
            cp_async16(sq + h * LDS + c * 8, src, valid);
        }
        cp_async_commit();
        for (int h = tid; h < HPAD; h += NTHREADS) sw[h] = h < H ? p.w[b * p.w_sb + s * p.w_ss + h * p.w_sh] : 0.0f;
        const i64 vis = min(static_cast<i64>(p.P), visible_keys(static_cast<i64>(p.query_start) + s, p.compress_ratio));

        // Slot `tid` (< BN) of tile `tile`: key (-1: ignored) and g*scale (0 when ignored,
        // so a masked slot's gradient, even inf or NaN, never enters a sum). Fetched into
        // registers two tiles ahead, stored to skey / sg one tile ahead, so the dependent
        // index -> row loads never wait in line with the tensor-core work.
        auto fetch_slot = [&](int tile, int& key_out, float& gs_out) {
            const i64 t = static_cast<i64>(tile) * BN + tid;
            key_out = -1;
            gs_out = 0.0f;
            if (tid < BN && t < p.T) {
                const i64 key = load_int(p.topk, b * p.t_sb + s * p.t_ss + t * p.t_st, p.topk_is_i64);
                const float gt = p.grad[b * p.g_sb + s * p.g_ss + t * p.g_st];
                if (key >= 0 && key < vis && gt != 0.0f) {
                    key_out = static_cast<int>(key);
                    gs_out = gt * p.scale;
                }
            }
        };
        auto stash_slot = [&](int buf, int key, float gs) {
            if (tid < BN) {
                skey[buf * BN + tid] = key;
                sg[buf * BN + tid] = gs;
            }
        };
        // kv rows of the slots in skey[buf] (zeros for ignored slots); needs skey published.
        auto load_rows = [&](int buf) {
#pragma unroll 1
            for (int e = tid; e < BN * DCH_PAD; e += NTHREADS) {
                const int c = e % DCH_PAD, j = e / DCH_PAD;
                const int key = skey[buf * BN + j];
                const bool load = key >= 0 && c < DCH;
                const bf16* src = load ? p.kv + b * p.kv_sb + static_cast<i64>(key) * p.kv_sp + c * 8 : p.kv;
                cp_async16(skv + (buf * BN + j) * LDS + c * 8, src, load);
            }
            cp_async_commit();
        };

        float dq_acc[NDT][4];
#pragma unroll
        for (int i = 0; i < NDT; ++i) dq_acc[i][0] = dq_acc[i][1] = dq_acc[i][2] = dq_acc[i][3] = 0.0f;
        float dw0 = 0.0f, dw1 = 0.0f;  // heads 16*warp + g and + g + 8 (this lane's slots)

        int next_key = -1;  // slot tid of the tile after the one being stashed
        float next_gs = 0.0f;
        if (n_tiles > 0) {
            int k0;
            float g0;
            fetch_slot(0, k0, g0);
            fetch_slot(1, next_key, next_gs);
            stash_slot(0, k0, g0);
            __syncthreads();
            load_rows(0);
        }
        for (int it = 0; it < n_tiles; ++it) {
            const int buf = it & 1;
            // Buffer buf^1 was last read in iteration it-1, which ended with a barrier.
            if (it + 1 < n_tiles) {
                stash_slot(buf ^ 1, next_key, next_gs);
                fetch_slot(it + 2, next_key, next_gs);
            }
            cp_async_wait<0>();  // tile it's rows (and the q rows)
            __syncthreads();     // ... for everyone; skey[buf^1] published
            if (it + 1 < n_tiles) load_rows(buf ^ 1);
            const bf16* kv_tile = skv + buf * BN * LDS;
            const float* g_tile = sg + buf * BN;
            const int* key_tile = skey + buf * BN;
            // A tile whose slots are all ignored (past a short query's selection, or masked)
            // adds nothing: its products are skipped. Block-uniform: every warp votes over
            // the same published keys.
            const bool tile_live = __any_sync(DSV4_FULL_MASK, key_tile[lane] >= 0 || key_tile[lane + 32] >= 0);

            // ---- 1. A = q kv^T for this warp's 16 heads; dw; G; dq += G kv -------------------
            // In two halves of NTH n-tiles (32 slots): a half's A accumulators and G fragments
            // live next to dq's (fewer registers, 3 CTAs per SM); every sum keeps its order.
            if (warp < MT && tile_live) {
                const float w0 = sw[warp * 16 + g], w1 = sw[warp * 16 + g + 8];
#pragma unroll 1
                for (int n0 = 0; n0 < NTN; n0 += NTH) {
                    float acc[NTH][4];
#pragma unroll
                    for (int nt = 0; nt < NTH; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
#pragma unroll 2
                    for (int ks = 0; ks < KSTEPS; ++ks) {
                        u32 a[4];
                        ldmatrix_x4(a, sq + (warp * 16 + (lane & 15)) * LDS + ks * 16 + (lane >> 4) * 8);
#pragma unroll
                        for (int nt = 0; nt < NTH; nt += 2) {
                            u32 bb[4];  // slots (n0+nt)*8.. (bb[0..1]) and 8 more (bb[2..3])
                            ldmatrix_x4(bb, kv_tile + ((n0 + nt) * 8 + (lane & 7) + ((lane >> 4) & 1) * 8) * LDS + ks * 16 + ((lane >> 3) & 1) * 8);
                            const u32 b0[2] = {bb[0], bb[1]}, b1[2] = {bb[2], bb[3]};
                            mma_bf16_16816(acc[nt], a, b0);
                            mma_bf16_16816(acc[nt + 1], a, b1);
                        }
                    }
                    u32 gf[NTH / 2][4];  // G as A fragments of dq (k = slots)
#pragma unroll
                    for (int nt = 0; nt < NTH; ++nt) {
                        float gv[4];
#pragma unroll
                        for (int j = 0; j < 2; ++j) {
                            const float gs = g_tile[(n0 + nt) * 8 + 2 * c4 + j];
                            dw0 += gs * fmaxf(acc[nt][j], 0.0f);
                            dw1 += gs * fmaxf(acc[nt][2 + j], 0.0f);
                            gv[j] = acc[nt][j] > 0.0f ? gs * w0 : 0.0f;
                            gv[2 + j] = acc[nt][2 + j] > 0.0f ? gs * w1 : 0.0f;
                        }
                        const u32 lo = pack_bf16(gv[0], gv[1]), hi = pack_bf16(gv[2], gv[3]);
                        gf[nt / 2][(nt & 1) * 2 + 0] = lo;  // rows g: a0 (slots 2c) / a2 (slots 8+2c)
                        gf[nt / 2][(nt & 1) * 2 + 1] = hi;  // rows g+8: a1 / a3
                        *reinterpret_cast<u32*>(sG + (warp * 16 + g) * LDG + (n0 + nt) * 8 + 2 * c4) = lo;
                        *reinterpret_cast<u32*>(sG + (warp * 16 + g + 8) * LDG + (n0 + nt) * 8 + 2 * c4) = hi;
                    }
#pragma unroll
                    for (int ks = 0; ks < NTH / 2; ++ks) {
#pragma unroll
                        for (int dn = 0; dn < NDT; dn += 2) {
                            u32 bb[4];  // kv[slot][d] as B (k = slot, n = d): d tiles dn, dn+1
                            ldmatrix_x4_trans(bb, kv_tile + (n0 * 8 + ks * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LDS + dn * 8 + (lane >> 4) * 8);
                            const u32 b0[2] = {bb[0], bb[1]}, b1[2] = {bb[2], bb[3]};
                            mma_bf16_16816(dq_acc[dn], gf[ks], b0);
                            mma_bf16_16816(dq_acc[dn + 1], gf[ks], b1);
                        }
                    }
                }
            }
            __syncthreads();  // sG complete (rows [0, HPAD): one 16-row block per warp < MT)

            // ---- 2. dkv rows of this warp's 16 slots: G^T q, DCHUNK d n-tiles at a time ------
            // (the accumulators of one chunk live next to dq's: fewer registers, 3 CTAs per SM;
            // each element's sum over the heads is the same sequence of mma either way).
            const int t0 = warp * 16;
            const int key_lo = key_tile[t0 + g], key_hi = key_tile[t0 + g + 8];
            const bool any = __any_sync(DSV4_FULL_MASK, key_lo >= 0 || key_hi >= 0);
#pragma unroll 1
            for (int dc = 0; dc < NDT; dc += DCHUNK) {
                float kacc[DCHUNK][4];
#pragma unroll
                for (int i = 0; i < DCHUNK; ++i) kacc[i][0] = kacc[i][1] = kacc[i][2] = kacc[i][3] = 0.0f;
                if (any) {
#pragma unroll 2
                    for (int kh = 0; kh < MT; ++kh) {
                        u32 a[4];  // G^T [slot][head] from sG [head][slot]
                        ldmatrix_x4_trans(a, sG + (kh * 16 + (lane & 7) + ((lane >> 4) & 1) * 8) * LDG + t0 + ((lane >> 3) & 1) * 8);
#pragma unroll
                        for (int i = 0; i < DCHUNK; i += 2) {
                            u32 bb[4];  // q[h][d] as B (k = head, n = d)
                            ldmatrix_x4_trans(bb, sq + (kh * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LDS + (dc + i) * 8 + (lane >> 4) * 8);
                            const u32 b0[2] = {bb[0], bb[1]}, b1[2] = {bb[2], bb[3]};
                            mma_bf16_16816(kacc[i], a, b0);
                            mma_bf16_16816(kacc[i + 1], a, b1);
                        }
                    }
                }
                if (!det && SWAP4) {
                    // One 16-byte vector atomic per 4 columns: lane pairs (c4, c4^1) swap halves
                    // so that the even lane holds 4 columns of key_lo, the odd one of key_hi.
                    if (any) {
                        const bool odd = (c4 & 1) != 0;
                        const int key = odd ? key_hi : key_lo;
#pragma unroll
                        for (int i = 0; i < DCHUNK; ++i) {  // in place: kacc[i] = 4 columns of `key`
                            const float r0 = __shfl_xor_sync(DSV4_FULL_MASK, odd ? kacc[i][0] : kacc[i][2], 1);
                            const float r1 = __shfl_xor_sync(DSV4_FULL_MASK, odd ? kacc[i][1] : kacc[i][3], 1);
                            kacc[i][0] = odd ? r0 : kacc[i][0];
                            kacc[i][1] = odd ? r1 : kacc[i][1];
                            kacc[i][2] = odd ? kacc[i][2] : r0;
                            kacc[i][3] = odd ? kacc[i][3] : r1;
                        }
                        if (key >= 0) {
#pragma unroll
                            for (int i = 0; i < DCHUNK; ++i) {
                                const int d = (dc + i) * 8 + 4 * (c4 >> 1);
                                if (d < D) {
                                    float* dst = dkv + static_cast<i64>(key) * D + d;
                                    if (v4) {
                                        add4(dst, make_float4(kacc[i][0], kacc[i][1], kacc[i][2], kacc[i][3]));
                                    } else {
                                        add2(dst, kacc[i][0], kacc[i][1]);
                                        add2(dst + 2, kacc[i][2], kacc[i][3]);
                                    }
                                }
                            }
                        }
                    }
                } else if (!det) {
                    if (any) {
#pragma unroll
                        for (int i = 0; i < DCHUNK; ++i) {
                            const int d = (dc + i) * 8 + 2 * c4;
                            if (d < D) {
                                if (key_lo >= 0) {
                                    float* dst = dkv + static_cast<i64>(key_lo) * D + d;
                                    if (d + 1 < D) add2(dst, kacc[i][0], kacc[i][1]);
                                    else atomicAdd(dst, kacc[i][0]);
                                }
                                if (key_hi >= 0) {
                                    float* dst = dkv + static_cast<i64>(key_hi) * D + d;
                                    if (d + 1 < D) add2(dst, kacc[i][2], kacc[i][3]);
                                    else atomicAdd(dst, kacc[i][2]);
                                }
                            }
                        }
                    }
                } else {
                    // Stage the tile's dkv rows (added in a fixed order below).
#pragma unroll
                    for (int i = 0; i < DCHUNK; ++i) {
                        const int d = (dc + i) * 8 + 2 * c4;
                        *reinterpret_cast<float2*>(sdkv + (t0 + g) * LDF + d) = make_float2(kacc[i][0], kacc[i][1]);
                        *reinterpret_cast<float2*>(sdkv + (t0 + g + 8) * LDF + d) = make_float2(kacc[i][2], kacc[i][3]);
                    }
                }
            }
            if (det && tile_live) {
                // Does a valid key repeat within the tile? (thread j checks slot j against
                // the earlier slots.) The barrier also publishes sdkv.
                bool dup = false;
                if (tid < BN) {
                    const int kj = key_tile[tid];
                    if (kj >= 0)
                        for (int i = 0; i < tid; ++i) dup |= key_tile[i] == kj;
                }
                if (__syncthreads_or(dup)) {
                    // Owner of column d adds the slots in order.
                    for (int d = tid; d < D; d += NTHREADS) {
                        for (int j = 0; j < BN; ++j) {
                            const int key = key_tile[j];
                            if (key >= 0) dkv[static_cast<i64>(key) * D + d] += sdkv[j * LDF + d];
                        }
                    }
                } else {
                    // Every address once: batches of 8 independent read-modify-writes.
                    constexpr int BATCH = 8;
                    for (int e0 = 0; e0 < BN * D; e0 += NTHREADS * BATCH) {
                        float v[BATCH];
#pragma unroll
                        for (int u = 0; u < BATCH; ++u) {
                            const int e = e0 + u * NTHREADS + tid;
                            const int j = e / D, d = e % D;
                            const int key = e < BN * D ? key_tile[j] : -1;
                            v[u] = key >= 0 ? dkv[static_cast<i64>(key) * D + d] + sdkv[j * LDF + d] : 0.0f;
                        }
#pragma unroll
                        for (int u = 0; u < BATCH; ++u) {
                            const int e = e0 + u * NTHREADS + tid;
                            const int j = e / D, d = e % D;
                            const int key = e < BN * D ? key_tile[j] : -1;
                            if (key >= 0) dkv[static_cast<i64>(key) * D + d] = v[u];
                        }
                    }
                }
            }
            __syncthreads();  // skv[buf], sG, sdkv, skey/sg[buf] are rewritten next
        }

        // ---- dq (bf16) and dw of this query, from the registers -------------------------------
        if (warp < MT) {
            const i64 row = b * p.S + s;
            bf16* dq_row = p.dq + row * H * D;
            const int h0 = warp * 16 + g, h1 = h0 + 8;
#pragma unroll
            for (int dn = 0; dn < NDT; ++dn) {
                const int d = dn * 8 + 2 * c4;
                if (d < D) {
                    if (h0 < H) store_pair(dq_row + h0 * D + d, dq_acc[dn][0], dq_acc[dn][1], d + 1 < D);
                    if (h1 < H) store_pair(dq_row + h1 * D + d, dq_acc[dn][2], dq_acc[dn][3], d + 1 < D);
                }
            }
            dw0 += __shfl_xor_sync(DSV4_FULL_MASK, dw0, 1);
            dw0 += __shfl_xor_sync(DSV4_FULL_MASK, dw0, 2);
            dw1 += __shfl_xor_sync(DSV4_FULL_MASK, dw1, 1);
            dw1 += __shfl_xor_sync(DSV4_FULL_MASK, dw1, 2);
            if (c4 == 0) {
                if (h0 < H) p.dw[row * H + h0] = dw0;
                if (h1 < H) p.dw[row * H + h1] = dw1;
            }
        }
        // The last tile ended with a barrier: sq and sw may be reloaded (T == 0: nothing
        // read them; the q copy is drained before it is issued again).
        if (n_tiles == 0) cp_async_wait<0>();
    }
}
