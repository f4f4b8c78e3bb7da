// Per-row top-k of f32 scores (SPEC.md section 3): the K = min(k, P) largest finite
// scores, descending, ties to the lower index, (-1, -inf) past the row's finite count.
// One CTA per row runs the block-wide exact selection of select.cuh (radix select on
// order-preserving keys, bitonic sort of the keys above the threshold, ties at the
// threshold in index order). The row's keys are cached in shared memory when they fit;
// otherwise every pass streams the row from global memory (long rows).
// dsv4-test-defines: TOPK_THREADS=64
// dsv4-test-defines: TOPK_THREADS=256
// dsv4-test-defines: TOPK_THREADS=512
#include "indexer/params.cuh"
#include "indexer/select.cuh"

#ifndef TOPK_THREADS
#define TOPK_THREADS 128
#endif

// Shared memory (bytes), mirrored by `topk_smem_bytes` in src/indexer.rs:
//   SelectSmem (2304) | sort [sort_cap] u64 | cache [P] u32 (when cache_row)
// Two CTAs per SM (the host keeps a CTA under 96 KiB of shared memory): up to 64
// registers a thread, which the register-resident sort blocks of select.cuh use.
extern "C" __global__ void __launch_bounds__(TOPK_THREADS, 2) indexer_topk(const IndexerTopkParams p) {
    using namespace dsv4::indexer;
    extern __shared__ __align__(16) unsigned char smem[];
    SelectSmem& sm = *reinterpret_cast<SelectSmem*>(smem);
    u64* sort = reinterpret_cast<u64*>(smem + sizeof(SelectSmem));
    u32* cache = reinterpret_cast<u32*>(sort + p.sort_cap);

    const i64 b = blockIdx.y, s = blockIdx.x;
    const float* row = p.scores + b * p.sc_sb + s * p.sc_ss;
    const i64 sp = p.sc_sp;
    const bool cached = p.cache_row != 0;
    if (cached) {
        for (int i = threadIdx.x; i < p.P; i += TOPK_THREADS) cache[i] = score_key(row[i * sp]);
    }
    const auto key_at = [&](int i) -> u32 { return cached ? cache[i] : score_key(row[i * sp]); };
    const auto val_at = [&](int i) -> float { return row[i * sp]; };
    select_topk_row<TOPK_THREADS>(key_at, val_at, p.P, p.K, sm, sort, p.sort_cap, p.idx + b * p.out_sb + s * p.out_ss, p.vals + b * p.out_sb + s * p.out_ss);
}
