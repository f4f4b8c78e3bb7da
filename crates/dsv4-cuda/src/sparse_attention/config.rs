//! The kernels' configurations (`tuning::configured`) and the one place each kernel's
//! defines are rendered: from the config, the tile (`tiles.rs`) and what the call decided
//! (a TMA map made, the backward's mode). The measurements behind the defaults are in
//! docs/perf/LOG.md (`vNN`) and docs/perf/DECISIONS.md.

use super::tiles::{choose_tiles, kernel_d, Pass, Tiles};
use crate::kernel_config;
use crate::tuning::Variant;

/// A kernel's defines, as `Gpu::kernel` takes them.
pub(crate) type Defines = Vec<(&'static str, String)>;

kernel_config! {
    /// The Hopper forward (`fwd_sm90.cu`).
    pub struct SaFwdConfig("sa_fwd") {
        /// Q tiles by TMA where q can be mapped (else, as when no map can be made, the producer's cp.async): H200 S=16384 2.33-2.34 against 2.40-2.44 ms (LOG v29).
        pub q_tma: bool = true,
        /// CTAs of its persistent wave; 0: min(rows, SMs / head blocks) (rows carried across a CTA's ring: S=16384 2.63 -> 2.49 ms against one CTA a row, v17). N > 0 caps it (tests: several rows a CTA on small shapes).
        pub ctas: u32 = 0,
    }
}

kernel_config! {
    /// The Hopper backward (`bwd_sm90.cu`).
    pub struct SaBwdConfig("sa_bwd") {
        /// Q and dO tiles by TMA where both can be mapped (else the producer's cp.async): S=4096 1.7038 against 1.7283 ms, level at S=16384 (v29).
        pub qdo_tma: bool = true,
        /// The atomic mode's dKV chunks (of 8) that consumer 0 takes, 0..=7: S=16384 8.00-8.06 ms with 2 against 8.07-8.08 with 1 and 8.09-8.10 with 3 (v31); 4 lost 5 % (v27).
        pub c0_chunks: u32 = 2,
        /// The same for the deterministic mode (16-bit rows): 10.72-10.73 ms with 2 against 10.82-10.84 with 3 at S=16384 (v31).
        pub det_c0_chunks: u32 = 2,
    }
}

kernel_config! {
    /// The deterministic backward: its waves (`deterministic.rs`) and reduce (`bwd_reduce.cu`).
    pub struct SaDetConfig("sa_det") {
        /// Hopper: rows from the last to the first, so the short remainder wave is a causal selection's cheap first rows: S=4096 2.527 -> 2.508 ms (v23).
        pub rows_desc: bool = true,
        /// One inverted index for all rows where it fits a quarter of the workspace (else one per wave): S=16384 14.40-14.43 -> 14.27 ms (v21).
        pub global_index: bool = true,
        /// Waves of whole rounds of CTAs where that keeps 3/4 of the rows that fit: S=16384, 2 GiB, 11.68-11.72 -> 11.41-11.42 ms (v23).
        pub whole_rounds: bool = true,
        /// The global index kept with a plan (built by its first deterministic backward): S=16384 13.92-13.94 -> 13.16-13.18 ms (v21).
        pub plan_index: bool = true,
        /// The last wave's reduce writes dkv (no conversion launch): at most 0.01 ms (v25).
        pub fused_convert: bool = true,
        /// Entry groups a key of the 16-bit reduce (1..=8; 64 threads each): 8 / 2 lost 1-3 % against 4 (v21, v25).
        pub reduce_groups: u32 = 4,
    }
}

/// `fwd_sm90.cu`: the Q loads by TMA when the launcher made q's map (`q_tma`).
pub(crate) fn fwd_sm90_defines(q_tma: bool) -> Defines {
    vec![("SA90_Q_TMA", (q_tma as u8).to_string())]
}

/// `bwd_sm90.cu`: the mode, consumer 0's dKV chunks for it, and the Q / dO loads by TMA when
/// the launcher made both maps (`qdo_tma`).
pub(crate) fn bwd_sm90_defines(c: &SaBwdConfig, deterministic: bool, qdo_tma: bool) -> Defines {
    let c0 = if deterministic { c.det_c0_chunks } else { c.c0_chunks };
    vec![("SA90_BWD_DET", (deterministic as u8).to_string()), ("SA90_BWD_C0_CHUNKS", c0.to_string()), ("SA90_BWD_QDO_TMA", (qdo_tma as u8).to_string())]
}

/// `fwd.cu` at kernel head dim `d` (a multiple of 64) with tile `t`.
pub(crate) fn fwd_defines(d: usize, t: &Tiles, natural_exp: bool, dedup: bool) -> Defines {
    let mut v = tile_defines(d, t, natural_exp);
    v.push(("SA_DEDUP", (dedup as i32).to_string()));
    v
}

/// `bwd.cu` at kernel head dim `d` with tile `t`.
pub(crate) fn bwd_defines(d: usize, t: &Tiles, natural_exp: bool) -> Defines {
    tile_defines(d, t, natural_exp)
}

fn tile_defines(d: usize, t: &Tiles, natural_exp: bool) -> Defines {
    vec![("SA_D", d.to_string()), ("SA_HB", t.hb.to_string()), ("SA_BN", t.bn.to_string()), ("SA_DW", t.dw.to_string()), ("SA_NATURAL_EXP", (natural_exp as i32).to_string())]
}

/// `bwd_reduce.cu` (every kernel of it: one module): the 16-bit reduce's entry groups.
pub(crate) fn reduce_defines(c: &SaDetConfig) -> Defines {
    vec![("SA_REDUCE_GROUPS", c.reduce_groups.to_string())]
}

/// Opt-in shared memory per block the compile variants' tiles are chosen for: H100/H200
/// (sm_90a) and A100 (sm_80).
const SMEM: [(&str, usize); 2] = [("sm_90a", 232_448), ("sm_80", 166_912)];
const SM90: &[&str] = &["sm_90a"];

/// (head dim, heads) of the portable kernels' compile variants: DeepSeek-V4 (D = 512, H = 64
/// and 128) and the GPU tests' small shapes (D run at `kernel_d`).
const SHAPES: [(usize, usize); 7] = [(512, 64), (512, 128), (8, 3), (128, 17), (320, 33), (448, 64), (128, 128)];

/// Every variant the launchers select with the default configs, for the shapes above (the
/// kernel compile test builds these): the Hopper kernels' modes and TMA fallbacks; the
/// portable kernels' tiles on sm_90a and sm_80, with the reference rounding and (forward)
/// the dense oracle's dedup at D = 512 and D = 64.
pub(crate) fn compile_variants() -> Vec<Variant> {
    let bwd = SaBwdConfig::default();
    let det = SaDetConfig::default();
    let mut v = Vec::new();
    for q_tma in [true, false] {
        v.push(Variant { path: "sparse_attention/fwd_sm90.cu", archs: SM90, defines: fwd_sm90_defines(q_tma) });
        for deterministic in [false, true] {
            v.push(Variant { path: "sparse_attention/bwd_sm90.cu", archs: SM90, defines: bwd_sm90_defines(&bwd, deterministic, q_tma) });
        }
    }
    for (arch, smem) in SMEM {
        let archs: &'static [&'static str] = if arch == "sm_90a" { SM90 } else { &["sm_80"] };
        for (i, (d, h)) in SHAPES.into_iter().enumerate() {
            let dp = kernel_d(d);
            let options: &[(bool, bool)] = if i == 0 || i == 2 { &[(false, false), (true, false), (false, true)] } else { &[(false, false)] };
            for &(natural_exp, dedup) in options {
                let (Some(tf), Some(tb)) = (choose_tiles(Pass::Fwd, dp, h, smem), choose_tiles(Pass::Bwd, dp, h, smem)) else { continue };
                push_new(&mut v, Variant { path: "sparse_attention/fwd.cu", archs, defines: fwd_defines(dp, &tf, natural_exp, dedup) });
                if !dedup {
                    push_new(&mut v, Variant { path: "sparse_attention/bwd.cu", archs, defines: bwd_defines(dp, &tb, natural_exp) });
                }
            }
        }
    }
    let both: &'static [&'static str] = &["sm_90a", "sm_80"];
    v.push(Variant { path: "sparse_attention/bwd_reduce.cu", archs: both, defines: reduce_defines(&det) });
    v.push(Variant { path: "sparse_attention/plan.cu", archs: both, defines: Vec::new() });
    v.push(Variant { path: "sparse_attention/pack.cu", archs: both, defines: Vec::new() });
    v
}

