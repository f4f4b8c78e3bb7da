//! The CUDA runtime of this crate: one [`Gpu`] per device ordinal (primary context, own
//! stream, device properties, compiled-kernel caches), device memory, and kernel launches
//! with one by-value params struct (and, `launch2`, a second by-value argument: a TMA
//! tensor map, [`TmaDesc`]).
//!
//! Built on cudarc's driver API with dynamic loading: libcuda is opened at run time, so a
//! machine without CUDA builds and tests everything but the GPU runs. Kernels are compiled
//! by NVRTC (`nvrtc.rs`) for the device's exact architecture and cached in memory and on
//! disk.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::{self, CUdevice_attribute as Attr};
use cudarc::driver::{result as cu, CudaContext, CudaStream, DriverError};
use dsv4_core::tensor::DeviceBuffer;
use dsv4_core::{DType, Device, Error, Result, Tensor};

use crate::nvrtc::{self, EntryInfo};

fn drv(what: &str) -> impl Fn(DriverError) -> Error + '_ {
    move |e| Error::Cuda(format!("{what}: {e:?}"))
}

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

type ModuleKey = (String, Vec<(String, String)>);
/// A resolved entry with its full key: (source and defines, entry, kernel).
type KernelEntry = (ModuleKey, String, Kernel);

/// One device: its primary context, the runtime's own stream and the kernel caches.
pub struct Gpu {
    ordinal: usize,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    props: DeviceProps,
    modules: Mutex<HashMap<ModuleKey, Arc<Module>>>,
    /// Resolved entries by the hash of (source, entry, defines), so a call's lookup
    /// allocates nothing; each bucket keeps its full keys to compare.
    kernels: Mutex<HashMap<u64, Vec<KernelEntry>>>,
}

/// The hash of a kernel lookup, over borrowed parts (no allocation).
fn kernel_hash(source: &str, entry: &str, defines: &[(&str, String)]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    source.hash(&mut h);
    entry.hash(&mut h);
    defines.len().hash(&mut h);
    for (k, v) in defines {
        k.hash(&mut h);
        v.hash(&mut h);
    }
    h.finish()
}

/// Whether a cached key is the lookup `(source, entry, defines)`.
fn same_kernel(module: &ModuleKey, ent: &str, source: &str, entry: &str, defines: &[(&str, String)]) -> bool {
    let (src, defs) = module;
    src == source && ent == entry && defs.len() == defines.len() && defs.iter().zip(defines).all(|((a, b), (c, d))| a == c && b == d)
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

/// `DSV4_EXTRA_DEFINES` (the `tuning` feature; empty in the default build).
fn extra_defines() -> &'static [(String, String)] {
    crate::tuning::extra_defines()
}

