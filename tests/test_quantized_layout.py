"""The 8-bit prepass's workspace and the byte tensor maps of its codes (`pictor_diffusers.cuda.quantized`), on CPU:
offsets, sizes and the planes handed to the driver, for shapes that are not multiples of the tiles."""

from __future__ import annotations

import itertools

import pytest
import torch

from pictor_diffusers.cuda import quantized, tensor_maps
from pictor_diffusers.cuda.geometry import Geometry

SHAPES = [(1, 24, 4608, 4608), (2, 3, 77, 1000), (3, 5, 1, 1), (2, 2, 300, 129)]


def _id(shape: tuple[int, int, int, int]) -> str:
    return "B{}-H{}-Nq{}-Nk{}".format(*shape)


@pytest.mark.parametrize("pv", quantized.PV_SCHEMES)
@pytest.mark.parametrize("shape", SHAPES, ids=_id)
def test_workspace_parts_are_aligned_sized_and_disjoint(shape: tuple[int, int, int, int], pv: str) -> None:
    """Scheme "0" (E4M3 V): q scales per 64 rows, one V scale per channel, two phase-0 statistics; "1" (int8 V):
    q scales per row, a step and a centre per channel, three statistics."""
    batch, heads, seq_q, seq_k = shape
    planes, k_pad, u8 = batch * heads, -(-seq_k // 128) * 128, pv == "1"
    layout = quantized.workspace_layout(planes, seq_q, seq_k, 128, pv)
    expected = {
        "q8": planes * seq_q * 128,
        "k8": planes * seq_k * 128,
        "vt8": planes * 128 * k_pad,
        "q_scale": 4 * planes * (seq_q if u8 else -(-seq_q // 64)),
        "k_scale": 4 * planes * (k_pad // 128),
        "v_scale": 4 * planes * 128 * (2 if u8 else 1),
        "q_shift": 4 * planes * seq_q,
        "partial": 4 * (3 if u8 else 2) * planes * quantized.CHUNKS * 128,
    }
    assert {name: size for name, (_, size) in layout.items()} == expected
    spans = sorted(layout.values())
    assert all(offset % 256 == 0 for offset, _ in spans), "each part starts 256-byte aligned (TMA needs 16)"
    assert all(a + size <= b for (a, size), (b, _) in itertools.pairwise(spans)), "parts overlap"


@pytest.mark.parametrize("shape", SHAPES, ids=_id)
def test_code_maps_describe_the_prepass_layout(
    shape: tuple[int, int, int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    batch, heads, seq_q, seq_k = shape
    k_pad = -(-seq_k // 128) * 128
    seen = []
    monkeypatch.setattr(tensor_maps, "map_at", lambda planes, inner, dtype: seen.append((planes, inner, dtype)))
    geometry = Geometry(batch * heads, seq_q, seq_k, seq_q, seq_k, 128, torch.bfloat16, heads, 0.1)
    at = {"q8": 1 << 20, "k8": 2 << 20, "vt8": 3 << 20}
    quantized._code_maps(at, geometry)
    (q_map, q_inner, q_dtype), (k_map, k_inner, _), (vt_map, vt_inner, _) = seen
    assert q_dtype == torch.uint8 and q_inner == k_inner == 128 and vt_inner == k_pad
    assert q_map == tensor_maps.Planes(at["q8"], heads, seq_q, batch, seq_q * 128, 128, heads * seq_q * 128)
    assert k_map == tensor_maps.Planes(at["k8"], heads, seq_k, batch, seq_k * 128, 128, heads * seq_k * 128)
    assert vt_map == tensor_maps.Planes(at["vt8"], heads, 128, batch, 128 * k_pad, k_pad, heads * 128 * k_pad)
    for planes in (q_map, k_map, vt_map):
        assert all(stride % 16 == 0 for stride in planes[4:]), f"byte strides must be multiples of 16: {planes}"


def test_unknown_scheme_is_refused() -> None:
    from pictor_diffusers.cuda.pass_rows import quantize_variant

    with pytest.raises(ValueError, match="'2'"):
        quantized.workspace_layout(1, 10, 10, 128, "2")
    with pytest.raises(ValueError, match="'2'"):
        quantize_variant(128, "bfloat16", "2")
