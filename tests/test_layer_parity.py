"""Layer-by-layer parity of `PictorAttn` with diffusers' stock FLUX.2 processors.

Recorded: `tests/fixtures/flux2_tiny_layers_<dtype>.safetensors` hold each
attention module's inputs and stock outputs from one forward of the seeded tiny
transformer (`tests/record_parity_fixtures.py`). Each test rebuilds the same
model, replays one layer's inputs through `PictorAttn` and compares.

Live: the same comparison on a freshly built model, capturing the inputs with
forward hooks, so the check does not depend on the fixtures.

Tolerances (relative L2 against the stock output; measured on torch 2.13 CPU):
* float32: <= 1e-5. Measured 1.1e-7..2.2e-7 (f32 reassociation in SDPA vs the
  online softmax); 1e-5 leaves ~50x margin for other BLAS builds while a wrong
  scale, RoPE or token order gives errors of order 1e-1..1.
* bfloat16: <= 2**-7 (one bf16 epsilon). Measured 2.1e-3..3.5e-3: PictorAttn
  keeps RoPE and attention in f32 where stock rounds them to bf16, so the two
  differ by bf16 rounding of the attention output (about eps/2). Against a
  float32 evaluation of the same layer both land at ~5e-3.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch
from record_parity_fixtures import (
    DTYPES,
    ROPE_KEYS,
    LayerCall,
    attention_modules,
    build_model,
    capture_attention_calls,
    fixture_path,
    weights_sha256,
)

from pictor_diffusers import PictorAttn
from pictor_diffusers.testing.models import TINY_CONFIG, transformer_inputs

REL_L2_TOL = {"float32": 1e-5, "bfloat16": 2.0**-7}
LAYERS = [f"transformer_blocks.{i}.attn" for i in range(TINY_CONFIG["num_layers"])] + [
    f"single_transformer_blocks.{i}.attn" for i in range(TINY_CONFIG["num_single_layers"])
]
REBUILD_HINT = "regenerate them with `python tests/record_parity_fixtures.py --out tests/fixtures`"


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    diff = actual.double() - expected.double()
    return (diff.norm() / expected.double().norm()).item()


@functools.cache
def load_fixture(dtype_name: str) -> tuple[dict[str, torch.Tensor], dict[str, object], torch.nn.Module]:
    """Tensors, decoded metadata and the rebuilt model of one fixture file."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = fixture_path(dtype_name)
    if not path.is_file():
        raise FileNotFoundError(f"missing parity fixture {path}; {REBUILD_HINT}")
    with safe_open(str(path), framework="pt") as handle:
        metadata = {key: json.loads(value) for key, value in handle.metadata().items()}
    model = build_model(DTYPES[dtype_name], config=metadata["config"], seed=metadata["seed"])
    return load_file(str(path)), metadata, model


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_fixture_matches_rebuilt_model(dtype_name: str) -> None:
    _, metadata, model = load_fixture(dtype_name)
    assert metadata["dtype"] == dtype_name
    assert metadata["layers"] == LAYERS
    assert metadata["weights_sha256"] == weights_sha256(model), (
        f"the seeded tiny FLUX.2 weights differ from those the {dtype_name} fixture was recorded with "
        f"(torch {metadata['torch_version']}, diffusers {metadata['diffusers_version']}): "
        f"the model initialisation changed; {REBUILD_HINT}"
    )


def _replay(module: torch.nn.Module, call: LayerCall) -> tuple[torch.Tensor, ...]:
    """`PictorAttn` on recorded inputs, through each module type's positional signature."""
    processor = PictorAttn()
    with torch.no_grad():
        if call.encoder_hidden_states is None:
            # Flux2ParallelSelfAttention: (hidden_states, attention_mask, image_rotary_emb)
            return (processor(module, call.hidden_states, None, call.image_rotary_emb),)
        # Flux2Attention: (hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        return processor(module, call.hidden_states, call.encoder_hidden_states, None, call.image_rotary_emb)


def _assert_close(name: str, actual: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...], tol: float) -> None:
    assert len(actual) == len(expected), f"{name}: {len(actual)} outputs, stock gives {len(expected)}"
    for index, (got, want) in enumerate(zip(actual, expected, strict=True)):
        assert got.shape == want.shape and got.dtype == want.dtype, f"{name}[{index}]: {got.shape}/{got.dtype}"
        assert torch.isfinite(got).all(), f"{name}[{index}] has NaN/Inf"
        error = rel_l2(got, want)
        max_abs = (got.double() - want.double()).abs().max().item()
        assert error <= tol, f"{name}[{index}]: rel L2 {error:.3e} > {tol:.1e} (max-abs {max_abs:.3e})"


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_recorded_layer_parity(dtype_name: str, layer: str) -> None:
    tensors, metadata, model = load_fixture(dtype_name)
    assert metadata["weights_sha256"] == weights_sha256(model), f"fixture weights changed; {REBUILD_HINT}"
    module = attention_modules(model)[layer]
    encoder = tensors.get(f"{layer}/encoder_hidden_states")
    call = LayerCall(
        hidden_states=tensors[f"{layer}/hidden_states"],
        encoder_hidden_states=encoder,
        image_rotary_emb=(tensors[ROPE_KEYS[0]], tensors[ROPE_KEYS[1]]),
        output=tensors[f"{layer}/out_hidden_states"],
    )
    expected = (call.output,) if encoder is None else (call.output, tensors[f"{layer}/out_encoder_hidden_states"])
    batch, (height, width), text_len = metadata["batch"], metadata["latent_hw"], metadata["text_len"]
    tokens = height * width + (0 if encoder is not None else text_len)
    assert call.hidden_states.shape[:2] == (batch, tokens), f"{layer}: recorded shape {call.hidden_states.shape}"
    _assert_close(layer, _replay(module, call), expected, REL_L2_TOL[dtype_name])


@pytest.mark.parametrize(
    ("batch", "latent_hw", "text_len", "fused"),
    [(1, (5, 7), 11, False), (2, (3, 3), 4, True), (2, (6, 6), 7, False)],
    ids=["b1-35img-11txt", "b2-9img-4txt-fused", "b2-36img-7txt"],
)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_live_layer_parity(dtype_name: str, batch: int, latent_hw: tuple[int, int], text_len: int, fused: bool) -> None:
    model = build_model(DTYPES[dtype_name])
    if fused:
        model.fuse_qkv_projections()
    inputs = transformer_inputs(model, batch, latent_hw, text_len, seed=3)
    calls = capture_attention_calls(model, inputs)
    assert list(calls) == LAYERS
    modules = attention_modules(model)
    for name, call in calls.items():
        module = modules[name]
        stock = call.output if isinstance(call.output, tuple) else (call.output,)
        with torch.no_grad():
            args = (call.encoder_hidden_states,) if call.encoder_hidden_states is not None else ()
            replayed = module.processor(module, call.hidden_states, *args, None, call.image_rotary_emb)
        replayed = replayed if isinstance(replayed, tuple) else (replayed,)
        for got, want in zip(replayed, stock, strict=True):
            assert torch.equal(got, want), f"{name}: the hook did not capture the stock call's inputs"
        _assert_close(name, _replay(module, call), stock, REL_L2_TOL[dtype_name])
