//! The deterministic backward (SPEC.md section 1's `backward_impl = deterministic`): in
//! waves of rows that fit `backward_workspace_bytes`, the main kernel stores each valid
//! slot's dkv contribution, an inverted index lists each key's (row, slot) entries in row
//! order, and the reduce (`bwd_reduce.cu`) adds them per key in that order, bitwise the
//! same whatever the workspace and its split into waves.

use super::backward::MainKernel;
use super::config::{reduce_defines, SaDetConfig};
use super::*;

/// What one deterministic backward call fixes before its waves.
pub(super) struct DetCall<'a> {
    pub gpu: &'a Gpu,
    pub dm: Dims,
    pub src: IndexSource,
    pub waves: DeterministicWaves,
    pub format: ContribFormat,
    pub n_hblk: usize,
    pub dp: usize,
    pub rows_desc: bool,
    /// The plan whose inverted index is kept with it (None: built here).
    pub plan: Option<&'a SparseIndexPlan>,
    /// [G, dp] f32 accumulator (zeroed) and dkv's bf16 destination.
    pub acc: u64,
    pub dkv_dst: u64,
    pub cfg: SaDetConfig,
}

impl DetCall<'_> {
    fn compact(&self) -> bool {
        self.format != ContribFormat::F32
    }
    fn keys(&self) -> usize {
        self.dm.b * self.dm.k
    }
    fn rows(&self) -> usize {
        self.dm.b * self.dm.s
    }
}

/// The index-building kernels of `bwd_reduce.cu`.
struct IndexKernels {
    count: Kernel,
    scan_rb: Kernel,
    scan_keys: Kernel,
    fill: Kernel,
}

impl IndexKernels {
    /// The index of rows [r0, r0 + n) in n_rb blocks of rows_per_rb rows, into the buffers
    /// ip points to (an `InvIndex` of at least n rows and n_rb blocks).
    fn build(&self, gpu: &Gpu, ip: &mut InvIndexParams, r0: usize, n: usize, rows_per_rb: usize, n_rb: usize) -> Result<()> {
        let g = ip.g as usize;
        (ip.row_base, ip.n_rows, ip.rows_per_rb, ip.n_rb) = (r0 as i32, n as i32, rows_per_rb as i32, n_rb as i32);
        gpu.zero(ip.counts, n_rb * g * 4)?;
        // SAFETY (these four): the index source as validated for the main kernel;
        // rows r0.. r0+n <= B*S; counts holds n_rb*G i32 (zeroed above), colptr G+1,
        // entries n*T (one per valid slot at most); count and fill take one CTA per
        // row block, scan_keys one CTA.
        unsafe { self.count.launch([n_rb as u32, 1, 1], [256, 1, 1], 0, &*ip)? };
        unsafe { self.scan_rb.launch([grid_for(gpu, g), 1, 1], [256, 1, 1], 0, &*ip)? };
        unsafe { self.scan_keys.launch([1, 1, 1], [1024, 1, 1], 0, &*ip)? };
        unsafe { self.fill.launch([n_rb as u32, 1, 1], [32, 1, 1], 0, &*ip) }
    }
}

/// The reduce of `bwd_reduce.cu` that matches the contributions' format, and its CTA size.
struct Reduce {
    kernel: Kernel,
    threads: usize,
    /// Entry groups a key (the 16-bit reduce's SA_REDUCE_GROUPS).
    groups: usize,
}

