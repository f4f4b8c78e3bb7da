//! `dsv4 check`: every operation, forward and backward, through a backend at a
//! DeepSeek-V4-like preset, judged (SPEC.md section 8) against an f64 evaluation of the
//! reference math on the same bf16-representable inputs. The problems are the shared case
//! sets' preset cases (`dsv4_core::cases::preset_set`): the case bodies the tests run on
//! every backend.

use std::io::Write;
use std::time::Instant;

use dsv4_core::backend::{self, BackendName};
use dsv4_core::cases::{preset_set, Preset, Target};
use dsv4_core::compare::Judgement;
use dsv4_core::{DType, Device, Result};

/// One judged output of a case.
pub struct Row {
    pub op: &'static str,
    /// The case: its shape and input pattern.
    pub case: String,
    pub backend: String,
    /// Named by the output alone (the case is `case`).
    pub judgement: Judgement,
    /// Wall time of the whole case: its inputs, every call of the op, the f64 reference.
    pub ms: f64,
}

/// Run the preset's cases through the backend on `device`, bf16 inputs as the kernels take
/// them; returns the table rows. A case that cannot run is one failed row with the error.
pub fn run(name: BackendName, device: Device, p: Preset, seed: u64, progress: &mut dyn Write) -> Result<Vec<Row>> {
    let backend_name = backend::select(name, "check", device)?.name().to_string();
    let target = Target { backend: name, device, input_dtype: DType::BF16 };
    let cases = preset_set(&p, seed);
    let mut rows = Vec::new();
    for (i, case) in cases.iter().enumerate() {
        let _ = write!(progress, "\r[{}/{}] {:<60}", i + 1, cases.len(), truncate(&format!("{}: {}", case.op(), case.name()), 60));
        let _ = progress.flush();
        let t0 = Instant::now();
        let result = case.run(&target).and_then(|js| target.synchronize().map(|()| js));
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        let case_name = case.name();
        let judgements = match result {
            // `Case::run` names each output `<case>: <output>`; the case has its own line.
            Ok(js) => js.into_iter().map(|j| Judgement { name: j.name.strip_prefix(&format!("{case_name}: ")).unwrap_or(&j.name).to_string(), ..j }).collect(),
            Err(e) => vec![Judgement { name: "(could not run)".into(), error: f64::NAN, max_abs: f64::NAN, bound: f64::NAN, pass: false, note: e.to_string() }],
        };
        rows.extend(judgements.into_iter().map(|judgement| Row { op: case.op(), case: case_name.clone(), backend: backend_name.clone(), judgement, ms }));
    }
    let _ = writeln!(progress, "\r{:<70}", "");
    Ok(rows)
}

/// Print the table: a line per case (its time), then a line per judged output; returns
/// whether every row passed.
pub fn print_table(rows: &[Row], out: &mut dyn Write) -> bool {
    let _ = writeln!(out, "  {:<26} {:<44} {:<10} {:>11} {:>10} {:>10}  status", "operation", "output", "backend", "max abs err", "rel err", "bound");
    let mut all = true;
    for (i, r) in rows.iter().enumerate() {
        if i == 0 || rows[i - 1].case != r.case || rows[i - 1].op != r.op {
            let _ = writeln!(out, "{}: {} ({:.1} ms)", r.op, r.case, r.ms);
        }
        let j = &r.judgement;
        all &= j.pass;
        let status = if j.pass { "ok".to_string() } else if j.note.is_empty() { "FAIL".to_string() } else { format!("FAIL: {}", j.note) };
        let _ = writeln!(out, "  {:<26} {:<44} {:<10} {:>11.3e} {:>10.3e} {:>10.1e}  {}", r.op, truncate(&j.name, 44), r.backend, j.max_abs, j.error, j.bound, status);
    }
    all
}

fn truncate(s: &str, n: usize) -> String {
    if s.len() <= n {
        s.to_string()
    } else {
        format!("{}…", &s[..n - 1])
    }
}
