//! dsv4-core: the training kernels of a DeepSeek-V4 attention layer — tensors, errors,
//! backend dispatch, and the CPU reference of every operation of SPEC.md.
//!
//! ```
//! use dsv4_core::{ops::sinkhorn::{sinkhorn_normalize, SinkhornArgs}, BackendName, Tensor};
//! let x = Tensor::from_f32(&[2, 4, 4], (0..32).map(|i| (i as f32 * 0.37).sin()).collect())?;
//! let y = sinkhorn_normalize(BackendName::Auto, &SinkhornArgs { x: x.view(), repeat: 20, eps: 1e-6 })?;
//! assert_eq!(y.shape(), &[2, 4, 4]);
//! # Ok::<(), dsv4_core::Error>(())
//! ```

pub mod backend;
pub mod cases;
pub mod check;
pub mod compare;
pub mod error;
pub mod golden;
pub mod ops;
pub mod real;
pub mod reference;
pub mod rng;
pub mod tensor;

pub use backend::{is_kernel_available, BackendName, KernelBackend};
pub use error::{Error, Result};
pub use tensor::{DType, Device, Tensor, TensorView, TensorViewMut};

/// The README's Rust example, compiled and run as a doctest.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
pub struct ReadmeDoctests;
