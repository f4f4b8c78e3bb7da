//! GPU sweeps of the small ops beyond the shared case set (`gpu_cases.rs` runs the small
//! shapes): Sinkhorn over a million matrices, qnorm_rope at the model's shapes, long
//! random builder arguments, bitwise reruns. Each case is a `dsv4_core` case (the bodies
//! the reference backend runs), through the `cuda` backend.
//!
//! Run with `scripts/gpu-test.sh` (they are ignored without a GPU).

mod common;

use dsv4_core::cases::Target;
use dsv4_core::compare::Judgement;
use dsv4_core::ops::qnorm_rope::cases::{Case as QNormCase, Layout};
use dsv4_core::ops::sinkhorn::cases::{Case as SinkhornCase, Stored};
use dsv4_core::ops::sinkhorn::{sinkhorn_normalize, SinkhornArgs};
use dsv4_core::ops::sparse_indices::cases::Case as BuildCase;
use dsv4_core::{BackendName, Tensor};
use common::*;

fn target() -> Target {
    cuda();
    Target::cuda()
}

fn run(case_name: String, js: dsv4_core::Result<Vec<Judgement>>) -> Vec<Judgement> {
    let mut js = js.unwrap_or_else(|e| panic!("{case_name}: {e}"));
    js.iter_mut().for_each(|j| j.name = format!("{case_name}: {}", j.name));
    js
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-test.sh"]
fn sinkhorn_many_matrices() {
    let t = target();
    let dout_t = Stored::Perm(vec![0, 2, 1]);
    let mut js = Vec::new();
    for c in [
        SinkhornCase::new(&[65_536, 4, 4], 20, 1),
        SinkhornCase { dout: dout_t.clone(), ..SinkhornCase::new(&[1_048_576, 4, 4], 20, 2) },
        SinkhornCase::new(&[16, 4096, 4, 4], 20, 3),
        SinkhornCase { dout: dout_t, ..SinkhornCase::new(&[100_003, 8, 8], 20, 4) },
        SinkhornCase::new(&[100_003, 7, 7], 20, 5),
    ] {
        js.extend(run(c.name(), c.run(&t)));
    }
    check(js);
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-test.sh"]
fn qnorm_rope_model_shape() {
    let t = target();
    let mut js = Vec::new();
    // C - R not a multiple of 8 (scalar cos/sin reads) with more rows than one wave of the
    // persistent fast kernels: every lane group runs several row blocks.
    for c in [
        QNormCase::new([1, 64, 1024, 512], 64, 1),
        QNormCase { x_layout: Layout::Plain, grad_layout: Layout::Plain, ..QNormCase::new([2, 64, 333, 512], 64, 2) },
        QNormCase::new([1, 16, 700, 128], 60, 3),
    ] {
        js.extend(run(c.name(), c.run(&t)));
    }
    check(js);
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-test.sh"]
fn build_indices_random_long() {
    let t = target();
    let js = (0..40).flat_map(|i| {
        let c = BuildCase::Random { seed: 6000 + i, long: true };
        run(c.name(), c.run(&t))
    });
    check(js.collect());
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-test.sh"]
fn small_rerun_is_bitwise_equal() {
    // The kernels have no reductions across threads whose order could vary: a rerun must be
    // bitwise equal.
    let mut rng = Rng(7);
    let xh = Tensor::from_f32(&[1000, 4, 4], rng.normals(16_000, 2.0)).unwrap();
    let xd = up(&xh);
    let a = SinkhornArgs { x: xd.view(), repeat: 20, eps: 1e-6 };
    let y1 = sinkhorn_normalize(BackendName::Cuda, &a).unwrap().to_f32_vec().unwrap();
    let y2 = sinkhorn_normalize(BackendName::Cuda, &a).unwrap().to_f32_vec().unwrap();
    assert!(y1.iter().zip(&y2).all(|(a, b)| a.to_bits() == b.to_bits()));
}
