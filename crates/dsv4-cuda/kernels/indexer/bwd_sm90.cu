// Backward of `indexer_topk_scores` (SPEC.md section 3), Hopper path (sm_90a, wgmma), atomic
// mode. For every slot t of query (b,s) whose index p is valid and visible and whose
// gradient g_t is nonzero, with a_h = <q[b,s,h], kv[b,p]> and G[h,t] = g_t*scale*w[b,s,h]*[a_h > 0]:
//
//   dw[b,s,h]  += g_t * scale * relu(a_h)
//   dq[b,s,h]  += G[h,t] * kv[b,p]
//   dkv[b,p]   += sum_h G[h,t] * q[b,s,h]          (f32 vector reductions into [B,P,D])
//
// Per query and tile of 64 slots (the maths and skip rules of bwd_mma.cu, read its header):
//   A    = q kv^T        [64 heads x 64 slots], K = D    m64n64k16 SS  (both K-major)
//   G, dw from A in registers (G rounded to bf16: the A operand of the next two products)
//   dq  += G kv          [64 heads x D],        K = 64   m64nDk16 RS   (kv N-major; D = 64 DG)
//   dkv_tile = G^T q     [64 slots x D],        K = H    m64n64k16 SS per 64 columns
//                                                        (G^T K-major, q N-major)
// dkv_tile goes to global memory from the accumulators (shuffles within a quad so that each
// lane holds 4 columns of one slot row, a warp's reduction covering 8 slot rows x 64 B: one
// red.global.add.v4.f32 each); dq (bf16) and dw
// of a query are written once, from the registers. Every wgmma form here is one the
// attention kernels use and hopper_probe.cu checks: S = Q K^T (A), dq += dS K (dq, A from
// the accumulator layout), dKV = dS^T Q with dS^T stored by stmatrix .trans (dkv_tile).
//
// dsv4-archs: sm_90a
//
// CTA: a persistent grid (at most one CTA per SM); CTA x takes the query rows x, x + G,
// x + 2G, ... (G = gridDim.x; rows of all batches, row = b * S + s), alternately to its two
// consumers: consumer c's k-th row is x + (2k + c) G. Three warpgroups:
//   WG 0, producer, two halves of 64 threads, half c feeding consumer c:
//        per row, the q tile [64 heads x D] (zero rows past H, zero columns past D) into one
//        of two SW128 q buffers, loaded as soon as the row before last frees its buffer;
//        per 64-slot tile, each thread validates one slot (key in [0, visible), g != 0, else
//        key -1, g*scale 0 so that a masked gradient, even inf or NaN, never enters a sum;
//        the next tile's key and g are fetched while this one is stored and copied), stores
//        key and g*scale to the stage's slot table, then the half copies the 64 kv rows with
//        cp.async into the ring stage (a row = DG*8 consecutive threads, coalesced; masked
//        rows zero-filled: a zero kv row makes A = 0, G = 0 and never a NaN from stale data).
//   WG 1, WG 2, consumers c = 0, 1, independent of each other (each its own rows, ring, q
//        buffers, G^T buffers; they share only the tensor cores, so that one's G, barrier
//        and flush work overlaps the other's products: no wgmma is in flight across a
//        tile, which is also what ptxas pipelines without serialising). Per tile n
//        (ring stage n % NST):
//          wait ready + keys; a tile whose slots are all masked is skipped (no products)
//          A_n = q kv_n^T; wait
//          G, dw in registers; issue dq += G kv_n (RS)
//          G^T -> smem (stmatrix .trans, buffer n % 2), proxy fence, named barrier
//          per 64 columns dc: issue dkv_n[:, dc] = G^T q[:, dc]; (dc = 0: wait for dq, free
//          stage n); wait; flush to dkv[key] (red.global.add.v4.f32)
//        After a row's last tile its q buffer is freed and dq (bf16) and dw are stored.
// Barriers (per consumer): qready[2] (q copies, 64 async arrivals), qfree[2] (128),
// ready[NST] (kv copies, 64 async arrivals: cp.async.mbarrier.arrive.noinc, one per
// producer thread and phase), keys[NST] (the slot table's plain stores, 64 arrivals),
// free[NST] (128). Named barriers: 1 + c (consumer c: its G^T tile written), 3 + c
// (producer half c: its slot table stored, before the row copies read it).
//
// Shared memory (bytes from the 1024-aligned base; D = 128: 195 KiB + 1 KiB alignment slack,
// one CTA per SM): per consumer
// q [2][DG][64][128 B] | kv ring [NST][DG][64][128 B] | G^T [2][64][128 B], then the slot
// tables key [2][NST][64] i32, g*scale [2][NST][64] f32, and the mbarriers. Mirrored by
// `bwd_sm90_smem_bytes` in src/indexer/config.rs.
//
// Defines: IDX_H heads <= 64 (the wgmma M; q rows past H are zero), IDX_D head dim <= 128,
// a multiple of 8 (one or two SW128 groups, zero columns past D; dkv reductions of 4
// columns stay inside a row). Deterministic mode stays on bwd_mma.cu (two consumers and
// many CTAs add into the same dkv rows in a schedule-dependent order).
#include "indexer/params.cuh"
#include "indexer/mma.cuh"
#include "hopper.cuh"
#include "wgmma.cuh"

