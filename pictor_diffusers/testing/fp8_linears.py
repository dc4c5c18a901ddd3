"""torchao's fp8 Linear layers on a FLUX transformer, as the flux-fast recipe sets them up.

`quantize_block_linears` swaps every `nn.Linear` weight inside the transformer blocks for a
torchao `Float8Tensor` (e4m3, one scale per output row; activations quantised per row at
run time), leaving the embedders and the final layer in the model dtype. torchao is an
optional extra (`pip install pictor-diffusers[ao]`); `torchao_available` says whether it
imports here.
"""

from __future__ import annotations

import importlib.util

import torch

BLOCK_LISTS = ("transformer_blocks", "single_transformer_blocks")
"""The FLUX.1 / FLUX.2 module lists whose Linear layers are quantised."""


def torchao_available() -> bool:
    """Whether `torchao` can be imported (it is not a dependency of pictor-diffusers)."""
    return importlib.util.find_spec("torchao") is not None


def in_blocks(module: torch.nn.Module, name: str) -> bool:
    """torchao filter: a Linear layer inside one of `BLOCK_LISTS`."""
    return isinstance(module, torch.nn.Linear) and name.split(".", 1)[0] in BLOCK_LISTS


def quantize_block_linears(model: torch.nn.Module, tune_inductor: bool = False) -> int:
    """Quantise `model`'s block Linear layers to fp8 in place; returns how many were swapped.

    `tune_inductor`: let torchao set its recommended inductor options (coordinate-descent
    tuning in every direction) for the whole process; off by default, since they multiply the
    compile time of a FLUX-sized graph and change every later compile in the process.
    Raises ImportError naming the extra when torchao is missing, and RuntimeError on a GPU
    without fp8 matrix units (compute capability below 8.9).
    """
    if not torchao_available():
        raise ImportError("fp8 linears need torchao: pip install 'pictor-diffusers[ao]'")
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    device = next(model.parameters()).device
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        capability = torch.cuda.get_device_capability(device)
        raise RuntimeError(f"fp8 linears need compute capability 8.9 or newer, this GPU has {capability}")
    count = sum(in_blocks(module, name) for name, module in model.named_modules())
    config = Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), set_inductor_config=tune_inductor)
    quantize_(model, config, filter_fn=in_blocks)
    return count
