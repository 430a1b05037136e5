"""minisgl: a compact, teachable LLM serving engine built the way SGLang is built.

    from minisgl import Engine, SamplingParams, ServerArgs

Imports are lazy: `import minisgl` loads neither torch nor transformers; the first use
of `Engine` does.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers see; at run time __getattr__ imports on first use
    from minisgl.entrypoints.engine import Engine
    from minisgl.sampling.sampling_params import SamplingParams
    from minisgl.server_args import ServerArgs

__all__ = ["Engine", "SamplingParams", "ServerArgs"]

# kernels/ and web/ sit beside minisgl/ in the repository (DESIGN.md) and install as
# minisgl.kernels and minisgl.web through pyproject's package-dir map. Run from a checkout
# that map is not in play: from the repo root after a plain `pip install .` this folder
# shadows the installed copy, and a `.pth` editable install maps nothing. Then the checkout
# itself is searched for them (it holds no other package).
_checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if not os.path.isdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels")) and os.path.isfile(
    os.path.join(_checkout, "kernels", "cpu_build.py")
):
    __path__.append(_checkout)


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