namespace {

using namespace dsv4;
using namespace dsv4::indexer;
using namespace dsv4::hopper;

constexpr int H = IDX_H;
constexpr int D = IDX_D;
static_assert(H >= 1 && H <= 64, "bwd_sm90: H <= 64 (the wgmma M is 64 heads)");
static_assert(D >= 8 && D <= 128 && D % 8 == 0, "bwd_sm90: D <= 128, a multiple of 8");

constexpr int DG = (D + 63) / 64;     // SW128 groups along the head dim
constexpr int DN = 64 * DG;           // N of the dq and dkv products
constexpr int DCH = D / 8;            // 16-byte chunks of a global row
constexpr int CPR = 8 * DG;           // 16-byte chunks of a stored row (zero past DCH)
constexpr int KS_A = (D + 15) / 16;   // k16 steps of A = q kv^T (over D)
// k16 steps of dkv = G^T q over the heads (at least 2: with a single, non-accumulating step
// ptxas serialises the products at some shapes, e.g. H = 16, D = 120; the second step adds
// zero rows: G^T and q are zero past H).
constexpr int KS_H = (H + 15) / 16 < 2 ? 2 : (H + 15) / 16;
constexpr int BN = 64;                // slots per tile (the N of A, the M of dkv)
constexpr int NST = 3;                // ring stages per consumer
constexpr int NCONS = 2;              // consumer warpgroups
constexpr int NTHREADS = 128 * (1 + NCONS);
constexpr int HALF = 64;              // producer threads per consumer
static_assert(HALF % (8 * DG) == 0, "a producer half copies whole rows of a tile");
constexpr int GROUP = 64 * 128;       // one SW128 group of a 64-row tile
constexpr int TILE = DG * GROUP;      // a q tile or a kv stage
constexpr int GT_BYTES = 64 * 128;    // G^T [64 slots][64 heads] bf16, one SW128 group
static_assert(HALF == BN, "producer thread i of a half validates slot i of a tile");

// Per-consumer region, then the slot tables and barriers of both.
constexpr int C_Q = 0;
constexpr int C_KV = C_Q + 2 * TILE;
constexpr int C_GT = C_KV + NST * TILE;
constexpr int C_BYTES = C_GT + 2 * GT_BYTES;
constexpr int OFF_KEYS = NCONS * C_BYTES;
constexpr int OFF_GS = OFF_KEYS + NCONS * NST * BN * 4;
constexpr int OFF_BAR = OFF_GS + NCONS * NST * BN * 4;
constexpr int B_QREADY = 0, B_QFREE = 2, B_READY = 4, B_KEYS = 4 + NST, B_FREE = 4 + 2 * NST;
constexpr int NBAR = 4 + 3 * NST;  // per consumer
constexpr int BYTES = OFF_BAR + NCONS * NBAR * 8;
static_assert(C_BYTES % 1024 == 0 && TILE % 1024 == 0, "SW128 tiles stay 1024-byte aligned");
static_assert(OFF_BAR % 8 == 0, "mbarriers are 8-byte aligned");

// Registers after setmaxnreg, within the 384 x 168 the launch reserves: 128 x 88 + 256 x 208.
// The producer spills below ~72 (its slot prefetch and row addresses); the consumers need
// ~170 (dq 64, dkv chunk 32, A 32, G fragments 16, addresses).
constexpr int PRODUCER_REGS = 88;
constexpr int CONSUMER_REGS = 208;
static_assert(128 * PRODUCER_REGS + 256 * CONSUMER_REGS <= NTHREADS * 168, "register pool of the CTA");

}  // namespace

