//! The per-device runtime: finding libcuda, the device count, one [`Gpu`] per ordinal
//! (primary context, own stream, properties) and the stream a thread's work goes to.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::c_void;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::{self, CUdevice_attribute as Attr};
use cudarc::driver::{result as cu, CudaContext, CudaStream};
use dsv4_core::{Error, Result};

use super::drv;
use super::kernel::{KernelEntry, Module, ModuleKey};
#[cfg(doc)]
use super::memory::with_workspace_allocator;

// ---------------------------------------------------------------------------------------
// Finding libcuda

/// Where libcuda was found, or why not (kept for `describe`).
static DRIVER_LIB: std::sync::OnceLock<std::result::Result<String, String>> = std::sync::OnceLock::new();

/// Make sure cudarc's dynamic loader can open libcuda; returns where it was found.
///
/// cudarc opens libcuda by bare name; a library already loaded from an explicit path
/// answers to its soname, so loading `$DSV4_CUDA_DRIVER_LIB` or a well-known driver
/// directory first makes those work without `LD_LIBRARY_PATH`.
pub fn driver_library() -> std::result::Result<String, String> {
    DRIVER_LIB
        .get_or_init(|| {
            let mut tried = Vec::new();
            let mut explicit: Vec<PathBuf> = std::env::var_os("DSV4_CUDA_DRIVER_LIB").map(PathBuf::from).into_iter().collect();
            for d in ["/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib/aarch64-linux-gnu", "/usr/local/nvidia/lib64", "/usr/lib/wsl/lib"] {
                explicit.push(PathBuf::from(d).join("libcuda.so.1"));
            }
            // SAFETY (is_culib_present): only probes dlopen for cudarc's candidate names.
            if unsafe { sys::is_culib_present() } {
                return Ok("libcuda.so.1 (found by the dynamic loader)".to_string());
            }
            tried.push(format!("libcuda.so.1, libcuda.so and {} other names via LD_LIBRARY_PATH/ld.so.cache", cudarc::get_lib_name_candidates("cuda").len().saturating_sub(2)));
            for p in explicit {
                if !p.exists() {
                    tried.push(format!("{} (absent)", p.display()));
                    continue;
                }
                // SAFETY: libcuda's initialisers have no preconditions; the handle is leaked
                // on purpose so the library stays loaded for cudarc.
                match unsafe { libloading::Library::new(&p) } {
                    Ok(l) => {
                        std::mem::forget(l);
                        // SAFETY: as above.
                        if unsafe { sys::is_culib_present() } {
                            return Ok(p.display().to_string());
                        }
                        tried.push(format!("{} (loaded, but its soname is not libcuda.so.1)", p.display()));
                    }
                    Err(e) => tried.push(format!("{} ({e})", p.display())),
                }
            }
            Err(format!("the CUDA driver library (libcuda) was not found: is an NVIDIA driver installed? Searched: {}", tried.join("; ")))
        })
        .clone()
}

// ---------------------------------------------------------------------------------------
// Streams

thread_local! {
    /// Per thread: ordinal -> a caller's raw CUstream (see `set_current_stream`).
    static CURRENT_STREAM: RefCell<HashMap<usize, u64>> = RefCell::new(HashMap::new());
}

/// Make this thread's launches for device `ordinal` use a caller's stream (a raw
/// `CUstream` as u64, e.g. torch's current stream); `None` returns to the runtime's own.
///
/// Memory the runtime allocates while a caller's stream is current (workspaces, and the
/// storage of tensors it returns) is stream-ordered on that stream: taken with
/// `cuMemAllocAsync` and given back with `cuMemFreeAsync` on it, so no call waits for the
/// device. The caller promises that the stream outlives that memory (a workspace lives for
/// one call; a returned tensor or plan as long as the caller keeps it). A workspace
/// allocator ([`with_workspace_allocator`]) takes precedence.
pub fn set_current_stream(ordinal: usize, stream: Option<u64>) {
    CURRENT_STREAM.with(|m| {
        let mut m = m.borrow_mut();
        match stream {
            Some(s) => m.insert(ordinal, s),
            None => m.remove(&ordinal),
        };
    });
}

// ---------------------------------------------------------------------------------------
// The per-device runtime

/// What the launchers need to know about a device.
#[derive(Clone, Debug)]
pub struct DeviceProps {
    pub name: String,
    pub compute_capability: (i32, i32),
    /// NVRTC architecture compiled for: `sm_90a` (Hopper), `sm_100a`/`sm_103a`
    /// (Blackwell datacentre), plain `sm_XY` elsewhere.
    pub arch: String,
    pub sm_count: u32,
    /// Dynamic shared memory one block may opt in to (bytes).
    pub max_shared_per_block_optin: u32,
    /// Shared memory per SM (bytes).
    pub max_shared_per_sm: u32,
    pub max_threads_per_block: u32,
    pub total_memory: usize,
    pub l2_bytes: u32,
    /// `cuDriverGetVersion`, e.g. 13000.
    pub driver_version: i32,
}

/// The architecture to compile for on a device of compute capability `(major, minor)`.
pub fn arch_for(cc: (i32, i32)) -> String {
    match cc {
        (9, 0) => "sm_90a".into(),
        (10, m) => format!("sm_10{m}a"),
        (major, minor) => format!("sm_{major}{minor}"),
    }
}

