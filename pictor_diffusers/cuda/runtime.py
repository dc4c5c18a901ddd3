"""The driver side of a launch: CuPy, torch's current stream, `cuLaunchKernel`.

* `launch` calls `cuLaunchKernel` (CuPy's binding) on a `CUfunction` handle that
  comes built and loaded (`nvrtc.function`), with torch's device addresses on
  torch's current stream of the device: zero copy, no host sync, capturable in
  CUDA graphs. No stream object is cached or kept alive.
* The one cache here, argument slots, is bounded by the few kernel signatures, per thread.
* `PreparedLaunch`: a launch filled once, replayed with a new output address (`plan_memo`'s replays).
"""

from __future__ import annotations

import ctypes
import functools
import threading
import warnings
from collections.abc import Callable
from typing import Any, Protocol

import torch

from .geometry import Launch

CUPY_INSTALL_HINT = (
    "PictorAttn needs CuPy to run its kernels on CUDA tensors. Install the extra that matches your torch "
    "build (torch.version.cuda = {torch_cuda}): {advice}; never install both cupy-cuda12x and cupy-cuda13x."
)

_thread_state = threading.local()


def _extra_advice() -> str:
    """The pip command for torch's CUDA, or both choices when torch has no CUDA."""
    if torch.version.cuda:
        return f"pip install 'pictor-diffusers[cuda{torch.version.cuda.split('.')[0]}]'"
    return "pip install 'pictor-diffusers[cuda12]' for CUDA 12 or 'pictor-diffusers[cuda13]' for CUDA 13"