fn inv_params(c: &DetCall) -> InvIndexParams {
    let src = &c.src;
    InvIndexParams {
        idx: src.ptr,
        row_len: src.row_len,
        counts: 0,
        colptr: 0,
        entries: 0,
        contrib: 0,
        acc: c.acc,
        idx_sb: src.sb,
        idx_ss: src.ss,
        idx_st: src.st,
        idx_bias: src.bias,
        g: c.keys() as i64,
        row_base: 0,
        n_rows: 0,
        rows_per_rb: 0,
        n_rb: 0,
        s: c.dm.s as i32,
        k: c.dm.k as i32,
        t: src.t as i32,
        d: c.dp as i32,
        n_hblk: c.n_hblk as i32,
        idx_is_i64: src.is_i64,
        entry_base: 0,
        rb_lo: 0,
        rb_hi: 0,
        rows_desc: c.rows_desc as i32,
        rows_total: c.rows() as i32,
        dkv_out: 0,
        partials: 0,
        carried: 0,
        last_wave: 0,
        pad_: 0,
    }
}

/// Runs the waves; returns whether the last wave's reduce wrote dkv (16-bit rows, fused
/// conversion), so that no conversion launch is needed.
pub(super) fn run(c: &DetCall, main: &mut MainKernel) -> Result<bool> {
    let (gpu, w, src, dp) = (c.gpu, c.waves, c.src, c.dp);
    let (g, rows) = (c.keys(), c.rows());
    let index = g > 0 && src.t > 0;
    let contrib = gpu.scratch(w.wave_rows * src.t * c.n_hblk * c.format.bytes(dp))?;
    let defines = reduce_defines(&c.cfg);
    let kern = |name| gpu.kernel("sparse_attention/bwd_reduce.cu", name, &defines);
    let ik = IndexKernels { count: kern("sparse_attn_inv_count")?, scan_rb: kern("sparse_attn_inv_scan_rb")?, scan_keys: kern("sparse_attn_inv_scan_keys")?, fill: kern("sparse_attn_inv_fill")? };
    // (sparse_attn_inv_reduce_f16: SA_REDUCE_GROUPS groups of dp/8 = 64 threads a key)
    let groups = c.cfg.reduce_groups as usize;
    let reduce = if c.compact() { Reduce { kernel: kern("sparse_attn_inv_reduce_f16")?, threads: groups * (dp / 8), groups } } else { Reduce { kernel: kern("sparse_attn_inv_reduce")?, threads: dp / 4, groups } };
    let mut ip = inv_params(c);
    // Several waves: the 16-bit reduce keeps each entry group's running sum between
    // them (and, with an index per wave, each key's entries so far), so the result
    // is bitwise that of one wave whatever the workspace (bwd_reduce.cu).
    let multi = c.compact() && w.wave_rows < rows;
    let partials = if multi && index { Some(gpu.scratch(g * reduce.groups * dp * 4)?) } else { None };
    let carried = if multi && index && !w.global { Some(gpu.scratch(g * 4)?) } else { None };
    if let Some(b) = &partials {
        gpu.zero(b.ptr(), g * reduce.groups * dp * 4)?;
        ip.partials = b.ptr();
    }
    if let Some(b) = &carried {
        gpu.zero(b.ptr(), g * 4)?;
        ip.carried = b.ptr();
    }
    // The global index is kept with a plan (it depends on the selection alone; the
    // plan's first deterministic backward builds it), else built here once.
    let shape = InvIndexShape { idx: src.ptr, row_len: src.row_len, t: src.t, g, rows, n_rb: w.n_rb, rows_per_rb: w.rows_per_rb, rows_desc: c.rows_desc };
    let kept = match c.plan {
        Some(pl) if index && w.global => pl
            .derived
            .get_or_try_init(|| -> Result<InvIndex> {
                let d = InvIndex::alloc(gpu, shape)?;
                d.point(&mut ip);
                ik.build(gpu, &mut ip, 0, rows, w.rows_per_rb, w.n_rb)?;
                Ok(d)
            })?
            .filter(|d| d.shape == shape),
        _ => None,
    };
    let own;
    let bufs: &InvIndex = match &kept {
        Some(d) => d,
        None => {
            own = InvIndex::alloc(gpu, InvIndexShape { rows: if w.global { rows } else { w.wave_rows }, ..shape })?;
            &own
        }
    };
    bufs.point(&mut ip);
    if index && w.global && kept.is_none() {
        ik.build(gpu, &mut ip, 0, rows, w.rows_per_rb, w.n_rb)?;
    }
    waves(c, main, &ik, &reduce, &mut ip, contrib.ptr(), index)
}

