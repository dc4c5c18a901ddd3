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


@torch.library.custom_op("pictor::attention", mutates_args=())
def _attention_op(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, kernel: str, out_dtype: str
) -> torch.Tensor:
    check_attention_inputs(query, key, value)
    check_scale(scale)
    check_kernel_choice(kernel, OUT_DTYPES[out_dtype])
    dtype = OUT_DTYPES[out_dtype]
    if query.device.type != "cuda":
        return online_softmax_attention(query, key, value, scale).to(dtype)
    from . import cuda_launch

    blocker = cuda_launch.tensor_core_blocker(query, key, value)
    if kernel == "tf32x3" and blocker is not None:
        raise ValueError(f"kernel='tf32x3' cannot run these inputs: {blocker}")
    if kernel == "f32" or blocker is not None:
        return cuda_launch.flash_attention_f32_cuda(query, key, value, scale).to(dtype)
    return cuda_launch.flash_attention_tf32x3_cuda(query, key, value, scale, out_dtype=dtype)


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
    out_dtype: torch.dtype = torch.float32,
    kernel: str = "auto",
) -> torch.Tensor:
    """Non-causal scaled-dot-product attention at f32 accuracy (inference only).

    Args:
        query, key, value: head-major `[B, H, N, D]`, contiguous torch.float32,
            all on one device. 1 <= D <= 384; any N >= 1.
        scale: logit scale, finite and > 0; defaults to `D ** -0.5`.
        out_dtype: float32, bfloat16 or float16; the f32 result is rounded once.
        kernel: "auto" (tensor cores where possible), "tf32x3" (require the
            3xTF32 tensor-core kernel) or "f32" (the scalar-FP32 reference kernel).

    Returns:
        token-major `[B, N, H*D]` in `out_dtype` on the inputs' device:
        `out[b, n, h*D + d] = softmax(scale * q k^T)[b, h, n, :] @ v[b, h, :, d]`.

    On CUDA, "auto" runs the 3xTF32 tensor-core kernel when D is 32, 64, 96 or
    128 and the device has the tensor cores and shared memory for it (Hopper),
    and the scalar-FP32 kernel otherwise; both are f32-accurate. On CPU it runs
    the same online-softmax algorithm in pure torch (`pictor_diffusers.reference`).
    """
    check_attention_inputs(query, key, value)
    check_kernel_choice(kernel, out_dtype)
    if scale is None:
        scale = query.shape[-1] ** -0.5
    check_scale(float(scale))
    return torch.ops.pictor.attention(query, key, value, float(scale), kernel, str(out_dtype).removeprefix("torch."))
