//! Kernel configurations and the one place a process may change them.
//!
//! Each kernel family has a typed config (declared with [`kernel_config!`]): a struct whose
//! `Default` is the measured choice, one doc line per field saying why. Launchers get theirs
//! from [`configured`] and render it into the kernel's defines themselves; no launcher reads
//! the environment.
//!
//! - Default build (the CLI release, the wheel): [`configured`] returns `Default` — the
//!   shipped kernels are exactly the measured ones, whatever the environment holds.
//! - `tuning` cargo feature (the lab): `DSV4_TUNE="prefix.field=value,..."` and
//!   `dsv4 bench --config prefix.field=value` (through [`set_overrides`]) change fields by
//!   name, e.g. `sa_bwd.c0_chunks=3`. `DSV4_EXTRA_DEFINES` (raw `NAME=VALUE` defines added
//!   to every kernel a process compiles) is read by the runtime in that build only.

use dsv4_core::{Error, Result};

/// A kernel family's configuration: `Default` is the shipped choice; `set` changes one field
/// by its name (the part after `prefix.` in a tuning key).
pub trait KernelConfig: Default {
    /// The key prefix of this config's fields (`sa_bwd` for `sa_bwd.c0_chunks`).
    const PREFIX: &'static str;
    /// Set `field` from `value`: `Ok(false)` when the config has no such field, an error when
    /// the value does not parse.
    fn set(&mut self, field: &str, value: &str) -> Result<bool>;
    /// Every field name, for error messages and `dsv4 bench --config help`.
    fn fields() -> &'static [&'static str];
}

