//! Finding and loading libnvrtc (a toolkit, the pip wheels, the dynamic loader) and the
//! CUDA include directory; the entry points this crate calls.

use std::ffi::{c_char, c_int, c_void};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use dsv4_core::{Error, Result};

pub(super) type NvrtcProgram = *mut c_void;
pub(super) type NvrtcResult = c_int;

/// The NVRTC entry points this crate uses.
pub(super) struct Api {
    pub(super) version: unsafe extern "C" fn(*mut c_int, *mut c_int) -> NvrtcResult,
    pub(super) create: unsafe extern "C" fn(*mut NvrtcProgram, *const c_char, *const c_char, c_int, *const *const c_char, *const *const c_char) -> NvrtcResult,
    pub(super) compile: unsafe extern "C" fn(NvrtcProgram, c_int, *const *const c_char) -> NvrtcResult,
    pub(super) log_size: unsafe extern "C" fn(NvrtcProgram, *mut usize) -> NvrtcResult,
    pub(super) log: unsafe extern "C" fn(NvrtcProgram, *mut c_char) -> NvrtcResult,
    pub(super) cubin_size: unsafe extern "C" fn(NvrtcProgram, *mut usize) -> NvrtcResult,
    pub(super) cubin: unsafe extern "C" fn(NvrtcProgram, *mut c_char) -> NvrtcResult,
    pub(super) destroy: unsafe extern "C" fn(*mut NvrtcProgram) -> NvrtcResult,
    pub(super) error_string: unsafe extern "C" fn(NvrtcResult) -> *const c_char,
}

/// A loaded libnvrtc and the CUDA include directory found beside it (or elsewhere).
pub struct Nvrtc {
    _lib: libloading::Library,
    /// libnvrtc-builtins from the same directory, loaded first: libnvrtc opens it by soname
    /// at compile time, and the pip wheels do not put their directory on the loader path.
    _builtins: Option<libloading::Library>,
    pub(super) api: Api,
    /// Where libnvrtc was loaded from (a path, or the bare name the dynamic loader resolved).
    pub library: String,
    /// `(major, minor)` of NVRTC.
    pub version: (i32, i32),
    /// A directory holding `cuda_bf16.h` (passed as `-I`), if one was found.
    pub include_dir: Option<PathBuf>,
}

// SAFETY: NVRTC entry points are thread-safe (each program is used by one thread); the
// struct holds only function pointers, the library handle and plain data.
unsafe impl Send for Nvrtc {}
unsafe impl Sync for Nvrtc {}

static NVRTC: OnceLock<std::result::Result<Nvrtc, String>> = OnceLock::new();

/// The process's NVRTC, loaded on first use; the error lists every place searched.
pub fn nvrtc() -> Result<&'static Nvrtc> {
    NVRTC.get_or_init(load).as_ref().map_err(|e| Error::Cuda(e.clone()))
}

/// Python `site-packages` (and similar) directories that may hold the `nvidia` wheels.
fn python_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Some(root) = std::env::var_os(var) {
            let lib = PathBuf::from(root).join("lib");
            if let Ok(rd) = std::fs::read_dir(&lib) {
                for e in rd.flatten() {
                    if e.file_name().to_string_lossy().starts_with("python") {
                        dirs.push(e.path().join("site-packages"));
                    }
                }
            }
        }
    }
    // The interpreter on PATH knows its own site-packages (user and system).
    let script = "import sys,site\nfor p in sys.path+site.getsitepackages()+[site.getusersitepackages()]: print(p)";
    for py in ["python3", "python"] {
        if let Ok(out) = std::process::Command::new(py).args(["-c", script]).stderr(std::process::Stdio::null()).output() {
            if out.status.success() {
                dirs.extend(String::from_utf8_lossy(&out.stdout).lines().filter(|l| !l.is_empty()).map(PathBuf::from));
                break;
            }
        }
    }
    let mut seen = std::collections::HashSet::new();
    dirs.retain(|d| d.is_dir() && seen.insert(d.clone()));
    dirs
}

