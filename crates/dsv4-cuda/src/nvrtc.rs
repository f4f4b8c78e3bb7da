//! NVRTC, loaded at run time: finding libnvrtc and the CUDA headers (a toolkit, or the pip
//! wheels `nvidia-cuda-nvrtc` / `nvidia-cuda-runtime`), and compiling one kernel source of
//! `kernels/` to a CUBIN for one architecture, with the compiler log kept whole.
//!
//! No GPU is needed here: `tests/nvrtc_compile.rs` compiles every kernel on a CPU-only
//! machine, and the runtime (`runtime.rs`) loads the CUBINs this module produces.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use dsv4_core::{Error, Result};

include!(concat!(env!("OUT_DIR"), "/kernel_sources.rs"));

/// The source of `path` (relative to `kernels/`), if it exists.
pub fn kernel_source(path: &str) -> Option<&'static str> {
    KERNEL_SOURCES.iter().find(|(p, _)| *p == path).map(|(_, s)| *s)
}

/// Every compilable kernel file (`*.cu`) under `kernels/`.
pub fn kernel_files() -> impl Iterator<Item = (&'static str, &'static str)> {
    KERNEL_SOURCES.iter().copied().filter(|(p, _)| p.ends_with(".cu"))
}

/// The architectures a kernel file declares it supports, from a line
/// `// dsv4-archs: sm_90a sm_100a` near its top (default: every architecture).
pub fn declared_archs(source: &str) -> Option<Vec<String>> {
    source.lines().take(40).find_map(|l| l.trim().strip_prefix("// dsv4-archs:").map(|rest| rest.split_whitespace().map(str::to_string).collect()))
}

/// Extra define sets a kernel file asks the compile test to try besides its defaults, one
/// per line `// dsv4-test-defines: NAME=VALUE NAME2=VALUE2` near its top.
pub fn test_variants(source: &str) -> Vec<Vec<(String, String)>> {
    source
        .lines()
        .take(60)
        .filter_map(|l| l.trim().strip_prefix("// dsv4-test-defines:"))
        .map(|rest| rest.split_whitespace().map(|kv| kv.split_once('=').map(|(k, v)| (k.to_string(), v.to_string())).unwrap_or((kv.to_string(), "1".to_string()))).collect())
        .collect()
}

type NvrtcProgram = *mut c_void;
type NvrtcResult = c_int;

/// The NVRTC entry points this crate uses.
struct Api {
    version: unsafe extern "C" fn(*mut c_int, *mut c_int) -> NvrtcResult,
    create: unsafe extern "C" fn(*mut NvrtcProgram, *const c_char, *const c_char, c_int, *const *const c_char, *const *const c_char) -> NvrtcResult,
    compile: unsafe extern "C" fn(NvrtcProgram, c_int, *const *const c_char) -> NvrtcResult,
    log_size: unsafe extern "C" fn(NvrtcProgram, *mut usize) -> NvrtcResult,
    log: unsafe extern "C" fn(NvrtcProgram, *mut c_char) -> NvrtcResult,
    cubin_size: unsafe extern "C" fn(NvrtcProgram, *mut usize) -> NvrtcResult,
    cubin: unsafe extern "C" fn(NvrtcProgram, *mut c_char) -> NvrtcResult,
    destroy: unsafe extern "C" fn(*mut NvrtcProgram) -> NvrtcResult,
    error_string: unsafe extern "C" fn(NvrtcResult) -> *const c_char,
}

/// A loaded libnvrtc and the CUDA include directory found beside it (or elsewhere).
pub struct Nvrtc {
    _lib: libloading::Library,
    /// libnvrtc-builtins from the same directory, loaded first: libnvrtc opens it by soname
    /// at compile time, and the pip wheels do not put their directory on the loader path.
    _builtins: Option<libloading::Library>,
    api: Api,
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

/// Registers, spills and stack of one entry point, from ptxas's info lines.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EntryInfo {
    pub entry: String,
    pub registers: u32,
    pub stack_bytes: u32,
    pub spill_stores: u32,
    pub spill_loads: u32,
    pub shared_bytes: u32,
}

