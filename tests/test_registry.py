"""The kernel registry's choice, on CPU, for every combination of inputs and device.

Two kinds of checks: a table of concrete cases written out by hand (what a
FLUX.2 user on a given GPU gets), and properties over the whole product of
dtypes x head_dims x devices x alignment x requested kernels (the chosen
kernel can run the problem; every kernel tried before it cannot; a named
kernel is honoured or refused with its reason).
"""

from __future__ import annotations

import itertools
import re
from dataclasses import replace

import pytest

from pictor_diffusers.cuda.registry import BY_NAME, KERNEL_CHOICES, KERNELS, kernels_for, variants
from pictor_diffusers.cuda.selection import SDPA, NoKernelError, Problem, blocker, select_kernel

H200 = ((9, 0), 232448)
A100 = ((8, 0), 166912)
L4 = ((8, 9), 101376)
T4 = ((7, 5), 65536)
B200 = ((10, 0), 232448)
RTX5090 = ((12, 0), 101376)
DEVICES = {"H200": H200, "A100": A100, "L4": L4, "T4": T4, "B200": B200, "RTX5090": RTX5090}


def problem(
    in_dtype: str, head_dim: int, device: tuple, out_dtype: str | None = None, aligned: bool = True, lse: bool = False
) -> Problem:
    return Problem(in_dtype, out_dtype or in_dtype, head_dim, device[0], device[1], aligned, lse=lse)


SDPA_PICK = (SDPA, False, None, None)
CASES = [
    # (in dtype, out dtype, head_dim, device, aligned[, lse]) -> (kernel, upcast, built head_dim, written dtype)
    (("bfloat16", None, 128, H200, True), ("wgmma", False, 128, "bfloat16")),
    (("float16", None, 128, H200, True), ("wgmma", False, 128, "float16")),
    (("bfloat16", None, 128, H200, True, True), ("wgmma", False, 128, "bfloat16")),
    (("bfloat16", None, 64, H200, True), ("wgmma", False, 64, "bfloat16")),
    (("float16", None, 64, H200, True, True), ("wgmma", False, 64, "float16")),
    # 16-bit calls no kernel was measured faster on go to SDPA, unless they need the LSE
    (("bfloat16", None, 96, H200, True), SDPA_PICK),
    (("bfloat16", None, 64, A100, True), SDPA_PICK),
    (("bfloat16", None, 128, A100, True), SDPA_PICK),
    (("bfloat16", None, 128, A100, True, True), ("mma16", False, 128, "bfloat16")),
    (("float16", None, 128, L4, True), SDPA_PICK),
    (("bfloat16", None, 128, B200, True), SDPA_PICK),
    (("bfloat16", None, 128, B200, True, True), ("mma16", False, 128, "bfloat16")),
    (("float16", None, 64, RTX5090, True), SDPA_PICK),
    (("bfloat16", None, 128, H200, False), SDPA_PICK),
    (("bfloat16", None, 128, H200, False, True), ("fp16x3", True, 128, "bfloat16")),
    (("bfloat16", None, 96, A100, True, True), ("tf32x3", True, 96, "bfloat16")),
    (("float16", None, 32, T4, True, True), ("f32", True, 128, "float32")),
    # the parity path keeps its kernels everywhere: SDPA has no f32-accurate fast path
    (("float32", None, 128, B200, True), ("tf32x3", False, 128, "float32")),
    (("float32", None, 128, H200, True), ("fp16x3", False, 128, "float32")),
    (("float32", "bfloat16", 128, H200, True), ("fp16x3", False, 128, "bfloat16")),
    (("float32", None, 96, H200, True), ("tf32x3", False, 96, "float32")),
    (("float32", None, 128, L4, True), ("f32", False, 128, "float32")),
    (("float32", "float16", 100, H200, True), ("f32", False, 128, "float32")),
    (("float32", None, 200, H200, True), ("f32", False, 256, "float32")),
    (("float32", None, 384, A100, True), ("f32", False, 384, "float32")),
    (("float32", None, 64, T4, True), ("f32", False, 128, "float32")),
]


