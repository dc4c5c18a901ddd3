"""One precision table (`pictor_diffusers.integration.precision`) behind `PictorAttn(precision=...)` and backends."""

from __future__ import annotations

import pytest
import torch

from pictor_diffusers import PictorAttn
from pictor_diffusers.cuda.registry import eight_bit_kernels
from pictor_diffusers.integration.backend import BACKENDS
from pictor_diffusers.integration.precision import BACKEND_PRECISIONS, PRECISIONS, compute_dtype, resolve_kernel

EXPECTED_BACKENDS = {
    "pictor": (torch.float32, "auto"),
    "pictor_bf16": (torch.bfloat16, "auto"),
    "pictor_fp16": (torch.float16, "auto"),
    "pictor_fp8": (torch.bfloat16, eight_bit_kernels()[0]),
}


def test_backends_are_rows_of_the_precision_table() -> None:
    assert {name: (backend.compute, backend.kernel) for name, backend in BACKENDS.items()} == EXPECTED_BACKENDS
    for name, precision in BACKEND_PRECISIONS.items():
        assert BACKENDS[name].compute == PRECISIONS[precision].compute
        assert PictorAttn(precision=precision).kernel == BACKENDS[name].kernel


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_every_listed_kernel_is_taken(precision: str) -> None:
    for kernel in PRECISIONS[precision].kernels:
        expected = PRECISIONS[precision].kernel if kernel == "auto" else kernel
        assert resolve_kernel(precision, kernel) == expected == PictorAttn(kernel, precision).kernel
    if precision == "fp8":
        assert resolve_kernel("fp8", "auto") == "int8", "the 8-bit path runs u8 x int8 P.V unless told otherwise"
        assert [resolve_kernel("fp8", name) for name in eight_bit_kernels()] == ["int8", "fp8"]


@pytest.mark.parametrize(
    ("precision", "model", "expected"),
    [
        ("fp32", torch.bfloat16, torch.float32),
        ("bf16", torch.float32, torch.bfloat16),
        ("fp16", torch.bfloat16, torch.float16),
        ("fp8", torch.float16, torch.bfloat16),
        ("auto", torch.bfloat16, torch.bfloat16),
        ("auto", torch.float16, torch.float16),
        ("auto", torch.float32, torch.float32),
    ],
)
def test_compute_dtype(precision: str, model: torch.dtype, expected: torch.dtype) -> None:
    assert compute_dtype(precision, model) == expected
