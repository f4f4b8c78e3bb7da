//! Tensor-core operands: bf16 inputs used in place, or packed by `pack.cu` into 16-byte rows.

use dsv4_core::{Result, TensorView};

use super::config::IdxPackConfig;
use super::params::IndexerPackParams;
use super::{strides_i64, unavailable};
use crate::runtime::{Gpu, Scratch};
use crate::tuning::configured;

/// A bf16 operand of the tensor-core loaders: base address and strides (elements) of its
/// leading dims, rows readable as whole 16-byte chunks. Holds the packed copy when one
/// was needed.
pub(super) struct TcOperand {
    pub(super) ptr: u64,
    pub(super) strides: Vec<i64>,
    _packed: Option<Scratch>,
}

/// `v` (bf16, any rank >= 2, last dim = head dim) as a tensor-core operand: used in place
/// when its last dim is contiguous, a multiple of 8 elements, and every row starts
/// 16-byte aligned; otherwise packed into a contiguous copy with the last dim padded
/// with zeros to a multiple of 8.
pub(super) fn tc_operand(gpu: &Gpu, op: &'static str, v: &TensorView) -> Result<TcOperand> {
    let st = strides_i64(v);
    let rank = v.shape().len();
    let d = v.shape()[rank - 1];
    let in_place = (st[rank - 1] == 1 || d <= 1) && d % 8 == 0 && (v.address() & 15) == 0 && st[..rank - 1].iter().all(|s| s % 8 == 0);
    if in_place {
        return Ok(TcOperand { ptr: v.address(), strides: st[..rank - 1].to_vec(), _packed: None });
    }
    if rank > 4 {
        return Err(unavailable(op, format!("cannot pack a rank-{rank} operand")));
    }
    let d_pad = d.div_ceil(8) * 8;
    // Left-pad shape and strides to rank 4.
    let mut n = [1i64; 4];
    let mut s = [0i64; 4];
    for i in 0..rank {
        n[4 - rank + i] = v.shape()[i] as i64;
        s[4 - rank + i] = st[i];
    }
    let rows: usize = v.shape()[..rank - 1].iter().product();
    let scratch = gpu.scratch(rows * d_pad * 2)?;
    let prm = IndexerPackParams { src: v.address(), dst: scratch.ptr(), s0: s[0], s1: s[1], s2: s[2], s3: s[3], n0: n[0], n1: n[1], n2: n[2], n3: n[3], n3_pad: d_pad as i64 };
    let total = rows * d_pad;
    if total > 0 {
        let k = gpu.kernel("indexer/pack.cu", "indexer_pack_bf16", &[])?;
        let per_sm = configured::<IdxPackConfig>()?.blocks_per_sm.max(1);
        let blocks = total.div_ceil(256).min(gpu.props().sm_count as usize * per_sm).max(1) as u32;
        // SAFETY: src addresses exactly the elements of `v` (its shape and strides, a live
        // device view); dst is a fresh scratch of rows*d_pad bf16; the params type is the
        // entry's.
        unsafe { k.launch([blocks, 1, 1], [256, 1, 1], 0, &prm)? };
    }
    // Contiguous [.., d_pad] strides of the leading dims.
    let mut strides = vec![0i64; rank - 1];
    let mut acc = d_pad as i64;
    for i in (0..rank - 1).rev() {
        strides[i] = if v.shape()[i] <= 1 { 0 } else { acc };
        acc *= v.shape()[i] as i64;
    }
    Ok(TcOperand { ptr: scratch.ptr(), strides, _packed: Some(scratch) })
}
