// Lightning-indexer scores on tensor cores (SPEC.md section 2):
//
//   score[b,s,p] = scale * sum_h w[b,s,h] * relu(<q[b,s,h,:], kv[b,p,:]>)   if p < (query_start+s+1)/r
//                = -inf                                                      otherwise
//
// One CTA owns BQ queries of one batch row and walks the key tiles they can see. Its
// queries' q rows (all H heads, zero-padded to a multiple of 16) stay in shared memory;
// key tiles of BN pooled keys stream through a cp.async double buffer. A = q [BQ*H, D],
// B = kv tile [BN, D]: warp (qi, kg) computes A[qi's heads] @ B[kg's NT*8 keys]^T with
// mma.sync m16n8k16 (bf16 in, f32 accumulate), one 16-head m-tile at a time, with its B
// fragments held in registers across the m-tiles. Each m-tile's accumulators go through
// relu, are weighted by w[h] and summed over h in registers; the last 16-row sum is a
// butterfly over the lanes that share a column. Key tiles beyond the CTA's last visible
// key are never computed; their -inf is written by a plain fill.
//
// IDX_FUSED=1 is the lightning indexer's forward (scores + top-k): each query's row of
// scores is kept in shared memory instead of global, and once all tiles are done the CTA
// selects its top-k from there with the block-wide exact selection of select.cuh (the
// same code as topk.cu), reading each row only up to its query's visible keys (the
// rest is -inf, never selected, and is not written either): the [B,S,P] scores are
// never written.
//
// IDX_GATHER=1 is `indexer_topk_scores`: one query per CTA, the "key tile" is BN slots of
// its selection, gathered by index (masked or invisible slots load zeros and score -inf).
//
// Defines (the host, `src/indexer/config.rs`, chooses them and mirrors the shared-memory
// size): IDX_H heads, IDX_D head dim (any; rows are padded to 16), IDX_BQ queries per CTA,
// IDX_BN keys per tile, IDX_NT 8-key n-tiles per warp, IDX_GATHER, IDX_FUSED (the modes
// above; 0 and 0: dense scores).
#include "indexer/params.cuh"
#include "indexer/mma.cuh"
#include "indexer/select.cuh"

namespace {

using namespace dsv4;
using namespace dsv4::indexer;

constexpr int H = IDX_H;
constexpr int D = IDX_D;
constexpr int HPAD = (H + 15) / 16 * 16;  // heads padded to whole m-tiles (zero q rows, zero weights)
constexpr int MT = HPAD / 16;             // m-tiles per query
constexpr int DPAD = (D + 15) / 16 * 16;  // the mma k dimension
constexpr int KSTEPS = DPAD / 16;
constexpr int DCH = (D + 7) / 8;          // 16-byte chunks of a global row
constexpr int DCH_PAD = DPAD / 8;         // 16-byte chunks of a shared row (tail zero-filled)
constexpr int LDS = DPAD + 8;             // shared row stride: +16 bytes puts the 8 rows of an ldmatrix on distinct banks
constexpr bool GATHER = IDX_GATHER != 0;
constexpr bool FUSED = IDX_FUSED != 0;
static_assert(!(GATHER && FUSED), "gather mode scores a given selection; nothing to select");
constexpr int BQ = GATHER ? 1 : IDX_BQ;
constexpr int BN = IDX_BN;
constexpr int NT = IDX_NT;
constexpr int KG = BN / (NT * 8);         // key groups: warps per query
constexpr int NWARPS = BQ * KG;
constexpr int NTHREADS = NWARPS * 32;
static_assert(BN % (NT * 8) == 0, "a tile must split into whole warp slabs of NT*8 keys");
static_assert(NTHREADS >= 32 && NTHREADS <= 1024, "bad CTA size");
static_assert((LDS * 2) % 16 == 0, "shared rows must stay 16-byte aligned");
static_assert(!GATHER || NTHREADS >= BN, "gather: one thread per slot fetches the keys");

// Shared memory (bytes), mirrored by `ScoresTiles::smem_bytes` in src/indexer/config.rs:
//   sq  [BQ*HPAD][LDS] bf16 | skv [2][BN][LDS] bf16 | sw [BQ*HPAD] f32 | sval [2][BN] i32 (gather: keys, -1 = masked)
// and, fused only (sized at run time):
//   SelectSmem (2304) | sort [sort_cap] u64 | srow [BQ][P] f32
constexpr int SMEM_BYTES = (BQ * HPAD * LDS + 2 * BN * LDS) * 2 + BQ * HPAD * 4 + 2 * BN * 4;
static_assert(SMEM_BYTES <= 227 * 1024, "the tile does not fit in shared memory (the host picks smaller tiles)");

}  // namespace

