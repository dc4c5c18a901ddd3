"""pictor's torch custom ops (`torch.ops.pictor.*`) are registered here, each the same way.

An op is opaque to `torch.compile` (its fake implementation serves tracing, so a compiled graph keeps
it as one node) and inference-only: its backward raises. `needs_op` says when a call must go through
the op instead of running the implementation directly (the eager path, which keeps host cost low).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

INFERENCE_ONLY = "pictor-diffusers kernels are inference-only: {what} has no backward"


def no_backward(*_: Any, what: str = "attention") -> None:
    """Every pictor backward (autograd's, and the one diffusers' dispatcher registers): it raises."""
    raise NotImplementedError(INFERENCE_ONLY.format(what=what))


def inference_op(name: str, fake: Callable[..., Any], what: str) -> Callable[[Callable[..., Any]], Any]:
    """Decorator: register `fn` as `torch.ops.pictor.<name>` with its `fake` and a backward that raises
    (`what` names the op in the error)."""

    def register(fn: Callable[..., Any]) -> Any:
        op = torch.library.custom_op(f"pictor::{name}", mutates_args=())(fn)
        op.register_fake(fake)
        op.register_autograd(lambda ctx, *grads: no_backward(what=what))
        return op

    return register


def needs_op(*tensors: torch.Tensor) -> bool:
    """Whether a call must go through the custom op: while compiling, or when autograd records it."""
    if torch.compiler.is_compiling():
        return True
    if not torch.is_grad_enabled():  # inference: no generator to run (this is on every call's path)
        return False
    return any(t.requires_grad for t in tensors)
