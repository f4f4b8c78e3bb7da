//! Properties that hold for every input: the index builder's causality and shape
//! (SPEC.md section 6), sparse attention against its dense oracle (section 1), the plan
//! path against the top-k path, and deterministic backwards bitwise reproducible.

use dsv4_core::ops::sparse_attention::{dense_attention_topk, sparse_attention, sparse_attention_backward, BackwardImpl, SparseAttentionArgs, SparseAttentionBwdArgs, SparseIndices};
use dsv4_core::ops::sparse_indices::{build_sparse_topk_indices, plan_sparse_indices, BuildIndicesArgs};
use dsv4_core::{BackendName, Tensor};
use proptest::prelude::*;

const REF: BackendName = BackendName::Reference;

use dsv4_core::rng::SplitMix64 as Rng;

fn rel_fro(got: &[f32], want: &[f32]) -> f64 {
    let num: f64 = got.iter().zip(want).map(|(&g, &w)| (g as f64 - w as f64).powi(2)).sum();
    let den: f64 = want.iter().map(|&w| (w as f64).powi(2)).sum();
    if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    }
}

fn build(a: &BuildIndicesArgs) -> (Vec<i64>, usize) {
    let t = build_sparse_topk_indices(REF, a).expect("build_sparse_topk_indices");
    assert_eq!(t.dtype(), dsv4_core::DType::I32);
    (t.to_i64_vec().unwrap(), t.shape()[2])
}

// ---------------------------------------------------------------- index builder (text)

#[derive(Debug, Clone)]
struct TextCase {
    b: usize,
    s: usize,
    offset: usize,
    per_batch_offset: bool,
    window: usize,
    ratio: usize,
    pooled: usize,
    compressed_topk: bool,
    mask: bool,
    cut: usize,
    seed: u64,
}

fn text_case() -> impl Strategy<Value = TextCase> {
    (1usize..=2, 1usize..=10, 0usize..6, any::<bool>(), 1usize..=12, 1usize..=4, 0usize..=6, any::<bool>(), any::<bool>(), 0usize..=4, any::<u64>()).prop_map(|(b, s, offset, per_batch_offset, window, ratio, pooled, compressed_topk, mask, cut, seed)| TextCase {
        b,
        s,
        offset,
        per_batch_offset,
        window,
        ratio,
        pooled,
        compressed_topk,
        mask,
        cut,
        seed,
    })
}

