// Reductions after the sparse-attention backward main kernel (bwd.cu), each in a fixed
// order so the deterministic backward is bitwise reproducible:
//   sparse_attn_inv_*:        deterministic dkv: per wave of rows, an inverted index (key ->
//                             its (row, slot) entries in order) and acc[g] += the sum of
//                             g's contributions in that order (_reduce: f32 rows;
//                             _reduce_f16: the Hopper kernel's fp16 rows with scales;
//                             its last wave writes dkv = bf16(acc + sum) instead)
//   sparse_attn_f32_to_bf16:  dkv = bf16(acc)
//   sparse_attn_dsinks:       dsinks[h] = sum over rows of the per-row partials
//
// Defines (the launcher's, src/sparse_attention/deterministic.rs): SA_REDUCE_GROUPS, the
// entry groups a key of sparse_attn_inv_reduce_f16 (1..8; its CTA is 64 threads a group).

#include "common.cuh"
#include "sparse_attention/params.cuh"
#include "sparse_attention/tile.cuh"

using namespace dsv4;

// Deterministic dkv (params.cuh, SparseAttnInvIndexParams): the contributions of a wave of
// rows summed per key in a fixed order, through an inverted index of rows [row_base,
// row_base + n_rows) in row blocks: built once for all rows (each wave a run of whole
// blocks) or per wave.

// counts[rb][g] += 1 for every valid slot of block rb's rows (one CTA per block).
extern "C" __global__ void __launch_bounds__(256) sparse_attn_inv_count(const SparseAttnInvIndexParams p) {
    const int rb = blockIdx.x;
    const int l0 = rb * p.rows_per_rb, l1 = min(p.n_rows, l0 + p.rows_per_rb);
    const i64 n = static_cast<i64>(max(0, l1 - l0)) * p.T;
    for (i64 i = threadIdx.x; i < n; i += blockDim.x) {
        const int row = static_cast<int>(sa::launch_row(p.row_base + l0 + static_cast<int>(i / p.T), p.rows_total, p.rows_desc)), t = static_cast<int>(i % p.T);
        const int b = row / p.S, s = row % p.S;
        const int n_slots = sa::row_slots(p.row_len, row, p.T);
        const int key = sa::slot_key(p.idx, b * p.idx_sb + s * p.idx_ss, p.idx_st, p.idx_is_i64, b * p.idx_bias, n_slots, p.K, t, false);
        if (key >= 0) atomicAdd(&p.counts[rb * p.G + static_cast<i64>(b) * p.K + key], 1);  // a count: order-free
    }
}

// Per key g: counts[rb][g] <- slots of g in blocks before rb; colptr[g + 1] <- slots of g.
// The counts of 16 row blocks are loaded before any is rewritten, so a thread has 16 loads
// in flight instead of one.
extern "C" __global__ void __launch_bounds__(256) sparse_attn_inv_scan_rb(const SparseAttnInvIndexParams p) {
    constexpr int kBatch = 16;
    for (i64 g = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x; g < p.G; g += static_cast<i64>(gridDim.x) * blockDim.x) {
        int run = 0;
        for (int rb0 = 0; rb0 < p.n_rb; rb0 += kBatch) {
            int c[kBatch];
#pragma unroll
            for (int i = 0; i < kBatch; ++i) c[i] = rb0 + i < p.n_rb ? p.counts[(rb0 + i) * p.G + g] : 0;
#pragma unroll
            for (int i = 0; i < kBatch; ++i) {
                if (rb0 + i < p.n_rb) p.counts[(rb0 + i) * p.G + g] = run;
                run += c[i];
            }
        }
        p.colptr[g + 1] = run;
    }
}

