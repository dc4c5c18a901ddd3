"""Where the host time of a backend call goes: µs per call and cProfile's top functions, per case.

Cases, bf16 through `dispatch_attention_fn` (native vs pictor_bf16; and pictor_bf16's backend function called
directly, without the dispatcher's own host time) and `attention()` directly (fp16x3 on f32):
`short` (B1 H2 N64 D128: host-bound), `cross` (B2 H24, 8192 queries over 300 keys), `masked` (B2 H24 N512
with a bool key-padding mask), `float-masked` (the same keys under an additive 0 / -10000 float mask),
`fp16x3` (`attention()` on f32 B1 H2 N64 D128). Host time: back-to-back calls while the GPU is held busy
(`bench_overheads.host_us_per_call`).

    python benchmarks/profile_host.py --json benchmarks/results/h100_host_profile.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
from pathlib import Path

import torch
from bench_kernel import environment
from bench_overheads import host_us_per_call
from diffusers.models import attention_dispatch
from diffusers.models.attention_dispatch import attention_backend, dispatch_attention_fn

import pictor_diffusers
from pictor_diffusers import attention


def token_major(batch: int, seq: int, heads: int = 24, head_dim: int = 128) -> torch.Tensor:
    return torch.randn(batch, seq, heads, head_dim, device="cuda", dtype=torch.bfloat16)


def cases() -> dict[str, tuple]:
    """name -> (q, k, v, mask) for the dispatcher cases."""
    kv512 = token_major(2, 512)
    keep = torch.ones(2, 512, dtype=torch.bool, device="cuda")
    keep[1, 300:] = False
    additive = torch.where(keep, 0.0, -10000.0).to(torch.bfloat16)[:, None, None, :]
    return {
        "short": (token_major(1, 64, 2), token_major(1, 64, 2), token_major(1, 64, 2), None),
        "cross": (token_major(2, 8192), token_major(2, 300), token_major(2, 300), None),
        "masked": (token_major(2, 512), kv512, kv512, keep[:, None, None, :]),
        "float-masked": (token_major(2, 512), kv512, kv512, additive),
    }


def backend_function(name: str) -> object:
    """The function diffusers' dispatcher calls for backend `name` (without the dispatcher's own host time)."""
    registry = attention_dispatch._AttentionBackendRegistry
    return registry._backends[attention_dispatch.AttentionBackendName(name)]


def profile(run: object, calls: int = 300) -> list[str]:
    """cProfile's top 12 functions by own time over `calls` calls of `run()` (µs per call)."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        run()
    profiler.disable()
    torch.cuda.synchronize()
    stream = io.StringIO()
    pstats.Stats(profiler, stream=stream).sort_stats("tottime").print_stats(12)
    return [line for line in stream.getvalue().splitlines() if line.strip()][-13:]


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    assert pictor_diffusers  # registers the backends
    records = []
    for name, (q, k, v, mask) in cases().items():
        for backend in ("native", "pictor_bf16"):

            def run(q=q, k=k, v=v, mask=mask, backend=backend) -> torch.Tensor:
                with attention_backend(backend):
                    return dispatch_attention_fn(q, k, v, attn_mask=mask)

            records.append({"case": name, "backend": backend, "host_us": host_us_per_call(run), "top": profile(run)})
        function = backend_function("pictor_bf16")

        def direct_backend(q=q, k=k, v=v, mask=mask, function=function) -> torch.Tensor:
            return function(q, k, v, attn_mask=mask)

        records.append({"case": name, "backend": "pictor_bf16 function", "host_us": host_us_per_call(direct_backend),
                        "top": profile(direct_backend)})  # fmt: skip
    f32 = torch.randn(1, 2, 64, 128, device="cuda")
    for kernel in ("fp16x3", "wgmma"):
        x = f32 if kernel == "fp16x3" else f32.to(torch.bfloat16)

        def direct(x=x, kernel=kernel) -> torch.Tensor:
            return attention(x, x, x, kernel=kernel)

        records.append({"case": f"attention-{kernel}", "backend": "pictor", "host_us": host_us_per_call(direct),
                        "top": profile(direct)})  # fmt: skip
    env = environment()
    for record in records:
        print(f"{record['case']:>18} {record['backend']:>12}: {record['host_us']:7.1f} µs host per call")
        print("\n".join(record["top"]))
    if args.json:
        args.json.write_text(json.dumps([{"suite": "host_profile", **r, **env} for r in records], indent=1))


if __name__ == "__main__":
    main()
