"""Per-model adapters: a new attention module type is served by registering one adapter.

* A toy FLUX-like self-attention (one fused Linear for Q/K/V, RMSNorm QK norms, an output Linear,
  all under its own names) registered with a small `Adapter` runs through `PictorAttn` on CPU and
  matches a plain-torch reference (RMSNorm, diffusers' `apply_rotary_emb`, SDPA) to f32 accuracy.
* A toy joint module holding a `Flux2Attention`'s layers under other names, served by `JointAdapter`
  with its own `JointLayout`, gives the `Flux2Attention`'s outputs.
* Lookup walks the MRO (subclasses are served); unregistered types, double registrations, masks and
  KV-cache modes raise errors that name them.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_flux import FluxAttention
from diffusers.models.transformers.transformer_flux2 import Flux2Attention, Flux2ParallelSelfAttention

import pictor_diffusers.integration.adapters.base as adapters_base
from pictor_diffusers import PictorAttn
from pictor_diffusers.integration.adapters import Adapter, Attend, Call, adapter_for, register_adapter
from pictor_diffusers.integration.adapters.flux1 import Flux1Adapter
from pictor_diffusers.integration.adapters.flux2_double import Flux2DoubleAdapter
from pictor_diffusers.integration.adapters.flux2_single import Flux2SingleAdapter
from pictor_diffusers.integration.adapters.joint import JointAdapter, JointLayout
from pictor_diffusers.ops.prologue import Segment

HEADS, HEAD_DIM, WIDTH = 3, 16, 40
F32_REL_L2_TOL = 1e-5


class ToyAttention(torch.nn.Module):
    """A minimal FLUX-like self-attention whose parts have names no FLUX adapter knows."""

    def __init__(self) -> None:
        super().__init__()
        self.heads, self.dim_per_head = HEADS, HEAD_DIM
        self.qkv = torch.nn.Linear(WIDTH, 3 * HEADS * HEAD_DIM)
        self.q_norm = torch.nn.RMSNorm(HEAD_DIM, eps=1e-6)
        self.k_norm = torch.nn.RMSNorm(HEAD_DIM, eps=1e-6)
        self.proj = torch.nn.Linear(HEADS * HEAD_DIM, WIDTH)
        with torch.no_grad():
            self.q_norm.weight.uniform_(0.5, 1.5)
            self.k_norm.weight.uniform_(0.5, 1.5)
        self.processor = PictorAttn()

    def forward(self, hidden_states: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        return self.processor(self, hidden_states, None, rotary)


class ToySubclass(ToyAttention):
    """Served through its base's adapter."""


class ToyAdapter(Adapter):
    """`ToyAttention(hidden_states, attention_mask, image_rotary_emb)`: where the toy keeps its parts."""

    family = "the toy model"
    args = ("attention_mask", "image_rotary_emb")

    def forward(self, attn: torch.nn.Module, call: Call, attend: Attend) -> torch.Tensor:
        segment = Segment(*attn.qkv(call.hidden_states).chunk(3, dim=-1), attn.q_norm, attn.k_norm)
        return attn.proj(attend([segment], attn.dim_per_head, call.image_rotary_emb, call.kv))


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> dict:
    """A copy of the adapter registry with `ToyAdapter` registered, restored after the test."""
    monkeypatch.setattr(adapters_base, "ADAPTERS", dict(adapters_base.ADAPTERS))
    register_adapter(ToyAttention)(ToyAdapter)
    return adapters_base.ADAPTERS


def rope_tables(tokens: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each `[tokens, HEAD_DIM]` with interleaved pairs, as FLUX's position embeddings give them."""
    angles = torch.rand(tokens, HEAD_DIM // 2, generator=torch.Generator().manual_seed(seed)) * 2 * math.pi
    return angles.cos().repeat_interleave(2, dim=-1), angles.sin().repeat_interleave(2, dim=-1)


def toy_reference(attn: ToyAttention, hidden_states: torch.Tensor, rope: tuple | None) -> torch.Tensor:
    """The toy's attention in plain torch: RMSNorm, RoPE, SDPA, output projection."""
    query, key, value = (t.unflatten(-1, (HEADS, HEAD_DIM)) for t in attn.qkv(hidden_states).chunk(3, dim=-1))
    query, key = attn.q_norm(query), attn.k_norm(key)
    if rope is not None:
        query, key = (apply_rotary_emb(t, rope, sequence_dim=1) for t in (query, key))
    out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (query, key, value)))
    return attn.proj(out.transpose(1, 2).flatten(2))


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