@pytest.mark.parametrize(("given", "expected"), CASES, ids=[str(i) for i in range(len(CASES))])
def test_auto_picks(given: tuple, expected: tuple) -> None:
    in_dtype, out_dtype, head_dim, device, aligned, *lse = given
    selection = select_kernel(problem(in_dtype, head_dim, device, out_dtype, aligned, *lse))
    variant = selection.variant
    if variant is None:
        assert (selection.delegate, selection.upcast, None, None) == expected
    else:
        assert selection.delegate is None
        assert (variant.spec.name, selection.upcast, variant.head_dim, variant.out_dtype) == expected


def test_key_counts_never_go_to_sdpa() -> None:
    selection = select_kernel(Problem("bfloat16", "bfloat16", 128, B200[0], B200[1], key_lens=True))
    assert selection.variant.spec.name == "mma16"
    assert dict(selection.rejected)[SDPA] == "gives NaN, not 0, for a batch with no keys"


def test_a_named_kernel_is_honoured_where_sdpa_is_preferred() -> None:
    assert select_kernel(problem("bfloat16", 128, B200), "mma16").variant.spec.name == "mma16"


def test_rejections_explain_themselves() -> None:
    selection = select_kernel(problem("bfloat16", 96, T4, lse=True))
    reasons = dict(selection.rejected)
    assert "head_dim in (64, 128), got 96" in reasons["wgmma"]
    assert "head_dim in (64, 128), got 96" in reasons["mma16"]
    assert "compute capability (8, 0)+, the device has (7, 5)" in reasons["tf32x3 (upcast)"]
    assert selection.variant.spec.name == "f32"


def test_a_disabled_kernel_is_skipped_with_its_reason() -> None:
    disabled = {"wgmma": "cubin failed to load"}
    assert select_kernel(problem("bfloat16", 128, H200), disabled=disabled).delegate == SDPA
    selection = select_kernel(problem("bfloat16", 128, H200, lse=True), disabled=disabled)
    assert selection.variant.spec.name == "mma16"
    assert selection.rejected == (("wgmma", "cubin failed to load"), (SDPA, "does not return the log-sum-exp"))


@pytest.mark.parametrize(
    ("kernel", "given", "match"),
    [
        ("wgmma", ("bfloat16", 128, A100), r"needs compute capability \(9, 0\), the device has \(8, 0\)"),
        ("mma16", ("float16", 32, H200), r"needs head_dim in \(64, 128\), got 32"),
        ("tf32x3", ("float32", 256, H200), r"needs head_dim in \(32, 64, 96, 128\), got 256"),
        ("tf32x3", ("float32", 128, L4), r"needs 218624 bytes of shared memory per block, the device allows 101376"),
        ("f32", ("float32", 385, H200), r"needs head_dim <= 384, got 385"),
    ],
)
def test_a_named_kernel_that_cannot_run_raises(kernel: str, given: tuple, match: str) -> None:
    with pytest.raises(NoKernelError, match=match):
        select_kernel(problem(*given), kernel)


def test_misaligned_inputs_refuse_tensor_core_kernels() -> None:
    with pytest.raises(NoKernelError, match="not 16-byte aligned"):
        select_kernel(problem("float32", 128, H200, aligned=False), "tf32x3")


PRODUCT = list(
    itertools.product(("float32", "bfloat16", "float16"), (1, 32, 64, 96, 100, 128, 256, 384), DEVICES, (True, False))
)


