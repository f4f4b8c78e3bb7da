// Sparse MQA attention with sinks, backward (SPEC.md section 1), Hopper path (sm_90a):
// wgmma products fed by a producer warpgroup, for D = 512 and a block of 64 heads. The
// maths and the output conventions are bwd.cu's (read its header): with
// p_t = exp(l_t - lse), delta = <dout, out>, dS = sm_scale * P (dP - delta),
//   dq      = dS K                       (f32 registers, written once per row)
//   dkv[k] += dS^T Q + P^T dO            (atomic: f32 vector reductions into [B,K,D];
//                                         deterministic: each valid slot's row stored to
//                                         contributions [rows of the wave, T, n_hblk, D]
//                                         as fp16 with an f32 scale per 64 columns,
//                                         summed per key by bwd_reduce.cu)
//   dsinks_part[row, h] = -p_sink * delta (0 for an empty row)
//
// dsv4-archs: sm_90a
//
// Defines (the launcher's, src/sparse_attention/backward.rs):
//   SA90_BWD_DET        1: the deterministic mode (16-bit contribution rows); 0: atomic
//   SA90_BWD_C0_CHUNKS  of the eight dKV chunks of a pair, how many consumer 0 takes (0..7)
//   SA90_BWD_QDO_TMA    1: Q and dO tiles by TMA through `q_map` / `do_map`; 0: by the
//                       producer's cp.async (where q or dout cannot be mapped)
//
// One CTA = one query row (b, s) x 64 heads (the wgmma M; heads >= H are zero rows whose
// P is forced to 0 and which are never stored); grid [rows, ceil(H / 64)]: launch row
// chunk_base + blockIdx.x (deterministic: the wave's local row blockIdx.x), which is row
// B*S - 1 - (chunk_base + blockIdx.x) when p.rows_desc (the launcher sets it in the
// deterministic mode: its waves run from the last rows down, so the short remainder wave
// holds a causal selection's cheap first rows), head block blockIdx.y, n_hblk = gridDim.y.
// Three warpgroups:
//   WG 0, producer: Q and dO of the row into SW128 tiles (one mbarrier; with
//        SA90_BWD_QDO_TMA sixteen TMA loads from one thread, one SW128 group of 64 heads x
//        64 columns each, heads >= H read as zeros, while the others start the gather),
//        then the row's slots gathered by cp.async a pair of 32-key blocks (64 keys; the
//        rows are K and V at once: MQA) at a time into one [64 x 512] tile in two column
//        halves, 0-255 and 256-511 (gather_pair_halves): half 0 is refilled once consumer
//        0's dq products are done (it alone reads it after S and dP), half 1 once consumer
//        1's are, so consumer 0's S and dP of the next pair start on columns 0-255 while
//        256-511 land; "ready" / "free" mbarriers per half, slot keys staged per
//        1024-slot chunk (as fwd_sm90.cu). The deterministic mode's gathers carry an L2
//        evict_last policy, so the 16-bit rows streamed out do not push the gathered keys
//        out of L2.
//   WG 1 and WG 2, consumers 0 and 1: first delta[h] = <dout[h], out[h]> (out from global
//        memory, dout from the dO tile, 4 threads a head) and lse in log2 units into
//        shared memory. Then per pair the consumers split by role:
//     consumer 0: S = Q K^T, dP = dO K^T of the pair's 64 keys (m64n64k16 SS over the
//          interleaved ring; 32 k-steps each, K-major),
//          P = exp2(S sm_scale log2e - lse2) (masked slots and padded heads: 0),
//          dS = sm_scale P (dP - delta); once consumer 1 has read the previous pair's
//          tiles (named barrier kBarTilesFree):
//            dS   -> dS   [64 heads][64 keys] (plain stores; A of consumer 1's dq)
//            P^T  -> P^T  [64 keys][64 heads] (stmatrix .trans; A of dKV)
//            dS^T -> dS^T [64 keys][64 heads]
//          (kBarTilesReady to consumer 1), then dq[:, 0:256] += dS K[:, 0:256] (RS, dS
//          from registers; K N-major: the forward's P V) and its half of the ring's frees;
//          then dKV chunks 0 .. SA90_BWD_C0_CHUNKS - 1 as consumer 1 does the others.
//     consumer 1: dq[:, 256:512] += dS K[:, 256:512] (SS from the dS tile), then (the rest
//          of) dKV[pair's 64 keys] = dS^T Q + P^T dO (M = keys, K = heads: 4 k-steps; A K-major
//          from the transposed tiles, B = the Q / dO tiles read N-major) in eight chunks of
//          64 columns over two accumulator sets (32 f32 a thread each): chunk c's products
//          run while chunk c - 1 is flushed, so the reductions, the kernel's bound, do not
//          stop for products; the ring is freed as soon as dq's products are done (dKV
//          needs no K/V), so the next pair's gathers overlap the dKV products.
//        Each chunk is flushed from its accumulators: atomic, f32 columns permuted within
//        groups of 16 (flush_chunk), 4 key rows x 128 B a warp instruction of
//        red.global.add.v4.f32 into [B, K, D]; deterministic, 16-bit rows by streaming
//        stores (flush_chunk_f16). Each thread copies its flush rows' keys to registers
//        first (the producer rewrites the slot keys).
// Why this split: the transposed P^T / dS^T tiles make the dKV product a plain K-major A
// (no transposed-A wgmma needed) and the non-transposed dS tile gives dq the forward's
// verified P V form; all descriptors are the forms hopper_probe.cu checks.
//
// Shared memory (SW128 operand tiles, hopper.cuh): Q 64 KiB, dO 64 KiB, the K/V ring
// 2 x 32 KiB (one [64 x 512] tile of the pair: its column halves), dS, P^T, dS^T
// 3 x 8 KiB, slot keys of the pair (for the masks) and of the producer's current
// 1024-slot chunk, lse2 / delta, the row's "a valid slot was seen" flag, barriers. The Q
// area stages the bf16 dq tile at the end (16-byte stores). A ring of one pair (not the
// forward's two) is what fits beside dO and the three P / dS tiles (so consumer 0 also
// waits for consumer 1 to read the tiles before it writes the next pair's).

