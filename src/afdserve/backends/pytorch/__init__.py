"""The device-agnostic PyTorch backends: what CUDA runs, and any CPU without afdserve's kernels."""
