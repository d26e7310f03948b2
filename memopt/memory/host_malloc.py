"""Keep freed host blocks for reuse when the CPU is the run's device, as CUDA's caching allocator keeps device blocks.

A CPU run allocates its activations with glibc's ``malloc``, which maps every block over its mmap threshold
(at most 32 MiB) afresh and unmaps it on ``free``, and gives the heap's free top back to the kernel: the next
step's blocks fault their pages in again, one 4 KiB page at a time, each zeroed by the kernel (~40 ms per
64 MiB here, 1.5 GiB/s). gpt_small at micro-batch 16 x 512 tokens maps 2.75 GiB of such blocks a step (its
MLP's activations and their gradients); on 2 ranks of an AVX2 CPU its step took 24.4-25.0 s that way and
19.8-20.1 s with freed blocks kept (experiments/fixed_budget/LOG.md), peak RSS +4%. PyTorch's CPU tuning
guide gives the same advice (jemalloc or tcmalloc, preloaded); this is glibc's own switch, set in-process.

``keep_freed_blocks`` sets ``M_MMAP_MAX`` to 0 (every block from the heap) and ``M_TRIM_THRESHOLD`` to its
largest value (the heap's free top stays mapped). The resident set then stays near its high-water mark, which
fragments raise a little: torch asks for 64-byte aligned blocks, which the same-size block just freed does not
hold, so the heap settles over a few steps (gpt_small above: +4%, none after the fifth step). Only on a CPU device: on a GPU the host holds long-lived states and pinned
buffers, and its tight budgets (PatrickStar's node) are better served by mmap'd blocks that never fragment
the heap.
"""
from __future__ import annotations

import ctypes
import functools
import sys

M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_MAX = -4
_INT_MAX = 2**31 - 1


@functools.cache  # once a process: the settings stay for its life
def keep_freed_blocks() -> bool:
    """Ask glibc's malloc to keep freed blocks in this process (the module says why). False, and nothing
    changed, where malloc is not glibc's (macOS, musl) or refuses."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library the interpreter runs on
    except (OSError, AttributeError):  # a C library without mallopt
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(M_TRIM_THRESHOLD, _INT_MAX)) and bool(mallopt(M_MMAP_MAX, 0))


def in_effect() -> bool:
    """Whether this process's malloc keeps freed blocks: ``keep_freed_blocks`` succeeded here before. Its settings
    last for the process, so a later run in it with the option off still runs with them (and records so)."""
    return keep_freed_blocks.cache_info().currsize > 0 and keep_freed_blocks()
