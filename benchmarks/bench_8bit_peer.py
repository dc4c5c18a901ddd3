"""pictor's 8-bit kernels and their peer on Hopper: `attention(kernel="fp8")` (E4M3 P.V), `attention(kernel="int8")`
(u8 x int8 P.V) and SageAttention 1.0.6 (int8 Q.K per block, fp16 P.V, Triton) beside pictor's bf16 kernel and
SDPA's cuDNN backend, speed and accuracy on the same inputs.

* Speed: B1, D128, H 24 and 48, N 4608 and 16896 (issue 13's kernel shapes); fresh N(0,1) bf16 inputs;
  GPU time by CUDA events after warm-up, median; TFLOP/s counted as 4 B H N^2 D / t. Both 8-bit rows include
  their quantisation; pictor's are also timed by stage (`pictor_<kernel>_prepass`: the two quantising launches;
  `pictor_<kernel>_kernel`: the attention kernel alone on prepared operands).
* Accuracy: B1 H24 N4608, the study's three input sets (`quant_reference.study_inputs`: N(0,1), K with a
  5-sigma channel offset, peaky q and k x4), rounded to bf16; every method against float64 attention of the
  same rounded inputs: cosine similarity, relative L1, relative L2, max abs.

    python benchmarks/bench_8bit_peer.py --json benchmarks/results/h200_8bit_peer.json
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_kernel import environment
from torch.nn.attention import SDPBackend, sdpa_kernel

from pictor_diffusers import attention
from pictor_diffusers.testing.quant_study import error_metrics, study_inputs
from pictor_diffusers.testing.references import attention_float64
from pictor_diffusers.testing.timing import median_ms

SPEED_SHAPES = [(1, 24, 4608, 128), (1, 48, 4608, 128), (1, 24, 16896, 128), (1, 48, 16896, 128)]
ACCURACY_SHAPE = (1, 24, 4608, 128)
Method = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _token_major(out: torch.Tensor) -> torch.Tensor:
    """`[B, H, N, D]` -> `[B, N, H*D]`, the layout pictor returns."""
    batch, heads, seq, head_dim = out.shape
    return out.transpose(1, 2).reshape(batch, seq, heads * head_dim)


def methods() -> dict[str, Method]:
    """name -> attention of head-major bf16 q, k, v, token-major output."""
    from sageattention import sageattn

    def cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return _token_major(F.scaled_dot_product_attention(q, k, v))

    return {
        "pictor_bf16": lambda q, k, v: attention(q, k, v),
        "pictor_fp8": lambda q, k, v: attention(q, k, v, kernel="fp8"),
        "pictor_int8": lambda q, k, v: attention(q, k, v, kernel="int8"),
        "sdpa_cudnn_bf16": cudnn,
        "sageattn_1.0.6": lambda q, k, v: _token_major(sageattn(q, k, v, tensor_layout="HND", smooth_k=True)),
    }


def speed_rows(table: dict[str, Method]) -> list[dict]:
    rows = []
    for shape in SPEED_SHAPES:
        generator = torch.Generator(device="cuda").manual_seed(sum(shape))
        q, k, v = (torch.randn(shape, device="cuda", generator=generator).bfloat16() for _ in range(3))
        flops = 4 * shape[0] * shape[1] * shape[2] ** 2 * shape[3]
        runs = {name: (lambda run=run, qkv=(q, k, v): run(*qkv)) for name, run in table.items()}
        for name, run in {**runs, **eight_bit_stages(q, k, v, "fp8"), **eight_bit_stages(q, k, v, "int8")}.items():
            ms = median_ms(run, warmup=5, timed=20)
            tflops = flops / ms / 1e9
            rows.append({"method": name, "shape": shape, "ms": ms, "tflops": tflops})
            print(f"{name:>16} B{shape[0]} H{shape[1]} N{shape[2]:>5} D{shape[3]}: {ms:8.3f} ms {tflops:7.1f} TFLOP/s")
    return rows


def eight_bit_stages(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, name: str) -> dict[str, Callable[[], object]]:
    """The 8-bit call's two stages on these inputs (kernel `name`): the prepass, and the kernel on operands
    prepared once."""
    from pictor_diffusers.cuda import nvrtc, runtime
    from pictor_diffusers.cuda.geometry import Geometry
    from pictor_diffusers.cuda.launch import _signature
    from pictor_diffusers.cuda.plan import resolve
    from pictor_diffusers.cuda.quantized import quantize, quantized_operands

    batch, heads, seq, head_dim = q.shape
    selection, function, prepass = resolve(name, q.dtype, q.dtype, head_dim, q.device.index, True)
    variant = selection.variant
    pv = variant.spec.geometry["PV"]
    geometry = Geometry(batch * heads, seq, seq, seq, seq, head_dim, q.dtype, heads, head_dim**-0.5 / math.log(2.0))
    out = torch.empty(batch, seq, heads * head_dim, dtype=q.dtype, device=q.device)
    pointers = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), 0, 0)
    operands, keep = quantized_operands(pointers, geometry, q.device.index, prepass, pv)
    args = (*operands, heads, seq, seq, seq)
    grid, shared, signature = (
        variant.grid(batch, heads, seq, nvrtc.multiprocessors(q.device.index)),
        variant.shared_bytes,
        _signature(variant.spec),
    )

    def kernel() -> tuple:
        runtime.launch(function, q.device.index, grid, variant.threads, shared, signature, args)
        return keep

    def prepass_only() -> tuple:
        return quantize(pointers[:3], geometry, q.device.index, prepass, pv)

    return {f"pictor_{name}_prepass": prepass_only, f"pictor_{name}_kernel": kernel}


def accuracy_rows(table: dict[str, Method]) -> list[dict]:
    rows = []
    for kind in ("normal", "k_offset", "peaky"):
        q, k, v = (t.cuda().bfloat16() for t in study_inputs(kind, *ACCURACY_SHAPE, seed=7))
        reference = attention_float64(q, k, v)
        bf16_l1 = None
        for name, run in table.items():
            metrics = error_metrics(run(q, k, v).double(), reference)
            bf16_l1 = metrics["rel_l1"] if name == "pictor_bf16" else bf16_l1
            rows.append({"method": name, "inputs": kind, **metrics, "rel_l1_x_bf16": metrics["rel_l1"] / bf16_l1})
            text = " ".join(f"{key} {value:.3e}" for key, value in metrics.items())
            print(f"{name:>16} {kind:>8}: {text} (rel_l1 {metrics['rel_l1'] / bf16_l1:.2f}x bf16's)")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    table = methods()
    with torch.no_grad():
        record = {"suite": "8bit_peer", **environment()}
        record["speed"], record["accuracy"] = speed_rows(table), accuracy_rows(table)
    if args.json:
        args.json.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
