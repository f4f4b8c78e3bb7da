//! Every case of every golden file (shared/golden/ and $DSV4_GOLDEN_DIR) through the
//! reference backend, judged by SPEC.md section 8.

use dsv4_core::golden::{default_files, load, run_case, Target};
use dsv4_core::{BackendName, DType, Device};

#[test]
fn golden_reference() {
    run_all(&Target::reference());
}

/// The reference fed bf16 inputs, as the CUDA kernels are: the same judging path the
/// GPU golden test takes (bf16 outputs, gradients against the same rounded inputs).
#[test]
fn golden_reference_bf16_inputs() {
    run_all(&Target { backend: BackendName::Reference, device: Device::Cpu, input_dtype: DType::BF16 });
}

fn run_all(target: &Target) {
    let files = default_files().expect("listing golden files");
    assert!(!files.is_empty(), "no golden files found: expected ../shared/golden/*.safetensors beside the repository, or DSV4_GOLDEN_DIR");
    let mut failures = Vec::new();
    for file in &files {
        let cases = load(file).unwrap_or_else(|e| panic!("{e}"));
        assert!(!cases.is_empty(), "{}: no cases", file.display());
        let mut passed = 0;
        for case in &cases {
            match run_case(case, target) {
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
                Err(e) => failures.push(format!("{}: {}.{}: {e}", file.display(), case.op, case.id)),
            }
        }
        let tag = if target.input_dtype == DType::F32 { String::new() } else { format!(" ({} inputs)", target.input_dtype) };
        println!("golden{tag}: {}: {passed} cases passed", file.file_name().unwrap().to_string_lossy());
    }
    assert!(failures.is_empty(), "golden failures:\n{}", failures.join("\n"));
}
