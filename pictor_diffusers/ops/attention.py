"""The public attention entry point and its torch custom op.

`attention()` validates once and, in eager mode, resolves one plan (`cuda.plan`) and runs it
(`cuda.launch`) on CUDA, or runs the kernel's CPU twin (`reference`): the path that keeps host
overhead low. A CUDA call repeating a served call's shapes, strides, dtypes and addresses replays its
plan (`cuda.plan_memo`), skipping the checks and the planning it already passed. Under
`torch.compile`, or when autograd would record the call, it goes through
`torch.ops.pictor.attention` instead. That op is opaque to the compiler (a fake implementation
serves tracing), so compiled FLUX.2 graphs keep it as one node with no graph break; its backward
raises "inference-only". Its implementation is `attention()` itself (inside the op nothing is
compiling or recording, so the call runs eagerly), so, being public, it validates its own inputs.
Both are capturable in CUDA graphs.
"""

from __future__ import annotations

import torch

from ..cuda import plan_memo
from ..cuda.geometry import Window
from ..cuda.launch import run
from ..cuda.plan import check_kernel_choice, plan_attention
from ..dtypes import DTYPE_NAMES, DTYPES
from .custom_ops import inference_op, needs_op
from .reference import twin_attention
from .validation import check_attention_inputs, check_flag, check_key_bias, check_key_lens, check_scale


def _dtype(name: str) -> torch.dtype:
    """The dtype a custom op's `out_dtype` names; ValueError for another name."""
    if name not in DTYPES:
        raise ValueError(f"out_dtype must be one of {tuple(DTYPES)}, got {name!r}")
    return DTYPES[name]


