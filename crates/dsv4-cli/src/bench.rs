//! `dsv4 bench`: GPU timings of the `cuda` backend through the public op API at the shapes
//! of the performance issues. Each row has three figures:
//! - `ms` (cool): CUDA events around each call after an idle `--cooldown-ms`, L2 flushed
//!   between calls by a 256 MiB memset outside the timed region, the median of `--iters`;
//! - `sustained`: events around `--iters` calls queued back to back (no idle, no flush), per
//!   call: what a training step that keeps the GPU busy sees;
//! - `host us`: the wall time of queueing those calls, per call: what a call costs the CPU
//!   (near `sustained`, the call waits for the device).
//!
//! FLOPs or bytes are counted honestly (valid slots only, causal halves) against the
//! measured H200 ceilings: 752 TFLOP/s bf16 GEMM, 4.24 TB/s device copy.

use cudarc::driver::{result as cu, sys};
use dsv4_core::backend::BackendName;
use dsv4_core::ops::indexer::{self, IndexerArgs, IndexerTopkScoresBwdArgs};
use dsv4_core::ops::qnorm_rope::{self, QNormRopeArgs};
use dsv4_core::ops::sinkhorn::{self, SinkhornArgs};
use dsv4_core::ops::sparse_attention::{self as sa, BackwardImpl, SparseAttentionArgs, SparseAttentionBwdArgs, SparseIndices};
use dsv4_core::ops::sparse_indices::{self as si, BuildIndicesArgs};
use dsv4_core::{DType, Device, Error, Result, Tensor};
use dsv4_cuda::runtime::{gpu, Gpu};

use crate::args::Args;
use crate::data::{rope_tables, Rng, Staged};

const GEMM_TFLOPS: f64 = 752.0;
const COPY_GBPS: f64 = 4240.0;
const CUDA: BackendName = BackendName::Cuda;
const DEV: Device = Device::Cuda(0);

