//! The shared cases of Sinkhorn normalisation (see `crate::cases`): forward and backward
//! against the f64 reference, x and dout stored plainly, permuted or misaligned.

use super::{reference, sinkhorn_normalize_backward_into, sinkhorn_normalize_into, SinkhornArgs};
use crate::cases::{f64s, Preset, Target};
use crate::compare::{judge, Judgement, Tolerance};
use crate::error::Result;
use crate::rng::SplitMix64;
use crate::tensor::{contiguous_strides, DType, Tensor, TensorView};

/// How a case stores `x` or `dout` on the target.
#[derive(Clone, Debug, PartialEq)]
pub enum Stored {
    /// Contiguous.
    Plain,
    /// Dimensions permuted in storage (see `Target::put_permuted`).
    Perm(Vec<usize>),
    /// Contiguous, starting one element (4 bytes) into its buffer: no vector path.
    Misaligned,
}

/// `x` `[..., n, n]` f32 (normal, scale 2), `dout` likewise (scale 1).
#[derive(Clone, Debug)]
pub struct Case {
    pub shape: Vec<usize>,
    pub repeat: usize,
    pub eps: f32,
    pub x: Stored,
    pub dout: Stored,
    pub seed: u64,
}

/// A stored tensor and the view the op reads (the view may start inside the buffer).
struct Put {
    buf: Tensor,
    misaligned: bool,
}

impl Put {
    fn new(tg: &Target, t: &Tensor, how: &Stored) -> Result<Put> {
        Ok(match how {
            Stored::Plain => Put { buf: tg.put(t, DType::F32)?, misaligned: false },
            Stored::Perm(p) => Put { buf: tg.put_permuted(t, DType::F32, p)?, misaligned: false },
            Stored::Misaligned => {
                let mut vals = vec![0f32];
                vals.extend(t.to_f32_vec()?);
                let n = vals.len();
                let buf = tg.put(&Tensor::from_f32(&[n], vals)?, DType::F32)?.with_layout(t.shape(), &contiguous_strides(t.shape()));
                Put { buf, misaligned: true }
            }
        })
    }

    fn view(&self) -> TensorView<'_> {
        if !self.misaligned {
            return self.buf.view();
        }
        let v = self.buf.view();
        // SAFETY: `buf` holds 1 + numel f32 values; the view covers elements 1..=numel and
        // borrows `self`, which keeps the buffer alive.
        unsafe { TensorView::from_raw((v.address() + 4) as usize as *const u8, DType::F32, v.shape(), v.strides(), v.device()) }
    }
}

impl Case {
    pub fn new(shape: &[usize], repeat: usize, seed: u64) -> Self {
        Case { shape: shape.to_vec(), repeat, eps: 1e-6, x: Stored::Plain, dout: Stored::Plain, seed }
    }

    /// The `dsv4 check` problem of a preset: `matrices` 4x4 matrices, repeat 20.
    pub fn preset(p: &Preset, seed: u64) -> Self {
        Case::new(&[p.matrices, 4, 4], 20, seed)
    }

    pub fn name(&self) -> String {
        let tag = |what: &str, s: &Stored| match s {
            Stored::Plain => String::new(),
            Stored::Perm(p) => format!(" {what} stored {p:?}"),
            Stored::Misaligned => format!(" {what} misaligned"),
        };
        format!("{:?} repeat {} eps {:e}{}{}", self.shape, self.repeat, self.eps, tag("x", &self.x), tag("dout", &self.dout))
    }

    /// Host `(x, dout)`.
    pub fn inputs(&self) -> Result<(Tensor, Tensor)> {
        let numel = self.shape.iter().product();
        let mut rng = SplitMix64(self.seed);
        let x = Tensor::from_f32(&self.shape, (0..numel).map(|_| 2.0 * rng.normal() as f32).collect())?;
        let dout = Tensor::from_f32(&self.shape, (0..numel).map(|_| rng.normal() as f32).collect())?;
        Ok((x, dout))
    }

