//! Golden vectors from the original Python system (`shared/golden/`, see its README):
//! loading, and running every case through a backend, judged by SPEC.md section 8.
//!
//! A file holds tensors `<op>.<case>.<name>` and metadata `<op>.<case>` -> JSON scalars.
//! Every case found is run; an op this module does not know is an error, so a new kind
//! of case cannot pass unseen.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::backend::BackendName;
use crate::compare::{judge, Judgement, Tolerance};
use crate::error::{Error, Result};
use crate::ops::indexer::{self, IndexerArgs, IndexerTopkScoresBwdArgs};
use crate::ops::qnorm_rope::{self, QNormRopeArgs};
use crate::ops::sinkhorn::{self, SinkhornArgs};
use crate::ops::sparse_attention::{self as sa, BackwardImpl, SparseAttentionArgs, SparseAttentionBwdArgs, SparseIndices};
use crate::ops::sparse_indices::{self as si, BuildIndicesArgs};
use crate::tensor::{DType, HostData, Tensor};

/// One case: its op, id, scalar parameters and tensors (host, f32 or i32).
#[derive(Clone, Debug)]
pub struct Case {
    pub op: String,
    pub id: String,
    pub params: serde_json::Map<String, serde_json::Value>,
    pub tensors: BTreeMap<String, Tensor>,
}

/// Every `.safetensors` file in `dir`, sorted.
pub fn files_in(dir: &Path) -> Result<Vec<PathBuf>> {
    let rd = std::fs::read_dir(dir).map_err(|e| Error::Data(format!("golden: cannot read directory {}: {e}", dir.display())))?;
    let mut files: Vec<PathBuf> = rd.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.extension().is_some_and(|x| x == "safetensors")).collect();
    files.sort();
    Ok(files)
}

/// The golden files a test runs: `shared/golden/` beside the repository (or
/// `$DSV4_SHARED_DIR/golden`), plus every file in `$DSV4_GOLDEN_DIR` when set.
pub fn default_files() -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    let shared = std::env::var_os("DSV4_SHARED_DIR").map(PathBuf::from).unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared"));
    let public = shared.join("golden");
    if public.is_dir() {
        files.extend(files_in(&public)?);
    }
    if let Some(extra) = std::env::var_os("DSV4_GOLDEN_DIR") {
        files.extend(files_in(Path::new(&extra))?);
    }
    Ok(files)
}

/// Read one safetensors file into its cases, sorted by op then case id.
pub fn load(path: &Path) -> Result<Vec<Case>> {
    let err = |m: String| Error::Data(format!("golden {}: {m}", path.display()));
    let bytes = std::fs::read(path).map_err(|e| err(e.to_string()))?;
    if bytes.len() < 8 {
        return Err(err("file too short".into()));
    }
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(bytes.get(8..8 + n).ok_or_else(|| err("truncated header".into()))?).map_err(|e| err(e.to_string()))?;
    let data = &bytes[8 + n..];
    let mut meta = serde_json::Map::new();
    let mut cases: BTreeMap<(String, String), Case> = BTreeMap::new();
    for (name, info) in &header {
        if name == "__metadata__" {
            meta = info.as_object().cloned().unwrap_or_default();
            continue;
        }
        let parts: Vec<&str> = name.splitn(3, '.').collect();
        if parts.len() != 3 {
            return Err(err(format!("tensor name `{name}` is not <op>.<case>.<name>")));
        }
        let dtype = info["dtype"].as_str().unwrap_or("");
        let shape: Vec<usize> = info["shape"].as_array().ok_or_else(|| err(format!("{name}: no shape")))?.iter().map(|v| v.as_u64().unwrap_or(0) as usize).collect();
        let off = info["data_offsets"].as_array().ok_or_else(|| err(format!("{name}: no data_offsets")))?;
        let (a, b) = (off[0].as_u64().unwrap_or(0) as usize, off[1].as_u64().unwrap_or(0) as usize);
        let raw = data.get(a..b).ok_or_else(|| err(format!("{name}: data out of range")))?;
        let host = match dtype {
            "F32" => HostData::F32(raw.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()),
            "I32" => HostData::I32(raw.chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().unwrap())).collect()),
            "I64" => HostData::I64(raw.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect()),
            other => return Err(err(format!("{name}: unsupported dtype {other}"))),
        };
        let key = (parts[0].to_string(), parts[1].to_string());
        let case = cases.entry(key).or_insert_with(|| Case { op: parts[0].into(), id: parts[1].into(), params: Default::default(), tensors: BTreeMap::new() });
        case.tensors.insert(parts[2].to_string(), Tensor::from_host(host, &shape)?);
    }
    for case in cases.values_mut() {
        if let Some(v) = meta.get(&format!("{}.{}", case.op, case.id)) {
            let parsed = match v {
                serde_json::Value::String(s) => serde_json::from_str(s).map_err(|e| err(format!("metadata {}.{}: {e}", case.op, case.id)))?,
                other => other.clone(),
            };
            case.params = parsed.as_object().cloned().unwrap_or_default();
        }
    }
    Ok(cases.into_values().collect())
}

