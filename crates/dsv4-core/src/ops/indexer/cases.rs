//! The shared cases of the lightning indexer (see `crate::cases`): scores, top-k (plain
//! and fused), the scores of a selection and their backward, against the f64 reference.

use super::{indexer_scores_into, indexer_topk_into, indexer_topk_scores_backward_into, indexer_topk_scores_into, lightning_indexer_into, reference, IndexerArgs, IndexerTopkScoresBwdArgs};
use crate::cases::{bf16_values, bits, f64s, Preset, Target};
use crate::compare::{judge, Judgement, Tolerance};
use crate::error::Result;
use crate::rng::SplitMix64;
use crate::tensor::{DType, Tensor};

/// One indexer problem, or a top-k of crafted scores.
#[derive(Clone, Debug)]
pub enum Case {
    Layer(Layer),
    Topk(Topk),
}

/// q `[B,S,H,D]`, pooled_kv `[B,P,D]`, weights `[B,S,H]`; top-`k`; a selection of `t`
/// slots for the scores of a selection and their backward.
#[derive(Clone, Debug)]
pub struct Layer {
    pub b: usize,
    pub s: usize,
    pub h: usize,
    pub d: usize,
    pub p: usize,
    pub ratio: usize,
    /// Global position of local query 0 (context parallelism).
    pub query_start: usize,
    pub k: usize,
    pub t: usize,
    /// The selection's dtype (i32 or i64).
    pub sel_dtype: DType,
    /// q read from `[B,H,S,D]` storage and pooled_kv with a d-stride of 2.
    pub strided: bool,
    pub seed: u64,
}

/// Top-`k` of `[B,S,P]` crafted scores: distinct values, heavy ties, +-0, +-inf, NaN, rows
/// with fewer finite scores than `k` and rows with none; `strided`: every other element of
/// a `[B,S,2P]` buffer.
#[derive(Clone, Debug)]
pub struct Topk {
    pub b: usize,
    pub s: usize,
    pub p: usize,
    pub k: usize,
    pub strided: bool,
    pub seed: u64,
}

impl Case {
    /// The `dsv4 check` problem of a preset: P = S / ratio pooled keys, top-`topk`.
    pub fn preset(p: &Preset, seed: u64) -> Self {
        Case::Layer(Layer::new([p.b, p.s, p.ih, p.id, p.s / p.ratio], p.ratio, 0, p.topk, p.topk, seed))
    }

    pub fn name(&self) -> String {
        match self {
            Case::Layer(c) => format!(
                "B={} S={} H={} D={} P={} ratio={} query_start={} k={} T={}{}{}",
                c.b, c.s, c.h, c.d, c.p, c.ratio, c.query_start, c.k, c.t,
                if c.sel_dtype == DType::I64 { " i64" } else { "" },
                if c.strided { " strided" } else { "" }
            ),
            Case::Topk(c) => format!("top-k of crafted scores B={} S={} P={} k={}{}", c.b, c.s, c.p, c.k, if c.strided { " strided" } else { "" }),
        }
    }

    pub fn run(&self, tg: &Target) -> Result<Vec<Judgement>> {
        match self {
            Case::Layer(c) => c.run(tg),
            Case::Topk(c) => c.run(tg),
        }
    }
}

/// Host inputs: q and pooled_kv bf16-representable, weights f32, the selection with
/// masked, out-of-range and duplicate slots, and its gradient (a seventh of it zero).
pub struct Inputs {
    pub q: Tensor,
    pub pooled_kv: Tensor,
    pub weights: Tensor,
    pub topk_indices: Tensor,
    pub grad: Tensor,
}

impl Layer {
    /// `[B, S, H, D, P]`, the compress ratio, the first query's position, top-`k`, and a
    /// selection of `t` slots (i32, contiguous inputs).
    pub fn new([b, s, h, d, p]: [usize; 5], ratio: usize, query_start: usize, k: usize, t: usize, seed: u64) -> Self {
        Layer { b, s, h, d, p, ratio, query_start, k, t, sel_dtype: DType::I32, strided: false, seed }
    }

    pub fn scale(&self) -> f32 {
        (self.d as f32).powf(-0.5)
    }

