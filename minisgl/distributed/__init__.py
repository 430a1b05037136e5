"""Tensor parallelism: the per-rank group object and its collectives (parallel_state.py)."""

from minisgl.distributed.parallel_state import GroupCoordinator, init_tensor_parallel_group

__all__ = ["GroupCoordinator", "init_tensor_parallel_group"]