// Dynamic shared memory the launcher passes: the layout plus alignment slack.
constexpr int kIdx90BwdSmemBytes = BYTES + 1024;
static_assert(kIdx90BwdSmemBytes <= 232448, "fits the opt-in shared memory of an H100/H200");
static_assert(D != 128 || kIdx90BwdSmemBytes == 200912, "mirrored by bwd_sm90_smem_bytes in src/indexer/config.rs");

namespace {

// dst[0..4] += v: one 16-byte f32 vector reduction (dst 16-byte aligned); each element's
// add is atomic on its own, no ordering implied.
__device__ __forceinline__ void red_add_v4(float* dst, float x, float y, float z, float w) {
    asm volatile("red.relaxed.gpu.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(dst), "f"(x), "f"(y), "f"(z), "f"(w) : "memory");
}

// Four 8x8 bf16 matrices from the mma fragment layout (register i: matrix i, thread t holds
// row t / 4, columns 2 (t % 4), +1) stored transposed: element (row, col) goes to row `col`
// of the stored matrix, position `row`. Lane l gives the address of stored row l % 8 of
// matrix l / 8 (16 bytes).
__device__ __forceinline__ void stsm_x4_trans(u32 addr, u32 r0, u32 r1, u32 r2, u32 r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}

// acc [64 x N] += A (registers) B (N-major descriptor): the dq product (N = DN; a template
// so that only the instruction of this N is instantiated).
template <int N>
__device__ __forceinline__ void wgmma_dn_rs(float (&d)[N / 2], const u32 (&a)[4], u64 desc_b) {
    if constexpr (N == 128) {
        wgmma_m64n128k16_rs<1>(d, a, desc_b, 1);
    } else {
        wgmma_m64n64k16_rs<1>(d, a, desc_b, 1);
    }
}

}  // namespace

extern "C" __global__ void __launch_bounds__(NTHREADS, 1) indexer_bwd_sm90(const IndexerBwdSm90Params p) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    if (p.smem_bytes < kIdx90BwdSmemBytes) __trap();  // the launcher's layout disagrees with this one
    unsigned char* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
    const u32 base = smem_u32(smem);
    const int tid = threadIdx.x;
    const int wg = tid / 128;

    // Query rows (row = b * S + s < 2^31: the launcher checks B * S) and 32-bit arithmetic
    // on them: a 64-bit division is a call, which serialises the wgmma products around it.
    const int n_rows = p.B * p.S;
    const int n_tiles = (p.T + BN - 1) / BN;
    const int grid = static_cast<int>(gridDim.x), cta = static_cast<int>(blockIdx.x);
    // Rows of consumer c in this CTA: cta + (2k + c) * grid, k < rows_of(c).
    auto rows_of = [&](int c) -> int {
        const int first = cta + c * grid;
        return first < n_rows ? (n_rows - first + 2 * grid - 1) / (2 * grid) : 0;
    };
    auto row_of = [&](int c, int k) -> int { return cta + (2 * k + c) * grid; };

    if (tid < NCONS) {  // thread c initialises consumer c's barriers
        u64* bb = reinterpret_cast<u64*>(smem + OFF_BAR) + tid * NBAR;
        for (int i = 0; i < 2; ++i) {
            mbar_init(bb + B_QREADY + i, HALF);
            mbar_init(bb + B_QFREE + i, 128);
        }
        for (int i = 0; i < NST; ++i) {
            mbar_init(bb + B_READY + i, HALF);
            mbar_init(bb + B_KEYS + i, HALF);
            mbar_init(bb + B_FREE + i, 128);
        }
    }
    __syncthreads();