/// The waves themselves: per wave, its index (when built per wave), the main kernel over its
/// rows and the reduce of its contributions.
fn waves(c: &DetCall, main: &mut MainKernel, ik: &IndexKernels, reduce: &Reduce, ip: &mut InvIndexParams, contrib: u64, index: bool) -> Result<bool> {
    let (gpu, w, src) = (c.gpu, c.waves, c.src);
    let (g, rows, n_hblk) = (c.keys(), c.rows(), c.n_hblk);
    let mut converted = false;
    let mut r0 = 0;
    while r0 < rows {
        let n = w.wave_rows.min(rows - r0);
        if index && !w.global {
            let rows_per_rb = n.div_ceil(w.n_rb);
            ik.build(gpu, ip, r0, n, rows_per_rb, n.div_ceil(rows_per_rb))?;
            (ip.entry_base, ip.rb_lo, ip.rb_hi) = (0, 0, ip.n_rb);
        } else if index {
            (ip.entry_base, ip.rb_lo, ip.rb_hi) = ((r0 * src.t) as i64, (r0 / w.rows_per_rb) as i32, (r0 + n).div_ceil(w.rows_per_rb) as i32);
        }
        main.p.chunk_base = r0 as i32;
        main.p.dkv = contrib;
        let grid = if main.hopper { [n as u32, n_hblk as u32, 1] } else { [(n * n_hblk) as u32, 1, 1] };
        // SAFETY: as the atomic launch, except that CTA i owns row r0 + i / n_hblk
        // (< B*S) and head block i % n_hblk, and stores its valid slots' dkv rows to
        // `contrib` ([wave_rows, T, n_hblk, dp] f32, local row < n <= wave_rows;
        // compact: [n, T, n_hblk, dp] fp16 then [n, T, n_hblk, dp/64] f32 scales, or
        // bf16 alone; within the wave_rows-sized buffer as n <= wave_rows).
        // Hopper: CTA (x, y) owns launch row r0 + x (row B*S - 1 - r0 - x with
        // rows_desc; the index counts the same launch rows) and head block y <
        // n_hblk.
        unsafe { main.launch(grid)? };
        if index {
            (ip.contrib, ip.n_rows) = (contrib, n as i32);
            // The last wave's reduce (16-bit rows) stores bf16(acc + its sum) into
            // dkv's destination for every key.
            let last = r0 + n == rows && c.compact() && c.cfg.fused_convert;
            ip.dkv_out = if last { c.dkv_dst } else { 0 };
            ip.last_wave = (r0 + n == rows) as i32;
            converted |= last;
            // SAFETY: colptr/counts/entries as built above index, for rows [r0, r0 +
            // n) (row blocks [rb_lo, rb_hi) of a global index: r0 and, but at the
            // end, r0 + n are multiples of rows_per_rb), entries r0*T - entry_base ..
            // of `contrib` written by the main kernel (every valid slot of the wave's
            // rows, every head block; compact: the layout of that kernel's n rows);
            // acc is [G, dp] f32; dp/4 <= 128 threads (compact: groups <= 8 of dp/8 =
            // 64, dp = 512); dkv_out, when set, is dkv's [G, dp] bf16 destination
            // (the output or dkv_pad) and every key g < G is visited (grid stride);
            // partials ([G, groups, dp] f32) and carried ([G] i32), when set, are zeroed
            // buffers that live until the end of the call.
            unsafe { reduce.kernel.launch([g.min(1 << 30) as u32, 1, 1], [reduce.threads as u32, 1, 1], 0, &*ip)? };
        }
        r0 += n;
    }
    Ok(converted)
}

