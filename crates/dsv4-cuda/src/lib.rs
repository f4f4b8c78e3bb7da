//! dsv4-cuda: the CUDA backend of dsv4-kernels.
//!
//! - [`nvrtc`]: finds libnvrtc and the CUDA headers, compiles `kernels/**.cu` to CUBINs.
//! - [`runtime`]: one [`Gpu`] per device (context, stream, kernel caches, allocation), on
//!   cudarc's driver API loaded at run time — building needs no CUDA.
//! - [`backend`]: [`CudaBackend`], dsv4-core's `KernelBackend` on these kernels, and
//!   [`register`], which makes it the `cuda` backend of dispatch.
//! - one launcher module per operation family, its kernels in `kernels/<family>/`.
//! - [`tuning`]: the typed kernel configs' trait, and (the `tuning` feature) overrides.
//! - [`params`]: the `#[repr(C)]` params structs and their header mirrors, in one table.

pub mod backend;
pub mod indexer;
pub mod nvrtc;
pub mod params;
pub mod qnorm_rope;
pub mod runtime;
pub mod sinkhorn;
pub mod sparse_attention;
pub mod sparse_indices;
pub mod tuning;

pub use backend::{register, CudaBackend};
pub use runtime::{gpu, set_current_stream, DeviceProps, Gpu, Kernel, Scratch};
