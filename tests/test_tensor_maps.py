"""Which strided `[B, H, N, D]` 16-bit layouts the Hopper kernel's TMA maps read in place, the planes a window
of rows becomes (pure functions of shapes, strides and addresses: checked on CPU tensors), and what the driver
is asked to encode for a key bias (its encoder replaced by a recorder)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from pictor_diffusers.cuda import launch, nvrtc, tensor_maps
from pictor_diffusers.cuda.geometry import Window
from pictor_diffusers.cuda.plan import AttentionPlan, log2_key_bias
from pictor_diffusers.cuda.selection import Problem, select_kernel
from pictor_diffusers.cuda.tensor_maps import Planes, out_planes, readable, rows_of

SHAPES = [(2, 3, 77, 128), (1, 24, 4608, 128), (2, 1, 1, 128)]  # N 77: not a multiple of the 128-row box


def _ids(shape: tuple[int, ...]) -> str:
    return "B{}H{}N{}D{}".format(*shape)


def layouts(shape: tuple[int, ...], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The same `[B, H, N, D]` values laid out several ways."""
    batch, heads, seq, head_dim = shape
    storage = torch.randn(batch * heads * seq * head_dim + 8).to(dtype)
    return {
        "head_major": storage[: batch * heads * seq * head_dim].view(shape),
        "token_major": storage[: batch * heads * seq * head_dim].view(batch, seq, heads, head_dim).transpose(1, 2),
        "row_slice": torch.randn(batch, heads, seq + 5, head_dim).to(dtype)[:, :, :seq],
        "one_element_in": storage[1 : 1 + batch * heads * seq * head_dim].view(shape),
        "columns_strided": torch.randn(batch, heads, seq, 2 * head_dim).to(dtype)[..., ::2],
        "broadcast_heads": torch.randn(batch, 1, seq, head_dim).to(dtype).expand(shape),
        "broadcast_rows": torch.randn(batch, heads, 1, head_dim).to(dtype).expand(shape),
    }


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_readable_layouts(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    tensors = layouts(shape, dtype)
    aligned = tensors["head_major"].data_ptr() % 16 == 0
    expected = {
        "head_major": aligned,
        "token_major": aligned,
        "row_slice": True,
        "one_element_in": False,  # 2 bytes past a 16-byte boundary
        "columns_strided": False,  # head_dim not contiguous
        "broadcast_heads": shape[1] == 1,  # a stride-0 dimension longer than 1 is copied, not mapped
        "broadcast_rows": shape[2] == 1,
    }
    got = {name: readable(tensor) for name, tensor in tensors.items()}
    assert got == expected


@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_rows_of_a_token_major_window(shape: tuple[int, ...]) -> None:
    """Rows [start, stop) of a token-major view: the address moves by start rows of H*D elements, the
    strides are the view's own, and a dimension of extent 1 gets stride 8."""
    batch, heads, seq, head_dim = shape
    tensor = torch.randn(batch, seq, heads, head_dim).bfloat16().transpose(1, 2)
    start, stop = min(3, seq - 1), seq
    planes = rows_of(tensor, start, stop)
    one = lambda extent, stride: stride if extent > 1 else 8  # noqa: E731
    assert planes == Planes(
        tensor.data_ptr() + start * heads * head_dim * 2,
        heads,
        stop - start,
        batch,
        one(heads, head_dim),
        one(seq, heads * head_dim),
        one(batch, seq * heads * head_dim),
    )


@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_out_planes_of_a_window_of_the_output(shape: tuple[int, ...]) -> None:
    """The wgmma kernel's output map: rows [start, stop) of the token-major `[B, N, H*D]` output are that
    window of its `[B, H, N, D]` view, the address at the window's first row (the kernel's output operand)."""
    batch, heads, seq, head_dim = shape
    out = torch.empty(batch, seq, heads * head_dim, dtype=torch.bfloat16)
    start, stop = min(3, seq - 1), seq
    planes = out_planes(out, heads, start, stop)
    assert planes == rows_of(out.view(batch, seq, heads, head_dim).transpose(1, 2), start, stop)
    assert planes.pointer == out.data_ptr() + start * heads * head_dim * out.element_size()
    assert (planes.heads, planes.rows, planes.batches) == (heads, stop - start, batch)
    if seq > 1:
        assert planes.row_stride == heads * head_dim


class _RecordingDriver:
    """Stands in for libcuda's `cuTensorMapEncodeTiled`: records what it was asked to encode."""

    def __init__(self) -> None:
        self.calls: list[dict[str, object]] = []

    def cuTensorMapEncodeTiled(  # the driver's name
        self, address: int, dtype: int, rank: int, pointer: int, dims: ctypes.Array, strides: ctypes.Array,
        box: ctypes.Array, unit: ctypes.Array, *modes: int,
    ) -> int:  # fmt: skip
        self.calls.append({
            "address": address, "dtype": dtype, "rank": rank, "pointer": pointer, "dims": list(dims[:rank]),
            "strides": list(strides[: rank - 1]), "box": list(box[:rank]), "swizzle": modes[1],
        })  # fmt: skip
        return 0


@pytest.mark.parametrize(("batch", "heads", "keys", "box"), [(2, 3, 352, 176), (1, 24, 384, 128), (3, 1, 128, 128)])
def test_key_bias_map_is_a_plane_per_head_without_swizzle(
    monkeypatch: pytest.MonkeyPatch, batch: int, heads: int, keys: int, box: int
) -> None:
    """The key bias as the plan holds it (`plan.log2_key_bias`: float32 `[B*H, k_pad]`) is encoded as rank 2:
    k_pad keys x B*H planes, a plane's row of 4 k_pad bytes, box `box` keys x 1, no swizzle, float32; memoised
    by address."""
    driver = _RecordingDriver()
    monkeypatch.setattr(tensor_maps, "_driver", lambda: driver)
    monkeypatch.setattr(tensor_maps, "_maps", type(tensor_maps._maps)())
    window = Window(0, 5, 0, keys - box // 2)  # the plan's padding of a window whose keys end inside a tile
    bias = log2_key_bias(torch.randn(batch, 1, keys), heads, window, box)
    assert bias.shape == (batch * heads, keys)
    buffer, address = tensor_maps.bias_map_at(bias, box)
    assert address % 64 == 0 and ctypes.addressof(buffer) <= address
    (call,) = driver.calls
    assert call["address"] == address and call["pointer"] == bias.data_ptr()
    assert (call["dtype"], call["rank"], call["swizzle"]) == (7, 2, 0)  # FLOAT32, no swizzle
    assert call["dims"] == [keys, batch * heads] and call["strides"] == [4 * keys] and call["box"] == [box, 1]
    assert tensor_maps.bias_map_at(bias, box)[1] == address and len(driver.calls) == 1
    unused_buffer, unused = tensor_maps.unused_map()
    assert unused % 64 == 0 and bytes(unused_buffer)[unused - ctypes.addressof(unused_buffer) :][:128] == bytes(128)


@pytest.mark.parametrize("biased", [True, False], ids=["key-bias", "no-bias"])
@pytest.mark.parametrize("short_keys", [True, False], ids=["persistent", "one-block"])
def test_wgmma_launch_passes_the_key_bias_map(monkeypatch: pytest.MonkeyPatch, biased: bool, short_keys: bool) -> None:
    """The wgmma launch's eighth operand (after the maps of q, k, v, the out, lse and key-count pointers and the
    output's map) is the map of the plan's key bias, boxed by the build's key tile, or the unused map."""
    driver = _RecordingDriver()
    monkeypatch.setattr(tensor_maps, "_driver", lambda: driver)
    monkeypatch.setattr(tensor_maps, "_maps", type(tensor_maps._maps)())
    monkeypatch.setattr(nvrtc, "multiprocessors", lambda index: 132)
    problem = Problem("bfloat16", "bfloat16", 128, (9, 0), 232448, short_keys=short_keys, key_bias=biased)
    selection = select_kernel(problem, "wgmma")
    batch, heads, seq_q, seq_k = 2, 3, 77, 300
    query = torch.randn(batch, heads, seq_q, 128).bfloat16()
    key, value = (torch.randn(batch, heads, seq_k, 128).bfloat16() for _ in range(2))
    window, box = Window(0, seq_q, 0, seq_k), selection.variant.key_rows
    bias = log2_key_bias(torch.randn(batch, 1, seq_k), heads, window, box) if biased else None
    written = torch.empty(batch, seq_q, heads * 128, dtype=torch.bfloat16)
    plan = AttentionPlan(
        selection, 1, 0, query, key, value, written, None, torch.bfloat16, None, None, window, 0.1, key_bias=bias
    )
    built = launch.attention_launch(plan)
    assert built.signature[:8] == (None, None, None, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint64, None, None)
    assert built.shared_bytes == selection.variant.shared_bytes
    encoded = {call["address"]: call for call in driver.calls}
    if not biased:
        assert built.args[7] == tensor_maps.unused_map()[1] and len(driver.calls) == 4
        return
    call = encoded[built.args[7]]
    assert call["pointer"] == bias.data_ptr() and call["dims"] == [bias.shape[1], batch * heads]
    assert call["box"] == [box, 1] and bias.shape[1] % box == 0