impl std::fmt::Display for EntryInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {} registers, {} B stack, {} B spill stores, {} B spill loads, {} B static smem", self.entry, self.registers, self.stack_bytes, self.spill_stores, self.spill_loads, self.shared_bytes)
    }
}

/// Parse ptxas `-v` output (as NVRTC returns it in the program log).
pub fn parse_ptxas_info(log: &str) -> Vec<EntryInfo> {
    let mut out: Vec<EntryInfo> = Vec::new();
    let num_before = |line: &str, key: &str| -> Option<u32> {
        let i = line.find(key)?;
        line[..i].split_whitespace().last()?.parse().ok()
    };
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            out.push(EntryInfo { entry: rest.split('\'').next().unwrap_or("").to_string(), ..Default::default() });
        } else if let Some(e) = out.last_mut() {
            if line.contains("bytes stack frame") {
                e.stack_bytes = num_before(line, "bytes stack frame").unwrap_or(0);
                e.spill_stores = num_before(line, "bytes spill stores").unwrap_or(0);
                e.spill_loads = num_before(line, "bytes spill loads").unwrap_or(0);
            } else if line.contains("Used") && line.contains("registers") {
                e.registers = num_before(line, "registers").unwrap_or(0);
                e.shared_bytes = num_before(line, "bytes smem").unwrap_or(0);
            }
        }
    }
    out
}

/// A compiled kernel source.
#[derive(Clone, Debug)]
pub struct Compiled {
    pub cubin: Vec<u8>,
    /// The whole NVRTC log (ptxas info lines included).
    pub log: String,
    pub options: Vec<String>,
    pub entries: Vec<EntryInfo>,
}

impl Compiled {
    /// Log lines that are warnings (ptxas info lines are not).
    pub fn warnings(&self) -> Vec<&str> {
        self.log.lines().filter(|l| l.to_ascii_lowercase().contains("warning")).collect()
    }
}

/// The options every kernel is compiled with (besides `-I` and the defines).
pub fn base_options(arch: &str) -> Vec<String> {
    vec![format!("--gpu-architecture={arch}"), "--std=c++17".into(), "-lineinfo".into(), "--ptxas-options=-v".into(), "-DDSV4_NVRTC=1".into()]
}

/// The text NVRTC compiles: one `#define` per define, then the file (with `#line` so
/// errors name the file and its own line numbers).
pub fn render_source(path: &str, defines: &[(&str, String)]) -> Result<String> {
    let src = kernel_source(path).ok_or_else(|| Error::Cuda(format!("no kernel source `{path}` under kernels/ (known: {})", KERNEL_SOURCES.iter().map(|(p, _)| *p).collect::<Vec<_>>().join(", "))))?;
    let mut text = String::new();
    for (name, value) in defines {
        text.push_str(&format!("#define {name} {value}\n"));
    }
    text.push_str(&format!("#line 1 \"{path}\"\n{src}"));
    Ok(text)
}