    if (wg == 0) {
        // ---------------- producer: half c feeds consumer c ----------------
        regs_dec<PRODUCER_REGS>();
        const int c = tid / HALF, ht = tid % HALF;
        u64* bb = reinterpret_cast<u64*>(smem + OFF_BAR) + c * NBAR;
        const u32 cbase = base + c * C_BYTES;
        int* keys_s = reinterpret_cast<int*>(smem + OFF_KEYS) + c * NST * BN;
        float* gs_s = reinterpret_cast<float*>(smem + OFF_GS) + c * NST * BN;
        const int nk = rows_of(c);
        if (nk == 0 || n_tiles == 0) return;

        // The q tile of row k of this consumer into buffer k % 2 (then one async arrival).
        auto load_q = [&](int k) {
            const int row = row_of(c, k);
            const int b = row / p.S;
            const bf16* src = p.q + b * p.q_sb + (row - b * p.S) * p.q_ss;
            const u32 dst = cbase + C_Q + (k & 1) * TILE;
#pragma unroll 4
            for (int i = 0; i < CPR; ++i) {
                const int id = ht + HALF * i, r = id / CPR, ch = id % CPR;
                const bool ok = r < H && ch < DCH;
                cp_async16_to(dst + (ch / 8) * GROUP + sw128(r, ch % 8), ok ? src + r * p.q_sh + ch * 8 : p.q, ok);
            }
            mbar_arrive_after_cp_async(bb + B_QREADY + (k & 1));
        };
        // Slot ht of tile t of row k: key (-1 unless in [0, P): the visibility test follows)
        // and gradient.
        auto fetch = [&](int k, int t, int& key, float& g) {
            const int row = row_of(c, k);
            const int b = row / p.S, s = row - b * p.S;
            const int slot = t * BN + ht;
            key = -1;
            g = 0.0f;
            if (slot < p.T) {
                const i64 raw = load_int(p.topk, b * p.t_sb + s * p.t_ss + slot * p.t_st, p.topk_is_i64);
                key = raw >= 0 && raw < p.P ? static_cast<int>(raw) : -1;
                g = p.grad[b * p.g_sb + s * p.g_ss + slot * p.g_st];
            }
        };

        load_q(0);
        int next_key;
        float next_g;
        fetch(0, 0, next_key, next_g);
#pragma unroll 1
        for (int k = 0; k < nk; ++k) {
            const int row = row_of(c, k);
            const int b = row / p.S;
            const int vis = static_cast<int>(min(static_cast<i64>(p.P), visible_keys(static_cast<i64>(p.query_start) + (row - b * p.S), p.compress_ratio)));
#pragma unroll 1
            for (int t = 0; t < n_tiles; ++t) {
                const int n = k * n_tiles + t, st = n % NST;
                const int raw_key = next_key;
                const float raw_g = next_g;
                // The next tile's slot, in flight while this one is stored and copied.
                if (t + 1 < n_tiles) fetch(k, t + 1, next_key, next_g);
                else if (k + 1 < nk) fetch(k + 1, 0, next_key, next_g);
                const bool valid = raw_key >= 0 && raw_key < vis && raw_g != 0.0f;

                if (n >= NST) mbar_wait(bb + B_FREE + st, ((n / NST) - 1) & 1);
                keys_s[st * BN + ht] = valid ? raw_key : -1;
                gs_s[st * BN + ht] = valid ? raw_g * p.scale : 0.0f;
                mbar_arrive(bb + B_KEYS + st);  // releases the slot table to the consumer
                named_sync(3 + c, HALF);        // ... and to this half's copies below
                // Thread ht copies chunk ch = ht % CPR of rows ht / CPR + (HALF / CPR) i; the
                // row-independent address arithmetic once (as scores.cu's gather copies).
                const int ch = ht % CPR, r0 = ht / CPR;
                const bool ch_ok = DCH == CPR || ch < DCH;
                const u32 dst = cbase + C_KV + st * TILE + (ch / 8) * GROUP;
                const u64 kv_chunk = reinterpret_cast<u64>(p.kv + b * p.kv_sb + min(ch, DCH - 1) * 8);  // + key * row bytes
                const u64 kv_row_bytes = static_cast<u64>(p.kv_sp) * sizeof(bf16);
#pragma unroll 4
                for (int i = 0; i < CPR; ++i) {
                    const int r = r0 + (HALF / CPR) * i;
                    const int kr = keys_s[st * BN + r];
                    const bool ok = ch_ok && kr >= 0;
                    const u64 src = kv_chunk + static_cast<u64>(ok ? static_cast<u32>(kr) : 0u) * kv_row_bytes;
                    cp_async16_to(dst + sw128(r, ch % 8), reinterpret_cast<const void*>(src), ok);
                }
                mbar_arrive_after_cp_async(bb + B_READY + st);
                // The next row's q, once its buffer is free (its previous user, row k - 1, is
                // released when the consumer has finished it): after this row's second tile,
                // so that the ring is full while the producer waits.
                if (t == min(1, n_tiles - 1) && k + 1 < nk) {
                    if (k + 1 >= 2) mbar_wait(bb + B_QFREE + ((k + 1) & 1), (((k + 1) >> 1) - 1) & 1);
                    load_q(k + 1);
                }
            }
        }
        asm volatile("cp.async.wait_all;\n" ::: "memory");
        return;
    }

