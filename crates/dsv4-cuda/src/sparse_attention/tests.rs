use super::backward::SA90_BWD_SMEM_BYTES;
use super::deterministic::DeterministicWaves;
use super::*;

#[test]
fn sa90_q_map_shapes_are_mappable() {
    use crate::runtime::tma_bf16_problem;
    // contiguous [B,S,H,512]
    let (d, st) = sa90_q_map_shape([2, 300, 64], &[300 * 64 * 512, 64 * 512, 512]);
    assert_eq!(d, [512, 64, 300, 2]);
    assert_eq!(st, [1024, 64 * 1024, 300 * 64 * 1024]);
    assert_eq!(tma_bf16_problem(0x1000, &d, &st, &SA90_Q_BOX), None);
    // a [B,H,S,D] tensor transposed to [B,S,H,D]; H = 1 and B = 1 with odd strides
    let (d, st) = sa90_q_map_shape([1, 300, 7], &[3, 512, 300 * 512]);
    assert_eq!(st, [300 * 1024, 1024, 300 * 1024]);
    assert_eq!(tma_bf16_problem(0x1000, &d, &st, &SA90_Q_BOX), None);
    let (d, st) = sa90_q_map_shape([3, 5, 1], &[5 * 520, 520, 1]);
    assert_eq!(st, [1024, 1040, 5 * 1040]);
    assert_eq!(tma_bf16_problem(0x1000, &d, &st, &SA90_Q_BOX), None);
    let (d, st) = sa90_q_map_shape([1, 1, 1], &[1, 1, 1]);
    assert_eq!(tma_bf16_problem(0x1000, &d, &st, &SA90_Q_BOX), None);
    // a head stride of 516 elements (1,032 bytes) is refused: the launcher then compiles
    // the cp.async Q loads (rows_input packs such a q anyway: strides of 8 elements)
    let (d, st) = sa90_q_map_shape([1, 4, 8], &[0, 8 * 516, 516]);
    assert!(tma_bf16_problem(0x1000, &d, &st, &SA90_Q_BOX).is_some());
}

#[test]
fn tiles_fit_hopper_and_ampere() {
    for smem in [232_448usize, 166_912] {
        for d in (64..=512).step_by(64) {
            for h in [1usize, 3, 16, 17, 64, 100, 128] {
                for pass in [Pass::Fwd, Pass::Bwd] {
                    let t = choose_tiles(pass, d, h, smem).unwrap_or_else(|| panic!("no tile for {pass:?} d={d} h={h} smem={smem}"));
                    let bytes = match pass {
                        Pass::Fwd => fwd_smem_bytes(d, t.hb, t.bn),
                        Pass::Bwd => bwd_smem_bytes(d, t.hb, t.bn),
                    };
                    assert!(bytes <= smem);
                    assert!(t.hb.is_multiple_of(16) && t.hb <= 64 && t.hb * t.head_blocks(h) >= h);
                    assert!(t.threads(d) <= if pass == Pass::Fwd { 512 } else { 256 });
                }
            }
        }
    }
    // The DeepSeek-V4 shape on an H100/H200: all 64 heads in one forward CTA.
    assert_eq!(choose_tiles(Pass::Fwd, 512, 64, 232_448), Some(Tiles { hb: 64, bn: 64, dw: 128 }));
    assert_eq!(choose_tiles(Pass::Fwd, 100, 64, 232_448), None);
    // Other head dims run padded: the golden's D = 8, 16, 32 at 64; 512 stays 512.
    assert_eq!([8, 16, 32, 64, 65, 96, 200, 512].map(kernel_d), [64, 64, 64, 64, 128, 128, 256, 512]);
}

