//! NVRTC, loaded at run time: finding libnvrtc and the CUDA headers (a toolkit, or the pip
//! wheels `nvidia-cuda-nvrtc` / `nvidia-cuda-runtime`), and compiling one kernel source of
//! `kernels/` to a CUBIN for one architecture, with the compiler log kept whole.
//!
//! No GPU is needed here: `tests/nvrtc_compile.rs` compiles every kernel on a CPU-only
//! machine, and the runtime (`runtime/`) loads the CUBINs this module produces.
//!
//! Files: `library.rs` (finding and loading libnvrtc and the CUDA headers), `compile.rs`
//! (rendering a source with its defines, compiling it, reading ptxas's report); the kernel
//! sources table is here.

include!(concat!(env!("OUT_DIR"), "/kernel_sources.rs"));

mod compile;
mod library;

pub use compile::{base_options, content_hash, parse_ptxas_info, render_source, Compiled, EntryInfo, Fnv128};
pub use library::{nvrtc, Nvrtc};

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_file_is_in_the_table() {
        assert!(kernel_source("common.cuh").is_some());
        assert!(kernel_files().count() > 0);
    }
}