// colptr[0] = 0, colptr[g + 1] = slots of keys 0..g (one CTA of 1024 threads, blocks of
// 1024 keys in order, each an inclusive warp scan plus the warps before it).
extern "C" __global__ void __launch_bounds__(1024) sparse_attn_inv_scan_keys(const SparseAttnInvIndexParams p) {
    __shared__ int warp_tot[32];
    __shared__ int offset;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (threadIdx.x == 0) {
        offset = 0;
        p.colptr[0] = 0;
    }
    __syncthreads();
    for (i64 base = 0; base < p.G; base += 1024) {
        const i64 g = base + threadIdx.x;
        int x = g < p.G ? p.colptr[g + 1] : 0;
        for (int o = 1; o < 32; o *= 2) {
            const int y = __shfl_up_sync(DSV4_FULL_MASK, x, o);
            if (lane >= o) x += y;
        }
        if (lane == 31) warp_tot[warp] = x;
        __syncthreads();
        int before = 0, total = 0;
        for (int w = 0; w < 32; ++w) {
            before += w < warp ? warp_tot[w] : 0;
            total += warp_tot[w];
        }
        const int off = offset;
        if (g < p.G) p.colptr[g + 1] = off + before + x;
        __syncthreads();
        if (threadIdx.x == 0) offset = off + total;
        __syncthreads();
    }
}

// entries[colptr[g] + counts[rb][g] + (earlier slots of g in the block)] = local * T + t
// (local = launch row - row_base: sa::launch_row), so each key's entries run in (launch
// row, slot) order; counts[rb][g] ends at the end of block rb's entries of g. One warp per
// block walks its rows and their slots in order, 32 slots at a time; lanes holding the same
// key take ranks in lane order.
extern "C" __global__ void __launch_bounds__(32) sparse_attn_inv_fill(const SparseAttnInvIndexParams p) {
    const int rb = blockIdx.x, lane = threadIdx.x;
    const int l0 = rb * p.rows_per_rb, l1 = min(p.n_rows, l0 + p.rows_per_rb);
    i32* cursor = p.counts + rb * p.G;
    for (int local = l0; local < l1; ++local) {
        const int row = static_cast<int>(sa::launch_row(p.row_base + local, p.rows_total, p.rows_desc));
        const int b = row / p.S, s = row % p.S;
        const int n_slots = sa::row_slots(p.row_len, row, p.T);
        for (int t0 = 0; t0 < n_slots; t0 += 32) {
            const int t = t0 + lane;
            const int key = sa::slot_key(p.idx, b * p.idx_sb + s * p.idx_ss, p.idx_st, p.idx_is_i64, b * p.idx_bias, n_slots, p.K, t, false);
            const i64 g = static_cast<i64>(b) * p.K + key;
            // invalid lanes get distinct negative values: they match no one
            const u32 peers = __match_any_sync(DSV4_FULL_MASK, key >= 0 ? static_cast<long long>(g) : -1LL - lane);
            const int rank = __popc(peers & ((1u << lane) - 1u));
            const int cur = key >= 0 ? cursor[g] : 0;
            __syncwarp();  // every lane has read its cursor before a leader advances it
            if (key >= 0) {
                p.entries[p.colptr[g] + cur + rank] = local * p.T + t;
                if (rank == 0) cursor[g] = cur + __popc(peers);
            }
            __syncwarp();
        }
    }
}

// The wave's entries of key g: entries[wave_begin, wave_end), its rows being the index's row
// blocks [rb_lo, rb_hi) (fill leaves counts[rb][g] at the end of block rb's entries of g,
// relative to colptr[g]). An index built for the wave alone: rb_lo = 0, rb_hi = n_rb.
__device__ __forceinline__ int wave_begin(const SparseAttnInvIndexParams& p, i64 g) {
    return p.colptr[g] + (p.rb_lo > 0 ? p.counts[(p.rb_lo - 1) * p.G + g] : 0);
}
__device__ __forceinline__ int wave_end(const SparseAttnInvIndexParams& p, i64 g) {
    return p.colptr[g] + p.counts[(p.rb_hi - 1) * p.G + g];
}

