// Lightning-indexer scores on Hopper tensor cores (wgmma), SPEC.md section 2:
//
//   score[b,s,p] = scale * sum_h w[b,s,h] * relu(<q[b,s,h,:], kv[b,p,:]>)   if p < (query_start+s+1)/r
//                = -inf                                                      otherwise
//
// dsv4-archs: sm_90a
//
// The dense scores of `indexer_scores` and of the chunked scores + top-k (the selection is
// topk.cu's; the gather mode of `indexer_topk_scores` stays on scores.cu). scores.cu
// (mma.sync + ldmatrix) is bound by shared-memory bandwidth (every warp re-reads its
// operand fragments); wgmma reads both operands from shared memory once per warpgroup
// instruction, 64 x N x 16 per issue.
//
// Orientation: D = A B with M = 64 pooled keys (A = the key tile kv[64][D], K-major) and
// N = BQ x HPAD = (4 queries) x (heads, padded to 16/32/64) (B = a warpgroup's q rows,
// K-major, row n = query n / HPAD, head n % HPAD). A thread's accumulator columns are heads
// of the same queries for two keys (rows r and r+8, r = 16 * warp + lane / 4): the weighted
// relu and the head sum are register FMAs over its 2 * HPAD / 8 heads per query, then a
// reduce-scatter over the 4 lanes of a quad (6 shuffles) leaves lane c with query c's two
// scores. No cross-warp reduction at all.
//
// CTA (one an SM, one block of 2 BQ queries of a batch row): two consumer warpgroups
// (warps 0-7: wgmma + epilogue), each with its own block of BQ queries (its own sq and sw),
// sharing one key ring of ST stages filled by a producer warp (warp 8): a key tile is read
// once for 2 BQ queries. The warpgroups take turns on the tensor cores (ping-pong):
// warpgroup 1 issues tile t's products once warpgroup 0's are done (named barrier
// BAR_PP_DONE), warpgroup 0 issues tile t + 1's once warpgroup 1's tile t products are
// issued (BAR_PP_ISSUED), so each warpgroup's epilogue runs under the other's products.
// The consumers load their q rows while the producer already fills the ring, and first
// prefetch into L2 the q rows of the block the next CTA on this SM most likely takes (this
// block + the number of SMs: CTAs start in blockIdx order).
//
// Operands are stored in the 128-byte swizzle of hopper.cuh (SW128): the head dim splits
// into groups of 64 (DG groups), a group is rows of 128 bytes, 16-byte chunk j of row r at
// chunk j ^ (r % 8). k16 step ks reads group ks / 4 at +32 bytes per step (ks % 4).
//
// The key ring, full/empty mbarriers per stage; the consumers release a stage after their
// wgmma group has completed (wgmma.wait_group 0). Two ways to fill it (IDX90_TMA):
// - TMA (1): one lane of the producer warp, per tile: wait for the stage to be free
//   (empty), arm its full barrier with the bytes to come (mbarrier.arrive.expect_tx; full is
//   initialised with count 1), and issue DG box loads (64 keys x 64 head-dim columns,
//   128-byte swizzle: the box lands as one SW128 group of the stage), each completing its
//   bytes on full. It waits only for free stages: all ST stages can be in flight; TMA writes
//   through the async proxy that wgmma reads, ordered by the barrier (no proxy fence). The
//   tensor map is kv as a [B][P][D] bf16 tensor (src/indexer/scores.rs,
//   `sm90_kv_tensor_map`): columns >= D and rows >= P of a box are zero-filled (the tail of
//   the last group, read by the k loop up to round_up(D, 16), and the part of the last tile
//   past P) and still count in the transaction bytes, so every stage expects the whole
//   SKV_STAGE. Rows in [n_keys, P) of the last tile hold real keys; their scores are
//   computed but never stored (store_tile).
// - cp.async (0; the launcher's choice where kv cannot be mapped: not 16-byte aligned, or
//   byte strides not multiples of 16): the producer warp's 32 lanes copy every 16-byte
//   chunk of a tile (rows past the visible keys: zeros); cp.async copies are generic-proxy
//   writes, so the producer waits for its own copies (cp.async.wait_group), fences them to
//   the async proxy (fence.proxy.async), then arrives on the stage's full barrier, LAG
//   tiles behind the copies it issues (LAG + 1 tiles in flight).
//
// Each query's row of P scores goes to `out`: its visible keys, and -inf at the others
// (past the last computed tile too) unless `visible_only` (the caller reads the visible
// prefix only).
//
// Defines: IDX_H heads (<= 64), IDX_D head dim (<= 128; rows are zero-padded to a group of
// 64 and the k loop stops at round_up(D, 16)), IDX90_STAGES ring stages (3..8), IDX90_TMA
// (above). The host (src/indexer/config.rs) mirrors the shared-memory size.
#include "indexer/params.cuh"
#include "indexer/mma.cuh"
#include "hopper.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