#include "common.cuh"
#include "hopper.cuh"
#include "wgmma.cuh"
#include "tma.cuh"
#include "sparse_attention/params.cuh"
#include "sparse_attention/tile.cuh"
#include "sparse_attention/gather_sm90.cuh"

using namespace dsv4;
using namespace dsv4::hopper;
using dsv4::sa::kLog2e;
using dsv4::sa::slot_key;


// The deterministic mode's 16-bit rows: each slot's contribution, per 64-column chunk, as
// fp16(c / s) with s = the chunk row's max |c| (f32), scale by rcp.approx (the decode
// multiplies by s itself, so the quotient's last bit does not matter). Layout (the wave's
// n = gridDim.x rows): contributions [n, T, n_hblk, D] fp16, each 64-column chunk in
// 16-byte units u = 4 k + c4 (quad lane c4, n8 tiles 4 k .. 4 k + 3, column 8 j + 2 c4 + e
// at position 8 u + 2 (j % 4) + e), so a quad's store writes whole 32-byte sectors; then
// the scales [n, T, n_hblk, D / 64] f32. bwd_reduce.cu's sparse_attn_inv_reduce_f16 reads
// this layout.

namespace {
constexpr int kD = 512;                  // head dim
constexpr int kHB = 64;                  // heads per CTA (wgmma M of S, dP, dq)
constexpr int kBN = 32;                  // slots per block (one consumer's S columns)
constexpr int kPair = 2 * kBN;           // keys per iteration (wgmma M of dKV)
constexpr int kNBuf = 2;                 // ring of blocks: one pair
constexpr int kThreads = 384;
constexpr int kGroupBytes = kBN * 128;   // one SW128 group of a block: 64 columns
constexpr int kQGroupBytes = kHB * 128;  // one SW128 group of Q / dO: 64 columns
constexpr int kBlockBytes = 8 * kGroupBytes;  // [32 x 512] bf16
// The ring holds the pair's two blocks interleaved as one [64 keys x 512] SW128 tile: block
// bb in rows 32 bb.. (at kv_base + bb * kRingBlockBytes), the 64-column groups 64 rows x
// 128 B apart (kRingGroupBytes), so S and dP of the pair are one m64n64k16 each a k-step,
// reading Q / dO once for 64 keys.
constexpr int kRingBlockBytes = kBN * 128;
constexpr int kRingGroupBytes = kPair * 128;
constexpr int kTileBytes = 64 * 128;     // [64 x 64] bf16 SW128: dS, P^T, dS^T
constexpr int kDkvN = 64;                // dKV columns per chunk (32 f32 accumulators a thread)
constexpr int kChunk = 1024;             // slot keys the producer reads per index pass

// Byte offsets from the 1024-aligned base.
constexpr int kQOff = 0;
constexpr int kDoOff = kQOff + 8 * kQGroupBytes;
constexpr int kKvOff = kDoOff + 8 * kQGroupBytes;     // [2] buffers
constexpr int kDsOff = kKvOff + kNBuf * kBlockBytes;  // dS   [64 heads][64 keys]
constexpr int kPtOff = kDsOff + kTileBytes;           // P^T  [64 keys][64 heads]
constexpr int kDstOff = kPtOff + kTileBytes;          // dS^T [64 keys][64 heads]
constexpr int kKeysOff = kDstOff + kTileBytes;        // int [2][32]: the ring's slot keys
constexpr int kLseOff = kKeysOff + kNBuf * kBN * 4;   // float [64]: lse * log2 e (+inf: padded head)
constexpr int kDeltaOff = kLseOff + kHB * 4;          // float [64]: <dout, out>
constexpr int kFlagOff = kDeltaOff + kHB * 4;         // int: a valid slot was seen (16 bytes reserved)
constexpr int kRowKeysOff = kFlagOff + 16;            // int [1024]: the producer's keys of a chunk of slots
constexpr int kBarOff = kRowKeysOff + kChunk * 4;     // u64: q/dO, ready[2], free[2], keys[2]
constexpr int kBytes = kBarOff + 7 * 8;
static_assert(kBarOff % 8 == 0, "mbarriers are 8-byte aligned");
}  // namespace

static_assert(kBN == sa90::kBN && kGroupBytes == sa90::kGroupBytes && kBlockBytes == sa90::kBlockBytes && kQGroupBytes == sa90::kTileGroupBytes && kChunk == sa90::kChunk, "the producer's layout (gather_sm90.cuh)");

// Dynamic shared memory the launcher passes: the layout plus alignment slack.
constexpr int kSa90BwdSmemBytes = kBytes + 1024;
static_assert(kSa90BwdSmemBytes <= 232448, "fits the opt-in shared memory of an H100/H200");
static_assert(kSa90BwdSmemBytes == 227144, "mirrored by SA90_BWD_SMEM_BYTES in src/sparse_attention/backward.rs");

// Four 8x8 bf16 matrices from the mma fragment layout (register i: matrix i, thread t
// holds row t / 4, columns 2 (t % 4) and 2 (t % 4) + 1) stored transposed: fragment
// element (row, col) goes to row `col` of the stored matrix, position `row`. Lane l gives
// the shared address of stored row l % 8 of matrix l / 8 (16 bytes).
__device__ __forceinline__ void stsm_x4_trans(u32 addr, u32 r0, u32 r1, u32 r2, u32 r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}