// acc[g] = (((acc[g] + c_1) + c_2) + ...) over g's entries of the wave in order, each c the
// head blocks' contributions in order: one sequential fold per column from the first wave
// to the last, so the sum's bits do not depend on where the waves split the rows. One CTA
// per key, D/4 threads of 4 columns each.
extern "C" __global__ void __launch_bounds__(128) sparse_attn_inv_reduce(const SparseAttnInvIndexParams p) {
    const int n4 = p.D / 4;
    const int c = threadIdx.x;
    const float4* contrib = reinterpret_cast<const float4*>(p.contrib);
    float4* acc = reinterpret_cast<float4*>(p.acc);
    for (i64 g = blockIdx.x; g < p.G; g += gridDim.x) {
        const int lo = wave_begin(p, g), hi = wave_end(p, g);
        if (lo == hi || c >= n4) continue;
        float4 sum = acc[g * n4 + c];
#pragma unroll 4
        for (int e = lo; e < hi; ++e) {  // unrolled: the loads of 4 entries in flight, the adds in order
            const i64 base = (p.entries[e] - p.entry_base) * p.n_hblk;
            for (int hb = 0; hb < p.n_hblk; ++hb) {
                const float4 v = contrib[(base + hb) * n4 + c];
                sum.x += v.x;
                sum.y += v.y;
                sum.z += v.z;
                sum.w += v.w;
            }
        }
        acc[g * n4 + c] = sum;
    }
}

