//! The portable kernels' tiles (`fwd.cu`, `bwd.cu`), chosen in one place.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pass {
    Fwd,
    Bwd,
}

/// Compile-time tile of `fwd.cu` / `bwd.cu`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tiles {
    /// Heads per CTA (the mma M, a multiple of 16; padded heads are masked rows).
    pub hb: usize,
    /// Slots per gathered K/V tile.
    pub bn: usize,
    /// O / dq columns per warp.
    pub dw: usize,
}

impl Tiles {
    pub fn threads(&self, d: usize) -> usize {
        (self.hb / 16) * (d / self.dw) * 32
    }
    pub fn head_blocks(&self, h: usize) -> usize {
        h.div_ceil(self.hb)
    }
}

/// Shared memory of `fwd.cu` (mirrors `FwdLayout` in tile.cuh): Q, two K/V tiles, S (f32),
/// P (bf16), row statistics, a ring of three tiles' slot keys. Rows padded by 16 bytes (bank-conflict-free ldmatrix).
pub fn fwd_smem_bytes(d: usize, hb: usize, bn: usize) -> usize {
    let (qs, ss, ps) = (d + 8, bn + 4, bn + 8);
    hb * qs * 2 + 2 * bn * qs * 2 + hb * ss * 4 + hb * ps * 2 + 3 * hb * 4 + 3 * bn * 4
}

/// Shared memory of `bwd.cu` (mirrors `BwdLayout` in tile.cuh): Q, dO, two K/V tiles, P and
/// dS (bf16), lse and delta, a ring of three tiles' slot keys.
pub fn bwd_smem_bytes(d: usize, hb: usize, bn: usize) -> usize {
    let (qs, ps) = (d + 8, bn + 8);
    2 * hb * qs * 2 + 2 * bn * qs * 2 + 2 * hb * ps * 2 + 2 * hb * 4 + 3 * bn * 4
}

/// The tile for head dim `d`, `h` heads and `smem_max` bytes of opt-in shared memory:
/// - `dw`: 128 columns per warp when `d` allows (O / dq: 64 f32 registers a thread), else 64.
/// - `hb`: all heads in one CTA when `h <= 64`, so each K/V tile is gathered once per row
///   and serves every head; more heads split evenly into blocks of at most 64 (the mma M
///   is padded to 16). Threads are capped: forward 512, backward 256 — the backward keeps
///   dq, Q/dO fragments and the dKV tile live, and at 512 threads ptxas has 128 registers
///   and spills.
/// - `bn`: 64 slots per tile when shared memory allows (half the barriers per key), else
///   32 (D = 512: a key row is 1 KiB, and the backward holds Q, dO and two K/V tiles).
pub fn choose_tiles(pass: Pass, d: usize, h: usize, smem_max: usize) -> Option<Tiles> {
    if d == 0 || !d.is_multiple_of(64) || d > 512 || h == 0 {
        return None;
    }
    let dw = if d.is_multiple_of(128) { 128 } else { 64 };
    let wd = d / dw;
    let max_threads = match pass {
        Pass::Fwd => 512,
        Pass::Bwd => 256,
    };
    for hb_cap in [64usize, 48, 32, 16] {
        if (hb_cap / 16) * wd * 32 > max_threads {
            continue;
        }
        let n_blocks = h.div_ceil(hb_cap);
        let hb = h.div_ceil(n_blocks).next_multiple_of(16);
        for bn in [64usize, 32] {
            let smem = match pass {
                Pass::Fwd => fwd_smem_bytes(d, hb, bn),
                Pass::Bwd => bwd_smem_bytes(d, hb, bn),
            };
            if smem <= smem_max {
                return Some(Tiles { hb, bn, dw });
            }
        }
    }
    None
}

/// The head dim the kernels run at: D rounded up to a multiple of 64. Inputs of another D
/// are copied with zero columns appended (a zero column adds 0 to every q.k and gives a
/// zero column of out, dq and dkv), and results are cut back to D.
pub fn kernel_d(d: usize) -> usize {
    d.next_multiple_of(64)
}