// Consumer 0 also takes dKV chunks 0 .. kC0Chunks - 1 (after its dq products; one
// accumulator set, each chunk flushed before the next is issued), so 8 warps instead of 4
// issue reductions part of the time.

// Named barriers between the consumers (1: both, 3 + c: consumer c alone).
constexpr int kBarTilesReady = 6;  // consumer 0 -> 1: the pair's dS, P^T, dS^T tiles are written
constexpr int kBarTilesFree = 7;   // consumer 1 -> 0: its last dKV products have read them

// Where key row r of pair `it` goes: the row's contribution entry (deterministic) or the
// f32 dkv row of its key (atomic; flush_chunk's destination). flush_chunk_f16 addresses the
// contribution rows itself (det_entry).
template <bool DET>
__device__ __forceinline__ float* flush_row(const SparseAttnBwdParams& p, int local, int it, int r, int n_hblk, int hb, int b, int fkey) {
    return (DET && p.deterministic) ? p.dkv + ((static_cast<i64>(local) * p.T + it * kPair + r) * n_hblk + hb) * kD
                                     : p.dkv + (static_cast<i64>(b) * p.K + max(fkey, 0)) * kD;
}

// The dKV flush layout: the f32 columns permuted within each group of 16 (column
// 16 m + 8 h + 2 c + e stored at 16 m + 4 c + 2 h + e), so a lane's two accumulator pairs
// of a group (n8 tiles 2m, 2m + 1) are 4 consecutive floats, one 16-byte vector. The
// f32 -> bf16 conversion (bwd_reduce.cu) undoes the permutation.
// A chunk of 2 NA columns (acc: key rows r0, r1 of the wgmma layout) goes out as 4 key rows
// x 128 B a warp instruction: the quads of lanes l and l ^ 4 (key rows r and r + 1) swap
// one vector of each pair of column groups (m, m + 1): the even quad keeps group m of its
// row and sends group m + 1, the odd quad keeps group m + 1 and sends group m; then one
// instruction writes both groups of the even quad's row, the next both of the odd quad's.
// row_a / row_b, on_a / on_b: the rows and predicates of those two instructions (the
// partner's shuffled once a pair); `col` = the chunk's first column + 4 c4.
// Each vector is one red.global.add.v4.f32 (each element's add atomic on its own, no
// ordering implied).
template <int NA>
__device__ __forceinline__ void flush_chunk(const float (&acc)[NA], float* const (&row_a)[2], float* const (&row_b)[2], const u32 (&on_a)[2], const u32 (&on_b)[2], bool odd, int col) {
#pragma unroll
    for (int m = 0; m < NA / 8; m += 2) {
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
            const float4 a = make_float4(acc[8 * m + 2 * rr], acc[8 * m + 2 * rr + 1], acc[8 * m + 4 + 2 * rr], acc[8 * m + 4 + 2 * rr + 1]);
            const float4 c = make_float4(acc[8 * m + 8 + 2 * rr], acc[8 * m + 8 + 2 * rr + 1], acc[8 * m + 12 + 2 * rr], acc[8 * m + 12 + 2 * rr + 1]);
            const float4 send = odd ? a : c;
            float4 recv;
            recv.x = __shfl_xor_sync(DSV4_FULL_MASK, send.x, 4);
            recv.y = __shfl_xor_sync(DSV4_FULL_MASK, send.y, 4);
            recv.z = __shfl_xor_sync(DSV4_FULL_MASK, send.z, 4);
            recv.w = __shfl_xor_sync(DSV4_FULL_MASK, send.w, 4);
            // The even quad's row: even lanes group m (own), odd lanes group m + 1 (received);
            // then the odd quad's row: even lanes group m (received), odd lanes group m + 1 (own).
            const float4 v1 = odd ? recv : a, v2 = odd ? c : recv;
            const int gcol = col + 16 * (m + (odd ? 1 : 0));
#pragma unroll
            for (int k = 0; k < 2; ++k) {
                const float4 v = k ? v2 : v1;
                float* ptr = (k ? row_b[rr] : row_a[rr]) + gcol;
                const u32 on = k ? on_b[rr] : on_a[rr];
                // Predicated in the PTX rather than under an `if`: with a divergent branch
                // between a wgmma's issue and its wait ptxas serialized the products (C7518).
                asm volatile(
                    "{\n.reg .pred q;\n"
                    "setp.ne.b32 q, %5, 0;\n"
                    "@q red.relaxed.gpu.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n}\n" ::"l"(ptr),
                    "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "r"(on) : "memory");
            }
        }
    }
}

