//! Every kernel file under `kernels/` (`*.cu`) compiles with NVRTC for `sm_90a` and
//! `sm_80` (or the architectures its `// dsv4-archs:` line names), with its default
//! defines and each `// dsv4-test-defines:` variant, without errors or warnings; a file
//! that `tuning::compile_variants` lists (its launcher's configs) with those variants only.
//! Prints ptxas's registers / stack / spills per entry point and its wgmma advisories;
//! fails when ptxas serialized a kernel's wgmma products.
//!
//! Needs libnvrtc (pip: `nvidia-cuda-nvrtc nvidia-cuda-runtime`, or a CUDA toolkit), not a
//! GPU. Without it this test fails and says where it looked, unless DSV4_SKIP_NVRTC=1.
//!
//! One file: `DSV4_KERNEL=sinkhorn/fwd.cu cargo test -p dsv4-cuda --test nvrtc_compile`.
//! `DSV4_FAIL_ON_SPILLS=1` also fails on register spills.

use dsv4_cuda::nvrtc::{declared_archs, kernel_files, nvrtc, test_variants};

const ARCHS: [&str; 2] = ["sm_90a", "sm_80"];

struct Job {
    path: &'static str,
    arch: String,
    defines: Vec<(String, String)>,
}

#[test]
fn every_kernel_compiles_without_warnings() {
    if std::env::var("DSV4_SKIP_NVRTC").as_deref() == Ok("1") {
        eprintln!("nvrtc_compile: skipped (DSV4_SKIP_NVRTC=1)");
        return;
    }
    let nv = nvrtc().unwrap_or_else(|e| panic!("{e}\n(set DSV4_SKIP_NVRTC=1 to skip this test on a machine without NVRTC)"));
    println!("nvrtc {}.{} from {}; CUDA headers: {}", nv.version.0, nv.version.1, nv.library, nv.include_dir.as_ref().map(|d| d.display().to_string()).unwrap_or_else(|| "none found (NVRTC built-ins only)".into()));
    let only = std::env::var("DSV4_KERNEL").ok();
    let mut jobs = Vec::new();
    // Files whose variants the launchers' configs list: those define sets only.
    let registered = dsv4_cuda::tuning::compile_variants();
    for v in &registered {
        if only.as_deref().is_some_and(|o| o != v.path) {
            continue;
        }
        for arch in v.archs {
            jobs.push(Job { path: v.path, arch: arch.to_string(), defines: v.defines.iter().map(|(k, d)| (k.to_string(), d.clone())).collect() });
        }
    }
    for (path, src) in kernel_files() {
        if only.as_deref().is_some_and(|o| o != path) || registered.iter().any(|v| v.path == path) {
            continue;
        }
        let archs = declared_archs(src).unwrap_or_else(|| ARCHS.iter().map(|s| s.to_string()).collect());
        let mut variants = vec![Vec::new()];
        variants.extend(test_variants(src));
        for arch in &archs {
            for v in &variants {
                jobs.push(Job { path, arch: arch.clone(), defines: v.clone() });
            }
        }
    }
    assert!(!jobs.is_empty(), "no kernel files matched (DSV4_KERNEL={only:?})");
    // Compile in parallel; report in a stable order.
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2).min(jobs.len());
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results: Vec<std::sync::Mutex<Option<(bool, String)>>> = jobs.iter().map(|_| std::sync::Mutex::new(None)).collect();
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(job) = jobs.get(i) else { break };
                let defines: Vec<(&str, String)> = job.defines.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
                let label = format!("{} [{}]{}", job.path, job.arch, if defines.is_empty() { String::new() } else { format!(" {}", job.defines.iter().map(|(k, v)| format!("-D{k}={v}")).collect::<Vec<_>>().join(" ")) });
                let t0 = std::time::Instant::now();
                let report = match nv.compile(job.path, &defines, &job.arch) {
                    Ok(c) => {
                        let warnings = c.warnings();
                        let mut r = format!("{label}: ok in {:.2}s\n", t0.elapsed().as_secs_f64());
                        for e in &c.entries {
                            r.push_str(&format!("    {e}{}\n", if e.spill_stores + e.spill_loads > 0 { "  <-- SPILLS" } else { "" }));
                        }
                        // ptxas advisories are info lines, not warnings. "wgmma.mma_async
                        // instructions are serialized" (C7510..C7520: every product waits
                        // for the previous one) is a performance bug and fails; injected
                        // waits / fences (C7517, C7519) are shown.
                        let serialized = c.log.lines().any(|l| l.contains("serialized"));
                        for l in c.log.lines().filter(|l| l.contains("Performance") || l.contains("serialized") || l.contains("injected")) {
                            r.push_str(&format!("    ADVISORY: {}\n", l.trim()));
                        }
                        let spills = c.entries.iter().any(|e| e.spill_stores + e.spill_loads > 0);
                        if serialized {
                            (false, format!("{r}    (ptxas serialized the wgmma products: see the advisory)\n"))
                        } else if spills && std::env::var("DSV4_FAIL_ON_SPILLS").as_deref() == Ok("1") {
                            (false, format!("{r}    (DSV4_FAIL_ON_SPILLS=1: register spills fail)\n"))
                        } else if warnings.is_empty() {
                            (true, r)
                        } else {
                            r = format!("{label}: WARNINGS (options: {})\n", c.options.join(" "));
                            for l in c.log.lines() {
                                r.push_str(&format!("    | {l}\n"));
                            }
                            (false, r)
                        }
                    }
                    Err(dsv4_core::Error::Compile { options, log, .. }) => {
                        let mut r = format!("{label}: FAILED\n    options: {options}\n");
                        for l in log.lines() {
                            r.push_str(&format!("    | {l}\n"));
                        }
                        (false, r)
                    }
                    Err(e) => (false, format!("{label}: FAILED: {e}\n")),
                };
                *results[i].lock().unwrap() = Some(report);
            });
        }
    });
    let mut failed = Vec::new();
    for r in results {
        let (ok, text) = r.into_inner().unwrap().expect("every job ran");
        print!("{text}");
        if !ok {
            failed.push(text);
        }
    }
    assert!(failed.is_empty(), "{} kernel compile(s) failed or warned:\n{}", failed.len(), failed.join(""));
}