/// A launcher's `defines` followed by the `extra` ones whose names it does not give: its
/// own values win over `DSV4_EXTRA_DEFINES` (each name is defined once, so NVRTC neither
/// warns about a redefinition nor takes the later value behind the launcher's back).
fn with_extra_defines<'a>(defines: &[(&'a str, String)], extra: &'a [(String, String)]) -> Vec<(&'a str, String)> {
    let own = |name: &str| defines.iter().any(|(k, _)| *k == name);
    defines.iter().cloned().chain(extra.iter().filter(|(k, _)| !own(k)).map(|(k, v)| (k.as_str(), v.clone()))).collect()
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
    fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(drv("binding the context to this thread"))
    }

    /// The raw stream this thread's work for this device goes to.
    pub fn stream_raw(&self) -> u64 {
        CURRENT_STREAM.with(|m| m.borrow().get(&self.ordinal).copied()).unwrap_or(self.stream.cu_stream() as u64)
    }

    fn own_stream(&self) -> bool {
        self.stream_raw() == self.stream.cu_stream() as u64
    }

    /// Compile (or fetch from cache) `source` with `defines` and return its `entry`.
    ///
    /// In a build with the `tuning` feature, `DSV4_EXTRA_DEFINES="NAME=VALUE,..."` adds
    /// defines to every kernel this process compiles (lab experiments; part of the cache key
    /// like any define); a name `defines` also gives keeps the launcher's value
    /// (`with_extra_defines`). The default build ignores it.
    pub fn kernel(&self, source: &str, entry: &str, defines: &[(&str, String)]) -> Result<Kernel> {
        let extra = extra_defines();
        let with_extra: Vec<(&str, String)>;
        let defines = if extra.is_empty() {
            defines
        } else {
            with_extra = with_extra_defines(defines, extra);
            &with_extra
        };
        let hash = kernel_hash(source, entry, defines);
        if let Some(bucket) = self.kernels.lock().unwrap_or_else(|p| p.into_inner()).get(&hash) {
            if let Some((_, _, k)) = bucket.iter().find(|(m, e, _)| same_kernel(m, e, source, entry, defines)) {
                return Ok(k.clone());
            }
        }
        let mkey: ModuleKey = (source.to_string(), defines.iter().map(|(k, v)| (k.to_string(), v.clone())).collect());
        self.bind()?;
        let module = {
            let existing = self.modules.lock().unwrap_or_else(|p| p.into_inner()).get(&mkey).cloned();
            match existing {
                Some(m) => m,
                None => {
                    let mut c = compile_cached(source, defines, &self.props.arch, false)?;
                    // SAFETY: `cubin` is a complete CUBIN image (NVRTC's output, or a disk
                    // entry whose checksum matched) for this device's architecture; the
                    // driver copies it during the call.
                    let load = |cubin: &[u8]| unsafe { cu::module::load_data(cubin.as_ptr() as *const c_void) };
                    let raw = match load(&c.cubin) {
                        Ok(raw) => raw,
                        // A cached image the driver rejects: compile afresh once.
                        Err(_) if c.from_cache => {
                            c = compile_cached(source, defines, &self.props.arch, true)?;
                            load(&c.cubin).map_err(|e| Error::Cuda(format!("loading the module of `{source}` ({}): {e:?}", self.props.arch)))?
                        }
                        Err(e) => return Err(Error::Cuda(format!("loading the module of `{source}` ({}, driver {}): {e:?}", self.props.arch, self.props.driver_version))),
                    };
                    let m = Arc::new(Module { raw, ctx: self.ctx.clone(), entries: c.entries });
                    self.modules.lock().unwrap_or_else(|p| p.into_inner()).insert(mkey.clone(), m.clone());
                    m
                }
            }
        };
        let c_entry = CString::new(entry).map_err(|_| Error::Cuda(format!("kernel entry `{entry}` contains a NUL byte")))?;
        // SAFETY: `module.raw` is a loaded module kept alive by the Arc stored in the Kernel.
        let func = unsafe { cu::module::get_function(module.raw, c_entry) }.map_err(|e| Error::Cuda(format!("`{source}` has no entry `{entry}`: {e:?}")))?;
        let info = module.entries.iter().find(|e| e.entry == entry).cloned().unwrap_or_else(|| EntryInfo { entry: entry.to_string(), ..Default::default() });
        let k = Kernel { inner: Arc::new(KernelInner { func, _module: module, name: format!("{source}:{entry}"), info, gpu: gpu(self.ordinal)?, smem_opt_in: Mutex::new(0) }) };
        self.kernels.lock().unwrap_or_else(|p| p.into_inner()).entry(hash).or_default().push((mkey, entry.to_string(), k.clone()));
        Ok(k)
    }

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

    /// Every module compiled so far in this process, with ptxas's figures per entry.
    pub fn compiled_entries(&self) -> Vec<(String, EntryInfo)> {
        let mods = self.modules.lock().unwrap_or_else(|p| p.into_inner());
        let mut v: Vec<(String, EntryInfo)> = mods.iter().flat_map(|((src, defs), m)| m.entries.iter().map(move |e| (format!("{src} {defs:?}"), e.clone()))).collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }
}

// ---------------------------------------------------------------------------------------
// The compile cache