// The deterministic flush in 16 bits: chunk `chunk` of the contribution rows e0, e1
// (entry (local row, slot) * n_hblk + hb of this thread's key rows r0, r1; on0 / on1:
// valid slots). The quad's four lanes hold a key row's 64 columns: its max |c| by two
// shuffles, then each lane scales its 16 values to [-1, 1] as fp16, and lane 0 stores the
// scale. The lanes of quads q and q ^ 1 (key rows r and r ^ 1) trade one 16-byte unit of
// each row, so that each store instruction writes 4 whole 128-byte row chunks (the even
// quad units 0-3, the odd one units 4-7 of one row): half the L2 write requests of each
// lane storing its own row's units, the same stored layout.
__device__ __forceinline__ void flush_chunk_f16(const SparseAttnBwdParams& p, const float (&acc)[kDkvN / 2], i64 e0, i64 e1, u32 on0, u32 on1, int chunk, int c4) {
    unsigned short* const vals = reinterpret_cast<unsigned short*>(p.dkv);
    float* const scales = reinterpret_cast<float*>(vals + static_cast<i64>(gridDim.x) * p.T * gridDim.y * kD);
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        float mx = 0.0f;
        u32 h[kDkvN / 8];
#pragma unroll
        for (int j = 0; j < kDkvN / 8; ++j) mx = fmaxf(mx, fmaxf(fabsf(acc[4 * j + 2 * rr]), fabsf(acc[4 * j + 2 * rr + 1])));
        mx = fmaxf(mx, __shfl_xor_sync(DSV4_FULL_MASK, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(DSV4_FULL_MASK, mx, 2));
        // (A row below the smallest normal f32 is stored as zeros: 1 / mx would overflow.)
        float inv = 0.0f;
        asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(inv) : "f"(mx));
        inv = mx >= 1.17549435e-38f ? inv : 0.0f;
#pragma unroll
        for (int j = 0; j < kDkvN / 8; ++j) {
            const float x = acc[4 * j + 2 * rr] * inv, y = acc[4 * j + 2 * rr + 1] * inv;
            asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(h[j]) : "f"(y), "f"(x));  // x in the low half
        }
        const i64 e = rr ? e1 : e0;
        const u32 on = rr ? on1 : on0;
        // Even quad: unit c4 of its own row (h[0..3]), then unit c4 of the odd row
        // (received); odd quad: unit 4 + c4 of the even row (received), then of its own
        // row (h[4..7]). Key row r ^ 1's entry is e -+ n_hblk.
        const bool odd = (threadIdx.x >> 2) & 1;
        const u32 s0 = odd ? h[0] : h[4], s1 = odd ? h[1] : h[5], s2 = odd ? h[2] : h[6], s3 = odd ? h[3] : h[7];
        const u32 r0 = __shfl_xor_sync(DSV4_FULL_MASK, s0, 4), r1 = __shfl_xor_sync(DSV4_FULL_MASK, s1, 4);
        const u32 r2 = __shfl_xor_sync(DSV4_FULL_MASK, s2, 4), r3 = __shfl_xor_sync(DSV4_FULL_MASK, s3, 4);
        const u32 pon = __shfl_xor_sync(DSV4_FULL_MASK, on, 4);
        const i64 e_pair = odd ? e - static_cast<i64>(gridDim.y) : e + static_cast<i64>(gridDim.y);
        const i64 e_even = odd ? e_pair : e, e_odd = odd ? e : e_pair;
        const int unit = odd ? 32 + 8 * c4 : 8 * c4;  // in fp16 values
        unsigned short* const dst_even = vals + e_even * kD + chunk * kDkvN + unit;
        unsigned short* const dst_odd = vals + e_odd * kD + chunk * kDkvN + unit;
        const u32 a0 = odd ? r0 : h[0], a1 = odd ? r1 : h[1], a2 = odd ? r2 : h[2], a3 = odd ? r3 : h[3];
        const u32 b0 = odd ? h[4] : r0, b1 = odd ? h[5] : r1, b2 = odd ? h[6] : r2, b3 = odd ? h[7] : r3;
        asm volatile(
            "{\n.reg .pred q, w;\n"
            "setp.ne.b32 q, %10, 0;\n"
            "setp.ne.b32 w, %11, 0;\n"
            "@q st.global.cs.v4.b32 [%0], {%2, %3, %4, %5};\n"
            "@w st.global.cs.v4.b32 [%1], {%6, %7, %8, %9};\n}\n" ::"l"(dst_even), "l"(dst_odd),
            "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "r"(b2), "r"(b3), "r"(odd ? pon : on), "r"(odd ? on : pon) : "memory");
        asm volatile(
            "{\n.reg .pred q;\n"
            "setp.ne.b32 q, %2, 0;\n"
            "@q st.global.cs.f32 [%0], %1;\n}\n" ::"l"(scales + e * (kD / kDkvN) + chunk), "f"(mx), "r"((rr ? on1 : on0) & static_cast<u32>(c4 == 0)) : "memory");
    }
}