/// The deterministic backward's inverted index (bwd_reduce.cu): per key, its (row, slot)
/// entries in row order, for `rows` rows in `n_rb` blocks of `rows_per_rb` (0: one wave's,
/// rebuilt per wave). Built for all rows of a plan, it is kept with the plan
/// (`SparseIndexPlan::derived`) and reused while its shape is the call's (the same index
/// source and sizes).
struct InvIndex {
    shape: InvIndexShape,
    counts: Tensor,  // i32 [n_rb, G]: block ends after fill
    colptr: Tensor,  // i32 [G + 1]
    entries: Tensor, // i32 [rows * T]
}

/// What an `InvIndex` was built for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct InvIndexShape {
    idx: u64,
    row_len: u64,
    t: usize,
    g: usize,
    rows: usize,
    n_rb: usize,
    rows_per_rb: usize,
    rows_desc: bool, // its rows numbered as the main kernel launches them (BwdParams::rows_desc)
}

impl InvIndex {
    fn alloc(gpu: &Gpu, shape: InvIndexShape) -> Result<Self> {
        let InvIndexShape { t, g, rows, n_rb, .. } = shape;
        Ok(InvIndex {
            shape,
            counts: gpu.alloc(DType::I32, &[(n_rb * g).max(1)])?,
            colptr: gpu.alloc(DType::I32, &[g + 1])?,
            entries: gpu.alloc(DType::I32, &[(rows * t).max(1)])?,
        })
    }

    fn point(&self, ip: &mut InvIndexParams) {
        (ip.counts, ip.colptr, ip.entries) = (self.counts.view().address(), self.colptr.view().address(), self.entries.view().address());
    }
}

/// How the deterministic backward splits its rows: waves of `wave_rows` consecutive launch
/// rows (B*S order, or its reverse: `BwdParams::rows_desc`), whose per-slot dkv
/// contributions (`T * n_hblk` contributions a row, [`ContribFormat::bytes`] each) fit
/// `backward_workspace_bytes` with the inverted index (`T` i32 entries a row and `[n_rb,
/// B*K]` i32 block counts), each wave a multiple of the rows that fill whole rounds of CTAs
/// where that keeps 3/4 of the rows that fit. `global`: one index for all rows in
/// `n_rb` blocks of `rows_per_rb` rows, built before the waves (each wave a run of whole
/// blocks), when it takes at most a quarter of the workspace and its entry ids fit in
/// int32; else an index per wave (`n_rb` blocks of that wave). `wave_rows == 0`: not even
/// one row fits (`row_bytes` a row is the least).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeterministicWaves {
    pub row_bytes: usize,
    pub wave_rows: usize,
    pub n_rb: usize,
    pub global: bool,
    pub rows_per_rb: usize,
}

/// How the deterministic backward stores each slot's dkv contribution (one head block):
/// f32 values (the portable kernel), or fp16 values and an f32 scale per 64 columns (the
/// Hopper kernel).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ContribFormat {
    F32,
    F16Scaled,
}

impl ContribFormat {
    /// The format of the backward that runs (`hopper`: bwd_sm90.cu).
    pub fn of_backward(hopper: bool) -> Self {
        if hopper {
            ContribFormat::F16Scaled
        } else {
            ContribFormat::F32
        }
    }

    /// Bytes of one contribution at kernel head dim `dp`.
    pub fn bytes(self, dp: usize) -> usize {
        match self {
            ContribFormat::F32 => 4 * dp,
            ContribFormat::F16Scaled => 2 * dp + 4 * (dp / 64),
        }
    }
}

impl DeterministicWaves {
    /// `format`: how a contribution is stored. `global`: the global index allowed (false:
    /// an index per wave; `SaDetConfig::global_index`).
    #[cfg(test)]
    pub(crate) fn for_sizes(sm_count: usize, dm: Dims, t: usize, n_hblk: usize, workspace: usize, format: ContribFormat, global: bool) -> Self {
        Self::with_rounds(sm_count, dm, t, n_hblk, workspace, format, global, true)
    }

