"""The prologue kernel's view of its inputs: the layouts `qkv_prologue` launches on, and why others are refused.

`prologue_layout` reads each tensor attribute once (the host cost of every prologue call) and returns the
`PrologueLayout` that `launch.qkv_prologue_cuda` launches on, or None; `prologue_layout_problem` then says why.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..dtypes import DTYPE_NAMES


def prologue_layout_problem(
    projections: list[torch.Tensor], weights: list[torch.Tensor], rope: list[torch.Tensor], eps: list[float]
) -> str | None:
    """Why `qkv_prologue` cannot take this layout (the caller then runs torch), or None.

    The kernel reads 4-element vectors, so every row and batch stride must be a
    multiple of 4 elements and every base 4-element aligned; q/k/v of a segment
    share strides; all projections share one dtype; text and image norms share eps.
    Takes the op's arguments: 6 projections and 4 norms ([text, image]) or 3 and 2 (one segment).
    """
    if prologue_layout(projections, weights, rope, eps) is not None:
        return None
    if len(projections) == 3:
        projections = [*(p[:, :0] for p in projections), *projections]
        weights, eps = [*weights, *weights], [*eps, *eps]
    if len(projections) != 6 or len(weights) != 4 or len(eps) != 4:
        return f"expected 3 or 6 projections with 2 or 4 norms, got {len(projections)} and {len(weights)}"
    shape_problem = _prologue_shape_problem(projections, weights, rope)
    if shape_problem is not None:
        return shape_problem
    head_dim = weights[0].shape[0]
    dtype = projections[0].dtype
    if dtype not in DTYPE_NAMES or any(p.dtype != dtype for p in projections):
        return f"projection dtypes {sorted({str(p.dtype) for p in projections})} are not one of f32/bf16/f16"
    if head_dim % 4 or head_dim > 128:
        return f"head_dim={head_dim} is not a multiple of 4 up to 128"
    if eps[0] != eps[2] or eps[1] != eps[3]:
        return f"text and image QK norms use different eps {eps}"
    vector_bytes = 4 * projections[0].element_size()
    for segment in (projections[:3], projections[3:]):
        if any(p.stride() != segment[0].stride() for p in segment) or segment[0].stride(-1) != 1:
            return "q, k, v projections of a segment have different or non-unit last strides"
        if any(s % 4 for s in segment[0].stride()[:2]) or any(p.data_ptr() % vector_bytes for p in segment):
            return "projection rows are not 4-element aligned"
    if any(t.data_ptr() % 16 for t in (*weights, *rope)):
        return "norm weights or rope tables are not 16-byte aligned"
    return None


class PrologueLayout(NamedTuple):
    """What the prologue kernel needs of a layout `prologue_layout` accepted.

    `pointers`: q, k, v text; q, k, v image; the 4 norm weights; cos, sin (the
    first weight twice when there is no RoPE). A single segment is passed as an
    empty text segment pointing at the image projections. `strides`: text row,
    text batch, image row, image batch, in elements. It holds addresses, not the tensors: the caller keeps
    them alive until the launches on it are queued.
    """

    pointers: list[int]
    strides: tuple[int, int, int, int]
    batch: int
    text_len: int
    seq: int
    heads: int
    head_dim: int
    device_index: int
    dtype: torch.dtype
    eps: tuple[float, float]
    rope: bool


def prologue_layout(
    projections: list[torch.Tensor], weights: list[torch.Tensor], rope: list[torch.Tensor], eps: list[float]
) -> PrologueLayout | None:
    """The kernel's view of the layouts FLUX.2's processors produce, reading each tensor
    attribute once (this is the host cost of every prologue call); None sends the call
    to torch, and `prologue_layout_problem` says why. `device_index` is -1 on the CPU."""
    count = len(projections)
    if count not in (3, 6) or len(weights) != count * 2 // 3 or len(eps) != count * 2 // 3:
        return None
    if count == 6 and (eps[0] != eps[2] or eps[1] != eps[3]):
        return None
    image = projections[-1]
    dtype, device, image_shape = image.dtype, image.get_device(), image.shape
    head_dim = weights[0].shape[0]
    if dtype not in DTYPE_NAMES or len(image_shape) != 3 or head_dim % 4 or head_dim > 128:
        return None
    batch, image_len, width = image_shape
    if width % head_dim:
        return None
    if count == 3:  # one segment: the kernel's text part is empty and points at the image
        segments, text_len = [(projections, image_len)], 0
    else:
        text_len = projections[0].shape[1]
        segments = [(projections[:3], text_len), (projections[3:], image_len)]
    pointers, strides, stride_bits, pointer_bits = [], [], 0, 0
    for segment, tokens in segments:
        stride = segment[0].stride()
        if stride[2] != 1:
            return None
        strides += (stride[1], stride[0])
        stride_bits |= stride[0] | stride[1]
        shape = (batch, tokens, width)
        for p in segment:
            if p.dtype != dtype or p.shape != shape or p.stride() != stride or p.get_device() != device:
                return None
            pointer = p.data_ptr()
            pointers.append(pointer)
            pointer_bits |= pointer
    if count == 3:
        pointers, strides = pointers * 2, strides * 2
    if stride_bits % 4 or pointer_bits % (4 * image.element_size()):
        return None
    seq, table_bits = text_len + image_len, 0
    tables = [(w, (head_dim,)) for w in (weights if count == 6 else weights * 2)]
    tables += [(r, (seq, head_dim)) for r in rope]
    for t, shape in tables:
        if t.dtype != torch.float32 or t.shape != shape or t.get_device() != device or not t.is_contiguous():
            return None
        pointer = t.data_ptr()
        pointers.append(pointer)
        table_bits |= pointer
    if table_bits % 16 or len(rope) not in (0, 2):
        return None
    if not rope:
        pointers += pointers[6:7] * 2
    eps_pair = (eps[-2], eps[-1])
    return PrologueLayout(pointers, tuple(strides), batch, text_len, seq, width // head_dim, head_dim, device,
                          dtype, eps_pair, bool(rope))  # fmt: skip


def _prologue_shape_problem(
    projections: list[torch.Tensor], weights: list[torch.Tensor], rope: list[torch.Tensor]
) -> str | None:
    """Shapes, devices and dtypes the kernel relies on without checking them itself."""
    device = projections[3].device
    if any(t.device != device for t in (*projections, *weights, *rope)):
        return "projections, norm weights and rope tables are not all on one device"
    head_dim = weights[0].shape[0] if weights[0].dim() == 1 else 0
    if any(w.shape != (head_dim,) or w.dtype != torch.float32 or not w.is_contiguous() for w in weights):
        return f"norm weights must be contiguous float32 [{head_dim}]"
    if any(p.dim() != 3 for p in projections):
        return "projections must be [B, n, H*D]"
    batch, width = projections[3].shape[0], projections[3].shape[2]
    if head_dim == 0 or width % head_dim or any(p.shape[0] != batch or p.shape[2] != width for p in projections):
        return f"projections differ in batch or width, or width is not a multiple of head_dim={head_dim}"
    if any(p.shape[1] != seg[0].shape[1] for seg in (projections[:3], projections[3:]) for p in seg):
        return "q, k and v of a segment differ in token count"
    seq = projections[0].shape[1] + projections[3].shape[1]
    if rope and (len(rope) != 2 or any(r.shape != (seq, head_dim) or r.dtype != torch.float32 for r in rope)):
        return f"rope tables must be two float32 [{seq}, {head_dim}] tensors"
    if rope and not all(r.is_contiguous() for r in rope):
        return "rope tables are not contiguous"
    return None