fn check_text(c: &TextCase) {
    let mut rng = Rng(c.seed);
    let (b, s) = (c.b, c.s);
    // Context parallelism: this rank holds positions offset.. of a prefix of length V.
    let offsets: Vec<usize> = (0..b).map(|bi| if c.per_batch_offset { (c.offset + bi) % 6 } else { c.offset }).collect();
    let positions: Vec<i64> = (0..b).flat_map(|bi| { let o = offsets[bi]; (0..s).map(move |i| (o + i) as i64) }).collect();
    let v = offsets.iter().max().unwrap() + s;
    let key_len = (v + c.pooled).saturating_sub(c.cut);
    let km = key_len + 2;
    let mask_vals: Vec<f32> = (0..b * s * km).map(|_| [0.0, 0.0, 1.0, -1.0, f32::NEG_INFINITY][rng.below(5) as usize]).collect();
    let tc = 3;
    let ctopk: Vec<i64> = (0..b * s * tc).map(|_| rng.below(c.pooled as u64 + 2) as i64 - 1).collect();
    let qp = if c.per_batch_offset { Tensor::from_i64(&[b, s], positions.clone()) } else { Tensor::from_i32(&[s], positions[..s].iter().map(|&p| p as i32).collect()) }.unwrap();
    let mask_t = Tensor::from_f32(&[b, 1, s, km], mask_vals.clone()).unwrap();
    let ct_t = Tensor::from_i64(&[b, s, tc], ctopk.clone()).unwrap();

    let mut a = BuildIndicesArgs::new(b, s, key_len, c.window);
    a.q_positions = Some(qp.view());
    a.vanilla_key_len = Some(v);
    a.compress_ratio = c.ratio;
    a.n_pooled = c.pooled;
    if c.mask {
        a.attention_mask = Some(mask_t.view());
    }
    if c.compressed_topk && c.pooled > 0 {
        a.compressed_topk = Some(ct_t.view());
    }
    let (out, width) = build(&a);
    let ww = v.min(c.window);
    let comp = if c.pooled == 0 { 0 } else if a.compressed_topk.is_some() { tc } else { c.pooled };
    assert_eq!(width, ww + comp, "width");
    let (w, k) = (c.window as i64, key_len as i64);
    for bi in 0..b {
        for si in 0..s {
            let r = bi * s + si;
            let p = positions[r];
            let row = &out[r * width..(r + 1) * width];
            let masked = |key: i64| c.mask && mask_vals[r * km + key as usize] < 0.0;
            // Every entry in [-1, K).
            assert!(row.iter().all(|&x| x >= -1 && x < k), "row {r}: {row:?} outside [-1, {k})");
            // Window: causal, and exactly max(p-W+1,0)..=p in order (minus slots >= K or masked).
            let win = &row[..ww];
            assert!(win.iter().all(|&x| x <= p), "row {r} (p = {p}): window {win:?} not causal");
            let expect: Vec<i64> = ((p - w + 1).max(0)..=p).filter(|&x| x < k && !masked(x)).collect();
            let got: Vec<i64> = win.iter().copied().filter(|&x| x >= 0).collect();
            assert_eq!(got, expect, "row {r} (p = {p}, W = {w}): window");
            for (j, &x) in win.iter().enumerate() {
                let key = (p - w + 1).max(0) + j as i64;
                assert!(x == -1 || x == key, "row {r}: window slot {j} holds {x}, expected {key} or -1");
            }
            // Compressed part.
            let cp = &row[ww..];
            for (j, &x) in cp.iter().enumerate() {
                let want = match &a.compressed_topk {
                    Some(_) => {
                        let cj = ctopk[r * tc + j];
                        if cj >= 0 {
                            cj + v as i64
                        } else {
                            -1
                        }
                    }
                    None => {
                        if (j as i64) < (p + 1) / c.ratio as i64 {
                            v as i64 + j as i64
                        } else {
                            -1
                        }
                    }
                };
                let want = if want >= k || (want >= 0 && masked(want)) { -1 } else { want };
                assert_eq!(x, want, "row {r} (p = {p}): compressed slot {j}");
            }
        }
    }
}

// ---------------------------------------------------------------- index builder (vision)

#[derive(Debug, Clone)]
struct VisionCase {
    b: usize,
    /// Per batch row: segments `(is_image, length)`.
    segments: Vec<Vec<(bool, usize)>>,
    window: usize,
    extra_m: usize,
}

fn vision_case() -> impl Strategy<Value = VisionCase> {
    let segs = prop::collection::vec((any::<bool>(), 1usize..=6), 1..=4);
    (1usize..=2, 1usize..=6, 0usize..=3, segs.clone(), segs).prop_map(|(b, window, extra_m, s0, s1)| {
        // Both rows must have the same length: pad the shorter with text.
        let len = |s: &Vec<(bool, usize)>| s.iter().map(|&(img, n)| if img { n.max(2) } else { n }).sum::<usize>();
        let (mut a, mut c) = (s0, s1);
        if b == 1 {
            c = a.clone();
        }
        let (la, lc) = (len(&a), len(&c));
        if la < lc {
            a.push((false, lc - la));
        } else if lc < la {
            c.push((false, la - lc));
        }
        VisionCase { b, segments: vec![a, c][..b].to_vec(), window, extra_m }
    })
}

