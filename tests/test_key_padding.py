"""`key_padding.padding_of`: what the backend derives from a mask is read once per mask object, read again
when the mask is written in place, and dropped with the mask; boolean and additive float masks alike."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from pictor_diffusers.integration import key_padding
from pictor_diffusers.integration.key_padding import DROPPED_AT, padding_of

BATCH, HEADS = 2, 3


def kept(seq_k: int) -> torch.Tensor:
    """`[B, Nk]` bool: batch 0 keeps all but a hole, batch 1 a shorter prefix with a hole."""
    keep = torch.ones(BATCH, seq_k, dtype=torch.bool)
    keep[0, seq_k // 3] = False
    keep[1, seq_k // 2 :] = False
    keep[1, 1] = False
    return keep


def as_mask(keep: torch.Tensor, kind: str) -> torch.Tensor:
    """`keep` as Qwen's bool `[B, 1, 1, Nk]` or LTX's additive bf16 `[B, H, 1, Nk]` (0 / -10000)."""
    if kind == "bool":
        return keep[:, None, None, :].clone()
    values = torch.where(keep, 0.0, -10000.0).to(torch.bfloat16)
    return values[:, None, None, :].expand(BATCH, HEADS, 1, keep.shape[1]).contiguous()


def expected(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(key_lens, the first key_lens[b] gathered key indices of each batch)."""
    lens = keep.sum(1, dtype=torch.int32)
    return lens, [torch.nonzero(row).flatten() for row in keep]


def check(mask: torch.Tensor, keep: torch.Tensor) -> None:
    """`padding_of(mask)` against `keep`: the counts, and the first key_lens[b] keys each batch attends after the
    gather (or, without one, in place)."""
    seq_k = keep.shape[1]
    padding = padding_of(mask, BATCH, HEADS, seq_k)
    lens, indices = expected(keep)
    assert torch.equal(padding.key_lens, lens)
    for b in range(BATCH):
        if padding.rows is None:
            attended = torch.arange(lens[b])
        else:
            attended = padding.rows[b * seq_k : b * seq_k + lens[b]] - b * seq_k
        assert torch.equal(attended, indices[b])


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("seq_k", [7, 128, 300])
def test_read_once_per_mask(kind: str, seq_k: int, monkeypatch: pytest.MonkeyPatch) -> None:
    keep = kept(seq_k)
    mask = as_mask(keep, kind)
    reads = []
    monkeypatch.setattr(key_padding, "_read", lambda *a, _f=key_padding._read: reads.append(a) or _f(*a))
    for _ in range(4):
        check(mask, keep)
    assert len(reads) == 1, reads


@pytest.mark.parametrize("kind", ["bool", "float", "float32", "not padding"])
@pytest.mark.parametrize("seq_k", [7, 129, 300])
def test_a_new_mask_is_read_in_one_host_transfer(kind: str, seq_k: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """LTX-Video's processor makes a new mask at every call: reading it takes one `.item()` or `.tolist()` (one
    host sync on CUDA), whether or not it turns out to be key padding."""
    keep = kept(seq_k)
    mask = as_mask(keep, "bool" if kind == "bool" else "float")
    if kind == "float32":
        mask = mask.float()
    if kind == "not padding":
        mask[1, 0, 0, 2] = 0.25
    transfers = []
    for name in ("item", "tolist"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda t, _f=original, _n=name: transfers.append(_n) or _f(t))
    padding = padding_of(mask, BATCH, HEADS, seq_k)
    assert len(transfers) == 1, transfers
    if kind == "not padding":
        assert padding is None
    else:
        monkeypatch.undo()
        check(mask, keep)


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_mask_written_in_place_is_read_again(kind: str) -> None:
    keep = kept(65)
    mask = as_mask(keep, kind)
    check(mask, keep)
    keep[0, 10:20] = False
    mask.copy_(as_mask(keep, kind))
    check(mask, keep)
    if kind == "float":
        mask[0, 0, 0, 3] = 0.5  # a bias: no longer key padding
        assert padding_of(mask, BATCH, HEADS, 65) is None


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_other_shapes_are_not_served_from_the_cache(kind: str) -> None:
    keep = kept(33)
    mask = as_mask(keep, kind)
    check(mask, keep)
    assert padding_of(mask, BATCH, HEADS, 34) is None, "another key count must not reuse the entry"


def test_not_key_padding_is_cached_too() -> None:
    mask = torch.full((BATCH, HEADS, 1, 40), DROPPED_AT / 2)
    assert padding_of(mask, BATCH, HEADS, 40) is None
    assert padding_of(mask, BATCH, HEADS, 40) is None


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_entries_die_with_their_mask(kind: str) -> None:
    mask = as_mask(kept(50), kind)
    padding_of(mask, BATCH, HEADS, 50)
    before, alive = len(key_padding._derived), weakref.ref(mask)
    del mask
    gc.collect()
    assert alive() is None, "the cache keeps the mask alive"
    assert len(key_padding._derived) == before - 1


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_padding_at_the_end_needs_no_gather(kind: str) -> None:
    keep = torch.ones(BATCH, 90, dtype=torch.bool)
    keep[1, 61:] = False
    check(as_mask(keep, kind), keep)
    assert padding_of(as_mask(keep, kind), BATCH, HEADS, 90).rows is None
    assert padding_of(as_mask(kept(90), kind), BATCH, HEADS, 90).rows is not None


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_nothing_read_or_cached_while_tracing(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torch.compile (here: its flag) a bool mask is gathered without a host read, a float one not served."""
    keep = torch.ones(BATCH, 40, dtype=torch.bool)
    keep[0, 30:] = False
    mask = as_mask(keep, kind)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    monkeypatch.setattr(key_padding, "_read", lambda *a: pytest.fail("a host read while tracing"))
    padding = padding_of(mask, BATCH, HEADS, 40)
    assert mask not in key_padding._derived
    if kind == "float":
        assert padding is None
    else:
        check(mask, keep)
        assert padding.rows is not None


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_inference_mode_masks_are_read_every_call(kind: str) -> None:
    """A mask made under torch.inference_mode has no version counter: served, never cached, still right."""
    keep = kept(70)
    with torch.inference_mode():
        mask = as_mask(keep, kind)
        check(mask, keep)
        assert mask not in key_padding._derived
        keep[0, 5:9] = False
        mask.copy_(as_mask(keep, kind))
        check(mask, keep)
