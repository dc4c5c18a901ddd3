"""The public ops: `attention()` and `windowed_attention()` (their checks and `torch.ops.pictor.*` registration),
the fused QK-norm / RoPE prologue, and the pure-torch twins of the kernels that serve CPU tensors."""
