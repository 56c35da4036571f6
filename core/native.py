"""Small C kernels compiled on first use for the machine they run on, and loaded with ctypes.

Why: a few hot loops (a decode step's paged attention, an i-quant's neighbour search) are
branchy or gather-heavy work that torch and numpy can only vectorise by doing several times the
arithmetic. Each kernel is one C file beside its Python module, built by the machine's C compiler
(``cc``, or ``$CC``) for this CPU (``-march=native``) into ``~/.cache/quantbench/kernels``, under a
name that hashes the source and the headers beside it, the flags, the compiler and the CPU, so a
changed source or another machine never loads a stale binary. No Python or torch headers are needed, so a build takes about
a second. Where no compiler works, ``load`` warns once and returns None, and the caller's torch or
numpy path runs: the results are the same, only slower.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
import warnings
from functools import cache
from pathlib import Path

import numpy as np

BASE_FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-std=gnu11")


def _cpu_name() -> str:
    """The CPU's model name and instruction-set flags (the first core's), which ``-march=native``
    compiles for: two VMs of one model can expose different flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return "\n".join(next((line for line in lines if line.startswith(key)), "") for key in ("model name", "flags"))


@cache
def load(source: Path, flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The kernel built from ``source`` with ``BASE_FLAGS`` and ``flags``, or None (with a warning
    naming the kernel) where it cannot be built or loaded here."""
    compiler = os.environ.get("CC", "cc")
    all_flags = [*BASE_FLAGS, *flags]
    try:
        code = source.read_bytes() + b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
        key = hashlib.sha256(b"\0".join([code, " ".join(all_flags).encode(), compiler.encode(),
                                         platform.machine().encode(), _cpu_name().encode()])).hexdigest()[:16]
        folder = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "quantbench" / "kernels"
        built = folder / f"{source.stem}-{key}.so"
        if not built.exists():
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=folder) as work:  # built aside, then renamed: never half a file
                out = Path(work) / built.name
                subprocess.run([compiler, *all_flags, str(source), "-o", str(out), "-lm"], check=True,
                               capture_output=True, text=True, timeout=120)
                os.replace(out, built)
        return ctypes.CDLL(str(built))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", None) or e
        warnings.warn(f"the C kernel {source.name} did not build ({str(detail).strip()[:300]}); the slower "
                      f"torch/numpy path runs", stacklevel=3)
        return None


def bind(source: Path, flags: tuple[str, ...], signatures: dict[str, list]) -> ctypes.CDLL | None:
    """``load``, with each named function's argument types set (they return nothing), or None."""
    lib = load(source, flags)
    if lib is not None:
        for name, argtypes in signatures.items():
            function = getattr(lib, name)
            function.argtypes, function.restype = argtypes, None
    return lib


def pointer(a: np.ndarray) -> ctypes.c_void_p:
    """A kernel's argument for a C-contiguous numpy array: a pointer to its data that keeps the
    array alive through the call (a bare address lets a temporary be freed before the kernel reads
    it, and its memory handed to the next argument)."""
    if not a.flags.c_contiguous:
        raise ValueError("C kernels read C-contiguous arrays")
    return a.ctypes.data_as(ctypes.c_void_p)
