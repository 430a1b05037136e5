"""Shared pytest setup.

- Triton kernels run on CPU through the interpreter: TRITON_INTERPRET must be set
  before any module with @triton.jit is imported, so it is set here, first.
- Tiny random-weight models (minisgl.test_utils.make_tiny_model) are built once per
  session and shared: `tiny_model` (Qwen3) and `tiny_model_factory(arch, **overrides)`.
- `one_thread`: torch on one thread for a module of tiny-model tests
  (`pytestmark = pytest.mark.usefixtures("one_thread")`).
- Hypothesis: with $CI set (.ci/run sets it) the property tests draw the same examples on
  every run, so whether a change lands never depends on the draw; a developer's run draws
  new ones each time (and replays its failures from .hypothesis/).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from typing import Any, Callable, Dict, Iterator, Tuple

import pytest
from hypothesis import settings

settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """Build (once per distinct arguments) a tiny model directory and return its path."""
    from minisgl.test_utils import make_tiny_model

    cache: Dict[Tuple[Any, ...], str] = {}

    def make(arch: str = "qwen3", **overrides: Any) -> str:
        key = (arch, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in cache:
            path = tmp_path_factory.mktemp(f"tiny-{arch}")
            cache[key] = make_tiny_model(str(path), arch, **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_model(tiny_model_factory: Callable[..., str]) -> str:
    return tiny_model_factory("qwen3")


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Tiny models run faster on one thread, and on a loaded machine OpenMP threads that spin
    waiting for each other slowed a 32-token generate from 0.2 s to 12 s."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
