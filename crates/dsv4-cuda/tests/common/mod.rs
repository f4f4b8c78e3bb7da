//! What every GPU test file needs: the CUDA backend, poisoned outputs, uploads, and the
//! judging of a list of outputs. (Each test file is its own crate; not every file uses
//! every helper.)
#![allow(dead_code)]

use dsv4_core::backend::{cuda_backend, KernelBackend};
use dsv4_core::compare::{judge, Judgement, Tolerance};
use dsv4_core::{DType, Device, Tensor};

pub use dsv4_core::rng::SplitMix64 as Rng;

pub const DEV: Device = Device::Cuda(0);

pub fn cuda() -> &'static dyn KernelBackend {
    dsv4_cuda::register();
    cuda_backend().unwrap_or_else(|e| panic!("no CUDA backend: {e}"))
}

/// Fill every byte a device tensor spans with `byte`.
pub fn poison(t: &Tensor, byte: u8) {
    let bytes = t.view().span_elems() * t.dtype().size();
    dsv4_cuda::gpu(0).unwrap().fill(t.view().address(), byte, bytes).unwrap();
}

/// A device tensor poisoned with NaN (floats: 0xFF bytes) or 0x7F7F7F7F (integers, a
/// value no index kernel writes), so an element a kernel forgets shows up.
pub fn poisoned(dtype: DType, shape: &[usize]) -> Tensor {
    let t = cuda().alloc(dtype, shape, DEV).unwrap();
    poison(&t, if dtype.is_int() { 0x7F } else { 0xFF });
    t
}

pub fn up(t: &Tensor) -> Tensor {
    cuda().upload(&t.view(), DEV).unwrap()
}

pub fn jt(name: &str, got: &Tensor, want: &Tensor, tol: Tolerance) -> Judgement {
    judge(name, &got.to_f64_vec().unwrap(), &want.to_f64_vec().unwrap(), tol)
}

/// Print every judgement; fail with the failing ones.
pub fn check(js: Vec<Judgement>) {
    let mut bad = Vec::new();
    for j in &js {
        println!("  {j}");
        if !j.pass {
            bad.push(j.to_string());
        }
    }
    assert!(bad.is_empty(), "failures:\n{}", bad.join("\n"));
}

/// The test inputs' distributions (values as the tests have always drawn them).
pub trait Draw {
    /// Uniform in [-1, 1) with 24 random bits.
    fn sym(&mut self) -> f32;
    /// Roughly normal, variance 1: the sum of three `sym`.
    fn normal3(&mut self) -> f32;
    /// `normal3` rounded to bf16.
    fn bf16_normal(&mut self) -> f32 {
        dsv4_core::real::round_bf16(self.normal3())
    }
    /// `n` values of `normal3() * scale`.
    fn normals(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.normal3() * scale).collect()
    }
}

impl Draw for Rng {
    fn sym(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    fn normal3(&mut self) -> f32 {
        self.sym() + self.sym() + self.sym()
    }
}
