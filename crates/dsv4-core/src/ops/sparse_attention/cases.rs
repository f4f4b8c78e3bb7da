//! The shared cases of sparse attention (see `crate::cases`): forward, the dense oracle,
//! a plan, and both backwards, judged against the f64 reference maths.

use super::{dense_attention_topk_into, reference, sparse_attention_backward_into, sparse_attention_into, BackwardImpl, SparseAttentionArgs, SparseAttentionBwdArgs, SparseIndices};
use crate::cases::{bf16_values, bits, causal_selection, f64s, Preset, Target};
use crate::compare::{judge, Judgement, Tolerance};
use crate::error::Result;
use crate::ops::sparse_indices::{self as si, BuildIndicesArgs};
use crate::rng::SplitMix64;
use crate::tensor::{DType, Tensor};
use crate::BackendName;

/// Where a case's `[B,S,T]` slots come from.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Slots {
    /// Random slots: valid keys, and in `noise`/10 of the slots -1, other negatives,
    /// indices `>= K` or a repeat of the row's previous key. With `empty_rows`, row 1 of
    /// every batch has no valid slot.
    Random { noise: u64, empty_rows: bool },
    /// A DeepSeek-V4 layer's: `K = S + S/ratio` keys (uncompressed, then pooled), a causal
    /// window of `window` keys plus `T - window` random causal picks of pooled keys,
    /// through the index builder. `emptied` rows (a multiple of 97 plus 2) lose every slot,
    /// and every 61st row keeps only its window: the rows a padded or packed batch gives.
    Model { window: usize, ratio: usize, emptied: bool },
}

/// One attention problem: q `[B,S,H,D]`, kv `[B,K,D]`, sinks `[H]`, slots `[B,S,T]`.
#[derive(Clone, Debug)]
pub struct Case {
    pub b: usize,
    pub s: usize,
    pub h: usize,
    pub d: usize,
    pub k: usize,
    pub t: usize,
    pub slots: Slots,
    /// |logit| ~ 1e4: every kv row has 8 in column 0 and q has +-1e4 / (8 sm_scale) there
    /// (even heads: a well-conditioned softmax around 1e4; odd heads: every slot
    /// underflows and the sink takes all the mass).
    pub big_logits: bool,
    /// Sinks uniform in +-sink_scale.
    pub sink_scale: f32,
    /// The slots' dtype (i32 or i64).
    pub idx_dtype: DType,
    pub reference_rounding: bool,
    pub seed: u64,
}

/// Host inputs (bf16-representable values in f32 tensors; slots in `idx_dtype`).
pub struct Inputs {
    pub q: Tensor,
    pub kv: Tensor,
    pub sinks: Tensor,
    pub topk_idxs: Tensor,
    pub dout: Tensor,
}

impl Case {
    /// Random slots with the default noise, one empty row per batch.
    pub fn random(b: usize, s: usize, h: usize, d: usize, k: usize, t: usize, seed: u64) -> Self {
        Case { b, s, h, d, k, t, slots: Slots::Random { noise: 4, empty_rows: true }, big_logits: false, sink_scale: 2.0, idx_dtype: DType::I32, reference_rounding: false, seed }
    }

    /// A DeepSeek-V4 layer's slots (see [`Slots::Model`]).
    pub fn model(b: usize, s: usize, h: usize, d: usize, window: usize, ratio: usize, picks: usize, seed: u64) -> Self {
        let k = s + s / ratio;
        Case { slots: Slots::Model { window, ratio, emptied: false }, ..Case::random(b, s, h, d, k, window + picks, seed) }
    }

    /// The `dsv4 check` problem of a preset.
    pub fn preset(p: &Preset, seed: u64) -> Self {
        Case::model(p.b, p.s, p.h, p.d, p.window, p.ratio, p.topk, seed)
    }

