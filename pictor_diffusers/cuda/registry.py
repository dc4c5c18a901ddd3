"""The kernel registry: one row per CUDA kernel (the attention kernels here; the prologues' and prepasses'
rows in `pass_rows.py`, whose `prepass_for` names the prepass build a row's operands need).

A row (`KernelSpec`) says what a kernel takes (dtypes, head_dims, compute capability), how it is built
(source, `-D` geometry, arch) and how it is launched (threads, rows per block, shared memory, operand and
scalar lists); a row may launch differently at some head_dims (`tiling.BlockShape`), and a build (`Variant`) says
which applies.
`selection.select_kernel` chooses among the rows from plain facts. Adding a kernel means adding a row here and
its `.cu` file in `kernels/`; `launch.py` runs any row. Everything here is a table or a pure lookup.

Geometry lives here only: the host passes it to the kernels as `-D` options, the kernels `#error` on a
missing one and `static_assert` their own formulas against it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from ..dtypes import HALF_DTYPES, KINDS
from .tiling import BlockShape, fp8_smem, fp16x3_smem, wgmma_bias_bytes, wgmma_shape, wgmma_smem

MAX_HEAD_DIM = 384
SHORT_KEYS = 2048
"""A call attending at most this many keys (its window's) runs the persistent build of a row that has one
(`KernelSpec.persistent`): there a work tile's start (its Q and first keys) and its store are a large share of
its time, and the persistent loop overlaps them with the previous tile's."""
F32_BUILD_HEAD_DIMS = (128, 256, 384)
"""The scalar kernel is built for the smallest of these >= head_dim (its register arrays)."""


SCALARS = {
    "heads": "H",
    "seq_q": "query rows the launch computes (its window)",
    "seq_k": "keys it attends (its window)",
    "q_pitch": "rows between q's planes (q's N)",
    "kv_pitch": "rows between k's and v's planes (their N)",
    "out_pitch": "token rows per batch of out and lse (q's N)",
    "head_dim": "D",
    "scale": "the logit scale",
    "scale_log2": "the logit scale times log2(e)",
    "batch": "B (a persistent kernel's work tiles)",
}
"""The scalar kernel arguments a row may list, in its `scalars`."""
MAP_SCALARS = ("heads", "seq_q", "seq_k", "out_pitch", "scale_log2")
"""The scalars of the TMA kernels: the maps carry the pitches."""


@dataclass(frozen=True, eq=False)
class KernelSpec:
    """One attention kernel: what it takes, how it is built and launched.

    Attributes:
        name: the `kernel=` name users pass.
        family: "fp32" (the parity path, f32 inputs), "16bit" (the fast path) or "8bit" (16-bit inputs
            quantised to 8 bits; never chosen by "auto", only by name).
        source, entry: file in `kernels/` and its `extern "C"` symbol.
        in_dtypes, out_dtypes: dtype names it reads and writes ("same": the input's).
        head_dims: head_dims it computes exactly.
        min_capability: oldest compute capability; `exact_capability` pins one.
        arch_suffix: "a" for arch-specific cubins (sm_90a: wgmma, setmaxnreg).
        threads, rows_per_block: block size and query rows per block (unless `head_dim_shapes` says otherwise).
        shared_bytes: dynamic shared memory per block, by head_dim.
        prefix: the source's macro prefix (FT_, MH_, ...).
        geometry: constants passed as `-D{prefix}{key}`.
        kinds: which dtype-kind defines the source takes ("IN_KIND", "OUT_KIND").
        head_define: the head_dim define (`-D{prefix}{head_define}={head_dim}{suffix}`).
        smem_define: whether the source takes `{prefix}SMEM_BYTES` to cross-check.
        flags: further NVRTC options. `-ftz=true` (denormal intermediates flush to zero) is what
            CuPy compiled these kernels with before the registry; it is kept, explicitly, so that
            the same source gives the same machine code (without it 3xTF32 ran 1.5-5% slower).
        operands: "pointers" (q, k, v, out, lse, key_lens), "tensor_maps" (TMA maps of q, k, v; out, lse and key_lens
            pointers; the output's map; the map of the key bias, `plan.log2_key_bias`'s, or an unused one) or
            "split_planes" (`SPLIT` first
            turns f32 q, k, v into scaled fp16 hi/lo planes; the kernel takes TMA maps of the planes, out, lse,
            key_lens and the split's column maxima) or "quantized" (the quantising prepass first turns 16-bit q, k, v
            into int8 q and k and 8-bit V^T with their scales, in the P.V scheme of the row's geometry "PV":
            `QUANTIZE` for "0", E4M3 V; `QUANTIZE_U8` for "1", int8 V; the kernel takes TMA maps of the codes, out,
            lse, key_lens, the q, k and v scales and q's logit shift from K smoothing). Every pointer is the first row
            of the launch's window; lse and key_lens (per-batch key counts, int32) may be null (0).
        scalars: the trailing arguments, from `SCALARS`.
        persistent: the row also has a persistent build (`-D{prefix}PERSISTENT=1`, see `SHORT_KEYS`): one block
            per SM (at most one per work tile), each looping over work tiles of `rows_per_block` query rows of
            one head and batch; its other build (`PERSISTENT=0`) runs one block per work tile.
        persistent_geometry, persistent_shared_bytes: what the persistent build changes of `geometry` and
            `shared_bytes`.
        key_bias_bytes: the row also has key-bias builds (`-D{prefix}KEY_BIAS=1`: an additive f32 bias per key
            and plane, SDPA's float mask over keys; without key counts), which take this many more bytes of shared
            memory at (head_dim, persistent); None: it has none.
        head_dim_shapes: head_dim -> the `BlockShape` its builds launch with instead of the row's `threads`,
            `rows_per_block`, `geometry` and `persistent_geometry` (`shape`); `shared_bytes` already takes
            the head_dim.
        beats_sdpa_on: for the 16-bit family, the (compute capability, head_dim) pairs at which it was
            measured at least as fast as torch's SDPA; elsewhere "auto" prefers SDPA for calls SDPA
            can serve.
            None (the parity path) means everywhere: SDPA has no f32-accurate fast path.
    """

    name: str
    family: str
    source: str
    entry: str
    in_dtypes: tuple[str, ...]
    out_dtypes: tuple[str, ...] | str
    head_dims: tuple[int, ...]
    min_capability: tuple[int, int]
    threads: int
    rows_per_block: int
    shared_bytes: Callable[[int], int]
    prefix: str
    geometry: Mapping[str, str] = field(default_factory=dict)
    kinds: tuple[str, ...] = ()
    head_define: tuple[str, str] = ("D", "")
    smem_define: bool = True
    flags: tuple[str, ...] = ("-ftz=true",)
    operands: str = "pointers"
    scalars: tuple[str, ...] = ("heads", "seq_q", "seq_k", "q_pitch", "kv_pitch", "out_pitch", "scale_log2")
    exact_capability: tuple[int, int] | None = None
    arch_suffix: str = ""
    persistent: bool = False
    persistent_geometry: Mapping[str, str] = field(default_factory=dict)
    persistent_shared_bytes: Callable[[int], int] | None = None
    key_bias_bytes: Callable[[int, bool], int] | None = None
    head_dim_shapes: Mapping[int, BlockShape] = field(default_factory=dict)
    beats_sdpa_on: tuple[tuple[tuple[int, int], int], ...] | None = None

    def writes(self, in_dtype: str) -> tuple[str, ...]:
        """The output dtypes it writes for `in_dtype` inputs."""
        return (in_dtype,) if self.out_dtypes == "same" else self.out_dtypes

    def shape(self, head_dim: int) -> BlockShape:
        """How its builds at `head_dim` are launched: the `head_dim_shapes` entry, else the row's own."""
        shape = self.head_dim_shapes.get(head_dim)
        if shape is None:
            return BlockShape(self.threads, self.rows_per_block, self.geometry, self.persistent_geometry)
        return shape


_WARP_SPECIALISED = {
    "head_dims": (128,), "min_capability": (9, 0), "exact_capability": (9, 0), "arch_suffix": "a",
    "threads": 384, "rows_per_block": 128, "flags": (),
}  # fmt: skip
"""What the three Hopper rows share: sm_90a only, a producer and two consumer warpgroups, 128-row query
blocks, head_dim 128 (the wgmma row's head_dim 64: three consumer warpgroups, 192 rows), no -ftz (fp16x3 keeps
subnormal scale factors)."""

_EIGHT_BIT = KernelSpec(
    name="fp8",
    family="8bit",
    source="flash_attn_fp8.cu",
    entry="joint_attention_fp8",
    in_dtypes=HALF_DTYPES,
    out_dtypes="same",
    **_WARP_SPECIALISED,
    shared_bytes=fp8_smem,
    prefix="F8_",
    geometry={"BQ": "128", "BK": "128", "STAGES": "4", "THREADS": "384", "PV": "0"},
    kinds=("IN_KIND",),
    operands="quantized",
    scalars=("heads", "seq_q", "seq_k", "out_pitch"),
)
"""The 8-bit kernel with E4M3 P.V ("fp8", geometry "PV" "0"); the "int8" row, first of the 8-bit family and so
`precision="fp8"`'s kernel, is it with u8 x int8 P.V ("PV" "1": 2.5x less error, 2-7% slower on the H100)."""

KERNELS: tuple[KernelSpec, ...] = (
    KernelSpec(
        name="fp16x3",
        family="fp32",
        source="flash_attn_fp16x3.cu",
        entry="joint_attention_fp16x3",
        in_dtypes=("float32",),
        out_dtypes=("float32", *HALF_DTYPES),
        **_WARP_SPECIALISED,
        shared_bytes=fp16x3_smem,
        prefix="X3_",
        geometry={"BQ": "128", "BK": "64", "STAGES": "2", "THREADS": "384"},
        kinds=("OUT_KIND",),
        operands="split_planes",
        scalars=MAP_SCALARS,
    ),
    KernelSpec(
        name="wgmma",
        family="16bit",
        source="flash_attn_wgmma.cu",
        entry="joint_attention_wgmma",
        in_dtypes=HALF_DTYPES,
        out_dtypes="same",
        **{**_WARP_SPECIALISED, "head_dims": (64, 128)},
        shared_bytes=wgmma_smem,
        prefix="WG_",
        geometry=wgmma_shape(128).geometry,
        kinds=("IN_KIND",),
        operands="tensor_maps",
        scalars=(*MAP_SCALARS, "batch"),
        persistent=True,
        persistent_geometry=wgmma_shape(128).persistent_geometry,
        persistent_shared_bytes=functools.partial(wgmma_smem, persistent=True),
        key_bias_bytes=wgmma_bias_bytes,
        head_dim_shapes={64: wgmma_shape(64)},
        beats_sdpa_on=(((9, 0), 64), ((9, 0), 128)),
    ),
    replace(_EIGHT_BIT, name="int8", geometry={**_EIGHT_BIT.geometry, "PV": "1"}),
    _EIGHT_BIT,
    KernelSpec(
        name="mma16",
        family="16bit",
        source="flash_attn_mma16.cu",
        entry="joint_attention_mma16",
        in_dtypes=HALF_DTYPES,
        out_dtypes="same",
        head_dims=(64, 128),
        min_capability=(8, 0),
        threads=128,
        rows_per_block=128,
        shared_bytes=lambda d: (128 + 2 * 64) * (2 * d + 16),
        prefix="MH_",
        geometry={"BQ": "128", "BK": "64", "THREADS": "128"},
        kinds=("IN_KIND",),
        beats_sdpa_on=(),
    ),
    KernelSpec(
        name="tf32x3",
        family="fp32",
        source="flash_attn_tf32x3.cu",
        entry="joint_attention_tf32x3",
        in_dtypes=("float32",),
        out_dtypes=("float32", *HALF_DTYPES),
        head_dims=(32, 64, 96, 128),
        min_capability=(8, 0),
        threads=256,
        rows_per_block=128,
        shared_bytes=lambda d: (128 * (d + 4) + 32 * (d + 4) + 32 * (d + 2)) * 8 + 32 * d * 4,
        prefix="FT_",
        geometry={"BQ": "128", "BK": "32", "THREADS": "256"},
        kinds=("OUT_KIND",),
    ),
    KernelSpec(
        name="f32",
        family="fp32",
        source="flash_attn_f32.cu",
        entry="joint_attention_flash_f32",
        in_dtypes=("float32",),
        out_dtypes=("float32",),
        head_dims=tuple(range(1, MAX_HEAD_DIM + 1)),
        min_capability=(5, 0),
        threads=128,
        rows_per_block=8,
        shared_bytes=lambda d: 2 * 32 * d * 4,
        prefix="FA_",
        geometry={"BQ": "8u", "BK": "32u", "THREADS": "128u"},
        head_define=("DMAX", "u"),
        smem_define=False,
        scalars=("heads", "seq_q", "seq_k", "q_pitch", "kv_pitch", "out_pitch", "head_dim", "scale"),
    ),
)
"""Every attention kernel, in the order "auto" tries them within a family."""

BY_NAME: dict[str, KernelSpec] = {spec.name: spec for spec in KERNELS}
KERNEL_CHOICES = ("auto", *BY_NAME)


def family_of(in_dtype: str) -> str:
    """The family of `in_dtype` inputs: "fp32" for float32, "16bit" for bfloat16 and float16."""
    return "fp32" if in_dtype == "float32" else "16bit"


def kernels_for(in_dtype: str, lossy: bool = True) -> tuple[str, ...]:
    """The `kernel=` names that take `in_dtype` inputs, "auto" first; `lossy`: with the 8-bit kernels
    (16-bit inputs only)."""
    families = (family_of(in_dtype), "8bit") if lossy and in_dtype in HALF_DTYPES else (family_of(in_dtype),)
    return ("auto", *(spec.name for spec in KERNELS if spec.family in families))


def eight_bit_kernels() -> tuple[str, ...]:
    """The `kernel=` names of the 8-bit family."""
    return tuple(spec.name for spec in KERNELS if spec.family == "8bit")


ATTENTION_FAMILIES = ("fp32", "16bit", "8bit")


@dataclass(frozen=True)
class Variant:
    """One compiled flavour of a row: the spec at one head_dim and in/out dtypes; for the attention rows,
    with or without per-batch key counts (`key_lens`: `-D{prefix}KEY_LENS=1`; without, the kernel's code
    is what it was before key counts existed, and its key_lens argument is ignored); for rows that have one,
    the persistent build (`persistent`) or the other; for rows with key-bias builds, with or without an additive
    bias per key (`key_bias`: `-D{prefix}KEY_BIAS=1`, without key counts)."""

    spec: KernelSpec
    head_dim: int
    in_dtype: str
    out_dtype: str
    key_lens: bool = False
    persistent: bool = False
    key_bias: bool = False

    @functools.cached_property
    def name(self) -> str:
        suffix = ("_keylens" if self.key_lens else "") + ("_persistent" if self.persistent else "")
        suffix += "_keybias" if self.key_bias else ""
        return f"{self.spec.name}_d{self.head_dim}_{self.in_dtype}_to_{self.out_dtype}{suffix}"

    def defines(self) -> tuple[tuple[str, str], ...]:
        """Every `-D` the source requires: head_dim, dtype kinds, key counts, geometry, shared bytes."""
        spec = self.spec
        name, suffix = spec.head_define
        values = {name: f"{self.head_dim}{suffix}"}
        dtypes = {"IN_KIND": self.in_dtype, "OUT_KIND": self.out_dtype}
        values.update((kind, str(KINDS[dtypes[kind]])) for kind in spec.kinds)
        if spec.family in ATTENTION_FAMILIES:
            values["KEY_LENS"] = str(int(self.key_lens))
        if spec.persistent:
            values["PERSISTENT"] = str(int(self.persistent))
        if spec.key_bias_bytes is not None:
            values["KEY_BIAS"] = str(int(self.key_bias))
        if spec.smem_define:
            values["SMEM_BYTES"] = str(self.shared_bytes)
        values.update(self.geometry)
        return tuple((spec.prefix + key, value) for key, value in values.items())

    @functools.cached_property
    def geometry(self) -> Mapping[str, str]:
        """This build's `-D` geometry (unprefixed): its shape's, with what the persistent build changes."""
        shape = self.shape
        return {**shape.geometry, **shape.persistent_geometry} if self.persistent else shape.geometry

    @property
    def key_rows(self) -> int:
        """Keys per key tile of this build (its geometry's BK): the box rows of its K and V tensor maps."""
        return int(self.geometry["BK"].rstrip("u"))

    @functools.cached_property
    def shape(self) -> BlockShape:
        """How this build is launched (its row's `shape` at its head_dim)."""
        return self.spec.shape(self.head_dim)

    @property
    def threads(self) -> int:
        """Threads per block of this build."""
        return self.shape.threads

    @property
    def rows_per_block(self) -> int:
        """Query rows per block (per work tile, in the persistent build) of this build."""
        return self.shape.rows_per_block

    @property
    def shared_bytes(self) -> int:
        """Dynamic shared memory per block of this build."""
        spec = self.spec
        bias = spec.key_bias_bytes(self.head_dim, self.persistent) if self.key_bias else 0
        if self.persistent and spec.persistent_shared_bytes is not None:
            return spec.persistent_shared_bytes(self.head_dim) + bias
        return spec.shared_bytes(self.head_dim) + bias

    def options(self) -> tuple[str, ...]:
        """NVRTC options that select this variant: its defines and the row's flags (no arch flag)."""
        return tuple(f"-D{key}={value}" for key, value in self.defines()) + self.spec.flags

    def arch(self, capability: tuple[int, int]) -> str:
        """The exact NVRTC target for a device of `capability`."""
        return f"sm_{capability[0]}{capability[1]}{self.spec.arch_suffix}"

    def grid(self, batch: int, heads: int, seq: int, multiprocessors: int) -> tuple[int, int, int]:
        """The launch grid over `batch` x `heads` x `seq` query rows on a device of `multiprocessors` SMs."""
        blocks = -(-seq // self.rows_per_block)
        if self.persistent:
            return (min(blocks * heads * batch, multiprocessors), 1, 1)
        return (blocks, heads, batch)


def variant_for(
    spec: KernelSpec, head_dim: int, in_dtype: str, out_dtype: str, key_lens: bool = False, short_keys: bool = False,
    key_bias: bool = False,
) -> Variant:  # fmt: skip
    """The build of `spec` that computes `head_dim` (the scalar kernel rounds it up); `short_keys`: the call
    attends at most `SHORT_KEYS` keys, which the row's persistent build runs where it has one."""
    if spec.name == "f32":
        head_dim = next(d for d in F32_BUILD_HEAD_DIMS if head_dim <= d)
    return Variant(spec, head_dim, in_dtype, out_dtype, key_lens, short_keys and spec.persistent, key_bias)


def variants(spec: KernelSpec) -> tuple[Variant, ...]:
    """Every build of an attention row: head_dims x input dtypes x output dtypes it writes x without and
    with key counts (x not persistent and persistent, for rows with a persistent build), and with a key bias
    instead (rows with key-bias builds)."""
    head_dims = F32_BUILD_HEAD_DIMS if spec.name == "f32" else spec.head_dims
    builds = [(d, i, o) for d in head_dims for i in spec.in_dtypes for o in spec.writes(i)]
    counts = ((False, False), (True, False)) + (((False, True),) if spec.key_bias_bytes is not None else ())
    flavours = [(k, p, b) for p in ((False, True) if spec.persistent else (False,)) for k, b in counts]
    return tuple(Variant(spec, *build, *flavour) for flavour in flavours for build in builds)