@pytest.mark.parametrize("with_rope", [True, False], ids=["rope", "no-rope"])
@pytest.mark.parametrize("module_type", [ToyAttention, ToySubclass])
def test_toy_adapter_matches_torch_reference(registry: dict, module_type: type, with_rope: bool) -> None:
    torch.manual_seed(0)
    attn, hidden_states = module_type(), torch.randn(2, 37, WIDTH)
    rope = rope_tables(37) if with_rope else None
    with torch.no_grad():
        actual, expected = attn(hidden_states, rope), toy_reference(attn, hidden_states, rope)
    assert isinstance(adapter_for(attn), ToyAdapter)
    assert actual.shape == expected.shape == hidden_states.shape and actual.dtype == torch.float32
    assert rel_l2(actual, expected) <= F32_REL_L2_TOL


def test_toy_adapter_errors(registry: dict) -> None:
    attn = ToyAttention()
    with pytest.raises(ValueError, match=r"as the toy model uses it; got an attention_mask of shape \(1, 1, 4, 4\)"):
        PictorAttn()(attn, torch.randn(1, 4, WIDTH), torch.ones(1, 1, 4, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"^ToyAttention takes no encoder_hidden_states$"):
        PictorAttn()(attn, torch.randn(1, 4, WIDTH), encoder_hidden_states=torch.randn(1, 2, WIDTH))
    with pytest.raises(TypeError, match=r"^kv_cache_mode is a FLUX\.2 mode; ToyAttention does not take it$"):
        PictorAttn()(attn, torch.randn(1, 4, WIDTH), kv_cache_mode="extract", num_ref_tokens=1)
    with pytest.raises(TypeError, match=re.escape("got 3 positional arguments after hidden_states")):
        PictorAttn()(attn, torch.randn(1, 4, WIDTH), None, None, None)


def test_unregistered_type_names_the_served_ones(registry: dict) -> None:
    served = "Attention, Flux2Attention, Flux2ParallelSelfAttention, FluxAttention and ToyAttention"
    message = f"PictorAttn serves {served}, not Linear"
    with pytest.raises(TypeError, match=f"^{message}$"):
        PictorAttn()(torch.nn.Linear(2, 2), torch.randn(1, 2, 2))


def test_second_adapter_for_a_type_is_refused(registry: dict) -> None:
    register_adapter(ToyAttention)(ToyAdapter)  # the same one again: kept
    with pytest.raises(ValueError, match="ToyAttention already has the adapter ToyAdapter"):
        register_adapter(ToyAttention)(type("OtherAdapter", (ToyAdapter,), {}))


def test_flux_types_have_their_adapters() -> None:
    flux2 = Flux2Attention(query_dim=32, heads=2, dim_head=16, added_kv_proj_dim=32)
    single = Flux2ParallelSelfAttention(query_dim=32, heads=2, dim_head=16)
    flux1 = FluxAttention(query_dim=32, heads=2, dim_head=16, added_kv_proj_dim=32)
    subclass = type("MyFlux2Attention", (Flux2Attention,), {})(query_dim=32, heads=2, dim_head=16)
    adapters = [type(adapter_for(module)) for module in (flux2, single, flux1, subclass)]
    assert adapters == [Flux2DoubleAdapter, Flux2SingleAdapter, Flux1Adapter, Flux2DoubleAdapter]


RENAMED = {"wq": "to_q", "wk": "to_k", "wv": "to_v", "qn": "norm_q", "kn": "norm_k", "out": "to_out"}
RENAMED_TEXT = {"tq": "add_q_proj", "tk": "add_k_proj", "tv": "add_v_proj", "tqn": "norm_added_q"}
RENAMED_TEXT |= {"tkn": "norm_added_k", "text_out": "to_add_out"}


class RenamedJoint(torch.nn.Module):
    """A `Flux2Attention`'s layers under other names."""

    def __init__(self, source: Flux2Attention) -> None:
        super().__init__()
        self.head_dim = source.head_dim
        for name, source_name in (RENAMED | RENAMED_TEXT).items():
            setattr(self, name, getattr(source, source_name))


class RenamedAdapter(JointAdapter):
    """`JointAdapter` with `RenamedJoint`'s layout."""

    family = "the renamed model"
    layout = JointLayout(
        qkv=("wq", "wk", "wv"),
        fused_qkv="fused_qkv",
        norms=("qn", "kn"),
        out="out",
        added_qkv=("tq", "tk", "tv"),
        fused_added_qkv="fused_text",
        added_norms=("tqn", "tkn"),
        added_out="text_out",
    )


def test_joint_layout_serves_other_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(adapters_base, "ADAPTERS", dict(adapters_base.ADAPTERS))
    register_adapter(RenamedJoint)(RenamedAdapter)
    torch.manual_seed(0)
    source = Flux2Attention(query_dim=32, heads=2, dim_head=16, added_kv_proj_dim=24, out_dim=32)
    image, text, rope = torch.randn(2, 9, 32), torch.randn(2, 5, 24), rope_tables(14)
    with torch.no_grad():
        expected = PictorAttn()(source, image, text, None, rope)
        actual = PictorAttn()(RenamedJoint(source), image, text, None, rope)
    for got, want in zip(actual, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
