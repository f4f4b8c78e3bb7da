// Backward of `indexer_topk_scores` (SPEC.md section 3). For every slot t of query (b,s)
// whose index p is valid and visible and whose gradient g_t is nonzero, with
// a_h = <q[b,s,h], kv[b,p]>:
//
//   dw[b,s,h]  += g_t * scale * relu(a_h)
//   dq[b,s,h]  += g_t * scale * w[b,s,h] * [a_h > 0] * kv[b,p]
//   dkv[b,p]   += sum_h g_t * scale * w[b,s,h] * [a_h > 0] * q[b,s,h]
//
// A CTA walks `rows_per_cta` consecutive queries of one batch row in order. Per query:
// q [H,D] (f32) and the dq [H,D] / dw [H] accumulators live in shared memory; the
// selection is processed NS slots at a time: the NS gathered kv rows, then the NS*H dot
// products a (a warp per (slot, head), lanes over d, butterfly sum), then
// coef[j][h] = g_j*scale*w[h]*[a>0], then dq += coef @ kv_rows (one thread per dq element)
// and the per-slot dkv rows coef^T @ q, summed over head groups and added by the thread
// that owns column d, slot after slot. dq (q's dtype, bf16) and dw are written once per
// query. Products on CUDA cores: this is the fallback for shapes beyond the tensor-core
// backward of bwd_mma.cu (H > 64 or D > 128, or outputs not aligned for its pair stores).
//
// dkv: atomic mode adds with atomicAdd into the zeroed [B,P,D]. Deterministic mode gives
// every CTA its own zeroed partial slice [P,D]: the owner thread of column d updates it by
// plain read-modify-write in (query, slot) order, so no two threads ever touch one
// address; `indexer_bwd_reduce` then sums the slices in chunk order. Bitwise reproducible.
//
// Defines: BWD_THREADS (the CTA size, a multiple of 32), BWD_NS (slots per step).
#include "indexer/params.cuh"

namespace {

using namespace dsv4;

constexpr int NTHREADS = BWD_THREADS;
constexpr int NWARPS = NTHREADS / 32;
constexpr int NS = BWD_NS;  // slots per step
static_assert(NTHREADS % 32 == 0 && NTHREADS <= 1024, "bad CTA size");

}  // namespace

