//! The shared case set of every op (`dsv4_core::cases`: the same bodies the reference
//! backend runs in `dsv4-core/tests/cases.rs`) through the `cuda` backend with bf16
//! kernel inputs, outputs poisoned first, judged against the f64 reference maths. A case
//! the CUDA backend reports unavailable FAILS: nothing passes by falling back. Cheap
//! enough for compute-sanitizer.
//!
//! Run with `scripts/gpu-test.sh` (ignored without a GPU).

use dsv4_core::cases::Target;

fn cuda() -> Target {
    dsv4_cuda::register();
    if let Err(e) = dsv4_core::backend::cuda_backend() {
        panic!("no CUDA backend: {e}");
    }
    Target::cuda()
}

dsv4_core::case_tests!(cuda(), ignore = "needs a CUDA GPU: scripts/gpu-test.sh");