/// Toolkit-style roots: `$CUDA_HOME`, `$CUDA_PATH`, `/usr/local/cuda`.
fn toolkit_roots() -> Vec<PathBuf> {
    let mut roots: Vec<PathBuf> = ["CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"].iter().filter_map(std::env::var_os).map(PathBuf::from).collect();
    roots.push(PathBuf::from("/usr/local/cuda"));
    roots
}

/// Candidate directories for libnvrtc, in search order.
fn library_dirs(py: &[PathBuf]) -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    for root in toolkit_roots() {
        dirs.push(root.join("lib64"));
        dirs.push(root.join("lib"));
    }
    for sp in py {
        for sub in ["nvidia/cu13/lib", "nvidia/cuda_nvrtc/lib", "nvidia/cu12/lib"] {
            dirs.push(sp.join(sub));
        }
    }
    dirs
}

/// Candidate include directories (holding `cuda_bf16.h`), in search order.
fn include_dirs(py: &[PathBuf], lib_dir: Option<&Path>) -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Some(var) = std::env::var_os("DSV4_CUDA_INCLUDE") {
        dirs.push(PathBuf::from(var));
    }
    if let Some(l) = lib_dir {
        // The headers of the same toolkit or wheel as the library first.
        dirs.push(l.join("../include"));
        if let Some(nvidia) = l.parent().and_then(Path::parent) {
            dirs.push(nvidia.join("cuda_runtime/include"));
        }
    }
    for root in toolkit_roots() {
        dirs.push(root.join("include"));
    }
    for sp in py {
        for sub in ["nvidia/cu13/include", "nvidia/cuda_runtime/include", "nvidia/cu12/include", "nvidia/cuda_nvrtc/include"] {
            dirs.push(sp.join(sub));
        }
    }
    dirs
}

/// `libnvrtc.so*` files in `dir`, best first (the unversioned link, then newest major).
fn nvrtc_files_in(dir: &Path) -> Vec<PathBuf> {
    let Ok(rd) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut files: Vec<(u32, PathBuf)> = rd
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let rest = name.strip_prefix("libnvrtc.so")?;
            if rest.is_empty() {
                return Some((u32::MAX, e.path()));
            }
            let major: u32 = rest.strip_prefix('.')?.split('.').next()?.parse().ok()?;
            Some((major, e.path()))
        })
        .collect();
    files.sort_by_key(|f| std::cmp::Reverse(f.0));
    files.into_iter().map(|(_, p)| p).collect()
}