/// One measured line.
struct Entry {
    op: String,
    shape: String,
    ms: f64,
    /// Per call over a back-to-back queue: GPU milliseconds and host microseconds.
    sustained_ms: f64,
    host_us: f64,
    /// (value, unit, % of ceiling)
    rate: Option<(f64, &'static str, f64)>,
    note: String,
}

struct Bench {
    gpu: &'static Gpu,
    iters: usize,
    flush: dsv4_cuda::runtime::Scratch,
    entries: Vec<Entry>,
    start: sys::CUevent,
    end: sys::CUevent,
    /// Idle time before each row's warm-up, so every row starts from the same power state.
    cooldown: std::time::Duration,
    /// The last `time`'s sustained GPU ms and host us per call, for the entry it produces.
    last: std::cell::Cell<(f64, f64)>,
}

fn drv(e: cudarc::driver::DriverError) -> Error {
    Error::Cuda(format!("{e:?}"))
}

impl Bench {
    fn new(iters: usize, cooldown_ms: u64) -> Result<Self> {
        let gpu = gpu(0)?;
        let flush = gpu.scratch(256 << 20)?;
        gpu.zero(flush.ptr(), flush.bytes())?;
        gpu.synchronize()?;
        let start = cu::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).map_err(drv)?;
        let end = cu::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).map_err(drv)?;
        Ok(Bench { gpu, iters, flush, entries: Vec::new(), start, end, cooldown: std::time::Duration::from_millis(cooldown_ms), last: std::cell::Cell::new((f64::NAN, f64::NAN)) })
    }

    /// Median milliseconds of `f` over `iters` timed runs after an idle `cooldown` and 3
    /// warm-up runs. The cooldown: an H200 under these kernels runs into its 700 W cap within
    /// a row (nvidia-smi: SM clock 1980 -> ~1850 MHz), so without it a row is slower when it
    /// follows a heavy one (the plan forward at S=16384: 2.63 ms timed first, 2.83 second).
    fn time(&self, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
        self.gpu.synchronize()?;
        std::thread::sleep(self.cooldown);
        for _ in 0..3 {
            f()?;
        }
        self.gpu.synchronize()?;
        let stream = self.gpu.stream_raw() as sys::CUstream;
        let mut times = Vec::with_capacity(self.iters);
        for _ in 0..self.iters {
            self.gpu.zero(self.flush.ptr(), self.flush.bytes())?;
            // SAFETY: both events were created in this device's context; `stream` is the
            // stream every launch of this thread goes to.
            unsafe {
                cu::event::record(self.start, stream).map_err(drv)?;
                f()?;
                cu::event::record(self.end, stream).map_err(drv)?;
                cu::event::synchronize(self.end).map_err(drv)?;
                times.push(cu::event::elapsed(self.start, self.end).map_err(drv)? as f64);
            }
        }
        times.sort_by(|a, b| a.partial_cmp(b).unwrap());
        // Sustained: the same calls queued back to back, events around the queue; the host
        // clock around the queueing alone.
        self.gpu.synchronize()?;
        // SAFETY: as above.
        let (sustained, host) = unsafe {
            cu::event::record(self.start, stream).map_err(drv)?;
            let t0 = std::time::Instant::now();
            for _ in 0..self.iters {
                f()?;
            }
            let host = t0.elapsed().as_secs_f64() * 1e6 / self.iters as f64;
            cu::event::record(self.end, stream).map_err(drv)?;
            cu::event::synchronize(self.end).map_err(drv)?;
            (cu::event::elapsed(self.start, self.end).map_err(drv)? as f64 / self.iters as f64, host)
        };
        self.last.set((sustained, host));
        Ok(times[times.len() / 2])
    }

    fn flops(&mut self, op: &str, shape: &str, ms: f64, flops: f64, note: &str) {
        let tf = flops / (ms * 1e-3) / 1e12;
        let (sustained_ms, host_us) = self.last.replace((f64::NAN, f64::NAN));
        self.entries.push(Entry { op: op.into(), shape: shape.into(), ms, sustained_ms, host_us, rate: Some((tf, "TFLOP/s", 100.0 * tf / GEMM_TFLOPS)), note: note.into() });
    }

    fn bytes(&mut self, op: &str, shape: &str, ms: f64, bytes: f64, note: &str) {
        let gb = bytes / (ms * 1e-3) / 1e9;
        let (sustained_ms, host_us) = self.last.replace((f64::NAN, f64::NAN));
        self.entries.push(Entry { op: op.into(), shape: shape.into(), ms, sustained_ms, host_us, rate: Some((gb, "GB/s", 100.0 * gb / COPY_GBPS)), note: note.into() });
    }
}

/// Random distinct causal selection: for query `s`, `min(k, visible)` of the pooled keys
/// `p < (s+1)/r`, in random order, -1 after. Returns `[B,S,k]` as f32 values.
fn random_selection(rng: &mut Rng, b: usize, s: usize, p: usize, r: usize, k: usize) -> Vec<f32> {
    let mut out = vec![-1.0f32; b * s * k];
    let mut pool: Vec<u32> = (0..p as u32).collect();
    for bi in 0..b {
        for si in 0..s {
            let visible = ((si + 1) / r).min(p);
            let take = k.min(visible);
            for j in 0..take {
                let pick = j + (rng.next_u64() as usize) % (visible - j);
                pool.swap(j, pick);
                out[(bi * s + si) * k + j] = pool[j] as f32;
            }
        }
    }
    out
}

/// The attention table's options (`dsv4 bench` flags).
struct AttnOpts {
    fwd_only: bool,
    bwd_only: bool,
    /// `--atomic-only`: of the backward rows, the atomic one alone (variant sweeps).
    atomic_only: bool,
    plan_first: bool,
    /// `--workspace-mib N`: the deterministic backward's workspace (default: the library's).
    workspace: Option<usize>,
}