    pub fn inputs(&self) -> Result<Inputs> {
        let (b, s, h, d, p, t) = (self.b, self.s, self.h, self.d, self.p, self.t);
        let mut rng = SplitMix64(self.seed);
        let q = bf16_values(&[b, s, h, d], &mut rng, 1.7);
        let pooled_kv = bf16_values(&[b, p, d], &mut rng, 1.7);
        // Weights in [-0.2, 1): both signs, but a row's few visible scores rarely cancel to
        // a tiny fraction of their terms (which would test the summation order, not the op).
        let weights = Tensor::from_f32(&[b, s, h], (0..b * s * h).map(|_| rng.uniform(-0.2f32, 1.0)).collect())?;
        let sel: Vec<i64> = (0..b * s * t)
            .map(|_| match rng.below(10) {
                0 => -1,
                1 => (p + rng.below(5) as usize) as i64,
                2 => -(rng.below(100) as i64) - 2,
                _ => rng.below(p.max(1) as u64) as i64,
            })
            .collect();
        let topk_indices = match self.sel_dtype {
            DType::I64 => Tensor::from_i64(&[b, s, t], sel)?,
            _ => Tensor::from_i32(&[b, s, t], sel.into_iter().map(|x| x as i32).collect())?,
        };
        let grad = Tensor::from_f32(&[b, s, t], (0..b * s * t).map(|i| if i % 7 == 3 { 0.0 } else { rng.uniform(-1.0f32, 1.0) }).collect())?;
        Ok(Inputs { q, pooled_kv, weights, topk_indices, grad })
    }

    fn run(&self, tg: &Target) -> Result<Vec<Judgement>> {
        let (b, s, h, d, p, t) = (self.b, self.s, self.h, self.d, self.p, self.t);
        let x = self.inputs()?;
        let (q, kv) = if self.strided {
            (tg.put_transposed(&x.q, tg.input_dtype, 1, 2)?, tg.put_strided_last(&x.pooled_kv, tg.input_dtype, 2)?)
        } else {
            (tg.input(&x.q)?, tg.input(&x.pooled_kv)?)
        };
        let w = tg.put(&x.weights, DType::F32)?;
        let mut a = IndexerArgs::new(q.view(), kv.view(), w.view(), self.scale(), self.ratio);
        a.query_start = self.query_start;
        let dm = reference::Dims { b, s, h, d, p };
        let causal = a.causal();
        let (q64, kv64, w64) = (f64s(&x.q)?, f64s(&x.pooled_kv)?, f64s(&x.weights)?);
        let scale = self.scale() as f64;

        let mut scores = tg.poisoned(DType::F32, &[b, s, p])?;
        indexer_scores_into(tg.backend, &a, &mut scores.view_mut())?;
        let ref_scores = reference::scores::<f64>(dm, &q64, &kv64, &w64, scale, causal);
        let got_scores = f64s(&scores)?;
        let mut js = vec![judge("scores", &got_scores, &ref_scores, Tolerance::F32Rows { row_len: p })];

        // Top-k: of the target's own scores exactly (indices and values), and a top-k of
        // the f64 scores within the scores' tolerance; the fused call selects the same.
        let kk = self.k.min(p);
        let (want_idx, want_val) = reference::topk::<f64>(&got_scores, p, kk);
        let mut selections = Vec::new();
        for fused in [false, true] {
            let mut idx = tg.poisoned(DType::I32, &[b, s, kk])?;
            let mut val = tg.poisoned(DType::F32, &[b, s, kk])?;
            if fused {
                lightning_indexer_into(tg.backend, &a, self.k, &mut idx.view_mut(), &mut val.view_mut())?;
            } else {
                indexer_topk_into(tg.backend, &scores.view(), self.k, &mut idx.view_mut(), &mut val.view_mut())?;
            }
            let tag = if fused { "lightning_indexer" } else { "topk" };
            let (gi, gv) = (idx.to_i64_vec()?, f64s(&val)?);
            if fused {
                js.push(judge_topk_of(&format!("{tag}: a top-k of the f64 scores"), &gi, &gv, &ref_scores, p, kk));
            } else {
                js.push(judge(&format!("{tag}: indices (of the target's scores)"), &gi.iter().map(|&i| i as f64).collect::<Vec<_>>(), &want_idx.iter().map(|&i| i as f64).collect::<Vec<_>>(), Tolerance::Exact));
                js.push(judge(&format!("{tag}: values"), &gv, &want_val, Tolerance::Exact));
            }
            selections.push((gi, gv));
        }
        let same = selections[0] == selections[1];
        js.push(exact_flag("lightning_indexer == scores + topk", same));

        // The scores of a given selection and their backward.
        let sel = tg.put(&x.topk_indices, self.sel_dtype)?;
        let sel64 = x.topk_indices.to_i64_vec()?;
        let mut ts = tg.poisoned(DType::F32, &[b, s, t])?;
        indexer_topk_scores_into(tg.backend, &a, &sel.view(), &mut ts.view_mut())?;
        let ref_ts = reference::topk_scores::<f64>(dm, &q64, &kv64, &w64, &sel64, t, scale, causal);
        js.push(judge("topk_scores", &f64s(&ts)?, &ref_ts, Tolerance::F32Rows { row_len: t }));
        let grad = tg.put(&x.grad, DType::F32)?;
        let rg = reference::topk_scores_backward::<f64>(dm, &q64, &kv64, &w64, &sel64, t, &f64s(&x.grad)?, scale, causal);
        let backward = |deterministic: bool| -> Result<(Tensor, Tensor, Tensor)> {
            let ba = IndexerTopkScoresBwdArgs { fwd: a.clone(), topk_indices: sel.view(), grad: grad.view(), deterministic };
            let mut dq = tg.poisoned(tg.input_dtype, &[b, s, h, d])?;
            let mut dw = tg.poisoned(DType::F32, &[b, s, h])?;
            let mut dkv = tg.poisoned(DType::F32, &[b, p, d])?;
            indexer_topk_scores_backward_into(tg.backend, &ba, &mut dq.view_mut(), &mut dw.view_mut(), &mut dkv.view_mut())?;
            Ok((dq, dw, dkv))
        };
        for deterministic in [false, true] {
            let tag = if deterministic { "deterministic" } else { "atomic" };
            let (dq, dw, dkv) = backward(deterministic)?;
            js.push(judge(&format!("dq ({tag})"), &f64s(&dq)?, &rg.dq, Tolerance::Bf16));
            js.push(judge(&format!("dweights ({tag})"), &f64s(&dw)?, &rg.dweights, Tolerance::F32Grad));
            js.push(judge(&format!("dpooled_kv ({tag})"), &f64s(&dkv)?, &rg.dpooled_kv, Tolerance::F32Grad));
            if deterministic {
                let (dq2, dw2, dkv2) = backward(true)?;
                js.push(exact_flag("rerun bitwise equal (deterministic)", bits(&dq)? == bits(&dq2)? && bits(&dw)? == bits(&dw2)? && bits(&dkv)? == bits(&dkv2)?));
            }
        }
        Ok(js)
    }
}

