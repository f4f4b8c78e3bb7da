//! Embeds every kernel source under `kernels/` (`*.cu`, `*.cuh`) into the library as a
//! generated table of `(path relative to kernels/, contents)`, so no file list is kept by
//! hand: add a file and it is compiled by the runtime and by `tests/nvrtc_compile.rs`.

use std::path::{Path, PathBuf};

fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("reading {}: {e}", dir.display())).map(|e| e.unwrap().path()).collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            walk(&p, out);
        } else if matches!(p.extension().and_then(|x| x.to_str()), Some("cu" | "cuh")) {
            out.push(p);
        }
    }
}

fn main() {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap()).join("kernels");
    println!("cargo:rerun-if-changed=kernels");
    let mut files = Vec::new();
    walk(&root, &mut files);
    let mut table = String::from("/// `(path under kernels/, source)` for every `.cu` and `.cuh` file, sorted by path.\npub static KERNEL_SOURCES: &[(&str, &str)] = &[\n");
    for f in &files {
        // Directories are watched by mtime of their entries only; watch each file too.
        println!("cargo:rerun-if-changed={}", f.display());
        let rel = f.strip_prefix(&root).unwrap().to_string_lossy().replace('\\', "/");
        table.push_str(&format!("    ({rel:?}, include_str!({:?})),\n", f.display().to_string()));
    }
    table.push_str("];\n");
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap()).join("kernel_sources.rs");
    std::fs::write(out, table).unwrap();
}