// Shared memory (f32 words unless noted), mirrored by `bwd_smem_bytes` in src/indexer/config.rs,
// with HG = max(1, min(H, NTHREADS / D)) head groups:
//   sq [H*D] | sdq [H*D] | skv [NS*D] | scoef [NS*H] | sdwp [NS*H] | spart [HG*NS*D] |
//   sw [H] | sdw [H] | sg [NS] | skey [NS] (i32)
extern "C" __global__ void __launch_bounds__(NTHREADS) indexer_bwd(const IndexerBwdParams p) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int H = p.H, D = p.D;
    const int HG = max(1, min(H, NTHREADS / D));
    float* sq = reinterpret_cast<float*>(smem);
    float* sdq = sq + H * D;
    float* skv = sdq + H * D;
    float* scoef = skv + NS * D;
    float* sdwp = scoef + NS * H;
    float* spart = sdwp + NS * H;
    float* sw = spart + HG * NS * D;
    float* sdw = sw + H;
    float* sg = sdw + H;
    int* skey = reinterpret_cast<int*>(sg + NS);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const i64 b = blockIdx.y;
    const i64 chunk = blockIdx.x;
    const i64 s_lo = chunk * p.rows_per_cta;
    const i64 s_hi = min(static_cast<i64>(p.S), s_lo + p.rows_per_cta);
    float* dkv = p.dkv + b * p.dkv_sb + chunk * p.dkv_sc;  // [P, D]: this CTA's target
    const bf16* kv_b = p.kv + b * p.kv_sb;

    for (i64 s = s_lo; s < s_hi; ++s) {
        // ---- the query's q, w; zero accumulators -------------------------------------------
        for (int e = tid; e < H * D; e += NTHREADS) {
            const int h = e / D, d = e % D;
            sq[e] = to_f32(p.q[b * p.q_sb + s * p.q_ss + h * p.q_sh + d * p.q_sd]);
            sdq[e] = 0.0f;
        }
        for (int h = tid; h < H; h += NTHREADS) {
            sw[h] = p.w[b * p.w_sb + s * p.w_ss + h * p.w_sh];
            sdw[h] = 0.0f;
        }
        const i64 vis = min(static_cast<i64>(p.P), (static_cast<i64>(p.query_start) + s + 1) / p.compress_ratio);

        for (int t0 = 0; t0 < p.T; t0 += NS) {
            // ---- slots: key (-1 = ignored) and gradient -----------------------------------
            if (tid < NS) {
                const i64 t = t0 + tid;
                i64 key = -1;
                float g = 0.0f;
                if (t < p.T) {
                    key = load_int(p.topk, b * p.t_sb + s * p.t_ss + t * p.t_st, p.topk_is_i64);
                    g = p.grad[b * p.g_sb + s * p.g_ss + t * p.g_st];
                }
                const bool valid = key >= 0 && key < vis && g != 0.0f;
                skey[tid] = valid ? static_cast<int>(key) : -1;
                sg[tid] = g * p.scale;
            }
            __syncthreads();  // also publishes sq, sw of a new query
            for (int e = tid; e < NS * D; e += NTHREADS) {
                const int j = e / D, d = e % D;
                const int key = skey[j];
                skv[e] = key >= 0 ? to_f32(kv_b[static_cast<i64>(key) * p.kv_sp + d * p.kv_sd]) : 0.0f;
            }
            __syncthreads();
            // ---- a[j][h] = q_h . kv_j; coef = g*scale*w*[a>0]; dw part = g*scale*relu(a) ----
            for (int item = warp; item < NS * H; item += NWARPS) {
                const int j = item / H, h = item % H;
                if (skey[j] < 0) {  // warp-uniform
                    if (lane == 0) scoef[item] = sdwp[item] = 0.0f;
                    continue;
                }
                float acc = 0.0f;
                for (int d = lane; d < D; d += 32) acc += sq[h * D + d] * skv[j * D + d];
                acc = warp_sum(acc);
                if (lane == 0) {
                    const bool on = acc > 0.0f;
                    scoef[item] = on ? sg[j] * sw[h] : 0.0f;
                    sdwp[item] = on ? sg[j] * acc : 0.0f;
                }
            }
            __syncthreads();
            // ---- dw += sum_j dw part; dq[h] += sum_j coef[j][h] * kv_j ----------------------
            for (int h = tid; h < H; h += NTHREADS) {
                float acc = sdw[h];
                for (int j = 0; j < NS; ++j) acc += sdwp[j * H + h];
                sdw[h] = acc;
            }
            for (int e = tid; e < H * D; e += NTHREADS) {
                const int h = e / D, d = e % D;
                float acc = sdq[e];
#pragma unroll
                for (int j = 0; j < NS; ++j) acc += scoef[j * H + h] * skv[j * D + d];
                sdq[e] = acc;
            }
            // ---- dkv rows: part[hg][j][d] = sum_{h = hg mod HG} coef[j][h] * q[h][d] --------
            for (int e = tid; e < HG * NS * D; e += NTHREADS) {
                const int hg = e / (NS * D), j = (e / D) % NS, d = e % D;
                float acc = 0.0f;
                if (skey[j] >= 0) {
                    for (int h = hg; h < H; h += HG) acc += scoef[j * H + h] * sq[h * D + d];
                }
                spart[e] = acc;
            }
            __syncthreads();
            // ---- dkv[key_j][d] += sum_hg part, by the owner of column d, slot by slot ----
            for (int d = tid; d < D; d += NTHREADS) {
                for (int j = 0; j < NS; ++j) {
                    const int key = skey[j];
                    if (key < 0) continue;
                    float v = 0.0f;
                    for (int hg = 0; hg < HG; ++hg) v += spart[(hg * NS + j) * D + d];
                    float* dst = dkv + static_cast<i64>(key) * D + d;
                    if (p.deterministic) {
                        *dst += v;
                    } else {
                        atomicAdd(dst, v);
                    }
                }
            }
            __syncthreads();  // skey, skv, scoef, spart are rewritten by the next step
        }
        // ---- dq (bf16) and dw of this query, written once ------------------------------------
        const i64 row = b * p.S + s;
        for (int e = tid; e < H * D; e += NTHREADS) p.dq[row * H * D + e] = from_f32<bf16>(sdq[e]);
        for (int h = tid; h < H; h += NTHREADS) p.dw[row * H + h] = sdw[h];
        __syncthreads();  // sq, sdq, sw, sdw are reloaded for the next query
    }
}

// dkv[b] = sum over chunks c, in order, of partial[b, c] (deterministic mode).
extern "C" __global__ void __launch_bounds__(256) indexer_bwd_reduce(const IndexerBwdReduceParams p) {
    const i64 total = static_cast<i64>(p.B) * p.n;
    for (i64 i = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += static_cast<i64>(gridDim.x) * blockDim.x) {
        const i64 b = i / p.n, e = i % p.n;
        const float* src = p.partial + b * p.n_chunks * p.n + e;
        float acc = 0.0f;
        for (int c = 0; c < p.n_chunks; ++c) acc += src[static_cast<i64>(c) * p.n];
        p.dkv[i] = acc;
    }
}
