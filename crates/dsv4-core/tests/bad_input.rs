//! One test per validation rule of every operation (`ops/*/mod.rs`), of `check.rs` and of
//! backend dispatch. Each error's Display must name the argument to fix. Device tensors
//! are faked: views of `Device::Cuda(0)` over a dangling pointer that nothing may
//! dereference, so every one of these errors is raised before any memory is touched.

use std::fmt::Debug;
use std::ptr::NonNull;
use std::sync::Arc;

use dsv4_core::check;
use dsv4_core::ops::indexer::{indexer_scores, indexer_scores_into, indexer_topk, indexer_topk_scores, indexer_topk_scores_backward, lightning_indexer, IndexerArgs, IndexerTopkScoresBwdArgs};
use dsv4_core::ops::qnorm_rope::{qnorm_rope, qnorm_rope_backward, qnorm_rope_backward_into, qnorm_rope_into, token_major_strides, QNormRopeArgs};
use dsv4_core::ops::sinkhorn::{sinkhorn_normalize, sinkhorn_normalize_backward, sinkhorn_normalize_backward_into, sinkhorn_normalize_into, SinkhornArgs};
use dsv4_core::ops::sparse_attention::{dense_attention_topk, dense_attention_topk_into, sparse_attention, sparse_attention_backward, sparse_attention_backward_into, sparse_attention_into, BackwardImpl, SparseAttentionArgs, SparseAttentionBwdArgs, SparseIndices};
use dsv4_core::ops::sparse_indices::{build_sparse_topk_indices, build_sparse_topk_indices_into, plan_sparse_indices, BuildIndicesArgs, SparseIndexPlan};
use dsv4_core::tensor::{contiguous_strides, DeviceBuffer};
use dsv4_core::{is_kernel_available, BackendName, DType, Device, Error, Result, Tensor, TensorView, TensorViewMut};

const REF: BackendName = BackendName::Reference;
const CUDA: Device = Device::Cuda(0);

// ---------------------------------------------------------------- helpers

/// A view of "device memory" that must never be read: the pointer is dangling.
fn dev<'a>(dtype: DType, shape: &[usize]) -> TensorView<'a> {
    // SAFETY: a Cuda view is never dereferenced on the host (host reads check the device
    // first); these tests prove validation rejects it before any backend sees it.
    unsafe { TensorView::from_raw(NonNull::<u64>::dangling().as_ptr() as *const u8, dtype, shape, &contiguous_strides(shape), CUDA) }
}

fn dev_mut<'a>(dtype: DType, shape: &[usize]) -> TensorViewMut<'a> {
    // SAFETY: as for `dev`.
    unsafe { TensorViewMut::from_raw(NonNull::<u64>::dangling().as_ptr() as *mut u8, dtype, shape, &contiguous_strides(shape), CUDA) }
}

/// Device memory for owned tensors (plans): every access fails.
#[derive(Debug)]
struct FakeDeviceBuffer;

impl DeviceBuffer for FakeDeviceBuffer {
    fn device_ptr(&self) -> u64 {
        8
    }
    fn len_bytes(&self) -> usize {
        0
    }
    fn ordinal(&self) -> usize {
        0
    }
    fn copy_to_host(&self, _offset: usize, _dst: &mut [u8]) -> Result<()> {
        panic!("a fake device buffer was read")
    }
}

fn zeros(dtype: DType, shape: &[usize]) -> Tensor {
    Tensor::zeros(dtype, shape)
}

/// The call failed, and its message names `arg` in backticks.
fn err_names<T: Debug>(r: Result<T>, arg: &str) -> Error {
    let e = match r {
        Ok(v) => panic!("expected an error naming `{arg}`, got Ok({v:?})"),
        Err(e) => e,
    };
    let msg = e.to_string();
    assert!(msg.contains(&format!("`{arg}`")), "error does not name `{arg}`: {msg}");
    e
}

fn shape_err<T: Debug>(r: Result<T>, arg: &str) {
    let e = err_names(r, arg);
    assert!(matches!(e, Error::Shape { .. }), "expected a shape error: {e}");
}
fn dtype_err<T: Debug>(r: Result<T>, arg: &str) {
    let e = err_names(r, arg);
    assert!(matches!(e, Error::DType { .. }), "expected a dtype error: {e}");
}
fn value_err<T: Debug>(r: Result<T>, arg: &str) {
    let e = err_names(r, arg);
    assert!(matches!(e, Error::Value { .. }), "expected a value error: {e}");
}
fn device_err<T: Debug>(r: Result<T>, arg: &str) {
    let e = err_names(r, arg);
    assert!(matches!(e, Error::Device { .. }), "expected a device error: {e}");
    assert!(e.to_string().contains("cuda:0"), "{e}");
}
fn layout_err<T: Debug>(r: Result<T>, arg: &str) {
    let e = err_names(r, arg);
    assert!(matches!(e, Error::Layout { .. }), "expected a layout error: {e}");
}
/// The backend cannot run the call, and says why.
fn unavailable<T: Debug>(r: Result<T>, backend: &str, why: &str) {
    let e = match r {
        Ok(v) => panic!("expected backend `{backend}` to refuse, got Ok({v:?})"),
        Err(e) => e,
    };
    assert!(matches!(e, Error::Unavailable { .. }), "{e}");
    let msg = e.to_string();
    assert!(msg.contains(&format!("backend `{backend}`")) && msg.contains(why), "{msg}");
}

// ---------------------------------------------------------------- sparse attention

/// Valid inputs: B=1, S=2, H=2, D=4, K=3, T=2.
struct Attn {
    q: Tensor,
    kv: Tensor,
    sinks: Tensor,
    idx: Tensor,
    out: Tensor,
    lse: Tensor,
}

const QS: [usize; 4] = [1, 2, 2, 4];

fn attn() -> Attn {
    Attn {
        q: Tensor::from_f32(&QS, (0..16).map(|i| i as f32 * 0.1).collect()).unwrap(),
        kv: Tensor::from_f32(&[1, 3, 4], (0..12).map(|i| i as f32 * -0.1).collect()).unwrap(),
        sinks: zeros(DType::F32, &[2]),
        idx: Tensor::from_i32(&[1, 2, 2], vec![0, 2, 1, -1]).unwrap(),
        out: zeros(DType::F32, &QS),
        lse: zeros(DType::F32, &[1, 2, 2]),
    }
}

impl Attn {
    fn args(&self) -> SparseAttentionArgs<'_> {
        SparseAttentionArgs::new(self.q.view(), self.kv.view(), self.sinks.view(), SparseIndices::TopK(self.idx.view()))
    }
    fn bwd(&self) -> SparseAttentionBwdArgs<'_> {
        SparseAttentionBwdArgs::new(self.args(), self.out.view(), self.lse.view(), self.out.view())
    }
}

fn fwd(a: &SparseAttentionArgs) -> Result<(Tensor, Tensor)> {
    sparse_attention(REF, a)
}

#[test]
fn sa_sanity_valid_inputs_pass() {
    let t = attn();
    fwd(&t.args()).unwrap();
    sparse_attention_backward(REF, &t.bwd()).unwrap();
    dense_attention_topk(REF, &t.args()).unwrap();
}

#[test]
fn sa_q_dtype() {
    let t = attn();
    let q = zeros(DType::I32, &QS);
    dtype_err(fwd(&SparseAttentionArgs { q: q.view(), ..t.args() }), "q");
}

#[test]
fn sa_q_rank() {
    let t = attn();
    let q = zeros(DType::F32, &[2, 2, 4]);
    shape_err(fwd(&SparseAttentionArgs { q: q.view(), ..t.args() }), "q");
}