namespace {

using namespace dsv4;
using namespace dsv4::indexer;
using namespace dsv4::hopper;

constexpr int H = IDX_H;
constexpr int D = IDX_D;
static_assert(H >= 1 && H <= 64, "scores_sm90: H <= 64 (N = 4 queries x padded heads <= 256)");
static_assert(D >= 1 && D <= 128, "scores_sm90: D <= 128 (two SW128 groups)");

constexpr int HPAD = H <= 16 ? 16 : H <= 32 ? 32 : 64;  // heads padded: N = 64, 128 or 256
constexpr int BQ = 4;                                     // queries per warpgroup = lanes of a quad
constexpr int NROWS = BQ * HPAD;                          // wgmma N: q rows of a warpgroup
constexpr int JQ = HPAD / 8;                              // 8-column accumulator blocks per query
constexpr int NACC = NROWS / 2;                           // accumulator registers a thread
constexpr int BM = 64;                                    // pooled keys per tile (wgmma M)
constexpr int DG = (D + 63) / 64;                         // SW128 groups of 64 along the head dim
constexpr int DCH = (D + 7) / 8;                          // 16-byte chunks of a global row
constexpr int DCHP = DG * 8;                              // 16-byte chunks of a stored row (tail zero)
constexpr int KSTEPS = (D + 15) / 16;                     // wgmma k16 steps
constexpr int NWG = 2;                                    // consumer warpgroups
constexpr int BQ_CTA = NWG * BQ;                          // queries per CTA
constexpr int ST = IDX90_STAGES;                          // key-tile ring stages
// The cp.async producer publishes tile t - LAG after issuing tile t, which waits for tile
// t - ST to be consumed: LAG <= ST - 1 avoids a deadlock, LAG <= ST - 2 keeps a tile of
// slack (else tile c is published only once tile c - 1 is consumed: a bubble each tile).
constexpr int LAG = ST >= 3 ? ST - 2 : 1;
constexpr int NCONS = 128;                                // threads of a consumer warpgroup
constexpr int NCONS_ALL = NWG * NCONS;                    // all consumer threads
constexpr int NTHREADS = NCONS_ALL + 32;                  // + producer warp
constexpr int BAR_PP_DONE = 3, BAR_PP_ISSUED = 4;          // named barriers (1, 2: the q loads)
constexpr bool TMA = IDX90_TMA != 0;                       // the key ring by TMA

// Shared memory (bytes from the 1024-aligned base), mirrored by `sm90_smem_bytes` in
// src/indexer/config.rs (which adds 1024 for the alignment of the base):
//   sq [NWG][DG][NROWS][128 B] | skv [ST][DG][BM][128 B] | sw [NWG][NROWS] f32 |
//   full[ST], empty[ST] u64 (BAR_BYTES: 64, 128 for more than 4 stages)
constexpr int SQ_GROUP = NROWS * 128;
constexpr int SQ_BYTES = DG * SQ_GROUP;
constexpr int SKV_GROUP = BM * 128;
constexpr int SKV_STAGE = DG * SKV_GROUP;
constexpr int OFF_KV = NWG * SQ_BYTES;
constexpr int OFF_W = OFF_KV + ST * SKV_STAGE;
constexpr int OFF_BAR = OFF_W + NWG * NROWS * 4;
static_assert(SQ_GROUP % 1024 == 0 && SKV_GROUP % 1024 == 0, "SW128 tiles must stay 1024-byte aligned");
static_assert(OFF_BAR % 8 == 0 && ST >= 3 && ST <= 8, "barrier block");
// A TMA box (64 keys x 64 bf16 columns) is one SW128 group of the stage; the swizzle
// pattern of a 128-byte box row is sw128 (16-byte chunk j of row r at j ^ (r % 8)).
static_assert(SKV_GROUP == BM * 64 * 2, "one TMA box per SW128 group of a key tile");

// acc (64 keys x N q rows) (+)= A B for one k16 step (a template so that only the
// instruction of this N is instantiated).
template <int N>
__device__ __forceinline__ void wgmma_tile(float (&acc)[N / 2], u64 desc_a, u64 desc_b, int scale_d) {
    if constexpr (N == 256) {
        wgmma_m64n256k16_ss<0>(acc, desc_a, desc_b, scale_d);
    } else if constexpr (N == 128) {
        wgmma_m64n128k16_ss<0>(acc, desc_a, desc_b, scale_d);
    } else {
        wgmma_m64n64k16_ss<0>(acc, desc_a, desc_b, scale_d);
    }
}

// acc (64 keys x NROWS q rows) = the key tile at a_base (SW128, K-major) times the q rows
// at b_base (the warpgroup's sq), over the head dim: KSTEPS wgmma k16 steps.
__device__ __forceinline__ void tile_product(float (&acc)[NACC], u32 a_base, u32 b_base) {
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) {
        const u32 koff = (ks % 4) * 32;  // +32 bytes per k16 step inside a group
        u32 a_lo = a_base + (ks / 4) * SKV_GROUP + koff, b_lo = b_base + (ks / 4) * SQ_GROUP + koff;
        asm volatile("" : "+r"(a_lo), "+r"(b_lo));  // recomputed per tile, not kept live across it
        const u64 da = sw128_desc(a_lo, 16, 1024);
        const u64 db = sw128_desc(b_lo, 16, 1024);
        wgmma_tile<NROWS>(acc, da, db, ks > 0 ? 1 : 0);  // acc = kv . q over the head dim
    }
}