@pytest.mark.parametrize("lse", [False, True], ids=["plain", "lse"])
@pytest.mark.parametrize(("in_dtype", "head_dim", "device", "aligned"), PRODUCT)
def test_every_combination(in_dtype: str, head_dim: int, device: str, aligned: bool, lse: bool) -> None:
    """The chosen kernel runs the problem; each earlier candidate cannot; named kernels are honoured;
    a 16-bit call goes to SDPA exactly when no kernel measured faster than SDPA on the device runs it."""
    given = problem(in_dtype, head_dim, DEVICES[device], aligned=aligned, lse=lse)
    try:
        selection = select_kernel(given)
    except NoKernelError as error:
        assert (in_dtype, head_dim, device) in {(d, 384, "T4") for d in ("float32", "bfloat16", "float16")}, error
        assert in_dtype == "float32" or lse, "a plain 16-bit call SDPA serves was refused"
        assert re.search(r"f32( \(upcast\))?: needs 98304 bytes of shared memory per block", str(error))
        return
    measured = (given.capability, head_dim)
    tuned = [s for s in KERNELS if s.family == "16bit" and measured in (s.beats_sdpa_on or ())]
    runs_tuned = any(blocker(s, given) is None for s in tuned)
    if selection.delegate is not None:
        assert in_dtype != "float32" and not lse and not runs_tuned and selection.variant is None
        return
    assert in_dtype == "float32" or lse or runs_tuned, "a plain 16-bit call ran an untuned kernel"
    run_as = Problem(**{**given.__dict__, "in_dtype": "float32", "aligned": True}) if selection.upcast else given
    assert blocker(selection.variant.spec, run_as) is None
    assert selection.variant.head_dim >= head_dim
    assert selection.variant.spec.family == ("fp32" if in_dtype == "float32" or selection.upcast else "16bit")
    for name, reason in selection.rejected:
        assert reason, name
    for kernel in kernels_for(in_dtype)[1:]:
        spec = BY_NAME[kernel]
        reason = blocker(spec, given)
        if reason is None:
            assert select_kernel(given, kernel).variant.spec is spec
        else:
            with pytest.raises(NoKernelError, match=re.escape(reason)):
                select_kernel(given, kernel)


def test_choices_and_families() -> None:
    assert KERNEL_CHOICES == ("auto", "fp16x3", "wgmma", "int8", "fp8", "mma16", "tf32x3", "f32")
    assert kernels_for("float32") == kernels_for("float32", lossy=False) == ("auto", "fp16x3", "tf32x3", "f32")
    assert kernels_for("bfloat16") == kernels_for("float16") == ("auto", "wgmma", "int8", "fp8", "mma16")
    assert kernels_for("bfloat16", lossy=False) == ("auto", "wgmma", "mma16")


@pytest.mark.parametrize("spec", KERNELS, ids=[s.name for s in KERNELS])
def test_variants_carry_their_whole_geometry(spec: object) -> None:
    """Each -D the sources require is produced, with the row's geometry and shared memory."""
    for variant in variants(spec):
        defines = dict(variant.defines())
        prefix = spec.prefix
        assert defines[prefix + "THREADS"].rstrip("u") == str(variant.threads)
        assert defines[prefix + "BQ"].rstrip("u") == str(variant.rows_per_block)
        if variant.head_dim not in spec.head_dim_shapes:
            assert (variant.threads, variant.rows_per_block) == (spec.threads, spec.rows_per_block)
        if spec.smem_define:
            assert int(defines[prefix + "SMEM_BYTES"]) == variant.shared_bytes
        persistent_bytes = spec.persistent_shared_bytes
        expected_bytes = persistent_bytes if variant.persistent and persistent_bytes else spec.shared_bytes
        bias_bytes = spec.key_bias_bytes(variant.head_dim, variant.persistent) if variant.key_bias else 0
        assert variant.shared_bytes == expected_bytes(variant.head_dim) + bias_bytes
        assert len(set(variant.options())) == len(variant.options())
        assert defines[prefix + "KEY_LENS"] == str(int(variant.key_lens))
    assert {v.key_lens for v in variants(spec)} == {False, True}
    names = [v.name for v in variants(spec)]
    assert len(set(names)) == len(names)


def test_compile_flags_match_the_pre_registry_builds() -> None:
    """CuPy compiled the CuPy-launched kernels with -ftz=true; the registry keeps that explicitly
    (same source, same options: the same machine code); the Hopper cubins never had it (fp16x3
    keeps subnormal scale factors)."""
    for spec in KERNELS:
        assert spec.flags == (() if spec.name in ("wgmma", "fp16x3", "fp8", "int8") else ("-ftz=true",)), spec.name
        assert all(option in variants(spec)[0].options() for option in spec.flags)


@pytest.mark.parametrize(("given", "expected"), CASES, ids=[str(i) for i in range(len(CASES))])
def test_key_counts_pick_the_same_kernel_in_its_key_count_build(given: tuple, expected: tuple) -> None:
    """With key counts, the kernel the same call with the LSE gets (neither goes to SDPA), in its key-count build."""
    in_dtype, out_dtype, head_dim, device, aligned, *_ = given
    plain = select_kernel(problem(in_dtype, head_dim, device, out_dtype, aligned, lse=True))
    counted = select_kernel(replace(problem(in_dtype, head_dim, device, out_dtype, aligned, lse=True), key_lens=True))
    assert not plain.variant.key_lens and counted.variant.key_lens
    assert replace(counted.variant, key_lens=False) == plain.variant and counted.upcast == plain.upcast