/// The on-disk cache directory: `$DSV4_CACHE_DIR`, else `$XDG_CACHE_HOME/dsv4-kernels`,
/// else `~/.cache/dsv4-kernels` (None when none can be named).
pub fn cache_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("DSV4_CACHE_DIR") {
        return Some(PathBuf::from(d));
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME").filter(|d| !d.is_empty()) {
        return Some(PathBuf::from(d).join("dsv4-kernels"));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/dsv4-kernels"))
}

const CACHE_MAGIC: &[u8; 8] = b"DSV4CUB1";

/// Entry layout: magic, u64 log length, u64 cubin length, u128 FNV of both, log, cubin.
fn encode_entry(log: &str, cubin: &[u8]) -> Vec<u8> {
    let mut h = nvrtc::Fnv128::new();
    h.write(log.as_bytes());
    h.write(cubin);
    let mut v = Vec::with_capacity(40 + log.len() + cubin.len());
    v.extend_from_slice(CACHE_MAGIC);
    v.extend_from_slice(&(log.len() as u64).to_le_bytes());
    v.extend_from_slice(&(cubin.len() as u64).to_le_bytes());
    v.extend_from_slice(&h.finish().to_le_bytes());
    v.extend_from_slice(log.as_bytes());
    v.extend_from_slice(cubin);
    v
}

/// `(log, cubin)` of a well-formed entry; None for a corrupt or truncated one.
fn decode_entry(bytes: &[u8]) -> Option<(String, Vec<u8>)> {
    if bytes.len() < 40 || &bytes[..8] != CACHE_MAGIC {
        return None;
    }
    let nlog = u64::from_le_bytes(bytes[8..16].try_into().ok()?) as usize;
    let ncub = u64::from_le_bytes(bytes[16..24].try_into().ok()?) as usize;
    let sum = u128::from_le_bytes(bytes[24..40].try_into().ok()?);
    if bytes.len() != 40usize.checked_add(nlog)?.checked_add(ncub)? {
        return None;
    }
    let (log, cubin) = bytes[40..].split_at(nlog);
    let mut h = nvrtc::Fnv128::new();
    h.write(log);
    h.write(cubin);
    (h.finish() == sum && ncub > 0).then(|| (String::from_utf8_lossy(log).into_owned(), cubin.to_vec()))
}

/// A CUBIN for `(source, defines, arch)`: from the disk cache when a valid entry exists,
/// else compiled and written by atomic rename (a cache that cannot be written is skipped).
/// A compiled kernel source as [`compile_cached`] returns it.
#[derive(Clone, Debug)]
pub struct CachedCubin {
    pub cubin: Vec<u8>,
    pub entries: Vec<EntryInfo>,
    /// Where the entry lives on disk (None without a cache directory).
    pub path: Option<PathBuf>,
    /// Read from the disk cache rather than compiled now.
    pub from_cache: bool,
}

/// A CUBIN for `(source, defines, arch)`: from the disk cache when a valid entry exists
/// (unless `fresh`), else compiled and written by atomic rename (a cache that cannot be
/// written is skipped). The key hashes the rendered source (defines included), every
/// header, the options (arch included) and the NVRTC version.
pub fn compile_cached(source: &str, defines: &[(&str, String)], arch: &str, fresh: bool) -> Result<CachedCubin> {
    let nv = nvrtc::nvrtc()?;
    let rendered = nvrtc::render_source(source, defines)?;
    let options = nv.options(arch);
    let mut h = nvrtc::Fnv128::new();
    h.write(&nvrtc::content_hash(&rendered, &options).to_le_bytes());
    h.write(format!("nvrtc {}.{}", nv.version.0, nv.version.1).as_bytes());
    let key = format!("{}-{arch}-{:032x}.cubin", source.replace(['/', '.'], "_"), h.finish());
    let path = cache_dir().map(|d| d.join(&key));
    if let (Some(p), false) = (&path, fresh) {
        if let Ok(bytes) = std::fs::read(p) {
            if let Some((log, cubin)) = decode_entry(&bytes) {
                return Ok(CachedCubin { cubin, entries: nvrtc::parse_ptxas_info(&log), path, from_cache: true });
            }
            // Corrupt or truncated: recompiled and overwritten below.
        }
    }
    let c = nv.compile_rendered(source, &rendered, arch)?;
    if let Some(p) = &path {
        let _ = write_atomic(p, &encode_entry(&c.log, &c.cubin));
    }
    Ok(CachedCubin { cubin: c.cubin, entries: c.entries, path, from_cache: false })
}