fn bench_sparse_attention(bn: &mut Bench, rng: &mut Rng, s: usize, h: usize, d: usize, o: &AttnOpts) -> Result<()> {
    let AttnOpts { fwd_only, bwd_only, atomic_only, plan_first, workspace } = *o;
    let (b, window, topk, r) = (1, 128, 512, 4);
    let st = Staged { device: DEV };
    let p = s / r;
    let k_len = s + p;
    let sel = st.put(&random_selection(rng, b, s, p, r, topk), &[b, s, topk], DType::I32)?;
    let mut ba = BuildIndicesArgs::new(b, s, k_len, window);
    ba.device = DEV;
    ba.compress_ratio = r;
    ba.n_pooled = p;
    ba.compressed_topk = Some(sel.view());
    let idx = si::build_sparse_topk_indices(CUDA, &ba)?;
    let valid = idx.to_i64_vec()?.iter().filter(|&&v| v >= 0).count() as f64;
    let t = idx.shape()[2];
    let q = st.put(&rng.vec_bf16(b * s * h * d, -1.7, 1.7), &[b, s, h, d], DType::BF16)?;
    let kv = st.put(&rng.vec_bf16(b * k_len * d, -1.7, 1.7), &[b, k_len, d], DType::BF16)?;
    let sinks = st.put(&rng.vec(h, -1.0f32, 1.0), &[h], DType::F32)?;
    let dout = st.put(&rng.vec_bf16(b * s * h * d, -1.7, 1.7), &[b, s, h, d], DType::BF16)?;
    let args = SparseAttentionArgs::new(q.view(), kv.view(), sinks.view(), SparseIndices::TopK(idx.view()));
    let mut out = bn.gpu.alloc(DType::BF16, &[b, s, h, d])?;
    let mut lse = bn.gpu.alloc(DType::F32, &[b, s, h])?;
    let (mut dq, mut dkv, mut dsinks) = (bn.gpu.alloc(DType::BF16, &[b, s, h, d])?, bn.gpu.alloc(DType::BF16, &[b, k_len, d])?, bn.gpu.alloc(DType::F32, &[h])?);
    let shape = format!("B={b} S={s} H={h} D={d} T={t} valid={:.0}/q", valid / (b * s) as f64);
    let fwd_flops = 4.0 * valid * h as f64 * d as f64;
    let plan = si::plan_sparse_indices(CUDA, &idx.view(), k_len, false)?;
    let mut pargs = args.clone();
    pargs.indices = SparseIndices::Plan(&plan);
    // `plan_first`: the plan forward timed before the plain one (the order's effect on the
    // two rows).
    let fwd_orders: &[bool] = match (bwd_only, plan_first) {
        (true, _) => &[],
        (false, true) => &[true, false],
        (false, false) => &[false, true],
    };
    for &with_plan in fwd_orders {
        let (a, name) = if with_plan { (&pargs, "sparse_attention fwd (plan)") } else { (&args, "sparse_attention fwd") };
        let ms = bn.time(|| sa::sparse_attention_into(CUDA, a, &mut out.view_mut(), &mut lse.view_mut()))?;
        bn.flops(name, &shape, ms, fwd_flops, "");
    }
    if plan_first || bwd_only {
        sa::sparse_attention_into(CUDA, &pargs, &mut out.view_mut(), &mut lse.view_mut())?;
    }
    if fwd_only {
        return Ok(());
    }
    let mut ms_bwd = [0.0; 2];
    let impls: &[BackwardImpl] = if atomic_only { &[BackwardImpl::Atomic] } else { &[BackwardImpl::Atomic, BackwardImpl::Deterministic] };
    for (i, &imp) in impls.iter().enumerate() {
        let mut bw = SparseAttentionBwdArgs::new(pargs.clone(), out.view(), lse.view(), dout.view());
        bw.backward_impl = imp;
        if let Some(ws) = workspace {
            bw.backward_workspace_bytes = ws;
        }
        let ms = bn.time(|| sa::sparse_attention_backward_into(CUDA, &bw, &mut dq.view_mut(), &mut dkv.view_mut(), &mut dsinks.view_mut()))?;
        ms_bwd[i] = ms;
        let name = if i == 0 { "sparse_attention bwd atomic (plan)" } else { "sparse_attention bwd deterministic (plan)" };
        let note = match (i, bwd_only) {
            (1, true) => format!("deterministic/atomic backward = {:.2}x", ms_bwd[1] / ms_bwd[0]),
            (1, false) => "ratio to atomic in the next line".into(),
            _ => String::new(),
        };
        bn.flops(name, &shape, ms, 2.5 * fwd_flops, &note);
    }
    if bwd_only || atomic_only {
        return Ok(());
    }
    let both = bn.time(|| {
        sa::sparse_attention_into(CUDA, &pargs, &mut out.view_mut(), &mut lse.view_mut())?;
        let bw = SparseAttentionBwdArgs::new(pargs.clone(), out.view(), lse.view(), dout.view());
        sa::sparse_attention_backward_into(CUDA, &bw, &mut dq.view_mut(), &mut dkv.view_mut(), &mut dsinks.view_mut())
    })?;
    bn.flops("sparse_attention fwd+bwd (plan)", &shape, both, 3.5 * fwd_flops, &format!("deterministic/atomic backward = {:.2}x", ms_bwd[1] / ms_bwd[0]));
    let o = out.to_f32_vec()?;
    if o.iter().any(|v| !v.is_finite()) {
        return Err(Error::Data("sparse_attention bench: non-finite output".into()));
    }
    Ok(())
}

