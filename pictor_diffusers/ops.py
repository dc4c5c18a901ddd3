"""The public attention entry point, registered as a torch custom op.

`torch.ops.pictor.attention` is opaque to `torch.compile` (it has a fake
implementation for tracing), so compiled FLUX.2 graphs keep it as one node with
no graph break; its CUDA implementation is capturable in CUDA graphs.
"""

from __future__ import annotations

import torch

from .reference import online_softmax_attention
from .validation import check_attention_inputs, check_kernel_choice, check_scale

OUT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _attention_f32_cuda(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, kernel: str, dtype: torch.dtype
) -> torch.Tensor:
    from . import cuda_launch

    blocker = cuda_launch.tensor_core_blocker(query, key, value)
    if kernel == "tf32x3" and blocker is not None:
        raise ValueError(f"kernel='tf32x3' cannot run these inputs: {blocker}")
    if kernel == "f32" or blocker is not None:
        return cuda_launch.flash_attention_f32_cuda(query, key, value, scale).to(dtype)
    return cuda_launch.flash_attention_tf32x3_cuda(query, key, value, scale, out_dtype=dtype)


def _attention_half_cuda(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, kernel: str
) -> torch.Tensor:
    """The 16-bit path: wgmma on Hopper, mma16 elsewhere, the f32 kernels on upcast inputs last."""
    from . import cuda_launch, hopper_launch

    launchers = {
        "wgmma": (hopper_launch.wgmma_blocker, hopper_launch.flash_attention_wgmma_cuda),
        "mma16": (cuda_launch.mma16_blocker, cuda_launch.flash_attention_mma16_cuda),
    }
    reasons = []
    for name in ("wgmma", "mma16") if kernel == "auto" else (kernel,):
        blocker, launch = launchers[name]
        reason = blocker(query, key, value)
        if reason is None:
            return launch(query, key, value, scale)
        reasons.append(f"{name}: {reason}")
    if kernel != "auto":
        raise ValueError(f"kernel={kernel!r} cannot run these inputs: {'; '.join(reasons)}")
    upcast = tuple(t.float() for t in (query, key, value))
    return _attention_f32_cuda(*upcast, scale, "auto", query.dtype)


@torch.library.custom_op("pictor::attention", mutates_args=())
def _attention_op(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, kernel: str, out_dtype: str
) -> torch.Tensor:
    check_attention_inputs(query, key, value)
    check_scale(scale)
    dtype = OUT_DTYPES[out_dtype]
    check_kernel_choice(kernel, query.dtype, dtype)
    if query.device.type != "cuda":
        upcast = tuple(t.float() for t in (query, key, value))
        return online_softmax_attention(*upcast, scale).to(dtype)
    if query.dtype == torch.float32:
        return _attention_f32_cuda(query, key, value, scale, kernel, dtype)
    return _attention_half_cuda(query, key, value, scale, kernel)


@_attention_op.register_fake
def _attention_op_fake(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, kernel: str, out_dtype: str
) -> torch.Tensor:
    batch, heads, seq, head_dim = query.shape
    return query.new_empty((batch, seq, heads * head_dim), dtype=OUT_DTYPES[out_dtype])


def _no_backward(ctx: object, grad: torch.Tensor) -> None:
    raise NotImplementedError("pictor-diffusers kernels are inference-only: attention has no backward")


_attention_op.register_autograd(_no_backward)


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float | None = None,
    *,
    out_dtype: torch.dtype | None = None,
    kernel: str = "auto",
) -> torch.Tensor:
    """Non-causal scaled-dot-product attention (inference only).

    Args:
        query, key, value: head-major `[B, H, N, D]`, contiguous, one dtype, all
            on one device. 1 <= D <= 384; any N >= 1.
        scale: logit scale, finite and > 0; defaults to `D ** -0.5`.
        out_dtype: float32 inputs: float32 (default), bfloat16 or float16, the
            f32 result rounded once. 16-bit inputs: None or the input dtype.
        kernel: float32 inputs (the parity path): "auto" (3xTF32 tensor cores
            where possible), "tf32x3" or "f32" (the scalar-FP32 reference).
            bfloat16 / float16 inputs (the fast path): "auto", "wgmma" (Hopper)
            or "mma16" (sm_80+).

    Returns:
        token-major `[B, N, H*D]` on the inputs' device:
        `out[b, n, h*D + d] = softmax(scale * q k^T)[b, h, n, :] @ v[b, h, :, d]`.

    Precision: the parity path keeps f32 accuracy end to end (max-abs about
    1e-6 against float64 on N(0, 1) inputs). The fast path multiplies the
    16-bit inputs on tensor cores with f32 accumulation and an f32 softmax,
    rounds the probabilities to the input dtype for P.V as FlashAttention
    does, and rounds the output once. On CUDA "auto" picks wgmma on Hopper
    with D = 128, mma16 on sm_80+ with D in {64, 128}, and otherwise runs the
    f32 kernels on upcast inputs. On CPU both paths run the same
    online-softmax algorithm in float32 torch (`pictor_diffusers.reference`).
    """
    check_attention_inputs(query, key, value)
    if out_dtype is None:
        out_dtype = query.dtype
    check_kernel_choice(kernel, query.dtype, out_dtype)
    if scale is None:
        scale = query.shape[-1] ** -0.5
    check_scale(float(scale))
    return torch.ops.pictor.attention(query, key, value, float(scale), kernel, str(out_dtype).removeprefix("torch."))