// q_map, do_map: the TMA maps of q and dout (SA90_BWD_QDO_TMA=1); zeros (unread) otherwise.
extern "C" __global__ void __launch_bounds__(kThreads, 1) sparse_attn_bwd_sm90(const SparseAttnBwdParams p, const __grid_constant__ TmaDesc q_map, const __grid_constant__ TmaDesc do_map) {
    // The launcher's defines (see the header), as local constants: NVRTC emits namespace-scope
    // ones as unused global data.
    constexpr bool kDet = SA90_BWD_DET != 0;
    constexpr int kC0Chunks = SA90_BWD_C0_CHUNKS;
    static_assert(kC0Chunks >= 0 && kC0Chunks <= 7, "SA90_BWD_C0_CHUNKS: 0..7");
    constexpr bool kQdoTma = SA90_BWD_QDO_TMA != 0;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    if (p.smem_bytes < kSa90BwdSmemBytes) __trap();  // the launcher's layout disagrees with this one
    if (!kDet && p.deterministic) __trap();  // compiled for the atomic mode alone
    unsigned char* smem = align_1024(smem_raw);
    const u32 q_base = smem_u32(smem + kQOff);
    const u32 do_base = smem_u32(smem + kDoOff);
    const u32 kv_base = smem_u32(smem + kKvOff);
    const u32 ds_base = smem_u32(smem + kDsOff);
    const u32 pt_base = smem_u32(smem + kPtOff);
    const u32 dst_base = smem_u32(smem + kDstOff);
    int* keys_s = reinterpret_cast<int*>(smem + kKeysOff);
    float* lse_s = reinterpret_cast<float*>(smem + kLseOff);
    float* delta_s = reinterpret_cast<float*>(smem + kDeltaOff);
    int* flag_s = reinterpret_cast<int*>(smem + kFlagOff);
    u64* qdo_bar = reinterpret_cast<u64*>(smem + kBarOff);
    u64* ready_bar = qdo_bar + 1;  // [half]: the producer's 128 threads
    u64* free_bar = qdo_bar + 3;   // [half]: the consumer that reads it last (its 128 threads)
    u64* keys_bar = qdo_bar + 5;   // [block of the pair]: the producer's key writers

    const int tid = threadIdx.x;
    const int wg = tid / 128, wtid = tid % 128;
    const int local = static_cast<int>(blockIdx.x);  // row of the launch (deterministic: of the wave)
    const i64 row = sa::launch_row(static_cast<i64>(p.chunk_base) + local, static_cast<i64>(p.B) * p.S, p.rows_desc);  // b * S + s
    const int b = static_cast<int>(row / p.S), s = static_cast<int>(row % p.S);
    const int hb = static_cast<int>(blockIdx.y), n_hblk = static_cast<int>(gridDim.y);
    const int h0 = hb * kHB;
    const int n_slots = sa::row_slots(p.row_len, row, p.T);
    const int n_iters = (n_slots + kPair - 1) / kPair;  // a pair of blocks each

    if (tid == 0) {
        mbar_init(qdo_bar, kQdoTma ? 1 : 128);
        for (int i = 0; i < kNBuf; ++i) {
            mbar_init(ready_bar + i, 128);
            mbar_init(free_bar + i, 128);
            mbar_init(keys_bar + i, sa90::kKeyWriters);
        }
        *flag_s = 0;
        if constexpr (kQdoTma) tma::fence_barrier_init();  // the TMA unit completes bytes on qdo_bar
    }
    __syncthreads();

    if (wg == 0) {
        // ---------------- producer ----------------
        regs_dec<40>();
        const i64 idx_row = b * p.idx_sb + s * p.idx_ss;
        const i64 bias = b * p.idx_bias;
        const bf16* kv_b = p.kv + b * p.kv_sb;
        if constexpr (kQdoTma) {
            if (wtid == 0) {
                const u32 bar = smem_u32(qdo_bar);
                tma::arrive_expect_tx(bar, 16 * kQGroupBytes);
#pragma unroll
                for (int grp = 0; grp < 8; ++grp) tma::load_4d(q_base + grp * kQGroupBytes, q_map, 64 * grp, h0, s, b, bar);
#pragma unroll
                for (int grp = 0; grp < 8; ++grp) tma::load_4d(do_base + grp * kQGroupBytes, do_map, 64 * grp, h0, s, b, bar);
            }
        } else {
            // Q and dO, one tile after the other (fewer live registers).
            sa90::load_head_tile<2>(q_base, p.q + b * p.q_sb + s * p.q_ss, p.q_sh, p.q, h0, p.H, wtid);
            sa90::load_head_tile<2>(do_base, p.dout + b * p.do_sb + s * p.do_ss, p.do_sh, p.dout, h0, p.H, wtid);
            sa90::producer_handoff(qdo_bar);
        }
        const sa90::SlotSource src{p.idx, idx_row, p.idx_st, bias, p.idx_is_i64, n_slots, p.K, kv_b, p.kv, p.kv_sk};
        sa90::gather_pair_halves<kRingGroupBytes, kDet>(src, n_iters, kv_base, keys_s, reinterpret_cast<int*>(smem + kRowKeysOff), ready_bar, keys_bar, free_bar, wtid);
        return;
    }

    // ---------------- consumers ----------------
    regs_inc<232>();
    const int cw = wg - 1;  // this consumer's role (0: S, dP, softmax, tiles; 1: dKV) and column half of dq
    const int ct = tid - 128;
    const int warp = wtid / 32, lane = wtid % 32;
    const int g = lane / 4, c4 = lane % 4;
    const int r0 = warp * 16 + g, r1 = r0 + 8;  // this thread's rows of S / dP / dq (heads h0 + r)

    // delta = <dout, out> per head (4 threads a head, interleaved 16-byte chunks) and lse
    // in log2 units (+inf for a padded head: its P is 0).
    {
        const int r = ct / 4, part = ct % 4;
        const int h = h0 + r;
        float acc = 0.0f;
        if (h < p.H) {
            const bf16* orow = p.out + b * p.o_sb + s * p.o_ss + h * p.o_sh;
            // out's 16 loads all issued first (one round of DRAM latency), dout from the dO
            // tile once the Q/dO barrier completes.
            uint4 ou[kD / 32], du[kD / 32];
#pragma unroll
            for (int i = 0; i < kD / 32; ++i) {
                const int cc = part + 4 * i;
                asm volatile("ld.global.nc.v4.b32 {%0,%1,%2,%3}, [%4];\n" : "=r"(ou[i].x), "=r"(ou[i].y), "=r"(ou[i].z), "=r"(ou[i].w) : "l"(orow + cc * 8));
            }
            mbar_wait(qdo_bar, 0);
#pragma unroll
            for (int i = 0; i < kD / 32; ++i) {
                const int cc = part + 4 * i;
                asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];\n" : "=r"(du[i].x), "=r"(du[i].y), "=r"(du[i].z), "=r"(du[i].w) : "r"(do_base + (cc / 8) * kQGroupBytes + sw128(r, cc % 8)) : "memory");
            }
#pragma unroll
            for (int i = 0; i < kD / 32; ++i) {
                const u32 ow[4] = {ou[i].x, ou[i].y, ou[i].z, ou[i].w}, dw[4] = {du[i].x, du[i].y, du[i].z, du[i].w};
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    acc += bf16_lo(ow[e]) * bf16_lo(dw[e]);
                    acc += bf16_hi(ow[e]) * bf16_hi(dw[e]);
                }
            }
        }
        acc += __shfl_xor_sync(DSV4_FULL_MASK, acc, 1);
        acc += __shfl_xor_sync(DSV4_FULL_MASK, acc, 2);
        if (part == 0) {
            delta_s[r] = acc;
            lse_s[r] = h < p.H ? p.lse[b * p.lse_sb + s * p.lse_ss + h * p.lse_sh] * kLog2e : __int_as_float(0x7f800000);
        }
    }
    named_sync(1, 256);
    const float lse0 = lse_s[r0], lse1 = lse_s[r1], de0 = delta_s[r0], de1 = delta_s[r1];
    const float s_scale = p.sm_scale * kLog2e;
    bool any_valid = false;  // a key of this thread's flush rows was valid

    float dq[128];  // dq[r0 / r1][256 cw + 8 j + 2 c4 + (0, 1)], layout of wgmma.cuh