impl Case {
    fn name(&self) -> String {
        format!("{}.{}", self.op, self.id)
    }
    fn t(&self, name: &str) -> Result<&Tensor> {
        self.tensors.get(name).ok_or_else(|| Error::Data(format!("golden case {}: missing tensor `{name}`", self.name())))
    }
    fn f(&self, name: &str) -> Result<f64> {
        self.params.get(name).and_then(|v| v.as_f64()).ok_or_else(|| Error::Data(format!("golden case {}: missing scalar `{name}`", self.name())))
    }
    fn u(&self, name: &str) -> Option<usize> {
        self.params.get(name).and_then(|v| v.as_u64()).map(|v| v as usize)
    }
    fn need_u(&self, name: &str) -> Result<usize> {
        self.u(name).ok_or_else(|| Error::Data(format!("golden case {}: missing integer `{name}`", self.name())))
    }
}

pub use crate::cases::Target;

fn j(case: &Case, what: &str, got: &Tensor, want: &Tensor, tol: Tolerance) -> Result<Judgement> {
    Ok(judge(&format!("{}.{what}", case.name()), &got.to_f64_vec()?, &want.to_f64_vec()?, tol))
}

/// Run one case through `target`; returns every judged output.
pub fn run_case(case: &Case, target: &Target) -> Result<Vec<Judgement>> {
    match case.op.as_str() {
        "sparse_attention" => run_sparse_attention(case, target),
        "indexer" => run_indexer(case, target),
        "sinkhorn" => run_sinkhorn(case, target),
        "qnorm_rope" => run_qnorm_rope(case, target),
        "build_sparse_topk_indices" => run_build(case, target),
        other => Err(Error::Data(format!("golden case {}: unknown op `{other}`", case.name()))),
    }
}

