//! `dsv4`: check, benchmark and describe the DeepSeek-V4 attention-layer kernels.

mod args;
mod bench;
mod check;
mod data;

use std::process::ExitCode;

use args::Args;
use dsv4_core::backend::{self, BackendName};
use dsv4_core::Device;

const USAGE: &str = "usage:
  dsv4 check [--backend auto|reference|cuda] [--preset tiny|small|medium] [--seed N]
      every operation forward and backward through the backend, judged against an f64
      evaluation of the reference (SPEC.md section 8); exits 1 on any failure
  dsv4 bench <sparse-attention|indexer|sinkhorn|qnorm-rope|all> [--json] [--iters N] [--fwd-only]
             [--bwd-only] [--atomic-only] [--workspace-mib N] [--topk-scores-only] [--s N] [--m N] [--no-sweep]
             [--plan-first] [--cooldown-ms N] [--config KEY=VALUE,...]
      GPU timings (CUDA events, medians) against the measured H200 ceilings; --fwd-only:
      attention forwards only; --bwd-only: attention backwards only; --atomic-only: of the
      attention backwards, the atomic one only (no fwd+bwd row); --workspace-mib N: the
      deterministic attention backward's workspace (default 2048); --topk-scores-only: the
      indexer's top-k scores rows only; --s N: only sequence length N (4096 or 16384) of the
      attention and indexer tables; --m N: only N matrices (65536 or 1048576) of the sinkhorn
      table; --no-sweep: the attention's two main shapes only (no other head counts or dims);
      --plan-first: the attention's plan forward timed before the plain one; --cooldown-ms N:
      idle time before each row (default 500: every row starts below the GPU's power cap);
      --config KEY=VALUE,...: kernel config overrides (e.g. sa_bwd.c0_chunks=3; a build with
      the `tuning` feature only, see docs/tuning.md)
  dsv4 info
      backends and devices this process sees";

fn main() -> ExitCode {
    dsv4_cuda::register();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let rest = args.get(1..).unwrap_or(&[]);
    let parsed = match args.first().map(String::as_str) {
        Some("check") => Args::parse("check", rest, &[], &["--backend", "--preset", "--seed"]),
        Some("bench") => Args::parse("bench", rest, bench::SWITCHES, bench::VALUED),
        Some("info") => Args::parse("info", rest, &[], &[]),
        _ => Ok(Args::default()),
    };
    let parsed = match parsed {
        Ok(p) if p.help => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Ok(p) => p,
        Err(e) => {
            eprintln!("{e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let result = match args.first().map(String::as_str) {
        Some("check") => cmd_check(&parsed),
        Some("bench") => bench::main(&parsed),
        Some("info") if parsed.positional().is_empty() => cmd_info(),
        Some("-h") | Some("--help") | Some("help") => {
            println!("{USAGE}");
            Ok(true)
        }
        _ => {
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("dsv4: {e}");
            ExitCode::from(2)
        }
    }
}

fn cmd_check(args: &Args) -> dsv4_core::Result<bool> {
    if let Some(w) = args.positional().first() {
        return Err(dsv4_core::Error::Data(format!("check: unexpected argument `{w}`")));
    }
    let name: BackendName = args.raw("--backend").unwrap_or("auto").parse()?;
    let preset_name = args.raw("--preset").unwrap_or("small");
    let preset = dsv4_core::cases::preset(preset_name).ok_or_else(|| dsv4_core::Error::Data(format!("unknown preset `{preset_name}` (tiny, small, medium)")))?;
    let seed = args.value("--seed", "an unsigned integer")?.unwrap_or(0x5eed);
    // `auto` and `cuda` run on the GPU when there is one; otherwise on the CPU.
    let device = match name {
        BackendName::Reference => Device::Cpu,
        BackendName::Cuda => Device::Cuda(0),
        BackendName::Auto => match backend::cuda_backend() {
            Ok(_) => Device::Cuda(0),
            Err(why) => {
                eprintln!("dsv4 check: no CUDA backend ({why}); auto runs the reference on the CPU");
                Device::Cpu
            }
        },
    };
    println!("dsv4 check: preset {preset_name}, backend {name}, device {device}");
    let t0 = std::time::Instant::now();
    let rows = check::run(name, device, preset, seed, &mut std::io::stderr())?;
    let ok = check::print_table(&rows, &mut std::io::stdout());
    let failed = rows.iter().filter(|r| !r.judgement.pass).count();
    println!("{} checks: {} passed, {} failed ({:.1} s)", rows.len(), rows.len() - failed, failed, t0.elapsed().as_secs_f64());
    Ok(ok)
}

fn cmd_info() -> dsv4_core::Result<bool> {
    println!("dsv4-kernels {}", env!("CARGO_PKG_VERSION"));
    for line in backend::reference_backend().describe() {
        println!("  {line}");
    }
    match backend::cuda_backend() {
        Ok(b) => b.describe().iter().for_each(|l| println!("  {l}")),
        Err(why) => println!("  cuda: not available: {why}"),
    }
    for fam in backend::KERNEL_FAMILIES {
        println!("  is_kernel_available({fam:?}) = {}", dsv4_core::is_kernel_available(fam));
    }
    Ok(true)
}