/// Headers handed to NVRTC for `path`: every `.cuh` by its path under `kernels/`, plus the
/// top-level ones and `path`'s siblings by bare name (top-level wins on a clash).
fn headers_for(path: &str) -> Vec<(String, &'static str)> {
    let dir = path.rsplit_once('/').map(|(d, _)| d).unwrap_or("");
    let mut hs: Vec<(String, &'static str)> = Vec::new();
    for (p, s) in KERNEL_SOURCES.iter().filter(|(p, _)| p.ends_with(".cuh")) {
        hs.push((p.to_string(), s));
    }
    for (p, s) in KERNEL_SOURCES.iter().filter(|(p, _)| p.ends_with(".cuh")) {
        if let Some((d, name)) = p.rsplit_once('/') {
            if d == dir && !hs.iter().any(|(n, _)| n == name) {
                hs.push((name.to_string(), s));
            }
        }
    }
    hs
}

/// A hash of everything a compile result depends on apart from the NVRTC version:
/// the rendered source, every header, and the options.
pub fn content_hash(rendered: &str, options: &[String]) -> u128 {
    let mut h = Fnv128::new();
    h.write(rendered.as_bytes());
    for (p, s) in KERNEL_SOURCES.iter().filter(|(p, _)| p.ends_with(".cuh")) {
        h.write(p.as_bytes());
        h.write(s.as_bytes());
    }
    for o in options {
        h.write(o.as_bytes());
    }
    h.finish()
}

/// FNV-1a, 128-bit: a stable content hash for cache keys (not for security).
pub struct Fnv128(u128);

impl Fnv128 {
    pub fn new() -> Self {
        Fnv128(0x6c62272e07bb014262b821756295c58d)
    }
    pub fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= b as u128;
            self.0 = self.0.wrapping_mul(0x0000000001000000000000000000013B);
        }
        // Separate consecutive fields.
        self.0 ^= 0xff;
        self.0 = self.0.wrapping_mul(0x0000000001000000000000000000013B);
    }
    pub fn finish(&self) -> u128 {
        self.0
    }
}

impl Default for Fnv128 {
    fn default() -> Self {
        Self::new()
    }
}