fn check_vision(c: &VisionCase) {
    // Types: -1 text; an image of n >= 2 tokens is 0, 1.., 4.
    let mut types = Vec::new();
    let mut spans: Vec<Vec<(usize, usize)>> = Vec::new();
    let mut longest = 1;
    for segs in &c.segments {
        let (mut row, mut sp) = (Vec::new(), Vec::new());
        for &(img, n) in segs {
            if img {
                let n = n.max(2);
                longest = longest.max(n);
                sp.push((row.len(), row.len() + n - 1));
                row.push(0);
                row.extend(std::iter::repeat_n(1, n - 2));
                row.push(4);
            } else {
                row.extend(std::iter::repeat_n(-1, n));
            }
        }
        types.extend(row);
        spans.push(sp);
    }
    let (b, s) = (c.b, types.len() / c.b);
    let m = longest + c.extra_m;
    let vt = Tensor::from_i64(&[b, s], types.clone()).unwrap();
    let mut a = BuildIndicesArgs::new(b, s, s, c.window);
    a.vision_token_types = Some(vt.view());
    a.max_image_tokens = m;
    let (out, width) = build(&a);
    assert_eq!(width, s.min(c.window + m));
    for bi in 0..b {
        for i in 0..s {
            let row = &out[(bi * s + i) * width..(bi * s + i + 1) * width];
            assert!(row.iter().all(|&x| x >= -1 && x < s as i64), "{row:?}");
            let valid: Vec<i64> = row.iter().copied().filter(|&x| x >= 0).collect();
            // Valid slots ascending and distinct.
            assert!(valid.windows(2).all(|p| p[0] < p[1]), "row ({bi},{i}): {row:?}");
            match spans[bi].iter().find(|&&(st, en)| st <= i && i <= en) {
                // An image query sees its whole span, in both directions.
                Some(&(st, en)) => {
                    for key in st..=en {
                        assert!(valid.contains(&(key as i64)), "image query ({bi},{i}) of span {st}..={en} misses {key}: {row:?}");
                    }
                    assert!(valid.iter().all(|&x| x as usize <= en), "image query ({bi},{i}) sees past its span end {en}: {row:?}");
                }
                // A text query is causal and sees its full local window.
                None => {
                    let expect: Vec<i64> = ((i as i64 - c.window as i64 + 1).max(0)..=i as i64).collect();
                    assert_eq!(valid, expect, "text query ({bi},{i}): {row:?}");
                }
            }
        }
    }
}

// ---------------------------------------------------------------- sparse attention

#[derive(Debug, Clone)]
struct AttnCase {
    b: usize,
    s: usize,
    h: usize,
    d: usize,
    k: usize,
    t: usize,
    duplicates: bool,
    seed: u64,
}

fn attn_case() -> impl Strategy<Value = AttnCase> {
    (1usize..=2, 1usize..=4, 1usize..=3, 1usize..=9, 1usize..=10, 0usize..=8, any::<bool>(), any::<u64>()).prop_map(|(b, s, h, d, k, t, duplicates, seed)| AttnCase { b, s, h, d, k, t, duplicates, seed })
}

struct AttnInputs {
    q: Tensor,
    kv: Tensor,
    sinks: Tensor,
    idx: Tensor,
    dout: Tensor,
    any_empty_row: bool,
}

