"""Large freed blocks kept for reuse in a training process: glibc's malloc told not to map and unmap them each step.

A CPU training step allocates and frees the same large tensors every step: the plain loss's logits, log-probs and
their gradients, four [tokens, V] fp32 tensors of 64 MiB each at 8 x 256 x 8192. Above glibc's largest mmap
threshold (32 MiB) each one is a fresh mapping, faulted in page by page and unmapped when freed: about 65k minor
page faults and a tenth of a tiny step (`benchmarks/train_step.py`, `faults_per_step`). `keep_freed_blocks()` sets,
through `mallopt`, what MALLOC_MMAP_MAX_=0 and MALLOC_TRIM_THRESHOLD_ set when a process starts (mmap off, trimming
off): every block comes from the heap, and freed memory stays there for the next step instead of going back to
the system. A finite trim threshold is not enough: at V = 131072 the four tensors are 1 GiB each, and a 2 GiB
threshold still handed them back and faulted them in again, a million faults a step. This changes where memory
lives, never a value: the same arithmetic on the same numbers (PyTorch aligns every CPU tensor to 64
bytes, whatever address malloc returns).

It acts once per process and only on glibc. A process whose environment already chose is left as it is
(MALLOC_MMAP_MAX_, MALLOC_MMAP_THRESHOLD_ or MALLOC_TRIM_THRESHOLD_ set, GLIBC_TUNABLES naming malloc, or another
allocator preloaded through LD_PRELOAD, such as jemalloc), and STEMLM_MALLOC=system turns it off. The cost: after
a large temporary is freed the process stays resident at its peak (the next step reuses that memory).
"""

from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # mallopt parameters, <malloc.h>
TRIM_NEVER = -1  # mallopt(3): "Setting M_TRIM_THRESHOLD to -1 disables trimming completely"
OPT_OUT = "STEMLM_MALLOC"  # "system": leave glibc's defaults
CHOSEN_BY_ENV = ("MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
PRELOADED_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")  # in LD_PRELOAD: glibc's malloc is not the one in use

_state: str | None = None  # what the first call found, kept for the rest of the process


def keep_freed_blocks() -> str:
    """Apply the setting once (see the module docstring) and say what holds: "kept" (set here), "environment"
    (the environment chose), "system" (STEMLM_MALLOC=system) or "unavailable" (not glibc)."""
    global _state
    if _state is None:
        _state = _apply()
    return _state


def _apply() -> str:
    if os.environ.get(OPT_OUT, "").lower() == "system":
        return "system"
    preload, tunables = os.environ.get("LD_PRELOAD", ""), os.environ.get("GLIBC_TUNABLES", "")
    if (
        any(os.environ.get(name) for name in CHOSEN_BY_ENV)
        or "malloc" in tunables
        or any(name in preload for name in PRELOADED_ALLOCATORS)
    ):
        return "environment"
    libc = _glibc()
    if libc is None:
        return "unavailable"
    # mallopt returns 1 on success; a refused value leaves glibc's defaults in place.
    if libc.mallopt(M_MMAP_MAX, 0) != 1 or libc.mallopt(M_TRIM_THRESHOLD, TRIM_NEVER) != 1:
        return "unavailable"
    return "kept"


def _glibc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        if not hasattr(libc, "gnu_get_libc_version"):  # only glibc has it (musl and others do not)
            return None
    except OSError:
        return None
    libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return libc