impl Nvrtc {
    fn err_str(&self, r: NvrtcResult) -> String {
        // SAFETY: nvrtcGetErrorString returns a static NUL-terminated string for any code.
        let p = unsafe { (self.api.error_string)(r) };
        if p.is_null() {
            format!("NVRTC error {r}")
        } else {
            // SAFETY: non-null, NUL-terminated, static.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
    }

    /// The full option list for `arch` (base options, then `-I` for the CUDA headers).
    pub fn options(&self, arch: &str) -> Vec<String> {
        let mut o = base_options(arch);
        if let Some(inc) = &self.include_dir {
            o.push(format!("--include-path={}", inc.display()));
        }
        o
    }

    /// Compile `path` (under `kernels/`) with `defines` for `arch` (e.g. `sm_90a`) to a CUBIN.
    pub fn compile(&self, path: &str, defines: &[(&str, String)], arch: &str) -> Result<Compiled> {
        let rendered = render_source(path, defines)?;
        self.compile_rendered(path, &rendered, arch)
    }

    /// Compile an already rendered source (see [`render_source`]).
    pub fn compile_rendered(&self, path: &str, rendered: &str, arch: &str) -> Result<Compiled> {
        let options = self.options(arch);
        match self.compile_with(path, rendered, arch, options.clone()) {
            // An NVRTC too old for `--ptxas-options`: compile without the ptxas report.
            Err(Error::Compile { log, .. }) if log.starts_with("NVRTC_ERROR_INVALID_OPTION") => self.compile_with(path, rendered, arch, options.into_iter().filter(|o| !o.starts_with("--ptxas-options")).collect()),
            r => r,
        }
    }

    fn compile_with(&self, path: &str, rendered: &str, arch: &str, options: Vec<String>) -> Result<Compiled> {
        let cuda = |what: &str, r: NvrtcResult| Error::Cuda(format!("nvrtc: {what} for `{path}` ({arch}): {}", self.err_str(r)));
        let c_src = CString::new(rendered).map_err(|_| Error::Cuda(format!("kernel `{path}` contains a NUL byte")))?;
        let c_name = CString::new(path).map_err(|_| Error::Cuda(format!("kernel path `{path}` contains a NUL byte")))?;
        let headers = headers_for(path);
        let c_hdr_src: Vec<CString> = headers.iter().map(|(_, s)| CString::new(*s).unwrap_or_default()).collect();
        let c_hdr_name: Vec<CString> = headers.iter().map(|(n, _)| CString::new(n.as_str()).unwrap_or_default()).collect();
        let hdr_src_ptrs: Vec<*const c_char> = c_hdr_src.iter().map(|c| c.as_ptr()).collect();
        let hdr_name_ptrs: Vec<*const c_char> = c_hdr_name.iter().map(|c| c.as_ptr()).collect();
        let c_opts: Vec<CString> = options.iter().map(|o| CString::new(o.as_str()).unwrap_or_default()).collect();
        let opt_ptrs: Vec<*const c_char> = c_opts.iter().map(|c| c.as_ptr()).collect();

        let mut prog: NvrtcProgram = std::ptr::null_mut();
        // SAFETY: every pointer is a live NUL-terminated CString owned above; the two header
        // arrays have `headers.len()` entries each.
        let r = unsafe { (self.api.create)(&mut prog, c_src.as_ptr(), c_name.as_ptr(), headers.len() as c_int, hdr_src_ptrs.as_ptr(), hdr_name_ptrs.as_ptr()) };
        if r != 0 {
            return Err(cuda("nvrtcCreateProgram", r));
        }
        let _guard = ProgramGuard { api: &self.api, prog };
        // SAFETY: `prog` was created above; `opt_ptrs` holds `options.len()` live C strings.
        let compile_result = unsafe { (self.api.compile)(prog, opt_ptrs.len() as c_int, opt_ptrs.as_ptr()) };
        let mut log_len = 0usize;
        // SAFETY: `prog` is live; the log buffer is sized by nvrtcGetProgramLogSize.
        let log = unsafe {
            let r = (self.api.log_size)(prog, &mut log_len);
            if r != 0 {
                return Err(cuda("nvrtcGetProgramLogSize", r));
            }
            let mut buf = vec![0u8; log_len.max(1)];
            let r = (self.api.log)(prog, buf.as_mut_ptr() as *mut c_char);
            if r != 0 {
                return Err(cuda("nvrtcGetProgramLog", r));
            }
            String::from_utf8_lossy(&buf[..buf.iter().position(|&b| b == 0).unwrap_or(buf.len())]).into_owned()
        };
        if compile_result != 0 {
            return Err(Error::Compile { kernel: path.to_string(), arch: arch.to_string(), options: options.join(" "), log: format!("{}\n{log}", self.err_str(compile_result)) });
        }
        let mut size = 0usize;
        // SAFETY: `prog` compiled successfully; the buffer is sized by nvrtcGetCUBINSize.
        let cubin = unsafe {
            let r = (self.api.cubin_size)(prog, &mut size);
            if r != 0 {
                return Err(cuda("nvrtcGetCUBINSize", r));
            }
            let mut buf = vec![0u8; size];
            let r = (self.api.cubin)(prog, buf.as_mut_ptr() as *mut c_char);
            if r != 0 {
                return Err(cuda("nvrtcGetCUBIN", r));
            }
            buf
        };
        if cubin.is_empty() {
            return Err(Error::Compile { kernel: path.to_string(), arch: arch.to_string(), options: options.join(" "), log: format!("NVRTC produced no CUBIN (is `{arch}` a real architecture?)\n{log}") });
        }
        let entries = parse_ptxas_info(&log);
        Ok(Compiled { cubin, log, options, entries })
    }
}

struct ProgramGuard<'a> {
    api: &'a Api,
    prog: NvrtcProgram,
}

impl Drop for ProgramGuard<'_> {
    fn drop(&mut self) {
        // SAFETY: `prog` was created by nvrtcCreateProgram and is destroyed once, here.
        unsafe { (self.api.destroy)(&mut self.prog) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ptxas_info_is_parsed() {
        let log = "ptxas info    : 0 bytes gmem\nptxas info    : Compiling entry function 'sinkhorn_fwd' for 'sm_90a'\nptxas info    : Function properties for sinkhorn_fwd\n    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\nptxas info    : Used 40 registers, used 0 barriers, 1024 bytes smem, 400 bytes cmem[0]\n";
        let e = parse_ptxas_info(log);
        assert_eq!(e, vec![EntryInfo { entry: "sinkhorn_fwd".into(), registers: 40, stack_bytes: 8, spill_stores: 4, spill_loads: 4, shared_bytes: 1024 }]);
    }

    #[test]
    fn every_kernel_file_is_in_the_table() {
        assert!(kernel_source("common.cuh").is_some());
        assert!(kernel_files().count() > 0);
    }
}
