//! Every params struct has the same size in Rust (`#[repr(C)]`) and in its kernel header
//! (`DSV4_PARAMS_SIZE(Type, bytes)`, a static_assert NVRTC checks when compiling). Both
//! sides also assert the size at compile time; this test ties the two numbers together.

use dsv4_cuda::params::{header_params_sizes, rust_params_sizes};

#[test]
fn params_sizes_match_headers() {
    let rust = rust_params_sizes();
    let headers = header_params_sizes();
    let mut problems = Vec::new();
    for (name, bytes, path) in &headers {
        match rust.iter().find(|(n, _)| n == name) {
            Some((_, r)) if r == bytes => {}
            Some((_, r)) => problems.push(format!("{name}: {bytes} bytes in kernels/{path}, {r} in Rust")),
            None => problems.push(format!("{name} (kernels/{path}) has no Rust mirror listed in a PARAMS_SIZES table")),
        }
    }
    for (name, bytes) in &rust {
        if !headers.iter().any(|(n, _, _)| n == name) {
            problems.push(format!("{name} ({bytes} bytes in Rust) has no DSV4_PARAMS_SIZE line in any kernel header"));
        }
    }
    for (name, bytes, path) in &headers {
        println!("{name}: {bytes} bytes (kernels/{path})");
    }
    assert!(problems.is_empty(), "params layout mismatches:\n  {}", problems.join("\n  "));
}