    // ---------------- consumers ----------------
    regs_inc<CONSUMER_REGS>();
    const int c = wg - 1;
    const int ct = tid - 128 * wg;
    const int warp = ct / 32, lane = ct % 32;
    const int g8 = lane / 4, c4 = lane % 4;
    const int r0 = warp * 16 + g8, r1 = r0 + 8;  // this thread's heads (A, dq) and slots (dkv)
    const bool odd = (c4 & 1) != 0;
    u64* bb = reinterpret_cast<u64*>(smem + OFF_BAR) + c * NBAR;
    const u32 cbase = base + c * C_BYTES;
    const int* keys_s = reinterpret_cast<const int*>(smem + OFF_KEYS) + c * NST * BN;
    const float* gs_s = reinterpret_cast<const float*>(smem + OFF_GS) + c * NST * BN;
    const int nk = rows_of(c);

    float dq[DN / 2];  // dq[r0 / r1][8 j + 2 c4 + (0, 1)], the accumulator layout of wgmma.cuh
#pragma unroll
    for (int i = 0; i < DN / 2; ++i) dq[i] = 0.0f;

#pragma unroll 1
    for (int k = 0; k < nk; ++k) {
        const int row = row_of(c, k);
        const int row_b = row / p.S;
        const int qb = k & 1;
        const u32 q_buf = cbase + C_Q + qb * TILE;
        const float* wr = p.w + static_cast<i64>(row_b) * p.w_sb + static_cast<i64>(row - row_b * p.S) * p.w_ss;
        const float w0 = r0 < H ? wr[r0 * p.w_sh] : 0.0f;
        const float w1 = r1 < H ? wr[r1 * p.w_sh] : 0.0f;
        float* const dkv_b = p.dkv + static_cast<i64>(row_b) * p.P * D;
        float dw0 = 0.0f, dw1 = 0.0f;  // heads r0, r1: this thread's partial sums of the row
        if (n_tiles > 0) mbar_wait(bb + B_QREADY + qb, (k >> 1) & 1);  // (T = 0: no q is loaded)

#pragma unroll 1
        for (int t = 0; t < n_tiles; ++t) {
            const int n = k * n_tiles + t;  // this consumer's tile count: ring stage and phase
            const int st = n % NST;
            const u32 par = (n / NST) & 1;
            const u32 kv_buf = cbase + C_KV + st * TILE;
            mbar_wait(bb + B_READY + st, par);
            mbar_wait(bb + B_KEYS + st, par);
            fence_proxy_async();  // the producer's copies (generic proxy) before wgmma reads them
            const int* keys = keys_s + st * BN;
            // Skip a tile whose slots are all masked (every warp votes over the same 64 keys).
            const bool live = __any_sync(DSV4_FULL_MASK, keys[lane] >= 0 || keys[lane + 32] >= 0);
            if (!live) {
                mbar_arrive(bb + B_FREE + st);
                // Keeps the G^T double buffer's invariant (below) across skipped tiles.
                named_sync(1 + c, 128);
                continue;
            }
            const int fkey0 = keys[r0], fkey1 = keys[r1];  // read before the stage is freed

            // ---- A = q kv^T [heads x slots], K = D -------------------------------------------
            float acc[32];
            wgmma_fence();
            {
                const u64 qd = sw128_desc(q_buf, 16, 1024), kd = sw128_desc(kv_buf, 16, 1024);
#pragma unroll
                for (int ks = 0; ks < KS_A; ++ks) {
                    const u32 off = (ks / 4) * GROUP + (ks % 4) * 32;
                    wgmma_m64n64k16_ss<0>(acc, desc_advance(qd, off), desc_advance(kd, off), ks > 0);
                }
            }
            wgmma_commit();
            wgmma_wait<0>();
            fence_regs(acc);

            // ---- dw += g*scale*relu(A); G = g*scale*w*[A > 0] as the A operand of dq ----------
            // gf[kk] = G[r0 / r1][slots 16 kk + 2 c4 .., 16 kk + 8 + 2 c4 ..] (wgmma.cuh's A layout).
            u32 gf[4][4];
            {
                const float* gs = gs_s + st * BN;
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const float2 gg = *reinterpret_cast<const float2*>(gs + 8 * j + 2 * c4);
                    dw0 = fmaf(gg.x, fmaxf(acc[4 * j + 0], 0.0f), dw0);
                    dw0 = fmaf(gg.y, fmaxf(acc[4 * j + 1], 0.0f), dw0);
                    dw1 = fmaf(gg.x, fmaxf(acc[4 * j + 2], 0.0f), dw1);
                    dw1 = fmaf(gg.y, fmaxf(acc[4 * j + 3], 0.0f), dw1);
                    gf[j / 2][(j % 2) * 2 + 0] = pack_bf16(acc[4 * j + 0] > 0.0f ? gg.x * w0 : 0.0f, acc[4 * j + 1] > 0.0f ? gg.y * w0 : 0.0f);
                    gf[j / 2][(j % 2) * 2 + 1] = pack_bf16(acc[4 * j + 2] > 0.0f ? gg.x * w1 : 0.0f, acc[4 * j + 3] > 0.0f ? gg.y * w1 : 0.0f);
                }
            }

            // ---- dq += G kv (K = slots; kv N-major) -------------------------------------------
            wgmma_fence();
            {
                const u64 kn = sw128_desc(kv_buf, GROUP, 1024);
#pragma unroll
                for (int kk = 0; kk < 4; ++kk) wgmma_dn_rs<DN>(dq, gf[kk], desc_advance(kn, kk * 2048));
            }
            wgmma_commit();

            // ---- G^T [slots][heads] -> smem, buffer n % 2 (its last reader, tile n - 2's dkv
            //      product, was waited for by every warp before the named barrier of tile n - 1).
            //      stmatrix x stores the 8x8 matrices (slot block 2x + m / 2, head half m % 2),
            //      m = lane / 8: lane l addresses slot row 8 (2x + m / 2) + l % 8 at heads
            //      16 warp + 8 (m % 2) (16-byte chunk 2 warp + m % 2).
            const u32 gt_buf = cbase + C_GT + (n & 1) * GT_BYTES;
            {
                const int m = lane / 8, i = lane % 8;
#pragma unroll
                for (int x = 0; x < 4; ++x) stsm_x4_trans(gt_buf + sw128(8 * (2 * x + m / 2) + i, 2 * warp + m % 2), gf[x][0], gf[x][1], gf[x][2], gf[x][3]);
            }
            fence_proxy_async();
            named_sync(1 + c, 128);  // all heads of G^T written

            // ---- dkv_tile = G^T q (M = slots, K = heads; G^T K-major, q N-major), one 64-column
            //      chunk (q's SW128 group dc) at a time, each added to dkv[key] from the
            //      registers: each lane adds 4 columns of slots r0 and r1 (masked slots:
            //      nothing), the quad's lanes 64 consecutive bytes of one slot row.
            float* const dst0 = dkv_b + static_cast<i64>(max(fkey0, 0)) * D + 4 * (c4 & 1);
            float* const dst1 = dkv_b + static_cast<i64>(max(fkey1, 0)) * D + 4 * (c4 & 1);
#pragma unroll
            for (int dc = 0; dc < DG; ++dc) {
                float dk[32];  // dkv_tile[slot r0 / r1][64 dc + 8 j + 2 c4 + (0, 1)]
                wgmma_fence();
                const u64 gd = sw128_desc(gt_buf, 16, 1024), qn = sw128_desc(q_buf + dc * GROUP, GROUP, 1024);
#pragma unroll
                for (int ks = 0; ks < KS_H; ++ks) wgmma_m64n64k16_ss<1>(dk, desc_advance(gd, ks * 32), desc_advance(qn, ks * 2048), ks > 0);
                wgmma_commit();
                if (dc == 0) {
                    wgmma_wait<1>();  // dq's products: the stage's kv is read
                    fence_regs(dq);
                    mbar_arrive(bb + B_FREE + st);
                }
                wgmma_wait<0>();
                fence_regs(dk);
                // (Every accumulator is read, the zero columns past D too: ptxas serialises
                // the products when some of them are left unread.)
                // Quads: per 16 columns (j = 2m, 2m + 1) and slot row rr, lane c4 adds columns
                // 8 (2m + hi) + 4 (c4 & 1) .. + 3 (hi = c4 / 2), held by quad lanes
                // a = 2 (c4 & 1) and a + 1 at j = 2m + hi: in round 0 lane c4 reads lane
                // a + hi, which offers its hi value if odd, else its lo one; round 1 lane
                // a + 1 - hi, offering the other; rounds 2, 3 the same for the second element.
                {
                    const bool hi = c4 >= 2;
                    const int qlane = lane & ~3, a = (c4 & 1) * 2;
                    const int src0 = qlane + a + (hi ? 1 : 0), src1 = qlane + a + (hi ? 0 : 1);
#pragma unroll
                    for (int m = 0; m < 4; ++m) {
#pragma unroll
                        for (int rr = 0; rr < 2; ++rr) {
                            const float lox = dk[8 * m + 2 * rr], loy = dk[8 * m + 2 * rr + 1];
                            const float hix = dk[8 * m + 4 + 2 * rr], hiy = dk[8 * m + 4 + 2 * rr + 1];
                            const float e0 = __shfl_sync(DSV4_FULL_MASK, odd ? hix : lox, src0);
                            const float e1 = __shfl_sync(DSV4_FULL_MASK, odd ? lox : hix, src1);
                            const float e2 = __shfl_sync(DSV4_FULL_MASK, odd ? hiy : loy, src0);
                            const float e3 = __shfl_sync(DSV4_FULL_MASK, odd ? loy : hiy, src1);
                            const int j = 2 * m + (hi ? 1 : 0);
                            if ((rr ? fkey1 : fkey0) >= 0 && 8 * dc + j < DCH) {
                                float* const dst = (rr ? dst1 : dst0) + 64 * dc + 8 * j;
                                if (hi)
                                    red_add_v4(dst, e1, e3, e0, e2);
                                else
                                    red_add_v4(dst, e0, e2, e1, e3);
                            }
                        }
                    }
                }
            }
        }
        // Every product of the row is done (waited above): q's buffer is free.
        if (n_tiles > 0) mbar_arrive(bb + B_QFREE + qb);

