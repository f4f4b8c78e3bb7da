//! The `#[repr(C)]` params structs of every kernel family, in one table, and the
//! `DSV4_PARAMS_SIZE(Type, bytes)` lines of the kernel headers they mirror
//! (`tests/params_layout.rs` checks that the two agree).

use crate::nvrtc::KERNEL_SOURCES;

/// `(struct name, size in bytes)` of every Rust params struct.
pub fn rust_params_sizes() -> Vec<(&'static str, usize)> {
    [crate::sinkhorn::PARAMS_SIZES, crate::qnorm_rope::PARAMS_SIZES, crate::sparse_indices::PARAMS_SIZES, crate::sparse_attention::PARAMS_SIZES, crate::indexer::PARAMS_SIZES, crate::runtime::PARAMS_SIZES].concat()
}

/// `(struct name, size in bytes, header path)` of every `DSV4_PARAMS_SIZE(Type, bytes);`
/// line in the kernel headers.
pub fn header_params_sizes() -> Vec<(String, usize, &'static str)> {
    let mut out = Vec::new();
    for (path, src) in KERNEL_SOURCES.iter().filter(|(p, _)| p.ends_with(".cuh")) {
        for line in src.lines() {
            let Some(args) = line.trim().strip_prefix("DSV4_PARAMS_SIZE(") else { continue };
            let Some((name, rest)) = args.split_once(',') else { continue };
            let Ok(bytes) = rest.trim().trim_end_matches(';').trim_end_matches(')').trim().parse::<usize>() else { continue };
            out.push((name.trim().to_string(), bytes, *path));
        }
    }
    out
}