// lo / hi[i] = sum over this lane's heads of w[i][h] * relu(acc[key r | r+8][i, h]) for the
// BQ queries (accumulator columns 8j + 2c4, +1 of query j / JQ: heads 8 (j % JQ) + 2c4, +1).
__device__ __forceinline__ void head_sums(const float (&acc)[NACC], const float* sw, int c4, float (&lo)[BQ], float (&hi)[BQ]) {
#pragma unroll
    for (int i = 0; i < BQ; ++i) {
        lo[i] = 0.0f;
        hi[i] = 0.0f;
#pragma unroll
        for (int jj = 0; jj < JQ; ++jj) {
            const int j = i * JQ + jj;
            const float2 wv = *reinterpret_cast<const float2*>(sw + i * HPAD + 8 * jj + 2 * c4);
            lo[i] = fmaf(wv.x, fmaxf(acc[4 * j + 0], 0.0f), lo[i]);
            lo[i] = fmaf(wv.y, fmaxf(acc[4 * j + 1], 0.0f), lo[i]);
            hi[i] = fmaf(wv.x, fmaxf(acc[4 * j + 2], 0.0f), hi[i]);
            hi[i] = fmaf(wv.y, fmaxf(acc[4 * j + 3], 0.0f), hi[i]);
        }
    }
}

}  // namespace

