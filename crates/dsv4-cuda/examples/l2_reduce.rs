//! L2 reduction throughput probe (GPU): how fast f32 rows of 2 KiB can be added into a
//! [20480, 512] f32 array by the access shapes of `l2_reduce.cu`, with the key pattern of
//! the attention backward bench (S = 16384: a 128-key causal window + 512 compressed keys
//! of the first s / 4, 640 slots a row) or uniformly random keys; CTAs in row order or
//! spread over 16 regions; as many CTAs an SM as fit or one (the backward's occupancy);
//! with or without the kv gathers. `cargo run --release -p dsv4-cuda --example l2_reduce [rows]`.
//! Prints the median of 5 timed runs (CUDA events) and the payload rate.
use cudarc::driver::{result as cu, sys};
use std::ffi::{c_void, CString};

const S: usize = 16384;
const P: usize = S / 4;
const SLOTS: usize = 640;
const KEYS: usize = S + P;

fn keys(rows: usize, window: bool) -> Vec<i32> {
    let mut state = 0x9e3779b97f4a7c15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut k = Vec::with_capacity(rows * SLOTS);
    for s in 0..rows {
        for t in 0..SLOTS {
            let key = if !window {
                (next() % KEYS as u64) as usize
            } else if t < 128 {
                (s + t).saturating_sub(127)
            } else {
                let vis = (s / 4).clamp(1, P);
                S + if vis <= 512 { (t - 128) % vis } else { (next() % vis as u64) as usize }
            };
            k.push(key as i32);
        }
    }
    k
}

fn main() {
    let rows: usize = std::env::args().nth(1).map(|a| a.parse().expect("rows")).unwrap_or(S);
    let gpu = dsv4_cuda::runtime::gpu(0).expect("a GPU");
    let src = include_str!("l2_reduce.cu");
    let c = dsv4_cuda::nvrtc::nvrtc().unwrap().compile_rendered("l2_reduce.cu", src, &gpu.props().arch).unwrap_or_else(|e| panic!("{e}"));
    let dst = gpu.scratch(KEYS * 512 * 4).unwrap();
    let kbuf = gpu.scratch(rows * SLOTS * 4).unwrap();
    let kv = gpu.scratch(KEYS * 1024).unwrap();
    gpu.fill(kv.ptr(), 0x3c, kv.bytes()).unwrap();
    let sink = gpu.scratch(16).unwrap();
    gpu.synchronize().unwrap();
    // SAFETY: a complete CUBIN for this device; the context is current after the calls above.
    let module = unsafe { cu::module::load_data(c.cubin.as_ptr() as *const c_void) }.expect("load");
    let start = cu::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).unwrap();
    let end = cu::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).unwrap();
    let stream = gpu.stream_raw() as sys::CUstream;
    for (pattern, window) in [("window+compressed", true), ("random", false)] {
        let k = keys(rows, window);
        let bytes: Vec<u8> = k.iter().flat_map(|x| x.to_le_bytes()).collect();
        gpu.upload_bytes(kbuf.ptr(), &bytes).unwrap();
        for entry in ["red_quads", "red_lines", "red_rows", "bulk"] {
            for (g, one_cta, gather) in [(1i32, false, 0i32), (16, false, 0), (1, true, 0), (1, false, 1), (1, true, 1)] {
                if !window && (g > 1 || one_cta || gather != 0) {
                    continue;
                }
                let name = CString::new(entry).unwrap();
                // SAFETY: the module is loaded and has this entry; every entry takes (float*
                // dst, const int* keys, int slots, int G, const uint4* kv, int gather,
                // unsigned* sink), the seven arguments below.
                let f = unsafe { cu::module::get_function(module, name) }.unwrap();
                let smem: u32 = if one_cta { 120 * 1024 } else if entry == "bulk" { 2 * 16 * 512 * 4 } else { 0 };
                if smem > 48 * 1024 {
                    // SAFETY: a function handle of the loaded module; the size is within the
                    // H100/H200 opt-in limit (227 KiB).
                    unsafe { cu::function::set_function_attribute(f, sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32) }.unwrap();
                }
                let (mut d, mut kp, mut sl, mut gg, mut kvp, mut ga, mut sk) = (dst.ptr(), kbuf.ptr(), SLOTS as i32, g, kv.ptr(), gather, sink.ptr());
                let mut args = [
                    &mut d as *mut u64 as *mut c_void,
                    &mut kp as *mut u64 as *mut c_void,
                    &mut sl as *mut i32 as *mut c_void,
                    &mut gg as *mut i32 as *mut c_void,
                    &mut kvp as *mut u64 as *mut c_void,
                    &mut ga as *mut i32 as *mut c_void,
                    &mut sk as *mut u64 as *mut c_void,
                ];
                let mut times = Vec::new();
                for it in 0..6 {
                    gpu.zero(dst.ptr(), dst.bytes()).unwrap();
                    // SAFETY: dst holds KEYS x 512 f32, kv KEYS x 1 KiB, every key < KEYS, kbuf
                    // rows x SLOTS keys; `args` points at the seven live values above.
                    unsafe {
                        cu::event::record(start, stream).unwrap();
                        cu::launch_kernel(f, (rows as u32, 1, 1), (256, 1, 1), smem, stream, &mut args).unwrap();
                        cu::event::record(end, stream).unwrap();
                        cu::event::synchronize(end).unwrap();
                        if it > 0 {
                            times.push(cu::event::elapsed(start, end).unwrap() as f64);
                        }
                    }
                }
                // Check: the sum of dst = rows x SLOTS x 512.
                let mut host = vec![0u8; dst.bytes()];
                // SAFETY: dst is a live allocation of dst.bytes() bytes; the stream is idle.
                unsafe { cu::memcpy_dtoh_sync(&mut host, dst.ptr()) }.unwrap();
                let sum: f64 = host.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64).sum();
                let ok = (sum - (rows * SLOTS * 512) as f64).abs() < 1.0;
                times.sort_by(|a, b| a.partial_cmp(b).unwrap());
                let ms = times[times.len() / 2];
                let tb = (rows * SLOTS * 2048) as f64 / ms / 1e9;
                let occ = if one_cta { "1 CTA/SM" } else { "full    " };
                println!("l2_reduce {pattern:18} {entry:9} spread={g:2} {occ} gather={gather}: {ms:7.3} ms  {tb:5.2} TB/s payload  sum {}", if ok { "ok" } else { "WRONG" });
            }
        }
    }
}