#pragma unroll
    for (int i = 0; i < 128; ++i) dq[i] = 0.0f;

    mbar_wait(qdo_bar, 0);

    const u64 qd0 = sw128_desc(q_base, 16, 1024), dod0 = sw128_desc(do_base, 16, 1024);
    for (int it = 0; it < n_iters; ++it) {
        const u32 par = it & 1;  // the ready phase of both halves in this iteration
        // Deterministic: the contribution entry of key row r of this pair.
        [[maybe_unused]] auto det_entry = [&](int r) -> i64 { return (static_cast<i64>(local) * p.T + it * kPair + r) * n_hblk + hb; };
        if (cw == 0) {
            // S = Q K^T, dP = dO K^T of both blocks (keys 32 bb.. of the pair).
            // (block bb's columns are n8 tiles 4 bb.. of the m64n64 accumulators: sc[16 bb + i])
            float sc[32], dp[32];
            const u64 kd0 = sw128_desc(kv_base, 16, 1024);
            // Columns 0-255 (ring half 0) as soon as they land, then 256-511.
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                mbar_wait(ready_bar + hh, par);
                sa90::consumer_after_ready();
                wgmma_fence();
#pragma unroll
                for (int k = 0; k < 16; ++k) {
                    const int ks = 16 * hh + k;
                    const u32 qo = (ks / 4) * kQGroupBytes + (ks % 4) * 32;
                    const u32 ko = (ks / 4) * kRingGroupBytes + (ks % 4) * 32;
                    wgmma_m64n64k16_ss<0>(sc, desc_advance(qd0, qo), desc_advance(kd0, ko), ks > 0);
                    wgmma_m64n64k16_ss<0>(dp, desc_advance(dod0, qo), desc_advance(kd0, ko), ks > 0);
                }
                wgmma_commit();
            }
            wgmma_wait<0>();
            fence_regs(sc);
            fence_regs(dp);

            // P and dS as bf16 pairs, per block bb (bwd.cu's formulas in log2 units):
            // pp[bb][jj][0 / 1] = P[r0 / r1][32 bb + 8 jj + 2 c4 ..]; da[2 bb + jj / 2] = dS
            // in the A layout of wgmma.cuh (k-step 2 bb + jj / 2 of the pair's 64 keys).
            mbar_wait(keys_bar + 0, par);
            mbar_wait(keys_bar + 1, par);
            u32 pp[2][4][2], da[4][4];
#pragma unroll
            for (int bb = 0; bb < 2; ++bb) {
                const int* keys = keys_s + bb * kBN;
#pragma unroll
                for (int jj = 0; jj < 4; ++jj) {
                    const int col = 8 * jj + 2 * c4;
                    const bool v0 = keys[col] >= 0, v1 = keys[col + 1] >= 0;
                    const float p00 = v0 ? sa90::exp2_p(sc[16 * bb + 4 * jj + 0] * s_scale - lse0) : 0.0f;
                    const float p01 = v1 ? sa90::exp2_p(sc[16 * bb + 4 * jj + 1] * s_scale - lse0) : 0.0f;
                    const float p10 = v0 ? sa90::exp2_p(sc[16 * bb + 4 * jj + 2] * s_scale - lse1) : 0.0f;
                    const float p11 = v1 ? sa90::exp2_p(sc[16 * bb + 4 * jj + 3] * s_scale - lse1) : 0.0f;
                    pp[bb][jj][0] = pack_bf16(p00, p01);
                    pp[bb][jj][1] = pack_bf16(p10, p11);
                    da[2 * bb + jj / 2][(jj % 2) * 2 + 0] = pack_bf16(p.sm_scale * p00 * (dp[16 * bb + 4 * jj + 0] - de0), p.sm_scale * p01 * (dp[16 * bb + 4 * jj + 1] - de0));
                    da[2 * bb + jj / 2][(jj % 2) * 2 + 1] = pack_bf16(p.sm_scale * p10 * (dp[16 * bb + 4 * jj + 2] - de1), p.sm_scale * p11 * (dp[16 * bb + 4 * jj + 3] - de1));
                }
            }

            if (it > 0) named_sync(kBarTilesFree, 256);  // consumer 1's last products of the previous pair read the tiles
#pragma unroll
            for (int bb = 0; bb < 2; ++bb) {
                // dS [heads][keys]: columns 32 bb + 8 jj.. (16-byte chunk 4 bb + jj of each head row).
#pragma unroll
                for (int jj = 0; jj < 4; ++jj) {
                    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(ds_base + sw128(r0, 4 * bb + jj) + 4 * c4), "r"(da[2 * bb + jj / 2][(jj % 2) * 2 + 0]) : "memory");
                    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(ds_base + sw128(r1, 4 * bb + jj) + 4 * c4), "r"(da[2 * bb + jj / 2][(jj % 2) * 2 + 1]) : "memory");
                }
                // P^T, dS^T [keys][heads]: rows 32 bb.. (stmatrix .trans of the fragments).
                const int m = lane / 8, i = lane % 8;