fn run_sparse_attention(c: &Case, tg: &Target) -> Result<Vec<Judgement>> {
    let q = tg.put(c.t("q")?, tg.input_dtype)?;
    let kv = tg.put(c.t("kv")?, tg.input_dtype)?;
    let sinks = tg.put(c.t("sinks")?, DType::F32)?;
    let idx = tg.put(c.t("topk_idxs")?, DType::I32)?;
    let mut args = SparseAttentionArgs::new(q.view(), kv.view(), sinks.view(), SparseIndices::TopK(idx.view()));
    args.sm_scale = c.f("sm_scale")? as f32;
    let mut out = Vec::new();
    let (o, lse) = sa::sparse_attention(tg.backend, &args)?;
    out.push(j(c, "out", &o, c.t("out")?, Tolerance::Bf16)?);
    out.push(j(c, "dense_out", &sa::dense_attention_topk(tg.backend, &args)?, c.t("dense_out")?, Tolerance::Bf16)?);
    let dout = tg.put(c.t("grad_out")?, tg.input_dtype)?;
    // SPEC.md section 8 judges a backend against the reference *on the same inputs*. The
    // golden gradients were made from an f32 `grad_out` (and f32 `out` inside delta); a
    // bf16 backend reads `grad_out` rounded to bf16 and its own bf16 `out`, which alone
    // moves dq by up to 3 % and dsinks by up to 0.7 % on the large-logit case (measured
    // by an f64 replay). So when rounding changed `grad_out`, the backward is judged
    // against the reference backend fed exactly what the backend was fed.
    let want = |name: &str, got_same_inputs: &Option<(Tensor, Tensor, Tensor)>, i: usize| -> Result<Tensor> {
        match got_same_inputs {
            None => Ok(c.t(name)?.clone()),
            Some(r) => Ok([&r.0, &r.1, &r.2][i].clone()),
        }
    };
    let rounded = dout.to_f64_vec()? != c.t("grad_out")?.to_f64_vec()?;
    let same_inputs = |imp: BackwardImpl| -> Result<Option<(Tensor, Tensor, Tensor)>> {
        if !rounded {
            return Ok(None);
        }
        let (hq, hkv, hs, hi) = (q.to_host()?, kv.to_host()?, sinks.to_host()?, idx.to_host()?);
        let (ho, hl, hd) = (o.to_host()?, lse.to_host()?, dout.to_host()?);
        let mut fa = SparseAttentionArgs::new(hq.view(), hkv.view(), hs.view(), SparseIndices::TopK(hi.view()));
        fa.sm_scale = args.sm_scale;
        let mut b = SparseAttentionBwdArgs::new(fa, ho.view(), hl.view(), hd.view());
        b.backward_impl = imp;
        sa::sparse_attention_backward(BackendName::Reference, &b).map(Some)
    };
    let against = if rounded { " vs reference on the same bf16 inputs" } else { "" };
    for imp in [BackwardImpl::Atomic, BackwardImpl::Deterministic] {
        let mut b = SparseAttentionBwdArgs::new(args.clone(), o.view(), lse.view(), dout.view());
        b.backward_impl = imp;
        let (dq, dkv, dsinks) = sa::sparse_attention_backward(tg.backend, &b)?;
        let tag = if imp == BackwardImpl::Atomic { "atomic" } else { "deterministic" };
        let r = same_inputs(imp)?;
        out.push(j(c, &format!("dq[{tag}]{against}"), &dq, &want("dq", &r, 0)?, Tolerance::Bf16)?);
        out.push(j(c, &format!("dkv[{tag}]{against}"), &dkv, &want("dkv", &r, 1)?, Tolerance::F32Grad)?);
        out.push(j(c, &format!("dsinks[{tag}]{against}"), &dsinks, &want("dsinks", &r, 2)?, Tolerance::F32Grad)?);
    }
    // The same selection through a plan.
    let plan = si::plan_sparse_indices(tg.backend, &idx.view(), kv.shape()[1], false)?;
    let mut pargs = args.clone();
    pargs.indices = SparseIndices::Plan(&plan);
    let (po, plse) = sa::sparse_attention(tg.backend, &pargs)?;
    out.push(j(c, "out[plan]", &po, c.t("out")?, Tolerance::Bf16)?);
    let (pdq, pdkv, _) = sa::sparse_attention_backward(tg.backend, &SparseAttentionBwdArgs::new(pargs.clone(), po.view(), plse.view(), dout.view()))?;
    let r = same_inputs(BackwardImpl::Atomic)?;
    out.push(j(c, &format!("dq[plan]{against}"), &pdq, &want("dq", &r, 0)?, Tolerance::Bf16)?);
    out.push(j(c, &format!("dkv[plan]{against}"), &pdkv, &want("dkv", &r, 1)?, Tolerance::F32Grad)?);
    Ok(out)
}

/// Sort each row of `[rows, k]` indices ascending with -1 last.
fn sorted_rows(v: &[i64], k: usize) -> Vec<f64> {
    v.chunks(k.max(1))
        .flat_map(|r| {
            let mut r = r.to_vec();
            r.sort_by_key(|&x| if x < 0 { i64::MAX } else { x });
            r.into_iter().map(|x| if x < 0 { -1.0 } else { x as f64 })
        })
        .collect()
}

