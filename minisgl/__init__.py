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
# shadows the installed copy, and a `.pth` editable install maps nothing. Then a finder maps
# those two names (and only those) onto the checkout's folders.
_here = os.path.dirname(os.path.abspath(__file__))
_checkout = os.path.dirname(_here)
if not os.path.isdir(os.path.join(_here, "kernels")) and os.path.isfile(os.path.join(_checkout, "kernels", "cpu_build.py")):
    import importlib.abc
    import importlib.util
    import sys

    class _CheckoutFolders(importlib.abc.MetaPathFinder):
        folders = {f"minisgl.{name}": os.path.join(_checkout, name) for name in ("kernels", "web")}

        def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
            folder = self.folders.get(fullname)
            if folder is None:
                return None
            init = os.path.join(folder, "__init__.py")
            return importlib.util.spec_from_file_location(fullname, init, submodule_search_locations=[folder])

    # first: an editable install of another checkout (a git worktree beside it) maps these names
    # to its own folders, and this package then drew the other checkout's pages and kernels
    sys.meta_path.insert(0, _CheckoutFolders())


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
