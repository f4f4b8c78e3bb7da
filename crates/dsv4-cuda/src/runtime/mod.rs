//! The CUDA runtime of this crate: one [`Gpu`] per device ordinal (primary context, own
//! stream, device properties, compiled-kernel caches), device memory, and kernel launches
//! with one by-value params struct (and, `launch2`, a second by-value argument: a TMA
//! tensor map, [`TmaDesc`]).
//!
//! Built on cudarc's driver API with dynamic loading: libcuda is opened at run time, so a
//! machine without CUDA builds and tests everything but the GPU runs. Kernels are compiled
//! by NVRTC (`nvrtc/`) for the device's exact architecture and cached in memory and on
//! disk.
//!
//! Files: `device.rs` (libcuda, the per-device [`Gpu`]: context, properties, streams),
//! `memory.rs` (device memory: the stream-ordered and caller's allocators, [`GpuBuffer`],
//! [`Scratch`]), `kernel.rs` (kernel lookup, modules and launches), `cache.rs` (the
//! compiled-CUBIN disk cache), `tma.rs` (TMA tensor maps).

use cudarc::driver::DriverError;
use dsv4_core::Error;

mod cache;
mod device;
mod kernel;
mod memory;
mod tma;

pub use cache::{cache_dir, compile_cached, CachedCubin};
pub use device::{arch_for, device_count, driver_library, gpu, set_current_stream, DeviceProps, Gpu};
pub use kernel::Kernel;
pub use memory::{ordinal_of, with_workspace_allocator, ForeignMemory, GpuBuffer, Scratch, WorkspaceAllocator};
pub use tma::{tma_bf16_problem, TmaDesc, PARAMS_SIZES};

fn drv(what: &str) -> impl Fn(DriverError) -> Error + '_ {
    move |e| Error::Cuda(format!("{what}: {e:?}"))
}