impl Topk {
    /// The crafted `[B,S,P]` scores (one row kind per row, cycling).
    pub fn scores(&self, width: usize) -> Vec<f32> {
        let mut rng = SplitMix64(self.seed);
        let mut v = Vec::with_capacity(self.b * self.s * width);
        for r in 0..self.b * self.s {
            for _ in 0..width {
                let u = rng.below(100);
                let x = match r % 5 {
                    0 => rng.uniform(-10.0f32, 10.0),
                    1 => (rng.below(7) as f32 - 3.0) * 0.5,
                    2 if u < 70 => f32::NEG_INFINITY,
                    3 => f32::NEG_INFINITY,
                    _ if u < 5 => f32::NAN,
                    _ if u < 8 => f32::INFINITY,
                    _ if u < 14 => f32::NEG_INFINITY,
                    _ if u < 20 => 0.0,
                    _ if u < 26 => -0.0,
                    _ => rng.uniform(-1.0f32, 1.0),
                };
                v.push(x);
            }
        }
        v
    }

    fn run(&self, tg: &Target) -> Result<Vec<Judgement>> {
        let (b, s, p) = (self.b, self.s, self.p);
        let kk = self.k.min(p);
        let logical: Vec<f32>;
        let scores = if self.strided {
            let raw = self.scores(2 * p);
            logical = raw.chunks(2 * p).flat_map(|r| r.iter().step_by(2).copied().collect::<Vec<_>>()).collect();
            tg.put(&Tensor::from_f32(&[b, s, 2 * p], raw)?, DType::F32)?.with_layout(&[b, s, p], &[(s * 2 * p) as isize, (2 * p) as isize, 2])
        } else {
            logical = self.scores(p);
            tg.put(&Tensor::from_f32(&[b, s, p], logical.clone())?, DType::F32)?
        };
        let mut idx = tg.poisoned(DType::I32, &[b, s, kk])?;
        let mut val = tg.poisoned(DType::F32, &[b, s, kk])?;
        indexer_topk_into(tg.backend, &scores.view(), self.k, &mut idx.view_mut(), &mut val.view_mut())?;
        let l64: Vec<f64> = logical.iter().map(|&x| x as f64).collect();
        let (want_idx, want_val) = reference::topk::<f64>(&l64, p, kk);
        let as_f64 = |v: Vec<i64>| v.into_iter().map(|i| i as f64).collect::<Vec<_>>();
        Ok(vec![judge("indices", &as_f64(idx.to_i64_vec()?), &as_f64(want_idx), Tolerance::Exact), judge("values", &f64s(&val)?, &want_val, Tolerance::Exact)])
    }
}

