"""Small launches of every kernel variant, for compute-sanitizer and ncu.

    compute-sanitizer --tool memcheck  python benchmarks/sanitizer_cases.py
    compute-sanitizer --tool racecheck python benchmarks/sanitizer_cases.py [--kernels wgmma --no-models]
    compute-sanitizer --tool racecheck python benchmarks/sanitizer_cases.py --key-bias-only
    ncu --clock-control none -k regex:joint_attention python benchmarks/sanitizer_cases.py --shape 1x24x4608x128
    ncu ... python benchmarks/sanitizer_cases.py --shape 1x24x4608x128 --kernels wgmma --dtype bf16

Shapes are odd on purpose (partial query blocks and key tiles). Exits non-zero
if an f32-path result is off by more than 1e-5 from float64, a 16-bit result
(float64 on the same 16-bit inputs) has a relative L2 error above one 16-bit
epsilon (an 8-bit one above `EIGHT_BIT_REL_L2`), or a tiny FLUX.2 forward is not finite. A 16-bit kernel that cannot
run on this device is reported and skipped.
"""

from __future__ import annotations

import argparse
import itertools

import torch

from pictor_diffusers import PictorAttn, attention
from pictor_diffusers.cuda.plan import cannot_run
from pictor_diffusers.cuda.registry import eight_bit_kernels, kernels_for
from pictor_diffusers.testing.models import TINY_CONFIG, build_transformer, transformer_inputs
from pictor_diffusers.testing.references import attention_float64, random_qkv

CASES = [(1, 2, 77, 128), (2, 1, 45, 64), (1, 2, 130, 96), (1, 1, 70, 200), (1, 1, 33, 384), (1, 1, 1, 32)]
CASES_16BIT = [(1, 2, 77, 128), (2, 3, 300, 128), (1, 2, 77, 64), (2, 70, 130, 128), (1, 2, 2100, 128)]
"""(2, 70, 130, 128) has 280 work tiles of 128 rows, more than the SMs: a persistent build's blocks take several;
(1, 2, 2100, 128) attends more than `registry.SHORT_KEYS` keys, which the non-persistent builds run."""
F32_KERNELS = kernels_for("float32")[1:]
HALF_KERNELS = kernels_for("bfloat16")[1:]
EIGHT_BIT = eight_bit_kernels()
EIGHT_BIT_REL_L2, EIGHT_BIT_MAX_ABS = 0.08, 0.15
"""The 8-bit kernels' bounds on N(0, 1) inputs (measured on the H200: rel L2 3.5e-2 to 4.9e-2)."""
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
TINY_D128 = {**TINY_CONFIG, "attention_head_dim": 128, "num_attention_heads": 2, "axes_dims_rope": (32, 32, 32, 32)}


def run_f32(shape: tuple[int, ...], kernels: list[str]) -> bool:
    q, k, v = random_qkv(*shape, seed=sum(shape))
    ref = attention_float64(q, k, v)
    ok = True
    for kernel in kernels:
        reason = cannot_run(kernel, q, k, v)
        if reason is not None:
            print(f"{shape} kernel={kernel}: skipped ({reason})")
            continue
        err = (attention(q, k, v, kernel=kernel).double() - ref).abs().max().item()
        print(f"{shape} kernel={kernel}: max_abs {err:.2e}")
        ok &= err <= 1e-5
    return ok


def run_16bit(shape: tuple[int, ...], kernels: list[str], dtypes: list[torch.dtype]) -> bool:
    ok = True
    for dtype in dtypes:
        q, k, v = (t.to(dtype) for t in random_qkv(*shape, seed=sum(shape)))
        ref = attention_float64(q, k, v)
        for kernel in kernels:
            reason = cannot_run(kernel, q, k, v)
            if reason is not None:
                print(f"{shape} kernel={kernel} {dtype}: skipped ({reason})")
                continue
            out = attention(q, k, v, kernel=kernel).double()
            rel = ((out - ref).norm() / ref.norm()).item()
            print(f"{shape} kernel={kernel} {dtype}: rel_l2 {rel:.2e} max_abs {(out - ref).abs().max().item():.2e}")
            bound = EIGHT_BIT_REL_L2 if kernel in EIGHT_BIT else torch.finfo(dtype).eps
            ok &= rel <= bound and bool(torch.isfinite(out).all())
            token_major = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
            same = torch.equal(attention(*token_major, kernel=kernel).double(), out)
            print(f"{shape} kernel={kernel} {dtype} token-major views: {'same' if same else 'DIFFERENT'}")
            ok &= same
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", help="one BxHxNxD shape instead of the odd-shape sets")
    parser.add_argument("--kernels", help=f"comma list of {F32_KERNELS + HALF_KERNELS} (default: all)")
    parser.add_argument("--dtype", default="bf16,fp16", help="16-bit dtypes for wgmma / mma16: bf16, fp16")
    parser.add_argument("--no-models", action="store_true", help="skip the tiny FLUX.2 forwards (prologue cases)")
    parser.add_argument("--key-bias-only", action="store_true", help="only the wgmma key-bias cases")
    args = parser.parse_args()
    if args.key_bias_only:
        return 0 if run_key_bias_cases([DTYPES[name] for name in args.dtype.split(",")]) else 1
    kernels = args.kernels.split(",") if args.kernels else list(F32_KERNELS + HALF_KERNELS)
    f32_kernels = [k for k in kernels if k in F32_KERNELS]
    half_kernels = [k for k in kernels if k in HALF_KERNELS]
    dtypes = [DTYPES[name] for name in args.dtype.split(",")]
    shape = tuple(int(x) for x in args.shape.split("x")) if args.shape else None
    ok = True
    for case in [shape] if shape else CASES:
        ok &= run_f32(case, f32_kernels) if f32_kernels else True
    for case in [shape] if shape else CASES_16BIT:
        ok &= run_16bit(case, half_kernels, dtypes) if half_kernels else True
    if shape is None:
        ok &= run_key_lens_cases(kernels, dtypes)
        ok &= run_key_bias_cases(dtypes) if "wgmma" in kernels else True
        ok &= True if args.no_models else run_prologue_cases()
    return 0 if ok else 1


