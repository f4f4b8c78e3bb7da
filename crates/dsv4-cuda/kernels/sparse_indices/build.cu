// build_sparse_topk_indices (SPEC.md section 6), two kernels:
//
// vision_spans: one block per batch row scans the token types once:
//   last_start[i] = last i' <= i with type 0 (0 if none)
//   first_end[i]  = first i' >= i with type 4 (S if none)
//   inside[i]     = (#starts - #ends over [0, i]) > 0, or type[i] == 4
// each thread walks a contiguous chunk; the chunks' carries come from block scans.
//
// build_indices: a block per query row (b, s), a thread per slot j:
//   window, text:   k = max(p - W + 1, 0) + j, or -1 when k > p         (p = q_positions[b,s])
//   window, vision: left = min((i - start) * inside, M - 1), right = min((end - i) * inside, M),
//                   ws = max(i - (W-1) - max(left - (W-1), 0), 0);  k = ws + j, -1 when k > i + right
//   compressed:     topk given: c + V for c >= 0 else -1;  else V + j' if j' < floor((p+1)/r) else -1
//   then k outside [0, K) -> -1, and mask[b,0,s,k] < 0 -> -1.
#include "sparse_indices/build.cuh"

#define SPAN_THREADS 512

// Inclusive block scan of `a[0..blockDim.x)` in shared memory with `op` (Hillis-Steele).
// `reverse` scans from the end (a suffix scan).
template <typename Op>
__device__ void block_scan(i64* a, Op op, bool reverse) {
    const int t = threadIdx.x, n = blockDim.x;
    for (int off = 1; off < n; off *= 2) {
        const int src = reverse ? t + off : t - off;
        const bool has = reverse ? src < n : src >= 0;
        const i64 v = has ? a[src] : 0;
        __syncthreads();
        if (has) a[t] = op(a[t], v);
        __syncthreads();
    }
}

__device__ __forceinline__ i64 token_type(const BuildIndicesParams& p, i64 b, i64 i) {
    return dsv4::load_int(p.vision_types, b * p.vt_stride[0] + i * p.vt_stride[1], p.vt_is_i64);
}

extern "C" __global__ void vision_spans(const BuildIndicesParams p) {
    __shared__ i64 depth[SPAN_THREADS];       // per chunk: starts - ends, then its inclusive prefix
    __shared__ i64 last_start[SPAN_THREADS];  // per chunk: last start in it (-1), then prefix max
    __shared__ i64 first_end[SPAN_THREADS];   // per chunk: first end in it (S), then suffix min
    const i64 b = blockIdx.x, S = p.seq_len;
    const int t = threadIdx.x, n = blockDim.x;
    const i64 chunk = (S + n - 1) / n, lo = min(S, t * chunk), hi = min(S, lo + chunk);
    i64 d = 0, ls = -1, fe = S;
    for (i64 i = lo; i < hi; ++i) {
        const i64 ty = token_type(p, b, i);
        if (ty == IMAGE_START) d += 1, ls = i;
        if (ty == IMAGE_END) d -= 1, fe = min(fe, i);
    }
    depth[t] = d, last_start[t] = ls, first_end[t] = fe;
    __syncthreads();
    block_scan(depth, [](i64 x, i64 y) { return x + y; }, false);
    block_scan(last_start, [](i64 x, i64 y) { return max(x, y); }, false);
    block_scan(first_end, [](i64 x, i64 y) { return min(x, y); }, true);
    // Carries into this chunk: from the chunks before (depth, last start) and after (first end).
    d = t > 0 ? depth[t - 1] : 0;
    ls = max(t > 0 ? last_start[t - 1] : (i64)-1, (i64)0);
    fe = t + 1 < n ? first_end[t + 1] : S;
    i32* out_start = p.spans + b * S;
    i32* out_end = p.spans + (p.batch + b) * S;
    i32* out_inside = p.spans + (2 * p.batch + b) * S;
    for (i64 i = lo; i < hi; ++i) {
        const i64 ty = token_type(p, b, i);
        if (ty == IMAGE_START) d += 1, ls = i;
        if (ty == IMAGE_END) d -= 1;
        out_start[i] = (i32)ls;
        out_inside[i] = (d > 0 || ty == IMAGE_END) ? 1 : 0;
    }
    for (i64 i = hi - 1; i >= lo; --i) {
        if (token_type(p, b, i) == IMAGE_END) fe = i;
        out_end[i] = (i32)fe;
    }
}

// floor(a / b) for b > 0 (Python's //).
__device__ __forceinline__ i64 floor_div(i64 a, i64 b) {
    const i64 q = a / b;
    return (a % b != 0 && a < 0) ? q - 1 : q;
}

extern "C" __global__ void __launch_bounds__(256) build_indices(const BuildIndicesParams p) {
    // Blocks over query rows (b, s), threads over the row's slots j.
    const i64 rows = p.batch * p.seq_len;
    for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const i64 b = row / p.seq_len, s = row % p.seq_len;
        const i64 pos = p.q_positions ? dsv4::load_int(p.q_positions, b * p.qp_stride[0] + s * p.qp_stride[1], p.qp_is_i64) : s;
        // The vision window of local position i = s (text windows use pos).
        i64 ws = 0, last = 0;
        if (p.vision) {
            const i64 i = s, W = p.window, M = p.max_image_tokens;
            const i64 start = p.spans[b * p.seq_len + i];
            const i64 end = p.spans[(p.batch + b) * p.seq_len + i];
            const i64 inside = p.spans[(2 * p.batch + b) * p.seq_len + i];
            const i64 left = min((i - start) * inside, M - 1);
            const i64 right = min((end - i) * inside, M);
            ws = max(i - (W - 1) - max(left - (W - 1), (i64)0), (i64)0);
            last = i + right;
        } else {
            ws = max(pos - p.window + 1, (i64)0);
            last = pos;
        }
        for (i64 j = threadIdx.x; j < p.width; j += blockDim.x) {
            i64 k;
            if (j < p.window_width) {
                k = ws + j;
                if (k > last) k = -1;
            } else {
                const i64 jc = j - p.window_width;
                if (p.has_compressed_topk) {
                    const i64 c = dsv4::load_int(p.compressed_topk, b * p.ct_stride[0] + s * p.ct_stride[1] + jc * p.ct_stride[2], p.ct_is_i64);
                    k = c >= 0 ? c + p.vanilla_key_len : -1;
                } else {
                    k = jc < floor_div(pos + 1, p.compress_ratio) ? p.vanilla_key_len + jc : -1;
                }
            }
            if (k < 0 || k >= p.key_len) {
                k = -1;
            } else if (p.mask) {
                const i64 off = b * p.mask_stride[0] + s * p.mask_stride[1] + k * p.mask_stride[2];
                const float m = p.mask_is_bf16 ? dsv4::to_f32(static_cast<const bf16*>(p.mask)[off]) : static_cast<const float*>(p.mask)[off];
                if (m < 0.f) k = -1;
            }
            p.out[row * p.width + j] = (i32)k;
        }
    }
}
