"""Arrays as the native layer takes them: plain descriptors of caller memory.

A descriptor is ``(data_ptr, dtype, shape, strides_in_elements, device)`` with ``device``
-1 for host memory or a CUDA ordinal. torch tensors are read through ``data_ptr()`` and
``stride()``, numpy arrays through ``__array_interface__``; nothing is copied. torch is
optional: without it only numpy arrays are accepted. numpy has no bf16: bf16 kernels
take f32 arrays (the reference accepts them), or ``ml_dtypes.bfloat16`` arrays when that
package is installed.
"""

from __future__ import annotations

import numpy as np

try:  # torch is optional
    import torch
except ImportError:  # pragma: no cover - exercised by the numpy-only CI
    torch = None

_NUMPY_DTYPES = {np.dtype(np.float32): "f32", np.dtype(np.int32): "i32", np.dtype(np.int64): "i64"}
_NUMPY_OF = {"f32": np.float32, "i32": np.int32, "i64": np.int64}
_TORCH_DTYPES = {} if torch is None else {torch.bfloat16: "bf16", torch.float32: "f32", torch.int32: "i32", torch.int64: "i64"}
_TORCH_OF = {} if torch is None else {v: k for k, v in _TORCH_DTYPES.items()}


_Tensor = None if torch is None else torch.Tensor


def is_torch(x) -> bool:
    return _Tensor is not None and isinstance(x, _Tensor)


ARRAY_TYPES = (np.ndarray,) if torch is None else (torch.Tensor, np.ndarray)


def is_array(x) -> bool:
    return isinstance(x, ARRAY_TYPES)


def device_index(x) -> int:
    """-1 for host memory, else the CUDA ordinal."""
    if is_torch(x):
        if x.is_cuda:
            return x.get_device()
        if x.is_cpu:
            return -1
        raise RuntimeError(f"tensors on {x.device} are not supported (cpu or cuda)")
    return -1


def is_cuda(x) -> bool:
    return is_torch(x) and x.is_cuda


def dtype_name(x) -> str:
    if is_torch(x):
        return _TORCH_DTYPES.get(x.dtype) or str(x.dtype).replace("torch.", "")
    if x.dtype.name == "bfloat16" and x.itemsize == 2:  # ml_dtypes' bfloat16
        return "bf16"
    return _NUMPY_DTYPES.get(x.dtype, str(x.dtype)) if x.dtype.isnative else f"{x.dtype} (non-native byte order)"


def describe(x, op: str, name: str):
    """The descriptor of ``x``; ``op`` and ``name`` label errors."""
    if _Tensor is not None and isinstance(x, _Tensor):
        # One pass over the attributes (this runs for every tensor of every call).
        if x.is_cuda:
            dev = x.get_device()
        elif x.is_cpu:
            dev = -1
        else:
            dev = device_index(x)  # raises: neither host nor CUDA memory
        return (x.data_ptr(), _TORCH_DTYPES.get(x.dtype) or dtype_name(x), x.shape, x.stride(), dev)
    if isinstance(x, np.ndarray):
        ptr = x.__array_interface__["data"][0]
        size = x.itemsize
        if any(s % size for s in x.strides):
            raise ValueError(f"{op}: argument `{name}` has byte strides {x.strides} that are not multiples of its item size {size}")
        return (ptr, dtype_name(x), tuple(x.shape), tuple(s // size for s in x.strides), -1)
    raise TypeError(f"{op}: argument `{name}` must be a numpy array or a torch tensor, got {type(x).__name__}")


def describe_opt(x, op: str, name: str):
    return None if x is None else describe(x, op, name)


def _byte_range(d):
    ptr, dtype, shape, strides, dev = d
    if 0 in shape:
        return None
    size = {"bf16": 2, "f32": 4, "i32": 4, "i64": 8}.get(dtype, 8)
    lo = sum((n - 1) * s for n, s in zip(shape, strides) if s < 0)
    hi = sum((n - 1) * s for n, s in zip(shape, strides) if s > 0)
    return dev, ptr + lo * size, ptr + (hi + 1) * size


def check_no_overlap(op: str, outputs: dict, inputs: dict) -> None:
    """A caller's ``out=`` array must not share memory with an input or another output."""
    outs = [(n, _byte_range(d)) for n, d in outputs.items() if d is not None]
    ins = [(n, _byte_range(d)) for n, d in inputs.items() if d is not None]
    for i, (on, orr) in enumerate(outs):
        if orr is None:
            continue
        for n, r in ins + outs[i + 1:]:
            if r is not None and r[0] == orr[0] and r[1] < orr[2] and orr[1] < r[2]:
                raise ValueError(f"{op}: output `{on}` overlaps `{n}`; pass memory of its own")


def empty(like, shape, dtype: str):
    """Uninitialised contiguous memory of ``dtype`` beside ``like`` (torch's allocator for
    torch tensors, numpy for numpy arrays). ``dtype`` is a kernel dtype name or "like"."""
    if is_torch(like):
        # new_empty: like's device without building a torch.device.
        return like.new_empty(tuple(shape)) if dtype == "like" else like.new_empty(tuple(shape), dtype=_TORCH_OF[dtype])
    nd = like.dtype if dtype == "like" else _NUMPY_OF[dtype]
    return np.empty(tuple(shape), dtype=nd)


def empty_token_major(like, b, h, s, c):
    """A logical ``[B,H,S,C]`` array stored token-major (``[B,S,H,C]`` contiguous)."""
    if is_torch(like):
        return torch.empty_strided((b, h, s, c), (s * h * c, c, h * c, 1), dtype=like.dtype, device=like.device)
    return empty(like, (b, s, h, c), "like").transpose(0, 2, 1, 3)


def swap01(x):
    """The view with the first two dimensions swapped (SBHD <-> BSHD); no copy."""
    if is_torch(x):
        return x.transpose(0, 1)
    axes = list(range(x.ndim))
    axes[0], axes[1] = 1, 0
    return x.transpose(axes)
