//! Compiling one kernel source: the rendered text (defines, `#line`), the headers handed
//! to NVRTC, the options, the content hash of a compile, and ptxas's per-entry report.

use std::ffi::{c_char, c_int, CStr, CString};

use dsv4_core::{Error, Result};

use super::library::{Api, Nvrtc, NvrtcProgram, NvrtcResult};
use super::{kernel_source, KERNEL_SOURCES};

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
}
