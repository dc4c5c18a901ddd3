"""`split_replay.SplitReplay` on the CPU (the driver's launches, memsets and map encodes replaced by recorders,
the workspace by CPU buffers): a remembered fp16x3 call replays the split's two phases and the kernel with the
arguments the unreplayed path builds, for the workspace it gets each time, building nothing again for a
workspace address it has seen; attention on planes the fused prologue made is remembered and replayed alike."""

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
    """`launch.split_buffers` on CPU buffers: the workspace at index `next` of a few buffers (as the caching
    allocator hands blocks back), its maxima zeroed through `runtime.zero` unless not `zero`."""

    def __init__(self, groups: int, q_rows: int, k_rows: int, head_dim: int) -> None:
        halves = split_halves(groups, q_rows, k_rows, head_dim)
        self.buffers = [torch.empty(halves + 6 * groups * head_dim, dtype=torch.float16) for _ in range(3)]
        self.halves, self.shape, self.next = halves, (3, groups, head_dim), 0

    def __call__(
        self, groups: int, q_rows: int, k_rows: int, head_dim: int, device_index: int | None, one_allocation: bool,
        zero: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        assert one_allocation
        buffer = self.buffers[self.next]
        colmax = buffer[self.halves :].view(torch.int32).view(self.shape)
        if zero:
            runtime.zero(colmax.data_ptr(), colmax.numel() * 4, device_index)
        return buffer[: self.halves], colmax


def fp16x3_plan(
    batch: int, heads: int, seq_q: int, seq_k: int, out_dtype: torch.dtype, key_lens: bool
) -> AttentionPlan:  # fmt: skip
    out = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[out_dtype]
    problem = Problem("float32", out, 128, (9, 0), 232448, key_lens=key_lens)
    selection = select_kernel(problem, "fp16x3")
    assert selection.variant.spec.name == "fp16x3" and selection.variant.key_lens == key_lens
    query = torch.randn(batch, heads, seq_q, 128)
    key, value = (torch.randn(batch, heads, seq_k, 128) for _ in range(2))
    written = torch.empty(batch, seq_q, heads * 128, dtype=out_dtype)
    lens = torch.arange(batch, dtype=torch.int32) * 7 + 5 if key_lens else None
    return AttentionPlan(
        selection, KERNEL, SPLIT, query, key, value, written, None, out_dtype, None, lens, Window(0, seq_q, 0, seq_k),
        128**-0.5,
    )  # fmt: skip


@pytest.fixture
def device(monkeypatch: pytest.MonkeyPatch) -> Device:
    spec = select_kernel(Problem("float32", "float32", 128, (9, 0), 232448), "fp16x3").variant.spec
    recorder = Device({KERNEL: launch._signature(spec), SPLIT: launch.SPLIT_SIGNATURE})
    monkeypatch.setattr(runtime, "_launch_params", recorder.launch)
    monkeypatch.setattr(runtime, "zero", recorder.zero)
    monkeypatch.setattr(tensor_maps, "_driver", lambda: recorder)
    monkeypatch.setattr(tensor_maps, "_maps", type(tensor_maps._maps)())
    monkeypatch.setattr(nvrtc, "multiprocessors", lambda index: 132)
    return recorder


def _at(written: torch.Tensor, address: int) -> torch.Tensor:
    """A tensor like `written` whose data_ptr() is `address` (only its address and extents are read)."""

    class Moved(torch.Tensor):
        def data_ptr(self) -> int:
            return address

    return written.as_subclass(Moved)


def _recorded(device: Device) -> list:
    """The recorded driver calls since the last, the kernel's maps named by the address each maps and its
    floats as the kernel's f32; then forgotten."""
    calls = []
    for event in device.events:
        if event[:2] == ("launch", KERNEL):
            named = (device.encoded.get(a, a) if i < 3 else a for i, a in enumerate(event[3]))
            event = (*event[:3], tuple(ctypes.c_float(a).value if isinstance(a, float) else a for a in named))
        calls.append(event)
    device.events.clear()
    return calls


@pytest.mark.parametrize("key_lens", [False, True], ids=["all-keys", "key-counts"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("batch", "heads", "seq_q", "seq_k"), [(1, 3, 77, 300), (2, 2, 129, 129), (3, 1, 300, 64)])
def test_replays_launch_what_the_unreplayed_path_launches(
    device: Device, monkeypatch: pytest.MonkeyPatch, batch: int, heads: int, seq_q: int, seq_k: int,
    out_dtype: torch.dtype, key_lens: bool,
) -> None:  # fmt: skip
    """Each replay's memset, split phases and kernel equal `launch_attention`'s on the unreplayed plan for the
    same workspace and output; the launches are built once per workspace address, and nothing runs on the
    device when the replay is made."""
    plan = fp16x3_plan(batch, heads, seq_q, seq_k, out_dtype, key_lens)
    workspaces = Workspaces(batch * heads, seq_q, seq_k, 128)
    monkeypatch.setattr(launch, "split_buffers", workspaces)
    mapped = []
    split_maps = launch.split_maps
    monkeypatch.setattr(launch, "split_maps", lambda base, geometry: mapped.append(base) or split_maps(base, geometry))
    replay = split_replay.SplitReplay(plan)
    assert device.events == [], "making a replay must not run anything"
    seen = {0}
    for run, index in enumerate([0, 0, 1, 0, 2, 1]):
        workspaces.next, out, built = index, 0x7000_0000 + 0x1000 * run, len(mapped)
        replay.run(out)
        assert (len(mapped) == built) == (index in seen), "launches are built once per workspace address"
        seen.add(index)
        got = _recorded(device)
        launch.launch_attention(plan._replace(written=_at(plan.written, out)))
        assert got == _recorded(device)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("batch", "heads", "seq"), [(1, 3, 77), (2, 2, 129)])
def test_attention_on_split_planes_is_remembered(
    device: Device, monkeypatch: pytest.MonkeyPatch, batch: int, heads: int, seq: int, out_dtype: torch.dtype
) -> None:
    """The parity path's attention on planes its fused prologue made (`plan_memo.remember_split`): a replay
    launches what the unreplayed plan launches, into its own output, and the memo keeps no tensor alive."""
    import gc
    import weakref

    from pictor_diffusers.cuda import plan_memo
    from pictor_diffusers.cuda.geometry import SplitPlanes

    monkeypatch.setattr(plan_memo, "_memo", type(plan_memo._memo)())
    workspaces = Workspaces(batch * heads, seq, seq, 128)
    planes, colmax = workspaces(batch * heads, seq, seq, 128, None, True, zero=False)
    split = SplitPlanes(planes, colmax, heads, seq)
    plan = fp16x3_plan(batch, heads, seq, seq, out_dtype, False)
    plan = plan._replace(prepass_function=0, query=None, key=None, value=None, split=split)
    call = plan_memo.split_call_key(split, 128**-0.5, "fp16x3", out_dtype)
    plan_memo.remember_split(call, plan)
    assert plan_memo.remembered() == 1
    out = plan_memo.launch_replay(call)
    assert out.shape == (batch, seq, heads * 128) and out.dtype == out_dtype
    got = _recorded(device)
    launch.launch_attention(plan._replace(written=_at(plan.written, out.data_ptr())))
    assert got == _recorded(device) and [e[:2] for e in got] == [("launch", KERNEL)]
    other = plan_memo.split_call_key(split._replace(seq=seq - 1), 128**-0.5, "fp16x3", out_dtype)
    assert plan_memo.launch_replay(other) is None, "another fact is another call"
    refs = [weakref.ref(t) for t in (workspaces.buffers[0], plan.written)]
    del planes, colmax, split, plan, workspaces
    gc.collect()
    assert all(ref() is None for ref in refs), "a remembered split call keeps no tensor alive"


def test_attend_split_checks_and_plans_once_then_replays(device: Device, monkeypatch: pytest.MonkeyPatch) -> None:
    """`split_route._attend_split` on CUDA planes (faked here): the first call checks the planes, plans and
    launches; the same call again replays that launch into a new output with neither; planes that fail the
    checks (heads that do not divide the planes' groups: another key) still raise."""
    from pictor_diffusers.cuda import plan_memo
    from pictor_diffusers.cuda.geometry import SplitPlanes
    from pictor_diffusers.ops import split_route
    from pictor_diffusers.ops.validation import check_split_planes

    class OnCuda(torch.Tensor):
        @property
        def is_cuda(self) -> bool:
            return True

    monkeypatch.setattr(plan_memo, "_memo", type(plan_memo._memo)())
    workspaces = Workspaces(3, 77, 77, 128)
    planes, colmax = workspaces(3, 77, 77, 128, None, True, zero=False)
    split = SplitPlanes(planes.as_subclass(OnCuda), colmax, 3, 77)
    checked, planned = [], []

    def plan_split_attention(split: SplitPlanes, scale: float, kernel: str, out_dtype: torch.dtype) -> AttentionPlan:
        plan = fp16x3_plan(1, 3, 77, 77, out_dtype, False)
        planned.append(plan._replace(prepass_function=0, query=None, key=None, value=None, split=split, scale=scale))
        return planned[-1]

    monkeypatch.setattr(split_route, "plan_split_attention", plan_split_attention)
    monkeypatch.setattr(split_route, "check_split_planes", lambda s: checked.append(s) or check_split_planes(s))
    outs = [split_route._attend_split(split, 128**-0.5, "fp16x3", torch.float32) for _ in range(3)]
    assert (len(checked), len(planned)) == (1, 1)
    kernels = [e[3] for e in _recorded(device) if e[:2] == ("launch", KERNEL)]
    assert len(kernels) == 3 and [k[3] for k in kernels] == [out.data_ptr() for out in outs]
    assert all(k[:3] + k[4:] == kernels[0][:3] + kernels[0][4:] for k in kernels), "a replay launches the same"
    with pytest.raises(ValueError, match="multiple of heads=2"):
        split_route._attend_split(split._replace(heads=2), 128**-0.5, "fp16x3", torch.float32)