#[test]
fn sa_zero_heads() {
    let t = attn();
    let q = zeros(DType::F32, &[1, 2, 0, 4]);
    value_err(fwd(&SparseAttentionArgs { q: q.view(), ..t.args() }), "q.shape[2] (heads)");
}

#[test]
fn sa_zero_head_dim() {
    let t = attn();
    let q = zeros(DType::F32, &[1, 2, 2, 0]);
    value_err(fwd(&SparseAttentionArgs { q: q.view(), ..t.args() }), "q.shape[3] (head_dim)");
}

#[test]
fn sa_kv_dtype_differs_from_q() {
    let t = attn();
    let kv = zeros(DType::BF16, &[1, 3, 4]);
    dtype_err(fwd(&SparseAttentionArgs { kv: kv.view(), ..t.args() }), "kv");
}

#[test]
fn sa_kv_shape() {
    let t = attn();
    for shape in [&[2, 3, 4][..], &[1, 3, 5], &[3, 4], &[1, 1, 3, 4]] {
        let kv = zeros(DType::F32, shape);
        shape_err(fwd(&SparseAttentionArgs { kv: kv.view(), ..t.args() }), "kv");
    }
}

#[test]
fn sa_sinks_dtype() {
    let t = attn();
    let s = zeros(DType::BF16, &[2]);
    dtype_err(fwd(&SparseAttentionArgs { sinks: s.view(), ..t.args() }), "sinks");
}

#[test]
fn sa_sinks_shape() {
    let t = attn();
    for shape in [&[3][..], &[1, 2], &[]] {
        let s = zeros(DType::F32, shape);
        shape_err(fwd(&SparseAttentionArgs { sinks: s.view(), ..t.args() }), "sinks");
    }
}

#[test]
fn sa_sm_scale_not_finite() {
    let t = attn();
    for s in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        value_err(fwd(&SparseAttentionArgs { sm_scale: s, ..t.args() }), "sm_scale");
    }
}

#[test]
fn sa_topk_idxs_dtype() {
    let t = attn();
    let idx = zeros(DType::F32, &[1, 2, 2]);
    dtype_err(fwd(&SparseAttentionArgs { indices: SparseIndices::TopK(idx.view()), ..t.args() }), "topk_idxs");
}

#[test]
fn sa_topk_idxs_shape() {
    let t = attn();
    for shape in [&[2, 2, 2][..], &[1, 3, 2], &[1, 2]] {
        let idx = zeros(DType::I64, shape);
        shape_err(fwd(&SparseAttentionArgs { indices: SparseIndices::TopK(idx.view()), ..t.args() }), "topk_idxs");
    }
}

#[test]
fn sa_plan_of_other_sizes() {
    let t = attn();
    let good = plan_sparse_indices(REF, &t.idx.view(), 3, false).unwrap();
    fwd(&SparseAttentionArgs { indices: SparseIndices::Plan(&good), ..t.args() }).unwrap();
    for (b, s, k) in [(2, 2, 3), (1, 1, 3), (1, 2, 4)] {
        let plan = SparseIndexPlan { batch: b, seq: s, kv_len: k, ..good.clone() };
        let e = err_names(fwd(&SparseAttentionArgs { indices: SparseIndices::Plan(&plan), ..t.args() }), "plan");
        assert!(matches!(e, Error::Value { .. }) && e.to_string().contains("kv length"), "{e}");
    }
}

#[test]
fn sa_plan_for_another_backend() {
    let t = attn();
    let plan = SparseIndexPlan { backend: "cuda", ..plan_sparse_indices(REF, &t.idx.view(), 3, false).unwrap() };
    let a = SparseAttentionArgs { indices: SparseIndices::Plan(&plan), ..t.args() };
    for r in [fwd(&a).map(|_| ()), dense_attention_topk(REF, &a).map(|_| ())] {
        let e = err_names(r, "plan");
        assert!(e.to_string().contains("backend `cuda`"), "{e}");
    }
    let mut o = zeros(DType::F32, &QS);
    let mut l = zeros(DType::F32, &[1, 2, 2]);
    err_names(sparse_attention_into(REF, &a, &mut o.view_mut(), &mut l.view_mut()), "plan");
    err_names(dense_attention_topk_into(REF, &a, &mut o.view_mut()), "plan");
    let bw = SparseAttentionBwdArgs { fwd: a.clone(), ..t.bwd() };
    err_names(sparse_attention_backward(REF, &bw), "plan");
}

#[test]
fn sa_plan_on_another_device() {
    let t = attn();
    let good = plan_sparse_indices(REF, &t.idx.view(), 3, false).unwrap();
    let plan = SparseIndexPlan { indices: Tensor::from_device(Arc::new(FakeDeviceBuffer), DType::I32, &[2, 1, 2], None), ..good };
    device_err(fwd(&SparseAttentionArgs { indices: SparseIndices::Plan(&plan), ..t.args() }), "plan");
}

#[test]
fn sa_inputs_on_mixed_devices() {
    let t = attn();
    device_err(fwd(&SparseAttentionArgs { kv: dev(DType::F32, &[1, 3, 4]), ..t.args() }), "kv");
    device_err(fwd(&SparseAttentionArgs { sinks: dev(DType::F32, &[2]), ..t.args() }), "sinks");
    device_err(fwd(&SparseAttentionArgs { indices: SparseIndices::TopK(dev(DType::I32, &[1, 2, 2])), ..t.args() }), "topk_idxs");
    // q on the device, the rest on the host: the first that differs from q is named.
    device_err(fwd(&SparseAttentionArgs { q: dev(DType::F32, &QS), ..t.args() }), "kv");
}

#[test]
fn sa_backward_out() {
    let t = attn();
    let bad = zeros(DType::I32, &QS);
    dtype_err(sparse_attention_backward(REF, &SparseAttentionBwdArgs { out: bad.view(), ..t.bwd() }), "out");
    let bad = zeros(DType::F32, &[1, 2, 2, 5]);
    shape_err(sparse_attention_backward(REF, &SparseAttentionBwdArgs { out: bad.view(), ..t.bwd() }), "out");
}

#[test]
fn sa_backward_lse() {
    let t = attn();
    let bad = zeros(DType::BF16, &[1, 2, 2]);
    dtype_err(sparse_attention_backward(REF, &SparseAttentionBwdArgs { lse: bad.view(), ..t.bwd() }), "lse");
    let bad = zeros(DType::F32, &[1, 2, 2, 1]);
    shape_err(sparse_attention_backward(REF, &SparseAttentionBwdArgs { lse: bad.view(), ..t.bwd() }), "lse");
}

#[test]
fn sa_backward_dout() {
    let t = attn();
    let bad = zeros(DType::I64, &QS);
    dtype_err(sparse_attention_backward(REF, &SparseAttentionBwdArgs { dout: bad.view(), ..t.bwd() }), "dout");
    let bad = zeros(DType::F32, &[1, 2, 3, 4]);
    shape_err(sparse_attention_backward(REF, &SparseAttentionBwdArgs { dout: bad.view(), ..t.bwd() }), "dout");
}

#[test]
fn sa_backward_workspace_zero() {
    let t = attn();
    value_err(sparse_attention_backward(REF, &SparseAttentionBwdArgs { backward_workspace_bytes: 0, ..t.bwd() }), "backward_workspace_bytes");
}

