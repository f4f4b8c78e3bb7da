//! GPU tests of sparse MQA attention with sinks (SPEC.md section 1) and its plans (section
//! 6): the cuda backend against the reference backend (CPU, f32 inputs holding the same
//! bf16 values), judged with the SPEC.md section 8 tolerances. Outputs are poisoned first
//! (0xFF bytes: NaN) and must be fully overwritten. `small_*` tests are cheap enough for
//! compute-sanitizer; the DeepSeek-V4 shape test takes a few seconds of reference time.
//!
//! Run with `scripts/gpu-test.sh` (they are ignored without a GPU).

mod common;

use dsv4_core::compare::{Judgement, Tolerance};
use dsv4_core::ops::sparse_attention::{
    dense_attention_topk, sparse_attention, sparse_attention_backward, sparse_attention_backward_into, sparse_attention_into, BackwardImpl, SparseAttentionArgs, SparseAttentionBwdArgs, SparseIndices,
};
use dsv4_core::ops::sparse_indices::{build_sparse_topk_indices, plan_sparse_indices, BuildIndicesArgs};
use dsv4_core::{BackendName, DType, Error, Tensor};
use common::*;

/// A bf16 device tensor and the f32 host tensor of the same values.
struct Pair {
    host: Tensor,
    dev: Tensor,
}

fn bf16_pair(shape: &[usize], vals: &[f32]) -> Pair {
    let hb = Tensor::from_f32_as_bf16(shape, vals).unwrap();
    let host = Tensor::from_f32(shape, hb.to_f32_vec().unwrap()).unwrap();
    Pair { dev: up(&hb), host }
}

/// lse is f32 from f32 sums: tight, relative to the whole tensor.
const LSE_TOL: Tolerance = Tolerance::RelFro(1e-4);

/// One attention problem.
#[derive(Clone, Copy, Debug)]
struct Case {
    b: usize,
    s: usize,
    h: usize,
    d: usize,
    k: usize,
    t: usize,
    /// |logit| ~ 1e4: every kv row has 8 in column 0 and q has +-1e4 / (8 sm_scale) there
    /// (+ for even heads: a well-conditioned softmax around 1e4; - for odd heads: every
    /// slot underflows and the sink takes all the mass).
    big_logits: bool,
    /// Sinks uniform in +-sink_scale.
    sink_scale: f32,
    idx_i64: bool,
    /// Row s == 1 of every batch has no valid slot.
    empty_rows: bool,
    /// Fraction (in 1/10) of slots that are masked, out of range or duplicated.
    noise: u64,
}

impl Case {
    fn small(b: usize, s: usize, h: usize, d: usize, k: usize, t: usize) -> Self {
        Case { b, s, h, d, k, t, big_logits: false, sink_scale: 2.0, idx_i64: false, empty_rows: true, noise: 4 }
    }
    fn name(&self) -> String {
        format!("B{} S{} H{} D{} K{} T{} sink+-{}{}{}", self.b, self.s, self.h, self.d, self.k, self.t, self.sink_scale, if self.big_logits { " |logit|~1e4" } else { "" }, if self.idx_i64 { " i64" } else { "" })
    }
}

struct Inputs {
    q: Pair,
    kv: Pair,
    sinks: Tensor,     // host f32
    sinks_dev: Tensor, // device f32
    idx: Tensor,       // host
    idx_dev: Tensor,
    dout: Pair,
}

/// Random row indices: valid keys, -1, other negatives, >= K, and repeats of the previous
/// slot (a duplicate key).
fn random_indices(rng: &mut Rng, c: &Case) -> Vec<i64> {
    let mut v = Vec::with_capacity(c.b * c.s * c.t);
    for _ in 0..c.b {
        for s in 0..c.s {
            let mut prev = 0i64;
            for _ in 0..c.t {
                let x = if c.empty_rows && s == 1 {
                    [-1, c.k as i64, -5][rng.below(3) as usize]
                } else {
                    match rng.below(10) {
                        r if r >= c.noise => rng.below(c.k as u64) as i64,
                        0 => -1,
                        1 => c.k as i64 + rng.below(3) as i64,
                        2 => -(2 + rng.below(4) as i64),
                        _ => prev,
                    }
                };
                if x >= 0 && (x as usize) < c.k {
                    prev = x;
                }
                v.push(x);
            }
        }
    }
    v
}

fn make_inputs(rng: &mut Rng, c: &Case) -> Inputs {
    let qn = c.b * c.s * c.h * c.d;
    let kvn = c.b * c.k * c.d;
    let mut qv: Vec<f32> = (0..qn).map(|_| rng.normal3()).collect();
    let mut kvv: Vec<f32> = (0..kvn).map(|_| rng.normal3()).collect();
    if c.big_logits {
        let big = 1e4 * (c.d as f32).sqrt() / 8.0;
        for (i, row) in qv.chunks_mut(c.d).enumerate() {
            row[0] = if (i % c.h).is_multiple_of(2) { big } else { -big };
        }
        kvv.chunks_mut(c.d).for_each(|row| row[0] = 8.0);
    }
    let dov: Vec<f32> = (0..qn).map(|_| rng.normal3()).collect();
    let sinks = Tensor::from_f32(&[c.h], (0..c.h).map(|_| rng.sym() * c.sink_scale).collect()).unwrap();
    let iv = random_indices(rng, c);
    let idx = if c.idx_i64 { Tensor::from_i64(&[c.b, c.s, c.t], iv).unwrap() } else { Tensor::from_i32(&[c.b, c.s, c.t], iv.into_iter().map(|x| x as i32).collect()).unwrap() };
    Inputs {
        q: bf16_pair(&[c.b, c.s, c.h, c.d], &qv),
        kv: bf16_pair(&[c.b, c.k, c.d], &kvv),
        sinks_dev: up(&sinks),
        sinks,
        idx_dev: up(&idx),
        idx,
        dout: bf16_pair(&[c.b, c.s, c.h, c.d], &dov),
    }
}