/// A compile error comes back as `Error::Compile` with the kernel, arch, options and the
/// whole log; a warning is visible in `Compiled::warnings`.
#[test]
fn errors_and_warnings_are_reported() {
    if std::env::var("DSV4_SKIP_NVRTC").as_deref() == Ok("1") {
        return;
    }
    let nv = nvrtc().unwrap_or_else(|e| panic!("{e}"));
    let bad = "#include \"common.cuh\"\nextern \"C\" __global__ void k(float* p) { p[0] = undefined_name; }\n";
    match nv.compile_rendered("probe/bad.cu", bad, "sm_90a") {
        Err(dsv4_core::Error::Compile { kernel, arch, options, log }) => {
            assert_eq!((kernel.as_str(), arch.as_str()), ("probe/bad.cu", "sm_90a"));
            assert!(options.contains("--gpu-architecture=sm_90a"), "{options}");
            assert!(log.contains("undefined_name") && log.contains("probe/bad.cu"), "{log}");
        }
        other => panic!("expected a compile error, got {other:?}"),
    }
    let warn = "#include \"common.cuh\"\nextern \"C\" __global__ void k(float* p) { int unused = 3; p[0] = 1.f; }\n";
    let c = nv.compile_rendered("probe/warn.cu", warn, "sm_90a").expect("compiles");
    assert!(!c.warnings().is_empty(), "expected a warning in:\n{}", c.log);
}

