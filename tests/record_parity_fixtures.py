"""Record per-layer inputs and stock outputs of a tiny FLUX.2 transformer.

    python tests/record_parity_fixtures.py --out tests/fixtures

builds `TINY_CONFIG` with seeded random weights, runs one forward with
diffusers' stock processors, and saves, for every attention module, its inputs
and outputs to `flux2_tiny_layers_<dtype>.safetensors` (float32 and bfloat16).
`tests/test_layer_parity.py` replays them through `PictorAttn`.

Keys: `<layer>/hidden_states`, `<layer>/encoder_hidden_states` (double-stream
only), `<layer>/out_hidden_states`, `<layer>/out_encoder_hidden_states`
(double-stream only), and `image_rotary_emb/cos`, `image_rotary_emb/sin`,
stored once since every layer receives the same RoPE (checked while recording).
Metadata (JSON strings): config, seeds, input shape, dtype, layer names and the
SHA-256 of the model weights, so that a changed diffusers/torch initialisation
is detected instead of silently comparing against other weights.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
from dataclasses import dataclass
from pathlib import Path

import diffusers
import torch
from diffusers.models.transformers.transformer_flux2 import Flux2Attention, Flux2ParallelSelfAttention

from pictor_diffusers.testing.models import TINY_CONFIG, build_transformer, transformer_inputs

FIXTURE_DIR = Path(__file__).resolve().parent / "fixtures"
SEED = 0
INPUT_SEED = 1
BATCH = 2
LATENT_HW = (4, 6)
TEXT_LEN = 9
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
ROPE_KEYS = ("image_rotary_emb/cos", "image_rotary_emb/sin")

Rope = tuple[torch.Tensor, torch.Tensor]


@dataclass
class LayerCall:
    """What one attention module received and returned during a stock forward."""

    hidden_states: torch.Tensor
    encoder_hidden_states: torch.Tensor | None
    image_rotary_emb: Rope
    output: torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def fixture_path(dtype_name: str, directory: Path = FIXTURE_DIR) -> Path:
    return directory / f"flux2_tiny_layers_{dtype_name}.safetensors"


def build_model(dtype: torch.dtype, config: dict | None = None, seed: int = SEED) -> torch.nn.Module:
    """The seeded tiny transformer, built in float32 and then cast (as the parity tests do)."""
    return build_transformer(config or TINY_CONFIG, seed=seed).to(dtype)


def attention_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Every FLUX.2 attention module by qualified name, double-stream first."""
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, (Flux2Attention, Flux2ParallelSelfAttention))
    }


def weights_sha256(model: torch.nn.Module) -> str:
    """SHA-256 over names, dtypes, shapes and raw bytes of the state dict."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        digest.update(f"{name}:{flat.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def capture_attention_calls(model: torch.nn.Module, inputs: dict) -> dict[str, LayerCall]:
    """Run one no-grad forward and record every attention module's inputs and output."""
    calls: dict[str, LayerCall] = {}

    def make_hook(name: str, module: torch.nn.Module):
        signature = inspect.signature(module.forward)

        def hook(_module: torch.nn.Module, args: tuple, kwargs: dict, output: object) -> None:
            bound = signature.bind(*args, **kwargs).arguments
            if bound.get("attention_mask") is not None:
                raise AssertionError(f"{name} got an attention_mask; FLUX.2 runs unmasked")
            rope = bound["image_rotary_emb"]
            calls[name] = LayerCall(
                hidden_states=bound["hidden_states"].detach().clone(),
                encoder_hidden_states=_clone(bound.get("encoder_hidden_states")),
                image_rotary_emb=(rope[0].detach().clone(), rope[1].detach().clone()),
                output=tuple(t.detach().clone() for t in output) if isinstance(output, tuple) else output.clone(),
            )

        return hook

    handles = [
        module.register_forward_hook(make_hook(name, module), with_kwargs=True)
        for name, module in attention_modules(model).items()
    ]
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    return calls


def _clone(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.detach().clone()


def layer_tensors(calls: dict[str, LayerCall]) -> dict[str, torch.Tensor]:
    """Flatten the captured calls into safetensors keys (RoPE once, checked identical)."""
    first_rope = next(iter(calls.values())).image_rotary_emb
    tensors = {ROPE_KEYS[0]: first_rope[0].contiguous(), ROPE_KEYS[1]: first_rope[1].contiguous()}
    for name, call in calls.items():
        for got, want in zip(call.image_rotary_emb, first_rope, strict=True):
            if not torch.equal(got, want):
                raise AssertionError(f"{name} received a different RoPE than the first layer")
        tensors[f"{name}/hidden_states"] = call.hidden_states.contiguous()
        if call.encoder_hidden_states is not None:
            tensors[f"{name}/encoder_hidden_states"] = call.encoder_hidden_states.contiguous()
        if isinstance(call.output, tuple):
            tensors[f"{name}/out_hidden_states"] = call.output[0].contiguous()
            tensors[f"{name}/out_encoder_hidden_states"] = call.output[1].contiguous()
        else:
            tensors[f"{name}/out_hidden_states"] = call.output.contiguous()
    return tensors


def record(out_dir: Path) -> list[Path]:
    """Write one fixture per dtype in `DTYPES`; returns the paths."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for dtype_name, dtype in DTYPES.items():
        model = build_model(dtype)
        inputs = transformer_inputs(model, BATCH, LATENT_HW, TEXT_LEN, seed=INPUT_SEED)
        calls = capture_attention_calls(model, inputs)
        metadata = {
            "config": json.dumps(TINY_CONFIG),
            "seed": json.dumps(SEED),
            "input_seed": json.dumps(INPUT_SEED),
            "batch": json.dumps(BATCH),
            "latent_hw": json.dumps(list(LATENT_HW)),
            "text_len": json.dumps(TEXT_LEN),
            "dtype": json.dumps(dtype_name),
            "layers": json.dumps(list(calls)),
            "weights_sha256": json.dumps(weights_sha256(model)),
            "torch_version": json.dumps(torch.__version__),
            "diffusers_version": json.dumps(diffusers.__version__),
        }
        path = fixture_path(dtype_name, out_dir)
        save_file(layer_tensors(calls), str(path), metadata=metadata)
        paths.append(path)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=FIXTURE_DIR, help="output folder (default: tests/fixtures)")
    args = parser.parse_args()
    for path in record(args.out):
        print(f"{path}: {path.stat().st_size / 1024:.1f} KiB")


if __name__ == "__main__":
    main()
