"""minisgl: a compact, teachable LLM serving engine built the way SGLang is built.

    from minisgl import Engine, SamplingParams, ServerArgs

Imports are lazy: `import minisgl` loads neither torch nor transformers; the first use
of `Engine` does.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Engine", "SamplingParams", "ServerArgs"]


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from minisgl.entrypoints.engine import Engine

        return Engine
    if name == "SamplingParams":
        from minisgl.sampling.sampling_params import SamplingParams

        return SamplingParams
    if name == "ServerArgs":
        from minisgl.server_args import ServerArgs

        return ServerArgs
    raise AttributeError(f"module 'minisgl' has no attribute {name!r}")
