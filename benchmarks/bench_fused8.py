"""The 8-bit path from FLUX.2 projections: the fused prologue + quantisation against the unfused route.

One attention call after the projections, klein-4B shapes (24 heads of 128, batch 1): a single-stream block
(q, k, v chunks of one fused `[1, N, 3*3072 + 18432]` projection) and a double-stream block (separate text
and image projections), N = 512 text + 4096 or 16384 image tokens (1024² and 2048²), bf16, RMSNorm + RoPE.
Rows, GPU time (CUDA events after warm-up, median):

* `fused`: `fused8.attention_8bit` (the fused prologue + prepass, two launches, then the 8-bit kernel);
* `unfused`: the same with fusion off (prologue kernel -> bf16 q, k, v; the prepass's two launches; kernel);
* `fused_quantise` / `unfused_quantise`: the launches before the attention kernel alone;
* `bf16`: the prologue (bf16) and pictor's 16-bit kernel; `sdpa_cudnn`: SDPA's cuDNN backend on the
  prologue's bf16 q, k, v (attention alone, for scale).

TFLOP/s = 4 B H N^2 D / t for the rows that include attention.

    python benchmarks/bench_fused8.py --json benchmarks/results/h200_fused8.json
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from pictor_diffusers import attention, fused8
from pictor_diffusers.geometry import Geometry
from pictor_diffusers.launch import qkv_prologue_cuda
from pictor_diffusers.prologue import Segment, pack_head_major, prologue_inputs
from pictor_diffusers.quantized import quantize, quantize_projections
from pictor_diffusers.testing.timing import median_ms
from pictor_diffusers.validation import prologue_layout

HEADS, HEAD_DIM, TEXT = 24, 128, 512
INNER = HEADS * HEAD_DIM


def segments(block: str, image: int) -> list[Segment]:
    """Random bf16 projections laid out as FLUX.2's `block` ("single" or "double") produces them."""
    options = {"device": "cuda", "dtype": torch.bfloat16}
    norms = [torch.nn.RMSNorm(HEAD_DIM, eps=1e-6, device="cuda") for _ in range(4)]
    if block == "single":
        fused = torch.randn(1, TEXT + image, 3 * INNER + 6 * INNER, **options)
        return [Segment(*fused[..., : 3 * INNER].chunk(3, dim=-1), *norms[:2])]
    text = [torch.randn(1, TEXT, INNER, **options) for _ in range(3)]
    image_projections = [torch.randn(1, image, INNER, **options) for _ in range(3)]
    return [Segment(*text, *norms[:2]), Segment(*image_projections, *norms[2:])]


def rope(seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.rand(seq, HEAD_DIM // 2, device="cuda") * 6.3
    return angles.cos().repeat_interleave(2, -1), angles.sin().repeat_interleave(2, -1)


def rows(block: str, image: int) -> dict[str, Callable[[], object]]:
    parts, table = segments(block, image), rope(TEXT + image)
    seq = TEXT + image
    layout = prologue_layout(*prologue_inputs(parts, HEAD_DIM, table))
    assert layout is not None and fused8.fused_blocker(*prologue_inputs(parts, HEAD_DIM, table)) is None
    g = Geometry(HEADS, seq, seq, seq, seq, HEAD_DIM, torch.bfloat16, HEADS, HEAD_DIM**-0.5 / math.log(2.0))
    q, k, v = pack_head_major(parts, HEAD_DIM, table, torch.bfloat16)

    def unfused() -> torch.Tensor:
        blocker = fused8.projections_blocker
        fused8.projections_blocker = lambda _: "off"
        try:
            return fused8.attention_8bit(parts, HEAD_DIM, table, "fp8")
        finally:
            fused8.projections_blocker = blocker

    def unfused_quantise() -> object:
        pq, pk, pv = qkv_prologue_cuda(layout, torch.bfloat16)
        return quantize((pq.data_ptr(), pk.data_ptr(), pv.data_ptr()), g, pq.device.index)

    def cudnn() -> torch.Tensor:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v)

    return {
        "fused": lambda: fused8.attention_8bit(parts, HEAD_DIM, table, "fp8"),
        "unfused": unfused,
        "fused_quantise": lambda: quantize_projections(layout, g),
        "unfused_quantise": unfused_quantise,
        "bf16": lambda: attention(*pack_head_major(parts, HEAD_DIM, table, torch.bfloat16), kernel="auto"),
        "sdpa_cudnn": cudnn,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", default="4096,16384")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = []
    with torch.no_grad():
        for image in (int(n) for n in args.images.split(",")):
            for block in ("single", "double"):
                seq = TEXT + image
                flop = 4 * HEADS * seq * seq * HEAD_DIM
                for name, run in rows(block, image).items():
                    ms = median_ms(run)
                    tflops = None if name.endswith("quantise") else flop / ms / 1e9
                    results.append({"block": block, "N": seq, "H": HEADS, "row": name, "ms": ms, "tflops": tflops})
                    rate = "" if tflops is None else f" {tflops:6.0f} TFLOP/s"
                    print(f"{block:6s} N{seq:6d} {name:16s} {ms:8.3f} ms{rate}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