fn host_args<'a>(x: &'a Inputs, reference_rounding: bool) -> SparseAttentionArgs<'a> {
    let mut a = SparseAttentionArgs::new(x.q.host.view(), x.kv.host.view(), x.sinks.view(), SparseIndices::TopK(x.idx.view()));
    a.reference_rounding = reference_rounding;
    a
}

fn dev_args<'a>(x: &'a Inputs, indices: SparseIndices<'a>, reference_rounding: bool) -> SparseAttentionArgs<'a> {
    let mut a = SparseAttentionArgs::new(x.q.dev.view(), x.kv.dev.view(), x.sinks_dev.view(), indices);
    a.reference_rounding = reference_rounding;
    a
}

/// The cuda forward into poisoned outputs.
fn gpu_forward(a: &SparseAttentionArgs, c: &Case) -> (Tensor, Tensor) {
    let mut out = poisoned(DType::BF16, &[c.b, c.s, c.h, c.d]);
    let mut lse = poisoned(DType::F32, &[c.b, c.s, c.h]);
    sparse_attention_into(BackendName::Cuda, a, &mut out.view_mut(), &mut lse.view_mut()).unwrap();
    (out, lse)
}

/// The cuda backward into poisoned outputs.
fn gpu_backward(a: &SparseAttentionBwdArgs, c: &Case) -> (Tensor, Tensor, Tensor) {
    let mut dq = poisoned(DType::BF16, &[c.b, c.s, c.h, c.d]);
    let mut dkv = poisoned(DType::BF16, &[c.b, c.k, c.d]);
    let mut ds = poisoned(DType::F32, &[c.h]);
    sparse_attention_backward_into(BackendName::Cuda, a, &mut dq.view_mut(), &mut dkv.view_mut(), &mut ds.view_mut()).unwrap();
    (dq, dkv, ds)
}

/// Forward and both backwards of one case against the reference; `plan`: through a cuda
/// plan instead of the [B,S,T] selection.
fn run_case(rng: &mut Rng, c: &Case, reference_rounding: bool, plan: bool) -> Vec<Judgement> {
    let name = format!("{}{}{}", c.name(), if reference_rounding { " ref-rounding" } else { "" }, if plan { " plan" } else { "" });
    println!("{name}");
    let x = make_inputs(rng, c);
    let cuda_plan = plan.then(|| plan_sparse_indices(BackendName::Cuda, &x.idx_dev.view(), c.k, false).unwrap());
    let indices = match &cuda_plan {
        Some(p) => SparseIndices::Plan(p),
        None => SparseIndices::TopK(x.idx_dev.view()),
    };
    let da = dev_args(&x, indices, reference_rounding);
    let (out, lse) = gpu_forward(&da, c);
    let ha = host_args(&x, reference_rounding);
    let (rout, rlse) = sparse_attention(BackendName::Reference, &ha).unwrap();
    let mut js = vec![jt(&format!("{name}: out"), &out, &rout, Tolerance::Bf16), jt(&format!("{name}: lse"), &lse, &rlse, LSE_TOL)];

    // Backward from the GPU forward's out and lse (the same inputs for both backends).
    let out_h = Tensor::from_f32(out.shape(), out.to_f32_vec().unwrap()).unwrap();
    let lse_h = lse.to_host().unwrap();
    let hb = SparseAttentionBwdArgs::new(ha.clone(), out_h.view(), lse_h.view(), x.dout.host.view());
    let (rdq, rdkv, rds) = sparse_attention_backward(BackendName::Reference, &hb).unwrap();
    for imp in [BackwardImpl::Atomic, BackwardImpl::Deterministic] {
        let mut db = SparseAttentionBwdArgs::new(da.clone(), out.view(), lse.view(), x.dout.dev.view());
        db.backward_impl = imp;
        let (dq, dkv, ds) = gpu_backward(&db, c);
        js.push(jt(&format!("{name}: dq ({imp:?})"), &dq, &rdq, Tolerance::Bf16));
        js.push(jt(&format!("{name}: dkv ({imp:?})"), &dkv, &rdkv, Tolerance::F32Grad));
        js.push(jt(&format!("{name}: dsinks ({imp:?})"), &ds, &rds, Tolerance::F32Grad));
    }
    js
}

/// The deterministic backward from the GPU forward's `out` and `lse`, for each workspace
/// size: judged against the reference on the first run, then bitwise equal to that run on
/// every rerun.
/// The bits of dq, dkv and dsinks.
type GradBits = (Vec<u64>, Vec<u64>, Vec<u64>);

fn deterministic_reruns(c: &Case, x: &Inputs, da: &SparseAttentionArgs, out: &Tensor, lse: &Tensor, workspaces: &[usize], runs: usize) -> Vec<Judgement> {
    let bits = |t: &Tensor| t.to_f64_vec().unwrap().into_iter().map(f64::to_bits).collect::<Vec<_>>();
    let out_h = Tensor::from_f32(out.shape(), out.to_f32_vec().unwrap()).unwrap();
    let lse_h = lse.to_host().unwrap();
    let hb = SparseAttentionBwdArgs::new(host_args(x, false), out_h.view(), lse_h.view(), x.dout.host.view());
    let (rdq, rdkv, rds) = sparse_attention_backward(BackendName::Reference, &hb).unwrap();
    let mut js = Vec::new();
    // The bits of the first workspace's run: every workspace (every split into waves, an
    // index for all rows or one per wave) must give them.
    let mut across: Option<(usize, GradBits)> = None;
    for &ws in workspaces {
        let mut first = None;
        for run in 0..runs {
            let mut db = SparseAttentionBwdArgs::new(da.clone(), out.view(), lse.view(), x.dout.dev.view());
            db.backward_impl = BackwardImpl::Deterministic;
            db.backward_workspace_bytes = ws;
            let (dq, dkv, ds) = gpu_backward(&db, c);
            let now = (bits(&dq), bits(&dkv), bits(&ds));
            match &first {
                None => {
                    let name = format!("{}: deterministic, workspace {ws}", c.name());
                    js.push(jt(&format!("{name}: dq"), &dq, &rdq, Tolerance::Bf16));
                    js.push(jt(&format!("{name}: dkv"), &dkv, &rdkv, Tolerance::F32Grad));
                    js.push(jt(&format!("{name}: dsinks"), &ds, &rds, Tolerance::F32Grad));
                    match &across {
                        None => across = Some((ws, now.clone())),
                        Some((ws0, bits0)) => assert!(bits0 == &now, "{}: workspace {ws} gives other bits than workspace {ws0}", c.name()),
                    }
                    first = Some(now);
                }
                Some(f) => assert!(f == &now, "{}: workspace {ws}: run {run} differs from run 0", c.name()),
            }
        }
    }
    js
}

