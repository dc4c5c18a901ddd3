"""`split_replay.SplitReplay` on the CPU (the driver's launches, memsets and map encodes replaced by recorders,
the workspace by CPU buffers): a remembered fp16x3 call replays the split's two phases and the kernel with the
arguments the unreplayed path builds, for the workspace it gets each time, building nothing again for a
workspace address it has seen."""

from __future__ import annotations

import ctypes
from typing import Any

import pytest
import torch

from pictor_diffusers.cuda import launch, nvrtc, runtime, split_replay, tensor_maps
from pictor_diffusers.cuda.geometry import Window, split_halves
from pictor_diffusers.cuda.plan import AttentionPlan
from pictor_diffusers.cuda.selection import Problem, select_kernel

KERNEL, SPLIT = 11, 22
"""Stand-in `CUfunction` handles of the fp16x3 kernel and of its split prepass."""


class Device:
    """Records what reaches the driver: launches (function, grid, decoded arguments), memsets, map encodes."""

    def __init__(self, signatures: dict[int, tuple[Any, ...]]) -> None:
        self.signatures, self.events, self.encoded = signatures, [], {}

    def launch(self, function: int, device: int, grid: tuple, threads: int, shared: int, params: int) -> None:
        signature = self.signatures[function]
        array = (ctypes.c_void_p * len(signature)).from_address(params)
        args = [array[i] if kind is None else kind.from_address(array[i]).value for i, kind in enumerate(signature)]
        self.events.append(("launch", function, tuple(grid), tuple(args)))

    def zero(self, pointer: int, size: int, device_index: int) -> None:
        self.events.append(("zero", pointer, size))

    def cuTensorMapEncodeTiled(self, address: int, dtype: int, rank: int, pointer: int, *rest: Any) -> int:
        self.encoded[address] = pointer
        return 0


class Workspaces:
    """`launch.split_buffers` on CPU buffers: the workspace of each call from `order` (indices into a few
    buffers, as the caching allocator hands blocks back)."""

    def __init__(self, groups: int, q_rows: int, k_rows: int, head_dim: int, order: list[int]) -> None:
        halves = split_halves(groups, q_rows, k_rows, head_dim)
        self.buffers = [torch.empty(halves + 6 * groups * head_dim, dtype=torch.float16) for _ in range(3)]
        self.halves, self.shape, self.order = halves, (3, groups, head_dim), list(order)

    def __call__(self, groups: int, q_rows: int, k_rows: int, head_dim: int, device_index: int, one_allocation: bool):
        assert one_allocation
        buffer = self.buffers[self.order.pop(0)]
        colmax = buffer[self.halves :].view(torch.int32).view(self.shape)
        runtime.zero(colmax.data_ptr(), colmax.numel() * 4, device_index)
        return buffer[: self.halves], colmax


def fp16x3_plan(batch: int, heads: int, seq_q: int, seq_k: int) -> AttentionPlan:
    selection = select_kernel(Problem("float32", "float32", 128, (9, 0), 232448), "fp16x3")
    query = torch.randn(batch, heads, seq_q, 128)
    key, value = (torch.randn(batch, heads, seq_k, 128) for _ in range(2))
    written = torch.empty(batch, seq_q, heads * 128)
    return AttentionPlan(
        selection, KERNEL, SPLIT, query, key, value, written, None, torch.float32, None, None,
        Window(0, seq_q, 0, seq_k), 128**-0.5,
    )  # fmt: skip


@pytest.fixture
def device(monkeypatch: pytest.MonkeyPatch) -> Device:
    kernel_signature = launch._signature(select_kernel(Problem("float32", "float32", 128, (9, 0), 232448)).variant.spec)
    recorder = Device({KERNEL: kernel_signature, SPLIT: launch.SPLIT_SIGNATURE})
    monkeypatch.setattr(runtime, "_launch_params", recorder.launch)
    monkeypatch.setattr(runtime, "zero", recorder.zero)
    monkeypatch.setattr(tensor_maps, "_driver", lambda: recorder)
    monkeypatch.setattr(tensor_maps, "_maps", type(tensor_maps._maps)())
    monkeypatch.setattr(nvrtc, "multiprocessors", lambda index: 132)
    return recorder


def expected_calls(plan: AttentionPlan, planes: torch.Tensor, colmax: torch.Tensor, out: int, device: Device) -> list:
    """What the unreplayed path launches for this workspace: the memset, the split's phases, the kernel (its maps
    named by the planes they map)."""
    geometry, inputs = launch.launch_geometry(plan)
    grid, args = launch.split_args(inputs, planes.data_ptr(), colmax.data_ptr(), geometry)
    built = launch.attention_launch(plan._replace(written=_at(plan.written, out)), workspace=(planes, colmax))
    kernel = _named(built.args, device)
    return [
        ("zero", colmax.data_ptr(), colmax.numel() * 4),
        *(("launch", SPLIT, grid, (*args, phase)) for phase in (0, 1)),
        ("launch", KERNEL, tuple(built.grid), kernel),
    ]


def _at(written: torch.Tensor, address: int) -> torch.Tensor:
    """A tensor like `written` whose data_ptr() is `address` (only its address and extents are read)."""

    class Moved(torch.Tensor):
        def data_ptr(self) -> int:
            return address

    return written.as_subclass(Moved)


@pytest.mark.parametrize(("batch", "heads", "seq_q", "seq_k"), [(1, 3, 77, 300), (2, 2, 129, 129)])
def test_replays_launch_what_the_plan_launches(device: Device, monkeypatch, batch, heads, seq_q, seq_k) -> None:
    plan = fp16x3_plan(batch, heads, seq_q, seq_k)
    order = [0, 0, 0, 1, 0, 2, 1]  # construction, then six runs: blocks seen before and new ones
    workspaces = Workspaces(batch * heads, seq_q, seq_k, 128, order)
    monkeypatch.setattr(launch, "split_buffers", workspaces)
    mapped = []
    split_maps = launch.split_maps
    monkeypatch.setattr(launch, "split_maps", lambda base, geometry: mapped.append(base) or split_maps(base, geometry))
    replay = split_replay.SplitReplay(plan)
    for run, index in enumerate(order[1:]):
        device.events.clear()
        built, out = len(mapped), 0x7000_0000 + 0x1000 * run
        replay.run(out)
        got = [(*e[:3], _named(e[3], device)) if e[:2] == ("launch", KERNEL) else e for e in device.events]
        buffer = workspaces.buffers[index]
        planes = buffer[: workspaces.halves]
        colmax = buffer[workspaces.halves :].view(torch.int32).view(workspaces.shape)
        assert (len(mapped) == built) == (index in order[: run + 1]), "launches are built once per workspace"
        assert got == expected_calls(plan, planes, colmax, out, device)


def _named(args: tuple, device: Device) -> tuple:
    """The kernel's arguments with its three maps named by the address each maps, floats as the kernel's f32."""
    named = (device.encoded.get(a, a) if i < 3 else a for i, a in enumerate(args))
    return tuple(ctypes.c_float(a).value if isinstance(a, float) else a for a in named)