fn visible_pairs(s: usize, p: usize, r: usize) -> f64 {
    (0..s).map(|i| ((i + 1) / r).min(p) as f64).sum()
}

/// The DSV4 indexer's inputs on the GPU: q `[1,S,64,128]`, pooled_kv `[1,S/4,128]`,
/// weights `[1,S,64]`.
fn indexer_inputs(rng: &mut Rng, s: usize) -> Result<[Tensor; 3]> {
    let (b, h, d, p) = (1, 64, 128, s / 4);
    let st = Staged { device: DEV };
    Ok([
        st.put(&rng.vec_bf16(b * s * h * d, -1.7, 1.7), &[b, s, h, d], DType::BF16)?,
        st.put(&rng.vec_bf16(b * p * d, -1.7, 1.7), &[b, p, d], DType::BF16)?,
        st.put(&rng.vec(b * s * h, -1.0f32, 1.0), &[b, s, h], DType::F32)?,
    ])
}

/// `topk_scores_only`: only the top-k scores rows (fwd+bwd, fwd, bwd), for variant sweeps.
fn bench_indexer(bn: &mut Bench, rng: &mut Rng, s: usize, topk_scores_only: bool) -> Result<()> {
    let (b, h, d, r, k) = (1, 64, 128, 4, 512);
    let p = s / r;
    let st = Staged { device: DEV };
    let [q, kv, w] = indexer_inputs(rng, s)?;
    let a = IndexerArgs::new(q.view(), kv.view(), w.view(), (d as f32).powf(-0.5), r);
    let shape = format!("B={b} S={s} H={h} D={d} P={p} k={k}");
    let flops = 2.0 * (h * d) as f64 * visible_pairs(s, p, r) * b as f64;
    if !topk_scores_only {
        let mut scores = bn.gpu.alloc(DType::F32, &[b, s, p])?;
        let ms = bn.time(|| indexer::indexer_scores_into(CUDA, &a, &mut scores.view_mut()))?;
        bn.flops("indexer scores", &shape, ms, flops, "materialised [B,S,P]");
        let ms = bn.time(|| indexer::lightning_indexer(CUDA, &a, k).map(|_| ()))?;
        bn.flops("indexer scores+top-k", &shape, ms, flops, "the default path (lightning_indexer)");
    }
    let sel = st.put(&random_selection(rng, b, s, p, r, k), &[b, s, k], DType::I32)?;
    let g = st.put(&rng.vec(b * s * k, -1.0f32, 1.0), &[b, s, k], DType::F32)?;
    let sel_flops = 2.0 * (h * d) as f64 * sel.to_i64_vec()?.iter().filter(|&&v| v >= 0).count() as f64;
    let ms = bn.time(|| {
        indexer::indexer_topk_scores(CUDA, &a, &sel.view())?;
        let bw = IndexerTopkScoresBwdArgs { fwd: a.clone(), topk_indices: sel.view(), grad: g.view(), deterministic: false };
        indexer::indexer_topk_scores_backward(CUDA, &bw).map(|_| ())
    })?;
    bn.flops("indexer top-k scores fwd+bwd", &shape, ms, 3.0 * sel_flops, "");
    // Each half alone (the backward recomputes its products from q and kv).
    let ms = bn.time(|| indexer::indexer_topk_scores(CUDA, &a, &sel.view()).map(|_| ()))?;
    bn.flops("indexer top-k scores fwd", &shape, ms, sel_flops, "");
    let ms = bn.time(|| {
        let bw = IndexerTopkScoresBwdArgs { fwd: a.clone(), topk_indices: sel.view(), grad: g.view(), deterministic: false };
        indexer::indexer_topk_scores_backward(CUDA, &bw).map(|_| ())
    })?;
    bn.flops("indexer top-k scores bwd", &shape, ms, 2.0 * sel_flops, "atomic dkv");
    Ok(())
}

