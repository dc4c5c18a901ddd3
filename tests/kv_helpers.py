"""FLUX.2-klein's reference-image KV cache steps on a tiny transformer, shared by the KV-cache tests (CPU and CUDA).

Shapes are odd on purpose (7 text tokens, 3x5 image, 2x3 reference).
"""

from __future__ import annotations

import torch

from pictor_diffusers.testing.models import image_ids, transformer_inputs

TEXT_LEN, IMAGE_HW, REF_HW = 7, (3, 5), (2, 3)


def kv_steps(model: torch.nn.Module, batch: int, cache: object = None) -> tuple[torch.Tensor, torch.Tensor, object]:
    """(extract output, cached output, cache) of one extract and one cached step on the model's device; `cache`,
    if given, replaces the extract step's cache for the cached step."""
    inputs = transformer_inputs(model, batch, IMAGE_HW, TEXT_LEN, seed=3)
    generator = torch.Generator().manual_seed(4)
    ref_len = REF_HW[0] * REF_HW[1]
    reference = torch.randn(batch, ref_len, model.config.in_channels, generator=generator)
    ref_ids = image_ids(*REF_HW)
    ref_ids[..., 0] = 10  # the reference image's time coordinate, as the KV pipeline sets it
    extract = {
        **inputs,
        "hidden_states": torch.cat([reference.to(inputs["hidden_states"]), inputs["hidden_states"]], dim=1),
        "img_ids": torch.cat([ref_ids.to(inputs["img_ids"].device), inputs["img_ids"]], dim=0),
    }
    with torch.no_grad():
        extracted, made = model(**extract, kv_cache_mode="extract", num_ref_tokens=ref_len, ref_fixed_timestep=0.0)
        cached = model(**inputs, kv_cache=cache or made, kv_cache_mode="cached")[0]
    return extracted, cached, made
