//! The backward's main kernel (`bwd_sm90.cu` on sm_90a at D = 512, `bwd.cu` elsewhere),
//! its atomic mode, and the conversions after it (dq and dkv cut back to D, dkv to bf16,
//! dsinks summed in a fixed order). The deterministic mode's waves: `deterministic.rs`.

use super::config::{bwd_defines, bwd_sm90_defines, reduce_defines, Defines, SaBwdConfig, SaDetConfig};
use super::deterministic::{self, ContribFormat, DetCall, DeterministicWaves};
use super::*;
use crate::runtime::Scratch;
use crate::tuning::configured;

/// A launch of the backward's main kernel: `bwd_sm90.cu` (`hopper`) takes the TmaDescs of q
/// and dout as its second and third parameters, the portable `bwd.cu` the params alone.
///
/// # Safety
/// As [`Kernel::launch3`] / [`Kernel::launch`]: `p` must describe live tensors as the
/// kernel reads and writes them, and `q_map`, `do_map` be maps of q and dout as
/// `[B,S,H,512]` at their strides (TMA reads only their elements), or zeros (unread) where
/// the kernel was compiled with SA90_BWD_QDO_TMA=0.
#[allow(clippy::too_many_arguments)]
unsafe fn launch_bwd(k: &Kernel, hopper: bool, grid: [u32; 3], block: [u32; 3], smem: u32, p: &BwdParams, q_map: &TmaDesc, do_map: &TmaDesc) -> Result<()> {
    // SAFETY: the caller's promise.
    unsafe {
        if hopper {
            k.launch3(grid, block, smem, p, q_map, do_map)
        } else {
            k.launch(grid, block, smem, p)
        }
    }
}

/// The backward's main kernel as every launch of one call takes it (the deterministic
/// waves set `p.chunk_base` and `p.dkv` per wave), with the packed inputs it reads kept
/// alive.
pub(super) struct MainKernel {
    k: Kernel,
    pub hopper: bool,
    block: [u32; 3],
    smem: usize,
    pub p: BwdParams,
    q_map: TmaDesc,
    do_map: TmaDesc,
    _inputs: [RowsInput; 4],
}

impl MainKernel {
    /// One launch over `grid`.
    ///
    /// # Safety
    /// As [`launch_bwd`]: every CTA of `grid` must own rows and head blocks that `p`
    /// addresses (see the callers' comments).
    pub(super) unsafe fn launch(&self, grid: [u32; 3]) -> Result<()> {
        // SAFETY: the caller's promise; the maps and inputs are this call's.
        unsafe { launch_bwd(&self.k, self.hopper, grid, self.block, self.smem as u32, &self.p, &self.q_map, &self.do_map) }
    }
}

/// What one backward call decides before its launches.
#[derive(Clone, Copy)]
struct BwdCall<'a, 'b> {
    gpu: &'a Gpu,
    a: &'a SparseAttentionBwdArgs<'b>,
    dm: Dims,
    tiles: Tiles,
    src: IndexSource,
    deterministic: bool,
    hopper: bool,
    rows_desc: bool,
    dp: usize,
}

/// The device buffers the main kernel writes: dq (the output or a padded scratch), the f32
/// dkv accumulator and the per-row dsinks partials.
struct MainBuffers {
    dq: u64,
    acc: u64,
    dsinks_part: u64,
}

/// The buffers the conversions after the main kernel read and write.
struct Finish<'a> {
    dq_pad: Option<&'a Scratch>,
    dkv_pad: Option<&'a Scratch>,
    acc: u64,
    dsinks_part: u64,
    /// The deterministic mode's last reduce wrote dkv (no conversion launch).
    converted: bool,
    /// `bwd_reduce.cu`'s defines (its conversion and dsinks kernels).
    reduce: Defines,
}

