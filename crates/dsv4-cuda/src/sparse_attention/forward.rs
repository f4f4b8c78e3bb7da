//! The forward (`fwd_sm90.cu` on sm_90a at D = 512, `fwd.cu` elsewhere) and the dense
//! oracle (`fwd.cu` with `SA_DEDUP=1` over a sorted plan).

use super::config::{fwd_defines, fwd_sm90_defines, SaFwdConfig};
use super::*;
use crate::tuning::configured;

/// out `[B,S,H,D]` bf16, lse `[B,S,H]` f32 (contiguous; the arguments and outputs validated
/// by dsv4-core).
pub(crate) fn forward(gpu: &Gpu, a: &SparseAttentionArgs, out: &mut TensorViewMut, lse: &mut TensorViewMut) -> Result<()> {
    let dm = dims(a);
    let tiles = check_supported(OP_FWD, Pass::Fwd, gpu, dm, &[("q", &a.q), ("kv", &a.kv)])?;
    let src = index_source(OP_FWD, &a.indices, dm)?;
    run_forward(gpu, a, dm, tiles, src, false, out_ptr(out), out_ptr(lse))
}

/// The dense oracle: the forward over each row's *set* of keys. The row is sorted (a plan,
/// built here unless given) and a key equal to its predecessor is masked.
pub(crate) fn dense(gpu: &Gpu, a: &SparseAttentionArgs, out: &mut TensorViewMut) -> Result<()> {
    let dm = dims(a);
    let tiles = check_supported(OP_DENSE, Pass::Fwd, gpu, dm, &[("q", &a.q), ("kv", &a.kv)])?;
    let owned;
    let plan = match &a.indices {
        SparseIndices::Plan(p) => *p,
        SparseIndices::TopK(idx) => {
            // The plan's global coordinates b*K + k in int32 (plan_sparse_indices' check).
            if (dm.b as u64) * (dm.k as u64) > i32::MAX as u64 {
                return Err(unavailable(OP_DENSE, format!("B*K = {} must fit in int32", dm.b * dm.k)));
            }
            owned = plan_impl(OP_DENSE, gpu, idx, dm.k, true)?;
            &owned
        }
    };
    let src = plan_source(OP_DENSE, plan, dm)?;
    let lse = gpu.scratch(dm.b * dm.s * dm.h * 4)?;
    run_forward(gpu, a, dm, tiles, src, true, out_ptr(out), lse.ptr())
}

/// Dynamic shared memory of `fwd_sm90.cu` (`kSa90SmemBytes`: Q, two 64-key K/V blocks, two
/// P tiles, the blocks' slot keys, the published maxima, row sums, the producer's 1024 slot
/// keys, barriers, 1024 bytes of alignment slack).
pub const SA90_FWD_SMEM_BYTES: usize = 64 * 1024 + 2 * 64 * 1024 + 2 * 8 * 1024 + 3 * 512 + 4096 + 11 * 8 + 1024;
const _: () = assert!(SA90_FWD_SMEM_BYTES == 219_736, "fwd_sm90.cu asserts the same number");

/// Whether the forward runs the Hopper kernel: an sm_90a device (and not DSV4_PORTABLE=1),
/// kernel head dim 512, the default exp2 arithmetic, no dedup (the dense oracle).
pub fn use_hopper_fwd(gpu: &Gpu, dp: usize, reference_rounding: bool, dedup: bool) -> bool {
    gpu.hopper() && dp == 512 && !reference_rounding && !dedup && SA90_FWD_SMEM_BYTES <= gpu.props().max_shared_per_block_optin as usize
}

/// The box of `fwd_sm90.cu`'s Q loads by TMA: one SW128 group, 64 columns x 64 heads.
pub(super) const SA90_Q_BOX: [u32; 4] = [64, 64, 1, 1];

/// q `[B,S,H,512]` (element `strides` of b, s, h; d-stride 1) as the 4D tensor map of
/// `fwd_sm90.cu`'s Q loads: dims {512, H, S, B} innermost first and the byte strides of H, S,
/// B. A dim of size 1 is only read at coordinate 0, so its stride (which a view may give any
/// value) is replaced by the one its extent implies.
pub(super) fn sa90_q_map_shape([b, s, h]: [usize; 3], strides: &[i64]) -> ([u64; 4], [u64; 3]) {
    let bytes = |st: i64| u64::try_from(st).map_or(0, |v| v.saturating_mul(2));  // negative: 0, refused
    let sh = if h == 1 { 512 * 2 } else { bytes(strides[2]) };
    let ss = if s == 1 { sh.saturating_mul(h as u64) } else { bytes(strides[1]) };
    let sb = if b == 1 { ss.saturating_mul(s as u64) } else { bytes(strides[0]) };
    ([512, h as u64, s as u64, b as u64], [sh, ss, sb])
}

