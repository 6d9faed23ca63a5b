"""CUDA C++ kernels, built at first use with torch.utils.cpp_extension (sources in csrc/)."""
