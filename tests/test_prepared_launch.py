"""`runtime.PreparedLaunch` on the CPU (the driver's launch replaced by a recorder): a replay changes the
output's address and, for a kernel that stores through a map of its output (wgmma), that map, built again
only when the output moved."""

from __future__ import annotations

import ctypes

import pytest

from pictor_diffusers.cuda import runtime
from pictor_diffusers.cuda.geometry import Launch

SIGNATURE = (ctypes.c_uint64, None, ctypes.c_uint32)
"""out's address, the map of out (passed by address), one scalar."""
FIRST_OUT = 0x7000_0000


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int]]:
    """(out address, map address, scalar) of each launch."""
    calls = []

    def record(function: int, device: int, grid: tuple, threads: int, shared: int, params: int) -> None:
        array = (ctypes.c_void_p * len(SIGNATURE)).from_address(params)
        out = ctypes.c_uint64.from_address(array[0]).value
        scalar = ctypes.c_uint32.from_address(array[2]).value
        calls.append((out, array[1], scalar))

    monkeypatch.setattr(runtime, "_launch_params", record)
    return calls


class Maps:
    """A stand-in for `tensor_maps.map_at`: a fresh 128-byte buffer per call, the addresses asked for kept."""

    def __init__(self) -> None:
        self.asked: list[int] = []

    def __call__(self, address: int) -> tuple[ctypes.Array, int]:
        self.asked.append(address)
        buffer = ctypes.create_string_buffer(128)
        return buffer, ctypes.addressof(buffer)


def prepared(maps: Maps | None) -> tuple[runtime.PreparedLaunch, int]:
    first_map = ctypes.create_string_buffer(128)
    built = Launch(0, (1, 1, 1), 128, 0, SIGNATURE, (FIRST_OUT, ctypes.addressof(first_map), 7), first_map)
    out_map = None if maps is None else (1, maps)
    return runtime.PreparedLaunch(11, built, 0, out_map), ctypes.addressof(first_map)


@pytest.mark.parametrize("moves", [1, 3])
def test_a_moved_output_gets_its_own_map(launched: list, moves: int) -> None:
    maps = Maps()
    launch, first_map = prepared(maps)
    launch.run(FIRST_OUT)
    assert launched[-1] == (FIRST_OUT, first_map, 7) and maps.asked == []
    for i in range(1, moves + 1):
        moved = FIRST_OUT + 0x1_0000 * i
        launch.run(moved)
        assert maps.asked[-1] == moved, "an output at a new address must be stored through a map of that address"
        out, map_address, _ = launched[-1]
        assert out == moved and map_address != first_map
    asked = len(maps.asked)
    launch.run(moved)
    assert len(maps.asked) == asked, "an output at the address last mapped keeps its map"
    launch.run(FIRST_OUT)
    assert maps.asked[-1] == FIRST_OUT and launched[-1][0] == FIRST_OUT


def test_without_an_output_map_only_the_address_changes(launched: list) -> None:
    launch, first_map = prepared(None)
    launch.run(FIRST_OUT + 0x40)
    assert launched[-1] == (FIRST_OUT + 0x40, first_map, 7)