@pytest.mark.parametrize(
    ("name", "head_dim", "persistent", "seq_q", "expected"),
    [
        ("wgmma", 128, True, 32760, (132, 1, 1)),  # one block per SM, each looping over 256 * 40 / 132 work tiles
        ("wgmma", 128, True, 200, (80, 1, 1)),  # fewer work tiles (2 x 40) than SMs: one block each
        ("wgmma", 128, False, 4097, (33, 40, 1)),  # the other build: one block per (query block, head, batch)
        ("wgmma", 128, False, 177, (2, 40, 1)),  # 176-key tiles leave the query blocks 128 rows
        ("wgmma", 64, False, 4097, (22, 40, 1)),  # 192-row query blocks at head_dim 64
        ("wgmma", 64, False, 191, (1, 40, 1)),
        ("wgmma", 64, True, 200, (80, 1, 1)),  # 2 x 40 work tiles of 192 rows
        ("wgmma", 64, True, 32760, (132, 1, 1)),
        ("wgmma", 64, True, 192, (40, 1, 1)),
        ("mma16", 64, False, 4097, (33, 40, 1)),
    ],
)
def test_grid(name: str, head_dim: int, persistent: bool, seq_q: int, expected: tuple) -> None:
    variant = next(v for v in variants(BY_NAME[name]) if (v.head_dim, v.persistent) == (head_dim, persistent))
    assert variant.grid(1, 40, seq_q, multiprocessors=132) == expected


@pytest.mark.parametrize("persistent", [False, True], ids=["one-block", "persistent"])
def test_head_dim_64_runs_three_consumer_warpgroups(persistent: bool) -> None:
    """The wgmma row's head_dim-64 builds: 512 threads (a producer and three consumer warpgroups), 192-row query
    blocks, four K/V stages (three persistent) in the shared memory the kernel's map needs; head_dim 128 keeps
    384 threads and 128 rows."""
    builds = {
        v.head_dim: v
        for v in variants(BY_NAME["wgmma"])
        if v.persistent == persistent and not v.key_lens and not v.key_bias
    }
    narrow, wide = builds[64], builds[128]
    assert (narrow.threads, narrow.rows_per_block, wide.threads, wide.rows_per_block) == (512, 192, 384, 128)
    stages = 3 if persistent else 4
    # Q tile (two and an output tile, persistent), 192 x 64 x 2 bytes each; K and V stages, 128 x 64 x 2 each
    tiles = (3 if persistent else 1) * 192 * 64 * 2 + 2 * stages * 128 * 64 * 2
    assert narrow.shared_bytes == 1024 + tiles + 8 * (4 + 4 * stages) == (173_184 if persistent else 156_832)
    assert wide.shared_bytes == (230_496 if persistent else 214_112)
    options = narrow.options()
    for define in ("-DWG_BQ=192", "-DWG_BK=128", f"-DWG_STAGES={stages}", "-DWG_THREADS=512"):
        assert define in options
    assert {"-DWG_BQ=128", "-DWG_THREADS=384"} <= set(wide.options())


