//! One module per operation: its arguments and checks (`mod.rs`) and its reference math
//! (`reference.rs`).

pub mod indexer;
pub mod qnorm_rope;
pub mod sinkhorn;
pub mod sparse_attention;
pub mod sparse_indices;