fn run_indexer(c: &Case, tg: &Target) -> Result<Vec<Judgement>> {
    let q = tg.put(c.t("q")?, tg.input_dtype)?;
    let kv = tg.put(c.t("pooled_kv")?, tg.input_dtype)?;
    let w = tg.put(c.t("weights")?, DType::F32)?;
    let mut a = IndexerArgs::new(q.view(), kv.view(), w.view(), c.f("softmax_scale")? as f32, c.need_u("compress_ratio")?);
    a.query_start = c.u("query_start").unwrap_or(0);
    a.query_total_len = c.u("query_total_len");
    let p = kv.shape()[1];
    let k = c.need_u("topk")?;
    let mut out = Vec::new();
    let scores = indexer::indexer_scores(tg.backend, &a)?;
    out.push(j(c, "scores", &scores, c.t("scores")?, Tolerance::F32Rows { row_len: p })?);
    let want_sorted = c.t("topk_indices_sorted")?.to_f64_vec()?;
    let kk = k.min(p);
    let (i1, v1) = indexer::indexer_topk(tg.backend, &scores.view(), k)?;
    let (i2, v2) = indexer::lightning_indexer(tg.backend, &a, k)?;
    for (tag, idx, vals) in [("topk", &i1, &v1), ("fused_topk", &i2, &v2)] {
        out.push(judge(&format!("{}.{tag}.indices", c.name()), &sorted_rows(&idx.to_i64_vec()?, kk), &want_sorted, Tolerance::Exact));
        out.push(j(c, &format!("{tag}.values"), vals, c.t("topk_scores")?, Tolerance::F32Rows { row_len: kk })?);
    }
    let topk = tg.put(c.t("topk_indices")?, DType::I32)?;
    let ts = indexer::indexer_topk_scores(tg.backend, &a, &topk.view())?;
    out.push(j(c, "topk_scores", &ts, c.t("topk_scores")?, Tolerance::F32Rows { row_len: topk.shape()[2] })?);
    let g = tg.put(c.t("grad_scores")?, DType::F32)?;
    for det in [false, true] {
        let b = IndexerTopkScoresBwdArgs { fwd: a.clone(), topk_indices: topk.view(), grad: g.view(), deterministic: det };
        let (dq, dw, dkv) = indexer::indexer_topk_scores_backward(tg.backend, &b)?;
        let tag = if det { "deterministic" } else { "atomic" };
        out.push(j(c, &format!("dq[{tag}]"), &dq, c.t("dq")?, Tolerance::Bf16)?);
        out.push(j(c, &format!("dweights[{tag}]"), &dw, c.t("dweights")?, Tolerance::F32Grad)?);
        out.push(j(c, &format!("dpooled_kv[{tag}]"), &dkv, c.t("dpooled_kv")?, Tolerance::F32Grad)?);
    }
    Ok(out)
}

/// The same logical tensor, stored with its last two dimensions swapped.
fn transposed_storage(t: &Tensor, tg: &Target) -> Result<Tensor> {
    let nd = t.shape().len();
    let flipped = t.view().transpose(nd - 2, nd - 1).to_tensor()?;
    let dev = tg.put(&flipped, t.dtype())?;
    let strides = dev.strides().to_vec();
    let mut s2 = strides.clone();
    s2.swap(nd - 2, nd - 1);
    Ok(dev.with_layout(t.shape(), &s2))
}

fn run_sinkhorn(c: &Case, tg: &Target) -> Result<Vec<Judgement>> {
    let x = tg.put(c.t("x")?, DType::F32)?;
    let n = *x.shape().last().unwrap();
    let a = SinkhornArgs { x: x.view(), repeat: c.need_u("repeat")?, eps: c.f("eps")? as f32 };
    let y = sinkhorn::sinkhorn_normalize(tg.backend, &a)?;
    // The "row scale" of a Sinkhorn gradient is its matrix's scale: a row of dx can be a
    // cancellation down to ~1e-8 of its matrix, where the golden f32 values are rounding
    // noise (an f64 replay differs from them by 100 % of such a row and 8e-7 of the matrix).
    let per_matrix = Tolerance::F32Rows { row_len: n * n };
    let mut out = vec![j(c, "out", &y, c.t("out")?, Tolerance::F32Rows { row_len: n })?];
    let g = tg.put(c.t("grad_out")?, DType::F32)?;
    let dx = sinkhorn::sinkhorn_normalize_backward(tg.backend, &a, &g.view())?;
    out.push(j(c, "dx", &dx, c.t("dx")?, per_matrix)?);
    let gt = transposed_storage(c.t("grad_out")?, tg)?;
    let dx2 = sinkhorn::sinkhorn_normalize_backward(tg.backend, &a, &gt.view())?;
    out.push(j(c, "dx[strided dout]", &dx2, c.t("dx")?, per_matrix)?);
    Ok(out)
}