/// A judgement of a yes/no property.
fn exact_flag(name: &str, ok: bool) -> Judgement {
    judge(name, &[f64::from(u8::from(ok))], &[1.0], Tolerance::Exact)
}

/// The selection (`idx`, `val` per row of `kk`) is a top-k of the reference scores: the
/// right count, distinct finite keys, descending values, -1 / -inf past the count, and
/// every selected key's reference score within 4e-5 of the row scale of the reference
/// k-th best (near-ties may order differently between f32 and f64 scores).
fn judge_topk_of(name: &str, idx: &[i64], val: &[f64], ref_scores: &[f64], p: usize, kk: usize) -> Judgement {
    let mut bad = None;
    for (r, row) in ref_scores.chunks(p).enumerate() {
        let mut finite: Vec<f64> = row.iter().copied().filter(|x| x.is_finite()).collect();
        finite.sort_by(|a, b| b.partial_cmp(a).unwrap());
        let want = kk.min(finite.len());
        let scale = finite.iter().fold(0.0f64, |m, x| m.max(x.abs()));
        let (gi, gv) = (&idx[r * kk..(r + 1) * kk], &val[r * kk..(r + 1) * kk]);
        let n = gi.iter().filter(|&&i| i >= 0).count();
        let mut seen = std::collections::HashSet::new();
        let why = if n != want {
            Some(format!("{n} selected, {want} finite scores to take"))
        } else if !(gi[..n].iter().all(|&i| i >= 0) && gi[n..].iter().all(|&i| i == -1) && gv[n..].iter().all(|&v| v == f64::NEG_INFINITY)) {
            Some("-1 / -inf not exactly past the count".into())
        } else if !gi[..n].iter().all(|&i| (i as usize) < p && row[i as usize].is_finite() && seen.insert(i)) {
            Some("an invisible, out-of-range or repeated key".into())
        } else if gv[..n].windows(2).any(|w| w[1] > w[0]) {
            Some("values not descending".into())
        } else if want > 0 && gi[..n].iter().map(|&i| row[i as usize]).fold(f64::INFINITY, f64::min) < finite[want - 1] - 4e-5 * scale {
            Some(format!("a selected score below the reference k-th best {}", finite[want - 1]))
        } else {
            None
        };
        if let Some(why) = why {
            bad = Some(format!("row {r}: {why}"));
            break;
        }
    }
    let mut j = exact_flag(name, bad.is_none());
    j.note = bad.unwrap_or_default();
    j
}

/// The indexer test set: head counts and dims across the kernels' tiles (D % 8 != 0
/// included), context-parallel offsets, queries that see no key, k above and equal to P,
/// i64 and strided inputs, and crafted top-k rows.
pub fn test_set() -> Vec<Case> {
    let mut v: Vec<Case> = [
        Layer::new([2, 7, 3, 16, 5], 1, 0, 4, 7, 201),
        Layer::new([1, 13, 17, 40, 9], 2, 3, 9, 130, 202),
        Layer::new([2, 5, 5, 20, 11], 1, 4, 14, 9, 203),
        Layer::new([1, 33, 64, 128, 37], 4, 100, 16, 33, 204),
        Layer::new([2, 9, 16, 64, 70], 1, 61, 1, 12, 205),
        Layer::new([1, 19, 8, 136, 130], 3, 0, 64, 10, 206),
        Layer::new([1, 40, 64, 128, 300], 1, 0, 40, 130, 207),
        Layer::new([1, 600, 16, 64, 200], 2, 7, 16, 70, 208),
        Layer { sel_dtype: DType::I64, ..Layer::new([2, 9, 4, 32, 13], 2, 5, 5, 40, 209) },
        Layer { strided: true, ..Layer::new([2, 11, 6, 32, 13], 2, 5, 6, 9, 210) },
    ]
    .into_iter()
    .map(Case::Layer)
    .collect();
    for (i, (b, s, p, k)) in [(2, 5, 7, 16), (1, 5, 9, 9), (2, 5, 100, 10), (1, 5, 1000, 512), (1, 5, 5000, 3000), (1, 5, 70000, 2048), (1, 5, 1, 1), (1, 10, 4096, 512), (2, 5, 2048, 300)].into_iter().enumerate() {
        v.push(Case::Topk(Topk { b, s, p, k, strided: false, seed: 220 + i as u64 }));
    }
    v.push(Case::Topk(Topk { b: 2, s: 5, p: 300, k: 64, strided: true, seed: 230 }));
    v
}