#[test]
fn deterministic_waves_fit_the_workspace() {
    let dm = Dims { b: 2, s: 1024, h: 64, d: 512, k: 1280, t: 640 };
    let (rows, g) = (2048usize, 2 * 1280);
    // An index per wave (the global one not allowed).
    let w = DeterministicWaves::for_sizes(132, dm, dm.t, 2, 2 << 30, ContribFormat::F32, false);
    assert_eq!(w.row_bytes, 640 * (2 * 512 + 1) * 4);
    // (818 rows fit; two head blocks a row: 66 rows fill a round of 132 CTAs)
    assert_eq!((2usize << 30) / w.row_bytes, 818);
    assert_eq!((w.wave_rows, w.global), (792, false));
    assert!(w.n_rb >= 1 && w.n_rb <= 4 * 132);
    let small = DeterministicWaves::for_sizes(132, dm, dm.t, 2, w.row_bytes * 3, ContribFormat::F32, true);
    assert_eq!((small.wave_rows, small.global), (3, false), "the global index takes more than a quarter of this workspace");
    assert_eq!(DeterministicWaves::for_sizes(132, dm, dm.t, 2, w.row_bytes - 1, ContribFormat::F32, true).wave_rows, 0);
    // No slots: every row in one wave.
    assert_eq!(DeterministicWaves::for_sizes(132, dm, 0, 2, 1, ContribFormat::F32, true).wave_rows, 2048);
    // The global index: waves of whole row blocks, contributions and index within the workspace.
    for ws in [2usize << 30, 256 << 20, 64 << 20] {
        let gw = DeterministicWaves::for_sizes(132, dm, dm.t, 2, ws, ContribFormat::F32, true);
        assert!(gw.global, "{ws}: {gw:?}");
        assert_eq!(gw.n_rb, rows.div_ceil(gw.rows_per_rb));
        assert!(gw.n_rb <= 4 * 132);
        let index_bytes = rows * 640 * 4 + gw.n_rb * g * 4 + (g + 1) * 4;
        assert!(gw.wave_rows > 0 && (gw.wave_rows.is_multiple_of(gw.rows_per_rb) || gw.wave_rows == rows), "{gw:?}");
        assert!(gw.wave_rows * 640 * 2 * 512 * 4 + index_bytes <= ws, "{ws}: {gw:?}");
        // at least 3/4 of the rows that fit
        assert!(4 * (gw.wave_rows + gw.rows_per_rb) * 640 * 2 * 512 * 4 + 4 * index_bytes > 3 * ws || gw.wave_rows == rows, "{ws}: {gw:?}");
    }
    // The bench's shapes (H200: 132 SMs, one head block): waves of whole rounds of 132
    // CTAs, in whole blocks of the global index.
    for (s, k, want) in [(16384usize, 20480usize, 3036usize), (4096, 5120, 3036)] {
        let dm = Dims { b: 1, s, h: 64, d: 512, k, t: 640 };
        let w = DeterministicWaves::for_sizes(132, dm, 640, 1, 2 << 30, ContribFormat::F16Scaled, true);
        assert!(w.global && w.wave_rows == want && want.is_multiple_of(w.rows_per_rb) && w.n_rb <= 4 * 132, "S={s}: {w:?}");
        // 4 GiB: S=4096 in one wave
        let big = DeterministicWaves::for_sizes(132, dm, 640, 1, 4 << 30, ContribFormat::F16Scaled, true);
        assert!(big.wave_rows == s || big.wave_rows.is_multiple_of(132), "S={s}: {big:?}");
    }
    // Two head blocks a row: 66 rows fill a round.
    let dm2 = Dims { b: 1, s: 16384, h: 128, d: 512, k: 20480, t: 640 };
    let w2 = DeterministicWaves::for_sizes(132, dm2, 640, 2, 2 << 30, ContribFormat::F16Scaled, true);
    assert!(w2.wave_rows.is_multiple_of(66) && w2.wave_rows.is_multiple_of(w2.rows_per_rb), "{w2:?}");
    // The Hopper kernel's 16-bit contributions: fp16 values and an f32 scale per 64
    // columns, and the T entries, about half the f32 rows.
    let c = DeterministicWaves::for_sizes(132, dm, dm.t, 2, 2 << 30, ContribFormat::F16Scaled, false);
    assert_eq!(c.row_bytes, 640 * (2 * (2 * 512 + 512 / 16) + 4));
    assert!(c.wave_rows > 19 * w.wave_rows / 10);
}

#[test]
fn backward_head_blocks_follow_the_kernel() {
    // Hopper: 64 heads a CTA whatever the portable tile.
    let t = choose_tiles(Pass::Bwd, 512, 64, 232_448).unwrap();
    assert!(t.hb < 64, "the portable D = 512 backward tile holds fewer than 64 heads: {t:?}");
    for (h, want) in [(1usize, 1usize), (17, 1), (64, 1), (65, 2), (100, 2), (128, 2), (129, 3)] {
        assert_eq!(bwd_head_blocks(true, &t, h), want, "h = {h}");
        assert_eq!(bwd_head_blocks(false, &t, h), t.head_blocks(h), "h = {h}");
    }
    // Fewer head blocks: a row's contributions are smaller, so more rows fit a wave.
    let dm = Dims { b: 1, s: 4096, h: 64, d: 512, k: 5120, t: 640 };
    let ws = 64 << 20;
    let hop = DeterministicWaves::for_sizes(132, dm, dm.t, bwd_head_blocks(true, &t, dm.h), ws, ContribFormat::F32, true);
    let port = DeterministicWaves::for_sizes(132, dm, dm.t, bwd_head_blocks(false, &t, dm.h), ws, ContribFormat::F32, true);
    assert_eq!(hop.row_bytes, 640 * (512 + 1) * 4);
    assert!(hop.wave_rows > port.wave_rows);
    // The shared-memory layout fits an H100/H200 block.
    const { assert!(SA90_BWD_SMEM_BYTES <= 232_448) };
}
