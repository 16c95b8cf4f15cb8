"""Keep freed big blocks in the process heap, so each step's large tensors reuse warm pages.

glibc serves blocks above a (dynamic, at most 32 MiB) threshold with a fresh ``mmap`` and gives
them back on free, so every new activation or decoded frame of tens of MiB pays a page fault per
4 KiB page: bench_codec measured the int8 decode of a 40 MiB tensor at 1.4 GB/s that way and
10.8 GB/s with the blocks kept. A training stage allocates the same sizes every micro-batch, so
the fellow raises both thresholds once; the cost is up to 1 GiB of freed memory the process keeps
instead of returning to the system.

Stages run in threads, and glibc gives other threads heaps of their own capped at 64 MiB, from
which a block of more than half that is never served: it goes to ``mmap`` whatever the
threshold. So the arena count is also set to one (all threads share the main heap; the fellow
has a handful of threads, so the shared lock costs little). That must happen before the threads
first allocate: the fellow daemon calls this first thing, and every stage runner again.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
KEEP_BYTES = 1 << 30

_done: bool | None = None


def keep_large_blocks() -> bool:
    """One heap for all threads, and raised mmap and trim thresholds (once per process).
    False when not glibc."""
    global _done
    if _done is None:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _done = bool(libc.mallopt(_M_ARENA_MAX, 1)) and \
                bool(libc.mallopt(_M_MMAP_THRESHOLD, KEEP_BYTES)) and \
                bool(libc.mallopt(_M_TRIM_THRESHOLD, KEEP_BYTES))
        except (OSError, AttributeError):
            _done = False
    return _done
