"""The diffusers integration: `PictorAttn` and its per-model adapters, the precision table, the attention
backends on diffusers' dispatcher, FLUX.2-klein's KV cache and context parallelism."""