fn attn_inputs(c: &AttnCase) -> AttnInputs {
    let mut rng = Rng(c.seed);
    let mut idx = Vec::new();
    let mut any_empty_row = false;
    for _ in 0..c.b * c.s {
        // A random permutation of the keys, then masked slots of every kind.
        let mut keys: Vec<i64> = (0..c.k as i64).collect();
        for i in (1..keys.len()).rev() {
            keys.swap(i, rng.below(i as u64 + 1) as usize);
        }
        let mut row = Vec::new();
        for j in 0..c.t {
            row.push(match rng.below(6) {
                0 => -1,
                1 => c.k as i64 + rng.below(3) as i64,
                2 if c.duplicates && j > 0 => row[rng.below(j as u64) as usize],
                _ => keys.get(j).copied().unwrap_or(-1),
            });
        }
        any_empty_row |= !row.iter().any(|&x| x >= 0 && x < c.k as i64);
        idx.extend(row);
    }
    AttnInputs {
        q: Tensor::from_f32(&[c.b, c.s, c.h, c.d], rng.vec(c.b * c.s * c.h * c.d, -2.0, 2.0)).unwrap(),
        kv: Tensor::from_f32(&[c.b, c.k, c.d], rng.vec(c.b * c.k * c.d, -2.0, 2.0)).unwrap(),
        sinks: Tensor::from_f32(&[c.h], rng.vec(c.h, -2.0, 2.0)).unwrap(),
        idx: Tensor::from_i64(&[c.b, c.s, c.t], idx).unwrap(),
        dout: Tensor::from_f32(&[c.b, c.s, c.h, c.d], rng.vec(c.b * c.s * c.h * c.d, -1.0, 1.0)).unwrap(),
        any_empty_row,
    }
}

fn has_duplicate(idx: &[i64], t: usize, k: usize) -> bool {
    idx.chunks(t.max(1)).any(|row| {
        let mut v: Vec<i64> = row.iter().copied().filter(|&x| x >= 0 && x < k as i64).collect();
        let n = v.len();
        v.sort_unstable();
        v.dedup();
        v.len() != n
    })
}

fn f32s(t: &Tensor) -> Vec<f32> {
    t.to_f32_vec().unwrap()
}

fn check_sparse_vs_dense(c: &AttnCase) {
    let x = attn_inputs(c);
    let a = SparseAttentionArgs::new(x.q.view(), x.kv.view(), x.sinks.view(), SparseIndices::TopK(x.idx.view()));
    let (out, lse) = sparse_attention(REF, &a).unwrap();
    let dense = dense_attention_topk(REF, &a).unwrap();
    let (out, dense) = (f32s(&out), f32s(&dense));
    assert!(out.iter().chain(&f32s(&lse)).all(|v| v.is_finite()));
    if !has_duplicate(&x.idx.to_i64_vec().unwrap(), c.t, c.k) {
        let e = rel_fro(&out, &dense);
        assert!(e <= 2e-6, "no duplicates, yet sparse and dense differ: {e:e}");
    }
}

fn check_plan_vs_topk(c: &AttnCase) {
    let x = attn_inputs(c);
    let nonempty = !x.any_empty_row;
    let plan = plan_sparse_indices(REF, &x.idx.view(), c.k, nonempty).unwrap();
    assert_eq!(plan.valid_rows.is_none(), nonempty);
    let mut runs = Vec::new();
    for indices in [SparseIndices::TopK(x.idx.view()), SparseIndices::Plan(&plan)] {
        let mut a = SparseAttentionArgs::new(x.q.view(), x.kv.view(), x.sinks.view(), indices);
        a.all_rows_nonempty = nonempty;
        let (out, lse) = sparse_attention(REF, &a).unwrap();
        let bw = SparseAttentionBwdArgs::new(a.clone(), out.view(), lse.view(), x.dout.view());
        let (dq, dkv, dsinks) = sparse_attention_backward(REF, &bw).unwrap();
        runs.push([out, lse, dq, dkv, dsinks].map(|t| f32s(&t)));
    }
    // The plan orders each row's keys ascending: only the summation order differs. The
    // error is relative to the norm floored at 1: dsinks and dkv are sums of O(1) terms
    // that may cancel, and a reordered f32 sum then differs by ~eps of its terms.
    for (name, (p, t)) in ["out", "lse", "dq", "dkv", "dsinks"].iter().zip(runs[1].iter().zip(&runs[0])) {
        let norm = t.iter().map(|&v| (v as f64).powi(2)).sum::<f64>().sqrt();
        let diff = p.iter().zip(t).map(|(&a, &b)| (a as f64 - b as f64).powi(2)).sum::<f64>().sqrt();
        let e = diff / norm.max(1.0);
        assert!(e <= 5e-6, "{name}: plan path vs top-k path: error {e:e} (norm {norm:e})");
    }
}

