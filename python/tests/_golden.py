"""Golden vectors (shared/golden, see its README) and the SPEC.md section 8 judgement.

Files: every ``.safetensors`` in ``<repo>/../shared/golden`` (``$DSV4_SHARED_DIR/golden``
when set) and in ``$DSV4_GOLDEN_DIR``. Read with numpy alone.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]


def golden_files() -> list[Path]:
    shared = Path(os.environ["DSV4_SHARED_DIR"]) if os.environ.get("DSV4_SHARED_DIR") else REPO.parent / "shared"
    files = sorted((shared / "golden").glob("*.safetensors")) if (shared / "golden").is_dir() else []
    extra = os.environ.get("DSV4_GOLDEN_DIR")
    if extra:
        files += sorted(Path(extra).glob("*.safetensors"))
    return files


_DTYPES = {"F32": np.float32, "I32": np.int32, "I64": np.int64}


def load(path: Path) -> dict:
    """``{(op, case): {"params": {...}, "tensors": {name: array}}}``."""
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    meta = header.pop("__metadata__", {}) or {}
    data = raw[8 + n:]
    cases: dict = {}
    for name, info in header.items():
        op, case, tensor = name.split(".", 2)
        a, b = info["data_offsets"]
        arr = np.frombuffer(data[a:b], dtype=_DTYPES[info["dtype"]]).reshape(info["shape"]).copy()
        cases.setdefault((op, case), {"params": {}, "tensors": {}})["tensors"][tensor] = arr
    for (op, case), c in cases.items():
        m = meta.get(f"{op}.{case}")
        if m is not None:
            c["params"] = json.loads(m) if isinstance(m, str) else m
    return cases


def all_cases() -> list[tuple[str, str, str]]:
    """``(file, op, case)`` for every case of every golden file."""
    out = []
    for f in golden_files():
        for op, case in sorted(load(f)):
            out.append((str(f), op, case))
    return out


def bf16_ulp(x: float) -> float:
    x = max(abs(x), np.finfo(np.float32).tiny)
    return 2.0 ** (math.floor(math.log2(x)) - 7)


def judge(name: str, got, ref, tol: str, row_len: int | None = None) -> None:
    """Assert ``got`` matches ``ref`` under SPEC.md section 8's class ``tol``:
    ``f32rows`` (max error / row's max |ref| <= 1e-5), ``bf16`` (rel. Frobenius <= 1e-2),
    ``bf16ulps`` (bf16 and every element within 2 bf16 ulps), ``f32grad`` (rel. Frobenius
    <= 5e-3), ``exact``. NaN never passes; infinities must match exactly."""
    got = np.asarray(got, dtype=np.float64).reshape(-1)
    ref = np.asarray(ref, dtype=np.float64).reshape(-1)
    assert got.shape == ref.shape, f"{name}: {got.size} values, reference has {ref.size}"
    assert not np.isnan(got).any(), f"{name}: NaN at {int(np.argmax(np.isnan(got)))}"
    inf = np.isinf(got) | np.isinf(ref)
    bad = inf & (got != ref)
    assert not bad.any(), f"{name}: element {int(np.argmax(bad))}: got {got[bad][0]}, reference {ref[bad][0]}"
    g, r = np.where(inf, 0.0, got), np.where(inf, 0.0, ref)

    def rel_fro():
        den = float(np.sqrt((r * r).sum()))
        num = float(np.sqrt(((g - r) ** 2).sum()))
        return 0.0 if num == 0 else (math.inf if den == 0 else num / den)

    if tol == "exact":
        n = int((got != ref).sum())
        assert n == 0, f"{name}: {n} mismatches"
    elif tol == "bf16":
        e = rel_fro()
        assert e <= 1e-2, f"{name}: relative Frobenius error {e:.3e} > 1e-2"
    elif tol == "f32grad":
        e = rel_fro()
        assert e <= 5e-3, f"{name}: relative Frobenius error {e:.3e} > 5e-3"
    elif tol == "f32rows":
        gr, rr = g.reshape(-1, row_len), r.reshape(-1, row_len)
        scale = np.abs(rr).max(axis=1, keepdims=True)
        err = np.abs(gr - rr)
        worst = np.where(scale > 0, err / np.where(scale > 0, scale, 1), np.where(err > 0, np.inf, 0)).max(initial=0.0)
        assert worst <= 1e-5, f"{name}: row-scaled error {worst:.3e} > 1e-5"
    elif tol == "bf16ulps":
        e = rel_fro()
        assert e <= 1e-2, f"{name}: relative Frobenius error {e:.3e} > 1e-2"
        gr, rr = g.reshape(-1, row_len), r.reshape(-1, row_len)
        row_max = np.abs(rr).max(axis=1, keepdims=True)
        mag = np.maximum(np.abs(rr), row_max / 256.0)
        ulp = np.vectorize(bf16_ulp)(mag)
        worst = float((np.abs(gr - rr) / ulp).max(initial=0.0))
        assert worst <= 2.0, f"{name}: {worst:.2f} bf16 ulps > 2"
    else:
        raise ValueError(f"unknown tolerance {tol}")


def sorted_rows(idx) -> np.ndarray:
    """Each row of ``[..., k]`` indices ascending with -1 last."""
    a = np.asarray(idx).astype(np.int64)
    key = np.where(a < 0, np.iinfo(np.int64).max, a)
    out = np.take_along_axis(a, np.argsort(key, axis=-1, kind="stable"), axis=-1)
    return np.where(out < 0, -1, out)