fn run_qnorm_rope(c: &Case, tg: &Target) -> Result<Vec<Judgement>> {
    let xs = c.t("x")?;
    let cc = xs.shape()[3];
    let cos = tg.put(c.t("cos")?, DType::F32)?;
    let sin = tg.put(c.t("sin")?, DType::F32)?;
    let g = tg.put(c.t("grad_out")?, DType::BF16)?;
    let tol = Tolerance::Bf16Ulps { row_len: cc, rotary: c.need_u("rotary")? };
    let mut out = Vec::new();
    // x as stored ([B,H,S,C] contiguous) and as the usual transposed token-major view.
    let x_plain = tg.put(xs, DType::BF16)?;
    let tm = xs.view().transpose(1, 2).to_tensor()?; // [B,S,H,C]
    let x_tm_dev = tg.put(&tm, DType::BF16)?;
    let x_tm = x_tm_dev.view().transpose(1, 2);
    for (tag, xv) in [("", x_plain.view()), ("[token-major x]", x_tm)] {
        let a = QNormRopeArgs { x: xv, cos: cos.view(), sin: sin.view(), rotary: c.need_u("rotary")?, eps: c.f("eps")? as f32 };
        let (y, rstd) = qnorm_rope::qnorm_rope(tg.backend, &a)?;
        out.push(j(c, &format!("out{tag}"), &y, c.t("out")?, tol)?);
        let dx = qnorm_rope::qnorm_rope_backward(tg.backend, &a, &rstd.view(), &g.view())?;
        out.push(j(c, &format!("dx{tag}"), &dx, c.t("dx")?, tol)?);
    }
    Ok(out)
}

fn run_build(c: &Case, tg: &Target) -> Result<Vec<Judgement>> {
    let opt = |name: &str, dtype: DType| -> Result<Option<Tensor>> { c.tensors.get(name).map(|t| tg.put(t, dtype)).transpose() };
    let mask = opt("attention_mask", DType::F32)?;
    let ct = opt("compressed_topk", DType::I32)?;
    let qp = opt("q_positions", DType::I32)?;
    let vt = opt("vision_token_types", DType::I32)?;
    let mut a = BuildIndicesArgs::new(c.need_u("batch_size")?, c.need_u("seq_len")?, c.need_u("key_len")?, c.need_u("window_size")?);
    a.device = tg.device;
    a.compress_ratio = c.u("compress_ratio").unwrap_or(0);
    a.n_pooled = c.u("n_pooled").unwrap_or(0);
    a.vanilla_key_len = c.u("vanilla_key_len");
    a.max_image_tokens = c.u("max_image_tokens").unwrap_or(0);
    a.attention_mask = mask.as_ref().map(|t| t.view());
    a.compressed_topk = ct.as_ref().map(|t| t.view());
    a.q_positions = qp.as_ref().map(|t| t.view());
    a.vision_token_types = vt.as_ref().map(|t| t.view());
    let got = si::build_sparse_topk_indices(tg.backend, &a)?;
    Ok(vec![j(c, "indices", &got, c.t("expected")?, Tolerance::Exact)?])
}

/// Run every case of every file in `files` through `target`; prints
/// `golden<tag>: <file>: <N> cases passed` per file (with `DSV4_VERBOSE` set, every
/// judgement too) and returns one line per failure — a failed judgement, or a case that
/// could not run (an unavailable backend included: nothing passes by falling back).
pub fn run_files(files: &[PathBuf], target: &Target, tag: &str) -> Result<Vec<String>> {
    if files.is_empty() {
        return Err(Error::Data("no golden files found: expected ../shared/golden/*.safetensors beside the repository, or DSV4_GOLDEN_DIR".into()));
    }
    let verbose = std::env::var_os("DSV4_VERBOSE").is_some();
    let mut failures = Vec::new();
    for file in files {
        let cases = load(file)?;
        if cases.is_empty() {
            return Err(Error::Data(format!("golden {}: no cases", file.display())));
        }
        let mut passed = 0;
        for case in &cases {
            match run_case(case, target) {
                Ok(js) => {
                    if verbose {
                        js.iter().for_each(|j| println!("  {j}"));
                    }
                    let before = failures.len();
                    failures.extend(js.iter().filter(|j| !j.pass).map(|j| format!("{}: {j}", file.display())));
                    passed += usize::from(failures.len() == before);
                }
                Err(e) => failures.push(format!("{}: {}.{}: {e}", file.display(), case.op, case.id)),
            }
        }
        println!("golden{tag}: {}: {passed} cases passed", file.file_name().unwrap_or_default().to_string_lossy());
    }
    Ok(failures)
}