/// Declares a [`KernelConfig`]: the struct, its `Default` (each field's `= value`) and `set`.
///
/// ```ignore
/// kernel_config! {
///     /// The Hopper attention backward.
///     pub struct SaBwdConfig("sa_bwd") {
///         /// 2 chunks of the first column block: 1.80 vs 1.84 ms at S=4096 (DECISIONS.md).
///         pub c0_chunks: u32 = 2,
///     }
/// }
/// ```
#[macro_export]
macro_rules! kernel_config {
    (
        $(#[$meta:meta])*
        $vis:vis struct $name:ident($prefix:literal) {
            $( $(#[$fmeta:meta])* $fvis:vis $field:ident : $ty:ty = $default:expr ),* $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq)]
        $vis struct $name { $( $(#[$fmeta])* $fvis $field: $ty ),* }

        impl Default for $name {
            fn default() -> Self {
                Self { $( $field: $default ),* }
            }
        }

        impl $crate::tuning::KernelConfig for $name {
            const PREFIX: &'static str = $prefix;
            fn set(&mut self, field: &str, value: &str) -> dsv4_core::Result<bool> {
                match field {
                    $( stringify!($field) => {
                        self.$field = $crate::tuning::parse_value(concat!($prefix, ".", stringify!($field)), value)?;
                        Ok(true)
                    } )*
                    _ => Ok(false),
                }
            }
            fn fields() -> &'static [&'static str] {
                &[$( stringify!($field) ),*]
            }
        }
    };
}

/// Parse a tuning value (`bool` also takes `0`/`1`).
pub fn parse_value<T: TuningValue>(key: &str, value: &str) -> Result<T> {
    T::parse(value).ok_or_else(|| Error::Value { op: "tuning", arg: "key", expected: format!("`{key}` = {}", T::KIND), got: value.to_string() })
}

/// Types a config field may have.
pub trait TuningValue: Sized {
    const KIND: &'static str;
    fn parse(s: &str) -> Option<Self>;
}

impl TuningValue for bool {
    const KIND: &'static str = "a bool (0/1/true/false)";
    fn parse(s: &str) -> Option<Self> {
        match s {
            "1" | "true" => Some(true),
            "0" | "false" => Some(false),
            _ => None,
        }
    }
}

macro_rules! tuning_int {
    ($($t:ty),*) => {$(
        impl TuningValue for $t {
            const KIND: &'static str = stringify!($t);
            fn parse(s: &str) -> Option<Self> {
                s.parse().ok()
            }
        }
    )*};
}
tuning_int!(u32, usize, i32);

/// `C::default()` with the process's tuning overrides applied (the `tuning` feature), or
/// `C::default()` alone (the default build).
pub fn configured<C: KernelConfig>() -> Result<C> {
    #[allow(unused_mut)]
    let mut config = C::default();
    #[cfg(feature = "tuning")]
    for (key, value) in lab::overrides().iter() {
        if let Some(field) = key.strip_prefix(C::PREFIX).and_then(|k| k.strip_prefix('.')) {
            if !config.set(field, value)? {
                return Err(Error::value("tuning", "key", format!("one of {}.{{{}}}", C::PREFIX, C::fields().join(", ")), key));
            }
        }
    }
    Ok(config)
}

/// One compile unit a launcher can select: a kernel file and the defines its config renders.
#[derive(Clone, Debug, PartialEq)]
pub struct Variant {
    /// The kernel file under `kernels/` (e.g. `sparse_attention/fwd_sm90.cu`).
    pub path: &'static str,
    /// The architectures it is compiled for (`sm_90a` only for the Hopper kernels).
    pub archs: &'static [&'static str],
    pub defines: Vec<(&'static str, String)>,
}

/// Every variant the launchers can select, rendered from their configs: what the kernel
/// compile test builds (a file listed here is compiled with these define sets only).
pub fn compile_variants() -> Vec<Variant> {
    let mut v = Vec::new();
    v.extend(crate::sparse_attention::compile_variants());
    v.extend(crate::indexer::compile_variants());
    v.extend(crate::sinkhorn::compile_variants());
    v.extend(crate::qnorm_rope::compile_variants());
    v
}

/// Whether this build honours tuning overrides (the `tuning` feature).
pub const ENABLED: bool = cfg!(feature = "tuning");

/// Replace the process's overrides (`dsv4 bench --config`): `key=value` pairs. An error in
/// the default build, which has none.
pub fn set_overrides(pairs: &[(String, String)]) -> Result<()> {
    #[cfg(feature = "tuning")]
    {
        *lab::OVERRIDES.write().unwrap_or_else(|p| p.into_inner()) = Some(pairs.to_vec());
        Ok(())
    }
    #[cfg(not(feature = "tuning"))]
    {
        let _ = pairs;
        Err(Error::Unavailable { backend: "cuda".into(), op: "tuning", reason: "overrides need a build with the `tuning` cargo feature".into() })
    }
}

/// Raw defines added to every kernel (`DSV4_EXTRA_DEFINES`, the `tuning` feature only; empty
/// otherwise). Read by the runtime, which lets a launcher's own defines win.
pub fn extra_defines() -> &'static [(String, String)] {
    #[cfg(feature = "tuning")]
    {
        lab::extra_defines()
    }
    #[cfg(not(feature = "tuning"))]
    {
        &[]
    }
}

/// `NAME=VALUE` pairs separated by commas (a bare `NAME` means `NAME=1`).
pub fn parse_pairs(s: &str) -> Vec<(String, String)> {
    s.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| match s.split_once('=') {
            Some((k, v)) => (k.trim().to_string(), v.trim().to_string()),
            None => (s.to_string(), "1".to_string()),
        })
        .collect()
}

#[cfg(feature = "tuning")]
mod lab {
    use std::sync::{OnceLock, RwLock};

    pub(super) static OVERRIDES: RwLock<Option<Vec<(String, String)>>> = RwLock::new(None);

    /// `set_overrides`' pairs, else `DSV4_TUNE`'s.
    pub(super) fn overrides() -> Vec<(String, String)> {
        if let Some(v) = OVERRIDES.read().unwrap_or_else(|p| p.into_inner()).as_ref() {
            return v.clone();
        }
        static ENV: OnceLock<Vec<(String, String)>> = OnceLock::new();
        ENV.get_or_init(|| super::parse_pairs(&std::env::var("DSV4_TUNE").unwrap_or_default())).clone()
    }

    pub(super) fn extra_defines() -> &'static [(String, String)] {
        static EXTRA: OnceLock<Vec<(String, String)>> = OnceLock::new();
        EXTRA.get_or_init(|| super::parse_pairs(&std::env::var("DSV4_EXTRA_DEFINES").unwrap_or_default()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    kernel_config! {
        /// A test config.
        pub struct Demo("demo") {
            /// A count.
            pub n: u32 = 4,
            /// A switch.
            pub on: bool = true,
        }
    }

    #[test]
    fn defaults_and_set() {
        let mut d = Demo::default();
        assert_eq!((d.n, d.on), (4, true));
        assert!(d.set("n", "7").unwrap());
        assert!(d.set("on", "0").unwrap());
        assert_eq!((d.n, d.on), (7, false));
        assert!(!d.set("missing", "1").unwrap());
        let e = d.set("n", "x").unwrap_err().to_string();
        assert!(e.contains("demo.n") && e.contains("= x"), "{e}");
        assert_eq!(Demo::fields(), &["n", "on"]);
    }

    #[test]
    fn parse_pairs_forms() {
        assert_eq!(parse_pairs(" A=1, B ,,C = x"), vec![("A".into(), "1".into()), ("B".into(), "1".into()), ("C".into(), "x".into())]);
    }

    #[cfg(not(feature = "tuning"))]
    #[test]
    fn default_build_ignores_overrides() {
        assert!(set_overrides(&[("demo.n".into(), "9".into())]).is_err());
        assert_eq!(configured::<Demo>().unwrap(), Demo::default());
        assert!(extra_defines().is_empty());
    }
}
