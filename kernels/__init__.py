"""Triton kernels for the paged KV cache (importable as minisgl.kernels). See docs/kernels.md."""
