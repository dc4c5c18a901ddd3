"""Per-model adapters: how `PictorAttn` runs each attention module type.

One file per module type registers its `Adapter` (`base.register_adapter`);
importing this package registers them all. Adding a model is one adapter file
here, imported below, plus its tests.
"""

from . import attention, flux1, flux2_double, flux2_single  # noqa: F401  (importing registers them)
from .base import ADAPTERS, Adapter, Attend, Call, KvArgs, adapter_for, register_adapter

__all__ = ["ADAPTERS", "Adapter", "Attend", "Call", "KvArgs", "adapter_for", "register_adapter"]
