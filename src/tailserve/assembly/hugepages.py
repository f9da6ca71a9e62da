"""A worker's C library set to back its large allocations with transparent huge pages.

A model runtime that frees its buffers after each run (ONNX Runtime without its arena, the
default on the CPU) has glibc map its large ones afresh on the next run: one page fault a
4 KiB page, a fifth to a half of a large batch's time. glibc's ``glibc.malloc.hugetlb=1``
tunable asks the kernel for 2 MiB pages there instead (where transparent huge pages are
``always`` or ``madvise``), 512 times fewer faults. glibc reads its tunables once, at the
start of the process, so a worker is started with it in its environment: `tailserve up`
sets it for each worker, and `tailserve serve` run by hand starts itself again with it.
A ``GLIBC_TUNABLES`` that already names ``glibc.malloc.hugetlb`` is left as it is.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

TUNABLES = "GLIBC_TUNABLES"
HUGE_PAGES = "glibc.malloc.hugetlb=1"


def with_huge_pages(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with the huge-page tunable added to ``GLIBC_TUNABLES`` (unless it names one)."""
    tunables = env.get(TUNABLES, "")
    if "glibc.malloc.hugetlb" in tunables:
        return dict(env)
    return {**env, TUNABLES: f"{tunables}:{HUGE_PAGES}" if tunables else HUGE_PAGES}


def restart_with_huge_pages() -> None:
    """Replace this process by itself, same pid and arguments, with the tunable set; returns
    only where that is not needed (set already, not Linux) or cannot be done."""
    if not sys.platform.startswith("linux") or not sys.orig_argv:
        return
    env = with_huge_pages(os.environ)
    if env.get(TUNABLES) == os.environ.get(TUNABLES):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, sys.orig_argv, env)
    except OSError:
        return
