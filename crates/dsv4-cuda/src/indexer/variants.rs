//! The indexer kernels' compile variants: the define sets the launchers select with the
//! default configs, at the DSV4 shape (H = 64, D = 128) and the shapes of the GPU tests
//! (`tests/gpu_indexer.rs`). `tests/nvrtc_compile.rs` builds exactly these.

use super::config::*;
use crate::tuning::Variant;

const PORTABLE_ARCHS: &[&str] = &["sm_90a", "sm_80"];
const HOPPER_ARCHS: &[&str] = &["sm_90a"];
/// Opt-in shared memory per block of an H100 / H200 (the tile choice's limit).
const HOPPER_SMEM: usize = 232_448;

/// (H, D) of the DSV4 indexer and of the GPU tests, and head dims beyond the tensor-core
/// backward and the Hopper scores (the portable kernels' larger tiles).
const SHAPES: &[(usize, usize)] = &[(64, 128), (1, 8), (3, 16), (6, 32), (8, 32), (16, 64), (17, 40), (32, 128), (33, 120), (49, 72), (8, 136), (64, 256), (8, 512)];

fn variant(path: &'static str, archs: &'static [&'static str], defines: Vec<(&'static str, String)>) -> Variant {
    Variant { path, archs, defines }
}

/// Every variant, rendered from the default configs.
pub fn compile_variants() -> Vec<Variant> {
    let (sc, tsc, s90, topk, bwd) = (IdxScoresConfig::default(), IdxTopkScoresConfig::default(), IdxScores90Config::default(), IdxTopkConfig::default(), IdxBwdConfig::default());
    let mut v = Vec::new();
    for &(h, d) in SHAPES {
        // scores.cu: dense, fused at the DSV4 selection (P = 1024 at S = 4096, top-512), gather.
        for mode in [ScoresMode::Dense, ScoresMode::Fused { p: 1024, sort_cap: 512 }, ScoresMode::Gather] {
            if let Ok(t) = ScoresTiles::choose(&sc, &tsc, HOPPER_SMEM, "variants", h, d, mode) {
                v.push(variant("indexer/scores.cu", PORTABLE_ARCHS, t.defines()));
            }
        }
        if sm90_fits(h, d) {
            for tma in [true, false] {
                v.push(variant("indexer/scores_sm90.cu", HOPPER_ARCHS, sm90_defines(&s90, h, d, tma).expect("default stages")));
            }
            v.push(variant("indexer/bwd_mma.cu", PORTABLE_ARCHS, shape_defines(h, d)));
            if d % 8 == 0 {
                v.push(variant("indexer/bwd_sm90.cu", HOPPER_ARCHS, shape_defines(h, d)));
            }
        }
    }
    v.push(variant("indexer/bwd.cu", PORTABLE_ARCHS, bwd_defines(&bwd).expect("default bwd config")));
    let t = topk_launch(&topk, HOPPER_SMEM, "variants", 1024, 512).expect("default top-k config");
    v.push(variant("indexer/topk.cu", PORTABLE_ARCHS, topk_defines(&t)));
    v.push(variant("indexer/pack.cu", PORTABLE_ARCHS, Vec::new()));
    // The same define set at several shapes compiles once.
    let mut seen = Vec::new();
    v.retain(|x| {
        let key = (x.path, x.defines.clone());
        let new = !seen.contains(&key);
        seen.push(key);
        new
    });
    v
}