/// dq `[B,S,H,D]` bf16, dkv `[B,K,D]` bf16, dsinks `[H]` f32 (contiguous; the arguments and
/// outputs validated by dsv4-core).
pub(crate) fn backward(gpu: &Gpu, a: &SparseAttentionBwdArgs, dq: &mut TensorViewMut, dkv: &mut TensorViewMut, dsinks: &mut TensorViewMut) -> Result<()> {
    let f = &a.fwd;
    let dm = dims(f);
    let tiles = check_supported(OP_BWD, Pass::Bwd, gpu, dm, &[("q", &f.q), ("kv", &f.kv), ("out", &a.out), ("dout", &a.dout)])?;
    let src = index_source(OP_BWD, &f.indices, dm)?;
    let deterministic = a.backward_impl == BackwardImpl::Deterministic;
    // The Hopper kernel (bwd_sm90.cu) takes 64 heads a CTA; the portable one its tile's.
    let hopper = use_hopper_bwd(gpu, kernel_d(dm.d), f.reference_rounding) && dm.h.div_ceil(SA90_BWD_HEADS) <= 65_535;
    let n_hblk = bwd_head_blocks(hopper, &tiles, dm.h);
    let det_cfg = configured::<SaDetConfig>()?;
    // The Hopper kernel stores the deterministic contributions in 16 bits (fp16 per
    // 64-column chunk with an f32 scale), the portable one in f32.
    let format = ContribFormat::of_backward(hopper);
    let waves = DeterministicWaves::with_rounds(gpu.props().sm_count as usize, dm, src.t, n_hblk, a.backward_workspace_bytes, format, det_cfg.global_index, det_cfg.whole_rounds);
    // The deterministic Hopper backward takes the rows from the last to the first
    // (bwd_sm90.cu, rows_desc): its waves run from the last rows down, so the short
    // remainder wave is a causal selection's cheap first rows. The atomic one keeps B*S order.
    let rows_desc = hopper && deterministic && det_cfg.rows_desc;
    if deterministic && waves.wave_rows == 0 && dm.b * dm.s > 0 {
        let need = match format {
            ContribFormat::F32 => "T*(n_head_blocks*D + 1)*4",
            ContribFormat::F16Scaled => "T*(n_head_blocks*(2*D + D/16) + 4)",
        };
        return Err(unavailable(OP_BWD, format!("the deterministic backward needs at least {need} = {} bytes of workspace for one row's dkv contributions (D rounded up to a multiple of 64); backward_workspace_bytes = {}", waves.row_bytes, a.backward_workspace_bytes)));
    }
    let rows = dm.b * dm.s;
    // The kernels run at head dim dp (D rounded up to 64): inputs zero-padded, dq and dkv
    // computed padded and cut back to D.
    let dp = kernel_d(dm.d);
    let kvd = dm.b * dm.k * dp;
    let dq_pad = if dp != dm.d { Some(gpu.scratch(rows * dm.h * dp * 2)?) } else { None };

    // f32 accumulator of dkv (auxiliary: not part of the partial workspace)
    let acc = gpu.scratch(kvd * 4)?;
    gpu.zero(acc.ptr(), kvd * 4)?;
    let dsinks_part = gpu.scratch(rows * dm.h * 4)?;
    // dkv's bf16 destination: the output, or a [B,K,dp] scratch cut back at the end.
    let dkv_pad = if kvd > 0 && dp != dm.d { Some(gpu.scratch(kvd * 2)?) } else { None };
    let dkv_dst = dkv_pad.as_ref().map_or(out_ptr(dkv), |s| s.ptr());
    let mut converted = false;

    if rows > 0 {
        let call = BwdCall { gpu, a, dm, tiles, src, deterministic, hopper, rows_desc, dp };
        let bufs = MainBuffers { dq: dq_pad.as_ref().map_or(out_ptr(dq), |s| s.ptr()), acc: acc.ptr(), dsinks_part: dsinks_part.ptr() };
        let mut main = main_kernel(&call, &bufs)?;
        let chunks = dm.b * n_hblk * dm.s;
        if chunks > i32::MAX as usize {
            return Err(unavailable(OP_BWD, format!("B * head blocks * S = {chunks} CTAs exceed int32")));
        }
        if !deterministic {
            let grid = if hopper { [rows as u32, n_hblk as u32, 1] } else { [chunks as u32, 1, 1] };
            // SAFETY: as the forward's launch for q, kv, the index source; out and dout
            // pass the same row rules (`rows_input`); lse is a validated [B,S,H] f32 view
            // read through its strides; dq is a contiguous [B,S,H,D] output; `dkv` is the
            // zeroed [B,K,D] f32 accumulator and `dsinks_part` [B*S,H] f32, both live
            // until the end of this function (stream-ordered frees); chunk c covers
            // exactly one row, c < B*n_hblk*S = the grid. Hopper: CTA (x, y) owns row x < B*S
            // (chunk_base = 0; B*S - 1 - x with rows_desc) and heads [64y, 64y + 64), y <
            // n_hblk = ceil(H/64).
            unsafe { main.launch(grid)? };
        } else {
            // The global index is kept with a plan (`SaDetConfig::plan_index`).
            let plan = match &a.fwd.indices {
                SparseIndices::Plan(pl) if det_cfg.plan_index => Some(*pl),
                _ => None,
            };
            let det = DetCall { gpu, dm, src, waves, format, n_hblk, dp, rows_desc, plan, acc: acc.ptr(), dkv_dst, cfg: det_cfg };
            converted = deterministic::run(&det, &mut main)?;
        }
    }
    let fin = Finish { dq_pad: dq_pad.as_ref(), dkv_pad: dkv_pad.as_ref(), acc: acc.ptr(), dsinks_part: dsinks_part.ptr(), converted, reduce: reduce_defines(&det_cfg) };
    finish(gpu, dm, hopper, dp, &fin, dq, dkv, dsinks)
}