/// S=65536, P=16384, top-512: peak device memory of the indexer's default path beyond its inputs
/// and outputs, read from the stream-ordered pool's high-water mark.
fn bench_indexer_memory(bn: &mut Bench, rng: &mut Rng) -> Result<()> {
    let (b, s, h, d, r, k) = (1, 65536, 64, 128, 4, 512);
    let p = s / r;
    let [q, kv, w] = indexer_inputs(rng, s)?;
    let a = IndexerArgs::new(q.view(), kv.view(), w.view(), (d as f32).powf(-0.5), r);
    bn.gpu.synchronize()?;
    let before = bn.gpu.pool_used_bytes()?;
    bn.gpu.reset_pool_high_water()?;
    let t0 = std::time::Instant::now();
    let (idx, vals) = indexer::lightning_indexer(CUDA, &a, k)?;
    bn.gpu.synchronize()?;
    let ms = t0.elapsed().as_secs_f64() * 1e3;
    let high = bn.gpu.pool_high_water_bytes()?;
    let outputs = (idx.numel() * 4 + vals.numel() * 4) as f64;
    let beyond = high as f64 - before as f64 - outputs;
    bn.entries.push(Entry {
        op: "indexer memory".into(),
        shape: format!("B={b} S={s} H={h} D={d} P={p} k={k}"),
        ms,
        sustained_ms: f64::NAN,
        host_us: f64::NAN,
        rate: None,
        note: format!("peak beyond inputs+outputs: {:.1} MiB (outputs {:.0} MiB; one cold call, host-timed)", beyond / 1048576.0, outputs / 1048576.0),
    });
    Ok(())
}

fn bench_sinkhorn(bn: &mut Bench, rng: &mut Rng, m: usize) -> Result<()> {
    let n = 4;
    let st = Staged { device: DEV };
    let x = st.put(&rng.vec(m * n * n, -3.0f32, 3.0), &[m, n, n], DType::F32)?;
    let g = st.put(&rng.vec(m * n * n, -1.0f32, 1.0), &[m, n, n], DType::F32)?;
    let a = SinkhornArgs { x: x.view(), repeat: 20, eps: 1e-6 };
    let mut y = bn.gpu.alloc(DType::F32, &[m, n, n])?;
    let mut dx = bn.gpu.alloc(DType::F32, &[m, n, n])?;
    let shape = format!("{m} x {n}x{n}, repeat 20");
    let bytes = (m * n * n * 4) as f64;
    let ms = bn.time(|| sinkhorn::sinkhorn_normalize_into(CUDA, &a, &mut y.view_mut()))?;
    bn.bytes("sinkhorn fwd", &shape, ms, 2.0 * bytes, "");
    let ms = bn.time(|| sinkhorn::sinkhorn_normalize_backward_into(CUDA, &a, &g.view(), &mut dx.view_mut()))?;
    bn.bytes("sinkhorn bwd", &shape, ms, 3.0 * bytes, "");
    Ok(())
}