fn write_atomic(path: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(std::path::Path::new("."));
    std::fs::create_dir_all(dir)?;
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    let tmp = dir.join(format!(".{}.{}.{nanos}.tmp", path.file_name().unwrap_or_default().to_string_lossy(), std::process::id()));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

// ---------------------------------------------------------------------------------------
// Modules and kernels

struct Module {
    raw: sys::CUmodule,
    ctx: Arc<CudaContext>,
    entries: Vec<EntryInfo>,
}

// SAFETY: a CUmodule handle may be used from any thread whose current context is the
// module's (every use binds `ctx` first).
unsafe impl Send for Module {}
unsafe impl Sync for Module {}

impl Drop for Module {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: the module was loaded once and no Kernel refers to it any more (they
            // hold this Arc).
            let _ = unsafe { cu::module::unload(self.raw) };
        }
    }
}

struct KernelInner {
    func: sys::CUfunction,
    /// Keeps the module loaded while the function handle is in use.
    _module: Arc<Module>,
    name: String,
    info: EntryInfo,
    gpu: &'static Gpu,
    /// The max-dynamic-shared-memory attribute set so far (bytes).
    smem_opt_in: Mutex<u32>,
}

// SAFETY: a CUfunction is an immutable handle into its module, which the Arc keeps loaded.
unsafe impl Send for KernelInner {}
unsafe impl Sync for KernelInner {}

/// A compiled entry point (the module stays loaded while any clone lives).
#[derive(Clone)]
pub struct Kernel {
    inner: Arc<KernelInner>,
}

impl std::fmt::Debug for Kernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Kernel({})", self.inner.name)
    }
}

impl Kernel {
    /// `source:entry`.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// ptxas's registers/spills/stack for this entry.
    pub fn info(&self) -> &EntryInfo {
        &self.inner.info
    }

    /// Launch on the current stream with ONE by-value argument: a `#[repr(C)]` params
    /// struct mirrored in the kernel's `.cuh` (`extern "C" __global__ void entry(const
    /// XParams p)`). Sets the max-dynamic-shared-memory attribute to `shared_bytes` (once
    /// per larger size). Checks the launch result.
    ///
    /// # Safety
    /// Every device pointer in `params` must be valid for what the kernel reads/writes,
    /// and `P` must be the params type the entry takes.
    pub unsafe fn launch<P: Copy>(&self, grid: [u32; 3], block: [u32; 3], shared_bytes: u32, params: &P) -> Result<()> {
        // SAFETY: the caller's promise, for the one argument the entry takes.
        unsafe { self.launch_args(grid, block, shared_bytes, &mut [params as *const P as *mut c_void]) }
    }

    /// [`launch`](Self::launch) with TWO by-value arguments: the params struct and a
    /// second one, e.g. a [`TmaDesc`] the entry takes as `const __grid_constant__ TmaDesc`
    /// (`extern "C" __global__ void entry(const XParams p, const __grid_constant__ TmaDesc
    /// map)`). The driver copies both into the kernel's parameter space at the entry's
    /// offsets (a 64-byte aligned TmaDesc lands 64-byte aligned). Same checks as `launch`.
    ///
    /// # Safety
    /// Every device pointer in `params` and `second` (a tensor map's global address
    /// included: the map's whole tensor) must be valid for what the kernel reads/writes,
    /// and `P`, `Q` must be the entry's first and second parameter types.
    pub unsafe fn launch2<P: Copy, Q: Copy>(&self, grid: [u32; 3], block: [u32; 3], shared_bytes: u32, params: &P, second: &Q) -> Result<()> {
        // SAFETY: the caller's promise, for the two arguments the entry takes.
        unsafe { self.launch_args(grid, block, shared_bytes, &mut [params as *const P as *mut c_void, second as *const Q as *mut c_void]) }
    }