fn push_new(v: &mut Vec<Variant>, x: Variant) {
    if !v.contains(&x) {
        v.push(x);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(pairs: &[(&'static str, &str)]) -> Defines {
        pairs.iter().map(|&(k, v)| (k, v.to_string())).collect()
    }

    /// What the launchers passed before the configs (at bb7d6e1, default environment):
    /// forward.rs `[("SA90_Q_TMA", map made)]`; backward.rs `SA90_BWD_C0_CHUNKS` 2 (both modes:
    /// the Hopper deterministic rows were 16-bit), `SA90_BWD_DET_F16` = deterministic,
    /// `SA90_BWD_ATOMIC` = !deterministic, `SA90_BWD_QDO_TMA` = maps made; `bwd_reduce.cu`
    /// nothing (its default SA_REDUCE_GROUPS 4); tiles.rs `defines` for the portable kernels.
    #[test]
    fn hopper_defines_are_the_old_launchers() {
        let c = SaBwdConfig::default();
        assert_eq!(fwd_sm90_defines(true), s(&[("SA90_Q_TMA", "1")]));
        assert_eq!(fwd_sm90_defines(false), s(&[("SA90_Q_TMA", "0")]));
        for det in [false, true] {
            for tma in [false, true] {
                // The old kernel's SA90_BWD_DET_F16 = det and SA90_BWD_ATOMIC = !det are the
                // one define SA90_BWD_DET (the kernel's only two modes).
                let (d, t) = ((det as u8).to_string(), (tma as u8).to_string());
                assert_eq!(bwd_sm90_defines(&c, det, tma), s(&[("SA90_BWD_DET", &d), ("SA90_BWD_C0_CHUNKS", "2"), ("SA90_BWD_QDO_TMA", &t)]));
            }
        }
        assert_eq!(reduce_defines(&SaDetConfig::default()), s(&[("SA_REDUCE_GROUPS", "4")]));
    }

    #[test]
    fn portable_defines_are_the_old_launchers() {
        let h100 = 232_448;
        // DeepSeek-V4: D = 512, H = 64 and 128 (two blocks of 64 forward heads).
        let f = choose_tiles(Pass::Fwd, 512, 64, h100).unwrap();
        assert_eq!(fwd_defines(512, &f, false, false), s(&[("SA_D", "512"), ("SA_HB", "64"), ("SA_BN", "64"), ("SA_DW", "128"), ("SA_NATURAL_EXP", "0"), ("SA_DEDUP", "0")]));
        assert_eq!(choose_tiles(Pass::Fwd, 512, 128, h100), Some(f));
        let b = choose_tiles(Pass::Bwd, 512, 64, h100).unwrap();
        assert_eq!(bwd_defines(512, &b, false), s(&[("SA_D", "512"), ("SA_HB", "32"), ("SA_BN", "64"), ("SA_DW", "128"), ("SA_NATURAL_EXP", "0")]));
        assert_eq!(bwd_defines(512, &choose_tiles(Pass::Bwd, 512, 128, h100).unwrap(), true), s(&[("SA_D", "512"), ("SA_HB", "32"), ("SA_BN", "64"), ("SA_DW", "128"), ("SA_NATURAL_EXP", "1")]));
        // A small test shape: D = 8 runs at 64, 3 heads in one padded block of 16; the dense oracle.
        let f = choose_tiles(Pass::Fwd, kernel_d(8), 3, h100).unwrap();
        assert_eq!(fwd_defines(64, &f, false, true), s(&[("SA_D", "64"), ("SA_HB", "16"), ("SA_BN", "64"), ("SA_DW", "64"), ("SA_NATURAL_EXP", "0"), ("SA_DEDUP", "1")]));
    }

    #[test]
    fn overrides_reach_the_defines() {
        use crate::tuning::KernelConfig;
        let mut c = SaBwdConfig::default();
        assert!(c.set("det_c0_chunks", "3").unwrap() && c.set("qdo_tma", "0").unwrap());
        assert_eq!(bwd_sm90_defines(&c, true, c.qdo_tma), s(&[("SA90_BWD_DET", "1"), ("SA90_BWD_C0_CHUNKS", "3"), ("SA90_BWD_QDO_TMA", "0")]));
        assert_eq!(bwd_sm90_defines(&c, false, true)[1], ("SA90_BWD_C0_CHUNKS", "2".to_string()));
        let mut d = SaDetConfig::default();
        assert!(d.set("reduce_groups", "8").unwrap());
        assert_eq!(reduce_defines(&d), s(&[("SA_REDUCE_GROUPS", "8")]));
        assert_eq!(SaFwdConfig::fields(), &["q_tma", "ctas"]);
    }

    #[test]
    fn compile_variants_cover_every_kernel_once() {
        let v = compile_variants();
        for path in ["fwd_sm90.cu", "bwd_sm90.cu", "fwd.cu", "bwd.cu", "bwd_reduce.cu", "plan.cu", "pack.cu"] {
            assert!(v.iter().any(|x| x.path == format!("sparse_attention/{path}")), "{path}");
        }
        for (i, x) in v.iter().enumerate() {
            assert!(!v[..i].contains(x), "{x:?} twice");
        }
        assert_eq!(v.iter().filter(|x| x.path.ends_with("sm90.cu")).count(), 6);
    }
}
