//! The shared cases of qnorm_rope (see `crate::cases`): forward and backward into
//! token-major outputs, against the f64 reference with the kernels' bf16 boundaries.

use super::{qnorm_rope_backward_into, qnorm_rope_into, reference, token_major_strides, QNormRopeArgs};
use crate::cases::{f64s, Preset, Target};
use crate::compare::{judge, Judgement, Tolerance};
use crate::error::Result;
use crate::rng::SplitMix64;
use crate::tensor::{DType, Tensor};

/// How a case stores the logical `[B,H,S,C]` x (or the gradient).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Layout {
    /// `[B,H,S,C]` contiguous.
    Plain,
    /// Token-major `[B,S,H,C]` storage viewed as `[B,H,S,C]` (the usual call).
    TokenMajor,
    /// `[B,H,S,C+pad]` storage: rows not 16-byte aligned, no vector path.
    Padded(usize),
}

/// x `[B,H,S,C]` (normal, scale 1.5), cos/sin `[B,S,R]` of real angles, the gradient
/// (normal) in `grad_dtype`.
#[derive(Clone, Debug)]
pub struct Case {
    pub b: usize,
    pub h: usize,
    pub s: usize,
    pub c: usize,
    pub r: usize,
    /// x in f32 whatever the target's input dtype (else the target's).
    pub x_f32: bool,
    pub x_layout: Layout,
    pub grad_dtype: DType,
    pub grad_layout: Layout,
    pub seed: u64,
}

/// Host inputs (x and grad bf16-representable; cos/sin f32).
pub struct Inputs {
    pub x: Tensor,
    pub cos: Tensor,
    pub sin: Tensor,
    pub grad: Tensor,
}

impl Case {
    /// `[B,H,S,C]`, `R` rotary channels: token-major bf16 x and gradient.
    pub fn new([b, h, s, c]: [usize; 4], r: usize, seed: u64) -> Self {
        Case { b, h, s, c, r, x_f32: false, x_layout: Layout::TokenMajor, grad_dtype: DType::BF16, grad_layout: Layout::TokenMajor, seed }
    }

    /// The `dsv4 check` problem of a preset.
    pub fn preset(p: &Preset, seed: u64) -> Self {
        Case::new([p.b, p.h, p.s, p.c], p.r, seed)
    }

    pub fn name(&self) -> String {
        let lay = |l: Layout| match l {
            Layout::Plain => "plain".to_string(),
            Layout::TokenMajor => "token-major".to_string(),
            Layout::Padded(p) => format!("padded +{p}"),
        };
        format!("[{},{},{},{}] R={} x {}{} grad {} {}", self.b, self.h, self.s, self.c, self.r, if self.x_f32 { "f32 " } else { "" }, lay(self.x_layout), self.grad_dtype, lay(self.grad_layout))
    }

    pub fn inputs(&self) -> Result<Inputs> {
        let (b, h, s, c, r) = (self.b, self.h, self.s, self.c, self.r);
        let mut rng = SplitMix64(self.seed);
        let n = b * h * s * c;
        let bf = |v: f64| crate::real::round_bf16(v as f32);
        let x = Tensor::from_f32(&[b, h, s, c], (0..n).map(|_| bf(1.5 * rng.normal())).collect())?;
        let grad = Tensor::from_f32(&[b, h, s, c], (0..n).map(|_| bf(rng.normal())).collect())?;
        // Pair j of token s rotates by (s + 1) * 1e4^(-j / (R/2)) + b (the first R/2
        // entries hold the pair angles, the rest repeat them).
        let (mut cos, mut sin) = (Vec::with_capacity(b * s * r), Vec::with_capacity(b * s * r));
        for bi in 0..b {
            for si in 0..s {
                for j in 0..r {
                    let ang = (si as f64 + 1.0) * 1e4f64.powf(-((j % (r / 2).max(1)) as f64) / (r as f64 / 2.0).max(1.0)) + bi as f64;
                    cos.push(ang.cos() as f32);
                    sin.push(ang.sin() as f32);
                }
            }
        }
        Ok(Inputs { x, cos: Tensor::from_f32(&[b, s, r], cos)?, sin: Tensor::from_f32(&[b, s, r], sin)?, grad })
    }