fn small_cases() -> Vec<Case> {
    let mut v = vec![
        Case::small(1, 3, 1, 64, 17, 7),
        Case::small(2, 4, 3, 128, 40, 33),
        Case::small(1, 4, 16, 64, 9, 1),
        Case::small(2, 3, 3, 64, 20, 0),
        Case::small(1, 3, 17, 128, 50, 33),
        Case::small(2, 2, 16, 192, 70, 65),
    ];
    v.push(Case { idx_i64: true, ..Case::small(2, 3, 3, 64, 30, 33) });
    // |logit| ~ 1e4 and sinks +-30
    v.push(Case { big_logits: true, sink_scale: 30.0, ..Case::small(1, 4, 3, 64, 24, 33) });
    v.push(Case { sink_scale: 30.0, ..Case::small(2, 3, 16, 128, 33, 7) });
    v
}

// ------------------------------------------------------------------------------------

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-test.sh"]
fn small_forward_backward_match_reference() {
    let mut rng = Rng(11);
    let mut js = Vec::new();
    for c in small_cases() {
        js.extend(run_case(&mut rng, &c, false, false));
    }
    check(js);
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-test.sh"]
fn small_reference_rounding_matches_reference() {
    let mut rng = Rng(12);
    let mut js = Vec::new();
    for c in [Case::small(2, 3, 3, 64, 20, 33), Case { big_logits: true, sink_scale: 30.0, ..Case::small(1, 3, 16, 128, 24, 7) }] {
        js.extend(run_case(&mut rng, &c, true, false));
    }
    check(js);
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-test.sh"]
fn small_many_heads_and_head_dims() {
    // H > 64 splits the heads across CTAs; D = 256..512 exercises the smaller tiles.
    let mut rng = Rng(13);
    let mut js = Vec::new();
    for c in [Case::small(1, 2, 100, 64, 30, 40), Case::small(1, 2, 128, 128, 30, 17), Case::small(1, 2, 5, 512, 30, 70), Case::small(1, 2, 64, 448, 20, 9), Case::small(1, 2, 33, 320, 20, 9)] {
        js.extend(run_case(&mut rng, &c, false, false));
    }
    check(js);
}

/// Mirror of `HopperProbeParams` (kernels/hopper_probe.cu).
#[repr(C)]
#[derive(Clone, Copy)]
struct HopperProbeParams {
    a: u64,
    b: u64,
    s: u64,
    o_rs: u64,
    o_ss: u64,
    half: i32,
    pad_: i32,
}
const _: () = assert!(std::mem::size_of::<HopperProbeParams>() == 48);

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-test.sh"]
fn small_hopper_wgmma_layouts() {
    // The wgmma descriptors and fragment layouts of hopper.cuh / wgmma.cuh on their own:
    // A B^T (both K-major) and A[:, :64] B[:, 256h..] (B N-major, A from registers and
    // from shared memory) against f64 products of the same bf16 values.
    let gpu = dsv4_cuda::gpu(0).unwrap();
    if !gpu.hopper() {
        println!("not an sm_90a device (or DSV4_PORTABLE=1): nothing to check");
        return;
    }
    let mut rng = Rng(22);
    let a = bf16_pair(&[64, 512], &rng.normals(64 * 512, 1.0));
    let bm = bf16_pair(&[64, 512], &rng.normals(64 * 512, 1.0));
    let (av, bv) = (a.host.to_f32_vec().unwrap(), bm.host.to_f32_vec().unwrap());
    let k = gpu.kernel("hopper_probe.cu", "hopper_probe", &[]).unwrap();
    let mut js = Vec::new();
    for half in 0..2usize {
        let (s, o_rs, o_ss) = (poisoned(DType::F32, &[64, 64]), poisoned(DType::F32, &[64, 256]), poisoned(DType::F32, &[64, 256]));
        let p = HopperProbeParams { a: a.dev.view().address(), b: bm.dev.view().address(), s: s.view().address(), o_rs: o_rs.view().address(), o_ss: o_ss.view().address(), half: half as i32, pad_: 0 };
        // SAFETY: the pointers are live device tensors of the shapes the kernel reads/writes.
        unsafe { k.launch([1, 1, 1], [128, 1, 1], 2 * 65536 + 1024, &p).unwrap() };
        let want_s: Vec<f32> = (0..64 * 64).map(|i| (0..512).map(|d| av[(i / 64) * 512 + d] as f64 * bv[(i % 64) * 512 + d] as f64).sum::<f64>() as f32).collect();
        let want_o: Vec<f32> = (0..64 * 256).map(|i| (0..64).map(|kk| av[(i / 256) * 512 + kk] as f64 * bv[kk * 512 + half * 256 + i % 256] as f64).sum::<f64>() as f32).collect();
        let ws = Tensor::from_f32(&[64, 64], want_s).unwrap();
        let wo = Tensor::from_f32(&[64, 256], want_o).unwrap();
        js.push(jt(&format!("A B^T (half {half} run)"), &s, &ws, Tolerance::RelFro(1e-5)));
        js.push(jt(&format!("P V, A from registers, half {half}"), &o_rs, &wo, Tolerance::RelFro(1e-5)));
        js.push(jt(&format!("P V, A from shared memory, half {half}"), &o_ss, &wo, Tolerance::RelFro(1e-5)));
    }
    check(js);
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-test.sh"]
fn small_hopper_forward_d512() {
    // D = 512 (and 480, padded to 512) runs fwd_sm90.cu on an sm_90a device: heads 1..128
    // (one or two 64-head blocks, padded rows), slot counts around the 64-key block and
    // the 128-key pair (0, 1, 63, 64, 65, 127, 128, 129, 200), masked / out-of-range /
    // duplicate slots, empty rows, |logit| ~ 1e4, sinks +-30, i64 indices, plans.
    let gpu = dsv4_cuda::gpu(0).unwrap();
    println!("hopper forward: {}", dsv4_cuda::sparse_attention::use_hopper_fwd(gpu, 512, false, false));
    let mut rng = Rng(21);
    let mut js = Vec::new();
    for (i, &(h, t)) in [(64, 129), (1, 0), (17, 1), (64, 63), (64, 64), (100, 65), (128, 127), (64, 128), (3, 200)].iter().enumerate() {
        let mut c = Case::small(1 + i % 2, 3, h, if i == 3 { 480 } else { 512 }, 300, t);
        c.idx_i64 = i == 5;
        js.extend(run_case(&mut rng, &c, false, i % 3 == 2));
    }
    let c = Case { sink_scale: 30.0, noise: 0, empty_rows: false, ..Case::small(2, 2, 64, 512, 700, 640) };
    js.extend(run_case(&mut rng, &c, false, false));
    js.extend(run_case(&mut rng, &c, false, true));
    // |logit| ~ 1e4 at D = 512: the forward only. (The backward from these outputs misses
    // its bound on the portable kernels too: q is 2.8e4 in column 0, so lse's f32 rounding,
    // ~1e-3 absolute, scales every P by ~1e-3 and dkv's column 0 by 1e2 absolute.)
    let c = Case { big_logits: true, sink_scale: 30.0, ..Case::small(1, 3, 64, 512, 100, 150) };
    for plan in [false, true] {
        let x = make_inputs(&mut rng, &c);
        js.extend(forward_vs_reference(&x, &c, &[plan]));
    }
    check(js);
}

/// The forward on the GPU from the [B,S,T] selection (plan = false) and/or from its cuda
/// plan (true), each against the reference's out and lse.
fn forward_vs_reference(x: &Inputs, c: &Case, plans: &[bool]) -> Vec<Judgement> {
    let (rout, rlse) = sparse_attention(BackendName::Reference, &host_args(x, false)).unwrap();
    let mut js = Vec::new();
    for &plan in plans {
        let cuda_plan = plan.then(|| plan_sparse_indices(BackendName::Cuda, &x.idx_dev.view(), c.k, false).unwrap());
        let indices = match &cuda_plan {
            Some(p) => SparseIndices::Plan(p),
            None => SparseIndices::TopK(x.idx_dev.view()),
        };
        let (out, lse) = gpu_forward(&dev_args(x, indices, false), c);
        js.push(jt(&format!("{} plan={plan}: out", c.name()), &out, &rout, Tolerance::Bf16));
        js.push(jt(&format!("{} plan={plan}: lse", c.name()), &lse, &rlse, LSE_TOL));
    }
    js
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-test.sh"]
fn small_hopper_forward_many_items() {
    // More (row, head block) items than an H200 has SMs, of varying lengths (a plan's
    // compacted rows, masked slots) with empty rows, two head blocks (H = 100): on an H200
    // fwd_sm90.cu's wave is 66 CTAs a head block, so each CTA takes ~9 of the 600 rows,
    // empty ones among them.
    let gpu = dsv4_cuda::gpu(0).unwrap();
    println!("hopper forward: {}", dsv4_cuda::sparse_attention::use_hopper_fwd(gpu, 512, false, false));
    let mut rng = Rng(24);
    let c = Case::small(2, 300, 100, 512, 500, 300);
    let x = make_inputs(&mut rng, &c);
    check(forward_vs_reference(&x, &c, &[false, true]));
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-test.sh"]
fn small_hopper_backward_d512() {
    // D = 512 (and 480, padded to 512) runs bwd_sm90.cu on an sm_90a device: 64 heads a CTA
    // (H = 1, 3, 17 padded; 100, 128: two head blocks), slot counts around the 32-key block
    // and the 64-key pair (0, 1, 31, 32, 33, 63, 64, 65, 130, 640) and past the producer's
    // 1024-slot key chunk (1100), masked / out-of-range / duplicate slots, empty rows, keys
    // shared by many rows (K = 40: colliding dkv reductions), i64 indices, plans. Both dkv
    // modes against the reference (`run_case`); then the deterministic mode bitwise across
    // reruns, with one wave and with many.
    let gpu = dsv4_cuda::gpu(0).unwrap();
    println!("hopper backward: {}", dsv4_cuda::sparse_attention::use_hopper_bwd(gpu, 512, false));
    let mut rng = Rng(23);
    let mut js = Vec::new();
    let cases = [(64usize, 0usize, 300usize), (1, 1, 300), (17, 31, 300), (64, 32, 300), (100, 33, 300), (128, 63, 300), (64, 64, 40), (3, 65, 300), (17, 130, 40)];
    for (i, &(h, t, k)) in cases.iter().enumerate() {
        let mut c = Case::small(1 + i % 2, 3, h, if i == 4 { 480 } else { 512 }, k, t);
        c.idx_i64 = i == 5;
        js.extend(run_case(&mut rng, &c, false, i % 3 == 1));
    }
    // DeepSeek-like slot counts: 640 slots (10 pairs) with many duplicates and sinks +-30,
    // H = 64 and 100; 1100 slots (two key chunks of the producer).
    for (h, plan) in [(64usize, false), (100, true)] {
        let c = Case { sink_scale: 30.0, noise: 8, ..Case::small(2, 2, h, 512, 700, 640) };
        js.extend(run_case(&mut rng, &c, false, plan));
    }
    let c = Case { empty_rows: false, ..Case::small(1, 2, 64, 512, 2000, 1100) };
    js.extend(run_case(&mut rng, &c, false, false));
    check(js);

    // Deterministic: bitwise equal across reruns, with the default workspace (one wave), with
    // room for one row's contributions (a wave per row, an index per wave) and for three (an
    // index for all rows, waves of whole row blocks).
    use dsv4_cuda::sparse_attention::{bwd_head_blocks, choose_tiles, use_hopper_bwd, Pass};
    for c in [Case::small(2, 5, 100, 512, 60, 65), Case { noise: 8, ..Case::small(1, 4, 64, 512, 300, 640) }] {
        let x = make_inputs(&mut rng, &c);
        let da = dev_args(&x, SparseIndices::TopK(x.idx_dev.view()), false);
        let (out, lse) = gpu_forward(&da, &c);
        let tiles = choose_tiles(Pass::Bwd, 512, c.h, gpu.props().max_shared_per_block_optin as usize).unwrap();
        let hopper = use_hopper_bwd(gpu, 512, false);
        let n_hblk = bwd_head_blocks(hopper, &tiles, c.h);
        // The Hopper kernel's contributions are fp16 with an f32 scale per 64 columns, and
        // an i32 index entry.
        let one_row = c.t * (n_hblk * dsv4_cuda::sparse_attention::ContribFormat::of_backward(hopper).bytes(512) + 4);
        // 3 rows' room: the inverted index built once for all rows, waves of whole row blocks.
        let mut js = deterministic_reruns(&c, &x, &da, &out, &lse, &[dsv4_core::ops::sparse_attention::DEFAULT_BACKWARD_WORKSPACE_BYTES, one_row, 3 * one_row], 4);
        // Through a plan: its first deterministic backward builds the index for all rows and
        // the plan keeps it; the later runs (and the other workspace) reuse it.
        let plan = plan_sparse_indices(BackendName::Cuda, &x.idx_dev.view(), c.k, false).unwrap();
        let pa = dev_args(&x, SparseIndices::Plan(&plan), false);
        assert!(!plan.derived.is_set());
        js.extend(deterministic_reruns(&c, &x, &pa, &out, &lse, &[3 * one_row, dsv4_core::ops::sparse_attention::DEFAULT_BACKWARD_WORKSPACE_BYTES], 3));
        assert!(plan.derived.is_set(), "the plan keeps the index");
        // One byte short of a row: says so (the message counts this path's head blocks).
        let mut db = SparseAttentionBwdArgs::new(da.clone(), out.view(), lse.view(), x.dout.dev.view());
        db.backward_impl = BackwardImpl::Deterministic;
        db.backward_workspace_bytes = one_row - 1;
        match sparse_attention_backward(BackendName::Cuda, &db) {
            Err(Error::Unavailable { reason, .. }) => assert!(reason.contains("workspace") && reason.contains(&one_row.to_string()), "{reason}"),
            other => panic!("expected Unavailable, got {:?}", other.map(|_| ())),
        }
        check(js);
    }
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-test.sh"]
fn small_head_dims_not_multiple_of_64() {
    // D = 8, 16, 32 (the golden cases), 40, 96, 200: run zero-padded to the next multiple
    // of 64 and cut back; also through a plan and with reference rounding.
    let mut rng = Rng(20);
    let mut js = Vec::new();
    for c in [
        Case::small(1, 3, 2, 8, 17, 7),
        Case::small(2, 4, 3, 16, 20, 33),
        Case::small(1, 3, 17, 32, 30, 40),
        Case::small(2, 2, 5, 40, 12, 9),
        Case::small(1, 2, 64, 96, 30, 65),
        Case::small(1, 2, 3, 200, 20, 33),
    ] {
        js.extend(run_case(&mut rng, &c, false, false));
    }
    js.extend(run_case(
        &mut rng,
        &Case::small(2, 3, 4, 16, 20, 33),
        true,
        false,
    ));
    js.extend(run_case(
        &mut rng,
        &Case::small(2, 3, 4, 32, 20, 33),
        false,
        true,
    ));
    check(js);
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-test.sh"]
fn small_plan_layout_and_results_match() {
    let mut rng = Rng(14);
    let mut js = Vec::new();
    for c in [Case::small(2, 4, 3, 64, 20, 33), Case { idx_i64: true, ..Case::small(1, 5, 16, 128, 40, 7) }, Case::small(2, 3, 3, 64, 20, 0)] {
        // Layout: exactly the reference's (valid_rows: the reference's, then -1).
        let x = make_inputs(&mut rng, &c);
        let gp = plan_sparse_indices(BackendName::Cuda, &x.idx_dev.view(), c.k, false).unwrap();
        let rp = plan_sparse_indices(BackendName::Reference, &x.idx.view(), c.k, false).unwrap();
        assert_eq!(gp.backend, "cuda");
        assert_eq!(gp.indices.shape(), rp.indices.shape());
        assert_eq!(gp.indices.to_i64_vec().unwrap(), rp.indices.to_i64_vec().unwrap(), "{}: plan indices", c.name());
        assert_eq!(gp.topk_length.as_ref().unwrap().to_i64_vec().unwrap(), rp.topk_length.as_ref().unwrap().to_i64_vec().unwrap(), "{}: topk_length", c.name());
        let gv = gp.valid_rows.as_ref().unwrap().to_i64_vec().unwrap();
        let rv = rp.valid_rows.as_ref().unwrap().to_i64_vec().unwrap();
        assert_eq!(gv.len(), c.b * c.s);
        assert_eq!(&gv[..rv.len()], &rv[..], "{}: valid_rows", c.name());
        assert!(gv[rv.len()..].iter().all(|&r| r == -1));
        let np = plan_sparse_indices(BackendName::Cuda, &x.idx_dev.view(), c.k, true).unwrap();
        assert!(np.valid_rows.is_none());
        // Results through the plan.
        js.extend(run_case(&mut rng, &c, false, true));
    }
    check(js);
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-test.sh"]
fn small_dense_oracle_collapses_duplicates() {
    let mut rng = Rng(15);
    let mut js = Vec::new();
    for c in [Case { noise: 9, ..Case::small(2, 4, 3, 64, 12, 33) }, Case { noise: 6, ..Case::small(1, 3, 17, 128, 30, 40) }] {
        let x = make_inputs(&mut rng, &c);
        let ha = host_args(&x, false);
        let want = dense_attention_topk(BackendName::Reference, &ha).unwrap();
        let got = dense_attention_topk(BackendName::Cuda, &dev_args(&x, SparseIndices::TopK(x.idx_dev.view()), false)).unwrap();
        js.push(jt(&format!("{}: dense", c.name()), &got, &want, Tolerance::Bf16));
        let plan = plan_sparse_indices(BackendName::Cuda, &x.idx_dev.view(), c.k, true).unwrap();
        let got = dense_attention_topk(BackendName::Cuda, &dev_args(&x, SparseIndices::Plan(&plan), false)).unwrap();
        js.push(jt(&format!("{}: dense (plan)", c.name()), &got, &want, Tolerance::Bf16));
        // With duplicates present, the sparse forward differs from the oracle.
        let (sparse, _) = sparse_attention(BackendName::Reference, &ha).unwrap();
        assert!(jt("sparse vs dense", &sparse, &want, Tolerance::RelFro(1e-3)).error > 1e-3, "the case must hold duplicates");
    }
    check(js);
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-test.sh"]
fn small_deterministic_backward_is_bitwise_reproducible() {
    let mut rng = Rng(16);
    for c in [Case::small(2, 9, 3, 64, 12, 33), Case { noise: 8, ..Case::small(1, 17, 17, 128, 20, 40) }] {
        let x = make_inputs(&mut rng, &c);
        let da = dev_args(&x, SparseIndices::TopK(x.idx_dev.view()), false);
        let (out, lse) = gpu_forward(&da, &c);
        // Too small for one row: says so.
        let mut db = SparseAttentionBwdArgs::new(da.clone(), out.view(), lse.view(), x.dout.dev.view());
        db.backward_impl = BackwardImpl::Deterministic;
        db.backward_workspace_bytes = c.t * (dsv4_cuda::sparse_attention::kernel_d(c.d) + 1) * 4 - 1;
        match sparse_attention_backward(BackendName::Cuda, &db) {
            Err(Error::Unavailable { reason, .. }) => assert!(reason.contains("workspace"), "{reason}"),
            other => panic!("expected Unavailable, got {:?}", other.map(|_| ())),
        }
        // The default workspace (one wave), and room for the contributions of one row (an
        // index per wave) and of three rows (many waves of an index for all rows; one head
        // block: H <= 64).
        let one_row = c.t * (dsv4_cuda::sparse_attention::kernel_d(c.d) + 1) * 4;
        check(deterministic_reruns(&c, &x, &da, &out, &lse, &[dsv4_core::ops::sparse_attention::DEFAULT_BACKWARD_WORKSPACE_BYTES, one_row, 3 * one_row], 5));
    }
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-test.sh"]
fn small_strided_inputs() {
    // q stored [B,H,S,D] (strided, readable in place); kv rows padded by 4 elements (not
    // 16-byte aligned: packed first); indices stored [B,T,S].
    let mut rng = Rng(17);
    // D = 24 also: padded to 64 on top of the packing.
    for d in [64usize, 24] {
        let c = Case::small(2, 5, 3, d, 20, 33);
        let x = make_inputs(&mut rng, &c);
        let q_perm = {
            let t = x.q.dev.to_host().unwrap();
            let v = t.view().transpose(1, 2).to_tensor().unwrap(); // [B,H,S,D] contiguous
            let d = up(&v);
            let st = d.strides().to_vec();
            d.with_layout(&[c.b, c.s, c.h, c.d], &[st[0], st[2], st[1], st[3]])
        };
        let kv_pad = {
            let vals = x.kv.host.to_f32_vec().unwrap();
            let mut host = vec![0f32; c.b * c.k * (c.d + 4)];
            for (r, row) in vals.chunks(c.d).enumerate() {
                host[r * (c.d + 4)..r * (c.d + 4) + c.d].copy_from_slice(row);
            }
            let d = up(&Tensor::from_f32_as_bf16(&[c.b, c.k, c.d + 4], &host).unwrap());
            let st = d.strides().to_vec();
            d.with_layout(&[c.b, c.k, c.d], &st)
        };
        let idx_t = {
            let v = x.idx.view().transpose(1, 2).to_tensor().unwrap();
            let d = up(&v);
            let st = d.strides().to_vec();
            d.with_layout(&[c.b, c.s, c.t], &[st[0], st[2], st[1]])
        };
        let a = SparseAttentionArgs::new(
            q_perm.view(),
            kv_pad.view(),
            x.sinks_dev.view(),
            SparseIndices::TopK(idx_t.view()),
        );
        let (out, lse) = gpu_forward(&a, &c);
        let (rout, rlse) = sparse_attention(BackendName::Reference, &host_args(&x, false)).unwrap();
        let mut js = vec![
            jt("strided: out", &out, &rout, Tolerance::Bf16),
            jt("strided: lse", &lse, &rlse, LSE_TOL),
        ];
        let db = SparseAttentionBwdArgs::new(a.clone(), out.view(), lse.view(), x.dout.dev.view());
        let (dq, dkv, ds) = gpu_backward(&db, &c);
        let out_h = Tensor::from_f32(out.shape(), out.to_f32_vec().unwrap()).unwrap();
        let lse_h = lse.to_host().unwrap();
        let hb = SparseAttentionBwdArgs::new(
            host_args(&x, false),
            out_h.view(),
            lse_h.view(),
            x.dout.host.view(),
        );
        let (rdq, rdkv, rds) = sparse_attention_backward(BackendName::Reference, &hb).unwrap();
        js.push(jt("strided: dq", &dq, &rdq, Tolerance::Bf16));
        js.push(jt("strided: dkv", &dkv, &rdkv, Tolerance::F32Grad));
        js.push(jt("strided: dsinks", &ds, &rds, Tolerance::F32Grad));
        check(js);
    }
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-test.sh"]
fn small_unsupported_inputs_say_why() {
    let mut rng = Rng(18);
    // f32 q/kv: the reference's.
    let c = Case::small(1, 2, 3, 64, 10, 5);
    let x = make_inputs(&mut rng, &c);
    let qf = up(&x.q.host);
    let kvf = up(&x.kv.host);
    let a = SparseAttentionArgs::new(qf.view(), kvf.view(), x.sinks_dev.view(), SparseIndices::TopK(x.idx_dev.view()));
    match sparse_attention(BackendName::Cuda, &a) {
        Err(Error::Unavailable { reason, .. }) => assert!(reason.contains("bf16"), "{reason}"),
        other => panic!("expected Unavailable, got {other:?}"),
    }
    // D = 520: above 512.
    let c = Case::small(1, 2, 3, 520, 10, 5);
    let x = make_inputs(&mut rng, &c);
    match sparse_attention(
        BackendName::Cuda,
        &dev_args(&x, SparseIndices::TopK(x.idx_dev.view()), false),
    ) {
        Err(Error::Unavailable { reason, .. }) => assert!(reason.contains("D <= 512"), "{reason}"),
        other => panic!("expected Unavailable, got {other:?}"),
    }
}

// ------------------------------------------------------------------------------------
// The DeepSeek-V4 shape

/// DeepSeek-V4 style inputs: K = S + S/ratio (uncompressed then pooled keys), T = window +
/// tc slots from `build_sparse_topk_indices`: a causal window of `window` keys plus `tc`
/// random picks among the visible pooled keys.
fn v4_inputs(rng: &mut Rng, b: usize, s: usize, h: usize, window: usize, ratio: usize, tc: usize) -> (Case, Inputs) {
    let d = 512;
    let pooled = s / ratio;
    let k = s + pooled;
    let mut picks = vec![-1i32; b * s * tc];
    for bi in 0..b {
        for si in 0..s {
            let visible = (si + 1) / ratio;
            let mut pool: Vec<i32> = (0..visible as i32).collect();
            let n = visible.min(tc);
            for j in 0..n {
                let r = j + rng.below((visible - j) as u64) as usize;
                pool.swap(j, r);
                picks[(bi * s + si) * tc + j] = pool[j];
            }
        }
    }
    let picks = Tensor::from_i32(&[b, s, tc], picks).unwrap();
    let mut ba = BuildIndicesArgs::new(b, s, k, window);
    ba.compress_ratio = ratio;
    ba.n_pooled = pooled;
    ba.compressed_topk = Some(picks.view());
    let idx = build_sparse_topk_indices(BackendName::Reference, &ba).unwrap();
    assert_eq!(idx.shape(), &[b, s, window + tc]);
    let t = window + tc;
    let c = Case { b, s, h, d, k, t, big_logits: false, sink_scale: 2.0, idx_i64: false, empty_rows: false, noise: 0 };
    let qv: Vec<f32> = (0..b * s * h * d).map(|_| rng.normal3()).collect();
    let kvv: Vec<f32> = (0..b * k * d).map(|_| rng.normal3()).collect();
    let dov: Vec<f32> = (0..b * s * h * d).map(|_| rng.normal3()).collect();
    let sinks = Tensor::from_f32(&[h], (0..h).map(|_| rng.sym() * 2.0).collect()).unwrap();
    let x = Inputs {
        q: bf16_pair(&[b, s, h, d], &qv),
        kv: bf16_pair(&[b, k, d], &kvv),
        sinks_dev: up(&sinks),
        sinks,
        idx_dev: up(&idx),
        idx,
        dout: bf16_pair(&[b, s, h, d], &dov),
    };
    (c, x)
}

/// Windowed selections (consecutive rows share all but one window key) over an odd S, three
/// batch rows, more rows than a wave of CTAs, with and without a plan: short rows (below the
/// window) and rows of several iterations through the Hopper forward.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-test.sh"]
fn small_hopper_forward_windowed_rows() {
    let mut rng = Rng(25);
    let (c, x) = v4_inputs(&mut rng, 3, 301, 64, 128, 4, 200);
    check(forward_vs_reference(&x, &c, &[false, true]));
}

/// B=2, S=1024, H=64, D=512; K = S + S/4 (uncompressed then pooled keys); T = 640 slots:
/// a 128-key causal window plus 512 random picks among the visible pooled keys.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-test.sh"]
fn deepseek_v4_shape_b2_s1024_h64_d512_t640() {
    let (b, s, h) = (2usize, 1024usize, 64usize);
    let mut rng = Rng(19);
    let (c, x) = v4_inputs(&mut rng, b, s, h, 128, 4, 512);
    let k = c.k;
    let da = dev_args(&x, SparseIndices::TopK(x.idx_dev.view()), false);
    let (out, lse) = gpu_forward(&da, &c);
    let ha = host_args(&x, false);
    let t0 = std::time::Instant::now();
    let (rout, rlse) = sparse_attention(BackendName::Reference, &ha).unwrap();
    println!("reference forward: {:.1}s", t0.elapsed().as_secs_f64());
    let mut js = vec![jt("v4: out", &out, &rout, Tolerance::Bf16), jt("v4: lse", &lse, &rlse, LSE_TOL)];

    let out_h = Tensor::from_f32(out.shape(), out.to_f32_vec().unwrap()).unwrap();
    let lse_h = lse.to_host().unwrap();
    let hb = SparseAttentionBwdArgs::new(ha.clone(), out_h.view(), lse_h.view(), x.dout.host.view());
    let t0 = std::time::Instant::now();
    let (rdq, rdkv, rds) = sparse_attention_backward(BackendName::Reference, &hb).unwrap();
    println!("reference backward: {:.1}s", t0.elapsed().as_secs_f64());
    for imp in [BackwardImpl::Atomic, BackwardImpl::Deterministic] {
        let mut db = SparseAttentionBwdArgs::new(da.clone(), out.view(), lse.view(), x.dout.dev.view());
        db.backward_impl = imp;
        let (dq, dkv, ds) = gpu_backward(&db, &c);
        js.push(jt(&format!("v4: dq ({imp:?})"), &dq, &rdq, Tolerance::Bf16));
        js.push(jt(&format!("v4: dkv ({imp:?})"), &dkv, &rdkv, Tolerance::F32Grad));
        js.push(jt(&format!("v4: dsinks ({imp:?})"), &ds, &rds, Tolerance::F32Grad));
    }
    // The plan path agrees too.
    let plan = plan_sparse_indices(BackendName::Cuda, &x.idx_dev.view(), k, true).unwrap();
    let pa = dev_args(&x, SparseIndices::Plan(&plan), false);
    let (pout, plse) = gpu_forward(&pa, &c);
    js.push(jt("v4: out (plan)", &pout, &rout, Tolerance::Bf16));
    js.push(jt("v4: lse (plan)", &plse, &rlse, LSE_TOL));
    check(js);
}

// ------------------------------------------------------------------------------------
// Compile sweep (NVRTC only, no GPU)

/// Every tile `choose_tiles` can pick for D = 64..512 and H = 1..128, on Hopper and Ampere
/// shared-memory limits, compiles without warnings and without register spills.
///
/// Some NVRTC builds (seen: CUDA 13.0's for sm_90a) return an empty log, so no ptxas info:
/// such a compile is reported as "no ptxas info from this NVRTC for <arch>" and is not a
/// failure, provided each kernel got ptxas info from at least one arch (CI's NVRTC reports
/// sm_90a, and its `nvrtc_compile` test checks spills there).
#[test]
#[ignore = "slow (a few minutes): compiles every tile the launcher can choose; needs NVRTC only"]
fn every_chosen_tile_compiles_without_spills() {
    use dsv4_cuda::sparse_attention::{choose_tiles, Pass};
    let nv = dsv4_cuda::nvrtc::nvrtc().unwrap();
    let mut jobs = std::collections::BTreeSet::new();
    for (arch, smem) in [("sm_90a", 232_448usize), ("sm_80", 166_912)] {
        for d in (64..=512).step_by(64) {
            for h in 1..=128 {
                for pass in [Pass::Fwd, Pass::Bwd] {
                    let t = choose_tiles(pass, d, h, smem).unwrap();
                    jobs.insert((arch, pass == Pass::Fwd, d, t.hb, t.bn, t.dw));
                }
            }
        }
    }
    let mut bad = Vec::new();
    let mut no_info = Vec::new();
    // Per kernel (fwd, bwd): compiles that reported ptxas info.
    let mut reported = [0usize; 2];
    for (arch, fwd, d, hb, bn, dw) in jobs {
        let (path, entry) = if fwd {
            ("sparse_attention/fwd.cu", "sparse_attn_fwd")
        } else {
            ("sparse_attention/bwd.cu", "sparse_attn_bwd")
        };
        // (the launchers' other defines at their usual values: exp2 arithmetic, no dedup)
        let mut defs = vec![("SA_D", d.to_string()), ("SA_HB", hb.to_string()), ("SA_BN", bn.to_string()), ("SA_DW", dw.to_string()), ("SA_NATURAL_EXP", "0".to_string())];
        if fwd {
            defs.push(("SA_DEDUP", "0".to_string()));
        }
        let label = format!("{path} [{arch}] D={d} HB={hb} BN={bn} DW={dw}");
        let c = match nv.compile(path, &defs, arch) {
            Ok(c) => c,
            Err(e) => {
                bad.push(format!("{label}: compile error: {e}"));
                continue;
            }
        };
        if c.entries.is_empty() && !c.log.contains("ptxas") {
            // This NVRTC printed no ptxas info at all (an empty log): nothing to check here.
            println!("{label}: no ptxas info from this NVRTC for {arch} (log {} chars)", c.log.len());
            no_info.push(label);
            continue;
        }
        let Some(e) = c.entries.iter().find(|e| e.entry == entry) else {
            // No ptxas info line for the entry: registers and spills cannot be checked.
            // Show the log so the parser (nvrtc::parse_ptxas_info) can be checked against it.
            let log: String = c.log.chars().take(2000).collect();
            println!("{label}: NO ptxas info for `{entry}` (entries parsed: {:?}); NVRTC log ({} chars):\n{log}", c.entries.iter().map(|e| &e.entry).collect::<Vec<_>>(), c.log.len());
            bad.push(format!(
                "{label}: no ptxas info for `{entry}` in the NVRTC log ({} chars; options {:?})",
                c.log.len(),
                c.options
            ));
            continue;
        };
        println!("{label}: {e}");
        reported[usize::from(!fwd)] += 1;
        if !c.warnings().is_empty() || e.spill_stores + e.spill_loads > 0 {
            bad.push(format!("{label}: {e} {:?}", c.warnings()));
        }
    }
    if !no_info.is_empty() {
        println!("{} compile(s) with no ptxas info from this NVRTC (not checked for spills)", no_info.len());
    }
    for (kernel, n) in ["fwd.cu", "bwd.cu"].iter().zip(reported) {
        if n == 0 {
            bad.push(format!("sparse_attention/{kernel}: no arch reported ptxas info: registers and spills unchecked"));
        }
    }
    assert!(
        bad.is_empty(),
        "{} compile(s) failed the check:\n{}",
        bad.len(),
        bad.join("\n")
    );
}
