//! Device memory: the workspace allocator a caller may install, stream-ordered allocation
//! on the current stream, [`GpuBuffer`] (the storage of device tensors) and [`Scratch`].

use std::cell::RefCell;
use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::sys;
use cudarc::driver::{result as cu, CudaContext, CudaStream};
use dsv4_core::tensor::DeviceBuffer;
use dsv4_core::{DType, Device, Error, Result, Tensor};

use super::device::{gpu, Gpu};
#[cfg(doc)]
use super::device::set_current_stream;
use super::drv;

/// Device memory from a caller's allocator (e.g. torch's caching allocator): the address
/// and an owner that keeps the memory alive until dropped (its release is the caller's
/// business, stream-ordered on the stream the memory was taken for).
pub type ForeignMemory = (u64, Box<dyn std::any::Any + Send + Sync>);

/// A caller's allocator for the memory the runtime needs during a call: workspaces, packed
/// copies, plan buffers. `allocate` returns at least `bytes` bytes on device `ordinal`,
/// usable in the order of the current stream (see [`set_current_stream`]).
pub trait WorkspaceAllocator: Send + Sync {
    fn allocate(&self, ordinal: usize, bytes: usize) -> std::result::Result<ForeignMemory, String>;
}

thread_local! {
    /// Per thread: the allocator installed by `with_workspace_allocator`, if any.
    static ALLOCATOR: RefCell<Option<Arc<dyn WorkspaceAllocator>>> = const { RefCell::new(None) };
}

/// Run `f` with `alloc` serving every device allocation the runtime makes on this thread
/// (the previous allocator, if any, comes back afterwards, also on a panic).
pub fn with_workspace_allocator<R>(alloc: Arc<dyn WorkspaceAllocator>, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<Arc<dyn WorkspaceAllocator>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let prev = self.0.take();
            ALLOCATOR.with(|a| *a.borrow_mut() = prev);
        }
    }
    let _restore = Restore(ALLOCATOR.with(|a| a.borrow_mut().replace(alloc)));
    f()
}

fn current_allocator() -> Option<Arc<dyn WorkspaceAllocator>> {
    ALLOCATOR.with(|a| a.borrow().clone())
}

impl Gpu {
    /// Contiguous device tensor (uninitialised) on the current stream.
    pub fn alloc(&self, dtype: DType, shape: &[usize]) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        let buf = self.buffer(n * dtype.size())?;
        Ok(Tensor::from_device(Arc::new(buf), dtype, shape, None))
    }

    /// Device memory of `bytes` (at least 1): from the thread's workspace allocator when one
    /// is installed ([`with_workspace_allocator`]), else stream-ordered on the current
    /// stream (the runtime's own or a caller's, see [`set_current_stream`]); plain
    /// `cuMemAlloc` only where the driver has no stream-ordered allocator.
    fn buffer(&self, bytes: usize) -> Result<GpuBuffer> {
        self.bind()?;
        let size = bytes.max(1);
        if let Some(a) = current_allocator() {
            let (ptr, owner) = a.allocate(self.ordinal, size).map_err(|e| Error::Cuda(format!("allocating {bytes} bytes on cuda:{} (caller's allocator): {e}", self.ordinal)))?;
            return Ok(GpuBuffer { ptr, bytes, ordinal: self.ordinal, ctx: self.ctx.clone(), release: Release::Foreign(owner) });
        }
        let stream = self.stream_raw();
        let stream_ordered = self.ctx.has_async_alloc();
        // SAFETY: the context is current; the stream is the runtime's own (live for the
        // process: the Gpu is never dropped) or the caller's current one, which the caller
        // keeps alive (set_current_stream's contract).
        let ptr = unsafe {
            if stream_ordered {
                cu::malloc_async(stream as sys::CUstream, size)
            } else {
                cu::malloc_sync(size)
            }
        }
        .map_err(|e| Error::Cuda(format!("allocating {bytes} bytes on cuda:{}: {e:?}", self.ordinal)))?;
        let release = if stream_ordered { Release::Async { stream, _own: self.own_stream().then(|| self.stream.clone()) } } else { Release::Sync };
        Ok(GpuBuffer { ptr, bytes, ordinal: self.ordinal, ctx: self.ctx.clone(), release })
    }

    /// Scratch workspace of `bytes`, freed on drop.
    pub fn scratch(&self, bytes: usize) -> Result<Scratch> {
        Ok(Scratch { buf: self.buffer(bytes)? })
    }

    /// Async memset 0 of `bytes` at `ptr` on the current stream.
    pub fn zero(&self, ptr: u64, bytes: usize) -> Result<()> {
        self.fill(ptr, 0, bytes)
    }

    /// Async byte fill on the current stream (tests poison outputs with 0xFF).
    pub fn fill(&self, ptr: u64, byte: u8, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: the caller passes device memory of at least `bytes`; the stream is live.
        unsafe { cu::memset_d8_async(ptr, byte, bytes, self.stream_raw() as sys::CUstream) }.map_err(drv("cuMemsetD8Async"))
    }

    /// Copy host bytes to device memory at `dst` (stream-ordered on the current stream,
    /// then synchronised, so `src` may be dropped on return).
    pub fn upload_bytes(&self, dst: u64, src: &[u8]) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        self.bind()?;
        let stream = self.stream_raw() as sys::CUstream;
        // SAFETY: `dst` holds at least `src.len()` bytes (allocated by the caller for
        // exactly this copy); the stream is synchronised before `src` can go away.
        unsafe {
            cu::memcpy_htod_async(dst, src, stream).map_err(drv("cuMemcpyHtoDAsync"))?;
            cu::stream::synchronize(stream).map_err(drv("cuStreamSynchronize"))
        }
    }

    /// `(free, total)` device memory in bytes.
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        self.bind()?;
        cu::mem_get_info().map_err(drv("cuMemGetInfo"))
    }

    fn pool_attribute(&self, attr: sys::CUmemPool_attribute, set: Option<u64>) -> Result<u64> {
        self.bind()?;
        // SAFETY: the device is valid and the context current; the used-memory attributes
        // read and write a u64 by pointer.
        unsafe {
            let pool = cu::device::get_default_mem_pool(self.ctx.cu_device()).map_err(drv("cuDeviceGetDefaultMemPool"))?;
            let mut v: u64 = set.unwrap_or(0);
            let p = &mut v as *mut u64 as *mut c_void;
            match set {
                Some(_) => cu::mem_pool::set_attribute(pool, attr, p).map_err(drv("cuMemPoolSetAttribute"))?,
                None => cu::mem_pool::get_attribute(pool, attr, p).map_err(drv("cuMemPoolGetAttribute"))?,
            }
            Ok(v)
        }
    }

    /// Bytes of the stream-ordered pool in use now (allocations of this runtime on its own
    /// stream).
    pub fn pool_used_bytes(&self) -> Result<u64> {
        self.pool_attribute(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT, None)
    }

    /// The pool's high-water mark of bytes in use since the last reset.
    pub fn pool_high_water_bytes(&self) -> Result<u64> {
        self.pool_attribute(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH, None)
    }

    /// Reset the high-water mark to the current use.
    pub fn reset_pool_high_water(&self) -> Result<()> {
        self.pool_attribute(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH, Some(0)).map(|_| ())
    }
}

