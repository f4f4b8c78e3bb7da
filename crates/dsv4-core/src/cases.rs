//! The shared case sets: for every operation, seeded inputs at named shapes, judged
//! (SPEC.md section 8) against an f64 evaluation of the reference maths. One case body
//! runs on every backend: the reference tests (`tests/cases.rs`), the CUDA tests
//! (`dsv4-cuda/tests/gpu_cases.rs`) and `dsv4 check` (the [`Preset`] sets) take their
//! problems from here; `dsv4 bench` still builds its own inputs at the bench's shapes.
//!
//! Each op keeps its cases beside its maths (`ops/<op>/cases.rs`): a `Case` (shape and
//! input pattern), `Case::inputs` (host tensors, bf16-representable where a kernel reads
//! bf16) and `Case::run` (the op through a [`Target`], outputs written into poisoned
//! memory, every output judged).

use crate::backend::{self, BackendName};
use crate::compare::Judgement;
use crate::error::{Error, Result};
use crate::ops::{indexer, qnorm_rope, sinkhorn, sparse_attention, sparse_indices};
use crate::real::round_bf16;
use crate::rng::SplitMix64;
use crate::tensor::{DType, Device, Tensor};

/// Where and how a case (or a golden vector) executes.
#[derive(Clone, Copy, Debug)]
pub struct Target {
    pub backend: BackendName,
    pub device: Device,
    /// The dtype bf16-kernel inputs (q, kv, pooled_kv) are given in: f32 for the exact
    /// reference comparison, bf16 for the kernels.
    pub input_dtype: DType,
}

impl Target {
    /// The reference backend on the CPU, f32 inputs.
    pub fn reference() -> Self {
        Target { backend: BackendName::Reference, device: Device::Cpu, input_dtype: DType::F32 }
    }

    /// The reference backend on the CPU fed bf16 inputs, as the kernels are.
    pub fn reference_bf16() -> Self {
        Target { input_dtype: DType::BF16, ..Self::reference() }
    }

    /// The `cuda` backend on device 0, bf16 inputs.
    pub fn cuda() -> Self {
        Target { backend: BackendName::Cuda, device: Device::Cuda(0), input_dtype: DType::BF16 }
    }

    /// A copy of a host tensor in `dtype` on the target's device.
    pub fn put(&self, t: &Tensor, dtype: DType) -> Result<Tensor> {
        let host = if t.dtype() == dtype {
            t.clone()
        } else {
            match dtype {
                DType::BF16 => Tensor::from_f32_as_bf16(t.shape(), &t.to_f32_vec()?)?,
                DType::F32 => Tensor::from_f32(t.shape(), t.to_f32_vec()?)?,
                DType::I32 => Tensor::from_i32(t.shape(), t.to_i64_vec()?.into_iter().map(|v| v as i32).collect())?,
                DType::I64 => Tensor::from_i64(t.shape(), t.to_i64_vec()?)?,
            }
        };
        match self.device {
            Device::Cpu => Ok(host),
            Device::Cuda(_) => backend::cuda_backend().map_err(Error::Cuda)?.upload(&host.view(), self.device),
        }
    }

    /// The logical tensor `t` stored with its dimensions in the order `perm` (storage
    /// dimension `i` is logical dimension `perm[i]`), read back through strides:
    /// `[0, 2, 1, 3]` is the token-major storage of a logical `[B,H,S,C]` tensor.
    pub fn put_permuted(&self, t: &Tensor, dtype: DType, perm: &[usize]) -> Result<Tensor> {
        let mut v = t.view();
        let mut order: Vec<usize> = (0..perm.len()).collect();
        for (i, &want) in perm.iter().enumerate() {
            let j = order.iter().position(|&d| d == want).expect("perm is a permutation");
            if i != j {
                v = v.transpose(i, j);
                order.swap(i, j);
            }
        }
        let stored = self.put(&v.to_tensor()?, dtype)?;
        let mut strides = vec![0isize; perm.len()];
        for (pos, &d) in perm.iter().enumerate() {
            strides[d] = stored.strides()[pos];
        }
        Ok(stored.with_layout(t.shape(), &strides))
    }

