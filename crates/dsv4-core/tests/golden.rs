//! Every case of every golden file (shared/golden/ and $DSV4_GOLDEN_DIR) through the
//! reference backend, judged by SPEC.md section 8.

use dsv4_core::golden::{default_files, run_files, Target};
use dsv4_core::{BackendName, DType, Device};

fn run(target: &Target, tag: &str) {
    let failures = run_files(&default_files().expect("listing golden files"), target, tag).unwrap_or_else(|e| panic!("{e}"));
    assert!(failures.is_empty(), "golden failures ({}):\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn golden_reference() {
    run(&Target::reference(), "");
}

/// The reference fed bf16 inputs, as the CUDA kernels are: the same judging path the
/// GPU golden test takes (bf16 outputs, gradients against the same rounded inputs).
#[test]
fn golden_reference_bf16_inputs() {
    run(&Target { backend: BackendName::Reference, device: Device::Cpu, input_dtype: DType::BF16 }, " (bf16 inputs)");
}
