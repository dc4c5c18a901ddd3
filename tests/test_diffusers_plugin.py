"""The diffusers-suite tools (CPU): the pytest plugin that puts PictorAttn in every FLUX.2, SD3 and CogVideoX
attention, the hub tokenizer substitutes, and the comparison of the stock and PictorAttn runs
(`tests/diffusers_suite`)."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.attention_processor import AttnProcessor, CogVideoXAttnProcessor2_0
from diffusers.models.transformers.transformer_flux2 import Flux2AttnProcessor
from suite_runner import load_runner

from pictor_diffusers import PictorAttn
from pictor_diffusers.testing import diffusers_plugin
from pictor_diffusers.testing.bypass_models import (
    TINY_COGVIDEOX_ROPE_CONFIG,
    TINY_SD35_CONFIG,
    build_cogvideox,
    build_sd3,
    cogvideox_inputs,
    sd3_inputs,
)
from pictor_diffusers.testing.models import (
    build_transformer,
    set_kv_processors,
    set_stock_processors,
    transformer_inputs,
)


@pytest.fixture
def plugin():
    diffusers_plugin.install()
    yield diffusers_plugin
    diffusers_plugin.uninstall()


def processor_types(model: torch.nn.Module) -> set[type]:
    return {type(processor) for processor in model.attn_processors.values()}


def test_every_way_in_ends_at_pictor(plugin) -> None:
    model = build_transformer()
    assert processor_types(model) == {PictorAttn}  # module __init__
    set_kv_processors(model)  # Flux2KleinKVPipeline's block.attn.set_processor(...)
    assert processor_types(model) == {PictorAttn}
    set_stock_processors(model)  # set_attn_processor with a dict
    assert processor_types(model) == {PictorAttn}
    model.transformer_blocks[0].attn.processor = Flux2AttnProcessor()  # past set_processor: caught at forward
    plugin._counts.update(pictor_attn_calls=0, stock_calls=0)
    with torch.no_grad():
        model(**transformer_inputs(model, 1, (2, 3), 5))
    assert processor_types(model) == {PictorAttn}
    assert plugin._counts["pictor_attn_calls"] == len(model.attn_processors)
    assert plugin._counts["stock_calls"] == 0


def test_sd3_and_cogvideox_ways_in_end_at_pictor(plugin) -> None:
    sd3 = build_sd3(TINY_SD35_CONFIG)
    assert processor_types(sd3) == {PictorAttn}  # module __init__ (JointAttnProcessor2_0)
    sd3.fuse_qkv_projections()  # set_attn_processor(FusedJointAttnProcessor2_0())
    assert processor_types(sd3) == {PictorAttn}
    cogvideox = build_cogvideox(TINY_COGVIDEOX_ROPE_CONFIG)
    assert processor_types(cogvideox) == {PictorAttn}
    cogvideox.transformer_blocks[0].attn1.processor = CogVideoXAttnProcessor2_0()  # past set_processor
    plugin._counts.update(pictor_attn_calls=0, stock_calls=0)
    with torch.no_grad():
        sd3(**sd3_inputs(sd3, 1, (4, 4), 3))
        cogvideox(**cogvideox_inputs(cogvideox, 1, 2, (4, 4), 7))
    assert processor_types(cogvideox) == {PictorAttn}
    served = len(sd3.attn_processors) + len(cogvideox.attn_processors)
    assert plugin._counts["pictor_attn_calls"] == served and plugin._counts["stock_calls"] == 0
    attn = cogvideox.transformer_blocks[1].attn1
    attn.set_processor(AttnProcessor())  # not a processor of these models: kept
    assert type(attn.processor) is AttnProcessor


def test_other_processors_and_settings_kept(plugin, monkeypatch) -> None:
    model = build_transformer()
    attn = model.transformer_blocks[0].attn
    mine = AttnProcessor()  # not a FLUX.2 processor: a test that sets it means it
    attn.set_processor(mine)
    assert attn.get_processor() is mine
    chosen = PictorAttn(precision="auto")
    attn.set_processor(chosen)
    assert attn.get_processor() is chosen
    stock = Flux2AttnProcessor()
    stock._attention_backend = "native"
    attn.set_processor(stock)
    assert attn.processor._attention_backend == "native"
    monkeypatch.setenv(diffusers_plugin.PRECISION_ENV, "bf16")
    attn.set_processor(None)
    assert attn.processor.precision == "bf16"


def test_uninstall_restores_stock() -> None:
    diffusers_plugin.install()
    diffusers_plugin.uninstall()
    assert processor_types(build_transformer()) != {PictorAttn}


def test_hub_substitutes_offline(monkeypatch) -> None:
    pytest.importorskip("transformers")
    from transformers import AutoProcessor, Qwen2TokenizerFast

    from pictor_diffusers.testing import hub_substitutes

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub_substitutes.install()
    try:
        qwen = Qwen2TokenizerFast.from_pretrained(hub_substitutes.QWEN_ID)
        text = qwen.apply_chat_template(
            [{"role": "user", "content": "a dog"}], tokenize=False, add_generation_prompt=True, enable_thinking=False
        )
        assert qwen(text, padding="max_length", max_length=64)["input_ids"][:1] == [
            qwen.convert_tokens_to_ids("<|im_start|>")
        ]
        mistral = AutoProcessor.from_pretrained(hub_substitutes.MISTRAL_ID)
        conversation = [{"role": "user", "content": [{"type": "text", "text": "a dog"}]}]
        batch = mistral.apply_chat_template(
            [conversation] * 2, tokenize=True, return_dict=True, return_tensors="pt",
            padding="max_length", truncation=True, max_length=8,
        )  # fmt: skip
        assert tuple(batch["input_ids"].shape) == (2, 8)
        assert int(batch["input_ids"].max()) < 32000
    finally:
        hub_substitutes.uninstall()


def test_runner_compares_runs() -> None:
    runner = load_runner()

    def case(outcome: str, calls: int = 1) -> dict:
        return {"outcome": outcome, "message": outcome, "properties": {"pictor_attn_calls": str(calls)}}

    stock = {"a::T::test_x": case("passed"), "a::TestTraining::test_y": case("passed"), "a::T::test_z": case("failed")}
    pictor = {"a::T::test_x": case("failed"), "a::TestTraining::test_y": case("failed"), "a::T::test_z": case("passed")}
    result = runner.compare(stock, pictor)
    assert [r["test"] for r in result["regressions"]] == ["a::T::test_x"]
    assert [r["test"] for r in result["training_regressions"]] == ["a::TestTraining::test_y"]
    assert [r["test"] for r in result["fixed"]] == ["a::T::test_z"]


def test_runner_without_diffusers_tests(tmp_path, capsys) -> None:
    assert load_runner().main(["--diffusers-tests", str(tmp_path)]) == 2
    assert "diffusers' tests are not at" in capsys.readouterr().err