    /// The logical tensor `t` stored with dimensions `a` and `b` swapped.
    pub fn put_transposed(&self, t: &Tensor, dtype: DType, a: usize, b: usize) -> Result<Tensor> {
        let mut perm: Vec<usize> = (0..t.shape().len()).collect();
        perm.swap(a, b);
        self.put_permuted(t, dtype, &perm)
    }

    /// The logical tensor `t` with a last-dimension stride of `step` (the elements between
    /// hold 7.0, which no op may read).
    pub fn put_strided_last(&self, t: &Tensor, dtype: DType, step: usize) -> Result<Tensor> {
        let shape = t.shape().to_vec();
        let last = *shape.last().unwrap_or(&1);
        let values = t.to_f32_vec()?;
        let spread: Vec<f32> = values.iter().flat_map(|&x| std::iter::once(x).chain(std::iter::repeat_n(7.0, step - 1))).collect();
        let mut stored_shape = shape.clone();
        *stored_shape.last_mut().expect("rank >= 1") = last * step;
        let stored = self.put(&Tensor::from_f32(&stored_shape, spread)?, dtype)?;
        let mut strides: Vec<isize> = stored.strides().to_vec();
        *strides.last_mut().expect("rank >= 1") = step as isize;
        Ok(stored.with_layout(&shape, &strides))
    }

    /// The logical tensor `t` whose last-dimension rows are followed by `pad` elements
    /// (holding 7.0) in storage: rows not aligned to any vector width.
    pub fn put_padded(&self, t: &Tensor, dtype: DType, pad: usize) -> Result<Tensor> {
        let shape = t.shape().to_vec();
        let c = *shape.last().unwrap_or(&1);
        let values = t.to_f32_vec()?;
        let padded: Vec<f32> = values.chunks(c.max(1)).flat_map(|row| row.iter().copied().chain(std::iter::repeat_n(7.0, pad))).collect();
        let mut stored_shape = shape.clone();
        *stored_shape.last_mut().expect("rank >= 1") = c + pad;
        let stored = self.put(&Tensor::from_f32(&stored_shape, padded)?, dtype)?;
        let strides = stored.strides().to_vec();
        Ok(stored.with_layout(&shape, &strides))
    }

    /// A bf16-kernel input (`input_dtype`) on the target's device.
    pub fn input(&self, t: &Tensor) -> Result<Tensor> {
        self.put(t, self.input_dtype)
    }

    /// An output buffer on the target's device, every element poisoned (floats NaN,
    /// integers 0x7F7F7F7F, a value no index op writes), so an element an op forgets to
    /// write fails its judgement.
    pub fn poisoned(&self, dtype: DType, shape: &[usize]) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        let host = match dtype {
            DType::BF16 => Tensor::from_f32_as_bf16(shape, &vec![f32::NAN; n])?,
            DType::F32 => Tensor::from_f32(shape, vec![f32::NAN; n])?,
            DType::I32 => Tensor::from_i32(shape, vec![0x7F7F_7F7F; n])?,
            DType::I64 => Tensor::from_i64(shape, vec![0x7F7F_7F7F_7F7F_7F7F; n])?,
        };
        self.put(&host, dtype)
    }

    /// Wait for the target's device (wall-clock timing of a case).
    pub fn synchronize(&self) -> Result<()> {
        match self.device {
            Device::Cpu => Ok(()),
            Device::Cuda(_) => backend::cuda_backend().map_err(Error::Cuda)?.synchronize(self.device),
        }
    }
}

/// One case of any op.
#[derive(Clone, Debug)]
pub enum Case {
    SparseAttention(sparse_attention::cases::Case),
    Indexer(indexer::cases::Case),
    BuildIndices(sparse_indices::cases::Case),
    Sinkhorn(sinkhorn::cases::Case),
    QNormRope(qnorm_rope::cases::Case),
}

