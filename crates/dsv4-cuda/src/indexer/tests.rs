use super::config::*;
use super::variants::compile_variants;
use super::PARAMS_SIZES;

/// H100 / H200: opt-in shared memory per block; A100's.
const HOPPER_SMEM: usize = 232_448;
const A100_SMEM: usize = 166_912;

fn defs(v: &[(&'static str, &str)]) -> Vec<(&'static str, String)> {
    v.iter().map(|(k, x)| (*k, x.to_string())).collect()
}

fn tiles(h: usize, d: usize, mode: ScoresMode, limit: usize) -> ScoresTiles {
    ScoresTiles::choose(&IdxScoresConfig::default(), &IdxTopkScoresConfig::default(), limit, "test", h, d, mode).unwrap()
}

#[test]
fn scores_smem_mirrors_the_kernel_formula() {
    // H = 64, D = 128, BQ = 2, BN = 64: (2*64*136 + 2*64*136)*2 + 2*64*4 + 2*64*4.
    let t = ScoresTiles { h: 64, d: 128, bq: 2, bn: 64, nt: 4, mode: ScoresMode::Dense };
    let base = (2 * 64 * 136 + 2 * 64 * 136) * 2 + 2 * 64 * 4 + 2 * 64 * 4;
    assert_eq!(t.smem_bytes(), base);
    assert_eq!(t.threads(), 128);
    // DSV4 at 4K tokens: P = 1024, top-512, fused in ~85 KB.
    let f = ScoresTiles { mode: ScoresMode::Fused { p: 1024, sort_cap: 512 }, ..t };
    assert_eq!(f.smem_bytes(), base + 2304 + 512 * 8 + 2 * 1024 * 4);
    assert!(f.smem_bytes() <= IdxScoresConfig::default().fused_smem_bytes);
}

#[test]
fn sm90_smem_mirrors_the_kernel_layout() {
    // H = 64, D = 128: 1024 (alignment) + two sq of 2 x 256 x 128 + a 4-stage ring of
    // 2 x 64 x 128 + two sw of 256 x 4 + 64 (barriers): one CTA an SM.
    let c = IdxScores90Config::default();
    let two = 1024 + 2 * 2 * 256 * 128 + 4 * 2 * 64 * 128 + 2 * 256 * 4 + 64;
    assert_eq!(sm90_smem_bytes(&c, 64, 128), two);
    assert!(two <= 227 << 10);
    // Heads pad to 16 / 32 / 64 (N = 64 / 128 / 256), the head dim to groups of 64.
    assert_eq!(sm90_smem_bytes(&c, 17, 40), 1024 + 2 * 128 * 128 + 4 * 64 * 128 + 2 * 128 * 4 + 64);
    assert_eq!(sm90_smem_bytes(&IdxScores90Config { stages: 5, ..c }, 17, 40), 1024 + 2 * 128 * 128 + 5 * 64 * 128 + 2 * 128 * 4 + 128);
    assert!(sm90_fits(64, 128) && sm90_fits(1, 8) && !sm90_fits(65, 128) && !sm90_fits(64, 136));
}

#[test]
fn bwd_mma_smem_mirrors_the_kernel_formula() {
    // H = 64, D = 128: sq 64x136, skv 2x64x136, sG 64x72 bf16; sw 64, sg 2x64, skey 2x64.
    let base = (64 * 136 + 2 * 64 * 136 + 64 * 72) * 2 + 64 * 4 + 2 * 64 * 4 + 2 * 64 * 4;
    assert_eq!(bwd_mma_smem_bytes(64, 128, false), base);
    assert_eq!(bwd_mma_smem_bytes(64, 128, true), base + 64 * 136 * 4);
    // Two CTAs per SM on Hopper even when deterministic; three in atomic mode (the
    // kernel's register bound, __launch_bounds__(128, 3), is sized for them).
    assert!(2 * bwd_mma_smem_bytes(64, 128, true) <= 227 << 10);
    assert!(3 * (bwd_mma_smem_bytes(64, 128, false) + 1024) <= 228 << 10);
    assert!(bwd_mma_fits(64, 128) && bwd_mma_fits(3, 20) && !bwd_mma_fits(65, 128) && !bwd_mma_fits(8, 136));
}

#[test]
fn bwd_sm90_smem_mirrors_the_kernel_layout() {
    // D = 128: per consumer q 2 x 16 KiB, ring 3 x 16 KiB, G^T 2 x 8 KiB; slot tables
    // 2 x 2 x 3 x 64 x 4; 2 x 13 mbarriers; 1024 of alignment slack. One CTA per SM.
    let d128 = 1024 + 2 * (2 * 16384 + 3 * 16384 + 2 * 8192) + 2 * 2 * 3 * 64 * 4 + 2 * 13 * 8;
    assert_eq!(bwd_sm90_smem_bytes(128), d128);
    assert_eq!(d128, 200_912);
    assert!(d128 <= 232_448 && 2 * (d128 + 1024) > 228 << 10);
    // D <= 64: one SW128 group per row.
    assert_eq!(bwd_sm90_smem_bytes(40), bwd_sm90_smem_bytes(64));
    assert_eq!(bwd_sm90_smem_bytes(64), 1024 + 2 * (5 * 8192 + 2 * 8192) + 2 * 2 * 3 * 64 * 4 + 2 * 13 * 8);
}

#[test]
fn bwd_smem_mirrors_the_kernel_layout() {
    // H = 64, D = 256 (beyond the tensor cores), 256 threads, 8 slots a step: one head group.
    let c = IdxBwdConfig::default();
    assert_eq!(bwd_smem_bytes(&c, 64, 256), (2 * 64 * 256 + 8 * 256 + 2 * 8 * 64 + 8 * 256 + 2 * 64 + 8) * 4 + 8 * 4);
}

#[test]
fn warp_slabs_divide_the_tiles() {
    for d in 1..=512 {
        let nt = warp_n_tiles(d);
        assert!(64 % (nt * 8) == 0 && 2 * d.div_ceil(16) * nt <= 64, "D = {d}: NT = {nt}");
    }
}

#[test]
fn params_sizes_are_listed() {
    assert_eq!(PARAMS_SIZES.len(), 6);
    assert!(PARAMS_SIZES.iter().all(|(_, n)| n % 8 == 0));
}

/// The defines of the DSV4 shape (H = 64, D = 128, top-512, P = S / 4 at S = 4096 and
/// 16384) are those the launchers passed before the typed configs (bb7d6e1):
/// - scores.cu: `ScoresTiles::defines`, unchanged (dense (4, 64, 4), fused (2, 64, 4),
///   gather (1, 64, 2)); its `choose` is the old one with the device limit as a number.
/// - scores_sm90.cu: IDX_H, IDX_D, IDX90_TMA as before; IDX_FUSED=0 no longer (the fused
///   Hopper kernel left), IDX90_STAGES=4 now passed (the kernel's IDX90_TWO_WG_STAGES
///   default).
/// - topk.cu: TOPK_THREADS=128 as before.
/// - bwd_mma.cu, bwd_sm90.cu: IDX_H, IDX_D as before; bwd.cu: BWD_THREADS=256, BWD_NS=8, its
///   former kernel defaults (the launcher passed none).
#[test]
fn dsv4_defines_match_the_previous_launcher() {
    for limit in [HOPPER_SMEM, A100_SMEM] {
        let dense = tiles(64, 128, ScoresMode::Dense, limit);
        assert_eq!(dense.defines(), defs(&[("IDX_H", "64"), ("IDX_D", "128"), ("IDX_BQ", "4"), ("IDX_BN", "64"), ("IDX_NT", "4"), ("IDX_GATHER", "0"), ("IDX_FUSED", "0")]));
        assert_eq!(dense.threads(), 256);
        let gather = tiles(64, 128, ScoresMode::Gather, limit);
        assert_eq!(gather.defines(), defs(&[("IDX_H", "64"), ("IDX_D", "128"), ("IDX_BQ", "1"), ("IDX_BN", "64"), ("IDX_NT", "2"), ("IDX_GATHER", "1"), ("IDX_FUSED", "0")]));
        assert_eq!(gather.threads(), 128);
        for s in [4096, 16384] {
            let fused = tiles(64, 128, ScoresMode::Fused { p: s / 4, sort_cap: 512 }, limit);
            assert_eq!(fused.defines(), defs(&[("IDX_H", "64"), ("IDX_D", "128"), ("IDX_BQ", "2"), ("IDX_BN", "64"), ("IDX_NT", "4"), ("IDX_GATHER", "0"), ("IDX_FUSED", "1")]));
            // Fused in shared memory (rows of P up to ~10.8K; beyond, the chunked path).
            assert!(fused.smem_bytes() <= IdxScoresConfig::default().fused_smem_bytes);
        }
        let long = tiles(64, 128, ScoresMode::Fused { p: 16384, sort_cap: 512 }, limit);
        assert!(long.smem_bytes() > IdxScoresConfig::default().fused_smem_bytes);
    }
    let s90 = IdxScores90Config::default();
    assert_eq!(sm90_defines(&s90, 64, 128, true).unwrap(), defs(&[("IDX_H", "64"), ("IDX_D", "128"), ("IDX90_STAGES", "4"), ("IDX90_TMA", "1")]));
    assert_eq!(sm90_defines(&s90, 64, 128, false).unwrap()[3], ("IDX90_TMA", "0".to_string()));
    for s in [4096, 16384] {
        let t = topk_launch(&IdxTopkConfig::default(), HOPPER_SMEM, "test", s / 4, 512).unwrap();
        assert_eq!(topk_defines(&t), defs(&[("TOPK_THREADS", "128")]));
        // The row cache: SelectSmem + 512 x 8 + P x 4 within 96 KiB.
        assert_eq!((t.sort_cap, t.cache_row, t.smem), (512, true, 2304 + 4096 + s));
    }
    assert_eq!(shape_defines(64, 128), defs(&[("IDX_H", "64"), ("IDX_D", "128")]));
    assert_eq!(bwd_defines(&IdxBwdConfig::default()).unwrap(), defs(&[("BWD_THREADS", "256"), ("BWD_NS", "8")]));
}

/// The small GPU tests' shapes: the tiles the old `ScoresTiles::choose` gave.
#[test]
fn small_shapes_defines_match_the_previous_launcher() {
    // (H, D) -> (dense BQ, BN, NT), (gather NT): NT by D (4 up to 128, 2 up to 256, 1 beyond).
    for (h, d, nt, gather_nt) in [(17, 40, 4, 2), (3, 16, 4, 2), (33, 120, 4, 2), (8, 136, 2, 2), (64, 256, 2, 2), (8, 512, 1, 1)] {
        let t = tiles(h, d, ScoresMode::Dense, HOPPER_SMEM);
        assert_eq!((t.bq, t.bn, t.nt), (4, 64, nt), "H = {h}, D = {d}");
        let g = tiles(h, d, ScoresMode::Gather, HOPPER_SMEM);
        assert_eq!((g.bq, g.bn, g.nt), (1, 64, gather_nt), "H = {h}, D = {d}");
    }
    // H = 64, D = 512 needs smaller blocks: (1 query, 64 keys) fits 227 KiB.
    let t = tiles(64, 512, ScoresMode::Dense, HOPPER_SMEM);
    assert_eq!((t.bq, t.bn, t.nt), (1, 64, 1));
    assert_eq!(sm90_defines(&IdxScores90Config::default(), 17, 40, false).unwrap(), defs(&[("IDX_H", "17"), ("IDX_D", "40"), ("IDX90_STAGES", "4"), ("IDX90_TMA", "0")]));
}

#[test]
fn bad_tuning_values_are_errors() {
    assert!(topk_launch(&IdxTopkConfig { threads: 100, ..Default::default() }, HOPPER_SMEM, "test", 1024, 512).is_err());
    assert!(sm90_defines(&IdxScores90Config { stages: 2, ..Default::default() }, 64, 128, true).is_err());
    let tsc = IdxTopkScoresConfig { bn: 40, nt_max: 2 };
    assert!(ScoresTiles::choose(&IdxScoresConfig::default(), &tsc, HOPPER_SMEM, "test", 64, 128, ScoresMode::Gather).is_err());
    // A valid override: 128 slots, 4 n-tiles.
    let tsc = IdxTopkScoresConfig { bn: 128, nt_max: 4 };
    let g = ScoresTiles::choose(&IdxScoresConfig::default(), &tsc, HOPPER_SMEM, "test", 64, 128, ScoresMode::Gather).unwrap();
    assert_eq!((g.bn, g.nt, g.threads()), (128, 4, 128));
}

#[test]
fn compile_variants_cover_every_kernel_file() {
    let v = compile_variants();
    for path in ["scores.cu", "scores_sm90.cu", "topk.cu", "bwd.cu", "bwd_mma.cu", "bwd_sm90.cu", "pack.cu"] {
        assert!(v.iter().any(|x| x.path == format!("indexer/{path}")), "{path}");
    }
    // The DSV4 Hopper scores with and without TMA.
    assert!(v.iter().any(|x| x.path == "indexer/scores_sm90.cu" && x.defines == sm90_defines(&IdxScores90Config::default(), 64, 128, false).unwrap()));
}
