// Per-row top-k of f32 scores (SPEC.md section 3): the K = min(k, P) largest finite
// scores, descending, ties to the lower index, (-1, -inf) past the row's finite count.
// One CTA per row runs the block-wide exact selection of select.cuh (radix select on
// order-preserving keys, bitonic sort of the keys above the threshold, ties at the
// threshold in index order). The row's keys are cached in shared memory when they fit;
// otherwise every pass streams the row from global memory (long rows). Rows of causal
// indexer scores (compress_ratio > 0) are read up to their visible prefix only: the rest
// is -inf, never selected, so the selection is the same.
//
// Defines: TOPK_THREADS, the CTA size (a multiple of 32, 64..=1024).
#include "indexer/params.cuh"
#include "indexer/select.cuh"

// Shared memory (bytes), mirrored by `topk_smem_bytes` in src/indexer/config.rs:
//   SelectSmem (2304) | sort [sort_cap] u64 (sort_cap >= 2: the cache stays 16-byte
//   aligned) | cache [round_up(P, 4)] u32 (when cache_row; zero past the row's prefix)
// Two CTAs per SM (the host keeps a CTA under 96 KiB of shared memory): up to 64
// registers a thread, which the register-resident sort blocks of select.cuh use.
extern "C" __global__ void __launch_bounds__(TOPK_THREADS, 2) indexer_topk(const IndexerTopkParams p) {
    using namespace dsv4::indexer;
    extern __shared__ __align__(16) unsigned char smem[];
    SelectSmem& sm = *reinterpret_cast<SelectSmem*>(smem);
    u64* sort = reinterpret_cast<u64*>(smem + sizeof(SelectSmem));
    u32* cache = reinterpret_cast<u32*>(sort + p.sort_cap);
    uint4* cache4 = reinterpret_cast<uint4*>(cache);

    const i64 b = blockIdx.y, s = blockIdx.x;
    const float* row = p.scores + b * p.sc_sb + s * p.sc_ss;
    const i64 sp = p.sc_sp;
    // (query_start + s + 1) / r in 32 bits: the launcher keeps query_start + S in i32.
    const int P = p.compress_ratio > 0 ? min(p.P, static_cast<int>((static_cast<u32>(p.query_start) + static_cast<u32>(s) + 1u) / static_cast<u32>(p.compress_ratio))) : p.P;
    const int P4 = (P + 3) / 4;
    const bool cached = p.cache_row != 0;
    const bool count_top = cached && P > p.K;  // the first radix pass during the caching
    const auto global_key = [&](int i) -> u32 { return score_key(row[i * sp]); };
    if (cached) {
        if (count_top) {
            for (int i = threadIdx.x; i < SELECT_BINS; i += TOPK_THREADS) sm.hist[i] = 0;
            __syncthreads();
        }
        // Quads of keys: one 16-byte load where the row is contiguous and aligned (never
        // past the row's prefix: a partial last quad is read element by element).
        const bool vec = sp == 1 && (reinterpret_cast<u64>(row) & 15u) == 0;
        for (int start = 0; start < P4; start += TOPK_THREADS) {  // warp-uniform trip count
            const int q = start + threadIdx.x;
            uint4 k4 = make_uint4(0u, 0u, 0u, 0u);
            if (vec && 4 * q + 4 <= P) {
                const float4 v = __ldg(reinterpret_cast<const float4*>(row) + q);
                k4 = make_uint4(score_key(v.x), score_key(v.y), score_key(v.z), score_key(v.w));
            } else if (q < P4) {
                k4 = key_quad(global_key, P, q);
            }
            if (q < P4) cache4[q] = k4;
            if (count_top) count_top_bytes(sm, k4, threadIdx.x & 31);
        }
    }
    const auto key_at = [&](int i) -> u32 { return cached ? cache[i] : global_key(i); };
    const auto key4_at = [&](int q) -> uint4 { return cached ? cache4[q] : key_quad(global_key, P, q); };
    const auto val_at = [&](int i) -> float { return row[i * sp]; };
    select_topk_row<TOPK_THREADS>(key_at, key4_at, val_at, P, p.K, sm, sort, p.sort_cap, p.idx + b * p.out_sb + s * p.out_ss, p.vals + b * p.out_sb + s * p.out_ss, count_top);
}