def _attention_op_fake(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    kernel: str,
    out_dtype: str,
    key_lens: torch.Tensor | None = None,
    key_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    batch, heads, seq, head_dim = query.shape
    return query.new_empty((batch, seq, heads * head_dim), dtype=DTYPES[out_dtype])


@inference_op("attention", _attention_op_fake, "attention")
def _attention_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    kernel: str,
    out_dtype: str,
    key_lens: torch.Tensor | None = None,
    key_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    return attention(
        query, key, value, scale, out_dtype=_dtype(out_dtype), kernel=kernel, key_lens=key_lens, key_bias=key_bias
    )


def _attention_lse_op_fake(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    kernel: str,
    out_dtype: str,
    key_lens: torch.Tensor | None = None,
    key_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    batch, heads, seq, _ = query.shape
    return _attention_op_fake(query, key, value, scale, kernel, out_dtype), query.new_empty(
        (batch, seq, heads), dtype=torch.float32
    )


@inference_op("attention_lse", _attention_lse_op_fake, "attention")
def _attention_lse_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    kernel: str,
    out_dtype: str,
    key_lens: torch.Tensor | None = None,
    key_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return attention(
        query, key, value, scale, out_dtype=_dtype(out_dtype), kernel=kernel, return_lse=True, key_lens=key_lens,
        key_bias=key_bias,
    )  # fmt: skip


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float | None = None,
    *,
    out_dtype: torch.dtype | None = None,
    kernel: str = "auto",
    return_lse: bool = False,
    key_lens: torch.Tensor | None = None,
    key_bias: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Non-causal scaled-dot-product attention (inference only), with optional per-batch key counts or a
    bias per key.

    Args:
        query: `[B, H, Nq, D]`; key, value: `[B, H, Nk, D]`; one dtype, all on one
            device. 1 <= D <= 384; any Nq, Nk >= 1. Any strides: the Hopper 16-bit
            kernel ("wgmma") reads head-major tensors and token-major views
            (`x.transpose(1, 2)` of `[B, N, H, D]`) in place; other kernels and
            layouts get a contiguous copy first.
        scale: logit scale, finite and > 0; defaults to `D ** -0.5`.
        out_dtype: float32 inputs: float32 (default), bfloat16 or float16, the
            f32 result rounded once. 16-bit inputs: None or the input dtype.
        kernel: "auto", or a kernel of the inputs' family in the registry
            (`pictor_diffusers.cuda.registry.KERNELS`). float32 inputs (the parity
            path): "fp16x3" (Hopper: scaled fp16 hi/lo splits, three wgmma
            products), "tf32x3" (3xTF32 on mma.sync, sm_80+) or "f32" (the
            scalar-FP32 reference). bfloat16 / float16 inputs (the fast path): "wgmma"
            (Hopper) or "mma16" (sm_80+); or, by name only, an 8-bit kernel (Hopper, head_dim 128,
            int8 Q.K): "int8" (u8 x int8 P.V) or "fp8" (E4M3 P.V); see the README's precision contract.
        return_lse: also return the natural log-sum-exp of each row's scaled
            logits, `lse[b, n, h] = log(sum_j exp(scale * q[b, h, n] . k[b, h, j]))`,
            `[B, Nq, H]` float32 (the layout diffusers' ring-attention merge uses).
        key_lens: None, or int32 `[B]` on the inputs' device: batch b attends only its first
            `key_lens[b]` keys (values are clamped to [0, Nk], on the device, with no host sync).
            A key-padding mask becomes this by moving each batch's kept keys to the front
            (`pictor_diffusers.integration.dispatcher_call` does so for diffusers' masks). A batch with no keys
            gets outputs of 0 and LSE -inf.
        key_bias: None, or a float `[B, 1 or H, Nk]` tensor on the inputs' device (any strides, any float
            dtype), added to every query row's scaled logits, as SDPA adds a float `attn_mask` of shape
            `[B, 1 or H, 1, Nk]`: 0 keeps a key, -inf drops it, any other value biases it (a row whose keys
            are all -inf gets outputs of 0 and LSE -inf). Not with `key_lens`. On CUDA the wgmma kernel
            (Hopper, bfloat16 / float16) takes it; other kernels raise. No host sync.

    Returns:
        token-major `[B, Nq, H*D]` on the inputs' device:
        `out[b, n, h*D + d] = softmax(scale * q k^T + bias)[b, h, n, :] @ v[b, h, :, d]`;
        with `return_lse`, `(out, lse)`.

    Precision: the parity path keeps f32 accuracy end to end (max-abs about
    1e-6 against float64 on N(0, 1) inputs). The fast path multiplies the
    16-bit inputs on tensor cores with f32 accumulation and an f32 softmax,
    rounds the probabilities to the input dtype for P.V as FlashAttention
    does, and rounds the output once. On CUDA "auto" takes the first kernel of
    the family that can run the inputs (`cuda.selection.select_kernel`); 16-bit
    inputs no 16-bit kernel takes run the f32 kernels on upcast inputs. On CPU
    both paths run the same online-softmax algorithm in float32 torch
    (`pictor_diffusers.ops.reference`); "int8" and "fp8" run their quantised twins
    (`pictor_diffusers.ops.quant_reference.kernel_twin`), at the kernels' head_dim 128 only.
    """
    call = None if key_bias is not None else memo_key(query, key, value, scale, kernel, out_dtype, return_lse, key_lens)
    if call is not None:
        replayed = plan_memo.launch_replay(call)
        if replayed is not None:
            return replayed
    check_attention_inputs(query, key, value)
    check_key_lens(key_lens, query)
    check_key_bias(key_bias, query, key, key_lens)
    out_dtype = query.dtype if out_dtype is None else out_dtype
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    check_scale(scale)
    scale = float(scale)
    check_flag("return_lse", return_lse)
    check_kernel_choice(kernel, query.dtype, out_dtype)
    if needs_op(query, key, value):
        name = DTYPE_NAMES[out_dtype]
        op = torch.ops.pictor.attention_lse if return_lse else torch.ops.pictor.attention
        return op(query, key, value, scale, kernel, name, key_lens, key_bias)
    if query.device.type == "cuda":
        batch, heads, seq_q, _ = query.shape
        lse = torch.empty((batch, seq_q, heads), dtype=torch.float32, device=query.device) if return_lse else None
        plan = plan_attention(
            query, key, value, scale, kernel, out_dtype, lse=lse, key_lens=key_lens, key_bias=key_bias
        )
        if call is not None:
            plan = plan_memo.remember(call, plan, query, key, value, key_lens)
        out = run(plan)
        return (out, lse) if return_lse else out
    return twin_attention(query, key, value, scale, kernel, out_dtype, return_lse, key_lens, key_bias)


def memo_key(
    query: object, key: object, value: object, scale: object, kernel: object, out_dtype: object,
    return_lse: object, key_lens: object,
) -> tuple | None:  # fmt: skip
    """The call's `plan_memo` key when the host fast path may serve it: CUDA tensors, eagerly, with no
    autograd recording, no LSE, and arguments of the types the checks accept (so a key that matches one of a
    validated call means these arguments pass the same checks); else None. diffusers' backend names its own
    calls with it too (`kernel="backend"`, under its backend's name)."""
    if return_lse is not False or type(kernel) is not str:
        return None
    if not (key_lens is None or isinstance(key_lens, torch.Tensor)):
        return None
    if not (scale is None or type(scale) is float) or not (out_dtype is None or isinstance(out_dtype, torch.dtype)):
        return None
    tensor = torch.Tensor
    if not (isinstance(query, tensor) and isinstance(key, tensor) and isinstance(value, tensor)):
        return None
    if not query.is_cuda or needs_op(query, key, value):
        return None
    return plan_memo.call_key(query, key, value, scale, kernel, out_dtype, key_lens)


def windowed_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    windows: list[Window],
    *,
    out_dtype: torch.dtype,
    kernel: str = "auto",
) -> torch.Tensor:
    """One token-major output `[B, Nq, H*D]` whose row blocks attend to different key ranges.

    Args:
        query: `[B, H, Nq, D]`; key, value: `[B, H, Nk, D]` (as `attention` takes them).
        windows: query rows [q_start, q_stop) over keys [k_start, k_stop) each; together
            they must cover rows [0, Nq) once, in order.
    On CUDA in eager mode each window is one launch into the shared output (strided
    inputs are made contiguous once, up front); elsewhere each runs `attention` on its slices.
    """
    check_attention_inputs(query, key, value)
    check_kernel_choice(kernel, query.dtype, out_dtype)
    _check_windows(windows, query.shape[2], key.shape[2])
    scale = query.shape[-1] ** -0.5
    batch, heads, seq_q, head_dim = query.shape
    if query.device.type == "cuda" and not needs_op(query, key, value):
        query, key, value = (t.contiguous() for t in (query, key, value))
        out = torch.empty((batch, seq_q, heads * head_dim), dtype=out_dtype, device=query.device)
        for window in windows:
            run(plan_attention(query, key, value, scale, kernel, out_dtype, out=out, window=window))
        return out
    parts = []
    for w in windows:
        keys = slice(w.k_start, w.k_stop)
        sliced = (query[:, :, w.q_start : w.q_stop], key[:, :, keys], value[:, :, keys])
        parts.append(attention(*(t.contiguous() for t in sliced), out_dtype=out_dtype, kernel=kernel))
    return torch.cat(parts, dim=1)


def _check_windows(windows: list[Window], seq_q: int, seq_k: int) -> None:
    """Raise ValueError unless the windows tile query rows [0, seq_q) in order, each over a
    non-empty key range inside [0, seq_k)."""
    row = 0
    for w in windows:
        if w.q_start != row or w.q_stop <= w.q_start or not 0 <= w.k_start < w.k_stop <= seq_k:
            break
        row = w.q_stop
    else:
        if row == seq_q:
            return
    raise ValueError(f"windows must tile query rows [0, {seq_q}) in order over keys in [0, {seq_k}); got {windows}")