    pub fn name(&self) -> String {
        let slots = match self.slots {
            Slots::Random { noise, empty_rows } => format!("random slots (noise {noise}/10{})", if empty_rows { ", empty rows" } else { "" }),
            Slots::Model { window, ratio, emptied } => format!("window {window} + pooled 1/{ratio}{}", if emptied { ", emptied rows" } else { "" }),
        };
        let mut extra = String::new();
        if self.big_logits {
            extra += " |logit|~1e4";
        }
        if self.idx_dtype == DType::I64 {
            extra += " i64";
        }
        if self.reference_rounding {
            extra += " ref-rounding";
        }
        format!("B={} S={} H={} D={} K={} T={} sinks+-{} {slots}{extra}", self.b, self.s, self.h, self.d, self.k, self.t, self.sink_scale)
    }

    fn slots(&self, rng: &mut SplitMix64) -> Result<Vec<i64>> {
        let (b, s, k, t) = (self.b, self.s, self.k, self.t);
        match self.slots {
            Slots::Random { noise, empty_rows } => {
                let mut v = Vec::with_capacity(b * s * t);
                for _ in 0..b {
                    for si in 0..s {
                        let mut prev = 0i64;
                        for _ in 0..t {
                            let x = if empty_rows && si == 1 {
                                [-1, k as i64, -5][rng.below(3) as usize]
                            } else {
                                match rng.below(10) {
                                    r if r >= noise => rng.below(k as u64) as i64,
                                    0 => -1,
                                    1 => k as i64 + rng.below(3) as i64,
                                    2 => -(2 + rng.below(4) as i64),
                                    _ => prev,
                                }
                            };
                            if x >= 0 && (x as usize) < k {
                                prev = x;
                            }
                            v.push(x);
                        }
                    }
                }
                Ok(v)
            }
            Slots::Model { window, ratio, emptied } => {
                let n_pooled = s / ratio;
                let picks = causal_selection(rng, b, s, n_pooled, ratio, t - window, 0);
                let mut ba = BuildIndicesArgs::new(b, s, k, window);
                ba.compress_ratio = ratio;
                ba.n_pooled = n_pooled;
                ba.compressed_topk = Some(picks.view());
                let mut v = si::build_sparse_topk_indices(BackendName::Reference, &ba)?.to_i64_vec()?;
                if emptied {
                    for (row, slots) in v.chunks_mut(t).enumerate() {
                        let si = row % s;
                        if si % 97 == 2 {
                            slots.fill(-1);
                        } else if si % 61 == 5 {
                            slots[window..].fill(-1);
                        }
                    }
                }
                Ok(v)
            }
        }
    }

    /// The case's host inputs, the same on every machine for a seed.
    pub fn inputs(&self) -> Result<Inputs> {
        let (b, s, h, d, k, t) = (self.b, self.s, self.h, self.d, self.k, self.t);
        let mut rng = SplitMix64(self.seed);
        let q = bf16_values(&[b, s, h, d], &mut rng, 1.7);
        let kv = bf16_values(&[b, k, d], &mut rng, 1.7);
        let dout = bf16_values(&[b, s, h, d], &mut rng, 1.7);
        let sinks = Tensor::from_f32(&[h], (0..h).map(|_| rng.uniform(-self.sink_scale, self.sink_scale)).collect())?;
        let (q, kv) = if self.big_logits {
            let big = 1e4 * (d as f32).sqrt() / 8.0;
            let mut qv = q.to_f32_vec()?;
            let mut kvv = kv.to_f32_vec()?;
            for (i, row) in qv.chunks_mut(d).enumerate() {
                row[0] = if (i % h).is_multiple_of(2) { big } else { -big };
            }
            kvv.chunks_mut(d).for_each(|row| row[0] = 8.0);
            let round = |v: Vec<f32>| v.into_iter().map(crate::real::round_bf16).collect::<Vec<_>>();
            (Tensor::from_f32(&[b, s, h, d], round(qv))?, Tensor::from_f32(&[b, k, d], round(kvv))?)
        } else {
            (q, kv)
        };
        let iv = self.slots(&mut rng)?;
        let topk_idxs = match self.idx_dtype {
            DType::I64 => Tensor::from_i64(&[b, s, t], iv)?,
            _ => Tensor::from_i32(&[b, s, t], iv.into_iter().map(|x| x as i32).collect())?,
        };
        Ok(Inputs { q, kv, sinks, topk_idxs, dout })
    }