    /// Forward and backward into poisoned memory, against the f64 reference. The f64
    /// reference is the gate: the backward over 2*repeat - 1 steps is ill-conditioned
    /// enough that an f32 evaluation lands up to ~6e-5 of the row scale from it.
    pub fn run(&self, tg: &Target) -> Result<Vec<Judgement>> {
        let n = *self.shape.last().unwrap_or(&1);
        let (x, dout) = self.inputs()?;
        let (xs, gs) = (Put::new(tg, &x, &self.x)?, Put::new(tg, &dout, &self.dout)?);
        let a = SinkhornArgs { x: xs.view(), repeat: self.repeat, eps: self.eps };
        let mut y = tg.poisoned(DType::F32, &self.shape)?;
        sinkhorn_normalize_into(tg.backend, &a, &mut y.view_mut())?;
        let mut dx = tg.poisoned(DType::F32, &self.shape)?;
        sinkhorn_normalize_backward_into(tg.backend, &a, &gs.view(), &mut dx.view_mut())?;
        let (x64, g64) = (f64s(&x)?, f64s(&dout)?);
        let tol = Tolerance::F32Rows { row_len: n };
        Ok(vec![
            judge("out", &f64s(&y)?, &reference::forward::<f64>(&x64, n, self.repeat, self.eps as f64), tol),
            judge("dx", &f64s(&dx)?, &reference::backward::<f64>(&x64, &g64, n, self.repeat, self.eps as f64), tol),
        ])
    }
}

/// The Sinkhorn test set: every n from 1 to 8 at repeat 1 and 20, batch dims, no matrix
/// at all, strided, permuted and misaligned x and dout, an eps below the forward's
/// reciprocal bound.
pub fn test_set() -> Vec<Case> {
    let mut v: Vec<Case> = Vec::new();
    let mut seed = 300;
    let mut next = || {
        seed += 1;
        seed
    };
    for (shape, repeat) in [(vec![7, 4, 4], 20), (vec![2, 3, 5, 4, 4], 3), (vec![33, 8, 8], 20), (vec![5, 3, 3], 1), (vec![9, 1, 1], 4), (vec![4, 2, 2], 2), (vec![3, 7, 7], 5), (vec![1, 5, 5], 10), (vec![4, 4], 20), (vec![0, 4, 4], 20)] {
        v.push(Case::new(&shape, repeat, next()));
    }
    for n in 1..=8 {
        for repeat in [1, 20] {
            v.push(Case::new(&[37, n, n], repeat, next()));
        }
    }
    let t = |p: &[usize]| Stored::Perm(p.to_vec());
    v.push(Case { x: Stored::Misaligned, dout: t(&[0, 2, 1]), ..Case::new(&[1, 5, 5], 20, next()) });
    v.push(Case { dout: t(&[0, 2, 1]), ..Case::new(&[6, 4, 4], 20, next()) });
    v.push(Case { eps: 1e-3, x: t(&[1, 0, 2, 3]), dout: t(&[1, 0, 3, 2]), ..Case::new(&[3, 5, 8, 8], 7, next()) });
    v.push(Case { x: t(&[2, 0, 1, 4, 3]), dout: t(&[0, 2, 1, 3, 4]), ..Case::new(&[2, 3, 4, 4, 4], 20, next()) });
    v.push(Case { x: Stored::Misaligned, ..Case::new(&[300, 4, 4], 20, next()) });
    v.push(Case { dout: Stored::Misaligned, ..Case::new(&[300, 4, 4], 20, next()) });
    v.push(Case { x: Stored::Misaligned, dout: t(&[0, 2, 1]), ..Case::new(&[129, 2, 2], 1, next()) });
    v.push(Case { dout: t(&[0, 2, 1]), ..Case::new(&[65, 6, 6], 20, next()) });
    v.push(Case { eps: 1e-25, ..Case::new(&[300, 4, 4], 20, next()) });
    v
}
