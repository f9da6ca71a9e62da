"""What a model costs in memory: its artifact files before it loads, and what its build adds to
the process, measured.

The measure is taken twice around a build: the process's resident set (``/proc/self/statm``)
and, where the C library is glibc, the bytes malloc has handed out (``mallinfo2``: its arenas
in use plus the chunks it mapped). A build's cost is the larger growth of the two. The resident
set alone under-reads a model loaded where another was just unloaded (the freed pages are
reused, so the process does not grow); malloc's count does not see memory mapped outside it
(Python's own small-object arenas). Other threads allocate meanwhile, so a measure made under
traffic is noisy; the catalogue keeps the last one, never less than the artifact bytes.

Before the second measure the C library is asked to give its free memory back
(`release_free_memory`): a warm-up's largest batches free buffers that glibc keeps in its
per-thread arenas, which would otherwise count as the model's and stay resident.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast


@dataclass(frozen=True, slots=True)
class Memory:
    resident: int  # bytes of the process in RAM (0: unknown here)
    allocated: int  # bytes malloc has handed out (0: unknown here)

    def growth_to(self, later: Memory) -> int:
        """Bytes added between this reading and ``later`` (the larger of the two measures)."""
        return max(0, later.resident - self.resident, later.allocated - self.allocated)


def artifact_bytes(version_dirs: Iterable[Path], instances: int = 1) -> int:
    """The bytes of every file under the version folders, once for each instance (each builds
    its own runtimes from them)."""
    total = 0
    for folder in version_dirs:
        for path in folder.rglob("*"):
            try:
                if path.is_file():
                    total += path.stat().st_size
            except OSError:
                continue
    return total * max(1, instances)


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _mallinfo2() -> Callable[[], _MallInfo2] | None:
    try:
        function: Any = ctypes.CDLL(None).mallinfo2
    except (AttributeError, OSError):  # not glibc, or one older than 2.33
        return None
    function.restype = _MallInfo2
    function.argtypes = []
    return cast("Callable[[], _MallInfo2]", function)


_MALLINFO2 = _mallinfo2()


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        function: Any = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):  # not glibc
        return None
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.c_size_t]
    return cast("Callable[[int], int]", function)


_MALLOC_TRIM = _malloc_trim()


def release_free_memory() -> None:
    """Hand the C library's free memory back to the system (glibc's ``malloc_trim``, every
    arena); nothing where the C library has no such call."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def memory_now() -> Memory:
    """The process's memory now (each measure 0 where this platform does not say)."""
    resident = 0
    try:
        with open("/proc/self/statm", "rb") as statm:
            resident = int(statm.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        pass
    allocated = 0
    if _MALLINFO2 is not None:
        info = _MALLINFO2()
        allocated = int(info.uordblks) + int(info.hblkhd)
    return Memory(resident, allocated)
