"""The CUDA host side: the kernel registry and the choice among its rows, the plan of one call, its launch,
the driver runtime, NVRTC and the on-disk cubin cache."""