    /// As [`Kernel::launch2`] for an entry of three parameters (`P`, `Q`, `R`).
    ///
    /// # Safety
    /// As `launch2`, for the three arguments.
    pub unsafe fn launch3<P: Copy, Q: Copy, R: Copy>(&self, grid: [u32; 3], block: [u32; 3], shared_bytes: u32, params: &P, second: &Q, third: &R) -> Result<()> {
        // SAFETY: the caller's promise, for the three arguments the entry takes.
        unsafe { self.launch_args(grid, block, shared_bytes, &mut [params as *const P as *mut c_void, second as *const Q as *mut c_void, third as *const R as *mut c_void]) }
    }

    /// The launch itself: `args` holds one pointer per kernel parameter, each to a value
    /// of that parameter's type that lives for the call (the driver copies them).
    ///
    /// # Safety
    /// As `launch` / `launch2`, for every pointer of `args`.
    unsafe fn launch_args(&self, grid: [u32; 3], block: [u32; 3], shared_bytes: u32, args: &mut [*mut c_void]) -> Result<()> {
        let k = &self.inner;
        let gpu = k.gpu;
        gpu.bind()?;
        if grid.contains(&0) {
            return Ok(());
        }
        if shared_bytes > gpu.props.max_shared_per_block_optin {
            return Err(Error::Cuda(format!("{}: {shared_bytes} bytes of dynamic shared memory exceed the device limit of {} per block", k.name, gpu.props.max_shared_per_block_optin)));
        }
        // Any dynamic size: the 48 KiB a launch gets without the attribute count the entry's
        // static shared memory too (v25: 42 KiB dynamic beside 7 KiB static failed with
        // CUDA_ERROR_INVALID_VALUE when only sizes over 48 KiB set it).
        if shared_bytes > 0 {
            let mut set = k.smem_opt_in.lock().unwrap_or_else(|p| p.into_inner());
            if *set < shared_bytes {
                cu::function::set_function_attribute(k.func, sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared_bytes as i32).map_err(|e| Error::Cuda(format!("{}: setting max dynamic shared memory to {shared_bytes}: {e:?}", k.name)))?;
                *set = shared_bytes;
            }
        }
        cu::launch_kernel(k.func, (grid[0], grid[1], grid[2]), (block[0], block[1], block[2]), shared_bytes, gpu.stream_raw() as sys::CUstream, args)
            .map_err(|e| Error::Cuda(format!("launching {} (grid {grid:?}, block {block:?}, {shared_bytes} B shared): {e:?}", k.name)))
    }
}

// ---------------------------------------------------------------------------------------
// Tensor maps (TMA)

/// A `CUtensorMap` (TMA descriptor): 128 opaque bytes, 64-byte aligned, passed by value to
/// a kernel that takes `const __grid_constant__ TmaDesc` (kernels/tma.cuh) with
/// [`Kernel::launch2`]; [`TmaDesc::ZERO`] where the entry takes one but the compiled
/// variant does not use it. Made by [`Gpu::tma_map_bf16`].
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TmaDesc(pub [u64; 16]);

impl TmaDesc {
    pub const ZERO: TmaDesc = TmaDesc([0; 16]);
}

const _: () = assert!(size_of::<TmaDesc>() == 128 && align_of::<TmaDesc>() == 64);
const _: () = assert!(size_of::<sys::CUtensorMap>() == 128 && align_of::<sys::CUtensorMap>() == 64);

/// `(struct name, size in bytes)` of the by-value kernel arguments defined here (mirrored
/// by `DSV4_PARAMS_SIZE` lines of the kernel headers, tests/params_layout.rs).
pub const PARAMS_SIZES: &[(&str, usize)] = &[("TmaDesc", size_of::<TmaDesc>())];