/// One device: its primary context, the runtime's own stream and the kernel caches.
pub struct Gpu {
    pub(super) ordinal: usize,
    pub(super) ctx: Arc<CudaContext>,
    pub(super) stream: Arc<CudaStream>,
    pub(super) props: DeviceProps,
    pub(super) modules: Mutex<HashMap<ModuleKey, Arc<Module>>>,
    /// Resolved entries by the hash of (source, entry, defines), so a call's lookup
    /// allocates nothing; each bucket keeps its full keys to compare.
    pub(super) kernels: Mutex<HashMap<u64, Vec<KernelEntry>>>,
}

static GPUS: Mutex<Vec<Option<&'static Gpu>>> = Mutex::new(Vec::new());

/// The runtime for a device ordinal, created once per process.
pub fn gpu(ordinal: usize) -> Result<&'static Gpu> {
    let mut gpus = GPUS.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(Some(g)) = gpus.get(ordinal) {
        return Ok(g);
    }
    let g: &'static Gpu = Box::leak(Box::new(Gpu::new(ordinal)?));
    if gpus.len() <= ordinal {
        gpus.resize(ordinal + 1, None);
    }
    gpus[ordinal] = Some(g);
    Ok(g)
}

/// Number of CUDA devices (0 when the driver is missing or reports none).
pub fn device_count() -> Result<usize> {
    driver_library().map_err(Error::Cuda)?;
    cu::init().map_err(drv("cuInit"))?;
    Ok(cu::device::get_count().map_err(drv("cuDeviceGetCount"))? as usize)
}

impl Gpu {
    fn new(ordinal: usize) -> Result<Gpu> {
        driver_library().map_err(Error::Cuda)?;
        let n = device_count()?;
        if ordinal >= n {
            return Err(Error::Cuda(format!("no CUDA device cuda:{ordinal} (the driver reports {n} device{})", if n == 1 { "" } else { "s" })));
        }
        let ctx = CudaContext::new(ordinal).map_err(drv("creating the primary context"))?;
        let stream = ctx.new_stream().map_err(drv("creating a stream"))?;
        let attr = |a: Attr| ctx.attribute(a).map_err(drv("cuDeviceGetAttribute"));
        let cc = ctx.compute_capability().map_err(drv("compute capability"))?;
        let mut driver_version = 0;
        // SAFETY: cuDriverGetVersion writes one int; the driver was initialised above.
        unsafe { sys::cuDriverGetVersion(&mut driver_version) };
        let props = DeviceProps {
            name: ctx.name().map_err(drv("cuDeviceGetName"))?,
            compute_capability: cc,
            arch: arch_for(cc),
            sm_count: attr(Attr::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32,
            max_shared_per_block_optin: attr(Attr::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)? as u32,
            max_shared_per_sm: attr(Attr::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR)? as u32,
            max_threads_per_block: attr(Attr::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK)? as u32,
            total_memory: ctx.total_mem().map_err(drv("cuDeviceTotalMem"))?,
            l2_bytes: attr(Attr::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)? as u32,
            driver_version,
        };
        if ctx.has_async_alloc() {
            // Keep freed memory in the stream-ordered pool instead of returning it to the
            // driver at every synchronisation (the default threshold is 0).
            // SAFETY: the device is valid; the attribute takes a u64 by pointer.
            unsafe {
                let pool = cu::device::get_default_mem_pool(ctx.cu_device()).map_err(drv("cuDeviceGetDefaultMemPool"))?;
                let mut threshold: u64 = u64::MAX;
                cu::mem_pool::set_attribute(pool, sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &mut threshold as *mut u64 as *mut c_void).map_err(drv("cuMemPoolSetAttribute"))?;
            }
        }
        Ok(Gpu { ordinal, ctx, stream, props, modules: Mutex::new(HashMap::new()), kernels: Mutex::new(HashMap::new()) })
    }

    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Device properties the launchers need.
    pub fn props(&self) -> &DeviceProps {
        &self.props
    }

    /// Whether the Hopper (sm_90a: wgmma, setmaxnreg, mbarrier pipelines) kernels run on
    /// this device. `DSV4_PORTABLE=1` keeps every op on its portable (mma.sync) kernel, to
    /// compare the two paths or to work around one.
    pub fn hopper(&self) -> bool {
        self.props.arch == "sm_90a" && std::env::var("DSV4_PORTABLE").as_deref() != Ok("1")
    }

    /// Make this device's context current on the calling thread.
    pub(super) fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(drv("binding the context to this thread"))
    }

    /// The raw stream this thread's work for this device goes to.
    pub fn stream_raw(&self) -> u64 {
        CURRENT_STREAM.with(|m| m.borrow().get(&self.ordinal).copied()).unwrap_or(self.stream.cu_stream() as u64)
    }

    pub(super) fn own_stream(&self) -> bool {
        self.stream_raw() == self.stream.cu_stream() as u64
    }

    /// Wait for all work queued on the current stream (and the runtime's own).
    pub fn synchronize(&self) -> Result<()> {
        self.bind()?;
        // SAFETY: both streams are live (the runtime's own is never destroyed; a caller's
        // stream is the caller's promise via `set_current_stream`).
        unsafe {
            cu::stream::synchronize(self.stream_raw() as sys::CUstream).map_err(drv("cuStreamSynchronize"))?;
            cu::stream::synchronize(self.stream.cu_stream()).map_err(drv("cuStreamSynchronize"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arch_names() {
        assert_eq!(arch_for((9, 0)), "sm_90a");
        assert_eq!(arch_for((10, 0)), "sm_100a");
        assert_eq!(arch_for((8, 6)), "sm_86");
    }
}