@functools.cache
def import_cupy() -> Any:
    """Import CuPy once, or raise ImportError naming the extra that matches torch's CUDA.

    Warns once when CuPy was built for another CUDA major version than torch.
    """
    try:
        import cupy
    except ImportError as error:
        raise ImportError(CUPY_INSTALL_HINT.format(torch_cuda=torch.version.cuda, advice=_extra_advice())) from error
    cupy_major = cupy.cuda.runtime.runtimeGetVersion() // 1000
    torch_cuda = torch.version.cuda
    if torch_cuda and int(torch_cuda.split(".")[0]) != cupy_major:
        warnings.warn(
            f"pictor-diffusers: CuPy is built for CUDA {cupy_major} but torch for CUDA {torch_cuda}; "
            f"replace CuPy with the matching extra: {_extra_advice()}",
            RuntimeWarning,
            stacklevel=2,
        )
    return cupy


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream(device_index: int) -> int:
    """The handle of torch's current stream on the device (no Python stream object)."""
    if _raw_stream is not None:
        return _raw_stream(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


def _bind_context(device_index: int) -> None:
    """Make the device's primary context current in this thread, once per thread and device.

    Driver-level launches need a current context; a thread that has only used
    torch's cached allocations may not have one yet. cudaSetDevice binds it.
    """
    bound = getattr(_thread_state, "devices", None)
    if bound is None:
        bound = _thread_state.devices = set()
    if device_index not in bound:
        import_cupy().cuda.runtime.setDevice(device_index)
        bound.add(device_index)


_RANGES = {
    ctypes.c_uint32: (0, 2**32 - 1),
    ctypes.c_int32: (-(2**31), 2**31 - 1),
    ctypes.c_uint64: (0, 2**64 - 1),
}


class _ArgSlots:
    """Reusable `cuLaunchKernel` argument storage for one kernel signature.

    `signature` holds a ctypes type per argument, or None for an argument
    passed by address as-is (a tensor map). `fill` writes the values and returns
    the address of the `void*[]` array; the launch copies them at once. An
    integer outside its C type's range raises instead of wrapping.
    """

    __slots__ = ("array", "by_address", "ranges", "values")

    def __init__(self, signature: tuple[Any, ...]) -> None:
        self.values = [kind() if kind is not None else None for kind in signature]
        self.array = (ctypes.c_void_p * len(signature))()
        self.by_address = [kind is None for kind in signature]
        self.ranges = [(i, kind, *_RANGES[kind]) for i, kind in enumerate(signature) if kind in _RANGES]
        for i, value in enumerate(self.values):
            if value is not None:
                self.array[i] = ctypes.addressof(value)

    def fill(self, args: tuple[Any, ...]) -> int:
        for i, kind, low, high in self.ranges:
            if not low <= args[i] <= high:
                raise OverflowError(f"kernel argument {i} = {args[i]} does not fit {kind.__name__} [{low}, {high}]")
        for i, arg in enumerate(args):
            if self.by_address[i]:
                self.array[i] = arg
            else:
                self.values[i].value = arg
        return ctypes.addressof(self.array)


def _slots(signature: tuple[Any, ...]) -> _ArgSlots:
    cache = getattr(_thread_state, "slots", None)
    if cache is None:
        cache = _thread_state.slots = {}
    slots = cache.get(signature)
    if slots is None:
        slots = cache[signature] = _ArgSlots(signature)
    return slots


class Replayable(Protocol):
    """A plan's prepared launch (`PreparedLaunch`, or `split_replay.SplitReplay` with its prepass): `run` launches
    it into the output at a device address."""

    def run(self, out_pointer: int) -> None: ...


class PreparedLaunch:
    """A built launch (`geometry.Launch`) of `function_handle` with its arguments filled once (checked as
    `launch` checks them); `run(out_pointer)` changes only the output's address, at argument `out_index`, and
    with `out_map` = (index, map_at) the map of the output at argument `index` (`map_at(out_pointer)` ->
    (owning buffer, map address); looked up only when the address moved), then launches on torch's current
    stream. It owns its argument slots, under a lock, so threads replaying one launch never mix their outputs;
    `built.keep` stays referenced (the tensor maps the arguments point to)."""

    __slots__ = ("_address", "_lock", "_map", "_mapped", "_out", "_slots", "built", "function_handle")

    def __init__(
        self, function_handle: int, built: Launch, out_index: int,
        out_map: tuple[int, Callable[[int], tuple[Any, int]]] | None = None,
    ) -> None:  # fmt: skip
        self.function_handle, self.built = function_handle, built
        self._slots = _ArgSlots(built.signature)  # owns the argument array `_address` points to
        self._address = self._slots.fill(built.args)
        self._out = self._slots.values[out_index]
        self._map, self._mapped = out_map, (built.args[out_index], None)
        self._lock = threading.Lock()

    def run(self, out_pointer: int) -> None:
        built = self.built
        with self._lock:
            self._out.value = out_pointer
            if self._map is not None and out_pointer != self._mapped[0]:
                index, map_at = self._map
                self._mapped = (out_pointer, map_at(out_pointer))  # the map's buffer stays referenced
                self._slots.array[index] = self._mapped[1][1]
            _launch_params(self.function_handle, built.device_index, built.grid, built.threads, built.shared_bytes,
                           self._address)  # fmt: skip


def launch(
    function_handle: int,
    device_index: int,
    grid: tuple[int, int, int],
    threads: int,
    shared_bytes: int,
    signature: tuple[Any, ...],
    args: tuple[Any, ...],
) -> None:
    """`cuLaunchKernel` on torch's current stream of `device_index`.

    Args:
        signature: ctypes type per kernel argument (None: passed by address, e.g. a tensor map).
        args: the values (device addresses as ints, scalars, tensor-map addresses).
    """
    _launch_params(function_handle, device_index, grid, threads, shared_bytes, _slots(signature).fill(args))


_get_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


def _launch_params(
    function_handle: int, device_index: int, grid: tuple[int, int, int], threads: int, shared_bytes: int, params: int
) -> None:
    """`cuLaunchKernel` with the address of a filled `void*[]` argument array, on torch's current stream."""
    cupy = import_cupy()
    stream = current_stream(device_index)
    if _get_device() != device_index:
        with torch.cuda.device(device_index):
            _bind_context(device_index)
            cupy.cuda.driver.launchKernel(function_handle, *grid, threads, 1, 1, shared_bytes, stream, params, 0)
        return
    _bind_context(device_index)
    cupy.cuda.driver.launchKernel(function_handle, *grid, threads, 1, 1, shared_bytes, stream, params, 0)


def zero(pointer: int, size: int, device_index: int) -> None:
    """Set `size` bytes at device address `pointer` to 0, asynchronously on torch's current stream of
    `device_index` (`cudaMemsetAsync`: no kernel launch through torch, capturable in CUDA graphs)."""
    memset = import_cupy().cuda.runtime.memsetAsync
    if torch.cuda.current_device() != device_index:
        with torch.cuda.device(device_index):
            _bind_context(device_index)
            memset(pointer, 0, size, current_stream(device_index))
        return
    _bind_context(device_index)
    memset(pointer, 0, size, current_stream(device_index))