impl Case {
    /// The op's name as the table and the tests print it.
    pub fn op(&self) -> &'static str {
        match self {
            Case::SparseAttention(_) => "sparse_attention",
            Case::Indexer(_) => "indexer",
            Case::BuildIndices(_) => "build_sparse_topk_indices",
            Case::Sinkhorn(_) => "sinkhorn_normalize",
            Case::QNormRope(_) => "qnorm_rope",
        }
    }

    pub fn name(&self) -> String {
        match self {
            Case::SparseAttention(c) => c.name(),
            Case::Indexer(c) => c.name(),
            Case::BuildIndices(c) => c.name(),
            Case::Sinkhorn(c) => c.name(),
            Case::QNormRope(c) => c.name(),
        }
    }

    /// Run the case through `target`; every judged output, named `<case>: <output>`.
    pub fn run(&self, target: &Target) -> Result<Vec<Judgement>> {
        let mut js = match self {
            Case::SparseAttention(c) => c.run(target)?,
            Case::Indexer(c) => c.run(target)?,
            Case::BuildIndices(c) => c.run(target)?,
            Case::Sinkhorn(c) => c.run(target)?,
            Case::QNormRope(c) => c.run(target)?,
        };
        let name = self.name();
        for j in &mut js {
            j.name = format!("{name}: {}", j.name);
        }
        Ok(js)
    }
}

/// The test set of every op: small shapes and the edge cases (empty rows, masked and
/// out-of-range slots, ties, extreme logits and sinks, context-parallel offsets, strided
/// inputs), cheap enough for a debug build and for compute-sanitizer.
pub fn test_set() -> Vec<Case> {
    let mut v: Vec<Case> = Vec::new();
    v.extend(sparse_attention::cases::test_set().into_iter().map(Case::SparseAttention));
    v.extend(indexer::cases::test_set().into_iter().map(Case::Indexer));
    v.extend(sparse_indices::cases::test_set().into_iter().map(Case::BuildIndices));
    v.extend(sinkhorn::cases::test_set().into_iter().map(Case::Sinkhorn));
    v.extend(qnorm_rope::cases::test_set().into_iter().map(Case::QNormRope));
    v
}