/// Why [`Gpu::tma_map_bf16`] cannot map this bf16 tensor (None: it can), by
/// cuTensorMapEncodeTiled's requirements for a tiled map with the 128-byte swizzle:
/// rank 1..=5; a 16-byte aligned base; every size in 1..=2^32; the strides of the
/// dimensions above the innermost (bytes) non-zero multiples of 16 below 2^40; box sizes
/// in 1..=256, the innermost one 16..=128 bytes in 16-byte steps (the swizzle span).
/// `dims` and `box_dims` innermost first, in elements; `byte_strides` of dims 1.. .
pub fn tma_bf16_problem(address: u64, dims: &[u64], byte_strides: &[u64], box_dims: &[u32]) -> Option<String> {
    let rank = dims.len();
    if !(1..=5).contains(&rank) || byte_strides.len() + 1 != rank || box_dims.len() != rank {
        return Some(format!("rank {rank} with {} strides and {} box sizes (TMA: rank 1..=5, rank - 1 strides)", byte_strides.len(), box_dims.len()));
    }
    if address == 0 || !address.is_multiple_of(16) {
        return Some(format!("base address {address:#x} is not 16-byte aligned"));
    }
    if let Some(d) = dims.iter().find(|&&d| d == 0 || d > 1 << 32) {
        return Some(format!("size {d} outside 1..=2^32"));
    }
    if let Some(s) = byte_strides.iter().find(|&&s| s == 0 || !s.is_multiple_of(16) || s >= 1 << 40) {
        return Some(format!("stride of {s} bytes is not a non-zero multiple of 16 below 2^40"));
    }
    if box_dims.iter().any(|&b| b == 0 || b > 256) || !(box_dims[0] * 2).is_multiple_of(16) || box_dims[0] * 2 > 128 {
        return Some(format!("box {box_dims:?} (sizes 1..=256, the innermost 16..=128 bytes in 16-byte steps)"));
    }
    None
}

impl Gpu {
    /// A TMA map of the bf16 tensor at `address` (`dims` innermost first, in elements;
    /// `byte_strides` of dims 1..; see [`tma_bf16_problem`]) whose loads move boxes of
    /// `box_dims` into shared memory in the 128-byte swizzle (the SW128 layout of
    /// kernels/hopper.cuh when the box is 128 bytes wide), elements outside the tensor
    /// written as zeros, L2 filled in 256-byte sectors. An error where the requirements do
    /// not hold or the driver refuses (the caller falls back to a path without TMA).
    pub fn tma_map_bf16(&self, address: u64, dims: &[u64], byte_strides: &[u64], box_dims: &[u32]) -> Result<TmaDesc> {
        if let Some(why) = tma_bf16_problem(address, dims, byte_strides, box_dims) {
            return Err(Error::Cuda(format!("TMA map: {why}")));
        }
        self.bind()?;
        let elem_strides = [1u32; 5];
        let mut map = sys::CUtensorMap { opaque: [0; 16] };
        // SAFETY: `map` is a 64-byte aligned CUtensorMap the driver writes; dims, strides,
        // box and element strides have `rank` (strides rank - 1) entries (checked above);
        // the driver only encodes `address`, nothing is read or written through it here.
        unsafe {
            sys::cuTensorMapEncodeTiled(
                &mut map,
                sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                dims.len() as u32,
                address as *mut c_void,
                dims.as_ptr(),
                byte_strides.as_ptr(),
                box_dims.as_ptr(),
                elem_strides.as_ptr(),
                sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
                sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
        }
        .result()
        .map_err(|e| Error::Cuda(format!("cuTensorMapEncodeTiled (bf16, dims {dims:?}, byte strides {byte_strides:?}, box {box_dims:?}): {e:?}")))?;
        Ok(TmaDesc(map.opaque))
    }
}

// ---------------------------------------------------------------------------------------
// Memory

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_entries_round_trip_and_reject_corruption() {
        let e = encode_entry("ptxas info", &[1, 2, 3, 4]);
        assert_eq!(decode_entry(&e), Some(("ptxas info".to_string(), vec![1, 2, 3, 4])));
        let mut bad = e.clone();
        *bad.last_mut().unwrap() ^= 1;
        assert_eq!(decode_entry(&bad), None);
        assert_eq!(decode_entry(&e[..e.len() - 1]), None);
        assert_eq!(decode_entry(b"garbage"), None);
    }

