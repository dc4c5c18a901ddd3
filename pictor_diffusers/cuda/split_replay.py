"""Replays of remembered fp16x3 calls on float32 q, k, v: the split prepass and the kernel, prepared.

The fp16x3 kernel reads q, k, v as scaled float16 hi/lo planes that its split prepass writes into a fresh
workspace on every call (`launch.split_planes`), so its launch cannot be filled once as `plan_memo` fills the
others. A remembered fp16x3 call keeps a `SplitReplay` instead: each run allocates the workspace (planes and
column maxima, one allocation), zeroes the maxima, launches the split's two phases and the kernel, with the
arguments of all three filled once per workspace address. PyTorch's caching allocator hands the same block back
call after call, so after the first run a replay builds nothing: one allocation for the workspace, one for the
output, a memset and three launches. The launches of the `WORKSPACES` addresses last used are kept.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import NamedTuple

import torch

from . import launch, runtime
from .geometry import OUT_OPERAND, Launch
from .pass_rows import SPLIT
from .plan import AttentionPlan

WORKSPACES = 4
"""Workspace addresses whose launches a replay keeps (the allocator may alternate between a few blocks)."""


class _Launches(NamedTuple):
    """The prepared launches for one workspace address: the split's phases 0 and 1, then the kernel."""

    phases: tuple[runtime.PreparedLaunch, runtime.PreparedLaunch]
    kernel: runtime.PreparedLaunch


class SplitReplay:
    """A split-planes plan (`plan.split` None: the prepass runs) over all rows, made replayable: `run(out)`
    splits the plan's q, k, v (the addresses it was built with) and launches the kernel into `out`, the
    address of a token-major `[B, N, H*D]` output of the plan's dtype. Holds no tensor."""

    __slots__ = ("_by_workspace", "_device", "_geometry", "_inputs", "_kernel", "_lock", "_split_function")

    def __init__(self, plan: AttentionPlan) -> None:
        geometry, inputs = launch.launch_geometry(plan)
        self._geometry, self._device, self._split_function = geometry, plan.written.device.index, plan.prepass_function
        planes, colmax = self._workspace(zero=False)  # only its addresses are used: nothing runs on it
        built = launch.attention_launch(plan, workspace=(planes, colmax))
        self._kernel, self._inputs = (plan.function, built._replace(keep=None)), inputs
        self._by_workspace: OrderedDict[int, _Launches] = OrderedDict()
        self._lock = threading.Lock()
        self._prepare(planes.data_ptr(), colmax.data_ptr())  # the first run most likely gets this block back

    def run(self, out_pointer: int) -> None:
        planes, colmax = self._workspace()
        launches = self._by_workspace.get(planes.data_ptr())
        if launches is None:
            launches = self._prepare(planes.data_ptr(), colmax.data_ptr())
        else:
            with self._lock:
                self._by_workspace.move_to_end(planes.data_ptr())  # the least recently used is evicted first
        for phase in launches.phases:
            phase.run(planes.data_ptr())
        launches.kernel.run(out_pointer)

    def _workspace(self, zero: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        g = self._geometry
        return launch.split_buffers(g.planes, g.q_count, g.k_count, g.head_dim, self._device, True, zero)

    def _prepare(self, planes: int, colmax: int) -> _Launches:
        """The three launches for a workspace whose planes start at `planes`, its column maxima at `colmax`."""
        grid, args = launch.split_args(self._inputs, planes, colmax, self._geometry)
        phases = tuple(
            runtime.PreparedLaunch(
                self._split_function,
                Launch(self._device, grid, SPLIT.threads, 0, launch.SPLIT_SIGNATURE, (*args, phase), None),
                launch.SPLIT_PLANES_ARG,
            )
            for phase in (0, 1)
        )
        function, built = self._kernel
        kernel = launch.on_workspace(built, planes, colmax, self._geometry)
        launches = _Launches(phases, runtime.PreparedLaunch(function, kernel, OUT_OPERAND))
        with self._lock:
            self._by_workspace[planes] = launches
            while len(self._by_workspace) > WORKSPACES:
                self._by_workspace.popitem(last=False)
        return launches