/// The main kernel of this call: its inputs as the loaders read them, the TMA maps of q and
/// dout (Hopper), the kernel compiled for the mode, and its params.
fn main_kernel(c: &BwdCall, bufs: &MainBuffers) -> Result<MainKernel> {
    let BwdCall { gpu, a, dm, tiles, deterministic, hopper, dp, .. } = *c;
    let f = &a.fwd;
    let inputs = [rows_input(gpu, &f.q, dp)?, rows_input(gpu, &f.kv, dp)?, rows_input(gpu, &a.out, dp)?, rows_input(gpu, &a.dout, dp)?];
    let (smem, k, block, q_map, do_map) = if hopper {
        let cfg = configured::<SaBwdConfig>()?;
        // bwd_sm90.cu's Q and dO tiles by TMA where both can be mapped (else by the
        // producer's cp.async): the kernel is compiled for the maps passed.
        let maps = if cfg.qdo_tma {
            let map = |v: &RowsInput| {
                let (dims, strides) = sa90_q_map_shape([dm.b, dm.s, dm.h], &v.strides);
                gpu.tma_map_bf16(v.ptr, &dims, &strides, &SA90_Q_BOX).ok()
            };
            map(&inputs[0]).zip(map(&inputs[3]))
        } else {
            None
        };
        let k = gpu.kernel("sparse_attention/bwd_sm90.cu", "sparse_attn_bwd_sm90", &bwd_sm90_defines(&cfg, deterministic, maps.is_some()))?;
        let (q_map, do_map) = maps.unwrap_or((TmaDesc::ZERO, TmaDesc::ZERO));
        (SA90_BWD_SMEM_BYTES, k, [384u32, 1, 1], q_map, do_map)
    } else {
        let k = gpu.kernel("sparse_attention/bwd.cu", "sparse_attn_bwd", &bwd_defines(dp, &tiles, f.reference_rounding))?;
        (bwd_smem_bytes(dp, tiles.hb, tiles.bn), k, [tiles.threads(dp) as u32, 1, 1], TmaDesc::ZERO, TmaDesc::ZERO)
    };
    let p = bwd_params(c, &inputs, bufs, smem);
    Ok(MainKernel { k, hopper, block, smem, p, q_map, do_map, _inputs: inputs })
}

/// The main kernel's params: `ins` = q, kv, out, dout as the loaders read them.
fn bwd_params(c: &BwdCall, ins: &[RowsInput; 4], bufs: &MainBuffers, smem: usize) -> BwdParams {
    let BwdCall { a, dm, src, deterministic, rows_desc, .. } = *c;
    let f = &a.fwd;
    let [q, kv, out, dout] = ins;
    let lse_st = strides_i64(&a.lse);
    BwdParams {
        q: q.ptr,
        kv: kv.ptr,
        sinks: f.sinks.address(),
        idx: src.ptr,
        row_len: src.row_len,
        out: out.ptr,
        dout: dout.ptr,
        lse: a.lse.address(),
        dq: bufs.dq,
        dkv: bufs.acc,
        dsinks_part: bufs.dsinks_part,
        q_sb: q.strides[0],
        q_ss: q.strides[1],
        q_sh: q.strides[2],
        kv_sb: kv.strides[0],
        kv_sk: kv.strides[1],
        idx_sb: src.sb,
        idx_ss: src.ss,
        idx_st: src.st,
        idx_bias: src.bias,
        sinks_sh: f.sinks.strides()[0] as i64,
        o_sb: out.strides[0],
        o_ss: out.strides[1],
        o_sh: out.strides[2],
        do_sb: dout.strides[0],
        do_ss: dout.strides[1],
        do_sh: dout.strides[2],
        lse_sb: lse_st[0],
        lse_ss: lse_st[1],
        lse_sh: lse_st[2],
        b: dm.b as i32,
        s: dm.s as i32,
        h: dm.h as i32,
        k: dm.k as i32,
        t: src.t as i32,
        idx_is_i64: src.is_i64,
        smem_bytes: smem as i32,
        rows_per_chunk: 1,
        chunks_per_bh: dm.s as i32,
        chunk_base: 0,
        deterministic: deterministic as i32,
        all_rows_nonempty: f.all_rows_nonempty as i32,
        sm_scale: f.sm_scale,
        rows_desc: rows_desc as i32,
    }
}