#[test]
fn sa_backward_tensors_on_mixed_devices() {
    let t = attn();
    device_err(sparse_attention_backward(REF, &SparseAttentionBwdArgs { out: dev(DType::F32, &QS), ..t.bwd() }), "out");
    device_err(sparse_attention_backward(REF, &SparseAttentionBwdArgs { lse: dev(DType::F32, &[1, 2, 2]), ..t.bwd() }), "lse");
    device_err(sparse_attention_backward(REF, &SparseAttentionBwdArgs { dout: dev(DType::F32, &QS), ..t.bwd() }), "dout");
}

#[test]
fn sa_backward_impl_string() {
    assert_eq!("atomic".parse::<BackwardImpl>().unwrap(), BackwardImpl::Atomic);
    assert_eq!("deterministic".parse::<BackwardImpl>().unwrap(), BackwardImpl::Deterministic);
    for s in ["", "Atomic", "determinstic", "fast"] {
        let e = err_names(s.parse::<BackwardImpl>(), "backward_impl");
        assert!(e.to_string().contains(&format!("{s:?}")), "{e}");
    }
}

#[test]
fn sa_forward_outputs() {
    let t = attn();
    let a = t.args();
    let mut lse = zeros(DType::F32, &[1, 2, 2]);
    let mut o = zeros(DType::BF16, &QS);
    dtype_err(sparse_attention_into(REF, &a, &mut o.view_mut(), &mut lse.view_mut()), "out");
    let mut o = zeros(DType::F32, &[1, 2, 2, 3]);
    shape_err(sparse_attention_into(REF, &a, &mut o.view_mut(), &mut lse.view_mut()), "out");
    let mut o = zeros(DType::F32, &QS);
    let mut l = zeros(DType::BF16, &[1, 2, 2]);
    dtype_err(sparse_attention_into(REF, &a, &mut o.view_mut(), &mut l.view_mut()), "lse");
    let mut l = zeros(DType::F32, &[4]);
    shape_err(sparse_attention_into(REF, &a, &mut o.view_mut(), &mut l.view_mut()), "lse");
    let mut l = zeros(DType::F32, &[1, 2, 2]);
    let addr = l.view_mut().address() as usize as *mut u8;
    // SAFETY: strides [4, 1, 2] permute the last two dims of `l`, inside its 4 elements.
    let mut lt = unsafe { TensorViewMut::from_raw(addr, DType::F32, &[1, 2, 2], &[4, 1, 2], Device::Cpu) };
    layout_err(sparse_attention_into(REF, &a, &mut o.view_mut(), &mut lt), "lse");
    let mut d = zeros(DType::F32, &[1, 2, 2, 3]);
    shape_err(dense_attention_topk_into(REF, &a, &mut d.view_mut()), "out");
}

#[test]
fn sa_backward_outputs() {
    let t = attn();
    let bw = t.bwd();
    let (mut dq, mut dkv, mut ds) = (zeros(DType::F32, &QS), zeros(DType::F32, &[1, 3, 4]), zeros(DType::F32, &[2]));
    sparse_attention_backward_into(REF, &bw, &mut dq.view_mut(), &mut dkv.view_mut(), &mut ds.view_mut()).unwrap();
    let mut bad = zeros(DType::BF16, &QS);
    dtype_err(sparse_attention_backward_into(REF, &bw, &mut bad.view_mut(), &mut dkv.view_mut(), &mut ds.view_mut()), "dq");
    let mut bad = zeros(DType::F32, &[1, 4, 4]);
    shape_err(sparse_attention_backward_into(REF, &bw, &mut dq.view_mut(), &mut bad.view_mut(), &mut ds.view_mut()), "dkv");
    let mut bad = zeros(DType::BF16, &[1, 3, 4]);
    dtype_err(sparse_attention_backward_into(REF, &bw, &mut dq.view_mut(), &mut bad.view_mut(), &mut ds.view_mut()), "dkv");
    let mut bad = zeros(DType::F32, &[1, 2]);
    shape_err(sparse_attention_backward_into(REF, &bw, &mut dq.view_mut(), &mut dkv.view_mut(), &mut bad.view_mut()), "dsinks");
    let mut bad = zeros(DType::BF16, &[2]);
    dtype_err(sparse_attention_backward_into(REF, &bw, &mut dq.view_mut(), &mut dkv.view_mut(), &mut bad.view_mut()), "dsinks");
}

#[test]
fn sa_outputs_on_another_device() {
    let t = attn();
    let a = t.args();
    let (mut o, mut l) = (zeros(DType::F32, &QS), zeros(DType::F32, &[1, 2, 2]));
    device_err(sparse_attention_into(REF, &a, &mut dev_mut(DType::F32, &QS), &mut l.view_mut()), "out");
    device_err(sparse_attention_into(REF, &a, &mut o.view_mut(), &mut dev_mut(DType::F32, &[1, 2, 2])), "lse");
    device_err(dense_attention_topk_into(REF, &a, &mut dev_mut(DType::F32, &QS)), "out");
    let bw = t.bwd();
    let (mut dq, mut dkv, mut ds) = (zeros(DType::F32, &QS), zeros(DType::F32, &[1, 3, 4]), zeros(DType::F32, &[2]));
    device_err(sparse_attention_backward_into(REF, &bw, &mut dev_mut(DType::F32, &QS), &mut dkv.view_mut(), &mut ds.view_mut()), "dq");
    device_err(sparse_attention_backward_into(REF, &bw, &mut dq.view_mut(), &mut dev_mut(DType::F32, &[1, 3, 4]), &mut ds.view_mut()), "dkv");
    device_err(sparse_attention_backward_into(REF, &bw, &mut dq.view_mut(), &mut dkv.view_mut(), &mut dev_mut(DType::F32, &[2])), "dsinks");
}

/// All inputs of a sparse-attention call on the (fake) device.
struct DevAttn<'a> {
    fwd: SparseAttentionArgs<'a>,
    bwd: SparseAttentionBwdArgs<'a>,
}

fn dev_attn<'a>() -> DevAttn<'a> {
    let fwd = SparseAttentionArgs::new(dev(DType::BF16, &QS), dev(DType::BF16, &[1, 3, 4]), dev(DType::F32, &[2]), SparseIndices::TopK(dev(DType::I32, &[1, 2, 2])));
    let bwd = SparseAttentionBwdArgs::new(fwd.clone(), dev(DType::BF16, &QS), dev(DType::F32, &[1, 2, 2]), dev(DType::BF16, &QS));
    DevAttn { fwd, bwd }
}

#[test]
fn sa_reference_backend_refuses_device_tensors() {
    let d = dev_attn();
    unavailable(sparse_attention(REF, &d.fwd), "reference", "CPU tensors");
    unavailable(sparse_attention_backward(REF, &d.bwd), "reference", "CPU tensors");
    unavailable(dense_attention_topk(REF, &d.fwd), "reference", "CPU tensors");
    let (mut o, mut l) = (dev_mut(DType::BF16, &QS), dev_mut(DType::F32, &[1, 2, 2]));
    unavailable(sparse_attention_into(REF, &d.fwd, &mut o, &mut l), "reference", "the inputs are on cuda:0");
}

#[test]
fn sa_cuda_backend_refuses_cpu_tensors() {
    let t = attn();
    unavailable(sparse_attention(BackendName::Cuda, &t.args()), "cuda", "CPU tensors");
    unavailable(sparse_attention_backward(BackendName::Cuda, &t.bwd()), "cuda", "CPU tensors");
    unavailable(dense_attention_topk(BackendName::Cuda, &t.args()), "cuda", "CPU tensors");
}