    /// Forward (into poisoned memory), the dense oracle, the forward through a plan, and
    /// the atomic and deterministic backwards (the deterministic one twice, bitwise equal)
    /// from the target's own `out` and `lse`: every output against the f64 reference on
    /// the same inputs.
    pub fn run(&self, tg: &Target) -> Result<Vec<Judgement>> {
        let (b, s, h, d, k, t) = (self.b, self.s, self.h, self.d, self.k, self.t);
        let x = self.inputs()?;
        let dm = reference::Dims { b, s, h, d, k, t };
        let idx64 = x.topk_idxs.to_i64_vec()?;
        let (q64, kv64, sinks64, dout64) = (f64s(&x.q)?, f64s(&x.kv)?, f64s(&x.sinks)?, f64s(&x.dout)?);
        let scale = (d as f64).powf(-0.5);

        let (q, kv, sinks, idx, dout) = (tg.input(&x.q)?, tg.input(&x.kv)?, tg.put(&x.sinks, DType::F32)?, tg.put(&x.topk_idxs, self.idx_dtype)?, tg.input(&x.dout)?);
        let mut args = SparseAttentionArgs::new(q.view(), kv.view(), sinks.view(), SparseIndices::TopK(idx.view()));
        args.sm_scale = scale as f32;
        args.reference_rounding = self.reference_rounding;
        let out_dtype = tg.input_dtype;
        let mut out = tg.poisoned(out_dtype, &[b, s, h, d])?;
        let mut lse = tg.poisoned(DType::F32, &[b, s, h])?;
        sparse_attention_into(tg.backend, &args, &mut out.view_mut(), &mut lse.view_mut())?;
        let (ref_out, ref_lse) = reference::forward::<f64>(dm, &q64, &kv64, &sinks64, &idx64, t, scale, false);
        let lse_tol = Tolerance::F32Rows { row_len: h };
        let mut js = vec![judge("out", &f64s(&out)?, &ref_out, Tolerance::Bf16), judge("lse", &f64s(&lse)?, &ref_lse, lse_tol)];

        let mut dense = tg.poisoned(out_dtype, &[b, s, h, d])?;
        dense_attention_topk_into(tg.backend, &args, &mut dense.view_mut())?;
        let (ref_dense, _) = reference::forward::<f64>(dm, &q64, &kv64, &sinks64, &idx64, t, scale, true);
        js.push(judge("dense_out (duplicates collapse)", &f64s(&dense)?, &ref_dense, Tolerance::Bf16));

        let plan = si::plan_sparse_indices(tg.backend, &idx.view(), k, false)?;
        let mut pargs = args.clone();
        pargs.indices = SparseIndices::Plan(&plan);
        let mut pout = tg.poisoned(out_dtype, &[b, s, h, d])?;
        let mut plse = tg.poisoned(DType::F32, &[b, s, h])?;
        sparse_attention_into(tg.backend, &pargs, &mut pout.view_mut(), &mut plse.view_mut())?;
        js.push(judge("out (plan)", &f64s(&pout)?, &ref_out, Tolerance::Bf16));
        js.push(judge("lse (plan)", &f64s(&plse)?, &ref_lse, lse_tol));

        // The backward's inputs include the forward's out and lse: the reference is
        // evaluated on the ones the target produced.
        let rg = reference::backward::<f64>(dm, &q64, &kv64, &sinks64, &idx64, t, scale, &f64s(&out)?, &f64s(&lse)?, &dout64);
        let backward = |fwd: &SparseAttentionArgs, imp: BackwardImpl| -> Result<(Tensor, Tensor, Tensor)> {
            let mut ba = SparseAttentionBwdArgs::new(fwd.clone(), out.view(), lse.view(), dout.view());
            ba.backward_impl = imp;
            let mut dq = tg.poisoned(out_dtype, &[b, s, h, d])?;
            let mut dkv = tg.poisoned(out_dtype, &[b, k, d])?;
            let mut dsinks = tg.poisoned(DType::F32, &[h])?;
            sparse_attention_backward_into(tg.backend, &ba, &mut dq.view_mut(), &mut dkv.view_mut(), &mut dsinks.view_mut())?;
            Ok((dq, dkv, dsinks))
        };
        for (tag, fwd, imp) in [("atomic", &args, BackwardImpl::Atomic), ("deterministic", &args, BackwardImpl::Deterministic), ("plan, deterministic", &pargs, BackwardImpl::Deterministic)] {
            let (dq, dkv, dsinks) = backward(fwd, imp)?;
            js.push(judge(&format!("dq ({tag})"), &f64s(&dq)?, &rg.dq, Tolerance::Bf16));
            js.push(judge(&format!("dkv ({tag})"), &f64s(&dkv)?, &rg.dkv, Tolerance::F32Grad));
            js.push(judge(&format!("dsinks ({tag})"), &f64s(&dsinks)?, &rg.dsinks, Tolerance::F32Grad));
            if imp == BackwardImpl::Deterministic {
                let (dq2, dkv2, ds2) = backward(fwd, imp)?;
                let same = bits(&dq)? == bits(&dq2)? && bits(&dkv)? == bits(&dkv2)? && bits(&dsinks)? == bits(&ds2)?;
                let mut j = judge(&format!("rerun bitwise equal ({tag})"), &[f64::from(u8::from(same))], &[1.0], Tolerance::Exact);
                if !same {
                    j.note = "the deterministic backward differs between two runs".into();
                }
                js.push(j);
            }
        }
        Ok(js)
    }
}

