"""Build and load the C kernels in kernels/csrc/ for the CPU path (ctypes, no torch headers).

Where it sits: under the CPU attention backend. `load_cpu_library("decode_attention_cpu")`
compiles `csrc/decode_attention_cpu.c` once per machine with the system C compiler into
`~/.cache/minisgl/kernels/` (`$XDG_CACHE_HOME` or `$MINISGL_CACHE_DIR` move it) and returns the loaded
library; later calls, and later processes, reuse the cached file.

Why plain C through ctypes instead of a torch C++ extension: the kernel only needs data
pointers and sizes, and a C file builds in well under a second, where a torch extension
compiles torch's headers for a minute. `-march=native` makes the build match this CPU's
vector units (AVX-512 here), so the cache key includes the CPU model and the compiler.
`-fopenmp` links libgomp by its soname, libgomp.so.1; torch's CPU wheel loads its own copy
under that soname first, so the kernel shares torch's OpenMP thread pool instead of
starting a second one that would fight it for the cores.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import List, Optional

CSRC_DIR = Path(__file__).resolve().parent / "csrc"
# Every C kernel the cpu attention backend uses (csrc/<name>.c), built together at startup.
CPU_KERNELS = ("decode_attention_cpu", "fused_add_rmsnorm_cpu", "rotary_embedding_cpu", "silu_and_mul_cpu")
# -fno-math-errno, -fno-trapping-math, -fno-signed-zeros and -fassociative-math let GCC
# vectorize the running max and reorder the sums (the decode kernel: 2.1 -> 1.6 ms per layer
# at batch 64); results stay within 1e-6 of the references. Not -ffast-math: its
# finite-math-only rule would let the compiler drop the -INFINITY bookkeeping.
CFLAGS = [
    "-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros", "-fassociative-math",
    "-fopenmp", "-shared", "-fPIC",
]  # fmt: skip


class CpuKernelUnavailable(RuntimeError):
    """The C kernels cannot be built here (no compiler, or the build failed)."""


def find_compiler() -> Optional[List[str]]:
    """The compiler command: $CC if set (split like a shell would: "ccache gcc"), else the first
    of cc, gcc, clang on PATH. None if there is none."""
    if os.environ.get("CC"):
        try:
            words = shlex.split(os.environ["CC"])
        except ValueError as e:  # an unbalanced quote
            raise CpuKernelUnavailable(f"$CC={os.environ['CC']!r} cannot be read as a command: {e}") from e
        path = shutil.which(words[0]) if words else None
        return [path, *words[1:]] if path else None
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return [path]
    return None


def _no_compiler_message() -> str:
    if os.environ.get("CC"):
        return f"$CC={os.environ['CC']!r} is not a command on PATH: fix $CC, or use --attention-backend torch"
    return "no C compiler on PATH (looked for cc, gcc, clang): install one (apt-get install -y gcc) or use --attention-backend torch"


def cache_dir() -> Path:
    """$MINISGL_CACHE_DIR/kernels, else $XDG_CACHE_HOME/minisgl/kernels (~/.cache by default, as
    pip, torch and Hugging Face place theirs)."""
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    root = os.environ.get("MINISGL_CACHE_DIR") or os.path.join(xdg, "minisgl")
    return Path(root) / "kernels"


def _cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str:
    """What -march=native compiled for: the first CPU's block of /proc/cpuinfo, x86's
    "model name" and "flags" or aarch64's implementer, part, variant and "Features" (an
    aarch64 block has no "model name": keyed on "aarch64" alone, a build made on a CPU with
    SVE would be loaded on one without, a SIGILL in the first decode step)."""
    keys = ("model name", "flags", "CPU implementer", "CPU part", "CPU variant", "Features")
    found = {}
    try:
        with open(cpuinfo) as f:
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key in keys and key not in found:
                    found[key] = line
                if not line.strip() and found:
                    break  # the end of the first processor's block
    except OSError:
        pass
    return "".join(found.values()) or platform.processor() or platform.machine()


def _cache_key(source: bytes, compiler: List[str]) -> str:
    version = subprocess.run([*compiler, "--version"], capture_output=True, text=True).stdout
    h = hashlib.sha256()
    headers = b"".join(p.read_bytes() for p in sorted(CSRC_DIR.glob("*.h")))  # included by the sources
    command = " ".join([*compiler[1:], *CFLAGS])  # $CC's own arguments build differently too
    for part in (source, headers, command.encode(), version.encode(), _cpu_model().encode()):
        h.update(part)
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def load_cpu_library(name: str) -> ctypes.CDLL:
    """Compile `csrc/<name>.c` if its cached build is missing, load it, and return it.

    Raises CpuKernelUnavailable with the compiler's message if it cannot be built.
    """
    source_path = CSRC_DIR / f"{name}.c"
    compiler = find_compiler()
    if compiler is None:
        raise CpuKernelUnavailable(_no_compiler_message())
    source = source_path.read_bytes()
    target = cache_dir() / f"{name}-{_cache_key(source, compiler)}.so"
    if not target.exists():
        _build(compiler, source_path, target)
    # torch first: its libgomp.so.1 is then the one the kernel binds to (one OpenMP runtime)
    importlib.import_module("torch")
    try:
        return ctypes.CDLL(str(target))
    except OSError:
        pass  # a damaged cached file (a crash mid-write, a bad copy): build it again, once
    _build(compiler, source_path, target)
    try:
        return ctypes.CDLL(str(target))
    except OSError as e:  # e.g. a libgomp or libc the build linked against is missing here
        raise CpuKernelUnavailable(
            f"loading {target} failed even after rebuilding it: {e}; use --attention-backend torch"
        ) from e


def _build(compiler: List[str], source_path: Path, target: Path) -> None:
    """Compile one kernel into `target`, atomically; CpuKernelUnavailable with the reason if it cannot."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # Build to a private name, then rename: concurrent processes never load a half-written file.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
    except OSError as e:
        raise CpuKernelUnavailable(
            f"cannot write the kernel cache {target.parent} ({e}): set MINISGL_CACHE_DIR to a writable "
            "directory or use --attention-backend torch"
        ) from e
    cmd: List[str] = [*compiler, *CFLAGS, str(source_path), "-o", tmp]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise CpuKernelUnavailable(
                f"building {source_path.name} failed ({' '.join(cmd)}):\n{result.stderr.strip()}\n"
                "use --attention-backend torch"
            )
        # mkstemp made it 0600: readable by everyone, as a build in a shared cache must be
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)
        with open(tmp, "rb") as f:  # on disk before the rename, so a crash cannot leave it empty
            os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):  # failed or interrupted (Ctrl-C): no stray temp file in the cache
            os.unlink(tmp)


def load_all_cpu_kernels() -> None:
    """Build (or load) every kernel of CPU_KERNELS: a missing compiler fails here, at startup."""
    for name in CPU_KERNELS:
        load_cpu_library(name)
