//! Every case of every golden file (shared/golden/ and $DSV4_GOLDEN_DIR) through the
//! `cuda` backend with bf16 kernel inputs, judged by SPEC.md section 8. A case whose op
//! the CUDA backend reports unavailable FAILS: nothing passes by falling back.
//!
//! Run with `scripts/gpu-test.sh` (ignored without a GPU).

use dsv4_core::golden::{default_files, load, run_case, Target};
use dsv4_core::{BackendName, DType, Device};

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-test.sh"]
fn small_golden_cases_through_cuda() {
    dsv4_cuda::register();
    if let Err(e) = dsv4_core::backend::cuda_backend() {
        panic!("no CUDA backend: {e}");
    }
    let target = Target { backend: BackendName::Cuda, device: Device::Cuda(0), input_dtype: DType::BF16 };
    let files = default_files().expect("listing golden files");
    assert!(!files.is_empty(), "no golden files found: expected ../shared/golden/*.safetensors beside the repository, or DSV4_GOLDEN_DIR");
    let mut failures = Vec::new();
    for file in &files {
        let cases = load(file).unwrap_or_else(|e| panic!("{e}"));
        assert!(!cases.is_empty(), "{}: no cases", file.display());
        let mut passed = 0;
        for case in &cases {
            match run_case(case, &target) {
                Ok(js) => {
                    if std::env::var_os("DSV4_VERBOSE").is_some() {
                        js.iter().for_each(|j| println!("  {j}"));
                    }
                    let bad: Vec<_> = js.iter().filter(|j| !j.pass).collect();
                    if bad.is_empty() {
                        passed += 1;
                    }
                    failures.extend(bad.iter().map(|j| format!("{}: {j}", file.display())));
                }
                // Unavailable included: the cuda backend must run every case.
                Err(e) => failures.push(format!("{}: {}.{}: {e}", file.display(), case.op, case.id)),
            }
        }
        println!("golden: {}: {passed} cases passed", file.file_name().unwrap().to_string_lossy());
    }
    assert!(failures.is_empty(), "golden failures ({}):\n{}", failures.len(), failures.join("\n"));
}