#[test]
fn sa_cuda_and_auto_without_a_cuda_backend() {
    // This test binary registers no CUDA backend: the reason says so, never a fallback.
    let d = dev_attn();
    for name in [BackendName::Cuda, BackendName::Auto] {
        unavailable(sparse_attention(name, &d.fwd), "cuda", "no CUDA backend registered");
        unavailable(sparse_attention_backward(name, &d.bwd), "cuda", "no CUDA backend registered");
    }
}

// ---------------------------------------------------------------- backend names

#[test]
fn unknown_backend_names() {
    for s in ["tpu", "Reference", "CUDA", "", "cuda:0"] {
        let e = s.parse::<BackendName>().unwrap_err();
        assert!(matches!(e, Error::UnknownBackend(_)), "{e}");
        assert!(e.to_string().contains(&format!("`{s}`")) && e.to_string().contains("reference, cuda, auto"), "{e}");
    }
    for (s, b) in [("reference", REF), ("cpu", REF), ("torch", REF), ("cuda", BackendName::Cuda), ("auto", BackendName::Auto)] {
        assert_eq!(s.parse::<BackendName>().unwrap(), b);
    }
}

#[test]
fn kernel_availability_without_cuda() {
    for f in ["sinkhorn", "sparse_attn", "indexer", "qnorm_rope", "unknown", ""] {
        assert!(!is_kernel_available(f), "{f}");
    }
}

// ---------------------------------------------------------------- indexer

/// Valid inputs: B=1, S=3, H=2, D=4, P=2.
struct Ix {
    q: Tensor,
    kv: Tensor,
    w: Tensor,
    sel: Tensor,
    grad: Tensor,
}

const IQ: [usize; 4] = [1, 3, 2, 4];

fn ix() -> Ix {
    Ix {
        q: Tensor::from_f32(&IQ, (0..24).map(|i| (i as f32).sin()).collect()).unwrap(),
        kv: Tensor::from_f32(&[1, 2, 4], (0..8).map(|i| (i as f32).cos()).collect()).unwrap(),
        w: Tensor::from_f32(&[1, 3, 2], vec![1.0; 6]).unwrap(),
        sel: Tensor::from_i32(&[1, 3, 2], vec![0, 1, 1, -1, 0, 0]).unwrap(),
        grad: Tensor::from_f32(&[1, 3, 2], vec![1.0; 6]).unwrap(),
    }
}

impl Ix {
    fn args(&self) -> IndexerArgs<'_> {
        IndexerArgs::new(self.q.view(), self.kv.view(), self.w.view(), 0.5, 1)
    }
    fn bwd(&self) -> IndexerTopkScoresBwdArgs<'_> {
        IndexerTopkScoresBwdArgs { fwd: self.args(), topk_indices: self.sel.view(), grad: self.grad.view(), deterministic: false }
    }
}

/// Every indexer entry point that validates `IndexerArgs` fails naming `arg`.
fn ix_all(t: &Ix, a: &IndexerArgs, arg: &str, check: fn(Result<()>, &str)) {
    check(indexer_scores(REF, a).map(|_| ()), arg);
    check(lightning_indexer(REF, a, 2).map(|_| ()), arg);
    check(indexer_topk_scores(REF, a, &t.sel.view()).map(|_| ()), arg);
    check(indexer_topk_scores_backward(REF, &IndexerTopkScoresBwdArgs { fwd: a.clone(), ..t.bwd() }).map(|_| ()), arg);
    let mut o = zeros(DType::F32, &[1, 3, 2]);
    check(indexer_scores_into(REF, a, &mut o.view_mut()), arg);
}

#[test]
fn ix_sanity_valid_inputs_pass() {
    let t = ix();
    indexer_scores(REF, &t.args()).unwrap();
    lightning_indexer(REF, &t.args(), 1).unwrap();
    indexer_topk_scores(REF, &t.args(), &t.sel.view()).unwrap();
    indexer_topk_scores_backward(REF, &t.bwd()).unwrap();
}

#[test]
fn ix_q_dtype() {
    let t = ix();
    let q = zeros(DType::I64, &IQ);
    ix_all(&t, &IndexerArgs { q: q.view(), ..t.args() }, "q", dtype_err);
}

#[test]
fn ix_q_rank() {
    let t = ix();
    let q = zeros(DType::F32, &[3, 2, 4]);
    ix_all(&t, &IndexerArgs { q: q.view(), ..t.args() }, "q", shape_err);
}

#[test]
fn ix_zero_heads_or_head_dim() {
    let t = ix();
    let q = zeros(DType::F32, &[1, 3, 0, 4]);
    ix_all(&t, &IndexerArgs { q: q.view(), ..t.args() }, "q.shape[2] (heads)", value_err);
    let q = zeros(DType::F32, &[1, 3, 2, 0]);
    ix_all(&t, &IndexerArgs { q: q.view(), ..t.args() }, "q.shape[3] (head_dim)", value_err);
}

#[test]
fn ix_pooled_kv_dtype() {
    let t = ix();
    let kv = zeros(DType::BF16, &[1, 2, 4]);
    ix_all(&t, &IndexerArgs { pooled_kv: kv.view(), ..t.args() }, "pooled_kv", dtype_err);
}

#[test]
fn ix_pooled_kv_shape() {
    let t = ix();
    for shape in [&[2, 2, 4][..], &[1, 2, 3], &[2, 4]] {
        let kv = zeros(DType::F32, shape);
        ix_all(&t, &IndexerArgs { pooled_kv: kv.view(), ..t.args() }, "pooled_kv", shape_err);
    }
}

#[test]
fn ix_weights_dtype() {
    let t = ix();
    let w = zeros(DType::BF16, &[1, 3, 2]);
    ix_all(&t, &IndexerArgs { weights: w.view(), ..t.args() }, "weights", dtype_err);
}

#[test]
fn ix_weights_shape() {
    let t = ix();
    for shape in [&[1, 3, 3][..], &[1, 2, 2], &[3, 2]] {
        let w = zeros(DType::F32, shape);
        ix_all(&t, &IndexerArgs { weights: w.view(), ..t.args() }, "weights", shape_err);
    }
}

#[test]
fn ix_softmax_scale_not_finite() {
    let t = ix();
    for s in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        ix_all(&t, &IndexerArgs { softmax_scale: s, ..t.args() }, "softmax_scale", value_err);
    }
}

#[test]
fn ix_compress_ratio_zero() {
    let t = ix();
    ix_all(&t, &IndexerArgs { compress_ratio: 0, ..t.args() }, "compress_ratio", value_err);
}

#[test]
fn ix_query_total_len_too_small() {
    let t = ix();
    indexer_scores(REF, &IndexerArgs { query_start: 2, query_total_len: Some(5), ..t.args() }).unwrap();
    ix_all(&t, &IndexerArgs { query_start: 2, query_total_len: Some(4), ..t.args() }, "query_total_len", value_err);
    ix_all(&t, &IndexerArgs { query_total_len: Some(2), ..t.args() }, "query_total_len", value_err);
}

#[test]
fn ix_inputs_on_mixed_devices() {
    let t = ix();
    ix_all(&t, &IndexerArgs { pooled_kv: dev(DType::F32, &[1, 2, 4]), ..t.args() }, "pooled_kv", device_err);
    ix_all(&t, &IndexerArgs { weights: dev(DType::F32, &[1, 3, 2]), ..t.args() }, "weights", device_err);
}

