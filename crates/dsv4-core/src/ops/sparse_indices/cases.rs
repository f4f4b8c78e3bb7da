//! The shared cases of the index builder (see `crate::cases`): random argument mixes
//! (masks in both float dtypes, compressed selections with masked and out-of-range
//! entries, context-parallel positions in every accepted shape, vision spans), judged
//! exactly against the reference builder (SPEC.md section 6 computed directly).

use super::{build_sparse_topk_indices_into, reference, BuildIndicesArgs};
use crate::cases::{causal_selection, Preset, Target};
use crate::compare::{judge, Judgement, Tolerance};
use crate::error::Result;
use crate::real::round_bf16;
use crate::rng::SplitMix64;
use crate::tensor::{DType, Device, Tensor};

/// One builder problem: the arguments drawn from `seed` (`Random`) or a layer's window +
/// causal selection of pooled keys (`Layer`).
#[derive(Clone, Debug)]
pub enum Case {
    /// `long`: S up to 3000 (else up to 40).
    Random { seed: u64, long: bool },
    Layer { b: usize, s: usize, window: usize, ratio: usize, picks: usize, seed: u64 },
}

/// The drawn arguments (host tensors).
pub struct Inputs {
    pub b: usize,
    pub s: usize,
    pub k: usize,
    pub window: usize,
    pub ratio: usize,
    pub n_pooled: usize,
    pub vanilla: Option<usize>,
    pub max_image: usize,
    pub mask: Option<Tensor>,
    pub compressed_topk: Option<Tensor>,
    pub q_positions: Option<Tensor>,
    pub vision_token_types: Option<Tensor>,
}

impl Inputs {
    fn args<'a>(&self, device: Device, t: [Option<&'a Tensor>; 4]) -> BuildIndicesArgs<'a> {
        let mut a = BuildIndicesArgs::new(self.b, self.s, self.k, self.window);
        a.device = device;
        a.compress_ratio = self.ratio;
        a.n_pooled = self.n_pooled;
        a.vanilla_key_len = self.vanilla;
        a.max_image_tokens = self.max_image;
        a.attention_mask = t[0].map(|t| t.view());
        a.compressed_topk = t[1].map(|t| t.view());
        a.q_positions = t[2].map(|t| t.view());
        a.vision_token_types = t[3].map(|t| t.view());
        a
    }
}

/// An integer tensor in i32 or i64 (drawn).
fn ints(rng: &mut SplitMix64, shape: &[usize], v: Vec<i64>) -> Result<Tensor> {
    if rng.below(2) == 0 {
        Tensor::from_i64(shape, v)
    } else {
        Tensor::from_i32(shape, v.into_iter().map(|x| x as i32).collect())
    }
}

/// Vision token types of one row: text (-1), image spans (0 start, inside tokens, 4 end,
/// sometimes left open) and stray ends.
fn random_types(rng: &mut SplitMix64, s: usize) -> Vec<i64> {
    let mut t = vec![-1i64; s];
    let mut i = 0;
    while i < s {
        match rng.below(10) {
            0 => {
                let len = 1 + rng.below(12) as usize;
                t[i] = 0;
                for (j, slot) in t.iter_mut().enumerate().take((i + len).min(s)).skip(i + 1) {
                    *slot = 1 + (j % 3) as i64;
                }
                if i + len < s && rng.below(6) != 0 {
                    t[i + len] = 4;
                }
                i += len + 1;
            }
            1 => {
                t[i] = 4;
                i += 1;
            }
            _ => i += 1,
        }
    }
    t
}

impl Case {
    /// The `dsv4 check` problem of a preset: a window plus `topk` causal picks.
    pub fn preset(p: &Preset, seed: u64) -> Self {
        Case::Layer { b: p.b, s: p.s, window: p.window, ratio: p.ratio, picks: p.topk, seed }
    }

    pub fn name(&self) -> String {
        match self {
            Case::Random { seed, long } => format!("random arguments #{seed}{}", if *long { " (long)" } else { "" }),
            Case::Layer { b, s, window, ratio, picks, .. } => format!("B={b} S={s} window {window} + {picks} of S/{ratio} pooled"),
        }
    }

