"""The adapter interface and its registry: what `PictorAttn` needs to know about one attention module type.

An `Adapter` says which call arguments its module type passes (positionally after hidden_states, in
`args` order), whether it takes FLUX.2-klein's KV-cache arguments (`kv_cache`), and in `forward` where
the module keeps its projections, QK norms and output projections and which argument is its RoPE:

    @register_adapter(MyAttention)
    class MyAdapter(Adapter):
        family = "My model"
        args = ("attention_mask", "image_rotary_emb")

        def forward(self, attn, call, attend):
            segment = Segment(*attn.to_qkv(call.hidden_states).chunk(3, dim=-1), attn.norm_q, attn.norm_k)
            return attn.to_out(attend([segment], attn.head_dim, call.image_rotary_emb, call.kv))

`adapter_for(module)` walks the module type's MRO, so a subclass of a registered type is served.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple, TypeVar

import torch

from ...ops.prologue import Rope, Segment
from ..kv_cache import KvRequest, kv_request

Attend = Callable[[list[Segment], int, Rope | None, KvRequest | None], torch.Tensor]
"""`PictorAttn._attend`: (segments, head_dim, rope, kv) -> token-major `[B, N, H*D]` in the projections' dtype."""

Output = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
CALL_ARGS = ("encoder_hidden_states", "attention_mask", "image_rotary_emb")


class KvArgs(NamedTuple):
    """FLUX.2-klein's KV-cache keyword arguments as `PictorAttn` received them."""

    cache: Any = None
    mode: str | None = None
    ref_tokens: int = 0
    txt_tokens: int = 0


class Call(NamedTuple):
    """One bound attention call: tokens `[B, N, C]` in the model dtype, RoPE `(cos, sin)` each `[N, D]`."""

    hidden_states: torch.Tensor
    encoder_hidden_states: torch.Tensor | None
    attention_mask: torch.Tensor | None
    image_rotary_emb: Rope | None
    kv: KvRequest | None


class Adapter:
    """How `PictorAttn` runs one attention module type; subclasses set the class attributes and `forward`.

    Attributes:
        family: the model family, named in error messages ("FLUX.2").
        args: the call arguments after hidden_states, in positional order, among `CALL_ARGS`.
        kv_cache: whether it serves `kv_cache`, `kv_cache_mode`, `num_ref_tokens`, `num_txt_tokens`.
    """

    family: ClassVar[str] = ""
    args: ClassVar[tuple[str, ...]] = CALL_ARGS
    kv_cache: ClassVar[bool] = False

    def bind(
        self,
        attn: torch.nn.Module,
        hidden_states: torch.Tensor,
        args: tuple[Any, ...],
        given: dict[str, Any],
        kv_args: KvArgs,
    ) -> Call:
        """The call, from positional `args` and keyword `given` (`CALL_ARGS` -> value); raises for what
        this module type does not take (KV-cache mode, extra arguments, a mask)."""
        text, mask, rope = self._bound(type(attn).__name__, args, given, kv_args.mode)
        kv = None
        if self.kv_cache:
            text_len = self.kv_text_len(text, kv_args.txt_tokens)
            kv = kv_request(kv_args.mode, kv_args.cache, text_len, kv_args.ref_tokens)
        self.reject_mask(mask)
        return Call(hidden_states, text, mask, rope, kv)

    def _bound(self, name: str, args: tuple[Any, ...], given: dict[str, Any], kv_mode: str | None) -> list[Any]:
        """The values of `CALL_ARGS`: positional `args` in `self.args` order, else the keyword's."""
        if kv_mode is not None and not self.kv_cache:
            raise TypeError(f"kv_cache_mode is a FLUX.2 mode; {name} does not take it")
        if len(args) > len(self.args):
            raise TypeError(
                f"PictorAttn got {len(args)} positional arguments after hidden_states; expected {self.args}"
            )
        extra = [arg for arg in CALL_ARGS if arg not in self.args and given.get(arg) is not None]
        if extra:
            raise TypeError(f"{name} takes no {extra[0]}")
        bound = {**given, **dict(zip(self.args, args, strict=False))}
        return [bound.get(arg) for arg in CALL_ARGS]

    def kv_text_len(self, encoder_hidden_states: torch.Tensor | None, num_txt_tokens: int) -> int:
        """Text tokens ahead of the reference tokens in a KV-cache call: those of `encoder_hidden_states`."""
        return 0 if encoder_hidden_states is None else encoder_hidden_states.shape[1]

    def reject_mask(self, attention_mask: torch.Tensor | None) -> None:
        """ValueError for any mask: pictor computes unmasked attention."""
        if attention_mask is not None:
            raise ValueError(
                f"PictorAttn computes unmasked attention, as {self.family} uses it; got an attention_mask "
                f"of shape {tuple(attention_mask.shape)}"
            )

    def forward(self, attn: torch.nn.Module, call: Call, attend: Attend) -> Output:
        """Projections -> `attend` -> output projections; returns what the stock processor returns."""
        raise NotImplementedError


ADAPTERS: dict[type, Adapter] = {}
"""Module type -> its adapter."""

A = TypeVar("A", bound=type[Adapter])


def register_adapter(module_type: type[torch.nn.Module]) -> Callable[[A], A]:
    """Class decorator: serve `module_type` (and its subclasses) with the decorated `Adapter`."""

    def register(adapter: A) -> A:
        current = ADAPTERS.get(module_type)
        if current is not None and type(current) is not adapter:
            raise ValueError(f"{module_type.__name__} already has the adapter {type(current).__name__}")
        ADAPTERS[module_type] = adapter()
        return adapter

    return register


def served_names() -> str:
    """The served module types' names, sorted: "A, B and C"."""
    names = sorted(module_type.__name__ for module_type in ADAPTERS)
    if len(names) < 2:
        return names[0] if names else "nothing"
    return f"{', '.join(names[:-1])} and {names[-1]}"


def adapter_for(attn: torch.nn.Module) -> Adapter:
    """The adapter of `attn`'s type or its nearest registered base; TypeError names unserved types.

    A registered type is looked up directly (the MRO walk is for subclasses; dynamo cannot iterate the MRO
    of classes diffusers marks `allow_in_graph`, such as `Attention`)."""
    adapter = ADAPTERS.get(type(attn))
    if adapter is not None:
        return adapter
    for module_type in type(attn).__mro__:
        adapter = ADAPTERS.get(module_type)
        if adapter is not None:
            return adapter
    raise TypeError(f"PictorAttn serves {served_names()}, not {type(attn).__name__}")
