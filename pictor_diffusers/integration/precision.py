"""The precision table: one source for `PictorAttn(precision=...)` and the diffusers backends.

Each precision names the dtype q, k, v are packed in (the prologue's output and the
attention kernel's input), the kernel it runs and the `kernel=` choices it takes:

* "fp32" (default, parity): norms, RoPE and attention in float32 whatever the
  model dtype; attention matches float64 to about 1e-6.
* "bf16" / "fp16" (speed): norms and RoPE in float32, q/k/v rounded once to the
  16-bit dtype, attention on 16-bit tensor cores with f32 accumulation and f32
  softmax (wgmma on Hopper); as accurate as SDPA's 16-bit kernels.
* "fp8" (8-bit speed, lossy): norms and RoPE in float32, q/k/v rounded to
  bf16, then quantised on the GPU (int8 q per row, smoothed int8 k per key
  tile, int8 v about each channel's mid-range) for int8 Q.K and u8 x int8 P.V
  on Hopper (the "int8" kernel; `kernel="fp8"`: E4M3 v and P.V); see the
  README's precision contract for their measured error.
* "auto": the 16-bit path in the model's dtype for bf16/fp16 models, "fp32"
  for fp32 models.

q and k are bounded by the RMSNorm, v is not: "fp16" on a bf16 or fp32 model
turns values beyond fp16's 65504 into inf. "auto" never narrows the range.

The diffusers backends (`pictor_diffusers.integration.backend.BACKENDS`) are rows of the same
table: `BACKEND_PRECISIONS` maps each backend name to its precision.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..cuda.registry import eight_bit_kernels, kernels_for

EIGHT_BIT_KERNEL = eight_bit_kernels()[0]
_HALF = (torch.bfloat16, torch.float16)


class Precision(NamedTuple):
    """One precision: q/k/v's compute dtype (None: chosen from the model dtype), the kernel `kernel="auto"`
    runs ("auto": chosen per call; else that kernel) and the `kernel=` choices it takes."""

    compute: torch.dtype | None
    kernel: str
    kernels: tuple[str, ...]


PRECISIONS: dict[str, Precision] = {
    "fp32": Precision(torch.float32, "auto", kernels_for("float32")),
    "bf16": Precision(torch.bfloat16, "auto", kernels_for("bfloat16", lossy=False)),
    "fp16": Precision(torch.float16, "auto", kernels_for("float16", lossy=False)),
    "fp8": Precision(torch.bfloat16, EIGHT_BIT_KERNEL, ("auto", *eight_bit_kernels())),
    "auto": Precision(None, "auto", ("auto",)),
}
"""Precision name -> its `Precision` row."""

BACKEND_PRECISIONS: dict[str, str] = {
    "pictor": "fp32",
    "pictor_bf16": "bf16",
    "pictor_fp16": "fp16",
    "pictor_fp8": "fp8",
}
"""diffusers attention backend name -> its precision in `PRECISIONS`."""


def resolve_kernel(precision: str, kernel: str) -> str:
    """The kernel a `PictorAttn(kernel=kernel, precision=precision)` runs (a named kernel itself, "auto" the
    row's `kernel`); ValueError names a bad pair."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {tuple(PRECISIONS)}, got {precision!r}")
    row = PRECISIONS[precision]
    if kernel not in row.kernels:
        raise ValueError(f"kernel={kernel!r} does not serve precision={precision!r}; choose one of {row.kernels}")
    return row.kernel if kernel == "auto" else kernel


def compute_dtype(precision: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype q, k, v are packed in for `precision` on a model of `model_dtype`."""
    chosen = PRECISIONS[precision].compute
    if chosen is not None:
        return chosen
    return model_dtype if model_dtype in _HALF else torch.float32