fn run_forward(gpu: &Gpu, a: &SparseAttentionArgs, dm: Dims, tiles: Tiles, src: IndexSource, dedup: bool, out: u64, lse: u64) -> Result<()> {
    if dm.b * dm.s == 0 {
        return Ok(());
    }
    let dp = kernel_d(dm.d);
    let q = rows_input(gpu, &a.q, dp)?;
    let kv = rows_input(gpu, &a.kv, dp)?;
    // D not a multiple of 64: the kernel writes a padded out, cut back below.
    let out_pad = if dp != dm.d { Some(gpu.scratch(dm.b * dm.s * dm.h * dp * 2)?) } else { None };
    // The Hopper kernel (fwd_sm90.cu): D = 512, 64 heads a CTA, exp2 arithmetic, no dedup.
    let hopper = use_hopper_fwd(gpu, dp, a.reference_rounding, dedup);
    let cfg = configured::<SaFwdConfig>()?;
    // Its Q tiles by TMA where q can be mapped (else by the producer's cp.async): the kernel
    // is compiled for the map passed.
    let q_map = if hopper && cfg.q_tma {
        let (dims, strides) = sa90_q_map_shape([dm.b, dm.s, dm.h], &q.strides);
        gpu.tma_map_bf16(q.ptr, &dims, &strides, &SA90_Q_BOX).ok()
    } else {
        None
    };
    let (smem, k, block, grid_y) = if hopper {
        let k = gpu.kernel("sparse_attention/fwd_sm90.cu", "sparse_attn_fwd_sm90", &fwd_sm90_defines(q_map.is_some()))?;
        (SA90_FWD_SMEM_BYTES, k, 384u32, dm.h.div_ceil(64))
    } else {
        let k = gpu.kernel("sparse_attention/fwd.cu", "sparse_attn_fwd", &fwd_defines(dp, &tiles, a.reference_rounding, dedup))?;
        (fwd_smem_bytes(dp, tiles.hb, tiles.bn), k, tiles.threads(dp) as u32, tiles.head_blocks(dm.h))
    };
    let p = FwdParams {
        q: q.ptr,
        kv: kv.ptr,
        sinks: a.sinks.address(),
        idx: src.ptr,
        row_len: src.row_len,
        out: out_pad.as_ref().map_or(out, |o| o.ptr()),
        lse,
        q_sb: q.strides[0],
        q_ss: q.strides[1],
        q_sh: q.strides[2],
        kv_sb: kv.strides[0],
        kv_sk: kv.strides[1],
        idx_sb: src.sb,
        idx_ss: src.ss,
        idx_st: src.st,
        idx_bias: src.bias,
        sinks_sh: a.sinks.strides()[0] as i64,
        b: dm.b as i32,
        s: dm.s as i32,
        h: dm.h as i32,
        k: dm.k as i32,
        t: src.t as i32,
        idx_is_i64: src.is_i64,
        smem_bytes: smem as i32,
        sm_scale: a.sm_scale,
    };
    // fwd_sm90.cu runs one wave of CTAs (one an SM), each taking rows x, x + grid x, ... of
    // its head block (`SaFwdConfig::ctas` caps the wave). The portable kernel takes one row
    // a CTA.
    let grid_x = if hopper {
        let cap = if cfg.ctas > 0 { cfg.ctas as usize } else { usize::MAX };
        let wave = cap.min((gpu.props().sm_count as usize / grid_y).max(1));
        (dm.b * dm.s).min(wave)
    } else {
        dm.b * dm.s
    };
    let grid = [grid_x as u32, grid_y as u32, 1];
    // SAFETY: q and kv meet the loaders' row rules (`rows_input`: d-stride 1, 16-byte
    // aligned rows, or a packed copy kept alive here); the index source was validated as
    // [B,S,T] (or a cuda plan [B*S,1,T] with its [B*S] lengths) and masked slots are never
    // dereferenced; out (or the padded [B,S,H,dp] scratch) and lse are contiguous
    // [B,S,H,D] / [B,S,H] outputs (checked by the caller); B*S, K, T fit in int32; `smem`
    // is this tile's layout, which the kernel checks. fwd_sm90.cu's second parameter is a
    // TmaDesc: q's map (q as [B,S,H,512] at its strides: TMA reads only elements of q) when
    // the kernel was compiled for it (SA90_Q_TMA=1), zeros (unread) otherwise.
    if hopper {
        unsafe { k.launch2(grid, [block, 1, 1], smem as u32, &p, &q_map.unwrap_or(TmaDesc::ZERO))? };
    } else {
        unsafe { k.launch(grid, [block, 1, 1], smem as u32, &p)? };
    }
    if let Some(o) = &out_pad {
        // SAFETY: the scratch holds [B*S*H, dp] bf16 written above; out is [B*S*H, D].
        unsafe { unpad(gpu, o.ptr(), dm.b * dm.s * dm.h, dp, out, dm.d)? };
    }
    Ok(())
}