    pub fn inputs(&self) -> Result<Inputs> {
        match *self {
            Case::Layer { b, s, window, ratio, picks, seed } => {
                let n_pooled = s / ratio;
                let ct = causal_selection(&mut SplitMix64(seed), b, s, n_pooled, ratio, picks, 0);
                Ok(Inputs { b, s, k: s + n_pooled, window, ratio, n_pooled, vanilla: None, max_image: 0, mask: None, compressed_topk: Some(ct), q_positions: None, vision_token_types: None })
            }
            Case::Random { seed, long } => {
                let rng = &mut SplitMix64(seed);
                let b = 1 + rng.below(3) as usize;
                let s = 1 + rng.below(if long { 3000 } else { 40 }) as usize;
                let window = [1, 2, 4, 16, 128][rng.below(5) as usize];
                let ratio = [1, 4, 128][rng.below(3) as usize];
                let n_pooled = if rng.below(3) == 0 { 0 } else { 1 + rng.below((s / ratio.min(4)).max(1) as u64 + 3) as usize };
                let vanilla = if rng.below(3) == 0 { Some(s + rng.below(5) as usize) } else { None };
                let k = (vanilla.unwrap_or(s) + n_pooled).saturating_sub(rng.below(4) as usize).max(1);
                let mut x = Inputs { b, s, k, window, ratio, n_pooled, vanilla, max_image: 0, mask: None, compressed_topk: None, q_positions: None, vision_token_types: None };
                if rng.below(2) == 0 {
                    let km = k + rng.below(4) as usize;
                    let vals: Vec<f32> = (0..b * s * km).map(|_| if rng.below(4) == 0 { -1e30 } else { rng.uniform(0.0f32, 1.0) }).collect();
                    x.mask = Some(if rng.below(2) == 0 { Tensor::from_f32_as_bf16(&[b, 1, s, km], &vals)? } else { Tensor::from_f32(&[b, 1, s, km], vals.into_iter().map(round_bf16).collect())? });
                }
                if n_pooled > 0 && rng.below(2) == 0 {
                    let tc = 1 + rng.below(9) as usize;
                    let vals: Vec<i64> = (0..b * s * tc).map(|_| rng.below(n_pooled as u64 + 3) as i64 - 2).collect();
                    x.compressed_topk = Some(ints(rng, &[b, s, tc], vals)?);
                }
                if rng.below(2) == 0 {
                    let start = rng.below(50) as i64;
                    let shape: Vec<usize> = match rng.below(3) {
                        0 => vec![s],
                        1 => vec![1, s],
                        _ => vec![b, s],
                    };
                    let n: usize = shape.iter().product();
                    let vals: Vec<i64> = (0..n).map(|i| start + (i % s) as i64 + (i / s) as i64 * 7).collect();
                    x.q_positions = Some(ints(rng, &shape, vals)?);
                }
                if rng.below(2) == 0 {
                    let types: Vec<i64> = (0..b).flat_map(|_| random_types(rng, s)).collect();
                    x.vision_token_types = Some(ints(rng, &[b, s], types)?);
                    x.max_image = [0, 1, 8, 64][rng.below(4) as usize];
                }
                Ok(x)
            }
        }
    }

    /// The target's indices (into poisoned memory) against the reference builder.
    pub fn run(&self, tg: &Target) -> Result<Vec<Judgement>> {
        let x = self.inputs()?;
        let host = [x.mask.as_ref(), x.compressed_topk.as_ref(), x.q_positions.as_ref(), x.vision_token_types.as_ref()];
        let ha = x.args(Device::Cpu, host);
        let (dm, _) = ha.validate()?;
        let want = reference::build(&dm, &ha.host_inputs(&dm)?);
        let put = |t: Option<&Tensor>| t.map(|t| tg.put(t, t.dtype())).transpose();
        let dev = [put(host[0])?, put(host[1])?, put(host[2])?, put(host[3])?];
        let da = x.args(tg.device, [dev[0].as_ref(), dev[1].as_ref(), dev[2].as_ref(), dev[3].as_ref()]);
        let width = want.len() / (x.b * x.s).max(1);
        let mut got = tg.poisoned(DType::I32, &[x.b, x.s, width])?;
        build_sparse_topk_indices_into(tg.backend, &da, &mut got.view_mut())?;
        let as_f64 = |v: Vec<i64>| v.into_iter().map(|i| i as f64).collect::<Vec<_>>();
        Ok(vec![judge("indices", &as_f64(got.to_i64_vec()?), &as_f64(want), Tolerance::Exact)])
    }
}

/// The builder test set: 60 short random argument mixes and a layer's (the long mixes,
/// `Case::Random { long: true, .. }`, are for a GPU sweep).
pub fn test_set() -> Vec<Case> {
    let mut v: Vec<Case> = (0..60).map(|i| Case::Random { seed: 500 + i, long: false }).collect();
    v.push(Case::Layer { b: 2, s: 300, window: 32, ratio: 4, picks: 24, seed: 700 });
    v
}