/// Run every case of `cases` whose op is `op` through `target`; panics listing every
/// failed judgement and every case that could not run (an unavailable backend included:
/// nothing passes by falling back). The body of the per-op tests of [`case_tests!`].
pub fn assert_cases_pass(cases: &[Case], op: &str, target: &Target) {
    let verbose = std::env::var_os("DSV4_VERBOSE").is_some();
    let mut failures = Vec::new();
    let mut ran = 0;
    for case in cases.iter().filter(|c| c.op() == op) {
        ran += 1;
        match case.run(target) {
            Ok(js) => {
                for j in js {
                    if verbose || !j.pass {
                        println!("  {j}");
                    }
                    if !j.pass {
                        failures.push(j.to_string());
                    }
                }
            }
            Err(e) => failures.push(format!("{}: {e}", case.name())),
        }
    }
    assert!(ran > 0, "no case of op `{op}`");
    println!("{op}: {ran} cases on {:?} ({} inputs), {} failures", target.backend, target.input_dtype, failures.len());
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

/// One `#[test]` per op running its whole [`test_set`] through a target, for a backend
/// crate's tests (candle's `test_device!` idea): the same case bodies on every backend.
///
/// ```ignore
/// dsv4_core::case_tests!(dsv4_core::cases::Target::cuda(), ignore = "needs a CUDA GPU");
/// ```
#[macro_export]
macro_rules! case_tests {
    ($target:expr $(, $attr:meta)*) => {
        #[test] $(#[$attr])* fn small_sparse_attention_cases() { $crate::cases::assert_cases_pass(&$crate::cases::test_set(), "sparse_attention", &$target) }
        #[test] $(#[$attr])* fn small_indexer_cases() { $crate::cases::assert_cases_pass(&$crate::cases::test_set(), "indexer", &$target) }
        #[test] $(#[$attr])* fn small_build_sparse_topk_indices_cases() { $crate::cases::assert_cases_pass(&$crate::cases::test_set(), "build_sparse_topk_indices", &$target) }
        #[test] $(#[$attr])* fn small_sinkhorn_normalize_cases() { $crate::cases::assert_cases_pass(&$crate::cases::test_set(), "sinkhorn_normalize", &$target) }
        #[test] $(#[$attr])* fn small_qnorm_rope_cases() { $crate::cases::assert_cases_pass(&$crate::cases::test_set(), "qnorm_rope", &$target) }
    };
}

/// Problem sizes of one `dsv4 check` preset: a DeepSeek-V4-like layer.
#[derive(Clone, Copy, Debug)]
pub struct Preset {
    pub name: &'static str,
    pub b: usize,
    pub s: usize,
    /// Attention heads and head dim.
    pub h: usize,
    pub d: usize,
    /// Local window and selected compressed keys (T = window + topk).
    pub window: usize,
    pub topk: usize,
    pub ratio: usize,
    /// Indexer heads and head dim.
    pub ih: usize,
    pub id: usize,
    /// Sinkhorn matrices (n = 4, repeat 20).
    pub matrices: usize,
    /// qnorm_rope channels and rotary channels (heads = h).
    pub c: usize,
    pub r: usize,
}

pub const PRESETS: &[Preset] = &[
    Preset { name: "tiny", b: 2, s: 32, h: 4, d: 64, window: 8, topk: 4, ratio: 4, ih: 4, id: 32, matrices: 64, c: 64, r: 16 },
    Preset { name: "small", b: 1, s: 256, h: 64, d: 512, window: 64, topk: 32, ratio: 4, ih: 64, id: 128, matrices: 4096, c: 512, r: 64 },
    Preset { name: "medium", b: 2, s: 1024, h: 64, d: 512, window: 128, topk: 128, ratio: 4, ih: 64, id: 128, matrices: 65536, c: 512, r: 64 },
];

pub fn preset(name: &str) -> Option<Preset> {
    PRESETS.iter().copied().find(|p| p.name == name)
}

/// The cases `dsv4 check` runs at a preset: one per op, the attention over the indices the
/// builder makes from a causal selection of pooled keys (what a DeepSeek-V4 layer feeds it).
pub fn preset_set(p: &Preset, seed: u64) -> Vec<Case> {
    vec![
        Case::Indexer(indexer::cases::Case::preset(p, seed)),
        Case::BuildIndices(sparse_indices::cases::Case::preset(p, seed + 1)),
        Case::SparseAttention(sparse_attention::cases::Case::preset(p, seed + 2)),
        Case::Sinkhorn(sinkhorn::cases::Case::preset(p, seed + 3)),
        Case::QNormRope(qnorm_rope::cases::Case::preset(p, seed + 4)),
    ]
}

// ---- input helpers shared by the op case files ----

/// `n` values uniform in `[-scale, scale)`, rounded to bf16.
pub(crate) fn bf16_uniform(rng: &mut SplitMix64, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| round_bf16(rng.uniform(-scale, scale))).collect()
}

/// A host tensor of bf16-representable values stored as f32.
pub(crate) fn bf16_values(shape: &[usize], rng: &mut SplitMix64, scale: f32) -> Tensor {
    let n = shape.iter().product();
    Tensor::from_f32(shape, bf16_uniform(rng, n, scale)).expect("shape matches")
}

/// A causal random selection of pooled keys: for query `s` (global position
/// `query_start + s`), `min(k, visible)` distinct keys `p < (pos+1)/ratio` in random order,
/// then -1. `[B,S,k]` i32.
pub(crate) fn causal_selection(rng: &mut SplitMix64, b: usize, s: usize, n_pooled: usize, ratio: usize, k: usize, query_start: usize) -> Tensor {
    let mut out = vec![-1i32; b * s * k];
    let mut pool: Vec<i32> = (0..n_pooled as i32).collect();
    for bi in 0..b {
        for si in 0..s {
            let visible = ((query_start + si + 1) / ratio.max(1)).min(n_pooled);
            let take = k.min(visible);
            for j in 0..take {
                let pick = j + rng.below((visible - j) as u64) as usize;
                pool.swap(j, pick);
                out[(bi * s + si) * k + j] = pool[j];
            }
        }
    }
    Tensor::from_i32(&[b, s, k], out).expect("shape matches")
}

/// f64 values of a host tensor.
pub(crate) fn f64s(t: &Tensor) -> Result<Vec<f64>> {
    t.to_f64_vec()
}

/// Every value's bits, for bitwise comparisons of reruns.
pub(crate) fn bits(t: &Tensor) -> Result<Vec<u64>> {
    Ok(t.to_f64_vec()?.into_iter().map(f64::to_bits).collect())
}