#[test]
fn ix_topk_indices() {
    let t = ix();
    let a = t.args();
    let bad = zeros(DType::F32, &[1, 3, 2]);
    dtype_err(indexer_topk_scores(REF, &a, &bad.view()), "topk_indices");
    dtype_err(indexer_topk_scores_backward(REF, &IndexerTopkScoresBwdArgs { topk_indices: bad.view(), ..t.bwd() }), "topk_indices");
    let bad = zeros(DType::I32, &[1, 2, 2]);
    shape_err(indexer_topk_scores(REF, &a, &bad.view()), "topk_indices");
    shape_err(indexer_topk_scores_backward(REF, &IndexerTopkScoresBwdArgs { topk_indices: bad.view(), ..t.bwd() }), "topk_indices");
    let d = dev(DType::I32, &[1, 3, 2]);
    device_err(indexer_topk_scores(REF, &a, &d), "topk_indices");
    device_err(indexer_topk_scores_backward(REF, &IndexerTopkScoresBwdArgs { topk_indices: d.clone(), ..t.bwd() }), "topk_indices");
}

#[test]
fn ix_backward_grad() {
    let t = ix();
    let bad = zeros(DType::BF16, &[1, 3, 2]);
    dtype_err(indexer_topk_scores_backward(REF, &IndexerTopkScoresBwdArgs { grad: bad.view(), ..t.bwd() }), "grad");
    let bad = zeros(DType::F32, &[1, 3, 3]);
    shape_err(indexer_topk_scores_backward(REF, &IndexerTopkScoresBwdArgs { grad: bad.view(), ..t.bwd() }), "grad");
    device_err(indexer_topk_scores_backward(REF, &IndexerTopkScoresBwdArgs { grad: dev(DType::F32, &[1, 3, 2]), ..t.bwd() }), "grad");
}

#[test]
fn ix_topk_scores_argument() {
    let bad = zeros(DType::BF16, &[1, 3, 2]);
    dtype_err(indexer_topk(REF, &bad.view(), 1), "scores");
    let bad = zeros(DType::F32, &[3, 2]);
    shape_err(indexer_topk(REF, &bad.view(), 1), "scores");
}

#[test]
fn ix_k_zero() {
    let t = ix();
    let scores = zeros(DType::F32, &[1, 3, 2]);
    value_err(indexer_topk(REF, &scores.view(), 0), "k");
    value_err(lightning_indexer(REF, &t.args(), 0), "k");
}

#[test]
fn ix_scores_output() {
    let t = ix();
    let mut o = zeros(DType::BF16, &[1, 3, 2]);
    dtype_err(indexer_scores_into(REF, &t.args(), &mut o.view_mut()), "out");
    let mut o = zeros(DType::F32, &[1, 3, 3]);
    shape_err(indexer_scores_into(REF, &t.args(), &mut o.view_mut()), "out");
    let mut o = zeros(DType::F32, &[1, 2, 3]);
    let addr = o.view_mut().address() as usize as *mut u8;
    // SAFETY: the transposed strides stay inside `o`'s 6 elements.
    let mut ot = unsafe { TensorViewMut::from_raw(addr, DType::F32, &[1, 3, 2], &[6, 1, 3], Device::Cpu) };
    layout_err(indexer_scores_into(REF, &t.args(), &mut ot), "out");
    device_err(indexer_scores_into(REF, &t.args(), &mut dev_mut(DType::F32, &[1, 3, 2])), "out");
}

#[test]
fn ix_backends_and_devices() {
    let t = ix();
    let da = IndexerArgs::new(dev(DType::BF16, &IQ), dev(DType::BF16, &[1, 2, 4]), dev(DType::F32, &[1, 3, 2]), 0.5, 1);
    unavailable(indexer_scores(REF, &da), "reference", "CPU tensors");
    unavailable(lightning_indexer(REF, &da, 1), "reference", "CPU tensors");
    unavailable(indexer_topk(REF, &dev(DType::F32, &[1, 3, 2]), 1), "reference", "CPU tensors");
    unavailable(indexer_topk_scores(REF, &da, &dev(DType::I32, &[1, 3, 2])), "reference", "CPU tensors");
    unavailable(indexer_scores(BackendName::Cuda, &t.args()), "cuda", "CPU tensors");
    unavailable(indexer_topk(BackendName::Cuda, &zeros(DType::F32, &[1, 3, 2]).view(), 1), "cuda", "CPU tensors");
    unavailable(indexer_topk_scores_backward(BackendName::Cuda, &t.bwd()), "cuda", "CPU tensors");
    unavailable(indexer_scores(BackendName::Auto, &da), "cuda", "no CUDA backend registered");
}

// ---------------------------------------------------------------- sinkhorn

fn sk(x: TensorView<'_>) -> SinkhornArgs<'_> {
    SinkhornArgs { x, repeat: 3, eps: 1e-6 }
}

#[test]
fn sk_sanity_valid_inputs_pass() {
    let x = zeros(DType::F32, &[2, 4, 4]);
    sinkhorn_normalize(REF, &sk(x.view())).unwrap();
    sinkhorn_normalize_backward(REF, &sk(x.view()), &x.view()).unwrap();
    // A single matrix of rank 2 is fine.
    sinkhorn_normalize(REF, &sk(zeros(DType::F32, &[3, 3]).view())).unwrap();
}

#[test]
fn sk_x_dtype() {
    let x = zeros(DType::BF16, &[4, 4]);
    dtype_err(sinkhorn_normalize(REF, &sk(x.view())), "x");
}

#[test]
fn sk_x_shape() {
    for shape in [&[4][..], &[], &[2, 3, 4], &[2, 0, 0]] {
        let x = zeros(DType::F32, shape);
        shape_err(sinkhorn_normalize(REF, &sk(x.view())), "x");
        shape_err(sinkhorn_normalize_backward(REF, &sk(x.view()), &x.view()), "x");
    }
}

#[test]
fn sk_repeat_zero() {
    let x = zeros(DType::F32, &[4, 4]);
    value_err(sinkhorn_normalize(REF, &SinkhornArgs { repeat: 0, ..sk(x.view()) }), "repeat");
}

#[test]
fn sk_eps_not_positive() {
    let x = zeros(DType::F32, &[4, 4]);
    for eps in [0.0, -1e-6, f32::NAN, f32::INFINITY] {
        value_err(sinkhorn_normalize(REF, &SinkhornArgs { eps, ..sk(x.view()) }), "eps");
        value_err(sinkhorn_normalize_backward(REF, &SinkhornArgs { eps, ..sk(x.view()) }, &x.view()), "eps");
    }
}

#[test]
fn sk_dout() {
    let x = zeros(DType::F32, &[2, 4, 4]);
    let bad = zeros(DType::BF16, &[2, 4, 4]);
    dtype_err(sinkhorn_normalize_backward(REF, &sk(x.view()), &bad.view()), "dout");
    let bad = zeros(DType::F32, &[4, 4]);
    shape_err(sinkhorn_normalize_backward(REF, &sk(x.view()), &bad.view()), "dout");
    device_err(sinkhorn_normalize_backward(REF, &sk(x.view()), &dev(DType::F32, &[2, 4, 4])), "dout");
}

#[test]
fn sk_outputs() {
    let x = zeros(DType::F32, &[2, 4, 4]);
    let a = sk(x.view());
    let mut bad = zeros(DType::BF16, &[2, 4, 4]);
    dtype_err(sinkhorn_normalize_into(REF, &a, &mut bad.view_mut()), "out");
    dtype_err(sinkhorn_normalize_backward_into(REF, &a, &x.view(), &mut bad.view_mut()), "dx");
    let mut bad = zeros(DType::F32, &[8, 4]);
    shape_err(sinkhorn_normalize_into(REF, &a, &mut bad.view_mut()), "out");
    shape_err(sinkhorn_normalize_backward_into(REF, &a, &x.view(), &mut bad.view_mut()), "dx");
    device_err(sinkhorn_normalize_into(REF, &a, &mut dev_mut(DType::F32, &[2, 4, 4])), "out");
    device_err(sinkhorn_normalize_backward_into(REF, &a, &x.view(), &mut dev_mut(DType::F32, &[2, 4, 4])), "dx");
}

#[test]
fn sk_backends_and_devices() {
    let x = zeros(DType::F32, &[4, 4]);
    let d = dev(DType::F32, &[4, 4]);
    unavailable(sinkhorn_normalize(REF, &sk(d.clone())), "reference", "CPU tensors");
    unavailable(sinkhorn_normalize_backward(REF, &sk(d.clone()), &d), "reference", "CPU tensors");
    unavailable(sinkhorn_normalize(BackendName::Cuda, &sk(x.view())), "cuda", "CPU tensors");
    unavailable(sinkhorn_normalize(BackendName::Auto, &sk(d)), "cuda", "no CUDA backend registered");
}

// ---------------------------------------------------------------- qnorm_rope

/// Valid inputs: x logical [B,H,S,C] = [1,2,3,8], R = 4.
struct Qn {
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    rstd: Tensor,
    grad: Tensor,
}

const XS: [usize; 4] = [1, 2, 3, 8];

fn qn() -> Qn {
    Qn {
        x: Tensor::from_f32_as_bf16(&XS, &(0..48).map(|i| (i as f32 * 0.3).sin()).collect::<Vec<_>>()).unwrap(),
        cos: Tensor::from_f32(&[1, 3, 4], vec![1.0; 12]).unwrap(),
        sin: zeros(DType::F32, &[1, 3, 4]),
        rstd: zeros(DType::F32, &[6]),
        grad: zeros(DType::BF16, &XS),
    }
}

impl Qn {
    fn args(&self) -> QNormRopeArgs<'_> {
        QNormRopeArgs { x: self.x.view(), cos: self.cos.view(), sin: self.sin.view(), rotary: 4, eps: 1e-6 }
    }
}

