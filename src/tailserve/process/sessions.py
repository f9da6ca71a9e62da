"""Children started in sessions of their own, at the CPU priority of their parent's session.

On Linux with autogroup scheduling (``/proc/sys/kernel/sched_autogroup_enabled``, on by default
in most distributions' kernels), the CPU is shared between sessions first, and a process's
nice value or SCHED_IDLE policy counts only against the other processes of its session. A
session's own weight is its autogroup's nice value (``/proc/PID/autogroup``).

`tailserve up` starts each worker and HAProxy in a session of its own (a signal to the
terminal's process group reaches the stack alone; it stops them itself). Each would then weigh
as much as any other session, whatever its parent's session was given: a stack started at the
lowest priority to stay out of the way would compete at full weight. `start_session` starts a
child in a session of its own and `keep_priority` gives that session the nice value of the
caller's. Where the kernel has no autogroups, or the value cannot be read or written, it does
nothing: the child runs as it would have.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from pathlib import Path
from typing import Any

_NICE = re.compile(rb"\bnice\s+(-?\d+)")


def session_nice(pid: int | str = "self") -> int | None:
    """The autogroup nice value of ``pid``'s session (None: no autogroups here)."""
    try:
        found = _NICE.search(Path(f"/proc/{pid}/autogroup").read_bytes())
    except OSError:
        return None
    return int(found.group(1)) if found else None


def set_session_nice(nice: int, pid: int | str = "self") -> None:
    """Give ``pid``'s session the autogroup nice value ``nice`` (nothing where that cannot be
    done)."""
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))


def keep_priority(child: int) -> None:
    """Give the session of ``child`` (a process that started one) the nice value of this
    process's session, where that is not the default (0)."""
    nice = session_nice()
    if nice:
        set_session_nice(nice, child)


async def start_session(*command: str, **options: Any) -> asyncio.subprocess.Process:
    """`asyncio.create_subprocess_exec` of ``command`` in a session of its own, at the
    priority of this process's session."""
    process = await asyncio.create_subprocess_exec(*command, start_new_session=True, **options)
    keep_priority(process.pid)
    return process
