"""The fp8-linear helper's choices, on CPU: which layers it names, and its errors without torchao."""

from __future__ import annotations

import pytest
import torch

from pictor_diffusers.testing import fp8_linears
from pictor_diffusers.testing.models import TINY_CONFIG, build_transformer


@pytest.mark.parametrize("config", [TINY_CONFIG, {**TINY_CONFIG, "num_layers": 1, "num_single_layers": 3}])
def test_only_the_blocks_linears_are_chosen(config: dict) -> None:
    model = build_transformer(config)
    chosen = [name for name, module in model.named_modules() if fp8_linears.in_blocks(module, name)]
    linears = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    assert chosen and set(chosen) < set(linears)
    assert all(name.split(".")[0] in fp8_linears.BLOCK_LISTS for name in chosen)
    assert not any(name.startswith(("x_embedder", "proj_out", "time_guidance_embed")) for name in chosen)
    per_block = {name.split(".")[0] for name in chosen}
    assert per_block == {"transformer_blocks", "single_transformer_blocks"}


def test_missing_torchao_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fp8_linears, "torchao_available", lambda: False)
    with pytest.raises(ImportError, match=r"pictor-diffusers\[ao\]"):
        fp8_linears.quantize_block_linears(build_transformer())