/// Forward and backward both fail naming `arg`.
fn qn_both(t: &Qn, a: &QNormRopeArgs, arg: &str, check: fn(Result<()>, &str)) {
    check(qnorm_rope(REF, a).map(|_| ()), arg);
    check(qnorm_rope_backward(REF, a, &t.rstd.view(), &t.grad.view()).map(|_| ()), arg);
}

#[test]
fn qn_sanity_valid_inputs_pass() {
    let t = qn();
    let (_, rstd) = qnorm_rope(REF, &t.args()).unwrap();
    qnorm_rope_backward(REF, &t.args(), &rstd.view(), &t.grad.view()).unwrap();
    // rotary = 0 and rotary = C are both valid.
    let c0 = zeros(DType::F32, &[1, 3, 0]);
    qnorm_rope(REF, &QNormRopeArgs { cos: c0.view(), sin: c0.view(), rotary: 0, ..t.args() }).unwrap();
    let c8 = zeros(DType::F32, &[1, 3, 8]);
    qnorm_rope(REF, &QNormRopeArgs { cos: c8.view(), sin: c8.view(), rotary: 8, ..t.args() }).unwrap();
}

#[test]
fn qn_x_dtype() {
    let t = qn();
    let x = zeros(DType::I32, &XS);
    qn_both(&t, &QNormRopeArgs { x: x.view(), ..t.args() }, "x", dtype_err);
}

#[test]
fn qn_x_rank() {
    let t = qn();
    let x = zeros(DType::BF16, &[2, 3, 8]);
    qn_both(&t, &QNormRopeArgs { x: x.view(), ..t.args() }, "x", shape_err);
}

#[test]
fn qn_zero_channels() {
    let t = qn();
    let x = zeros(DType::BF16, &[1, 2, 3, 0]);
    let c = zeros(DType::F32, &[1, 3, 0]);
    qn_both(&t, &QNormRopeArgs { x: x.view(), cos: c.view(), sin: c.view(), rotary: 0, ..t.args() }, "x.shape[3] (channels)", value_err);
}

#[test]
fn qn_rotary_odd() {
    let t = qn();
    let c = zeros(DType::F32, &[1, 3, 3]);
    qn_both(&t, &QNormRopeArgs { cos: c.view(), sin: c.view(), rotary: 3, ..t.args() }, "rotary", value_err);
}

#[test]
fn qn_rotary_larger_than_channels() {
    let t = qn();
    let c = zeros(DType::F32, &[1, 3, 10]);
    qn_both(&t, &QNormRopeArgs { cos: c.view(), sin: c.view(), rotary: 10, ..t.args() }, "rotary", value_err);
}

#[test]
fn qn_eps_not_positive() {
    let t = qn();
    for eps in [0.0, -1.0, f32::NAN, f32::INFINITY] {
        qn_both(&t, &QNormRopeArgs { eps, ..t.args() }, "eps", value_err);
    }
}

#[test]
fn qn_cos_and_sin_dtype() {
    let t = qn();
    let bad = zeros(DType::BF16, &[1, 3, 4]);
    qn_both(&t, &QNormRopeArgs { cos: bad.view(), ..t.args() }, "cos", dtype_err);
    qn_both(&t, &QNormRopeArgs { sin: bad.view(), ..t.args() }, "sin", dtype_err);
}

#[test]
fn qn_cos_and_sin_shape() {
    let t = qn();
    for shape in [&[1, 3, 2][..], &[1, 2, 4], &[2, 3, 4], &[3, 4]] {
        let bad = zeros(DType::F32, shape);
        qn_both(&t, &QNormRopeArgs { cos: bad.view(), ..t.args() }, "cos", shape_err);
        qn_both(&t, &QNormRopeArgs { sin: bad.view(), ..t.args() }, "sin", shape_err);
    }
}

#[test]
fn qn_inputs_on_mixed_devices() {
    let t = qn();
    qn_both(&t, &QNormRopeArgs { cos: dev(DType::F32, &[1, 3, 4]), ..t.args() }, "cos", device_err);
    qn_both(&t, &QNormRopeArgs { sin: dev(DType::F32, &[1, 3, 4]), ..t.args() }, "sin", device_err);
}

#[test]
fn qn_backward_rstd() {
    let t = qn();
    let a = t.args();
    let bad = zeros(DType::BF16, &[6]);
    dtype_err(qnorm_rope_backward(REF, &a, &bad.view(), &t.grad.view()), "rstd");
    let bad = zeros(DType::F32, &[1, 3, 2]);
    shape_err(qnorm_rope_backward(REF, &a, &bad.view(), &t.grad.view()), "rstd");
    device_err(qnorm_rope_backward(REF, &a, &dev(DType::F32, &[6]), &t.grad.view()), "rstd");
}

#[test]
fn qn_backward_grad() {
    let t = qn();
    let a = t.args();
    let bad = zeros(DType::I32, &XS);
    dtype_err(qnorm_rope_backward(REF, &a, &t.rstd.view(), &bad.view()), "grad");
    let bad = zeros(DType::BF16, &[1, 3, 2, 8]);
    shape_err(qnorm_rope_backward(REF, &a, &t.rstd.view(), &bad.view()), "grad");
    device_err(qnorm_rope_backward(REF, &a, &t.rstd.view(), &dev(DType::BF16, &XS)), "grad");
}

