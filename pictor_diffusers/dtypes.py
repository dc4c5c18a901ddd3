"""The one table of the dtypes pictor computes in, shared by the ops, the launch path and the registry.

`DTYPES`: name -> torch dtype; `DTYPE_NAMES`: the reverse; `HALF_DTYPES`: the 16-bit names;
`KINDS`: name -> the kind number the kernels' `*_KIND` defines take (0 f32, 1 bf16, 2 f16).
"""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
HALF_DTYPES = ("bfloat16", "float16")
KINDS = {"float32": 0, "bfloat16": 1, "float16": 2}
COMPUTE_DTYPES = tuple(DTYPES.values())
"""float32, bfloat16, float16: what q, k, v and the outputs may be."""
