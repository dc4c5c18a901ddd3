"""Test and benchmark support, importable without path edits.

* `references`: random q/k/v, the float64 attention reference, FLOP count, error metrics;
* `models`: randomly initialised FLUX.2 and FLUX.1 transformers (tiny and production-shaped) and inputs;
* `bypass_models`: tiny SD3 / SD3.5 and CogVideoX transformers and inputs (CogVideoX's RoPE tables included);
* `timing`: CUDA-event medians.

Nothing here is needed to use the plugin; it ships so that the tests and the
benchmarks of an installed wheel run the same code.
"""
