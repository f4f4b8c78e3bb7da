//! SPEC.md section 6 computed directly (exact integer arithmetic).

use super::BuildDims;

/// Host copies of the builder's optional tensors, flattened in logical order.
pub struct BuildInputs {
    /// `[B,1,S,Km]` additive mask, `Km >= K`.
    pub attention_mask: Option<(Vec<f32>, usize)>,
    /// `[B,S,Tc]`.
    pub compressed_topk: Option<(Vec<i64>, usize)>,
    /// Global positions, broadcast to `[B,S]`.
    pub q_positions: Option<Vec<i64>>,
    /// `[B,S]`: 0 starts an image span, 4 ends it, -1 is text.
    pub vision_token_types: Option<Vec<i64>>,
}

const IMAGE_START: i64 = 0;
const IMAGE_END: i64 = 4;

/// The vision window of one batch row: `[S, width]`.
fn vision_window(types: &[i64], window: i64, max_image: i64, width: usize, out: &mut [i64]) {
    let s = types.len();
    let (mut starts, mut ends) = (0i64, 0i64);
    let mut last_start = 0i64;
    let mut first_end = vec![s as i64; s + 1];
    for i in (0..s).rev() {
        first_end[i] = if types[i] == IMAGE_END { i as i64 } else { first_end[i + 1] };
    }
    for i in 0..s {
        if types[i] == IMAGE_START {
            starts += 1;
            last_start = i as i64;
        }
        if types[i] == IMAGE_END {
            ends += 1;
        }
        let inside = (starts > ends || types[i] == IMAGE_END) as i64;
        let ii = i as i64;
        let left = ((ii - last_start) * inside).min(max_image - 1);
        let right = ((first_end[i] - ii) * inside).min(max_image);
        let ws = (ii - (window - 1) - (left - (window - 1)).max(0)).max(0);
        for j in 0..width {
            let k = ws + j as i64;
            out[i * width + j] = if k > ii + right { -1 } else { k };
        }
    }
}

/// Returns `[B,S,W']` as i64 (the caller narrows to i32).
pub fn build(dm: &BuildDims, inp: &BuildInputs) -> Vec<i64> {
    let (b, s, wt) = (dm.batch_size, dm.seq_len, dm.width());
    let mut out = vec![-1i64; b * s * wt];
    let wwin = dm.window_width();
    for bi in 0..b {
        if dm.vision() {
            let types = &inp.vision_token_types.as_ref().unwrap()[bi * s..(bi + 1) * s];
            let mut win = vec![0i64; s * wwin];
            vision_window(types, dm.window_size as i64, dm.max_image_tokens as i64, wwin, &mut win);
            for si in 0..s {
                out[(bi * s + si) * wt..][..wwin].copy_from_slice(&win[si * wwin..(si + 1) * wwin]);
            }
        }
        for si in 0..s {
            let row = &mut out[(bi * s + si) * wt..(bi * s + si + 1) * wt];
            let p = inp.q_positions.as_ref().map_or(si as i64, |qp| qp[bi * s + si]);
            if !dm.vision() {
                let w = dm.window_size as i64;
                let first = p.saturating_sub(w - 1).max(0);
                for (j, slot) in row[..wwin].iter_mut().enumerate() {
                    let k = first + j as i64;
                    *slot = if k > p { -1 } else { k };
                }
            }
            if dm.n_pooled > 0 {
                let v = dm.vanilla_key_len as i64;
                let comp = &mut row[wwin..];
                match &inp.compressed_topk {
                    Some((ct, tc)) => {
                        for (j, slot) in comp.iter_mut().enumerate() {
                            let c = ct[(bi * s + si) * tc + j];
                            *slot = if c >= 0 { c.saturating_add(v) } else { -1 };
                        }
                    }
                    None => {
                        let visible = p.saturating_add(1).div_euclid(dm.compress_ratio as i64);
                        for (j, slot) in comp.iter_mut().enumerate() {
                            *slot = if (j as i64) < visible { v + j as i64 } else { -1 };
                        }
                    }
                }
            }
            for slot in row.iter_mut() {
                if *slot < 0 || *slot >= dm.key_len as i64 {
                    *slot = -1;
                } else if let Some((mask, km)) = &inp.attention_mask {
                    if mask[(bi * s + si) * km + *slot as usize] < 0.0 {
                        *slot = -1;
                    }
                }
            }
        }
    }
    out
}

/// The plan layout (SPEC.md section 6, the cuDNN layout, which the reference uses too):
/// per row `b*S+s`, the valid keys as global `b*K+k`, ascending (duplicates kept), then
/// -1 up to `width`. Returns `(indices [B*S*width], topk_length [B*S], valid_rows)`.
pub fn plan(idx: &[i64], b: usize, s: usize, t: usize, k: usize, width: usize) -> (Vec<i64>, Vec<i64>, Vec<i64>) {
    let mut indices = vec![-1i64; b * s * width];
    let mut lengths = vec![0i64; b * s];
    let mut valid_rows = Vec::new();
    for r in 0..b * s {
        let bi = r / s.max(1);
        let mut keys: Vec<i64> = idx[r * t..(r + 1) * t].iter().copied().filter(|&i| i >= 0 && (i as usize) < k).collect();
        keys.sort_unstable();
        for (j, key) in keys.iter().enumerate() {
            indices[r * width + j] = (bi * k) as i64 + key;
        }
        lengths[r] = keys.len() as i64;
        if !keys.is_empty() {
            valid_rows.push(r as i64);
        }
    }
    (indices, lengths, valid_rows)
}