#[test]
fn qn_outputs() {
    let t = qn();
    let a = t.args();
    let tm = token_major_strides(XS);
    let mk = |dtype: DType, shape: &[usize], strides: &[isize]| -> Tensor { zeros(dtype, &[1, 3, 2, 8]).with_layout(shape, strides) };
    let mut rstd = zeros(DType::F32, &[6]);
    let mut good = mk(DType::BF16, &XS, &tm);
    qnorm_rope_into(REF, &a, &mut good.view_mut(), &mut rstd.view_mut()).unwrap();
    qnorm_rope_backward_into(REF, &a, &rstd.view(), &t.grad.view(), &mut good.view_mut()).unwrap();
    let mut bad = mk(DType::F32, &XS, &tm);
    dtype_err(qnorm_rope_into(REF, &a, &mut bad.view_mut(), &mut rstd.view_mut()), "out");
    dtype_err(qnorm_rope_backward_into(REF, &a, &rstd.view(), &t.grad.view(), &mut bad.view_mut()), "dx");
    let mut bad = zeros(DType::BF16, &[1, 3, 2, 8]);
    shape_err(qnorm_rope_into(REF, &a, &mut bad.view_mut(), &mut rstd.view_mut()), "out");
    shape_err(qnorm_rope_backward_into(REF, &a, &rstd.view(), &t.grad.view(), &mut bad.view_mut()), "dx");
    let mut bad = zeros(DType::BF16, &XS);
    layout_err(qnorm_rope_into(REF, &a, &mut bad.view_mut(), &mut rstd.view_mut()), "out");
    layout_err(qnorm_rope_backward_into(REF, &a, &rstd.view(), &t.grad.view(), &mut bad.view_mut()), "dx");
    let mut bad_r = zeros(DType::F32, &[1, 3, 2]);
    shape_err(qnorm_rope_into(REF, &a, &mut good.view_mut(), &mut bad_r.view_mut()), "rstd");
    let mut bad_r = zeros(DType::BF16, &[6]);
    dtype_err(qnorm_rope_into(REF, &a, &mut good.view_mut(), &mut bad_r.view_mut()), "rstd");
    // SAFETY (dev views below): never dereferenced.
    let mut dout = unsafe { TensorViewMut::from_raw(NonNull::<u64>::dangling().as_ptr() as *mut u8, DType::BF16, &XS, &tm, CUDA) };
    device_err(qnorm_rope_into(REF, &a, &mut dout, &mut rstd.view_mut()), "out");
    device_err(qnorm_rope_into(REF, &a, &mut good.view_mut(), &mut dev_mut(DType::F32, &[6])), "rstd");
    device_err(qnorm_rope_backward_into(REF, &a, &rstd.view(), &t.grad.view(), &mut dout), "dx");
}

#[test]
fn qn_backends_and_devices() {
    let t = qn();
    let da = QNormRopeArgs { x: dev(DType::BF16, &XS), cos: dev(DType::F32, &[1, 3, 4]), sin: dev(DType::F32, &[1, 3, 4]), rotary: 4, eps: 1e-6 };
    unavailable(qnorm_rope(REF, &da), "reference", "CPU tensors");
    unavailable(qnorm_rope_backward(REF, &da, &dev(DType::F32, &[6]), &dev(DType::BF16, &XS)), "reference", "CPU tensors");
    unavailable(qnorm_rope(BackendName::Cuda, &t.args()), "cuda", "CPU tensors");
    unavailable(qnorm_rope(BackendName::Auto, &da), "cuda", "no CUDA backend registered");
}

// ---------------------------------------------------------------- index builder and plans

fn build(a: &BuildIndicesArgs) -> Result<Tensor> {
    build_sparse_topk_indices(REF, a)
}

#[test]
fn bi_sanity_valid_inputs_pass() {
    let mut a = BuildIndicesArgs::new(2, 3, 5, 2);
    a.n_pooled = 2;
    a.compress_ratio = 2;
    build(&a).unwrap();
}

#[test]
fn bi_window_size_zero() {
    value_err(build(&BuildIndicesArgs::new(1, 3, 3, 0)), "window_size");
}

#[test]
fn bi_attention_mask() {
    let base = BuildIndicesArgs::new(2, 3, 4, 2);
    let bad = zeros(DType::I32, &[2, 1, 3, 4]);
    dtype_err(build(&BuildIndicesArgs { attention_mask: Some(bad.view()), ..base.clone() }), "attention_mask");
    for shape in [&[2, 3, 4][..], &[2, 2, 3, 4], &[1, 1, 3, 4], &[2, 1, 4, 4]] {
        let bad = zeros(DType::F32, shape);
        shape_err(build(&BuildIndicesArgs { attention_mask: Some(bad.view()), ..base.clone() }), "attention_mask");
    }
    // Narrower than key_len.
    let bad = zeros(DType::F32, &[2, 1, 3, 3]);
    let e = err_names(build(&BuildIndicesArgs { attention_mask: Some(bad.view()), ..base.clone() }), "attention_mask");
    assert!(e.to_string().contains("key_len"), "{e}");
    let wide = zeros(DType::BF16, &[2, 1, 3, 6]);
    build(&BuildIndicesArgs { attention_mask: Some(wide.view()), ..base }).unwrap();
}

#[test]
fn bi_compressed_topk() {
    let base = BuildIndicesArgs { n_pooled: 2, ..BuildIndicesArgs::new(2, 3, 5, 2) };
    let bad = zeros(DType::F32, &[2, 3, 2]);
    dtype_err(build(&BuildIndicesArgs { compressed_topk: Some(bad.view()), ..base.clone() }), "compressed_topk");
    for shape in [&[2, 2, 2][..], &[1, 3, 2], &[2, 3]] {
        let bad = zeros(DType::I32, shape);
        shape_err(build(&BuildIndicesArgs { compressed_topk: Some(bad.view()), ..base.clone() }), "compressed_topk");
    }
    let ok = zeros(DType::I64, &[2, 3, 2]);
    build(&BuildIndicesArgs { compressed_topk: Some(ok.view()), ..base.clone() }).unwrap();
    value_err(build(&BuildIndicesArgs { compressed_topk: Some(ok.view()), n_pooled: 0, ..base }), "n_pooled");
}

#[test]
fn bi_compress_ratio_zero_with_pooled_keys() {
    let a = BuildIndicesArgs { n_pooled: 2, compress_ratio: 0, ..BuildIndicesArgs::new(1, 3, 5, 2) };
    value_err(build(&a), "compress_ratio");
    // Without pooled keys the ratio is unused.
    build(&BuildIndicesArgs { n_pooled: 0, ..a }).unwrap();
}

#[test]
fn bi_q_positions() {
    let base = BuildIndicesArgs::new(2, 3, 5, 2);
    let bad = zeros(DType::F32, &[3]);
    dtype_err(build(&BuildIndicesArgs { q_positions: Some(bad.view()), ..base.clone() }), "q_positions");
    for shape in [&[4][..], &[3, 3], &[2, 4], &[1, 1, 3], &[]] {
        let bad = zeros(DType::I32, shape);
        shape_err(build(&BuildIndicesArgs { q_positions: Some(bad.view()), ..base.clone() }), "q_positions");
    }
    for shape in [&[3][..], &[1, 3], &[2, 3]] {
        let ok = zeros(DType::I64, shape);
        build(&BuildIndicesArgs { q_positions: Some(ok.view()), ..base.clone() }).unwrap();
    }
}