def run_key_lens_cases(kernels: list[str], dtypes: list[torch.dtype]) -> bool:
    """Per-batch key counts (all keys, none, a partial tile) on every kernel, head_dim 64 and 128: batch b
    against float64 over its first counts[b] keys; a batch with none must be all 0. 50 heads: 150 work
    tiles, more than the SMs, so a persistent kernel's blocks cross from batches with keys to one without."""
    counts, ok = [77, 0, 40], True
    for dtype, head_dim in itertools.product([torch.float32, *dtypes], (64, 128)):
        q, k, v = (t.to(dtype) for t in random_qkv(3, 50, 77, head_dim, seed=11))
        key_lens = torch.tensor(counts, dtype=torch.int32, device="cuda")
        family = F32_KERNELS if dtype == torch.float32 else HALF_KERNELS
        for kernel in [name for name in kernels if name in family]:
            if cannot_run(kernel, q, k, v) is not None:
                continue
            out = attention(q, k, v, kernel=kernel, key_lens=key_lens).double()
            errors = [(out[b] - attention_float64(q[b:b+1], k[b:b+1, :, :n], v[b:b+1, :, :n])[0]).abs().max().item()
                      for b, n in enumerate(counts) if n]  # fmt: skip
            bound = 1e-5 if dtype == torch.float32 else EIGHT_BIT_MAX_ABS if kernel in EIGHT_BIT else 2e-2
            print(f"key_lens {counts} D{head_dim} kernel={kernel} {dtype}: max_abs {max(errors):.2e}")
            ok &= max(errors) <= bound and bool((out[1] == 0).all())
    return ok


def run_key_bias_cases(dtypes: list[torch.dtype]) -> bool:
    """The wgmma kernel's key-bias builds, head_dim 64 and 128: 2100 keys (the one-block build) and 181 (the
    persistent one), each ending in a partial key tile; N(0, 9) biases, batch 0's leading and trailing tiles -inf,
    batch 1 all -inf (rows of 0),
    against float64 SDPA with the bias as its mask."""
    ok = True
    for dtype, head_dim, seq_k in itertools.product(dtypes, (64, 128), (2100, 181)):
        q = random_qkv(2, 3, 150, head_dim, seed=12)[0].to(dtype)
        k, v = (t.to(dtype) for t in random_qkv(2, 3, seq_k, head_dim, seed=13)[1:])
        if cannot_run("wgmma", q, k, v) is not None:
            continue
        bias = torch.randn(2, 3, seq_k, device="cuda") * 3
        bias[0, :, : seq_k // 3], bias[0, :, -seq_k // 4 :], bias[1] = float("-inf"), float("-inf"), float("-inf")
        out = attention(q, k, v, kernel="wgmma", key_bias=bias).double()
        mask = bias[:1, :, None].double()
        want = torch.nn.functional.scaled_dot_product_attention(*(t[:1].double() for t in (q, k, v)), attn_mask=mask)
        error = (out[0] - want.transpose(1, 2).reshape(150, 3 * head_dim)).abs().max().item()
        print(f"key_bias D{head_dim} Nk{seq_k} kernel=wgmma {dtype}: max_abs {error:.2e}")
        ok &= error <= 2e-2 and bool((out[1] == 0).all())
    return ok


@torch.no_grad()
def run_prologue_cases() -> bool:
    """Tiny FLUX.2 forwards through PictorAttn: the fused prologue (f32 and 16-bit outputs; at head_dim 128 on
    Hopper the parity path's split prologue; fp8 from bf16, fp16 and f32 models), QKV projections fused and not."""
    finite = True
    cases = [(TINY_CONFIG, torch.float32, "fp32"), (TINY_CONFIG, torch.bfloat16, "fp32")]
    cases += [(TINY_D128, torch.float32, "fp32"), (TINY_D128, torch.bfloat16, "fp32")]
    cases += [(TINY_D128, torch.bfloat16, "bf16"), (TINY_D128, torch.float16, "fp16")]
    cases += [(TINY_D128, dtype, "fp8") for dtype in (torch.bfloat16, torch.float16, torch.float32)]
    for config, dtype, precision in cases:
        model = build_transformer(config, device="cuda", dtype=dtype)
        model.set_attn_processor(PictorAttn(precision=precision))
        inputs = transformer_inputs(model, batch=2, latent_hw=(5, 7), text_len=9)
        finite &= bool(torch.isfinite(model(**inputs)[0]).all())
        model.fuse_qkv_projections()
        finite &= bool(torch.isfinite(model(**inputs)[0]).all())
        print(f"tiny FLUX.2 {dtype} head_dim {config['attention_head_dim']} precision={precision}: finite={finite}")
    return finite


if __name__ == "__main__":
    raise SystemExit(main())