fn load() -> std::result::Result<Nvrtc, String> {
    let mut tried: Vec<String> = Vec::new();
    let mut lib: Option<(libloading::Library, String, Option<PathBuf>)> = None;
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(p) = std::env::var_os("DSV4_NVRTC_LIB") {
        candidates.push(PathBuf::from(p));
    }
    let mut py: Option<Vec<PathBuf>> = None;
    let try_files = |files: Vec<PathBuf>, tried: &mut Vec<String>| -> Option<(libloading::Library, String, Option<PathBuf>)> {
        for f in files {
            // SAFETY: loading libnvrtc runs only its (side-effect free) initialisers.
            match unsafe { libloading::Library::new(&f) } {
                Ok(l) => return Some((l, f.display().to_string(), f.parent().map(Path::to_path_buf))),
                Err(e) => tried.push(format!("{} ({e})", f.display())),
            }
        }
        None
    };
    lib = lib.or_else(|| try_files(candidates, &mut tried));
    if lib.is_none() {
        // Toolkit locations before spawning a Python interpreter.
        for root in toolkit_roots() {
            for d in [root.join("lib64"), root.join("lib")] {
                if lib.is_none() {
                    let files = nvrtc_files_in(&d);
                    if files.is_empty() {
                        tried.push(format!("{}/libnvrtc.so* (none)", d.display()));
                    }
                    lib = try_files(files, &mut tried);
                }
            }
        }
    }
    if lib.is_none() {
        let dirs = python_dirs();
        for d in library_dirs(&dirs).into_iter().filter(|d| !toolkit_roots().iter().any(|r| d.starts_with(r))) {
            if lib.is_none() {
                let files = nvrtc_files_in(&d);
                if !files.is_empty() {
                    lib = try_files(files, &mut tried);
                } else if d.parent().is_some_and(Path::is_dir) {
                    tried.push(format!("{}/libnvrtc.so* (none)", d.display()));
                }
            }
        }
        if lib.is_none() {
            tried.push(format!(
                "nvidia/{{cu13,cuda_nvrtc,cu12}}/lib/ under the Python package directories [{}]",
                dirs.iter().filter(|d| d.ends_with("site-packages") || d.ends_with("dist-packages")).map(|d| d.display().to_string()).collect::<Vec<_>>().join(", ")
            ));
        }
        py = Some(dirs);
    }
    if lib.is_none() {
        // Last: whatever the dynamic loader finds (LD_LIBRARY_PATH, ld.so.cache).
        for name in ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"] {
            if lib.is_none() {
                // SAFETY: as above.
                match unsafe { libloading::Library::new(name) } {
                    Ok(l) => lib = Some((l, format!("{name} (found by the dynamic loader)"), None)),
                    Err(e) => tried.push(format!("{name} via LD_LIBRARY_PATH/ld.so.cache ({e})")),
                }
            }
        }
    }
    let Some((library, where_, lib_dir)) = lib else {
        return Err(format!(
            "libnvrtc not found. Install it with `pip install nvidia-cuda-nvrtc nvidia-cuda-runtime` (CUDA 13: nvidia-cuda-nvrtc==13.0.88), \
             set CUDA_HOME to a CUDA toolkit, or DSV4_NVRTC_LIB to the library file. Searched:\n  {}",
            tried.join("\n  ")
        ));
    };
    let builtins = lib_dir.as_deref().and_then(|d| {
        let rd = std::fs::read_dir(d).ok()?;
        let mut files: Vec<PathBuf> = rd.flatten().map(|e| e.path()).filter(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("libnvrtc-builtins.so"))).collect();
        files.sort();
        // SAFETY: as for libnvrtc itself.
        files.iter().find_map(|f| unsafe { libloading::Library::new(f) }.ok())
    });
    // SAFETY: each symbol is looked up by its documented NVRTC name and given its
    // documented C signature (nvrtc.h); the library stays loaded in `_lib` while `api` lives.
    let api = unsafe {
        macro_rules! sym {
            ($name:literal) => {
                *library.get(concat!($name, "\0").as_bytes()).map_err(|e| format!("{where_}: missing symbol {}: {e}", $name))?
            };
        }
        Api {
            version: sym!("nvrtcVersion"),
            create: sym!("nvrtcCreateProgram"),
            compile: sym!("nvrtcCompileProgram"),
            log_size: sym!("nvrtcGetProgramLogSize"),
            log: sym!("nvrtcGetProgramLog"),
            cubin_size: sym!("nvrtcGetCUBINSize"),
            cubin: sym!("nvrtcGetCUBIN"),
            destroy: sym!("nvrtcDestroyProgram"),
            error_string: sym!("nvrtcGetErrorString"),
        }
    };
    let (mut major, mut minor) = (0, 0);
    // SAFETY: nvrtcVersion writes two ints.
    unsafe { (api.version)(&mut major, &mut minor) };
    let py = py.unwrap_or_else(python_dirs);
    let include_dir = include_dirs(&py, lib_dir.as_deref()).into_iter().find(|d| d.join("cuda_bf16.h").is_file()).map(|d| d.canonicalize().unwrap_or(d));
    Ok(Nvrtc { _lib: library, _builtins: builtins, api, library: where_, version: (major, minor), include_dir })
}