@pytest.mark.parametrize("persistent", [False, True], ids=["one-block", "persistent"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_wgmma_key_tiles(head_dim: int, persistent: bool) -> None:
    """The head_dim-128 one-block builds take 176-key tiles, two stages of them; every other wgmma build 128-key
    tiles. The key tile is the build's -DWG_BK, its K and V maps' box rows, and what its shared memory holds."""
    keys = 176 if (head_dim, persistent) == (128, False) else 128
    for variant in variants(BY_NAME["wgmma"]):
        if (variant.head_dim, variant.persistent) != (head_dim, persistent):
            continue
        options, rows, d = variant.options(), variant.rows_per_block, head_dim
        assert variant.key_rows == keys and f"-DWG_BK={keys}" in options
        stages = int(dict(variant.defines())["WG_STAGES"])
        q_tiles = 3 if persistent else 1
        biases = stages * -(-keys * 4 // 128) * 128 if variant.key_bias else 0  # f32 key biases, 128-byte rows
        tiles = q_tiles * rows * d * 2 + 2 * stages * keys * d * 2
        assert variant.shared_bytes == 1024 + tiles + biases + 8 * (4 + 4 * stages)
        assert variant.shared_bytes <= 227 * 1024
        more = variant.shared_bytes + 2 * keys * d * 2 + 32
        assert head_dim == 64 or more > 227 * 1024, "a stage more would fit"
        assert (keys * 128) % 1024 == 0, "K and V slabs start on the 128-byte swizzle's 1024-byte period"


@pytest.mark.parametrize("key_lens", [False, True])
@pytest.mark.parametrize("short_keys", [False, True])
def test_short_key_sequences_select_the_persistent_build(short_keys: bool, key_lens: bool) -> None:
    problem = Problem("bfloat16", "bfloat16", 128, (9, 0), 232448, key_lens=key_lens, short_keys=short_keys)
    variant = select_kernel(problem, "wgmma").variant
    assert (variant.persistent, variant.key_lens) == (short_keys, key_lens)
    assert "-DWG_PERSISTENT=" + str(int(short_keys)) in variant.options()
    # two Q tiles, two stages of 128-key tiles and the output tile, or one Q tile and two stages of 176 keys
    assert variant.shared_bytes == (230_496 if short_keys else 214_112)
    assert "-DWG_STAGES=2" in variant.options()
    assert f"-DWG_BK={128 if short_keys else 176}" in variant.options()
    mma16 = select_kernel(replace(problem, capability=(8, 0)), "mma16").variant
    assert not mma16.persistent and not any("PERSISTENT" in option for option in mma16.options())


def test_key_bias_builds_are_wgmma_builds() -> None:
    """Only the wgmma row has key-bias builds: one per head_dim, dtype and persistence, without key counts, each
    with -DWG_KEY_BIAS=1 (every other wgmma build: 0) and a row of f32 biases per K/V stage, each padded to 128
    bytes (the tensor copy's alignment: 768 bytes for 176 keys); the persistent
    head_dim-128 one still fits the 227 KiB of shared memory a Hopper block may have."""
    for spec in KERNELS:
        biased = [v for v in variants(spec) if v.key_bias]
        if spec.name != "wgmma":
            assert not biased and spec.key_bias_bytes is None
            continue
        expected = {(d, i, p) for d in (64, 128) for i in spec.in_dtypes for p in (False, True)}
        assert {(v.head_dim, v.in_dtype, v.persistent) for v in biased} == expected
        assert max(v.shared_bytes for v in biased) == 231_520 <= 227 * 1024
        for variant in variants(spec):
            defines = dict(variant.defines())
            assert defines["WG_KEY_BIAS"] == str(int(variant.key_bias))
            if variant.key_bias:
                assert not variant.key_lens and variant.name.endswith("_keybias")
                plain = replace(variant, key_bias=False)
                keys, stages = variant.key_rows, int(defines["WG_STAGES"])
                row = {128: 512, 176: 768}[keys]
                assert variant.shared_bytes == plain.shared_bytes + row * stages


@pytest.mark.parametrize("short_keys", [False, True], ids=["long", "short"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_a_key_bias_runs_a_wgmma_key_bias_build(head_dim: int, short_keys: bool) -> None:
    """On Hopper a 16-bit call with a key bias runs a wgmma key-bias build (persistent for short keys, as without
    a bias; never SDPA); on Ampere, in float32, and with key counts too, no kernel takes it and the error says why."""
    hopper = Problem("bfloat16", "bfloat16", head_dim, (9, 0), 232_448, short_keys=short_keys, key_bias=True)
    variant = select_kernel(hopper).variant
    assert variant.spec.name == "wgmma" and variant.key_bias and variant.persistent == short_keys
    with pytest.raises(NoKernelError, match="takes no key bias"):
        select_kernel(replace(hopper, capability=(8, 0)))
    with pytest.raises(NoKernelError, match="a key bias or key counts, not both"):
        select_kernel(replace(hopper, key_lens=True), kernel="wgmma")
    with pytest.raises(NoKernelError, match="takes no key bias"):
        select_kernel(replace(hopper, in_dtype="float32", out_dtype="float32"))
