//! Kernel lookup and launch: [`Gpu::kernel`] compiles (through the disk cache) or fetches
//! a module and resolves an entry, cached per (source, entry, defines); [`Kernel`] launches
//! it with by-value arguments.

use std::ffi::{c_void, CString};
use std::sync::{Arc, Mutex};

use cudarc::driver::sys;
use cudarc::driver::{result as cu, CudaContext};
use dsv4_core::{Error, Result};

use super::cache::compile_cached;
use super::device::{gpu, Gpu};
#[cfg(doc)]
use super::tma::TmaDesc;
use crate::nvrtc::EntryInfo;

pub(super) type ModuleKey = (String, Vec<(String, String)>);
/// A resolved entry with its full key: (source and defines, entry, kernel).
pub(super) type KernelEntry = (ModuleKey, String, Kernel);

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

impl Gpu {
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

    /// Every module compiled so far in this process, with ptxas's figures per entry.
    pub fn compiled_entries(&self) -> Vec<(String, EntryInfo)> {
        let mods = self.modules.lock().unwrap_or_else(|p| p.into_inner());
        let mut v: Vec<(String, EntryInfo)> = mods.iter().flat_map(|((src, defs), m)| m.entries.iter().map(move |e| (format!("{src} {defs:?}"), e.clone()))).collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }
}

pub(super) struct Module {
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