    /// Forward into poisoned token-major outputs, then the backward from the target's own
    /// rstd, against the f64 reference (bf16 boundaries in place when x is bf16).
    pub fn run(&self, tg: &Target) -> Result<Vec<Judgement>> {
        let (b, h, s, c, r) = (self.b, self.h, self.s, self.c, self.r);
        let x = self.inputs()?;
        let x_dtype = if self.x_f32 { DType::F32 } else { tg.input_dtype };
        let stored = |t: &Tensor, dtype: DType, l: Layout| match l {
            Layout::Plain => tg.put(t, dtype),
            Layout::TokenMajor => tg.put_permuted(t, dtype, &[0, 2, 1, 3]),
            Layout::Padded(p) => tg.put_padded(t, dtype, p),
        };
        let xd = stored(&x.x, x_dtype, self.x_layout)?;
        let gd = stored(&x.grad, self.grad_dtype, self.grad_layout)?;
        let (cos, sin) = (tg.put(&x.cos, DType::F32)?, tg.put(&x.sin, DType::F32)?);
        let eps = 1e-6f32;
        let a = QNormRopeArgs { x: xd.view(), cos: cos.view(), sin: sin.view(), rotary: r, eps };
        let token_major = |dtype| -> Result<Tensor> { Ok(tg.poisoned(dtype, &[b, s, h, c])?.with_layout(&[b, h, s, c], &token_major_strides([b, h, s, c]))) };
        let mut y = token_major(x_dtype)?;
        let mut rstd = tg.poisoned(DType::F32, &[b * s * h])?;
        qnorm_rope_into(tg.backend, &a, &mut y.view_mut(), &mut rstd.view_mut())?;
        let mut dx = token_major(x_dtype)?;
        qnorm_rope_backward_into(tg.backend, &a, &rstd.view(), &gd.view(), &mut dx.view_mut())?;

        let dm = reference::Dims { b, h, s, c, r };
        let round = x_dtype == DType::BF16;
        let (x64, cos64, sin64) = (f64s(&x.x)?, f64s(&x.cos)?, f64s(&x.sin)?);
        // The f32 gradient is read as given; a bf16 one holds the same (bf16) values.
        let (want_y, want_rstd) = reference::forward::<f64>(dm, &x64, &cos64, &sin64, eps as f64, round);
        let want_dx = reference::backward::<f64>(dm, &x64, &cos64, &sin64, &f64s(&rstd)?, &f64s(&x.grad)?, round);
        let tol = Tolerance::Bf16Ulps { row_len: c, rotary: r };
        Ok(vec![
            judge("out", &f64s(&y)?, &want_y, tol),
            judge("rstd", &f64s(&rstd)?, &want_rstd, Tolerance::F32Rows { row_len: 1 }),
            judge("dx", &f64s(&dx)?, &want_dx, tol),
        ])
    }
}

/// The qnorm_rope test set: C from 2 to 1032 (C = 1 normalises a scalar: its gradient
/// is a cancellation to ~1e-7 that no f32 evaluation resolves) (the fast kernels' lane groups and chunks,
/// partial chunks, the generic kernels past 1024), no and full rotation, C - R not a
/// multiple of 8, plain, token-major and padded x, f32 x, f32 and plain gradients.
pub fn test_set() -> Vec<Case> {
    use Layout::{Padded, Plain, TokenMajor};
    let bf = DType::BF16;
    let f32_ = DType::F32;
    let shapes: [([usize; 4], usize, bool, Layout, DType, Layout); 20] = [
        ([2, 3, 5, 128], 64, false, TokenMajor, bf, TokenMajor),
        ([2, 3, 5, 100], 10, false, Plain, bf, Plain),
        ([1, 4, 7, 130], 2, false, Padded(3), bf, TokenMajor),
        ([2, 2, 3, 64], 64, false, Plain, f32_, Plain),
        ([1, 2, 3, 40], 0, false, TokenMajor, bf, Plain),
        ([1, 1, 1, 2], 2, false, Plain, bf, Plain),
        ([1, 3, 2, 7], 6, false, Plain, bf, TokenMajor),
        ([2, 3, 4, 128], 32, true, TokenMajor, f32_, TokenMajor),
        ([1, 5, 3, 36], 8, true, Padded(1), f32_, Plain),
        ([1, 2, 37, 1000], 64, false, TokenMajor, bf, TokenMajor),
        ([1, 3, 7, 8], 8, false, Plain, bf, Plain),
        ([2, 5, 3, 24], 24, false, TokenMajor, bf, TokenMajor),
        ([2, 3, 5, 64], 64, false, Plain, bf, TokenMajor),
        ([1, 4, 9, 264], 64, false, TokenMajor, bf, TokenMajor),
        ([1, 2, 5, 256], 0, false, TokenMajor, bf, Plain),
        ([1, 3, 11, 1024], 64, false, TokenMajor, bf, TokenMajor),
        ([1, 3, 3, 512], 512, false, TokenMajor, bf, TokenMajor),
        ([1, 2, 3, 1032], 64, false, TokenMajor, bf, TokenMajor),
        ([1, 7, 5, 512], 64, false, TokenMajor, f32_, TokenMajor),
        ([1, 16, 70, 128], 60, false, TokenMajor, bf, TokenMajor),
    ];
    shapes
        .into_iter()
        .enumerate()
        .map(|(i, (dims, r, x_f32, x_layout, grad_dtype, grad_layout))| Case { x_f32, x_layout, grad_dtype, grad_layout, ..Case::new(dims, r, 400 + i as u64) })
        .collect()
}