        // ---- dq (bf16) and dw of the row, from the registers; dq restarts at zero -------------
        bf16* const dq_row = p.dq + static_cast<i64>(row) * (H * D);
#pragma unroll
        for (int j = 0; j < DN / 8; ++j) {  // (all accumulators read, as in the dkv flush)
            const int col = 8 * j + 2 * c4;
            const u32 lo = pack_bf16(dq[4 * j + 0], dq[4 * j + 1]), hi = pack_bf16(dq[4 * j + 2], dq[4 * j + 3]);
            if (j < DCH && r0 < H) *reinterpret_cast<u32*>(dq_row + r0 * D + col) = lo;
            if (j < DCH && r1 < H) *reinterpret_cast<u32*>(dq_row + r1 * D + col) = hi;
        }
#pragma unroll
        for (int i = 0; i < DN / 2; ++i) dq[i] = 0.0f;
        dw0 += __shfl_xor_sync(DSV4_FULL_MASK, dw0, 1);
        dw0 += __shfl_xor_sync(DSV4_FULL_MASK, dw0, 2);
        dw1 += __shfl_xor_sync(DSV4_FULL_MASK, dw1, 1);
        dw1 += __shfl_xor_sync(DSV4_FULL_MASK, dw1, 2);
        if (c4 == 0) {
            if (r0 < H) p.dw[static_cast<i64>(row) * H + r0] = dw0;
            if (r1 < H) p.dw[static_cast<i64>(row) * H + r1] = dw1;
        }
    }
}