fn bench_qnorm_rope(bn: &mut Bench, rng: &mut Rng) -> Result<()> {
    let (b, s, h, c, r) = (1, 16384, 64, 512, 64);
    let st = Staged { device: DEV };
    let x = st.put(&rng.vec_bf16(b * s * h * c, -3.4, 3.4), &[b, s, h, c], DType::BF16)?;
    let g = st.put(&rng.vec_bf16(b * s * h * c, -1.7, 1.7), &[b, s, h, c], DType::BF16)?;
    let (cos, sin) = rope_tables(b, s, r);
    let cos = st.put(&cos, &[b, s, r], DType::F32)?;
    let sin = st.put(&sin, &[b, s, r], DType::F32)?;
    let a = QNormRopeArgs { x: x.view().transpose(1, 2), cos: cos.view(), sin: sin.view(), rotary: r, eps: 1e-6 };
    let shape = format!("B={b} H={h} S={s} C={c} R={r}");
    let n = (b * s * h * c) as f64;
    let rows = (b * s * h) as f64;
    let tables = 2.0 * (b * s * r * 4) as f64;
    let tm = |t: Tensor| {
        let strides = qnorm_rope::token_major_strides([b, h, s, c]);
        t.with_layout(&[b, h, s, c], &strides)
    };
    let mut y = tm(bn.gpu.alloc(DType::BF16, &[b, s, h, c])?);
    let mut rstd = bn.gpu.alloc(DType::F32, &[b * s * h])?;
    let mut dx = tm(bn.gpu.alloc(DType::BF16, &[b, s, h, c])?);
    let ms_f = bn.time(|| qnorm_rope::qnorm_rope_into(CUDA, &a, &mut y.view_mut(), &mut rstd.view_mut()))?;
    bn.bytes("qnorm_rope fwd", &shape, ms_f, 4.0 * n + 4.0 * rows + tables, "");
    let gv = g.view().transpose(1, 2);
    let ms_fb = bn.time(|| {
        qnorm_rope::qnorm_rope_into(CUDA, &a, &mut y.view_mut(), &mut rstd.view_mut())?;
        qnorm_rope::qnorm_rope_backward_into(CUDA, &a, &rstd.view(), &gv, &mut dx.view_mut())
    })?;
    bn.bytes("qnorm_rope fwd+bwd", &shape, ms_fb, 10.0 * n + 12.0 * rows + 2.0 * tables, "");
    Ok(())
}

fn print(entries: &[Entry], json: bool) {
    if json {
        let rows: Vec<serde_json::Value> = entries
            .iter()
            .map(|e| {
                serde_json::json!({
                    "op": e.op, "shape": e.shape, "ms": e.ms, "sustained_ms": e.sustained_ms, "host_us": e.host_us,
                    "rate": e.rate.map(|r| r.0), "unit": e.rate.map(|r| r.1), "pct_of_ceiling": e.rate.map(|r| r.2), "note": e.note,
                })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&rows).unwrap());
        return;
    }
    println!("{:<42} {:<44} {:>9} {:>9} {:>8} {:>16} {:>7}  note", "operation", "shape", "ms", "sustained", "host us", "rate", "% ceil");
    for e in entries {
        let (rate, pct) = match e.rate {
            Some((v, unit, pct)) => (format!("{v:.1} {unit}"), format!("{pct:.1}")),
            None => ("-".into(), "-".into()),
        };
        println!("{:<42} {:<44} {:>9.4} {:>9.4} {:>8.1} {:>16} {:>7}  {}", e.op, e.shape, e.ms, e.sustained_ms, e.host_us, rate, pct, e.note);
    }
}

/// `dsv4 bench`'s switches and valued flags (see the usage in main.rs).
pub const SWITCHES: &[&str] = &["--json", "--fwd-only", "--bwd-only", "--atomic-only", "--topk-scores-only", "--no-sweep", "--plan-first"];
pub const VALUED: &[&str] = &["--iters", "--workspace-mib", "--s", "--m", "--config", "--cooldown-ms"];
/// The benches `dsv4 bench <target>` runs.
const TARGETS: &[&str] = &["sparse-attention", "indexer", "sinkhorn", "qnorm-rope", "all"];