#[test]
fn bi_vision_token_types() {
    let base = BuildIndicesArgs { max_image_tokens: 2, ..BuildIndicesArgs::new(2, 3, 3, 2) };
    let bad = zeros(DType::BF16, &[2, 3]);
    dtype_err(build(&BuildIndicesArgs { vision_token_types: Some(bad.view()), ..base.clone() }), "vision_token_types");
    for shape in [&[3][..], &[1, 3], &[2, 3, 1]] {
        let bad = zeros(DType::I32, shape);
        shape_err(build(&BuildIndicesArgs { vision_token_types: Some(bad.view()), ..base.clone() }), "vision_token_types");
    }
}

#[test]
fn bi_tensors_on_mixed_devices() {
    let mask = zeros(DType::F32, &[1, 1, 3, 3]);
    let base = BuildIndicesArgs { attention_mask: Some(mask.view()), ..BuildIndicesArgs::new(1, 3, 3, 2) };
    device_err(build(&BuildIndicesArgs { q_positions: Some(dev(DType::I32, &[3])), ..base.clone() }), "q_positions");
    device_err(build(&BuildIndicesArgs { vision_token_types: Some(dev(DType::I32, &[1, 3])), max_image_tokens: 1, ..base.clone() }), "vision_token_types");
    device_err(build(&BuildIndicesArgs { n_pooled: 1, compressed_topk: Some(dev(DType::I32, &[1, 3, 1])), ..base }), "compressed_topk");
}

#[test]
fn bi_output() {
    let a = BuildIndicesArgs::new(1, 3, 3, 2);
    let mut bad = zeros(DType::I64, &[1, 3, 2]);
    dtype_err(build_sparse_topk_indices_into(REF, &a, &mut bad.view_mut()), "out");
    let mut bad = zeros(DType::I32, &[1, 3, 3]);
    shape_err(build_sparse_topk_indices_into(REF, &a, &mut bad.view_mut()), "out");
    device_err(build_sparse_topk_indices_into(REF, &a, &mut dev_mut(DType::I32, &[1, 3, 2])), "out");
}

#[test]
fn bi_backends_and_devices() {
    let on_dev = BuildIndicesArgs { device: CUDA, ..BuildIndicesArgs::new(1, 3, 3, 2) };
    unavailable(build(&on_dev), "reference", "CPU tensors");
    let with_dev_tensor = BuildIndicesArgs { q_positions: Some(dev(DType::I32, &[3])), ..BuildIndicesArgs::new(1, 3, 3, 2) };
    unavailable(build(&with_dev_tensor), "reference", "CPU tensors");
    unavailable(build_sparse_topk_indices(BackendName::Cuda, &BuildIndicesArgs::new(1, 3, 3, 2)), "cuda", "CPU tensors");
    unavailable(build_sparse_topk_indices(BackendName::Auto, &on_dev), "cuda", "no CUDA backend registered");
}

#[test]
fn plan_topk_idxs() {
    let bad = zeros(DType::F32, &[1, 2, 2]);
    dtype_err(plan_sparse_indices(REF, &bad.view(), 3, false), "topk_idxs");
    let bad = zeros(DType::I32, &[2, 2]);
    shape_err(plan_sparse_indices(REF, &bad.view(), 3, false), "topk_idxs");
}

#[test]
fn plan_kv_len_overflows_int32_coordinates() {
    let idx = zeros(DType::I32, &[2, 1, 1]);
    plan_sparse_indices(REF, &idx.view(), (i32::MAX / 2) as usize, false).unwrap();
    value_err(plan_sparse_indices(REF, &idx.view(), i32::MAX as usize, false), "kv_len");
}

#[test]
fn plan_backends_and_devices() {
    unavailable(plan_sparse_indices(REF, &dev(DType::I32, &[1, 2, 2]), 3, false), "reference", "CPU tensors");
    unavailable(plan_sparse_indices(BackendName::Cuda, &zeros(DType::I32, &[1, 2, 2]).view(), 3, false), "cuda", "CPU tensors");
    unavailable(plan_sparse_indices(BackendName::Auto, &dev(DType::I32, &[1, 2, 2]), 3, false), "cuda", "no CUDA backend registered");
}

// ---------------------------------------------------------------- check.rs

#[test]
fn check_shape_rank_and_dims() {
    let t = zeros(DType::F32, &[2, 3]);
    check::shape("op", "t", &t.view(), "[A,B]", &[Some(2), None]).unwrap();
    let e = err_names(check::shape("op", "t", &t.view(), "[A,B]", &[Some(2), Some(4)]), "t");
    assert!(e.to_string().contains("[A,B] = [2, 4]") && e.to_string().contains("[2, 3]"), "{e}");
    shape_err(check::shape("op", "t", &t.view(), "[A,B,C]", &[None; 3]), "t");
}

#[test]
fn check_dtype_lists_the_allowed() {
    let t = zeros(DType::I64, &[1]);
    check::dtype("op", "t", &t.view(), check::INTS).unwrap();
    let e = err_names(check::dtype("op", "t", &t.view(), check::FLOATS), "t");
    assert!(e.to_string().contains("bf16 or f32") && e.to_string().contains("i64"), "{e}");
}

#[test]
fn check_output_dtype_shape_layout() {
    let mut t = zeros(DType::F32, &[2, 3]);
    check::output_on("op", "o", &t.view_mut(), Device::Cpu, DType::F32, &[2, 3], None).unwrap();
    dtype_err(check::output_on("op", "o", &t.view_mut(), Device::Cpu, DType::BF16, &[2, 3], None), "o");
    shape_err(check::output_on("op", "o", &t.view_mut(), Device::Cpu, DType::F32, &[3, 2], None), "o");
    layout_err(check::output_on("op", "o", &t.view_mut(), Device::Cpu, DType::F32, &[2, 3], Some(&[1, 2])), "o");
    device_err(check::output_on("op", "o", &t.view_mut(), CUDA, DType::F32, &[2, 3], None), "o");
    // Size-1 dimensions may carry any stride.
    let addr = t.view_mut().address() as usize as *mut u8;
    // SAFETY: 1 x 3 elements at stride 1 inside `t`.
    let v = unsafe { TensorViewMut::from_raw(addr, DType::F32, &[1, 3], &[999, 1], Device::Cpu) };
    check::output_on("op", "o", &v, Device::Cpu, DType::F32, &[1, 3], None).unwrap();
}

#[test]
fn check_scalars() {
    check::finite("op", "x", -3.0).unwrap();
    for x in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
        value_err(check::finite("op", "x", x), "x");
    }
    check::positive("op", "x", 1e-30).unwrap();
    for x in [0.0, -0.0, -1.0, f64::NAN, f64::INFINITY] {
        value_err(check::positive("op", "x", x), "x");
    }
    check::at_least("op", "n", 3, 3).unwrap();
    let e = err_names(check::at_least("op", "n", 2, 3), "n");
    assert!(e.to_string().contains(">= 3") && e.to_string().contains("= 2"), "{e}");
}

#[test]
fn sa_plan_with_inconsistent_layout() {
    // A hand-made plan whose indices do not hold B*S rows: an error, never an
    // out-of-bounds read.
    let t = attn();
    let good = plan_sparse_indices(REF, &t.idx.view(), 3, false).unwrap();
    for indices in [zeros(DType::I32, &[1, 1, 2]), zeros(DType::I32, &[2, 2]), zeros(DType::F32, &[2, 1, 2])] {
        let plan = SparseIndexPlan { indices, ..good.clone() };
        let a = SparseAttentionArgs { indices: SparseIndices::Plan(&plan), ..t.args() };
        err_names(fwd(&a), "plan");
        err_names(sparse_attention_backward(REF, &SparseAttentionBwdArgs { fwd: a.clone(), ..t.bwd() }), "plan");
    }
}
