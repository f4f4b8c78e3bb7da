//! The shared case set of every op (`dsv4_core::cases`) through the reference backend,
//! with f32 inputs and with the bf16 inputs the kernels take; the CUDA crate runs the same
//! case bodies through its backend (`dsv4-cuda/tests/gpu_cases.rs`).

mod f32_inputs {
    dsv4_core::case_tests!(dsv4_core::cases::Target::reference());
}

mod bf16_inputs {
    dsv4_core::case_tests!(dsv4_core::cases::Target::reference_bf16());
}

/// `dsv4 check`'s problems (`cases::preset_set`) at the tiny preset and its default seed,
/// through the reference fed bf16 inputs, as `dsv4 check --backend reference --preset tiny`
/// runs them.
#[test]
fn check_preset_tiny() {
    use dsv4_core::cases::{assert_cases_pass, preset, preset_set, Target};
    let cases = preset_set(&preset("tiny").expect("the tiny preset"), 0x5eed);
    for op in ["indexer", "build_sparse_topk_indices", "sparse_attention", "sinkhorn_normalize", "qnorm_rope"] {
        assert_cases_pass(&cases, op, &Target::reference_bf16());
    }
}
