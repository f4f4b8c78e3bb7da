//! SPEC.md section 8: how a result is judged against a reference. NaN never passes;
//! `-inf` must sit exactly where the reference has it.

use std::fmt;

/// The tolerance classes of SPEC.md section 8.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Tolerance {
    /// f32 paths (sinkhorn, indexer scores): max |got - ref| / (row's max |ref|) <= 1e-5.
    F32Rows { row_len: usize },
    /// bf16 outputs (attention out, dq): ||got - ref|| / ||ref|| <= 1e-2.
    Bf16,
    /// bf16 outputs of qnorm_rope: Bf16 and every element within 2 bf16 ulps of its
    /// reference magnitude. Rows are `row_len` channels whose last `rotary` form rotated
    /// pairs: a pair's magnitude is its L2 norm (a rotation mixes the pair, so a 1-ulp
    /// difference in one input lands on both outputs); other channels use their own
    /// magnitude, floored at 1/256 of the row's largest (an element that is a difference
    /// of near-equal terms has no ulp of its own worth keeping).
    Bf16Ulps { row_len: usize, rotary: usize },
    /// f32-accumulated gradients (dkv, dsinks, dweights, dpooled_kv): rel. Frobenius <= 5e-3.
    F32Grad,
    /// Exactly equal.
    Exact,
    /// A custom relative Frobenius bound.
    RelFro(f64),
}

/// One judged output.
#[derive(Clone, Debug)]
pub struct Judgement {
    pub name: String,
    /// The figure the tolerance bounds (relative error; mismatches for `Exact`).
    pub error: f64,
    /// Max absolute error over finite entries.
    pub max_abs: f64,
    pub bound: f64,
    pub pass: bool,
    /// Why it failed beyond the number (NaN, -inf placement, length).
    pub note: String,
}

impl fmt::Display for Judgement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {} (error {:.3e}, bound {:.1e}, max abs {:.3e}){}", self.name, if self.pass { "ok" } else { "FAIL" }, self.error, self.bound, self.max_abs, if self.note.is_empty() { String::new() } else { format!(" — {}", self.note) })
    }
}

/// Size of one bf16 ulp at magnitude `x` (8 significant bits).
pub fn bf16_ulp(x: f64) -> f64 {
    let x = x.abs().max(f32::MIN_POSITIVE as f64);
    2f64.powi(x.log2().floor() as i32 - 7)
}

/// Judge `got` against `reference` under `tol`.
pub fn judge(name: &str, got: &[f64], reference: &[f64], tol: Tolerance) -> Judgement {
    let mut j = Judgement { name: name.to_string(), error: 0.0, max_abs: 0.0, bound: 0.0, pass: true, note: String::new() };
    if got.len() != reference.len() {
        j.pass = false;
        j.error = f64::INFINITY;
        j.note = format!("{} values, reference has {}", got.len(), reference.len());
        return j;
    }
    let fail = |j: &mut Judgement, note: String| {
        if j.note.is_empty() {
            j.note = note;
        }
        j.pass = false;
    };
    for (i, (&g, &r)) in got.iter().zip(reference).enumerate() {
        if g.is_nan() {
            fail(&mut j, format!("NaN at {i}"));
            break;
        }
        if r.is_infinite() || g.is_infinite() {
            if g != r {
                fail(&mut j, format!("element {i}: got {g}, reference {r}"));
                break;
            }
            continue;
        }
        j.max_abs = j.max_abs.max((g - r).abs());
    }
    let finite = |v: f64| if v.is_finite() { v } else { 0.0 };
    let rel_fro = || {
        let (mut num, mut den) = (0.0f64, 0.0f64);
        for (&g, &r) in got.iter().zip(reference) {
            num += (finite(g) - finite(r)).powi(2);
            den += finite(r).powi(2);
        }
        if den == 0.0 {
            if num == 0.0 {
                0.0
            } else {
                f64::INFINITY
            }
        } else {
            (num / den).sqrt()
        }
    };
    let row_scaled = |row_len: usize| {
        let mut worst = 0.0f64;
        for (gr, rr) in got.chunks(row_len.max(1)).zip(reference.chunks(row_len.max(1))) {
            let scale = rr.iter().map(|&r| finite(r).abs()).fold(0.0, f64::max);
            for (&g, &r) in gr.iter().zip(rr) {
                let e = (finite(g) - finite(r)).abs();
                worst = worst.max(if scale > 0.0 { e / scale } else if e > 0.0 { f64::INFINITY } else { 0.0 });
            }
        }
        worst
    };
    let (error, bound) = match tol {
        Tolerance::F32Rows { row_len } => (row_scaled(row_len), 1e-5),
        Tolerance::Bf16 => (rel_fro(), 1e-2),
        Tolerance::F32Grad => (rel_fro(), 5e-3),
        Tolerance::RelFro(b) => (rel_fro(), b),
        Tolerance::Exact => (got.iter().zip(reference).filter(|(g, r)| g != r).count() as f64, 0.0),
        Tolerance::Bf16Ulps { row_len, rotary } => {
            let mut worst_ulps = 0.0f64;
            let rot0 = row_len.saturating_sub(rotary);
            for (gr, rr) in got.chunks(row_len.max(1)).zip(reference.chunks(row_len.max(1))) {
                let row_max = rr.iter().map(|r| r.abs()).fold(0.0, f64::max);
                for (i, (&g, &r)) in gr.iter().zip(rr).enumerate() {
                    let own = if i >= rot0 && i - rot0 < rotary {
                        let pair = rot0 + ((i - rot0) & !1);
                        rr[pair].hypot(*rr.get(pair + 1).unwrap_or(&0.0))
                    } else {
                        r.abs()
                    };
                    let mag = own.max(row_max / 256.0);
                    worst_ulps = worst_ulps.max((g - r).abs() / bf16_ulp(mag));
                }
            }
            let fro = rel_fro();
            if fro > 1e-2 {
                fail(&mut j, format!("relative Frobenius error {fro:.3e} > 1e-2"));
            }
            (worst_ulps, 2.0)
        }
    };
    j.error = error;
    j.bound = bound;
    if error.is_nan() || error > bound {
        j.pass = false;
    }
    j
}
