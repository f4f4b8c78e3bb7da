//! Time the CPU reference of sparse_attention forward + backward at B=1, S=512, H=64,
//! D=512, 640 valid slots per query (distinct random keys of K=2048), bf16 inputs.
//!
//! cargo run --release -p dsv4-core --example reference_timing

use std::time::Instant;

use dsv4_core::ops::sparse_attention::{sparse_attention, sparse_attention_backward, SparseAttentionArgs, SparseAttentionBwdArgs, SparseIndices};
use dsv4_core::{BackendName, Tensor};

fn main() -> dsv4_core::Result<()> {
    let (b, s, h, d, k, t) = (1usize, 512usize, 64usize, 512usize, 2048usize, 640usize);
    let mut state = 0x1234_5678_9abc_def0u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut uni = |n: usize| -> Vec<f32> { (0..n).map(|_| (next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0).collect() };
    let q = Tensor::from_f32_as_bf16(&[b, s, h, d], &uni(b * s * h * d))?;
    let kv = Tensor::from_f32_as_bf16(&[b, k, d], &uni(b * k * d))?;
    let sinks = Tensor::from_f32(&[h], uni(h))?;
    let dout = Tensor::from_f32_as_bf16(&[b, s, h, d], &uni(b * s * h * d))?;
    let mut idx = Vec::with_capacity(b * s * t);
    let mut keys: Vec<i32> = (0..k as i32).collect();
    let mut pick = 0x9e37_79b9u64;
    for _ in 0..b * s {
        for j in 0..t {
            pick = pick.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let r = j + (pick >> 33) as usize % (k - j);
            keys.swap(j, r);
            idx.push(keys[j]);
        }
    }
    let topk = Tensor::from_i32(&[b, s, t], idx)?;
    let args = SparseAttentionArgs::new(q.view(), kv.view(), sinks.view(), SparseIndices::TopK(topk.view()));
    let t0 = Instant::now();
    let (out, lse) = sparse_attention(BackendName::Reference, &args)?;
    let fwd = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    sparse_attention_backward(BackendName::Reference, &SparseAttentionBwdArgs::new(args.clone(), out.view(), lse.view(), dout.view()))?;
    let bwd = t1.elapsed().as_secs_f64();
    let flops = 4.0 * (b * s * t * h * d) as f64;
    println!(
        "reference sparse_attention B={b} S={s} H={h} D={d} T={t} on {} threads: forward {fwd:.2} s ({:.1} GFLOP/s), backward {bwd:.2} s ({:.1} GFLOP/s), forward+backward {:.2} s",
        rayon::current_num_threads(),
        flops / fwd / 1e9,
        2.5 * flops / bwd / 1e9,
        fwd + bwd
    );
    Ok(())
}