/// The table sizes `all`, or only the one `flag N` names (`--s N`: a sequence length of the
/// attention and indexer tables; `--m N`: a Sinkhorn matrix count), an error if it is not one.
fn sizes(args: &Args, flag: &str, all: &[usize]) -> Result<Vec<usize>> {
    match args.value::<usize>(flag, "a size")? {
        None => Ok(all.to_vec()),
        Some(n) if all.contains(&n) => Ok(vec![n]),
        Some(n) => Err(Error::Data(format!("`{flag} {n}`: the table has {}", all.iter().map(|a| a.to_string()).collect::<Vec<_>>().join(", ")))),
    }
}

pub fn main(args: &Args) -> Result<bool> {
    let what = match args.positional() {
        [] => "all",
        [w] => w.as_str(),
        [_, extra, ..] => return Err(Error::Data(format!("bench: unexpected argument `{extra}` (one target: {})", TARGETS.join(", ")))),
    };
    if !TARGETS.contains(&what) {
        return Err(Error::Data(format!("unknown bench `{what}` ({})", TARGETS.join(", "))));
    }
    let json = args.has("--json");
    let iters = args.value::<usize>("--iters", "a positive count")?.unwrap_or(20);
    if iters == 0 {
        return Err(Error::Data("`--iters 0`: expected a positive count".into()));
    }
    let fwd_only = args.has("--fwd-only");
    // --bwd-only: the attention's backward rows alone (one untimed forward makes out, lse)
    let bwd_only = args.has("--bwd-only");
    // --atomic-only: with --bwd-only, the atomic backward's row alone
    let atomic_only = args.has("--atomic-only");
    let workspace = match args.raw("--workspace-mib") {
        Some(v) => Some(v.parse::<usize>().ok().filter(|m| *m > 0).map(|m| m << 20).ok_or_else(|| Error::Data(format!("--workspace-mib {v}: a positive number of MiB")))?),
        None => None,
    };
    if let Some(pairs) = args.raw("--config") {
        // The lab build's kernel config overrides (`sa_bwd.c0_chunks=3,...`); an error in
        // the default build, whose kernels are the shipped ones.
        dsv4_cuda::tuning::set_overrides(&dsv4_cuda::tuning::parse_pairs(pairs))?;
    }
    let plan_first = args.has("--plan-first");
    let cooldown_ms = args.value("--cooldown-ms", "milliseconds")?.unwrap_or(500);
    let (attn_sizes, m_sizes) = (sizes(args, "--s", &[4096, 16384])?, sizes(args, "--m", &[65536, 1 << 20])?);
    let mut bn = Bench::new(iters, cooldown_ms)?;
    let mut rng = Rng(42);
    let attn = AttnOpts { fwd_only, bwd_only, atomic_only, plan_first, workspace };
    let all = what == "all";
    if all || what == "sparse-attention" {
        for &s in &attn_sizes {
            bench_sparse_attention(&mut bn, &mut rng, s, 64, 512, &attn)?;
        }
        // `--no-sweep`: the two main shapes only (no other head counts and head dims).
        if !args.has("--no-sweep") {
            for h in [16, 32, 128] {
                bench_sparse_attention(&mut bn, &mut rng, 4096, h, 512, &attn)?;
            }
            for d in [128, 256] {
                bench_sparse_attention(&mut bn, &mut rng, 4096, 64, d, &attn)?;
            }
        }
    }
    if all || what == "indexer" {
        let topk_scores_only = args.has("--topk-scores-only");
        for &s in &attn_sizes {
            bench_indexer(&mut bn, &mut rng, s, topk_scores_only)?;
        }
        if !topk_scores_only {
            bench_indexer_memory(&mut bn, &mut rng)?;
        }
    }
    if all || what == "sinkhorn" {
        for &m in &m_sizes {
            bench_sinkhorn(&mut bn, &mut rng, m)?;
        }
    }
    if all || what == "qnorm-rope" {
        bench_qnorm_rope(&mut bn, &mut rng)?;
    }
    print(&bn.entries, json);
    Ok(true)
}
