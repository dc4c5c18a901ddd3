"""pytest plugin: `PictorAttn` in every FLUX.2, SD3 / SD3.5 and CogVideoX attention that diffusers' own tests build.

    pytest -p pictor_diffusers.testing.diffusers_plugin tests/models/transformers/test_models_transformer_flux2.py

(run from a checkout of diffusers' tests; `tests/diffusers_suite/run_diffusers_tests.py` runs them with and
without it and compares). `PICTOR_DIFFUSERS_PRECISION` picks `PictorAttn(precision=...)`, default "fp32".

Which processors it replaces (`STOCK_PROCESSORS`): diffusers' own FLUX.2 processors, that is the
`_default_processor_cls` and `_available_processors` of `Flux2Attention` and `Flux2ParallelSelfAttention` (the
stock processors and `Flux2KleinKVPipeline`'s KV processors), and on the generic `Attention` the processors of
SD3 / SD3.5 and CogVideoX (`JointAttnProcessor2_0`, `CogVideoXAttnProcessor2_0` and their fused variants). A
processor of any other type that a test sets on purpose (say the generic `AttnProcessor` of diffusers' processor
get/set tests) is left in place, as is a `PictorAttn` already set.

Where, so that no path round it is left:

* `set_processor` of the three module classes: every other way in goes through it (module `__init__`, so also
  `from_pretrained` and pipeline loading; `set_attn_processor`, `set_default_attn_processor`,
  `fuse_qkv_projections`; `Flux2KleinKVPipeline.__init__`'s KV processors; a test's own
  `block.attn.set_processor(...)`);
* `forward` of the three classes, for a processor assigned to `.processor` directly: the stock one is replaced
  before the call. Every replacement carries over the old processor's `_attention_backend` and
  `_parallel_config`.

It hides nothing: PictorAttn's errors propagate, no test is skipped or altered, and each test's report
carries two counts (junit `<properties>`): `pictor_attn_calls`, the attention calls of those classes that
PictorAttn served, and `stock_calls`, any that one of the replaced stock processors served (0 under this plugin;
the comparison script flags a test where it is not).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import pytest
import torch
from diffusers.models.attention_processor import Attention
from diffusers.models.transformers.transformer_flux2 import Flux2Attention, Flux2ParallelSelfAttention

from pictor_diffusers import PictorAttn
from pictor_diffusers.testing import bypass_models

PRECISION_ENV = "PICTOR_DIFFUSERS_PRECISION"
STOCK_PROCESSORS: dict[type, tuple[type, ...]] = {
    **{
        cls: (cls._default_processor_cls, *cls._available_processors)
        for cls in (Flux2Attention, Flux2ParallelSelfAttention)
    },
    Attention: bypass_models.STOCK_PROCESSORS,
}
"""Module class -> diffusers' own processors of it that the plugin replaces."""
_CARRIED = ("_attention_backend", "_parallel_config")
_counts = {"pictor_attn_calls": 0, "stock_calls": 0, "replaced": 0}
_installed: dict[type, dict[str, Any]] = {}


def precision() -> str:
    return os.environ.get(PRECISION_ENV, "fp32")


def stock_processor_types(module_class: type) -> tuple[type, ...]:
    """diffusers' own processors of an attention module class that PictorAttn replaces."""
    return STOCK_PROCESSORS[module_class]


def pictor_for(processor: Any, module_class: type) -> Any:
    """The processor to install in place of `processor`: PictorAttn for a stock one (or None)."""
    if processor is not None and not isinstance(processor, stock_processor_types(module_class)):
        return processor
    replacement = PictorAttn(precision=precision())
    for name in _CARRIED:
        if name in getattr(processor, "__dict__", {}):
            setattr(replacement, name, processor.__dict__[name])
    _counts["replaced"] += 1
    return replacement


def _wrap(module_class: type) -> None:
    original_set = module_class.set_processor
    original_forward = module_class.forward

    @functools.wraps(original_set)
    def set_processor(self: torch.nn.Module, processor: Any) -> None:
        original_set(self, pictor_for(processor, module_class))

    @functools.wraps(original_forward)
    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        processor = getattr(self, "processor", None)
        if isinstance(processor, stock_processor_types(module_class)):
            set_processor(self, processor)  # assigned to .processor directly, past set_processor
            processor = self.processor
        if not torch.compiler.is_compiling():
            key = "pictor_attn_calls" if isinstance(processor, PictorAttn) else None
            if isinstance(processor, stock_processor_types(module_class)):
                key = "stock_calls"
            if key is not None:
                _counts[key] += 1
        return original_forward(self, *args, **kwargs)

    _installed[module_class] = {name: module_class.__dict__.get(name) for name in ("set_processor", "forward")}
    module_class.set_processor = set_processor
    module_class.forward = forward


def install() -> None:
    """Patch the attention classes of `STOCK_PROCESSORS` (idempotent)."""
    PictorAttn(precision=precision())  # an unknown precision fails here, once, not in every test
    for module_class in STOCK_PROCESSORS:
        if module_class not in _installed:
            _wrap(module_class)


def uninstall() -> None:
    for module_class, originals in _installed.items():
        for name, original in originals.items():
            if original is None:
                delattr(module_class, name)  # inherited: the class had none of its own
            else:
                setattr(module_class, name, original)
    _installed.clear()


def pytest_configure(config: pytest.Config) -> None:
    install()


def pytest_unconfigure(config: pytest.Config) -> None:
    uninstall()


def pytest_report_header(config: pytest.Config) -> str:
    return (
        f"pictor_diffusers plugin: PictorAttn(precision={precision()!r}) in every FLUX.2, SD3 and CogVideoX attention"
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    for key in _counts:
        _counts[key] = 0
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    report = yield
    if report.when == "teardown":
        item.user_properties.extend((key, _counts[key]) for key in ("pictor_attn_calls", "stock_calls"))
        report.user_properties = list(item.user_properties)
    return report