// The same for the Hopper backward's 16-bit contributions (bwd_sm90.cu, SA90_BWD_DET=1):
// contrib holds fp16 [n_rows, T, n_hblk, D] (each 64-column chunk in 16-byte units u = 4 k
// + c4: quad lane c4, n8 tiles 4 k .. 4 k + 3) and then the f32 scales [n_rows, T, n_hblk,
// D / 64]; acc[g] (bwd_sm90.cu's permuted flush layout, as the atomic mode leaves it) += the sum of
// g's entries of fp16 * scale over head blocks in order. One CTA per key, kGroups groups of
// D/8 threads (8 stored values, 16 bytes, each): group q sums, in order, the entries whose
// position among ALL of g's entries (every wave's) is q mod kGroups, then the groups' sums
// are added in group order (a fixed tree), so a key that most rows select (thousands of
// entries at the causal start) is not one thread's serial loop. Over several waves each
// group's running sum is kept in `partials` and the tree is taken by the last wave alone:
// the bits are those of one wave over all rows, whatever the workspace and the split.
// With one head block, a key's entry ids are staged in shared memory (a CTA's worth at a
// time, one coalesced load) and each group's values loaded kN = 4 entries at a time, so its
// loads do not wait on the entry loads one by one (the same entries in the same order:
// bitwise the same sums). CTA i takes key G - 1 - i: a selection's keys after the window's
// (DeepSeek's pooled keys, K = S + S/4) are each in hundreds to thousands of rows' slots,
// the window's in at most 128; taken first, the long keys do not start in the grid's last
// rounds and finish alone (the same sums per key, bitwise).
constexpr int kReduceGroups = SA_REDUCE_GROUPS;
static_assert(kReduceGroups >= 1 && kReduceGroups <= 8, "SA_REDUCE_GROUPS: 1..8");
// Where the Hopper backward's flush layout keeps column c (0..15) of a group of 16: column
// 8 h + 2 c4 + e at 4 c4 + 2 h + e (bwd_sm90.cu, flush_chunk).
__device__ __forceinline__ int flush_col16(int c) {
    return 4 * ((c >> 1) & 3) + 2 * (c >> 3) + (c & 1);
}
// sum[2 k], sum[2 k + 1] += the low, high fp16 of w[k] times sc.
__device__ __forceinline__ void add_f16_unit(float (&sum)[8], const uint4 v, float sc) {
    const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        float x, y;
        asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %2;\ncvt.f32.f16 %0, lo;\ncvt.f32.f16 %1, hi;\n}\n" : "=f"(x), "=f"(y) : "r"(w[k]));
        sum[2 * k] = fmaf(x, sc, sum[2 * k]);
        sum[2 * k + 1] = fmaf(y, sc, sum[2 * k + 1]);
    }
}
extern "C" __global__ void __launch_bounds__(64 * kReduceGroups, 16 / kReduceGroups) sparse_attn_inv_reduce_f16(const SparseAttnInvIndexParams p) {
    __shared__ float part[kReduceGroups > 1 ? kReduceGroups - 1 : 1][64 * 8];
    __shared__ int ids[64 * kReduceGroups];
    const int lanes = p.D / 8;  // threads of a group (64 at D = 512)
    const int t = threadIdx.x % lanes, grp = threadIdx.x / lanes;
    const int chunks = p.D / 64;
    const int ch = t / 8, qd = t % 8;
    const unsigned short* vals = reinterpret_cast<const unsigned short*>(p.contrib);
    const float* scales = reinterpret_cast<const float*>(vals + static_cast<i64>(p.n_rows) * p.T * p.n_hblk * p.D);
    for (i64 i = blockIdx.x; i < p.G; i += gridDim.x) {
        const i64 g = p.G - 1 - i;
        const int lo = wave_begin(p, g), hi = wave_end(p, g);
        const bool waves = p.partials != nullptr;
        if (lo == hi && !(waves && p.last_wave)) {  // uniform across the CTA
            if (p.dkv_out != nullptr && !waves) {
                // The last wave: the key's earlier sum (or zeros) converted (as sparse_attn_f32_to_bf16).
                for (int c = 2 * static_cast<int>(threadIdx.x); c < p.D; c += 2 * static_cast<int>(blockDim.x)) {
                    const int src = (c & ~15) + flush_col16(c & 15);  // c even: c + 1 is at src + 1
                    const float* a = p.acc + g * p.D + src;
                    *reinterpret_cast<u32*>(p.dkv_out + g * p.D + c) = pack_bf16(a[0], a[1]);
                }
            }
            continue;
        }
        // The position of entry lo among all of g's entries (earlier waves' first), and the
        // first entry of this wave that is this group's.
        const int before = waves ? (p.carried != nullptr ? p.carried[g] : lo - p.colptr[g]) : 0;
        const int skew = ((grp - before) % kReduceGroups + kReduceGroups) % kReduceGroups;
        float* const run = waves ? p.partials + (g * kReduceGroups + grp) * p.D + 8 * t : nullptr;
        float sum[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) sum[k] = waves ? run[k] : 0.0f;  // partials start as zeros
        if (p.n_hblk == 1) {
            constexpr int kN = 4;  // entries whose loads are in flight at once
            const int cta = static_cast<int>(blockDim.x);  // a multiple of kReduceGroups
            for (int c0 = lo; c0 < hi; c0 += cta) {
                const int cn = min(cta, hi - c0);
                __syncthreads();  // the previous chunk's ids are read
                if (static_cast<int>(threadIdx.x) < cn) ids[threadIdx.x] = static_cast<int>(p.entries[c0 + threadIdx.x] - p.entry_base);
                __syncthreads();
                int i = skew;  // cta is a multiple of kReduceGroups: the chunk keeps the phase
                for (; i + (kN - 1) * kReduceGroups < cn; i += kN * kReduceGroups) {
                    uint4 v[kN];
                    float sc[kN];
#pragma unroll
                    for (int u = 0; u < kN; ++u) {
                        const i64 e = ids[i + u * kReduceGroups];
                        v[u] = *reinterpret_cast<const uint4*>(vals + e * p.D + ch * 64 + 8 * qd);
                        sc[u] = scales[e * chunks + ch];
                    }
#pragma unroll
                    for (int u = 0; u < kN; ++u) add_f16_unit(sum, v[u], sc[u]);
                }
                for (; i < cn; i += kReduceGroups) {
                    const i64 e = ids[i];
                    add_f16_unit(sum, *reinterpret_cast<const uint4*>(vals + e * p.D + ch * 64 + 8 * qd), scales[e * chunks + ch]);
                }
            }
        } else {
#pragma unroll 4
            for (int e = lo + skew; e < hi; e += kReduceGroups) {  // unrolled: 4 entries' loads in flight, the adds in order
                const i64 base = (p.entries[e] - p.entry_base) * p.n_hblk;
                for (int hb = 0; hb < p.n_hblk; ++hb) {
                    add_f16_unit(sum, *reinterpret_cast<const uint4*>(vals + (base + hb) * p.D + ch * 64 + 8 * qd), scales[(base + hb) * chunks + ch]);
                }
            }
        }
        if (waves && !p.last_wave) {
            // A wave before the last: the groups' running sums wait for the next wave.
#pragma unroll
            for (int k = 0; k < 8; ++k) run[k] = sum[k];
            __syncthreads();  // every thread has read carried[g]
            if (p.carried != nullptr && threadIdx.x == 0) p.carried[g] = before + (hi - lo);
            continue;
        }
        if (grp > 0) {
#pragma unroll
            for (int k = 0; k < 8; ++k) part[grp - 1][8 * t + k] = sum[k];
        }
        __syncthreads();
        if (grp == 0) {
            // Stored position 8 qd + k of the chunk (unit qd): c4 = qd % 4, j = 4 (qd / 4) +
            // k / 2, e = k % 2, column n = 8 j + 2 c4 + e = 16 m + 8 h + 2 c4 + e (m = j / 2,
            // h = j % 2), which acc keeps at 16 m + 4 c4 + 2 h + e.
            // The last wave (dkv_out) stores bf16(acc + v) at the natural column n (pairs e = 0,
            // 1 as one bf16x2) instead of writing acc back.
            float* a = p.acc + g * p.D + ch * 64;
#pragma unroll
            for (int k = 0; k < 8; k += 2) {
                float v[2];
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    v[e] = sum[k + e];
#pragma unroll
                    for (int q = 0; q < kReduceGroups - 1; ++q) v[e] += part[q][8 * t + k + e];
                }
                const int c4 = qd % 4;
                const int j = 4 * (qd / 4) + k / 2;
                float* const at = a + 16 * (j / 2) + 4 * c4 + 2 * (j % 2);
                if (p.dkv_out != nullptr) {
                    *reinterpret_cast<u32*>(p.dkv_out + g * p.D + ch * 64 + 8 * j + 2 * c4) = pack_bf16(at[0] + v[0], at[1] + v[1]);
                } else {
                    at[0] += v[0];
                    at[1] += v[1];
                }
            }
        }
        __syncthreads();  // part is rewritten for the next key
    }
}

