//! The shared case set of every op (`dsv4_core::cases`) through the reference backend,
//! with f32 inputs and with the bf16 inputs the kernels take; the CUDA crate runs the same
//! case bodies through its backend (`dsv4-cuda/tests/gpu_cases.rs`).

mod f32_inputs {
    dsv4_core::case_tests!(dsv4_core::cases::Target::reference());
}

mod bf16_inputs {
    dsv4_core::case_tests!(dsv4_core::cases::Target::reference_bf16());
}