/// dq cut back to D, dkv = bf16(acc) unless the deterministic mode's last reduce wrote it,
/// dsinks summed over the rows.
#[allow(clippy::too_many_arguments)]
fn finish(gpu: &Gpu, dm: Dims, hopper: bool, dp: usize, fin: &Finish, dq: &mut TensorViewMut, dkv: &mut TensorViewMut, dsinks: &mut TensorViewMut) -> Result<()> {
    let rows = dm.b * dm.s;
    let kvd = dm.b * dm.k * dp;
    let (acc, dsinks_part, converted) = (fin.acc, fin.dsinks_part, fin.converted);
    let dkv_dst = fin.dkv_pad.map_or(out_ptr(dkv), |s| s.ptr());
    // dq cut back to D; dkv = bf16(acc) (unless the deterministic mode's last reduce wrote
    // it; padded: through a bf16 [B,K,dp] scratch, then cut back); dsinks = fixed-order sum
    // of the per-row partials
    if let Some(s) = fin.dq_pad {
        // SAFETY: the scratch holds [B*S*H, dp] bf16 written by the main kernel (every row
        // and head: rows > 0 launched it; rows == 0 copies nothing); dq is [B*S*H, D].
        unsafe { unpad(gpu, s.ptr(), rows * dm.h, dp, out_ptr(dq), dm.d)? };
    }
    if kvd > 0 {
        if !converted {
            let conv = gpu.kernel("sparse_attention/bwd_reduce.cu", "sparse_attn_f32_to_bf16", &fin.reduce)?;
            // The Hopper kernel writes acc's columns permuted within groups of 16 (its flush layout).
            let c = ConvertParams { src: acc, dst: dkv_dst, n: kvd as i64, permuted: hopper as i32, pad_: 0 };
            // SAFETY: `acc` holds B*K*dp f32; dst is the contiguous [B,K,D] bf16 output (dp ==
            // D) or a [B,K,dp] bf16 scratch.
            unsafe { conv.launch([grid_for(gpu, kvd), 1, 1], [256, 1, 1], 0, &c)? };
        }
        if let Some(s) = fin.dkv_pad {
            // SAFETY: the scratch holds [B*K, dp] bf16 written above; dkv is [B*K, D].
            unsafe { unpad(gpu, s.ptr(), dm.b * dm.k, dp, out_ptr(dkv), dm.d)? };
        }
    }
    let ds = gpu.kernel("sparse_attention/bwd_reduce.cu", "sparse_attn_dsinks", &fin.reduce)?;
    let d = DsinksParams { part: dsinks_part, dsinks: out_ptr(dsinks), rows: rows as i64, h: dm.h as i32, pad_: 0 };
    // SAFETY: `dsinks_part` holds [rows, H] f32, every entry written by the main kernel
    // (rows > 0) or none read (rows == 0); dsinks is a contiguous [H] f32 output; one CTA
    // per head (H fits in int32).
    unsafe { ds.launch([dm.h as u32, 1, 1], [256, 1, 1], 0, &d) }
}

/// Heads per CTA of `bwd_sm90.cu` (its wgmma M).
pub const SA90_BWD_HEADS: usize = 64;

/// Dynamic shared memory of `bwd_sm90.cu` (`kSa90BwdSmemBytes`: Q and dO, a ring of two
/// 32-key K/V blocks, the dS, P^T and dS^T tiles, the ring's slot keys, lse and delta, the
/// nonempty-row flag, the producer's 1024 slot keys, barriers, 1024 bytes of alignment slack).
pub const SA90_BWD_SMEM_BYTES: usize = 2 * 64 * 1024 + 2 * 32 * 1024 + 3 * 8 * 1024 + 256 + 2 * 256 + 16 + 4096 + 7 * 8 + 1024;
const _: () = assert!(SA90_BWD_SMEM_BYTES == 227_144, "bwd_sm90.cu asserts the same number");

/// Whether the backward runs the Hopper kernel: an sm_90a device (and not DSV4_PORTABLE=1),
/// kernel head dim 512, the default exp2 arithmetic (`reference_rounding` runs the portable
/// kernel's natural-exp variant).
pub fn use_hopper_bwd(gpu: &Gpu, dp: usize, reference_rounding: bool) -> bool {
    gpu.hopper() && dp == 512 && !reference_rounding && SA90_BWD_SMEM_BYTES <= gpu.props().max_shared_per_block_optin as usize
}

/// Head blocks of the backward kernel that runs: 64 heads a CTA on the Hopper path, the
/// portable tile's `hb` otherwise. The deterministic contributions are `[rows, T, n_hblk,
/// D]`, so the workspace and its waves are sized with this number.
pub fn bwd_head_blocks(hopper: bool, tiles: &Tiles, h: usize) -> usize {
    if hopper {
        h.div_ceil(SA90_BWD_HEADS)
    } else {
        tiles.head_blocks(h)
    }
}
