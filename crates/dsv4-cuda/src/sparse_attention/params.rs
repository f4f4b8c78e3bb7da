//! The params structs: mirrors of `kernels/sparse_attention/params.cuh` (field comments
//! there), with their sizes checked against the headers (`tests/params_layout.rs`).

use std::mem::size_of;

/// Mirrors `SparseAttnFwdParams`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct FwdParams {
    pub q: u64,       // [B,S,H,D] bf16
    pub kv: u64,      // [B,K,D] bf16
    pub sinks: u64,   // [H] f32
    pub idx: u64,     // [B,S,T] i32/i64, or a plan's [B*S,1,T] i32 global coordinates
    pub row_len: u64, // [B*S] i32 or 0
    pub out: u64,     // [B,S,H,D] bf16 out
    pub lse: u64,     // [B,S,H] f32 out
    pub q_sb: i64,
    pub q_ss: i64,
    pub q_sh: i64,
    pub kv_sb: i64,
    pub kv_sk: i64,
    pub idx_sb: i64,
    pub idx_ss: i64,
    pub idx_st: i64,
    pub idx_bias: i64,
    pub sinks_sh: i64,
    pub b: i32,
    pub s: i32,
    pub h: i32,
    pub k: i32,
    pub t: i32,
    pub idx_is_i64: i32,
    pub smem_bytes: i32,
    pub sm_scale: f32,
}

/// Mirrors `SparseAttnBwdParams`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct BwdParams {
    pub q: u64,           // [B,S,H,D] bf16
    pub kv: u64,          // [B,K,D] bf16
    pub sinks: u64,       // [H] f32
    pub idx: u64,         // as FwdParams::idx
    pub row_len: u64,     // [B*S] i32 or 0
    pub out: u64,         // [B,S,H,D] bf16
    pub dout: u64,        // [B,S,H,D] bf16
    pub lse: u64,         // [B,S,H] f32
    pub dq: u64,          // [B,S,H,D] bf16 out
    pub dkv: u64,         // atomic: [B,K,D] f32; deterministic: [wave rows, T, n_hblk, D] f32 contributions
    pub dsinks_part: u64, // [B*S, H] f32 out
    pub q_sb: i64,
    pub q_ss: i64,
    pub q_sh: i64,
    pub kv_sb: i64,
    pub kv_sk: i64,
    pub idx_sb: i64,
    pub idx_ss: i64,
    pub idx_st: i64,
    pub idx_bias: i64,
    pub sinks_sh: i64,
    pub o_sb: i64,
    pub o_ss: i64,
    pub o_sh: i64,
    pub do_sb: i64,
    pub do_ss: i64,
    pub do_sh: i64,
    pub lse_sb: i64,
    pub lse_ss: i64,
    pub lse_sh: i64,
    pub b: i32,
    pub s: i32,
    pub h: i32,
    pub k: i32,
    pub t: i32,
    pub idx_is_i64: i32,
    pub smem_bytes: i32,
    pub rows_per_chunk: i32,
    pub chunks_per_bh: i32,
    pub chunk_base: i32,
    pub deterministic: i32,
    pub all_rows_nonempty: i32,
    pub sm_scale: f32,
    pub rows_desc: i32, // bwd_sm90.cu: launch row v is row B*S - 1 - v
}