// One CTA an SM (9 warps; ptxas caps them at 168 registers a thread, 128 of them the
// accumulators at N = 256). kv_map: the TMA tensor map of kv (IDX90_TMA); always passed
// (zeros when unused), so the signature does not depend on the define.
extern "C" __global__ void __launch_bounds__(NTHREADS, 1) indexer_scores_sm90(const IndexerScoresParams p, const __grid_constant__ TmaDesc kv_map) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    // SW128 tiles need a 1024-byte aligned base (the swizzle is on address bits 4-9).
    const u32 raw_addr = smem_u32(smem_raw);
    unsigned char* smem = smem_raw + (((raw_addr + 1023u) & ~1023u) - raw_addr);
    const u32 sq_addr = smem_u32(smem);
    const u32 skv_addr = sq_addr + OFF_KV;
    float* sw_all = reinterpret_cast<float*>(smem + OFF_W);  // [NWG][BQ][HPAD] weights, 0 for padding
    u64* full = reinterpret_cast<u64*>(smem + OFF_BAR);  // [ST]: the producer's 32 lanes arrive (TMA: lane 0 + the bytes)
    u64* empty = full + ST;                              // [ST]: every consumer thread arrives

    const int tid = threadIdx.x;
    const int warp = tid >> 5, lane = tid & 31;
    const float neg_inf = -__int_as_float(0x7f800000);
    // A consumer's warpgroup, its thread and warp index within it, its q block and weights.
    const int wg = warp / 4;
    const int wtid = tid - wg * NCONS, wwarp = warp - wg * 4;
    const u32 sq_wg = sq_addr + wg * SQ_BYTES;
    float* sw = sw_all + wg * NROWS;

    if (tid == 0) {
        for (int s = 0; s < ST; ++s) {
            mbar_init(&full[s], TMA ? 1 : 32);
            mbar_init(&empty[s], NCONS_ALL);
        }
        if constexpr (TMA) tma::fence_barrier_init();  // the TMA unit completes bytes on full
    }
    if constexpr (TMA) {
        if (tid == NCONS_ALL) tma::prefetch_desc(kv_map);  // the producer lane's first load
    }
    // (published by the barrier below)

    // The work item: (batch row, query block of BQ_CTA), heaviest (last) blocks first so
    // that the grid ends on light items.
    const int n_blk = (p.s_count + BQ_CTA - 1) / BQ_CTA;
    const i64 n_items = static_cast<i64>(n_blk) * p.B;
    const u32 tiles_done = 0;  // ring phases start fresh (one item a CTA)

    for (i64 item = blockIdx.x; item < n_items; item += gridDim.x) {
        const i64 b = item % p.B;
        const int blk = n_blk - 1 - static_cast<int>(item / p.B);
        const i64 s0_cta = static_cast<i64>(p.s_begin) + static_cast<i64>(blk) * BQ_CTA;  // first query
        const int nq_cta = static_cast<int>(min(static_cast<i64>(BQ_CTA), static_cast<i64>(p.s_begin) + p.s_count - s0_cta));
        // This thread's warpgroup's queries (none for the second of a last, short block).
        const i64 s0 = s0_cta + wg * BQ;
        const int nq = max(0, min(BQ, nq_cta - wg * BQ));
        // Keys visible to the CTA's last query: the tiles this block computes.
        const i64 n_keys = min(static_cast<i64>(p.P), visible_keys(static_cast<i64>(p.query_start) + s0_cta + nq_cta - 1, p.compress_ratio));
        const int n_tiles = static_cast<int>((n_keys + BM - 1) / BM);

        __syncthreads();  // the barriers are initialised

        // ---- q rows of the block -> sq (SW128, zero rows for padded heads / missing
        //      queries, zero tail chunks), weights -> sw: by the consumers while the
        //      producer warp already fills the key ring, then a named barrier per
        //      warpgroup. -----------------------------------------------------------------
        if (warp < NCONS_ALL / 32) {
            for (int e = wtid; e < NROWS * DCHP; e += NCONS) {
                const int c = e % DCHP, row = e / DCHP;
                const int qi = row / HPAD, h = row % HPAD;
                const bool valid = qi < nq && h < H && c < DCH;
                const bf16* src = valid ? p.q + b * p.q_sb + (s0 + qi) * p.q_ss + h * p.q_sh + c * 8 : p.q;
                cp_async16_to(sq_wg + (c / 8) * SQ_GROUP + sw128(row, c % 8), src, valid);
            }
            cp_async_commit();
            for (int e = wtid; e < NROWS; e += NCONS) {
                const int qi = e / HPAD, h = e % HPAD;
                sw[e] = (qi < nq && h < H) ? p.w[b * p.w_sb + (s0 + qi) * p.w_ss + h * p.w_sh] : 0.0f;
            }
            // The q rows of the block the next CTA on this SM most likely takes, into L2.
            {
                u32 n_sm;
                asm("mov.u32 %0, %%nsmid;\n" : "=r"(n_sm));
                const i64 next = item + n_sm;  // one item a CTA, items in blockIdx order
                if (next < n_items) {
                    const i64 nb = next % p.B;
                    const i64 ns0 = static_cast<i64>(p.s_begin) + static_cast<i64>(n_blk - 1 - static_cast<int>(next / p.B)) * BQ_CTA + wg * BQ;
                    const int nnq = static_cast<int>(max(static_cast<i64>(0), min(static_cast<i64>(BQ), static_cast<i64>(p.s_begin) + p.s_count - ns0)));
                    constexpr int LINES = (D * 2 + 127) / 128;  // 128-byte lines of a q row
                    for (int e = wtid; e < nnq * H * LINES; e += NCONS) {
                        const int line = e % LINES, row = e / LINES;
                        const bf16* src = p.q + nb * p.q_sb + (ns0 + row / H) * p.q_ss + (row % H) * p.q_sh + line * 64;
                        asm volatile("prefetch.global.L2 [%0];\n" ::"l"(src));
                    }
                }
            }
            cp_async_wait<0>();
            fence_proxy_async();  // this thread's q copies, visible to wgmma (async proxy)
            named_sync(1 + wg, NCONS);  // the warpgroup's q copies and weights
        }

        if (TMA && warp == NCONS_ALL / 32) {
            // ---- producer warp, TMA: key tiles by TMA, lane 0 alone ----------------------
            // Box g of tile t: columns [64 g, 64 g + 64) of keys [t*BM, t*BM + BM) of batch
            // row b, into SW128 group g of the stage. The full barrier expects the whole
            // stage (out-of-bounds parts of a box count: see tma.cuh).
            if (lane == 0) {
                for (int t = 0; t < n_tiles; ++t) {
                    const u32 g = tiles_done + t;
                    const int st = static_cast<int>(g % ST);
                    mbar_wait(&empty[st], ((g / ST) & 1u) ^ 1u);  // stage free (fresh barrier: passes)
                    const u32 bar = smem_u32(&full[st]);
                    tma::arrive_expect_tx(bar, SKV_STAGE);
#pragma unroll
                    for (int dg = 0; dg < DG; ++dg) {
                        tma::load_3d(skv_addr + st * SKV_STAGE + dg * SKV_GROUP, kv_map, 64 * dg, t * BM, static_cast<int>(b), bar);
                    }
                }
            }
        } else if (warp == NCONS_ALL / 32) {
            // ---- producer warp, cp.async: key tiles [t*BM, t*BM + BM) into the ring -------
            // Lane l copies 16-byte chunk c = l % DCHP of rows l / DCHP + (32 / DCHP) i; the
            // row-independent address arithmetic once.
            constexpr int RSTEP = 32 / DCHP;
            static_assert(32 % DCHP == 0 && BM % RSTEP == 0, "a lane copies one chunk of whole rows");
            const int c = lane % DCHP, r0 = lane / DCHP;
            const bool c_ok = DCH == DCHP || c < DCH;
            const u64 kv_chunk = reinterpret_cast<u64>(p.kv + b * p.kv_sb + min(c, DCH - 1) * 8);  // key 0's chunk
            const u64 row_bytes = static_cast<u64>(p.kv_sp) * sizeof(bf16);
            for (int t = 0; t < n_tiles; ++t) {
                const u32 g = tiles_done + t;
                const int st = static_cast<int>(g % ST);
                mbar_wait(&empty[st], ((g / ST) & 1u) ^ 1u);  // stage free (fresh barrier: passes)
                const u32 dst = skv_addr + st * SKV_STAGE + (c / 8) * SKV_GROUP;
                const int rows = static_cast<int>(min(static_cast<i64>(BM), n_keys - static_cast<i64>(t) * BM));  // rows past the visible keys: zeros
                const u64 tile_src = kv_chunk + static_cast<u64>(t) * BM * row_bytes;  // key t*BM < n_keys: mapped
#pragma unroll 8
                for (int i = 0; i < BM / RSTEP; ++i) {
                    const int row = r0 + RSTEP * i;
                    const bool valid = c_ok && row < rows;
                    const u64 src = tile_src + static_cast<u64>(valid ? row : 0) * row_bytes;
                    cp_async16_to(dst + sw128(row, c % 8), reinterpret_cast<const void*>(src), valid);
                }
                cp_async_commit();
                if (t >= LAG) {  // tile t - LAG has landed: publish it
                    cp_async_wait<LAG>();
                    fence_proxy_async();
                    mbar_arrive(&full[(g - LAG) % ST]);
                }
            }
            if (n_tiles > 0) {  // the last LAG tiles (fewer when the block has fewer)
                cp_async_wait<0>();
                fence_proxy_async();
#pragma unroll
                for (int k = LAG; k >= 1; --k) {
                    if (n_tiles - k >= 0) mbar_arrive(&full[(tiles_done + n_tiles - k) % ST]);
                }
            }
        } else if (warp < NCONS_ALL / 32) {
            // ---- consumer warpgroup: acc[key][q row] = kv_tile q^T, then the epilogue ----
            const int g8 = lane >> 2, c4 = lane & 3;
            const int r = 16 * wwarp + g8;  // this thread's keys in the tile: r and r + 8
            // Query c4 of the block: its output row and visible keys (lane c4 writes it).
            const bool q_live = c4 < nq;
            const i64 sq_pos = s0 + c4;
            const i64 vis = q_live ? min(static_cast<i64>(p.P), visible_keys(static_cast<i64>(p.query_start) + sq_pos, p.compress_ratio)) : 0;
            float* out_row = !q_live ? nullptr : p.out + b * p.out_sb + (sq_pos - p.s_begin) * p.out_ss;
            // Reduce-scatter over the quad (lane c4 ends with query c4's sums), then lane c4
            // stores query c4's scores of keys r and r + 8 of tile t.
            auto store_tile = [&](int t, const float (&lo)[BQ], const float (&hi)[BQ]) {
                // Step 1 (lanes c4 ^ 2): keep queries {2*b1, 2*b1+1}, send the other two.
                const bool b1 = (c4 & 2) != 0, b0 = (c4 & 1) != 0;
                float u_lo[2], u_hi[2];
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    const float send_lo = b1 ? lo[i] : lo[2 + i], keep_lo = b1 ? lo[2 + i] : lo[i];
                    const float send_hi = b1 ? hi[i] : hi[2 + i], keep_hi = b1 ? hi[2 + i] : hi[i];
                    u_lo[i] = keep_lo + __shfl_xor_sync(DSV4_FULL_MASK, send_lo, 2);
                    u_hi[i] = keep_hi + __shfl_xor_sync(DSV4_FULL_MASK, send_hi, 2);
                }
                // Step 2 (lanes c4 ^ 1): keep query 2*b1 + b0.
                const float s_lo = (b0 ? u_lo[1] : u_lo[0]) + __shfl_xor_sync(DSV4_FULL_MASK, b0 ? u_lo[0] : u_lo[1], 1);
                const float s_hi = (b0 ? u_hi[1] : u_hi[0]) + __shfl_xor_sync(DSV4_FULL_MASK, b0 ? u_hi[0] : u_hi[1], 1);

                if (q_live) {
                    // Keys >= vis (<= n_keys) are never stored as scores: the rows of the
                    // last tile past n_keys (zeros with cp.async, real keys with TMA) only
                    // ever reach the -inf / nothing branches.
                    const i64 key_lo = static_cast<i64>(t) * BM + r, key_hi = key_lo + 8;
                    // Every key of a computed tile below P (-inf when invisible), or only
                    // the visible keys (visible_only).
                    if (key_lo < vis) out_row[key_lo] = p.scale * s_lo;
                    else if (!p.visible_only && key_lo < p.P) out_row[key_lo] = neg_inf;
                    if (key_hi < vis) out_row[key_hi] = p.scale * s_hi;
                    else if (!p.visible_only && key_hi < p.P) out_row[key_hi] = neg_inf;
                }
            };
            float acc[NACC];
#pragma unroll
            for (int i = 0; i < NACC; ++i) acc[i] = 0.0f;
            for (int t = 0; t < n_tiles; ++t) {
                const u32 g = tiles_done + t;
                const int st = static_cast<int>(g % ST);
                mbar_wait(&full[st], (g / ST) & 1u);
                const u32 a_base = skv_addr + st * SKV_STAGE;
                __syncwarp();
                // Wait for the turn (ping-pong, above).
                if (wg == 1) {
                    named_sync(BAR_PP_DONE, 2 * NCONS);  // warpgroup 0's tile t is done
                } else if (t > 0) {
                    named_sync(BAR_PP_ISSUED, 2 * NCONS);  // warpgroup 1's tile t - 1 is issued
                }
                wgmma_fence();
                tile_product(acc, a_base, sq_wg);
                wgmma_commit();
                if (wg == 1 && t + 1 < n_tiles) named_arrive(BAR_PP_ISSUED, 2 * NCONS);
                wgmma_wait<0>();
                if (wg == 0) named_arrive(BAR_PP_DONE, 2 * NCONS);
                fence_regs(acc);
                mbar_arrive(&empty[st]);  // this thread's part of the stage is read

                float lo[BQ], hi[BQ];
                head_sums(acc, sw, c4, lo, hi);
                store_tile(t, lo, hi);
            }
            if (!p.visible_only) {
                // -inf past the last computed tile, after the products (off the block's
                // critical path at its start).
                for (int qi = 0; qi < nq; ++qi) {
                    float* row = p.out + b * p.out_sb + (s0 + qi - p.s_begin) * p.out_ss;
                    for (i64 key = static_cast<i64>(n_tiles) * BM + wtid; key < p.P; key += NCONS) row[key] = neg_inf;
                }
            }
        }
        break;  // one item a CTA (the grid has one CTA per item; the loop state is not kept live)
    }
}
