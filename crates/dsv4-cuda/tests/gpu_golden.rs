//! Every case of every golden file (shared/golden/ and $DSV4_GOLDEN_DIR) through the
//! `cuda` backend with bf16 kernel inputs, judged by SPEC.md section 8. A case whose op
//! the CUDA backend reports unavailable FAILS: nothing passes by falling back.
//!
//! Run with `scripts/gpu-test.sh` (ignored without a GPU).

use dsv4_core::golden::{default_files, run_files, Target};
use dsv4_core::{BackendName, DType, Device};

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-test.sh"]
fn small_golden_cases_through_cuda() {
    dsv4_cuda::register();
    if let Err(e) = dsv4_core::backend::cuda_backend() {
        panic!("no CUDA backend: {e}");
    }
    let target = Target { backend: BackendName::Cuda, device: Device::Cuda(0), input_dtype: DType::BF16 };
    let failures = run_files(&default_files().expect("listing golden files"), &target, "").unwrap_or_else(|e| panic!("{e}"));
    assert!(failures.is_empty(), "golden failures ({}):\n{}", failures.len(), failures.join("\n"));
}
