//! Index plans in the cuDNN layout of SPEC.md section 6, built on the GPU (`plan.cu`).

use super::*;

/// A plan in the cuDNN layout of SPEC.md section 6, built on the GPU with no host round
/// trip: `indices` i32 `[B*S,1,T]` global `b*K+k` ascending (duplicates kept) then -1,
/// `topk_length` i32 `[B*S]`, and unless `all_rows_nonempty`, `valid_rows` i64 `[B*S]`:
/// the nonempty rows ascending, then -1 (a fixed length, so no count is read back).
/// dsv4-core checked the selection and that B*K fits in int32.
pub(crate) fn plan(gpu: &Gpu, topk_idxs: &TensorView, kv_len: usize, all_rows_nonempty: bool) -> Result<SparseIndexPlan> {
    plan_impl(OP_PLAN, gpu, topk_idxs, kv_len, all_rows_nonempty)
}

/// `plan` for `op`; the caller has checked that B*K (the global coordinates) fits in int32.
pub(super) fn plan_impl(op: &'static str, gpu: &Gpu, topk_idxs: &TensorView, kv_len: usize, all_rows_nonempty: bool) -> Result<SparseIndexPlan> {
    let (b, s, t) = (topk_idxs.shape()[0], topk_idxs.shape()[1], topk_idxs.shape()[2]);
    let rows = b * s;
    if rows > i32::MAX as usize || t > i32::MAX as usize {
        return Err(unavailable(op, format!("B*S = {rows} and T = {t} must fit in int32")));
    }
    let sort_cap = t.max(1).next_power_of_two();
    let smem = sort_cap * 4;
    let smem_max = gpu.props().max_shared_per_block_optin as usize;
    if smem > smem_max {
        return Err(unavailable(op, format!("T = {t} slots per row: the row sort needs {smem} bytes of shared memory, the device has {smem_max}")));
    }
    let indices = gpu.alloc(DType::I32, &[rows, 1, t])?;
    let lengths = gpu.alloc(DType::I32, &[rows])?;
    if rows > 0 {
        let st = strides_i64(topk_idxs);
        let p = PlanParams {
            idx: topk_idxs.address(),
            indices: indices.view().address(),
            lengths: lengths.view().address(),
            idx_sb: st[0],
            idx_ss: st[1],
            idx_st: st[2],
            b: b as i32,
            s: s as i32,
            t: t as i32,
            k: kv_len as i32,
            sort_cap: sort_cap as i32,
            idx_is_i64: (topk_idxs.dtype() == DType::I64) as i32,
        };
        let k = gpu.kernel("sparse_attention/plan.cu", "sparse_attn_plan_rows", &[])?;
        let threads = (sort_cap / 2).clamp(32, 1024) as u32;
        // SAFETY: topk_idxs is a validated [B,S,T] integer view read through its strides;
        // indices [B*S,1,T] and lengths [B*S] are fresh contiguous i32 tensors; the shared
        // sort buffer holds sort_cap ints (checked against the device limit above).
        unsafe { k.launch([rows as u32, 1, 1], [threads, 1, 1], smem as u32, &p)? };
    }
    let valid_rows = if all_rows_nonempty {
        None
    } else {
        let v = gpu.alloc(DType::I64, &[rows])?;
        if rows > 0 {
            let k = gpu.kernel("sparse_attention/plan.cu", "sparse_attn_valid_rows", &[])?;
            let p = ValidRowsParams { lengths: lengths.view().address(), valid_rows: v.view().address(), rows: rows as i64 };
            // SAFETY: lengths holds B*S i32 (written by the launch above, same stream);
            // valid_rows is a fresh [B*S] i64 tensor; one CTA of 1024 threads.
            unsafe { k.launch([1, 1, 1], [1024, 1, 1], 0, &p)? };
        }
        Some(v)
    };
    Ok(SparseIndexPlan { backend: "cuda", indices, topk_length: Some(lengths), valid_rows, kv_len, batch: b, seq: s, slots: t, all_rows_nonempty, derived: Default::default() })
}