fn check_deterministic_backward(c: &AttnCase) {
    let x = attn_inputs(c);
    let a = SparseAttentionArgs::new(x.q.view(), x.kv.view(), x.sinks.view(), SparseIndices::TopK(x.idx.view()));
    let (out, lse) = sparse_attention(REF, &a).unwrap();
    let mut bw = SparseAttentionBwdArgs::new(a, out.view(), lse.view(), x.dout.view());
    bw.backward_impl = "deterministic".parse::<BackwardImpl>().unwrap();
    let bits = |ts: (Tensor, Tensor, Tensor)| [ts.0, ts.1, ts.2].map(|t| f32s(&t).iter().map(|v| v.to_bits()).collect::<Vec<u32>>());
    let first = bits(sparse_attention_backward(REF, &bw).unwrap());
    let second = bits(sparse_attention_backward(REF, &bw).unwrap());
    assert_eq!(first, second, "deterministic backward differs between two runs");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]

    #[test]
    fn text_window_and_compressed_slots(c in text_case()) {
        check_text(&c);
    }

    #[test]
    fn vision_spans_are_seen_whole(c in vision_case()) {
        check_vision(&c);
    }

    #[test]
    fn sparse_equals_dense_without_duplicates(c in attn_case()) {
        check_sparse_vs_dense(&c);
    }

    #[test]
    fn plan_path_equals_topk_path(c in attn_case()) {
        check_plan_vs_topk(&c);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn deterministic_backward_is_bitwise_reproducible(c in attn_case()) {
        check_deterministic_backward(&c);
    }
}

#[test]
fn deterministic_backward_bitwise_on_a_larger_problem() {
    // Enough rows that the reduction uses every chunk, and heavy key reuse across rows.
    let c = AttnCase { b: 2, s: 64, h: 4, d: 16, k: 24, t: 16, duplicates: true, seed: 5 };
    check_deterministic_backward(&c);
}

#[test]
fn duplicates_make_sparse_differ_from_dense() {
    // Row [0, 0]: the gather counts key 0 twice, the dense oracle once.
    let q = Tensor::from_f32(&[1, 1, 1, 2], vec![1.0, 0.5]).unwrap();
    let kv = Tensor::from_f32(&[1, 2, 2], vec![1.0, 2.0, -1.0, 0.5]).unwrap();
    let sinks = Tensor::from_f32(&[1], vec![0.0]).unwrap();
    let idx = Tensor::from_i32(&[1, 1, 2], vec![0, 0]).unwrap();
    let a = SparseAttentionArgs::new(q.view(), kv.view(), sinks.view(), SparseIndices::TopK(idx.view()));
    let sparse = f32s(&sparse_attention(REF, &a).unwrap().0);
    let dense = f32s(&dense_attention_topk(REF, &a).unwrap());
    // l = (1 + 1) / sqrt(2); sparse = 2e^l/(2e^l+1) * kv0, dense = e^l/(e^l+1) * kv0.
    let e = (2f32 / 2f32.sqrt()).exp();
    let (ws, wd) = (2.0 * e / (2.0 * e + 1.0), e / (e + 1.0));
    assert!((sparse[0] - ws).abs() < 1e-6 && (sparse[1] - 2.0 * ws).abs() < 1e-6, "{sparse:?}");
    assert!((dense[0] - wd).abs() < 1e-6 && (dense[1] - 2.0 * wd).abs() < 1e-6, "{dense:?}");
    assert!(rel_fro(&sparse, &dense) > 1e-2);
}
