"""Triton kernels (the CUDA path) and C kernels for the CPU (csrc/, built by cpu_build.py),
importable as minisgl.kernels. See docs/kernels.md."""
