"""pytest plugin: small local tokenizers in place of the two the FLUX.2 pipeline tests fetch from the hub.

    pytest -p pictor_diffusers.testing.hub_substitutes tests/pipelines/flux2

diffusers' FLUX.2 pipeline tests build their transformers, text encoders and VAEs in code, but load a tokenizer
from the hub; offline, every one of them would fail at set-up. This plugin builds two tokenizers locally (once a
session, in a temporary folder, through `save_pretrained`) and sends `from_pretrained` of those two hub ids there,
for the stock run and the PictorAttn run alike. Every other id or path loads as before.

* `hf-internal-testing/tiny-random-Qwen2VLForConditionalGeneration` (`Qwen2TokenizerFast`, the klein tests): a
  `Qwen2TokenizerFast` of 256 byte-level tokens without merges, plus `<|endoftext|>` (pad, eos), `<|im_start|>`,
  `<|im_end|>`, `<think>`, `</think>`, and a Qwen3-style chat template that takes `enable_thinking`.
* `hf-internal-testing/Mistral-Small-3.1-24B-Instruct-2503-only-processor` (`AutoProcessor`, `Flux2Pipeline`'s
  tests): the tokenizer half of that processor, a byte-level `PreTrainedTokenizerFast` with Mistral's special
  tokens (`<s>`, `</s>`, `<pad>`, `[INST]`, `[SYSTEM_PROMPT]`, `[IMG]`, ...) and a chat template for its
  `[{"type": "text", ...}]` message contents. The real processor is a `PixtralProcessor`, whose image half
  needs torchvision; `Flux2Pipeline` uses only `apply_chat_template` on text, which the tokenizer serves with the
  same arguments (batched conversations, padding, truncation).

All ids fit the test text encoders' vocabularies (32000, 151936); the tokens differ from the hub's, so
exact-value checks against hub-tokenized references could not be expected to hold (the FLUX.2 tests have none).
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path
from typing import Any

import pytest

QWEN_ID = "hf-internal-testing/tiny-random-Qwen2VLForConditionalGeneration"
MISTRAL_ID = "hf-internal-testing/Mistral-Small-3.1-24B-Instruct-2503-only-processor"

QWEN_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] if part['type'] == 'text' %}{{ part['text'] }}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['content'] is string %}{% set parts = [{'type': 'text', 'text': message['content']}] %}"
    "{% else %}{% set parts = message['content'] %}{% endif %}"
    "{% if message['role'] == 'system' %}[SYSTEM_PROMPT]{% elif message['role'] == 'user' %}[INST]{% endif %}"
    "{% for part in parts %}{% if part['type'] == 'text' %}{{ part['text'] }}{% else %}[IMG]{% endif %}{% endfor %}"
    "{% if message['role'] == 'system' %}[/SYSTEM_PROMPT]{% elif message['role'] == 'user' %}[/INST]"
    "{% else %}{{ eos_token }}{% endif %}{% endfor %}"
)
QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
MISTRAL_SPECIALS = (
    "<unk>", "<s>", "</s>", "[INST]", "[/INST]", "<pad>", "[IMG]", "[IMG_BREAK]", "[IMG_END]",
    "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
)  # fmt: skip


def _byte_vocab(specials: tuple[str, ...]) -> dict[str, int]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {token: index for index, token in enumerate(specials)}
    for char in bytes_to_unicode().values():
        vocab.setdefault(char, len(vocab))
    return vocab


def build_qwen(folder: Path) -> Path:
    from transformers import Qwen2TokenizerFast

    tokenizer = Qwen2TokenizerFast(vocab=_byte_vocab(QWEN_SPECIALS), merges=[])
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN_SPECIALS[1:])})
    tokenizer.chat_template = QWEN_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


def build_mistral(folder: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(vocab=_byte_vocab(MISTRAL_SPECIALS), merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(MISTRAL_SPECIALS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    tokenizer.chat_template = MISTRAL_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


_BUILDERS = {QWEN_ID: build_qwen, MISTRAL_ID: build_mistral}
_folders: dict[str, Path] = {}
_originals: list[tuple[type, Any]] = []
_tmp: tempfile.TemporaryDirectory | None = None


def local_path(name: Any) -> Any:
    """The local folder standing in for a substituted hub id; any other name unchanged."""
    global _tmp
    if not isinstance(name, str) or name not in _BUILDERS:
        return name
    if name not in _folders:
        if _tmp is None:
            _tmp = tempfile.TemporaryDirectory(prefix="pictor-hub-substitutes-")
        folder = Path(_tmp.name) / name.replace("/", "--")
        _folders[name] = _BUILDERS[name](folder)
    return str(_folders[name])


def _redirect(cls: type) -> None:
    original = cls.__dict__["from_pretrained"]

    @functools.wraps(original.__func__)
    def from_pretrained(klass: type, pretrained_model_name_or_path: Any, *args: Any, **kwargs: Any) -> Any:
        return original.__func__(klass, local_path(pretrained_model_name_or_path), *args, **kwargs)

    _originals.append((cls, original))
    cls.from_pretrained = classmethod(from_pretrained)


def install() -> None:
    from transformers import AutoProcessor, AutoTokenizer
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    if not _originals:
        for cls in (PreTrainedTokenizerBase, AutoTokenizer, AutoProcessor):
            _redirect(cls)


def uninstall() -> None:
    global _tmp
    while _originals:
        cls, original = _originals.pop()
        cls.from_pretrained = original
    _folders.clear()
    if _tmp is not None:
        _tmp.cleanup()
        _tmp = None


def pytest_configure(config: pytest.Config) -> None:
    install()


def pytest_unconfigure(config: pytest.Config) -> None:
    uninstall()


def pytest_report_header(config: pytest.Config) -> str:
    return f"hub substitutes: local tokenizers for {QWEN_ID} and {MISTRAL_ID}"