/// Device memory owned by the runtime; the storage of tensors from [`Gpu::alloc`].
pub struct GpuBuffer {
    ptr: u64,
    bytes: usize,
    ordinal: usize,
    ctx: Arc<CudaContext>,
    release: Release,
}

/// How a [`GpuBuffer`] gives its memory back.
enum Release {
    /// `cuMemFree` (no stream-ordered allocator).
    Sync,
    /// `cuMemFreeAsync` on the stream it was allocated on (`_own` keeps the runtime's own
    /// stream alive when it is that one).
    Async { stream: u64, _own: Option<Arc<CudaStream>> },
    /// A caller's allocator owns it: dropping the owner releases it.
    Foreign(#[allow(dead_code)] Box<dyn std::any::Any + Send + Sync>),
}

impl std::fmt::Debug for GpuBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GpuBuffer(cuda:{}, {:#x}, {} bytes)", self.ordinal, self.ptr, self.bytes)
    }
}

impl Drop for GpuBuffer {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_err() {
            return;
        }
        // SAFETY: `ptr` was allocated once by `Gpu::buffer` and is freed once, here, the
        // same way it was allocated, on the stream it was allocated on (the runtime's own,
        // live for the process, or a caller's, which set_current_stream's contract keeps
        // alive); foreign memory is released by dropping its owner.
        let _ = unsafe {
            match &self.release {
                Release::Async { stream, .. } => cu::free_async(self.ptr, *stream as sys::CUstream),
                Release::Sync => cu::free_sync(self.ptr),
                Release::Foreign(_) => Ok(()),
            }
        };
    }
}

impl DeviceBuffer for GpuBuffer {
    fn device_ptr(&self) -> u64 {
        self.ptr
    }
    fn len_bytes(&self) -> usize {
        self.bytes
    }
    fn ordinal(&self) -> usize {
        self.ordinal
    }
    fn copy_to_host(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        if offset + dst.len() > self.bytes {
            return Err(Error::Cuda(format!("copy of {} bytes at offset {offset} from a buffer of {} bytes", dst.len(), self.bytes)));
        }
        if dst.is_empty() {
            return Ok(());
        }
        // Work queued on the current stream (and ours) must finish before the copy reads.
        gpu(self.ordinal)?.synchronize()?;
        // SAFETY: the range lies inside this allocation (checked above); the copy is
        // synchronous and `dst` is a live host slice of exactly that length.
        unsafe { cu::memcpy_dtoh_sync(dst, self.ptr + offset as u64) }.map_err(drv("cuMemcpyDtoH"))
    }
}

/// A scratch workspace; freed (stream-ordered) on drop.
#[derive(Debug)]
pub struct Scratch {
    buf: GpuBuffer,
}

impl Scratch {
    pub fn ptr(&self) -> u64 {
        self.buf.ptr
    }
    pub fn bytes(&self) -> usize {
        self.buf.bytes
    }
}

/// The device ordinal of a tensor argument, or an error naming it.
pub fn ordinal_of(op: &'static str, device: Device) -> Result<usize> {
    match device {
        Device::Cuda(i) => Ok(i),
        Device::Cpu => Err(Error::Unavailable { backend: "cuda".into(), op, reason: "the inputs are CPU tensors; move them to a CUDA device".into() }),
    }
}