/// The disk cache: a compile writes an entry, the next call reads it, a corrupt entry is
/// recompiled and rewritten.
#[test]
fn disk_cache_round_trip() {
    if std::env::var("DSV4_SKIP_NVRTC").as_deref() == Ok("1") {
        return;
    }
    use dsv4_cuda::runtime::compile_cached;
    let dir = std::env::temp_dir().join(format!("dsv4-cache-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::env::set_var("DSV4_CACHE_DIR", &dir);
    let defines = [("SINKHORN_N", "4".to_string()), ("SINKHORN_VEC", "0".to_string()), ("SINKHORN_FWD_NEWTON", "4".to_string())];
    let first = compile_cached("sinkhorn/fwd.cu", &defines, "sm_90a", false).unwrap_or_else(|e| panic!("{e}"));
    assert!(!first.from_cache);
    let path = first.path.clone().expect("a cache path");
    assert!(path.starts_with(&dir) && path.is_file(), "{path:?}");
    let second = compile_cached("sinkhorn/fwd.cu", &defines, "sm_90a", false).unwrap();
    assert!(second.from_cache);
    assert_eq!(second.cubin, first.cubin);
    assert_eq!(second.entries, first.entries);
    // Another define set is another entry.
    let other = compile_cached("sinkhorn/fwd.cu", &[("SINKHORN_N", "8".to_string()), ("SINKHORN_VEC", "0".to_string()), ("SINKHORN_FWD_NEWTON", "4".to_string())], "sm_90a", false).unwrap();
    assert_ne!(other.path, first.path);
    // Corrupt the entry: it is recompiled and rewritten.
    let mut bytes = std::fs::read(&path).unwrap();
    let n = bytes.len();
    bytes[n - 10] ^= 0xff;
    std::fs::write(&path, &bytes).unwrap();
    let third = compile_cached("sinkhorn/fwd.cu", &defines, "sm_90a", false).unwrap();
    assert!(!third.from_cache);
    assert_eq!(third.cubin, first.cubin);
    assert!(compile_cached("sinkhorn/fwd.cu", &defines, "sm_90a", false).unwrap().from_cache);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Every kernel file a launcher requests with no defines (`gpu.kernel("f.cu", "entry", &[])`
/// in `src/`) compiles with none: a file whose module needs its config's defines must get
/// them at every launch site, not only at the one `compile_variants` lists.
#[test]
fn kernels_launched_without_defines_compile_without_them() {
    if std::env::var("DSV4_SKIP_NVRTC").as_deref() == Ok("1") {
        return;
    }
    let nv = nvrtc().unwrap_or_else(|e| panic!("{e}"));
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = std::collections::BTreeSet::new();
    let mut stack = vec![src];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()) {
            if entry.is_dir() {
                stack.push(entry);
            } else if entry.extension().is_some_and(|x| x == "rs") {
                let text = std::fs::read_to_string(&entry).unwrap();
                for call in text.split(".kernel(\"").skip(1) {
                    let Some((file, rest)) = call.split_once('"') else { continue };
                    let Some((_, after_entry)) = rest.trim_start_matches([',', ' ']).trim_start_matches('"').split_once('"') else { continue };
                    if after_entry.trim_start_matches([',', ' ']).starts_with("&[])") {
                        files.insert(file.to_string());
                    }
                }
            }
        }
    }
    assert!(files.contains("sparse_attention/plan.cu"), "the scan found the plan launcher's call: {files:?}");
    for file in &files {
        let path = kernel_files().map(|(p, _)| p).find(|p| p == file).unwrap_or_else(|| panic!("no kernel file {file}"));
        let archs = declared_archs(kernel_files().into_iter().find(|(p, _)| *p == path).unwrap().1).unwrap_or_else(|| ARCHS.iter().map(|s| s.to_string()).collect());
        for arch in &archs {
            if let Err(e) = nv.compile(path, &[], arch) {
                panic!("{file} is launched with no defines but does not compile without them ({arch}): {e}");
            }
        }
    }
}
