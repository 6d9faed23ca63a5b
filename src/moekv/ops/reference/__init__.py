"""Pure-PyTorch reference implementations of moekv's ops (CPU and CUDA). The oracle for kernels."""
