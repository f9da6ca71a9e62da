"""How idle the machine's CPUs are: the share of their time not spent running anything, from
the kernel's counters (Linux ``/proc/stat``), as a moving average over about a second.

On a machine whose cores the worker shares (its event loop, its instances' threads, the other
workers, the front door), neither the loop nor an instance looks saturated when the machine
is: each thread waits its turn for a core, so its own CPU over wall time reads low and its
lateness stays under a millisecond, while requests queue in front of the worker. No idle CPU
is what says so. Where the counters cannot be read, the machine counts as idle.
"""

from __future__ import annotations

from pathlib import Path

STAT = Path("/proc/stat")
# Each reading moves the average this far towards it (readings every quarter second).
_ALPHA = 0.3


class HostCpu:
    def __init__(self, path: Path = STAT) -> None:
        self._path = path
        self.idle = 1.0  # 0..1, the machine's CPUs' idle share (moving average)
        self._last: tuple[int, int] | None = None

    def sample(self) -> None:
        """Read the counters and move the average by what passed since the last reading."""
        counters = _read(self._path)
        if counters is None:
            return
        last, self._last = self._last, counters
        if last is None:
            return
        idle, total = counters[0] - last[0], counters[1] - last[1]
        if total > 0:
            self.idle += _ALPHA * (idle / total - self.idle)


def _read(path: Path) -> tuple[int, int] | None:
    """(idle, total) jiffies of all CPUs: idle counts the ``idle`` and ``iowait`` columns."""
    try:
        with path.open("rb") as stat:
            line = stat.readline().split()
    except OSError:
        return None
    if len(line) < 5 or line[0] != b"cpu":
        return None
    try:
        values = [int(value) for value in line[1:9]]
    except ValueError:
        return None
    return values[3] + values[4], sum(values)