#pragma unroll
                for (int x = 0; x < 2; ++x) {
                    const u32 off = sw128(bb * kBN + 8 * (2 * x + m / 2) + i, 2 * warp + m % 2);
                    stsm_x4_trans(pt_base + off, pp[bb][2 * x][0], pp[bb][2 * x][1], pp[bb][2 * x + 1][0], pp[bb][2 * x + 1][1]);
                    stsm_x4_trans(dst_base + off, da[2 * bb + x][0], da[2 * bb + x][1], da[2 * bb + x][2], da[2 * bb + x][3]);
                }
            }
            fence_proxy_async();
            named_arrive(kBarTilesReady, 256);

            // dq[:, 0:256] += dS K[:, 0:256] over the pair's 64 keys (RS; K N-major).
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
                const u64 kd = sw128_desc(kv_base + (kk / 2) * kRingBlockBytes, kRingGroupBytes, 1024);
                wgmma_m64n256k16_rs<1>(dq, da[kk], desc_advance(kd, (kk % 2) * 2048), 1);
            }
            wgmma_commit();
            if constexpr (kC0Chunks > 0) {
                const int fkey0 = keys_s[r0], fkey1 = keys_s[r1];  // read before this consumer frees the ring
                float* const d0 = flush_row<kDet>(p, local, it, r0, n_hblk, hb, b, fkey0);
                float* const d1 = flush_row<kDet>(p, local, it, r1, n_hblk, hb, b, fkey1);
                const bool odd = (g & 1) != 0;
                const u32 on0 = fkey0 >= 0, on1 = fkey1 >= 0;
                float* const pd0 = reinterpret_cast<float*>(__shfl_xor_sync(DSV4_FULL_MASK, reinterpret_cast<unsigned long long>(d0), 4));
                float* const pd1 = reinterpret_cast<float*>(__shfl_xor_sync(DSV4_FULL_MASK, reinterpret_cast<unsigned long long>(d1), 4));
                const u32 pon0 = __shfl_xor_sync(DSV4_FULL_MASK, on0, 4), pon1 = __shfl_xor_sync(DSV4_FULL_MASK, on1, 4);
                float* const row_a[2] = {odd ? pd0 : d0, odd ? pd1 : d1};
                float* const row_b[2] = {odd ? d0 : pd0, odd ? d1 : pd1};
                const u32 on_a[2] = {odd ? pon0 : on0, odd ? pon1 : on1};
                const u32 on_b[2] = {odd ? on0 : pon0, odd ? on1 : pon1};
                named_sync(3, 128);  // this consumer's tile stores are done before its products read them
                const u64 dstd = sw128_desc(dst_base, 16, 1024), ptd = sw128_desc(pt_base, 16, 1024);
                float acc[kDkvN / 2];
#pragma unroll
                for (int c = 0; c < kC0Chunks; ++c) {
                    const u64 qnd = sw128_desc(q_base + c * kQGroupBytes, kQGroupBytes, 1024);
                    const u64 donm = sw128_desc(do_base + c * kQGroupBytes, kQGroupBytes, 1024);
                    wgmma_fence();
#pragma unroll
                    for (int ks = 0; ks < 4; ++ks) {
                        wgmma_m64n64k16_ss<1>(acc, desc_advance(dstd, ks * 32), desc_advance(qnd, ks * 2048), ks > 0);
                        wgmma_m64n64k16_ss<1>(acc, desc_advance(ptd, ks * 32), desc_advance(donm, ks * 2048), 1);
                    }
                    wgmma_commit();
                    if (c == 0) {
                        wgmma_wait<1>();  // dq's products: the ring is read
                        fence_regs(dq);
                        mbar_arrive(free_bar + 0);
                    }
                    wgmma_wait<0>();
                    fence_regs(acc);
                    if constexpr (kDet) {
                        flush_chunk_f16(p, acc, det_entry(r0), det_entry(r1), on0, on1, c, c4);
                    } else {
                        flush_chunk(acc, row_a, row_b, on_a, on_b, odd, kDkvN * c + 4 * c4);
                    }
                }
            } else {
                wgmma_wait<0>();
                fence_regs(dq);
                mbar_arrive(free_bar + 0);
            }
        } else {
            named_sync(kBarTilesReady, 256);
            // Done already (consumer 0 waited); orders the data for this thread. Its dq reads
            // half 1 alone, and half 0's barrier may be a phase further on (consumer 0 frees
            // half 0 without this consumer).
            mbar_wait(ready_bar + 1, par);
            sa90::consumer_after_ready();
            mbar_wait(keys_bar + 0, par);  // done already as well
            mbar_wait(keys_bar + 1, par);
            const int fkey0 = keys_s[r0], fkey1 = keys_s[r1];  // key rows r0, r1 of the pair
            any_valid |= fkey0 >= 0 || fkey1 >= 0;
            float* const d0 = flush_row<kDet>(p, local, it, r0, n_hblk, hb, b, fkey0);
            float* const d1 = flush_row<kDet>(p, local, it, r1, n_hblk, hb, b, fkey1);
            // The rows and predicates of the two instructions of each vector pair: a = the
            // even quad's rows, b = the odd quad's (flush_chunk).
            const bool odd = (g & 1) != 0;
            const u32 on0 = fkey0 >= 0, on1 = fkey1 >= 0;
            float* const pd0 = reinterpret_cast<float*>(__shfl_xor_sync(DSV4_FULL_MASK, reinterpret_cast<unsigned long long>(d0), 4));
            float* const pd1 = reinterpret_cast<float*>(__shfl_xor_sync(DSV4_FULL_MASK, reinterpret_cast<unsigned long long>(d1), 4));
            const u32 pon0 = __shfl_xor_sync(DSV4_FULL_MASK, on0, 4), pon1 = __shfl_xor_sync(DSV4_FULL_MASK, on1, 4);
            float* const row_a[2] = {odd ? pd0 : d0, odd ? pd1 : d1};
            float* const row_b[2] = {odd ? d0 : pd0, odd ? d1 : pd1};
            const u32 on_a[2] = {odd ? pon0 : on0, odd ? pon1 : on1};
            const u32 on_b[2] = {odd ? on0 : pon0, odd ? on1 : pon1};

            // dq[:, 256:512] += dS K[:, 256:512] (SS: the dS tile, K N-major).
            wgmma_fence();
            const u64 dsd = sw128_desc(ds_base, 16, 1024);
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
                const u64 kd = sw128_desc(kv_base + (kk / 2) * kRingBlockBytes + 4 * kRingGroupBytes, kRingGroupBytes, 1024);
                wgmma_m64n256k16_ss<1>(dq, desc_advance(dsd, kk * 32), desc_advance(kd, (kk % 2) * 2048), 1);
            }
            wgmma_commit();

            // dKV[pair keys, 64 c ..] = dS^T Q + P^T dO (chunk c: one SW128 group of Q / dO)
            // into acc[c % 2]; chunk c - 1's reductions go out while chunk c's products run.
            const u64 dstd = sw128_desc(dst_base, 16, 1024), ptd = sw128_desc(pt_base, 16, 1024);
            float acc[2][kDkvN / 2];
