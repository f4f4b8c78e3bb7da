use super::config::{bwd_mma_fits, bwd_mma_smem_bytes, bwd_sm90_smem_bytes, sm90_fits, sm90_smem_bytes, warp_n_tiles, ScoresTiles};
use super::{FUSED_SMEM_BYTES, PARAMS_SIZES};

#[test]
fn scores_smem_mirrors_the_kernel_formula() {
    // H = 64, D = 128, BQ = 2, BN = 64: (2*64*136 + 2*64*136)*2 + 2*64*4 + 2*64*4.
    let t = ScoresTiles { h: 64, d: 128, bq: 2, bn: 64, nt: 4, gather: false, fused: None };
    let base = (2 * 64 * 136 + 2 * 64 * 136) * 2 + 2 * 64 * 4 + 2 * 64 * 4;
    assert_eq!(t.smem_bytes(), base);
    assert_eq!(t.threads(), 128);
    // DSV4 at 4K tokens: P = 1024, top-512, fused in ~85 KB.
    let f = ScoresTiles { fused: Some((1024, 512)), ..t };
    assert_eq!(f.smem_bytes(), base + 2304 + 512 * 8 + 2 * 1024 * 4);
    assert!(f.smem_bytes() <= FUSED_SMEM_BYTES);
}

#[test]
fn sm90_smem_mirrors_the_kernel_layout() {
    // H = 64, D = 128: 1024 (alignment) + sq 2 x 256 x 128 + skv 2 x 2 x 64 x 128
    // + sw 256 x 4 + 64 (barriers); fused adds SelectSmem and the sort buffer.
    let dense = 1024 + 2 * 256 * 128 + 2 * 2 * 64 * 128 + 256 * 4 + 64;
    assert_eq!(sm90_smem_bytes(64, 128, None, 1), dense);
    assert_eq!(sm90_smem_bytes(64, 128, Some(512), 1), dense + 2304 + 512 * 8);
    // Two consumer warpgroups (the dense default): two sq and sw, a 4-stage ring, 64 B of
    // barriers; one CTA an SM within the 227 KiB a block may opt in to.
    let two = 1024 + 2 * 2 * 256 * 128 + 4 * 2 * 64 * 128 + 2 * 256 * 4 + 64;
    assert_eq!(sm90_smem_bytes(64, 128, None, 2), two);
    assert!(two <= 227 << 10);
    // Two CTAs per SM on Hopper (228 KiB a SM, 1 KiB reserved per CTA) for the dense
    // scores and the fused top-512 / top-1024.
    for cap in [None, Some(512), Some(1024)] {
        assert!(2 * (sm90_smem_bytes(64, 128, cap, 1) + 1024) <= 228 << 10, "{cap:?}");
    }
    // Heads pad to 16 / 32 / 64 (N = 64 / 128 / 256), the head dim to groups of 64.
    assert_eq!(sm90_smem_bytes(17, 40, None, 1), 1024 + 128 * 128 + 2 * 64 * 128 + 128 * 4 + 64);
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
