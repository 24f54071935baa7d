"""Whether this host can build what ``torch.compile`` makes for a device: inductor's code needs a compiler.

Inductor writes C++ for a CPU and Triton kernels for a GPU, and builds them
the first time a compiled function runs: the C++ with the host's C++
compiler, each Triton kernel's launcher with a C compiler and Python's
headers. Without them a run would fail at its first step, deep in the
compiler's traceback; ``--compile`` and ``--decode compiled`` ask here when
their role starts and refuse in one line.
"""

from __future__ import annotations

import os
import shutil
import sysconfig

import torch

from ._causal_lm import ModelError

__all__ = ["missing_compiler", "require_compiler"]


def _cpp_compilers() -> list[str]:
    """The C++ compilers inductor tries for CPU code (its ``cpp.cxx`` setting: ``$CXX``, else g++)."""
    from torch._inductor import config

    cxx = config.cpp.cxx
    return [name for name in (cxx if isinstance(cxx, (list, tuple)) else (cxx,)) if name]


def _c_compilers() -> list[str]:
    """The C compilers Triton tries for its kernels' launchers: ``$CC``, else clang, else gcc."""
    named = os.environ.get("CC")
    return [named] if named else ["clang", "gcc"]


def missing_compiler(device: torch.device) -> str | None:
    """Why ``torch.compile``'s code for ``device`` cannot be built on this host, or None when it can."""
    if device.type == "cuda":
        compilers = _c_compilers()
        if not any(shutil.which(name) for name in compilers):
            return f"Triton's kernels need a C compiler ({' or '.join(compilers)}; $CC names another): none found"
        headers = sysconfig.get_paths()["include"]
        if not os.path.exists(os.path.join(headers, "Python.h")):
            return f"Triton's kernels need Python's headers (Python.h in {headers}; the python3-dev package)"
        return None
    compilers = _cpp_compilers()
    if not any(shutil.which(name) for name in compilers):
        return f"inductor's CPU code needs a C++ compiler ({' or '.join(compilers)}; $CXX names another): none found"
    return None


def require_compiler(device: torch.device, flag: str) -> None:
    """Refuse ``flag`` (the option that compiles) in one line where :func:`missing_compiler` finds no compiler."""
    why = missing_compiler(device)
    if why is not None:
        raise ModelError(
            f"{flag} on {device}: {why}; install one (e.g. apt install build-essential) or leave {flag} out"
        )