    /// `for_sizes`, with waves of whole rounds of CTAs or not (`SaDetConfig::whole_rounds`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn with_rounds(sm_count: usize, dm: Dims, t: usize, n_hblk: usize, workspace: usize, format: ContribFormat, global: bool, rounds: bool) -> Self {
        let rows = dm.b * dm.s;
        let slot_bytes = n_hblk * format.bytes(kernel_d(dm.d));
        // a row: T slots of n_hblk contributions and one i32 index entry
        let row_bytes = t * (slot_bytes + 4);
        let g = (dm.b * dm.k).max(1);
        // Row blocks: enough warps to fill the device, and [n_rb, B*K] counters <= 256 MiB.
        let rb_cap = (4 * sm_count).min(((256usize << 20) / (4 * g)).max(1));
        // Rows whose CTAs (n_hblk a row, one an SM: bwd_sm90.cu's shared memory) fill whole
        // rounds of the device: a wave of a multiple of them has no last round of a few CTAs
        // beside idle SMs (H200 S=16384, 2 GiB: waves of 3,040 rows took 24 rounds of 132
        // CTAs each, of 3,036 rows 23). A multiple is taken when it holds at least 3/4 of
        // the rows that fit.
        let round_rows = (sm_count / gcd(sm_count.max(1), n_hblk.max(1))).max(1);
        let whole_rounds = |fit: usize, block: usize| -> usize {
            if !rounds {
                return 0;
            }
            let unit = block / gcd(block, round_rows) * round_rows;
            let w = fit / unit * unit;
            if 4 * w >= 3 * fit { w } else { 0 }
        };
        if global && t > 0 && rows > 0 && rows * t <= i32::MAX as usize {
            // Rows a wave holds beside the index of blocks of `rows_per_rb` rows (None: the
            // index takes more than a quarter of the workspace).
            let fit = |rows_per_rb: usize| -> Option<usize> {
                let n_rb = rows.div_ceil(rows_per_rb);
                let index_bytes = rows * t * 4 + n_rb * g * 4 + (g + 1) * 4;
                (index_bytes <= workspace / 4).then(|| (workspace - index_bytes) / (t * slot_bytes))
            };
            let least = rows.div_ceil(rb_cap.min(rows));
            if let Some(per) = fit(least) {
                let wave = |rows_per_rb: usize, wave_rows: usize| DeterministicWaves { row_bytes, wave_rows, n_rb: rows.div_ceil(rows_per_rb), global: true, rows_per_rb };
                if per >= rows {
                    return wave(least, rows);
                }
                // Block sizes least..=2 least (fewer blocks: still <= rb_cap): the one whose
                // waves of whole rounds and whole blocks hold the most rows, else waves of
                // whole blocks.
                let aligned = (least..=2 * least).filter_map(|d| Some((whole_rounds(fit(d)? / d * d, d), d))).filter(|&(w, _)| w > 0).max_by_key(|&(w, d)| (w, std::cmp::Reverse(d)));
                let (wave_rows, rows_per_rb) = aligned.unwrap_or((per / least * least, least));
                if wave_rows > 0 {
                    return wave(rows_per_rb, wave_rows);
                }
            }
        }
        // entry ids local * T + t stay below 2^31
        let id_cap = (i32::MAX as usize).checked_div(t).unwrap_or(rows);
        let fit = workspace.checked_div(row_bytes).map_or(rows, |w| w.min(rows).min(id_cap));
        let wave_rows = if fit < rows { Some(whole_rounds(fit, 1)).filter(|&w| w > 0).unwrap_or(fit) } else { fit };
        let n_rb = rb_cap.clamp(1, wave_rows.max(1));
        DeterministicWaves { row_bytes, wave_rows, n_rb, global: false, rows_per_rb: 0 }
    }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}