/// The attention test set: head counts and dims across the kernels' tilings, masked,
/// out-of-range and duplicate slots, empty rows, i64 slots, |logit| ~ 1e4, sinks of +-30,
/// the seeds' rounding, and a layer's slots with emptied and window-only rows.
pub fn test_set() -> Vec<Case> {
    let mut v = vec![
        Case::random(1, 3, 1, 64, 17, 7, 101),
        Case::random(2, 4, 3, 128, 40, 33, 102),
        Case::random(1, 4, 16, 64, 9, 1, 103),
        Case::random(2, 3, 3, 64, 20, 0, 104),
        Case::random(1, 3, 17, 128, 50, 33, 105),
        Case::random(2, 2, 16, 192, 70, 65, 106),
        Case::random(1, 2, 100, 64, 30, 40, 107),
        Case::random(1, 2, 5, 512, 30, 70, 108),
        Case::random(1, 2, 33, 320, 20, 9, 109),
        Case::random(1, 2, 128, 128, 30, 17, 117),
        Case::random(1, 2, 64, 448, 20, 9, 118),
        Case { idx_dtype: DType::I64, ..Case::random(2, 3, 3, 64, 30, 33, 110) },
        Case { big_logits: true, sink_scale: 30.0, ..Case::random(1, 4, 3, 64, 24, 33, 111) },
        Case { sink_scale: 30.0, ..Case::random(2, 3, 16, 128, 33, 7, 112) },
        Case { reference_rounding: true, ..Case::random(2, 3, 3, 64, 20, 33, 113) },
        Case { slots: Slots::Random { noise: 10, empty_rows: true }, ..Case::random(1, 5, 4, 64, 12, 9, 114) },
    ];
    let mut layer = Case::model(2, 200, 8, 64, 16, 4, 24, 115);
    layer.slots = Slots::Model { window: 16, ratio: 4, emptied: true };
    v.push(layer);
    v.push(Case::model(1, 130, 64, 512, 32, 4, 16, 116));
    v
}