    #[test]
    fn kernel_lookup_keys() {
        let d = |v: &str| vec![("A", "1".to_string()), ("B", v.to_string())];
        let module: ModuleKey = ("x.cu".into(), vec![("A".into(), "1".into()), ("B".into(), "2".into())]);
        assert!(same_kernel(&module, "k", "x.cu", "k", &d("2")));
        assert!(!same_kernel(&module, "k", "x.cu", "k", &d("3")));
        assert!(!same_kernel(&module, "k", "x.cu", "j", &d("2")));
        assert!(!same_kernel(&module, "k", "y.cu", "k", &d("2")));
        assert!(!same_kernel(&module, "k", "x.cu", "k", &d("2")[..1]));
        assert_eq!(kernel_hash("x.cu", "k", &d("2")), kernel_hash("x.cu", "k", &d("2")));
        assert_ne!(kernel_hash("x.cu", "k", &d("2")), kernel_hash("x.cu", "k", &d("3")));
    }

    #[test]
    fn launcher_defines_win_over_extra_defines() {
        let extra = vec![("IDX90_TMA".to_string(), "1".to_string()), ("LAB_KNOB".to_string(), "2".to_string())];
        let own = [("IDX_H", "64".to_string()), ("IDX90_TMA", "0".to_string())];
        let merged = with_extra_defines(&own, &extra);
        assert_eq!(merged, vec![("IDX_H", "64".to_string()), ("IDX90_TMA", "0".to_string()), ("LAB_KNOB", "2".to_string())]);
        assert_eq!(with_extra_defines(&[], &extra), vec![("IDX90_TMA", "1".to_string()), ("LAB_KNOB", "2".to_string())]);
    }

    #[test]
    fn tma_requirements() {
        // kv [B=2][P=300][D=128] bf16, contiguous: mappable with 64 x 64 boxes.
        let (dims, strides, boxes) = ([128u64, 300, 2], [256u64, 300 * 256], [64u32, 64, 1]);
        assert_eq!(tma_bf16_problem(0x1000, &dims, &strides, &boxes), None);
        assert!(tma_bf16_problem(0x1008, &dims, &strides, &boxes).is_some(), "8-byte aligned base");
        assert!(tma_bf16_problem(0x1000, &dims, &[80 + 8, 300 * 256], &boxes).is_some(), "row stride of 44 elements");
        assert!(tma_bf16_problem(0x1000, &dims, &[256, 0], &boxes).is_some(), "zero stride");
        assert!(tma_bf16_problem(0x1000, &dims, &[256, 1 << 40], &boxes).is_some(), "stride >= 2^40");
        assert!(tma_bf16_problem(0x1000, &[128, 0, 2], &strides, &boxes).is_some(), "empty dimension");
        assert!(tma_bf16_problem(0x1000, &dims, &strides, &[128, 64, 1]).is_some(), "256-byte box rows exceed the swizzle span");
        assert!(tma_bf16_problem(0x1000, &dims, &strides, &[4, 64, 1]).is_some(), "8-byte box rows");
        assert!(tma_bf16_problem(0x1000, &dims, &strides[..1], &boxes).is_some(), "a stride missing");
        // Heads past a box (D = 40 < 64): the box overhangs the tensor, which TMA allows.
        assert_eq!(tma_bf16_problem(0x1000, &[40, 29, 1], &[80, 29 * 80], &boxes), None);
    }

    #[test]
    fn arch_names() {
        assert_eq!(arch_for((9, 0)), "sm_90a");
        assert_eq!(arch_for((10, 0)), "sm_100a");
        assert_eq!(arch_for((8, 6)), "sm_86");
    }
}