// Gather mode: as many CTAs per SM as shared memory allows (one query each, so more CTAs
// overlap more queries' index and row fetches), up to 4 and at least 128 registers a thread.
#if IDX_GATHER
namespace {
constexpr int GATHER_SMEM_CTAS = (228 * 1024) / (SMEM_BYTES + 1024);  // 1 KB reserved per CTA
constexpr int GATHER_REG_CTAS = 512 / NTHREADS;                       // 65536 / (128 * NTHREADS)
constexpr int GATHER_MIN_CTAS_RAW = GATHER_SMEM_CTAS < GATHER_REG_CTAS ? GATHER_SMEM_CTAS : GATHER_REG_CTAS;
constexpr int GATHER_MIN_CTAS = GATHER_MIN_CTAS_RAW < 1 ? 1 : GATHER_MIN_CTAS_RAW > 4 ? 4 : GATHER_MIN_CTAS_RAW;
}  // namespace
#define IDX_SCORES_BOUNDS __launch_bounds__(NTHREADS, GATHER_MIN_CTAS)
#else
#define IDX_SCORES_BOUNDS __launch_bounds__(NTHREADS)
#endif

extern "C" __global__ void IDX_SCORES_BOUNDS indexer_scores(const IndexerScoresParams p) {
    extern __shared__ __align__(16) unsigned char smem[];
    bf16* sq = reinterpret_cast<bf16*>(smem);
    bf16* skv = sq + BQ * HPAD * LDS;
    float* sw = reinterpret_cast<float*>(skv + 2 * BN * LDS);
    int* sval = reinterpret_cast<int*>(sw + BQ * HPAD);
    SelectSmem& ssel = *reinterpret_cast<SelectSmem*>(smem + SMEM_BYTES);  // fused only
    u64* ssort = reinterpret_cast<u64*>(smem + SMEM_BYTES + sizeof(SelectSmem));
    float* srow = reinterpret_cast<float*>(ssort + (FUSED ? p.sort_cap : 0));

    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const i64 b = blockIdx.y;
    // First query of this CTA. Causal work grows with the query, and CTAs start roughly in
    // blockIdx order: the last query blocks go first, so that the wave ends on the lightest
    // CTAs instead of a partial wave of the heaviest (gather: all CTAs alike, no effect).
    const i64 s0 = p.s_begin + static_cast<i64>(gridDim.x - 1 - blockIdx.x) * BQ;
    const int nq = static_cast<int>(min(static_cast<i64>(BQ), static_cast<i64>(p.s_begin) + p.s_count - s0));
    const float neg_inf = -__int_as_float(0x7f800000);

    // ---- q rows of the CTA's queries -> sq (cp.async), weights -> sw ----------------------
    for (int e = tid; e < BQ * HPAD * DCH_PAD; e += NTHREADS) {
        const int c = e % DCH_PAD, row = e / DCH_PAD;
        const int qi = row / HPAD, h = row % HPAD;
        const bool valid = qi < nq && h < H && c < DCH;
        const bf16* src = valid ? p.q + b * p.q_sb + (s0 + qi) * p.q_ss + h * p.q_sh + c * 8 : p.q;
        cp_async16(sq + row * LDS + c * 8, src, valid);
    }
    cp_async_commit();
    for (int e = tid; e < BQ * HPAD; e += NTHREADS) {
        const int qi = e / HPAD, h = e % HPAD;
        sw[e] = (qi < nq && h < H) ? p.w[b * p.w_sb + (s0 + qi) * p.w_ss + h * p.w_sh] : 0.0f;
    }

    // ---- the key tiles this CTA computes --------------------------------------------------
    // Dense: keys [0, n_keys) where n_keys = keys visible to the CTA's last query.
    // Gather: slots [0, T); the query's visible range masks each slot.
    const i64 vis_first = min(static_cast<i64>(p.P), visible_keys(static_cast<i64>(p.query_start) + s0, p.compress_ratio));
    const i64 n_keys = GATHER ? static_cast<i64>(p.T)
                              : min(static_cast<i64>(p.P), visible_keys(static_cast<i64>(p.query_start) + s0 + nq - 1, p.compress_ratio));
    const int n_tiles = static_cast<int>((n_keys + BN - 1) / BN);

    if (!GATHER && !FUSED && !p.visible_only) {
        // Keys past the last computed tile: -inf for every query of the CTA. (Fused: the
        // selection reads a row only below its query's visible count, never out there;
        // visible_only: nor does the caller.)
        for (int qi = 0; qi < nq; ++qi) {
            float* out_row = FUSED ? srow + static_cast<i64>(qi) * p.P : p.out + b * p.out_sb + (s0 + qi - p.s_begin) * p.out_ss;
            for (i64 key = static_cast<i64>(n_tiles) * BN + tid; key < p.P; key += NTHREADS) out_row[key] = neg_inf;
        }
    }

    // Gather: slot `tid` of tile `tile`, its key if valid and visible, else -1. Keys are
    // fetched into a register two tiles ahead and published in sval one tile ahead, so the
    // row copies never wait on an index load in line (one thread per slot).
    auto fetch_key = [&](int tile) -> int {
        const i64 t = static_cast<i64>(tile) * BN + tid;
        if (tid >= BN || t >= p.T) return -1;
        const i64 key = load_int(p.topk, b * p.t_sb + s0 * p.t_ss + t * p.t_st, p.topk_is_i64);
        return key >= 0 && key < vis_first ? static_cast<int>(key) : -1;
    };
    // Thread tid copies 16-byte chunk c = tid % DCH_PAD of rows tid / DCH_PAD + i * ROW_STEP
    // of a tile when the CTA's threads cover whole rows (the address arithmetic that does not
    // depend on the row is done once); otherwise a plain strided loop.
    constexpr bool ROW_COPIES = NTHREADS % DCH_PAD == 0 && BN % (NTHREADS / DCH_PAD) == 0;
    constexpr int ROW_STEP = ROW_COPIES ? NTHREADS / DCH_PAD : 1;
    const int copy_c = tid % DCH_PAD, copy_j = tid / DCH_PAD;
    const bool copy_c_ok = DCH == DCH_PAD || copy_c < DCH;
    // The chunk's source address is kv_chunk + key * kv_row_bytes: an unsigned 32 x 64-bit
    // multiply-add (key >= 0 when loaded; row 0's chunk, a mapped address, when not).
    const u64 kv_chunk = reinterpret_cast<u64>(p.kv + b * p.kv_sb + min(copy_c, DCH - 1) * 8);
    const u64 kv_row_bytes = static_cast<u64>(p.kv_sp) * sizeof(bf16);
    auto load_tile = [&](int tile, int buf) {
        if constexpr (ROW_COPIES) {
            bf16* const dst = skv + (buf * BN + copy_j) * LDS + copy_c * 8;
#pragma unroll
            for (int i = 0; i < BN / ROW_STEP; ++i) {
                const int j = copy_j + i * ROW_STEP;
                const int key = GATHER ? sval[buf * BN + j] : tile * BN + j;  // gather: published by the caller
                const bool load = copy_c_ok && (GATHER ? key >= 0 : key < n_keys);
                const u64 src = kv_chunk + static_cast<u64>(load ? static_cast<u32>(key) : 0u) * kv_row_bytes;
                cp_async16(dst + i * ROW_STEP * LDS, reinterpret_cast<const void*>(src), load);
            }
        } else {
            for (int e = tid; e < BN * DCH_PAD; e += NTHREADS) {
                const int c = e % DCH_PAD, j = e / DCH_PAD;
                i64 key;
                bool valid;
                if (GATHER) {
                    key = sval[buf * BN + j];  // published by the caller
                    valid = key >= 0;
                } else {
                    key = static_cast<i64>(tile) * BN + j;
                    valid = key < n_keys;
                }
                const bool load = valid && c < DCH;
                const bf16* src = load ? p.kv + b * p.kv_sb + key * p.kv_sp + c * 8 : p.kv;
                cp_async16(skv + (buf * BN + j) * LDS + c * 8, src, load);
            }
        }
    };

    const int qi = warp / KG;          // this warp's query within the CTA
    const int kg = warp % KG;          // this warp's slab of NT*8 keys within the tile
    const int g = lane >> 2, c4 = lane & 3;

    // This warp's query's row of scores (and, dense, its visible keys): lanes 0-3 write it.
    float* const out_row = FUSED ? srow + static_cast<i64>(qi) * p.P : p.out + b * p.out_sb + (s0 + qi - p.s_begin) * p.out_ss;
    const int out_vis = static_cast<int>(min(static_cast<i64>(p.P), visible_keys(static_cast<i64>(p.query_start) + s0 + qi, p.compress_ratio)));

    int next_key = -1;  // gather: slot tid of the tile after the one published next
    if (n_tiles > 0) {
        if (GATHER) {
            const int k0 = fetch_key(0);
            next_key = fetch_key(1);
            if (tid < BN) sval[tid] = k0;
            __syncthreads();
        }
        load_tile(0, 0);
        cp_async_commit();
    }
    for (int it = 0; it < n_tiles; ++it) {
        const int buf = it & 1;
        if (GATHER) {
            // sval / skv [buf^1] were last read in iteration it-1, which ended with a barrier.
            if (it + 1 < n_tiles) {
                if (tid < BN) sval[(buf ^ 1) * BN + tid] = next_key;
                next_key = fetch_key(it + 2);
            }
            cp_async_wait<0>();  // tile it (and the q rows)
            __syncthreads();     // ... for everyone; sval[buf^1] published
            if (it + 1 < n_tiles) {
                load_tile(it + 1, buf ^ 1);
                cp_async_commit();
            }
        } else {
            if (it + 1 < n_tiles) {
                load_tile(it + 1, buf ^ 1);
                cp_async_commit();
                cp_async_wait<1>();  // all but the tile just issued
            } else {
                cp_async_wait<0>();
            }
            __syncthreads();
        }

        // part[nt][j] = sum over this lane's heads of w[h] * relu(A[h] . kv[key])
        float part[NT][2];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) part[nt][0] = part[nt][1] = 0.0f;
        // Gather: a warp whose slots in this tile are all masked (past a short selection)
        // skips its products; part = 0 and the masked slots' -inf are written below.
        bool live = true;
        if (GATHER) {
            bool v = false;
            for (int j = lane; j < NT * 8; j += 32) v |= sval[buf * BN + kg * NT * 8 + j] >= 0;
            live = __any_sync(DSV4_FULL_MASK, v);
        }
        if (live) {
            // B fragments of this warp's keys, all k-steps: kv[key][k] is B^T, i.e. n-major.
            const bf16* kv_tile = skv + (buf * BN + kg * NT * 8) * LDS;
            u32 bfrag[KSTEPS][NT][2];
#pragma unroll
            for (int ks = 0; ks < KSTEPS; ++ks) {
                if (NT == 1) {
                    ldmatrix_x2(bfrag[ks][0], kv_tile + (lane & 7) * LDS + ks * 16 + ((lane >> 3) & 1) * 8);
                } else {
#pragma unroll
                    for (int nt = 0; nt + 1 < NT; nt += 2) {  // two n-tiles a load: lanes 16-31 address n-tile nt+1
                        u32 r[4];
                        ldmatrix_x4(r, kv_tile + (nt * 8 + (lane & 7) + ((lane >> 4) & 1) * 8) * LDS + ks * 16 + ((lane >> 3) & 1) * 8);
                        bfrag[ks][nt][0] = r[0];
                        bfrag[ks][nt][1] = r[1];
                        bfrag[ks][nt + 1][0] = r[2];
                        bfrag[ks][nt + 1][1] = r[3];
                    }
                }
            }

            const bf16* q_tile = sq + qi * HPAD * LDS;
#pragma unroll 1
            for (int mt = 0; mt < MT; ++mt) {
                float acc[NT][4];
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
#pragma unroll
                for (int ks = 0; ks < KSTEPS; ++ks) {
                    u32 a[4];
                    ldmatrix_x4(a, q_tile + (mt * 16 + (lane & 15)) * LDS + ks * 16 + (lane >> 4) * 8);
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt) mma_bf16_16816(acc[nt], a, bfrag[ks][nt]);  // acc = q_h . kv_key
                }
                const float w0 = sw[qi * HPAD + mt * 16 + g];
                const float w1 = sw[qi * HPAD + mt * 16 + g + 8];
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    part[nt][0] += w0 * fmaxf(acc[nt][0], 0.0f) + w1 * fmaxf(acc[nt][2], 0.0f);
                    part[nt][1] += w0 * fmaxf(acc[nt][1], 0.0f) + w1 * fmaxf(acc[nt][3], 0.0f);
                }
            }
            // Sum over the 8 row groups (lanes with equal lane % 4 hold the same columns).
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int j = 0; j < 2; ++j)
#pragma unroll
                    for (int o = 4; o < 32; o <<= 1) part[nt][j] += __shfl_xor_sync(DSV4_FULL_MASK, part[nt][j], o);
        }

        if (lane < 4 && qi < nq) {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const int col = kg * NT * 8 + nt * 8 + 2 * c4 + j;
                    const int n = it * BN + col;  // key (dense) or slot (gather)
                    if (GATHER) {
                        if (n < p.T) out_row[n] = sval[buf * BN + col] >= 0 ? p.scale * part[nt][j] : neg_inf;
                    } else {
                        if (n < out_vis) out_row[n] = p.scale * part[nt][j];
                        else if (n < p.P && !p.visible_only) out_row[n] = neg_inf;
                    }
                }
        }
        __syncthreads();  // the buffer is refilled by the next iteration
    }
    cp_async_wait<0>();

    if (FUSED) {
        // Each query's top-k from its row in shared memory (select_topk_row begins with a
        // barrier, which publishes the rows). Only the query's visible keys are read: the
        // rest of the row is -inf (never selected) and is neither written nor scanned,
        // which halves the selection passes on average over a causal sequence.
        for (int qi = 0; qi < nq; ++qi) {
            const float* row = srow + static_cast<i64>(qi) * p.P;
            const i64 o = b * p.out_sb + (s0 + qi - p.s_begin) * p.out_ss;
            const int vis = static_cast<int>(min(static_cast<i64>(p.P), visible_keys(static_cast<i64>(p.query_start) + s0 + qi, p.compress_ratio)));
            const auto key_at = [&](int i) { return score_key(row[i]); };
            select_topk_row<NTHREADS>(key_at, [&](int q) { return key_quad(key_at, vis, q); }, [&](int i) { return row[i]; }, vis, p.k, ssel, ssort, p.sort_cap, p.idx + o, p.out + o);
        }
    }
}
