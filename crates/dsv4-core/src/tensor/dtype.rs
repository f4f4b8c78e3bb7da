//! Element types, devices, and typed host storage.

use std::fmt;

use half::bf16;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    BF16,
    F32,
    I32,
    I64,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::BF16 => 2,
            DType::F32 | DType::I32 => 4,
            DType::I64 => 8,
        }
    }
    pub fn is_float(self) -> bool {
        matches!(self, DType::BF16 | DType::F32)
    }
    pub fn is_int(self) -> bool {
        matches!(self, DType::I32 | DType::I64)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DType::BF16 => "bf16",
            DType::F32 => "f32",
            DType::I32 => "i32",
            DType::I64 => "i64",
        })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Device {
    Cpu,
    Cuda(usize),
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

/// Typed host storage: keeps every element naturally aligned.
#[derive(Clone, Debug)]
pub enum HostData {
    BF16(Vec<bf16>),
    F32(Vec<f32>),
    I32(Vec<i32>),
    I64(Vec<i64>),
}

impl HostData {
    pub(super) fn zeros(dtype: DType, n: usize) -> Self {
        match dtype {
            DType::BF16 => HostData::BF16(vec![bf16::ZERO; n]),
            DType::F32 => HostData::F32(vec![0.0; n]),
            DType::I32 => HostData::I32(vec![0; n]),
            DType::I64 => HostData::I64(vec![0; n]),
        }
    }
    pub(super) fn dtype(&self) -> DType {
        match self {
            HostData::BF16(_) => DType::BF16,
            HostData::F32(_) => DType::F32,
            HostData::I32(_) => DType::I32,
            HostData::I64(_) => DType::I64,
        }
    }
    pub(super) fn ptr(&self) -> *const u8 {
        match self {
            HostData::BF16(v) => v.as_ptr() as *const u8,
            HostData::F32(v) => v.as_ptr() as *const u8,
            HostData::I32(v) => v.as_ptr() as *const u8,
            HostData::I64(v) => v.as_ptr() as *const u8,
        }
    }
    pub(super) fn ptr_mut(&mut self) -> *mut u8 {
        match self {
            HostData::BF16(v) => v.as_mut_ptr() as *mut u8,
            HostData::F32(v) => v.as_mut_ptr() as *mut u8,
            HostData::I32(v) => v.as_mut_ptr() as *mut u8,
            HostData::I64(v) => v.as_mut_ptr() as *mut u8,
        }
    }
}