// dst = bf16(src), round to nearest even. permuted: dst column 16 m + 8 h + 2 c + e is src
// column 16 m + 4 c + 2 h + e (the Hopper backward's flush layout; n a multiple of 16).
extern "C" __global__ void __launch_bounds__(256) sparse_attn_f32_to_bf16(const SparseAttnConvertParams p) {
    for (i64 i = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x; i < p.n; i += static_cast<i64>(gridDim.x) * blockDim.x) {
        const i64 src = p.permuted ? (i & ~static_cast<i64>(15)) + flush_col16(static_cast<int>(i & 15)) : i;
        p.dst[i] = from_f32<bf16>(p.src[src]);
    }
}

// One CTA per head: thread t sums rows t, t + 256, ... in order, then a fixed tree.
extern "C" __global__ void __launch_bounds__(256) sparse_attn_dsinks(const SparseAttnDsinksParams p) {
    __shared__ float part[256];
    const int h = blockIdx.x;
    float sum = 0.0f;
    for (i64 r = threadIdx.x; r < p.rows; r += 256) sum += p.part[r * p.H + h];
    part[threadIdx.x] = sum;
    __syncthreads();
    for (int w = 128; w > 0; w /= 2) {
        if (static_cast<int>(threadIdx.x) < w) part[threadIdx.x] += part[threadIdx.x + w];
        __syncthreads();
    }
    if (threadIdx.x == 0) p.dsinks[h] = part[0];
}