/// Mirrors `SparseAttnInvIndexParams`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct InvIndexParams {
    pub idx: u64,     // as BwdParams::idx
    pub row_len: u64, // [B*S] i32 or 0
    pub counts: u64,  // [n_rb, G] i32
    pub colptr: u64,  // [G + 1] i32
    pub entries: u64, // [n_rows * T] i32
    pub contrib: u64, // [n_rows, T, n_hblk, D] f32
    pub acc: u64,     // [G, D] f32 in/out
    pub idx_sb: i64,
    pub idx_ss: i64,
    pub idx_st: i64,
    pub idx_bias: i64,
    pub g: i64,
    pub row_base: i32,
    pub n_rows: i32,
    pub rows_per_rb: i32,
    pub n_rb: i32,
    pub s: i32,
    pub k: i32,
    pub t: i32,
    pub d: i32,
    pub n_hblk: i32,
    pub idx_is_i64: i32,
    pub entry_base: i64, // reduce: entry id of the wave's first contribution
    pub rb_lo: i32,      // reduce: the wave's row blocks of the index
    pub rb_hi: i32,
    pub rows_desc: i32,  // the main kernel's BwdParams::rows_desc: launch row v is row rows_total - 1 - v
    pub rows_total: i32, // B*S
    pub dkv_out: u64,    // reduce_f16's last wave: [G, D] bf16 written as bf16(acc + sum); 0: acc += sum
    pub partials: u64,   // reduce_f16 over several waves: [G, groups, D] f32 running group sums (zeroed); 0: one wave
    pub carried: u64,    // reduce_f16, an index per wave: [G] i32 entries of each key in earlier waves (zeroed); 0: global index
    pub last_wave: i32,  // 1: the last wave's reduce (it adds the groups' sums)
    pub pad_: i32,
}

/// Mirrors `SparseAttnConvertParams`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ConvertParams {
    pub src: u64, // [n] f32
    pub dst: u64, // [n] bf16 out
    pub n: i64,
    pub permuted: i32, // 1: src columns permuted within groups of 16 (bwd_sm90.cu's flush layout)
    pub pad_: i32,
}

/// Mirrors `SparseAttnDsinksParams`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct DsinksParams {
    pub part: u64,   // [rows, H] f32
    pub dsinks: u64, // [H] f32 out
    pub rows: i64,
    pub h: i32,
    pub pad_: i32,
}

/// Mirrors `SparseAttnPlanParams`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct PlanParams {
    pub idx: u64,     // [B,S,T] i32/i64
    pub indices: u64, // [B*S,1,T] i32 out
    pub lengths: u64, // [B*S] i32 out
    pub idx_sb: i64,
    pub idx_ss: i64,
    pub idx_st: i64,
    pub b: i32,
    pub s: i32,
    pub t: i32,
    pub k: i32,
    pub sort_cap: i32,
    pub idx_is_i64: i32,
}

/// Mirrors `SparseAttnValidRowsParams`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ValidRowsParams {
    pub lengths: u64,    // [rows] i32
    pub valid_rows: u64, // [rows] i64 out
    pub rows: i64,
}

/// Mirrors `SparseAttnPackParams`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct PackParams {
    pub src: u64,
    pub dst: u64,
    pub s: [i64; 4],
    pub n: [i64; 4],
    pub n3_dst: i64,
}

const _: () = assert!(size_of::<FwdParams>() == 168);
const _: () = assert!(size_of::<BwdParams>() == 296);
const _: () = assert!(size_of::<InvIndexParams>() == 192);
const _: () = assert!(size_of::<ConvertParams>() == 32);
const _: () = assert!(size_of::<DsinksParams>() == 32);
const _: () = assert!(size_of::<PlanParams>() == 72);
const _: () = assert!(size_of::<ValidRowsParams>() == 24);
const _: () = assert!(size_of::<PackParams>() == 88);

/// `(params struct name, size in bytes)` of every params struct of this family.
pub const PARAMS_SIZES: &[(&str, usize)] = &[
    ("SparseAttnFwdParams", size_of::<FwdParams>()),
    ("SparseAttnBwdParams", size_of::<BwdParams>()),
    ("SparseAttnInvIndexParams", size_of::<InvIndexParams>()),
    ("SparseAttnConvertParams", size_of::<ConvertParams>()),
    ("SparseAttnDsinksParams", size_of::<DsinksParams>()),
    ("SparseAttnPlanParams", size_of::<PlanParams>()),
    ("SparseAttnValidRowsParams", size_of::<ValidRowsParams>()),
    ("SparseAttnPackParams", size_of::<PackParams>()),
];
