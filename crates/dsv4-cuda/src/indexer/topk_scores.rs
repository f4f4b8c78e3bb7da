//! Scores of a given selection: the scores kernel in gather mode.

use dsv4_core::ops::indexer::IndexerArgs;
use dsv4_core::{Result, TensorView, TensorViewMut};

use super::config::ScoresMode;
use super::scores::{launch_scores, scores_inputs, ScoresOut};
use super::{check_bf16, shape_of};
use crate::runtime::Gpu;

/// Scores of a selection `[B,S,T]` f32 (-inf where masked or not visible), into the
/// validated `out`.
pub(crate) fn topk_scores(gpu: &Gpu, a: &IndexerArgs, topk: &TensorView, out: &mut TensorViewMut) -> Result<()> {
    const OP: &str = "indexer_topk_scores";
    check_bf16(OP, a)?;
    let sh = shape_of(OP, a)?;
    let (b, s, t) = (sh.b as usize, sh.s as usize, topk.shape()[2]);
    if b * s * t == 0 {
        return Ok(());
    }
    let inp = scores_inputs(gpu, OP, a, ScoresMode::Gather)?;
    let dst = ScoresOut { out: out.as_view().address(), idx: 0, k: 0, strides: ((s * t) as i64, t as i64), visible_only: false };
    launch_scores(gpu, OP, a, &sh, &inp, Some(topk), &dst, 0, s)
}
