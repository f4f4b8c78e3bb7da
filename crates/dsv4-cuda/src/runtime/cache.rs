//! The compiled-CUBIN disk cache: one checksummed entry (ptxas log and CUBIN) per rendered
//! source, options and NVRTC version, written by atomic rename.

use std::path::PathBuf;

use dsv4_core::Result;

use crate::nvrtc::{self, EntryInfo};

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
}
