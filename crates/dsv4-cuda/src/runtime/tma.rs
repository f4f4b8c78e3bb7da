//! Tensor maps (TMA): [`TmaDesc`], the by-value `CUtensorMap` a kernel takes, and
//! [`Gpu::tma_map_bf16`], which encodes one for a bf16 tensor.

use std::ffi::c_void;

use cudarc::driver::sys;
use dsv4_core::{Error, Result};

use super::device::Gpu;
#[cfg(doc)]
use super::kernel::Kernel;

/// A `CUtensorMap` (TMA descriptor): 128 opaque bytes, 64-byte aligned, passed by value to
/// a kernel that takes `const __grid_constant__ TmaDesc` (kernels/tma.cuh) with
/// [`Kernel::launch2`]; [`TmaDesc::ZERO`] where the entry takes one but the compiled
/// variant does not use it. Made by [`Gpu::tma_map_bf16`].
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TmaDesc(pub [u64; 16]);

impl TmaDesc {
    pub const ZERO: TmaDesc = TmaDesc([0; 16]);
}

const _: () = assert!(size_of::<TmaDesc>() == 128 && align_of::<TmaDesc>() == 64);
const _: () = assert!(size_of::<sys::CUtensorMap>() == 128 && align_of::<sys::CUtensorMap>() == 64);

/// `(struct name, size in bytes)` of the by-value kernel arguments defined here (mirrored
/// by `DSV4_PARAMS_SIZE` lines of the kernel headers, tests/params_layout.rs).
pub const PARAMS_SIZES: &[(&str, usize)] = &[("TmaDesc", size_of::<TmaDesc>())];

/// Why [`Gpu::tma_map_bf16`] cannot map this bf16 tensor (None: it can), by
/// cuTensorMapEncodeTiled's requirements for a tiled map with the 128-byte swizzle:
/// rank 1..=5; a 16-byte aligned base; every size in 1..=2^32; the strides of the
/// dimensions above the innermost (bytes) non-zero multiples of 16 below 2^40; box sizes
/// in 1..=256, the innermost one 16..=128 bytes in 16-byte steps (the swizzle span).
/// `dims` and `box_dims` innermost first, in elements; `byte_strides` of dims 1.. .
pub fn tma_bf16_problem(address: u64, dims: &[u64], byte_strides: &[u64], box_dims: &[u32]) -> Option<String> {
    let rank = dims.len();
    if !(1..=5).contains(&rank) || byte_strides.len() + 1 != rank || box_dims.len() != rank {
        return Some(format!("rank {rank} with {} strides and {} box sizes (TMA: rank 1..=5, rank - 1 strides)", byte_strides.len(), box_dims.len()));
    }
    if address == 0 || !address.is_multiple_of(16) {
        return Some(format!("base address {address:#x} is not 16-byte aligned"));
    }
    if let Some(d) = dims.iter().find(|&&d| d == 0 || d > 1 << 32) {
        return Some(format!("size {d} outside 1..=2^32"));
    }
    if let Some(s) = byte_strides.iter().find(|&&s| s == 0 || !s.is_multiple_of(16) || s >= 1 << 40) {
        return Some(format!("stride of {s} bytes is not a non-zero multiple of 16 below 2^40"));
    }
    if box_dims.iter().any(|&b| b == 0 || b > 256) || !(box_dims[0] * 2).is_multiple_of(16) || box_dims[0] * 2 > 128 {
        return Some(format!("box {box_dims:?} (sizes 1..=256, the innermost 16..=128 bytes in 16-byte steps)"));
    }
    None
}

impl Gpu {
    /// A TMA map of the bf16 tensor at `address` (`dims` innermost first, in elements;
    /// `byte_strides` of dims 1..; see [`tma_bf16_problem`]) whose loads move boxes of
    /// `box_dims` into shared memory in the 128-byte swizzle (the SW128 layout of
    /// kernels/hopper.cuh when the box is 128 bytes wide), elements outside the tensor
    /// written as zeros, L2 filled in 256-byte sectors. An error where the requirements do
    /// not hold or the driver refuses (the caller falls back to a path without TMA).
    pub fn tma_map_bf16(&self, address: u64, dims: &[u64], byte_strides: &[u64], box_dims: &[u32]) -> Result<TmaDesc> {
        if let Some(why) = tma_bf16_problem(address, dims, byte_strides, box_dims) {
            return Err(Error::Cuda(format!("TMA map: {why}")));
        }
        self.bind()?;
        let elem_strides = [1u32; 5];
        let mut map = sys::CUtensorMap { opaque: [0; 16] };
        // SAFETY: `map` is a 64-byte aligned CUtensorMap the driver writes; dims, strides,
        // box and element strides have `rank` (strides rank - 1) entries (checked above);
        // the driver only encodes `address`, nothing is read or written through it here.
        unsafe {
            sys::cuTensorMapEncodeTiled(
                &mut map,
                sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                dims.len() as u32,
                address as *mut c_void,
                dims.as_ptr(),
                byte_strides.as_ptr(),
                box_dims.as_ptr(),
                elem_strides.as_ptr(),
                sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
                sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
        }
        .result()
        .map_err(|e| Error::Cuda(format!("cuTensorMapEncodeTiled (bf16, dims {dims:?}, byte strides {byte_strides:?}, box {box_dims:?}): {e:?}")))?;
        Ok(TmaDesc(map.opaque))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tma_requirements() {
        // kv [B=2][P=300][D=128] bf16, contiguous: mappable with 64 x 64 boxes.
        let (dims, strides, boxes) = ([128u64, 300, 2], [256u64, 300 * 256], [64u32, 64, 1]);
        assert_eq!(tma_bf16_problem(0x1000, &dims, &strides, &boxes), None);
        assert!(tma_bf16_problem(0x1008, &dims, &strides, &boxes).is_some(), "8-byte aligned base");
        assert!(tma_bf16_problem(0x1000, &dims, &[80 + 8, 300 * 256], &boxes).is_some(), "row stride of 44 elements");
        assert!(tma_bf16_problem(0x1000, &dims, &[256, 0], &boxes).is_some(), "zero stride");
        assert!(tma_bf16_problem(0x1000, &dims, &[256, 1 << 40], &boxes).is_some(), "stride >= 2^40");
        assert!(tma_bf16_problem(0x1000, &[128, 0, 2], &strides, &boxes).is_some(), "empty dimension");
        assert!(tma_bf16_problem(0x1000, &dims, &strides, &[128, 64, 1]).is_some(), "256-byte box rows exceed the swizzle span");
        assert!(tma_bf16_problem(0x1000, &dims, &strides, &[4, 64, 1]).is_some(), "8-byte box rows");
        assert!(tma_bf16_problem(0x1000, &dims, &strides[..1], &boxes).is_some(), "a stride missing");
        // Heads past a box (D = 40 < 64): the box overhangs the tensor, which TMA allows.
        assert_eq!(tma_bf16_problem(0x1000, &[40, 29, 1], &[80, 29 * 80], &boxes), None);
    }
}