#pragma unroll
            for (int c = kC0Chunks; c < kD / kDkvN; ++c) {
                const u64 qnd = sw128_desc(q_base + c * kQGroupBytes, kQGroupBytes, 1024);
                const u64 donm = sw128_desc(do_base + c * kQGroupBytes, kQGroupBytes, 1024);
                if (c > kC0Chunks) wgmma_fence();
#pragma unroll
                for (int ks = 0; ks < 4; ++ks) {
                    wgmma_m64n64k16_ss<1>(acc[(c - kC0Chunks) % 2], desc_advance(dstd, ks * 32), desc_advance(qnd, ks * 2048), ks > 0);
                    wgmma_m64n64k16_ss<1>(acc[(c - kC0Chunks) % 2], desc_advance(ptd, ks * 32), desc_advance(donm, ks * 2048), 1);
                }
                wgmma_commit();
                wgmma_wait<1>();  // the first chunk: dq's products (the ring is read); else chunk c - 1
                if (c == kC0Chunks) {
                    fence_regs(dq);
                    mbar_arrive(free_bar + 1);
                } else {
                    fence_regs(acc[(c - 1 - kC0Chunks) % 2]);
                    if constexpr (kDet) {
                        flush_chunk_f16(p, acc[(c - 1 - kC0Chunks) % 2], det_entry(r0), det_entry(r1), on0, on1, c - 1, c4);
                    } else {
                        flush_chunk(acc[(c - 1 - kC0Chunks) % 2], row_a, row_b, on_a, on_b, odd, kDkvN * (c - 1) + 4 * c4);
                    }
                }
            }
            wgmma_wait<0>();
            constexpr int kLast = (kD / kDkvN - 1 - kC0Chunks) % 2;
            fence_regs(acc[kLast]);
            named_arrive(kBarTilesFree, 256);  // the tiles are read
            if constexpr (kDet) {
                flush_chunk_f16(p, acc[kLast], det_entry(r0), det_entry(r1), on0, on1, kD / kDkvN - 1, c4);
            } else {
                flush_chunk(acc[kLast], row_a, row_b, on_a, on_b, odd, kD - kDkvN + 4 * c4);
            }
        }
    }
    // Consumer 1 arrived on kBarTilesFree once a pair, consumer 0 synced all but the first.
    if (cw == 0 && n_iters > 0) named_sync(kBarTilesFree, 256);

    // Whether the row has a valid slot (consumer 1's flush rows cover all 64 keys of every
    // pair).
    if (any_valid) *flag_s = 1;
    named_sync(1, 256);  // also: every product of both consumers is done, so Q is free
    const bool row_nonempty = *flag_s != 0 || p.all_rows_nonempty;

    // dq staged as bf16 in the Q area (SW128, this consumer's 4 groups), then 16-byte
    // coalesced stores. An empty row stores zeros: its masked slots' dS = 0 * (dP - delta)
    // is NaN where its dout is not finite, and SPEC.md gives it zero gradients.
#pragma unroll
    for (int jj = 0; jj < 32; ++jj) {
        const u32 grp = q_base + (cw * 4 + jj / 8) * kQGroupBytes;
        const u32 lo = row_nonempty ? pack_bf16(dq[4 * jj], dq[4 * jj + 1]) : 0u, hi = row_nonempty ? pack_bf16(dq[4 * jj + 2], dq[4 * jj + 3]) : 0u;
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(grp + sw128(r0, jj % 8) + 4 * c4), "r"(lo) : "memory");
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(grp + sw128(r1, jj % 8) + 4 * c4), "r"(hi) : "memory");
    }
    named_sync(3 + cw, 128);
#pragma unroll 4
    for (int i = 0; i < 16; ++i) {
        const int id = wtid + i * 128;
        const int r = id / 32, cc = id % 32;
        if (h0 + r < p.H) {
            uint4 v;
            asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(q_base + (cw * 4 + cc / 8) * kQGroupBytes + sw128(r, cc % 8)) : "memory");
            *reinterpret_cast<uint4*>(p.dq + (row * p.H + h0 + r) * kD + cw * 256 + cc * 8) = v;
        }
    }
    // dsinks partial: -p_sink * delta (0 for an empty row).
    if (cw == 0 && wtid < kHB) {
        const int h = h0 + wtid;
        if (h < p.H) {
            const float sink = p.sinks[h * p.sinks_sh] * kLog2e;
            p.dsinks_part[row * p.H + h] = row_nonempty ? -exp2f(sink - lse_s[wtid]) * delta_s[wtid] : 0.0f;
        }
    }
}
